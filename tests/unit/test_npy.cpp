// Tests of the .npy reader/writer used by the command-line tools: round trips, the exact bytes of
// the header numpy.save writes, every class of malformed input, truncation at every length, and a
// fuzz loop over mutated files (all of which must parse or raise npy::error, never crash); reading
// pipes and devices only as far as the header says; atomic replacement of files on write
// (npy/files.hpp): a failing write keeps the old file, modes, symlinks, /dev/null and FIFOs.
#include "npy/npy.hpp"

#include "npy/files.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <csignal>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <iterator>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <fcntl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

namespace {

namespace npy = dfss::npy;
using bytes_t = std::vector<unsigned char>;
using dfss::dtype;

constexpr dtype kWritable[] = {dtype::f64, dtype::f32, dtype::f16, dtype::i32,
                               dtype::i64, dtype::u8,  dtype::u16};

/// A .npy image with the raw header text @p dict (no padding added) and @p data.
bytes_t make_file(const std::string& dict, const bytes_t& data = {}, int major = 1) {
  bytes_t out = {0x93, 'N', 'U', 'M', 'P', 'Y', static_cast<unsigned char>(major), 0};
  const std::size_t length_bytes = major == 1 ? 2 : 4;
  for (std::size_t i = 0; i < length_bytes; ++i) {
    out.push_back(static_cast<unsigned char>((dict.size() >> (8 * i)) & 0xff));
  }
  out.insert(out.end(), dict.begin(), dict.end());
  out.insert(out.end(), data.begin(), data.end());
  return out;
}

/// A header dict with the given descr and shape text, in numpy's spelling.
std::string dict_of(const std::string& descr, const std::string& shape) {
  return "{'descr': '" + descr + "', 'fortran_order': False, 'shape': " + shape + ", }\n";
}

bytes_t pattern_bytes(std::size_t n, unsigned seed = 1) {
  bytes_t b(n);
  for (std::size_t i = 0; i < n; ++i) {
    b[i] = static_cast<unsigned char>((i * 37 + seed * 11) & 0xff);
  }
  return b;
}

npy::array make_array(dtype type, std::vector<std::int64_t> shape) {
  npy::array a;
  a.type = type;
  a.shape = std::move(shape);
  a.bytes = pattern_bytes(static_cast<std::size_t>(a.numel()) * a.item_size());
  return a;
}

npy::array parse(const bytes_t& b, const std::string& name = "test.npy") {
  return npy::parse(b.data(), b.size(), name);
}

/// Expects parse() to raise npy::error whose message names the file and contains every needle.
void expect_error(const bytes_t& b, std::initializer_list<const char*> needles) {
  try {
    parse(b, "bad.npy");
    ADD_FAILURE() << "expected npy::error";
  } catch (const npy::error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("'bad.npy'"), std::string::npos) << what;
    for (const char* needle : needles) {
      EXPECT_NE(what.find(needle), std::string::npos) << "missing '" << needle << "' in: " << what;
    }
  }
}

void expect_error(const std::string& dict, std::initializer_list<const char*> needles) {
  expect_error(make_file(dict), needles);
}

/// A scratch directory removed at the end of the test.
class temp_dir {
 public:
  temp_dir() {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    path_ = std::filesystem::temp_directory_path() /
            ("dfss_test_npy_" + std::to_string(::getpid()) + "_" + info->name());
    std::filesystem::remove_all(path_);
    std::filesystem::create_directories(path_);
  }
  temp_dir(const temp_dir&) = delete;
  temp_dir& operator=(const temp_dir&) = delete;
  ~temp_dir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  std::string file(const std::string& name) const { return (path_ / name).string(); }
  /// The names in the directory, sorted (to spot temporary files left behind).
  std::vector<std::string> entries() const {
    std::vector<std::string> names;
    for (const auto& e : std::filesystem::directory_iterator(path_)) names.push_back(e.path().filename().string());
    std::sort(names.begin(), names.end());
    return names;
  }

 private:
  std::filesystem::path path_;
};

void expect_same(const npy::array& a, const npy::array& b) {
  EXPECT_EQ(a.type, b.type);
  EXPECT_EQ(a.shape, b.shape);
  EXPECT_EQ(a.bytes, b.bytes);
}

TEST(Npy, RoundTripEveryDtypeAndShape) {
  const std::vector<std::vector<std::int64_t>> shapes = {
      {}, {0}, {1}, {7}, {2, 3}, {3, 0}, {2, 0, 3}, {2, 3, 4, 5}, {1, 1, 1, 1, 1, 1, 1, 2}};
  for (const dtype type : kWritable) {
    for (const auto& shape : shapes) {
      const npy::array a = make_array(type, shape);
      const bytes_t image = npy::serialize(a);
      EXPECT_EQ((image.size() - a.bytes.size()) % 64, 0u) << "data must start at a multiple of 64";
      EXPECT_EQ(image[image.size() - a.bytes.size() - 1], '\n');
      expect_same(parse(image), a);
    }
  }
}

