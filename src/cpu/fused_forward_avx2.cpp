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
//      exactly; the scale * log2(e) factor is folded into the exp2 argument by an FMA instead.
//   2. Per row: bias, masks (-inf), the row's running maximum (the maximum of a group
//      is always kept, so the maximum over all scores is the maximum over the kept ones), then the
//      N:M selection, which also compacts the kept scores and their key indices: 1:2 and 2:4 by
//      in-register compares and permutes, any other N:M through dfss::nm_select_group.
//   3. exp2 of the compacted scores only (half the exponentials for 1:2 and 2:4), and
//      acc += p * V[index] over the kept keys only, with the accumulator row held in registers.
// Dense (N = M) runs the same code with an identity selection, so the sparsity's own speedup is
// measured against an equally optimised dense kernel.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include <cstdlib>
#include <new>

#include "core/element_access.hpp"
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

/// For 2:4 compaction: entry k (an 8-bit keep mask of two groups of 4 lanes) lists the kept lanes of
/// the low group in slots 0-1 and of the high group in slots 2-3; slots 4-7 are unused. Defined
/// before the AVX2 target region so its static initialiser runs on any x86-64 CPU.
struct compact_lut_2of4 {
  alignas(32) std::int32_t perm[256][8];
  compact_lut_2of4() {
    for (int k = 0; k < 256; ++k) {
      int slot = 0;
      for (int lane = 0; lane < 8; ++lane)
        if ((k >> lane) & 1) perm[k][slot < 4 ? slot++ : 0] = lane;
      for (int s = slot; s < 8; ++s) perm[k][s] = 0;
    }
  }
};
const compact_lut_2of4 kLut24;

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

/// Query rows per task: enough to amortise the S tile epilogue setup and small enough that the
/// task's Q (32 x dp), S (32 x W) and accumulators (32 x dp) stay in L1/L2 for d = 64.
constexpr int kRowsPerTask = 32;
/// Minimum key tile width; the real width is a multiple of lcm(M, 16) at least this wide. 64 keys of
/// K (16 KiB at d = 64) fit in L1 next to the S tile.
constexpr int kMinKeyTile = 64;
/// Widest key tile: lcm(M, 16) <= 240 for M <= 16, times 1.
constexpr int kMaxKeyTile = 256;
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

int gcd_int(int a, int b) { return b == 0 ? a : gcd_int(b, a % b); }

int key_tile_width(int m) {
  const int l = m / gcd_int(m, 16) * 16;
  return (kMinKeyTile + l - 1) / l * l;
}

/// 2^x for x <= 0 (scores minus the running maximum). Below -125 the result flushes to 0: the true
/// value is under 2.4e-38 while the row's largest term is 1. Degree-7 Taylor polynomial of 2^f on
/// |f| <= 0.5: truncation error 5e-9 relative, below half an fp32 ulp.
inline __m256 exp2_avx2(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-125.0f);
  const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_max_ps(x, lo);
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

template <typename T>
inline float load_f32(const void* base, std::int64_t off) {
  return to_float(static_cast<const T*>(base)[off]);
}

/// 32-byte aligned scratch of 4-byte elements (no std::vector here: see the target pragma above).
template <typename E>
struct aligned_buffer {
  E* ptr = nullptr;
  std::size_t size = 0;
  aligned_buffer() = default;
  aligned_buffer(const aligned_buffer&) = delete;
  aligned_buffer& operator=(const aligned_buffer&) = delete;
  void resize(std::size_t n) {
    if (n <= size) return;
    std::free(ptr);
    ptr = static_cast<E*>(std::aligned_alloc(32, (n * sizeof(E) + 31) / 32 * 32));
    if (ptr == nullptr) throw std::bad_alloc();
    size = n;
  }
  E& operator[](std::size_t i) { return ptr[i]; }
  ~aligned_buffer() { std::free(ptr); }
};

/// Per-thread state: the packed keys and values of one (batch, kv head) and the task scratch.
struct workspace {
  std::int64_t packed_b = -1, packed_hk = -1;
  aligned_buffer<float> kt, vp, q, s, acc, comp_val, row_max, row_sum;
  aligned_buffer<std::int32_t> comp_idx, row_nan;
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
        c_(static_cast<float>(p.scale) * kLog2e),
        group_(p.heads / p.heads_kv) {}

