// CPU backend entry points. The fused forward is flash-style: one pass over key tiles per query row
// with online softmax over the kept scores, no L x L buffer.
#pragma once

#include "dfss/error.hpp"
#include "dfss/params.hpp"

namespace dfss::cpu {

/// @brief Generic scalar fused forward (fp32 accumulation) for f32, f16 and bf16 inputs, any N:M
/// with M <= 16. Parallel over (batch, head, query row); each row is computed in a fixed order, so
/// results are bitwise identical for every thread count.
status fused_forward_scalar(const attention_params& p) noexcept;

}  // namespace dfss::cpu
