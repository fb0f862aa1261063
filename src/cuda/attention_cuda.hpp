// src/cuda/attention_cuda.hpp: the CUDA backend's entry points as seen by the core (plain C++, no
// CUDA types, so g++ translation units include it). Defined in attention_cuda.cu, compiled only when
// DFSS_HAVE_CUDA.
#pragma once

#include <string>

#include "dfss/error.hpp"
#include "dfss/params.hpp"

namespace dfss::cuda {

/// @brief Why the CUDA forward cannot run @p p (empty when it can): element type, head dim,
/// pattern, bias, layout and alignment of the views, grid limits, and that every tensor is device
/// (or managed) memory, checked with cudaPointerGetAttributes. Reads no tensor data.
std::string forward_unsupported_reason(const attention_params& p);

/// @brief Stable name of the kernels that run @p p, e.g. "cuda.three_stage_forward.bf16.d64.2of4"
/// (the name predates the folded softmax, which made the three stages two kernels; kept, since
/// callers match on it).
std::string forward_kernel_name(const attention_params& p);

/// @brief Enqueues the two-kernel forward (SDDMM + selection + first half of the softmax, SpMM +
/// second half; src/cuda/warp/softmax_fold.hpp) on
/// @p stream (a cudaStream_t; null is the legacy default stream). Intermediates are allocated and
/// freed stream-ordered (cudaMallocAsync / cudaFreeAsync), so the call never synchronises with the
/// host and can be captured in a CUDA graph. Every launch is checked; errors come back as
/// status_code::cuda_error naming the step. Precondition: forward_unsupported_reason(p) is empty.
status attention_forward(const attention_params& p, void* stream);

}  // namespace dfss::cuda
