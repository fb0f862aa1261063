// The fused forward's Q K^T and P V on Intel's AMX tiles (tdpbf16ps), for bf16 inputs on CPUs with
// AMX-BF16 (core::cpu_uses_amx). One translation unit compiled with -mamx-tile -mamx-bf16
// (amx_tiles.cpp, only where the compiler has the flags: DFSS_HAVE_AMX); the AVX3 instance of the
// forward calls it, only when core::cpu_uses_amx() said yes.
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

/// acc[r][0, dp) += sum over key pairs g < @p pairs of p_r,2g v_2g + p_r,2g+1 v_2g+1 for @p rows
/// accumulator rows (row stride dp floats): @p p holds [rows][pairs] bf16 weight pairs (key 2g in the
/// low half), @p v [pairs][dp] value pairs (column c of keys 2g and 2g + 1 in one 32-bit word, 2g in
/// the low half); @p pairs a multiple of kPairs, @p dp of 16. The thread's tiles must be configured
/// for @p rows (configure: the same tiles as qk_tile's).
void pv_tile(const std::uint32_t* p, int rows, int pairs, const std::uint32_t* v, int dp, float* acc) noexcept;

}  // namespace dfss::cpu::amx
