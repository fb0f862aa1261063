// amx_tiles.hpp's tile loops (compiled with -mamx-tile -mamx-bf16).
#include "cpu/simd/amx_tiles.hpp"

#include <immintrin.h>

#include <initializer_list>

namespace dfss::cpu::amx {
namespace {

/// LDTILECFG's 64-byte operand (palette 1): per tile its bytes per row and its rows.
struct alignas(64) tile_config {
  std::uint8_t palette = 1, start_row = 0;
  std::uint8_t reserved[14] = {};
  std::uint16_t colsb[16] = {};
  std::uint8_t rows[16] = {};
};
static_assert(sizeof(tile_config) == 64, "LDTILECFG reads 64 bytes");

}  // namespace

void configure(int rows) noexcept {
  // Tiles: 0, 1 the scores of rows [0, 16) (keys 0-15, 16-31 of a panel), 2, 3 those of rows
  // [16, rows); 4, 5 the two row blocks of Q; 6, 7 the panel's two halves of keys.
  const int r0 = rows < 16 ? rows : 16, r1 = rows - r0;
  tile_config cfg;
  const auto set = [&cfg](int t, int n) {
    cfg.colsb[t] = static_cast<std::uint16_t>(n > 0 ? 64 : 0);
    cfg.rows[t] = static_cast<std::uint8_t>(n);
  };
  set(0, r0), set(1, r0), set(4, r0);
  set(2, r1), set(3, r1), set(5, r1);
  set(6, kPairs), set(7, kPairs);
  // LDTILECFG written out with the configuration as a memory operand: GCC 12's _tile_loadconfig
  // does not tell the optimiser that it reads the structure, and the stores above were dropped.
  asm volatile("ldtilecfg %0" : : "m"(cfg));
}

void release() noexcept { _tile_release(); }

void qk_tile(const std::uint32_t* q, int rows, int dp, const std::uint32_t* panels, int width, int w,
             float* s) noexcept {
  const int r1 = rows > 16 ? rows - 16 : 0;
  const int pairs = dp / 2;
  const long q_bytes = static_cast<long>(pairs) * 4;   // a Q row's stride
  const long k_bytes = static_cast<long>(kPanel) * 4;  // a panel row's stride
  const long s_bytes = static_cast<long>(w) * 4;
  const std::uint32_t* q1 = q + static_cast<long>(16) * pairs;
  for (int p = 0; p < width / kPanel; ++p) {
    const std::uint32_t* panel = panels + static_cast<long>(p) * pairs * kPanel;
    _tile_zero(0);
    _tile_zero(1);
    if (r1 > 0) {
      _tile_zero(2);
      _tile_zero(3);
    }
    for (int c = 0; c < pairs; c += kPairs) {
      _tile_loadd(6, panel + static_cast<long>(c) * kPanel, k_bytes);
      _tile_loadd(7, panel + static_cast<long>(c) * kPanel + 16, k_bytes);
      _tile_loadd(4, q + c, q_bytes);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      if (r1 > 0) {
        _tile_loadd(5, q1 + c, q_bytes);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      }
    }
    float* out = s + p * kPanel;
    _tile_stored(0, out, s_bytes);
    _tile_stored(1, out + 16, s_bytes);
    if (r1 > 0) {
      _tile_stored(2, out + 16 * static_cast<long>(w), s_bytes);
      _tile_stored(3, out + 16 * static_cast<long>(w) + 16, s_bytes);
    }
  }
}

void weights_to_pairs(const float* w, int pairs, std::uint32_t* out) noexcept {
  for (int g = 0; g < pairs; g += 16) {
    // Keys 2g .. 2g + 31 in order: the first 16 in the low half of the result.
    const __m512bh b = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(w + 2 * g + 16), _mm512_loadu_ps(w + 2 * g));
    _mm512_storeu_si512(out + g, reinterpret_cast<__m512i>(b));
  }
}

