// Cross-architecture check of the SIMD CPU kernels: built for AArch64 by
// tools/scripts/check-aarch64.sh and run under qemu-user, it runs every check below on each SIMD
// target of this build that the (emulated) CPU supports (qemu's default CPU has NEON, SVE and
// SVE2; "portable" must be selectable and "automatic" must pick the best target), comparing it with
// the fp64 reference backend on small-integer inputs,
// whose scores are exact, so selections must match and only the softmax carries rounding
// (tolerance as in tests/unit/test_cpu.cpp); then the same for the backward pass, which must be the
// portable backward twin (tolerance as in tests/unit/test_cpu_backward_twins.cpp), and a trip test
// that the backward keeps exactly the keys the forward kept on near-tied scores (here the compiler
// fuses multiply-adds into FMA, so this is where a second copy of the score code could drift); and
// the forward and backward on extreme inputs (+inf, NaN and -inf scores, scores near 1e3, 2^100 and
// beyond float max after scaling, a scale of float max; tests/unit/test_extreme_values.cpp has the
// full set). Prints "N passed, M failed" and exits non-zero on any failure.
#include <dfss/dfss.hpp>

#include <cfloat>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

namespace {

int passed = 0, failed = 0;
/// The SIMD target under test (every check's cpu_isa) and the kernel names it must select.
dfss::cpu_isa g_isa = dfss::cpu_isa::neon;
std::string kernel_name(bool forward) {
  return std::string(forward ? "cpu.fused_forward." : "cpu.fused_backward.") + dfss::cpu_isa_name(g_isa);
}
/// The forward the selector runs for @p lq query rows: the decode kernel up to 8 rows
/// (cpu::kDecodeMaxQueryRows), the fused forward above.
std::string forward_name(long long lq) {
  return lq <= 8 ? std::string("cpu.decode_forward.") + dfss::cpu_isa_name(g_isa) : kernel_name(true);
}

void check(bool ok, const char* what, long long a, long long b, long long c, const char* pat) {
  if (ok) {
    ++passed;
  } else {
    ++failed;
    std::printf("FAIL %s (Lq=%lld Lk=%lld d=%lld pattern %s)\n", what, a, b, c, pat);
  }
}

/// Largest |got - want| over all elements, or infinity when a value is not finite (outputs are
/// poisoned with NaN before the call, so this also checks that every element was written).
double max_err(const std::vector<float>& got, const std::vector<double>& want, double& max_want) {
  double err = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    if (!std::isfinite(got[i])) return INFINITY;
    err = std::fmax(err, std::fabs(static_cast<double>(got[i]) - want[i]));
    max_want = std::fmax(max_want, std::fabs(want[i]));
  }
  return err;
}

