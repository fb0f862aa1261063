// Non-finite and extreme inputs (docs/semantics.md, "Non-finite and extreme inputs"
// and forward step 2) against every CPU kernel: the fused generic, portable and AVX2 forwards,
// the three-stage pipeline and the three backwards, with f32, f16 and bf16 inputs (the fused
// forwards also on the cases' keys repeated to 2100, where the SIMD forwards split them); the fp64
// reference itself is checked against the independent naive implementation of testing.hpp.
//
// Cases: +inf scores from the bias and from q or k (a NaN or +inf among a row's visible scores
// makes the row NaN; one behind a mask does not), -inf bias (masks, whole rows, a single visible
// key), NaN in q, k, v and the bias, scores offset by 1e3 and 1e6 with a spread softmax, scores up
// to near float max after scaling, q scaled by 1e9, a scale of float max, scale * score beyond
// float max, and a mixture of these in the rows of one query tile.
//
// Oracle: the fp64 reference on the inputs rounded to the kernel's storage type (the bias, which
// the kernels read as fp32, rounded to fp32), so both compute the same function of the same
// numbers. Except in RandomQTimes1e9, inputs are small integers (and their products with powers of
// two), so the fp32 scores equal the fp64 ones (a small q . k added to a bias of 2^66 or more rounds
// away in both) and every selection, tie and row maximum is the reference's. Checked: the NaN pattern of O and of every gradient, element by element; the class of
// each row's LSE (-inf, finite, +inf, NaN) against the reference's LSE rounded to fp32 (the LSE type
// of these inputs); finite values within the bounds below. Every call runs twice, outputs poisoned
// with NaN and then with a finite value, so an output expected to be NaN must have been written too.
//
// Tolerances:
// - O: a convex combination of at most Lk rows of V whose weights come from fp32 exp, sums and one
//   division: (16 + Lk) eps_f32 max|v| (test_cpu.cpp's bound). With exact scores the exponent
//   scale * (s_j - max) is exact but for the rounding of the scale and the product, which is
//   inside that bound for the weights that matter (a weight below 2^-24 cannot move O by more).
//   Where the forward rounds P to bf16 (avx3_bf16 with bf16 inputs), plus kBf16Roundoff max|v|
//   (tests/common/testing.hpp); one-hot rows stay exact (their one weight is 1).
// - LSE = scale * max + log(sum): relative (16 + Lk) eps_f32 (1 + |LSE|), the product and the
//   sum's rounding; plus, where the scores are rounded (RandomQTimes1e9), the fp32 dot product's
//   relative error 4 d eps_f32.
// - Gradients: dS = P (dP - D) is a difference of two fp32 dot products of d terms (dP = dO . v_j,
//   D = dO . O), so its absolute rounding error is about d eps_f32 max|dO| max|v| whatever its
//   value, and dQ, dK and dBias multiply it by the scale and by |K| or |Q|. With huge scores the
//   rows are one-hot and the reference's dS is exactly 0: only this term bound is meaningful there.
//   So dQ, dK, dBias get (64 + terms + 2 d) eps_f32 (1 + max|want| + B) with B = scale d max|dO|
//   max|v| times max|K| (dQ), max|Q| (dK) or 1 (dBias); dV = P^T dO has no cancellation and keeps
//   (64 + terms + 2 d) eps_f32 (1 + max|want| + max|dO|). terms = Lk (dQ, dBias), group Lq (dK, dV).
#include <gtest/gtest.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

#include "common/run.hpp"
#include "common/testing.hpp"