  void run() {
    const std::int64_t q_tiles = (p_.seqlen_q + kRowsPerTask - 1) / kRowsPerTask;
    const std::int64_t tasks = p_.batch * p_.heads * q_tiles;
    const int threads = p_.num_threads > 0 ? p_.num_threads : omp_get_max_threads();
#pragma omp parallel num_threads(threads)
    {
      workspace ws;
      ws.kt.resize(static_cast<std::size_t>((lk_pad_ / 16) * dp_ * 16));
      ws.vp.resize(static_cast<std::size_t>((lk_pad_ + 1) * dp_));
      ws.q.resize(static_cast<std::size_t>(kRowsPerTask * dp_));
      ws.s.resize(static_cast<std::size_t>(kRowsPerTask * w_));
      ws.acc.resize(static_cast<std::size_t>(kRowsPerTask * dp_));
      ws.comp_val.resize(static_cast<std::size_t>(w_ + 8));
      ws.comp_idx.resize(static_cast<std::size_t>(w_ + 8));
      ws.row_max.resize(kRowsPerTask);
      ws.row_sum.resize(kRowsPerTask);
      ws.row_nan.resize(kRowsPerTask);
      // Causal tasks differ in cost: hand them out dynamically. Otherwise contiguous static chunks
      // let each thread pack each (batch, kv head) once. Either way every row is computed by one
      // thread in a fixed order, so the result does not depend on the thread count.
      if (p_.causal) {
#pragma omp for schedule(dynamic, 1)
        for (std::int64_t t = 0; t < tasks; ++t) task(ws, t, q_tiles);
      } else {
#pragma omp for schedule(static)
        for (std::int64_t t = 0; t < tasks; ++t) task(ws, t, q_tiles);
      }
    }
  }

