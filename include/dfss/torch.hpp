// dfss/torch.hpp: DFSS attention on at::Tensor (LibTorch), with autograd.
//
// Link dfss::dfss_torch (find_package(dfss) in a project that also finds Torch). The call goes
// through the registered operator torch.ops.dfss.attention, so gradients flow with autograd and a
// CUDA implementation, once built, is picked up by PyTorch's dispatcher without API changes.
//
//   auto [out, lse] = dfss::torch::attention(q, k, v);            // q, k, v: [B, L, H, d]
//   out.sum().backward();                                          // dq, dk, dv via dfss's backward
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <tuple>

#include <ATen/Tensor.h>

namespace dfss::torch {

/// @brief Options of dfss::torch::attention. An undefined at::Tensor means "absent".
struct attention_options {
  /// "N:M" (1 <= N <= M <= 16) or "dense".
  std::string pattern = "2:4";
  /// Causal mask: key j is visible to query i iff key_offset + j <= query_offset[b] + i (default
  /// bottom-right: j <= i + (Lk - Lq)).
  bool causal = false;
  /// Softmax scale; empty means 1/sqrt(d). Must be finite and > 0.
  std::optional<double> scale;
  /// Optional [B] int32/int64 number of valid keys per batch entry in global positions, each >= 0.
  at::Tensor key_lengths;
  /// Global position of key 0, a multiple of M (docs/semantics.md, "Positions").
  std::int64_t key_offset = 0;
  /// Optional [B] int32/int64 global position of query row 0 (default key_offset + Lk - Lq).
  at::Tensor query_offset;
  /// Dense sink and recent windows (docs/semantics.md, "Sink and recent windows"); 0: none.
  std::int64_t sink_tokens = 0;
  std::int64_t recent_tokens = 0;
  /// Optional additive bias [B or 1, H or 1, Lq, Lk] (any floating type; -inf masks), added to the
  /// scores before the N:M selection. Differentiable.
  at::Tensor attn_bias;
};

/// @brief DFSS attention: q [B, Lq, H, d], k and v [B, Lk, Hkv, d] (H a multiple of Hkv; any
/// strides; float64, float32, float16 or bfloat16, CPU). Returns (out [B, Lq, H, d] in q's dtype,
/// lse [B, H, Lq] float32, float64 for float64 q). out is differentiable with respect to q, k, v and
/// attn_bias (the forward's N:M selection held fixed); so is lse (a gradient of lse enters the
/// backward as dlse).
/// Bad arguments throw c10::ValueError (or c10::Error) naming the argument, expected and received.
std::tuple<at::Tensor, at::Tensor> attention(const at::Tensor& q, const at::Tensor& k,
                                             const at::Tensor& v,
                                             const attention_options& options = {});

}  // namespace dfss::torch
