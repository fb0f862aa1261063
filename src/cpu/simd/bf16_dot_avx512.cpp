// The avx3_bf16 target's bf16 dot-product loops (bf16_dot.hpp): compiled with AVX-512 F/BW/DQ/VL
// and AVX512_BF16 (src/CMakeLists.txt), called only when the selector picked avx3_bf16, which
// needs a CPU that reports AVX512_BF16. Everything here is internal or declared in bf16_dot.hpp
// (no inline function shared with other translation units, see there).
#include "cpu/simd/bf16_dot.hpp"

#include <immintrin.h>

namespace dfss::cpu::bf16dot {
namespace {

__m512bh as_bh(__m512i x) noexcept { return __builtin_bit_cast(__m512bh, x); }
__m256bh as_bh(__m256i x) noexcept { return __builtin_bit_cast(__m256bh, x); }

/// The sum of the 16 lanes of @p v, halves added pairwise. Not _mm512_reduce_add_ps: GCC 12's
/// 512-to-256-bit casts and extracts start from an undefined value inside its own header, which
/// -Wmaybe-uninitialized (an error in CI) reports at every caller.
float sum_lanes(__m512 v) noexcept {
  const __m256 h = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) + __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m128 x = __builtin_shufflevector(h, h, 0, 1, 2, 3) + __builtin_shufflevector(h, h, 4, 5, 6, 7);
  const __m128 y = x + __builtin_shufflevector(x, x, 2, 3, 2, 3);
  return y[0] + y[1];
}

/// The lane sums of eight 16-lane vectors at once: lane i of the result is the sum of @p v[i]'s
/// lanes. A transposing tree, 18 instructions for the eight sums where sum_lanes takes about 9
/// for each; the sums' order differs from sum_lanes' (a different rounding, within the same
/// bound: docs/design.md, "The decode forward").
[[gnu::always_inline]] inline __m256 sum_lanes8(const __m512* v) noexcept {
  // __builtin_shufflevector rather than the unpack and shuffle intrinsics: see sum_lanes.
  __m512 t[4];
#pragma GCC unroll 4
  for (int j = 0; j < 4; ++j) {
    const __m512 a = v[2 * j], b = v[2 * j + 1];
    t[j] = __builtin_shufflevector(a, b, 0, 16, 1, 17, 4, 20, 5, 21, 8, 24, 9, 25, 12, 28, 13, 29) +
           __builtin_shufflevector(a, b, 2, 18, 3, 19, 6, 22, 7, 23, 10, 26, 11, 27, 14, 30, 15, 31);
  }
  // Each 128-bit block of t[j]: partial sums of (v[2j], v[2j + 1], v[2j], v[2j + 1]).
  __m512 u[2];
#pragma GCC unroll 2
  for (int j = 0; j < 2; ++j) {
    const __m512d a = __builtin_bit_cast(__m512d, t[2 * j]), b = __builtin_bit_cast(__m512d, t[2 * j + 1]);
    u[j] = __builtin_bit_cast(__m512, __builtin_shufflevector(a, b, 0, 8, 2, 10, 4, 12, 6, 14)) +
           __builtin_bit_cast(__m512, __builtin_shufflevector(a, b, 1, 9, 3, 11, 5, 13, 7, 15));
  }
  // Each 128-bit block of u[j]: partial sums of v[4j .. 4j + 3]. Blocks 0 and 1 of x: of v[0 ..
  // 3], blocks 2 and 3: of v[4 .. 7]; then fold the halves.
  const __m512 x = __builtin_shufflevector(u[0], u[1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
                   __builtin_shufflevector(u[0], u[1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  return __builtin_shufflevector(x, x, 0, 1, 2, 3, 8, 9, 10, 11) + __builtin_shufflevector(x, x, 4, 5, 6, 7, 12, 13, 14, 15);
}

/// The bf16 bits of an fp32 that holds a bf16 value exactly (it was widened from bf16).
std::uint32_t bf16_bits(float x) noexcept {
  std::uint32_t u;
  __builtin_memcpy(&u, &x, sizeof u);
  return u >> 16;
}

std::uint32_t column_pair(const float* row, int c) noexcept { return bf16_bits(row[c]) << 16 | bf16_bits(row[c + 1]); }

/// S[kRows][kPanel] (row stride lds) = Q rows (column pairs, row stride dpp) x one key panel:
/// 16 accumulators, two panel vectors and one broadcast, as the fp32 AVX3 micro-kernel.
void microkernel(const std::uint32_t* q, int dpp, const std::uint32_t* kt, float* s, int lds) noexcept {
  __m512 c0[kRows], c1[kRows];
#pragma GCC unroll 8
  for (int r = 0; r < kRows; ++r) c0[r] = c1[r] = _mm512_setzero_ps();
  for (int cp = 0; cp < dpp; ++cp) {
    const __m512bh b0 = as_bh(_mm512_load_si512(kt + cp * kPanel));
    const __m512bh b1 = as_bh(_mm512_load_si512(kt + cp * kPanel + 16));
#pragma GCC unroll 8
    for (int r = 0; r < kRows; ++r) {
      const __m512bh a = as_bh(_mm512_set1_epi32(static_cast<int>(q[r * dpp + cp])));
      c0[r] = _mm512_dpbf16_ps(c0[r], a, b0);
      c1[r] = _mm512_dpbf16_ps(c1[r], a, b1);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < kRows; ++r) {
    _mm512_storeu_ps(s + r * lds, c0[r]);
    _mm512_storeu_ps(s + r * lds + 16, c1[r]);
  }
}

/// pv_row on NB blocks of 32 columns and, with TAIL, one more of 16 (at most 128 columns: 8
/// accumulators). A pair of keys (a, b) per step: one 512-bit load of 32 bf16 of each row,
/// unpacklo/hi_epi16 interleave them into (v_a[c], v_b[c]) lanes (in the column order
/// pack_value_row prepared), one vdpbf16ps per 16 columns against the broadcast weight pair
/// (p_a, p_b). Where fewer than 8 accumulators hold the chunk (d <= 64), two sets alternate
/// between pairs and are summed at the end, so that vdpbf16ps's latency does not stall 4 chains of
/// dependent updates: measured (perf, Zen 5, L = 2048, 1:2, one thread) P V went from 1.47x to
/// 1.07x the Q K^T micro-kernel's time at d = 64; at d = 128 (8 chains already) two sets were
/// slower (1.43x against 1.17x). Interleaving by shifts and 16-bit blends instead of unpacks (no
/// shuffle port) measured slower too (1.24x at d = 64, 1.30x at d = 128).
template <int NB, bool TAIL>
void pv_chunk(float* acc, int n, const float* p, const std::int32_t* off, const std::uint16_t* v) noexcept {
  constexpr int kSets = NB <= 2 ? 2 : 1;
  constexpr int kB = NB > 0 ? NB : 1;
  __m512 lo[kSets][kB], hi[kSets][kB];
  __m256 tlo[kSets], thi[kSets];
#pragma GCC unroll 2
  for (int g = 0; g < kSets; ++g) {
#pragma GCC unroll 4
    for (int k = 0; k < NB; ++k) {
      lo[g][k] = g == 0 ? _mm512_loadu_ps(acc + 32 * k) : _mm512_setzero_ps();
      hi[g][k] = g == 0 ? _mm512_loadu_ps(acc + 32 * k + 16) : _mm512_setzero_ps();
    }
    if constexpr (TAIL) {
      tlo[g] = g == 0 ? _mm256_loadu_ps(acc + 32 * NB) : _mm256_setzero_ps();
      thi[g] = g == 0 ? _mm256_loadu_ps(acc + 32 * NB + 8) : _mm256_setzero_ps();
    }
  }
  const auto step = [&](int g, std::uint32_t weights, const std::uint16_t* a, const std::uint16_t* b) {
    const __m512bh w = as_bh(_mm512_set1_epi32(static_cast<int>(weights)));
#pragma GCC unroll 4
    for (int k = 0; k < NB; ++k) {
      const __m512i x = _mm512_loadu_si512(a + 32 * k);
      const __m512i y = _mm512_loadu_si512(b + 32 * k);
      lo[g][k] = _mm512_dpbf16_ps(lo[g][k], w, as_bh(_mm512_unpacklo_epi16(x, y)));
      hi[g][k] = _mm512_dpbf16_ps(hi[g][k], w, as_bh(_mm512_unpackhi_epi16(x, y)));
    }
    if constexpr (TAIL) {
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + 32 * NB));
      const __m256i y = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 32 * NB));
      const __m256bh w8 = as_bh(_mm256_set1_epi32(static_cast<int>(weights)));
      tlo[g] = _mm256_dpbf16_ps(tlo[g], w8, as_bh(_mm256_unpacklo_epi16(x, y)));
      thi[g] = _mm256_dpbf16_ps(thi[g], w8, as_bh(_mm256_unpackhi_epi16(x, y)));
    }
  };
  alignas(32) std::uint32_t w[8];
  for (int t = 0; t < n; t += 16) {
    // 16 weights rounded to bf16 (round to nearest even; they lie in [0, 1]): 8 pairs (p_t in the
    // low half, with key t's value in the even lanes that unpacklo/hi put first).
    const int left = n - t < 16 ? n - t : 16;
    const __mmask16 m = static_cast<__mmask16>((1u << left) - 1u);
    const __m256bh pb = _mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(m, p + t));
    _mm256_store_si256(reinterpret_cast<__m256i*>(w), __builtin_bit_cast(__m256i, pb));
    const int pairs = left / 2;
    int u = 0;
    for (; u + kSets <= pairs; u += kSets) {
#pragma GCC unroll 2
      for (int g = 0; g < kSets; ++g) step(g, w[u + g], v + off[t + 2 * (u + g)], v + off[t + 2 * (u + g) + 1]);
    }
    for (; u < pairs; ++u) step(0, w[u], v + off[t + 2 * u], v + off[t + 2 * u + 1]);
  }
  if constexpr (kSets == 2) {
#pragma GCC unroll 4
    for (int k = 0; k < NB; ++k) {
      lo[0][k] = _mm512_add_ps(lo[0][k], lo[1][k]);
      hi[0][k] = _mm512_add_ps(hi[0][k], hi[1][k]);
    }
    if constexpr (TAIL) {
      tlo[0] = _mm256_add_ps(tlo[0], tlo[1]);
      thi[0] = _mm256_add_ps(thi[0], thi[1]);
    }
  }
#pragma GCC unroll 4
  for (int k = 0; k < NB; ++k) {
    _mm512_storeu_ps(acc + 32 * k, lo[0][k]);
    _mm512_storeu_ps(acc + 32 * k + 16, hi[0][k]);
  }
  if constexpr (TAIL) {
    _mm256_storeu_ps(acc + 32 * NB, tlo[0]);
    _mm256_storeu_ps(acc + 32 * NB + 8, thi[0]);
  }
}

/// pv_tile_rows on R rows and NV accumulators of 16 columns per row: per key pair, NV loads of
/// packed pairs serve the R rows' NV vdpbf16ps each.
template <int R, int NV>
void pv_tile_block(float* const* acc, int c0, const std::uint32_t (*w)[kTilePairs], const std::uint32_t* v, int dp,
                   int pairs) noexcept {
  __m512 a[R][NV];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
    for (int k = 0; k < NV; ++k) a[r][k] = _mm512_loadu_ps(acc[r] + c0 + 16 * k);
  }
  for (int g = 0; g < pairs; ++g) {
    __m512bh wr[R];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) wr[r] = as_bh(_mm512_set1_epi32(static_cast<int>(w[r][g])));
    const std::uint32_t* x = v + static_cast<std::ptrdiff_t>(g) * dp + c0;
#pragma GCC unroll 4
    for (int k = 0; k < NV; ++k) {
      __m512i xv = _mm512_loadu_si512(x + 16 * k);
      asm("" : "+v"(xv));  // one load for the R rows (GCC would fold it into each vdpbf16ps)
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) a[r][k] = _mm512_dpbf16_ps(a[r][k], wr[r], as_bh(xv));
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
    for (int k = 0; k < NV; ++k) _mm512_storeu_ps(acc[r] + c0 + 16 * k, a[r][k]);
  }
}

