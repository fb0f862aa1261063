// Portable-SIMD fused DFSS forward: the fast path for CPUs without AVX2 (ARM in particular).
//
// Same algorithm and data layout as fused_forward_avx2.cpp (packed 16-key K panels and V rows per
// (batch, kv head), tasks of 32 query rows, a 4 x 16 register-blocked Q K^T micro-kernel, online
// softmax over the kept scores only, P V over the kept keys with the accumulator row in registers),
// written with GCC/Clang vector extensions instead of intrinsics: an 8-float vector type that the
// compiler maps to two NEON registers on AArch64, two SSE registers on baseline x86-64, and so on.
// The N:M selection runs through the scalar functions of dfss/format/nm_select.hpp, group by group;
// it is the only part not vectorised (cheap next to the two matrix products).
//
// The portable backward (fused_backward_portable) is a member of the same class, the twin of the
// AVX2 backward: one task per (batch, kv head) packs K and V (panels and rows) once; per 32-row
// query tile and key tile it recomputes S with the forward's micro-kernel (never inlined, so both
// directions run one machine-code instance of it) and selects with the forward's bias_and_mask and
// compact, so it keeps exactly the keys the portable forward kept. dP = dO V^T runs on the same
// micro-kernel over V^T panels; P = exp(scale S - LSE) from the forward's LSE (or, for
// |LSE| > kDirectLseLimit, from the row's own maximum and sum); dS = P (dP - D) with
// D = rowsum(dO O); dQ accumulates in registers over the kept keys, dK and dV in the task's buffers
// in a fixed order (heads, then rows), so gradients are bitwise identical for any thread count.
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <new>
#include <type_traits>

#include "core/element_access.hpp"
#include "cpu/fused_common.hpp"
#include "cpu/fused_forward.hpp"
#include "dfss/format/nm_select.hpp"
#include "dfss/numeric.hpp"

