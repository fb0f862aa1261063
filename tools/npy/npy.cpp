// NumPy .npy reading and writing: a bounds-checked decoder, a hand-written parser for the header
// dict, and a writer that reproduces numpy.save byte for byte.
#include "npy/npy.hpp"

#include <algorithm>
#include <array>
#include <bit>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <limits>
#include <new>
#include <stdexcept>
#include <string_view>
#include <utility>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include "npy/files.hpp"

namespace dfss::npy {
namespace {

static_assert(std::endian::native == std::endian::little,
              "dfss::npy stores little-endian data and assumes a little-endian host");

constexpr std::array<unsigned char, 6> kMagic = {0x93, 'N', 'U', 'M', 'P', 'Y'};
constexpr std::size_t kAlign = 64;          // numpy.lib.format.ARRAY_ALIGN
constexpr std::size_t kGrowthDigits = 21;   // numpy.lib.format.GROWTH_AXIS_MAX_DIGITS
constexpr std::size_t kMaxPreamble = 12;    // magic, version and a 4-byte header length
constexpr std::size_t kSnippet = 24;        // characters of offending text quoted in messages

[[noreturn]] void fail(const std::string& name, const std::string& what) {
  throw error("npy file '" + name + "': " + what);
}

const char* type_name(dfss::dtype type) noexcept {
  switch (type) {
    case dfss::dtype::f64: return "f64";
    case dfss::dtype::f32: return "f32";
    case dfss::dtype::f16: return "f16";
    case dfss::dtype::bf16: return "bf16";
    case dfss::dtype::i32: return "i32";
    case dfss::dtype::i64: return "i64";
    case dfss::dtype::u8: return "u8";
    case dfss::dtype::u16: return "u16";
  }
  return "unknown";
}

/// Quotes up to @p limit bytes of @p data, escaping anything that is not printable ASCII.
std::string quote(const unsigned char* data, std::size_t size, std::size_t limit = kSnippet) {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out = "'";
  for (std::size_t i = 0; i < std::min(size, limit); ++i) {
    const unsigned char c = data[i];
    if (c == '\\' || c == '\'') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c == '\n') {
      out += "\\n";
    } else if (c >= 0x20 && c < 0x7f) {
      out += static_cast<char>(c);
    } else {
      out += "\\x";
      out += kHex[c >> 4];
      out += kHex[c & 0xf];
    }
  }
  out += '\'';
  if (size > limit) out += "...";
  return out;
}

std::string quote(std::string_view text, std::size_t limit = kSnippet) {
  return quote(reinterpret_cast<const unsigned char*>(text.data()), text.size(), limit);
}

/// Python's repr of a shape tuple: "()", "(5,)", "(2, 3)".
std::string shape_repr(const std::vector<std::int64_t>& shape) {
  std::string out = "(";
  for (std::size_t i = 0; i < shape.size(); ++i) {
    if (i > 0) out += ", ";
    out += std::to_string(shape[i]);
  }
  if (shape.size() == 1) out += ',';
  out += ')';
  return out;
}

/// Bytes of data that @p shape of @p item_bytes-byte elements needs. Like NumPy, the product of
/// the non-zero dimensions must not overflow even when a zero dimension makes the array empty.
std::size_t data_bytes(const std::vector<std::int64_t>& shape, std::size_t item_bytes,
                       const std::string& name) {
  std::int64_t count = 1;
  bool empty = false;
  for (const std::int64_t d : shape) {
    if (d < 0) fail(name, "expected non-negative dimensions, found shape " + shape_repr(shape));
    if (d == 0) {
      empty = true;
    } else if (__builtin_mul_overflow(count, d, &count)) {
      fail(name, "element count of shape " + shape_repr(shape) + " overflows int64");
    }
  }
  std::size_t bytes = 0;
  if (__builtin_mul_overflow(count, item_bytes, &bytes) ||
      bytes > static_cast<std::size_t>(std::numeric_limits<std::int64_t>::max())) {
    fail(name, "byte count of shape " + shape_repr(shape) + " with " +
                   std::to_string(item_bytes) + "-byte elements overflows size_t/int64");
  }
  return empty ? 0 : bytes;
}

struct preamble {
  int major = 0;
  std::size_t header_offset = 0;  // offset of the header text
  std::size_t header_length = 0;  // length of the header text (including padding and '\n')
};

/// Decodes magic, version and header length from the first @p n = min(total, 12) bytes.
preamble decode_preamble(const unsigned char* p, std::size_t n, std::uint64_t total,
                         const std::string& name) {
  const std::string file_size = "the file is only " + std::to_string(total) + " bytes";
  const std::size_t magic_seen = std::min(n, kMagic.size());
  if (std::memcmp(p, kMagic.data(), magic_seen) != 0) {
    fail(name, "bad magic: expected '\\x93NUMPY' (a NumPy .npy file), found " +
                   quote(p, magic_seen));
  }
  if (n < 8) {
    fail(name, "truncated: expected the 6-byte magic string and a 2-byte version, but " +
                   file_size);
  }
  preamble pre;
  pre.major = p[6];
  const int minor = p[7];
  if ((pre.major != 1 && pre.major != 2 && pre.major != 3) || minor != 0) {
    fail(name, "unsupported format version: expected 1.0, 2.0 or 3.0, found " +
                   std::to_string(pre.major) + "." + std::to_string(minor));
  }
  const std::size_t length_bytes = pre.major == 1 ? 2 : 4;
  pre.header_offset = 8 + length_bytes;
  if (n < pre.header_offset) {
    fail(name, "truncated: expected a " + std::to_string(length_bytes) +
                   "-byte header length after the version, but " + file_size);
  }
  std::uint32_t length = 0;
  for (std::size_t i = 0; i < length_bytes; ++i) {
    length |= static_cast<std::uint32_t>(p[8 + i]) << (8 * i);
  }
  pre.header_length = length;
  if (length > total - pre.header_offset) {
    fail(name, "header length past end of file: expected " + std::to_string(length) +
                   " header bytes after offset " + std::to_string(pre.header_offset) +
                   ", found " + std::to_string(total - pre.header_offset));
  }
  return pre;
}

struct header {
  dfss::dtype type = dfss::dtype::f32;
  bool swap = false;  // big-endian data with multi-byte elements
  std::string descr;
  std::vector<std::int64_t> shape;
};

/// Maps a descr string onto a dfss::dtype; throws for anything outside the supported set.
void decode_descr(header& h, const std::string& name) {
  struct entry {
    char kind;
    char size;
    dfss::dtype type;
  };
  static constexpr entry kTypes[] = {
      {'f', '8', dfss::dtype::f64}, {'f', '4', dfss::dtype::f32}, {'f', '2', dfss::dtype::f16},
      {'i', '4', dfss::dtype::i32}, {'i', '8', dfss::dtype::i64}, {'u', '2', dfss::dtype::u16},
      {'u', '1', dfss::dtype::u8},  {'b', '1', dfss::dtype::u8},
  };
  const std::string& d = h.descr;
  const std::string supported =
      "expected one of '<f8', '<f4', '<f2', '<i4', '<i8', '<u2', '|u1', '|b1' "
      "(or '>'/'=' byte order), found " + quote(d);
  if (d.size() != 3) fail(name, "unsupported descr: " + supported);
  const char order = d[0];
  if (order != '<' && order != '>' && order != '=' && order != '|') {
    fail(name, "unsupported descr: " + supported);
  }
  for (const entry& e : kTypes) {
    if (d[1] != e.kind || d[2] != e.size) continue;
    const bool single = e.size == '1';
    if (order == '|' && !single) {
      fail(name, "unsupported descr: byte order '|' is only meaningful for 1-byte types; " +
                     supported);
    }
    h.type = e.type;
    h.swap = order == '>' && !single;
    return;
  }
  fail(name, "unsupported descr: " + supported);
}

/// Parser for the Python literal subset NumPy writes: a dict with the keys 'descr' (a string),
/// 'fortran_order' (True/False) and 'shape' (a tuple of integers), with arbitrary whitespace,
/// either quote character and optional trailing commas.
class header_parser {
 public:
  header_parser(std::string_view text, const std::string& name) : text_(text), name_(name) {}

