// AVX2 + FMA fused DFSS forward (flash style), the fast twin of fused_forward_scalar.cpp.
//
// Work is split into tasks of kRowsPerTask query rows of one (batch, head). A thread packs the keys
// and values of the (batch, kv head) it works on once, in fp32 with the head dimension padded to a
// multiple of 8 (dp):
//   Kt: [ceil(Lk / 16)][dp][16]   16-key panels, transposed, for the Q K^T micro-kernel;
//   Vp: [Lk_pad + 1][dp]          value rows; rows >= Lk are zero (row Lk_pad is the "zero row").
// Extra memory is therefore O(threads x Lk x d): linear in the sequence length, never L x L.
//
// Per task and key tile of W keys (W a multiple of 16 and of M, at least 64):
//   1. S = Q K^T for the task's rows with a 4 x 16 register-blocked micro-kernel. Q is not pre-scaled:
//      unscaled scores of integer inputs are exact, so selections (ties included) match the reference
//      exactly; the scale enters the exp2 argument as scale (s - max) log2(e) instead, which stays
//      accurate for scores up to float max (docs/semantics.md, "Non-finite and extreme inputs").
//   2. Per row: bias, masks (-inf), the row's running maximum (the maximum of a group
//      is always kept, so the maximum over all scores is the maximum over the kept ones), then the
//      N:M selection, which also compacts the kept scores and their key indices: 1:2 and 2:4 by
//      in-register compares, blends and in-lane shuffles, any other N:M through nm_select_group.
//   3. exp2 of the compacted scores only (half the exponentials for 1:2 and 2:4), and
//      acc += p * V[index] over the kept keys only, with the accumulator row held in registers.
// A row with a NaN or +inf score (only possible with a bias or with non-finite or huge inputs,
// flagged per task while packing) is written as NaN.
// Dense (N = M) runs the same code with an identity selection, so the sparsity's own speedup is
// measured against an equally optimised dense kernel.
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include <cstdlib>
#include <new>
#include <type_traits>

#include "core/element_access.hpp"
#include "cpu/fused_common.hpp"
#include "cpu/fused_forward.hpp"
#include "dfss/format/nm_select.hpp"
#include "dfss/numeric.hpp"

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define DFSS_HAVE_AVX2_KERNEL 1
#include <immintrin.h>
#endif

namespace dfss::cpu {

#if DFSS_HAVE_AVX2_KERNEL
namespace {

/// The generic N:M selection, called out of line so that no AVX2 copy of the shared inline template
/// is emitted from this file.
[[gnu::noinline]] std::uint32_t select_group_generic(const float* s, int n, int m) {
  return nm_select_group<float>(s, m, n, m);
}

}  // namespace
}  // namespace dfss::cpu

// Everything below is compiled for AVX2 + FMA + F16C; it runs only after the selector's cpuid check.
// A target pragma placed after all includes (rather than -mavx2 on the file) keeps the inline
// functions of the headers above, which other files share, free of AVX2 instructions.
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

namespace dfss::cpu {
namespace {

using namespace fused;



/// 2^x for x <= 127 (a larger x would wrap the exponent field below): the forward's exponents
/// scale (s - max) log2(e) are <= 0 by construction, the backward clamps its own (exp2_clamped).
/// Below -125 the result flushes to 0: the true value is under 2.4e-38 while the row's largest term
/// is 1. A NaN stays NaN: MAXPS returns its second operand when one is NaN, so x goes second.
/// Degree-7 Taylor polynomial of 2^f on |f| <= 0.5: truncation error 5e-9 relative, below half an
/// fp32 ulp.
inline __m256 exp2_avx2(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-125.0f);
  const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_max_ps(lo, x);
  const __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(x, n);
  __m256 p = _mm256_set1_ps(1.5252734e-05f);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.5403530e-04f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.3333558e-03f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.6181291e-03f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.5504109e-02f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.4022651e-01f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.9314718e-01f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_cvtps_epi32(n), 23);
  const __m256 r = _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(p), e));
  return _mm256_andnot_ps(under, r);
}

/// exp2_avx2 for any x: above 127 it saturates at 2^127 (the backward's scale s - LSE exceeds 0 only
/// by rounding, unless the caller's LSE is not the forward's). MINPS returns its second operand when
/// one is NaN, so a NaN stays NaN.
inline __m256 exp2_clamped(__m256 x) { return exp2_avx2(_mm256_min_ps(_mm256_set1_ps(127.0f), x)); }

inline float hmax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

/// S[4][16] (row stride lds) = Q'[4][dp] (row stride ldq) x Kt panel [dp][16].
inline void microkernel_4x16(const float* q, std::int64_t ldq, const float* kt, int dp, float* s,
                             std::int64_t lds) {
  __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00,
         c30 = c00, c31 = c00;
  for (int c = 0; c < dp; ++c) {
    const __m256 b0 = _mm256_load_ps(kt + c * 16);
    const __m256 b1 = _mm256_load_ps(kt + c * 16 + 8);
    __m256 a = _mm256_broadcast_ss(q + c);
    c00 = _mm256_fmadd_ps(a, b0, c00);
    c01 = _mm256_fmadd_ps(a, b1, c01);
    a = _mm256_broadcast_ss(q + ldq + c);
    c10 = _mm256_fmadd_ps(a, b0, c10);
    c11 = _mm256_fmadd_ps(a, b1, c11);
    a = _mm256_broadcast_ss(q + 2 * ldq + c);
    c20 = _mm256_fmadd_ps(a, b0, c20);
    c21 = _mm256_fmadd_ps(a, b1, c21);
    a = _mm256_broadcast_ss(q + 3 * ldq + c);
    c30 = _mm256_fmadd_ps(a, b0, c30);
    c31 = _mm256_fmadd_ps(a, b1, c31);
  }
  _mm256_store_ps(s, c00);
  _mm256_store_ps(s + 8, c01);
  _mm256_store_ps(s + lds, c10);
  _mm256_store_ps(s + lds + 8, c11);
  _mm256_store_ps(s + 2 * lds, c20);
  _mm256_store_ps(s + 2 * lds + 8, c21);
  _mm256_store_ps(s + 3 * lds, c30);
  _mm256_store_ps(s + 3 * lds + 8, c31);
}



/// acc[0, dp) += sum over t < n of weight(t) * row(t)[0, dp): the sparse combination of rows behind
/// dQ (over a query row's kept keys) and dK, dV (over the query rows that kept a key). 64 columns are
/// held in 8 registers at a time, so acc is read and written once per call.
template <typename Weight, typename Row>
inline void add_row_combination(float* acc, int dp, int n, Weight weight, Row row) {
  int c0 = 0;
  for (; c0 + 64 <= dp; c0 += 64) {
    __m256 a0 = _mm256_load_ps(acc + c0), a1 = _mm256_load_ps(acc + c0 + 8), a2 = _mm256_load_ps(acc + c0 + 16),
           a3 = _mm256_load_ps(acc + c0 + 24), a4 = _mm256_load_ps(acc + c0 + 32), a5 = _mm256_load_ps(acc + c0 + 40),
           a6 = _mm256_load_ps(acc + c0 + 48), a7 = _mm256_load_ps(acc + c0 + 56);
    for (int t = 0; t < n; ++t) {
      const __m256 w = _mm256_set1_ps(weight(t));
      const float* x = row(t) + c0;
      a0 = _mm256_fmadd_ps(w, _mm256_load_ps(x), a0);
      a1 = _mm256_fmadd_ps(w, _mm256_load_ps(x + 8), a1);
      a2 = _mm256_fmadd_ps(w, _mm256_load_ps(x + 16), a2);
      a3 = _mm256_fmadd_ps(w, _mm256_load_ps(x + 24), a3);
      a4 = _mm256_fmadd_ps(w, _mm256_load_ps(x + 32), a4);
      a5 = _mm256_fmadd_ps(w, _mm256_load_ps(x + 40), a5);
      a6 = _mm256_fmadd_ps(w, _mm256_load_ps(x + 48), a6);
      a7 = _mm256_fmadd_ps(w, _mm256_load_ps(x + 56), a7);
    }
    _mm256_store_ps(acc + c0, a0);
    _mm256_store_ps(acc + c0 + 8, a1);
    _mm256_store_ps(acc + c0 + 16, a2);
    _mm256_store_ps(acc + c0 + 24, a3);
    _mm256_store_ps(acc + c0 + 32, a4);
    _mm256_store_ps(acc + c0 + 40, a5);
    _mm256_store_ps(acc + c0 + 48, a6);
    _mm256_store_ps(acc + c0 + 56, a7);
  }
  for (; c0 < dp; c0 += 8) {
    __m256 a = _mm256_load_ps(acc + c0);
    for (int t = 0; t < n; ++t) a = _mm256_fmadd_ps(_mm256_set1_ps(weight(t)), _mm256_load_ps(row(t) + c0), a);
    _mm256_store_ps(acc + c0, a);
  }
}

