// dfss/format.hpp: host API of the N:M compressed format and its sparse tensor core metadata.
//
// A dense [rows, cols] matrix of scores (row stride ld) is pruned row by row with the N:M rule of
// dfss/format/nm_select.hpp and stored as two packed row-major arrays of [rows, ceil(cols/M) * N]
// elements: `values` holds the kept entries of every group in increasing key order and `indices`
// their key positions. A last partial group is padded: a kept padding position has value -inf and
// its (out-of-range, >= cols) key position as index. From the indices, nm_metadata_encode builds
// the row-order 16-bit metadata words of dfss/format/nm_meta.hpp, and nm_metadata_reorder moves
// 16-bit-format words into the reordered (CUTLASS ColumnMajorInterleaved<2>) layout that the
// original DFSS kernels and ldmatrix use.
//
// Every function validates its arguments and throws dfss::error (status_code::invalid_argument)
// naming the function, the argument, the expected and the received value. Pointers may be null only
// when the buffer they describe is empty.
#pragma once

#include <cstdint>
#include <limits>

#include "dfss/error.hpp"
#include "dfss/format/nm_meta.hpp"
#include "dfss/format/nm_select.hpp"
#include "dfss/types.hpp"

namespace dfss {

/// @brief Prunes every row of @p dense ([rows, cols], row stride @p ld >= cols) to pattern @p p.
/// Writes [rows, ceil(cols/M) * N] kept values and their key indices, row-major, kept entries of
/// each group in increasing key order; kept padding positions get value -inf and index >= cols.
void nm_compress(const float* dense, std::int64_t rows, std::int64_t cols, std::int64_t ld,
                 pattern p, float* values, std::int32_t* indices);
/// @brief nm_compress for double.
void nm_compress(const double* dense, std::int64_t rows, std::int64_t cols, std::int64_t ld,
                 pattern p, double* values, std::int32_t* indices);

/// @brief Inverse of nm_compress: writes @p fill to every entry of @p dense ([rows, cols], row
/// stride @p ld) and then the kept values at their indices (padding indices >= cols are skipped).
/// Indices are validated first (each within its group, strictly increasing); on error @p dense is
/// untouched.
void nm_decompress(const float* values, const std::int32_t* indices, std::int64_t rows,
                   std::int64_t cols, pattern p, float* dense, std::int64_t ld,
                   float fill = -std::numeric_limits<float>::infinity());
/// @brief nm_decompress for double.
void nm_decompress(const double* values, const std::int32_t* indices, std::int64_t rows,
                   std::int64_t cols, pattern p, double* dense, std::int64_t ld,
                   double fill = -std::numeric_limits<double>::infinity());

/// @brief Name of a metadata format ("sm80_16bit_2of4", ...), as used in error messages.
const char* meta_format_name(meta_format f) noexcept;

/// @brief Row-order metadata words per row of @p cols keys: ceil(cols/16) for the 16-bit formats,
/// ceil(cols/8) for tf32.
std::int64_t nm_metadata_words_per_row(std::int64_t cols, meta_format f);

/// @brief Encodes nm_compress @p indices ([rows, ceil(cols/M) * N]) of pattern @p p as row-order
/// metadata words [rows, nm_metadata_words_per_row(cols, f)]. @p p must be the format's pattern
/// (2:4 for sm80_16bit_2of4, 1:2 for the others). Groups past the end of the row are encoded as
/// all-padding groups (lowest positions kept), so every code is legal.
void nm_metadata_encode(const std::int32_t* indices, std::int64_t rows, std::int64_t cols,
                        pattern p, meta_format f, std::uint16_t* words);

/// @brief Inverse of nm_metadata_encode: decodes row-order @p words into [rows, ceil(cols/M) * N]
/// indices (M:N of the format). Throws when any code of @p words is illegal for @p f.
void nm_metadata_decode(const std::uint16_t* words, std::int64_t rows, std::int64_t cols,
                        meta_format f, std::int32_t* indices);

/// @brief Size in uint16 elements of the reordered metadata of a [rows, cols] matrix in a 16-bit
/// format: rows rounded up to 32 times ceil(cols/16) rounded up to even.
std::int64_t nm_metadata_reordered_size(std::int64_t rows, std::int64_t cols);

/// @brief Copies row-order 16-bit-format metadata words ([rows, ceil(cols/16)]) into the reordered
/// layout (nm_metadata_reordered_size(rows, cols) elements, every one written; padding words are
/// kMetaPaddingWord). Not for the tf32 format.
void nm_metadata_reorder(const std::uint16_t* row_words, std::int64_t rows, std::int64_t cols,
                         std::uint16_t* reordered);

/// @brief Inverse of nm_metadata_reorder: reads the real words back into row order.
void nm_metadata_unreorder(const std::uint16_t* reordered, std::int64_t rows, std::int64_t cols,
                           std::uint16_t* row_words);

}  // namespace dfss