  header run() {
    header h;
    bool have_descr = false;
    bool have_fortran = false;
    bool have_shape = false;
    bool fortran = false;
    skip_space();
    if (!at('{')) syntax("a dict starting with '{' (the header is not a dict)");
    ++pos_;
    skip_space();
    while (!at('}')) {
      const std::size_t key_pos = pos_;
      const std::string key = parse_string("a quoted key or '}'");
      bool* seen = nullptr;
      if (key == "descr") {
        seen = &have_descr;
      } else if (key == "fortran_order") {
        seen = &have_fortran;
      } else if (key == "shape") {
        seen = &have_shape;
      } else {
        fail(name_, "header: expected only the keys 'descr', 'fortran_order' and 'shape', "
                    "found key " + quote(key) + " at offset " + std::to_string(key_pos));
      }
      if (*seen) fail(name_, "header: duplicate key " + quote(key));
      *seen = true;
      skip_space();
      expect(':');
      skip_space();
      if (key == "descr") {
        if (at('[')) {
          fail(name_, "header: expected 'descr' to be a type string such as '<f4', found a list "
                      "(structured dtypes are not supported)");
        }
        h.descr = parse_string("a quoted descr string such as '<f4'");
      } else if (key == "fortran_order") {
        fortran = parse_bool();
      } else {
        h.shape = parse_shape();
      }
      skip_space();
      if (at(',')) {
        ++pos_;
        skip_space();
      } else if (!at('}')) {
        syntax("',' or '}'");
      }
    }
    ++pos_;
    skip_space();
    if (pos_ != text_.size()) syntax("the end of the header after '}'");
    for (const auto& [present, key] : {std::pair{have_descr, "descr"},
                                       std::pair{have_fortran, "fortran_order"},
                                       std::pair{have_shape, "shape"}}) {
      if (!present) fail(name_, std::string("header: missing key '") + key + "'");
    }
    if (fortran) {
      fail(name_, "expected C order ('fortran_order': False), found 'fortran_order': True; "
                  "save the array with numpy.ascontiguousarray");
    }
    decode_descr(h, name_);
    return h;
  }

