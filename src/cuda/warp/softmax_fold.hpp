// src/cuda/warp/softmax_fold.hpp: the per-lane maths of the two-kernel CUDA pipeline with the
// softmax folded into the SDDMM and the SpMM, as host+device functions shared by the kernels
// (src/cuda/sddmm_select.cu, src/cuda/spmm.cu) and the CPU emulation of the whole pipeline
// (tests/unit/test_cuda_fold.cpp), so the maths CI checks is the maths the GPU runs.
//
// The fold (docs/design.md, "The CUDA pipeline"):
//   SDDMM, per 64-key step (two 32 x 32 units, the key tile of both kernels) and row r: m_t = max of
//     the row's visible fp32 scores in the step (a max that propagates NaN; -inf when the step masks
//     the whole row), the kept scores s stored as exp2((s - m_t) * scale log2 e) in T (in [0, 1], so
//     f16 cannot overflow), and m_t itself; the row's running max M over all its steps is stored once
//     at the end. One maximum per 64 keys rather than per unit halves the quad reductions and the
//     SpMM's factors; it costs no precision: a weight w = exp2((s - m_t) c) >= exp2((s - M) c), the
//     final value, so where w is subnormal in f16 the result is too.
//   SpMM, per step and row: the stored values times f_t = exp2((m_t - M) * scale log2 e) (0 when
//     m_t = -inf), multiplied by V on the sparse tensor cores, and by a column of ones in the same
//     MMA, which gives the row sum L of exactly the weights used; O = acc / L, LSE = ln 2 (M scale
//     log2 e + log2 L). Two exponentials per kept score at most (one here, one per row and step).
//   Special rows: a NaN visible score makes m_t and M NaN, hence every weight, O and LSE NaN; a row
//     with no visible key has L = 0: O = 0, LSE = -inf; +inf makes exp2(inf - inf) = NaN.
// The selection needs no NaN path: a row with a NaN has NaN output whatever was kept, and this
// backend does not export the kept set; the fast rule below keeps a NaN among the kept values (so
// the row maximum, taken over kept values, sees it) and yields legal metadata.
#pragma once

#include <cstdint>

#if !defined(__CUDA_ARCH__)
#include <cmath>
#endif

#include "cuda/warp/mma_fragments.hpp"
#include "cuda/warp/nm_warp_select.hpp"
#include "cuda/warp/sddmm_epilogue.hpp"
#include "dfss/config.hpp"

