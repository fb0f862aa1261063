// src/cuda/warp/nm_warp_select.hpp: the SDDMM epilogue's register-level N:M selection, the quad
// exchange that assembles mma.sp metadata registers, and the global layout of the compressed
// intermediates, as host+device functions.
//
// A lane's accumulators of one unit (see mma_fragments.hpp) are pruned without touching other
// lanes: every group of M keys lives in one lane. The kept values come out directly in the order of
// the lane's sparse A fragment (mma_sp_a16_coord / mma_sp_a_tf32_coord). Each lane also produces
// its 4-bit fields of the metadata, already shifted to their bit positions; the words are then
// assembled across the quad by meta_quad_exchange, written once against a warp policy W:
//   - on the device, W = device_warp (src/cuda/warp/device_warp.cuh): u32 is std::uint32_t and
//     shfl_xor is __shfl_xor_sync;
//   - on the host, W = host_warp (below): u32 is a lane_array of 32 values (one per lane) and
//     shfl_xor permutes it, so the CPU tests run the identical code for all 32 lanes at once.
#pragma once

#include <cstdint>

#include "cuda/warp/mma_fragments.hpp"
#include "dfss/config.hpp"
#include "dfss/format/nm_meta.hpp"
#include "dfss/format/nm_select.hpp"