 private:
  bool at(char c) const { return pos_ < text_.size() && text_[pos_] == c; }

  static bool is_space(char c) {
    return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f';
  }
  static bool is_digit(char c) { return c >= '0' && c <= '9'; }
  static bool is_word(char c) {
    return is_digit(c) || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' || c == '.';
  }

  void skip_space() {
    while (pos_ < text_.size() && is_space(text_[pos_])) ++pos_;
  }

  [[noreturn]] void syntax(const std::string& expected) const {
    const std::string found =
        pos_ < text_.size() ? quote(text_.substr(pos_)) : std::string("the end of the header");
    fail(name_, "header: expected " + expected + " at offset " + std::to_string(pos_) +
                    ", found " + found);
  }

  void expect(char c) {
    if (!at(c)) syntax(std::string("'") + c + "'");
    ++pos_;
  }

  std::string parse_string(const std::string& what) {
    if (!at('\'') && !at('"')) syntax(what);
    const char q = text_[pos_++];
    std::string out;
    while (pos_ < text_.size() && text_[pos_] != q) {
      const char c = text_[pos_];
      const auto u = static_cast<unsigned char>(c);
      if (c == '\\') syntax("a string without escape sequences");
      if (u < 0x20 || u >= 0x7f) syntax("printable ASCII inside a string");
      out += c;
      ++pos_;
    }
    if (pos_ >= text_.size()) syntax(std::string("the closing quote ") + q);
    ++pos_;
    return out;
  }

  std::string_view word() const {
    std::size_t end = pos_;
    while (end < text_.size() && is_word(text_[end])) ++end;
    return text_.substr(pos_, end - pos_);
  }

  bool parse_bool() {
    const std::string_view w = word();
    if (w != "True" && w != "False") syntax("True or False for 'fortran_order'");
    pos_ += w.size();
    return w == "True";
  }

