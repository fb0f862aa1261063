// src/cuda/attention_cuda.hpp: the CUDA backend's entry points as seen by the core (plain C++, no
// CUDA types, so g++ translation units include it). Defined in attention_cuda.cu, compiled only when
// DFSS_HAVE_CUDA.
#pragma once

#include <cstddef>
#include <string>

#include "dfss/error.hpp"
#include "dfss/params.hpp"

namespace dfss::cuda {

/// @brief Why the CUDA forward cannot run @p p (empty when it can): element type, head dim,
/// pattern, bias, layout and alignment of the views, grid limits, and that every tensor is device
/// memory of the current device (or managed memory), checked with cudaPointerGetAttributes. Reads no
/// tensor data.
std::string forward_unsupported_reason(const attention_params& p);

/// @brief Stable name of the kernels that run @p p, e.g. "cuda.three_stage_forward.bf16.d64.2of4"
/// (the name predates the folded softmax, which made the three stages two kernels; kept, since
/// callers match on it).
std::string forward_kernel_name(const attention_params& p);

/// @brief Enqueues the two-kernel forward (SDDMM + selection + first half of the softmax, SpMM +
/// second half; src/cuda/warp/softmax_fold.hpp) on @p stream (a cudaStream_t of the current device; null is the legacy default stream). The
/// intermediates are one block allocated and freed stream-ordered (cudaMallocFromPoolAsync /
/// cudaFreeAsync) from a dfss-owned pool per device whose release threshold is unlimited, so the
/// memory stays mapped between calls (the pool keeps the largest concurrent intermediates so far);
/// the call never synchronises with the host and can be captured in a CUDA graph. Errors come back
/// as status_code::cuda_error naming the step: a CUDA error already pending at entry is reported as
/// such (nothing is launched, the error is left pending), so a launch error is always our launch's,
/// except for sticky asynchronous errors, which the message says may come from earlier kernels.
/// Precondition: forward_unsupported_reason(p) is empty.
status attention_forward(const attention_params& p, void* stream);

/// @brief Bytes the dfss-owned workspace pool of the current device holds mapped (0 before its first
/// use); for the tests, which check that the intermediates stay mapped between calls.
std::size_t workspace_pool_reserved_bytes();

}  // namespace dfss::cuda
