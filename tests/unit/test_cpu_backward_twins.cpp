// The CPU backward twins (generic scalar and portable SIMD) against the fp64 reference backward, for
// using exactly the selection of their own forward kernel, for determinism, empty and NaN rows, and
// for the selector's choice of backward per cpu_isa. Both twins run on every x86-64 and ARM CPU, so
// nothing here is skipped.
//
// Tolerance policy (as for the AVX2 backward in test_cpu_backward.cpp): on small-integer inputs the
// scores, hence the selections, are exact in fp32; the gradients then differ from fp64 only by fp32
// rounding in exp, the D = rowsum(dO O) dot product and sums over up to Lk (dQ) or group * Lq (dK,
// dV) terms, each bounded by the largest gradient magnitude: we allow
// (64 + terms) * eps_f32 * (1 + max |reference grad|). Small integers are exact in f16 and bf16, so
// 16-bit inputs are the same numbers and take the same bound; 16-bit outputs add one ulp of their
// type relative to the largest magnitude (round to nearest gives half an ulp of the element itself,
// which is at most that). A dbias with broadcast dimensions sums k = (B or 1) * (H or 1) values of
// scale dS, each within the unbroadcast bound 65 eps (1 + max |term|), and the fp32 sum adds at most
// k eps k max |term|: we allow (65 k + k^2) eps (1 + max |term|), max |term| taken from the
// reference's unbroadcast dbias.
#include <gtest/gtest.h>

#include "common/gradients.hpp"
#include "common/run.hpp"
#include "common/testing.hpp"

