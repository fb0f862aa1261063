// amx_tiles.hpp's tile loops (compiled with -mamx-tile -mamx-bf16).
#include "cpu/simd/amx_tiles.hpp"

#include <immintrin.h>

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

}  // namespace dfss::cpu::amx
