// Cross-architecture check of the portable-SIMD CPU kernel: built for AArch64 by
// tools/scripts/check-aarch64.sh and run under qemu-user, it compares the automatic CPU kernel
// (which must be the portable one on ARM) with the fp64 reference backend on small-integer inputs,
// whose scores are exact, so selections must match and only the softmax carries rounding
// (tolerance as in tests/unit/test_cpu.cpp). Prints "N passed, M failed" and exits non-zero on any
// failure.
#include <dfss/dfss.hpp>

#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

namespace {

int passed = 0, failed = 0;

void check(bool ok, const char* what, long long a, long long b, long long c, const char* pat) {
  if (ok) {
    ++passed;
  } else {
    ++failed;
    std::printf("FAIL %s (Lq=%lld Lk=%lld d=%lld pattern %s)\n", what, a, b, c, pat);
  }
}

}  // namespace

int main() {
  std::mt19937 rng(7);
  std::uniform_int_distribution<int> small(-3, 3);
  struct shape {
    std::int64_t B, Lq, Lk, H, Hkv, d;
  };
  for (const shape s : {shape{1, 5, 9, 2, 1, 3}, shape{2, 33, 130, 2, 2, 16}, shape{1, 40, 257, 4, 2, 64}}) {
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
        cfg.pattern = pat;
        cfg.causal = causal;
        const auto sel = dfss::select_kernel(a, cfg);
        check(sel.name == "cpu.fused_forward.portable", "automatic selects the portable kernel", s.Lq, s.Lk, s.d,
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
  std::printf("%d passed, %d failed\n", passed, failed);
  return failed == 0 ? 0 : 1;
}
