// dfss/format/nm_meta.hpp: sparse tensor core metadata encodings (sm_80 mma.sp and newer).
//
// A sparse A operand (rows = queries, reduction = keys) stores only the kept values of every group
// plus metadata naming their positions. For 16-bit types the pattern is 2:4: each group of 4 keys
// gets a 4-bit nibble of two 2-bit in-group indices, the lower index in bits [1:0] and the higher
// in bits [3:2]. With mma.sp::ordered_metadata the indices must be strictly increasing, so the only
// legal nibbles are 0x4 (0,1), 0x8 (0,2), 0xC (0,3), 0x9 (1,2), 0xD (1,3) and 0xE (2,3). 1:2 on
// 16-bit types is the subset of 2:4 that keeps one key in each half of a group of 4. For tf32 the
// pattern is 1:2 with a 4-bit code per pair of keys: 0x4 keeps position 0, 0xE keeps position 1.
//
// Row-order metadata words are uint16. For 16-bit types word c of a row covers keys 16c..16c+15
// and nibble t (bits 4t..4t+3) covers keys 16c+4t..16c+4t+3. For tf32 word c covers keys 8c..8c+7
// and code t covers keys 8c+2t, 8c+2t+1. Keys past the end of the row are padding scores that rank
// below every real key, so a group of padding keeps its lowest positions and still gets a legal
// code.
//
// The reordered global-memory layout is CUTLASS's ColumnMajorInterleaved<2> for 16-bit metadata
// words, the layout the original DFSS artifact wrote and ldmatrix loads directly: rows are padded
// to a multiple of 32 and 16-key chunks to an even count, and word W(r, c) lives at
// nm_meta_reordered_offset(r, c, rows_padded). Equivalently, the int32 at slot 32k + 4g + 2i + j of
// column pair p holds W(32k + 16i + g, 2p + j) in its low half and W(32k + 16i + 8 + g, 2p + j) in
// its high half, which is what one lane feeds to mma.sp.m16n8k32.
#pragma once

#include <cstdint>

#include "dfss/config.hpp"