/// The automatic backward (the portable twin on ARM) against the fp64 reference backward on
/// small-integer inputs (exact scores, so the selections match), with grouped heads, causal masks,
/// a bias (dBias checked too) and key lengths that empty a batch. Kept to a few small shapes: it
/// runs under qemu.
void check_backward(std::mt19937& rng) {
  std::uniform_int_distribution<int> small(-3, 3);
  struct shape {
    std::int64_t B, Lq, Lk, H, Hkv, d;
  };
  for (const shape s : {shape{1, 5, 9, 2, 1, 3}, shape{2, 33, 70, 4, 2, 16}}) {
    for (dfss::pattern pat : {dfss::pattern{1, 1}, dfss::pattern{1, 2}, dfss::pattern{2, 4}, dfss::pattern{3, 8}}) {
      for (bool causal : {false, true}) {
        const auto nq = static_cast<std::size_t>(s.B * s.Lq * s.H * s.d), nk = static_cast<std::size_t>(s.B * s.Lk * s.Hkv * s.d);
        const auto nb = static_cast<std::size_t>(s.B * s.H * s.Lq * s.Lk);
        std::vector<float> q(nq), k(nk), v(nk), dout(nq), bias(nb), dq(nq, NAN), dk(nk, NAN), dv(nk, NAN), dbias(nb, NAN);
        std::vector<double> q64(nq), k64(nk), v64(nk), dout64(nq), bias64(nb), dq64(nq), dk64(nk), dv64(nk), dbias64(nb);
        for (std::size_t i = 0; i < nq; ++i) q64[i] = q[i] = static_cast<float>(small(rng));
        for (std::size_t i = 0; i < nq; ++i) dout64[i] = dout[i] = static_cast<float>(small(rng));
        for (std::size_t i = 0; i < nk; ++i) k64[i] = k[i] = static_cast<float>(small(rng));
        for (std::size_t i = 0; i < nk; ++i) v64[i] = v[i] = static_cast<float>(small(rng));
        for (std::size_t i = 0; i < nb; ++i) bias64[i] = bias[i] = static_cast<float>(small(rng));
        std::vector<std::int64_t> lens(static_cast<std::size_t>(s.B), s.Lk - s.Lk / 3);
        if (s.B > 1) lens[1] = 0;
        dfss::backward_args a;
        a.q = dfss::make_view(q.data(), {s.B, s.Lq, s.H, s.d});
        a.k = dfss::make_view(k.data(), {s.B, s.Lk, s.Hkv, s.d});
        a.v = dfss::make_view(v.data(), {s.B, s.Lk, s.Hkv, s.d});
        a.dout = dfss::make_view(dout.data(), {s.B, s.Lq, s.H, s.d});
        a.bias = dfss::make_view(bias.data(), {s.B, s.H, s.Lq, s.Lk});
        a.key_lengths = dfss::make_view(lens.data(), {s.B});
        a.dq = dfss::make_view(dq.data(), {s.B, s.Lq, s.H, s.d});
        a.dk = dfss::make_view(dk.data(), {s.B, s.Lk, s.Hkv, s.d});
        a.dv = dfss::make_view(dv.data(), {s.B, s.Lk, s.Hkv, s.d});
        a.dbias = dfss::make_view(dbias.data(), {s.B, s.H, s.Lq, s.Lk});
        dfss::attention_config cfg;
        cfg.cpu_isa = g_isa;
        cfg.pattern = pat;
        cfg.causal = causal;
        const auto sel = dfss::select_kernel(a, cfg);
        check(sel.name == kernel_name(false), "the target's backward is selected", s.Lq, s.Lk, s.d,
              pat.str().c_str());
        dfss::attention_backward(a, cfg);
        dfss::backward_args r;
        r.q = dfss::make_view(q64.data(), {s.B, s.Lq, s.H, s.d});
        r.k = dfss::make_view(k64.data(), {s.B, s.Lk, s.Hkv, s.d});
        r.v = dfss::make_view(v64.data(), {s.B, s.Lk, s.Hkv, s.d});
        r.dout = dfss::make_view(dout64.data(), {s.B, s.Lq, s.H, s.d});
        r.bias = dfss::make_view(bias64.data(), {s.B, s.H, s.Lq, s.Lk});
        r.key_lengths = a.key_lengths;
        r.dq = dfss::make_view(dq64.data(), {s.B, s.Lq, s.H, s.d});
        r.dk = dfss::make_view(dk64.data(), {s.B, s.Lk, s.Hkv, s.d});
        r.dv = dfss::make_view(dv64.data(), {s.B, s.Lk, s.Hkv, s.d});
        r.dbias = dfss::make_view(dbias64.data(), {s.B, s.H, s.Lq, s.Lk});
        cfg.backend = dfss::backend::reference;
        dfss::attention_backward(r, cfg);
        // (64 + terms) fp32 epsilons times (1 + the largest reference gradient), terms = Lk for dQ,
        // group * Lq for dK and dV, 1 for dBias (see tests/unit/test_cpu_backward_twins.cpp).
        const double eps = 1.0 / (1 << 23), group = static_cast<double>(s.H / s.Hkv);
        const struct {
          const char* what;
          const std::vector<float>& got;
          const std::vector<double>& want;
          double terms;
        } grads[] = {{"portable backward dq vs reference", dq, dq64, static_cast<double>(s.Lk)},
                     {"portable backward dk vs reference", dk, dk64, group * static_cast<double>(s.Lq)},
                     {"portable backward dv vs reference", dv, dv64, group * static_cast<double>(s.Lq)},
                     {"portable backward dbias vs reference", dbias, dbias64, 1.0}};
        for (const auto& g : grads) {
          double max_want = 0;
          const double err = max_err(g.got, g.want, max_want);
          check(err <= (64.0 + g.terms) * eps * (1.0 + max_want), g.what, s.Lq, s.Lk, s.d, pat.str().c_str());
        }
      }
    }
  }
}

