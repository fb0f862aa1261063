// The CPU backward pass (SIMD fused, the best target this CPU runs) against the fp64 reference backward, for determinism, and for
// using exactly the selection of the forward that produced O and LSE.
//
// Tolerance policy: on small-integer inputs the scores, hence the selections, are exact; the
// gradients then differ from fp64 only by fp32 rounding in exp, the D = rowsum(dO O) dot product
// and sums over up to Lk (dQ) or group * Lq (dK, dV) terms, each term bounded by the largest
// gradient magnitude: we allow (64 + Lk + group * Lq) * eps_f32 * (1 + max |reference grad|), and
// half an ulp of a 16-bit output type on top.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cstdint>

#include "common/gradients.hpp"
#include "common/run.hpp"
#include "common/testing.hpp"

namespace dfss::testing {
namespace {

/// Whether automatic runs a SIMD backward here (the tests below use the automatic ISA: the best SIMD
/// target this CPU runs; test_cpu_backward_twins.cpp runs the same contract on every target).
bool cpu_has_backward() { return runnable_cpu_isas().size() > 2; }
cpu_isa best_isa() { return automatic_cpu_isa(); }

TEST(CpuBackward, SelectorPicksTheKernelOfEachIsa) {
  if (!cpu_has_backward()) GTEST_SKIP() << "this CPU runs none of the compiled SIMD targets";
  std::vector<float> q(2 * 3 * 2 * 4, 0.5f), g(q.size()), gk(q.size()), gv(q.size());
  backward_args a;
  a.q = a.k = a.v = a.dout = make_view(q.data(), {2, 3, 2, 4});
  a.dq = make_view(g.data(), {2, 3, 2, 4});
  a.dk = make_view(gk.data(), {2, 3, 2, 4});
  a.dv = make_view(gv.data(), {2, 3, 2, 4});
  EXPECT_EQ(select_kernel(a).name, fused_kernel_name(best_isa(), false));
  attention_config cfg;
  cfg.cpu_isa = cpu_isa::portable;
  EXPECT_EQ(select_kernel(a, cfg).name, "cpu.fused_backward.portable");
  cfg.cpu_isa = cpu_isa::generic;
  EXPECT_EQ(select_kernel(a, cfg).name, "cpu.fused_backward.scalar");
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
      // dBias with a real batch and head dimension, and broadcast over either or both (summed).
      p.bias_b = variant % 5 != 1;
      p.bias_h = variant % 5 != 2 && variant % 5 != 1;
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
  if (!cpu_has_backward()) GTEST_SKIP() << "this CPU runs none of the compiled SIMD targets";
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
      if (pr.has_bias) {
        // A broadcast dBias entry sums over the B and/or H contributions it stands for.
        const double summed = (pr.bias_b ? 1.0 : static_cast<double>(pr.B)) * (pr.bias_h ? 1.0 : static_cast<double>(pr.H));
        expect_grad_close(got.dbias, want.dbias, summed, dtype::f32, what + " dbias");
      }
      if (::testing::Test::HasFatalFailure()) return;
    }
  }
}

/// Rounds every input of @p pr to values of type T, so that the fp64 reference (differentiated by
/// finite differences) and the cpu kernel (reading T) compute the same function.
template <typename T>
void round_inputs_to(problem& pr) {
  for (auto* x : {&pr.q, &pr.k, &pr.v, &pr.dout, &pr.bias})
    for (auto& e : *x)
      if (std::isfinite(e)) e = to_double(from_double<T>(e));
}

void round_inputs(problem& pr, dtype t) {
  if (t == dtype::f32) round_inputs_to<float>(pr);
  if (t == dtype::f16) round_inputs_to<half>(pr);
  if (t == dtype::bf16) round_inputs_to<bfloat16>(pr);
}