namespace dfss::cuda::warp {

/// The hardware patterns of the CUDA backend.
enum class sp_pattern : int {
  p2of4,  ///< 16-bit 2:4
  p1of2,  ///< 16-bit 1:2, expressed as 2:4 nibbles (one kept key per pair)
};

/// @brief The two kept values of a 4-key group in increasing key order, chosen with selects on
/// constant indices only (a run-time register index would force the array to local memory).
/// @p nibble is the group's legal 2:4 nibble.
template <typename T>
DFSS_HD void kept_pair(const T (&s)[4], std::uint32_t nibble, T& lo, T& hi) {
  const std::uint32_t i0 = nibble & 3u;         // 0, 1 or 2
  const std::uint32_t i1 = (nibble >> 2) & 3u;  // 1, 2 or 3
  lo = i0 == 0u ? s[0] : (i0 == 1u ? s[1] : s[2]);
  hi = i1 == 3u ? s[3] : (i1 == 2u ? s[2] : s[1]);
}

/// One lane's result of pruning a 16-bit unit (32 rows x 32 keys).
template <typename T>
struct unit16_selection {
  /// a[i][e]: element e of the lane's sparse A fragment of mma.sp.m16n8k32 for m16 tile i.
  T a[2][8];
  /// meta_bits[i][h]: the lane's nibbles of the metadata word of m16 tile i, key half h (keys
  /// 16h..16h+15), at their final bit positions (row g in bits 15:0, row g+8 in 31:16).
  std::uint32_t meta_bits[2][2];
};

/// @brief The loop of a lane's 16-bit unit selection, written once: @p select(s, lo, hi, nibble,
/// shift) picks the kept pair of each 4-key group s (keys 16h + 4t .. 16h + 4t + 3: columns 2t,
/// 2t+1 of n8 tiles 2h and 2h+1, row half rh) and gives its nibble shifted left by @p shift. The two
/// row halves' nibbles go to constant positions (shift 0 and 16, constants at compile time), then
/// one shift by the lane's 4 t places them in the word.
template <typename T, typename GroupSelect>
DFSS_HD unit16_selection<T> select_unit16_with(const T (&acc)[2][4][4], int lane, const GroupSelect& select) {
  unit16_selection<T> out{};
  const int t = quad_pos_of(lane);
DFSS_UNROLL
  for (int i = 0; i < 2; ++i) {
DFSS_UNROLL
    for (int h = 0; h < 2; ++h) {
      std::uint32_t bits = 0;
DFSS_UNROLL
      for (int rh = 0; rh < 2; ++rh) {
        const T s[4] = {acc[i][2 * h][2 * rh], acc[i][2 * h][2 * rh + 1], acc[i][2 * h + 1][2 * rh],
                        acc[i][2 * h + 1][2 * rh + 1]};
        std::uint32_t placed;
        select(s, out.a[i][4 * h + 2 * rh], out.a[i][4 * h + 2 * rh + 1], placed, 16u * rh);
        bits |= placed;
      }
      out.meta_bits[i][h] = bits << (4 * t);
    }
  }
  return out;
}

/// The general group selection of pattern p: the format module's ranking (ties, -inf and NaN).
struct ranked_group_select {
  sp_pattern p;
  template <typename T>
  DFSS_HD void operator()(const T (&s)[4], T& lo, T& hi, std::uint32_t& nibble, unsigned shift) const {
    if (p == sp_pattern::p1of2) {
      // One ranking per pair; the nibble keeps index b0 of keys 0..1 and 2 + b1 of keys 2..3
      // (nm_nibble_1of2_as_2of4 of the two masks, without the generic mask-to-nibble chain).
      const std::uint32_t b0 = nm_ranks_above(s[1], 1, s[0], 0) ? 1u : 0u;
      const std::uint32_t b1 = nm_ranks_above(s[3], 3, s[2], 2) ? 1u : 0u;
      lo = b0 != 0u ? s[1] : s[0];
      hi = b1 != 0u ? s[3] : s[2];
      nibble = b0 | ((2u + b1) << 2);
    } else {
      nibble = nm_nibble_2of4(nm_select_2of4(s));
      kept_pair(s, nibble, lo, hi);
    }
    nibble <<= shift;
  }
};

/// @brief Prunes lane @p lane's accumulators acc[i][j][r] of a 16-bit SDDMM unit (keys permuted by
/// sddmm16_key_of_column) to pattern @p p with the general ranking. Masked and out-of-range scores
/// must already be -inf.
template <typename T>
DFSS_HD unit16_selection<T> select_unit16(const T (&acc)[2][4][4], int lane, sp_pattern p) {
  return select_unit16_with(acc, lane, ranked_group_select{p});
}

/// One lane's result of pruning a tf32 unit (32 rows x 16 keys) to 1:2.
template <typename T>
struct unit_tf32_selection {
  /// a[i][e]: element e of the lane's sparse A fragment of mma.sp.m16n8k16 tf32 for m16 tile i.
  T a[2][4];
  /// meta_bits[i][h]: the lane's codes of the metadata word of m16 tile i, key half h (keys
  /// 8h..8h+7), at their final bit positions.
  std::uint32_t meta_bits[2][2];
};

/// @brief Prunes lane @p lane's accumulators acc[i][j][r] of a tf32 SDDMM unit to 1:2.
template <typename T>
DFSS_HD unit_tf32_selection<T> select_unit_tf32(const T (&acc)[2][2][4], int lane) {
  unit_tf32_selection<T> out{};
  const int t = quad_pos_of(lane);
DFSS_UNROLL
  for (int i = 0; i < 2; ++i) {
DFSS_UNROLL
    for (int h = 0; h < 2; ++h) {
DFSS_UNROLL
      for (int rh = 0; rh < 2; ++rh) {
        // Keys 8h + 2t + p, p = 0, 1: columns 2t, 2t+1 of n8 tile h, row half rh.
        const T s[2] = {acc[i][h][2 * rh], acc[i][h][2 * rh + 1]};
        const std::uint32_t keep = nm_select_1of2(s);
        out.a[i][2 * h + rh] = (keep & 1u) ? s[0] : s[1];
        out.meta_bits[i][h] |= nm_code_tf32_1of2(keep) << (16 * rh + 4 * t);
      }
    }
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// Quad exchange.

/// @brief 32 per-lane values, for simulating warp code on the host.
template <typename V>
struct lane_array {
  V v[kWarpSize];
  DFSS_HD V& operator[](int lane) { return v[lane]; }
  DFSS_HD const V& operator[](int lane) const { return v[lane]; }
  DFSS_HD friend lane_array operator|(const lane_array& a, const lane_array& b) {
    lane_array r{};
    for (int l = 0; l < kWarpSize; ++l) r.v[l] = a.v[l] | b.v[l];
    return r;
  }
};

/// Host warp policy: a u32 is the 32 lanes' values; shfl_xor(x, m) gives lane l the value of lane
/// l ^ m, as __shfl_xor_sync with a full mask does.
struct host_warp {
  using u32 = lane_array<std::uint32_t>;
  static u32 shfl_xor(const u32& x, int mask) {
    u32 r{};
    for (int l = 0; l < kWarpSize; ++l) r.v[l] = x.v[l ^ mask];
    return r;
  }
  /// Per lane: c != 0 ? a : b.
  static u32 select(const u32& c, const u32& a, const u32& b) {
    u32 r{};
    for (int l = 0; l < kWarpSize; ++l) r.v[l] = c.v[l] != 0u ? a.v[l] : b.v[l];
    return r;
  }
  /// Per lane: bit @p bit of the lane's index.
  static u32 lane_bit(int bit) {
    u32 r{};
    for (int l = 0; l < kWarpSize; ++l) r.v[l] = (static_cast<std::uint32_t>(l) >> bit) & 1u;
    return r;
  }
};

/// @brief Assembles the metadata registers of a unit across each quad: on entry every lane holds its
/// bits b[i][h] (m16 tile i, key half h); on return lane 4g + 2i + h holds the OR of b[i][h] over its
/// quad, i.e. the complete word of m16 tile i, key half h for rows g (bits 15:0) and g+8 (31:16).
/// That is the register mma.sp consumes from lane 4g + 2f + h with selector f = i, and the order of
/// the reordered global layout (slot 32k + 4g + 2i + h). A reduce-scatter: 3 shuffles instead of the
/// 8 of four all-reduces.
template <typename W>
DFSS_HD typename W::u32 meta_quad_exchange(const typename W::u32& b00, const typename W::u32& b01,
                                           const typename W::u32& b10, const typename W::u32& b11) {
  using u32 = typename W::u32;
  // Step 1 (lanes t and t ^ 2): keep tile i = bit 1 of the lane, send the other tile's two words.
  const u32 tile = W::lane_bit(1);
  const u32 send0 = W::select(tile, b00, b10);
  const u32 send1 = W::select(tile, b01, b11);
  const u32 keep0 = W::select(tile, b10, b00) | W::shfl_xor(send0, 2);
  const u32 keep1 = W::select(tile, b11, b01) | W::shfl_xor(send1, 2);
  // Step 2 (lanes t and t ^ 1): keep key half h = bit 0 of the lane, send the other half.
  const u32 half = W::lane_bit(0);
  const u32 send = W::select(half, keep0, keep1);
  return W::select(half, keep1, keep0) | W::shfl_xor(send, 1);
}

// ---------------------------------------------------------------------------------------------
// Global layout of the pipeline's intermediates, per (batch, head) slice:
//   values rows_padded x keys_padded / 2 16-bit weights, in the fragment order of softmax_fold.hpp
//          (fold_value_offset; compressed column 2c + slot is the slot-th kept key of 4-key group c);
//   meta   [keys_padded / 32][rows_padded] int32, the reordered layout of nm_meta.hpp: the int32 at
//          (p, 32k + 4g + 2i + h) holds the words of rows 32k + 16i + g (low half) and
//          32k + 16i + 8 + g (high half) for keys 32p + 16h .. 32p + 16h + 15.
// rows_padded and keys_padded are multiples of the kernels' tiles (kIntermediateRowAlign,
// kIntermediateKeyAlign), so no tile ever reads or writes past a slice.

/// Rows are padded to 128: the largest row tile of any kernel (the d = 64 SpMM's), so no kernel
/// needs row predication on the intermediates; also a multiple of 32, as the metadata layout needs.
inline constexpr std::int64_t kIntermediateRowAlign = 128;
/// Keys are padded to 64: the SDDMM key tile and the SpMM's k step are both 64 keys.
inline constexpr std::int64_t kIntermediateKeyAlign = 64;

struct intermediate_layout {
  std::int64_t rows_padded;
  std::int64_t keys_padded;

  DFSS_HD static intermediate_layout make(std::int64_t rows, std::int64_t keys) {
    return {(rows + kIntermediateRowAlign - 1) / kIntermediateRowAlign * kIntermediateRowAlign,
            (keys + kIntermediateKeyAlign - 1) / kIntermediateKeyAlign * kIntermediateKeyAlign};
  }
  /// Elements of one slice's compressed values.
  DFSS_HD std::int64_t value_elems() const { return rows_padded * (keys_padded / 2); }
  /// int32 words of one slice's metadata.
  DFSS_HD std::int64_t meta_words() const { return rows_padded * (keys_padded / 32); }
  /// Offset of the int32 that lane @p lane of the warp owning rows 32k.. and keys 32p.. stores.
  DFSS_HD std::int64_t meta_offset(std::int64_t row_block, std::int64_t key_block, int lane) const {
    return key_block * rows_padded + 32 * row_block + lane;
  }
};

}  // namespace dfss::cuda::warp