namespace dfss::cuda::warp {

/// max of two floats that is NaN when either is (PTX max.NaN.f32, sm_80+, one instruction).
DFSS_HD float max_nan(float a, float b) {
#if defined(__CUDA_ARCH__)
  float r;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
#else
  if (a != a) return a;
  if (b != b) return b;
  return a > b ? a : b;
#endif
}

/// min of two floats that ignores one NaN (fminf: one FMNMX instruction on the device), std::fmin
/// on the host, which behaves the same.
DFSS_HD float min_num(float a, float b) {
#if defined(__CUDA_ARCH__)
  return fminf(a, b);
#else
  return std::fmin(a, b);
#endif
}

/// 2^x: ex2.approx.ftz on the device (one MUFU instruction, about 2 ulp; results below 2^-126
/// flush to 0, below the 16-bit types' smallest normals anyway), std::exp2 on the host.
DFSS_HD float fold_exp2(float x) {
#if defined(__CUDA_ARCH__)
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
#else
  return std::exp2(x);
#endif
}

/// @brief 2:4 selection of one group, ranked as nm_select_2of4 ranks (ties to the lower index) when
/// no score is NaN: the larger of each pair (w0 of keys 0-1, w1 of keys 2-3) is kept unless the
/// smaller of the other pair outranks it (a min that ignores one NaN, so a pair's lone NaN is its
/// maximum only). 4 compares, 4 min/max and 4 selects instead of the
/// generic 6 rankings. Gives the two kept values in key order and the group's legal 2:4 nibble.
/// With a NaN in @p s the nibble is still legal and a NaN is among the kept values (the pair
/// maxima propagate NaN), so the row's maximum over kept values is NaN, as the fold needs; which
/// key the nibble names is then unspecified (the row's output is NaN whatever is kept).
template <typename T>
DFSS_HD void select_2of4_no_nan(const T (&s)[4], T& lo, T& hi, std::uint32_t& nibble, unsigned shift = 0) {
  const bool c01 = s[0] >= s[1];  // key 0 outranks key 1 (a tie goes to the lower index)
  const bool c23 = s[2] >= s[3];
  const T w0 = max_nan(s[0], s[1]);
  const T l0 = min_num(s[0], s[1]);
  const T w1 = max_nan(s[2], s[3]);
  const T l1 = min_num(s[2], s[3]);
  const bool both0 = l0 >= w1;  // keys 0 and 1 kept: l0 (lower index) outranks w1 (false if w1 is NaN)
  const bool both1 = l1 > w0;   // keys 2 and 3 kept: l1 (higher index) outranks w0 (false if w0 is NaN)
  lo = both0 ? s[0] : (both1 ? s[2] : w0);
  hi = both0 ? s[1] : (both1 ? s[3] : w1);
  // index a | (2 + b) << 2, every arm a constant (shifted at compile time when @p shift is one)
  const std::uint32_t winners = c23 ? (c01 ? 8u << shift : 9u << shift) : (c01 ? 12u << shift : 13u << shift);
  nibble = both0 ? 0x4u << shift : (both1 ? 0xEu << shift : winners);
}

/// The SDDMM's group selection of pattern p for inputs without NaN (with NaN: legal metadata, a
/// NaN among the kept values of its group, the kept keys unspecified). 1:2 keeps key 1 of a pair
/// iff it is strictly greater; the kept value is the pair's NaN-propagating maximum.
struct no_nan_group_select {
  sp_pattern p;
  template <typename T>
  DFSS_HD void operator()(const T (&s)[4], T& lo, T& hi, std::uint32_t& nibble, unsigned shift = 0) const {
    if (p == sp_pattern::p1of2) {
      const bool b0 = s[1] > s[0];
      const bool b1 = s[3] > s[2];
      lo = max_nan(s[0], s[1]);
      hi = max_nan(s[2], s[3]);
      nibble = b1 ? (b0 ? 13u << shift : 12u << shift) : (b0 ? 9u << shift : 8u << shift);
    } else {
      select_2of4_no_nan(s, lo, hi, nibble, shift);
    }
  }
};

/// @brief select_unit16 with the no-NaN rule: the SDDMM's selection.
template <typename T>
DFSS_HD unit16_selection<T> select_unit16_no_nan(const T (&acc)[2][4][4], int lane, sp_pattern p) {
  return select_unit16_with(acc, lane, no_nan_group_select{p});
}

/// @brief Lane @p lane's part of each row maximum of a unit, from its kept values (the maximum of a
/// group is always kept, and a NaN is kept where there is one): m[i][rh] = NaN-propagating max of
/// the lane's 4 kept values of row 16 i + 8 rh + g (fragment elements 4 h + 2 rh + slot). The row's
/// maximum is the max over its quad.
template <typename T>
DFSS_HD void unit16_lane_row_max(const unit16_selection<T>& sel, T (&m)[2][2]) {
DFSS_UNROLL
  for (int i = 0; i < 2; ++i) {
DFSS_UNROLL
    for (int rh = 0; rh < 2; ++rh) {
      m[i][rh] = max_nan(max_nan(sel.a[i][2 * rh], sel.a[i][2 * rh + 1]),
                         max_nan(sel.a[i][4 + 2 * rh], sel.a[i][4 + 2 * rh + 1]));
    }
  }
}

/// @brief Lane @p lane's part of each row maximum of a 64-key step: the NaN-propagating max of its
/// kept values in both units @p u0 and @p u1 (unit16_lane_row_max of each). The row's maximum is the
/// max over its quad.
template <typename T>
DFSS_HD void step_lane_row_max(const unit16_selection<T>& u0, const unit16_selection<T>& u1, T (&m)[2][2]) {
  T m0[2][2], m1[2][2];
  unit16_lane_row_max(u0, m0);
  unit16_lane_row_max(u1, m1);
DFSS_UNROLL
  for (int i = 0; i < 2; ++i) {
DFSS_UNROLL
    for (int rh = 0; rh < 2; ++rh) m[i][rh] = max_nan(m0[i][rh], m1[i][rh]);
  }
}

/// The reference each stored value is taken against: the row's step maximum, or -FLT_MAX when the
/// unit masks the whole row (m = -inf), so masked scores give exp2(-inf - -FLT_MAX) = 0 rather than
/// NaN; NaN stays NaN. One max.NaN instead of a compare and a select.
DFSS_HD float fold_reference(float m) { return max_nan(m, -3.40282347e38f); }

/// @brief A stored weight: exp2((s - ref) * scale_log2). The difference is taken in fp32 before
/// scaling, so huge finite scores stay exact where s * scale_log2 would overflow.
DFSS_HD float fold_weight(float s, float ref, float scale_log2) { return fold_exp2((s - ref) * scale_log2); }

/// @brief The SpMM's factor of a step's stored weights for a row: exp2((m_t - M) * scale_log2),
/// 0 for a step that masks the whole row (m_t = -inf, also when M = -inf).
DFSS_HD float fold_factor(float m_t, float row_max, float scale_log2) {
  return m_t == neg_inf_f32() ? 0.0f : fold_exp2((m_t - row_max) * scale_log2);
}

/// Row (within the 32 rows of a unit) whose tile maximum lane @p lane stores, and whose factor it
/// computes in the SpMM: quad position t covers m16 tile t / 2, row half t % 2 of row g.
DFSS_HD int fold_lane_row(int lane) {
  const int t = quad_pos_of(lane);
  return 16 * (t >> 1) + 8 * (t & 1) + group_of(lane);
}

// ---------------------------------------------------------------------------------------------
// Intermediates of the folded pipeline, per (batch, head) slice (rows and keys padded as in
// intermediate_layout):
//   values    [rows_padded / 32][keys_padded / 32][2][32][8] T: per 32 x 32 unit, lane l's sparse A
//             fragment of mma.sp m16n8k32 for m16 tile i (the weights, 8 per lane, register order),
//             so the SDDMM stores and the SpMM loads one 16-byte vector per lane and tile;
//   meta      intermediate_layout::meta_offset (one word per lane and unit);
//   tile_max  [rows_padded / 32][keys_padded / 64][32] f32: m_t of each row of each 64-key step;
//   row_max   [rows_padded] f32: M of each row.

/// Offset (elements) of lane @p lane's fragment of m16 tile @p i in unit (@p row_block, @p key_block).
DFSS_HD std::int64_t fold_value_offset(const intermediate_layout& l, std::int64_t row_block, std::int64_t key_block,
                                       int i, int lane) {
  return (((row_block * (l.keys_padded / 32) + key_block) * 2 + i) * 32 + lane) * 8;
}

/// @brief Offset (elements) in the values of compressed column @p ccol (2 x 4-key group + slot) of
/// row @p row: the inverse of the fragment order (mma_sp_a16_coord), for host-side checks.
DFSS_HD std::int64_t fold_value_index(const intermediate_layout& l, std::int64_t row, std::int64_t ccol) {
  const int ru = static_cast<int>(row % 32);      // row within the unit
  const int cu = static_cast<int>(ccol % 16);     // compressed column within the unit (8 groups x 2)
  const int chunk = cu / 2;                       // 4-key group: t + 4 h
  const int rr = ru % 16;                         // row within the m16 tile: g + 8 rh
  const int lane = 4 * (rr % 8) + chunk % 4;
  const int e = 4 * (chunk / 4) + 2 * (rr / 8) + cu % 2;
  return fold_value_offset(l, row / 32, ccol / 16, ru / 16, lane) + e;
}

/// Keys per tile maximum m_t: one SDDMM step (two units), the SpMM's k step too.
inline constexpr std::int64_t kFoldStepKeys = 64;
static_assert(kIntermediateKeyAlign % kFoldStepKeys == 0, "every padded slice holds whole steps");

/// Offset of m_t of row @p row (0..31) of rows 32 @p row_block.. and keys 64 @p key_step...
DFSS_HD std::int64_t fold_tile_max_offset(const intermediate_layout& l, std::int64_t row_block,
                                          std::int64_t key_step, int row) {
  return (row_block * (l.keys_padded / kFoldStepKeys) + key_step) * 32 + row;
}

/// Floats of one slice's tile maxima.
DFSS_HD std::int64_t fold_tile_max_elems(const intermediate_layout& l) {
  return l.rows_padded * (l.keys_padded / kFoldStepKeys);
}

}  // namespace dfss::cuda::warp