namespace dfss::cpu {
namespace {

using namespace fused;

using v8f = float __attribute__((vector_size(32)));
using v8i = std::int32_t __attribute__((vector_size(32)));


inline v8f splat(float x) { return v8f{x, x, x, x, x, x, x, x}; }
inline v8f load8(const float* p) {
  v8f v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void store8(float* p, v8f v) { std::memcpy(p, &v, sizeof v); }


/// 2^x for x <= 127 (a larger x would wrap the exponent field), as in the AVX2 kernel: the
/// forward's exponents scale (s - max) log2(e) are <= 0 by construction, the backward clamps its own
/// (exp2_v8_clamped). Below -125 flush to 0; degree-7 polynomial on the fraction. Rounding to the
/// nearest integer uses the 1.5 * 2^23 trick (exact for |x| < 2^22). A NaN x gives an unspecified
/// value (the bit arithmetic mixes its payload into the exponent field): the forward replaces a NaN
/// row's output, and the backward uses exp2_v8_clamped.
inline v8f exp2_v8(v8f x) {
  const v8f lo = splat(-125.0f);
  const v8i under = x < lo;
  x = under ? lo : x;
  const v8f magic = splat(12582912.0f);
  const v8f shifted = x + magic;
  const v8f n = shifted - magic;
  const v8f f = x - n;
  v8f p = splat(1.5252734e-05f);
  p = p * f + splat(1.5403530e-04f);
  p = p * f + splat(1.3333558e-03f);
  p = p * f + splat(9.6181291e-03f);
  p = p * f + splat(5.5504109e-02f);
  p = p * f + splat(2.4022651e-01f);
  p = p * f + splat(6.9314718e-01f);
  p = p * f + splat(1.0f);
  v8i ni, pi;
  std::memcpy(&ni, &shifted, sizeof ni);
  std::memcpy(&pi, &p, sizeof pi);
  const v8i magic_bits = v8i{} + 0x4B400000;  // the bits of 1.5 * 2^23: its low bits hold n
  pi = pi + ((ni - magic_bits) << 23);
  pi = pi & ~under;
  v8f r;
  std::memcpy(&r, &pi, sizeof r);
  return r;
}

/// exp2_v8 for any x: above 127 it saturates at 2^127 (the backward's scale s - LSE exceeds 0 only
/// by rounding, unless the caller's LSE is not the forward's), and a NaN stays NaN.
inline v8f exp2_v8_clamped(v8f x) {
  const v8f hi = splat(127.0f);
  const v8f r = exp2_v8(x > hi ? hi : x);
  return x != x ? x : r;
}



/// Per-thread state: the packed keys and values of one (batch, kv head) and the task scratch.
struct workspace {
  std::int64_t packed_b = -1, packed_hk = -1;
  aligned_buffer<float> kt, vp, q, s, acc, cv, row_max, row_sum;
  aligned_buffer<std::int32_t> ci, row_nan;
  // Backward only: K rows, V^T panels, dK and dV accumulators of the (batch, kv head), the dO tile
  // and its dP tile, per-row D = rowsum(dO * O) and LSE * log2(e), and the kept probabilities and
  // scaled dS of one row tile.
  aligned_buffer<float> kr, vt, dk, dv, dout, dps, row_d, row_lse2, cp, cds;
  // Backward with a broadcast dbias only: the dbias rows of one query tile, [32][seqlen_k].
  aligned_buffer<float> dbias_acc;
};

template <typename T>
class fused_portable {
 public:
  explicit fused_portable(const attention_params& p)
      : p_(p),
        d_(static_cast<int>(p.head_dim)),
        dp_((d_ + 7) / 8 * 8),
        w_(key_tile_width(p.pattern_m)),
        lk_pad_((p.seqlen_k + w_ - 1) / w_ * w_),
        scale_(static_cast<float>(p.scale)),
        e1_(std::isfinite(scale_ * kLog2e) ? scale_ * kLog2e : scale_),
        e2_(std::isfinite(scale_ * kLog2e) ? 1.0f : kLog2e),
        group_(p.heads / p.heads_kv),
        dbias_broadcast_(p.dbias != nullptr && ((p.dbias_stride[0] == 0 && p.batch > 1) ||
                                                (p.dbias_stride[1] == 0 && p.heads > 1))) {}

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
      const auto panels = static_cast<std::size_t>(lk_pad_ * dp_);
      const auto tile_rows = static_cast<std::size_t>(kRowsPerTask * dp_);
      const auto tile_scores = static_cast<std::size_t>(kRowsPerTask * w_);
      const auto compact = static_cast<std::size_t>(w_ + 8);
      ws.kt.resize(panels);
      ws.vp.resize(rows_pad);
      ws.q.resize(tile_rows);
      ws.s.resize(tile_scores);
      ws.acc.resize(tile_rows);
      ws.cv.resize(compact);
      ws.ci.resize(compact);
      ws.row_max.resize(kRowsPerTask);
      ws.row_sum.resize(kRowsPerTask);
      ws.row_nan.resize(kRowsPerTask);
      if (backward) {
        ws.kr.resize(rows_pad);
        ws.vt.resize(panels);
        ws.dk.resize(rows_pad);
        ws.dv.resize(rows_pad);
        ws.dout.resize(tile_rows);
        ws.dps.resize(tile_scores);
        ws.row_d.resize(kRowsPerTask);
        ws.row_lse2.resize(kRowsPerTask);
        ws.cp.resize(compact);
        ws.cds.resize(compact);
        if (dbias_broadcast_) ws.dbias_acc.resize(static_cast<std::size_t>(kRowsPerTask * p_.seqlen_k));
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

  /// Backward pass (see fused_backward_portable): one task per (batch, kv head), each writing only
  /// its own dK, dV rows and its heads' dQ (and dBias) rows.
  void run_backward() {
    const std::int64_t tasks = p_.batch * p_.heads_kv;
    const int threads = p_.num_threads > 0 ? p_.num_threads : omp_get_max_threads();
    std::atomic<bool> out_of_memory{false};
#pragma omp parallel num_threads(threads)
    {
      workspace& ws = thread_workspace();
      const bool ready = reserve(ws, /*backward=*/true);
      if (!ready) out_of_memory = true;
#pragma omp for schedule(static)
      for (std::int64_t t = 0; t < tasks; ++t)
        if (ready) backward_task(ws, t);
      if (dbias_broadcast_) run_dbias_pass(ws, ready);
    }
    if (out_of_memory) throw std::bad_alloc();
  }

  /// A dbias with broadcast dimensions: one task per (dbias batch, dbias head, 32-row query tile)
  /// sums scale dS over the (batch, head) pairs it broadcasts to, in increasing (batch, head) order,
  /// recomputing each pair's tile as backward_tile does; each dbias row is written by one thread.
  /// Called inside run_backward's parallel region (the worksharing loop's barrier separates it from
  /// the main pass).
  void run_dbias_pass(workspace& ws, bool ready) {
    const std::int64_t q_tiles = (p_.seqlen_q + kRowsPerTask - 1) / kRowsPerTask;
    const std::int64_t hb_count = p_.dbias_stride[1] == 0 ? 1 : p_.heads;
    const std::int64_t tasks = (p_.dbias_stride[0] == 0 ? 1 : p_.batch) * hb_count * q_tiles;
#pragma omp for schedule(static)
    for (std::int64_t t = 0; t < tasks; ++t) {
      if (!ready) continue;
      const std::int64_t qt = t % q_tiles, hb = (t / q_tiles) % hb_count, bb = t / (q_tiles * hb_count);
      const std::int64_t i0 = qt * kRowsPerTask;
      const int rows = static_cast<int>(std::min<std::int64_t>(kRowsPerTask, p_.seqlen_q - i0));
      const std::int64_t b_lo = p_.dbias_stride[0] == 0 ? 0 : bb, b_hi = p_.dbias_stride[0] == 0 ? p_.batch : bb + 1;
      const std::int64_t h_lo = hb_count == 1 ? 0 : hb, h_hi = hb_count == 1 ? p_.heads : hb + 1;
      std::fill(ws.dbias_acc.ptr, ws.dbias_acc.ptr + rows * p_.seqlen_k, 0.0f);
      for (std::int64_t b = b_lo; b < b_hi; ++b) {
        for (std::int64_t h = h_lo; h < h_hi; ++h) {
          if (ws.packed_b != b || ws.packed_hk != h / group_) {
            pack_head(ws, b, h / group_);
            pack_vt(ws);
          }
          backward_tile(ws, b, h, i0, ws.dbias_acc.ptr);
        }
      }
      for (int i = 0; i < rows; ++i) {
        const std::int64_t row = bb * p_.dbias_stride[0] + hb * p_.dbias_stride[1] + (i0 + i) * p_.dbias_stride[2];
        const float* acc = ws.dbias_acc.ptr + static_cast<std::int64_t>(i) * p_.seqlen_k;
        for (std::int64_t j = 0; j < p_.seqlen_k; ++j) {
          core::store_from_double(p_.dbias, p_.bias_type, row + j * p_.dbias_stride[3], static_cast<double>(acc[j]));
        }
      }
    }
  }

 private:
  void load_row(const void* base, const std::int64_t* st, std::int64_t b, std::int64_t j, std::int64_t h,
                bool valid, float* out) const {
    if (!valid) {
      std::fill(out, out + dp_, 0.0f);
      return;
    }
    const std::int64_t off = core::offset4(st, b, j, h, 0);
    for (int c = 0; c < d_; ++c) out[c] = load_f32<T>(base, off + c * st[3]);
    std::fill(out + d_, out + dp_, 0.0f);
  }

  void pack_head(workspace& ws, std::int64_t b, std::int64_t hk) {
    if (ws.packed_b == b && ws.packed_hk == hk) return;
    float* row = ws.q.ptr;
    for (std::int64_t blk = 0; blk < lk_pad_ / 16; ++blk) {
      float* panel = ws.kt.ptr + blk * dp_ * 16;
      for (int t = 0; t < 16; ++t) {
        const std::int64_t j = blk * 16 + t;
        load_row(p_.k, p_.k_stride, b, j, hk, j < p_.seqlen_k, row);
        for (int c = 0; c < dp_; ++c) panel[c * 16 + t] = row[c];
      }
    }
    for (std::int64_t j = 0; j <= lk_pad_; ++j) load_row(p_.v, p_.v_stride, b, j, hk, j < p_.seqlen_k, ws.vp.ptr + j * dp_);
    ws.packed_b = b;
    ws.packed_hk = hk;
  }

  std::int64_t key_limit(std::int64_t b, std::int64_t qi) const {
    std::int64_t lim = core::valid_keys(p_, b);
    if (p_.causal) lim = std::min(lim, qi + (p_.seqlen_k - p_.seqlen_q) + 1);
    return lim;
  }

  /// S[4][16] (row stride w_) = Q[4][dp] (row stride dp_) x panel[dp][16]. The one score
  /// computation of the portable forward and backward (and the backward's dP = dO V^T). Never
  /// inlined: with -ffp-contract=fast the compiler decides where a * b + c becomes an FMA, and a
  /// single machine-code instance makes that decision once for both directions, so the backward's
  /// scores are bitwise the forward's.
  [[gnu::noinline]] void microkernel_4x16(const float* q, const float* kt, float* s) const {
    v8f c00{}, c01{}, c10{}, c11{}, c20{}, c21{}, c30{}, c31{};
    for (int c = 0; c < dp_; ++c) {
      const v8f b0 = load8(kt + c * 16), b1 = load8(kt + c * 16 + 8);
      const v8f a0 = splat(q[c]), a1 = splat(q[dp_ + c]), a2 = splat(q[2 * dp_ + c]), a3 = splat(q[3 * dp_ + c]);
      c00 += a0 * b0;
      c01 += a0 * b1;
      c10 += a1 * b0;
      c11 += a1 * b1;
      c20 += a2 * b0;
      c21 += a2 * b1;
      c30 += a3 * b0;
      c31 += a3 * b1;
    }
    store8(s, c00);
    store8(s + 8, c01);
    store8(s + w_, c10);
    store8(s + w_ + 8, c11);
    store8(s + 2 * w_, c20);
    store8(s + 2 * w_ + 8, c21);
    store8(s + 3 * w_, c30);
    store8(s + 3 * w_ + 8, c31);
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
    for (int i = 0; i < rows4; ++i) load_row(p_.q, p_.q_stride, b, i0 + i, h, i < rows, ws.q.ptr + i * dp_);
    std::fill(ws.acc.ptr, ws.acc.ptr + rows * dp_, 0.0f);
    std::int64_t tile_end = 0;
    for (int i = 0; i < rows; ++i) {
      ws.row_max.ptr[i] = -std::numeric_limits<float>::infinity();
      ws.row_sum.ptr[i] = 0.0f;
      ws.row_nan.ptr[i] = 0;
      tile_end = std::max(tile_end, key_limit(b, i0 + i));
    }
    for (std::int64_t j0 = 0; j0 < tile_end; j0 += w_) {
      for (int i = 0; i < rows4; i += 4) {
        for (int jb = 0; jb < w_; jb += 16) {
          microkernel_4x16(ws.q.ptr + i * dp_, ws.kt.ptr + ((j0 + jb) / 16) * dp_ * 16, ws.s.ptr + i * w_ + jb);
        }
      }
      for (int i = 0; i < rows; ++i) row_epilogue(ws, b, h, i0 + i, i, j0);
    }
    const float nan = std::numeric_limits<float>::quiet_NaN();
    const float neg_inf = -std::numeric_limits<float>::infinity();
    for (int i = 0; i < rows; ++i) {
      const float mx = ws.row_max.ptr[i], sum = ws.row_sum.ptr[i];
      const bool is_nan = ws.row_nan.ptr[i] != 0, empty = mx == neg_inf;
      const float inv = empty ? 0.0f : 1.0f / sum;
      const float* acc = ws.acc.ptr + i * dp_;
      for (int c = 0; c < d_; ++c) {
        core::store_from_double(p_.o, p_.output_type, core::offset4(p_.o_stride, b, i0 + i, h, c),
                                static_cast<double>(is_nan ? nan : acc[c] * inv));
      }
      if (p_.lse != nullptr) {
        // scale * max overflows to +-inf exactly where the reference's LSE, rounded to fp32, does.
        const float lse = is_nan ? nan : (empty ? neg_inf : scale_ * mx + std::log2(sum) * kLn2);
        core::store_from_double(p_.lse, p_.lse_type, b * p_.lse_stride[0] + h * p_.lse_stride[1] + (i0 + i) * p_.lse_stride[2],
                                static_cast<double>(lse));
      }
    }
  }

  /// Adds the bias to the tile row @p s of query qi and sets masked keys (j >= lim) to -inf.
  void bias_and_mask(float* s, std::int64_t b, std::int64_t h, std::int64_t qi, std::int64_t j0, std::int64_t lim) const {
    if (p_.bias != nullptr) {
      const std::int64_t n = std::min<std::int64_t>(w_, p_.seqlen_k - j0);
      const std::int64_t base = b * p_.bias_stride[0] + h * p_.bias_stride[1] + qi * p_.bias_stride[2];
      for (std::int64_t t = 0; t < n; ++t) {
        s[t] += static_cast<float>(core::load_as_double(p_.bias, p_.bias_type, base + (j0 + t) * p_.bias_stride[3]));
      }
    }
    for (std::int64_t t = std::max<std::int64_t>(0, lim - j0); t < w_; ++t) s[t] = -std::numeric_limits<float>::infinity();
  }

  /// Selection and compaction (the one selection rule) of the tile row @p s: the kept scores and key
  /// indices go to @p cv / @p ci (a kept -inf points at the zero row), padded with -inf / the zero
  /// row to a multiple of 8. @p tile_max receives the largest kept score; @p nan is set when a kept
  /// score is NaN or +inf (either makes the row NaN, docs/semantics.md "Non-finite and extreme
  /// inputs"; a NaN ranks highest and a +inf is pruned only for another +inf or a NaN, so a row
  /// with one always keeps one). Returns the count.
  int compact(const float* s, std::int64_t j0, float* cv, std::int32_t* ci, float& tile_max, bool& nan) const {
    const float neg_inf = -std::numeric_limits<float>::infinity();
    const int n = p_.pattern_n, m = p_.pattern_m;
    const std::int32_t zero_row = static_cast<std::int32_t>(lk_pad_);
    int kept = 0;
    tile_max = neg_inf;
    for (int g = 0; g < w_; g += m) {
      const std::uint32_t keep = n == m ? (1u << m) - 1u
                                        : (n == 1 && m == 2 ? nm_select_1of2(s + g)
                                                            : (n == 2 && m == 4 ? nm_select_2of4(s + g) : nm_select_group(s + g, m, n, m)));
      for (int q = 0; q < m; ++q) {
        if (!((keep >> q) & 1u)) continue;
        const float x = s[g + q];
        if (x != x) nan = true;
        tile_max = x > tile_max ? x : tile_max;
        cv[kept] = x;
        ci[kept] = x == neg_inf ? zero_row : static_cast<std::int32_t>(j0 + g + q);
        ++kept;
      }
    }
    for (; kept % 8 != 0; ++kept) {
      cv[kept] = neg_inf;
      ci[kept] = zero_row;
    }
    if (tile_max == std::numeric_limits<float>::infinity()) nan = true;
    return kept;
  }

  void row_epilogue(workspace& ws, std::int64_t b, std::int64_t h, std::int64_t qi, int i, std::int64_t j0) {
    const std::int64_t lim = key_limit(b, qi);
    if (j0 >= lim) return;
    float* s = ws.s.ptr + static_cast<std::int64_t>(i) * w_;
    const float neg_inf = -std::numeric_limits<float>::infinity();
    bias_and_mask(s, b, h, qi, j0, lim);
    float* cv = ws.cv.ptr;
    std::int32_t* ci = ws.ci.ptr;
    float tile_max = neg_inf;
    bool nan = false;
    const int kept = compact(s, j0, cv, ci, tile_max, nan);
    if (nan) ws.row_nan.ptr[i] = 1;
    if (tile_max == neg_inf) return;
    float& mx = ws.row_max.ptr[i];
    float& sum = ws.row_sum.ptr[i];
    float* acc = ws.acc.ptr + static_cast<std::int64_t>(i) * dp_;
    if (tile_max > mx) {
      const float corr = mx == neg_inf ? 0.0f : std::exp2(((mx - tile_max) * e1_) * e2_);
      for (int c = 0; c < dp_; ++c) acc[c] *= corr;
      sum *= corr;
      mx = tile_max;
    }
    // scale (x - max) log2(e), not x c - max c (see the AVX2 kernel's exp_kept); the second
    // multiply only for a scale above float max / log2(e).
    const v8f vmx = splat(mx), ve1 = splat(e1_), ve2 = splat(e2_);
    v8f vsum{};
    if (e2_ == 1.0f) {
      for (int t = 0; t < kept; t += 8) {
        const v8f e = exp2_v8((load8(cv + t) - vmx) * ve1);
        store8(cv + t, e);
        vsum += e;
      }
    } else {
      for (int t = 0; t < kept; t += 8) {
        const v8f e = exp2_v8(((load8(cv + t) - vmx) * ve1) * ve2);
        store8(cv + t, e);
        vsum += e;
      }
    }
    for (int l = 0; l < 8; ++l) sum += vsum[l];

    const float* vp = ws.vp.ptr;
    for (int c0 = 0; c0 < dp_; c0 += 64) {
      const int nv = std::min(8, (dp_ - c0) / 8);
      v8f a[8];
      for (int r = 0; r < nv; ++r) a[r] = load8(acc + c0 + 8 * r);
      for (int t = 0; t < kept; ++t) {
        const v8f pj = splat(cv[t]);
        const float* v = vp + static_cast<std::int64_t>(ci[t]) * dp_ + c0;
        for (int r = 0; r < nv; ++r) a[r] += pj * load8(v + 8 * r);
      }
      for (int r = 0; r < nv; ++r) store8(acc + c0 + 8 * r, a[r]);
    }
  }

  /// V^T of the packed head in 16-key panels like K, so that dP = dO V^T runs on the same
  /// micro-kernel as S = Q K^T.
  void pack_vt(workspace& ws) const {
    for (std::int64_t blk = 0; blk < lk_pad_ / 16; ++blk) {
      float* panel = ws.vt.ptr + blk * dp_ * 16;
      for (int key = 0; key < 16; ++key) {
        const float* row = ws.vp.ptr + (blk * 16 + key) * dp_;
        for (int c = 0; c < dp_; ++c) panel[c * 16 + key] = row[c];
      }
    }
  }

  void backward_task(workspace& ws, std::int64_t t) {
    const std::int64_t b = t / p_.heads_kv, hk = t % p_.heads_kv;
    pack_head(ws, b, hk);
    pack_vt(ws);
    for (std::int64_t j = 0; j <= lk_pad_; ++j) load_row(p_.k, p_.k_stride, b, j, hk, j < p_.seqlen_k, ws.kr.ptr + j * dp_);
    std::fill(ws.dk.ptr, ws.dk.ptr + (lk_pad_ + 1) * dp_, 0.0f);
    std::fill(ws.dv.ptr, ws.dv.ptr + (lk_pad_ + 1) * dp_, 0.0f);
    const std::int64_t q_tiles = (p_.seqlen_q + kRowsPerTask - 1) / kRowsPerTask;
    for (std::int64_t h = hk * group_; h < (hk + 1) * group_; ++h) {
      for (std::int64_t qt = 0; qt < q_tiles; ++qt) backward_tile(ws, b, h, qt * kRowsPerTask, nullptr);
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

  /// Query rows i0 .. i0 + 31 of head h: dQ (and dBias without broadcast dimensions) written, dK
  /// and dV accumulated. With @p dbias_acc ([32][seqlen_k]) it only adds the tile's scale dS to it
  /// (the broadcast dbias pass). Per row, P = exp2((scale (s - shift)) log2(e) - offset) with
  /// shift = 0 and offset = LSE log2(e) while |LSE| <= kDirectLseLimit; for the other rows (large or
  /// overflowed scores) row_statistics first finds the row's maximum m and sum l: shift = m,
  /// offset = log2(l).
  void backward_tile(workspace& ws, std::int64_t b, std::int64_t h, std::int64_t i0, float* dbias_acc) {
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
    if (p_.dbias != nullptr && !dbias_broadcast_) {
      for (int i = 0; i < rows; ++i) {
        const std::int64_t row = b * p_.dbias_stride[0] + h * p_.dbias_stride[1] + (i0 + i) * p_.dbias_stride[2];
        for (std::int64_t j = 0; j < p_.seqlen_k; ++j) core::store_from_double(p_.dbias, p_.bias_type, row + j * p_.dbias_stride[3], 0.0);
      }
    }
    for (std::int64_t j0 = 0; j0 < tile_end; j0 += w_) {
      for (int i = 0; i < rows4; i += 4) {
        for (int jb = 0; jb < w_; jb += 16) {
          const std::int64_t panel = ((j0 + jb) / 16) * dp_ * 16;
          microkernel_4x16(q + i * dp_, ws.kt.ptr + panel, ws.s.ptr + i * w_ + jb);
          microkernel_4x16(dout + i * dp_, ws.vt.ptr + panel, ws.dps.ptr + i * w_ + jb);
        }
      }
      for (int i = 0; i < rows; ++i) {
        backward_row(ws, b, h, i0 + i, i, j0, dbias_acc == nullptr ? nullptr : dbias_acc + static_cast<std::int64_t>(i) * p_.seqlen_k);
      }
    }
    if (dbias_acc != nullptr) return;
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
    const v8f ve1 = splat(e1_), ve2 = splat(e2_);
    for (std::int64_t j0 = 0; j0 < tile_end; j0 += w_) {
      for (int i = 0; i < rows4; i += 4) {
        for (int jb = 0; jb < w_; jb += 16) {
          microkernel_4x16(ws.q.ptr + i * dp_, ws.kt.ptr + ((j0 + jb) / 16) * dp_ * 16, ws.s.ptr + i * w_ + jb);
        }
      }
      for (std::uint32_t r = rows_mask; r != 0; r &= r - 1) {
        const int i = __builtin_ctz(r);
        const std::int64_t lim = key_limit(b, i0 + i);
        if (j0 >= lim || ws.row_nan.ptr[i] != 0) continue;
        float* s = ws.s.ptr + static_cast<std::int64_t>(i) * w_;
        bias_and_mask(s, b, h, i0 + i, j0, lim);
        float tile_max = neg_inf;
        bool nan = false;
        const int kept = compact(s, j0, ws.cv.ptr, ws.ci.ptr, tile_max, nan);
        if (nan) {
          ws.row_nan.ptr[i] = 1;
          continue;
        }
        if (tile_max == neg_inf) continue;
        float& mx = ws.row_max.ptr[i];
        float& sum = ws.row_sum.ptr[i];
        if (tile_max > mx) {
          sum = mx == neg_inf ? 0.0f : sum * std::exp2(((mx - tile_max) * e1_) * e2_);
          mx = tile_max;
        }
        const v8f vmx = splat(mx);
        v8f vsum{};
        for (int t = 0; t < kept; t += 8) vsum += exp2_v8(((load8(ws.cv.ptr + t) - vmx) * ve1) * ve2);
        for (int l = 0; l < 8; ++l) sum += vsum[l];
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
  /// dQ += scale dS K, dK += scale dS q, dV += P dO, dBias = scale dS. With @p dbias_acc (the row's
  /// [seqlen_k] sums) only dBias, added there.
  void backward_row(workspace& ws, std::int64_t b, std::int64_t h, std::int64_t qi, int i, std::int64_t j0,
                    float* dbias_acc) {
    const std::int64_t lim = key_limit(b, qi);
    const float offset = ws.row_lse2.ptr[i];
    const bool want_dbias = dbias_acc != nullptr || (p_.dbias != nullptr && !dbias_broadcast_);
    // Empty rows (offset -inf) have zero gradients.
    if (j0 >= lim || offset == -std::numeric_limits<float>::infinity()) return;
    float* s = ws.s.ptr + static_cast<std::int64_t>(i) * w_;
    bias_and_mask(s, b, h, qi, j0, lim);
    float* cv = ws.cv.ptr;
    std::int32_t* ci = ws.ci.ptr;
    float tile_max = 0.0f;
    bool nan = false;
    const int kept = compact(s, j0, cv, ci, tile_max, nan);
    const std::int64_t dbias_row = b * p_.dbias_stride[0] + h * p_.dbias_stride[1] + qi * p_.dbias_stride[2];
    const auto add_dbias = [&](std::int64_t j, float x) {
      if (dbias_acc != nullptr) {
        dbias_acc[j] += x;
      } else if (want_dbias) {
        core::store_from_double(p_.dbias, p_.bias_type, dbias_row + j * p_.dbias_stride[3], static_cast<double>(x));
      }
    };
    if (nan) ws.row_nan.ptr[i] = 1;
    float* cp = ws.cp.ptr;
    float* cds = ws.cds.ptr;
    const std::int32_t zero_row = static_cast<std::int32_t>(lk_pad_);
    if (ws.row_nan.ptr[i] != 0) {
      // A NaN row: P and dS are NaN at every kept key that is not masked (as in the reference), so
      // the NaN reaches exactly those keys' dK, dV and dBias; the dQ row is written NaN anyway.
      const float qnan = std::numeric_limits<float>::quiet_NaN();
      for (int t = 0; t < kept; ++t) cp[t] = cds[t] = ci[t] == zero_row ? 0.0f : qnan;
    } else {
      const float* dp_row = ws.dps.ptr + static_cast<std::int64_t>(i) * w_;
      const float d_row = ws.row_d.ptr[i];
      // P of the kept keys (a kept -inf and the padding slots: exp2(-inf) = 0).
      const v8f vshift = splat(ws.row_max.ptr[i]), ve1 = splat(e1_), ve2 = splat(e2_), voffset = splat(offset);
      for (int t = 0; t < kept; t += 8) store8(cp + t, exp2_v8_clamped(((load8(cv + t) - vshift) * ve1) * ve2 - voffset));
      for (int t = 0; t < kept; ++t) {
        // Slots with P = 0 point at the zero row, past the tile: they are skipped below, so dS is 0.
        const std::int64_t local = static_cast<std::int64_t>(ci[t]) - j0;
        cds[t] = cp[t] == 0.0f || local >= w_ ? 0.0f : scale_ * (cp[t] * (dp_row[local] - d_row));
      }
    }
    if (dbias_acc != nullptr) {
      for (int t = 0; t < kept; ++t)
        if (cp[t] != 0.0f) add_dbias(ci[t], cds[t]);
      return;
    }
    const float* dout = ws.dout.ptr + static_cast<std::int64_t>(i) * dp_;
    const float* qrow = ws.q.ptr + static_cast<std::int64_t>(i) * dp_;
    float* dq = ws.acc.ptr + static_cast<std::int64_t>(i) * dp_;
    // dQ += scale dS K over the kept keys, the dQ row held in registers (64 columns at a time).
    for (int c0 = 0; c0 < dp_; c0 += 64) {
      const int nv = std::min(8, (dp_ - c0) / 8);
      v8f a[8];
      for (int r = 0; r < nv; ++r) a[r] = load8(dq + c0 + 8 * r);
      for (int t = 0; t < kept; ++t) {
        if (cp[t] == 0.0f) continue;  // masked, or underflowed: no contribution
        const v8f sds = splat(cds[t]);
        const float* krow = ws.kr.ptr + static_cast<std::int64_t>(ci[t]) * dp_ + c0;
        for (int r = 0; r < nv; ++r) a[r] += sds * load8(krow + 8 * r);
      }
      for (int r = 0; r < nv; ++r) store8(dq + c0 + 8 * r, a[r]);
    }
    // dK += scale dS^T q and dV += P^T dO for the kept keys (accumulated in the task's buffers).
    for (int t = 0; t < kept; ++t) {
      if (cp[t] == 0.0f) continue;
      const std::int64_t j = ci[t];
      const v8f sds = splat(cds[t]), pj = splat(cp[t]);
      float* dkrow = ws.dk.ptr + j * dp_;
      float* dvrow = ws.dv.ptr + j * dp_;
      for (int c = 0; c < dp_; c += 8) {
        store8(dkrow + c, load8(dkrow + c) + sds * load8(qrow + c));
        store8(dvrow + c, load8(dvrow + c) + pj * load8(dout + c));
      }
      add_dbias(j, cds[t]);
    }
  }

  const attention_params& p_;
  const int d_, dp_, w_;
  const std::int64_t lk_pad_;
  const float scale_;
  /// exp(scale * x) = exp2((x * e1_) * e2_): e1_ = scale log2(e) and e2_ = 1, or, when scale
  /// log2(e) overflows fp32, e1_ = scale and e2_ = log2(e) (as in the AVX2 kernel).
  const float e1_, e2_;
  const std::int64_t group_;
  /// dbias sums over a broadcast batch or head dimension: written by run_dbias_pass, not the tasks.
  const bool dbias_broadcast_;
};

}  // namespace

status fused_forward_portable(const attention_params& p) noexcept {
  try {
    switch (p.input_type) {
      case dtype::f32: fused_portable<float>(p).run(); break;
      case dtype::f16: fused_portable<half>(p).run(); break;
      case dtype::bf16: fused_portable<bfloat16>(p).run(); break;
      default:
        return {status_code::unsupported, std::string("dfss cpu portable fused forward: input type ") +
                                              dtype_name(p.input_type) + " (takes f32, f16, bf16)"};
    }
  } catch (const std::bad_alloc&) {
    return {status_code::internal, "dfss cpu portable fused forward: out of memory for the packed keys and values"};
  }
  return status::success();
}

status fused_backward_portable(const attention_params& p) noexcept {
  // Kept keys are int32 indices into the packed rows (up to seqlen_k rounded up to a key tile).
  if (p.seqlen_k + kMaxKeyTile + 1 > std::numeric_limits<std::int32_t>::max()) {
    return {status_code::unsupported, "dfss cpu portable backward: seqlen_k above 2^31 - 258"};
  }
  if (p.o == nullptr || p.lse == nullptr) {
    return {status_code::internal, "dfss cpu portable backward: called without the forward's output and LSE"};
  }
  try {
    switch (p.input_type) {
      case dtype::f32: fused_portable<float>(p).run_backward(); break;
      case dtype::f16: fused_portable<half>(p).run_backward(); break;
      case dtype::bf16: fused_portable<bfloat16>(p).run_backward(); break;
      default:
        return {status_code::unsupported, std::string("dfss cpu portable backward: input type ") +
                                              dtype_name(p.input_type) + " (takes f32, f16, bf16)"};
    }
  } catch (const std::bad_alloc&) {
    return {status_code::internal, "dfss cpu portable backward: out of memory for the packed keys and values"};
  }
  return status::success();
}

}  // namespace dfss::cpu
