// LibTorch test of dfss::torch::attention: trains a tiny attention model for a few SGD steps through
// the operator and checks, at every step, the loss and every parameter gradient against an
// independent float64 LibTorch implementation of docs/semantics.md (reference_attention below:
// dense scores, masks, pairwise group ranking with ties to the lower key index, softmax over the
// kept scores; autograd differentiates it with the selection held fixed). Also checks the
// operator's error for a bad argument. Exit code 0 = pass, 1 = failure (printed).
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>

#include <torch/torch.h>

#include "dfss/torch.hpp"

namespace {

int failures = 0;

void check(bool ok, const std::string& what) {
  if (!ok) {
    std::printf("FAIL: %s\n", what.c_str());
    ++failures;
  }
}

double max_abs_diff(const at::Tensor& a, const at::Tensor& b) {
  return (a - b).abs().max().item<double>();
}

/// Keep mask [..., Lk] of the N largest scores of every aligned group of M keys.
at::Tensor select_nm(const at::Tensor& scores, int64_t n, int64_t m) {
  const int64_t lk = scores.size(-1);
  const int64_t groups = (lk + m - 1) / m;
  at::Tensor s = scores;
  if (groups * m != lk) {
    s = torch::constant_pad_nd(scores, {0, groups * m - lk}, -INFINITY);
  }
  std::vector<int64_t> shape(s.sizes().begin(), s.sizes().end() - 1);
  shape.push_back(groups);
  shape.push_back(m);
  s = s.reshape(shape);
  const at::Tensor a = s.unsqueeze(-1), b = s.unsqueeze(-2);
  const at::Tensor greater = (a > b) | (a.isnan() & ~b.isnan());
  const at::Tensor equal = (a == b) | (a.isnan() & b.isnan());
  const at::Tensor idx = torch::arange(m);
  const at::Tensor lower = idx.view({m, 1}) < idx.view({1, m});
  const at::Tensor rank = (greater | (equal & lower)).sum(-2);
  std::vector<int64_t> flat(shape.begin(), shape.end() - 2);
  flat.push_back(groups * m);
  return (rank < n).reshape(flat).narrow(-1, 0, lk);
}

/// q [B, Lq, H, d], k, v [B, Lk, Hkv, d] -> out [B, Lq, H, d] in float64.
at::Tensor reference_attention(at::Tensor q, at::Tensor k, at::Tensor v, int64_t n, int64_t m, bool causal,
                               const at::Tensor& key_lengths) {
  const int64_t bsz = q.size(0), lq = q.size(1), h = q.size(2), d = q.size(3), lk = k.size(1);
  k = k.repeat_interleave(h / k.size(2), 2);
  v = v.repeat_interleave(h / v.size(2), 2);
  at::Tensor s = torch::einsum("bihd,bjhd->bhij", {q, k});
  const at::Tensor i = torch::arange(lq).view({lq, 1}), j = torch::arange(lk).view({1, lk});
  at::Tensor visible = j.view({1, 1, 1, lk}) < key_lengths.view({bsz, 1, 1, 1});
  if (causal) visible = visible & (j <= i + (lk - lq)).view({1, 1, lq, lk});
  s = s.masked_fill(~visible, -INFINITY);
  const at::Tensor keep = select_nm(s.detach(), n, m);
  const at::Tensor kept = s.masked_fill(~keep, -INFINITY);
  const at::Tensor empty = ~(kept.detach() > -INFINITY).any(-1);
  const at::Tensor z = (kept / std::sqrt(static_cast<double>(d))).masked_fill(empty.unsqueeze(-1), 0.0);
  const at::Tensor p = torch::softmax(z, -1).masked_fill(empty.unsqueeze(-1), 0.0);
  return torch::einsum("bhij,bjhd->bihd", {p, v});
}

struct tiny_model {
  int64_t e, h, hkv, d;
  at::Tensor wq, wk, wv, wo;  // float64 parameters

  tiny_model(int64_t e_, int64_t h_, int64_t hkv_) : e(e_), h(h_), hkv(hkv_), d(e_ / h_) {
    const auto opt = torch::TensorOptions().dtype(torch::kFloat64);
    const double s = 1.0 / std::sqrt(static_cast<double>(e));
    wq = (torch::randn({e, e}, opt) * s).requires_grad_();
    wk = (torch::randn({e, hkv * d}, opt) * s).requires_grad_();
    wv = (torch::randn({e, hkv * d}, opt) * s).requires_grad_();
    wo = (torch::randn({e, e}, opt) * s).requires_grad_();
  }

