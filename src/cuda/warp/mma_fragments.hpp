// src/cuda/warp/mma_fragments.hpp: which lane of a warp holds which matrix element of the sm_80
// tensor core instructions dfss uses, written as host+device functions (PTX ISA 9.1, sections
// 9.7.13.4.x for the dense mma and 9.7.14.6.2.x for mma.sp; anchors.md section C.3 and C.4).
//
// Notation: lane = 0..31, g = lane / 4 (groupID), t = lane % 4 (threadID_in_group). A "quad" is the
// four lanes 4g .. 4g+3. Every function returns logical coordinates inside one instruction's tile;
// the kernels add tile origins. The CPU tests simulate all 32 lanes with these functions, and the
// kernels compute their addresses with the same functions, so the index maths the GPU runs is the
// maths CI checks.
//
// Shapes:
//   dense  mma.sync.m16n8k16 f16/bf16 (SDDMM Q K^T): A 16x16 (8 halves/lane), B 16x8 (4), C 16x8 (4 f32)
//   dense  mma.sync.m16n8k8  tf32                  : A 16x8  (4 tf32/lane),  B 8x8  (2), C 16x8 (4 f32)
//   sparse mma.sp.m16n8k32   f16/bf16 (SpMM P V)   : A 16x32 stored 16x16 (8 kept halves/lane), B 32x8 (8)
//   sparse mma.sp.m16n8k16   tf32                  : A 16x16 stored 16x8 (4 kept tf32/lane),    B 16x8 (4)
#pragma once

#include <cstdint>

#include "dfss/config.hpp"

// Full unrolling of the fixed-trip loops over a lane's registers, so every register array is indexed
// by constants (a run-time index would move it to local memory). Host compilers just run the loops.
#if defined(__CUDA_ARCH__)
#define DFSS_UNROLL _Pragma("unroll")
#else
#define DFSS_UNROLL
#endif

