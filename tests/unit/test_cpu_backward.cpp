// The CPU backward pass (AVX2 fused) against the fp64 reference backward, for determinism, and for
// using exactly the selection of the forward that produced O and LSE.
//
// Tolerance policy: on small-integer inputs the scores, hence the selections, are exact; the
// gradients then differ from fp64 only by fp32 rounding in exp, the D = rowsum(dO O) dot product
// and sums over up to Lk (dQ) or group * Lq (dK, dV) terms, each term bounded by the largest
// gradient magnitude: we allow (64 + Lk + group * Lq) * eps_f32 * (1 + max |reference grad|), and
// half an ulp of a 16-bit output type on top.
#include <gtest/gtest.h>

#include "common/run.hpp"
#include "common/testing.hpp"

namespace dfss::testing {
namespace {

constexpr double kEps32 = 1.0 / (1 << 23);

bool cpu_has_backward() { return cpu_runs_avx2_kernels(); }

double max_abs(const std::vector<double>& x) {
  double m = 0;
  for (double v : x) m = std::max(m, std::abs(v));
  return m;
}

void expect_grad_close(const std::vector<double>& got, const std::vector<double>& want, double terms, dtype out,
                       const std::string& what) {
  const double ulp_out = out == dtype::f16 ? 1.0 / 1024 : (out == dtype::bf16 ? 1.0 / 128 : 0.0);
  const double scale = 1.0 + max_abs(want);
  const double tol = ((64.0 + terms) * kEps32 + ulp_out) * scale;
  ASSERT_EQ(got.size(), want.size()) << what;
  double err = 0;
  for (std::size_t x = 0; x < got.size(); ++x) {
    ASSERT_TRUE(std::isfinite(got[x])) << what << " at " << x;
    err = std::max(err, std::abs(got[x] - want[x]));
  }
  EXPECT_LE(err, tol) << what;
}

TEST(CpuBackward, SelectorPicksItAndFallsBack) {
  if (!cpu_has_backward()) GTEST_SKIP() << "this CPU has no AVX2/FMA/F16C";
  std::vector<float> q(2 * 3 * 2 * 4, 0.5f), g(q.size()), gk(q.size()), gv(q.size());
  backward_args a;
  a.q = a.k = a.v = a.dout = make_view(q.data(), {2, 3, 2, 4});
  a.dq = make_view(g.data(), {2, 3, 2, 4});
  a.dk = make_view(gk.data(), {2, 3, 2, 4});
  a.dv = make_view(gv.data(), {2, 3, 2, 4});
  EXPECT_EQ(select_kernel(a).name, "cpu.fused_backward.avx2");
  attention_config cfg;
  cfg.cpu_isa = cpu_isa::portable;
  EXPECT_EQ(select_kernel(a, cfg).name, "reference.backward");
  cfg.backend = backend::cpu;
  const auto s = select_kernel(a, cfg);
  EXPECT_FALSE(s.supported());
  EXPECT_NE(s.reason.find("avx2"), std::string::npos);
}

std::vector<problem> backward_shapes(std::mt19937_64& rng) {
  std::vector<problem> out;
  struct shape {
    std::int64_t B, Lq, Lk, H, Hkv, d;
  };
  const shape shapes[] = {{1, 1, 1, 1, 1, 1}, {2, 7, 70, 4, 2, 5}, {1, 33, 129, 3, 1, 16}, {2, 40, 9, 2, 2, 64}};
  const pattern patterns[] = {{1, 2}, {2, 4}, {3, 8}, {1, 1}, {2, 3}};
  int variant = 0;
  for (const auto& s : shapes)
    for (const auto& pat : patterns) {
      problem p;
      p.B = s.B, p.Lq = s.Lq, p.Lk = s.Lk, p.H = s.H, p.Hkv = s.Hkv, p.d = s.d, p.pat = pat;
      p.causal = variant % 2 == 1;
      p.has_bias = variant % 3 == 1;
      p.bias_b = p.bias_h = true;  // dbias without broadcast dimensions (the cpu kernel's case)
      if (variant % 4 == 3) {
        for (std::int64_t b = 0; b < p.B; ++b) p.key_lengths.push_back(b == 1 ? 0 : p.Lk - p.Lk / 3);
      }
      fill(p, rng, /*integers=*/true);
      out.push_back(p);
      ++variant;
    }
  return out;
}

TEST(CpuBackward, MatchesReferenceOnExactScores) {
  if (!cpu_has_backward()) GTEST_SKIP() << "this CPU has no AVX2/FMA/F16C";
  std::mt19937_64 rng(test_seed() + 31);
  for (const auto& pr : backward_shapes(rng)) {
    const auto want = run_backward(pr);
    const double group = static_cast<double>(pr.H / pr.Hkv);
    for (dtype t : {dtype::f32, dtype::f16, dtype::bf16}) {
      run_options opt;
      opt.type = t;
      opt.out_type = dtype::f32;  // gradients in f32 (16-bit outputs only add their own rounding)
      opt.backend = backend::cpu;
      opt.bhld = t == dtype::bf16;
      const auto got = run_backward(pr, opt);
      const std::string what = pr.describe() + " " + dtype_name(t);
      expect_grad_close(got.dq, want.dq, static_cast<double>(pr.Lk), dtype::f32, what + " dq");
      expect_grad_close(got.dk, want.dk, group * static_cast<double>(pr.Lq), dtype::f32, what + " dk");
      expect_grad_close(got.dv, want.dv, group * static_cast<double>(pr.Lq), dtype::f32, what + " dv");
      if (pr.has_bias) expect_grad_close(got.dbias, want.dbias, 1.0, dtype::f32, what + " dbias");
      if (::testing::Test::HasFatalFailure()) return;
    }
  }
}

TEST(CpuBackward, BitwiseIdenticalForAnyThreadCount) {
  if (!cpu_has_backward()) GTEST_SKIP() << "this CPU has no AVX2/FMA/F16C";
  std::mt19937_64 rng(test_seed() + 32);
  problem pr;
  pr.B = 2, pr.Lq = 45, pr.Lk = 77, pr.H = 4, pr.Hkv = 2, pr.d = 16, pr.causal = true;
  fill(pr, rng);
  run_options opt;
  opt.type = dtype::f32;
  opt.backend = backend::cpu;
  opt.threads = 1;
  const auto one = run_backward(pr, opt);
  for (int t : {2, 3}) {
    opt.threads = t;
    const auto many = run_backward(pr, opt);
    EXPECT_EQ(one.dq, many.dq) << t;
    EXPECT_EQ(one.dk, many.dk) << t;
    EXPECT_EQ(one.dv, many.dv) << t;
  }
}

TEST(CpuBackward, UsesExactlyTheForwardSelection) {
  // Near-ties everywhere: all keys equal up to noise of a few fp32 ulps, so which key of a group
  // the fp32 forward keeps is decided by rounding (and often differs from fp64). With K having one
  // extra coordinate that is the identity (k_j[1 + j] = 1) and V = I, the forward's output row is P
  // itself; dV_j = P_j dO is then non-zero exactly for the keys the forward kept. A backward that
  // recomputed the selection differently (another summation order, fp64) trips this test.
  if (!cpu_has_backward()) GTEST_SKIP() << "this CPU has no AVX2/FMA/F16C";
  std::mt19937_64 rng(test_seed() + 33);
  std::uniform_real_distribution<float> u(0.5f, 1.5f), tiny(-4e-7f, 4e-7f);
  const std::int64_t Lk = 48, d = Lk, Lq = 8;
  for (pattern pat : {pattern{1, 2}, pattern{2, 4}, pattern{3, 8}}) {
    std::vector<float> q(static_cast<std::size_t>(Lq * d)), k(static_cast<std::size_t>(Lk * d), 0.0f),
        v(static_cast<std::size_t>(Lk * d), 0.0f), o(q.size()), lse(static_cast<std::size_t>(Lq)),
        dout(q.size(), 1.0f), dq(q.size()), dk(k.size()), dv(v.size());
    for (auto& x : q) x = u(rng);
    for (std::int64_t j = 0; j < Lk; ++j) {
      for (std::int64_t c = 0; c < d; ++c) k[static_cast<std::size_t>(j * d + c)] = 1.0f + tiny(rng);
      v[static_cast<std::size_t>(j * d + j)] = 1.0f;
    }
    forward_args f;
    f.q = make_view(q.data(), {1, Lq, 1, d});
    f.k = make_view(k.data(), {1, Lk, 1, d});
    f.v = make_view(v.data(), {1, Lk, 1, d});
    f.out = make_view(o.data(), {1, Lq, 1, d});
    f.lse = make_view(lse.data(), {1, 1, Lq});
    attention_config cfg;
    cfg.pattern = pat;
    cfg.backend = backend::cpu;
    cfg.cpu_isa = cpu_isa::avx2;
    attention_forward(f, cfg);
    backward_args b;
    b.q = f.q, b.k = f.k, b.v = f.v, b.out = f.out, b.lse = f.lse;
    b.dout = make_view(dout.data(), {1, Lq, 1, d});
    b.dq = make_view(dq.data(), {1, Lq, 1, d});
    b.dk = make_view(dk.data(), {1, Lk, 1, d});
    b.dv = make_view(dv.data(), {1, Lk, 1, d});
    attention_backward(b, cfg);
    // Key j is kept by some row iff O[i, j] > 0 for that row; dV_j = sum_i P_ij dO_i (dO = 1).
    for (std::int64_t j = 0; j < Lk; ++j) {
      bool kept_somewhere = false;
      for (std::int64_t i = 0; i < Lq; ++i) kept_somewhere |= o[static_cast<std::size_t>(i * d + j)] > 0.0f;
      EXPECT_EQ(dv[static_cast<std::size_t>(j * d)] != 0.0f, kept_somewhere) << pat.str() << " key " << j;
    }
  }
}

TEST(CpuBackward, RecomputesForwardWhenOutAndLseAreAbsent) {
  if (!cpu_has_backward()) GTEST_SKIP() << "this CPU has no AVX2/FMA/F16C";
  std::mt19937_64 rng(test_seed() + 34);
  const std::int64_t B = 1, L = 37, H = 2, d = 8;
  std::vector<float> q(static_cast<std::size_t>(B * L * H * d)), k(q.size()), v(q.size()), dout(q.size()), o(q.size()),
      lse(static_cast<std::size_t>(B * H * L));
  std::uniform_real_distribution<float> u(-1, 1);
  for (auto* t : {&q, &k, &v, &dout})
    for (auto& x : *t) x = u(rng);
  forward_args f;
  f.q = make_view(q.data(), {B, L, H, d});
  f.k = make_view(k.data(), {B, L, H, d});
  f.v = make_view(v.data(), {B, L, H, d});
  f.out = make_view(o.data(), {B, L, H, d});
  f.lse = make_view(lse.data(), {B, H, L});
  attention_forward(f);
  std::vector<float> g1(q.size() * 3), g2(q.size() * 3);
  auto grads = [&](std::vector<float>& g, bool with_forward) {
    backward_args b;
    b.q = f.q, b.k = f.k, b.v = f.v;
    b.dout = make_view(dout.data(), {B, L, H, d});
    if (with_forward) b.out = f.out, b.lse = f.lse;
    b.dq = make_view(g.data(), {B, L, H, d});
    b.dk = make_view(g.data() + q.size(), {B, L, H, d});
    b.dv = make_view(g.data() + 2 * q.size(), {B, L, H, d});
    attention_backward(b);
  };
  grads(g1, true);
  grads(g2, false);
  EXPECT_EQ(g1, g2);
}

}  // namespace
}  // namespace dfss::testing
