// src/torch/ops.hpp: the kernels behind torch.ops.dfss.attention and their shared signatures.
//
// One operator pair, registered once (ops.cpp): `dfss::attention` (forward) and
// `dfss::attention_backward`. Each dispatch key gets its own kernel: CPU (cpu.cpp), CUDA (cuda.cpp:
// the forward through dfss's CUDA backend, a clear error for the backward; or cuda_unavailable.cpp,
// a clear error for both, in a build without CUDA: setup.py picks one of the two files), Meta
// (meta.cpp: shapes and dtypes only, for tracing with fake tensors) and Autograd (ops.cpp), which
// calls the others through the dispatcher. The device-independent half of the kernels (checks,
// translation into dfss's views and config, error translation) is in cpu.cpp, declared here.
#pragma once

#include <cstdint>
#include <tuple>

#include <ATen/ATen.h>
#include <c10/util/Optional.h>
#include <c10/util/string_view.h>

#include "dfss/attention.hpp"

namespace dfss::torch_ops {

using optional_tensor = c10::optional<at::Tensor>;

/// C++ signature of dfss::attention; every kernel registered for it has exactly this type.
using attention_signature = std::tuple<at::Tensor, at::Tensor>(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, c10::string_view pattern,
    bool causal, c10::optional<double> scale, const optional_tensor& key_lengths,
    const optional_tensor& attn_bias, std::int64_t key_offset, const optional_tensor& query_offset,
    std::int64_t sink_tokens, std::int64_t recent_tokens);

/// C++ signature of dfss::attention_backward. dbias is a 0-element tensor unless
/// bias_requires_grad is set and attn_bias is given. dlse: the gradient of lse, or absent (zero).
using attention_backward_signature = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, c10::string_view pattern, bool causal,
    c10::optional<double> scale, const optional_tensor& key_lengths,
    const optional_tensor& attn_bias, bool bias_requires_grad, std::int64_t key_offset,
    const optional_tensor& query_offset, std::int64_t sink_tokens, std::int64_t recent_tokens,
    const optional_tensor& dlse);

/// Python's name of a dtype ("float32"), which is what most callers of the operator write.
const char* type_name(at::ScalarType t);

/// The checks shared by every device's kernels, with the operator's argument names: tensors on
/// @p device and all on q's device (else RuntimeError), ranks, dtypes and shapes (else ValueError).
void check_inputs(const char* op, c10::DeviceType device, const at::Tensor& q, const at::Tensor& k,
                  const at::Tensor& v, const optional_tensor& key_lengths, const optional_tensor& attn_bias,
                  const optional_tensor& query_offset = c10::nullopt);
/// check_inputs plus dout, out and lse of the backward.
void check_backward_inputs(const char* op, c10::DeviceType device, const at::Tensor& dout, const at::Tensor& q,
                           const at::Tensor& k, const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse,
                           const optional_tensor& key_lengths, const optional_tensor& attn_bias,
                           const optional_tensor& query_offset = c10::nullopt, const optional_tensor& dlse = c10::nullopt);

/// Rethrows a dfss::error as the operator's error (ValueError for invalid arguments, RuntimeError
/// otherwise), with the operator's name and argument names in place of the C++ API's.
[[noreturn]] void rethrow(const char* op, const dfss::error& e);

/// The config of a call: the pattern parsed, the scale checked (ValueError), the masks and windows,
/// and torch's thread count for the CPU backend. Backend automatic; a device kernel sets its own.
dfss::attention_config make_config(const char* op, c10::string_view pattern, bool causal,
                                   c10::optional<double> scale, std::int64_t key_offset, std::int64_t sink_tokens,
                                   std::int64_t recent_tokens);

/// The forward on checked inputs (check_inputs) on any device: (out, lse) allocated with q's options
/// (so on q's device), the problems without work answered here (no rows; no keys: out 0, lse -inf),
/// then dfss::attention_forward with @p config on views of the tensors; a dfss::error is rethrown.
std::tuple<at::Tensor, at::Tensor> run_forward(const char* op, const at::Tensor& q, const at::Tensor& k,
                                               const at::Tensor& v, const optional_tensor& key_lengths,
                                               const optional_tensor& attn_bias, const optional_tensor& query_offset,
                                               const dfss::attention_config& config);

attention_signature attention_cpu;
attention_backward_signature attention_backward_cpu;

}  // namespace dfss::torch_ops
