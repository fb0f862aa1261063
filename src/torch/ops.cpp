// src/torch/ops.cpp: the operator schema (torch.ops.dfss.attention), its autograd kernel, the CPU
// registration and the C++ API dfss::torch::attention.
#include <string>

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include "dfss/torch.hpp"
#include "ops.hpp"

namespace dfss::torch_ops {
namespace {

using ::torch::autograd::AutogradContext;
using ::torch::autograd::variable_list;

c10::TypedOperatorHandle<attention_signature> forward_op() {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("dfss::attention", "").typed<attention_signature>();
  return op;
}

c10::TypedOperatorHandle<attention_backward_signature> backward_op() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("dfss::attention_backward", "")
                             .typed<attention_backward_signature>();
  return op;
}

optional_tensor optional_of(const at::Tensor& t) {
  return t.defined() ? optional_tensor(t) : optional_tensor(c10::nullopt);
}

/// A present-but-undefined optional (possible from C++) as nullopt.
optional_tensor optional_of_present(const optional_tensor& t) {
  return t.has_value() && t->defined() ? t : optional_tensor(c10::nullopt);
}

/// (out, lse) = attention(q, k, v) with the forward's N:M selection held fixed in the backward
/// (dfss's backward recomputes exactly that selection from q, k, bias and masks). Both outputs are
/// differentiable: a gradient of lse (from merge_attention_states, say) enters the backward as dlse
/// (docs/semantics.md, "Backward").
class attention_function : public ::torch::autograd::Function<attention_function> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k,
                               const at::Tensor& v, const std::string& pattern, bool causal,
                               c10::optional<double> scale, const optional_tensor& key_lengths,
                               const optional_tensor& attn_bias, std::int64_t key_offset,
                               const optional_tensor& query_offset, std::int64_t sink_tokens,
                               std::int64_t recent_tokens) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [out, lse] = forward_op().call(q, k, v, pattern, causal, scale, key_lengths, attn_bias, key_offset,
                                        query_offset, sink_tokens, recent_tokens);
    const at::Tensor bias = attn_bias.value_or(at::Tensor());
    ctx->save_for_backward(
        {q, k, v, out, lse, key_lengths.value_or(at::Tensor()), bias, query_offset.value_or(at::Tensor())});
    ctx->saved_data["pattern"] = pattern;
    ctx->saved_data["causal"] = causal;
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["bias_requires_grad"] = bias.defined() && bias.requires_grad();
    ctx->saved_data["key_offset"] = key_offset;
    ctx->saved_data["sink_tokens"] = sink_tokens;
    ctx->saved_data["recent_tokens"] = recent_tokens;
    return {out, lse};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    // Autograd passes an undefined gradient for an output the loss does not use.
    const at::Tensor dout = grads[0].defined() ? grads[0] : at::zeros_like(saved[3]);
    const at::Tensor& dlse = grads[1];
    const std::string pattern = ctx->saved_data["pattern"].toStringRef();
    const bool causal = ctx->saved_data["causal"].toBool();
    const c10::optional<double> scale = ctx->saved_data["scale"].toOptional<double>();
    const bool bias_requires_grad = ctx->saved_data["bias_requires_grad"].toBool();
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [dq, dk, dv, dbias] = backward_op().call(
        dout, saved[0], saved[1], saved[2], saved[3], saved[4], pattern, causal, scale, optional_of(saved[5]),
        optional_of(saved[6]), bias_requires_grad, ctx->saved_data["key_offset"].toInt(), optional_of(saved[7]),
        ctx->saved_data["sink_tokens"].toInt(), ctx->saved_data["recent_tokens"].toInt(), optional_of(dlse));
    // One gradient per forward argument: q, k, v, pattern, causal, scale, key_lengths, attn_bias,
    // key_offset, query_offset, sink_tokens, recent_tokens.
    return {dq, dk, dv, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(),
            bias_requires_grad ? dbias : at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

std::tuple<at::Tensor, at::Tensor> attention_autograd(const at::Tensor& q, const at::Tensor& k,
                                                      const at::Tensor& v, c10::string_view pattern,
                                                      bool causal, c10::optional<double> scale,
                                                      const optional_tensor& key_lengths,
                                                      const optional_tensor& attn_bias, std::int64_t key_offset,
                                                      const optional_tensor& query_offset,
                                                      std::int64_t sink_tokens, std::int64_t recent_tokens) {
  // Absent optionals stay c10::nullopt: torch 1.13's Function::apply rejects undefined tensors.
  const variable_list result = attention_function::apply(
      q, k, v, std::string(pattern.data(), pattern.size()), causal, scale, optional_of_present(key_lengths),
      optional_of_present(attn_bias), key_offset, optional_of_present(query_offset), sink_tokens, recent_tokens);
  return {result[0], result[1]};
}

}  // namespace
}  // namespace dfss::torch_ops

TORCH_LIBRARY(dfss, m) {
  m.def("attention(Tensor q, Tensor k, Tensor v, str pattern=\"2:4\", bool causal=False, float? scale=None, "
        "Tensor? key_lengths=None, Tensor? attn_bias=None, int key_offset=0, Tensor? query_offset=None, "
        "int sink_tokens=0, int recent_tokens=0) -> (Tensor out, Tensor lse)");
  m.def("attention_backward(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, str pattern, "
        "bool causal, float? scale, Tensor? key_lengths, Tensor? attn_bias, bool bias_requires_grad, "
        "int key_offset=0, Tensor? query_offset=None, int sink_tokens=0, int recent_tokens=0, Tensor? dlse=None) "
        "-> (Tensor dq, Tensor dk, Tensor dv, Tensor dbias)");
}

TORCH_LIBRARY_IMPL(dfss, CPU, m) {
  m.impl("attention", &dfss::torch_ops::attention_cpu);
  m.impl("attention_backward", &dfss::torch_ops::attention_backward_cpu);
}

TORCH_LIBRARY_IMPL(dfss, Autograd, m) {
  m.impl("attention", &dfss::torch_ops::attention_autograd);
}

namespace dfss::torch {

std::tuple<at::Tensor, at::Tensor> attention(const at::Tensor& q, const at::Tensor& k,
                                             const at::Tensor& v, const attention_options& options) {
  const c10::optional<double> scale =
      options.scale.has_value() ? c10::optional<double>(*options.scale) : c10::optional<double>();
  return torch_ops::forward_op().call(q, k, v, options.pattern, options.causal, scale,
                                      torch_ops::optional_of(options.key_lengths),
                                      torch_ops::optional_of(options.attn_bias), options.key_offset,
                                      torch_ops::optional_of(options.query_offset), options.sink_tokens,
                                      options.recent_tokens);
}

}  // namespace dfss::torch