/// Near-ties everywhere (keys equal up to noise below one fp32 ulp of the score; see
/// UsesExactlyItsForwardSelection in tests/unit/test_cpu_backward_twins.cpp): with V = I the
/// forward's O[i, j] > 0 exactly where row i kept key j, and with a zero bias dBias[i, j] != 0
/// exactly where the backward kept it.
void check_backward_selection(std::mt19937& rng) {
  std::uniform_real_distribution<float> u(0.5f, 1.5f), tiny(-4e-7f, 4e-7f);
  const std::int64_t Lk = 48, d = Lk, Lq = 24;
  for (dfss::pattern pat : {dfss::pattern{1, 2}, dfss::pattern{2, 4}, dfss::pattern{3, 8}}) {
    std::vector<float> q(static_cast<std::size_t>(Lq * d)), k(static_cast<std::size_t>(Lk * d)),
        v(static_cast<std::size_t>(Lk * d), 0.0f), o(q.size()), lse(static_cast<std::size_t>(Lq)), dout(q.size()),
        dq(q.size()), dk(k.size()), dv(v.size()), bias(static_cast<std::size_t>(Lq * Lk), 0.0f), dbias(bias.size(), NAN);
    for (auto& x : q) x = u(rng);
    for (auto& x : dout) x = u(rng) - 1.0f;
    for (auto& x : k) x = 1.0f + tiny(rng);
    for (std::int64_t j = 0; j < Lk; ++j) v[static_cast<std::size_t>(j * d + j)] = 1.0f;
    dfss::forward_args f;
    f.q = dfss::make_view(q.data(), {1, Lq, 1, d});
    f.k = dfss::make_view(k.data(), {1, Lk, 1, d});
    f.v = dfss::make_view(v.data(), {1, Lk, 1, d});
    f.out = dfss::make_view(o.data(), {1, Lq, 1, d});
    f.lse = dfss::make_view(lse.data(), {1, 1, Lq});
    f.bias = dfss::make_view(bias.data(), {1, 1, Lq, Lk});
    dfss::attention_config cfg;
    cfg.cpu_isa = g_isa;
    cfg.pattern = pat;
    dfss::attention_forward(f, cfg);
    dfss::backward_args b;
    b.q = f.q, b.k = f.k, b.v = f.v, b.out = f.out, b.lse = f.lse, b.bias = f.bias;
    b.dout = dfss::make_view(dout.data(), {1, Lq, 1, d});
    b.dq = dfss::make_view(dq.data(), {1, Lq, 1, d});
    b.dk = dfss::make_view(dk.data(), {1, Lk, 1, d});
    b.dv = dfss::make_view(dv.data(), {1, Lk, 1, d});
    b.dbias = dfss::make_view(dbias.data(), {1, 1, Lq, Lk});
    dfss::attention_backward(b, cfg);
    bool same = true;
    for (std::size_t x = 0; x < bias.size(); ++x) same = same && (dbias[x] != 0.0f) == (o[x / Lk * d + x % Lk] > 0.0f);
    check(same, "portable backward keeps the portable forward's near-tie selection", Lq, Lk, d, pat.str().c_str());
  }
}


/// Same class (NaN, +-inf, finite) and, where finite, |got - want| <= tol, element by element.
bool matches(const std::vector<float>& got, const std::vector<double>& want, double tol) {
  for (std::size_t i = 0; i < got.size(); ++i) {
    const double g = got[i], w = want[i];
    if (std::isnan(g) || std::isnan(w)) {
      if (std::isnan(g) != std::isnan(w)) return false;
    } else if (std::isinf(g) || std::isinf(w)) {
      if (g != w) return false;
    } else if (std::fabs(g - w) > tol) {
      return false;
    }
  }
  return true;
}

double max_finite(const std::vector<float>& x) {
  double m = 0;
  for (float e : x)
    if (std::isfinite(e)) m = std::fmax(m, std::fabs(static_cast<double>(e)));
  return m;
}

