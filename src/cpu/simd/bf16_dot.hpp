// The bf16 dot-product loops of the avx3_bf16 target (x86-64 AVX-512 with AVX512_BF16): Q K^T
// and P V of the fused forward from bf16 operands with fp32 accumulation (vdpbf16ps). They live in
// their own translation unit (bf16_dot_avx512.cpp, compiled with -mavx512bf16 and only on x86-64
// with a compiler that has it: DFSS_HAVE_BF16_DOT); the AVX3 instance of the Highway kernel family
// calls them for bf16 inputs when the selector picked avx3_bf16, which it does only on a CPU that
// reports AVX512_BF16 (core::cpu_has). docs/design.md, "bf16 dot products", has the layouts and
// the measurements; docs/semantics.md, "Precision", what changes numerically.
//
// vdpbf16ps computes, per fp32 lane, acc + a_odd b_odd and then + a_even b_even, each step one
// rounding (the products of two bf16 are exact in fp32), bf16 denormal operands read as 0 and a
// denormal result flushed to 0 (the Intel pseudo-code; measured bit for bit on Zen 5, and tested:
// tests/unit/test_cpu.cpp, "Bf16DotScoresAreTheFp32Scores"). So with column c in the odd slot and
// c + 1 in the even one, a score is the same fp32 FMA chain over c = 0, 1, ... as the fp32
// micro-kernel's: the same bits, unless an operand or a partial sum is below 2^-126 in magnitude.
//
// Only constants and declarations here: every function is defined in the -mavx512bf16 unit, none
// inline, so the linker can never pick an AVX-512 copy of a shared inline function for other code.
#pragma once

#include <cstdint>

namespace dfss::cpu::bf16dot {

/// Panel width of the packed keys (32 keys: two 16-lane accumulators per row), equal to the AVX3
/// fp32 panel so that the key tile width and every offset stay the fp32 path's.
inline constexpr int kPanel = 32;
/// Rows per Q K^T micro-kernel call (16 accumulators of the 32 registers), the AVX3 kMicroRows.
inline constexpr int kRows = 8;

/// Packs one query row (dp fp32 holding bf16 values, dp even) as dp / 2 column pairs: columns
/// (c, c + 1) in one 32-bit lane, c in the odd (high) half, which vdpbf16ps adds first.
void pack_query_row(const float* row, int dp, std::uint32_t* out) noexcept;

/// Packs one panel of kPanel key rows (fp32 holding bf16 values, row stride dp, dp even) into
/// @p panel: [dp / 2][kPanel] column pairs (as pack_query_row's), for qk_tile.
void pack_key_panel(const float* rows, int dp, std::uint32_t* panel) noexcept;

/// Packs one value row (fp32 holding bf16 values, dp a multiple of 16) as dp bf16 in the column
/// order pv_row's unpacking turns back into 0, 1, 2, ...: within each block of 2h columns (h = 16,
/// and h = 8 for a last block of 16), position 8k + i holds column 4k + i and 8k + 4 + i holds
/// column h + 4k + i (i < 4).
void pack_value_row(const float* row, int dp, std::uint16_t* out) noexcept;

/// S[rows][W] (row stride w) = Q K^T for the key tile at @p j0: @p q holds the tile's rows as
/// column pairs ([rows][dp / 2], rows a multiple of kRows), @p panels the packed keys.
void qk_tile(const std::uint32_t* q, int rows, int dp, const std::uint32_t* panels, std::int64_t j0, int w,
             float* s) noexcept;

/// acc[0, dp) += sum over t < n of p[t] v(t), with p[t] rounded to bf16 (round to nearest even)
/// and v(t) = @p v + off[t] (a packed value row). @p n is even: keys are taken in pairs.
void pv_row(float* acc, int dp, int n, const float* p, const std::int32_t* off, const std::uint16_t* v) noexcept;

/// Packs the value rows of keys 2 g and 2 g + 1 (@p even, @p odd: fp32 holding bf16 values) as dp
/// pairs for pv_tile_rows: column c's two values in one 32-bit lane, key 2 g's in the low half
/// (where a weight pair holds p_2g).
void pack_value_pair(const float* even, const float* odd, int dp, std::uint32_t* out) noexcept;

/// Rows per call of pv_tile_rows at most (16 accumulators of the 32 registers).
inline constexpr int kTileRows = 4;
/// Key pairs per call of pv_tile_rows at most (a key tile of 128, the bf16 path's tile width).
inline constexpr int kTilePairs = 64;

/// The dense P V of one key tile for @p rows <= kTileRows query rows, each V vector loaded once for
/// all of them: acc[r][0, dp) += sum over pairs g < @p pairs of p_r,2g v_2g + p_r,2g+1 v_2g+1, the
/// weights @p p[r] (fp32, the tile's keys in order) rounded to bf16 (round to nearest even), @p v
/// the tile's key pairs (pack_value_pair, dp lanes each), dp a multiple of 16, pairs <= kTilePairs.
void pv_tile_rows(float* const* acc, int rows, int dp, const float* const* p, const std::uint32_t* v,
                  int pairs) noexcept;

/// Keys per call of decode_dots at most (the keys of one 16-lane vector of the decode kernel).
inline constexpr int kDecodeKeys = 16;
/// Rows per call of decode_dots at most (their Q in 16 of the 32 registers at d = 128).
inline constexpr int kDecodeRows = 4;

/// The decode kernel's direct Q K^T from a bf16 cache: for @p rows <= kDecodeRows query rows @p q
/// (bf16, row stride @p dq) and @p n <= kDecodeKeys cache rows k + t * step (bf16, contiguous),
/// s[r * ds + t] = the score of row r and key t: per lane j the sum over blocks of 32 columns c0
/// of the products of columns c0 + 2j + 1 and then c0 + 2j (one vdpbf16ps per block, from zero),
/// then the sum of the 16 lanes; d a multiple of 32. With @p check, @p top gets the largest
/// magnitude bits (x & 0x7fff) of the K values read.
void decode_dots(const std::uint16_t* q, int rows, std::int64_t dq, int d, const std::uint16_t* k, std::int64_t step,
                 int n, float* s, std::int64_t ds, bool check, std::uint16_t* top) noexcept;

/// Keys per call of decode_pv at most (the decode kernel's key-major block).
inline constexpr int kDecodePvKeys = 32;

/// The decode kernel's key-major P V from a bf16 cache, each V row read once for all rows: for
/// @p rows <= kDecodeRows accumulator rows acc + r * dp (fp32, columns in order),
/// acc[r][0, d) += sum over k < @p n of w[r * wstride + keys[k]] v(keys[k]), the weights rounded to
/// bf16 (round to nearest even), v(t) = v + t * step (bf16, d a multiple of 32), n <=
/// kDecodePvKeys, @p keys increasing. Keys are taken in pairs (a last odd key paired with itself
/// at weight 0), two rows' 32 values interleaved into (v_a[c], v_b[c]) lanes by unpacklo/hi_epi16,
/// so the accumulators hold the columns permuted while the block runs (undone when stored).
/// The rows v(ahead[i]), i < @p ahead_n (the next block's keys), are requested into L2 meanwhile,
/// spread evenly over the block's pairs of keys (attention_decode.cpp, kKeyMajorRequestsNext).
void decode_pv(float* acc, int rows, int dp, int d, const float* w, std::int64_t wstride, const std::int32_t* keys,
               int n, const std::uint16_t* v, std::int64_t step, const std::int32_t* ahead = nullptr,
               int ahead_n = 0) noexcept;

}  // namespace dfss::cpu::bf16dot
