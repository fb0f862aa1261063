// The fused forward's Q K^T and P V on Intel's AMX tiles (tdpbf16ps), for bf16 inputs on CPUs with
// AMX-BF16 (core::cpu_uses_amx), and the grouped decode's (decode_qk, decode_pv: a bf16 cache with
// 2 to 16 rows per kv head). One translation unit compiled with -mamx-tile -mamx-bf16
// (amx_tiles.cpp, only where the compiler has the flags: DFSS_HAVE_AMX); the AVX3 instances of the
// forward and the decode forward call it, only when core::cpu_uses_amx() said yes.
//
// Numerics: tdpbf16ps multiplies bf16 pairs exactly and accumulates in fp32, but in an order and
// with roundings that Intel does not specify (measured on Sapphire Rapids: the bits match neither
// an FMA chain in either pair order nor one rounding per pair; the largest error over 512,000 random
// 32-term sums was 5.5 u times the sum of the terms' magnitudes, u = 2^-24). So the scores are not
// the fp32 micro-kernel's bits: the forward settles every group with two scores within the error
// bound in the micro-kernel's order (attention_forward.cpp, select_amx), which keeps the
// selection exactly that of the fp32 kernels (and of the fused backward, which recomputes it).
// The bound assumed there: at most d additions, each exact to within 2u relative (any rounding
// direction), bf16 denormal operands read as 0 and denormal sums flushed to 0; checked on the
// running CPU through its consequence, by Cpu.AmxKeepsTheFp32Selection (tests/unit/test_cpu.cpp:
// near ties everywhere, decided by rounding).
#pragma once

#include <cstdint>

namespace dfss::cpu::amx {

/// Keys of a packed panel (the AVX3 panel: two 16-key B tiles side by side).
inline constexpr int kPanel = 32;
/// Column pairs per tile step (one 64-byte tile row of bf16 pairs): the head dim must be a
/// multiple of 2 kPairs.
inline constexpr int kPairs = 16;
/// Rows per call at most: two A tiles of 16 rows.
inline constexpr int kMaxRows = 32;

/// Loads the tile configuration of qk_tile for @p rows query rows (<= kMaxRows) on this thread
/// (replacing any earlier one, e.g. oneDNN's): once per task, as LDTILECFG and TILERELEASE per key
/// tile were a third of the tile loop's time.
void configure(int rows) noexcept;

/// Releases the tiles of this thread (TILERELEASE: the OS then saves no tile state on a switch).
void release() noexcept;

/// S[r][t] (row stride @p w floats) = sum over column pairs of q[r] . k[t], for @p rows query rows
/// (@p rows <= kMaxRows; rows past 16 in a second tile) and the first @p width keys (a multiple of
/// kPanel) of @p panels: q holds [rows][dp / 2] pairs (columns c and c + 1 of a row in one 32-bit
/// word), the panels [width / kPanel][dp / 2][kPanel] pairs of the keys, in the same column order;
/// @p dp a multiple of 2 kPairs. The thread's tiles must be configured for @p rows (configure).
void qk_tile(const std::uint32_t* q, int rows, int dp, const std::uint32_t* panels, int width, int w,
             float* s) noexcept;

/// @p out[g] = the bf16 pair of @p w[2g] (low half) and @p w[2g + 1], for g < @p pairs (a multiple
/// of 16): round to nearest even (vcvtne2ps2bf16), as float_to_bf16 rounds, except that results
/// below bf16's normal range become 0, which pv_tile's tdpbf16ps reads them as anyway.
void weights_to_pairs(const float* w, int pairs, std::uint32_t* out) noexcept;

/// @p out[g] = the bf16 of @p w[g] shifted left by @p shift[g] (0: key 2g's half of the pair, 16:
/// key 2g + 1's), the other half 0, for g < @p pairs (a multiple of 16): a 1:2 row's weights, one
/// per pair, as weights_to_pairs makes them from the dense row with its pruned keys' zeros (the
/// same rounding, the same bits).
void kept_weights_to_pairs(const float* w, const std::int32_t* shift, int pairs, std::uint32_t* out) noexcept;

/// acc[r][0, dp) += sum over key pairs g < @p pairs of p_r,2g v_2g + p_r,2g+1 v_2g+1 for @p rows
/// accumulator rows (row stride dp floats): @p p holds [rows][pairs] bf16 weight pairs (key 2g in the
/// low half), @p v [pairs][dp] value pairs (column c of keys 2g and 2g + 1 in one 32-bit word, 2g in
/// the low half); @p pairs a multiple of kPairs, @p dp of 16. The thread's tiles must be configured
/// for @p rows (configure: the same tiles as qk_tile's).
void pv_tile(const std::uint32_t* p, int rows, int pairs, const std::uint32_t* v, int dp, float* acc) noexcept;

/// Task rows of the decode kernel's tile products at most (a B tile row holds 16 32-bit columns).
inline constexpr int kDecodeMaxRows = 16;
/// Head dims of the decode kernel's tile products: multiples of 32 up to this (the Q K^T keeps
/// d / 32 B tiles of Q beside the scores' and the keys' tiles, 8 tiles in all).
inline constexpr int kDecodeMaxDim = 128;

/// The decode kernel's direct Q K^T from a bf16 cache on the tiles, S^T = K Q^T: for @p rows (at
/// most kDecodeMaxRows) task rows given as @p qt ([d / 2][rows] pairs: columns 2p, in the low half,
/// and 2p + 1 of row r at qt[p rows + r]) and @p n (a multiple of 16) cache rows k + t * step (bf16,
/// d contiguous values each, read straight from the cache as A tiles), s[r * ds + t] = the score of
/// row r and key t; d a multiple of 32, at most kDecodeMaxDim. @p top gets the largest magnitude
/// bits (x & 0x7fff) of the K values read, maxed into it. Loads its own tile configuration.
void decode_qk(const std::uint32_t* qt, int rows, int d, const std::uint16_t* k, std::int64_t step, int n, float* s,
               std::int64_t ds, std::uint16_t* top) noexcept;

/// The decode kernel's key-major P V from a bf16 cache on the tiles, each V row read once for all
/// rows: acc[r][0, d) += sum over t < @p n of w[r * wstride + key(t)] v(key(t)) for @p rows (at
/// most kDecodeMaxRows) accumulator rows acc + r * dp, key(t) = @p keys[t] (or t where @p keys is
/// null), v(j) = v + j * step (bf16, d contiguous values), the weights each split into a bf16 part
/// and the bf16 of the rest (two tile products: the weight kept to 2^-17 of itself, where the fp32
/// FMAs of the other kernels keep it whole and bf16 alone to 2^-9), d a multiple of 32, at most
/// kDecodeMaxDim. Keys go in blocks of 32 of the list (16 pairs: one pair of tile products per 16
/// columns; a last partial block padded with weight 0 and zero values), so any split of the list
/// at multiples of 32 gives the same bits. A non-finite V value read reaches every row's
/// accumulator in its column (0 * inf is NaN). Loads its own tile configuration.
void decode_pv(float* acc, int rows, int dp, int d, const float* w, std::int64_t wstride, const std::int32_t* keys,
               int n, const std::uint16_t* v, std::int64_t step) noexcept;

}  // namespace dfss::cpu::amx
