// Runs a testing::problem through the public API with a chosen element type, backend, memory
// layout and thread count; outputs are poisoned (NaN unless run_options::poison says otherwise)
// before the call and returned as fp64 in packed [B, Lq, H, d] / [B, H, Lq] order.
#pragma once

#include "testing.hpp"

namespace dfss::testing {

struct run_options {
  dtype type = dtype::f64;
  dtype out_type = dtype::f64;  // f64 here means "same as type"
  dfss::backend backend = dfss::backend::reference;
  bool bhld = false;  // store q, k, v, o (and grads) as [B, H, L, d] and pass strided views
  int threads = 0;
  bool want_lse = true;
  dfss::cpu_isa isa = dfss::cpu_isa::automatic;
  dfss::cpu_algorithm algorithm = dfss::cpu_algorithm::fused;
  /// Element type of the bias in the forward (f64, f32, bf16 or f16; values rounded to it); the
  /// backward passes it as f64.
  dtype bias_type = dtype::f64;
  /// What every output element holds before the call. NaN shows an unwritten element wherever a
  /// finite result is expected; a finite poison shows one where NaN is expected.
  double poison = kNaN;
};

struct forward_result {
  std::vector<double> o, lse;
};

struct backward_result {
  std::vector<double> dq, dk, dv, dbias;
};

namespace detail {

/// Storage of one [B, L, heads, d] tensor in the requested layout, with its view.
template <typename T>
struct stored {
  std::vector<T> data;
  tensor_view view;
  std::int64_t B = 0, L = 0, Hh = 0, d = 0;
  bool bhld = false;

  void init(std::int64_t b, std::int64_t l, std::int64_t hh, std::int64_t dd, bool layout_bhld,
            double poison = kNaN) {
    B = b, L = l, Hh = hh, d = dd, bhld = layout_bhld;
    data.assign(static_cast<std::size_t>(B * L * Hh * d), from_double<T>(poison));
    if (bhld) {
      view = make_strided_view(data.data(), {B, L, Hh, d}, {Hh * L * d, d, L * d, 1});
    } else {
      view = make_view(data.data(), {B, L, Hh, d});
    }
  }
  std::size_t at(std::int64_t b, std::int64_t l, std::int64_t h, std::int64_t c) const {
    return static_cast<std::size_t>(bhld ? ((b * Hh + h) * L + l) * d + c : ((b * L + l) * Hh + h) * d + c);
  }
  void load(const std::vector<double>& packed) {
    for (std::int64_t b = 0; b < B; ++b)
      for (std::int64_t l = 0; l < L; ++l)
        for (std::int64_t h = 0; h < Hh; ++h)
          for (std::int64_t c = 0; c < d; ++c)
            data[at(b, l, h, c)] = from_double<T>(packed[static_cast<std::size_t>(((b * L + l) * Hh + h) * d + c)]);
  }
  std::vector<double> packed() const {
    std::vector<double> out(static_cast<std::size_t>(B * L * Hh * d));
    for (std::int64_t b = 0; b < B; ++b)
      for (std::int64_t l = 0; l < L; ++l)
        for (std::int64_t h = 0; h < Hh; ++h)
          for (std::int64_t c = 0; c < d; ++c)
            out[static_cast<std::size_t>(((b * L + l) * Hh + h) * d + c)] = to_double(data[at(b, l, h, c)]);
    return out;
  }
};

template <typename T, typename O>
struct runner {
  const problem& pr;
  const run_options& opt;
  stored<T> q, k, v, dout;
  std::vector<double> bias_store;  // bias kept in f64 (any float type is accepted)
  std::vector<float> bias_f32;     // the forward's bias in opt.bias_type, where not f64
  std::vector<half> bias_f16;
  std::vector<bfloat16> bias_bf16;
  std::vector<std::int64_t> lens, qoff;
  tensor_view bias_view, lens_view, qoff_view;
  attention_config cfg;

  runner(const problem& p, const run_options& o) : pr(p), opt(o) {
    q.init(pr.B, pr.Lq, pr.H, pr.d, opt.bhld);
    k.init(pr.B, pr.Lk, pr.Hkv, pr.d, opt.bhld);
    v.init(pr.B, pr.Lk, pr.Hkv, pr.d, opt.bhld);
    q.load(pr.q);
    k.load(pr.k);
    v.load(pr.v);
    if (pr.has_bias) {
      bias_store = pr.bias;
      bias_view = make_view(bias_store.data(), {pr.bias_b ? pr.B : 1, pr.bias_h ? pr.H : 1, pr.Lq, pr.Lk});
    }
    if (!pr.key_lengths.empty()) {
      lens = pr.key_lengths;
      lens_view = make_view(lens.data(), {pr.B});
    }
    if (!pr.query_offset.empty()) {
      qoff = pr.query_offset;
      qoff_view = make_view(qoff.data(), {pr.B});
    }
    cfg.key_offset = pr.key_offset;
    cfg.sink_tokens = pr.sink;
    cfg.recent_tokens = pr.recent;
    cfg.pattern = pr.pat;
    cfg.scale = pr.scale;
    cfg.causal = pr.causal;
    cfg.backend = opt.backend;
    cfg.num_threads = opt.threads;
    cfg.cpu_isa = opt.isa;
    cfg.cpu_algorithm = opt.algorithm;
  }

