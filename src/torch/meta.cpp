// src/torch/meta.cpp: Meta kernels of torch.ops.dfss.attention: the same argument checks and
// output shapes and dtypes, no data. They let PyTorch trace the operator with fake tensors
// (torch.compile, torch.export, shape propagation) without running it.
#include <torch/library.h>

#include "ops.hpp"

namespace dfss::torch_ops {
namespace {

std::tuple<at::Tensor, at::Tensor> attention_meta(const at::Tensor& q, const at::Tensor& k,
                                                  const at::Tensor& v, c10::string_view, bool,
                                                  c10::optional<double>, const optional_tensor& key_lengths,
                                                  const optional_tensor& attn_bias, std::int64_t,
                                                  const optional_tensor& query_offset, std::int64_t, std::int64_t) {
  check_inputs("dfss.attention", c10::DeviceType::Meta, q, k, v, key_lengths, attn_bias, query_offset);
  const at::ScalarType lse_type = q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  return {at::empty(q.sizes(), q.options()),
          at::empty({q.size(0), q.size(2), q.size(1)}, q.options().dtype(lse_type))};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> attention_backward_meta(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, c10::string_view, bool, c10::optional<double>,
    const optional_tensor& key_lengths, const optional_tensor& attn_bias, bool bias_requires_grad, std::int64_t,
    const optional_tensor& query_offset, std::int64_t, std::int64_t, const optional_tensor& dlse) {
  check_backward_inputs("dfss.attention_backward", c10::DeviceType::Meta, dout, q, k, v, out, lse, key_lengths,
                        attn_bias, query_offset, dlse);
  const bool want_dbias = bias_requires_grad && attn_bias.has_value() && attn_bias->defined();
  return {at::empty(q.sizes(), q.options()), at::empty(k.sizes(), k.options()),
          at::empty(v.sizes(), v.options()),
          want_dbias ? at::empty(attn_bias->sizes(), attn_bias->options()) : at::empty({0}, q.options())};
}

}  // namespace
}  // namespace dfss::torch_ops

TORCH_LIBRARY_IMPL(dfss, Meta, m) {
  m.impl("attention", &dfss::torch_ops::attention_meta);
  m.impl("attention_backward", &dfss::torch_ops::attention_backward_meta);
}