/// Per-thread state: the packed keys and values of one (batch, kv head) and the task scratch.
struct workspace {
  std::int64_t packed_b = -1, packed_hk = -1;
  bool kv_risky = false;  ///< the packed K or V holds a non-finite or huge value
  bool risky = false;     ///< the current task can produce NaN scores (see row_epilogue)
  aligned_buffer<float> kt, vp, q, s, acc, comp_val, row_max, row_sum;
  aligned_buffer<std::int32_t> comp_idx, row_nan;
  // Backward only: K rows, dK and dV accumulators of the (batch, kv head), the dO tile, per-row
  // D = rowsum(dO * O) and LSE * log2(e), the kept probabilities and scaled dS of one row, and the
  // key-major P and scaled dS of one (row tile, key tile) block (zero where a key was not kept).
  aligned_buffer<float> kr, dk, dv, dout, row_d, row_lse2, comp_p, comp_ds, vt, dps, p_keys, ds_keys;
  aligned_buffer<float> dbias_acc;  ///< fp32 sum of a shared 16-bit dBias slice [Lq, Lk]
};

template <typename T>
class fused_avx2 {
 public:
  explicit fused_avx2(const attention_params& p)
      : p_(p),
        d_(static_cast<int>(p.head_dim)),
        dp_((d_ + 7) / 8 * 8),
        w_(key_tile_width(p.pattern_m)),
        lk_pad_((p.seqlen_k + w_ - 1) / w_ * w_),
        zero_row_(static_cast<std::int32_t>(lk_pad_)),
        scale_(static_cast<float>(p.scale)),
        e1_(std::isfinite(scale_ * kLog2e) ? scale_ * kLog2e : scale_),
        e2_(std::isfinite(scale_ * kLog2e) ? 1.0f : kLog2e),
        group_(p.heads / p.heads_kv) {}

  /// The calling thread's scratch. It lives as long as the thread (OpenMP keeps its threads), so
  /// repeated calls do not pay for fresh pages; it is as large as the packed K and V of one head.
  static workspace& thread_workspace() {
    static thread_local workspace tls;
    return tls;
  }

  /// Sizes the scratch for this call (and the backward's extra buffers); false when an allocation
  /// failed. Exceptions must not leave a parallel region, so the caller reports the failure after it.
  bool reserve(workspace& ws, bool backward) const noexcept {
    ws.packed_b = ws.packed_hk = -1;  // a new call: the packed head may be stale
    try {
      const auto rows_pad = static_cast<std::size_t>((lk_pad_ + 1) * dp_);
      const auto panels = static_cast<std::size_t>((lk_pad_ / 16) * dp_ * 16);
      const auto tile_rows = static_cast<std::size_t>(kRowsPerTask * dp_);
      const auto compact = static_cast<std::size_t>(w_ + 8);
      ws.kt.resize(panels);
      ws.vp.resize(rows_pad);
      ws.q.resize(tile_rows);
      ws.s.resize(static_cast<std::size_t>(kRowsPerTask * w_));
      ws.acc.resize(tile_rows);
      ws.comp_val.resize(compact);
      ws.comp_idx.resize(compact);
      ws.row_max.resize(kRowsPerTask);
      ws.row_sum.resize(kRowsPerTask);
      ws.row_nan.resize(kRowsPerTask);
      if (backward) {
        ws.vt.resize(panels);
        ws.dps.resize(static_cast<std::size_t>(kRowsPerTask * w_));
        ws.kr.resize(rows_pad);
        ws.dk.resize(rows_pad);
        ws.dv.resize(rows_pad);
        ws.dout.resize(tile_rows);
        ws.comp_p.resize(compact);
        ws.comp_ds.resize(compact);
        // One slot per key of the tile.
        const auto block = static_cast<std::size_t>(w_ * kRowsPerTask);
        ws.p_keys.resize(block);
        ws.ds_keys.resize(block);
        ws.row_d.resize(kRowsPerTask);
        ws.row_lse2.resize(kRowsPerTask);
      }
    } catch (const std::bad_alloc&) {
      return false;
    }
    return true;
  }

  void run() {
    const std::int64_t q_tiles = (p_.seqlen_q + kRowsPerTask - 1) / kRowsPerTask;
    const std::int64_t tasks = p_.batch * p_.heads * q_tiles;
    const int threads = p_.num_threads > 0 ? p_.num_threads : omp_get_max_threads();
    std::atomic<bool> out_of_memory{false};
#pragma omp parallel num_threads(threads)
    {
      workspace& ws = thread_workspace();
      const bool ready = reserve(ws, /*backward=*/false);
      if (!ready) out_of_memory = true;
      // Causal tasks differ in cost: hand them out dynamically. Otherwise contiguous static chunks
      // let each thread pack each (batch, kv head) once. Either way every row is computed by one
      // thread in a fixed order, so the result does not depend on the thread count.
      if (p_.causal) {
#pragma omp for schedule(dynamic, 1)
        for (std::int64_t t = 0; t < tasks; ++t)
          if (ready) task(ws, t, q_tiles);
      } else {
#pragma omp for schedule(static)
        for (std::int64_t t = 0; t < tasks; ++t)
          if (ready) task(ws, t, q_tiles);
      }
    }
    if (out_of_memory) throw std::bad_alloc();
  }

  /// Backward pass (see fused_backward_avx2): one task per (batch, kv head), or per group of them
  /// when dBias broadcasts over the batch or the heads: a task then owns every (batch, kv head) that
  /// adds into the same dBias entries and visits them in a fixed order (deterministic, no atomics).
  void run_backward() {
    const bool dbias_over_b = p_.dbias != nullptr && p_.dbias_stride[0] == 0 && p_.batch > 1;
    const bool dbias_over_h = p_.dbias != nullptr && p_.dbias_stride[1] == 0 && p_.heads > 1;
    const std::int64_t task_b = dbias_over_b ? 1 : p_.batch, task_hk = dbias_over_h ? 1 : p_.heads_kv;
    const std::int64_t tasks = task_b * task_hk;
    // A shared 16-bit dBias is summed in fp32 scratch and rounded once, like the reference's single
    // rounding; f32 and f64 dBias are summed in place.
    const bool shared = dbias_over_b || dbias_over_h;
    const bool scratch = shared && p_.bias_type != dtype::f32 && p_.bias_type != dtype::f64;
    const int threads = p_.num_threads > 0 ? p_.num_threads : omp_get_max_threads();
    std::atomic<bool> out_of_memory{false};
#pragma omp parallel num_threads(threads)
    {
      workspace& ws = thread_workspace();
      bool ready = reserve(ws, /*backward=*/true);
      if (ready && scratch) {
        try {
          ws.dbias_acc.resize(static_cast<std::size_t>((dbias_over_h ? 1 : group_) * p_.seqlen_q * p_.seqlen_k));
        } catch (const std::bad_alloc&) {
          ready = false;
        }
      }
      if (!ready) out_of_memory = true;
#pragma omp for schedule(static)
      for (std::int64_t t = 0; t < tasks; ++t) {
        if (!ready) continue;
        const std::int64_t tb = t / task_hk, thk = t % task_hk;
        // The scratch holds the task's dBias slices: one [Lq, Lk] slice, or (shared over the batch
        // only) one per head of the kv head's group, indexed from its first head.
        dbias_sink sink = direct_dbias_sink();
        if (scratch) {
          const std::int64_t slice = p_.seqlen_q * p_.seqlen_k;
          sink = {ws.dbias_acc.ptr, dtype::f32, {0, dbias_over_h ? 0 : slice, p_.seqlen_k, 1}, dbias_over_h ? 0 : thk * group_};
        }
        for (std::int64_t b = dbias_over_b ? 0 : tb; b < (dbias_over_b ? p_.batch : tb + 1); ++b) {
          for (std::int64_t hk = dbias_over_h ? 0 : thk; hk < (dbias_over_h ? p_.heads_kv : thk + 1); ++hk) {
            backward_task(ws, b, hk, sink, /*first_b=*/!dbias_over_b || b == 0);
          }
        }
        if (scratch) {
          for (std::int64_t g = 0; g < (dbias_over_h ? 1 : group_); ++g) {
            flush_dbias(ws.dbias_acc.ptr + g * p_.seqlen_q * p_.seqlen_k, tb, dbias_over_h ? 0 : thk * group_ + g);
          }
        }
      }
    }
    if (out_of_memory) throw std::bad_alloc();
  }