template <int R>
void pv_tile_columns(float* const* acc, const std::uint32_t (*w)[kTilePairs], const std::uint32_t* v, int dp, int pairs) noexcept {
  for (int c0 = 0; c0 < dp; c0 += 64) {
    switch (dp - c0 >= 64 ? 4 : (dp - c0) / 16) {
      case 1: pv_tile_block<R, 1>(acc, c0, w, v, dp, pairs); break;
      case 2: pv_tile_block<R, 2>(acc, c0, w, v, dp, pairs); break;
      case 3: pv_tile_block<R, 3>(acc, c0, w, v, dp, pairs); break;
      default: pv_tile_block<R, 4>(acc, c0, w, v, dp, pairs); break;
    }
  }
}

/// decode_dots for R rows and NB blocks of 32 columns (0: d / 32 at run time, Q read from L1).
template <int R, int NB, bool Check>
void decode_dots_rows(const std::uint16_t* q, std::int64_t dq, int d, const std::uint16_t* k, std::int64_t step, int n,
                      float* s, std::int64_t ds, std::uint16_t* top) noexcept {
  const int nb = NB > 0 ? NB : d / 32;
  constexpr int kHeld = NB > 0 ? NB : 1;
  __m512i qv[R][kHeld];
  if constexpr (NB > 0) {
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
      for (int c = 0; c < NB; ++c) qv[r][c] = _mm512_loadu_si512(q + r * dq + 32 * c);
    }
  }
  const __m512i magnitude = _mm512_set1_epi16(0x7fff);
  __m512i t_top = _mm512_setzero_si512();
  int t = 0;
  if constexpr (R == 2 || R == 4) {
    // G keys at a time, their 8 scores summed by one tree (sum_lanes8, lane r G + g: row r, key
    // t + g). One thread, K in L1, 4 rows, d = 128: 34 -> 28 cycles per key (Zen 4, 3.7 GHz), of
    // which the magnitude check takes 8 either way.
    constexpr int G = 8 / R;
    for (; t + G <= n; t += G) {
      __m512 a[8];
#pragma GCC unroll 8
      for (int i = 0; i < 8; ++i) a[i] = _mm512_setzero_ps();
      for (int c = 0; c < nb; ++c) {
#pragma GCC unroll 4
        for (int g = 0; g < G; ++g) {
          const __m512i kc = _mm512_loadu_si512(k + (t + g) * step + 32 * c);
          if constexpr (Check) t_top = _mm512_max_epu16(t_top, _mm512_and_si512(kc, magnitude));
#pragma GCC unroll 4
          for (int r = 0; r < R; ++r) {
            const __m512i qc = NB > 0 ? qv[r][NB > 0 ? c : 0] : _mm512_loadu_si512(q + r * dq + 32 * c);
            a[r * G + g] = _mm512_dpbf16_ps(a[r * G + g], as_bh(qc), as_bh(kc));
          }
        }
      }
      const __m256 sums = sum_lanes8(a);
      if constexpr (G == 2) {
        const __m128 lo = __builtin_shufflevector(sums, sums, 0, 1, 2, 3), hi = __builtin_shufflevector(sums, sums, 4, 5, 6, 7);
        _mm_storel_pi(reinterpret_cast<__m64*>(s + t), lo);
        _mm_storeh_pi(reinterpret_cast<__m64*>(s + ds + t), lo);
        _mm_storel_pi(reinterpret_cast<__m64*>(s + 2 * ds + t), hi);
        _mm_storeh_pi(reinterpret_cast<__m64*>(s + 3 * ds + t), hi);
      } else {
        _mm_storeu_ps(s + t, __builtin_shufflevector(sums, sums, 0, 1, 2, 3));
        _mm_storeu_ps(s + ds + t, __builtin_shufflevector(sums, sums, 4, 5, 6, 7));
      }
    }
  }
  for (; t < n; ++t) {
    const std::uint16_t* row = k + t * step;
    __m512 a[R];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) a[r] = _mm512_setzero_ps();
    for (int c = 0; c < nb; ++c) {
      const __m512i kc = _mm512_loadu_si512(row + 32 * c);
      if constexpr (Check) t_top = _mm512_max_epu16(t_top, _mm512_and_si512(kc, magnitude));
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const __m512i qc = NB > 0 ? qv[r][NB > 0 ? c : 0] : _mm512_loadu_si512(q + r * dq + 32 * c);
        a[r] = _mm512_dpbf16_ps(a[r], as_bh(qc), as_bh(kc));
      }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) s[r * ds + t] = sum_lanes(a[r]);
  }
  if constexpr (Check) {
    alignas(64) std::uint16_t lanes[32];
    _mm512_store_si512(lanes, t_top);
    for (std::uint16_t x : lanes) *top = x > *top ? x : *top;
  }
}

