// SDDMM with fused N:M selection and the first half of the softmax (src/cuda/warp/softmax_fold.hpp):
// S = Q K^T on the tensor cores (dense mma.sync m16n8k16, f32 accumulators), masks on the
// accumulators, N:M selection in registers, and per 32 x 32 unit the kept weights exp2((s - m_t) *
// scale log2 e) stored as T in the SpMM's fragment order, the metadata, and each row's unit
// maximum m_t; each row's maximum M over its units at the end.
//
// CTA: 128 query rows, 4 warps of 32 rows each. A warp's Q fragments stay in registers for the
// whole key loop (loaded once from global memory), so a key step costs only the K fragments, the
// MMAs and the epilogue. Keys advance 64 at a time (two units per warp) through a 2-stage cp.async
// pipeline shared by the 4 warps; K rows are stored in accumulator-column order
// (sddmm16_smem_row_of_key). The loop stops at the last key any row of the CTA sees (causal limit,
// key length: tile skipping), and runs in two parts: the steps that every row of the CTA sees whole
// (no mask code at all) and the boundary steps (each row's visible end, one 32-bit compare per score).
#include "cuda/pipeline.cuh"
#include "cuda/ptx.cuh"
#include "cuda/warp/device_warp.cuh"
#include "cuda/warp/ldmatrix_addr.hpp"
#include "cuda/warp/sddmm_epilogue.hpp"
#include "cuda/warp/softmax_fold.hpp"
#include "dfss/mask/visibility.hpp"

