// Entry points of the AVX2 and portable-SIMD CPU kernels (fused_forward_avx2.cpp,
// fused_forward_portable.cpp). The fused forward is flash-style: one pass over key tiles per query
// row with online softmax over the kept scores, no L x L buffer. The scalar twins are declared in
// cpu/scalar/attention.hpp, the three-stage pipeline in cpu/three_stage/attention.hpp.
#pragma once

#include "cpu/scalar/attention.hpp"  // the AVX2 forward falls back to the scalar twin
#include "dfss/error.hpp"
#include "dfss/params.hpp"

namespace dfss::cpu {

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

/// @brief Portable-SIMD fused backward: the twin of fused_backward_avx2 for CPUs without AVX2 (same
/// contract as the scalar twin, broadcast dBias included). Recomputes the scores with the portable forward's micro-kernel and selection, so it
/// keeps exactly the keys fused_forward_portable kept.
status fused_backward_portable(const attention_params& p) noexcept;

}  // namespace dfss::cpu
