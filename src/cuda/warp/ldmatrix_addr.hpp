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

/// @brief ldmatrix.x4 of a 16 x 16 A fragment (dense m16n8k16 A; also the compressed sparse A of
/// mma.sp m16n8k32) from a row-major tile: lanes 0..15 give rows 0..15 at column 0 (matrices 0, 1:
/// rows 0..7 and 8..15 of columns 0..7), lanes 16..31 the same rows at column 8 (matrices 2, 3).
DFSS_HD smem_coord ldsm_a16_x4(int lane) { return {lane & 15, 8 * (lane >> 4)}; }

/// @brief ldmatrix.x4 of the SDDMM's K tile (keys x head dim, row-major) for n8 tiles 2 jp and
/// 2 jp + 1 of a 16-bit unit: matrix m = lane / 8 is n8 tile 2 jp + m / 2, k half m % 2; its row
/// lane % 8 is the key of accumulator column 8 (2 jp + m / 2) + lane % 8 under the key permutation.
DFSS_HD smem_coord ldsm_sddmm16_b_x4(int lane, int jp) {
  const int m = lane >> 3;
  return {sddmm16_key_of_column(8 * (2 * jp + (m >> 1)) + (lane & 7)), 8 * (m & 1)};
}

/// @brief ldmatrix.x4.trans of the B fragment of one mma.sp m16n8k32 from the SpMM's V tile (keys x
/// head dim, row-major): lane l gives key row l, so matrix m covers keys 8m..8m+7 of 8 columns.
DFSS_HD smem_coord ldsm_spmm_b_x4_trans(int lane) { return {lane, 0}; }

}  // namespace dfss::cuda::warp