  forward_result forward() {
    stored<O> o;
    o.init(pr.B, pr.Lq, pr.H, pr.d, opt.bhld, opt.poison);
    using L = std::conditional_t<std::is_same_v<T, double>, double, float>;
    std::vector<L> lse(static_cast<std::size_t>(pr.B * pr.H * pr.Lq), static_cast<L>(opt.poison));
    forward_args a;
    a.q = q.view, a.k = k.view, a.v = v.view, a.out = o.view;
    if (opt.want_lse) a.lse = make_view(lse.data(), {pr.B, pr.H, pr.Lq});
    a.bias = forward_bias();
    a.key_lengths = lens_view;
    a.query_offset = qoff_view;
    attention_forward(a, cfg);
    forward_result r;
    r.o = o.packed();
    if (opt.want_lse) r.lse = widen(lse);
    return r;
  }

  /// The bias view of the forward: bias_view, or the bias rounded to opt.bias_type.
  tensor_view forward_bias() {
    if (!pr.has_bias || opt.bias_type == dtype::f64) return bias_view;
    const std::int64_t b = pr.bias_b ? pr.B : 1, h = pr.bias_h ? pr.H : 1;
    switch (opt.bias_type) {
      case dtype::f32:
        bias_f32.clear();
        for (double x : pr.bias) bias_f32.push_back(static_cast<float>(x));
        return make_view(bias_f32.data(), {b, h, pr.Lq, pr.Lk});
      case dtype::f16:
        bias_f16.clear();
        for (double x : pr.bias) bias_f16.push_back(from_double<half>(x));
        return make_view(bias_f16.data(), {b, h, pr.Lq, pr.Lk});
      case dtype::bf16:
        bias_bf16.clear();
        for (double x : pr.bias) bias_bf16.push_back(from_double<bfloat16>(x));
        return make_view(bias_bf16.data(), {b, h, pr.Lq, pr.Lk});
      default:
        ADD_FAILURE() << "run_options::bias_type: f64, f32, f16 or bf16, got " << dtype_name(opt.bias_type);
        return bias_view;
    }
  }

