// The CPU backend's fused forward kernels (generic scalar and AVX2, every one this CPU can run)
// against the fp64 reference and against each other.
//
// Tolerance policy: scores of small-integer inputs are exact in fp32, so the selection must equal the
// reference's exactly and only the softmax and P V carry rounding: each output is a convex
// combination of at most Lk values computed with fp32 exp and sums, so its error is bounded by
// (c + Lk) * eps_f32 * max|v| with a small constant c for exp, scale and the final division; we use
// c = 16. 16-bit outputs add half an ulp of the output type. Where the forward rounds P to bf16
// (the avx3_bf16 target with bf16 inputs), O may move by another kBf16Roundoff * max|v|
// (tests/common/testing.hpp derives it).
#include <gtest/gtest.h>
#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#endif

#include <array>
#include <bit>
#include <cstring>

#include "common/near_ties.hpp"
#include "common/run.hpp"
#include "common/testing.hpp"

namespace dfss::testing {
namespace {

constexpr double kEps32 = 1.0 / (1 << 23);

/// The ISAs this machine can run (tests/common: generic, portable and every compiled SIMD target
/// this CPU supports); every test below runs for each of them.
std::vector<cpu_isa> runnable_isas() { return runnable_cpu_isas(); }

const char* isa_name(cpu_isa i) { return cpu_isa_name(i); }

double output_tol(const problem& pr, dtype out, bool p_in_bf16 = false) {
  double vmax = 0;
  for (double x : pr.v) vmax = std::max(vmax, std::abs(x));
  const double ulp_out = out == dtype::f16 ? 1.0 / 1024 : (out == dtype::bf16 ? 1.0 / 128 : 0.0);
  return (16.0 + static_cast<double>(pr.Lk)) * kEps32 * vmax + ulp_out * vmax + (p_in_bf16 ? kBf16Roundoff * vmax : 0.0);
}

std::vector<problem> cpu_shapes(std::mt19937_64& rng, bool integers) {
  std::vector<problem> out;
  struct shape {
    std::int64_t B, Lq, Lk, H, Hkv, d;
  };
  const shape shapes[] = {{1, 1, 1, 1, 1, 1}, {2, 7, 70, 4, 2, 5}, {1, 33, 129, 3, 1, 16},
                          {2, 65, 9, 2, 2, 64}, {1, 4, 200, 2, 1, 3}};
  const pattern patterns[] = {{1, 2}, {2, 4}, {3, 8}, {7, 16}, {1, 1}, {2, 3}};
  int variant = 0;
  for (const auto& s : shapes)
    for (const auto& pat : patterns) {
      problem p;
      p.B = s.B, p.Lq = s.Lq, p.Lk = s.Lk, p.H = s.H, p.Hkv = s.Hkv, p.d = s.d, p.pat = pat;
      p.causal = variant % 2 == 1;
      p.has_bias = variant % 3 == 1;
      p.bias_b = variant % 4 < 2;
      if (variant % 5 == 3) {
        for (std::int64_t b = 0; b < p.B; ++b) p.key_lengths.push_back(b == 1 ? 0 : p.Lk - p.Lk / 3);
      }
      fill(p, rng, integers);
      out.push_back(p);
      ++variant;
    }
  return out;
}

TEST(Cpu, FusedScalarMatchesReferenceOnExactScores) {
  std::mt19937_64 rng(test_seed() + 11);
  for (const auto& pr : cpu_shapes(rng, /*integers=*/true)) {
    const auto want = run_forward(pr);
    for (cpu_isa isa : runnable_isas())
    for (dtype t : {dtype::f32, dtype::f16, dtype::bf16}) {
      for (dtype out : {t, dtype::f32}) {
        run_options opt;
        opt.isa = isa;
        opt.type = t;
        opt.out_type = out;
        opt.backend = backend::cpu;
        opt.bhld = t == dtype::f16;
        const auto got = run_forward(pr, opt);
        double err = 0;
        for (std::size_t x = 0; x < got.o.size(); ++x) {
          ASSERT_TRUE(std::isfinite(got.o[x])) << pr.describe() << " at " << x;
          err = std::max(err, std::abs(got.o[x] - want.o[x]));
        }
        EXPECT_LE(err, output_tol(pr, out, forward_rounds_p_to_bf16(isa, t)))
            << pr.describe() << " " << isa_name(isa) << " " << dtype_name(t) << "->" << dtype_name(out);
        for (std::size_t x = 0; x < got.lse.size(); ++x) {
          if (std::isinf(want.lse[x])) {
            EXPECT_EQ(got.lse[x], want.lse[x]) << pr.describe();
          } else {
            // LSE = scale * max + log(sum): the sum's relative error passes through log unchanged.
            EXPECT_NEAR(got.lse[x], want.lse[x], (16.0 + static_cast<double>(pr.Lk)) * kEps32 * (1 + std::abs(want.lse[x])))
                << pr.describe();
          }
        }
      }
    }
  }
}


TEST(Cpu, FusedScalarMatchesReferenceOnRandomInputs) {
  std::mt19937_64 rng(test_seed() + 12);
  for (auto pr : cpu_shapes(rng, /*integers=*/false)) {
    pr.has_bias = false;  // keep the near-tie analysis to Q K^T alone
    const auto want = run_forward(pr);
    for (cpu_isa isa : runnable_isas()) {
    run_options opt;
    opt.type = dtype::f32;
    opt.backend = backend::cpu;
    opt.isa = isa;
    const auto got = run_forward(pr, opt);
    // fp32 dot products of d terms in [-1, 1]: error below d * eps_f32 (times 4 for margin).
    const auto ties = near_tie_rows(pr, 4.0 * static_cast<double>(pr.d) * kEps32);
    std::size_t skipped = 0;
    ASSERT_TRUE(rows_near_except_ties(got.o, want.o, ties, pr.d, output_tol(pr, dtype::f32), &skipped))
        << pr.describe() << " " << isa_name(isa);
    EXPECT_LE(skipped, ties.size() / 50 + 1) << "too many near-tie rows to be a meaningful test";
    }
  }
}

TEST(Cpu, ResultsAreBitwiseIdenticalForAnyThreadCount) {
  std::mt19937_64 rng(test_seed() + 13);
  problem pr;
  pr.B = 2, pr.Lq = 37, pr.Lk = 101, pr.H = 3, pr.Hkv = 1, pr.d = 16, pr.causal = true;
  fill(pr, rng);
  for (cpu_isa isa : runnable_isas()) {
    for (bool causal : {false, true}) {
      pr.causal = causal;
      run_options opt;
      opt.type = dtype::f32;
      opt.backend = backend::cpu;
      opt.isa = isa;
      opt.threads = 1;
      const auto one = run_forward(pr, opt);
      for (int t : {2, 3, 7}) {
        opt.threads = t;
        const auto many = run_forward(pr, opt);
        EXPECT_EQ(one.o, many.o) << isa_name(isa) << " causal=" << causal << " " << t << " threads";
        EXPECT_EQ(one.lse, many.lse) << isa_name(isa) << " causal=" << causal << " " << t << " threads";
      }
    }
  }
}

TEST(Cpu, BiasOfEveryTypeGivesTheBitsOfAnF64Bias) {
  // A bias in f32, bf16 or f16 with contiguous keys is added by vectors (add_bias_vectors), an f64
  // one value by value: with values exact in every type (quarters in [-2, 2], and -inf), the same
  // bits. The fused forward (Lq = 67) and the decode kernel (Lq = 2; its direct path where the bias
  // is only 0 and -inf, bias_only_masks), causal and not, Lk not a multiple of any vector.
  std::mt19937_64 rng(test_seed() + 14);
  std::uniform_int_distribution<int> quarter(-8, 8), pick(0, 6);
  for (std::int64_t lq : {67, 2}) {
    for (bool mask_only : {false, true}) {
      problem pr;
      pr.B = 2, pr.Lq = lq, pr.Lk = 301, pr.H = 4, pr.Hkv = 2, pr.d = 32;
      pr.has_bias = pr.bias_b = pr.bias_h = true;
      fill(pr, rng);
      for (auto& e : pr.bias) e = pick(rng) == 0 ? -kInf : mask_only ? 0.0 : quarter(rng) / 4.0;
      for (cpu_isa isa : runnable_isas()) {
        for (bool causal : {false, true}) {
          pr.causal = causal;
          run_options opt;
          opt.type = dtype::f32;
          opt.backend = backend::cpu;
          opt.isa = isa;
          const auto want = run_forward(pr, opt);
          for (dtype bt : {dtype::f32, dtype::bf16, dtype::f16}) {
            opt.bias_type = bt;
            const auto got = run_forward(pr, opt);
            const std::string what = pr.describe() + " " + isa_name(isa) + " bias " + dtype_name(bt);
            EXPECT_EQ(want.o, got.o) << what;
            EXPECT_EQ(want.lse, got.lse) << what;
          }
        }
      }
    }
  }
}

TEST(Cpu, BiasTilesWithoutMaskedKeys) {
  // Tiles whose bias row holds no -inf run the blocked P V forms (dense; 1:2 by pairs where the
  // target has them) like tiles without a bias: a finite bias (small integers: exact scores, so the
  // selection is the reference's exactly), and a left-padding mask (0, and -inf for the first keys
  // of batch 0: only its first tiles are masked). Against the fp64 reference, causal and not, fp32,
  // 1 and 3 threads alike.
  std::mt19937_64 rng(test_seed() + 15);
  std::uniform_int_distribution<int> small(-3, 3);
  for (pattern pat : {pattern{1, 1}, pattern{1, 2}, pattern{2, 4}}) {
    for (bool left_padding : {false, true}) {
      for (bool causal : {false, true}) {
        problem pr;
        pr.B = 2, pr.Lq = 70, pr.Lk = 600, pr.H = 4, pr.Hkv = 2, pr.d = 32, pr.pat = pat, pr.causal = causal;
        pr.has_bias = pr.bias_b = pr.bias_h = true;
        fill(pr, rng, /*integers=*/true);
        for (std::size_t x = 0; x < pr.bias.size(); ++x) {
          const std::int64_t b = static_cast<std::int64_t>(x) / (pr.H * pr.Lq * pr.Lk), j = static_cast<std::int64_t>(x) % pr.Lk;
          pr.bias[x] = left_padding ? (b == 0 && j < 150 ? -kInf : 0.0) : small(rng);
        }
        const auto want = run_forward(pr);
        for (cpu_isa isa : runnable_isas()) {
          run_options opt;
          opt.isa = isa;
          opt.type = dtype::f32;
          opt.out_type = dtype::f32;
          opt.backend = backend::cpu;
          opt.threads = 1;
          const auto got = run_forward(pr, opt);
          const std::string what = pr.describe() + " " + isa_name(isa);
          double err = 0;
          for (std::size_t x = 0; x < got.o.size(); ++x) {
            ASSERT_TRUE(std::isfinite(got.o[x])) << what << " at " << x;
            err = std::max(err, std::abs(got.o[x] - want.o[x]));
          }
          EXPECT_LE(err, output_tol(pr, dtype::f32, false)) << what;
          for (std::size_t x = 0; x < got.lse.size(); ++x) {
            EXPECT_NEAR(got.lse[x], want.lse[x], (16.0 + static_cast<double>(pr.Lk)) * kEps32 * (1 + std::abs(want.lse[x])))
                << what;
          }
          opt.threads = 3;
          const auto many = run_forward(pr, opt);
          EXPECT_EQ(got.o, many.o) << what;
        }
      }
    }
  }
}

TEST(Cpu, EmptyRowsAndNaN) {
  std::mt19937_64 rng(test_seed() + 14);
  problem pr;
  pr.B = 2, pr.Lq = 6, pr.Lk = 9, pr.d = 4, pr.causal = true;
  pr.Lq = 12;  // Lq > Lk: the first Lq - Lk rows see no key under the bottom-right causal mask
  pr.key_lengths = {9, 0};
  fill(pr, rng);
  pr.q[static_cast<std::size_t>(10 * 4 + 2)] = kNaN;  // batch 0, row 10
  pr.v[static_cast<std::size_t>(8 * 4 + 1)] = kNaN;   // batch 0, key 8: visible only to the last row
  const auto want = run_forward(pr);
  for (cpu_isa isa : runnable_isas()) {
  run_options opt;
  opt.type = dtype::f32;
  opt.backend = backend::cpu;
  opt.isa = isa;
  const auto got = run_forward(pr, opt);
  EXPECT_LE(max_rel_err(got.lse, want.lse), 1e-5);
  for (std::size_t x = 0; x < got.o.size(); ++x) {
    EXPECT_EQ(std::isnan(got.o[x]), std::isnan(want.o[x])) << x;
    if (want.o[x] == 0.0) {
      EXPECT_EQ(got.o[x], 0.0) << x;
    }
  }
  EXPECT_TRUE(std::isnan(got.o[static_cast<std::size_t>(10 * 4)]));
  EXPECT_EQ(got.lse[0], -kInf);
  }
}

// A bf16 output is the fp32 output rounded by float_to_bf16 (nearest even, NaN quieted; its own
// rounding is tested in test_numeric), element for element, in both layouts and for a d that is
// not a multiple of the vector: store_row normalises the row in place before handing it to the
// element-wise store, and this pins down that nothing else moves. Batch 0 has Q = 0, so each
// row's weights are equal and its output is the mean of its visible V rows: the mean of two bf16
// values holds one bit more than bf16 (about half of such columns are exact ties), of four, two.
// Batch 1 is random, with NaN in a V value and a +inf in a Q value (a NaN row).
TEST(Cpu, Bf16OutputIsTheFp32OutputRounded) {
  std::mt19937_64 rng(test_seed() + 15);
  for (const std::int64_t d : {std::int64_t{64}, std::int64_t{44}}) {
    for (const pattern pat : {pattern{1, 1}, pattern{1, 2}}) {
      problem pr;
      pr.B = 2, pr.Lq = 70, pr.Lk = 70, pr.H = 2, pr.Hkv = 1, pr.d = d, pr.pat = pat, pr.causal = true;
      fill(pr, rng);
      for (std::int64_t x = 0; x < pr.Lq * pr.H * d; ++x) pr.q[static_cast<std::size_t>(x)] = 0.0;
      const std::int64_t b1 = pr.Lk * d;  // batch 1's first K and V element
      pr.v[static_cast<std::size_t>(b1 + 20 * d + 3)] = kNaN;
      pr.q[static_cast<std::size_t>(pr.Lq * pr.H * d + (40 * pr.H + 1) * d + 5)] = kInf;
      for (cpu_isa isa : runnable_isas()) {
        for (const bool bhld : {false, true}) {
          run_options opt;
          opt.isa = isa;
          opt.type = dtype::bf16;
          opt.backend = backend::cpu;
          opt.bhld = bhld;
          opt.out_type = dtype::f32;
          const auto wide = run_forward(pr, opt);
          opt.out_type = dtype::bf16;
          const auto got = run_forward(pr, opt);
          ASSERT_EQ(got.o.size(), wide.o.size());
          std::int64_t ties = 0, nans = 0;
          for (std::size_t x = 0; x < got.o.size(); ++x) {
            const float f = static_cast<float>(wide.o[x]);
            if (std::isnan(f)) {
              ++nans;
              EXPECT_TRUE(std::isnan(got.o[x])) << x;
              continue;
            }
            if ((std::bit_cast<std::uint32_t>(f) & 0xffffu) == 0x8000u) ++ties;
            const double want = static_cast<double>(bf16_to_float(float_to_bf16(f)));
            ASSERT_EQ(got.o[x], want) << isa_name(isa) << " " << pr.describe() << " bhld=" << bhld << " at " << x
                                      << ": fp32 " << f;
            ASSERT_EQ(std::signbit(got.o[x]), std::signbit(want)) << x;
          }
          EXPECT_GT(ties, d / 4) << "the test should hold exact ties";
          EXPECT_GT(nans, 0) << "the test should hold NaN outputs";
        }
      }
    }
  }
}

TEST(Cpu, SimdTargetsAgreeWithGenericOnLargerShapes) {
  // Shapes that exercise several key tiles, partial tiles, d not a multiple of the vector length or
  // above 64, and the generic N:M path inside the SIMD kernels, on every target this CPU runs.
  std::mt19937_64 rng(test_seed() + 15);
  struct shape {
    std::int64_t B, Lq, Lk, H, Hkv, d;
  };
  for (const auto& s : {shape{1, 70, 300, 2, 1, 64}, shape{2, 33, 257, 2, 2, 13}, shape{1, 5, 520, 1, 1, 96},
                        shape{1, 40, 130, 3, 3, 128}}) {
    for (pattern pat : {pattern{1, 1}, pattern{1, 2}, pattern{2, 4}, pattern{3, 8}, pattern{5, 7}, pattern{1, 4}, pattern{3, 4}}) {
      problem pr;
      pr.B = s.B, pr.Lq = s.Lq, pr.Lk = s.Lk, pr.H = s.H, pr.Hkv = s.Hkv, pr.d = s.d, pr.pat = pat;
      pr.causal = s.d == 13;
      pr.has_bias = s.d == 96;
      fill(pr, rng, /*integers=*/true);
      const auto want = run_forward(pr);
      for (cpu_isa isa : runnable_isas()) {
        run_options opt;
        opt.type = dtype::f32;
        opt.backend = backend::cpu;
        opt.isa = isa;
        const auto a = run_forward(pr, opt);
        double err = 0;
        for (std::size_t x = 0; x < a.o.size(); ++x) {
          ASSERT_TRUE(std::isfinite(a.o[x])) << pr.describe() << " " << isa_name(isa);
          err = std::max(err, std::abs(a.o[x] - want.o[x]));
        }
        EXPECT_LE(err, output_tol(pr, dtype::f32)) << pr.describe() << " " << isa_name(isa);
      }
    }
  }
}

TEST(Cpu, BitwiseIdenticalForEveryThreadCount) {
  // Each row (forward) and each (batch, kv head) (backward) is computed by one worker in a fixed
  // order, so 1, 2, 3 and 7 threads give the same bits, on every target, causal or not.
  std::mt19937_64 rng(test_seed() + 17);
  for (bool causal : {false, true}) {
    problem pr;
    pr.B = 2, pr.Lq = 70, pr.Lk = 150, pr.H = 4, pr.Hkv = 2, pr.d = 24, pr.pat = {2, 4};
    pr.causal = causal;
    pr.has_bias = causal;
    fill(pr, rng);
    for (cpu_isa isa : runnable_isas()) {
      run_options opt;
      opt.type = dtype::f32;
      opt.backend = backend::cpu;
      opt.isa = isa;
      opt.threads = 1;
      const auto f1 = run_forward(pr, opt);
      const auto g1 = run_backward(pr, opt);
      for (int threads : {2, 3, 7}) {
        opt.threads = threads;
        const auto f = run_forward(pr, opt);
        const auto g = run_backward(pr, opt);
        const auto same = [](const std::vector<double>& a, const std::vector<double>& b) {
          if (a.size() != b.size()) return false;
          for (std::size_t x = 0; x < a.size(); ++x) {
            if (std::memcmp(&a[x], &b[x], sizeof(double)) != 0) return false;
          }
          return true;
        };
        EXPECT_TRUE(same(f.o, f1.o) && same(f.lse, f1.lse)) << isa_name(isa) << " forward, threads " << threads;
        EXPECT_TRUE(same(g.dq, g1.dq) && same(g.dk, g1.dk) && same(g.dv, g1.dv) && same(g.dbias, g1.dbias))
            << isa_name(isa) << " backward, threads " << threads;
      }
    }
  }
}

}  // namespace
}  // namespace dfss::testing

