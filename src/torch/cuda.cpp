// src/torch/cuda.cpp: the CUDA kernels of torch.ops.dfss.attention, through dfss's CUDA backend
// (the public C++ API, dfss::attention_forward with device pointers and a stream). Compiled instead
// of cuda_unavailable.cpp when the extension is built against a torch with CUDA and a dfss core with
// the CUDA backend (setup.py decides and says why).
//
// The forward: the shared checks and translation (cpu.cpp, run_forward), on q's device and the
// caller's current stream, so it orders with the caller's other work on that stream and can be
// captured in a CUDA graph; it returns once the kernels are enqueued. What the CUDA backend does not
// take (f32 and f64, head_dim other than 64 and 128, patterns other than 1:2 and 2:4, attn_bias,
// key_offset, query_offset, sink and recent windows, strides that are not multiples of 8 elements)
// is an error naming the reason; nothing falls back to the CPU silently.
// The backward: an error until dfss has a CUDA backward.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "ops.hpp"

namespace dfss::torch_ops {
namespace {

constexpr const char* kForward = "dfss.attention";

std::tuple<at::Tensor, at::Tensor> attention_cuda(const at::Tensor& q, const at::Tensor& k,
                                                  const at::Tensor& v, c10::string_view pattern, bool causal,
                                                  c10::optional<double> scale, const optional_tensor& key_lengths,
                                                  const optional_tensor& attn_bias, std::int64_t key_offset,
                                                  const optional_tensor& query_offset, std::int64_t sink_tokens,
                                                  std::int64_t recent_tokens) {
  check_inputs(kForward, c10::DeviceType::CUDA, q, k, v, key_lengths, attn_bias, query_offset);
  // The dtype is checked here rather than left to the backend so that the message names the
  // argument and Python's dtype names; the backend's own reason covers every other limit.
  const at::ScalarType t = q.scalar_type();
  TORCH_CHECK_NOT_IMPLEMENTED(t == at::kHalf || t == at::kBFloat16, kForward,
                              ": argument 'q': expected dtype float16 or bfloat16 for CUDA tensors, got ",
                              type_name(t),
                              " (dfss's CUDA kernels take 16-bit inputs only; convert q, k and v with .half() or "
                              ".bfloat16(), or run on the CPU, which takes every float dtype)");
  dfss::attention_config config =
      make_config(kForward, pattern, causal, scale, key_offset, sink_tokens, recent_tokens);
  // backend cuda rather than automatic: the call must never be sent to a host backend, and an
  // unsupported call is reported with the CUDA backend's own reason.
  config.backend = dfss::backend::cuda;
  // The backend allocates its intermediates with cudaMallocAsync on the current device, and the
  // outputs are allocated by torch on q's device: both need q's device current.
  const c10::cuda::CUDAGuard device_guard(q.device());
  config.cuda_stream = c10::cuda::getCurrentCUDAStream(q.device().index()).stream();
  return run_forward(kForward, q, k, v, key_lengths, attn_bias, query_offset, config);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> attention_backward_cuda(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
    const at::Tensor&, c10::string_view, bool, c10::optional<double>, const optional_tensor&,
    const optional_tensor&, bool, std::int64_t, const optional_tensor&, std::int64_t, std::int64_t,
    const optional_tensor&) {
  TORCH_CHECK_NOT_IMPLEMENTED(false,
                              "dfss.attention_backward: no CUDA backward yet: dfss's CUDA backend computes the "
                              "forward only. Train on CPU tensors, or run the CUDA forward without autograd "
                              "(under torch.no_grad(), or on inputs that do not require grad)");
}

}  // namespace
}  // namespace dfss::torch_ops

TORCH_LIBRARY_IMPL(dfss, CUDA, m) {
  m.impl("attention", &dfss::torch_ops::attention_cuda);
  m.impl("attention_backward", &dfss::torch_ops::attention_backward_cuda);
}