  std::int64_t parse_dimension() {
    const std::size_t start = pos_;
    const bool negative = at('-');
    if (negative) {
      ++pos_;
      skip_space();
    }
    if (pos_ >= text_.size() || !is_digit(text_[pos_])) {
      pos_ = start;
      syntax("a non-negative integer dimension");
    }
    std::int64_t value = 0;
    bool overflow = false;
    while (pos_ < text_.size() && is_digit(text_[pos_])) {
      const std::int64_t digit = text_[pos_] - '0';
      overflow = overflow || __builtin_mul_overflow(value, std::int64_t{10}, &value) ||
                 __builtin_add_overflow(value, digit, &value);
      ++pos_;
    }
    if (at('L') || at('l')) ++pos_;  // Python 2 long suffix, written by old NumPy versions
    if (pos_ < text_.size() && is_word(text_[pos_])) {
      std::size_t end = pos_;
      while (end < text_.size() && is_word(text_[end])) ++end;
      const std::string token(text_.substr(start, end - start));
      pos_ = start;
      syntax("an integer dimension in 'shape', not " + quote(token));
    }
    const std::string token(text_.substr(start, pos_ - start));
    if (negative) {
      fail(name_, "header: expected non-negative dimensions in 'shape', found " + token);
    }
    if (overflow) fail(name_, "header: dimension " + token + " in 'shape' overflows int64");
    return value;
  }

  std::vector<std::int64_t> parse_shape() {
    if (at('[')) syntax("a tuple for 'shape' such as (2, 3), not a list");
    if (!at('(')) syntax("a tuple for 'shape' such as (2, 3)");
    ++pos_;
    skip_space();
    std::vector<std::int64_t> shape;
    bool comma = false;
    while (!at(')')) {
      if (shape.size() == max_dims) {
        fail(name_, "header: expected at most " + std::to_string(max_dims) +
                        " dimensions in 'shape', found more");
      }
      shape.push_back(parse_dimension());
      skip_space();
      comma = at(',');
      if (comma) {
        ++pos_;
        skip_space();
      } else if (!at(')')) {
        syntax("',' or ')' in 'shape'");
      }
    }
    if (shape.size() == 1 && !comma) {
      syntax("',' after the only dimension: (n) is an integer, (n,) is a 1-d shape");
    }
    ++pos_;
    return shape;
  }

