// src/torch/cpu.cpp: the CPU kernels of torch.ops.dfss.attention: argument checks with the
// operator's own argument names, then dfss::attention_forward / attention_backward on strided views
// of the tensors (no copies: dfss takes any element strides).
//
// The device-independent half of every kernel lives here too and is declared in ops.hpp: the
// checks, the translation of tensors and arguments into dfss's views and config (make_config,
// run_forward) and the error translation (rethrow). The CUDA forward (cuda.cpp) and the Meta
// kernels call it, so the CPU tests exercise the code the CUDA kernel runs up to the device. Not a
// file of its own: every translation unit that includes the torch headers costs 20-40 s per build
// of the extension, and the Python tests build it twice per CI run.
#include <cmath>
#include <limits>
#include <sstream>
#include <string>

#include <ATen/Parallel.h>

#include "dfss/attention.hpp"
#include "ops.hpp"

namespace dfss::torch_ops {

const char* type_name(at::ScalarType t) {
  switch (t) {
    case at::kDouble: return "float64";
    case at::kFloat: return "float32";
    case at::kHalf: return "float16";
    case at::kBFloat16: return "bfloat16";
    case at::kInt: return "int32";
    case at::kLong: return "int64";
    case at::kBool: return "bool";
    default: return c10::toString(t);
  }
}

namespace {

constexpr const char* kForward = "dfss.attention";
constexpr const char* kBackward = "dfss.attention_backward";

std::string shape_of(const at::Tensor& t) {
  std::ostringstream s;
  s << t.sizes();
  return s.str();
}

/// Device, layout and rank: RuntimeError for a tensor that is not a strided tensor on the kernel's
/// device (a device problem), ValueError for the rank.
void check_tensor(const char* op, c10::DeviceType device, const char* name, const at::Tensor& t, int rank,
                  const char* dims) {
  TORCH_CHECK_VALUE(t.defined(), op, ": argument '", name, "': expected a tensor, got an undefined tensor");
  TORCH_CHECK(t.device().type() == device, op, ": argument '", name, "': expected a ",
              c10::DeviceTypeName(device), " tensor, got a tensor on ",
              t.device());
  TORCH_CHECK(t.layout() == at::kStrided, op, ": argument '", name,
              "': expected a dense (strided) tensor, got layout ", t.layout());
  TORCH_CHECK_VALUE(t.dim() == rank, op, ": argument '", name, "': expected ", rank, " dimensions ", dims,
                    ", got ", t.dim(), " dimensions with shape ", shape_of(t));
}

/// Every tensor on q's device: on one device type, the device index still has to match (cuda:0 and
/// cuda:1); the kernel runs on q's device.
void check_same_device(const char* op, const at::Tensor& q, const char* name, const at::Tensor& t) {
  TORCH_CHECK(t.device() == q.device(), op, ": argument '", name, "': expected a tensor on ", q.device(),
              " (the device of 'q'), got a tensor on ", t.device());
}

bool is_attention_float(at::ScalarType t) {
  return t == at::kDouble || t == at::kFloat || t == at::kHalf || t == at::kBFloat16;
}

void check_dim(const char* op, const char* name, const at::Tensor& t, int d, const char* what,
               std::int64_t expected) {
  TORCH_CHECK_VALUE(t.size(d) == expected, op, ": argument '", name, "': expected shape[", d, "] (",
                    what, ") == ", expected, ", got ", t.size(d), " (shape ", shape_of(t), ")");
}

}  // namespace

void check_inputs(const char* op, c10::DeviceType device, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                  const optional_tensor& key_lengths, const optional_tensor& attn_bias,
                  const optional_tensor& query_offset) {
  check_tensor(op, device, "q", q, 4, "[B, Lq, H, d]");
  check_tensor(op, device, "k", k, 4, "[B, Lk, Hkv, d]");
  check_tensor(op, device, "v", v, 4, "[B, Lk, Hkv, d]");
  check_same_device(op, q, "k", k);
  check_same_device(op, q, "v", v);
  TORCH_CHECK_VALUE(is_attention_float(q.scalar_type()), op,
                    ": argument 'q': expected dtype float64, float32, float16 or bfloat16, got ",
                    type_name(q.scalar_type()));
  TORCH_CHECK_VALUE(k.scalar_type() == q.scalar_type(), op, ": argument 'k': expected dtype ",
                    type_name(q.scalar_type()), " (the dtype of q), got ", type_name(k.scalar_type()));
  TORCH_CHECK_VALUE(v.scalar_type() == q.scalar_type(), op, ": argument 'v': expected dtype ",
                    type_name(q.scalar_type()), " (the dtype of q), got ", type_name(v.scalar_type()));
  TORCH_CHECK_VALUE(q.size(3) >= 1, op, ": argument 'q': expected shape[3] (head_dim) >= 1, got 0");
  check_dim(op, "k", k, 0, "batch", q.size(0));
  check_dim(op, "k", k, 3, "head_dim", q.size(3));
  TORCH_CHECK_VALUE(k.size(2) >= 1 && q.size(2) % k.size(2) == 0, op,
                    ": argument 'k': expected shape[2] (heads_kv) to divide the ", q.size(2),
                    " query heads, got ", k.size(2), " (shape ", shape_of(k), ")");
  TORCH_CHECK_VALUE(v.sizes() == k.sizes(), op, ": argument 'v': expected the shape of 'k' ", shape_of(k),
                    ", got ", shape_of(v));
  if (key_lengths.has_value() && key_lengths->defined()) {
    const at::Tensor& kl = *key_lengths;
    check_tensor(op, device, "key_lengths", kl, 1, "[B]");
    check_same_device(op, q, "key_lengths", kl);
    TORCH_CHECK_VALUE(kl.scalar_type() == at::kInt || kl.scalar_type() == at::kLong, op,
                      ": argument 'key_lengths': expected dtype int32 or int64, got ", type_name(kl.scalar_type()));
    check_dim(op, "key_lengths", kl, 0, "batch", q.size(0));
  }
  if (query_offset.has_value() && query_offset->defined()) {
    const at::Tensor& qo = *query_offset;
    check_tensor(op, device, "query_offset", qo, 1, "[B]");
    check_same_device(op, q, "query_offset", qo);
    TORCH_CHECK_VALUE(qo.scalar_type() == at::kInt || qo.scalar_type() == at::kLong, op,
                      ": argument 'query_offset': expected dtype int32 or int64, got ", type_name(qo.scalar_type()));
    check_dim(op, "query_offset", qo, 0, "batch", q.size(0));
  }
  if (attn_bias.has_value() && attn_bias->defined()) {
    const at::Tensor& b = *attn_bias;
    check_tensor(op, device, "attn_bias", b, 4, "[B or 1, H or 1, Lq, Lk]");
    check_same_device(op, q, "attn_bias", b);
    TORCH_CHECK_VALUE(is_attention_float(b.scalar_type()), op,
                      ": argument 'attn_bias': expected dtype float64, float32, float16 or bfloat16, got ",
                      type_name(b.scalar_type()));
    const std::int64_t want[4] = {q.size(0), q.size(2), q.size(1), k.size(1)};
    const char* what[4] = {"batch or 1", "heads or 1", "seqlen_q", "seqlen_k"};
    for (int d = 0; d < 4; ++d) {
      TORCH_CHECK_VALUE(b.size(d) == want[d] || (d < 2 && b.size(d) == 1), op,
                        ": argument 'attn_bias': expected shape[", d, "] (", what[d], ") == ", want[d],
                        ", got ", b.size(d), " (shape ", shape_of(b), ")");
    }
  }
}

/// Rethrows a dfss::error with the operator's name and argument names: invalid arguments become
/// ValueError, everything else (unsupported, internal) RuntimeError.
[[noreturn]] void rethrow(const char* op, const dfss::error& e) {
  std::string msg = e.what();
  // dfss's messages start with the C++ function ("dfss::attention_forward: ") and name the C++
  // fields; the user called the operator, whose bias argument is attn_bias.
  if (msg.rfind("dfss:", 0) == 0) {
    const auto colon = msg.find(": ");
    if (colon != std::string::npos) msg.erase(0, colon + 2);
  }
  for (const char* field : {"'bias'", "'dbias'"}) {
    const std::string from = std::string("argument ") + field;
    const std::string to = field[1] == 'b' ? "argument 'attn_bias'" : "argument 'attn_bias' (its gradient)";
    for (auto pos = msg.find(from); pos != std::string::npos; pos = msg.find(from, pos + to.size())) {
      msg.replace(pos, from.size(), to);
    }
  }
  if (e.code() == dfss::status_code::invalid_argument) TORCH_CHECK_VALUE(false, op, ": ", msg);
  TORCH_CHECK(false, op, ": ", msg);
}

dfss::attention_config make_config(const char* op, c10::string_view pattern, bool causal,
                                   c10::optional<double> scale, std::int64_t key_offset, std::int64_t sink_tokens,
                                   std::int64_t recent_tokens) {
  dfss::attention_config config;
  try {
    config.pattern = dfss::pattern::parse(std::string_view(pattern.data(), pattern.size()), "pattern");
  } catch (const dfss::error& e) {
    rethrow(op, e);
  }
  if (scale.has_value()) {
    TORCH_CHECK_VALUE(std::isfinite(*scale) && *scale > 0.0, op,
                      ": argument 'scale': expected a finite value > 0 (or None for 1/sqrt(d)), got ",
                      *scale);
    config.scale = *scale;
  }
  config.causal = causal;
  config.key_offset = key_offset;
  config.sink_tokens = sink_tokens;
  config.recent_tokens = recent_tokens;
  // The caller's torch.set_num_threads() applies to dfss's OpenMP loops too.
  config.num_threads = at::get_num_threads();
  return config;
}

namespace {

dfss::dtype dfss_type(at::ScalarType t) {
  switch (t) {
    case at::kDouble: return dfss::dtype::f64;
    case at::kFloat: return dfss::dtype::f32;
    case at::kHalf: return dfss::dtype::f16;
    case at::kBFloat16: return dfss::dtype::bf16;
    case at::kInt: return dfss::dtype::i32;
    case at::kLong: return dfss::dtype::i64;
    default: break;
  }
  TORCH_CHECK(false, "dfss: internal error: unchecked dtype ", t);
}

dfss::tensor_view view_of(const at::Tensor& t) {
  dfss::tensor_view v;
  v.data = t.data_ptr();
  v.type = dfss_type(t.scalar_type());
  v.rank = static_cast<int>(t.dim());
  for (int d = 0; d < v.rank; ++d) {
    v.shape[d] = t.size(d);
    v.stride[d] = t.stride(d);
  }
  return v;
}

dfss::tensor_view optional_view(const optional_tensor& t) {
  return t.has_value() && t->defined() ? view_of(*t) : dfss::tensor_view{};
}

at::ScalarType lse_type(const at::Tensor& q) { return q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat; }

}  // namespace

void check_backward_inputs(const char* op, c10::DeviceType device, const at::Tensor& dout, const at::Tensor& q,
                           const at::Tensor& k, const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse,
                           const optional_tensor& key_lengths, const optional_tensor& attn_bias,
                           const optional_tensor& query_offset, const optional_tensor& dlse) {
  check_inputs(op, device, q, k, v, key_lengths, attn_bias, query_offset);
  check_tensor(op, device, "dout", dout, 4, "[B, Lq, H, d]");
  check_tensor(op, device, "out", out, 4, "[B, Lq, H, d]");
  check_tensor(op, device, "lse", lse, 3, "[B, H, Lq]");
  check_same_device(op, q, "dout", dout);
  check_same_device(op, q, "out", out);
  check_same_device(op, q, "lse", lse);
  TORCH_CHECK_VALUE(dout.sizes() == q.sizes(), op, ": argument 'dout': expected the shape of 'q' ", shape_of(q),
                    ", got ", shape_of(dout));
  if (dlse.has_value() && dlse->defined()) {
    check_tensor(op, device, "dlse", *dlse, 3, "[B, H, Lq]");
    check_same_device(op, q, "dlse", *dlse);
    TORCH_CHECK_VALUE(dlse->sizes() == lse.sizes(), op, ": argument 'dlse': expected the shape of 'lse' ",
                      shape_of(lse), ", got ", shape_of(*dlse));
  }
}

std::tuple<at::Tensor, at::Tensor> run_forward(const char* op, const at::Tensor& q, const at::Tensor& k,
                                               const at::Tensor& v, const optional_tensor& key_lengths,
                                               const optional_tensor& attn_bias, const optional_tensor& query_offset,
                                               const dfss::attention_config& config) {
  // q's options: the outputs live on q's device (and for CUDA, on the caller's current stream's
  // allocator); dfss writes every element, so they are not initialised here.
  at::Tensor out = at::empty(q.sizes(), q.options());
  at::Tensor lse = at::empty({q.size(0), q.size(2), q.size(1)}, q.options().dtype(lse_type(q)));
  if (q.numel() == 0) return {out, lse};
  if (k.size(1) == 0) {
    // No keys: every row is empty (semantics: output 0, LSE -inf). dfss itself takes no 0-sized dims.
    out.zero_();
    lse.fill_(-std::numeric_limits<double>::infinity());
    return {out, lse};
  }
  dfss::forward_args a;
  a.q = view_of(q);
  a.k = view_of(k);
  a.v = view_of(v);
  a.out = view_of(out);
  a.lse = view_of(lse);
  a.key_lengths = optional_view(key_lengths);
  a.query_offset = optional_view(query_offset);
  a.bias = optional_view(attn_bias);
  try {
    dfss::attention_forward(a, config);
  } catch (const dfss::error& e) {
    rethrow(op, e);
  }
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor> attention_cpu(const at::Tensor& q, const at::Tensor& k,
                                                 const at::Tensor& v, c10::string_view pattern,
                                                 bool causal, c10::optional<double> scale,
                                                 const optional_tensor& key_lengths,
                                                 const optional_tensor& attn_bias, std::int64_t key_offset,
                                                 const optional_tensor& query_offset, std::int64_t sink_tokens,
                                                 std::int64_t recent_tokens) {
  check_inputs(kForward, c10::DeviceType::CPU, q, k, v, key_lengths, attn_bias, query_offset);
  const dfss::attention_config config =
      make_config(kForward, pattern, causal, scale, key_offset, sink_tokens, recent_tokens);
  return run_forward(kForward, q, k, v, key_lengths, attn_bias, query_offset, config);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> attention_backward_cpu(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, c10::string_view pattern, bool causal,
    c10::optional<double> scale, const optional_tensor& key_lengths, const optional_tensor& attn_bias,
    bool bias_requires_grad, std::int64_t key_offset, const optional_tensor& query_offset, std::int64_t sink_tokens,
    std::int64_t recent_tokens, const optional_tensor& dlse) {
  check_backward_inputs(kBackward, c10::DeviceType::CPU, dout, q, k, v, out, lse, key_lengths, attn_bias,
                        query_offset, dlse);
  // dfss wants dout in q's dtype; autograd may hand over another one (e.g. from a dtype cast).
  const at::Tensor dout_q = dout.scalar_type() == q.scalar_type() ? dout : dout.to(q.scalar_type());
  const dfss::attention_config config =
      make_config(kBackward, pattern, causal, scale, key_offset, sink_tokens, recent_tokens);
  // The LSE gradient in lse's dtype (autograd may hand over another one).
  at::Tensor dlse_t;
  if (dlse.has_value() && dlse->defined()) dlse_t = dlse->scalar_type() == lse.scalar_type() ? *dlse : dlse->to(lse.scalar_type());
  const bool want_dbias = bias_requires_grad && attn_bias.has_value() && attn_bias->defined();
  at::Tensor dq = at::empty(q.sizes(), q.options());
  at::Tensor dk = at::empty(k.sizes(), k.options());
  at::Tensor dv = at::empty(v.sizes(), v.options());
  at::Tensor dbias = want_dbias ? at::empty(attn_bias->sizes(), attn_bias->options())
                                : at::empty({0}, q.options());
  if (q.numel() == 0 || k.numel() == 0) {
    // Nothing is attended (no queries or no keys): every gradient is zero.
    dq.zero_();
    dk.zero_();
    dv.zero_();
    dbias.zero_();
    return {dq, dk, dv, dbias};
  }
  dfss::backward_args a;
  a.q = view_of(q);
  a.k = view_of(k);
  a.v = view_of(v);
  a.out = view_of(out);
  a.lse = view_of(lse);
  a.dout = view_of(dout_q);
  a.dq = view_of(dq);
  a.dk = view_of(dk);
  a.dv = view_of(dv);
  a.key_lengths = optional_view(key_lengths);
  a.query_offset = optional_view(query_offset);
  if (dlse_t.defined()) a.dlse = view_of(dlse_t);
  a.bias = optional_view(attn_bias);
  if (want_dbias) a.dbias = view_of(dbias);
  try {
    dfss::attention_backward(a, config);
  } catch (const dfss::error& e) {
    rethrow(kBackward, e);
  }
  return {dq, dk, dv, dbias};
}

}  // namespace dfss::torch_ops