  backward_result backward() {
    dout.init(pr.B, pr.Lq, pr.H, pr.d, opt.bhld);
    dout.load(pr.dout);
    stored<O> dq, dk, dv;
    dq.init(pr.B, pr.Lq, pr.H, pr.d, opt.bhld, opt.poison);
    dk.init(pr.B, pr.Lk, pr.Hkv, pr.d, opt.bhld, opt.poison);
    dv.init(pr.B, pr.Lk, pr.Hkv, pr.d, opt.bhld, opt.poison);
    std::vector<double> dbias(pr.has_bias ? static_cast<std::size_t>(pr.bias_numel()) : 0, opt.poison);
    backward_args a;
    a.q = q.view, a.k = k.view, a.v = v.view, a.dout = dout.view;
    a.dq = dq.view, a.dk = dk.view, a.dv = dv.view;
    a.bias = bias_view;
    if (pr.has_bias) a.dbias = make_view(dbias.data(), {pr.bias_b ? pr.B : 1, pr.bias_h ? pr.H : 1, pr.Lq, pr.Lk});
    a.key_lengths = lens_view;
    a.query_offset = qoff_view;
    // A gradient of the LSE goes with the forward's O and LSE (computed here by the same config).
    using L = std::conditional_t<std::is_same_v<T, double>, double, float>;
    stored<O> o;
    std::vector<L> lse, dlse;
    if (!pr.dlse.empty()) {
      o.init(pr.B, pr.Lq, pr.H, pr.d, opt.bhld);
      lse.assign(static_cast<std::size_t>(pr.B * pr.H * pr.Lq), static_cast<L>(kNaN));
      forward_args f;
      f.q = q.view, f.k = k.view, f.v = v.view, f.out = o.view;
      f.lse = make_view(lse.data(), {pr.B, pr.H, pr.Lq});
      f.bias = bias_view, f.key_lengths = lens_view, f.query_offset = qoff_view;
      attention_forward(f, cfg);
      for (double x : pr.dlse) dlse.push_back(static_cast<L>(x));
      a.out = o.view;
      a.lse = f.lse;
      a.dlse = make_view(dlse.data(), {pr.B, pr.H, pr.Lq});
    }
    attention_backward(a, cfg);
    return {dq.packed(), dk.packed(), dv.packed(), dbias};
  }
};

template <typename T, typename F>
auto with_out_type(const run_options& opt, F&& f) {
  if constexpr (std::is_same_v<T, double> || std::is_same_v<T, float>) {
    return f.template operator()<T, T>();
  } else {
    if (opt.out_type == dtype::f32) return f.template operator()<T, float>();
    return f.template operator()<T, T>();
  }
}

template <typename F>
auto dispatch(const run_options& opt, F&& f) {
  switch (opt.type) {
    case dtype::f32: return with_out_type<float>(opt, f);
    case dtype::f16: return with_out_type<half>(opt, f);
    case dtype::bf16: return with_out_type<bfloat16>(opt, f);
    default: return with_out_type<double>(opt, f);
  }
}

}  // namespace detail

inline forward_result run_forward(const problem& pr, const run_options& opt = {}) {
  return detail::dispatch(opt, [&]<typename T, typename O>() {
    return detail::runner<T, O>(pr, opt).forward();
  });
}

inline backward_result run_backward(const problem& pr, const run_options& opt = {}) {
  return detail::dispatch(opt, [&]<typename T, typename O>() {
    return detail::runner<T, O>(pr, opt).backward();
  });
}

/// Independent backward in matrix form from the naive forward's keep mask:
/// P dense with zeros where pruned, then the formulas of docs/semantics.md.
inline backward_result naive_backward(const problem& pr) {
  const auto f = naive_forward(pr);
  backward_result g;
  g.dq.assign(static_cast<std::size_t>(pr.q_numel()), 0.0);
  g.dk.assign(static_cast<std::size_t>(pr.kv_numel()), 0.0);
  g.dv.assign(static_cast<std::size_t>(pr.kv_numel()), 0.0);
  g.dbias.assign(pr.has_bias ? static_cast<std::size_t>(pr.bias_numel()) : 0, 0.0);
  const double sc = pr.resolved_scale();
  const auto d = pr.d;
  auto Q = [&](auto b, auto i, auto h, auto c) { return static_cast<std::size_t>(((b * pr.Lq + i) * pr.H + h) * d + c); };
  auto K = [&](auto b, auto j, auto h, auto c) { return static_cast<std::size_t>(((b * pr.Lk + j) * pr.Hkv + h) * d + c); };
  for (std::int64_t b = 0; b < pr.B; ++b)
    for (std::int64_t h = 0; h < pr.H; ++h) {
      const std::int64_t hk = h / (pr.H / pr.Hkv);
      for (std::int64_t i = 0; i < pr.Lq; ++i) {
        const double lse = f.lse[static_cast<std::size_t>((b * pr.H + h) * pr.Lq + i)];
        if (lse == -kInf) continue;
        std::vector<double> P(static_cast<std::size_t>(pr.Lk), 0.0), dP(static_cast<std::size_t>(pr.Lk), 0.0);
        double D = 0;
        for (std::int64_t c = 0; c < d; ++c) D += pr.dout[Q(b, i, h, c)] * f.o[Q(b, i, h, c)];
        // A gradient of the LSE: d LSE / d (scale s_j) = P_j, so dS gains P dLSE.
        if (!pr.dlse.empty()) D -= pr.dlse[static_cast<std::size_t>((b * pr.H + h) * pr.Lq + i)];
        for (std::int64_t j = 0; j < pr.Lk; ++j) {
          if (!f.keep[static_cast<std::size_t>(((b * pr.H + h) * pr.Lq + i) * pr.Lk + j)]) continue;
          double s = 0;
          for (std::int64_t c = 0; c < d; ++c) s += pr.q[Q(b, i, h, c)] * pr.k[K(b, j, hk, c)];
          if (pr.has_bias)
            s += pr.bias[static_cast<std::size_t>((((pr.bias_b ? b : 0) * (pr.bias_h ? pr.H : 1) + (pr.bias_h ? h : 0)) * pr.Lq + i) * pr.Lk + j)];
          // Global positions, as in naive_forward.
          const std::int64_t len = pr.key_lengths.empty() ? pr.key_offset + pr.Lk : pr.key_lengths[static_cast<std::size_t>(b)];
          const std::int64_t qpos = pr.query_offset.empty() ? pr.key_offset + pr.Lk - pr.Lq + i
                                                             : pr.query_offset[static_cast<std::size_t>(b)] + i;
          const bool masked = pr.key_offset + j >= len || (pr.causal && pr.key_offset + j > qpos);
          P[static_cast<std::size_t>(j)] = (masked || std::isinf(s)) ? 0.0 : std::exp(sc * s - lse);
          for (std::int64_t c = 0; c < d; ++c) dP[static_cast<std::size_t>(j)] += pr.dout[Q(b, i, h, c)] * pr.v[K(b, j, hk, c)];
        }
        for (std::int64_t j = 0; j < pr.Lk; ++j) {
          const double dS = P[static_cast<std::size_t>(j)] * (dP[static_cast<std::size_t>(j)] - D);
          for (std::int64_t c = 0; c < d; ++c) {
            g.dq[Q(b, i, h, c)] += sc * dS * pr.k[K(b, j, hk, c)];
            g.dk[K(b, j, hk, c)] += sc * dS * pr.q[Q(b, i, h, c)];
            g.dv[K(b, j, hk, c)] += P[static_cast<std::size_t>(j)] * pr.dout[Q(b, i, h, c)];
          }
          if (pr.has_bias)
            g.dbias[static_cast<std::size_t>((((pr.bias_b ? b : 0) * (pr.bias_h ? pr.H : 1) + (pr.bias_h ? h : 0)) * pr.Lq + i) * pr.Lk + j)] += sc * dS;
        }
      }
    }
  return g;
}

}  // namespace dfss::testing