 private:
  void pack_head(workspace& ws, std::int64_t b, std::int64_t hk) {
    if (ws.packed_b == b && ws.packed_hk == hk) return;
    float* kt = ws.kt.ptr;
    float* vp = ws.vp.ptr;
    const std::int64_t lk = p_.seqlen_k;
    // Rows are converted to fp32 once into a contiguous scratch row, then scattered: K transposed
    // into its 16-key panels (c outer, so the stores are contiguous), V copied row by row.
    float* row = ws.q.ptr;  // the Q tile scratch is free while packing (dp floats needed)
    bool risky = false;
    bool fast = false;
    if constexpr (std::is_same_v<T, float>) fast = p_.k_stride[3] == 1 && d_ % 8 == 0;
    for (std::int64_t blk = 0; blk < lk_pad_ / 16; ++blk) {
      float* panel = kt + blk * dp_ * 16;
      if (fast) {
        risky |= !pack_panel_f32(b, hk, blk * 16, panel);
        continue;
      }
      for (int t = 0; t < 16; ++t) {
        const std::int64_t j = blk * 16 + t;
        load_row(p_.k, p_.k_stride, b, j, hk, j < lk, row);
        risky |= !row_is_tame(row);
        for (int c = 0; c < dp_; ++c) panel[c * 16 + t] = row[c];
      }
    }
    for (std::int64_t j = 0; j <= lk_pad_; ++j) {
      load_row(p_.v, p_.v_stride, b, j, hk, j < lk, vp + j * dp_);
      risky |= !row_is_tame(vp + j * dp_);
    }
    ws.kv_risky = risky;
    ws.packed_b = b;
    ws.packed_hk = hk;
  }

  /// Packs keys j0 .. j0 + 15 of an f32 K with unit element stride and d % 8 == 0 into a [dp][16]
  /// panel by 8 x 8 register transposes (keys >= Lk are zero). Returns whether all values are tame
  /// (see row_is_tame).
  bool pack_panel_f32(std::int64_t b, std::int64_t hk, std::int64_t j0, float* panel) const {
    const float* k = static_cast<const float*>(p_.k);
    const __m256 lim = _mm256_set1_ps(0x1p50f);
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 ok = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
    for (int half = 0; half < 2; ++half) {
      const float* rows[8];
      for (int r = 0; r < 8; ++r) {
        const std::int64_t j = j0 + 8 * half + r;
        rows[r] = j < p_.seqlen_k ? k + core::offset4(p_.k_stride, b, j, hk, 0) : nullptr;
      }
      for (int c0 = 0; c0 < d_; c0 += 8) {
        __m256 r[8];
        for (int q = 0; q < 8; ++q) {
          r[q] = rows[q] != nullptr ? _mm256_loadu_ps(rows[q] + c0) : _mm256_setzero_ps();
          ok = _mm256_and_ps(ok, _mm256_cmp_ps(_mm256_and_ps(r[q], abs_mask), lim, _CMP_LE_OQ));
        }
        const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
        const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
        const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
        const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
        const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
        const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
        const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
        const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
        float* out = panel + c0 * 16 + 8 * half;
        _mm256_store_ps(out + 0 * 16, _mm256_permute2f128_ps(u0, u4, 0x20));
        _mm256_store_ps(out + 1 * 16, _mm256_permute2f128_ps(u1, u5, 0x20));
        _mm256_store_ps(out + 2 * 16, _mm256_permute2f128_ps(u2, u6, 0x20));
        _mm256_store_ps(out + 3 * 16, _mm256_permute2f128_ps(u3, u7, 0x20));
        _mm256_store_ps(out + 4 * 16, _mm256_permute2f128_ps(u0, u4, 0x31));
        _mm256_store_ps(out + 5 * 16, _mm256_permute2f128_ps(u1, u5, 0x31));
        _mm256_store_ps(out + 6 * 16, _mm256_permute2f128_ps(u2, u6, 0x31));
        _mm256_store_ps(out + 7 * 16, _mm256_permute2f128_ps(u3, u7, 0x31));
      }
    }
    return _mm256_movemask_ps(ok) == 0xff;
  }

  /// Whether every value of a packed row is finite and at most 2^50 in magnitude: then no product or
  /// sum of d <= 512 such values overflows, so scores are finite and NaN-free.
  bool row_is_tame(const float* row) const {
    const __m256 lim = _mm256_set1_ps(0x1p50f);
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 ok = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
    for (int c = 0; c < dp_; c += 8) {
      ok = _mm256_and_ps(ok, _mm256_cmp_ps(_mm256_and_ps(_mm256_loadu_ps(row + c), abs_mask), lim, _CMP_LE_OQ));
    }
    return _mm256_movemask_ps(ok) == 0xff;
  }