template <int R, bool Check>
void decode_dots_blocks(const std::uint16_t* q, std::int64_t dq, int d, const std::uint16_t* k, std::int64_t step,
                        int n, float* s, std::int64_t ds, std::uint16_t* top) noexcept {
  switch (d / 32) {
    case 2: return decode_dots_rows<R, 2, Check>(q, dq, d, k, step, n, s, ds, top);
    case 4: return decode_dots_rows<R, 4, Check>(q, dq, d, k, step, n, s, ds, top);
    default: return decode_dots_rows<R, 0, Check>(q, dq, d, k, step, n, s, ds, top);
  }
}

template <int R>
void decode_dots_checked(const std::uint16_t* q, std::int64_t dq, int d, const std::uint16_t* k, std::int64_t step,
                         int n, float* s, std::int64_t ds, bool check, std::uint16_t* top) noexcept {
  if (check) return decode_dots_blocks<R, true>(q, dq, d, k, step, n, s, ds, top);
  decode_dots_blocks<R, false>(q, dq, d, k, step, n, s, ds, top);
}

/// decode_pv's weights of one row as bf16 pairs: pairs[g] = (w of key 2g in the low half, w of
/// key 2g + 1 in the high half), a weight 0 past @p n.
void decode_pv_weights(const float* w, const std::int32_t* keys, int n, std::uint32_t* pairs) noexcept {
  alignas(64) float x[kDecodePvKeys];
  if (keys[n - 1] - keys[0] == n - 1) {  // increasing keys: a contiguous range
    const float* src = w + keys[0];
    for (int k = 0; k < kDecodePvKeys; k += 16) {
      const int left = n - k <= 0 ? 0 : (n - k < 16 ? n - k : 16);
      _mm512_store_ps(x + k, _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << left) - 1u), src + k));
    }
  } else {
    for (int k = 0; k < kDecodePvKeys; ++k) x[k] = k < n ? w[keys[k]] : 0.0f;
  }
  const __m512bh b = _mm512_cvtne2ps_pbh(_mm512_load_ps(x + 16), _mm512_load_ps(x));
  _mm512_storeu_si512(pairs, __builtin_bit_cast(__m512i, b));
}