TEST(CpuBackward, MatchesFiniteDifferencesOfTheReferenceForward) {
  // The fast kernel's gradients against central differences of the fp64 reference forward of
  // L = sum(O * dO), on real-valued inputs (rounded to the storage type) whose selection is at least
  // 1e-2 from flipping: a step of h = 1e-5 moves a score by under 1e-4, so the selection is fixed.
  // Rows with no visible key (key length 0, causal rows above the diagonal when Lq > Lk) must get
  // exactly zero dQ, never NaN.
  if (!cpu_has_backward()) GTEST_SKIP() << "this CPU runs none of the compiled SIMD targets";
  std::mt19937_64 rng(test_seed() + 35);
  const double h = 1e-5;
  struct shape {
    std::int64_t B, Lq, Lk, H, Hkv, d;
    bool bias, bias_h;
  };
  const shape shapes[] = {{2, 5, 11, 2, 1, 4, true, false}, {1, 7, 4, 2, 2, 3, true, true}, {2, 3, 13, 3, 3, 5, false, false}};
  int variant = 0;
  for (pattern pat : {pattern{1, 2}, pattern{2, 4}, pattern{3, 8}, pattern{1, 1}, pattern{2, 3}}) {
    for (dtype t : {dtype::f32, dtype::f16, dtype::bf16}) {
      const shape& sh = shapes[variant % 3];
      problem pr;
      pr.B = sh.B, pr.Lq = sh.Lq, pr.Lk = sh.Lk, pr.H = sh.H, pr.Hkv = sh.Hkv, pr.d = sh.d, pr.pat = pat;
      pr.causal = true;
      pr.has_bias = sh.bias, pr.bias_b = true, pr.bias_h = sh.bias_h;
      if (pr.B == 2) pr.key_lengths = {0, pr.Lk - 2};
      ++variant;
      std::vector<double> gaps;
      do {
        fill(pr, rng);
        round_inputs(pr, t);
        gaps = selection_gaps(pr);
      } while (*std::min_element(gaps.begin(), gaps.end()) < 1e-2);
      run_options opt;
      opt.type = t;
      opt.out_type = dtype::f32;
      opt.backend = backend::cpu;
      const auto g = run_backward(pr, opt);
      auto loss = [](const problem& p) {
        run_options one;
        one.threads = 1;  // thousands of tiny calls: no thread start-up per call
        const auto o = run_forward(p, one).o;
        double l = 0;
        for (std::size_t x = 0; x < o.size(); ++x) l += o[x] * p.dout[x];
        return l;
      };
      // Query rows that see no key at all (in [B, Lq, H, d] order): their dQ is exactly zero.
      auto empty_row = [&](std::size_t x) {
        const auto at = static_cast<std::int64_t>(x) / (pr.H * pr.d);
        const std::int64_t i = at % pr.Lq, b = at / pr.Lq;
        const std::int64_t len = pr.key_lengths.empty() ? pr.Lk : pr.key_lengths[static_cast<std::size_t>(b)];
        return std::min(len, i + pr.Lk - pr.Lq + 1) <= 0;
      };
      auto check = [&](std::vector<double> problem::*field, const std::vector<double>& grad, const char* name) {
        ASSERT_EQ(grad.size(), (pr.*field).size()) << name;
        for (std::size_t x = 0; x < grad.size(); ++x) {
          if (!std::isfinite((pr.*field)[x])) continue;  // -inf bias entries have no derivative
          problem plus = pr, minus = pr;
          (plus.*field)[x] += h;
          (minus.*field)[x] -= h;
          const double fd = (loss(plus) - loss(minus)) / (2 * h);
          const std::string what = std::string(name) + "[" + std::to_string(x) + "] " + pr.describe() + " " + dtype_name(t);
          // fp32 kernel error ~ 64 terms * 6e-8; difference error ~ h^2 + 1e-16 / h: 1e-4 covers
          // both with room, while a wrong gradient is off by its own size (0.01 to 1 here).
          ASSERT_NEAR(grad[x], fd, 1e-4) << what;
          if (field == &problem::q && empty_row(x)) {
            ASSERT_EQ(grad[x], 0.0) << what << " (row sees no key)";
          }
        }
      };
      check(&problem::q, g.dq, "dq");
      check(&problem::k, g.dk, "dk");
      check(&problem::v, g.dv, "dv");
      if (pr.has_bias) check(&problem::bias, g.dbias, "dbias");
      if (::testing::Test::HasFatalFailure()) return;
    }
  }
}

