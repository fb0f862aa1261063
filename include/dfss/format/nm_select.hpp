// dfss/format/nm_select.hpp: the N:M selection rule, written once for every backend.
//
// The keys of an attention row are split into aligned groups of M consecutive keys; in every group
// the N highest-ranked scores are kept. "Ranks above" is a strict total order on (score, key
// index): NaN ranks above every number (so a NaN is never pruned away and propagates as in dense
// attention), numbers rank by signed value, and equal scores (including -inf == -inf and +0 == -0)
// and pairs of NaNs rank by key index, the lower index first. A last partial group is padded with
// positions that rank below every real position, and among themselves by index. The result of a
// selection is a keep mask: bit p set means position p of the group is kept; it always has exactly
// N bits set.
//
// The functions here are header-only and compile for host (g++) and device (nvcc) alike, so the
// reference, CPU and CUDA backends all evaluate exactly this code. They use no exceptions, no std::
// containers and no library maths (NaN is detected with x != x).
#pragma once

#include <cstdint>

#include "dfss/config.hpp"

namespace dfss {

/// @brief True when score @p a at key index @p ia ranks above score @p b at key index @p ib: a is
/// NaN and b is not, or a > b, or a and b compare equal (or are both NaN) and ia < ib.
template <typename T>
DFSS_HD bool nm_ranks_above(T a, int ia, T b, int ib) {
  const bool a_nan = a != a;
  const bool b_nan = b != b;
  if (a_nan || b_nan) return a_nan && (!b_nan || ia < ib);
  return a > b || (a == b && ia < ib);
}

/// @brief Keep mask of one aligned group of an N:M selection.
///
/// @p s points at the group's scores; only s[0 .. count) are read. Positions >= @p count (a partial
/// last group) are padding that ranks below every real position, in index order. Position p is kept
/// iff fewer than @p n positions rank above it, so exactly @p n bits are set.
/// Preconditions: 1 <= n <= m <= 16; @p count outside [0, m] is clamped.
template <typename T>
DFSS_HD std::uint32_t nm_select_group(const T* s, int count, int n, int m) {
  const int real = count < 0 ? 0 : (count > m ? m : count);
  std::uint32_t keep = 0;
  for (int p = 0; p < m; ++p) {
    // Padding position p ranks below all `real` real positions and the padding before it: rank p.
    int above = p;
    if (p < real) {
      above = 0;
      for (int q = 0; q < real && above < n; ++q) {
        above += nm_ranks_above(s[q], q, s[p], p) ? 1 : 0;
      }
    }
    if (above < n) keep |= 1u << p;
  }
  return keep;
}

/// @brief 1:2 selection of a full group (equal to nm_select_group(s, 2, 1, 2)): 0x1 keeps s[0],
/// 0x2 keeps s[1]. One comparison: the order is total, so exactly one position ranks above the
/// other.
template <typename T>
DFSS_HD std::uint32_t nm_select_1of2(const T* s) {
  return nm_ranks_above(s[1], 1, s[0], 0) ? 0x2u : 0x1u;
}

/// @brief 2:4 selection of a full group (equal to nm_select_group(s, 4, 2, 4)).
///
/// The six pairwise comparisons of the ranking give, for every position, the number of positions
/// ranking above it (the order is total, so "q above p" is exactly "not p above q"); a position is
/// kept iff that number is below 2. Unlike a "largest pairwise sum" rule, this stays exact with
/// -inf, NaN and fp32 rounding.
template <typename T>
DFSS_HD std::uint32_t nm_select_2of4(const T* s) {
  const int a01 = nm_ranks_above(s[0], 0, s[1], 1) ? 1 : 0;
  const int a02 = nm_ranks_above(s[0], 0, s[2], 2) ? 1 : 0;
  const int a03 = nm_ranks_above(s[0], 0, s[3], 3) ? 1 : 0;
  const int a12 = nm_ranks_above(s[1], 1, s[2], 2) ? 1 : 0;
  const int a13 = nm_ranks_above(s[1], 1, s[3], 3) ? 1 : 0;
  const int a23 = nm_ranks_above(s[2], 2, s[3], 3) ? 1 : 0;
  const int above0 = (1 - a01) + (1 - a02) + (1 - a03);
  const int above1 = a01 + (1 - a12) + (1 - a13);
  const int above2 = a02 + a12 + (1 - a23);
  const int above3 = a03 + a13 + a23;
  return (above0 < 2 ? 0x1u : 0u) | (above1 < 2 ? 0x2u : 0u) | (above2 < 2 ? 0x4u : 0u) |
         (above3 < 2 ? 0x8u : 0u);
}

/// @brief Number of set bits of a 16-bit keep mask (portable: no compiler builtins).
DFSS_HD int nm_mask_popcount(std::uint32_t mask) {
  int c = 0;
  for (int p = 0; p < 16; ++p) c += static_cast<int>((mask >> p) & 1u);
  return c;
}

}  // namespace dfss