/// The portable forward and backward against the reference on extreme inputs: small-integer q, k,
/// v, dO (exact scores) with, per query row, a +inf bias at a visible key (NaN row) or behind the
/// causal mask (finite row), a NaN bias, a row of -inf bias (empty), an offset of 1024 or of 2^100
/// on the bias (large scores with a spread or one-hot softmax), a NaN in q; then the whole problem
/// with scale = float max (q, k / 16, no bias) and with scale 1e20 and the bias times 2^66, where
/// scale * score overflows fp32 (O still the reference's, LSE +-inf as its fp32 rounding).
/// Tolerances as in tests/unit/test_extreme_values.cpp.
void check_extreme(std::mt19937& rng) {
  std::uniform_int_distribution<int> small(-3, 3);
  const std::int64_t Lq = 40, Lk = 150, H = 2, d = 8;
  const auto nq = static_cast<std::size_t>(Lq * H * d), nk = static_cast<std::size_t>(Lk * d), nb = static_cast<std::size_t>(H * Lq * Lk);
  const double eps = 1.0 / (1 << 23), inf = INFINITY;
  for (int variant = 0; variant < 3; ++variant) {
    std::vector<double> q64(nq), k64(nk), v64(nk), dout64(nq), bias64(nb);
    for (auto* x : {&q64, &k64, &v64, &dout64, &bias64})
      for (auto& e : *x) e = small(rng);
    auto at = [&](std::int64_t h, std::int64_t i, std::int64_t j) { return static_cast<std::size_t>((h * Lq + i) * Lk + j); };
    double scale = 0.0;
    if (variant == 0) {
      bias64[at(0, 2, 5)] = inf;     // row 2 sees keys up to 112: NaN row
      bias64[at(0, 3, 140)] = inf;   // behind the causal mask: finite row
      bias64[at(1, 4, 20)] = NAN;
      for (std::int64_t j = 0; j < Lk; ++j) {
        bias64[at(0, 5, j)] = -inf;                            // empty row
        bias64[at(1, 7, j)] += 1024.0;                         // scores near 1e3, spread softmax
        if (j % 9 == 0) bias64[at(0, 9, j)] = 0x1p100;         // scores 2^100, ties
      }
      q64[static_cast<std::size_t>((11 * H + 1) * d + 2)] = NAN;
    } else if (variant == 1) {
      scale = FLT_MAX;
      for (auto* x : {&q64, &k64})
        for (auto& e : *x) e /= 16;
      for (auto& e : dout64) e *= 0x1p-40;  // keeps scale * dS far from overflowing
    } else {
      scale = 1e20;
      for (auto& e : bias64) e *= 0x1p66;
    }
    const bool with_bias = variant != 1;
    std::vector<float> q(q64.begin(), q64.end()), k(k64.begin(), k64.end()), v(v64.begin(), v64.end()),
        dout(dout64.begin(), dout64.end()), bias(bias64.begin(), bias64.end());
    std::vector<float> o(nq, NAN), lse(static_cast<std::size_t>(H * Lq), NAN), dq(nq, NAN), dk(nk, NAN), dv(nk, NAN);
    std::vector<double> o64(nq), lse64(static_cast<std::size_t>(H * Lq)), dq64(nq), dk64(nk), dv64(nk);
    dfss::attention_config cfg;
    cfg.cpu_isa = g_isa;
    cfg.causal = true;
    cfg.scale = scale;
    dfss::forward_args f;
    f.q = dfss::make_view(q.data(), {1, Lq, H, d});
    f.k = dfss::make_view(k.data(), {1, Lk, 1, d});
    f.v = dfss::make_view(v.data(), {1, Lk, 1, d});
    f.out = dfss::make_view(o.data(), {1, Lq, H, d});
    f.lse = dfss::make_view(lse.data(), {1, H, Lq});
    if (with_bias) f.bias = dfss::make_view(bias.data(), {1, H, Lq, Lk});
    dfss::attention_forward(f, cfg);
    dfss::backward_args g;
    g.q = f.q, g.k = f.k, g.v = f.v, g.bias = f.bias;
    g.dout = dfss::make_view(dout.data(), {1, Lq, H, d});
    g.dq = dfss::make_view(dq.data(), {1, Lq, H, d});
    g.dk = dfss::make_view(dk.data(), {1, Lk, 1, d});
    g.dv = dfss::make_view(dv.data(), {1, Lk, 1, d});
    dfss::attention_backward(g, cfg);
    cfg.backend = dfss::backend::reference;
    dfss::forward_args rf;
    rf.q = dfss::make_view(q64.data(), {1, Lq, H, d});
    rf.k = dfss::make_view(k64.data(), {1, Lk, 1, d});
    rf.v = dfss::make_view(v64.data(), {1, Lk, 1, d});
    rf.out = dfss::make_view(o64.data(), {1, Lq, H, d});
    rf.lse = dfss::make_view(lse64.data(), {1, H, Lq});
    if (with_bias) rf.bias = dfss::make_view(bias64.data(), {1, H, Lq, Lk});
    dfss::attention_forward(rf, cfg);
    dfss::backward_args rg;
    rg.q = rf.q, rg.k = rf.k, rg.v = rf.v, rg.bias = rf.bias;
    rg.dout = dfss::make_view(dout64.data(), {1, Lq, H, d});
    rg.dq = dfss::make_view(dq64.data(), {1, Lq, H, d});
    rg.dk = dfss::make_view(dk64.data(), {1, Lk, 1, d});
    rg.dv = dfss::make_view(dv64.data(), {1, Lk, 1, d});
    dfss::attention_backward(rg, cfg);
    const char* name = variant == 0 ? "non-finite and large bias" : (variant == 1 ? "scale float max" : "scale * score overflows");
    check(matches(o, o64, (16.0 + Lk) * eps * 3.0), "extreme inputs: O vs reference", Lq, Lk, d, name);
    bool lse_ok = true;
    for (std::size_t x = 0; x < lse.size(); ++x) {
      const auto want = static_cast<double>(static_cast<float>(lse64[x]));  // the fp32 LSE
      lse_ok = lse_ok && matches({lse[x]}, {want}, (16.0 + Lk) * eps * (1.0 + std::fabs(want)));
    }
    check(lse_ok, "extreme inputs: LSE vs reference", Lq, Lk, d, name);
    const double r = cfg.scale > 0 ? cfg.scale : 1.0 / std::sqrt(static_cast<double>(d));
    // terms: Lk bounds both Lk (dQ) and group * Lq = 80 (dK, dV).
    const double dS = r * d * max_finite(dout) * max_finite(v), terms = 64.0 + Lk + 2.0 * d;
    auto tol = [&](const std::vector<double>& w, double bound) {
      double m = 0;
      for (double e : w)
        if (std::isfinite(e)) m = std::fmax(m, std::fabs(e));
      return terms * eps * (1.0 + m + bound);
    };
    check(matches(dq, dq64, tol(dq64, dS * max_finite(k))), "extreme inputs: dQ vs reference", Lq, Lk, d, name);
    check(matches(dk, dk64, tol(dk64, dS * max_finite(q))), "extreme inputs: dK vs reference", Lq, Lk, d, name);
    check(matches(dv, dv64, tol(dv64, max_finite(dout))), "extreme inputs: dV vs reference", Lq, Lk, d, name);
  }
}