namespace dfss::cuda {
namespace {

using i64 = std::int64_t;

// 4 warps of 32 rows: each K step is read from shared memory by 4 warps, and the CTA's 128 rows match
// the intermediate layout's row padding (kIntermediateRowAlign), so no row of a CTA is out of range
// of the intermediates.
constexpr int kThreads = 128;
constexpr int kTileRows = 128;
// CTAs per SM to plan registers for: for d = 64, 3 (at most 170 registers; left to itself ptxas
// squeezes the 2:4 kernel into 128 with a spill, for 4 CTAs); for d = 128, 2 (at most 255: its 64
// registers of Q fragments and two units in flight need about 250).
template <int D>
constexpr int kMinCtasPerSm = D == 64 ? 3 : 2;
// Keys per pipeline step: two 32-key units per warp, and the intermediate layout's key padding (64),
// so a step never reaches past a slice.
constexpr int kStepKeys = 64;
// Two stages: the copy of step s + 1 overlaps the MMAs of step s, within 48 KB of static shared
// memory for D = 128 (2 x 64 x 136 x 2 bytes = 34 KB).
constexpr int kStages = 2;
// Shared-memory row padding of 8 elements (16 bytes): rows of D = 64 or 128 halves would otherwise
// start in the same bank and serialise every ldmatrix 8 ways.
constexpr int kPad = 8;

// Everything a warp keeps across the key loop.
struct warp_rows {
  std::uint32_t qf[2][8][4];  // Q fragments: m16 tile i, k step kk / 16 (D <= 128), registers
  int end[2][2];              // visible end of row 16 i + 8 rh + g (keys < 2^31: attention_cuda.cu)
  float run_max[2][2];        // M so far
};

// @p unit_smem: shared-memory address of the unit's first K row; @p b_off[jp]: the lane's ldmatrix
// offset (bytes) for n8 tiles 2 jp, 2 jp + 1 at head-dim column 0 (ldsm_sddmm16_b_x4). The unit's
// scores, masked (boundary steps) and pruned: the lane's kept values, and its metadata word
// assembled at once (so no comparison result stays live until the stores).
template <typename T, int D, warp::sp_pattern P, bool Masked>
__device__ __forceinline__ warp::unit16_selection<float> sddmm_unit_select(std::uint32_t unit_smem,
                                                                           const std::uint32_t (&b_off)[2], int lane,
                                                                           const warp_rows& w, int ukey0,
                                                                           std::uint32_t& meta_word) {
  float acc[2][4][4] = {};
  DFSS_UNROLL
  for (int kk = 0; kk < D; kk += 16) {
    DFSS_UNROLL
    for (int jp = 0; jp < 2; ++jp) {
      std::uint32_t bf[4];
      ptx::ldmatrix_x4(bf, unit_smem + b_off[jp] + kk * static_cast<std::uint32_t>(sizeof(T)));
      DFSS_UNROLL
      for (int i = 0; i < 2; ++i) {
        ptx::mma_m16n8k16<T>(acc[i][2 * jp], w.qf[i][kk / 16], bf[0], bf[1]);
        ptx::mma_m16n8k16<T>(acc[i][2 * jp + 1], w.qf[i][kk / 16], bf[2], bf[3]);
      }
    }
  }
  if constexpr (Masked) {
    int end[2][2];
    DFSS_UNROLL
    for (int i = 0; i < 2; ++i) {
      DFSS_UNROLL
      for (int rh = 0; rh < 2; ++rh) end[i][rh] = warp::unit_relative_end(w.end[i][rh], ukey0);
    }
    warp::mask_unit16_relative(acc, lane, end);
  }
  const warp::unit16_selection<float> sel = warp::select_unit16_no_nan(acc, lane, P);
  meta_word = warp::meta_quad_exchange<warp::device_warp>(sel.meta_bits[0][0], sel.meta_bits[0][1],
                                                          sel.meta_bits[1][0], sel.meta_bits[1][1]);
  return sel;
}

// A unit's stored weights exp2((s - ref) scale log2 e), in fragment order.
template <typename T>
__device__ __forceinline__ void sddmm_unit_store(const warp::unit16_selection<float>& sel, const float (&ref)[2][2],
                                                 float scale_log2, T* values) {
  // Element e = 4 h + 2 rh + slot of the fragment is row half rh: registers 0, 2 row g, 1, 3 row g + 8.
  DFSS_UNROLL
  for (int i = 0; i < 2; ++i) {
    std::uint32_t r[4];
    DFSS_UNROLL
    for (int q = 0; q < 4; ++q) {
      const float x = ref[i][q & 1];
      r[q] = ptx::elem<T>::pack(warp::fold_weight(sel.a[i][2 * q], x, scale_log2),
                                warp::fold_weight(sel.a[i][2 * q + 1], x, scale_log2));
    }
    *reinterpret_cast<uint4*>(values + i * 32 * 8) = make_uint4(r[0], r[1], r[2], r[3]);
  }
}

template <typename T, int D, warp::sp_pattern P>
__global__ void __launch_bounds__(kThreads, kMinCtasPerSm<D>) sddmm_select_kernel(pipeline_args a) {
  static_assert(D % 16 == 0 && D <= 128, "head dim: a multiple of the mma k step, at most 128");
  __shared__ __align__(16) T ks[kStages][kStepKeys][D + kPad];

  const int tid = static_cast<int>(threadIdx.x);
  const int lane = tid & 31;
  const int warp_id = tid >> 5;
  const i64 row0 = static_cast<i64>(blockIdx.x) * kTileRows;
  const i64 bh = blockIdx.y;
  const i64 b = bh / a.heads;
  const i64 h = bh % a.heads;
  const i64 hkv = h / (a.heads / a.heads_kv);
  const i64 kv_len = kv_length(a, b);

  // Keys of the loop: up to the end of the CTA's last real row, whole steps (tile skipping); the
  // first `full` keys are seen whole by every row of the CTA (its first row's end).
  const i64 last_row = row0 + kTileRows - 1 < a.seqlen_q ? row0 + kTileRows - 1 : a.seqlen_q - 1;
  const i64 key_end = mask::visible_end(a.causal, a.seqlen_q, a.seqlen_k, kv_len, last_row);
  // Steps and keys fit 32 bits (Lk < 2^31: attention_cuda.cu), so the loop's bookkeeping is 32-bit.
  const int steps = static_cast<int>((key_end + kStepKeys - 1) / kStepKeys);
  const int full_steps = static_cast<int>(mask::visible_end(a.causal, a.seqlen_q, a.seqlen_k, kv_len, row0) / kStepKeys);

  // The warp's rows: Q fragments straight from global memory (rows past Lq are zero), visible ends.
  const i64 wrow0 = row0 + 32 * warp_id;
  const T* q = static_cast<const T*>(a.q) + b * a.q_stride[0] + h * a.q_stride[2];
  warp_rows w;
  DFSS_UNROLL
  for (int i = 0; i < 2; ++i) {
    DFSS_UNROLL
    for (int kk = 0; kk < D; kk += 16) {
      DFSS_UNROLL
      for (int reg = 0; reg < 4; ++reg) {
        const warp::frag_coord c = warp::mma_a16_coord(lane, 2 * reg);
        const i64 row = wrow0 + 16 * i + c.row;
        w.qf[i][kk / 16][reg] =
            row < a.seqlen_q ? *reinterpret_cast<const std::uint32_t*>(q + row * a.q_stride[1] + kk + c.col) : 0u;
      }
    }
    DFSS_UNROLL
    for (int rh = 0; rh < 2; ++rh) {
      w.end[i][rh] = static_cast<int>(
          mask::visible_end(a.causal, a.seqlen_q, a.seqlen_k, kv_len, wrow0 + 16 * i + 8 * rh + (lane >> 2)));
      w.run_max[i][rh] = warp::neg_inf_f32();
    }
  }

  // The copy: each thread moves the same 16-byte chunks of every step (rows r0 + kPassRows it,
  // column col), into rows permuted within each unit (sddmm16_smem_row_of_key); keys past Lk are
  // zero-filled. Shared addresses are computed once; each step advances one global address
  // (integer arithmetic: a chunk past Lk forms an address that is never read).
  constexpr int kChunks = D / 8;
  constexpr int kPassRows = kThreads / kChunks;
  constexpr int kCopies = kStepKeys / kPassRows;
  static_assert(kThreads % kChunks == 0 && kStepKeys % kPassRows == 0, "the step divides evenly over the threads");
  constexpr std::uint32_t kStageBytes = sizeof(ks[0]);
  static_assert(kPassRows >= 8 && (kPassRows & (kPassRows - 1)) == 0,
                "chunk rows r0 + kPassRows it with r0 < kPassRows have disjoint bits: the permuted row is a sum");
  const int r0 = tid / kChunks;
  const int col = (tid % kChunks) * 8;
  // Chunk it's row: a base per thread plus a constant once `it` is unrolled (sddmm16_copy_row_*), so
  // one register holds every chunk's address and each chunk adds an immediate.
  const std::uint32_t dst0 = ptx::smem_addr(&ks[0][warp::sddmm16_copy_row_base(r0)][col]);
  const auto dst_off = [](int it) {
    return static_cast<std::uint32_t>(warp::sddmm16_copy_row_offset(kPassRows, it) * (D + kPad) * sizeof(T));
  };
  const T* k = static_cast<const T*>(a.k) + b * a.k_stride[0] + hkv * a.k_stride[2];
  // The next step's global address and how many of this thread's chunk rows exist from there.
  std::uint64_t src = reinterpret_cast<std::uint64_t>(k) + static_cast<std::uint64_t>(r0 * a.k_stride[1] + col) * sizeof(T);
  int left = static_cast<int>(a.seqlen_k) - r0;
  const std::uint64_t step_bytes = static_cast<std::uint64_t>(kStepKeys * a.k_stride[1]) * sizeof(T);
  const std::uint64_t pass_bytes = static_cast<std::uint64_t>(kPassRows * a.k_stride[1]) * sizeof(T);
  auto load_next = [&](std::uint32_t stage_off) {
    const int rows = left < kStepKeys ? left : kStepKeys;
    DFSS_UNROLL
    for (int it = 0; it < kCopies; ++it) {
      ptx::cp_async_16(dst0 + stage_off + dst_off(it), src + it * pass_bytes, kPassRows * it < rows);
    }
    src += step_bytes;
    left -= kStepKeys;
  };
  // The lane's ldmatrix offsets within a unit, and the stages' addresses.
  std::uint32_t b_off[2];
  DFSS_UNROLL
  for (int jp = 0; jp < 2; ++jp) {
    const warp::smem_coord at = warp::ldsm_sddmm16_b_x4(lane, jp);
    b_off[jp] = static_cast<std::uint32_t>((at.row * (D + kPad) + at.col) * sizeof(T));
  }
  const std::uint32_t ks_smem = ptx::smem_addr(&ks[0][0][0]);
  constexpr std::uint32_t kUnitBytes = 32 * (D + kPad) * sizeof(T);

  // Output pointers of the warp's first unit; every unit advances them by constant strides.
  const i64 row_block = wrow0 / 32;
  T* values = static_cast<T*>(a.values) + bh * a.layout.value_elems() +
              warp::fold_value_offset(a.layout, row_block, 0, 0, lane);
  std::uint32_t* meta = a.meta + bh * a.layout.meta_words() + a.layout.meta_offset(row_block, 0, lane);
  float* tile_max = a.tile_max + bh * warp::fold_tile_max_elems(a.layout) +
                    warp::fold_tile_max_offset(a.layout, row_block, 0, warp::fold_lane_row(lane));
  constexpr i64 kValueStride = 2 * 32 * 8;  // elements per unit (fold_value_offset)
  const i64 meta_stride = a.layout.rows_padded;

  // Byte offset of step s's stage (s & 1), toggled once per step.
  std::uint32_t stage_off = 0;
  if (steps > 0) load_next(stage_off);
  ptx::cp_async_commit();
  auto run = [&](auto masked, int s_begin, int s_end) {
    for (int s = s_begin; s < s_end; ++s) {
      if (s + 1 < steps) load_next(stage_off ^ kStageBytes);
      ptx::cp_async_commit();
      ptx::cp_async_wait<1>();
      __syncthreads();
      // Both units of a step in one body: ptxas interleaves their epilogues and keeps the lane's
      // offsets in registers (d = 64: 391 -> 332 SASS per tile for 2:4, 310 -> 252 for 1:2 at about
      // 160 registers; d = 128: about 210 registers, still the 2 CTAs per SM of the rolled loop;
      // rolled, d = 64 2:4 measured 411 per tile against 310 unrolled).
      warp::unit16_selection<float> sel[2];
      DFSS_UNROLL
      for (int u = 0; u < 2; ++u) {
        std::uint32_t word;
        sel[u] = sddmm_unit_select<T, D, P, decltype(masked)::value>(
            ks_smem + stage_off + static_cast<std::uint32_t>(u) * kUnitBytes, b_off, lane, w, s * kStepKeys + 32 * u,
            word);
        meta[u * meta_stride] = word;
      }
      // The step's row maxima m_s from the kept values of both units, over the quad (NaN-propagating),
      // then the references the weights are taken against: one reduction per 64 keys.
      float m[2][2];
      warp::step_lane_row_max(sel[0], sel[1], m);
      float ref[2][2];
      DFSS_UNROLL
      for (int i = 0; i < 2; ++i) {
        DFSS_UNROLL
        for (int rh = 0; rh < 2; ++rh) {
          m[i][rh] = warp::max_nan(m[i][rh], __shfl_xor_sync(0xffffffffu, m[i][rh], 1));
          m[i][rh] = warp::max_nan(m[i][rh], __shfl_xor_sync(0xffffffffu, m[i][rh], 2));
          w.run_max[i][rh] = warp::max_nan(w.run_max[i][rh], m[i][rh]);
          ref[i][rh] = warp::fold_reference(m[i][rh]);
        }
      }
      DFSS_UNROLL
      for (int u = 0; u < 2; ++u) sddmm_unit_store<T>(sel[u], ref, a.scale_log2, values + u * kValueStride);
      // Lane 4 g + 2 i + rh stores the maximum of row 16 i + 8 rh + g (fold_lane_row).
      const bool t_odd = (lane & 1) != 0;
      const float m0 = t_odd ? m[0][1] : m[0][0];
      const float m1 = t_odd ? m[1][1] : m[1][0];
      *tile_max = (lane & 2) != 0 ? m1 : m0;
      values += 2 * kValueStride;
      meta += 2 * meta_stride;
      tile_max += 32;
      stage_off ^= kStageBytes;
      __syncthreads();
    }
  };
  const int split = full_steps < steps ? full_steps : steps;
  run(std::false_type{}, 0, split);
  run(std::true_type{}, split, steps);
  ptx::cp_async_wait<0>();

  const int t = lane & 3;
  a.row_max[bh * a.layout.rows_padded + wrow0 + warp::fold_lane_row(lane)] =
      t == 0 ? w.run_max[0][0] : (t == 1 ? w.run_max[0][1] : (t == 2 ? w.run_max[1][0] : w.run_max[1][1]));
}

}  // namespace

template <typename T, int D, warp::sp_pattern P>
cudaError_t launch_sddmm_select(const pipeline_args& a, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(a.layout.rows_padded / kTileRows), static_cast<unsigned>(a.batch * a.heads));
  sddmm_select_kernel<T, D, P><<<grid, kThreads, 0, stream>>>(a);
  return cudaGetLastError();
}

#define DFSS_INSTANTIATE(T, D, P) \
  template cudaError_t launch_sddmm_select<T, D, P>(const pipeline_args&, cudaStream_t);
DFSS_INSTANTIATE(__half, 64, warp::sp_pattern::p2of4)
DFSS_INSTANTIATE(__half, 64, warp::sp_pattern::p1of2)
DFSS_INSTANTIATE(__half, 128, warp::sp_pattern::p2of4)
DFSS_INSTANTIATE(__half, 128, warp::sp_pattern::p1of2)
DFSS_INSTANTIATE(__nv_bfloat16, 64, warp::sp_pattern::p2of4)
DFSS_INSTANTIATE(__nv_bfloat16, 64, warp::sp_pattern::p1of2)
DFSS_INSTANTIATE(__nv_bfloat16, 128, warp::sp_pattern::p2of4)
DFSS_INSTANTIATE(__nv_bfloat16, 128, warp::sp_pattern::p1of2)
#undef DFSS_INSTANTIATE

}  // namespace dfss::cuda