  std::string_view text_;
  const std::string& name_;
  std::size_t pos_ = 0;
};

/// "data for shape (2, 3) of '<f4': expected 24 bytes, found <found>".
std::string data_what(const header& h, std::size_t need, const std::string& found) {
  return "data for shape " + shape_repr(h.shape) + " of " + quote(h.descr) + ": expected " +
         std::to_string(need) + " bytes, found " + found;
}

/// An array of @p h's type and shape with room reserved for @p count bytes of data; running out of
/// memory is reported as npy::error naming the byte count.
array allocate(const header& h, std::size_t reserve, const std::string& name) {
  array a;
  a.type = h.type;
  a.shape = h.shape;
  try {
    a.bytes.reserve(reserve);
  } catch (const std::bad_alloc&) {
    fail(name, "cannot allocate " + std::to_string(reserve) + " bytes for the data of shape " +
                   shape_repr(h.shape) + ": out of memory");
  } catch (const std::length_error&) {
    fail(name, "cannot allocate " + std::to_string(reserve) + " bytes for the data of shape " +
                   shape_repr(h.shape) + ": more than a vector can hold");
  }
  return a;
}

/// Byte-swaps the elements of big-endian data in place.
void to_little_endian(array& a, const header& h) {
  if (!h.swap) return;
  const std::size_t item = item_size(h.type);
  for (std::size_t i = 0; i < a.bytes.size(); i += item) {
    std::reverse(&a.bytes[i], &a.bytes[i] + item);
  }
}

/// Decodes an .npy image of @p total bytes read through fetch(offset, destination, count), which
/// is only ever asked for ranges inside [0, total).
template <class Fetch>
array decode(std::uint64_t total, Fetch&& fetch, const std::string& name) {
  std::array<unsigned char, kMaxPreamble> head{};
  const auto n = static_cast<std::size_t>(std::min<std::uint64_t>(total, kMaxPreamble));
  fetch(0, head.data(), n);
  const preamble pre = decode_preamble(head.data(), n, total, name);

  std::string text(pre.header_length, '\0');
  fetch(pre.header_offset, reinterpret_cast<unsigned char*>(text.data()), text.size());
  const header h = header_parser(text, name).run();

  const std::size_t need = data_bytes(h.shape, item_size(h.type), name);
  const std::size_t offset = pre.header_offset + pre.header_length;
  const std::uint64_t have = total - offset;
  if (have < need) fail(name, "truncated " + data_what(h, need, std::to_string(have)));
  if (have > need) fail(name, "trailing bytes after the " + data_what(h, need, std::to_string(have)));

  array a = allocate(h, need, name);
  a.bytes.resize(need);
  fetch(offset, a.bytes.data(), need);
  to_little_endian(a, h);
  return a;
}

/// Reads from @p fd (a pipe or character device) until @p out holds @p want bytes or the input
/// ends; returns whether it got them all. Reads in chunks and grows @p out only by what arrived, so
/// a header that announces more data than the input holds costs no more memory than the input.
bool read_up_to(int fd, std::vector<unsigned char>& out, std::size_t want, const std::string& name) {
  constexpr std::size_t kChunk = std::size_t{1} << 16;  // 64 KiB: the default Linux pipe buffer
  while (out.size() < want) {
    const std::size_t old = out.size();
    const std::size_t step = std::min(want - old, kChunk);
    try {
      out.resize(old + step);
    } catch (const std::bad_alloc&) {
      fail(name, "cannot allocate " + std::to_string(old + step) + " bytes while reading: out of memory");
    }
    ::ssize_t got = 0;
    do {
      got = ::read(fd, out.data() + old, step);
    } while (got < 0 && errno == EINTR);
    if (got < 0) {
      const int code = errno;
      out.resize(old);
      fail(name, std::string("read error: ") + std::strerror(code));
    }
    out.resize(old + static_cast<std::size_t>(got));
    if (got == 0) return false;
  }
  return true;
}

/// Reads an .npy stream of unknown size: the preamble, then the header, then exactly the data
/// bytes the header announces, then checks that the input ends there. Malformed input fails as soon
/// as it is seen (/dev/zero after 12 bytes), and memory never exceeds what arrived.
array decode_stream(int fd, const std::string& name) {
  std::vector<unsigned char> head;
  if (!read_up_to(fd, head, kMaxPreamble, name)) return parse(head.data(), head.size(), name);
  // The stream's length is unknown: the preamble's own checks run against "no end", the header and
  // data lengths below against what actually arrives.
  const preamble pre =
      decode_preamble(head.data(), head.size(), std::numeric_limits<std::uint64_t>::max(), name);
  const std::size_t offset = pre.header_offset + pre.header_length;
  if (!read_up_to(fd, head, offset, name)) return parse(head.data(), head.size(), name);
  const std::string text(reinterpret_cast<const char*>(head.data()) + pre.header_offset,
                         pre.header_length);
  const header h = header_parser(text, name).run();
  const std::size_t need = data_bytes(h.shape, item_size(h.type), name);

  array a;
  a.type = h.type;
  a.shape = h.shape;
  // offset <= head.size(); bytes past the header (read with the preamble, possible only for a
  // header shorter than 2 bytes, which the parser has rejected) would be the start of the data.
  a.bytes.assign(head.begin() + static_cast<std::ptrdiff_t>(offset), head.end());
  if (!read_up_to(fd, a.bytes, need, name)) {
    fail(name, "truncated " + data_what(h, need, std::to_string(a.bytes.size())));
  }
  std::vector<unsigned char> probe;
  if (read_up_to(fd, probe, 1, name)) {
    fail(name, "trailing bytes after the " + data_what(h, need, "more (the input continues)"));
  }
  to_little_endian(a, h);
  return a;
}

/// The header numpy.save writes for @p type and @p shape: magic, version, length, the dict padded
/// with spaces and a final '\n' so that the data starts at a multiple of 64 bytes.
std::string encode_header(dfss::dtype type, const std::vector<std::int64_t>& shape) {
  std::string dict = "{'descr': '" + descr(type) + "', 'fortran_order': False, 'shape': " +
                     shape_repr(shape) + ", }";
  if (!shape.empty()) dict.append(kGrowthDigits - std::to_string(shape[0]).size(), ' ');

  // numpy.lib.format._wrap_header: the text, padding spaces and '\n' end on a 64-byte boundary;
  // version 1.0 unless its 16-bit header length cannot hold the header.
  const std::size_t text = dict.size() + 1;
  std::size_t prefix = kMagic.size() + 2 + 2;
  std::size_t pad = kAlign - (prefix + text) % kAlign;
  unsigned char major = 1;
  if (text + pad > 0xffff) {
    major = 2;
    prefix = kMagic.size() + 2 + 4;
    pad = kAlign - (prefix + text) % kAlign;
  }
  const std::size_t length = text + pad;

  std::string head(reinterpret_cast<const char*>(kMagic.data()), kMagic.size());
  head += static_cast<char>(major);
  head += '\0';
  for (std::size_t i = 0; i < prefix - 8; ++i) {
    head += static_cast<char>((length >> (8 * i)) & 0xff);
  }
  head += dict;
  head.append(pad, ' ');
  head += '\n';
  return head;
}

/// Checks that @p size bytes hold @p shape of @p type and returns the header to write before them.
std::string checked_header(dfss::dtype type, const std::vector<std::int64_t>& shape, std::size_t size,
                           const std::string& name) {
  descr(type);  // throws for bf16 and values outside the enumeration
  if (shape.size() > max_dims) {
    fail(name, "cannot write: expected at most " + std::to_string(max_dims) +
                   " dimensions, found " + std::to_string(shape.size()));
  }
  const std::size_t need = data_bytes(shape, item_size(type), name);
  if (size != need) {
    fail(name, "cannot write: shape " + shape_repr(shape) + " of " + type_name(type) + " needs " +
                   std::to_string(need) + " bytes, but the array holds " + std::to_string(size));
  }
  return encode_header(type, shape);
}

files::piece as_piece(const std::string& text) {
  return {reinterpret_cast<const unsigned char*>(text.data()), text.size()};
}

/// Closes a POSIX file descriptor on scope exit.
class descriptor {
 public:
  explicit descriptor(int fd) : fd_(fd) {}
  descriptor(const descriptor&) = delete;
  descriptor& operator=(const descriptor&) = delete;
  ~descriptor() {
    if (fd_ >= 0) ::close(fd_);
  }
  int get() const noexcept { return fd_; }

