// SpMM O = P V with sparse P on the sparse tensor cores (mma.sp::ordered_metadata m16n8k32, 16-bit
// inputs, f32 accumulators) and the second half of the softmax (src/cuda/warp/softmax_fold.hpp):
// each step's stored weights are scaled by the row's factor exp2((m_t - M) * scale log2 e) as they
// are loaded (one packed multiply per fragment register, one factor per row and 64-key step), one more mma.sp per m16 tile multiplies
// them by a column of ones, which gives each row's sum L of exactly the weights used, and the
// epilogue writes O = acc / L and LSE = ln 2 (M scale log2 e + log2 L).
//
// Every lane loads its sparse A fragments (16 bytes per m16 tile and unit, stored in fragment order
// by the SDDMM) and its metadata register straight from global memory one step ahead; V goes
// through a 2-stage cp.async pipeline into shared memory and ldmatrix.x4.trans. Tiles suit the
// head dim: every warp computes 32 rows x 64 columns (2 m16 x 8 n8 tiles), and the CTA's 4 warps
// are 4 x 1 over rows for D = 64 (128 x 64) and 2 x 2 for D = 128 (64 x 128), so no MMA works on
// columns past D. Keys advance 64 at a time (two units) up to the last key any row of the CTA sees
// (tile skipping); V rows of keys at or past the batch's valid length are zero-filled, so padding
// adds exactly 0 even when those V rows hold NaN or Inf.
#include "cuda/pipeline.cuh"
#include "cuda/ptx.cuh"
#include "cuda/warp/ldmatrix_addr.hpp"
#include "cuda/warp/sddmm_epilogue.hpp"
#include "cuda/warp/softmax_fold.hpp"
#include "dfss/mask/visibility.hpp"