namespace dfss::testing {
namespace {

TEST(Cpu, NaNInKeysReachesEveryRowThatSeesTheKey) {
  // d = 16 f32 packed takes the vectorised packing path; a NaN score ranks above every number, so
  // it is kept and turns every row that sees key 21 into NaN (and no other row).
  std::mt19937_64 rng(test_seed() + 16);
  problem pr;
  pr.Lq = 40, pr.Lk = 50, pr.d = 16, pr.causal = true, pr.pat = {2, 4};
  fill(pr, rng);
  pr.k[static_cast<std::size_t>(21 * 16 + 3)] = kNaN;
  const auto want = run_forward(pr);
  for (cpu_isa isa : runnable_isas()) {
    run_options opt;
    opt.type = dtype::f32;
    opt.backend = backend::cpu;
    opt.isa = isa;
    const auto got = run_forward(pr, opt);
    for (std::int64_t i = 0; i < pr.Lq; ++i) {
      const bool sees = 21 <= i + (pr.Lk - pr.Lq);
      EXPECT_EQ(std::isnan(got.o[static_cast<std::size_t>(i * 16)]), sees) << isa_name(isa) << " row " << i;
      EXPECT_EQ(std::isnan(want.o[static_cast<std::size_t>(i * 16)]), sees) << "reference row " << i;
    }
  }
}

}  // namespace
}  // namespace dfss::testing