TEST(Npy, RoundTripThroughFiles) {
  const temp_dir dir;
  for (const dtype type : kWritable) {
    const npy::array a = make_array(type, {2, 3, 4, 5});
    const std::string path = dir.file(std::string("a") + std::to_string(static_cast<int>(type)));
    npy::write(path, a);
    expect_same(npy::read(path), a);

    npy::write(path, type, {0}, nullptr);
    const npy::array empty = npy::read(path);
    EXPECT_EQ(empty.numel(), 0);
    EXPECT_TRUE(empty.bytes.empty());
  }
  const double scalar = 2.5;
  const std::string path = dir.file("scalar.npy");
  npy::write(path, dtype::f64, {}, &scalar);
  const npy::array s = npy::read(path);
  EXPECT_TRUE(s.shape.empty());
  EXPECT_EQ(s.numel(), 1);
  EXPECT_EQ(s.data<double>()[0], 2.5);
}

TEST(Npy, HeaderIsByteExactWithNumpy) {
  // np.save(f, np.arange(6, dtype='<f4').reshape(2, 3)) writes exactly these 128 header bytes:
  // 59 characters of dict, 20 spaces reserved for the growth axis, padding, and '\n'.
  const std::string expected = std::string("\x93NUMPY\x01\x00\x76\x00", 10) +
                               "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }" +
                               std::string(58, ' ') + "\n";
  ASSERT_EQ(expected.size(), 128u);
  npy::array a;
  a.type = dtype::f32;
  a.shape = {2, 3};
  a.bytes.resize(24);
  float* values = a.data<float>();
  for (int i = 0; i < 6; ++i) values[i] = static_cast<float>(i);
  const bytes_t image = npy::serialize(a);
  ASSERT_EQ(image.size(), 128u + 24u);
  EXPECT_EQ(std::string(image.begin(), image.begin() + 128), expected);
  EXPECT_TRUE(std::equal(a.bytes.begin(), a.bytes.end(), image.begin() + 128));

  // A 0-d array has no growth axis: 55 characters of dict and 62 spaces.
  const std::string scalar = std::string("\x93NUMPY\x01\x00\x76\x00", 10) +
                             "{'descr': '<f8', 'fortran_order': False, 'shape': (), }" +
                             std::string(62, ' ') + "\n";
  const bytes_t image0 = npy::serialize(make_array(dtype::f64, {}));
  EXPECT_EQ(std::string(image0.begin(), image0.begin() + 128), scalar);

  // u8 is written as '|u1', 1-d shapes as (n,).
  const bytes_t image1 = npy::serialize(make_array(dtype::u8, {5}));
  const std::string dict = "{'descr': '|u1', 'fortran_order': False, 'shape': (5,), }";
  EXPECT_EQ(std::string(image1.begin() + 10, image1.begin() + 10 + 57), dict);
}

TEST(Npy, AcceptsHeaderSpellingsAndVersions) {
  const bytes_t data = pattern_bytes(24);
  const std::vector<std::string> dicts = {
      dict_of("<f4", "(2, 3)"),
      "{\"descr\": \"<f4\", \"fortran_order\": False, \"shape\": (2,3)}",
      "  {'shape':(2 , 3 ,),'descr':'<f4','fortran_order':False}  \n",
      "{'fortran_order': False,\n\t'shape': (2L, 3L), 'descr': '<f4',}",
      "{'descr':'=f4','fortran_order':False,'shape':(2,3),}",
  };
  for (const std::string& dict : dicts) {
    for (int major : {1, 2, 3}) {
      const npy::array a = parse(make_file(dict, data, major));
      EXPECT_EQ(a.type, dtype::f32) << dict;
      EXPECT_EQ(a.shape, (std::vector<std::int64_t>{2, 3})) << dict;
      EXPECT_EQ(a.bytes, data) << dict;
    }
  }
  const npy::array b = parse(make_file(dict_of("|b1", "(3,)"), {0, 1, 1}));
  EXPECT_EQ(b.type, dtype::u8);
  EXPECT_EQ(b.bytes, (bytes_t{0, 1, 1}));
  for (const char* d : {"|u1", "<u1", ">u1", "=u1"}) {
    const npy::array u = parse(make_file(dict_of(d, "(2,)"), {7, 9}));
    EXPECT_EQ(u.type, dtype::u8) << d;
    EXPECT_EQ(u.bytes, (bytes_t{7, 9})) << d;
  }
  const npy::array z = parse(make_file(dict_of("<i8", "()"), pattern_bytes(8)));
  EXPECT_TRUE(z.shape.empty());
  EXPECT_EQ(z.numel(), 1);
}

