// N:M compressed format and sparse tensor core metadata: host implementation of dfss/format.hpp.
// The selection and the bit encodings come from the host+device headers under dfss/format/, so the
// CUDA kernels and these functions cannot disagree.
#include "dfss/format.hpp"

#include <cstdint>
#include <limits>
#include <string>

namespace dfss {
namespace {

using i64 = std::int64_t;

std::string pattern_text(pattern p) { return std::to_string(p.n) + ":" + std::to_string(p.m); }

std::string hex(std::uint32_t v) {
  static constexpr char digits[] = "0123456789ABCDEF";
  std::string out;
  do {
    out.insert(out.begin(), digits[v & 0xFu]);
    v >>= 4;
  } while (v != 0);
  return "0x" + out;
}

[[noreturn]] void fail(const char* fn, const char* arg, const std::string& expected,
                       const std::string& got) {
  throw error(status_code::invalid_argument, std::string("dfss::") + fn + ": argument '" + arg +
                                                 "': expected " + expected + ", got " + got);
}

void check_pattern(const char* fn, pattern p) {
  if (!(1 <= p.n && p.n <= p.m && p.m <= kMaxGroupSize)) {
    fail(fn, "pattern", "1 <= N <= M <= " + std::to_string(kMaxGroupSize), pattern_text(p));
  }
}

void check_nonnegative(const char* fn, const char* arg, i64 v) {
  if (v < 0) fail(fn, arg, ">= 0", std::to_string(v));
}

void check_pointer(const char* fn, const char* arg, const void* ptr, i64 elements) {
  if (elements > 0 && ptr == nullptr) {
    fail(fn, arg, "a non-null pointer (" + std::to_string(elements) + " elements)", "nullptr");
  }
}

// a * b for non-negative a, b; throws when the product (a buffer size) does not fit in int64.
i64 checked_product(const char* fn, const char* arg, i64 a, i64 b) {
  if (a != 0 && b > std::numeric_limits<i64>::max() / a) {
    fail(fn, arg, "a size that fits in int64",
         std::to_string(a) + " x " + std::to_string(b) + " elements");
  }
  return a * b;
}

i64 ceil_div(i64 a, i64 b) { return (a + b - 1) / b; }

// Shape checks shared by the compressed-format functions; returns the groups per row.
i64 check_compressed_shape(const char* fn, i64 rows, i64 cols, pattern p) {
  check_nonnegative(fn, "rows", rows);
  check_nonnegative(fn, "cols", cols);
  check_pattern(fn, p);
  // Indices are int32 and reach the last padding position of the row.
  const i64 max_cols = i64{std::numeric_limits<std::int32_t>::max()} - (p.m - 1);
  if (cols > max_cols) {
    fail(fn, "cols", "<= " + std::to_string(max_cols) + " (int32 key indices)",
         std::to_string(cols));
  }
  return ceil_div(cols, p.m);
}

void check_ld(const char* fn, i64 rows, i64 cols, i64 ld) {
  if (ld < cols) fail(fn, "ld", ">= cols (" + std::to_string(cols) + ")", std::to_string(ld));
  checked_product(fn, "ld", rows, ld);
}

// Every group's indices must name distinct in-group positions in increasing order.
void check_indices(const char* fn, const std::int32_t* indices, i64 rows, i64 groups, pattern p) {
  for (i64 r = 0; r < rows; ++r) {
    for (i64 g = 0; g < groups; ++g) {
      const std::int32_t* idx = indices + (r * groups + g) * p.n;
      i64 previous = g * p.m - 1;
      for (int k = 0; k < p.n; ++k) {
        if (idx[k] <= previous || idx[k] >= (g + 1) * p.m) {
          fail(fn, "indices",
               "increasing key indices in [" + std::to_string(g * p.m) + ", " +
                   std::to_string((g + 1) * p.m) + ") for row " + std::to_string(r) + " group " +
                   std::to_string(g),
               std::to_string(idx[k]) + " at slot " + std::to_string(k));
        }
        previous = idx[k];
      }
    }
  }
}

std::uint32_t indices_mask(const std::int32_t* idx, i64 group_start, int n) {
  std::uint32_t mask = 0;
  for (int k = 0; k < n; ++k) mask |= 1u << (idx[k] - group_start);
  return mask;
}

void check_meta_format(const char* fn, meta_format f) {
  switch (f) {
    case meta_format::sm80_16bit_2of4:
    case meta_format::sm80_16bit_1of2:
    case meta_format::sm80_tf32_1of2:
      return;
  }
  fail(fn, "format", "sm80_16bit_2of4, sm80_16bit_1of2 or sm80_tf32_1of2",
       std::to_string(static_cast<int>(f)));
}

pattern format_pattern(meta_format f) { return {nm_meta_keep_count(f), nm_meta_group_size(f)}; }

template <typename T>
void compress(const T* dense, i64 rows, i64 cols, i64 ld, pattern p, T* values,
              std::int32_t* indices) {
  const char* fn = "nm_compress";
  const i64 groups = check_compressed_shape(fn, rows, cols, p);
  check_ld(fn, rows, cols, ld);
  const i64 out_cols = groups * p.n;
  const i64 out_size = checked_product(fn, "cols", rows, out_cols);
  check_pointer(fn, "dense", dense, rows * cols);
  check_pointer(fn, "values", values, out_size);
  check_pointer(fn, "indices", indices, out_size);

  const T pad = -std::numeric_limits<T>::infinity();
  for (i64 r = 0; r < rows; ++r) {
    for (i64 g = 0; g < groups; ++g) {
      const i64 start = g * p.m;
      const T* s = dense + r * ld + start;
      const int count = static_cast<int>(cols - start < p.m ? cols - start : p.m);
      const std::uint32_t keep = nm_select_group(s, count, p.n, p.m);
      i64 o = r * out_cols + g * p.n;
      for (int q = 0; q < p.m; ++q) {
        if (((keep >> q) & 1u) == 0) continue;
        values[o] = q < count ? s[q] : pad;
        indices[o] = static_cast<std::int32_t>(start + q);
        ++o;
      }
    }
  }
}

template <typename T>
void decompress(const T* values, const std::int32_t* indices, i64 rows, i64 cols, pattern p,
                T* dense, i64 ld, T fill) {
  const char* fn = "nm_decompress";
  const i64 groups = check_compressed_shape(fn, rows, cols, p);
  check_ld(fn, rows, cols, ld);
  const i64 in_cols = groups * p.n;
  const i64 in_size = checked_product(fn, "cols", rows, in_cols);
  check_pointer(fn, "values", values, in_size);
  check_pointer(fn, "indices", indices, in_size);
  check_pointer(fn, "dense", dense, rows * cols);
  check_indices(fn, indices, rows, groups, p);

  for (i64 r = 0; r < rows; ++r) {
    T* row = dense + r * ld;
    for (i64 j = 0; j < cols; ++j) row[j] = fill;
    for (i64 k = 0; k < in_cols; ++k) {
      const std::int32_t key = indices[r * in_cols + k];
      if (key < cols) row[key] = values[r * in_cols + k];
    }
  }
}

}  // namespace

void nm_compress(const float* dense, std::int64_t rows, std::int64_t cols, std::int64_t ld,
                 pattern p, float* values, std::int32_t* indices) {
  compress(dense, rows, cols, ld, p, values, indices);
}

void nm_compress(const double* dense, std::int64_t rows, std::int64_t cols, std::int64_t ld,
                 pattern p, double* values, std::int32_t* indices) {
  compress(dense, rows, cols, ld, p, values, indices);
}

void nm_decompress(const float* values, const std::int32_t* indices, std::int64_t rows,
                   std::int64_t cols, pattern p, float* dense, std::int64_t ld, float fill) {
  decompress(values, indices, rows, cols, p, dense, ld, fill);
}

void nm_decompress(const double* values, const std::int32_t* indices, std::int64_t rows,
                   std::int64_t cols, pattern p, double* dense, std::int64_t ld, double fill) {
  decompress(values, indices, rows, cols, p, dense, ld, fill);
}

const char* meta_format_name(meta_format f) noexcept {
  switch (f) {
    case meta_format::sm80_16bit_2of4:
      return "sm80_16bit_2of4";
    case meta_format::sm80_16bit_1of2:
      return "sm80_16bit_1of2";
    case meta_format::sm80_tf32_1of2:
      return "sm80_tf32_1of2";
  }
  return "unknown";
}

std::int64_t nm_metadata_words_per_row(std::int64_t cols, meta_format f) {
  const char* fn = "nm_metadata_words_per_row";
  check_nonnegative(fn, "cols", cols);
  check_meta_format(fn, f);
  return nm_meta_words_per_row(cols, f);
}

void nm_metadata_encode(const std::int32_t* indices, std::int64_t rows, std::int64_t cols,
                        pattern p, meta_format f, std::uint16_t* words) {
  const char* fn = "nm_metadata_encode";
  check_meta_format(fn, f);
  const i64 groups = check_compressed_shape(fn, rows, cols, p);
  if (p != format_pattern(f)) {
    fail(fn, "pattern", pattern_text(format_pattern(f)) + " for meta_format " + meta_format_name(f),
         pattern_text(p));
  }
  const i64 words_per_row = nm_meta_words_per_row(cols, f);
  check_pointer(fn, "indices", indices, checked_product(fn, "cols", rows, groups * p.n));
  check_pointer(fn, "words", words, checked_product(fn, "cols", rows, words_per_row));
  check_indices(fn, indices, rows, groups, p);

  const int groups_per_word = nm_meta_keys_per_word(f) / p.m;
  // An all-padding group keeps its lowest N positions, as nm_select_group does.
  const std::uint32_t padding_mask = (1u << p.n) - 1u;
  for (i64 r = 0; r < rows; ++r) {
    for (i64 w = 0; w < words_per_row; ++w) {
      std::uint32_t word = 0;
      for (int q = 0; q < groups_per_word; ++q) {
        const i64 g = w * groups_per_word + q;
        const std::uint32_t mask =
            g < groups ? indices_mask(indices + (r * groups + g) * p.n, g * p.m, p.n)
                       : padding_mask;
        word |= nm_meta_group_bits(f, q, mask);
      }
      words[r * words_per_row + w] = static_cast<std::uint16_t>(word);
    }
  }
}

void nm_metadata_decode(const std::uint16_t* words, std::int64_t rows, std::int64_t cols,
                        meta_format f, std::int32_t* indices) {
  const char* fn = "nm_metadata_decode";
  check_meta_format(fn, f);
  const pattern p = format_pattern(f);
  const i64 groups = check_compressed_shape(fn, rows, cols, p);
  const i64 words_per_row = nm_meta_words_per_row(cols, f);
  check_pointer(fn, "words", words, checked_product(fn, "cols", rows, words_per_row));
  check_pointer(fn, "indices", indices, checked_product(fn, "cols", rows, groups * p.n));

  const int groups_per_word = nm_meta_keys_per_word(f) / p.m;
  for (i64 r = 0; r < rows; ++r) {
    for (i64 w = 0; w < words_per_row; ++w) {
      const std::uint32_t word = words[r * words_per_row + w];
      for (int q = 0; q < groups_per_word; ++q) {
        const std::uint32_t mask = nm_meta_group_mask(f, q, word);
        if (mask == 0) {
          fail(fn, "words",
               std::string("legal ") + meta_format_name(f) + " codes (row " + std::to_string(r) +
                   ", word " + std::to_string(w) + ", group " + std::to_string(q) + ")",
               hex(word));
        }
        const i64 g = w * groups_per_word + q;
        if (g >= groups) continue;
        std::int32_t* out = indices + (r * groups + g) * p.n;
        for (int pos = 0; pos < p.m; ++pos) {
          if ((mask >> pos) & 1u) *out++ = static_cast<std::int32_t>(g * p.m + pos);
        }
      }
    }
  }
}

std::int64_t nm_metadata_reordered_size(std::int64_t rows, std::int64_t cols) {
  const char* fn = "nm_metadata_reordered_size";
  check_nonnegative(fn, "rows", rows);
  check_nonnegative(fn, "cols", cols);
  return checked_product(fn, "rows", nm_meta_reordered_rows(rows),
                         nm_meta_reordered_chunks(ceil_div(cols, 16)));
}

namespace {

struct reorder_shape {
  i64 chunks;       // row-order words per row
  i64 rows_padded;  // reordered rows
  i64 chunks_padded;
};

reorder_shape check_reorder(const char* fn, const void* row_words, const void* reordered, i64 rows,
                            i64 cols) {
  check_nonnegative(fn, "rows", rows);
  check_nonnegative(fn, "cols", cols);
  reorder_shape s{ceil_div(cols, 16), nm_meta_reordered_rows(rows), 0};
  s.chunks_padded = nm_meta_reordered_chunks(s.chunks);
  const i64 size = checked_product(fn, "rows", s.rows_padded, s.chunks_padded);
  check_pointer(fn, "row_words", row_words, rows * s.chunks);
  check_pointer(fn, "reordered", reordered, size);
  return s;
}

}  // namespace

void nm_metadata_reorder(const std::uint16_t* row_words, std::int64_t rows, std::int64_t cols,
                         std::uint16_t* reordered) {
  const reorder_shape s = check_reorder("nm_metadata_reorder", row_words, reordered, rows, cols);
  for (i64 r = 0; r < s.rows_padded; ++r) {
    for (i64 c = 0; c < s.chunks_padded; ++c) {
      const bool real = r < rows && c < s.chunks;
      reordered[nm_meta_reordered_offset(r, c, s.rows_padded)] =
          real ? row_words[r * s.chunks + c] : kMetaPaddingWord;
    }
  }
}

void nm_metadata_unreorder(const std::uint16_t* reordered, std::int64_t rows, std::int64_t cols,
                           std::uint16_t* row_words) {
  const reorder_shape s = check_reorder("nm_metadata_unreorder", row_words, reordered, rows, cols);
  for (i64 r = 0; r < rows; ++r) {
    for (i64 c = 0; c < s.chunks; ++c) {
      row_words[r * s.chunks + c] = reordered[nm_meta_reordered_offset(r, c, s.rows_padded)];
    }
  }
}

}  // namespace dfss