/// Requests the cache lines of the @p d bf16 values at @p row into L2 (prefetcht1).
void request_row_l2(const std::uint16_t* row, int d) noexcept {
  const char* bytes = reinterpret_cast<const char*>(row);
  for (int x = 0; x < 2 * d; x += 64) _mm_prefetch(bytes + x, _MM_HINT_T1);
}

/// decode_pv for R rows, NB blocks of 32 columns per slice of the columns (2 R NB <= 16
/// accumulators). A block's accumulators in the unpacked order: lo lane i holds column 8 (i / 4) +
/// i % 4 of the block, hi lane i that plus 4.
template <int R, int NB>
void decode_pv_rows(float* acc, int dp, int d, const std::uint32_t (*wp)[kDecodePvKeys / 2], const std::int32_t* keys,
                    int n, const std::uint16_t* v, std::int64_t step, const std::int32_t* ahead, int ahead_n) noexcept {
  // The ahead rows spread over the pairs of keys of every slice of the columns.
  const int steps = (d + 32 * NB - 1) / (32 * NB) * ((n + 1) / 2);
  const int per_step = ahead_n > 0 ? (ahead_n + steps - 1) / steps : 0;
  int requested = 0;
  const __m512i to_lo = _mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27);
  const __m512i to_hi = _mm512_setr_epi32(4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  const __m512i from_0 = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i from_1 = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  const int pairs = (n + 1) / 2;
  for (int c0 = 0; c0 < d; c0 += 32 * NB) {
    const int nb = (d - c0) / 32 < NB ? (d - c0) / 32 : NB;
    __m512 lo[R][NB], hi[R][NB];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
      for (int k = 0; k < NB; ++k) {
        if (k >= nb) {  // past d: never updated or stored
          lo[r][k] = hi[r][k] = _mm512_setzero_ps();
          continue;
        }
        const float* a = acc + static_cast<std::ptrdiff_t>(r) * dp + c0 + 32 * k;
        const __m512 n0 = _mm512_loadu_ps(a), n1 = _mm512_loadu_ps(a + 16);
        lo[r][k] = _mm512_permutex2var_ps(n0, to_lo, n1);
        hi[r][k] = _mm512_permutex2var_ps(n0, to_hi, n1);
      }
    }
    for (int g = 0; g < pairs; ++g) {
      for (int i = 0; i < per_step && requested < ahead_n; ++i) request_row_l2(v + ahead[requested++] * step, d);
      const std::uint16_t* a = v + keys[2 * g] * step + c0;
      const std::uint16_t* b = v + keys[2 * g + 1 < n ? 2 * g + 1 : 2 * g] * step + c0;
      __m512bh wr[R];
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) wr[r] = as_bh(_mm512_set1_epi32(static_cast<int>(wp[r][g])));
#pragma GCC unroll 4
      for (int k = 0; k < NB; ++k) {
        if (k >= nb) continue;
        const __m512i x = _mm512_loadu_si512(a + 32 * k), y = _mm512_loadu_si512(b + 32 * k);
        const __m512bh xl = as_bh(_mm512_unpacklo_epi16(x, y)), xh = as_bh(_mm512_unpackhi_epi16(x, y));
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
          lo[r][k] = _mm512_dpbf16_ps(lo[r][k], wr[r], xl);
          hi[r][k] = _mm512_dpbf16_ps(hi[r][k], wr[r], xh);
        }
      }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
      for (int k = 0; k < NB; ++k) {
        if (k >= nb) continue;
        float* a = acc + static_cast<std::ptrdiff_t>(r) * dp + c0 + 32 * k;
        _mm512_storeu_ps(a, _mm512_permutex2var_ps(lo[r][k], from_0, hi[r][k]));
        _mm512_storeu_ps(a + 16, _mm512_permutex2var_ps(lo[r][k], from_1, hi[r][k]));
      }
    }
  }
}

}  // namespace

