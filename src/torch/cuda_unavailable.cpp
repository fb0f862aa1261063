// src/torch/cuda_unavailable.cpp: the CUDA kernels of torch.ops.dfss.attention for a build without
// CUDA kernels (a torch without CUDA, no CUDA toolkit, a dfss core without the CUDA backend, or the
// CMake-built dfss_torch library): a clear RuntimeError naming the first CUDA argument. Builds with
// CUDA compile cuda.cpp instead (setup.py decides).
#include <initializer_list>
#include <utility>

#include <torch/library.h>

#include "ops.hpp"

namespace dfss::torch_ops {
namespace {

[[noreturn]] void no_cuda(const char* op,
                          std::initializer_list<std::pair<const char*, const at::Tensor*>> tensors) {
  for (const auto& [name, t] : tensors) {
    if (t->defined() && !t->device().is_cpu()) {
      TORCH_CHECK(false, op, ": argument '", name, "': expected a CPU tensor, got a tensor on ", t->device(),
                   " (this dfss build has no CUDA kernels; move the inputs to the CPU, or build dfss with CUDA)");
    }
  }
  TORCH_CHECK(false, op, ": this dfss build has no CUDA kernels; move the inputs to the CPU, or build dfss with CUDA");
}

const at::Tensor& or_undefined(const optional_tensor& t) {
  static const at::Tensor undefined;
  return t.has_value() ? *t : undefined;
}

std::tuple<at::Tensor, at::Tensor> attention_cuda(const at::Tensor& q, const at::Tensor& k,
                                                  const at::Tensor& v, c10::string_view, bool,
                                                  c10::optional<double>, const optional_tensor& key_lengths,
                                                  const optional_tensor& attn_bias, std::int64_t,
                                                  const optional_tensor& query_offset, std::int64_t, std::int64_t) {
  no_cuda("dfss.attention", {{"q", &q}, {"k", &k}, {"v", &v}, {"key_lengths", &or_undefined(key_lengths)},
                             {"attn_bias", &or_undefined(attn_bias)}, {"query_offset", &or_undefined(query_offset)}});
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> attention_backward_cuda(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, c10::string_view, bool, c10::optional<double>,
    const optional_tensor& key_lengths, const optional_tensor& attn_bias, bool, std::int64_t,
    const optional_tensor& query_offset, std::int64_t, std::int64_t, const optional_tensor& dlse) {
  no_cuda("dfss.attention_backward",
          {{"dout", &dout}, {"q", &q}, {"k", &k}, {"v", &v}, {"out", &out}, {"lse", &lse},
           {"key_lengths", &or_undefined(key_lengths)}, {"attn_bias", &or_undefined(attn_bias)},
           {"query_offset", &or_undefined(query_offset)}, {"dlse", &or_undefined(dlse)}});
}

}  // namespace
}  // namespace dfss::torch_ops

TORCH_LIBRARY_IMPL(dfss, CUDA, m) {
  m.impl("attention", &dfss::torch_ops::attention_cuda);
  m.impl("attention_backward", &dfss::torch_ops::attention_backward_cuda);
}
