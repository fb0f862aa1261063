// SpMM O = P V with sparse P on the sparse tensor cores: mma.sp::ordered_metadata m16n8k32 (16-bit
// inputs, f32 accumulators). P's compressed values are loaded with ldmatrix.x4 from the row-major
// intermediate (the compressed 16 x 16 tile's dense-A fragment is the sparse-A fragment), V with
// ldmatrix.x4.trans (32 keys x 8 columns per n8 tile), and each lane's metadata register straight
// from the reordered intermediate (one coalesced 128-byte load per warp, 32 rows x 32 keys): lane
// 4g + 2i + h holds the words of m16 tile i, key half h, read by the MMA of tile i with selector i.
//
// Tiles suit the head dim: every warp computes 32 rows x 64 columns (2 m16 x 8 n8 tiles), and the
// CTA's 4 warps are 4 x 1 over rows for D = 64 (128 x 64) and 2 x 2 for D = 128 (64 x 128), so no
// MMA ever works on columns past D (the original artifact ran a 128-wide tile at D = 64 and wasted
// half its tensor-core issue). Keys advance 64 at a time through a 2-stage cp.async pipeline. V rows
// of keys at or past the batch's valid length are zero-filled, so padding and masked keys add
// exactly 0 even when their V rows hold NaN or Inf.
#include "cuda/pipeline.cuh"
#include "cuda/ptx.cuh"
#include "cuda/warp/ldmatrix_addr.hpp"