void decode_pv(float* acc, int rows, int dp, int d, const float* w, std::int64_t wstride, const std::int32_t* keys,
               int n, const std::uint16_t* v, std::int64_t step, const std::int32_t* ahead, int ahead_n) noexcept {
  if (n <= 0) return;
  alignas(64) std::uint32_t wp[kDecodeRows][kDecodePvKeys / 2];
  for (int r = 0; r < rows; ++r) decode_pv_weights(w + r * wstride, keys, n, wp[r]);
  switch (rows) {
    case 4: return decode_pv_rows<4, 2>(acc, dp, d, wp, keys, n, v, step, ahead, ahead_n);
    case 3: return decode_pv_rows<3, 2>(acc, dp, d, wp, keys, n, v, step, ahead, ahead_n);
    case 2: return decode_pv_rows<2, 4>(acc, dp, d, wp, keys, n, v, step, ahead, ahead_n);
    default: return decode_pv_rows<1, 4>(acc, dp, d, wp, keys, n, v, step, ahead, ahead_n);
  }
}

void decode_dots(const std::uint16_t* q, int rows, std::int64_t dq, int d, const std::uint16_t* k, std::int64_t step,
                 int n, float* s, std::int64_t ds, bool check, std::uint16_t* top) noexcept {
  switch (rows) {
    case 4: return decode_dots_checked<4>(q, dq, d, k, step, n, s, ds, check, top);
    case 3: return decode_dots_checked<3>(q, dq, d, k, step, n, s, ds, check, top);
    case 2: return decode_dots_checked<2>(q, dq, d, k, step, n, s, ds, check, top);
    default: return decode_dots_checked<1>(q, dq, d, k, step, n, s, ds, check, top);
  }
}