// ---- The avx3_bf16 target: Q K^T and P V as bf16 dot products (src/cpu/simd/bf16_dot.hpp) -------

namespace dfss::testing {
namespace {

bool bf16_dot_runs() {
  const auto isas = runnable_isas();
  return std::find(isas.begin(), isas.end(), cpu_isa::avx3_bf16) != isas.end();
}

/// Sets MXCSR's FTZ and DAZ on this thread while alive (where @p on, on x86), as
/// torch.set_flush_denormal(True) does; restores MXCSR after.
class flushed_denormals {
 public:
  explicit flushed_denormals(bool on) {
#if defined(__x86_64__) || defined(__i386__)
    saved_ = _mm_getcsr();
    if (on) _mm_setcsr(saved_ | 0x8040u);  // FTZ (bit 15) and DAZ (bit 6)
#else
    (void)on;
#endif
  }
  ~flushed_denormals() {
#if defined(__x86_64__) || defined(__i386__)
    _mm_setcsr(saved_);
#endif
  }
  flushed_denormals(const flushed_denormals&) = delete;
  flushed_denormals& operator=(const flushed_denormals&) = delete;

 private:
  [[maybe_unused]] unsigned saved_ = 0;
};

run_options bf16_options(cpu_isa isa, int threads = 0) {
  run_options opt;
  opt.type = dtype::bf16;
  opt.out_type = dtype::f32;  // O unrounded: the kernel's values, not the output rounding, are tested
  opt.backend = backend::cpu;
  opt.isa = isa;
  opt.threads = threads;
  return opt;
}

/// The inputs rounded to bf16, so that the fp64 reference computes the function of what the kernel reads.
problem rounded_to_bf16(problem pr) {
  pr.q = round_through<bfloat16>(pr.q);
  pr.k = round_through<bfloat16>(pr.k);
  pr.v = round_through<bfloat16>(pr.v);
  return pr;
}

bool same_bits(const std::vector<double>& a, const std::vector<double>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(double)) == 0);
}