namespace dfss {

/// @brief Metadata formats of the sm_80+ sparse tensor cores.
enum class meta_format : int {
  sm80_16bit_2of4,  ///< f16/bf16 2:4: a 2:4 nibble per group of 4, one uint16 per 16 keys
  sm80_16bit_1of2,  ///< f16/bf16 1:2 expressed as 2:4 (one key kept per half), one uint16 per 16
                    ///< keys
  sm80_tf32_1of2,   ///< tf32 1:2: a 4-bit code per pair, one uint16 per 8 keys
};

/// Fill word of the reordered layout's padding rows and chunks: four nibbles 0x4, the encoding of
/// an all-padding 2:4 group (keep positions 0 and 1), legal for every 16-bit format.
inline constexpr std::uint16_t kMetaPaddingWord = 0x4444;

/// @brief 2:4 nibble of a 4-bit keep mask with exactly two bits set: lower kept index in bits
/// [1:0], higher in [3:2]. A mask without exactly two bits gives an illegal nibble.
DFSS_HD std::uint32_t nm_nibble_2of4(std::uint32_t mask) {
  const std::uint32_t lo = (mask & 1u) ? 0u : (mask & 2u) ? 1u : (mask & 4u) ? 2u : 3u;
  const std::uint32_t hi = (mask & 8u) ? 3u : (mask & 4u) ? 2u : (mask & 2u) ? 1u : 0u;
  return lo | (hi << 2);
}

/// @brief Keep mask named by a 2:4 nibble (bits of both 2-bit indices; one bit for a repeated
/// index).
DFSS_HD std::uint32_t nm_mask_2of4(std::uint32_t nibble) {
  return (1u << (nibble & 3u)) | (1u << ((nibble >> 2) & 3u));
}

/// @brief True for the six nibbles legal under mma.sp::ordered_metadata: two strictly increasing
/// 2-bit indices (0x4, 0x8, 0xC, 0x9, 0xD, 0xE).
DFSS_HD bool is_legal_ordered_nibble(std::uint32_t nibble) {
  return nibble < 16u && (nibble & 3u) < (nibble >> 2);
}

/// @brief 2:4 nibble of a group of 4 keys pruned as two 1:2 groups: @p mask_lo and @p mask_hi are
/// the 2-bit keep masks (exactly one bit each) of keys 0..1 and 2..3. Legal results: 0x8, 0xC, 0x9,
/// 0xD.
DFSS_HD std::uint32_t nm_nibble_1of2_as_2of4(std::uint32_t mask_lo, std::uint32_t mask_hi) {
  return nm_nibble_2of4((mask_lo & 3u) | ((mask_hi & 3u) << 2));
}

/// @brief True for the 2:4 nibbles that keep one key in each half (0x8, 0xC, 0x9, 0xD).
DFSS_HD bool is_legal_1of2_as_2of4_nibble(std::uint32_t nibble) {
  return nibble < 16u && (nibble & 3u) < 2u && (nibble >> 2) >= 2u;
}

/// @brief tf32 1:2 code of a 2-bit keep mask: 0x4 keeps position 0, 0xE keeps position 1.
DFSS_HD std::uint32_t nm_code_tf32_1of2(std::uint32_t mask) { return (mask & 1u) ? 0x4u : 0xEu; }

/// @brief Keep mask (0x1 or 0x2) named by a tf32 1:2 code, or 0 for an illegal code.
DFSS_HD std::uint32_t nm_mask_tf32_1of2(std::uint32_t code) {
  return code == 0x4u ? 0x1u : code == 0xEu ? 0x2u : 0u;
}

/// @brief Group size M of a metadata format (4 for 2:4; 2 for both 1:2 formats).
DFSS_HD int nm_meta_group_size(meta_format f) { return f == meta_format::sm80_16bit_2of4 ? 4 : 2; }

/// @brief Kept keys N per group of a metadata format.
DFSS_HD int nm_meta_keep_count(meta_format f) { return f == meta_format::sm80_16bit_2of4 ? 2 : 1; }

/// @brief Keys covered by one 16-bit metadata word: 16 for the 16-bit formats, 8 for tf32.
DFSS_HD int nm_meta_keys_per_word(meta_format f) {
  return f == meta_format::sm80_tf32_1of2 ? 8 : 16;
}

/// @brief Metadata words per row of @p cols keys (the last word may cover padding keys).
DFSS_HD std::int64_t nm_meta_words_per_row(std::int64_t cols, meta_format f) {
  const std::int64_t k = nm_meta_keys_per_word(f);
  return (cols + k - 1) / k;
}

/// @brief Bits that group @p q of a metadata word contributes for keep mask @p mask, already
/// shifted into place; OR them over the groups of the word. For 2:4 and tf32 group q owns bits
/// 4q..4q+3; for 1:2 on 16-bit types pair q owns bits 2q..2q+1 and holds its kept index within the
/// enclosing group of 4 (0..1 for an even pair, 2..3 for an odd pair).
DFSS_HD std::uint32_t nm_meta_group_bits(meta_format f, int q, std::uint32_t mask) {
  switch (f) {
    case meta_format::sm80_16bit_2of4:
      return nm_nibble_2of4(mask) << (4 * q);
    case meta_format::sm80_16bit_1of2: {
      const std::uint32_t index = 2u * static_cast<std::uint32_t>(q & 1) + ((mask & 1u) ? 0u : 1u);
      return index << (2 * q);
    }
    case meta_format::sm80_tf32_1of2:
      return nm_code_tf32_1of2(mask) << (4 * q);
  }
  return 0;
}

/// @brief Keep mask of group @p q of metadata word @p word, or 0 when its code is illegal for @p f
/// (for 1:2 on 16-bit types the enclosing nibble must be a legal one-per-half nibble).
DFSS_HD std::uint32_t nm_meta_group_mask(meta_format f, int q, std::uint32_t word) {
  switch (f) {
    case meta_format::sm80_16bit_2of4: {
      const std::uint32_t nibble = (word >> (4 * q)) & 0xFu;
      return is_legal_ordered_nibble(nibble) ? nm_mask_2of4(nibble) : 0u;
    }
    case meta_format::sm80_16bit_1of2: {
      const std::uint32_t nibble = (word >> (4 * (q / 2))) & 0xFu;
      if (!is_legal_1of2_as_2of4_nibble(nibble)) return 0u;
      const std::uint32_t index = (q & 1) ? (nibble >> 2) - 2u : (nibble & 3u);
      return 1u << index;
    }
    case meta_format::sm80_tf32_1of2:
      return nm_mask_tf32_1of2((word >> (4 * q)) & 0xFu);
  }
  return 0;
}

/// @brief Rows of the reordered layout: @p rows rounded up to a multiple of 32 (one 32-row block
/// feeds the two m16 tiles of a warp's metadata register).
DFSS_HD std::int64_t nm_meta_reordered_rows(std::int64_t rows) { return (rows + 31) / 32 * 32; }

/// @brief 16-key chunks of the reordered layout: @p chunks rounded up to even (chunks are stored in
/// pairs, the two halves of an m16n8k32 step).
DFSS_HD std::int64_t nm_meta_reordered_chunks(std::int64_t chunks) { return (chunks + 1) / 2 * 2; }

/// @brief uint16 offset of word W(@p r, @p c) (row r, 16-key chunk c) in the reordered layout of a
/// matrix with @p rows_padded (a multiple of 32) rows.
DFSS_HD std::int64_t nm_meta_reordered_offset(std::int64_t r, std::int64_t c,
                                              std::int64_t rows_padded) {
  std::int64_t slot = 32 * (r / 32) + 4 * (r % 8) + (r % 32) / 8;
  std::int64_t chunk = c;
  // Swap within 2x2 blocks of (slot, chunk) so that one int32 holds rows r and r + 8 of one chunk.
  if (slot % 2 == 0 && chunk % 2 == 1) {
    slot += 1;
    chunk -= 1;
  } else if (slot % 2 == 1 && chunk % 2 == 0) {
    slot -= 1;
    chunk += 1;
  }
  return 2 * rows_padded * (chunk / 2) + 2 * slot + chunk % 2;
}

}  // namespace dfss