namespace dfss::testing {
namespace {

struct twin {
  cpu_isa isa;
  std::string forward_name;
  std::string backward_name;
};

void PrintTo(const twin& t, std::ostream* os) { *os << t.backward_name; }

/// The generic twin, portable, and every SIMD target this build compiled (tests/common's list).
std::vector<twin> twins() {
  std::vector<twin> out;
  for (cpu_isa isa : fused_cpu_isas()) out.push_back({isa, fused_kernel_name(isa, true), fused_kernel_name(isa, false)});
  return out;
}

class CpuBackwardTwin : public ::testing::TestWithParam<twin> {
 protected:
  void SetUp() override {
    const std::string why = cpu_isa_skip_reason(GetParam().isa);
    if (!why.empty()) GTEST_SKIP() << why;
  }
};

std::string twin_name(const ::testing::TestParamInfo<twin>& info) {
  return info.param.isa == cpu_isa::generic ? std::string("Scalar") : cpu_isa_label(info.param.isa);
}

/// The awkward-shape sweep: Lq != Lk, lengths not multiples of M or of the tiles (32 rows, 64+
/// keys), grouped heads, d not a multiple of 8, causal, key lengths with a whole batch at 0 (empty
/// rows), bias with -inf entries, its dbias with and without broadcast dimensions; patterns 1:2,
/// 2:4, 3:8, 5:16, 2:3 and dense (1:1 and 4:4).
std::vector<problem> twin_shapes(std::mt19937_64& rng) {
  std::vector<problem> out;
  struct shape {
    std::int64_t B, Lq, Lk, H, Hkv, d;
  };
  const shape shapes[] = {{1, 1, 1, 1, 1, 1}, {2, 7, 70, 4, 2, 5}, {1, 33, 129, 3, 1, 16}, {2, 40, 9, 2, 2, 64},
                          {1, 70, 45, 6, 2, 12}};
  const pattern patterns[] = {{1, 2}, {2, 4}, {3, 8}, {5, 16}, {2, 3}, {1, 1}, {4, 4}};
  int variant = 0;
  for (const auto& s : shapes)
    for (const auto& pat : patterns) {
      problem p;
      p.B = s.B, p.Lq = s.Lq, p.Lk = s.Lk, p.H = s.H, p.Hkv = s.Hkv, p.d = s.d, p.pat = pat;
      p.causal = variant % 2 == 1;
      p.has_bias = variant % 3 == 1;
      p.bias_b = (variant / 3) % 2 == 0;  // [B or 1, H or 1, Lq, Lk]: all four combinations
      p.bias_h = (variant / 6) % 2 == 0;
      if (variant % 4 == 3) {
        for (std::int64_t b = 0; b < p.B; ++b) p.key_lengths.push_back(b == 1 ? 0 : p.Lk - p.Lk / 3);
      }
      fill(p, rng, /*integers=*/true);
      out.push_back(p);
      ++variant;
    }
  return out;
}

/// The problem with its bias repeated over the batch and heads it broadcasts to.
problem unbroadcast_bias(const problem& pr) {
  problem full = pr;
  full.bias_b = full.bias_h = true;
  full.bias.assign(static_cast<std::size_t>(full.bias_numel()), 0.0);
  const std::int64_t Hb = pr.bias_h ? pr.H : 1, plane = pr.Lq * pr.Lk;
  for (std::int64_t b = 0; b < pr.B; ++b)
    for (std::int64_t h = 0; h < pr.H; ++h)
      for (std::int64_t x = 0; x < plane; ++x) {
        const std::int64_t from = ((pr.bias_b ? b : 0) * Hb + (pr.bias_h ? h : 0)) * plane + x;
        full.bias[static_cast<std::size_t>((b * pr.H + h) * plane + x)] = pr.bias[static_cast<std::size_t>(from)];
      }
  return full;
}

void expect_dbias_close(const problem& pr, const std::vector<double>& got, const std::vector<double>& want,
                        const std::string& what) {
  if (pr.bias_b && pr.bias_h) return expect_grad_close(got, want, 1.0, dtype::f32, what);
  const double k = static_cast<double>((pr.bias_b ? 1 : pr.B) * (pr.bias_h ? 1 : pr.H));
  const double max_term = max_abs(run_backward(unbroadcast_bias(pr)).dbias);
  const double tol = (65.0 * k + k * k) * kEps32 * (1.0 + max_term);
  ASSERT_EQ(got.size(), want.size()) << what;
  double err = 0;
  for (std::size_t x = 0; x < got.size(); ++x) {
    ASSERT_TRUE(std::isfinite(got[x])) << what << " at " << x;
    err = std::max(err, std::abs(got[x] - want[x]));
  }
  EXPECT_LE(err, tol) << what;
}

TEST_P(CpuBackwardTwin, MatchesReferenceOnExactScores) {
  const twin tw = GetParam();
  std::mt19937_64 rng(test_seed() + 41);
  for (const auto& pr : twin_shapes(rng)) {
    const auto want = run_backward(pr);
    const double group = static_cast<double>(pr.H / pr.Hkv);
    for (dtype t : {dtype::f32, dtype::f16, dtype::bf16}) {
      for (bool out16 : {false, true}) {
        if (out16 && t == dtype::f32) continue;
        run_options opt;
        opt.type = t;
        opt.out_type = out16 ? t : dtype::f32;
        opt.backend = backend::cpu;
        opt.isa = tw.isa;
        opt.bhld = t == dtype::bf16;  // strided [B, H, L, d] views too
        const auto got = run_backward(pr, opt);
        const dtype out = out16 ? t : dtype::f32;
        const std::string what = pr.describe() + " " + dtype_name(t) + " out " + dtype_name(out);
        expect_grad_close(got.dq, want.dq, static_cast<double>(pr.Lk), out, what + " dq");
        expect_grad_close(got.dk, want.dk, group * static_cast<double>(pr.Lq), out, what + " dk");
        expect_grad_close(got.dv, want.dv, group * static_cast<double>(pr.Lq), out, what + " dv");
        // dbias is written in the bias's type (f64 here), from fp32 values.
        if (pr.has_bias) expect_dbias_close(pr, got.dbias, want.dbias, what + " dbias");
        if (::testing::Test::HasFatalFailure()) return;
      }
    }
  }
}

// Dense patterns on causal shapes with several key tiles: tiles every row of a 32-row query tile
// keeps whole (the blocked dK and dV products), tiles on the diagonal where some rows keep them whole
// and others do not (those rows' P and dS go back to the key-major block), and partial tiles. Real
// inputs, so no P underflows to 0 and the whole-tile rows exist.
TEST_P(CpuBackwardTwin, DenseCausalTilesMatchReference) {
  const twin tw = GetParam();
  std::mt19937_64 rng(test_seed() + 47);
  struct shape {
    std::int64_t Lq, Lk;
  };
  for (const shape s : {shape{100, 100}, shape{40, 200}, shape{70, 300}}) {
    for (const pattern pat : {pattern{1, 1}, pattern{2, 2}, pattern{4, 4}}) {
      problem pr;
      pr.B = 1, pr.Lq = s.Lq, pr.Lk = s.Lk, pr.H = 2, pr.Hkv = 1, pr.d = 64, pr.pat = pat;
      pr.causal = true;
      fill(pr, rng);
      const auto want = run_backward(pr);
      run_options opt;
      opt.type = dtype::f32;
      opt.out_type = dtype::f32;
      opt.backend = backend::cpu;
      opt.isa = tw.isa;
      const auto got = run_backward(pr, opt);
      const std::string what = pr.describe();
      expect_grad_close(got.dq, want.dq, static_cast<double>(pr.Lk), dtype::f32, what + " dq");
      expect_grad_close(got.dk, want.dk, 2.0 * static_cast<double>(pr.Lq), dtype::f32, what + " dk");
      expect_grad_close(got.dv, want.dv, 2.0 * static_cast<double>(pr.Lq), dtype::f32, what + " dv");
      if (::testing::Test::HasFatalFailure()) return;
    }
  }
}

TEST_P(CpuBackwardTwin, EmptyRowsGiveExactZeroGradients) {
  // Batch 1 has no valid key; with causal and Lq > Lk the first Lq - Lk rows see no key either.
  const twin tw = GetParam();
  std::mt19937_64 rng(test_seed() + 42);
  problem pr;
  pr.B = 2, pr.Lq = 20, pr.Lk = 13, pr.H = 2, pr.Hkv = 1, pr.d = 8, pr.causal = true;
  pr.key_lengths = {13, 0};
  fill(pr, rng);
  run_options opt;
  opt.type = dtype::f32;
  opt.backend = backend::cpu;
  opt.isa = tw.isa;
  const auto got = run_backward(pr, opt);
  for (std::int64_t b = 0; b < pr.B; ++b)
    for (std::int64_t i = 0; i < pr.Lq; ++i)
      for (std::int64_t h = 0; h < pr.H; ++h) {
        const bool empty = b == 1 || i < pr.Lq - pr.Lk;
        for (std::int64_t c = 0; c < pr.d; ++c) {
          const double g = got.dq[static_cast<std::size_t>(((b * pr.Lq + i) * pr.H + h) * pr.d + c)];
          ASSERT_TRUE(std::isfinite(g)) << b << " " << i << " " << h;
          if (empty) {
            ASSERT_EQ(g, 0.0) << b << " " << i << " " << h;
          }
        }
      }
  for (std::size_t x = 0; x < got.dk.size(); ++x) {
    ASSERT_TRUE(std::isfinite(got.dk[x]) && std::isfinite(got.dv[x])) << x;
    if (x >= got.dk.size() / 2) {  // batch 1: no valid key
      ASSERT_EQ(got.dk[x], 0.0) << x;
      ASSERT_EQ(got.dv[x], 0.0) << x;
    }
  }
  EXPECT_GT(max_abs(got.dq), 0.0);  // the visible rows do have gradients
}

TEST_P(CpuBackwardTwin, NanScoreMakesItsRowAndItsKeptKeysNan) {
  // A NaN in one query row: that row's dQ is NaN, and its P and dS are NaN at the keys it keeps, so
  // dK and dV are NaN at exactly those keys, as in the reference backward (docs/semantics.md,
  // "Non-finite and extreme inputs"; a masked key it keeps by default has P = 0 and stays finite);
  // the other kv head and the other rows stay finite. Its dBias row is NaN at the kept keys, and so
  // is the broadcast row it sums into.
  const twin tw = GetParam();
  for (bool broadcast : {false, true}) {
    std::mt19937_64 rng(test_seed() + 43);
    problem pr;
    pr.B = 1, pr.Lq = 9, pr.Lk = 21, pr.H = 4, pr.Hkv = 2, pr.d = 8;
    pr.has_bias = true, pr.bias_b = true, pr.bias_h = !broadcast;
    fill(pr, rng);
    const std::int64_t bad_i = 5, bad_h = 1;  // kv head 0
    pr.q[static_cast<std::size_t>((bad_i * pr.H + bad_h) * pr.d + 3)] = kNaN;
    run_options opt;
    opt.type = dtype::f32;
    opt.backend = backend::cpu;
    opt.isa = tw.isa;
    const auto got = run_backward(pr, opt);
    for (std::int64_t i = 0; i < pr.Lq; ++i)
      for (std::int64_t h = 0; h < pr.H; ++h)
        for (std::int64_t c = 0; c < pr.d; ++c) {
          const double g = got.dq[static_cast<std::size_t>((i * pr.H + h) * pr.d + c)];
          EXPECT_EQ(std::isnan(g), i == bad_i && h == bad_h) << i << " " << h << " " << c;
        }
    // Which keys the NaN row keeps (the selection rule: NaN ranks above every number, ties go to
    // the lower index; -inf bias entries mask) is read off the reference backward.
    const auto want = run_backward(pr);
    std::int64_t nan_keys = 0;
    for (std::int64_t j = 0; j < pr.Lk; ++j)
      for (std::int64_t hk = 0; hk < pr.Hkv; ++hk) {
        const auto at = static_cast<std::size_t>((j * pr.Hkv + hk) * pr.d);
        EXPECT_FALSE(hk == 1 && std::isnan(want.dk[at])) << "reference, key " << j;
        nan_keys += std::isnan(want.dk[at]) ? 1 : 0;
        for (std::int64_t c = 0; c < pr.d; ++c) {
          EXPECT_EQ(std::isnan(got.dk[at + static_cast<std::size_t>(c)]), std::isnan(want.dk[at + static_cast<std::size_t>(c)])) << j << " " << hk;
          EXPECT_EQ(std::isnan(got.dv[at + static_cast<std::size_t>(c)]), std::isnan(want.dv[at + static_cast<std::size_t>(c)])) << j << " " << hk;
        }
      }
    // 2:4 on 21 keys: at most 12 kept, so some keys of kv head 0 stay finite.
    EXPECT_GT(nan_keys, 0);
    EXPECT_LE(nan_keys, 12);
    const std::int64_t Hb = pr.bias_h ? pr.H : 1;
    for (std::int64_t hb = 0; hb < Hb; ++hb)
      for (std::int64_t i = 0; i < pr.Lq; ++i) {
        const bool bad_row = i == bad_i && (broadcast || hb == bad_h);
        std::int64_t nans = 0;
        for (std::int64_t j = 0; j < pr.Lk; ++j) {
          nans += std::isnan(got.dbias[static_cast<std::size_t>((hb * pr.Lq + i) * pr.Lk + j)]) ? 1 : 0;
        }
        // A group keeps at least one key whose bias is not -inf or the row is not NaN there; at
        // most N of every M keys are kept.
        if (bad_row) {
          EXPECT_GT(nans, 0) << broadcast << " " << hb << " " << i;
          EXPECT_LE(nans, (pr.Lk + pr.pat.m - 1) / pr.pat.m * pr.pat.n) << broadcast << " " << hb << " " << i;
        } else {
          EXPECT_EQ(nans, 0) << broadcast << " " << hb << " " << i;
        }
      }
  }
}

TEST_P(CpuBackwardTwin, BitwiseIdenticalForAnyThreadCount) {
  const twin tw = GetParam();
  std::mt19937_64 rng(test_seed() + 44);
  problem pr;
  pr.B = 2, pr.Lq = 45, pr.Lk = 77, pr.H = 4, pr.Hkv = 2, pr.d = 16, pr.causal = true, pr.pat = {2, 4};
  pr.has_bias = pr.bias_b = pr.bias_h = true;
  pr.key_lengths = {77, 50};
  fill(pr, rng);
  run_options opt;
  opt.type = dtype::f32;
  opt.backend = backend::cpu;
  opt.isa = tw.isa;
  // dbias per (batch, head), and summed over both (the broadcast pass's fixed order).
  for (const problem& p : {pr, [&] {
         problem b = pr;
         b.bias_b = b.bias_h = false;
         b.bias.resize(static_cast<std::size_t>(b.bias_numel()));
         return b;
       }()}) {
    opt.threads = 1;
    const auto one = run_backward(p, opt);
    for (int t : {2, 3, 7}) {
      opt.threads = t;
      const auto many = run_backward(p, opt);
      EXPECT_EQ(one.dq, many.dq) << t;
      EXPECT_EQ(one.dk, many.dk) << t;
      EXPECT_EQ(one.dv, many.dv) << t;
      EXPECT_EQ(one.dbias, many.dbias) << t;
    }
  }
}

TEST_P(CpuBackwardTwin, UsesExactlyItsForwardSelection) {
  // Near-ties everywhere: all keys equal up to noise below one fp32 ulp of the score, so which key
  // of a group the fp32 forward keeps is decided by rounding (and often differs from fp64). With
  // V = I (d = Lk) the forward's output row is P itself, so O[i, j] > 0 exactly where row i kept key
  // j. A zero bias (it leaves every score unchanged) makes dBias[i, j] = scale dS[i, j], non-zero
  // (dO is random) exactly where the backward kept key j for row i. A backward that recomputed the
  // scores another way (another summation order, fp64) trips this test; so must dV_j != 0 iff
  // some row kept key j without the bias.
  const twin tw = GetParam();
  std::mt19937_64 rng(test_seed() + 45);
  std::uniform_real_distribution<float> u(0.5f, 1.5f), tiny(-4e-7f, 4e-7f);
  const std::int64_t Lk = 48, d = Lk, Lq = 24;
  std::int64_t differs_from_fp64 = 0;
  for (pattern pat : {pattern{1, 2}, pattern{2, 4}, pattern{3, 8}}) {
    for (bool with_bias : {false, true}) {
      std::vector<float> q(static_cast<std::size_t>(Lq * d)), k(static_cast<std::size_t>(Lk * d), 0.0f),
          v(static_cast<std::size_t>(Lk * d), 0.0f), o(q.size()), lse(static_cast<std::size_t>(Lq)), dout(q.size()),
          dq(q.size()), dk(k.size()), dv(v.size()), bias(static_cast<std::size_t>(Lq * Lk), 0.0f),
          dbias(bias.size(), NAN);
      for (auto& x : q) x = u(rng);
      for (auto& x : dout) x = u(rng) - 1.0f;
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
      if (with_bias) f.bias = make_view(bias.data(), {1, 1, Lq, Lk});
      attention_config cfg;
      cfg.pattern = pat;
      cfg.backend = backend::cpu;
      cfg.cpu_isa = tw.isa;
      ASSERT_EQ(select_kernel(f, cfg).name, tw.forward_name);
      attention_forward(f, cfg);
      backward_args b;
      b.q = f.q, b.k = f.k, b.v = f.v, b.out = f.out, b.lse = f.lse, b.bias = f.bias;
      b.dout = make_view(dout.data(), {1, Lq, 1, d});
      b.dq = make_view(dq.data(), {1, Lq, 1, d});
      b.dk = make_view(dk.data(), {1, Lk, 1, d});
      b.dv = make_view(dv.data(), {1, Lk, 1, d});
      if (with_bias) b.dbias = make_view(dbias.data(), {1, 1, Lq, Lk});
      ASSERT_EQ(select_kernel(b, cfg).name, tw.backward_name);
      attention_backward(b, cfg);
      if (with_bias) {
        for (std::int64_t i = 0; i < Lq; ++i)
          for (std::int64_t j = 0; j < Lk; ++j) {
            const auto at = static_cast<std::size_t>(i * Lk + j);
            EXPECT_EQ(dbias[at] != 0.0f, o[static_cast<std::size_t>(i * d + j)] > 0.0f)
                << pat.str() << " row " << i << " key " << j;
          }
      } else {
        for (std::int64_t j = 0; j < Lk; ++j) {
          bool kept_somewhere = false;
          for (std::int64_t i = 0; i < Lq; ++i) kept_somewhere |= o[static_cast<std::size_t>(i * d + j)] > 0.0f;
          EXPECT_EQ(dv[static_cast<std::size_t>(j * d)] != 0.0f, kept_somewhere) << pat.str() << " key " << j;
        }
      }
      // How often the fp32 forward kept other keys than the fp64 reference on these inputs: the
      // test only has teeth if such flips exist (a differently computed selection would then miss).
      std::vector<double> q64(q.begin(), q.end()), k64(k.begin(), k.end()), v64(v.begin(), v.end()), o64(q.size());
      forward_args r;
      r.q = make_view(q64.data(), {1, Lq, 1, d});
      r.k = make_view(k64.data(), {1, Lk, 1, d});
      r.v = make_view(v64.data(), {1, Lk, 1, d});
      r.out = make_view(o64.data(), {1, Lq, 1, d});
      attention_config rcfg = cfg;
      rcfg.backend = backend::reference;
      attention_forward(r, rcfg);
      for (std::size_t x = 0; x < o.size(); ++x) differs_from_fp64 += (o[x] > 0.0f) != (o64[x] > 0.0);
    }
  }
  EXPECT_GT(differs_from_fp64, 0) << "the near-tie inputs did not separate fp32 from fp64 selections";
}

TEST_P(CpuBackwardTwin, RecomputesItsOwnForwardWhenOutAndLseAreAbsent) {
  const twin tw = GetParam();
  std::mt19937_64 rng(test_seed() + 46);
  const std::int64_t B = 1, L = 37, H = 2, d = 8;
  std::vector<float> q(static_cast<std::size_t>(B * L * H * d)), k(q.size()), v(q.size()), dout(q.size()), o(q.size()),
      lse(static_cast<std::size_t>(B * H * L));
  std::uniform_real_distribution<float> u(-1, 1);
  for (auto* t : {&q, &k, &v, &dout})
    for (auto& x : *t) x = u(rng);
  attention_config cfg;
  cfg.backend = backend::cpu;
  cfg.cpu_isa = tw.isa;
  forward_args f;
  f.q = make_view(q.data(), {B, L, H, d});
  f.k = make_view(k.data(), {B, L, H, d});
  f.v = make_view(v.data(), {B, L, H, d});
  f.out = make_view(o.data(), {B, L, H, d});
  f.lse = make_view(lse.data(), {B, H, L});
  attention_forward(f, cfg);
  std::vector<float> g1(q.size() * 3, NAN), g2(q.size() * 3, NAN);
  auto grads = [&](std::vector<float>& g, bool with_forward) {
    backward_args b;
    b.q = f.q, b.k = f.k, b.v = f.v;
    b.dout = make_view(dout.data(), {B, L, H, d});
    if (with_forward) b.out = f.out, b.lse = f.lse;
    b.dq = make_view(g.data(), {B, L, H, d});
    b.dk = make_view(g.data() + q.size(), {B, L, H, d});
    b.dv = make_view(g.data() + 2 * q.size(), {B, L, H, d});
    attention_backward(b, cfg);
  };
  grads(g1, true);
  grads(g2, false);
  EXPECT_EQ(g1, g2);
  for (float x : g1) ASSERT_TRUE(std::isfinite(x));
}

INSTANTIATE_TEST_SUITE_P(Twins, CpuBackwardTwin, ::testing::ValuesIn(twins()), twin_name);

struct small_backward {
  std::vector<float> x = std::vector<float>(2 * 3 * 2 * 4, 0.5f), g = x, gk = x, gv = x;
  std::vector<float> bias = std::vector<float>(3 * 3, 0.0f), dbias = bias;
  backward_args a;
  small_backward() {
    a.q = a.k = a.v = a.dout = make_view(x.data(), {2, 3, 2, 4});
    a.dq = make_view(g.data(), {2, 3, 2, 4});
    a.dk = make_view(gk.data(), {2, 3, 2, 4});
    a.dv = make_view(gv.data(), {2, 3, 2, 4});
  }
};

TEST(CpuBackwardTwinSelector, EachIsaGetsItsBackward) {
  small_backward s;
  attention_config cfg;
  for (backend be : {backend::cpu, backend::automatic}) {
    cfg.backend = be;
    cfg.cpu_isa = cpu_isa::generic;
    EXPECT_EQ(select_kernel(s.a, cfg).name, "cpu.fused_backward.scalar");
    EXPECT_EQ(select_kernel(s.a, cfg).kind, kernel_kind::cpu_fused_backward_scalar);
    cfg.cpu_isa = cpu_isa::portable;
    EXPECT_EQ(select_kernel(s.a, cfg).name, "cpu.fused_backward.portable");
    EXPECT_EQ(select_kernel(s.a, cfg).kind, kernel_kind::cpu_fused_backward_portable);
    // automatic: the best SIMD target this CPU runs (automatic_cpu_isa).
    cfg.cpu_isa = cpu_isa::automatic;
    ASSERT_GE(runnable_cpu_isas().size(), 3u);  // generic, portable, at least the baseline target
    EXPECT_EQ(select_kernel(s.a, cfg).name, fused_kernel_name(automatic_cpu_isa(), false));
  }
}

TEST(CpuBackwardTwinSelector, Avx2RequestedIsHonouredOrRejected) {
  // Which branch runs depends on this CPU; both are the selector's contract.
  small_backward s;
  attention_config cfg;
  cfg.backend = backend::cpu;
  cfg.cpu_isa = cpu_isa::avx2;
  const auto sel = select_kernel(s.a, cfg);
  if (cpu_isa_skip_reason(cpu_isa::avx2).empty()) {
    EXPECT_EQ(sel.name, "cpu.fused_backward.avx2");
    EXPECT_EQ(sel.kind, kernel_kind::cpu_fused_backward_avx2);
  } else {
    EXPECT_FALSE(sel.supported());
    EXPECT_NE(sel.reason.find("avx2"), std::string::npos) << sel.reason;
  }
}

TEST(CpuBackwardTwinSelector, TwinsTakeBroadcastDbias) {
  small_backward s;
  s.a.bias = make_view(s.bias.data(), {1, 1, 3, 3});
  s.a.dbias = make_view(s.dbias.data(), {1, 1, 3, 3});
  attention_config cfg;
  cfg.backend = backend::cpu;
  cfg.cpu_isa = cpu_isa::generic;
  EXPECT_EQ(select_kernel(s.a, cfg).name, "cpu.fused_backward.scalar");
  cfg.cpu_isa = cpu_isa::portable;
  EXPECT_EQ(select_kernel(s.a, cfg).name, "cpu.fused_backward.portable");
}

TEST(CpuBackwardTwinSelector, F64InputsFallBackToReference) {
  std::vector<double> x(2 * 3 * 2 * 4, 0.5), g(x.size()), gk(x.size()), gv(x.size());
  backward_args a;
  a.q = a.k = a.v = a.dout = make_view(x.data(), {2, 3, 2, 4});
  a.dq = make_view(g.data(), {2, 3, 2, 4});
  a.dk = make_view(gk.data(), {2, 3, 2, 4});
  a.dv = make_view(gv.data(), {2, 3, 2, 4});
  attention_config cfg;
  cfg.cpu_isa = cpu_isa::generic;
  EXPECT_EQ(select_kernel(a, cfg).name, "reference.backward");
  cfg.backend = backend::cpu;
  EXPECT_NE(select_kernel(a, cfg).reason.find("f64"), std::string::npos);
}

}  // namespace
}  // namespace dfss::testing
