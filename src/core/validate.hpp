// Argument validation: turns the caller's views into an attention_params, or a status naming the
// argument, what was expected and what came. Nothing here touches tensor contents except the key
// lengths and query offsets, host integers checked against [0, kMaxPosition].
#pragma once

#include "dfss/attention.hpp"
#include "dfss/error.hpp"
#include "dfss/merge.hpp"
#include "dfss/params.hpp"

namespace dfss::core {

/// Largest head dimension any backend accepts. 512 covers every published head size (<= 256) with
/// room to spare and bounds the per-row scratch that the fused CPU kernels keep on the stack.
inline constexpr std::int64_t kMaxHeadDim = 512;

/// Largest seqlen_q and seqlen_k. The kernels hold key indices (and the three-stage export its
/// compressed indices) in int32, padded by up to a key tile: 2^31 - 2^16 leaves room for any
/// tile. Element offsets are int64 everywhere, so only the index width sets this bound.
inline constexpr std::int64_t kMaxSeqLen = (std::int64_t{1} << 31) - (std::int64_t{1} << 16);

/// Largest global position (key_offset + seqlen_k, key lengths, query_offset + seqlen_q, sink and
/// recent windows): 2^62 leaves headroom so that a position plus a window, a row index or a group
/// never overflows int64 in any kernel's arithmetic.
inline constexpr std::int64_t kMaxPosition = std::int64_t{1} << 62;

/// @brief Validates forward arguments and fills @p params. @p op names the API call in messages.
status build_forward_params(const forward_args& args, const attention_config& config,
                            const char* op, attention_params& params);
/// @brief Validates backward arguments and fills @p params.
status build_backward_params(const backward_args& args, const attention_config& config,
                             const char* op, attention_params& params);

/// @brief Validates merge_attention_states arguments (include/dfss/merge.hpp) and fills @p params.
status build_merge_params(const merge_args& args, int num_threads, const char* op, merge_params& params);

}  // namespace dfss::core
