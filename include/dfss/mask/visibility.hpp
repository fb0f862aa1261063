// dfss/mask/visibility.hpp: the one rule for which keys a query row sees, and which of its groups
// are kept whole (docs/semantics.md, "Masks" and "Positions"). Written once for g++ and nvcc: the
// fp64 reference, every CPU kernel, the CUDA kernels and `dfss quality` ask these functions, so no
// backend can drift from the others.
//
// Positions are global: local key j sits at key_offset + j (key_offset a multiple of M, so that the
// local groups are global groups), query row i of batch b at query_offset[b] + i (default
// key_offset + Lk - Lq, the bottom-right alignment of FlashAttention >= 2.1). Key j of batch b is
// visible to query row i iff
//   key_offset + j < key_length[b]                      (key padding; key_offset + Lk without lengths), and
//   key_offset + j <= query_offset[b] + i               (causal only).
// Both conditions are upper bounds on j, so the visible keys of a row are always a prefix [0, end).
#pragma once

#include <cstdint>

#include "dfss/config.hpp"

namespace dfss::mask {

/// @brief Global exclusive end of the keys the query at global position @p query_pos sees: keys at
/// global positions below it are visible, later ones are masked. @p key_length is the sequence's
/// valid key count in global positions. Never below 0.
DFSS_HD std::int64_t global_visible_end(bool causal, std::int64_t key_length, std::int64_t query_pos) {
  std::int64_t end = key_length;
  if (causal && query_pos + 1 < end) end = query_pos + 1;
  return end < 0 ? 0 : end;
}

/// @brief Local exclusive end of the visible keys of a row whose global visible end is
/// @p global_end, for keys [key_offset, key_offset + seqlen_k): clamped to [0, seqlen_k].
DFSS_HD std::int64_t local_end(std::int64_t global_end, std::int64_t key_offset, std::int64_t seqlen_k) {
  const std::int64_t end = global_end - key_offset;
  return end < 0 ? 0 : (end > seqlen_k ? seqlen_k : end);
}

/// @brief Exclusive end of the causal window of query row @p i (no offsets: key_offset 0, query row
/// 0 at Lk - Lq): keys j < end are not in its future. Without a causal mask every key of the row
/// (@p seqlen_k). Clamped to [0, seqlen_k].
DFSS_HD std::int64_t causal_end(bool causal, std::int64_t seqlen_q, std::int64_t seqlen_k, std::int64_t i) {
  return local_end(global_visible_end(causal, seqlen_k, i + (seqlen_k - seqlen_q)), 0, seqlen_k);
}

/// @brief Exclusive end of the visible keys of query row @p i without offsets, given the batch's
/// valid key count @p key_length: keys [0, end) are visible, every later key is masked (-inf).
DFSS_HD std::int64_t visible_end(bool causal, std::int64_t seqlen_q, std::int64_t seqlen_k, std::int64_t key_length,
                                 std::int64_t i) {
  const std::int64_t len = key_length < seqlen_k ? key_length : seqlen_k;
  return local_end(global_visible_end(causal, len, i + (seqlen_k - seqlen_q)), 0, seqlen_k);
}

/// @brief Whether key @p j is visible to query row @p i (the same rule, one key at a time).
DFSS_HD bool visible(bool causal, std::int64_t seqlen_q, std::int64_t seqlen_k, std::int64_t key_length,
                     std::int64_t i, std::int64_t j) {
  return j < visible_end(causal, seqlen_q, seqlen_k, key_length, i);
}

/// @brief The groups of a row kept whole (dense sink and recent windows): the groups starting at
/// local keys g0 < sink_end, and those with recent_begin <= g0 < recent_end (recent_begin a group
/// boundary, recent_end the row's visible end). Without a recent window recent_begin is
/// INT64_MAX, so that a tile test `j0 + W > recent_begin` stays false past the last key.
struct whole_groups {
  std::int64_t sink_end = 0;
  std::int64_t recent_begin = INT64_MAX;
  std::int64_t recent_end = INT64_MAX;
};

/// @brief Which groups of a row are kept whole: group [g, g + M) (global positions) is kept whole
/// iff it intersects [0, @p sink_tokens) or (p - @p recent_tokens, p], where p = @p global_end - 1
/// is the row's last visible key (global). Local keys of a tensor at @p key_offset (a multiple of
/// @p m) with @p seqlen_k keys. A row without visible keys (global_end 0) has no recent window.
/// A window wholly past the local keys gives recent_begin = seqlen_k (no local group).
DFSS_HD whole_groups whole_groups_of(std::int64_t sink_tokens, std::int64_t recent_tokens, std::int64_t m,
                                     std::int64_t key_offset, std::int64_t seqlen_k, std::int64_t global_end) {
  whole_groups w;
  const std::int64_t sink_groups_end = (sink_tokens + m - 1) / m * m;  // the first group not touching the sink
  w.sink_end = local_end(sink_groups_end, key_offset, seqlen_k);
  if (recent_tokens > 0 && global_end > 0) {
    // The first key of the window is p - recent + 1 = global_end - recent; its group starts it.
    std::int64_t first = global_end - recent_tokens;
    if (first < 0) first = 0;
    w.recent_begin = local_end(first / m * m, key_offset, seqlen_k);
    w.recent_end = local_end(global_end, key_offset, seqlen_k);  // groups starting after p are not in it
  }
  return w;
}

/// @brief Whether the group starting at local key @p g0 (a multiple of M) is kept whole.
DFSS_HD bool group_is_whole(const whole_groups& w, std::int64_t g0) {
  return g0 < w.sink_end || (g0 >= w.recent_begin && g0 < w.recent_end);
}

/// @brief @p w seen from a tile that starts at local key @p j0 (a multiple of M): the same groups
/// in tile-relative key indices (the sentinel INT64_MAX stays beyond every tile).
DFSS_HD whole_groups shifted(const whole_groups& w, std::int64_t j0) {
  const auto shift = [j0](std::int64_t x) { return x == INT64_MAX ? x : x - j0; };
  return {shift(w.sink_end), shift(w.recent_begin), shift(w.recent_end)};
}

/// @brief Whether the tile of local keys [j0, j0 + width) holds a group kept whole.
DFSS_HD bool tile_has_whole_groups(const whole_groups& w, std::int64_t j0, std::int64_t width) {
  return j0 < w.sink_end || (j0 + width > w.recent_begin && j0 < w.recent_end);
}

}  // namespace dfss::mask