void pack_value_pair(const float* even, const float* odd, int dp, std::uint32_t* out) noexcept {
  for (int c = 0; c < dp; ++c) out[c] = bf16_bits(odd[c]) << 16 | bf16_bits(even[c]);
}

void pv_tile_rows(float* const* acc, int rows, int dp, const float* const* p, const std::uint32_t* v,
                  int pairs) noexcept {
  // Each row's weights as bf16 pairs (p_2g in the low half), 16 weights per conversion.
  alignas(64) std::uint32_t w[kTileRows][kTilePairs];
  for (int r = 0; r < rows; ++r) {
    for (int t = 0; t < 2 * pairs; t += 16) {
      const int left = 2 * pairs - t < 16 ? 2 * pairs - t : 16;
      const __mmask16 m = static_cast<__mmask16>((1u << left) - 1u);
      const __m256bh pb = _mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(m, p[r] + t));
      _mm256_store_si256(reinterpret_cast<__m256i*>(w[r] + t / 2), __builtin_bit_cast(__m256i, pb));
    }
  }
  switch (rows) {
    case 1: pv_tile_columns<1>(acc, w, v, dp, pairs); break;
    case 2: pv_tile_columns<2>(acc, w, v, dp, pairs); break;
    case 3: pv_tile_columns<3>(acc, w, v, dp, pairs); break;
    default: pv_tile_columns<4>(acc, w, v, dp, pairs); break;
  }
}

