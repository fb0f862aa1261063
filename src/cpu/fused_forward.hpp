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

/// @brief Generic scalar fused backward: the twin of fused_backward_simd (cpu/simd/targets.hpp; same
/// contract: requires p.o and p.lse, parallel over (batch, kv head), bitwise identical for any
/// thread count), plus dBias with broadcast dimensions (a second pass over its rows, each summed in
/// a fixed order).
/// Recomputes the scores with the scalar forward's own score function, so it keeps exactly the keys
/// fused_forward_scalar kept.
status fused_backward_scalar(const attention_params& p) noexcept;

/// @brief The paper's three-stage pipeline on the CPU: (a) Q K^T with the N:M selection fused into
/// the tile epilogue, writing compressed values, indices and (1:2, 2:4) metadata; (b) softmax over
/// the compressed rows; (c) compressed-by-dense product with V. Writes p.compressed_* when non-null.
status three_stage_forward(const attention_params& p) noexcept;

}  // namespace dfss::cpu
