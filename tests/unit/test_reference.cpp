// The fp64 reference backend against an independent naive formulation, exact selection checks,
// finite differences for the backward pass, dtypes, layouts, threads and NaN propagation.
#include <gtest/gtest.h>

#include "common/run.hpp"
#include "common/testing.hpp"

namespace dfss::testing {
namespace {

// Reference and naive both run in fp64 with different summation orders; 1e-12 relative leaves a
// margin of ~1e3 over the rounding of sums of at most a few hundred terms.
constexpr double kFp64Tol = 1e-12;

std::vector<problem> awkward_shapes(std::mt19937_64& rng) {
  std::vector<problem> out;
  const pattern patterns[] = {{1, 2}, {2, 4}, {3, 8}, {5, 16}, {1, 1}, {4, 4}, {2, 3}};
  struct shape {
    std::int64_t B, Lq, Lk, H, Hkv, d;
  };
  const shape shapes[] = {{1, 1, 1, 1, 1, 1},  {2, 5, 7, 4, 2, 3},   {1, 17, 33, 3, 1, 8},
                          {2, 9, 4, 2, 2, 5},  {1, 3, 19, 6, 3, 16}, {3, 6, 6, 2, 1, 7}};
  int variant = 0;
  for (const auto& s : shapes) {
    for (const auto& pat : patterns) {
      problem p;
      p.B = s.B, p.Lq = s.Lq, p.Lk = s.Lk, p.H = s.H, p.Hkv = s.Hkv, p.d = s.d;
      p.pat = pat;
      p.causal = (variant % 2) == 1;
      p.has_bias = (variant % 3) != 0;
      p.bias_b = (variant % 5) < 2;
      p.bias_h = (variant % 7) < 3;
      if (variant % 4 == 2) {
        // Key padding, including a batch with no valid key (its rows are empty).
        for (std::int64_t b = 0; b < p.B; ++b) p.key_lengths.push_back(b == 0 ? p.Lk / 2 : (b == 1 ? 0 : p.Lk));
      }
      if (variant % 6 == 5) p.scale = 0.37;
      fill(p, rng);
      out.push_back(p);
      ++variant;
    }
  }
  return out;
}

TEST(Reference, ForwardMatchesNaiveFormulation) {
  std::mt19937_64 rng(test_seed());
  for (const auto& pr : awkward_shapes(rng)) {
    for (bool bhld : {false, true}) {
      run_options opt;
      opt.bhld = bhld;
      const auto got = run_forward(pr, opt);
      const auto want = naive_forward(pr);
      EXPECT_LE(max_rel_err(got.o, want.o), kFp64Tol) << pr.describe() << " bhld=" << bhld;
      EXPECT_LE(max_rel_err(got.lse, want.lse), kFp64Tol) << pr.describe() << " bhld=" << bhld;
      for (double x : got.o) ASSERT_TRUE(std::isfinite(x)) << pr.describe();
    }
  }
}

TEST(Reference, DensePatternEqualsFullAttention) {
  std::mt19937_64 rng(test_seed() + 1);
  problem pr;
  pr.B = 2, pr.Lq = 11, pr.Lk = 13, pr.H = 4, pr.Hkv = 2, pr.d = 6, pr.causal = true;
  fill(pr, rng);
  // Full attention written out directly: softmax over every visible key.
  std::vector<double> full(static_cast<std::size_t>(pr.q_numel()), 0.0);
  const double sc = pr.resolved_scale();
  for (std::int64_t b = 0; b < pr.B; ++b)
    for (std::int64_t h = 0; h < pr.H; ++h)
      for (std::int64_t i = 0; i < pr.Lq; ++i) {
        std::vector<double> e;
        double mx = -kInf;
        const std::int64_t last = std::min(pr.Lk - 1, i + pr.Lk - pr.Lq);
        for (std::int64_t j = 0; j <= last; ++j) {
          double s = 0;
          for (std::int64_t c = 0; c < pr.d; ++c)
            s += pr.q[static_cast<std::size_t>(((b * pr.Lq + i) * pr.H + h) * pr.d + c)] *
                 pr.k[static_cast<std::size_t>(((b * pr.Lk + j) * pr.Hkv + h / 2) * pr.d + c)];
          e.push_back(sc * s);
          mx = std::max(mx, sc * s);
        }
        double z = 0;
        for (auto& x : e) z += (x = std::exp(x - mx));
        for (std::int64_t j = 0; j <= last; ++j)
          for (std::int64_t c = 0; c < pr.d; ++c)
            full[static_cast<std::size_t>(((b * pr.Lq + i) * pr.H + h) * pr.d + c)] +=
                e[static_cast<std::size_t>(j)] / z *
                pr.v[static_cast<std::size_t>(((b * pr.Lk + j) * pr.Hkv + h / 2) * pr.d + c)];
      }
  for (pattern pat : {pattern{1, 1}, pattern{4, 4}, pattern{16, 16}}) {
    pr.pat = pat;
    EXPECT_LE(max_rel_err(run_forward(pr).o, full), kFp64Tol) << pat.str();
  }
}

/// A problem whose score matrix is exactly @p scores ([Lq, Lk]) and whose output is exactly P:
/// K = I (d = Lk) makes Q K^T = Q, and V = I makes P V = P.
problem identity_problem(const std::vector<std::vector<double>>& scores, pattern pat) {
  problem pr;
  pr.Lq = static_cast<std::int64_t>(scores.size());
  pr.Lk = static_cast<std::int64_t>(scores[0].size());
  pr.d = pr.Lk;
  pr.pat = pat;
  pr.scale = 0.01;  // keeps every kept probability far from underflow
  for (const auto& row : scores) pr.q.insert(pr.q.end(), row.begin(), row.end());
  pr.k.assign(static_cast<std::size_t>(pr.Lk * pr.Lk), 0.0);
  for (std::int64_t j = 0; j < pr.Lk; ++j) pr.k[static_cast<std::size_t>(j * pr.Lk + j)] = 1.0;
  pr.v = pr.k;
  pr.dout.assign(pr.q.size(), 1.0);
  return pr;
}

TEST(Reference, SelectionTieFreeKeepsTheNLargest) {
  std::mt19937_64 rng(test_seed() + 2);
  for (pattern pat : {pattern{1, 2}, pattern{2, 4}, pattern{3, 8}, pattern{7, 16}, pattern{2, 5}}) {
    const std::int64_t Lk = 37;  // not a multiple of any M above: a partial last group
    std::vector<std::vector<double>> scores(5, std::vector<double>(Lk));
    for (auto& row : scores) {
      // Distinct integers: no ties anywhere.
      std::vector<int> perm(Lk);
      for (int j = 0; j < Lk; ++j) perm[static_cast<std::size_t>(j)] = j - 18;
      std::shuffle(perm.begin(), perm.end(), rng);
      for (int j = 0; j < Lk; ++j) row[static_cast<std::size_t>(j)] = perm[static_cast<std::size_t>(j)];
    }
    const auto out = run_forward(identity_problem(scores, pat)).o;
    for (std::size_t i = 0; i < scores.size(); ++i) {
      for (std::int64_t g = 0; g < Lk; g += pat.m) {
        const std::int64_t end = std::min<std::int64_t>(g + pat.m, Lk);
        for (std::int64_t j = g; j < end; ++j) {
          int larger = 0;
          for (std::int64_t t = g; t < end; ++t) larger += scores[i][static_cast<std::size_t>(t)] > scores[i][static_cast<std::size_t>(j)];
          const bool expect_kept = larger < pat.n;
          const double pij = out[i * static_cast<std::size_t>(Lk) + static_cast<std::size_t>(j)];
          EXPECT_EQ(pij > 0.0, expect_kept) << pat.str() << " row " << i << " key " << j;
          if (!expect_kept) {
            EXPECT_EQ(pij, 0.0);
          }
        }
      }
    }
  }
}

TEST(Reference, TiesGoToTheLowerIndex) {
  // Row 0: all equal -> keep the first N of each group. Row 1: [5, 7, 7, 7 | 1, 1, 2, 1].
  const std::vector<std::vector<double>> scores = {{3, 3, 3, 3, 3, 3, 3, 3}, {5, 7, 7, 7, 1, 1, 2, 1}};
  const auto out = run_forward(identity_problem(scores, {2, 4})).o;
  const int expect[2][8] = {{1, 1, 0, 0, 1, 1, 0, 0}, {0, 1, 1, 0, 1, 0, 1, 0}};
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 8; ++j) EXPECT_EQ(out[static_cast<std::size_t>(i * 8 + j)] > 0, expect[i][j] == 1) << i << "," << j;
}

TEST(Reference, MaskedGroupsAndRows) {
  // Key padding to 5 of 11 keys with 2:4: group [4, 8) has one valid key (kept, with one -inf
  // companion), group [8, 11) is fully masked; a batch with length 0 has only empty rows.
  problem pr = identity_problem({{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11}, {11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1}}, {2, 4});
  pr.B = 2;
  const auto q = pr.q, k = pr.k, v = pr.v;
  pr.q.insert(pr.q.end(), q.begin(), q.end());
  pr.k.insert(pr.k.end(), k.begin(), k.end());
  pr.v.insert(pr.v.end(), v.begin(), v.end());
  pr.dout.assign(pr.q.size(), 1.0);
  pr.key_lengths = {5, 0};
  const auto r = run_forward(pr);
  const std::int64_t Lk = 11;
  for (std::int64_t i = 0; i < 2; ++i) {
    for (std::int64_t j = 5; j < Lk; ++j) EXPECT_EQ(r.o[static_cast<std::size_t>(i * Lk + j)], 0.0);
    EXPECT_GT(r.o[static_cast<std::size_t>(i * Lk + 4)], 0.0) << "the lone valid key of a group is kept";
    EXPECT_TRUE(std::isfinite(r.lse[static_cast<std::size_t>(i)]));
  }
  for (std::int64_t x = 2 * Lk; x < 4 * Lk; ++x) EXPECT_EQ(r.o[static_cast<std::size_t>(x)], 0.0);
  EXPECT_EQ(r.lse[2], -kInf);
  EXPECT_EQ(r.lse[3], -kInf);
  // The gradients of an empty row are zero, never NaN.
  const auto g = run_backward(pr);
  for (std::size_t x = 2 * static_cast<std::size_t>(Lk); x < g.dq.size(); ++x) EXPECT_EQ(g.dq[x], 0.0);
  for (double x : g.dk) EXPECT_TRUE(std::isfinite(x));
}

TEST(Reference, CausalIsBottomRightAligned) {
  for (auto [Lq, Lk] : {std::pair<int, int>{3, 8}, {8, 3}, {5, 5}}) {
    std::vector<std::vector<double>> scores(static_cast<std::size_t>(Lq), std::vector<double>(static_cast<std::size_t>(Lk)));
    for (int i = 0; i < Lq; ++i)
      for (int j = 0; j < Lk; ++j) scores[static_cast<std::size_t>(i)][static_cast<std::size_t>(j)] = (i * 7 + j * 3) % 5;
    problem pr = identity_problem(scores, {1, 1});
    pr.causal = true;
    const auto r = run_forward(pr);
    for (int i = 0; i < Lq; ++i) {
      const int last = i + (Lk - Lq);
      for (int j = 0; j < Lk; ++j)
        EXPECT_EQ(r.o[static_cast<std::size_t>(i * Lk + j)] > 0, j <= last) << Lq << "x" << Lk << " " << i << "," << j;
      if (last < 0) {
        EXPECT_EQ(r.lse[static_cast<std::size_t>(i)], -kInf);
      }
    }
  }
}

TEST(Reference, StorageTypesAreWidenedExactly) {
  // The reference on f32/f16/bf16 inputs computes in fp64 on the exactly widened values, so it must
  // equal the f64 reference on the rounded inputs, up to the final rounding of the outputs.
  std::mt19937_64 rng(test_seed() + 3);
  problem pr;
  pr.B = 2, pr.Lq = 7, pr.Lk = 10, pr.H = 4, pr.Hkv = 2, pr.d = 5, pr.causal = true, pr.has_bias = true;
  fill(pr, rng);
  auto check = [&]<typename T>(dtype t) {
    problem rounded = pr;
    rounded.q = round_through<T>(pr.q), rounded.k = round_through<T>(pr.k), rounded.v = round_through<T>(pr.v);
    const auto want = run_forward(rounded);
    run_options opt;
    opt.type = t;
    const auto got = run_forward(rounded, opt);
    EXPECT_EQ(got.o, round_through<T>(want.o)) << dtype_name(t);
    EXPECT_EQ(got.lse, round_through<float>(want.lse)) << dtype_name(t);
    opt.out_type = dtype::f32;
    EXPECT_EQ(run_forward(rounded, opt).o, round_through<float>(want.o)) << dtype_name(t) << " -> f32";
  };
  check.operator()<float>(dtype::f32);
  check.operator()<half>(dtype::f16);
  check.operator()<bfloat16>(dtype::bf16);
}

TEST(Reference, ResultsDoNotDependOnThreads) {
  std::mt19937_64 rng(test_seed() + 4);
  problem pr;
  pr.B = 3, pr.Lq = 9, pr.Lk = 14, pr.H = 4, pr.Hkv = 1, pr.d = 4, pr.has_bias = true, pr.bias_h = true;
  fill(pr, rng);
  run_options one, many;
  one.threads = 1;
  many.threads = 3;
  EXPECT_EQ(run_forward(pr, one).o, run_forward(pr, many).o);
  const auto g1 = run_backward(pr, one), g3 = run_backward(pr, many);
  EXPECT_EQ(g1.dq, g3.dq);
  EXPECT_EQ(g1.dk, g3.dk);
  EXPECT_EQ(g1.dv, g3.dv);
  EXPECT_EQ(g1.dbias, g3.dbias);
}

TEST(Reference, NaNPropagatesToAffectedRowsOnly) {
  std::mt19937_64 rng(test_seed() + 5);
  problem pr;
  pr.Lq = 4, pr.Lk = 8, pr.d = 3, pr.pat = {2, 4};
  fill(pr, rng);
  pr.q[1 * 3 + 0] = kNaN;  // query row 1
  const auto r = run_forward(pr);
  for (int i = 0; i < 4; ++i)
    for (int c = 0; c < 3; ++c)
      EXPECT_EQ(std::isnan(r.o[static_cast<std::size_t>(i * 3 + c)]), i == 1) << i << "," << c;
  // NaN in a value row reaches exactly the rows that keep that key.
  fill(pr, rng);
  pr.v[5 * 3 + 1] = kNaN;
  const auto naive = naive_forward(pr);
  const auto r2 = run_forward(pr);
  for (int i = 0; i < 4; ++i)
    EXPECT_EQ(std::isnan(r2.o[static_cast<std::size_t>(i * 3 + 1)]), naive.keep[static_cast<std::size_t>(i * 8 + 5)] == 1) << i;
}

TEST(Reference, BackwardMatchesMatrixFormulation) {
  std::mt19937_64 rng(test_seed() + 6);
  for (const auto& pr : awkward_shapes(rng)) {
    const auto got = run_backward(pr);
    const auto want = naive_backward(pr);
    EXPECT_LE(max_rel_err(got.dq, want.dq), kFp64Tol) << pr.describe();
    EXPECT_LE(max_rel_err(got.dk, want.dk), kFp64Tol) << pr.describe();
    EXPECT_LE(max_rel_err(got.dv, want.dv), kFp64Tol) << pr.describe();
    EXPECT_LE(max_rel_err(got.dbias, want.dbias), kFp64Tol) << pr.describe();
  }
}

/// Smallest selection gap of the whole problem: a central difference with a step well below it
/// cannot change the selection.
double min_selection_gap(const problem& pr) {
  const auto gaps = selection_gaps(pr);
  return *std::min_element(gaps.begin(), gaps.end());
}

TEST(Reference, BackwardMatchesFiniteDifferences) {
  std::mt19937_64 rng(test_seed() + 7);
  const double h = 1e-6;
  for (pattern pat : {pattern{2, 4}, pattern{1, 2}, pattern{3, 5}, pattern{1, 1}}) {
    problem pr;
    pr.B = 2, pr.Lq = 4, pr.Lk = 7, pr.H = 2, pr.Hkv = 1, pr.d = 3, pr.pat = pat, pr.causal = true;
    pr.has_bias = true, pr.bias_h = true;
    pr.key_lengths = {6, 7};
    // Redraw until every selection is at least 1e-3 away from flipping (h moves scores by < 1e-5).
    do fill(pr, rng); while (min_selection_gap(pr) < 1e-3);
    const auto g = run_backward(pr);
    auto loss = [&](const problem& p) {
      const auto o = run_forward(p).o;
      double l = 0;
      for (std::size_t x = 0; x < o.size(); ++x) l += o[x] * p.dout[x];
      return l;
    };
    auto check = [&](std::vector<double> problem::*field, const std::vector<double>& grad, const char* name) {
      for (std::size_t x = 0; x < (pr.*field).size(); ++x) {
        if (!std::isfinite((pr.*field)[x])) continue;  // -inf bias entries have no derivative
        problem plus = pr, minus = pr;
        (plus.*field)[x] += h;
        (minus.*field)[x] -= h;
        const double fd = (loss(plus) - loss(minus)) / (2 * h);
        // Central differences: truncation O(h^2) and cancellation ~1e-16/h = 1e-10.
        EXPECT_NEAR(grad[x], fd, 1e-7) << name << "[" << x << "] " << pr.describe();
      }
    };
    check(&problem::q, g.dq, "dq");
    check(&problem::k, g.dk, "dk");
    check(&problem::v, g.dv, "dv");
    check(&problem::bias, g.dbias, "dbias");
  }
}

}  // namespace
}  // namespace dfss::testing