 private:
  void pack_head(workspace& ws, std::int64_t b, std::int64_t hk) {
    if (ws.packed_b == b && ws.packed_hk == hk) return;
    float* kt = ws.kt.ptr;
    float* vp = ws.vp.ptr;
    const std::int64_t lk = p_.seqlen_k;
    for (std::int64_t blk = 0; blk < lk_pad_ / 16; ++blk) {
      float* panel = kt + blk * dp_ * 16;
      for (int t = 0; t < 16; ++t) {
        const std::int64_t j = blk * 16 + t;
        for (int c = 0; c < dp_; ++c) {
          panel[c * 16 + t] = (j < lk && c < d_) ? load_f32<T>(p_.k, core::offset4(p_.k_stride, b, j, hk, c)) : 0.0f;
        }
      }
    }
    for (std::int64_t j = 0; j <= lk_pad_; ++j) {
      float* row = vp + j * dp_;
      for (int c = 0; c < dp_; ++c) {
        row[c] = (j < lk && c < d_) ? load_f32<T>(p_.v, core::offset4(p_.v_stride, b, j, hk, c)) : 0.0f;
      }
    }
    ws.packed_b = b;
    ws.packed_hk = hk;
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
    for (int i = 0; i < rows4; ++i) {
      for (int c = 0; c < dp_; ++c) {
        q[i * dp_ + c] = (i < rows && c < d_) ? load_f32<T>(p_.q, core::offset4(p_.q_stride, b, i0 + i, h, c)) : 0.0f;
      }
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
        const float lse = is_nan ? nan : (empty ? -std::numeric_limits<float>::infinity() : (c_ * mx + std::log2(sum)) * kLn2);
        core::store_from_double(p_.lse, p_.lse_type,
                                b * p_.lse_stride[0] + h * p_.lse_stride[1] + (i0 + i) * p_.lse_stride[2],
                                static_cast<double>(lse));
      }
    }
  }

  void row_epilogue(workspace& ws, std::int64_t b, std::int64_t h, std::int64_t qi, int i, std::int64_t j0) {
    const std::int64_t lim = key_limit(b, qi);
    if (j0 >= lim) return;  // the whole tile is masked for this row
    float* s = ws.s.ptr + static_cast<std::int64_t>(i) * w_;
    const float neg_inf = -std::numeric_limits<float>::infinity();
    if (p_.bias != nullptr) {
      const std::int64_t n = std::min<std::int64_t>(w_, p_.seqlen_k - j0);
      const std::int64_t base = b * p_.bias_stride[0] + h * p_.bias_stride[1] + qi * p_.bias_stride[2];
      for (std::int64_t t = 0; t < n; ++t) {
        s[t] += static_cast<float>(core::load_as_double(p_.bias, p_.bias_type, base + (j0 + t) * p_.bias_stride[3]));
      }
    }
    for (std::int64_t t = std::max<std::int64_t>(0, lim - j0); t < w_; ++t) s[t] = neg_inf;

    __m256 vmax = _mm256_set1_ps(neg_inf);
    __m256 vnan = _mm256_setzero_ps();
    for (int t = 0; t < w_; t += 8) {
      const __m256 x = _mm256_load_ps(s + t);
      vmax = _mm256_max_ps(vmax, x);
      vnan = _mm256_or_ps(vnan, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    }
    if (_mm256_movemask_ps(vnan) != 0) ws.row_nan[static_cast<std::size_t>(i)] = 1;
    const float tile_max = hmax(vmax);
    if (tile_max == neg_inf) return;
    float& mx = ws.row_max[static_cast<std::size_t>(i)];
    float& sum = ws.row_sum[static_cast<std::size_t>(i)];
    float* acc = ws.acc.ptr + static_cast<std::int64_t>(i) * dp_;
    if (tile_max > mx) {
      const float corr = mx == neg_inf ? 0.0f : std::exp2(c_ * (mx - tile_max));
      const __m256 vc = _mm256_set1_ps(corr);
      for (int c = 0; c < dp_; c += 8) _mm256_store_ps(acc + c, _mm256_mul_ps(vc, _mm256_load_ps(acc + c)));
      sum *= corr;
      mx = tile_max;
    }

    float* cv = ws.comp_val.ptr;
    std::int32_t* ci = ws.comp_idx.ptr;
    const int kept = compact(s, static_cast<std::int32_t>(j0), cv, ci);

    // exp2 of the kept scores; masked kept slots (-inf) become 0 and point at the zero value row.
    const __m256 vc = _mm256_set1_ps(c_);
    const __m256 vcm = _mm256_set1_ps(c_ * mx);
    const __m256i vzero_row = _mm256_set1_epi32(zero_row_);
    __m256 vsum = _mm256_setzero_ps();
    for (int t = 0; t < kept; t += 8) {
      const __m256 x = _mm256_load_ps(cv + t);
      const __m256 masked = _mm256_cmp_ps(x, _mm256_set1_ps(neg_inf), _CMP_EQ_OQ);
      const __m256 e = exp2_avx2(_mm256_fmsub_ps(x, vc, vcm));
      _mm256_store_ps(cv + t, e);
      vsum = _mm256_add_ps(vsum, e);
      const __m256i idx = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ci + t));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(ci + t),
                          _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(idx), _mm256_castsi256_ps(vzero_row), masked)));
    }
    sum += hsum(vsum);

    // acc += p * V[index] over the kept keys, 64 columns (8 registers) at a time.
    const float* vp = ws.vp.ptr;
    for (int c0 = 0; c0 < dp_; c0 += 64) {
      const int nv = std::min(8, (dp_ - c0) / 8);
      if (nv == 8) {
        __m256 a0 = _mm256_load_ps(acc + c0), a1 = _mm256_load_ps(acc + c0 + 8), a2 = _mm256_load_ps(acc + c0 + 16),
               a3 = _mm256_load_ps(acc + c0 + 24), a4 = _mm256_load_ps(acc + c0 + 32), a5 = _mm256_load_ps(acc + c0 + 40),
               a6 = _mm256_load_ps(acc + c0 + 48), a7 = _mm256_load_ps(acc + c0 + 56);
        for (int t = 0; t < kept; ++t) {
          const __m256 pj = _mm256_broadcast_ss(cv + t);
          const float* v = vp + static_cast<std::int64_t>(ci[t]) * dp_ + c0;
          a0 = _mm256_fmadd_ps(pj, _mm256_load_ps(v), a0);
          a1 = _mm256_fmadd_ps(pj, _mm256_load_ps(v + 8), a1);
          a2 = _mm256_fmadd_ps(pj, _mm256_load_ps(v + 16), a2);
          a3 = _mm256_fmadd_ps(pj, _mm256_load_ps(v + 24), a3);
          a4 = _mm256_fmadd_ps(pj, _mm256_load_ps(v + 32), a4);
          a5 = _mm256_fmadd_ps(pj, _mm256_load_ps(v + 40), a5);
          a6 = _mm256_fmadd_ps(pj, _mm256_load_ps(v + 48), a6);
          a7 = _mm256_fmadd_ps(pj, _mm256_load_ps(v + 56), a7);
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
          const float* v = vp + static_cast<std::int64_t>(ci[t]) * dp_ + c0;
          for (int r = 0; r < nv; ++r) {
            _mm256_store_ps(acc + c0 + 8 * r, _mm256_fmadd_ps(pj, _mm256_load_ps(v + 8 * r), _mm256_load_ps(acc + c0 + 8 * r)));
          }
        }
      }
    }
  }

  /// Selects N of every M keys of the tile row @p s and writes the kept scores and key indices to
  /// @p cv / @p ci (padded with -inf / the zero row to a multiple of 8). Returns the padded count.
  int compact(const float* s, std::int32_t j0, float* cv, std::int32_t* ci) const {
    const int n = p_.pattern_n, m = p_.pattern_m;
    int kept = 0;
    if (n == m) {
      for (int t = 0; t < w_; t += 8) {
        _mm256_store_ps(cv + t, _mm256_load_ps(s + t));
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
        _mm256_store_ps(cv + kept, _mm256_shuffle_ps(va, vb, 0x88));
        const __m256i keep_even = _mm256_castps_si256(_mm256_shuffle_ps(ka, kb, 0x88));
        // index = pair start + 1 - [even kept] (keep_even is -1 where the even key is kept).
        const __m256i idx = _mm256_add_epi32(_mm256_add_epi32(pair_base, _mm256_set1_epi32(j0 + t + 1)), keep_even);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(ci + kept), idx);
        kept += 8;
      }
    } else if (n == 2 && m == 4) {
      // Rank counting inside each 128-bit lane (one group of 4): for the rotation by r, lane p compares
      // with q = (p + r) mod 4, which ranks above p if s_q > s_p, or s_q == s_p and q < p. A lane is
      // kept iff fewer than two rank above it.
      const __m256 ge1 = _mm256_castsi256_ps(_mm256_setr_epi32(0, 0, 0, -1, 0, 0, 0, -1));
      const __m256 ge2 = _mm256_castsi256_ps(_mm256_setr_epi32(0, 0, -1, -1, 0, 0, -1, -1));
      const __m256 ge3 = _mm256_castsi256_ps(_mm256_setr_epi32(0, -1, -1, -1, 0, -1, -1, -1));
      __m256i sel[2];
      __m256 val[2];
      for (int t = 0; t < w_; t += 16) {
        for (int half = 0; half < 2; ++half) {
          const __m256 x = _mm256_load_ps(s + t + 8 * half);
          const __m256 r1 = _mm256_permute_ps(x, 0x39), r2 = _mm256_permute_ps(x, 0x4E), r3 = _mm256_permute_ps(x, 0x93);
          const __m256 a1 = _mm256_blendv_ps(_mm256_cmp_ps(r1, x, _CMP_GT_OQ), _mm256_cmp_ps(r1, x, _CMP_GE_OQ), ge1);
          const __m256 a2 = _mm256_blendv_ps(_mm256_cmp_ps(r2, x, _CMP_GT_OQ), _mm256_cmp_ps(r2, x, _CMP_GE_OQ), ge2);
          const __m256 a3 = _mm256_blendv_ps(_mm256_cmp_ps(r3, x, _CMP_GT_OQ), _mm256_cmp_ps(r3, x, _CMP_GE_OQ), ge3);
          const __m256i above = _mm256_add_epi32(_mm256_add_epi32(_mm256_castps_si256(a1), _mm256_castps_si256(a2)),
                                                 _mm256_castps_si256(a3));
          const __m256i keep = _mm256_cmpgt_epi32(above, _mm256_set1_epi32(-2));
          const int mask = _mm256_movemask_ps(_mm256_castsi256_ps(keep));
          sel[half] = _mm256_load_si256(reinterpret_cast<const __m256i*>(kLut24.perm[mask]));
          val[half] = _mm256_permutevar8x32_ps(x, sel[half]);
        }
        _mm256_store_ps(cv + kept, _mm256_permute2f128_ps(val[0], val[1], 0x20));
        const __m256i idx = _mm256_permute2x128_si256(sel[0], _mm256_add_epi32(sel[1], _mm256_set1_epi32(8)), 0x20);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(ci + kept), _mm256_add_epi32(idx, _mm256_set1_epi32(j0 + t)));
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
    }
    return kept;
  }

  const attention_params& p_;
  const int d_, dp_, w_;
  const std::int64_t lk_pad_;
  const std::int32_t zero_row_;
  const float c_;  ///< scale * log2(e): exp(scale * x) = exp2(c_ * x)
  const std::int64_t group_;
};

}  // namespace

status fused_forward_avx2(const attention_params& p) noexcept {
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

#else

status fused_forward_avx2(const attention_params&) noexcept {
  return {status_code::unsupported, "dfss cpu avx2 fused forward: this build has no AVX2 kernels"};
}

#endif

}  // namespace dfss::cpu