void kept_weights_to_pairs(const float* w, const std::int32_t* shift, int pairs, std::uint32_t* out) noexcept {
  // (The maskz forms: GCC 12 warns of the plain ones' undefined pass-through operand.)
  for (int g = 0; g < pairs; g += 16) {
    const __m256bh b = _mm512_cvtneps_pbh(_mm512_loadu_ps(w + g));
    const __m512i wide = _mm512_maskz_cvtepu16_epi32(0xffff, reinterpret_cast<__m256i>(b));
    _mm512_storeu_si512(out + g, _mm512_maskz_sllv_epi32(0xffff, wide, _mm512_loadu_si512(shift + g)));
  }
}

void pv_tile(const std::uint32_t* p, int rows, int pairs, const std::uint32_t* v, int dp, float* acc) noexcept {
  // Tiles (configure's): 0 and 2 the accumulators of the two row blocks, 4 and 5 their weights, 6
  // the values. Per block of 16 columns, each accumulator tile is loaded and stored once.
  const int r1 = rows > 16 ? rows - 16 : 0;
  const long p_bytes = static_cast<long>(pairs) * 4;
  const long row_bytes = static_cast<long>(dp) * 4;  // acc rows and value pairs alike
  const std::uint32_t* p1 = p + 16 * static_cast<long>(pairs);
  float* acc1 = acc + 16 * static_cast<long>(dp);
  for (int n = 0; n < dp; n += 16) {
    _tile_loadd(0, acc + n, row_bytes);
    if (r1 > 0) _tile_loadd(2, acc1 + n, row_bytes);
    for (int g = 0; g < pairs; g += kPairs) {
      _tile_loadd(6, v + static_cast<long>(g) * dp + n, row_bytes);
      _tile_loadd(4, p + g, p_bytes);
      _tile_dpbf16ps(0, 4, 6);
      if (r1 > 0) {
        _tile_loadd(5, p1 + g, p_bytes);
        _tile_dpbf16ps(2, 5, 6);
      }
    }
    _tile_stored(0, acc + n, row_bytes);
    if (r1 > 0) _tile_stored(2, acc1 + n, row_bytes);
  }
}