namespace dfss::cuda {
namespace {

using i64 = std::int64_t;

constexpr int kThreads = 128;
// Keys per pipeline step: two m16n8k32 k steps (units), and the intermediate layout's key padding.
constexpr int kStepKeys = 64;
// Two stages: loads of step s + 1 overlap the MMAs of step s, within 48 KB of static shared memory
// for D = 128 (2 x 64 x 136 x 2 bytes = 35 KB).
constexpr int kStages = 2;
// Row padding of 8 elements (16 bytes): keeps the 8 row addresses of every ldmatrix in distinct
// bank groups (unpadded rows of 128 or 256 bytes would map to the same banks).
constexpr int kPad = 8;

template <int D>
struct spmm_tile {
  static constexpr int kWarpsN = D / 64;
  static constexpr int kWarpsM = 4 / kWarpsN;
  static constexpr int kRows = 32 * kWarpsM;  // 128 for D = 64, 64 for D = 128
  static_assert(D == 64 || D == 128, "SpMM tiles exist for D = 64 and 128");
};

// One unit's P operands of a lane: its fragments of the two m16 tiles and metadata register.
struct unit_operands {
  uint4 frag[2];
  std::uint32_t meta;
};

template <typename T>
__device__ __forceinline__ std::uint32_t mul2(std::uint32_t x, std::uint32_t f) {
  const auto r = __hmul2(*reinterpret_cast<const typename ptx::elem<T>::pair*>(&x),
                         *reinterpret_cast<const typename ptx::elem<T>::pair*>(&f));
  return *reinterpret_cast<const std::uint32_t*>(&r);
}

template <typename T, int D>
__global__ void __launch_bounds__(kThreads) spmm_kernel(pipeline_args a) {
  using tile = spmm_tile<D>;
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
  // The SDDMM wrote every unit up to the last key its 128-row CTA sees, which contains this CTA's
  // rows, so it covers these steps too (the end of a later row is never smaller).
  const i64 last_row = row0 + tile::kRows - 1 < a.seqlen_q ? row0 + tile::kRows - 1 : a.seqlen_q - 1;
  const i64 steps =
      (mask::visible_end(a.causal, a.seqlen_q, a.seqlen_k, kv_len, last_row) + kStepKeys - 1) / kStepKeys;

  const i64 wrow0 = row0 + 32 * wm;
  const i64 row_block = wrow0 / 32;
  const T* values = static_cast<const T*>(a.values) + bh * a.layout.value_elems() +
                    warp::fold_value_offset(a.layout, row_block, 0, 0, lane);
  const std::uint32_t* meta = a.meta + bh * a.layout.meta_words() + a.layout.meta_offset(row_block, 0, lane);
  const float* tile_max = a.tile_max + bh * warp::fold_tile_max_elems(a.layout) +
                          warp::fold_tile_max_offset(a.layout, row_block, 0, warp::fold_lane_row(lane));
  const float row_max = a.row_max[bh * a.layout.rows_padded + wrow0 + warp::fold_lane_row(lane)];
  const T* v = static_cast<const T*>(a.v) + b * a.v_stride[0] + hkv * a.v_stride[2];

  auto load_v = [&](int stage, i64 step) {
    const i64 key0 = step * kStepKeys;
    constexpr int kVChunks = D / 8;
    DFSS_UNROLL
    for (int it = 0; it < kStepKeys * kVChunks / kThreads; ++it) {
      const int c = tid + it * kThreads;
      const int r = c / kVChunks;
      const int col = (c % kVChunks) * 8;
      const bool ok = key0 + r < kv_len;
      ptx::cp_async_16(&vs[stage][r][col], ok ? v + (key0 + r) * a.v_stride[1] + col : v, ok);
    }
  };
  auto load_p = [&](i64 unit, unit_operands& o) {
    const T* f = values + unit * (2 * 32 * 8);
    o.frag[0] = __ldg(reinterpret_cast<const uint4*>(f));
    o.frag[1] = __ldg(reinterpret_cast<const uint4*>(f + 32 * 8));
    o.meta = __ldg(meta + unit * a.layout.rows_padded);
  };
  // The tile maximum of the lane's row (fold_lane_row) for a step.
  auto load_m = [&](i64 step) { return __ldg(tile_max + step * 32); };

  // The ones column: a B operand of 1.0 in every element sums each row's weights in the MMA.
  const std::uint32_t one2 = ptx::elem<T>::pack(1.0f, 1.0f);
  const std::uint32_t ones[4] = {one2, one2, one2, one2};
  float acc[2][8][4] = {};
  float sum[2][4] = {};
  unit_operands cur[2], next[2];
  float cur_m = 0.0f, next_m = 0.0f;
  if (steps > 0) {
    load_v(0, 0);
    load_p(0, cur[0]);
    load_p(1, cur[1]);
    cur_m = load_m(0);
  }
  ptx::cp_async_commit();
  for (i64 step = 0; step < steps; ++step) {
    const int stage = static_cast<int>(step & 1);
    if (step + 1 < steps) {
      load_v(stage ^ 1, step + 1);
      load_p(2 * step + 2, next[0]);
      load_p(2 * step + 3, next[1]);
      next_m = load_m(step + 1);
    }
    ptx::cp_async_commit();
    // The lane's factor is for row fold_lane_row(lane); lane 4 g + 2 i + rh of the quad has row
    // 16 i + 8 rh + g, so each lane gathers its 4 rows' factors from its quad, once per step.
    const std::uint32_t f_own = ptx::elem<T>::pack_same(warp::fold_factor(cur_m, row_max, a.scale_log2));
    std::uint32_t f[2][2];
    DFSS_UNROLL
    for (int i = 0; i < 2; ++i) {
      f[i][0] = __shfl_sync(0xffffffffu, f_own, (lane & ~3) | (2 * i));
      f[i][1] = __shfl_sync(0xffffffffu, f_own, (lane & ~3) | (2 * i + 1));
    }
    DFSS_UNROLL
    for (int u = 0; u < 2; ++u) {
      DFSS_UNROLL
      for (int i = 0; i < 2; ++i) {
        const std::uint32_t f0 = f[i][0];
        const std::uint32_t f1 = f[i][1];
        uint4& x = cur[u].frag[i];
        x.x = mul2<T>(x.x, f0);  // registers 0, 2: row g; 1, 3: row g + 8
        x.y = mul2<T>(x.y, f1);
        x.z = mul2<T>(x.z, f0);
        x.w = mul2<T>(x.w, f1);
      }
    }
    ptx::cp_async_wait<1>();
    __syncthreads();
    DFSS_UNROLL
    for (int u = 0; u < 2; ++u) {
      const std::uint32_t af0[4] = {cur[u].frag[0].x, cur[u].frag[0].y, cur[u].frag[0].z, cur[u].frag[0].w};
      const std::uint32_t af1[4] = {cur[u].frag[1].x, cur[u].frag[1].y, cur[u].frag[1].z, cur[u].frag[1].w};
      DFSS_UNROLL
      for (int n = 0; n < 8; ++n) {
        std::uint32_t bf[4];
        const warp::smem_coord bt = warp::ldsm_spmm_b_x4_trans(lane);
        ptx::ldmatrix_x4_trans(bf, &vs[stage][32 * u + bt.row][64 * wn + 8 * n + bt.col]);
        ptx::mma_sp_m16n8k32<T, 0>(acc[0][n], af0, bf, cur[u].meta);
        ptx::mma_sp_m16n8k32<T, 1>(acc[1][n], af1, bf, cur[u].meta);
      }
      ptx::mma_sp_m16n8k32<T, 0>(sum[0], af0, ones, cur[u].meta);
      ptx::mma_sp_m16n8k32<T, 1>(sum[1], af1, ones, cur[u].meta);
    }
    __syncthreads();
    cur[0] = next[0];
    cur[1] = next[1];
    cur_m = next_m;
  }
  ptx::cp_async_wait<0>();

  // Epilogue: rows g and g + 8 of each m16 tile, columns 2t, 2t + 1 of each n8 tile; every column
  // of `sum` holds the row's L. L = 0: no visible key (O = 0 even if a V row held NaN, LSE = -inf).
  const int g = lane >> 2;
  const int t = lane & 3;
  float m_row[2][2];  // M of row 16 i + 8 rh + g, held by lane 4 g + 2 i + rh
  DFSS_UNROLL
  for (int i = 0; i < 2; ++i) {
    DFSS_UNROLL
    for (int rh = 0; rh < 2; ++rh) m_row[i][rh] = __shfl_sync(0xffffffffu, row_max, (lane & ~3) | (2 * i + rh));
  }
  DFSS_UNROLL
  for (int i = 0; i < 2; ++i) {
    DFSS_UNROLL
    for (int rh = 0; rh < 2; ++rh) {
      const i64 row = wrow0 + 16 * i + g + 8 * rh;
      if (row >= a.seqlen_q) continue;
      const float l = sum[i][2 * rh];
      const bool empty = l == 0.0f;
      const float inv = 1.0f / l;
      const i64 base = b * a.o_stride[0] + row * a.o_stride[1] + h * a.o_stride[2];
      DFSS_UNROLL
      for (int n = 0; n < 8; ++n) {
        const i64 col = 64 * wn + 8 * n + 2 * t;
        const float x0 = empty ? 0.0f : acc[i][n][2 * rh] * inv;
        const float x1 = empty ? 0.0f : acc[i][n][2 * rh + 1] * inv;
        if (a.o_is_f32) {
          *reinterpret_cast<float2*>(static_cast<float*>(a.o) + base + col) = make_float2(x0, x1);
        } else {
          *reinterpret_cast<std::uint32_t*>(static_cast<T*>(a.o) + base + col) = ptx::elem<T>::pack(x0, x1);
        }
      }
      if (a.lse != nullptr && wn == 0 && t == 0) {
        // ln sum_j 2^(s_j c) = ln 2 (M c + log2 L), c = scale log2 e; NaN in M or L stays NaN.
        a.lse[b * a.lse_stride[0] + h * a.lse_stride[1] + row * a.lse_stride[2]] =
            empty ? warp::neg_inf_f32() : 0.69314718055994531f * (m_row[i][rh] * a.scale_log2 + log2f(l));
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