 private:
  int fd_;
};

std::string errno_text(int code) { return std::strerror(code); }

}  // namespace

error::~error() = default;

std::size_t item_size(dfss::dtype type) noexcept {
  switch (type) {
    case dfss::dtype::f64: return 8;
    case dfss::dtype::f32: return 4;
    case dfss::dtype::f16: return 2;
    case dfss::dtype::bf16: return 2;
    case dfss::dtype::i32: return 4;
    case dfss::dtype::i64: return 8;
    case dfss::dtype::u8: return 1;
    case dfss::dtype::u16: return 2;
  }
  return 0;
}

std::string descr(dfss::dtype type) {
  switch (type) {
    case dfss::dtype::f64: return "<f8";
    case dfss::dtype::f32: return "<f4";
    case dfss::dtype::f16: return "<f2";
    case dfss::dtype::i32: return "<i4";
    case dfss::dtype::i64: return "<i8";
    case dfss::dtype::u8: return "|u1";
    case dfss::dtype::u16: return "<u2";
    case dfss::dtype::bf16:
      throw error("npy: bf16 has no NumPy type; expected f64, f32, f16, i32, i64, u8 or u16 "
                  "(convert bf16 to f32 before writing)");
  }
  throw error("npy: expected a dfss::dtype, found the value " +
              std::to_string(static_cast<int>(type)));
}