TEST(Npy, BigEndianIsSwappedToLittleEndian) {
  struct big_case {
    const char* descr;
    dtype type;
    bytes_t big;
    bytes_t little;
  };
  const std::vector<big_case> cases = {
      {">f4", dtype::f32, {0x3f, 0x80, 0, 0, 0xc0, 0, 0, 0}, {0, 0, 0x80, 0x3f, 0, 0, 0, 0xc0}},
      {">f8", dtype::f64, {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16},
       {8, 7, 6, 5, 4, 3, 2, 1, 16, 15, 14, 13, 12, 11, 10, 9}},
      {">f2", dtype::f16, {0x3c, 0x00, 0xc0, 0x00}, {0x00, 0x3c, 0x00, 0xc0}},
      {">i4", dtype::i32, {0, 0, 1, 2, 0xff, 0xff, 0xff, 0xfe},
       {2, 1, 0, 0, 0xfe, 0xff, 0xff, 0xff}},
      {">i8", dtype::i64, {0, 0, 0, 0, 0, 0, 1, 2, 1, 0, 0, 0, 0, 0, 0, 3},
       {2, 1, 0, 0, 0, 0, 0, 0, 3, 0, 0, 0, 0, 0, 0, 1}},
      {">u2", dtype::u16, {0x12, 0x34, 0xab, 0xcd}, {0x34, 0x12, 0xcd, 0xab}},
  };
  for (const big_case& c : cases) {
    const npy::array a = parse(make_file(dict_of(c.descr, "(2,)"), c.big));
    EXPECT_EQ(a.type, c.type) << c.descr;
    EXPECT_EQ(a.bytes, c.little) << c.descr;
  }
  const npy::array f = parse(make_file(dict_of(">f4", "(2,)"), cases[0].big));
  EXPECT_EQ(f.data<float>()[0], 1.0f);
  EXPECT_EQ(f.data<float>()[1], -2.0f);
}

TEST(Npy, RejectsBadMagicAndVersion) {
  bytes_t b = npy::serialize(make_array(dtype::f32, {2}));
  bytes_t bad = b;
  bad[1] = 'X';
  expect_error(bad, {"bad magic", "expected", "\\x93NUMPY", "found '\\x93XUMPY'"});
  expect_error(bytes_t{'P', 'K', 3, 4}, {"bad magic", "found 'PK\\x03\\x04'"});
  bad = b;
  bad[6] = 4;
  expect_error(bad, {"unsupported format version", "1.0, 2.0 or 3.0", "found 4.0"});
  bad = b;
  bad[7] = 1;
  expect_error(bad, {"unsupported format version", "found 1.1"});
  bad = b;
  bad[6] = 0;
  expect_error(bad, {"unsupported format version", "found 0.0"});
}

TEST(Npy, RejectsHeaderLengthPastEnd) {
  bytes_t b = make_file(dict_of("<f4", "(2,)"), pattern_bytes(8));
  b[8] = 0xff;
  b[9] = 0xff;
  expect_error(b, {"header length past end of file", "expected 65535 header bytes"});
  bytes_t v2 = make_file(dict_of("<f4", "(2,)"), pattern_bytes(8), 2);
  v2[11] = 0xff;
  expect_error(v2, {"header length past end of file"});
}

TEST(Npy, RejectsMalformedDicts) {
  expect_error(std::string("[1, 2, 3]\n"), {"not a dict", "found '[1, 2, 3]\\n'"});
  expect_error(std::string(""), {"not a dict", "end of the header"});
  expect_error(std::string("{}"), {"missing key 'descr'"});
  expect_error("{'descr': '<f4', 'shape': (2,)}", {"missing key 'fortran_order'"});
  expect_error("{'descr': '<f4', 'fortran_order': False}", {"missing key 'shape'"});
  expect_error("{'descr': '<f4', 'descr': '<f4', 'fortran_order': False, 'shape': ()}",
               {"duplicate key 'descr'"});
  expect_error("{'descr': '<f4', 'fortran_order': False, 'shape': (), 'extra': 1}",
               {"expected only the keys", "found key 'extra'"});
  expect_error("{'descr': '<f4' 'fortran_order': False, 'shape': ()}", {"expected ',' or '}'"});
  expect_error("{'descr' '<f4', 'fortran_order': False, 'shape': ()}", {"expected ':'"});
  expect_error("{'descr': '<f4, 'fortran_order': False, 'shape': ()}", {"header: expected"});
  expect_error("{'descr': '<f4', 'fortran_order': False, 'shape': ()", {"expected", "'}'"});
  expect_error("{'descr': '<f4', 'fortran_order': False, 'shape': ()} x",
               {"end of the header after '}'", "found 'x'"});
  expect_error("{'descr': '<f4', 'fortran_order': 0, 'shape': ()}", {"True or False"});
  expect_error("{'descr': '<f\\x34', 'fortran_order': False, 'shape': ()}", {"escape"});
  using namespace std::string_literals;
  const std::string with_nul = "{'descr': '<f4'\0, 'fortran_order': False, 'shape': ()}"s;
  expect_error(make_file(with_nul), {"expected ',' or '}'", "\\x00"});
  expect_error("{'descr': '<f4', 'fortran_order': True, 'shape': (2,)}",
               {"expected C order", "'fortran_order': True"});
}