  /// Row (b, j, h, :) of a [B, L, H, d] tensor as dp floats (zero padded; all zero when !valid).
  /// Always inlined, as bias_and_mask: GCC 12 stopped inlining both into task() once the exp
  /// epilogue grew, which cost 1.4% more instructions in the forward (callgrind, L = 1024).
  [[gnu::always_inline]] void load_row(const void* base, const std::int64_t* st, std::int64_t b, std::int64_t j, std::int64_t h,
                bool valid, float* out) const {
    if (!valid) {
      std::memset(out, 0, sizeof(float) * static_cast<std::size_t>(dp_));
      return;
    }
    const std::int64_t off = core::offset4(st, b, j, h, 0);
    if constexpr (std::is_same_v<T, float>) {
      if (st[3] == 1) {
        const float* src = static_cast<const float*>(base) + off;
        int c = 0;
        for (; c + 8 <= d_; c += 8) _mm256_storeu_ps(out + c, _mm256_loadu_ps(src + c));
        for (; c < d_; ++c) out[c] = src[c];
        for (; c < dp_; ++c) out[c] = 0.0f;
        return;
      }
    }
    int c = 0;
    if (st[3] == 1) {
      // 16-bit rows: f16 through F16C, bf16 by widening to 32 bits and shifting into the high half.
      const auto* src = static_cast<const std::uint16_t*>(base) + off;
      for (; c + 8 <= d_; c += 8) {
        const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + c));
        if constexpr (std::is_same_v<T, half>) {
          _mm256_storeu_ps(out + c, _mm256_cvtph_ps(raw));
        } else {
          _mm256_storeu_ps(out + c, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16)));
        }
      }
    }
    for (; c < d_; ++c) out[c] = load_f32<T>(base, off + c * st[3]);
    for (; c < dp_; ++c) out[c] = 0.0f;
  }

  /// Keys visible to query row qi: j < limit (key padding, causal and the sequence end).
  std::int64_t key_limit(std::int64_t b, std::int64_t qi) const {
    std::int64_t lim = core::valid_keys(p_, b);
    if (p_.causal) lim = std::min(lim, qi + (p_.seqlen_k - p_.seqlen_q) + 1);
    return lim;
  }

  void task(workspace& ws, std::int64_t t, std::int64_t q_tiles) {
    const std::int64_t qt = t % q_tiles;
    const std::int64_t h = (t / q_tiles) % p_.heads;
    const std::int64_t b = t / (q_tiles * p_.heads);
    const std::int64_t hk = h / group_;
    const std::int64_t i0 = qt * kRowsPerTask;
    const int rows = static_cast<int>(std::min<std::int64_t>(kRowsPerTask, p_.seqlen_q - i0));
    const int rows4 = (rows + 3) / 4 * 4;
    pack_head(ws, b, hk);

    float* q = ws.q.ptr;
    ws.risky = ws.kv_risky || p_.bias != nullptr;
    for (int i = 0; i < rows4; ++i) {
      load_row(p_.q, p_.q_stride, b, i0 + i, h, i < rows, q + i * dp_);
      ws.risky = ws.risky || !row_is_tame(q + i * dp_);
    }
    std::fill(ws.acc.ptr, ws.acc.ptr + rows * dp_, 0.0f);
    std::int64_t tile_end = 0;  // keys beyond the last visible key of any row of the task are skipped
    for (int i = 0; i < rows; ++i) {
      ws.row_max[static_cast<std::size_t>(i)] = -std::numeric_limits<float>::infinity();
      ws.row_sum[static_cast<std::size_t>(i)] = 0.0f;
      ws.row_nan[static_cast<std::size_t>(i)] = 0;
      tile_end = std::max(tile_end, key_limit(b, i0 + i));
    }

    for (std::int64_t j0 = 0; j0 < tile_end; j0 += w_) {
      for (int i = 0; i < rows4; i += 4) {
        for (int jb = 0; jb < w_; jb += 16) {
          microkernel_4x16(q + i * dp_, dp_, ws.kt.ptr + ((j0 + jb) / 16) * dp_ * 16, dp_, ws.s.ptr + i * w_ + jb, w_);
        }
      }
      for (int i = 0; i < rows; ++i) row_epilogue(ws, b, h, i0 + i, i, j0);
    }

    const float nan = std::numeric_limits<float>::quiet_NaN();
    for (int i = 0; i < rows; ++i) {
      const float mx = ws.row_max[static_cast<std::size_t>(i)], sum = ws.row_sum[static_cast<std::size_t>(i)];
      const bool is_nan = ws.row_nan[static_cast<std::size_t>(i)] != 0;
      const bool empty = mx == -std::numeric_limits<float>::infinity();
      const float inv = empty ? 0.0f : 1.0f / sum;
      const float* acc = ws.acc.ptr + i * dp_;
      for (int c = 0; c < d_; ++c) {
        core::store_from_double(p_.o, p_.output_type, core::offset4(p_.o_stride, b, i0 + i, h, c),
                                static_cast<double>(is_nan ? nan : acc[c] * inv));
      }
      if (p_.lse != nullptr) {
        // scale * max overflows to +-inf exactly where the reference's LSE, rounded to fp32, does.
        const float lse = is_nan ? nan : (empty ? -std::numeric_limits<float>::infinity() : scale_ * mx + std::log2(sum) * kLn2);
        core::store_from_double(p_.lse, p_.lse_type,
                                b * p_.lse_stride[0] + h * p_.lse_stride[1] + (i0 + i) * p_.lse_stride[2],
                                static_cast<double>(lse));
      }
    }
  }

  /// Adds the bias to the tile row @p s of query qi and sets masked keys (j >= lim) to -inf (always
  /// inlined: see load_row).
  [[gnu::always_inline]] void bias_and_mask(float* s, std::int64_t b, std::int64_t h, std::int64_t qi, std::int64_t j0, std::int64_t lim) const {
    if (p_.bias != nullptr) {
      const std::int64_t n = std::min<std::int64_t>(w_, p_.seqlen_k - j0);
      const std::int64_t base = b * p_.bias_stride[0] + h * p_.bias_stride[1] + qi * p_.bias_stride[2];
      for (std::int64_t t = 0; t < n; ++t) {
        s[t] += static_cast<float>(core::load_as_double(p_.bias, p_.bias_type, base + (j0 + t) * p_.bias_stride[3]));
      }
    }
    for (std::int64_t t = std::max<std::int64_t>(0, lim - j0); t < w_; ++t) s[t] = -std::numeric_limits<float>::infinity();
  }

  /// Whether the tile row @p s holds a NaN or +inf score: either makes its row NaN
  /// (docs/semantics.md, "Non-finite and extreme inputs"), kept or pruned (a +inf is pruned only
  /// in favour of another +inf or a NaN).
  bool row_has_nan_or_inf(const float* s) const {
    const __m256 inf = _mm256_set1_ps(std::numeric_limits<float>::infinity());
    __m256 bad = _mm256_setzero_ps();
    for (int t = 0; t < w_; t += 8) {
      const __m256 x = _mm256_load_ps(s + t);
      bad = _mm256_or_ps(bad, _mm256_or_ps(_mm256_cmp_ps(x, x, _CMP_UNORD_Q), _mm256_cmp_ps(x, inf, _CMP_EQ_OQ)));
    }
    return _mm256_movemask_ps(bad) != 0;
  }

  /// exp(scale (x - max)) of the @p kept compacted scores @p cv, in place; returns their sum. Key
  /// indices @p ci become element offsets into the packed V here (one multiply per 8 keys instead of
  /// one per key in the P V loop). Only a tile that holds masked keys (@p masked_tile: a boundary
  /// tile, or any tile with a bias, which may be -inf) can keep a -inf slot: there it becomes 0 and
  /// points at the zero row. The exponent is (x - max) e1 (e2 when Split): x - max is exact when it
  /// matters (Sterbenz) and at most 0, so huge scores keep accurate weights; the form
  /// x c - max c would cancel away eps |c max| of them and produce exponents far above 0 once
  /// |c max| is large.
  template <bool Split>
  float exp_kept(float* cv, std::int32_t* ci, int kept, float mx, bool masked_tile) const {
    const __m256 vmx = _mm256_set1_ps(mx), ve1 = _mm256_set1_ps(e1_), ve2 = _mm256_set1_ps(e2_);
    const auto exponent = [&](__m256 x) {
      const __m256 y = _mm256_mul_ps(_mm256_sub_ps(x, vmx), ve1);
      if constexpr (Split) return _mm256_mul_ps(y, ve2);
      return y;
    };
    __m256 vsum = _mm256_setzero_ps();
    const __m256i vdp = _mm256_set1_epi32(dp_);
    if (masked_tile) {
      const __m256i vzero_row = _mm256_set1_epi32(zero_row_ * dp_);
      for (int t = 0; t < kept; t += 8) {
        const __m256 x = _mm256_load_ps(cv + t);
        const __m256 e = exp2_avx2(exponent(x));
        _mm256_store_ps(cv + t, e);
        vsum = _mm256_add_ps(vsum, e);
        const __m256 masked = _mm256_cmp_ps(x, _mm256_set1_ps(-std::numeric_limits<float>::infinity()), _CMP_EQ_OQ);
        const __m256i off = _mm256_mullo_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(ci + t)), vdp);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(ci + t),
                            _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(off), _mm256_castsi256_ps(vzero_row), masked)));
      }
    } else {
      for (int t = 0; t < kept; t += 8) {
        const __m256 e = exp2_avx2(exponent(_mm256_load_ps(cv + t)));
        _mm256_store_ps(cv + t, e);
        vsum = _mm256_add_ps(vsum, e);
        const __m256i off = _mm256_mullo_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(ci + t)), vdp);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(ci + t), off);
      }
    }
    return hsum(vsum);
  }

  void row_epilogue(workspace& ws, std::int64_t b, std::int64_t h, std::int64_t qi, int i, std::int64_t j0) {
    const std::int64_t lim = key_limit(b, qi);
    if (j0 >= lim) return;  // the whole tile is masked for this row
    float* s = ws.s.ptr + static_cast<std::int64_t>(i) * w_;
    const float neg_inf = -std::numeric_limits<float>::infinity();
    bias_and_mask(s, b, h, qi, j0, lim);

    // A NaN or +inf score can only come from non-finite or huge inputs (flagged while packing) or a
    // bias; the row's output is then NaN whatever the arithmetic below does with it.
    if (ws.risky && row_has_nan_or_inf(s)) ws.row_nan[static_cast<std::size_t>(i)] = 1;

    // Selection and compaction; the maximum over the kept scores is the tile's maximum.
    float* cv = ws.comp_val.ptr;
    std::int32_t* ci = ws.comp_idx.ptr;
    float tile_max = neg_inf;
    const int kept = compact(s, static_cast<std::int32_t>(j0), cv, ci, tile_max);
    if (tile_max == neg_inf) return;
    float& mx = ws.row_max[static_cast<std::size_t>(i)];
    float& sum = ws.row_sum[static_cast<std::size_t>(i)];
    float* acc = ws.acc.ptr + static_cast<std::int64_t>(i) * dp_;
    if (tile_max > mx) {
      const float corr = mx == neg_inf ? 0.0f : std::exp2(((mx - tile_max) * e1_) * e2_);
      const __m256 vc = _mm256_set1_ps(corr);
      for (int c = 0; c < dp_; c += 8) _mm256_store_ps(acc + c, _mm256_mul_ps(vc, _mm256_load_ps(acc + c)));
      sum *= corr;
      mx = tile_max;
    }

    // exp(scale (x - max)) of the kept scores; the second multiply only for a scale above
    // float max / log2(e).
    const bool masked_tile = j0 + w_ > lim || p_.bias != nullptr;
    sum += e2_ == 1.0f ? exp_kept<false>(cv, ci, kept, mx, masked_tile) : exp_kept<true>(cv, ci, kept, mx, masked_tile);

    // acc += p * V[index] over the kept keys, 64 columns (8 registers) at a time.
    const float* vp = ws.vp.ptr;
    for (int c0 = 0; c0 < dp_; c0 += 64) {
      const int nv = std::min(8, (dp_ - c0) / 8);
      if (nv == 8) {
        __m256 a0 = _mm256_load_ps(acc + c0), a1 = _mm256_load_ps(acc + c0 + 8), a2 = _mm256_load_ps(acc + c0 + 16),
               a3 = _mm256_load_ps(acc + c0 + 24), a4 = _mm256_load_ps(acc + c0 + 32), a5 = _mm256_load_ps(acc + c0 + 40),
               a6 = _mm256_load_ps(acc + c0 + 48), a7 = _mm256_load_ps(acc + c0 + 56);
        // kept is a multiple of 8, so two keys per iteration need no tail.
        for (int t = 0; t < kept; t += 2) {
          const float* v = vp + ci[t] + c0;
          const float* u = vp + ci[t + 1] + c0;
          const __m256 pj = _mm256_broadcast_ss(cv + t);
          const __m256 pu = _mm256_broadcast_ss(cv + t + 1);
          a0 = _mm256_fmadd_ps(pj, _mm256_load_ps(v), a0);
          a1 = _mm256_fmadd_ps(pj, _mm256_load_ps(v + 8), a1);
          a2 = _mm256_fmadd_ps(pj, _mm256_load_ps(v + 16), a2);
          a3 = _mm256_fmadd_ps(pj, _mm256_load_ps(v + 24), a3);
          a4 = _mm256_fmadd_ps(pj, _mm256_load_ps(v + 32), a4);
          a5 = _mm256_fmadd_ps(pj, _mm256_load_ps(v + 40), a5);
          a6 = _mm256_fmadd_ps(pj, _mm256_load_ps(v + 48), a6);
          a7 = _mm256_fmadd_ps(pj, _mm256_load_ps(v + 56), a7);
          a0 = _mm256_fmadd_ps(pu, _mm256_load_ps(u), a0);
          a1 = _mm256_fmadd_ps(pu, _mm256_load_ps(u + 8), a1);
          a2 = _mm256_fmadd_ps(pu, _mm256_load_ps(u + 16), a2);
          a3 = _mm256_fmadd_ps(pu, _mm256_load_ps(u + 24), a3);
          a4 = _mm256_fmadd_ps(pu, _mm256_load_ps(u + 32), a4);
          a5 = _mm256_fmadd_ps(pu, _mm256_load_ps(u + 40), a5);
          a6 = _mm256_fmadd_ps(pu, _mm256_load_ps(u + 48), a6);
          a7 = _mm256_fmadd_ps(pu, _mm256_load_ps(u + 56), a7);
        }
        _mm256_store_ps(acc + c0, a0);
        _mm256_store_ps(acc + c0 + 8, a1);
        _mm256_store_ps(acc + c0 + 16, a2);
        _mm256_store_ps(acc + c0 + 24, a3);
        _mm256_store_ps(acc + c0 + 32, a4);
        _mm256_store_ps(acc + c0 + 40, a5);
        _mm256_store_ps(acc + c0 + 48, a6);
        _mm256_store_ps(acc + c0 + 56, a7);
      } else {
        for (int t = 0; t < kept; ++t) {
          const __m256 pj = _mm256_broadcast_ss(cv + t);
          const float* v = vp + ci[t] + c0;
          for (int r = 0; r < nv; ++r) {
            _mm256_store_ps(acc + c0 + 8 * r, _mm256_fmadd_ps(pj, _mm256_load_ps(v + 8 * r), _mm256_load_ps(acc + c0 + 8 * r)));
          }
        }
      }
    }
  }

  /// Where dBias goes: the output itself, or an fp32 [Lq, Lk] scratch for a shared 16-bit dBias.
  struct dbias_sink {
    void* base;
    dtype type;
    std::int64_t stride[4];  ///< [b, h, i, j]; 0 for a dimension that is summed over
    std::int64_t h0;         ///< first head held (the scratch holds a kv head group's heads)
    std::int64_t at(std::int64_t b, std::int64_t h, std::int64_t i, std::int64_t j) const {
      return b * stride[0] + (h - h0) * stride[1] + i * stride[2] + j * stride[3];
    }
  };

  dbias_sink direct_dbias_sink() const {
    return {p_.dbias, p_.bias_type, {p_.dbias_stride[0], p_.dbias_stride[1], p_.dbias_stride[2], p_.dbias_stride[3]}, 0};
  }

  /// Rounds the fp32 scratch sum of a shared dBias slice (batch b, head h unless broadcast) into dBias.
  void flush_dbias(const float* acc, std::int64_t b, std::int64_t h) const {
    const std::int64_t base = b * p_.dbias_stride[0] + h * p_.dbias_stride[1];
    for (std::int64_t i = 0; i < p_.seqlen_q; ++i) {
      for (std::int64_t j = 0; j < p_.seqlen_k; ++j) {
        core::store_from_double(p_.dbias, p_.bias_type, base + i * p_.dbias_stride[2] + j * p_.dbias_stride[3],
                                static_cast<double>(acc[i * p_.seqlen_k + j]));
      }
    }
  }

  /// dQ, dK, dV of (batch b, kv head hk), and its heads' dBias into @p sink: written by the first
  /// contributor to an entry (@p first_b and, for a dBias shared over heads, head 0), added after.
  void backward_task(workspace& ws, std::int64_t b, std::int64_t hk, const dbias_sink& sink, bool first_b) {
    pack_head(ws, b, hk);
    for (std::int64_t j = 0; j <= lk_pad_; ++j) load_row(p_.k, p_.k_stride, b, j, hk, j < p_.seqlen_k, ws.kr.ptr + j * dp_);
    // V^T in 16-key panels like K, so that dP = dO V^T runs on the same micro-kernel as S = Q K^T.
    for (std::int64_t blk = 0; blk < lk_pad_ / 16; ++blk) {
      float* panel = ws.vt.ptr + blk * dp_ * 16;
      for (int key = 0; key < 16; ++key) {
        const float* row = ws.vp.ptr + (blk * 16 + key) * dp_;
        for (int c = 0; c < dp_; ++c) panel[c * 16 + key] = row[c];
      }
    }
    std::fill(ws.dk.ptr, ws.dk.ptr + (lk_pad_ + 1) * dp_, 0.0f);
    std::fill(ws.dv.ptr, ws.dv.ptr + (lk_pad_ + 1) * dp_, 0.0f);
    const std::int64_t q_tiles = (p_.seqlen_q + kRowsPerTask - 1) / kRowsPerTask;
    for (std::int64_t h = hk * group_; h < (hk + 1) * group_; ++h) {
      const bool first = first_b && (sink.stride[1] != 0 || h == 0);
      for (std::int64_t qt = 0; qt < q_tiles; ++qt) backward_tile(ws, b, h, qt * kRowsPerTask, sink, first);
    }
    // A NaN row's P and dS are NaN at the keys it kept (backward_row), so its NaN reaches exactly
    // those keys' dK and dV, as in the reference.
    for (std::int64_t j = 0; j < p_.seqlen_k; ++j) {
      for (int c = 0; c < d_; ++c) {
        const std::int64_t at = j * dp_ + c;
        core::store_from_double(p_.dk, p_.output_type, core::offset4(p_.dk_stride, b, j, hk, c),
                                static_cast<double>(ws.dk.ptr[at]));
        core::store_from_double(p_.dv, p_.output_type, core::offset4(p_.dv_stride, b, j, hk, c),
                                static_cast<double>(ws.dv.ptr[at]));
      }
    }
  }

  /// Query rows i0 .. i0 + 31 of head h: dQ written, dK and dV accumulated. Per row,
  /// P = exp2((scale (s - shift)) log2(e) - offset) with shift = 0 and offset = LSE log2(e) (the
  /// forward's LSE) while |LSE| <= kDirectLseLimit; for the other rows (large or overflowed scores)
  /// row_statistics first finds the row's maximum m and sum l: shift = m, offset = log2(l).
  void backward_tile(workspace& ws, std::int64_t b, std::int64_t h, std::int64_t i0, const dbias_sink& sink,
                     bool first) {
    const int rows = static_cast<int>(std::min<std::int64_t>(kRowsPerTask, p_.seqlen_q - i0));
    const int rows4 = (rows + 3) / 4 * 4;
    float* q = ws.q.ptr;
    float* dout = ws.dout.ptr;
    std::int64_t tile_end = 0;
    for (int i = 0; i < rows4; ++i) {
      load_row(p_.q, p_.q_stride, b, i0 + i, h, i < rows, q + i * dp_);
      load_row(p_.dout, p_.dout_stride, b, i0 + i, h, i < rows, dout + i * dp_);
    }
    std::uint32_t recompute = 0;  // bit i: row i needs its own maximum and sum
    for (int i = 0; i < rows; ++i) {
      float dsum = 0.0f;
      for (int c = 0; c < d_; ++c) {
        dsum += dout[i * dp_ + c] *
                static_cast<float>(core::load_as_double(p_.o, p_.o_type, core::offset4(p_.o_stride, b, i0 + i, h, c)));
      }
      ws.row_d.ptr[i] = dsum;
      const auto lse = static_cast<float>(core::load_as_double(
          p_.lse, p_.lse_type, b * p_.lse_stride[0] + h * p_.lse_stride[1] + (i0 + i) * p_.lse_stride[2]));
      ws.row_max.ptr[i] = 0.0f;
      ws.row_lse2.ptr[i] = lse * kLog2e;
      ws.row_nan.ptr[i] = lse != lse ? 1 : 0;
      const std::int64_t lim = key_limit(b, i0 + i);
      // LSE -inf is an empty row, or a row whose scale * max overflowed: only a row that sees a key
      // can be the latter.
      if (lse == lse && !(std::abs(lse) <= kDirectLseLimit) && lim > 0) recompute |= 1u << i;
      tile_end = std::max(tile_end, lim);
    }
    if (recompute != 0) row_statistics(ws, b, h, i0, rows4, tile_end, recompute);
    std::fill(ws.acc.ptr, ws.acc.ptr + rows * dp_, 0.0f);
    if (p_.dbias != nullptr && first) {
      for (int i = 0; i < rows; ++i) {
        for (std::int64_t j = 0; j < p_.seqlen_k; ++j) {
          core::store_from_double(sink.base, sink.type, sink.at(b, h, i0 + i, j), 0.0);
        }
      }
    }
    for (std::int64_t j0 = 0; j0 < tile_end; j0 += w_) {
      for (int i = 0; i < rows4; i += 4) {
        for (int jb = 0; jb < w_; jb += 16) {
          const std::int64_t panel = ((j0 + jb) / 16) * dp_ * 16;
          microkernel_4x16(q + i * dp_, dp_, ws.kt.ptr + panel, dp_, ws.s.ptr + i * w_ + jb, w_);
          microkernel_4x16(dout + i * dp_, dp_, ws.vt.ptr + panel, dp_, ws.dps.ptr + i * w_ + jb, w_);
        }
      }
      std::fill(ws.p_keys.ptr, ws.p_keys.ptr + w_ * kRowsPerTask, 0.0f);
      for (int i = 0; i < rows; ++i) backward_row(ws, b, h, i0 + i, i, j0, sink, first);
      accumulate_dk_dv(ws, j0);
    }
    const float nan = std::numeric_limits<float>::quiet_NaN();
    for (int i = 0; i < rows; ++i) {
      const bool is_nan = ws.row_nan.ptr[i] != 0;
      for (int c = 0; c < d_; ++c) {
        core::store_from_double(p_.dq, p_.output_type, core::offset4(p_.dq_stride, b, i0 + i, h, c),
                                static_cast<double>(is_nan ? nan : ws.acc.ptr[i * dp_ + c]));
      }
    }
  }

  /// The maximum m and sum l = sum of exp(scale (s - m)) over the kept scores of the rows in
  /// @p rows_mask (the forward's scores, selection and online update), stored as the rows' shift
  /// (m) and offset (log2 l); offset -inf for a row without a finite kept score, row_nan for a row
  /// with a NaN or +inf score. Costs one more pass of S = Q K^T over the row tile: only tiles with
  /// such rows take it.
  void row_statistics(workspace& ws, std::int64_t b, std::int64_t h, std::int64_t i0, int rows4,
                      std::int64_t tile_end, std::uint32_t rows_mask) {
    const float neg_inf = -std::numeric_limits<float>::infinity();
    for (std::uint32_t r = rows_mask; r != 0; r &= r - 1) {
      const int i = __builtin_ctz(r);
      ws.row_max.ptr[i] = neg_inf;
      ws.row_sum.ptr[i] = 0.0f;
    }
    const __m256 ve1 = _mm256_set1_ps(e1_), ve2 = _mm256_set1_ps(e2_);
    for (std::int64_t j0 = 0; j0 < tile_end; j0 += w_) {
      for (int i = 0; i < rows4; i += 4) {
        for (int jb = 0; jb < w_; jb += 16) {
          microkernel_4x16(ws.q.ptr + i * dp_, dp_, ws.kt.ptr + ((j0 + jb) / 16) * dp_ * 16, dp_, ws.s.ptr + i * w_ + jb, w_);
        }
      }
      for (std::uint32_t r = rows_mask; r != 0; r &= r - 1) {
        const int i = __builtin_ctz(r);
        const std::int64_t lim = key_limit(b, i0 + i);
        if (j0 >= lim || ws.row_nan.ptr[i] != 0) continue;
        float* s = ws.s.ptr + static_cast<std::int64_t>(i) * w_;
        bias_and_mask(s, b, h, i0 + i, j0, lim);
        if (row_has_nan_or_inf(s)) {
          ws.row_nan.ptr[i] = 1;
          continue;
        }
        float tile_max = neg_inf;
        const int kept = compact(s, static_cast<std::int32_t>(j0), ws.comp_val.ptr, ws.comp_idx.ptr, tile_max);
        if (tile_max == neg_inf) continue;
        float& mx = ws.row_max.ptr[i];
        float& sum = ws.row_sum.ptr[i];
        if (tile_max > mx) {
          sum = mx == neg_inf ? 0.0f : sum * std::exp2(((mx - tile_max) * e1_) * e2_);
          mx = tile_max;
        }
        const __m256 vmx = _mm256_set1_ps(mx);
        __m256 vsum = _mm256_setzero_ps();
        for (int t = 0; t < kept; t += 8) {
          vsum = _mm256_add_ps(vsum, exp2_avx2(_mm256_mul_ps(_mm256_mul_ps(_mm256_sub_ps(_mm256_load_ps(ws.comp_val.ptr + t), vmx), ve1), ve2)));
        }
        sum += hsum(vsum);
      }
    }
    for (std::uint32_t r = rows_mask; r != 0; r &= r - 1) {
      const int i = __builtin_ctz(r);
      const float mx = ws.row_max.ptr[i];
      ws.row_lse2.ptr[i] = mx == neg_inf ? neg_inf : std::log2(ws.row_sum.ptr[i]);
    }
  }

  /// One row against one key tile: the forward's scores and selection, then
  /// P = exp2((scale (S - shift)) log2(e) - offset) (see backward_tile), dS = P (dO . V - D),
  /// dQ += scale dS K, dK += scale dS q, dV += P dO.
  void backward_row(workspace& ws, std::int64_t b, std::int64_t h, std::int64_t qi, int i, std::int64_t j0,
                    const dbias_sink& sink, bool first) {
    const std::int64_t lim = key_limit(b, qi);
    const float offset = ws.row_lse2.ptr[i];
    // Empty rows (offset -inf) have zero gradients.
    if (j0 >= lim || offset == -std::numeric_limits<float>::infinity()) return;
    float* s = ws.s.ptr + static_cast<std::int64_t>(i) * w_;
    bias_and_mask(s, b, h, qi, j0, lim);
    if (row_has_nan_or_inf(s)) ws.row_nan.ptr[i] = 1;
    if (ws.row_nan.ptr[i] != 0) {
      nan_row_keys(ws, b, h, qi, i, j0, s, sink);
      return;
    }
    float* cv = ws.comp_val.ptr;
    std::int32_t* ci = ws.comp_idx.ptr;
    float* cp = ws.comp_p.ptr;
    float* cds = ws.comp_ds.ptr;
    float tile_max = 0.0f;
    const int kept = compact(s, static_cast<std::int32_t>(j0), cv, ci, tile_max);
    const float d_row = ws.row_d.ptr[i];
    const __m256 vshift = _mm256_set1_ps(ws.row_max.ptr[i]), ve1 = _mm256_set1_ps(e1_), ve2 = _mm256_set1_ps(e2_),
                 voffset = _mm256_set1_ps(offset);
    const float* dp_row = ws.dps.ptr + static_cast<std::int64_t>(i) * w_;
    const __m256i vj0 = _mm256_set1_epi32(static_cast<std::int32_t>(j0)), vlast = _mm256_set1_epi32(w_ - 1);
    const __m256 zero = _mm256_setzero_ps();
    int zero_p = 0;  // bit set: some kept slot has P = 0
    for (int t = 0; t < kept; t += 8) {
      // P of 8 kept keys (masked slots: exp2(-inf) = 0) and their dO . V from the dP tile (padding
      // slots point past the tile: clamped, their P is 0).
      const __m256 arg = _mm256_mul_ps(_mm256_mul_ps(_mm256_sub_ps(_mm256_load_ps(cv + t), vshift), ve1), ve2);
      const __m256 pv = exp2_clamped(_mm256_sub_ps(arg, voffset));
      const __m256i local = _mm256_min_epi32(
          _mm256_sub_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(ci + t)), vj0), vlast);
      const __m256 dpv = _mm256_i32gather_ps(dp_row, local, 4);
      const __m256 ds = _mm256_mul_ps(pv, _mm256_sub_ps(dpv, _mm256_set1_ps(d_row)));
      _mm256_store_ps(cp + t, pv);
      _mm256_store_ps(cds + t, _mm256_mul_ps(_mm256_set1_ps(scale_), ds));
      zero_p |= _mm256_movemask_ps(_mm256_cmp_ps(pv, zero, _CMP_EQ_OQ));
    }
    // Slots with P = 0 (masked keys, padding, underflow) contribute nothing and are dropped, not
    // multiplied by 0: a masked key's K row or dP may be NaN or inf (as in the reference).
    int live = kept;
    if (zero_p != 0) {
      live = 0;
      for (int t = 0; t < kept; ++t) {
        if (cp[t] == 0.0f) continue;
        cp[live] = cp[t], cds[live] = cds[t], ci[live] = ci[t];
        ++live;
      }
    }
    // dQ += scale dS K over the kept keys (a gather of K rows, the dQ row held in registers).
    const float* kr = ws.kr.ptr;
    add_row_combination(
        ws.acc.ptr + static_cast<std::int64_t>(i) * dp_, dp_, live, [&](int t) { return cds[t]; },
        [&](int t) { return kr + static_cast<std::int64_t>(ci[t]) * dp_; });
    // P and dS go to the key-major block for accumulate_dk_dv.
    float* pk = ws.p_keys.ptr;
    float* dsk = ws.ds_keys.ptr;
    for (int t = 0; t < live; ++t) {
      const std::int64_t slot = (ci[t] - j0) * kRowsPerTask + i;  // live slots are keys of this tile
      pk[slot] = cp[t];
      dsk[slot] = cds[t];
    }
    if (p_.dbias != nullptr) {
      for (int t = 0; t < live; ++t) {
        const std::int64_t at = sink.at(b, h, qi, ci[t]);
        const double prior = first ? 0.0 : core::load_as_double(sink.base, sink.type, at);
        core::store_from_double(sink.base, sink.type, at, prior + static_cast<double>(cds[t]));
      }
    }
  }

  /// A NaN row against one key tile: P and dS are NaN at every key it keeps that is not masked (as
  /// in the reference), so dK, dV (through the key-major block) and dBias turn NaN at exactly those
  /// keys; its dQ row is written NaN by backward_tile. The kept keys come from the scalar selection
  /// rule, which ranks NaN above every number (the in-register 1:2 and 2:4 compaction does not need
  /// to, as a NaN row's output is NaN whatever it keeps).
  void nan_row_keys(workspace& ws, std::int64_t b, std::int64_t h, std::int64_t qi, int i, std::int64_t j0,
                    const float* s, const dbias_sink& sink) {
    const int n = p_.pattern_n, m = p_.pattern_m;
    const float nan = std::numeric_limits<float>::quiet_NaN();
    const std::int64_t keys = std::min<std::int64_t>(w_, p_.seqlen_k - j0);
    for (int g = 0; g < keys; g += m) {
      const std::uint32_t keep = n == m ? (1u << m) - 1u : select_group_generic(s + g, n, m);
      for (int x = 0; x < m && g + x < keys; ++x) {
        if (!((keep >> x) & 1u) || s[g + x] == -std::numeric_limits<float>::infinity()) continue;
        const std::int64_t slot = static_cast<std::int64_t>(g + x) * kRowsPerTask + i;
        ws.p_keys.ptr[slot] = nan;
        ws.ds_keys.ptr[slot] = nan;
        if (p_.dbias != nullptr) core::store_from_double(sink.base, sink.type, sink.at(b, h, qi, j0 + g + x), static_cast<double>(nan));
      }
    }
  }

  /// dV += P^T dO and dK += scale dS^T Q for the keys of the tile at j0, from the key-major block the
  /// rows of the tile filled: per key, a gather over the query rows that kept it, so that each dK and
  /// dV row is read and written once per (row tile, key tile) and pruned entries cost nothing.
  void accumulate_dk_dv(workspace& ws, std::int64_t j0) {
    const std::int64_t keys = std::min<std::int64_t>(w_, p_.seqlen_k - j0);
    const __m256 zero = _mm256_setzero_ps();
    int rows[kRowsPerTask];
    for (std::int64_t k = 0; k < keys; ++k) {
      const float* pk = ws.p_keys.ptr + k * kRowsPerTask;
      const float* dsk = ws.ds_keys.ptr + k * kRowsPerTask;
      // Rows with P != 0: kept, unmasked and not underflowed (P = 0 contributes nothing to either).
      std::uint32_t live = 0;
      for (int r = 0; r < kRowsPerTask; r += 8) {
        const auto bits = static_cast<std::uint32_t>(
            _mm256_movemask_ps(_mm256_cmp_ps(_mm256_load_ps(pk + r), zero, _CMP_NEQ_UQ)));
        live |= bits << r;
      }
      if (live == 0) continue;
      int n = 0;
      for (; live != 0; live &= live - 1) rows[n++] = __builtin_ctz(live);
      const std::int64_t j = j0 + k;
      const float* dout = ws.dout.ptr;
      const float* q = ws.q.ptr;
      add_row_combination(
          ws.dv.ptr + j * dp_, dp_, n, [&](int t) { return pk[rows[t]]; },
          [&](int t) { return dout + static_cast<std::int64_t>(rows[t]) * dp_; });
      add_row_combination(
          ws.dk.ptr + j * dp_, dp_, n, [&](int t) { return dsk[rows[t]]; },
          [&](int t) { return q + static_cast<std::int64_t>(rows[t]) * dp_; });
    }
  }

  /// Selects N of every M keys of the tile row @p s and writes the kept scores and key indices to
  /// @p cv / @p ci (padded with -inf / the zero row to a multiple of 8); @p max_out receives the
  /// largest kept score (NaN-free rows only; NaN rows are flagged separately). Returns the count.
  int compact(const float* s, std::int32_t j0, float* cv, std::int32_t* ci, float& max_out) const {
    const int n = p_.pattern_n, m = p_.pattern_m;
    int kept = 0;
    __m256 vmax = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
    if (n == m) {
      for (int t = 0; t < w_; t += 8) {
        const __m256 x = _mm256_load_ps(s + t);
        vmax = _mm256_max_ps(vmax, x);
        _mm256_store_ps(cv + t, x);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(ci + t),
                            _mm256_add_epi32(_mm256_set1_epi32(j0 + t), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
      }
      kept = w_;
    } else if (n == 1 && m == 2) {
      // Each pair keeps its larger score, the lower index on ties: even lane kept iff s[2p] >= s[2p+1].
      // Two vectors (16 keys) compact into one: lanes hold pairs {0, 1, 4, 5, 2, 3, 6, 7}.
      const __m256i pair_base = _mm256_setr_epi32(0, 2, 8, 10, 4, 6, 12, 14);
      for (int t = 0; t < w_; t += 16) {
        const __m256 a = _mm256_load_ps(s + t), b = _mm256_load_ps(s + t + 8);
        const __m256 asw = _mm256_permute_ps(a, 0xB1), bsw = _mm256_permute_ps(b, 0xB1);
        const __m256 va = _mm256_max_ps(a, asw), vb = _mm256_max_ps(b, bsw);
        const __m256 ka = _mm256_cmp_ps(a, asw, _CMP_GE_OQ), kb = _mm256_cmp_ps(b, bsw, _CMP_GE_OQ);
        const __m256 v = _mm256_shuffle_ps(va, vb, 0x88);
        vmax = _mm256_max_ps(vmax, v);
        _mm256_store_ps(cv + kept, v);
        const __m256i keep_even = _mm256_castps_si256(_mm256_shuffle_ps(ka, kb, 0x88));
        // index = pair start + 1 - [even kept] (keep_even is -1 where the even key is kept).
        const __m256i idx = _mm256_add_epi32(_mm256_add_epi32(pair_base, _mm256_set1_epi32(j0 + t + 1)), keep_even);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(ci + kept), idx);
        kept += 8;
      }
    } else if (n == 2 && m == 4) {
      // Per group of 4 = pairs P0 (keys 0, 1) and P1 (keys 2, 3): each pair's winner hi and loser lo
      // (ties to the lower index) as for 1:2. The two kept keys are {hi0, hi1}, except {hi0, lo0}
      // when lo0 ranks above hi1 (lo0 >= hi1: lo0 has the lower index) and {hi1, lo1} when lo1 ranks
      // above hi0 (lo1 > hi0 strictly). So lane 0 keeps (lo0 above hi1 ? lo0 : hi1) and lane 2 keeps
      // (lo1 above hi0 ? lo1 : hi0): two blends, then the even lanes compact as for 1:2.
      const __m256i lane_base = _mm256_setr_epi32(0, 0, 2, 0, 4, 0, 6, 0);
      __m256 val[2], idx[2];
      for (int t = 0; t < w_; t += 16) {
        for (int half = 0; half < 2; ++half) {
          const __m256 x = _mm256_load_ps(s + t + 8 * half);
          const __m256 sw = _mm256_permute_ps(x, 0xB1);
          const __m256i even_wins = _mm256_castps_si256(_mm256_cmp_ps(x, sw, _CMP_GE_OQ));
          const __m256 hi = _mm256_max_ps(x, sw), lo = _mm256_min_ps(x, sw);
          const __m256 hi_other = _mm256_permute_ps(hi, 0x4E);
          const __m256 lo_wins = _mm256_blend_ps(_mm256_cmp_ps(lo, hi_other, _CMP_GE_OQ),
                                                 _mm256_cmp_ps(lo, hi_other, _CMP_GT_OQ), 0xCC);
          val[half] = _mm256_blendv_ps(hi_other, lo, lo_wins);
          const __m256i base = _mm256_add_epi32(lane_base, _mm256_set1_epi32(j0 + t + 8 * half));
          const __m256i hi_idx = _mm256_add_epi32(_mm256_add_epi32(base, _mm256_set1_epi32(1)), even_wins);
          const __m256i lo_idx = _mm256_sub_epi32(base, even_wins);
          const __m256 hi_idx_other = _mm256_permute_ps(_mm256_castsi256_ps(hi_idx), 0x4E);
          idx[half] = _mm256_blendv_ps(hi_idx_other, _mm256_castsi256_ps(lo_idx), lo_wins);
        }
        const __m256 v = _mm256_shuffle_ps(val[0], val[1], 0x88);
        vmax = _mm256_max_ps(vmax, v);
        _mm256_store_ps(cv + kept, v);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(ci + kept), _mm256_castps_si256(_mm256_shuffle_ps(idx[0], idx[1], 0x88)));
        kept += 8;
      }
    } else {
      for (int g = 0; g < w_; g += m) {
        const std::uint32_t keep = select_group_generic(s + g, n, m);
        for (int q = 0; q < m; ++q) {
          if ((keep >> q) & 1u) {
            cv[kept] = s[g + q];
            ci[kept] = j0 + g + q;
            ++kept;
          }
        }
      }
      for (; kept % 8 != 0; ++kept) {
        cv[kept] = -std::numeric_limits<float>::infinity();
        ci[kept] = zero_row_;
      }
      for (int t = 0; t < kept; t += 8) vmax = _mm256_max_ps(vmax, _mm256_load_ps(cv + t));
    }
    max_out = hmax(vmax);
    return kept;
  }

  const attention_params& p_;
  const int d_, dp_, w_;
  const std::int64_t lk_pad_;
  const std::int32_t zero_row_;
  const float scale_;
  /// exp(scale * x) = exp2((x * e1_) * e2_): e1_ = scale log2(e) and e2_ = 1, or, when scale
  /// log2(e) overflows fp32 (scale above float max / log2(e), up to float max), e1_ = scale and
  /// e2_ = log2(e), which stays finite for every |x| the product can take.
  const float e1_, e2_;
  const std::int64_t group_;
};

}  // namespace

