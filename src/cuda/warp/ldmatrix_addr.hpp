// src/cuda/warp/ldmatrix_addr.hpp: the shared-memory row and column whose address each lane gives
// ldmatrix in the kernels, as host+device functions: the kernels (sddmm_select.cu, spmm.cu) take
// their ldmatrix addresses from here, and tests/unit/test_cuda_ldmatrix.cpp emulates ldmatrix and
// ldmatrix.trans for 32 lanes on these addresses and checks that every register receives exactly
// the element mma_fragments.hpp says it must hold.
//
// ldmatrix.x4 (PTX ISA 9.7.14.5.15): lane l gives the address of row l % 8 of 8x8 matrix l / 8 (8
// consecutive 16-bit elements); register m of lane l receives elements (row l / 4, columns 2 (l % 4)
// and + 1) of matrix m, or with .trans elements (rows 2 (l % 4) and + 1, column l / 4).
#pragma once

#include "cuda/warp/mma_fragments.hpp"
#include "dfss/config.hpp"

namespace dfss::cuda::warp {

/// A (row, column) offset inside a shared-memory tile, from the tile origin the kernel adds.
struct smem_coord {
  int row;
  int col;
};

/// @brief Shared-memory row (0..31, within the unit's 32 rows) where the SDDMM's copy puts key
/// @p k (0..31) of a unit: keys are stored in accumulator-column order (row s holds key
/// sddmm16_key_of_column(s)), so every ldmatrix of B reads 8 consecutive rows, which the row padding
/// spreads over distinct banks (key-order storage with permuted addresses cost a 2-way conflict).
DFSS_HD int sddmm16_smem_row_of_key(int k) { return sddmm16_column_of_key(k); }

/// @brief Shared-memory row of key @p r (0..63) of a 64-key step: its unit's rows, permuted within the
/// unit. The permutation only moves bits 1..4 of r, so for r = r0 + p with r0 < 8 and p a multiple
/// of 8 the row is sddmm16_smem_row(r0) + sddmm16_smem_row(p): the copy adds a constant per chunk.
DFSS_HD int sddmm16_smem_row(int r) { return 32 * (r / 32) + sddmm16_smem_row_of_key(r % 32); }

/// @brief The SDDMM copy's shared-memory row of chunk row r0 + pass it (r0 < pass, pass a power of two
/// >= 8, so the two terms share no bit) is copy_row_base(r0) + copy_row_offset(pass, it): one register
/// per thread plus a compile-time constant per chunk.
DFSS_HD int sddmm16_copy_row_base(int r0) { return sddmm16_smem_row(r0); }
DFSS_HD int sddmm16_copy_row_offset(int pass, int it) { return sddmm16_smem_row(pass * it); }

/// @brief ldmatrix.x4 of the SDDMM's K tile (rows in accumulator-column order, see
/// sddmm16_smem_row_of_key) for n8 tiles 2 jp and 2 jp + 1 of a 16-bit unit: matrix m = lane / 8 is
/// n8 tile 2 jp + m / 2, k half m % 2; its row lane % 8 is accumulator column 8 (2 jp + m / 2) +
/// lane % 8.
DFSS_HD smem_coord ldsm_sddmm16_b_x4(int lane, int jp) {
  const int m = lane >> 3;
  return {8 * (2 * jp + (m >> 1)) + (lane & 7), 8 * (m & 1)};
}

/// @brief ldmatrix.x4.trans of the B fragment of one mma.sp m16n8k32 from the SpMM's V tile (keys x
/// head dim, row-major): lane l gives key row l, so matrix m covers keys 8m..8m+7 of 8 columns.
DFSS_HD smem_coord ldsm_spmm_b_x4_trans(int lane) { return {lane, 0}; }

}  // namespace dfss::cuda::warp