TEST(Npy, RejectsUnknownDescr) {
  for (const char* d : {"<c8", "<f16", "<i2", "<u4", "<U3", "f4", "|f4", "!f4", "<b2", ""}) {
    expect_error(dict_of(d, "()"), {"unsupported descr", "expected one of"});
  }
  expect_error("{'descr': [('a', '<f4')], 'fortran_order': False, 'shape': ()}",
               {"found a list", "structured"});
  expect_error("{'descr': 4, 'fortran_order': False, 'shape': ()}", {"quoted descr string"});
}

TEST(Npy, RejectsBadShapes) {
  expect_error(dict_of("<f4", "(-1,)"), {"non-negative", "found -1"});
  expect_error(dict_of("<f4", "(2, -3)"), {"non-negative", "found -3"});
  expect_error(dict_of("<f4", "(2.0,)"), {"integer dimension", "'2.0'"});
  expect_error(dict_of("<f4", "(2, True)"), {"non-negative integer"});
  expect_error(dict_of("<f4", "(0x10,)"), {"integer dimension", "'0x10'"});
  expect_error(dict_of("<f4", "(2)"), {"(n) is an integer"});
  expect_error(dict_of("<f4", "[2, 3]"), {"not a list"});
  expect_error(dict_of("<f4", "2"), {"a tuple for 'shape'"});
  expect_error(dict_of("<f4", "(2,,)"), {"non-negative integer"});
  expect_error(dict_of("<f4", "(1, 1, 1, 1, 1, 1, 1, 1, 1)"),
               {"at most 8 dimensions", "found more"});
  expect_error(dict_of("<f4", "(99999999999999999999,)"), {"overflows int64"});
  expect_error(dict_of("<f4", "(4294967296, 4294967296)"), {"element count", "overflows int64"});
  expect_error(dict_of("<f8", "(2305843009213693952,)"), {"byte count", "overflows"});
  expect_error(dict_of("<f4", "(4294967296, 4294967296, 0)"), {"overflows int64"});
}

TEST(Npy, RejectsTruncatedAndTrailingData) {
  expect_error(make_file(dict_of("<f4", "(2, 3)"), pattern_bytes(23)),
               {"truncated data", "shape (2, 3)", "'<f4'", "expected 24 bytes, found 23"});
  expect_error(make_file(dict_of("<f4", "(2, 3)"), pattern_bytes(25)),
               {"trailing bytes", "expected 24 bytes, found 25"});
  expect_error(make_file(dict_of("<f8", "(1000000000000,)"), pattern_bytes(16)),
               {"truncated data", "expected 8000000000000 bytes, found 16"});
  expect_error(make_file(dict_of("<u2", "(0,)"), pattern_bytes(1)), {"trailing bytes"});
  expect_error(bytes_t{}, {"truncated", "only 0 bytes"});
  expect_error(bytes_t{0x93, 'N', 'U'}, {"truncated", "only 3 bytes"});
  expect_error(bytes_t{0x93, 'N', 'U', 'M', 'P', 'Y', 2, 0, 1}, {"truncated", "4-byte header"});
}

TEST(Npy, TruncationAtEveryLengthRaises) {
  const std::vector<bytes_t> files = {
      npy::serialize(make_array(dtype::f32, {2, 3})),
      npy::serialize(make_array(dtype::f64, {})),
      npy::serialize(make_array(dtype::u16, {3, 0})),
      make_file(dict_of(">i8", "(3,)"), pattern_bytes(24), 2),
      make_file(dict_of("<f2", "(1, 2)"), pattern_bytes(4), 3),
  };
  for (const bytes_t& file : files) {
    ASSERT_NO_THROW(parse(file));
    for (std::size_t n = 0; n < file.size(); ++n) {
      // A fresh allocation of exactly n bytes, so that AddressSanitizer catches any read past it.
      const bytes_t prefix(file.begin(), file.begin() + static_cast<std::ptrdiff_t>(n));
      EXPECT_THROW(npy::parse(prefix.data(), prefix.size(), "cut.npy"), npy::error) << n;
    }
    bytes_t longer = file;
    longer.push_back(0);
    EXPECT_THROW(parse(longer), npy::error);
  }
}