/// Every check on the target g_isa names.
void check_target() {
  std::mt19937 rng(7);
  std::uniform_int_distribution<int> small(-3, 3);
  struct shape {
    std::int64_t B, Lq, Lk, H, Hkv, d;
  };
  // {1, 3, 300, 8, 2, 16}: a decode step whose d fills whole NEON vectors (the direct path) with a
  // group of 12 rows (the key-major P V, row blocks of 4) and a partial key tile.
  for (const shape s : {shape{1, 5, 9, 2, 1, 3}, shape{1, 3, 300, 8, 2, 16}, shape{2, 33, 130, 2, 2, 16}, shape{1, 40, 257, 4, 2, 64}}) {
    for (dfss::pattern pat : {dfss::pattern{1, 1}, dfss::pattern{1, 2}, dfss::pattern{2, 4}, dfss::pattern{3, 8}}) {
      for (bool causal : {false, true}) {
        const auto nq = static_cast<std::size_t>(s.B * s.Lq * s.H * s.d), nk = static_cast<std::size_t>(s.B * s.Lk * s.Hkv * s.d);
        std::vector<float> q(nq), k(nk), v(nk), o(nq, NAN);
        std::vector<double> q64(nq), k64(nk), v64(nk), o64(nq);
        for (std::size_t i = 0; i < nq; ++i) q64[i] = q[i] = static_cast<float>(small(rng));
        for (std::size_t i = 0; i < nk; ++i) k64[i] = k[i] = static_cast<float>(small(rng));
        for (std::size_t i = 0; i < nk; ++i) v64[i] = v[i] = static_cast<float>(small(rng));
        dfss::forward_args a;
        a.q = dfss::make_view(q.data(), {s.B, s.Lq, s.H, s.d});
        a.k = dfss::make_view(k.data(), {s.B, s.Lk, s.Hkv, s.d});
        a.v = dfss::make_view(v.data(), {s.B, s.Lk, s.Hkv, s.d});
        a.out = dfss::make_view(o.data(), {s.B, s.Lq, s.H, s.d});
        dfss::attention_config cfg;
        cfg.cpu_isa = g_isa;
        cfg.pattern = pat;
        cfg.causal = causal;
        const auto sel = dfss::select_kernel(a, cfg);
        check(sel.name == forward_name(s.Lq), "the target's forward is selected", s.Lq, s.Lk, s.d,
              pat.str().c_str());
        dfss::attention_forward(a, cfg);
        dfss::forward_args r;
        r.q = dfss::make_view(q64.data(), {s.B, s.Lq, s.H, s.d});
        r.k = dfss::make_view(k64.data(), {s.B, s.Lk, s.Hkv, s.d});
        r.v = dfss::make_view(v64.data(), {s.B, s.Lk, s.Hkv, s.d});
        r.out = dfss::make_view(o64.data(), {s.B, s.Lq, s.H, s.d});
        cfg.backend = dfss::backend::reference;
        dfss::attention_forward(r, cfg);
        // Values are in [-3, 3]: (16 + Lk) fp32 epsilons times max|v| (see tests/unit/test_cpu.cpp).
        const double tol = (16.0 + static_cast<double>(s.Lk)) * 3.0 / (1 << 23);
        double err = 0;
        bool finite = true;
        for (std::size_t i = 0; i < nq; ++i) {
          finite = finite && std::isfinite(o[i]);
          err = std::fmax(err, std::fabs(static_cast<double>(o[i]) - o64[i]));
        }
        check(finite && err <= tol, causal ? "portable vs reference (causal)" : "portable vs reference", s.Lq, s.Lk, s.d,
              pat.str().c_str());
      }
    }
  }
  check_backward(rng);
  check_backward_selection(rng);
  check_extreme(rng);
}

}  // namespace