TEST(Cpu, Bf16DotScoresAreTheFp32Scores) {
  // vdpbf16ps with column c in the odd half of a pair is the fp32 micro-kernel's FMA chain, so on
  // bf16 inputs avx3_bf16 computes avx3's scores bit for bit and keeps the same keys, also where a
  // near-tie is decided by fp32 rounding (real-valued inputs). With one key tile (Lk <= 64) both
  // also sum the same exponentials in the same order, so the LSE (from the unrounded weights) must
  // be bitwise avx3's: a different score or kept set would change it. d not a multiple of 32
  // exercises the tail paths of the packing.
  if (!bf16_dot_runs()) GTEST_SKIP() << "this CPU or build has no avx3_bf16";
  if (avx3_scores_on_amx()) GTEST_SKIP() << "avx3 scores bf16 on AMX tiles here (CTest cpu_forward_amx_0 reruns this without)";
  std::mt19937_64 rng(test_seed() + 18);
  int variant = 0;
  for (std::int64_t d : {16, 48, 64, 80, 128, 5}) {
    for (pattern pat : {pattern{1, 2}, pattern{2, 4}, pattern{3, 8}, pattern{1, 1}, pattern{2, 3}, pattern{7, 16}}) {
      problem pr;
      pr.B = 2, pr.Lq = 37, pr.Lk = variant % 3 == 0 ? 64 : 45, pr.H = 4, pr.Hkv = 2, pr.d = d, pr.pat = pat;
      pr.causal = variant % 2 == 1;
      if (variant % 4 == 2) pr.key_lengths = {pr.Lk - 7, 3};
      ++variant;
      fill(pr, rng);
      const auto fp32 = run_forward(pr, bf16_options(cpu_isa::avx3));
      const auto dot = run_forward(pr, bf16_options(cpu_isa::avx3_bf16));
      EXPECT_TRUE(same_bits(fp32.lse, dot.lse)) << pr.describe();
    }
  }
}

