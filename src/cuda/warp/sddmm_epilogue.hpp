// src/cuda/warp/sddmm_epilogue.hpp: the SDDMM epilogue's masking of a unit's accumulators (from each
// row's visible end, dfss/mask/visibility.hpp), as host+device functions shared by the kernel
// (src/cuda/sddmm_select.cu) and the CPU simulation tests (tests/unit/test_cuda_warp.cpp).
#pragma once

#include <cstdint>

#include "cuda/warp/mma_fragments.hpp"
#include "dfss/config.hpp"

namespace dfss::cuda::warp {

/// -inf without library calls (valid in host and device code).
DFSS_HD float neg_inf_f32() { return -__builtin_huge_valf(); }

/// @brief Exclusive end, relative to @p key0 and clamped to [0, 32], of the visible keys of a row
/// whose visible end is @p row_end (mask::visible_end; the CUDA backend takes Lk < 2^31 keys, so
/// both fit 32 bits and the difference cannot overflow).
DFSS_HD int unit_relative_end(int row_end, int key0) {
  const int end = row_end - key0;
  return end < 0 ? 0 : (end > kUnitKeys16 ? kUnitKeys16 : end);
}

/// @brief Sets to -inf lane @p lane's accumulators at keys >= end[i][rh] of its rows (keys within
/// the unit, 32-bit): the boundary units' mask, from each row's visible end computed once.
template <typename T>
DFSS_HD void mask_unit16_relative(T (&acc)[2][4][4], int lane, const int (&end)[2][2]) {
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

}  // namespace dfss::cuda::warp