namespace dfss::cuda {
namespace {

using i64 = std::int64_t;

constexpr int kThreads = 128;
// Keys per pipeline step: two m16n8k32 k steps, and the intermediate layout's key padding.
constexpr int kStepKeys = 64;
// Two stages: loads of step s + 1 overlap the MMAs of step s, within 48 KB of static shared memory
// for D = 128 (2 x (64 x 40 + 64 x 136) x 2 bytes = 45 KB).
constexpr int kStages = 2;
// Row padding of 8 elements (16 bytes): keeps the 8 row addresses of every ldmatrix in distinct
// bank groups (unpadded rows of 64 or 256 bytes would map to the same banks).
constexpr int kPad = 8;

template <int D>
struct spmm_tile {
  static constexpr int kWarpsN = D / 64;
  static constexpr int kWarpsM = 4 / kWarpsN;
  static constexpr int kRows = 32 * kWarpsM;  // 128 for D = 64, 64 for D = 128
  static_assert(D == 64 || D == 128, "SpMM tiles exist for D = 64 and 128");
};

template <typename T, int D>
__global__ void __launch_bounds__(kThreads) spmm_kernel(pipeline_args a) {
  using tile = spmm_tile<D>;
  constexpr int kCcols = kStepKeys / 2;
  __shared__ __align__(16) T ps[kStages][tile::kRows][kCcols + kPad];
  __shared__ __align__(16) T vs[kStages][kStepKeys][D + kPad];

  const int tid = static_cast<int>(threadIdx.x);
  const int lane = tid & 31;
  const int warp_id = tid >> 5;
  const int wm = warp_id / tile::kWarpsN;
  const int wn = warp_id % tile::kWarpsN;
  const i64 row0 = static_cast<i64>(blockIdx.x) * tile::kRows;
  const i64 bh = blockIdx.y;
  const i64 b = bh / a.heads;
  const i64 h = bh % a.heads;
  const i64 hkv = h / (a.heads / a.heads_kv);
  const i64 kv_len = kv_length(a, b);

  const T* pv = static_cast<const T*>(a.values) + bh * a.layout.value_elems();
  const std::uint32_t* meta = a.meta + bh * a.layout.meta_words();
  const T* v = static_cast<const T*>(a.v) + b * a.v_stride[0] + hkv * a.v_stride[2];
  // Keys past kv_len contribute nothing: the loop stops at the last step holding a valid key.
  const i64 steps = (kv_len + kStepKeys - 1) / kStepKeys;
  const i64 row_block = (row0 + 32 * wm) / 32;

  auto load_stage = [&](int stage, i64 step) {
    const i64 key0 = step * kStepKeys;
    constexpr int kPChunks = kCcols / 8;
    for (int c = tid; c < tile::kRows * kPChunks; c += kThreads) {
      const int r = c / kPChunks;
      const int col = (c % kPChunks) * 8;
      ptx::cp_async_16(&ps[stage][r][col], pv + a.layout.value_offset(row0 + r, key0 / 2 + col), true);
    }
    constexpr int kVChunks = D / 8;
    for (int c = tid; c < kStepKeys * kVChunks; c += kThreads) {
      const int r = c / kVChunks;
      const int col = (c % kVChunks) * 8;
      const bool ok = key0 + r < kv_len;
      ptx::cp_async_16(&vs[stage][r][col], ok ? v + (key0 + r) * a.v_stride[1] + col : v, ok);
    }
  };
  auto load_meta = [&](i64 step, std::uint32_t (&e)[2]) {
    e[0] = __ldg(meta + a.layout.meta_offset(row_block, 2 * step, lane));
    e[1] = __ldg(meta + a.layout.meta_offset(row_block, 2 * step + 1, lane));
  };

  float acc[2][8][4] = {};
  std::uint32_t e_cur[2] = {0x44444444u, 0x44444444u};
  if (steps > 0) {
    load_stage(0, 0);
    load_meta(0, e_cur);
  }
  ptx::cp_async_commit();
  for (i64 step = 0; step < steps; ++step) {
    const int stage = static_cast<int>(step & 1);
    std::uint32_t e_next[2] = {0x44444444u, 0x44444444u};
    if (step + 1 < steps) {
      load_stage(stage ^ 1, step + 1);
      load_meta(step + 1, e_next);
    }
    ptx::cp_async_commit();
    ptx::cp_async_wait<1>();
    __syncthreads();
    DFSS_UNROLL
    for (int ks = 0; ks < 2; ++ks) {
      std::uint32_t af[2][4];
      DFSS_UNROLL
      for (int i = 0; i < 2; ++i) {
        const warp::smem_coord at = warp::ldsm_a16_x4(lane);
        ptx::ldmatrix_x4(af[i], &ps[stage][32 * wm + 16 * i + at.row][16 * ks + at.col]);
      }
      DFSS_UNROLL
      for (int n = 0; n < 8; ++n) {
        std::uint32_t bf[4];
        const warp::smem_coord bt = warp::ldsm_spmm_b_x4_trans(lane);
        ptx::ldmatrix_x4_trans(bf, &vs[stage][32 * ks + bt.row][64 * wn + 8 * n + bt.col]);
        ptx::mma_sp_m16n8k32<T, 0>(acc[0][n], af[0], bf, e_cur[ks]);
        ptx::mma_sp_m16n8k32<T, 1>(acc[1][n], af[1], bf, e_cur[ks]);
      }
    }
    __syncthreads();
    e_cur[0] = e_next[0];
    e_cur[1] = e_next[1];
  }
  ptx::cp_async_wait<0>();

  // Epilogue: rows g and g + 8 of each m16 tile, columns 2t, 2t + 1 of each n8 tile.
  const int g = lane >> 2;
  const int t = lane & 3;
  DFSS_UNROLL
  for (int i = 0; i < 2; ++i) {
    DFSS_UNROLL
    for (int rh = 0; rh < 2; ++rh) {
      const i64 row = row0 + 32 * wm + 16 * i + g + 8 * rh;
      if (row >= a.seqlen_q) continue;
      const i64 base = b * a.o_stride[0] + row * a.o_stride[1] + h * a.o_stride[2];
      DFSS_UNROLL
      for (int n = 0; n < 8; ++n) {
        const i64 col = 64 * wn + 8 * n + 2 * t;
        const float x0 = acc[i][n][2 * rh];
        const float x1 = acc[i][n][2 * rh + 1];
        if (a.o_is_f32) {
          *reinterpret_cast<float2*>(static_cast<float*>(a.o) + base + col) = make_float2(x0, x1);
        } else {
          *reinterpret_cast<std::uint32_t*>(static_cast<T*>(a.o) + base + col) = ptx::elem<T>::pack(x0, x1);
        }
      }
    }
  }
}

}  // namespace

template <typename T, int D>
cudaError_t launch_spmm(const pipeline_args& a, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(a.layout.rows_padded / spmm_tile<D>::kRows),
                  static_cast<unsigned>(a.batch * a.heads));
  spmm_kernel<T, D><<<grid, kThreads, 0, stream>>>(a);
  return cudaGetLastError();
}

template cudaError_t launch_spmm<__half, 64>(const pipeline_args&, cudaStream_t);
template cudaError_t launch_spmm<__half, 128>(const pipeline_args&, cudaStream_t);
template cudaError_t launch_spmm<__nv_bfloat16, 64>(const pipeline_args&, cudaStream_t);
template cudaError_t launch_spmm<__nv_bfloat16, 128>(const pipeline_args&, cudaStream_t);

}  // namespace dfss::cuda