TEST(Cpu, AmxKeepsTheFp32Selection) {
  // On a CPU with AMX (and DFSS_CPU_AMX not 0) the avx3 forward scores bf16 inputs on the AMX tiles,
  // whose sums round otherwise than the fp32 micro-kernel; select_amx must still keep exactly
  // the micro-kernel's keys, here avx2's (the same FMA chain over the same columns). Near ties
  // decided by rounding everywhere: the keys of a group share a random row but for one small column
  // (2^-12 (1 + n / 128), n random), so their scores (about 128) differ by q 2^-19 n, about the
  // sums' rounding. V = I (d >= Lk) makes O's row i P_i itself: nonzero exactly at the kept keys.
  // Lq = 40: a task of 32 rows (two row tiles) and one of 8; Lk = 120: a last partial panel.
  // Each pattern also with a causal mask and a key length of 117 (groups cut by the mask: -inf
  // among near scores), with sink and recent windows (tiles with groups kept whole), with a
  // mask given as a bias (0 and -inf: it keeps the AMX tiles; -inf among near scores), and scaled
  // under FTZ and DAZ (x86): K by 2^-64 and Q by 2^48, so that every score is 2^-16 times the
  // unscaled one with the same roundings, while each key's squares (about 2^-128) flush to 0 in
  // near_tie_bound's norm bounds, on one thread (MXCSR is per thread). That variant fails with
  // norm_slack() returning 0: the norms' bound is then 0 and picked, and the near ties go unsettled.
  const auto isas = runnable_isas();
  const auto runs = [&](cpu_isa isa) { return std::find(isas.begin(), isas.end(), isa) != isas.end(); };
  if (!runs(cpu_isa::avx2) || !runs(cpu_isa::avx3)) GTEST_SKIP() << "this CPU runs avx2 or avx3 not";
  std::mt19937_64 rng(test_seed() + 21);
  std::uniform_real_distribution<double> u(0.5, 1.5);
  std::uniform_int_distribution<int> n128(0, 127);
  for (int variant = 0; variant < 15; ++variant) {
    const pattern pat = std::array{pattern{1, 2}, pattern{2, 4}, pattern{3, 8}}[static_cast<std::size_t>(variant % 3)];
    const bool flushed = variant / 3 == 4;
#if !(defined(__x86_64__) || defined(__i386__))
    if (flushed) continue;  // MXCSR's FTZ and DAZ are x86's
#endif
    problem pr;
    pr.B = 1, pr.Lq = 40, pr.Lk = 120, pr.H = 2, pr.Hkv = 1, pr.d = 128, pr.pat = pat;
    if (variant / 3 == 1) pr.causal = true, pr.key_lengths = {117};
    if (variant / 3 == 2) pr.sink = 5, pr.recent = 9;
    if (variant / 3 == 3) {
      pr.has_bias = true;  // [1, 1, Lq, Lk]: the first 10 keys and every 7th masked
      pr.bias.assign(static_cast<std::size_t>(pr.bias_numel()), 0.0);
      for (std::size_t e = 0; e < pr.bias.size(); ++e) {
        const std::int64_t j = static_cast<std::int64_t>(e) % pr.Lk;
        if (j < 10 || j % 7 == 3) pr.bias[e] = -kInf;
      }
    }
    pr.q.resize(static_cast<std::size_t>(pr.q_numel()));
    pr.k.resize(static_cast<std::size_t>(pr.kv_numel()));
    pr.v.assign(static_cast<std::size_t>(pr.kv_numel()), 0.0);
    for (auto& x : pr.q) x = u(rng);
    for (std::int64_t g = 0; g < pr.Lk / pat.m; ++g) {
      std::vector<double> base(static_cast<std::size_t>(pr.d));
      for (auto& x : base) x = u(rng);
      const auto small = static_cast<std::size_t>(rng() % static_cast<std::uint64_t>(pr.d));
      for (std::int64_t j = g * pat.m; j < (g + 1) * pat.m; ++j) {
        for (std::int64_t c = 0; c < pr.d; ++c) pr.k[static_cast<std::size_t>(j * pr.d + c)] = base[static_cast<std::size_t>(c)];
        pr.k[static_cast<std::size_t>(j * pr.d) + small] = std::ldexp(1.0 + n128(rng) / 128.0, -12);
        pr.v[static_cast<std::size_t>(j * pr.d + j)] = 1.0;
      }
    }
    if (flushed) {
      for (double& x : pr.q) x = std::ldexp(x, 48);
      for (double& x : pr.k) x = std::ldexp(x, -64);
    }
    pr = rounded_to_bf16(pr);
    const int threads = flushed ? 1 : 0;
    const flushed_denormals ftz_daz(flushed);
    const auto fp32 = run_forward(pr, bf16_options(cpu_isa::avx2, threads));
    const auto got = run_forward(pr, bf16_options(cpu_isa::avx3, threads));
    int differ = 0;
    for (std::size_t e = 0; e < got.o.size(); ++e) differ += (got.o[e] > 0.0) != (fp32.o[e] > 0.0);
    EXPECT_EQ(differ, 0) << pr.describe() << (flushed ? " scaled, FTZ and DAZ" : "");
  }
}