  /// The model's attention output through dfss (use_dfss) or through the reference.
  at::Tensor forward(const at::Tensor& x, const at::Tensor& key_lengths, bool use_dfss) const {
    const int64_t b = x.size(0), l = x.size(1);
    const at::Tensor q = x.matmul(wq).view({b, l, h, d});
    const at::Tensor k = x.matmul(wk).view({b, l, hkv, d});
    const at::Tensor v = x.matmul(wv).view({b, l, hkv, d});
    at::Tensor o;
    if (use_dfss) {
      dfss::torch::attention_options opt;
      opt.pattern = "2:4";
      opt.causal = true;
      opt.key_lengths = key_lengths;
      o = std::get<0>(dfss::torch::attention(q, k, v, opt));
    } else {
      o = reference_attention(q, k, v, 2, 4, true, key_lengths);
    }
    return o.reshape({b, l, e}).matmul(wo);
  }
};

}  // namespace

int main() {
  const char* seed_env = std::getenv("DFSS_TEST_SEED");
  const uint64_t seed = seed_env != nullptr ? std::strtoull(seed_env, nullptr, 10) : std::random_device{}();
  torch::manual_seed(seed);
  std::printf("DFSS_TEST_SEED=%llu\n", static_cast<unsigned long long>(seed));

  // Awkward on purpose: L = 11 is not a multiple of M = 4, grouped heads (4 query heads share 2
  // key/value heads), causal, and batch 1 pads keys 7.. away.
  tiny_model model(16, 4, 2);
  const auto f64 = torch::TensorOptions().dtype(torch::kFloat64);
  const at::Tensor x = torch::randn({2, 11, 16}, f64);
  const at::Tensor target = torch::randn({2, 11, 16}, f64);
  const at::Tensor key_lengths = torch::tensor({11, 7}, torch::kInt64);
  std::vector<at::Tensor> params{model.wq, model.wk, model.wv, model.wo};
  torch::optim::SGD sgd(params, torch::optim::SGDOptions(0.5));

  double first_loss = 0.0, last_loss = 0.0;
  for (int step = 0; step < 6; ++step) {
    // Reference gradients at the current parameters.
    const at::Tensor ref_loss = torch::mse_loss(model.forward(x, key_lengths, false), target);
    const auto ref_grads = torch::autograd::grad({ref_loss}, params);

    sgd.zero_grad();
    const at::Tensor loss = torch::mse_loss(model.forward(x, key_lengths, true), target);
    loss.backward();
    // float64 through dfss's fp64 reference backend: agreement to rounding (1e-10 relative).
    const double l = loss.item<double>();
    check(std::abs(l - ref_loss.item<double>()) <= 1e-10 * std::abs(l),
          "step " + std::to_string(step) + ": loss " + std::to_string(l) + " vs reference " +
              std::to_string(ref_loss.item<double>()));
    for (size_t i = 0; i < params.size(); ++i) {
      const double scale = ref_grads[i].abs().max().item<double>();
      const double diff = max_abs_diff(params[i].grad(), ref_grads[i]);
      check(diff <= 1e-9 * scale, "step " + std::to_string(step) + ": gradient of parameter " +
                                      std::to_string(i) + " differs by " + std::to_string(diff) +
                                      " (largest " + std::to_string(scale) + ")");
    }
    if (step == 0) first_loss = l;
    last_loss = l;
    sgd.step();
  }
  std::printf("loss %.6f -> %.6f over 6 steps\n", first_loss, last_loss);
  check(last_loss < first_loss, "training through dfss::torch::attention did not reduce the loss");

  // A bad argument: the error names it, with the expected and the received value.
  try {
    const at::Tensor q = torch::randn({1, 4, 2, 8});
    dfss::torch::attention(q, q.to(torch::kFloat64), q);
    check(false, "mismatched dtypes were accepted");
  } catch (const c10::ValueError& e) {
    const std::string msg = e.what_without_backtrace();
    check(msg.find("argument 'k': expected dtype float32 (the dtype of q), got float64") != std::string::npos,
          "unexpected error message: " + msg);
  }

  if (failures != 0) {
    std::printf("%d check(s) failed\n", failures);
    return 1;
  }
  std::printf("all checks passed\n");
  return 0;
}