TEST(Npy, FuzzedFilesParseOrThrow) {
  std::mt19937 rng(20240521);
  const std::vector<bytes_t> seeds = {
      npy::serialize(make_array(dtype::f32, {2, 3})),
      npy::serialize(make_array(dtype::i64, {})),
      npy::serialize(make_array(dtype::u8, {4, 1, 2})),
      make_file(dict_of(">f2", "(3,)"), pattern_bytes(6), 3),
  };
  const std::string alphabet = "(){}[]'\",: -0123456789LTrueFalse<>|=fiub\n\\\x93";
  int parsed = 0;
  for (int iter = 0; iter < 40000; ++iter) {
    bytes_t b = seeds[static_cast<std::size_t>(iter) % seeds.size()];
    const int edits = 1 + static_cast<int>(rng() % 4);
    for (int e = 0; e < edits; ++e) {
      const std::size_t pos = rng() % b.size();
      switch (rng() % 4) {
        case 0: b[pos] = static_cast<unsigned char>(rng() & 0xff); break;
        case 1: b[pos] = static_cast<unsigned char>(alphabet[rng() % alphabet.size()]); break;
        case 2: b.erase(b.begin() + static_cast<std::ptrdiff_t>(pos)); break;
        default:
          b.insert(b.begin() + static_cast<std::ptrdiff_t>(pos),
                   static_cast<unsigned char>(alphabet[rng() % alphabet.size()]));
          break;
      }
      if (b.empty()) break;
    }
    bytes_t exact(b);  // exact-size buffer for the sanitizers
    try {
      const npy::array a = npy::parse(exact.data(), exact.size(), "fuzz.npy");
      EXPECT_EQ(a.bytes.size(), static_cast<std::size_t>(a.numel()) * a.item_size());
      EXPECT_LE(a.shape.size(), npy::max_dims);
      ++parsed;
    } catch (const npy::error&) {
    } catch (const std::exception& e) {
      ADD_FAILURE() << "unexpected exception type: " << e.what();
    }
  }
  EXPECT_GT(parsed, 0);
}

TEST(Npy, FileErrorsNameTheFileAndReason) {
  const temp_dir dir;
  const std::string missing = dir.file("missing.npy");
  try {
    npy::read(missing);
    ADD_FAILURE() << "expected npy::error";
  } catch (const npy::error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find(missing), std::string::npos) << what;
    EXPECT_NE(what.find(std::strerror(ENOENT)), std::string::npos) << what;
  }
  try {
    npy::read(dir.file(""));
    ADD_FAILURE() << "expected npy::error";
  } catch (const npy::error& e) {
    EXPECT_NE(std::string(e.what()).find("directory"), std::string::npos) << e.what();
  }
  EXPECT_THROW(npy::read("/dev/null"), npy::error);
  try {
    npy::write(dir.file("no/such/dir.npy"), make_array(dtype::f32, {2}));
    ADD_FAILURE() << "expected npy::error";
  } catch (const npy::error& e) {
    EXPECT_NE(std::string(e.what()).find(std::strerror(ENOENT)), std::string::npos) << e.what();
  }
  const std::string truncated = dir.file("truncated.npy");
  bytes_t image = npy::serialize(make_array(dtype::f64, {4}));
  image.pop_back();
  std::ofstream(truncated, std::ios::binary)
      .write(reinterpret_cast<const char*>(image.data()),
             static_cast<std::streamsize>(image.size()));
  try {
    npy::read(truncated);
    ADD_FAILURE() << "expected npy::error";
  } catch (const npy::error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find(truncated), std::string::npos) << what;
    EXPECT_NE(what.find("expected 32 bytes, found 31"), std::string::npos) << what;
  }
}

TEST(Npy, WriterRejectsInconsistentArrays) {
  EXPECT_THROW(npy::serialize(make_array(dtype::bf16, {2})), npy::error);
  npy::array a = make_array(dtype::f32, {2, 3});
  a.bytes.pop_back();
  EXPECT_THROW(npy::serialize(a), npy::error);
  a.shape = {-1};
  EXPECT_THROW(npy::serialize(a), npy::error);
  a.shape.assign(9, 1);
  a.bytes.resize(4);
  EXPECT_THROW(npy::serialize(a), npy::error);
  EXPECT_THROW(npy::write("unused.npy", dtype::f32, {2}, nullptr), npy::error);
  EXPECT_THROW(npy::descr(dtype::bf16), npy::error);
  EXPECT_EQ(npy::descr(dtype::u16), "<u2");
}

TEST(Npy, TypedAccessChecksElementSize) {
  npy::array a = make_array(dtype::f64, {3});
  EXPECT_NO_THROW(a.data<double>());
  EXPECT_NO_THROW(a.data<std::int64_t>());
  EXPECT_THROW(a.data<float>(), npy::error);
  const npy::array& c = a;
  EXPECT_THROW(c.data<std::uint16_t>(), npy::error);
  EXPECT_EQ(make_array(dtype::f32, {2, 0, 5}).numel(), 0);
  npy::array huge;
  huge.shape = {std::int64_t{1} << 40, std::int64_t{1} << 40};
  EXPECT_THROW(huge.numel(), npy::error);
}

