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

/// @brief AVX2 + FMA fused forward (f16 inputs need F16C); same contract as the scalar twin.
/// The caller (the selector) checks the CPU features first.
status fused_forward_avx2(const attention_params& p) noexcept;

/// @brief Portable-SIMD fused forward (compiler vector extensions; NEON on ARM); same contract. The
/// fast path on CPUs without AVX2.
status fused_forward_portable(const attention_params& p) noexcept;

/// @brief AVX2 fused backward: dQ, dK, dV (and dBias, summed over its broadcast dimensions). Requires p.o and
/// p.lse (the forward's output and LSE). Recomputes the scores with the AVX2 forward's micro-kernel
/// and selection, so it keeps exactly the keys that forward kept. Parallel over (batch, kv head);
/// the query heads of a group and all query rows accumulate into dK, dV in a fixed order, so the
/// gradients are bitwise identical for any thread count.
status fused_backward_avx2(const attention_params& p) noexcept;

/// @brief Generic scalar fused backward: the twin of fused_backward_avx2 (same contract: requires
/// p.o and p.lse, parallel over (batch, kv head), bitwise identical for any thread count), plus
/// dBias with broadcast dimensions (a second pass over its rows, each summed in a fixed order).
/// Recomputes the scores with the scalar forward's own score function, so it keeps exactly the keys
/// fused_forward_scalar kept.
status fused_backward_scalar(const attention_params& p) noexcept;

/// @brief Portable-SIMD fused backward: the twin of fused_backward_avx2 for CPUs without AVX2 (same
/// contract as the scalar twin, broadcast dBias included). Recomputes the scores with the portable forward's micro-kernel and selection, so it
/// keeps exactly the keys fused_forward_portable kept.
status fused_backward_portable(const attention_params& p) noexcept;

/// @brief The paper's three-stage pipeline on the CPU: (a) Q K^T with the N:M selection fused into
/// the tile epilogue, writing compressed values, indices and (1:2, 2:4) metadata; (b) softmax over
/// the compressed rows; (c) compressed-by-dense product with V. Writes p.compressed_* when non-null.
status three_stage_forward(const attention_params& p) noexcept;

}  // namespace dfss::cpu
