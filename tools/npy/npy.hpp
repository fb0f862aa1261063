// npy/npy.hpp: reading and writing NumPy .npy files for the dfss command-line tools.
//
// The .npy format (NumPy Enhancement Proposal 1, numpy.lib.format) is a 6-byte magic string
// "\x93NUMPY", a two-byte format version, a little-endian header length, and an ASCII header that
// is a Python dict literal such as {'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), },
// followed by the raw array data. This reader accepts versions 1.0, 2.0 and 3.0, the element types
// that map onto dfss::dtype ('<f8', '<f4', '<f2', '<i4', '<i8', '<u2', '|u1', and '|b1' read as
// u8), the '=' and '|' byte-order spellings where they are meaningful, and big-endian data, which
// it byte-swaps so that an array in memory is always little-endian and in C order. Fortran-ordered
// files are rejected. The header dict is parsed by a small hand-written parser, not evaluated.
// Every malformed, truncated or inconsistent input raises dfss::npy::error with a message naming
// the file, what was expected and what was found; the reader never reads out of bounds and never
// allocates memory for data before it has checked that the input really holds that much data.
// Writes replace files atomically (npy/files.hpp).
// The writer produces byte-for-byte the files numpy.save writes: version 1.0 (2.0 only when the
// header does not fit a 16-bit length), the header padded with spaces and a final '\n' so that the
// data starts at a multiple of 64 bytes. bf16 has no NumPy type and cannot be written.
#pragma once

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "dfss/types.hpp"

namespace dfss::files {
class transaction;
}

namespace dfss::npy {

/// @brief Raised for every unreadable, malformed, truncated or inconsistent .npy input and for
/// every failure to write one. what() names the file and what was expected versus found.
class error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
  error(const error&) = default;
  error& operator=(const error&) = default;
  ~error() override;
};

/// @brief Largest number of dimensions accepted when reading or writing.
inline constexpr std::size_t max_dims = 8;

/// @brief Size in bytes of one element of @p type (0 for a value outside the enumeration).
std::size_t item_size(dfss::dtype type) noexcept;

/// @brief The little-endian NumPy descr written for @p type ("<f4", "|u1", ...); throws
/// npy::error for bf16, which NumPy has no type for.
std::string descr(dfss::dtype type);

/// @brief An n-dimensional array as stored in an .npy file: C order, little-endian elements.
struct array {
  dfss::dtype type = dfss::dtype::f32;  ///< element type
  std::vector<std::int64_t> shape;      ///< dimensions; empty for a 0-d (scalar) array
  std::vector<unsigned char> bytes;     ///< numel() * item_size(type) bytes, C order, little-endian

  /// @brief Number of elements: the product of shape (1 for a 0-d array, 0 if any dimension is 0).
  /// Throws npy::error on a negative dimension or when the product overflows std::int64_t.
  std::int64_t numel() const;

  /// @brief Size in bytes of one element.
  std::size_t item_size() const noexcept { return npy::item_size(type); }

  /// @brief The elements as @p T; throws npy::error when sizeof(T) differs from item_size().
  /// The storage comes from operator new and is therefore aligned for every arithmetic type.
  template <class T>
  const T* data() const {
    check_element<T>();
    return reinterpret_cast<const T*>(bytes.data());
  }

  /// @brief Mutable access to the elements as @p T; same checks as the const overload.
  template <class T>
  T* data() {
    check_element<T>();
    return reinterpret_cast<T*>(bytes.data());
  }

 private:
  template <class T>
  void check_element() const {
    static_assert(std::is_trivially_copyable<T>::value,
                  "npy::array::data<T>: T must be trivially copyable");
    if (sizeof(T) != item_size()) throw_element_mismatch(sizeof(T));
  }
  [[noreturn]] void throw_element_mismatch(std::size_t requested) const;
};

/// @brief Parses an in-memory .npy image of @p size bytes; @p name is used in error messages.
array parse(const unsigned char* data, std::size_t size, const std::string& name);

/// @brief Reads the .npy file at @p path. A regular file is checked against its size before any
/// data is read or allocated; a pipe or character device is read incrementally: the header first,
/// then exactly the data bytes it announces, and the input must end there (trailing bytes are an
/// error, as for files). Running out of memory for the data raises npy::error with the byte count.
array read(const std::string& path);

/// @brief The complete .npy image (header and data) that write() stores for @p a.
/// @p name is used in error messages. Throws npy::error when @p a is inconsistent.
std::vector<unsigned char> serialize(const array& a, const std::string& name = "<memory>");

/// @brief Writes @p a to @p path, atomically replacing any existing regular file (a temporary file
/// in the same directory, renamed over it; see npy/files.hpp): if the write fails, the old file is
/// left byte for byte as it was and no temporary file remains. /dev/null, FIFOs and other
/// non-regular targets are written in place.
void write(const std::string& path, const array& a);

/// @brief Stages @p a for @p path in @p t (written when @p t commits; see npy/files.hpp), so that
/// several outputs are replaced together or not at all. Errors are raised as npy::error.
void stage(files::transaction& t, const std::string& path, const array& a);

/// @brief Writes numel(@p shape) elements of @p type from @p data (C order, little-endian) to
/// @p path. @p data may be null only when the shape has no elements.
void write(const std::string& path, dfss::dtype type, const std::vector<std::int64_t>& shape,
           const void* data);

}  // namespace dfss::npy