bytes_t file_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return bytes_t(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

/// Ignores a signal for the scope (SIGPIPE: a writer whose reader stopped gets EPIPE; SIGXFSZ: a
/// write past RLIMIT_FSIZE fails with EFBIG instead of killing the process).
class ignore_signal {
 public:
  explicit ignore_signal(int sig) : sig_(sig), old_(std::signal(sig, SIG_IGN)) {}
  ignore_signal(const ignore_signal&) = delete;
  ignore_signal& operator=(const ignore_signal&) = delete;
  ~ignore_signal() { std::signal(sig_, old_); }

 private:
  int sig_;
  void (*old_)(int);
};

/// Serves @p data through a FIFO at @p path from a thread, counting the bytes the reader took
/// (the writer stops at EPIPE once the reader has closed its end).
class fifo_writer {
 public:
  fifo_writer(const std::string& path, bytes_t data) : data_(std::move(data)) {
    if (::mkfifo(path.c_str(), 0600) != 0) throw std::runtime_error("mkfifo failed");
    thread_ = std::thread([this, path] {
      const int fd = ::open(path.c_str(), O_WRONLY);
      if (fd < 0) return;
      std::size_t done = 0;
      while (done < data_.size()) {
        // Small writes, so that the count stays close to what the reader consumed.
        const std::size_t step = std::min<std::size_t>(4096, data_.size() - done);
        const ::ssize_t n = ::write(fd, data_.data() + done, step);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) break;
        done += static_cast<std::size_t>(n);
        written_ = done;
      }
      ::close(fd);
    });
  }
  fifo_writer(const fifo_writer&) = delete;
  fifo_writer& operator=(const fifo_writer&) = delete;
  ~fifo_writer() { finish(); }
  /// Waits for the writer to stop; returns the bytes it wrote.
  std::size_t finish() {
    if (thread_.joinable()) thread_.join();
    return written_;
  }

 private:
  bytes_t data_;
  std::atomic<std::size_t> written_{0};
  std::thread thread_;
};

TEST(NpyStream, PipesReadLikeFiles) {
  const temp_dir dir;
  const ignore_signal no_sigpipe(SIGPIPE);
  const std::vector<bytes_t> files = {
      npy::serialize(make_array(dtype::f32, {2, 3})),
      npy::serialize(make_array(dtype::u16, {3, 0})),
      make_file(dict_of(">i8", "(3,)"), pattern_bytes(24), 2),
      npy::serialize(make_array(dtype::f64, {300, 100})),  // more than one 64 KiB read
  };
  int serial = 0;
  for (const bytes_t& file : files) {
    const std::string whole = dir.file("fifo" + std::to_string(serial++));
    {
      fifo_writer writer(whole, file);
      expect_same(npy::read(whole), parse(file));
    }
    // Every truncation (a few lengths) raises, as parse() does.
    for (const std::size_t n : {std::size_t{0}, std::size_t{5}, std::size_t{11}, std::size_t{40}, file.size() - 1}) {
      const std::string cut = dir.file("fifo" + std::to_string(serial++));
      fifo_writer writer(cut, bytes_t(file.begin(), file.begin() + static_cast<std::ptrdiff_t>(n)));
      EXPECT_THROW(npy::read(cut), npy::error) << n;
    }
    bytes_t longer = file;
    longer.push_back(0);
    const std::string trailing = dir.file("fifo" + std::to_string(serial++));
    fifo_writer writer(trailing, longer);
    try {
      npy::read(trailing);
      ADD_FAILURE() << "expected npy::error";
    } catch (const npy::error& e) {
      EXPECT_NE(std::string(e.what()).find("trailing bytes"), std::string::npos) << e.what();
    }
  }
}

TEST(NpyStream, PipeIsReadOnlyAsFarAsTheHeaderSays) {
  const temp_dir dir;
  const ignore_signal no_sigpipe(SIGPIPE);
  // A valid 24-byte array followed by 16 MiB of junk: the reader takes the array and one byte of
  // the junk, reports trailing bytes and closes, so the writer is stopped by EPIPE long before the
  // end (the pipe buffers 64 KiB; 1 MiB leaves room for the writer's last chunks).
  bytes_t data = npy::serialize(make_array(dtype::f32, {2, 3}));
  const std::size_t valid = data.size();
  data.resize(valid + (std::size_t{16} << 20), 0x55);
  const std::string path = dir.file("endless");
  fifo_writer writer(path, data);
  try {
    npy::read(path);
    ADD_FAILURE() << "expected npy::error";
  } catch (const npy::error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("trailing bytes"), std::string::npos) << what;
    EXPECT_NE(what.find("expected 24 bytes, found more"), std::string::npos) << what;
  }
  EXPECT_LT(writer.finish(), valid + (std::size_t{1} << 20));

  // A header announcing 2^40 bytes of data followed by 100 bytes: truncated, and no attempt to
  // allocate 1 TiB first.
  const std::string huge = dir.file("huge");
  fifo_writer liar(huge, make_file(dict_of("<f8", "(137438953472,)"), pattern_bytes(100)));
  try {
    npy::read(huge);
    ADD_FAILURE() << "expected npy::error";
  } catch (const npy::error& e) {
    EXPECT_NE(std::string(e.what()).find("expected 1099511627776 bytes, found 100"), std::string::npos) << e.what();
  }
}