namespace {

/// decode_qk for NB blocks of 32 columns (the Q tiles 2 .. 1 + NB held).
template <int NB>
void decode_qk_blocks(const std::uint32_t* qt, int rows, const std::uint16_t* k, std::int64_t step, int n, float* s,
                      std::int64_t ds, std::uint16_t* top) noexcept {
  const long q_bytes = 4L * rows, k_bytes = 2L * step;
  // Q^T's blocks of 16 column pairs, 16 pairs apart.
  _tile_loadd(2, qt, q_bytes);
  if constexpr (NB > 1) _tile_loadd(3, qt + 16L * rows, q_bytes);
  if constexpr (NB > 2) _tile_loadd(4, qt + 32L * rows, q_bytes);
  if constexpr (NB > 3) _tile_loadd(5, qt + 48L * rows, q_bytes);
  const __m512i magnitude = _mm512_set1_epi16(0x7fff);
  __m512i t_top = _mm512_setzero_si512();
  alignas(64) float st[16 * kDecodeMaxRows];
  for (int t0 = 0; t0 < n; t0 += 16) {
    const std::uint16_t* kb = k + t0 * step;
    // The key blocks alternate between tiles 1, 6 and 7, so that a load need not wait for the
    // product that reads the previous block.
    _tile_zero(0);
    _tile_loadd(1, kb, k_bytes);
    _tile_dpbf16ps(0, 1, 2);
    if constexpr (NB > 1) {
      _tile_loadd(6, kb + 32, k_bytes);
      _tile_dpbf16ps(0, 6, 3);
    }
    if constexpr (NB > 2) {
      _tile_loadd(7, kb + 64, k_bytes);
      _tile_dpbf16ps(0, 7, 4);
    }
    if constexpr (NB > 3) {
      _tile_loadd(1, kb + 96, k_bytes);
      _tile_dpbf16ps(0, 1, 5);
    }
    // The tame test on the block's K values, from L1 now.
    for (int t = 0; t < 16; ++t) {
#pragma GCC unroll 4
      for (int c = 0; c < NB; ++c) {
        t_top = _mm512_max_epu16(t_top, _mm512_and_si512(_mm512_loadu_si512(kb + t * step + 32 * c), magnitude));
      }
    }
    _tile_stored(0, st, q_bytes);
    if (rows == 4) {
      // st holds 4 keys of 4 rows per vector: two rounds of two-source permutes give each row's 16.
      const __m512 a0 = _mm512_load_ps(st), a1 = _mm512_load_ps(st + 16), a2 = _mm512_load_ps(st + 32),
                   a3 = _mm512_load_ps(st + 48);
      const __m512i even = _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 1, 5, 9, 13, 17, 21, 25, 29);
      const __m512i odd = _mm512_setr_epi32(2, 6, 10, 14, 18, 22, 26, 30, 3, 7, 11, 15, 19, 23, 27, 31);
      const __m512i lo = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23);
      const __m512i hi = _mm512_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
      // b0: rows 0 and 1 of keys 0-7, b1: rows 2 and 3 of keys 0-7; b2, b3: the same of keys 8-15.
      const __m512 b0 = _mm512_permutex2var_ps(a0, even, a1), b1 = _mm512_permutex2var_ps(a0, odd, a1);
      const __m512 b2 = _mm512_permutex2var_ps(a2, even, a3), b3 = _mm512_permutex2var_ps(a2, odd, a3);
      _mm512_storeu_ps(s + t0, _mm512_permutex2var_ps(b0, lo, b2));
      _mm512_storeu_ps(s + ds + t0, _mm512_permutex2var_ps(b0, hi, b2));
      _mm512_storeu_ps(s + 2 * ds + t0, _mm512_permutex2var_ps(b1, lo, b3));
      _mm512_storeu_ps(s + 3 * ds + t0, _mm512_permutex2var_ps(b1, hi, b3));
    } else {
      const __m512i stride = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                                _mm512_set1_epi32(rows));
      for (int r = 0; r < rows; ++r) {
        _mm512_storeu_ps(s + r * ds + t0, _mm512_mask_i32gather_ps(_mm512_setzero_ps(), static_cast<__mmask16>(0xffff),
                                                                          _mm512_add_epi32(stride, _mm512_set1_epi32(r)), st, 4));
      }
    }
  }
  alignas(64) std::uint16_t lanes[32];
  _mm512_store_si512(lanes, t_top);
  for (std::uint16_t x : lanes) *top = x > *top ? x : *top;
}

}  // namespace

void decode_qk(const std::uint32_t* qt, int rows, int d, const std::uint16_t* k, std::int64_t step, int n, float* s,
               std::int64_t ds, std::uint16_t* top) noexcept {
  if (n <= 0) return;
  // Tiles: 0 S^T (16 keys x rows), 1, 6 and 7 blocks of 16 keys x 32 columns, 2-5 Q^T's blocks of
  // 16 column pairs x rows.
  tile_config cfg;
  const auto set = [&cfg](int t, int r, int bytes) {
    cfg.colsb[t] = static_cast<std::uint16_t>(bytes);
    cfg.rows[t] = static_cast<std::uint8_t>(r);
  };
  set(0, 16, 4 * rows);
  set(1, 16, 64), set(6, 16, 64), set(7, 16, 64);
  for (int t = 2; t < 2 + d / 32; ++t) set(t, 16, 4 * rows);
  asm volatile("ldtilecfg %0" : : "m"(cfg));
  switch (d / 32) {
    case 1: return decode_qk_blocks<1>(qt, rows, k, step, n, s, ds, top);
    case 2: return decode_qk_blocks<2>(qt, rows, k, step, n, s, ds, top);
    case 3: return decode_qk_blocks<3>(qt, rows, k, step, n, s, ds, top);
    default: return decode_qk_blocks<4>(qt, rows, k, step, n, s, ds, top);
  }
}

