// Tests of tools/quality: the exact attention and the DFSS function of the quality tool against the
// library's fp64 reference backend (an independent implementation), each baseline against
// properties that a wrong implementation fails (top-k is the best set of its size, full-width
// windows and budgets give full attention, random features and landmarks converge to exact
// attention), and the metrics on hand-made vectors.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <set>
#include <stdexcept>
#include <vector>

#include "common/testing.hpp"
#include "dfss/dfss.hpp"
#include "quality/quality.hpp"

namespace dfss::quality {
namespace {

using dfss::testing::kInf;
using dfss::testing::test_seed;

/// A head of Lq x d queries and Lk x d keys and values, standard normal times @p spread (larger
/// spreads give more peaked attention).
head random_head(std::mt19937_64& rng, std::int64_t lq, std::int64_t lk, std::int64_t d, bool causal,
                 double spread = 1.0) {
  std::normal_distribution<double> n(0.0, 1.0);
  head h;
  h.q = matrix(lq, d);
  h.k = matrix(lk, d);
  h.v = matrix(lk, d);
  for (auto* m : {&h.q, &h.k}) {
    for (auto& x : m->a) x = spread * n(rng);
  }
  for (auto& x : h.v.a) x = n(rng);
  h.scale = 1.0 / std::sqrt(static_cast<double>(d));
  h.causal = causal;
  return h;
}

/// The library's fp64 reference backend on one head ([1, L, 1, d] views).
matrix reference_attention(const head& h, pattern p) {
  head copy = h;
  matrix o(h.lq(), h.v.cols);
  forward_args a;
  a.q = make_view(copy.q.a.data(), {1, h.lq(), 1, h.q.cols});
  a.k = make_view(copy.k.a.data(), {1, h.lk(), 1, h.k.cols});
  a.v = make_view(copy.v.a.data(), {1, h.lk(), 1, h.v.cols});
  a.out = make_view(o.a.data(), {1, h.lq(), 1, h.v.cols});
  attention_config cfg;
  cfg.pattern = p;
  cfg.scale = h.scale;
  cfg.causal = h.causal;
  cfg.backend = backend::reference;
  attention_forward(a, cfg);
  return o;
}

std::vector<std::int64_t> full_budgets(const head& h) {
  std::vector<std::int64_t> b(static_cast<std::size_t>(h.lq()));
  for (std::int64_t i = 0; i < h.lq(); ++i) b[static_cast<std::size_t>(i)] = visible_keys(i, h.lq(), h.lk(), h.causal);
  return b;
}

// Two fp64 computations of the same softmax attention that differ only in summation order: their
// relative difference is a few ulps times the row length, far below this bound.
constexpr double kSameFunctionTol = 1e-12;

TEST(QualityBudget, VisibleKeysAndNmBudgetByHand) {
  EXPECT_EQ(visible_keys(0, 3, 5, false), 5);
  EXPECT_EQ(visible_keys(0, 3, 5, true), 3);   // bottom-right aligned: 0 + (5 - 3) + 1
  EXPECT_EQ(visible_keys(2, 3, 5, true), 5);
  EXPECT_EQ(visible_keys(0, 6, 4, true), 0);   // more queries than keys: the first rows see nothing
  EXPECT_EQ(visible_keys(3, 6, 4, true), 2);
  EXPECT_EQ(nm_budget(8, {2, 4}), 4);
  EXPECT_EQ(nm_budget(10, {2, 4}), 6);  // groups 4, 4, 2: 2 + 2 + min(2, 2)
  EXPECT_EQ(nm_budget(9, {2, 4}), 5);   // 2 + 2 + min(2, 1)
  EXPECT_EQ(nm_budget(5, {1, 2}), 3);
  EXPECT_EQ(nm_budget(0, {1, 2}), 0);
  EXPECT_EQ(nm_budget(7, {1, 1}), 7);   // dense keeps everything
}

TEST(QualityExact, FullAttentionMatchesTheReferenceBackend) {
  std::mt19937_64 rng(test_seed());
  for (bool causal : {false, true}) {
    for (auto [lq, lk] : {std::pair<std::int64_t, std::int64_t>{13, 13}, {7, 19}, {19, 7}}) {
      SCOPED_TRACE(::testing::Message() << "causal=" << causal << " Lq=" << lq << " Lk=" << lk << " seed=" << test_seed());
      const head h = random_head(rng, lq, lk, 6, causal, 1.5);
      EXPECT_LE(relative_error(full_attention(h), reference_attention(h, {1, 1})), kSameFunctionTol);
      const matrix p = full_probabilities(h);
      for (std::int64_t i = 0; i < lq; ++i) {
        double sum = 0.0;
        for (std::int64_t j = 0; j < lk; ++j) sum += p(i, j);
        // A row with visible keys is a probability distribution; an empty row is all 0.
        EXPECT_NEAR(sum, visible_keys(i, lq, lk, causal) > 0 ? 1.0 : 0.0, 1e-12);
      }
    }
  }
}

TEST(QualityExact, NmSelectionMatchesTheReferenceBackend) {
  std::mt19937_64 rng(test_seed() + 1);
  for (pattern p : {pattern{1, 2}, pattern{2, 4}, pattern{3, 8}}) {
    for (bool causal : {false, true}) {
      SCOPED_TRACE(::testing::Message() << p.str() << " causal=" << causal << " seed=" << test_seed());
      // Lk = 22 leaves a partial last group for every M here.
      const head h = random_head(rng, 17, 22, 5, causal, 1.5);
      const matrix s = scores(h);
      const key_sets keep = select_nm(s, p);
      EXPECT_LE(relative_error(sparse_attention(h, keep), reference_attention(h, p)), kSameFunctionTol);
      const auto budget = row_budgets(h, p);
      for (std::int64_t i = 0; i < h.lq(); ++i) {
        EXPECT_EQ(static_cast<std::int64_t>(keep[static_cast<std::size_t>(i)].size()), budget[static_cast<std::size_t>(i)]);
      }
    }
  }
}

TEST(QualityTopk, FullBudgetEqualsFullAttention) {
  std::mt19937_64 rng(test_seed() + 2);
  for (bool causal : {false, true}) {
    const head h = random_head(rng, 11, 16, 4, causal, 2.0);
    const key_sets keep = select_topk(scores(h), full_budgets(h));
    EXPECT_LE(relative_error(sparse_attention(h, keep), full_attention(h)), kSameFunctionTol);
    for (double m : kept_mass(full_probabilities(h), keep)) EXPECT_NEAR(m, 1.0, 1e-12);  // ulps of a sum of <= 16
  }
}

TEST(QualityTopk, KeepsTheLargestScoresAndAtLeastTheDfssMass) {
  std::mt19937_64 rng(test_seed() + 3);
  for (pattern p : {pattern{1, 2}, pattern{2, 4}}) {
    for (bool causal : {false, true}) {
      SCOPED_TRACE(::testing::Message() << p.str() << " causal=" << causal << " seed=" << test_seed());
      const head h = random_head(rng, 24, 30, 8, causal, 2.0);
      const matrix s = scores(h), pr = full_probabilities(h);
      const auto budget = row_budgets(h, p);
      const key_sets top = select_topk(s, budget), nm = select_nm(s, p);
      const auto top_mass = kept_mass(pr, top), nm_mass = kept_mass(pr, nm);
      for (std::int64_t i = 0; i < h.lq(); ++i) {
        const auto& ks = top[static_cast<std::size_t>(i)];
        ASSERT_EQ(static_cast<std::int64_t>(ks.size()), budget[static_cast<std::size_t>(i)]);
        const std::set<std::int64_t> kept(ks.begin(), ks.end());
        double min_kept = kInf, max_dropped = -kInf;
        for (std::int64_t j = 0; j < visible_keys(i, h.lq(), h.lk(), causal); ++j) {
          if (kept.count(j)) {
            min_kept = std::min(min_kept, s(i, j));
          } else {
            max_dropped = std::max(max_dropped, s(i, j));
          }
        }
        EXPECT_GE(min_kept, max_dropped) << "row " << i;
        // Both sets have the row's budget and top-k holds the largest probabilities; the sums may
        // differ in the last ulps when the sets coincide.
        EXPECT_GE(top_mass[static_cast<std::size_t>(i)], nm_mass[static_cast<std::size_t>(i)] - 1e-15) << "row " << i;
      }
    }
  }
}

TEST(QualityWindow, FullWidthEqualsFullAttention) {
  std::mt19937_64 rng(test_seed() + 4);
  for (bool causal : {false, true}) {
    const head h = random_head(rng, 9, 14, 4, causal);
    const key_sets keep = select_window(h.lq(), h.lk(), causal, full_budgets(h));
    EXPECT_LE(relative_error(sparse_attention(h, keep), full_attention(h)), kSameFunctionTol);
  }
}

TEST(QualityWindow, ConsecutiveKeysAroundTheDiagonal) {
  const std::int64_t L = 20;
  const std::vector<std::int64_t> budget(static_cast<std::size_t>(L), 5);
  const key_sets centred = select_window(L, L, false, budget);
  EXPECT_EQ(centred[0], (std::vector<std::int64_t>{0, 1, 2, 3, 4}));         // shifted inside [0, L)
  EXPECT_EQ(centred[10], (std::vector<std::int64_t>{8, 9, 10, 11, 12}));     // centred on the diagonal
  EXPECT_EQ(centred[19], (std::vector<std::int64_t>{15, 16, 17, 18, 19}));
  const key_sets causal = select_window(L, L, true, budget);
  EXPECT_EQ(causal[10], (std::vector<std::int64_t>{6, 7, 8, 9, 10}));        // the most recent keys
  EXPECT_EQ(causal[2], (std::vector<std::int64_t>{0, 1, 2}));                // only 3 visible
  // Lq != Lk: query i is centred at floor((i + 1/2) Lk / Lq).
  const key_sets cross = select_window(4, 16, false, std::vector<std::int64_t>(4, 2));
  EXPECT_EQ(cross[1], (std::vector<std::int64_t>{5, 6}));
}

/// Each set: sorted, distinct, visible, of size min(budget, visible).
void expect_valid_sets(const key_sets& keep, std::int64_t lq, std::int64_t lk, bool causal,
                       const std::vector<std::int64_t>& budget) {
  for (std::int64_t i = 0; i < lq; ++i) {
    const auto& ks = keep[static_cast<std::size_t>(i)];
    const std::int64_t c = visible_keys(i, lq, lk, causal);
    EXPECT_EQ(static_cast<std::int64_t>(ks.size()), std::min(c, budget[static_cast<std::size_t>(i)])) << "row " << i;
    EXPECT_TRUE(std::adjacent_find(ks.begin(), ks.end(), std::greater_equal<>()) == ks.end()) << "row " << i;
    if (!ks.empty()) {
      EXPECT_GE(ks.front(), 0);
      EXPECT_LT(ks.back(), c);
    }
  }
}

TEST(QualityRandom, DistinctVisibleKeysReproducibleBySeed) {
  for (bool causal : {false, true}) {
    const std::int64_t lq = 40, lk = 64;
    const std::vector<std::int64_t> budget(static_cast<std::size_t>(lq), 16);
    const key_sets a = select_random(lq, lk, causal, budget, 7, 0);
    expect_valid_sets(a, lq, lk, causal, budget);
    EXPECT_EQ(a, select_random(lq, lk, causal, budget, 7, 0));
    EXPECT_NE(a, select_random(lq, lk, causal, budget, 8, 0));
    EXPECT_NE(a, select_random(lq, lk, causal, budget, 7, 1));
  }
}

TEST(QualityRandom, KeysAreDrawnUniformly) {
  // 4000 draws of 8 of 32 keys: each key is expected 1000 times with standard deviation ~27, so a
  // count outside [850, 1150] (5.5 sigma) signals a biased draw, not bad luck.
  const std::int64_t lq = 4000, lk = 32;
  const key_sets keep = select_random(lq, lk, false, std::vector<std::int64_t>(static_cast<std::size_t>(lq), 8), 11, 3);
  std::vector<int> count(static_cast<std::size_t>(lk), 0);
  for (const auto& ks : keep) {
    for (std::int64_t j : ks) ++count[static_cast<std::size_t>(j)];
  }
  for (std::int64_t j = 0; j < lk; ++j) {
    EXPECT_GT(count[static_cast<std::size_t>(j)], 850) << "key " << j;
    EXPECT_LT(count[static_cast<std::size_t>(j)], 1150) << "key " << j;
  }
}

TEST(QualityBigbird, WindowGlobalAndRandomBlocksWithinTheBudget) {
  EXPECT_EQ(bigbird_block(512), 64);
  EXPECT_EQ(bigbird_block(256), 32);
  EXPECT_EQ(bigbird_block(100), 8);
  EXPECT_EQ(bigbird_block(5), 1);
  for (bool causal : {false, true}) {
    const std::int64_t L = 256, k = 64;
    const std::vector<std::int64_t> budget(static_cast<std::size_t>(L), k);
    const key_sets keep = select_bigbird(L, L, causal, budget, 5, 2);
    expect_valid_sets(keep, L, L, causal, budget);
    EXPECT_EQ(keep, select_bigbird(L, L, causal, budget, 5, 2));
    const std::int64_t n_window = 3 * k / 8, n_global = k / 4;
    const key_sets window = select_window(L, L, causal, std::vector<std::int64_t>(static_cast<std::size_t>(L), n_window));
    for (std::int64_t i = 0; i < L; ++i) {
      const std::int64_t c = visible_keys(i, L, L, causal);
      if (c <= k) continue;
      const std::set<std::int64_t> kept(keep[static_cast<std::size_t>(i)].begin(), keep[static_cast<std::size_t>(i)].end());
      for (std::int64_t j : window[static_cast<std::size_t>(i)]) {
        EXPECT_TRUE(kept.count(j)) << "row " << i << " misses window key " << j;
      }
      for (std::int64_t j = 0; j < n_global; ++j) EXPECT_TRUE(kept.count(j)) << "row " << i << " misses global key " << j;
    }
    // Rows of one query block share their random blocks: the far-away keys (outside window and
    // global keys) of rows 128 and 129 (block size 8) lie in the same 8-key blocks.
    if (!causal) {
      auto far_blocks = [&](std::int64_t i) {
        std::set<std::int64_t> blocks;
        for (std::int64_t j : keep[static_cast<std::size_t>(i)]) {
          if (j >= n_global && std::abs(j - i) > n_window) blocks.insert(j / bigbird_block(k));
        }
        return blocks;
      };
      EXPECT_EQ(far_blocks(128), far_blocks(129));
    }
  }
  // A budget that covers every visible key keeps them all.
  const key_sets all = select_bigbird(6, 6, false, std::vector<std::int64_t>(6, 6), 1, 0);
  for (const auto& ks : all) EXPECT_EQ(ks, (std::vector<std::int64_t>{0, 1, 2, 3, 4, 5}));
}

/// Mean relative error of @p f over 8 seeds (the random-feature error is itself random).
template <typename F>
double mean_error_over_seeds(const head& h, F f) {
  const matrix exact = full_attention(h);
  double sum = 0.0;
  for (std::uint64_t s = 0; s < 8; ++s) sum += relative_error(f(s), exact);
  return sum / 8.0;
}

TEST(QualityPerformer, ErrorFallsAsFeaturesGrow) {
  std::mt19937_64 rng(test_seed() + 5);
  for (bool causal : {false, true}) {
    SCOPED_TRACE(::testing::Message() << "causal=" << causal << " seed=" << test_seed());
    // Spread 0.5: moderate scores, where the log-normal feature products are not so heavy-tailed
    // that thousands of features are still pre-asymptotic.
    const head h = random_head(rng, 24, 24, 4, causal, 0.5);
    auto error = [&](std::int64_t m) {
      return mean_error_over_seeds(h, [&](std::uint64_t s) { return performer_attention(h, m, 100 + s, 0); });
    };
    // Monte-Carlo error ~ 1 / sqrt(m): 256x more features should cut it ~16x (about 10x typical, the
    // heavy tails of exp(w . x) make small m look better than the asymptote, and over 300 test seeds
    // as little as 3.1x: a factor 4 failed 1% of runs); a factor 2 leaves room for the randomness of
    // 8 seeds, while a wrong estimator (biased features, broken prefix sums) stalls at its bias
    // instead of falling (ratio near 1).
    const double few = error(64), many = error(16384);
    EXPECT_LT(many, few / 2.0);
    EXPECT_LT(many, 0.1);  // 0.005 to 0.03 seen: the estimate does approach exact attention
  }
}

TEST(QualityPerformer, ReproducibleBySeedAndRejectsNoFeatures) {
  std::mt19937_64 rng(test_seed() + 6);
  const head h = random_head(rng, 8, 8, 4, false);
  EXPECT_EQ(performer_attention(h, 20, 1, 0).a, performer_attention(h, 20, 1, 0).a);
  EXPECT_NE(performer_attention(h, 20, 1, 0).a, performer_attention(h, 20, 2, 0).a);
  EXPECT_THROW(performer_attention(h, 0, 1, 0), std::invalid_argument);
}

TEST(QualityNystrom, AllLandmarksAreNearExact) {
  std::mt19937_64 rng(test_seed() + 7);
  // Peaked attention (spread 3) makes the landmark kernel diagonally dominant, so 40 pseudo-inverse
  // steps converge to its inverse and F Z B V = P P^-1 P V = P V. What remains is rounding amplified
  // by the kernel's condition: median 4e-13, worst of 3000 random draws 6e-8, hence the bound.
  const head h = random_head(rng, 16, 16, 8, false, 3.0);
  const double e_all = relative_error(nystrom_attention(h, 16, 40), full_attention(h));
  EXPECT_LT(e_all, 1e-6);
  // Two landmarks cannot represent this attention (errors of 0.7 and more seen).
  const double e_two = relative_error(nystrom_attention(h, 2, 40), full_attention(h));
  EXPECT_GT(e_two, 0.1);
}

TEST(QualityNystrom, ExactOnDataOfTheLandmarkRank) {
  std::mt19937_64 rng(test_seed() + 8);
  // Every query and key repeated twice in a row: the segment means of 8 landmarks are the distinct
  // rows, the attention matrix has rank 8, and the Nystrom factorisation reproduces it exactly up to
  // rounding amplified by the landmark kernel's condition (worst of 3000 random draws: 1e-9).
  head h = random_head(rng, 16, 16, 6, false, 2.0);
  for (std::int64_t i = 1; i < 16; i += 2) {
    for (std::int64_t c = 0; c < 6; ++c) {
      h.q(i, c) = h.q(i - 1, c);
      h.k(i, c) = h.k(i - 1, c);
    }
  }
  EXPECT_LT(relative_error(nystrom_attention(h, 8, 40), full_attention(h)), 1e-6);
  EXPECT_GT(relative_error(nystrom_attention(h, 2, 40), full_attention(h)), 0.1);  // 0.3 and more seen
}

TEST(QualityNystrom, RejectsCausalHeadsAndNoLandmarks) {
  std::mt19937_64 rng(test_seed() + 9);
  const head causal = random_head(rng, 8, 8, 4, true);
  EXPECT_THROW(nystrom_attention(causal, 4), std::invalid_argument);
  const head plain = random_head(rng, 8, 8, 4, false);
  EXPECT_THROW(nystrom_attention(plain, 0), std::invalid_argument);
  // More landmarks than rows are capped at the row count.
  EXPECT_EQ(nystrom_attention(plain, 100, 10).a, nystrom_attention(plain, 8, 10).a);
}

TEST(QualityMetrics, CosineOnHandMadeVectors) {
  const double a[] = {1, 2, 3}, twice[] = {2, 4, 6}, minus[] = {-1, -2, -3}, zero[] = {0, 0, 0};
  const double x[] = {1, 0, 0}, y[] = {0, 5, 0}, diag[] = {1, 1, 0};
  EXPECT_DOUBLE_EQ(cosine(a, a, 3), 1.0);
  EXPECT_DOUBLE_EQ(cosine(a, twice, 3), 1.0);
  EXPECT_DOUBLE_EQ(cosine(a, minus, 3), -1.0);
  EXPECT_DOUBLE_EQ(cosine(x, y, 3), 0.0);
  EXPECT_DOUBLE_EQ(cosine(x, diag, 3), 1.0 / std::sqrt(2.0));
  EXPECT_DOUBLE_EQ(cosine(zero, zero, 3), 1.0);
  EXPECT_DOUBLE_EQ(cosine(zero, a, 3), 0.0);
}

TEST(QualityMetrics, RelativeErrorOnHandMadeMatrices) {
  matrix exact(2, 2), approx(2, 2);
  exact.a = {3, 0, 0, 4};   // norm 5
  approx.a = {3, 0, 0, 1};  // difference norm 3
  EXPECT_DOUBLE_EQ(relative_error(approx, exact), 0.6);
  EXPECT_DOUBLE_EQ(relative_error(exact, exact), 0.0);
  error_sums sums;
  sums.add(approx, exact);
  sums.add(exact, exact);  // a second head without error: 3 / sqrt(50)
  EXPECT_DOUBLE_EQ(sums.relative(), 3.0 / std::sqrt(50.0));
  EXPECT_EQ(relative_error(matrix(1, 2), matrix(1, 2)), 0.0);
  EXPECT_TRUE(std::isinf(relative_error(approx, matrix(2, 2))));
}

TEST(QualityMetrics, PercentileInterpolatesLikeNumpy) {
  // numpy.percentile([50, 10, 40, 20, 30], p): 5 -> 12, 50 -> 30, 100 -> 50, 0 -> 10, 37.5 -> 25.
  const std::vector<double> v{50, 10, 40, 20, 30};
  EXPECT_DOUBLE_EQ(percentile(v, 5), 12.0);
  EXPECT_DOUBLE_EQ(percentile(v, 50), 30.0);
  EXPECT_DOUBLE_EQ(percentile(v, 100), 50.0);
  EXPECT_DOUBLE_EQ(percentile(v, 0), 10.0);
  EXPECT_DOUBLE_EQ(percentile(v, 37.5), 25.0);
  EXPECT_DOUBLE_EQ(percentile({7}, 5), 7.0);
  EXPECT_TRUE(std::isnan(percentile({}, 5)));
  EXPECT_DOUBLE_EQ(mean(v), 30.0);
  EXPECT_TRUE(std::isnan(mean({})));
}

TEST(QualityMetrics, KeptMassSumsTheKeptProbabilities) {
  matrix p(2, 4);
  p.a = {0.1, 0.2, 0.3, 0.4, 0.5, 0.5, 0.0, 0.0};
  const auto m = kept_mass(p, {{1, 3}, {}});
  EXPECT_DOUBLE_EQ(m[0], 0.6);
  EXPECT_DOUBLE_EQ(m[1], 0.0);
}

TEST(QualityMethods, NamesRoundTripAndBadNamesAreNamed) {
  for (method m : {method::dfss, method::topk, method::window, method::random, method::bigbird, method::performer,
                   method::nystrom}) {
    EXPECT_EQ(parse_method(method_name(m), "--methods"), m);
  }
  EXPECT_TRUE(is_sparse(method::bigbird));
  EXPECT_FALSE(is_sparse(method::nystrom));
  try {
    parse_method("linformer", "--methods");
    FAIL() << "expected std::invalid_argument";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("--methods"), std::string::npos);
    EXPECT_NE(std::string(e.what()).find("linformer"), std::string::npos);
  }
}

}  // namespace
}  // namespace dfss::quality