TEST(NpyStream, DevZeroFailsFast) {
  // Reading /dev/zero to its end never finishes: run it in a child process that an alarm stops
  // after 20 s (the read must fail at the magic string, after 12 bytes).
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    ::alarm(20);
    try {
      npy::read("/dev/zero");
    } catch (const npy::error& e) {
      ::_exit(std::string(e.what()).find("bad magic") != std::string::npos ? 0 : 3);
    }
    ::_exit(4);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
      << "status " << status << " (signal " << (WIFSIGNALED(status) ? WTERMSIG(status) : 0) << ")";
}

TEST(NpyWrite, FailedWriteKeepsTheOldFile) {
  const temp_dir dir;
  const std::string path = dir.file("out.npy");
  npy::write(path, make_array(dtype::f32, {1000}));
  const bytes_t before = file_bytes(path);
  const auto names = dir.entries();

  // A file size limit of 4 KiB: the 40 KiB replacement fails part way with EFBIG.
  constexpr rlim_t kLimit = 4096;
  rlimit old_limit{};
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &old_limit), 0);
  {
    const ignore_signal no_sigxfsz(SIGXFSZ);
    rlimit small = old_limit;
    small.rlim_cur = kLimit;
    ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &small), 0);
    try {
      npy::write(path, make_array(dtype::f32, {10000}));
      ADD_FAILURE() << "expected npy::error";
    } catch (const npy::error& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find(path), std::string::npos) << what;
      EXPECT_NE(what.find(std::strerror(EFBIG)), std::string::npos) << what;
      EXPECT_NE(what.find("of 40128 bytes"), std::string::npos) << what;
    }
    ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &old_limit), 0);
  }
  EXPECT_EQ(file_bytes(path), before);
  EXPECT_EQ(dir.entries(), names) << "a temporary file was left behind";
}

