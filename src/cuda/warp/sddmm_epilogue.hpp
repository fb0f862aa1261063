// src/cuda/warp/sddmm_epilogue.hpp: the SDDMM epilogue's per-lane index maths (masking of a unit's
// accumulators and where each kept value is stored), as host+device functions shared by the kernel
// (src/cuda/sddmm_select.cu) and the CPU simulation tests (tests/unit/test_cuda_warp.cpp).
#pragma once

#include <cstdint>

#include "cuda/warp/mma_fragments.hpp"
#include "dfss/config.hpp"
#include "dfss/mask/visibility.hpp"

namespace dfss::cuda::warp {

/// -inf without library calls (valid in host and device code).
DFSS_HD float neg_inf_f32() { return -__builtin_huge_valf(); }

/// Which keys a row sees: the one rule of dfss/mask/visibility.hpp (key lengths, bottom-right
/// causal). Its visible keys are a prefix of [0, Lk), so keys past the end (padding of the last
/// tile) are masked to -inf too.
struct score_mask {
  std::int64_t seqlen_q;  ///< Lq
  std::int64_t seqlen_k;  ///< Lk
  std::int64_t kv_len;    ///< valid keys of this batch, in [0, Lk]
  bool causal;            ///< apply the causal rule

  DFSS_HD bool visible(std::int64_t row, std::int64_t key) const {
    return mask::visible(causal, seqlen_q, seqlen_k, kv_len, row, key);
  }
};

/// @brief Exclusive end, relative to @p key0 and clamped to [0, 32], of the keys of row @p row that
/// @p m leaves visible. The visible keys of a row are a prefix (mask::visible_end), so one 64-bit
/// limit per row and 32-bit compares per element suffice.
DFSS_HD int unit_visible_end(const score_mask& m, std::int64_t row, std::int64_t key0) {
  const std::int64_t end = mask::visible_end(m.causal, m.seqlen_q, m.seqlen_k, m.kv_len, row) - key0;
  return end < 0 ? 0 : (end > kUnitKeys16 ? kUnitKeys16 : static_cast<int>(end));
}

/// @brief Sets to -inf every accumulator of lane @p lane's 16-bit unit (rows row0.., keys key0..)
/// that @p m masks. Selection then runs on the masked fp32 scores, as the semantics require. A lane
/// holds 4 rows (m16 tile i, row half rh): one limit each, then one compare per accumulator.
template <typename T>
DFSS_HD void apply_unit16_mask(T (&acc)[2][4][4], int lane, std::int64_t row0, std::int64_t key0,
                               const score_mask& m) {
  int end[2][2];
DFSS_UNROLL
  for (int i = 0; i < 2; ++i) {
DFSS_UNROLL
    for (int rh = 0; rh < 2; ++rh) end[i][rh] = unit_visible_end(m, row0 + sddmm16_acc_coord(lane, i, 0, 2 * rh).row, key0);
  }
DFSS_UNROLL
  for (int i = 0; i < 2; ++i) {
DFSS_UNROLL
    for (int j = 0; j < 4; ++j) {
DFSS_UNROLL
      for (int r = 0; r < 4; ++r) {
        if (sddmm16_acc_coord(lane, i, j, r).col >= end[i][r >> 1]) acc[i][j][r] = static_cast<T>(neg_inf_f32());
      }
    }
  }
}

/// Where a lane stores a pair of kept values: row and compressed column of the first of the two
/// (the second is at ccol + 1).
struct unit16_store {
  std::int64_t row;
  std::int64_t ccol;
};

/// @brief Store position of elements @p e and e + 1 (e even) of lane @p lane's sparse A fragment
/// of m16 tile @p i in a unit at rows row0.., keys key0.. (compressed columns key0 / 2..).
DFSS_HD unit16_store unit16_value_store(int lane, int i, int e, std::int64_t row0, std::int64_t key0) {
  const frag_coord c = mma_sp_a16_coord(lane, e);
  return {row0 + 16 * i + c.row, key0 / 2 + c.col};
}

}  // namespace dfss::cuda::warp