status fused_forward_avx2(const attention_params& p) noexcept {
  // Offsets into the packed V are int32: beyond ~2^31 elements per head (e.g. 4M keys at d = 512)
  // the generic kernel takes over.
  const std::int64_t dp = (p.head_dim + 7) / 8 * 8;
  if ((p.seqlen_k + kMaxKeyTile + 1) * dp > std::numeric_limits<std::int32_t>::max()) {
    return fused_forward_scalar(p);
  }
  try {
    switch (p.input_type) {
      case dtype::f32: fused_avx2<float>(p).run(); break;
      case dtype::f16: fused_avx2<half>(p).run(); break;
      case dtype::bf16: fused_avx2<bfloat16>(p).run(); break;
      default:
        return {status_code::unsupported, std::string("dfss cpu avx2 fused forward: input type ") +
                                              dtype_name(p.input_type) + " (takes f32, f16, bf16)"};
    }
  } catch (const std::bad_alloc&) {
    return {status_code::internal, "dfss cpu avx2 fused forward: out of memory for the packed keys and values"};
  }
  return status::success();
}

}  // namespace dfss::cpu
#pragma GCC pop_options
namespace dfss::cpu {

status fused_backward_avx2(const attention_params& p) noexcept {
  const std::int64_t dp = (p.head_dim + 7) / 8 * 8;
  if ((p.seqlen_k + kMaxKeyTile + 1) * dp > std::numeric_limits<std::int32_t>::max()) {
    return {status_code::unsupported, "dfss cpu avx2 backward: more than 2^31 packed key elements per head"};
  }
  if (p.o == nullptr || p.lse == nullptr) {
    return {status_code::internal, "dfss cpu avx2 backward: called without the forward's output and LSE"};
  }
  try {
    switch (p.input_type) {
      case dtype::f32: fused_avx2<float>(p).run_backward(); break;
      case dtype::f16: fused_avx2<half>(p).run_backward(); break;
      case dtype::bf16: fused_avx2<bfloat16>(p).run_backward(); break;
      default:
        return {status_code::unsupported, std::string("dfss cpu avx2 backward: input type ") + dtype_name(p.input_type)};
    }
  } catch (const std::bad_alloc&) {
    return {status_code::internal, "dfss cpu avx2 backward: out of memory for the packed keys and values"};
  }
  return status::success();
}

#else

status fused_backward_avx2(const attention_params&) noexcept {
  return {status_code::unsupported, "dfss cpu avx2 backward: this build has no AVX2 kernels"};
}

status fused_forward_avx2(const attention_params&) noexcept {
  return {status_code::unsupported, "dfss cpu avx2 fused forward: this build has no AVX2 kernels"};
}

#endif

}  // namespace dfss::cpu