/// The fused forward's near-tie contest (tests/common/near_ties.hpp) as a problem: B = 1, Lq = 40
/// (a task of 32 rows and one of 8, more than the decode kernel's rows), Lk = 96, H = 2, Hkv = 1,
/// d = 128, every query row the contest's, V = I (d >= Lk: O's row is P). @p q_small: 1 makes
/// max|q| sum|k| the tighter of near_tie_bound's two bounds, 2^-14 the norms'. @p contest gets the contest.
problem contest_problem(pattern pat, std::mt19937_64& rng, rounding_contest& contest, double q_small = 1.0) {
  problem pr;
  pr.B = 1, pr.Lq = 40, pr.Lk = 96, pr.H = 2, pr.Hkv = 1, pr.d = 128, pr.pat = pat;
  contest = make_rounding_contest(pat.m, pr.Lk, pr.d, rng, q_small);
  pr.q.resize(static_cast<std::size_t>(pr.q_numel()));
  for (std::int64_t row = 0; row < pr.Lq * pr.H; ++row) {
    std::copy(contest.q_row.begin(), contest.q_row.end(), pr.q.begin() + row * pr.d);
  }
  pr.k = contest.k;
  pr.v.assign(static_cast<std::size_t>(pr.kv_numel()), 0.0);
  for (std::int64_t j = 0; j < pr.Lk; ++j) pr.v[static_cast<std::size_t>(j * pr.d + j)] = 1.0;
  return pr;
}

TEST(Cpu, NearTiesAsFarApartAsTheBoundsAllowFollowTheFusedOrder) {
  // The fused forward on every ISA, fp32 and bf16 inputs, keeps the keys that its fp32 micro-kernel's
  // order of additions ranks first, also where that order and the exact one disagree by a fifth of
  // select_amx's bound for settling a pair (tests/common/near_ties.hpp: the micro-kernel moves each
  // score by about half a ulp per column, up for one kind of key and down for the other, while the
  // AMX tiles' sums of pairs stay near exact). AmxKeepsTheFp32Selection cannot tell a bound many
  // times too small from the right one. select_amx's per-key bound goes through one of two, per
  // row the smaller over the keys (near_tie_bound): max|q| sum_c |k_c|, the tighter one with q_small = 1 (q = 1: ||q|| =
  // sqrt(d)), and through ||q|| ||k||, the tighter one with q_small = 2^-14 (||q|| = max|q| = 1, and
  // sum_c |k_c| 1.1-1.7 times ||k||). On a CPU with AMX this test fails with the first divided by 6
  // (by 5 it still settles the widest pairs), or the second by 6 (by 5 it passes). contest_problem: V = I.
  std::mt19937_64 rng(test_seed() + 23);
  for (const auto& [pat, q_small] : {std::pair{pattern{1, 2}, 1.0}, std::pair{pattern{2, 4}, 1.0},
                                     std::pair{pattern{1, 2}, 0x1p-14}, std::pair{pattern{2, 4}, 0x1p-14}}) {
    rounding_contest contest;
    const problem pr = contest_problem(pat, rng, contest, q_small);
    ASSERT_TRUE(same_bits(rounded_to_bf16(pr).k, pr.k)) << "every value of the contest is a bf16";
    for (cpu_isa isa : runnable_isas()) {
      for (dtype type : {dtype::f32, dtype::bf16}) {
        run_options opt = bf16_options(isa);
        opt.type = type;
        const auto got = run_forward(pr, opt);
        int wrong = 0;
        for (std::int64_t row = 0; row < pr.Lq * pr.H; ++row) {
          for (std::int64_t j = 0; j < pr.Lk; ++j) {
            wrong += (got.o[static_cast<std::size_t>(row * pr.d + j)] > 0.0) != contest.kept[static_cast<std::size_t>(j)];
          }
        }
        EXPECT_EQ(wrong, 0) << pr.describe() << " " << dtype_name(type) << " isa=" << cpu_isa_name(isa) << " q_small=" << q_small;
      }
    }
  }
}

TEST(Cpu, BackwardWithoutTheOutputKeepsTheFusedOrderOnNearTies) {
  // The backward without O and LSE recomputes them with its ISA's forward (run_cpu_backward, p.fp32_weights),
  // and its D = rowsum(dO O) must come from the keys its own fp32 selection keeps. On a CPU with
  // AMX that forward scores bf16 inputs on the tiles without running P V there; until 2026-12-06 it
  // then compacted the tiles' scores without settling their near ties, and dQ missed by up to 185
  // here. The contest of NearTiesAsFarApartAsTheBoundsAllowFollowTheFusedOrder (contest_problem:
  // every query row the same, V = I); the expected dQ in fp64 from the contest's kept keys (the fused order):
  // P over the kept keys, O = P, dP = dO, D = dO . P, dS = P (dP - D), dQ = scale sum_j dS_j k_j,
  // each column within 2^-12 of sum_j |dS_j k_jc| scale (fp32 scores of 128 terms and fp32 weights
  // stay within 2^-16 of it here; the missed settling put every element of dQ outside).
  std::mt19937_64 rng(test_seed() + 24);
  for (pattern pat : {pattern{1, 2}, pattern{2, 4}}) {
    rounding_contest contest;
    problem pr = contest_problem(pat, rng, contest);
    std::uniform_int_distribution<int> eighths(-8, 8);
    pr.dout.resize(static_cast<std::size_t>(pr.q_numel()));
    for (double& x : pr.dout) x = eighths(rng) / 8.0;
    const double scale = pr.resolved_scale();
    // Per query row (b = 0, row i, head h at q row index (i H + h)): the fp64 dQ and its tolerance.
    std::vector<double> want(pr.dout.size()), tol(pr.dout.size());
    std::vector<double> score(static_cast<std::size_t>(pr.Lk));
    double top = -kInf;
    for (std::int64_t j = 0; j < pr.Lk; ++j) {
      double sum = 0;
      for (std::int64_t c = 0; c < pr.d; ++c) sum += contest.q_row[static_cast<std::size_t>(c)] * pr.k[static_cast<std::size_t>(j * pr.d + c)];
      score[static_cast<std::size_t>(j)] = scale * sum;
      if (contest.kept[static_cast<std::size_t>(j)]) top = std::max(top, scale * sum);
    }
    std::vector<double> prob(static_cast<std::size_t>(pr.Lk), 0.0);
    double total = 0;
    for (std::int64_t j = 0; j < pr.Lk; ++j) {
      if (contest.kept[static_cast<std::size_t>(j)]) total += prob[static_cast<std::size_t>(j)] = std::exp(score[static_cast<std::size_t>(j)] - top);
    }
    for (double& x : prob) x /= total;
    for (std::int64_t row = 0; row < pr.Lq * pr.H; ++row) {
      const double* dout = pr.dout.data() + row * pr.d;
      double D = 0;
      for (std::int64_t j = 0; j < pr.Lk; ++j) D += dout[j] * prob[static_cast<std::size_t>(j)];
      for (std::int64_t j = 0; j < pr.Lk; ++j) {
        const double ds = prob[static_cast<std::size_t>(j)] * (dout[j] - D);
        for (std::int64_t c = 0; c < pr.d; ++c) {
          const double kc = pr.k[static_cast<std::size_t>(j * pr.d + c)];
          want[static_cast<std::size_t>(row * pr.d + c)] += scale * ds * kc;
          tol[static_cast<std::size_t>(row * pr.d + c)] += 0x1p-12 * scale * std::abs(ds * kc);
        }
      }
    }
    for (cpu_isa isa : runnable_isas()) {
      for (dtype type : {dtype::f32, dtype::bf16}) {
        run_options opt = bf16_options(isa);
        opt.type = type;
        const auto got = run_backward(pr, opt);  // no O or LSE given: the backward's own forward
        int wrong = 0;
        for (std::size_t e = 0; e < want.size(); ++e) wrong += !(std::abs(got.dq[e] - want[e]) <= tol[e] + 1e-12);
        EXPECT_EQ(wrong, 0) << pr.describe() << " " << dtype_name(type) << " isa=" << cpu_isa_name(isa);
      }
    }
  }
}