namespace dfss::cuda::warp {

inline constexpr int kWarpSize = 32;

/// groupID of a lane: the accumulator row (and row + 8) it holds.
DFSS_HD int group_of(int lane) { return lane >> 2; }
/// threadID_in_group of a lane: its position inside its quad.
DFSS_HD int quad_pos_of(int lane) { return lane & 3; }

/// A (row, column) position inside one instruction's tile. For a sparse A operand `col` is the
/// column of the compressed (stored) matrix.
struct frag_coord {
  int row;
  int col;
};

/// @brief C/D accumulator @p reg (0..3) of m16n8k16 and m16n8k8 (f32): c0, c1 at row g, columns 2t
/// and 2t+1; c2, c3 at row g+8, same columns.
DFSS_HD frag_coord mma_c_coord(int lane, int reg) {
  return {group_of(lane) + 8 * ((reg >> 1) & 1), 2 * quad_pos_of(lane) + (reg & 1)};
}

/// @brief Element @p e (0..7) of the dense A operand of mma.sync.m16n8k16 f16/bf16: a0,a1 row g
/// cols 2t,2t+1; a2,a3 row g+8 same cols; a4..a7 the same rows at cols + 8.
DFSS_HD frag_coord mma_a16_coord(int lane, int e) {
  return {group_of(lane) + 8 * ((e >> 1) & 1), 2 * quad_pos_of(lane) + (e & 1) + 8 * ((e >> 2) & 1)};
}

/// @brief Element @p e (0..3) of the dense B operand of mma.sync.m16n8k16 f16/bf16 as (k, n):
/// b0,b1 at k = 2t, 2t+1; b2,b3 at k = 2t+8, 2t+9; n = g.
DFSS_HD frag_coord mma_b16_coord(int lane, int e) {
  return {2 * quad_pos_of(lane) + (e & 1) + 8 * ((e >> 1) & 1), group_of(lane)};
}

/// @brief Element @p e (0..3) of the dense A operand of mma.sync.m16n8k8 tf32: a0 (g, t),
/// a1 (g+8, t), a2 (g, t+4), a3 (g+8, t+4).
DFSS_HD frag_coord mma_a_tf32_coord(int lane, int e) {
  return {group_of(lane) + 8 * (e & 1), quad_pos_of(lane) + 4 * ((e >> 1) & 1)};
}

/// @brief Element @p e (0..1) of the dense B operand of mma.sync.m16n8k8 tf32 as (k, n): b0 at
/// k = t, b1 at k = t+4; n = g.
DFSS_HD frag_coord mma_b_tf32_coord(int lane, int e) {
  return {quad_pos_of(lane) + 4 * (e & 1), group_of(lane)};
}

/// @brief Kept element @p e (0..7) of the sparse A operand of mma.sp.m16n8k32 f16/bf16 as (row,
/// compressed column). Row g (e = 0,1,4,5) or g+8 (e = 2,3,6,7); e 0..3 are the two kept values of
/// 4-key chunk t, e 4..7 those of chunk t+4, each pair in increasing key order. Compressed column
/// = 2 * chunk + slot: the same (row, col) map as the dense m16n8k16 A fragment of the compressed
/// 16x16 tile, which is why ldmatrix.x4 loads it from a row-major compressed matrix.
DFSS_HD frag_coord mma_sp_a16_coord(int lane, int e) {
  const int chunk = quad_pos_of(lane) + 4 * ((e >> 2) & 1);
  return {group_of(lane) + 8 * ((e >> 1) & 1), 2 * chunk + (e & 1)};
}

/// @brief Element @p e (0..7) of the dense B operand of mma.sp.m16n8k32 f16/bf16 as (k, n): k = 2t +
/// (e & 1) + 8 * (e >> 1), n = g (two stacked m16n8k16 B fragments; ldmatrix.x4.trans of 32 rows).
DFSS_HD frag_coord mma_sp_b16_coord(int lane, int e) {
  return {2 * quad_pos_of(lane) + (e & 1) + 8 * ((e >> 1) & 3), group_of(lane)};
}

/// @brief Kept element @p e (0..3) of the sparse A operand of mma.sp.m16n8k16 tf32 as (row,
/// compressed column = pair index): a0 (g, pair t), a1 (g+8, pair t), a2 (g, pair t+4), a3 (g+8,
/// pair t+4). The same map as the dense m16n8k8 tf32 A fragment of the compressed 16x8 tile.
DFSS_HD frag_coord mma_sp_a_tf32_coord(int lane, int e) { return mma_a_tf32_coord(lane, e); }

/// Where one 4-bit metadata field lives: the lane that supplies it and its bit offset in that
/// lane's 32-bit metadata register.
struct meta_slot {
  int lane;
  int shift;
};

/// @brief Metadata field of row @p row (0..15) and group @p group of a sparse A tile, for
/// mma.sp.m16n8k32 f16/bf16 (group = 4-key chunk 0..7) and mma.sp.m16n8k16 tf32 (group = key pair
/// 0..7), with sparsity selector @p f (0 or 1). Lane 4g + 2f supplies groups 0..3 and lane 4g + 2f
/// + 1 groups 4..7, for rows g (bits 15:0) and g+8 (bits 31:16); group q's field is at bits 4(q%4)
/// within its half (anchors.md C.4).
DFSS_HD meta_slot mma_sp_meta_slot(int row, int group, int f) {
  return {4 * (row & 7) + 2 * f + ((group >> 2) & 1), 16 * ((row >> 3) & 1) + 4 * (group & 3)};
}

// ---------------------------------------------------------------------------------------------
// The SDDMM warp tile ("unit"): 32 query rows (two m16 tiles i = 0, 1) by 32 keys for 16-bit types
// (four n8 tiles j = 0..3 of the dense m16n8k16) or 16 keys for tf32 (two n8 tiles of m16n8k8). A
// lane's accumulators of a unit are acc[i][j][r], r = the C register (mma_c_coord).
//
// 16-bit key permutation: the K rows are fed to the dense Q K^T so that accumulator column s of the
// unit holds key sddmm16_key_of_column(s). Lane t's columns {2t, 2t+1} of n8 tiles 0 and 1 then hold
// keys 4t..4t+3 (chunk t) and those of tiles 2 and 3 keys 16+4t..19+4t (chunk t+4): every lane owns
// whole aligned groups of 4 keys, exactly the chunks its sparse A fragment of mma.sp.m16n8k32 needs,
// so selection and compression need no data exchange between lanes (only the metadata does). The
// permutation costs nothing: it only changes which K row address each lane gives ldmatrix. (This is
// the original DFSS artifact's interleaving, p = [0,1,4,5,8,9,12,13, 2,3,6,7,10,11,14,15].)
//
// tf32 needs no permutation: lane t's columns {2t, 2t+1} of n8 tiles 0 and 1 are key pairs t and
// t+4 of the 16 keys, the pairs of its sparse A fragment of mma.sp.m16n8k16 tf32.

inline constexpr int kUnitRows = 32;
inline constexpr int kUnitKeys16 = 32;
inline constexpr int kUnitKeysTf32 = 16;

/// @brief Key (0..31, within a 32-key unit) held by accumulator column @p s (0..31, n8 tile s / 8,
/// column s % 8) of the 16-bit SDDMM.
DFSS_HD int sddmm16_key_of_column(int s) {
  return 16 * ((s >> 4) & 1) + 4 * ((s >> 1) & 3) + 2 * ((s >> 3) & 1) + (s & 1);
}

/// @brief Inverse of sddmm16_key_of_column: the accumulator column holding key @p k (0..31).
DFSS_HD int sddmm16_column_of_key(int k) {
  return 16 * ((k >> 4) & 1) + 8 * ((k >> 1) & 1) + 2 * ((k >> 2) & 3) + (k & 1);
}

/// @brief (row within the unit, key within the unit) of lane @p lane's 16-bit SDDMM accumulator
/// acc[i][j][r].
DFSS_HD frag_coord sddmm16_acc_coord(int lane, int i, int j, int r) {
  const frag_coord c = mma_c_coord(lane, r);
  return {16 * i + c.row, sddmm16_key_of_column(8 * j + c.col)};
}

/// @brief (row within the unit, key within the unit) of lane @p lane's tf32 SDDMM accumulator
/// acc[i][j][r] (no permutation).
DFSS_HD frag_coord sddmm_tf32_acc_coord(int lane, int i, int j, int r) {
  const frag_coord c = mma_c_coord(lane, r);
  return {16 * i + c.row, 8 * j + c.col};
}

}  // namespace dfss::cuda::warp
