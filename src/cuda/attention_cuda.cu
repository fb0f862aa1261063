// The CUDA backend's forward: argument checks and the two-kernel pipeline (see pipeline.cuh).
#include "cuda/attention_cuda.hpp"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <iterator>
#include <string>
#include <utility>

#include "cuda/pipeline.cuh"
#include "cuda/warp/softmax_fold.hpp"

namespace dfss::cuda {
namespace {

using i64 = std::int64_t;

// CUDA's limit on gridDim.y and gridDim.z: batch * heads is a grid dimension of every kernel.
constexpr i64 kMaxGridYZ = 65535;
// The kernels index keys in 32 bits (their masks compare int offsets): Lk < 2^31, less the 64-key
// padding of the intermediates. (At that length one row block's weights alone would be 256 GB.)
constexpr i64 kMaxKeys = 2147483647 - 64;

std::string pointer_reason(const char* name, const void* ptr) {
  if (ptr == nullptr) return "";
  cudaPointerAttributes attr{};
  const cudaError_t e = cudaPointerGetAttributes(&attr, ptr);
  if (e != cudaSuccess) {
    cudaGetLastError();  // clear the error so it does not leak into the caller's next CUDA call
    return std::string("the CUDA backend needs '") + name + "' in CUDA device memory, but the CUDA runtime " +
           "could not inspect the pointer: " + cudaGetErrorName(e) + ": " + cudaGetErrorString(e);
  }
  if (attr.type != cudaMemoryTypeDevice && attr.type != cudaMemoryTypeManaged) {
    return std::string("the CUDA backend needs '") + name +
           "' in CUDA device (or managed) memory, got a host pointer";
  }
  return "";
}

bool aligned(const void* p, std::uintptr_t bytes) { return reinterpret_cast<std::uintptr_t>(p) % bytes == 0; }

std::string view_reason(const char* name, const void* ptr, const i64 (&stride)[4], i64 align_elems,
                        std::uintptr_t align_bytes) {
  if (stride[3] != 1) {
    return std::string("the CUDA backend needs '") + name + "' contiguous along head_dim (stride[3] = 1), got " +
           std::to_string(stride[3]);
  }
  for (int d = 0; d < 3; ++d) {
    if (stride[d] % align_elems != 0) {
      return std::string("the CUDA backend needs the strides of '") + name + "' to be multiples of " +
             std::to_string(align_elems) + " elements (" + std::to_string(align_bytes) +
             "-byte vector access), got stride[" + std::to_string(d) + "] = " + std::to_string(stride[d]);
    }
  }
  if (!aligned(ptr, align_bytes)) {
    return std::string("the CUDA backend needs '") + name + "' aligned to " + std::to_string(align_bytes) +
           " bytes";
  }
  return "";
}

template <typename T>
cudaError_t launch_all(const pipeline_args& a, const attention_params& p, cudaStream_t s, const char*& step) {
  const bool two_of_four = p.pattern_n == 2;
  cudaError_t e = cudaSuccess;
  step = "SDDMM + N:M selection kernel";
  if (p.head_dim == 64) {
    e = two_of_four ? launch_sddmm_select<T, 64, warp::sp_pattern::p2of4>(a, s)
                    : launch_sddmm_select<T, 64, warp::sp_pattern::p1of2>(a, s);
  } else {
    e = two_of_four ? launch_sddmm_select<T, 128, warp::sp_pattern::p2of4>(a, s)
                    : launch_sddmm_select<T, 128, warp::sp_pattern::p1of2>(a, s);
  }
  if (e != cudaSuccess) return e;
  step = "SpMM (mma.sp) kernel";
  return p.head_dim == 64 ? launch_spmm<T, 64>(a, s) : launch_spmm<T, 128>(a, s);
}

status cuda_failure(const char* step, cudaError_t e) {
  return {status_code::cuda_error, std::string("dfss::attention_forward (cuda): ") + step + ": " +
                                       cudaGetErrorName(e) + ": " + cudaGetErrorString(e)};
}

}  // namespace

std::string forward_unsupported_reason(const attention_params& p) {
  if (p.input_type != dtype::f16 && p.input_type != dtype::bf16) {
    return std::string("the CUDA backend takes f16 and bf16 inputs, got ") + dtype_name(p.input_type) +
           " (tf32 for f32 inputs is not implemented yet)";
  }
  if (p.head_dim != 64 && p.head_dim != 128) {
    return "the CUDA backend has kernels for head_dim 64 and 128, got " + std::to_string(p.head_dim);
  }
  if (!((p.pattern_n == 2 && p.pattern_m == 4) || (p.pattern_n == 1 && p.pattern_m == 2))) {
    return "the CUDA backend runs the sparse tensor core patterns 1:2 and 2:4, got " +
           std::to_string(p.pattern_n) + ":" + std::to_string(p.pattern_m);
  }
  if (p.bias != nullptr) return "the CUDA backend does not take an additive bias yet";
  if (p.compressed_values != nullptr || p.compressed_meta != nullptr) {
    return "the CUDA backend does not write the compressed outputs";
  }
  if (p.seqlen_k > kMaxKeys) {
    return "the CUDA backend needs seqlen_k <= " + std::to_string(kMaxKeys) + " (32-bit key indices), got " +
           std::to_string(p.seqlen_k);
  }
  if (p.batch * p.heads > kMaxGridYZ) {
    return "the CUDA backend needs batch * heads <= 65535 (a CUDA grid dimension), got " +
           std::to_string(p.batch * p.heads);
  }
  std::string r = view_reason("q", p.q, p.q_stride, 8, 16);
  if (r.empty()) r = view_reason("k", p.k, p.k_stride, 8, 16);
  if (r.empty()) r = view_reason("v", p.v, p.v_stride, 8, 16);
  if (r.empty()) {
    // Outputs are written two elements at a time.
    r = p.o_type == dtype::f32 ? view_reason("out", p.o, p.o_stride, 2, 8) : view_reason("out", p.o, p.o_stride, 2, 4);
  }
  if (!r.empty()) return r;
  for (const auto& [name, ptr] : {std::pair<const char*, const void*>{"q", p.q}, {"k", p.k}, {"v", p.v},
                                  {"out", p.o}, {"lse", p.lse}, {"key_lengths", p.key_lengths}}) {
    r = pointer_reason(name, ptr);
    if (!r.empty()) return r;
  }
  return "";
}

std::string forward_kernel_name(const attention_params& p) {
  return std::string("cuda.three_stage_forward.") + dtype_name(p.input_type) + ".d" + std::to_string(p.head_dim) +
         (p.pattern_n == 2 ? ".2of4" : ".1of2");
}

status attention_forward(const attention_params& p, void* stream_ptr) {
  const cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  if (p.batch == 0 || p.heads == 0 || p.seqlen_q == 0) return status::success();
  pipeline_args a{};
  a.batch = p.batch;
  a.heads = p.heads;
  a.heads_kv = p.heads_kv;
  a.seqlen_q = p.seqlen_q;
  a.seqlen_k = p.seqlen_k;
  a.q = p.q;
  a.k = p.k;
  a.v = p.v;
  a.o = p.o;
  for (int d = 0; d < 3; ++d) {
    a.q_stride[d] = p.q_stride[d];
    a.k_stride[d] = p.k_stride[d];
    a.v_stride[d] = p.v_stride[d];
    a.o_stride[d] = p.o_stride[d];
    a.lse_stride[d] = p.lse_stride[d];
  }
  a.o_is_f32 = p.o_type == dtype::f32;
  a.lse = static_cast<float*>(p.lse);
  a.key_lengths = p.key_lengths;
  a.key_lengths_i32 = p.key_lengths_type == dtype::i32;
  a.key_lengths_stride = p.key_lengths_stride;
  a.causal = p.causal;
  a.scale_log2 = static_cast<float>(p.scale * 1.4426950408889634);
  // Lk = 0 still runs one (fully masked) key tile, so every row gets zeros and LSE -inf.
  a.layout = warp::intermediate_layout::make(p.seqlen_q, p.seqlen_k > 0 ? p.seqlen_k : 1);
  const i64 slices = p.batch * p.heads;
  // The intermediates, stream-ordered: compressed weights, metadata, tile and row maxima.
  struct buffer {
    void** ptr;
    std::size_t bytes;
    const char* what;
  };
  const buffer buffers[] = {
      {&a.values, static_cast<std::size_t>(slices * a.layout.value_elems()) * 2, "the compressed weights"},
      {reinterpret_cast<void**>(&a.meta), static_cast<std::size_t>(slices * a.layout.meta_words()) * 4, "the metadata"},
      {reinterpret_cast<void**>(&a.tile_max), static_cast<std::size_t>(slices * warp::fold_tile_max_elems(a.layout)) * 4,
       "the tile maxima"},
      {reinterpret_cast<void**>(&a.row_max), static_cast<std::size_t>(slices * a.layout.rows_padded) * 4, "the row maxima"},
  };
  std::size_t allocated = 0;
  cudaError_t e = cudaSuccess;
  const char* step = "";
  for (const buffer& x : buffers) {
    e = cudaMallocAsync(x.ptr, x.bytes, stream);
    if (e != cudaSuccess) {
      step = x.what;
      break;
    }
    ++allocated;
  }
  if (e == cudaSuccess) {
    e = p.input_type == dtype::bf16 ? launch_all<__nv_bfloat16>(a, p, stream, step)
                                    : launch_all<__half>(a, p, stream, step);
  }
  cudaError_t freed = cudaSuccess;
  for (std::size_t i = allocated; i-- > 0;) {
    const cudaError_t f = cudaFreeAsync(*buffers[i].ptr, stream);
    if (freed == cudaSuccess) freed = f;
  }
  if (allocated < std::size(buffers)) return cuda_failure((std::string("cudaMallocAsync of ") + step).c_str(), e);
  if (e != cudaSuccess) return cuda_failure(step, e);
  if (freed != cudaSuccess) return cuda_failure("cudaFreeAsync of the intermediates", freed);
  return status::success();
}

}  // namespace dfss::cuda
