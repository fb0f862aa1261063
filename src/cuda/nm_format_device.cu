// Device N:M pruning of dense fp32 rows (see nm_format_device.hpp). One thread handles one "unit"
// of a row: a metadata word's span of keys (16 for the 16-bit formats, 8 for tf32) when metadata is
// requested, otherwise one group of M keys. Selection and encodings are the shared host+device
// functions, so the result equals the host nm_compress / nm_metadata_encode bit for bit.
#include <cstdint>
#include <limits>
#include <string>

#include "cuda/nm_format_device.hpp"
#include "dfss/format/nm_meta.hpp"
#include "dfss/format/nm_select.hpp"

namespace dfss::cuda {
namespace {

using i64 = std::int64_t;

// 256 threads per block: enough warps to hide global-memory latency of this memory-bound kernel
// while keeping many blocks resident per SM.
constexpr int kThreads = 256;
// Grid cap: the kernel is grid-stride, so more blocks than this only add scheduling overhead; 65535
// also stays within every architecture's grid limits.
constexpr i64 kMaxBlocks = 65535;

struct prune_args {
  const float* dense;
  i64 rows;
  i64 cols;
  i64 ld;
  int n;
  int m;
  float* values;
  std::int32_t* indices;
  std::uint16_t* words;  // null: no metadata
  meta_format format;
  int groups_per_unit;
  i64 units_per_row;
  i64 groups_per_row;
};

__global__ void __launch_bounds__(kThreads) nm_prune_rows_kernel(prune_args a) {
  const float pad = -__int_as_float(0x7f800000);  // -inf, the score of a padding position
  const i64 total = a.rows * a.units_per_row;
  const i64 stride = static_cast<i64>(gridDim.x) * blockDim.x;
  for (i64 u = static_cast<i64>(blockIdx.x) * blockDim.x + threadIdx.x; u < total; u += stride) {
    const i64 r = u / a.units_per_row;
    const i64 unit = u % a.units_per_row;
    const float* row = a.dense + r * a.ld;
    const i64 out_cols = a.groups_per_row * a.n;
    std::uint32_t word = 0;
    for (int q = 0; q < a.groups_per_unit; ++q) {
      const i64 g = unit * a.groups_per_unit + q;
      const i64 start = g * a.m;
      const i64 remaining = a.cols - start;
      const int count = remaining <= 0 ? 0 : (remaining >= a.m ? a.m : static_cast<int>(remaining));
      const float* s = count > 0 ? row + start : row;
      const std::uint32_t keep = nm_select_group(s, count, a.n, a.m);
      if (g < a.groups_per_row) {
        i64 o = r * out_cols + g * a.n;
        for (int p = 0; p < a.m; ++p) {
          if (((keep >> p) & 1u) == 0) continue;
          a.values[o] = p < count ? s[p] : pad;
          a.indices[o] = static_cast<std::int32_t>(start + p);
          ++o;
        }
      }
      word |= nm_meta_group_bits(a.format, q, keep);
    }
    if (a.words != nullptr) a.words[r * a.units_per_row + unit] = static_cast<std::uint16_t>(word);
  }
}

status invalid(const char* arg, const std::string& expected, const std::string& got) {
  return {status_code::invalid_argument, std::string("dfss::cuda::nm_prune_rows: argument '") +
                                             arg + "': expected " + expected + ", got " + got};
}

std::string pattern_text(pattern p) { return std::to_string(p.n) + ":" + std::to_string(p.m); }

}  // namespace

status nm_prune_rows(const float* dense, std::int64_t rows, std::int64_t cols, std::int64_t ld,
                     pattern p, float* values, std::int32_t* indices, std::uint16_t* meta_words,
                     meta_format format, cudaStream_t stream) {
  if (!(1 <= p.n && p.n <= p.m && p.m <= kMaxGroupSize)) {
    return invalid("pattern", "1 <= N <= M <= " + std::to_string(kMaxGroupSize), pattern_text(p));
  }
  if (rows < 0) return invalid("rows", ">= 0", std::to_string(rows));
  if (cols < 0) return invalid("cols", ">= 0", std::to_string(cols));
  const i64 max_cols = i64{std::numeric_limits<std::int32_t>::max()} - (p.m - 1);
  if (cols > max_cols) {
    return invalid("cols", "<= " + std::to_string(max_cols) + " (int32 key indices)",
                   std::to_string(cols));
  }
  if (ld < cols) return invalid("ld", ">= cols (" + std::to_string(cols) + ")", std::to_string(ld));
  if (rows != 0 && ld > std::numeric_limits<i64>::max() / rows) {
    return invalid("ld", "rows * ld to fit in int64", std::to_string(ld));
  }
  const bool with_meta = meta_words != nullptr;
  if (with_meta) {
    if (format != meta_format::sm80_16bit_2of4 && format != meta_format::sm80_16bit_1of2 &&
        format != meta_format::sm80_tf32_1of2) {
      return invalid("format", "sm80_16bit_2of4, sm80_16bit_1of2 or sm80_tf32_1of2",
                     std::to_string(static_cast<int>(format)));
    }
    if (p.n != nm_meta_keep_count(format) || p.m != nm_meta_group_size(format)) {
      return invalid("pattern",
                     std::to_string(nm_meta_keep_count(format)) + ":" +
                         std::to_string(nm_meta_group_size(format)) + " for the metadata format",
                     pattern_text(p));
    }
  }
  const i64 groups = (cols + p.m - 1) / p.m;
  if (rows == 0 || cols == 0) return status::success();
  if (dense == nullptr) return invalid("dense", "a non-null pointer", "nullptr");
  if (values == nullptr) return invalid("values", "a non-null pointer", "nullptr");
  if (indices == nullptr) return invalid("indices", "a non-null pointer", "nullptr");

  prune_args a{};
  a.dense = dense;
  a.rows = rows;
  a.cols = cols;
  a.ld = ld;
  a.n = p.n;
  a.m = p.m;
  a.values = values;
  a.indices = indices;
  a.words = meta_words;
  a.format = format;
  a.groups_per_row = groups;
  if (with_meta) {
    a.groups_per_unit = nm_meta_keys_per_word(format) / p.m;
    a.units_per_row = nm_meta_words_per_row(cols, format);
  } else {
    a.groups_per_unit = 1;
    a.units_per_row = groups;
  }
  const i64 total = rows * a.units_per_row;
  const i64 wanted = (total + kThreads - 1) / kThreads;
  const unsigned blocks = static_cast<unsigned>(wanted < kMaxBlocks ? wanted : kMaxBlocks);
  nm_prune_rows_kernel<<<blocks, kThreads, 0, stream>>>(a);
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) {
    return {status_code::cuda_error,
            std::string("dfss::cuda::nm_prune_rows: kernel launch failed: ") +
                cudaGetErrorName(err) + ": " + cudaGetErrorString(err)};
  }
  return status::success();
}

}  // namespace dfss::cuda