std::int64_t array::numel() const {
  std::int64_t count = 1;
  bool empty = false;
  for (const std::int64_t d : shape) {
    if (d < 0 || (d > 0 && __builtin_mul_overflow(count, d, &count))) {
      throw error("npy::array::numel: expected non-negative dimensions whose product fits "
                  "int64, found shape " + shape_repr(shape));
    }
    empty = empty || d == 0;
  }
  return empty ? 0 : count;
}

void array::throw_element_mismatch(std::size_t requested) const {
  throw error("npy::array::data: requested a " + std::to_string(requested) +
              "-byte element type, but the array holds " + type_name(type) + " (" +
              std::to_string(item_size()) + "-byte elements)");
}

array parse(const unsigned char* data, std::size_t size, const std::string& name) {
  if (data == nullptr && size != 0) fail(name, "expected a buffer, found a null pointer");
  return decode(
      size,
      [data](std::size_t offset, unsigned char* out, std::size_t count) {
        if (count != 0) std::memcpy(out, data + offset, count);
      },
      name);
}

array read(const std::string& path) {
  const descriptor fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) fail(path, "cannot open for reading: " + errno_text(errno));
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) fail(path, "cannot stat: " + errno_text(errno));
  if (S_ISDIR(st.st_mode)) {
    fail(path, "expected a regular file, found a directory (" + errno_text(EISDIR) + ")");
  }
  if (S_ISREG(st.st_mode)) {
    const auto total = static_cast<std::uint64_t>(st.st_size);
    return decode(
        total,
        [&](std::size_t offset, unsigned char* out, std::size_t count) {
          while (count > 0) {
            const ::ssize_t got = ::pread(fd.get(), out, count, static_cast<::off_t>(offset));
            if (got < 0 && errno == EINTR) continue;
            if (got < 0) fail(path, "read error: " + errno_text(errno));
            if (got == 0) {
              fail(path, "truncated while reading: expected " + std::to_string(total) +
                             " bytes (the size reported by stat), the file ended at offset " +
                             std::to_string(offset));
            }
            const auto step = static_cast<std::size_t>(got);
            out += step;
            offset += step;
            count -= step;
          }
        },
        path);
  }
  // A pipe or character device: its size is unknown, so it is read as far as its header says.
  return decode_stream(fd.get(), path);
}

std::vector<unsigned char> serialize(const array& a, const std::string& name) {
  const std::string head = checked_header(a.type, a.shape, a.bytes.size(), name);
  std::vector<unsigned char> out(head.size() + a.bytes.size());
  std::copy(head.begin(), head.end(), out.begin());
  std::copy(a.bytes.begin(), a.bytes.end(), out.begin() + static_cast<std::ptrdiff_t>(head.size()));
  return out;
}

void stage(files::transaction& t, const std::string& path, const array& a) {
  const std::string head = checked_header(a.type, a.shape, a.bytes.size(), path);
  try {
    t.stage(path, {as_piece(head), files::piece(a.bytes)});
  } catch (const files::write_error& e) {
    fail(path, e.what());
  }
}

void write(const std::string& path, const array& a) {
  files::transaction t;
  stage(t, path, a);
  try {
    t.commit();
  } catch (const files::write_error& e) {
    fail(path, e.what());
  }
}

void write(const std::string& path, dfss::dtype type, const std::vector<std::int64_t>& shape,
           const void* data) {
  const std::string type_descr = descr(type);
  if (shape.size() > max_dims) {
    fail(path, "cannot write: expected at most " + std::to_string(max_dims) +
                   " dimensions, found " + std::to_string(shape.size()));
  }
  const std::size_t need = data_bytes(shape, item_size(type), path);
  if (need != 0 && data == nullptr) {
    fail(path, "cannot write: expected data for shape " + shape_repr(shape) + " of " +
                   type_descr + ", found a null pointer");
  }
  const std::string head = checked_header(type, shape, need, path);
  try {
    files::replace(path, {as_piece(head), files::piece(static_cast<const unsigned char*>(data), need)});
  } catch (const files::write_error& e) {
    fail(path, e.what());
  }
}

}  // namespace dfss::npy