TEST(Cpu, AmxWithAMaskGivenAsABias) {
  // A bias of 0 and -inf only keeps the AMX tiles (uses_amx, bias_masks_): -inf from each
  // sequence's length on gives the bits that those key lengths give without a bias (AMX both; the
  // fp32 micro-kernel, where a bias sent it before, rounds otherwise). Lengths of whole key tiles,
  // so that both compute the same tiles; random inputs, dense, 1:2 and 2:4, causal and not.
  const auto isas = runnable_isas();
  if (std::find(isas.begin(), isas.end(), cpu_isa::avx3) == isas.end() || !avx3_scores_on_amx()) {
    GTEST_SKIP() << "the avx3 forward scores on AMX tiles only on a CPU with AMX (and DFSS_CPU_AMX not 0)";
  }
  std::mt19937_64 rng(test_seed() + 22);
  for (pattern pat : {pattern{1, 1}, pattern{1, 2}, pattern{2, 4}}) {
    for (bool causal : {false, true}) {
      problem with_lengths;
      with_lengths.B = 2, with_lengths.Lq = 40, with_lengths.Lk = 700, with_lengths.H = 4, with_lengths.Hkv = 2;
      with_lengths.d = 64, with_lengths.pat = pat, with_lengths.causal = causal;
      fill(with_lengths, rng);
      with_lengths = rounded_to_bf16(with_lengths);
      problem with_bias = with_lengths;
      with_lengths.key_lengths = {512, 256};
      with_bias.has_bias = with_bias.bias_b = true;
      with_bias.bias.assign(static_cast<std::size_t>(with_bias.bias_numel()), 0.0);
      for (std::size_t e = 0; e < with_bias.bias.size(); ++e) {
        const std::int64_t b = static_cast<std::int64_t>(e) / (with_bias.Lq * with_bias.Lk);
        if (static_cast<std::int64_t>(e) % with_bias.Lk >= with_lengths.key_lengths[static_cast<std::size_t>(b)]) {
          with_bias.bias[e] = -kInf;
        }
      }
      if (causal) {
        // Bottom-right causal rows against the lengths: the same positions with the bias's Lk.
        with_lengths.query_offset = with_bias.query_offset = {512 - 40, 256 - 40};
      }
      const auto want = run_forward(with_lengths, bf16_options(cpu_isa::avx3, 2));
      const auto got = run_forward(with_bias, bf16_options(cpu_isa::avx3, 2));
      EXPECT_EQ(want.o, got.o) << with_bias.describe();
      EXPECT_EQ(want.lse, got.lse) << with_bias.describe();
    }
  }
}

TEST(Cpu, Bf16DotMatchesReferenceOnRandomInputs) {
  // Real-valued bf16 inputs against the fp64 reference on the same (rounded) numbers: awkward
  // shapes, grouped heads, causal masks, key lengths, every pattern. Rows where a group's N-th and
  // (N+1)-th scores lie within the fp32 dot product's error (4 d eps_f32, inputs in [-1, 1]) may
  // keep another key and are skipped. O: test_cpu's fp32 bound plus kBf16Roundoff max|v| for P in
  // bf16; the LSE keeps the fp32 bound (it comes from the unrounded weights).
  if (!bf16_dot_runs()) GTEST_SKIP() << "this CPU or build has no avx3_bf16";
  std::mt19937_64 rng(test_seed() + 19);
  for (auto pr : cpu_shapes(rng, /*integers=*/false)) {
    pr.has_bias = false;  // keep the near-tie analysis to Q K^T alone
    pr = rounded_to_bf16(pr);
    const auto want = run_forward(pr);
    const auto got = run_forward(pr, bf16_options(cpu_isa::avx3_bf16, 1));
    const auto ties = near_tie_rows(pr, 4.0 * static_cast<double>(pr.d) * kEps32);
    const double lse_tol = (16.0 + static_cast<double>(pr.Lk)) * kEps32;
    ASSERT_TRUE(rows_near_except_ties(got.o, want.o, ties, pr.d, output_tol(pr, dtype::f32, true))) << pr.describe();
    // LSE rows are [B, H, Lq]; tie rows are [B, Lq, H].
    for (std::int64_t b = 0; b < pr.B; ++b)
      for (std::int64_t h = 0; h < pr.H; ++h)
        for (std::int64_t i = 0; i < pr.Lq; ++i) {
          const std::size_t x = static_cast<std::size_t>((b * pr.H + h) * pr.Lq + i);
          if (ties[static_cast<std::size_t>((b * pr.Lq + i) * pr.H + h)]) continue;
          if (std::isinf(want.lse[x])) {
            EXPECT_EQ(got.lse[x], want.lse[x]) << pr.describe();
          } else {
            EXPECT_NEAR(got.lse[x], want.lse[x], lse_tol * (1 + std::abs(want.lse[x]))) << pr.describe();
          }
        }
    const auto many = run_forward(pr, bf16_options(cpu_isa::avx3_bf16, 3));
    EXPECT_TRUE(same_bits(got.o, many.o) && same_bits(got.lse, many.lse)) << pr.describe() << ": 1 vs 3 threads";
  }
}