TEST(NpyWrite, KeepsTheModeAndUsesTheUmaskForNewFiles) {
  const temp_dir dir;
  const std::string path = dir.file("mode.npy");
  npy::write(path, make_array(dtype::f32, {3}));
  ASSERT_EQ(::chmod(path.c_str(), 0640), 0);
  npy::write(path, make_array(dtype::f64, {5}));
  struct stat st {};
  ASSERT_EQ(::stat(path.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 07777, 0640u);
  expect_same(npy::read(path), make_array(dtype::f64, {5}));

  for (const mode_t mask : {mode_t{022}, mode_t{077}, mode_t{0}}) {
    const mode_t old_mask = ::umask(mask);
    const std::string fresh = dir.file("new" + std::to_string(mask) + ".npy");
    npy::write(fresh, make_array(dtype::u8, {4}));
    ::umask(old_mask);
    ASSERT_EQ(::stat(fresh.c_str(), &st), 0);
    EXPECT_EQ(st.st_mode & 07777, 0666u & ~mask) << "umask " << mask;
  }
}

TEST(NpyWrite, FollowsSymlinksAndWritesDevicesAndFifosInPlace) {
  const temp_dir dir;
  const std::string target = dir.file("target.npy");
  const std::string link = dir.file("link.npy");
  npy::write(target, make_array(dtype::f32, {2}));
  std::filesystem::create_symlink("target.npy", link);
  npy::write(link, make_array(dtype::i32, {7}));
  EXPECT_TRUE(std::filesystem::is_symlink(link));
  expect_same(npy::read(target), make_array(dtype::i32, {7}));
  // A dangling link: the file it names is created, the link stays.
  const std::string dangling = dir.file("dangling.npy");
  std::filesystem::create_symlink("created.npy", dangling);
  npy::write(dangling, make_array(dtype::u8, {3}));
  EXPECT_TRUE(std::filesystem::is_symlink(dangling));
  expect_same(npy::read(dir.file("created.npy")), make_array(dtype::u8, {3}));

  npy::write("/dev/null", make_array(dtype::f64, {100}));
  struct stat st {};
  ASSERT_EQ(::stat("/dev/null", &st), 0);
  EXPECT_TRUE(S_ISCHR(st.st_mode)) << "/dev/null must stay a character device";

  // A FIFO with a reader already attached receives the file (a rename would replace the FIFO and
  // leave the reader with nothing). The image is far below the 64 KiB pipe buffer.
  const std::string fifo = dir.file("fifo");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  const int reader = ::open(fifo.c_str(), O_RDONLY | O_NONBLOCK);
  ASSERT_GE(reader, 0);
  const npy::array a = make_array(dtype::f32, {16});
  npy::write(fifo, a);
  bytes_t got(4096);
  const ::ssize_t n = ::read(reader, got.data(), got.size());
  ::close(reader);
  got.resize(n > 0 ? static_cast<std::size_t>(n) : 0);
  EXPECT_EQ(got, npy::serialize(a));
  ASSERT_EQ(::lstat(fifo.c_str(), &st), 0);
  EXPECT_TRUE(S_ISFIFO(st.st_mode));
  EXPECT_EQ(dir.entries(), (std::vector<std::string>{"created.npy", "dangling.npy", "fifo", "link.npy", "target.npy"}));
}

TEST(NpyWrite, DirectoriesAndMissingDirectoriesAreReported) {
  const temp_dir dir;
  try {
    npy::write(dir.file(""), make_array(dtype::f32, {2}));
    ADD_FAILURE() << "expected npy::error";
  } catch (const npy::error& e) {
    EXPECT_NE(std::string(e.what()).find("directory"), std::string::npos) << e.what();
  }
  EXPECT_THROW(dfss::files::check_writable(dir.file("")), dfss::files::write_error);
  EXPECT_THROW(dfss::files::check_writable(dir.file("no/such.npy")), dfss::files::write_error);
  EXPECT_NO_THROW(dfss::files::check_writable(dir.file("fresh.npy")));
  EXPECT_NO_THROW(dfss::files::check_writable("/dev/null"));
  npy::write(dir.file("plain"), make_array(dtype::u8, {1}));
  try {
    dfss::files::check_writable(dir.file("plain/x.npy"));
    ADD_FAILURE() << "expected write_error";
  } catch (const dfss::files::write_error& e) {
    EXPECT_NE(std::string(e.what()).find(std::strerror(ENOTDIR)), std::string::npos) << e.what();
  }
  EXPECT_EQ(dir.entries(), std::vector<std::string>{"plain"});
}

TEST(NpyWrite, TransactionReplacesAllOrNothing) {
  const temp_dir dir;
  const std::string a = dir.file("a.npy"), b = dir.file("b.npy");
  npy::write(a, make_array(dtype::f32, {1}));
  const bytes_t old_a = file_bytes(a);
  {
    dfss::files::transaction t;
    npy::stage(t, a, make_array(dtype::f32, {2}));
    EXPECT_EQ(file_bytes(a), old_a) << "staging must not replace the file";
    EXPECT_THROW(npy::stage(t, dir.file("missing/b.npy"), make_array(dtype::f32, {2})), npy::error);
  }  // not committed
  EXPECT_EQ(file_bytes(a), old_a);
  EXPECT_EQ(dir.entries(), std::vector<std::string>{"a.npy"});

  dfss::files::transaction t;
  npy::stage(t, a, make_array(dtype::f32, {2}));
  npy::stage(t, b, make_array(dtype::i64, {3}));
  t.commit();
  expect_same(npy::read(a), make_array(dtype::f32, {2}));
  expect_same(npy::read(b), make_array(dtype::i64, {3}));
  EXPECT_EQ(dir.entries(), (std::vector<std::string>{"a.npy", "b.npy"}));
}

TEST(NpyFiles, SameFileSeesThroughSpellingsLinksAndHardLinks) {
  namespace fs = std::filesystem;
  using dfss::files::identify;
  using dfss::files::same_file;
  const temp_dir dir;
  const std::string a = dir.file("a.npy");
  npy::write(a, make_array(dtype::u8, {1}));
  fs::create_directory(dir.file("sub"));
  fs::create_symlink("a.npy", dir.file("sym.npy"));
  fs::create_hard_link(a, dir.file("hard.npy"));
  fs::create_directory_symlink("sub", dir.file("subl"));
  for (const std::string& alias : {dir.file("./a.npy"), dir.file("sub/../a.npy"), dir.file("sym.npy"),
                                   dir.file("hard.npy")}) {
    EXPECT_TRUE(same_file(identify(a), identify(alias))) << alias;
  }
  // Files that do not exist yet: compared by their resolved paths.
  EXPECT_TRUE(same_file(identify(dir.file("sub/new.npy")), identify(dir.file("subl/new.npy"))));
  EXPECT_TRUE(same_file(identify(dir.file("sub/new.npy")), identify(dir.file("sub/../sub/./new.npy"))));
  fs::create_symlink("sub/new.npy", dir.file("to_new.npy"));  // dangling
  EXPECT_TRUE(same_file(identify(dir.file("to_new.npy")), identify(dir.file("sub/new.npy"))));
  EXPECT_FALSE(same_file(identify(dir.file("sub/new.npy")), identify(dir.file("sub/other.npy"))));
  EXPECT_FALSE(same_file(identify(a), identify(dir.file("sub/a.npy"))));
  npy::write(dir.file("b.npy"), make_array(dtype::u8, {1}));
  EXPECT_FALSE(same_file(identify(a), identify(dir.file("b.npy"))));
}

}  // namespace
