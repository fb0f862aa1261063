// SDDMM with fused N:M selection: S = Q K^T on the tensor cores (dense mma.sync m16n8k16, f32
// accumulators), masks folded into the accumulators, N:M selection in registers on the f32 scores
// (src/cuda/warp/, simulated on the CPU by tests/unit/test_cuda_warp.cpp), and the kept scores
// (times scale * log2 e, rounded to T) and the mma.sp metadata written straight in the layout the
// SpMM's ldmatrix / mma.sp consume (warp::intermediate_layout).
//
// CTA tile: 64 query rows x 64 keys, 4 warps, each one unit of 32 rows x 32 keys. Q and K tiles
// are loaded whole (all of D) with cp.async, zero-filled past Lq / Lk. The K rows are read through
// sddmm16_key_of_column, so each lane's accumulators are whole 4-key groups.
#include "cuda/pipeline.cuh"
#include "cuda/ptx.cuh"
#include "cuda/warp/device_warp.cuh"
#include "cuda/warp/ldmatrix_addr.hpp"
#include "cuda/warp/sddmm_epilogue.hpp"

namespace dfss::cuda {
namespace {

using i64 = std::int64_t;

// 4 warps: two row units x two key units of 32, so the 64 x 64 tile's Q and K rows are each read by
// two warps from shared memory while the CTA stays small enough for several to share an SM.
constexpr int kThreads = 128;
// The tile: a multiple of the 32 x 32 unit in both directions, and a divisor of the intermediate
// layout's row (128) and key (64) padding, so no tile needs bounds checks on the intermediates.
constexpr int kTileRows = 64;
constexpr int kTileKeys = 64;
// Shared-memory row padding of 8 elements (16 bytes): rows of D = 64 or 128 halves would otherwise
// start in the same bank and serialise every ldmatrix 8 ways.
constexpr int kPad = 8;

template <typename T, int D, warp::sp_pattern P>
__global__ void __launch_bounds__(kThreads) sddmm_select_kernel(pipeline_args a) {
  static_assert(D % 16 == 0, "head dim must be a multiple of the mma k step");
  __shared__ __align__(16) T qs[kTileRows][D + kPad];
  __shared__ __align__(16) T ks[kTileKeys][D + kPad];

  const int tid = static_cast<int>(threadIdx.x);
  const int lane = tid & 31;
  const int warp_id = tid >> 5;
  const i64 key0 = static_cast<i64>(blockIdx.x) * kTileKeys;
  const i64 row0 = static_cast<i64>(blockIdx.y) * kTileRows;
  const i64 bh = blockIdx.z;
  const i64 b = bh / a.heads;
  const i64 h = bh % a.heads;
  const i64 hkv = h / (a.heads / a.heads_kv);

  const T* q = static_cast<const T*>(a.q) + b * a.q_stride[0] + h * a.q_stride[2];
  const T* k = static_cast<const T*>(a.k) + b * a.k_stride[0] + hkv * a.k_stride[2];
  constexpr int kChunks = D / 8;  // 16-byte chunks per row
  // Rows of the tile that exist (the rest are zero-filled), as 32-bit counts: the copy loops below
  // then need no 64-bit compares. Both loops have a trip count known at compile time (the tile
  // divides evenly over the threads), so they unroll without branches.
  static_assert(kTileRows * kChunks % kThreads == 0 && kTileKeys * kChunks % kThreads == 0);
  const i64 q_left = a.seqlen_q - row0, k_left = a.seqlen_k - key0;
  const int q_rows = q_left < kTileRows ? static_cast<int>(q_left) : kTileRows;
  const int k_rows = k_left < kTileKeys ? static_cast<int>(k_left) : kTileKeys;
  // Rows past the end are never read (cp.async with zero source bytes), but they still name the
  // slice's first row, a valid address.
  const T* q_tile = q + row0 * a.q_stride[1];
  const T* k_tile = k + key0 * a.k_stride[1];
  DFSS_UNROLL
  for (int it = 0; it < kTileRows * kChunks / kThreads; ++it) {
    const int c = tid + it * kThreads;
    const int r = c / kChunks;
    const int col = (c % kChunks) * 8;
    const bool ok = r < q_rows;
    ptx::cp_async_16(&qs[r][col], ok ? q_tile + r * a.q_stride[1] + col : q, ok);
  }
  DFSS_UNROLL
  for (int it = 0; it < kTileKeys * kChunks / kThreads; ++it) {
    const int c = tid + it * kThreads;
    const int r = c / kChunks;
    const int col = (c % kChunks) * 8;
    const bool ok = r < k_rows;
    ptx::cp_async_16(&ks[r][col], ok ? k_tile + r * a.k_stride[1] + col : k, ok);
  }
  ptx::cp_async_commit();
  ptx::cp_async_wait<0>();
  __syncthreads();

  const int wr = warp_id >> 1;  // row unit
  const int wk = warp_id & 1;   // key unit
  float acc[2][4][4] = {};
  DFSS_UNROLL
  for (int kk = 0; kk < D; kk += 16) {
    std::uint32_t af[2][4];
    DFSS_UNROLL
    for (int i = 0; i < 2; ++i) {
      const warp::smem_coord at = warp::ldsm_a16_x4(lane);
      ptx::ldmatrix_x4(af[i], &qs[32 * wr + 16 * i + at.row][kk + at.col]);
    }
    DFSS_UNROLL
    for (int jp = 0; jp < 2; ++jp) {
      // Matrix m = lane / 8: n8 tile 2 jp + m / 2, k half m % 2, keys permuted (ldmatrix_addr.hpp).
      const warp::smem_coord at = warp::ldsm_sddmm16_b_x4(lane, jp);
      std::uint32_t bf[4];
      ptx::ldmatrix_x4(bf, &ks[32 * wk + at.row][kk + at.col]);
      DFSS_UNROLL
      for (int i = 0; i < 2; ++i) {
        ptx::mma_m16n8k16<T>(acc[i][2 * jp], af[i], bf[0], bf[1]);
        ptx::mma_m16n8k16<T>(acc[i][2 * jp + 1], af[i], bf[2], bf[3]);
      }
    }
  }

  // Epilogue: masks, selection, stores.
  const i64 urow0 = row0 + 32 * wr;
  const i64 ukey0 = key0 + 32 * wk;
  const warp::score_mask mask{a.seqlen_q, a.seqlen_k, kv_length(a, b), a.causal};
  warp::apply_unit16_mask(acc, lane, urow0, ukey0, mask);
  const warp::unit16_selection<float> sel = warp::select_unit16(acc, lane, P);
  // The lane's stores are at fixed offsets from its first one: rows 16 i (+ 8 for e >= 2) and
  // compressed columns + 8 (e >= 4), so one 64-bit address and constant offsets.
  const std::int64_t ld = a.layout.keys_padded / 2;
  const warp::unit16_store st0 = warp::unit16_value_store(lane, 0, 0, urow0, ukey0);
  T* values = static_cast<T*>(a.values) + bh * a.layout.value_elems() + a.layout.value_offset(st0.row, st0.ccol);
  DFSS_UNROLL
  for (int i = 0; i < 2; ++i) {
    DFSS_UNROLL
    for (int e = 0; e < 8; e += 2) {
      const warp::unit16_store st = warp::unit16_value_store(lane, i, e, 0, 0);
      const warp::unit16_store base = warp::unit16_value_store(lane, 0, 0, 0, 0);
      *reinterpret_cast<std::uint32_t*>(values + (st.row - base.row) * ld + (st.ccol - base.ccol)) =
          ptx::elem<T>::pack(sel.a[i][e] * a.scale_log2, sel.a[i][e + 1] * a.scale_log2);
    }
  }
  const std::uint32_t word = warp::meta_quad_exchange<warp::device_warp>(
      sel.meta_bits[0][0], sel.meta_bits[0][1], sel.meta_bits[1][0], sel.meta_bits[1][1]);
  a.meta[bh * a.layout.meta_words() + a.layout.meta_offset(urow0 / 32, ukey0 / 32, lane)] = word;
}

}  // namespace

template <typename T, int D, warp::sp_pattern P>
cudaError_t launch_sddmm_select(const pipeline_args& a, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(a.layout.keys_padded / kTileKeys),
                  static_cast<unsigned>(a.layout.rows_padded / kTileRows),
                  static_cast<unsigned>(a.batch * a.heads));
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