TEST(Cpu, Bf16DotOnLargerShapesForEveryThreadCount) {
  // Several 128-key tiles (avx3_bf16's width), partial tiles, d below, between and above the
  // 32-column blocks of the P V loop (13, 64, 96, 128, 200), sink and recent windows, a bias: exact
  // (small-integer) scores, so the selection is the reference's and O is within the fp32 bound plus
  // the P rounding. 1, 2, 3 and 7 threads give the same bits.
  if (!bf16_dot_runs()) GTEST_SKIP() << "this CPU or build has no avx3_bf16";
  std::mt19937_64 rng(test_seed() + 20);
  struct shape {
    std::int64_t B, Lq, Lk, H, Hkv, d;
  };
  int variant = 0;
  for (const auto& s : {shape{1, 70, 300, 2, 1, 64}, shape{2, 33, 257, 2, 2, 13}, shape{1, 5, 520, 1, 1, 96},
                        shape{1, 40, 130, 3, 3, 128}, shape{1, 9, 200, 2, 1, 200}}) {
    for (pattern pat : {pattern{1, 1}, pattern{1, 2}, pattern{2, 4}, pattern{3, 8}, pattern{5, 7}}) {
      problem pr;
      pr.B = s.B, pr.Lq = s.Lq, pr.Lk = s.Lk, pr.H = s.H, pr.Hkv = s.Hkv, pr.d = s.d, pr.pat = pat;
      pr.causal = variant % 2 == 0;
      pr.has_bias = variant % 3 == 1;
      if (variant % 4 == 3) pr.sink = 5, pr.recent = 20;
      ++variant;
      fill(pr, rng, /*integers=*/true);
      const auto want = run_forward(pr);
      const auto got = run_forward(pr, bf16_options(cpu_isa::avx3_bf16, 1));
      double err = 0;
      for (std::size_t x = 0; x < got.o.size(); ++x) {
        ASSERT_TRUE(std::isfinite(got.o[x])) << pr.describe();
        err = std::max(err, std::abs(got.o[x] - want.o[x]));
      }
      EXPECT_LE(err, output_tol(pr, dtype::f32, true)) << pr.describe();
      for (int threads : {2, 3, 7}) {
        const auto many = run_forward(pr, bf16_options(cpu_isa::avx3_bf16, threads));
        EXPECT_TRUE(same_bits(got.o, many.o) && same_bits(got.lse, many.lse)) << pr.describe() << ", threads " << threads;
      }
    }
  }
}

TEST(Cpu, Bf16DotBackwardWithItsForwardsOutput) {
  // The avx3_bf16 backward given the avx3_bf16 forward's O and LSE (run_backward passes them when
  // a dLSE is given; here 0), on exact scores. Bounds: the fp32 ones of test_cpu_backward.cpp,
  // (64 + terms) eps_f32 (1 + max|want|), plus what O's P-in-bf16 error does to D = rowsum(dO O):
  // |dD| <= d max|dO| kBf16Roundoff max|v|, and dS = P (dP - D) moves by P |dD|, so dQ = scale
  // sum_j dS_j k_j by at most scale |dD| max|k| (the P of a row sum to 1), dK_j = scale sum_i
  // dS_ij q_i by at most scale group Lq |dD| max|q|, dBias by scale |dD| per summed entry; dV =
  // P^T dO does not read O.
  if (!bf16_dot_runs()) GTEST_SKIP() << "this CPU or build has no avx3_bf16";
  std::mt19937_64 rng(test_seed() + 21);
  int variant = 0;
  for (pattern pat : {pattern{1, 2}, pattern{2, 4}, pattern{3, 8}, pattern{1, 1}}) {
    problem pr;
    pr.B = 2, pr.Lq = 37, pr.Lk = 150, pr.H = 4, pr.Hkv = 2, pr.d = variant % 2 == 0 ? 24 : 64, pr.pat = pat;
    pr.causal = variant % 2 == 1;
    pr.has_bias = variant % 3 == 0, pr.bias_b = true, pr.bias_h = true;
    pr.key_lengths = {150, 101};
    ++variant;
    fill(pr, rng, /*integers=*/true);
    pr.dlse.assign(static_cast<std::size_t>(pr.B * pr.H * pr.Lq), 0.0);
    const auto want = run_backward(pr);
    const auto got = run_backward(pr, bf16_options(cpu_isa::avx3_bf16));
    const auto max_of = [](const std::vector<double>& x) {
      double m = 0;
      for (double e : x) m = std::max(m, std::abs(e));
      return m;
    };
    const double scale = pr.resolved_scale(), group_rows = static_cast<double>(pr.H / pr.Hkv * pr.Lq);
    const double dD = static_cast<double>(pr.d) * max_of(pr.dout) * kBf16Roundoff * max_of(pr.v);
    const auto check = [&](const std::vector<double>& g, const std::vector<double>& w, double terms, double extra,
                           const char* name) {
      ASSERT_EQ(g.size(), w.size()) << name;
      const double tol = (64.0 + terms) * kEps32 * (1.0 + max_of(w)) + extra;
      double err = 0;
      for (std::size_t x = 0; x < g.size(); ++x) {
        ASSERT_TRUE(std::isfinite(g[x])) << pr.describe() << " " << name << " at " << x;
        err = std::max(err, std::abs(g[x] - w[x]));
      }
      EXPECT_LE(err, tol) << pr.describe() << " " << name;
    };
    const double lk = static_cast<double>(pr.Lk);
    check(got.dq, want.dq, lk, scale * dD * max_of(pr.k), "dq");
    check(got.dk, want.dk, group_rows, scale * group_rows * dD * max_of(pr.q), "dk");
    check(got.dv, want.dv, group_rows, 0.0, "dv");
    if (pr.has_bias) check(got.dbias, want.dbias, lk, scale * dD, "dbias");
  }
}

}  // namespace
}  // namespace dfss::testing