int main() {
  // portable names the baseline target (NEON), automatic the best one this CPU runs.
  dfss::forward_args a;
  std::vector<float> x(4, 1.0f), o(4);
  a.q = a.k = a.v = dfss::make_view(x.data(), {1, 1, 1, 4});
  a.out = dfss::make_view(o.data(), {1, 1, 1, 4});
  dfss::attention_config cfg;
  cfg.cpu_isa = dfss::cpu_isa::portable;
  // One query row: the decode forward of the target.
  check(dfss::select_kernel(a, cfg).name == "cpu.decode_forward.portable", "portable is selectable", 1, 1, 4, "-");
  std::string best;
  for (const dfss::cpu_isa_support& t : dfss::cpu_simd_isas()) {
    std::printf("target %s: %s\n", dfss::cpu_isa_name(t.isa), t.supported ? "supported, checking" : "not supported here");
    if (!t.supported) continue;
    if (t.automatic) best = std::string("cpu.decode_forward.") + dfss::cpu_isa_name(t.isa);
    g_isa = t.isa;
    const int before = failed;
    const auto start = std::chrono::steady_clock::now();
    check_target();
    std::printf("target %s: %d failed (%.0f s)\n", dfss::cpu_isa_name(t.isa), failed - before,
                std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    std::fflush(stdout);
  }
  cfg.cpu_isa = dfss::cpu_isa::automatic;
  check(!best.empty() && dfss::select_kernel(a, cfg).name == best, "automatic selects the best target", 1, 1, 4, "-");
  std::printf("%d passed, %d failed\n", passed, failed);
  return failed == 0 ? 0 : 1;
}
