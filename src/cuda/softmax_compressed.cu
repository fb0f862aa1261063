// Softmax over compressed rows: the SDDMM left, in every row, exactly the kept scores (times
// scale * log2 e; -inf where masked or padding), so the softmax over the kept entries is a plain
// softmax over the compressed row (the original artifact's observation). One warp per row,
// 16-byte vectors, two passes (the second re-reads the row from L2): an online max / sum, then
// P = exp2(t - max) / sum written in place as T, and LSE = ln 2 (max + log2 sum).
//
// Special rows (docs/semantics.md): a row with no finite kept score writes zeros and LSE -inf; a
// NaN kept score makes the whole row NaN (as dense softmax would), LSE NaN.
#include <cmath>

#include "cuda/pipeline.cuh"
#include "cuda/ptx.cuh"

namespace dfss::cuda {
namespace {

using i64 = std::int64_t;

// 4 rows (warps) per CTA: rows are independent, and small CTAs spread short problems over all SMs.
constexpr int kThreads = 128;
constexpr int kRowsPerCta = kThreads / 32;
// Elements per lane per vector: one 16-byte load of 16-bit values.
constexpr int kVec = 8;

struct online_sum {
  float m;  // running max (-inf: nothing finite yet)
  float s;  // sum of exp2(x - m)
};

__device__ __forceinline__ online_sum combine(online_sum x, online_sum y) {
  const float m = fmaxf(x.m, y.m);
  if (m == -INFINITY) return {m, 0.0f};
  return {m, x.s * exp2f(x.m - m) + y.s * exp2f(y.m - m)};
}

template <typename T>
__global__ void __launch_bounds__(kThreads) softmax_compressed_kernel(pipeline_args a) {
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const i64 row = static_cast<i64>(blockIdx.x) * kRowsPerCta + (threadIdx.x >> 5);
  const i64 bh = blockIdx.y;
  if (row >= a.seqlen_q) return;  // warp-uniform: the whole warp shares the row
  const i64 cols = a.layout.keys_padded / 2;
  T* p = static_cast<T*>(a.values) + bh * a.layout.value_elems() + a.layout.value_offset(row, 0);

  online_sum acc{-INFINITY, 0.0f};
  bool nan = false;
  for (i64 c = static_cast<i64>(lane) * kVec; c < cols; c += 32 * kVec) {
    const uint4 raw = *reinterpret_cast<const uint4*>(p + c);
    const std::uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const float2 f = ptx::elem<T>::unpack(w[u]);
      nan = nan || f.x != f.x || f.y != f.y;
      acc = combine(acc, {f.x, f.x == -INFINITY ? 0.0f : 1.0f});
      acc = combine(acc, {f.y, f.y == -INFINITY ? 0.0f : 1.0f});
    }
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    const online_sum other{__shfl_xor_sync(0xffffffffu, acc.m, off), __shfl_xor_sync(0xffffffffu, acc.s, off)};
    acc = combine(acc, other);
  }
  nan = __any_sync(0xffffffffu, nan);
  const bool empty = !nan && acc.s == 0.0f;
  const float inv = nan ? NAN : (empty ? 0.0f : 1.0f / acc.s);
  const float m = empty ? 0.0f : acc.m;
  for (i64 c = static_cast<i64>(lane) * kVec; c < cols; c += 32 * kVec) {
    uint4 raw = *reinterpret_cast<const uint4*>(p + c);
    std::uint32_t* w = reinterpret_cast<std::uint32_t*>(&raw);
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const float2 f = ptx::elem<T>::unpack(w[u]);
      w[u] = ptx::elem<T>::pack(exp2f(f.x - m) * inv, exp2f(f.y - m) * inv);
    }
    *reinterpret_cast<uint4*>(p + c) = raw;
  }
  if (a.lse != nullptr && lane == 0) {
    const i64 b = bh / a.heads;
    const i64 h = bh % a.heads;
    const float lse = nan ? NAN : (empty ? -INFINITY : 0.69314718055994531f * (acc.m + log2f(acc.s)));
    a.lse[b * a.lse_stride[0] + h * a.lse_stride[1] + row * a.lse_stride[2]] = lse;
  }
}

}  // namespace

template <typename T>
cudaError_t launch_softmax_compressed(const pipeline_args& a, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>((a.seqlen_q + kRowsPerCta - 1) / kRowsPerCta),
                  static_cast<unsigned>(a.batch * a.heads));
  softmax_compressed_kernel<T><<<grid, kThreads, 0, stream>>>(a);
  return cudaGetLastError();
}

template cudaError_t launch_softmax_compressed<__half>(const pipeline_args&, cudaStream_t);
template cudaError_t launch_softmax_compressed<__nv_bfloat16>(const pipeline_args&, cudaStream_t);

}  // namespace dfss::cuda