void pack_query_row(const float* row, int dp, std::uint32_t* out) noexcept {
  for (int c = 0; c < dp; c += 2) out[c / 2] = column_pair(row, c);
}

void pack_key_panel(const float* rows, int dp, std::uint32_t* panel) noexcept {
  for (int c = 0; c < dp; c += 2) {
    for (int t = 0; t < kPanel; ++t) panel[(c / 2) * kPanel + t] = column_pair(rows + t * dp, c);
  }
}

void pack_value_row(const float* row, int dp, std::uint16_t* out) noexcept {
  // unpacklo_epi16 takes words 0-3 of each 128-bit block (8 bf16) of both rows, unpackhi words
  // 4-7; so lane 4k + i of the "lo" result reads position 8k + i, and the lo result covers the
  // block's first h columns in order when position 8k + i holds column 4k + i (hi: h + 4k + i).
  for (int c0 = 0; c0 < dp; c0 += 32) {
    const int h = dp - c0 >= 32 ? 16 : 8;
    for (int k = 0; k < h / 4; ++k) {
      for (int i = 0; i < 4; ++i) {
        out[c0 + 8 * k + i] = static_cast<std::uint16_t>(bf16_bits(row[c0 + 4 * k + i]));
        out[c0 + 8 * k + 4 + i] = static_cast<std::uint16_t>(bf16_bits(row[c0 + h + 4 * k + i]));
      }
    }
  }
}

void qk_tile(const std::uint32_t* q, int rows, int dp, const std::uint32_t* panels, std::int64_t j0, int w,
             float* s) noexcept {
  const int dpp = dp / 2;
  for (int i = 0; i < rows; i += kRows) {
    for (int jb = 0; jb < w; jb += kPanel) {
      microkernel(q + i * dpp, dpp, panels + ((j0 + jb) / kPanel) * dpp * kPanel, s + i * w + jb, w);
    }
  }
}

void pv_row(float* acc, int dp, int n, const float* p, const std::int32_t* off, const std::uint16_t* v) noexcept {
  // Chunks of up to 128 columns (8 accumulators of the 32 registers, plus two rows and their
  // interleavings); dp is a multiple of 16.
  for (int c0 = 0; c0 < dp; c0 += 128) {
    const int left = dp - c0;
    const std::uint16_t* vc = v + c0;
    float* a = acc + c0;
    switch (left >= 128 ? 8 : left / 16) {
      case 1: pv_chunk<0, true>(a, n, p, off, vc); break;
      case 2: pv_chunk<1, false>(a, n, p, off, vc); break;
      case 3: pv_chunk<1, true>(a, n, p, off, vc); break;
      case 4: pv_chunk<2, false>(a, n, p, off, vc); break;
      case 5: pv_chunk<2, true>(a, n, p, off, vc); break;
      case 6: pv_chunk<3, false>(a, n, p, off, vc); break;
      case 7: pv_chunk<3, true>(a, n, p, off, vc); break;
      default: pv_chunk<4, false>(a, n, p, off, vc); break;
    }
  }
}

}  // namespace dfss::cpu::bf16dot
