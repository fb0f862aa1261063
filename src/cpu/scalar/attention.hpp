// Entry points of the generic scalar CPU kernels: the readable twins every SIMD kernel is tested
// against, and the last fallback. Forward in attention_forward.cpp, backward in
// attention_backward.cpp; both score with tile_scores.hpp.
#pragma once

#include "dfss/error.hpp"
#include "dfss/params.hpp"

namespace dfss::cpu {

/// @brief Generic scalar fused forward (fp32 accumulation) for f32, f16 and bf16 inputs, any N:M
/// with M <= 16. Parallel over (batch, head, query row); each row is computed in a fixed order, so
/// results are bitwise identical for every thread count.
status fused_forward_scalar(const attention_params& p) noexcept;

/// @brief Generic scalar fused backward: the twin of fused_backward_avx2 (same contract: requires
/// p.o and p.lse, parallel over (batch, kv head), bitwise identical for any thread count), plus
/// dBias with broadcast dimensions (a second pass over its rows, each summed in a fixed order).
/// Recomputes the scores with the scalar forward's own score function, so it keeps exactly the keys
/// fused_forward_scalar kept.
status fused_backward_scalar(const attention_params& p) noexcept;

}  // namespace dfss::cpu