namespace {

/// decode_pv for @p rows <= kDecodeMaxRows / 2 accumulator rows and NB blocks of 32 columns.
template <int NB>
void decode_pv_rows(float* acc, int rows, int dp, const float* w, std::int64_t wstride, const std::int32_t* keys, int n,
                    const std::uint16_t* v, std::int64_t step) noexcept {
  constexpr int d = 32 * NB;
  // The value rows go into the tiles as they lie in the cache: B tile row k holds key k's 32
  // columns of a block as 16 pairs (columns 2i, 2i + 1). Each task row r is two tile rows: 2r
  // with its weight in the low half of every A pair (and 0 in the high half) sums the even
  // columns, 2r + 1 with the weight in the high half the odd ones. Twice the products, half of
  // them by 0, but no rearranging of V: interleaving pairs of V rows for the B tiles (two permutes
  // and two stores per 32 columns of two keys) took most of a GQA step's P V.
  // Tiles: 0 and 1 the weights (bf16 high parts, then the rests), 2 and 3 value blocks in turn,
  // 4 .. 3 + NB the accumulators of the column blocks (2 rows x 16 pairs), held across the call.
  tile_config cfg;
  for (int t : {0, 1}) cfg.colsb[t] = 64, cfg.rows[t] = static_cast<std::uint8_t>(2 * rows);
  for (int t : {2, 3}) cfg.colsb[t] = 64, cfg.rows[t] = 16;
  for (int t = 4; t < 4 + NB; ++t) cfg.colsb[t] = 64, cfg.rows[t] = static_cast<std::uint8_t>(2 * rows);
  asm volatile("ldtilecfg %0" : : "m"(cfg));
  // The accumulators in the tiles' layout: row 2r the even columns of row r, 2r + 1 the odd ones.
  alignas(64) float at[kDecodeMaxRows][kDecodeMaxDim / 2];
  const __m512i evens = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odds = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
  for (int r = 0; r < rows; ++r) {
    for (int c = 0; c < d; c += 32) {
      const __m512 a = _mm512_loadu_ps(acc + r * dp + c), b = _mm512_loadu_ps(acc + r * dp + c + 16);
      _mm512_store_ps(at[2 * r] + c / 2, _mm512_permutex2var_ps(a, evens, b));
      _mm512_store_ps(at[2 * r + 1] + c / 2, _mm512_permutex2var_ps(a, odds, b));
    }
  }
  constexpr long at_bytes = sizeof(at[0]);
  _tile_loadd(4, at[0], at_bytes);
  if constexpr (NB > 1) _tile_loadd(5, at[0] + 16, at_bytes);
  if constexpr (NB > 2) _tile_loadd(6, at[0] + 32, at_bytes);
  if constexpr (NB > 3) _tile_loadd(7, at[0] + 48, at_bytes);
  alignas(64) std::uint32_t wh[kDecodeMaxRows][16], wl[kDecodeMaxRows][16];
  alignas(64) std::uint16_t rows_copy[16 * d];  // listed keys' rows, or a last block's, padded with 0
  const __m512i top_half = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
  // bf16 of each lane (finite, >= 0) by rounding the bits to nearest even, as fp32.
  const auto high = [top_half](__m512 y) {
    const __m512i b = _mm512_castps_si512(y);
    const __m512i odd =
        _mm512_and_si512(_mm512_maskz_srli_epi32(static_cast<__mmask16>(0xffff), b, 16), _mm512_set1_epi32(1));
    return _mm512_castsi512_ps(
        _mm512_and_si512(_mm512_add_epi32(b, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), top_half));
  };
  for (int k0 = 0; k0 < n; k0 += 16) {
    const int kn = n - k0 < 16 ? n - k0 : 16;
    for (int r = 0; r < rows; ++r) {
      alignas(64) float listed[16];
      const float* x = w + r * wstride + k0;
      if (keys != nullptr) {  // the weights of the listed keys, in list order
        for (int t = 0; t < 16; ++t) listed[t] = t < kn ? w[r * wstride + keys[k0 + t]] : 0.0f;
        x = listed;
      }
      const __m512 y = _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << kn) - 1u), x);
      // The weight as its bf16 part h and the bf16 of the rest y - h (exact in fp32): the two
      // products carry it to within 2^-17 of itself, where bf16 alone keeps 2^-9.
      const __m512 h = high(y);
      const __m512i hb = _mm512_castps_si512(h), lb = _mm512_castps_si512(high(_mm512_sub_ps(y, h)));
      _mm512_store_si512(wh[2 * r], _mm512_maskz_srli_epi32(static_cast<__mmask16>(0xffff), hb, 16));
      _mm512_store_si512(wh[2 * r + 1], hb);
      _mm512_store_si512(wl[2 * r], _mm512_maskz_srli_epi32(static_cast<__mmask16>(0xffff), lb, 16));
      _mm512_store_si512(wl[2 * r + 1], lb);
    }
    _tile_loadd(0, wh, 64);
    _tile_loadd(1, wl, 64);
    const std::uint16_t* base = v + k0 * step;
    long stride = 2L * step;
    if (keys != nullptr || kn < 16) {
      for (int t = 0; t < 16; ++t) {
        const std::uint16_t* row = v + static_cast<std::int64_t>(keys != nullptr ? keys[k0 + t < n ? k0 + t : k0] : k0 + t) * step;
        for (int c = 0; c < d; c += 32) {
          _mm512_store_si512(rows_copy + t * d + c, t < kn ? _mm512_loadu_si512(row + c) : _mm512_setzero_si512());
        }
      }
      base = rows_copy;
      stride = 2L * d;
    }
    // One block of 32 columns after another, written out: a tile's number is an immediate.
    _tile_loadd(2, base, stride);
    _tile_dpbf16ps(4, 0, 2);
    _tile_dpbf16ps(4, 1, 2);
    if constexpr (NB > 1) {
      _tile_loadd(3, base + 32, stride);
      _tile_dpbf16ps(5, 0, 3);
      _tile_dpbf16ps(5, 1, 3);
    }
    if constexpr (NB > 2) {
      _tile_loadd(2, base + 64, stride);
      _tile_dpbf16ps(6, 0, 2);
      _tile_dpbf16ps(6, 1, 2);
    }
    if constexpr (NB > 3) {
      _tile_loadd(3, base + 96, stride);
      _tile_dpbf16ps(7, 0, 3);
      _tile_dpbf16ps(7, 1, 3);
    }
  }
  _tile_stored(4, at[0], at_bytes);
  if constexpr (NB > 1) _tile_stored(5, at[0] + 16, at_bytes);
  if constexpr (NB > 2) _tile_stored(6, at[0] + 32, at_bytes);
  if constexpr (NB > 3) _tile_stored(7, at[0] + 48, at_bytes);
  const __m512i lo_mix = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  const __m512i hi_mix = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
  for (int r = 0; r < rows; ++r) {
    for (int c = 0; c < d; c += 32) {
      const __m512 e = _mm512_load_ps(at[2 * r] + c / 2), o = _mm512_load_ps(at[2 * r + 1] + c / 2);
      _mm512_storeu_ps(acc + r * dp + c, _mm512_permutex2var_ps(e, lo_mix, o));
      _mm512_storeu_ps(acc + r * dp + c + 16, _mm512_permutex2var_ps(e, hi_mix, o));
    }
  }
}

}  // namespace

void decode_pv(float* acc, int rows, int dp, int d, const float* w, std::int64_t wstride, const std::int32_t* keys,
               int n, const std::uint16_t* v, std::int64_t step) noexcept {
  if (n <= 0) return;
  // Two tile rows per task row: blocks of kDecodeMaxRows / 2 rows.
  for (int r0 = 0; r0 < rows; r0 += kDecodeMaxRows / 2) {
    const int rb = rows - r0 < kDecodeMaxRows / 2 ? rows - r0 : kDecodeMaxRows / 2;
    float* a = acc + static_cast<std::int64_t>(r0) * dp;
    const float* x = w + r0 * wstride;
    switch (d / 32) {
      case 1: decode_pv_rows<1>(a, rb, dp, x, wstride, keys, n, v, step); break;
      case 2: decode_pv_rows<2>(a, rb, dp, x, wstride, keys, n, v, step); break;
      case 3: decode_pv_rows<3>(a, rb, dp, x, wstride, keys, n, v, step); break;
      default: decode_pv_rows<4>(a, rb, dp, x, wstride, keys, n, v, step); break;
    }
  }
}

}  // namespace dfss::cpu::amx
