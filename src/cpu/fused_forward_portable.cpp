// Portable-SIMD fused DFSS forward: the fast path for CPUs without AVX2 (ARM in particular).
//
// Same algorithm and data layout as fused_forward_avx2.cpp (packed 16-key K panels and V rows per
// (batch, kv head), tasks of 32 query rows, a 4 x 16 register-blocked Q K^T micro-kernel, online
// softmax over the kept scores only, P V over the kept keys with the accumulator row in registers),
// written with GCC/Clang vector extensions instead of intrinsics: an 8-float vector type that the
// compiler maps to two NEON registers on AArch64, two SSE registers on baseline x86-64, and so on.
// The N:M selection runs through the scalar functions of dfss/format/nm_select.hpp, group by group;
// it is the only part not vectorised (cheap next to the two matrix products).
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


/// 2^x for x <= 0, as in the AVX2 kernel: below -125 flush to 0; degree-7 polynomial on the
/// fraction. Rounding to the nearest integer uses the 1.5 * 2^23 trick (exact for |x| < 2^22).
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



struct workspace {
  std::int64_t packed_b = -1, packed_hk = -1;
  aligned_buffer<float> kt, vp, q, s, acc, cv, row_max, row_sum;
  aligned_buffer<std::int32_t> ci, row_nan;
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
        c_(static_cast<float>(p.scale) * kLog2e),
        group_(p.heads / p.heads_kv) {}

  void run() {
    const std::int64_t q_tiles = (p_.seqlen_q + kRowsPerTask - 1) / kRowsPerTask;
    const std::int64_t tasks = p_.batch * p_.heads * q_tiles;
    const int threads = p_.num_threads > 0 ? p_.num_threads : omp_get_max_threads();
    std::atomic<bool> out_of_memory{false};
#pragma omp parallel num_threads(threads)
    {
      static thread_local workspace tls;
      workspace& ws = tls;
      ws.packed_b = ws.packed_hk = -1;
      // Exceptions must not leave the parallel region: a failed allocation is reported after it.
      bool ready = true;
      try {
        ws.kt.resize(static_cast<std::size_t>(lk_pad_ * dp_));
        ws.vp.resize(static_cast<std::size_t>((lk_pad_ + 1) * dp_));
        ws.q.resize(static_cast<std::size_t>(kRowsPerTask * dp_));
        ws.s.resize(static_cast<std::size_t>(kRowsPerTask * w_));
        ws.acc.resize(static_cast<std::size_t>(kRowsPerTask * dp_));
        ws.cv.resize(static_cast<std::size_t>(w_ + 8));
        ws.ci.resize(static_cast<std::size_t>(w_ + 8));
        ws.row_max.resize(kRowsPerTask);
        ws.row_sum.resize(kRowsPerTask);
        ws.row_nan.resize(kRowsPerTask);
      } catch (const std::bad_alloc&) {
        ready = false;
        out_of_memory = true;
      }
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

  /// S[4][16] = Q[4][dp] x panel[dp][16].
  void microkernel_4x16(const float* q, const float* kt, float* s) const {
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
        const float lse = is_nan ? nan : (empty ? neg_inf : (c_ * mx + std::log2(sum)) * kLn2);
        core::store_from_double(p_.lse, p_.lse_type, b * p_.lse_stride[0] + h * p_.lse_stride[1] + (i0 + i) * p_.lse_stride[2],
                                static_cast<double>(lse));
      }
    }
  }

  void row_epilogue(workspace& ws, std::int64_t b, std::int64_t h, std::int64_t qi, int i, std::int64_t j0) {
    const std::int64_t lim = key_limit(b, qi);
    if (j0 >= lim) return;
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

    // Selection and compaction (the one selection rule), with the tile maximum over kept scores.
    float* cv = ws.cv.ptr;
    std::int32_t* ci = ws.ci.ptr;
    const int n = p_.pattern_n, m = p_.pattern_m;
    const std::int32_t zero_row = static_cast<std::int32_t>(lk_pad_);
    int kept = 0;
    float tile_max = neg_inf;
    for (int g = 0; g < w_; g += m) {
      const std::uint32_t keep = n == m ? (1u << m) - 1u
                                        : (n == 1 && m == 2 ? nm_select_1of2(s + g)
                                                            : (n == 2 && m == 4 ? nm_select_2of4(s + g) : nm_select_group(s + g, m, n, m)));
      for (int q = 0; q < m; ++q) {
        if (!((keep >> q) & 1u)) continue;
        const float x = s[g + q];
        if (x != x) ws.row_nan.ptr[i] = 1;
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
    if (tile_max == neg_inf) return;
    float& mx = ws.row_max.ptr[i];
    float& sum = ws.row_sum.ptr[i];
    float* acc = ws.acc.ptr + static_cast<std::int64_t>(i) * dp_;
    if (tile_max > mx) {
      const float corr = mx == neg_inf ? 0.0f : std::exp2(c_ * (mx - tile_max));
      for (int c = 0; c < dp_; ++c) acc[c] *= corr;
      sum *= corr;
      mx = tile_max;
    }
    const v8f vc = splat(c_), vcm = splat(c_ * mx);
    v8f vsum{};
    for (int t = 0; t < kept; t += 8) {
      const v8f e = exp2_v8(load8(cv + t) * vc - vcm);
      store8(cv + t, e);
      vsum += e;
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

  const attention_params& p_;
  const int d_, dp_, w_;
  const std::int64_t lk_pad_;
  const float c_;  ///< scale * log2(e)
  const std::int64_t group_;
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

}  // namespace dfss::cpu