namespace dfss::testing {
namespace {

constexpr double kEps32 = 1.0 / (1 << 23);
constexpr double kFltMax = static_cast<double>(FLT_MAX);

// ---- The cases ---------------------------------------------------------------------------------

struct extreme_case {
  problem pr;
  bool exact_scores = true;  ///< fp32 scores equal the fp64 ones (no rounding in q . k + bias)
};

constexpr const char* kCaseNames[] = {
    "PosInfBias",      "NegInfBias",          "NaNQ",
    "NaNK",            "NaNV",                "NaNBias",
    "InfQ",            "InfK",                "HugeQ",
    "LargeOffsetBias", "HugeScoresNearFloatMax", "HugeBiasNearFloatMax",
    "ScaleFloatMax",   "ScaleTimesScoreOverflows", "RandomQTimes1e9",
    "Mixture",
};
constexpr int kCases = static_cast<int>(sizeof(kCaseNames) / sizeof(kCaseNames[0]));

std::size_t qi(const problem& p, std::int64_t b, std::int64_t i, std::int64_t h, std::int64_t c) {
  return static_cast<std::size_t>(((b * p.Lq + i) * p.H + h) * p.d + c);
}
std::size_t ki(const problem& p, std::int64_t b, std::int64_t j, std::int64_t hk, std::int64_t c) {
  return static_cast<std::size_t>(((b * p.Lk + j) * p.Hkv + hk) * p.d + c);
}
std::size_t bi(const problem& p, std::int64_t b, std::int64_t h, std::int64_t i, std::int64_t j) {
  return static_cast<std::size_t>(((b * p.H + h) * p.Lq + i) * p.Lk + j);
}

/// Multiplies every finite entry of @p x by @p f.
void scale_finite(std::vector<double>& x, double f) {
  for (double& e : x)
    if (std::isfinite(e)) e *= f;
}

/// Whether some row's two largest visible scores lie within the fp32 dot-product error bound of
/// each other (4 d eps_f32 sum |q_c k_c| per score): there an fp32 kernel may pick another maximum.
bool has_near_top_tie(const problem& pr) {
  for (std::int64_t b = 0; b < pr.B; ++b)
    for (std::int64_t h = 0; h < pr.H; ++h)
      for (std::int64_t i = 0; i < pr.Lq; ++i) {
        double top = -kInf, second = -kInf, top_err = 0, second_err = 0;
        const std::int64_t len = pr.key_lengths.empty() ? pr.Lk : pr.key_lengths[static_cast<std::size_t>(b)];
        for (std::int64_t j = 0; j < len; ++j) {
          if (pr.causal && j > i + (pr.Lk - pr.Lq)) continue;
          double s = 0, mag = 0;
          for (std::int64_t c = 0; c < pr.d; ++c) {
            const double t = pr.q[qi(pr, b, i, h, c)] * pr.k[ki(pr, b, j, h / (pr.H / pr.Hkv), c)];
            s += t;
            mag += std::abs(t);
          }
          const double err = 4.0 * static_cast<double>(pr.d) * kEps32 * mag;
          if (s > top) {
            second = top, second_err = top_err;
            top = s, top_err = err;
          } else if (s > second) {
            second = s, second_err = err;
          }
        }
        if (second != -kInf && top - second <= top_err + second_err) return true;
      }
  return false;
}

/// The base problem: two query tiles of 32 rows, three key tiles of the AVX2 kernel (64+ keys) with
/// a partial one, grouped heads, d = 8, batch 1 with 97 valid keys; small-integer inputs and a
/// bias with some -inf entries (testing::fill).
problem base_problem(std::mt19937_64& rng, bool causal) {
  problem p;
  p.B = 2, p.Lq = 40, p.Lk = 150, p.H = 2, p.Hkv = 1, p.d = 8;
  p.causal = causal;
  p.has_bias = p.bias_b = p.bias_h = true;
  p.key_lengths = {150, 97};
  fill(p, rng, /*integers=*/true);
  return p;
}

/// Case @p index (see kCaseNames), drawn from the test seed.
extreme_case make_case(int index) {
  std::mt19937_64 rng(test_seed() + 700 + static_cast<std::uint64_t>(index));
  extreme_case c;
  problem& p = c.pr;
  const std::string name = kCaseNames[index];
  if (name == "PosInfBias") {
    p = base_problem(rng, false);
    p.bias[bi(p, 0, 0, 3, 10)] = kInf;    // visible: row NaN
    p.bias[bi(p, 1, 0, 4, 120)] = kInf;   // past batch 1's 97 keys: masked, row finite
    p.bias[bi(p, 0, 1, 6, 20)] = kInf;    // two +inf in one group: 1:2 prunes one, row NaN
    p.bias[bi(p, 0, 1, 6, 21)] = kInf;
    p.bias[bi(p, 0, 1, 7, 40)] = kInf;    // +inf next to a NaN in its group
    p.bias[bi(p, 0, 1, 7, 41)] = kNaN;
    p.bias[bi(p, 1, 1, 30, 0)] = kInf;    // the first key of the row
  } else if (name == "NegInfBias") {
    p = base_problem(rng, true);
    for (std::int64_t j = 0; j < p.Lk; ++j) {
      p.bias[bi(p, 0, 0, 5, j)] = -kInf;                     // every key masked: empty row
      p.bias[bi(p, 0, 1, 9, j)] = j == 77 ? 0.0 : -kInf;     // a single visible key
      if (j < 64) p.bias[bi(p, 1, 0, 12, j)] = -kInf;        // whole groups and a whole key tile
    }
    for (std::int64_t i = 0; i < p.Lq; ++i) p.bias[bi(p, 0, 1, i, 30)] = -kInf;  // a key column
  } else if (name == "NaNQ") {
    p = base_problem(rng, false);
    p.q[qi(p, 0, 5, 1, 2)] = kNaN;
    p.q[qi(p, 1, 39, 0, 0)] = kNaN;  // the last row of the partial second row tile
  } else if (name == "NaNK") {
    p = base_problem(rng, true);      // row i sees keys j <= i + 110
    p.k[ki(p, 0, 130, 0, 3)] = kNaN;  // visible to rows 20 and up of batch 0 only
    p.k[ki(p, 1, 120, 0, 0)] = kNaN;  // past batch 1's 97 keys: reaches no row
  } else if (name == "NaNV") {
    p = base_problem(rng, false);
    p.v[ki(p, 0, 33, 0, 1)] = kNaN;   // channel 1 of the rows that keep key 33
    p.v[ki(p, 1, 120, 0, 2)] = kNaN;  // masked for every row
  } else if (name == "NaNBias") {
    p = base_problem(rng, true);
    p.bias[bi(p, 0, 0, 2, 50)] = kNaN;    // visible: row NaN
    p.bias[bi(p, 1, 1, 3, 110)] = kNaN;   // past batch 1's 97 keys
    p.bias[bi(p, 0, 1, 0, 145)] = kNaN;   // causal: row 0 sees keys up to 110
  } else if (name == "InfQ") {
    p = base_problem(rng, false);
    p.q[qi(p, 0, 7, 0, 0)] = kInf;   // scores +inf, -inf or NaN (k = 0): row NaN
    p.q[qi(p, 0, 8, 0, 1)] = -kInf;
    // Batch 1: channel 0 of every key positive, so q_0 = -inf makes every score of row 9 -inf:
    // an empty row (zeros, LSE -inf) that no mask made.
    std::uniform_int_distribution<int> pos(1, 3);
    for (std::int64_t j = 0; j < p.Lk; ++j) p.k[ki(p, 1, j, 0, 0)] = pos(rng);
    p.q[qi(p, 1, 9, 1, 0)] = -kInf;
  } else if (name == "InfK") {
    p = base_problem(rng, false);
    // Rows with q_0 > 0 see a +inf score (NaN row); q_0 < 0 a -inf one (the key acts as masked);
    // q_0 = 0 a NaN one.
    p.k[ki(p, 0, 50, 0, 0)] = kInf;
    p.k[ki(p, 1, 140, 0, 0)] = kInf;  // masked for batch 1
  } else if (name == "HugeQ") {
    p = base_problem(rng, false);
    // Scores about 1e9, exact: integers times 2^30 (the bias too, or fp32 would round it away).
    scale_finite(p.q, 0x1p30);
    scale_finite(p.bias, 0x1p30);
  } else if (name == "LargeOffsetBias") {
    // Scores about 1e3 (batch 0) and 1e6 (batch 1) that differ by small integers: a spread softmax
    // whose weights need the differences of the scores, not the scores, to be accurate.
    p = base_problem(rng, true);
    for (std::int64_t b = 0; b < p.B; ++b)
      for (std::int64_t x = 0; x < p.H * p.Lq * p.Lk; ++x) {
        double& e = p.bias[static_cast<std::size_t>(b * p.H * p.Lq * p.Lk + x)];
        if (std::isfinite(e)) e += b == 0 ? 1024.0 : 0x1p20;
      }
  } else if (name == "HugeScoresNearFloatMax") {
    p = base_problem(rng, false);
    scale_finite(p.q, 0x1p60);  // |q . k| <= 72 * 2^120 = 9.6e37; scaled by 1/sqrt(8): 3.4e37
    scale_finite(p.k, 0x1p60);
  } else if (name == "HugeBiasNearFloatMax") {
    p = base_problem(rng, true);
    scale_finite(p.bias, 0x1p122);  // |bias| <= 3 * 2^122 = 1.6e37, representable in every type
  } else if (name == "ScaleFloatMax") {
    p = base_problem(rng, true);
    p.has_bias = false;
    p.bias.clear();
    p.scale = kFltMax;        // scale * log2(e) overflows fp32
    scale_finite(p.q, 1.0 / 16);  // |q . k| <= 72 / 256: scaled scores up to 9.6e37
    scale_finite(p.k, 1.0 / 16);
    scale_finite(p.dout, 0x1p-40);  // keeps scale * dS (dBias) far from overflowing
  } else if (name == "ScaleTimesScoreOverflows") {
    // Scores n * 2^66 (n in [-3, 3]) times scale 1e20: |scale * score| up to 2e40 > float max for
    // n != 0; O is still one-hot, and LSE is +-inf in fp32 (finite in the fp64 reference).
    p = base_problem(rng, true);
    p.scale = 1e20;
    scale_finite(p.bias, 0x1p66);
  } else if (name == "RandomQTimes1e9") {
    c.exact_scores = false;
    p.B = 2, p.Lq = 40, p.Lk = 150, p.H = 2, p.Hkv = 1, p.d = 8, p.causal = true;
    p.key_lengths = {150, 97};
    // Random reals: redrawn until no row's maximum is within fp32 rounding of its runner-up (for
    // the f32 and the bf16 rounding of the inputs), so the fp32 kernels find the reference's.
    bool tie_free = false;
    for (int attempt = 0; attempt < 1000 && !tie_free; ++attempt) {
      fill(p, rng);
      scale_finite(p.q, 1e9);
      problem f32 = p, b16 = p;
      f32.q = round_through<float>(p.q), f32.k = round_through<float>(p.k);
      b16.q = round_through<bfloat16>(p.q), b16.k = round_through<bfloat16>(p.k);
      tie_free = !has_near_top_tie(f32) && !has_near_top_tie(b16);
    }
    EXPECT_TRUE(tie_free) << "no tie-free draw in 1000 for RandomQTimes1e9, seed " << test_seed();
  } else if (name == "Mixture") {
    // One query tile whose rows meet different conditions next to ordinary rows (causal: row i
    // sees keys up to i + 110).
    p = base_problem(rng, true);
    p.q[qi(p, 0, 0, 0, 4)] = kNaN;                        // row 0: NaN
    p.bias[bi(p, 0, 0, 2, 5)] = kInf;                     // row 2: +inf kept
    p.bias[bi(p, 0, 0, 3, 140)] = kInf;                   // row 3: +inf behind the causal mask
    p.bias[bi(p, 0, 0, 4, 20)] = kNaN;                    // row 4: NaN, and a +inf that 1:2 prunes
    p.bias[bi(p, 0, 0, 4, 21)] = kInf;
    for (std::int64_t j = 0; j < p.Lk; ++j) {
      p.bias[bi(p, 0, 0, 5, j)] = -kInf;                  // row 5: empty
      if (std::isfinite(p.bias[bi(p, 0, 0, 7, j)])) p.bias[bi(p, 0, 0, 7, j)] += 1024.0;  // row 7
    }
    p.bias[bi(p, 0, 0, 6, 7)] = 0x1p100;                  // row 6: huge, a tie of two keys
    p.bias[bi(p, 0, 0, 6, 60)] = 0x1p100;
    p.bias[bi(p, 1, 0, 8, 130)] = kInf;                   // batch 1 row 8: past the 97 keys
  }
  return c;
}

/// The case's inputs as a kernel of storage type @p t sees them; false when an input that is
/// finite does not stay finite in that type (e.g. q * 1e9 in f16): the case does not apply.
bool rounded_to(const problem& pr, dtype t, problem& out) {
  out = pr;
  auto round = [&](std::vector<double>& x) {
    if (t == dtype::f32) x = round_through<float>(x);
    if (t == dtype::f16) x = round_through<half>(x);
    if (t == dtype::bf16) x = round_through<bfloat16>(x);
  };
  round(out.q), round(out.k), round(out.v), round(out.dout);
  out.bias = round_through<float>(out.bias);
  const std::pair<const std::vector<double>*, const std::vector<double>*> inputs[] = {
      {&pr.q, &out.q}, {&pr.k, &out.k}, {&pr.v, &out.v}, {&pr.dout, &out.dout}};
  for (const auto& [a, b] : inputs)
    for (std::size_t x = 0; x < a->size(); ++x)
      if (std::isfinite((*a)[x]) && !std::isfinite((*b)[x])) return false;
  return true;
}

// ---- Comparison ----------------------------------------------------------------------------------

/// -inf, finite, +inf or NaN.
int value_class(double x) {
  if (std::isnan(x)) return 3;
  if (x == -kInf) return 0;
  if (x == kInf) return 2;
  return 1;
}
const char* class_name(double x) {
  const char* names[] = {"-inf", "finite", "+inf", "NaN"};
  return names[value_class(x)];
}

double max_abs_finite(const std::vector<double>& x) {
  double m = 0;
  for (double e : x)
    if (std::isfinite(e)) m = std::max(m, std::abs(e));
  return m;
}

/// Elementwise: the same class (NaN, +-inf, finite) and, where finite, |got - want| <= tol. Reports
/// the first mismatch with its index.
void expect_matches(const std::vector<double>& got, const std::vector<double>& want, double tol, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (std::size_t x = 0; x < got.size(); ++x) {
    if (value_class(got[x]) != value_class(want[x])) {
      ADD_FAILURE() << what << " at " << x << ": got " << got[x] << ", want " << want[x] << " (" << class_name(want[x]) << ")";
      return;
    }
    if (std::isfinite(want[x]) && std::abs(got[x] - want[x]) > tol) {
      ADD_FAILURE() << what << " at " << x << ": got " << got[x] << ", want " << want[x] << " (tolerance " << tol << ")";
      return;
    }
  }
}

void expect_forward_matches(const extreme_case& c, const problem& pr, const forward_result& got,
                            const forward_result& want, bool p_in_bf16, const std::string& what) {
  const double o_tol =
      ((16.0 + static_cast<double>(pr.Lk)) * kEps32 + (p_in_bf16 ? kBf16Roundoff : 0.0)) * max_abs_finite(pr.v);
  expect_matches(got.o, want.o, o_tol, what + " O");
  ASSERT_EQ(got.lse.size(), want.lse.size()) << what;
  const double score_rel = c.exact_scores ? 0.0 : 4.0 * static_cast<double>(pr.d) * kEps32;
  for (std::size_t x = 0; x < got.lse.size(); ++x) {
    // The kernels' LSE is fp32: the reference's, rounded to fp32 (+-inf beyond float max).
    const double want32 = static_cast<double>(static_cast<float>(want.lse[x]));
    const double tol = ((16.0 + static_cast<double>(pr.Lk)) * kEps32 + score_rel) * (1.0 + std::abs(want32));
    if (value_class(got.lse[x]) != value_class(want32) || (std::isfinite(want32) && std::abs(got.lse[x] - want32) > tol)) {
      ADD_FAILURE() << what << " LSE row " << x << ": got " << got.lse[x] << ", want " << want32 << " ("
                    << class_name(want32) << ", fp64 " << want.lse[x] << ")";
      return;
    }
  }
}

void expect_backward_matches(const problem& pr, const backward_result& got, const backward_result& want,
                             const std::string& what) {
  const double d = static_cast<double>(pr.d), group = static_cast<double>(pr.H / pr.Hkv);
  const double dS_bound = pr.resolved_scale() * d * max_abs_finite(pr.dout) * max_abs_finite(pr.v);
  auto tol = [&](double terms, double bound, const std::vector<double>& w) {
    return (64.0 + terms + 2.0 * d) * kEps32 * (1.0 + max_abs_finite(w) + bound);
  };
  const double lk = static_cast<double>(pr.Lk), rows = group * static_cast<double>(pr.Lq);
  expect_matches(got.dq, want.dq, tol(lk, dS_bound * max_abs_finite(pr.k), want.dq), what + " dQ");
  expect_matches(got.dk, want.dk, tol(rows, dS_bound * max_abs_finite(pr.q), want.dk), what + " dK");
  expect_matches(got.dv, want.dv, tol(rows, max_abs_finite(pr.dout), want.dv), what + " dV");
  if (pr.has_bias) expect_matches(got.dbias, want.dbias, tol(lk, dS_bound, want.dbias), what + " dBias");
}

// ---- Kernels -------------------------------------------------------------------------------------

struct kernel {
  std::string name;
  cpu_isa isa;
  cpu_algorithm algorithm;
};

/// Every fused CPU kernel (tests/common's list: generic, portable, each compiled SIMD target), plus
/// the three-stage pipeline for the forward.
std::vector<kernel> fused_kernels(bool forward) {
  std::vector<kernel> out;
  for (cpu_isa isa : fused_cpu_isas()) out.push_back({cpu_isa_label(isa), isa, cpu_algorithm::fused});
  if (forward) out.push_back({"ThreeStage", cpu_isa::generic, cpu_algorithm::three_stage});
  return out;
}
const std::vector<kernel> kForward = fused_kernels(true);
const std::vector<kernel> kBackward = fused_kernels(false);
const std::vector<kernel> kFused = fused_kernels(false);  // the decode slices and the split forward: fused kernels only

/// Patterns: the in-register 1:2 and 2:4 paths of the AVX2 kernel, the generic N:M path, dense.
const pattern kPatterns[] = {{1, 2}, {2, 4}, {3, 8}, {4, 4}};
constexpr double kFinitePoison = 4321.0;  // exact in the f32 and f64 outputs used here; no output takes it
const dtype kTypes[] = {dtype::f32, dtype::f16, dtype::bf16};

using param = std::tuple<int, int>;  // (kernel, case)

template <const std::vector<kernel>* Kernels>
std::string param_name(const ::testing::TestParamInfo<param>& info) {
  return (*Kernels)[static_cast<std::size_t>(std::get<0>(info.param))].name + "_" + kCaseNames[std::get<1>(info.param)];
}

class ExtremeForward : public ::testing::TestWithParam<param> {
 protected:
  void SetUp() override {
    const std::string why = cpu_isa_skip_reason(kForward[static_cast<std::size_t>(std::get<0>(GetParam()))].isa);
    if (!why.empty()) GTEST_SKIP() << why;
  }
};

class ExtremeDecode : public ::testing::TestWithParam<param> {
 protected:
  void SetUp() override {
    const std::string why = cpu_isa_skip_reason(kFused[static_cast<std::size_t>(std::get<0>(GetParam()))].isa);
    if (!why.empty()) GTEST_SKIP() << why;
  }
};

class ExtremeSplit : public ::testing::TestWithParam<param> {
 protected:
  void SetUp() override {
    const std::string why = cpu_isa_skip_reason(kFused[static_cast<std::size_t>(std::get<0>(GetParam()))].isa);
    if (!why.empty()) GTEST_SKIP() << why;
  }
};

class ExtremeBackward : public ::testing::TestWithParam<param> {
 protected:
  void SetUp() override {
    const std::string why = cpu_isa_skip_reason(kBackward[static_cast<std::size_t>(std::get<0>(GetParam()))].isa);
    if (!why.empty()) GTEST_SKIP() << why;
  }
};

/// A CPU call of kernel @p kn's ISA in storage type @p t, O (or the gradients) in fp32 so that the
/// values and not the output rounding are tested, the outputs poisoned with @p poison first.
run_options cpu_options(const kernel& kn, dtype t, double poison) {
  run_options opt;
  opt.type = t;
  opt.out_type = dtype::f32;
  opt.backend = backend::cpu;
  opt.isa = kn.isa;
  opt.poison = poison;
  return opt;
}

/// Case @p c on kernel @p kn for every pattern and storage type, each call twice (NaN and finite
/// poison), against the reference of the inputs rounded to that type.
void expect_case_matches(const kernel& kn, extreme_case c) {
  int ran = 0;
  for (pattern pat : kPatterns) {
    c.pr.pat = pat;
    for (dtype t : kTypes) {
      problem pr;
      if (!rounded_to(c.pr, t, pr)) continue;
      const auto want = run_forward(pr);
      for (double poison : {kNaN, kFinitePoison}) {
        run_options opt = cpu_options(kn, t, poison);
        opt.algorithm = kn.algorithm;
        const auto got = run_forward(pr, opt);
        expect_forward_matches(c, pr, got, want,
                               kn.algorithm == cpu_algorithm::fused && forward_rounds_p_to_bf16(kn.isa, t),
                               pr.describe() + " " + dtype_name(t) + " poison " + std::to_string(poison));
        ++ran;
      }
    }
  }
  EXPECT_GT(ran, 0);
}

TEST_P(ExtremeForward, MatchesReference) {
  expect_case_matches(kForward[static_cast<std::size_t>(std::get<0>(GetParam()))], make_case(std::get<1>(GetParam())));
}

/// Rows [i0, i0 + n) of @p pr as a problem of their own (Q, dO and bias rows; K, V, masks as they
/// are): a decode-sized slice of a case. Under a causal mask the slice is bottom-right aligned
/// again, so it is a different problem, checked against its own reference.
problem slice_rows(const problem& pr, std::int64_t i0, std::int64_t n) {
  problem out = pr;
  out.Lq = n;
  const auto rows = [&](const std::vector<double>& x, std::int64_t outer, std::int64_t row_size) {
    std::vector<double> y;
    for (std::int64_t o = 0; o < outer; ++o)
      for (std::int64_t i = i0; i < i0 + n; ++i) {
        const auto at = x.begin() + static_cast<std::ptrdiff_t>((o * pr.Lq + i) * row_size);
        y.insert(y.end(), at, at + static_cast<std::ptrdiff_t>(row_size));
      }
    return y;
  };
  out.q = rows(pr.q, pr.B, pr.H * pr.d);
  out.dout = rows(pr.dout, pr.B, pr.H * pr.d);
  if (pr.has_bias) out.bias = rows(pr.bias, (pr.bias_b ? pr.B : 1) * (pr.bias_h ? pr.H : 1), pr.Lk);
  return out;
}

/// @p pr with its head dim widened to @p d by zero columns of Q, K, V and dO (the scale kept):
/// the same scores and outputs, at a head dim the AVX-512 decode's tile products take.
problem widen_head_dim(const problem& pr, std::int64_t d) {
  problem out = pr;
  out.d = d;
  out.scale = pr.resolved_scale();
  const auto widen = [&](const std::vector<double>& x) {
    std::vector<double> y(x.size() / static_cast<std::size_t>(pr.d) * static_cast<std::size_t>(d), 0.0);
    for (std::size_t r = 0; r < x.size() / static_cast<std::size_t>(pr.d); ++r) {
      std::copy_n(x.begin() + static_cast<std::ptrdiff_t>(r * static_cast<std::size_t>(pr.d)), pr.d,
                  y.begin() + static_cast<std::ptrdiff_t>(r * static_cast<std::size_t>(d)));
    }
    return y;
  };
  out.q = widen(pr.q);
  out.k = widen(pr.k);
  out.v = widen(pr.v);
  if (!pr.dout.empty()) out.dout = widen(pr.dout);
  return out;
}

/// The decode kernel (selected for few query rows on every SIMD target) on slices of 4 rows of
/// every case: rows 0 to 11, where the cases put their special rows (a NaN row, a +inf kept or
/// masked, an empty row, huge scores, a tie), against the reference of each slice.
TEST_P(ExtremeDecode, SlicesMatchReference) {
  const kernel& kn = kFused[static_cast<std::size_t>(std::get<0>(GetParam()))];
  const extreme_case whole = make_case(std::get<1>(GetParam()));
  int ran = 0;
  for (std::int64_t i0 : {0, 4, 8}) {
    extreme_case c = whole;
    c.pr = slice_rows(whole.pr, i0, 4);
    for (pattern pat : kPatterns) {
      c.pr.pat = pat;
      // Also, in bf16, at d = 32 in a [B, H, L, d] layout: on a CPU with AMX the decode's tile
      // products (2 heads per kv head times 4 rows), where their inputs are tame.
      for (int wide = 0; wide < 2; ++wide) {
        for (dtype t : kTypes) {
          if (wide == 1 && t != dtype::bf16) continue;
          problem pr;
          if (!rounded_to(wide == 1 ? widen_head_dim(c.pr, 32) : c.pr, t, pr)) continue;
          const auto want = run_forward(pr);
          for (double poison : {kNaN, kFinitePoison}) {
            run_options opt = cpu_options(kn, t, poison);
            opt.bhld = wide == 1;
            const auto got = run_forward(pr, opt);
            // The decode forward keeps P in fp32 on every target (avx3_bf16 takes bf16 dot products
            // for Q K^T only; the AMX tiles' two bf16 parts keep each weight to 2^-18, inside the bound).
            expect_forward_matches(c, pr, got, want, /*p_in_bf16=*/false,
                                   pr.describe() + " rows from " + std::to_string(i0) + " " + dtype_name(t) +
                                       " poison " + std::to_string(poison));
            ++ran;
          }
        }
      }
    }
  }
  EXPECT_GT(ran, 0);
}

/// @p pr with its keys repeated @p times along the key axis (K, V and bias columns; key j' is key
/// j' mod Lk): a sequence of full key length repeats every special key; a shorter one keeps its
/// length, so what lay past it stays masked. Causal rows stay bottom-right aligned, so the last copy
/// is masked as the original keys were and the earlier copies are visible.
problem repeat_keys(const problem& pr, std::int64_t times) {
  problem out = pr;
  out.Lk = pr.Lk * times;
  const auto columns = [&](const std::vector<double>& x, std::int64_t outer, std::int64_t inner) {
    std::vector<double> y;
    y.reserve(x.size() * static_cast<std::size_t>(times));
    for (std::int64_t o = 0; o < outer; ++o)
      for (std::int64_t j = 0; j < out.Lk; ++j) {
        const auto at = x.begin() + static_cast<std::ptrdiff_t>((o * pr.Lk + j % pr.Lk) * inner);
        y.insert(y.end(), at, at + static_cast<std::ptrdiff_t>(inner));
      }
    return y;
  };
  out.k = columns(pr.k, pr.B, pr.Hkv * pr.d);
  out.v = columns(pr.v, pr.B, pr.Hkv * pr.d);
  if (pr.has_bias) out.bias = columns(pr.bias, (pr.bias_b ? pr.B : 1) * (pr.bias_h ? pr.H : 1) * pr.Lq, 1);
  for (std::int64_t& len : out.key_lengths) len = len == pr.Lk ? out.Lk : len;
  return out;
}

/// Every case with its 150 keys repeated 14 times (2100 keys): with 8 row tasks the SIMD fused
/// forwards split the keys into chunks (split_chunk_keys) that each hold the case's special keys,
/// so the fold of the chunks meets NaN and +inf rows, huge maxima whose scale * max overflows, and
/// empty chunks of a short sequence; against the reference of the long problem.
TEST_P(ExtremeSplit, RepeatedKeysMatchReference) {
  extreme_case c = make_case(std::get<1>(GetParam()));
  c.pr = repeat_keys(c.pr, 14);
  expect_case_matches(kFused[static_cast<std::size_t>(std::get<0>(GetParam()))], c);
}

TEST_P(ExtremeBackward, MatchesReference) {
  const kernel& kn = kBackward[static_cast<std::size_t>(std::get<0>(GetParam()))];
  extreme_case c = make_case(std::get<1>(GetParam()));
  int ran = 0;
  for (pattern pat : kPatterns) {
    c.pr.pat = pat;
    for (dtype t : kTypes) {
      problem pr;
      if (!rounded_to(c.pr, t, pr)) continue;
      const auto want = run_backward(pr);
      for (double poison : {kNaN, kFinitePoison}) {
        const auto got = run_backward(pr, cpu_options(kn, t, poison));
        expect_backward_matches(pr, got, want, pr.describe() + " " + dtype_name(t) + " poison " + std::to_string(poison));
        ++ran;
      }
    }
  }
  EXPECT_GT(ran, 0);
}

INSTANTIATE_TEST_SUITE_P(Cpu, ExtremeForward,
                         ::testing::Combine(::testing::Range(0, static_cast<int>(kForward.size())), ::testing::Range(0, kCases)),
                         param_name<&kForward>);
INSTANTIATE_TEST_SUITE_P(Cpu, ExtremeDecode,
                         ::testing::Combine(::testing::Range(0, static_cast<int>(kFused.size())), ::testing::Range(0, kCases)),
                         param_name<&kFused>);
INSTANTIATE_TEST_SUITE_P(Cpu, ExtremeSplit,
                         ::testing::Combine(::testing::Range(0, static_cast<int>(kFused.size())), ::testing::Range(0, kCases)),
                         param_name<&kFused>);
INSTANTIATE_TEST_SUITE_P(Cpu, ExtremeBackward,
                         ::testing::Combine(::testing::Range(0, static_cast<int>(kBackward.size())), ::testing::Range(0, kCases)),
                         param_name<&kBackward>);

// ---- The fp64 reference itself -------------------------------------------------------------------

TEST(ExtremeReference, MatchesNaiveImplementation) {
  // f64 inputs (no rounding, fp64 LSE): the reference against the independent literal
  // implementation of testing.hpp on every case. Both compute in fp64 with the same operation
  // order for a score, so they agree to a few ulps.
  for (int index = 0; index < kCases; ++index) {
    extreme_case c = make_case(index);
    for (pattern pat : kPatterns) {
      c.pr.pat = pat;
      const auto got = run_forward(c.pr);
      const auto want = naive_forward(c.pr);
      EXPECT_LE(max_rel_err(got.o, want.o), 1e-12) << kCaseNames[index] << " " << c.pr.describe();
      EXPECT_LE(max_rel_err(got.lse, want.lse), 1e-12) << kCaseNames[index] << " " << c.pr.describe();
    }
  }
}

TEST(ExtremeReference, OneHotRowsHaveTheAnalyticGradients) {
  // Scores 2^30 apart (K = 2^30 I, distinct integer queries): every row's softmax is exactly
  // one-hot at its largest kept score, so O_i = v_argmax(i), dV_j = the sum of dO_i over the rows
  // whose maximum is key j, and dQ = dK = dBias = 0 (dS = P (dP - D) with P in {0, 1} and D = dP
  // at the maximum). An oracle that needs no softmax at all.
  std::mt19937_64 rng(test_seed() + 790);
  problem pr;
  pr.Lq = 12, pr.Lk = 10, pr.d = 10, pr.pat = {2, 4};
  pr.has_bias = pr.bias_b = pr.bias_h = true;
  fill(pr, rng);
  pr.bias.assign(pr.bias.size(), 0.0);
  std::fill(pr.k.begin(), pr.k.end(), 0.0);
  for (std::int64_t j = 0; j < pr.Lk; ++j) pr.k[ki(pr, 0, j, 0, j)] = 0x1p30;
  std::vector<int> perm(static_cast<std::size_t>(pr.d));
  for (std::int64_t i = 0; i < pr.Lq; ++i) {
    std::iota(perm.begin(), perm.end(), -4);
    std::shuffle(perm.begin(), perm.end(), rng);
    for (std::int64_t c = 0; c < pr.d; ++c) pr.q[qi(pr, 0, i, 0, c)] = perm[static_cast<std::size_t>(c)];
  }
  const auto fwd = run_forward(pr);
  const auto got = run_backward(pr);
  std::vector<double> dv(pr.v.size(), 0.0);
  for (std::int64_t i = 0; i < pr.Lq; ++i) {
    std::int64_t arg = 0;
    for (std::int64_t j = 1; j < pr.Lk; ++j)
      if (pr.q[qi(pr, 0, i, 0, j)] > pr.q[qi(pr, 0, i, 0, arg)]) arg = j;
    for (std::int64_t c = 0; c < pr.d; ++c) {
      EXPECT_EQ(fwd.o[qi(pr, 0, i, 0, c)], pr.v[ki(pr, 0, arg, 0, c)]) << "row " << i;
      dv[ki(pr, 0, arg, 0, c)] += pr.dout[qi(pr, 0, i, 0, c)];
    }
  }
  EXPECT_LE(max_rel_err(got.dv, dv), 1e-15);
  // max_rel_err counts a NaN as an infinite error: these are exactly zero, element by element.
  EXPECT_EQ(max_rel_err(got.dq, std::vector<double>(got.dq.size(), 0.0)), 0.0);
  EXPECT_EQ(max_rel_err(got.dk, std::vector<double>(got.dk.size(), 0.0)), 0.0);
  EXPECT_EQ(max_rel_err(got.dbias, std::vector<double>(got.dbias.size(), 0.0)), 0.0);
}

TEST(ExtremeReference, MaskedKeysOfANaNRowGetNoGradient) {
  // Row 0 of a causal problem with Lq = 3, Lk = 8 sees keys 0..5; with 1:2 the masked group {6, 7}
  // keeps key 6 with score -inf. A NaN in row 0's query makes the row NaN, but a masked key has
  // P = 0 and never enters the row (docs/design.md), in the backward as in the forward: its dK, dV
  // and dBias stay finite, while every visible key the row kept turns NaN.
  std::mt19937_64 rng(test_seed() + 791);
  problem pr;
  pr.Lq = 3, pr.Lk = 8, pr.d = 2, pr.pat = {1, 2}, pr.causal = true;
  pr.has_bias = pr.bias_b = pr.bias_h = true;
  fill(pr, rng);
  pr.bias.assign(pr.bias.size(), 0.0);
  pr.q[qi(pr, 0, 0, 0, 0)] = kNaN;
  const auto got = run_backward(pr);
  for (std::int64_t j = 0; j < pr.Lk; ++j) {
    // Row 0 keeps the lower key of each visible group (both NaN: ties go to the lower index).
    const bool nan = j < 6 && j % 2 == 0;
    EXPECT_EQ(std::isnan(got.dk[ki(pr, 0, j, 0, 0)]), nan) << "dK key " << j;
    EXPECT_EQ(std::isnan(got.dv[ki(pr, 0, j, 0, 0)]), nan) << "dV key " << j;
    EXPECT_EQ(std::isnan(got.dbias[bi(pr, 0, 0, 0, j)]), nan) << "dBias key " << j;
  }
}

// ---- Validation ----------------------------------------------------------------------------------

TEST(ExtremeScale, AboveFloatMaxIsRejectedForFp32Kernels) {
  // The f32, f16 and bf16 kernels compute in fp32, where a scale above float max does not exist;
  // f64 inputs (the reference) take it.
  std::vector<float> f(2 * 4 * 2 * 8, 0.5f), o(f.size());
  std::vector<double> f64(f.size(), 0.5), o64(f.size());
  forward_args a;
  a.q = a.k = a.v = make_view(f.data(), {2, 4, 2, 8});
  a.out = make_view(o.data(), {2, 4, 2, 8});
  attention_config cfg;
  cfg.scale = 1e39;
  const status st = try_attention_forward(a, cfg);
  EXPECT_EQ(st.code, status_code::invalid_argument);
  for (const char* part : {"'config.scale'", "3.40282e+38", "got 1e+39"})
    EXPECT_NE(st.message.find(part), std::string::npos) << st.message << " lacks " << part;
  backward_args g;
  std::vector<float> dq(f.size()), dk(f.size()), dv(f.size());
  g.q = g.k = g.v = g.dout = make_view(f.data(), {2, 4, 2, 8});
  g.dq = make_view(dq.data(), {2, 4, 2, 8});
  g.dk = make_view(dk.data(), {2, 4, 2, 8});
  g.dv = make_view(dv.data(), {2, 4, 2, 8});
  EXPECT_EQ(try_attention_backward(g, cfg).code, status_code::invalid_argument);
  cfg.scale = kFltMax;
  EXPECT_TRUE(try_attention_forward(a, cfg).ok());
  cfg.scale = 1e39;
  a.q = a.k = a.v = make_view(f64.data(), {2, 4, 2, 8});
  a.out = make_view(o64.data(), {2, 4, 2, 8});
  EXPECT_TRUE(try_attention_forward(a, cfg).ok());
}

}  // namespace
}  // namespace dfss::testing
