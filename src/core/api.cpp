// The public API: validate, select, dispatch; statuses become dfss::error at this boundary.
#include <algorithm>
#include <limits>
#include <vector>

#include "core/element_access.hpp"
#include "core/registry.hpp"
#include "core/select.hpp"
#include "core/validate.hpp"
#include "dfss/attention.hpp"

namespace dfss {
namespace {

constexpr const char* kForwardOp = "dfss::attention_forward";
constexpr const char* kBackwardOp = "dfss::attention_backward";

status unsupported(const char* op, const kernel_selection& s) {
  return {status_code::unsupported,
          std::string(op) + ": backend '" + backend_name(s.backend) + "' cannot run this call: " +
              s.reason};
}

/// The registry's row of the selected kernel when it runs direction @p dir, else nullptr.
const core::kernel_entry* chosen(const kernel_selection& s, core::direction dir) {
  const core::kernel_entry* e = core::find_kernel(s.kind);
  return e != nullptr && e->dir == dir && (e->run != nullptr || e->run_on_stream != nullptr) ? e : nullptr;
}

status run_forward(const attention_params& p, const kernel_selection& s, const attention_config& config) {
  const core::kernel_entry* e = chosen(s, core::direction::forward);
  if (e == nullptr) {
    return {status_code::internal, std::string(kForwardOp) + ": selector chose '" + s.name +
                                       "', which is not a forward kernel"};
  }
  return e->run_on_stream != nullptr ? e->run_on_stream(p, config.cuda_stream) : e->run(p);
}

/// Writes @p value to every element of the [n0, n1, n2, n3] tensor at @p base (element strides
/// @p stride, type @p t). For the empty problems below only, so not a hot path.
void fill(void* base, dtype t, const std::int64_t* stride, const std::int64_t (&shape)[4], double value) {
  for (std::int64_t a = 0; a < shape[0]; ++a)
    for (std::int64_t b = 0; b < shape[1]; ++b)
      for (std::int64_t c = 0; c < shape[2]; ++c)
        for (std::int64_t e = 0; e < shape[3]; ++e)
          core::store_from_double(base, t, a * stride[0] + b * stride[1] + c * stride[2] + e * stride[3], value);
}

bool no_rows(const attention_params& p) { return p.batch * p.heads * p.seqlen_q == 0; }

/// A problem without work (docs/semantics.md, "Shapes"): with B, H or Lq = 0 there is nothing to
/// write; with Lk = 0 every row is empty, so O = 0 and LSE = -inf. Answered here, once, so that no
/// kernel has to handle zero-sized loops. Returns false when the kernels must run.
bool forward_without_work(const attention_params& p, const kernel_selection& s, status& st) {
  if (no_rows(p)) return (st = status::success()), true;
  if (p.seqlen_k != 0) return false;
  if (s.backend == backend::cuda) {
    st = {status_code::unsupported, std::string(kForwardOp) + ": the cuda backend does not take seqlen_k = 0 yet"};
    return true;
  }
  fill(p.o, p.o_type, p.o_stride, {p.batch, p.seqlen_q, p.heads, p.head_dim}, 0.0);
  if (p.lse != nullptr) {
    const std::int64_t lse_stride[4] = {p.lse_stride[0], p.lse_stride[1], p.lse_stride[2], 0};
    fill(p.lse, p.lse_type, lse_stride, {p.batch, p.heads, p.seqlen_q, 1}, -std::numeric_limits<double>::infinity());
  }
  st = status::success();
  return true;
}

/// The backward of a problem without work: every gradient is zero (dK and dV get no contribution
/// when no query row exists; dQ and dBias have no key to sum over when Lk = 0).
bool backward_without_work(const attention_params& p, const backward_args& a) {
  if (!no_rows(p) && p.seqlen_k != 0) return false;
  fill(p.dq, p.output_type, p.dq_stride, {p.batch, p.seqlen_q, p.heads, p.head_dim}, 0.0);
  fill(p.dk, p.output_type, p.dk_stride, {p.batch, p.seqlen_k, p.heads_kv, p.head_dim}, 0.0);
  fill(p.dv, p.output_type, p.dv_stride, {p.batch, p.seqlen_k, p.heads_kv, p.head_dim}, 0.0);
  if (p.dbias != nullptr) {
    // dbias's own shape: a dimension broadcast over (size 1) sums over zero rows when B or H is 0.
    const auto& n = a.dbias.shape;
    fill(p.dbias, p.bias_type, p.dbias_stride, {n[0], n[1], n[2], n[3]}, 0.0);
  }
  return true;
}

/// The CPU backward needs the forward's O and LSE; when the caller gave neither, they are computed
/// here with the forward of the same instruction set (same scores, same selection) into
/// temporaries. A caller that gives them must have produced them with that forward too, or a
/// near-tie may be kept differently.
status run_cpu_backward(const attention_params& p, core::host_kernel_fn forward, core::host_kernel_fn backward) {
  if (p.o != nullptr && p.lse != nullptr) return backward(p);
  const std::int64_t B = p.batch, Lq = p.seqlen_q, H = p.heads, d = p.head_dim;
  std::vector<float> o(static_cast<std::size_t>(B * Lq * H * d)), lse(static_cast<std::size_t>(B * H * Lq));
  attention_params f = p;
  f.o = o.data();
  f.o_type = f.output_type = dtype::f32;
  const std::int64_t o_stride[4] = {Lq * H * d, H * d, d, 1};
  const std::int64_t lse_stride[3] = {H * Lq, Lq, 1};
  std::copy(o_stride, o_stride + 4, f.o_stride);
  f.lse = lse.data();
  f.lse_type = dtype::f32;
  std::copy(lse_stride, lse_stride + 3, f.lse_stride);
  f.dq = f.dk = f.dv = f.dbias = nullptr;
  f.fp32_weights = true;  // O only feeds D: keep the weights unrounded
  status st = forward(f);
  if (!st.ok()) return st;
  attention_params b = p;
  b.o = f.o;
  b.o_type = dtype::f32;
  std::copy(o_stride, o_stride + 4, b.o_stride);
  b.lse = f.lse;
  b.lse_type = dtype::f32;
  std::copy(lse_stride, lse_stride + 3, b.lse_stride);
  return backward(b);
}

status run_backward(const attention_params& p, const kernel_selection& s) {
  const core::kernel_entry* e = chosen(s, core::direction::backward);
  if (e == nullptr || e->run == nullptr) {
    return {status_code::internal, std::string(kBackwardOp) + ": selector chose '" + s.name +
                                       "', which is not a backward kernel"};
  }
  if (e->forward == kernel_kind::none) return e->run(p);
  const core::kernel_entry* f = core::find_kernel(e->forward);
  if (f == nullptr || f->run == nullptr) {
    return {status_code::internal, std::string(kBackwardOp) + ": '" + s.name + "' names no host forward kernel"};
  }
  return run_cpu_backward(p, f->run, e->run);
}

}  // namespace

status try_attention_forward(const forward_args& args, const attention_config& config) noexcept {
  try {
    attention_params p;
    status st = core::build_forward_params(args, config, kForwardOp, p);
    if (!st.ok()) return st;
    const kernel_selection s = core::select(p, config, core::direction::forward);
    if (!s.supported()) return unsupported(kForwardOp, s);
    const core::kernel_entry* e = core::find_kernel(s.kind);
    if ((p.compressed_values != nullptr || p.compressed_meta != nullptr) && (e == nullptr || !e->writes_compressed)) {
      return {status_code::unsupported,
              std::string(kForwardOp) + ": the compressed outputs need the cpu three-stage kernel, but '" +
                  s.name + "' was selected (the cpu backend takes f32, f16 and bf16 inputs)"};
    }
    if (forward_without_work(p, s, st)) return st;
    return run_forward(p, s, config);
  } catch (const std::exception& e) {
    return {status_code::internal, std::string(kForwardOp) + ": " + e.what()};
  }
}

status try_attention_backward(const backward_args& args, const attention_config& config) noexcept {
  try {
    attention_params p;
    status st = core::build_backward_params(args, config, kBackwardOp, p);
    if (!st.ok()) return st;
    const kernel_selection s = core::select(p, config, core::direction::backward);
    if (!s.supported()) return unsupported(kBackwardOp, s);
    if (backward_without_work(p, args)) return status::success();
    return run_backward(p, s);
  } catch (const std::exception& e) {
    return {status_code::internal, std::string(kBackwardOp) + ": " + e.what()};
  }
}

void attention_forward(const forward_args& args, const attention_config& config) {
  throw_if_error(try_attention_forward(args, config));
}

void attention_backward(const backward_args& args, const attention_config& config) {
  throw_if_error(try_attention_backward(args, config));
}

kernel_selection select_kernel(const forward_args& args, const attention_config& config) {
  attention_params p;
  throw_if_error(core::build_forward_params(args, config, "dfss::select_kernel", p));
  return core::select(p, config, core::direction::forward);
}

kernel_selection select_kernel(const backward_args& args, const attention_config& config) {
  attention_params p;
  throw_if_error(core::build_backward_params(args, config, "dfss::select_kernel", p));
  return core::select(p, config, core::direction::backward);
}

}  // namespace dfss
