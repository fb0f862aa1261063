// dfss/mask/visibility.hpp: the one rule for which keys a query row sees (docs/semantics.md,
// "Masks"). Written once for g++ and nvcc: the fp64 reference, every CPU kernel, the CUDA kernels
// and `dfss quality` ask these functions, so no backend can drift from the others.
//
// Key j of batch b is visible to query row i iff
//   j < key_length[b]                     (key padding; Lk without lengths), and
//   j <= i + (Lk - Lq)                    (causal only: bottom-right alignment, as FlashAttention >= 2.1).
// Both conditions are upper bounds on j, so the visible keys of a row are always a prefix [0, end).
#pragma once

#include <cstdint>

#include "dfss/config.hpp"

namespace dfss::mask {

/// @brief Exclusive end of the causal window of query row @p i: keys j < end are not in its
/// future. Without a causal mask every key of the row (@p seqlen_k). Clamped to [0, seqlen_k].
DFSS_HD std::int64_t causal_end(bool causal, std::int64_t seqlen_q, std::int64_t seqlen_k, std::int64_t i) {
  if (!causal) return seqlen_k;
  const std::int64_t end = i + (seqlen_k - seqlen_q) + 1;
  return end < 0 ? 0 : (end > seqlen_k ? seqlen_k : end);
}

/// @brief Exclusive end of the visible keys of query row @p i given the batch's valid key count
/// @p key_length (in [0, seqlen_k]): keys [0, end) are visible, every later key is masked (-inf).
DFSS_HD std::int64_t visible_end(bool causal, std::int64_t seqlen_q, std::int64_t seqlen_k, std::int64_t key_length,
                                 std::int64_t i) {
  const std::int64_t c = causal_end(causal, seqlen_q, seqlen_k, i);
  return key_length < c ? key_length : c;
}

/// @brief Whether key @p j is visible to query row @p i (the same rule, one key at a time).
DFSS_HD bool visible(bool causal, std::int64_t seqlen_q, std::int64_t seqlen_k, std::int64_t key_length,
                     std::int64_t i, std::int64_t j) {
  return j < visible_end(causal, seqlen_q, seqlen_k, key_length, i);
}

}  // namespace dfss::mask
