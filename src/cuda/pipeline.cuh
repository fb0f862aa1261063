// src/cuda/pipeline.cuh: the arguments and launchers of the two-kernel DFSS pipeline (nvcc only):
// SDDMM with fused N:M selection and the first half of the softmax -> SpMM with mma.sp and the
// second half (src/cuda/warp/softmax_fold.hpp).
// Compile-time axes: element type T (__half, __nv_bfloat16), head dim D (64, 128) and, for the
// SDDMM, the pattern (1:2, 2:4). Everything else (sizes, strides, masks, scale) is a run-time value.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/warp/nm_warp_select.hpp"

namespace dfss::cuda {

/// Everything the three kernels read; every offset is 64-bit.
struct pipeline_args {
  std::int64_t batch, heads, heads_kv, seqlen_q, seqlen_k;
  const void* q;  ///< [B, Lq, H, D], element stride 1 along D
  std::int64_t q_stride[3];
  const void* k;  ///< [B, Lk, Hkv, D]
  std::int64_t k_stride[3];
  const void* v;  ///< [B, Lk, Hkv, D]
  std::int64_t v_stride[3];
  void* o;  ///< [B, Lq, H, D], f32 or T
  std::int64_t o_stride[3];
  bool o_is_f32;
  float* lse;  ///< optional [B, H, Lq]
  std::int64_t lse_stride[3];
  const void* key_lengths;  ///< optional [B], i32 or i64, on the device; clamped to [0, Lk]
  bool key_lengths_i32;
  std::int64_t key_lengths_stride;
  bool causal;
  /// softmax scale * log2(e): the SDDMM stores scores in this base-2 domain so the softmax uses exp2.
  float scale_log2;
  /// Intermediates, one slice per (batch, head) (layouts in softmax_fold.hpp): the kept weights
  /// (T), their metadata, each row's maximum per 32-key unit and over all units.
  void* values;
  std::uint32_t* meta;
  float* tile_max;
  float* row_max;
  warp::intermediate_layout layout;
};

/// Valid keys of batch @p b (all Lk without key_lengths).
__device__ __forceinline__ std::int64_t kv_length(const pipeline_args& a, std::int64_t b) {
  if (a.key_lengths == nullptr) return a.seqlen_k;
  const std::int64_t off = b * a.key_lengths_stride;
  const std::int64_t len = a.key_lengths_i32 ? static_cast<const std::int32_t*>(a.key_lengths)[off]
                                             : static_cast<const std::int64_t*>(a.key_lengths)[off];
  return len < 0 ? 0 : (len > a.seqlen_k ? a.seqlen_k : len);
}

/// Launchers: enqueue on @p stream, return the launch error (cudaGetLastError), never synchronise.
template <typename T, int D, warp::sp_pattern P>
cudaError_t launch_sddmm_select(const pipeline_args& a, cudaStream_t stream);
template <typename T, int D>
cudaError_t launch_spmm(const pipeline_args& a, cudaStream_t stream);

}  // namespace dfss::cuda