TEST(CpuBackward, BroadcastDbiasInEveryStorageType) {
  // dBias broadcast over the batch, the heads or both is the sum of the per-(b, h) gradients; 16-bit
  // storage is summed in fp32 and rounded once. Also bitwise identical for any thread count.
  if (!cpu_has_backward()) GTEST_SKIP() << "this CPU runs none of the compiled SIMD targets";
  std::mt19937_64 rng(test_seed() + 36);
  for (int form = 0; form < 3; ++form) {
    problem pr;
    pr.B = 3, pr.Lq = 9, pr.Lk = 21, pr.H = 4, pr.Hkv = 2, pr.d = 8, pr.pat = {2, 4};
    pr.has_bias = true, pr.bias_b = form == 1, pr.bias_h = form == 0;
    fill(pr, rng, /*integers=*/true);
    for (auto& e : pr.bias)
      if (std::isfinite(e)) e *= 0.25;  // exact in every storage type, scores stay exact in fp32
    const auto want = run_backward(pr);
    const std::int64_t Bb = pr.bias_b ? pr.B : 1, Hb = pr.bias_h ? pr.H : 1;
    const double summed = static_cast<double>((pr.B / Bb) * (pr.H / Hb));
    auto check_type = [&]<typename T>() {
      std::vector<T> bias(pr.bias.size()), dbias(pr.bias.size());
      for (std::size_t x = 0; x < bias.size(); ++x) bias[x] = from_double<T>(pr.bias[x]);
      std::vector<float> q(pr.q.begin(), pr.q.end()), k(pr.k.begin(), pr.k.end()), v(pr.v.begin(), pr.v.end()),
          dout(pr.dout.begin(), pr.dout.end()), dq(q.size()), dk(k.size()), dv(v.size());
      std::vector<double> got, first;
      for (int threads : {1, 2, 3}) {
        backward_args a;
        a.q = make_view(q.data(), {pr.B, pr.Lq, pr.H, pr.d});
        a.k = make_view(k.data(), {pr.B, pr.Lk, pr.Hkv, pr.d});
        a.v = make_view(v.data(), {pr.B, pr.Lk, pr.Hkv, pr.d});
        a.dout = make_view(dout.data(), {pr.B, pr.Lq, pr.H, pr.d});
        a.dq = make_view(dq.data(), {pr.B, pr.Lq, pr.H, pr.d});
        a.dk = make_view(dk.data(), {pr.B, pr.Lk, pr.Hkv, pr.d});
        a.dv = make_view(dv.data(), {pr.B, pr.Lk, pr.Hkv, pr.d});
        a.bias = make_view(bias.data(), {Bb, Hb, pr.Lq, pr.Lk});
        a.dbias = make_view(dbias.data(), {Bb, Hb, pr.Lq, pr.Lk});
        attention_config cfg;
        cfg.pattern = pr.pat;
        cfg.backend = backend::cpu;
        cfg.num_threads = threads;
        std::fill(dbias.begin(), dbias.end(), from_double<T>(kNaN));
        attention_backward(a, cfg);
        got.assign(dbias.size(), 0.0);
        for (std::size_t x = 0; x < got.size(); ++x) got[x] = to_double(dbias[x]);
        if (threads == 1) first = got;
        for (std::size_t x = 0; x < got.size(); ++x) {
          ASSERT_TRUE(std::bit_cast<std::uint64_t>(got[x]) == std::bit_cast<std::uint64_t>(first[x]))
              << "threads " << threads << " at " << x;
        }
      }
      const dtype out = dtype_of<T>() == dtype::bf16 ? dtype::bf16 : dtype::f32;
      expect_grad_close(got, want.dbias, summed, out, pr.describe() + " dbias " + dtype_name(dtype_of<T>()));
    };
    check_type.template operator()<float>();
    check_type.template operator()<bfloat16>();
    check_type.template operator()<double>();
    if (::testing::Test::HasFatalFailure()) return;
  }
}

TEST(CpuBackward, BitwiseIdenticalForAnyThreadCount) {
  if (!cpu_has_backward()) GTEST_SKIP() << "this CPU runs none of the compiled SIMD targets";
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
  if (!cpu_has_backward()) GTEST_SKIP() << "this CPU runs none of the compiled SIMD targets";
  std::mt19937_64 rng(test_seed() + 33);
  std::uniform_real_distribution<float> u(0.5f, 1.5f), tiny(-4e-7f, 4e-7f);
  const std::int64_t Lk = 48, d = Lk, Lq = 8;
  for (cpu_isa isa : runnable_cpu_isas())
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
    cfg.cpu_isa = isa;
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
      EXPECT_EQ(dv[static_cast<std::size_t>(j * d)] != 0.0f, kept_somewhere) << pat.str() << " key " << j << " " << cpu_isa_name(isa);
    }
  }
}

TEST(CpuBackward, RecomputesForwardWhenOutAndLseAreAbsent) {
  if (!cpu_has_backward()) GTEST_SKIP() << "this CPU runs none of the compiled SIMD targets";
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
