// The CPU three-stage pipeline (cpu_algorithm::three_stage) against the fp64 reference, the fused
// kernel and an independent computation of its compressed outputs.
//
// Tolerance policy (as in test_cpu.cpp, docs/testing.md): on small-integer inputs the scores are
// exact in fp32, so the selection must equal the reference's exactly and only the softmax and P V
// carry rounding, bounded by (16 + Lk) * eps_f32 * max|v| (+ half an ulp of a 16-bit output type).
// The compressed values, indices and metadata are then checked bit for bit against a computation
// written here (scores in double, a stable sort per group, the scale applied in fp32, metadata by
// dfss::nm_metadata_encode). On random inputs (every input type, rounded before the reference
// sees them), rows where some group's N-th and (N+1)-th scores lie within the fp32 dot-product
// error bound are excluded from the comparison with the reference and counted (at most 2%).
#include <gtest/gtest.h>

#include <cstring>

#include "common/run.hpp"
#include "common/testing.hpp"
#include "dfss/format.hpp"

namespace dfss::testing {
namespace {

constexpr double kEps32 = 1.0 / (1 << 23);

double output_tol(const problem& pr, dtype out) {
  double vmax = 0;
  for (double x : pr.v) vmax = std::max(vmax, std::abs(x));
  const double ulp_out = out == dtype::f16 ? 1.0 / 1024 : (out == dtype::bf16 ? 1.0 / 128 : 0.0);
  return (16.0 + static_cast<double>(pr.Lk)) * kEps32 * vmax + ulp_out * vmax;
}

bool hardware_pattern(pattern p) { return (p.n == 1 && p.m == 2) || (p.n == 2 && p.m == 4); }
std::int64_t slots_per_row(const problem& pr) { return (pr.Lk + pr.pat.m - 1) / pr.pat.m * pr.pat.n; }
std::int64_t words_per_row(const problem& pr) { return (pr.Lk + 15) / 16; }

/// How one three-stage (or fused) call is made.
struct ts_options {
  dtype type = dtype::f32;
  dtype out_type = dtype::f64;  // f64: same as type
  bool bhld = false;            // q, k, v, o as [B, H, L, d] memory; compressed as [B, Lq, H, .] memory
  int threads = 0;
  bool compressed = false;      // ask for compressed values and indices
  bool meta = false;            // ask for the metadata (1:2 and 2:4 only)
  bool want_lse = true;
  cpu_algorithm algorithm = cpu_algorithm::three_stage;
};

/// Outputs as fp64 in packed [B, Lq, H, d] / [B, H, Lq] order, compressed outputs packed
/// [B, H, Lq, slots] / [B, H, Lq, words].
struct ts_result {
  std::vector<double> o, lse;
  std::vector<float> values;
  std::vector<std::int32_t> indices;
  std::vector<std::uint16_t> meta;
};

/// A [B, H, Lq, w] compressed output buffer, packed or stored as [B, Lq, H, w] memory.
template <typename E>
struct compressed_store {
  std::vector<E> data;
  tensor_view view;
  std::int64_t B = 0, H = 0, Lq = 0, w = 0;
  bool permuted = false;

  void init(std::int64_t b, std::int64_t h, std::int64_t lq, std::int64_t width, bool perm, E poison) {
    B = b, H = h, Lq = lq, w = width, permuted = perm;
    data.assign(static_cast<std::size_t>(B * H * Lq * w), poison);
    view = permuted ? make_strided_view(data.data(), {B, H, Lq, w}, {Lq * H * w, w, H * w, 1})
                    : make_view(data.data(), {B, H, Lq, w});
  }
  std::vector<E> packed() const {
    std::vector<E> out(data.size());
    for (std::int64_t b = 0; b < B; ++b)
      for (std::int64_t h = 0; h < H; ++h)
        for (std::int64_t i = 0; i < Lq; ++i)
          for (std::int64_t k = 0; k < w; ++k) {
            const std::int64_t from = permuted ? ((b * Lq + i) * H + h) * w + k : ((b * H + h) * Lq + i) * w + k;
            out[static_cast<std::size_t>(((b * H + h) * Lq + i) * w + k)] = data[static_cast<std::size_t>(from)];
          }
    return out;
  }
};

constexpr std::uint16_t kPoisonWord = 0xFFFF;  // four 0xF nibbles: illegal in every format
constexpr std::int32_t kPoisonIndex = -7;

ts_result run_cpu(const problem& pr, const ts_options& opt) {
  run_options ro;
  ro.type = opt.type;
  ro.out_type = opt.out_type;
  return detail::dispatch(ro, [&]<typename T, typename O>() {
    detail::stored<T> q, k, v;
    detail::stored<O> o;
    q.init(pr.B, pr.Lq, pr.H, pr.d, opt.bhld);
    k.init(pr.B, pr.Lk, pr.Hkv, pr.d, opt.bhld);
    v.init(pr.B, pr.Lk, pr.Hkv, pr.d, opt.bhld);
    o.init(pr.B, pr.Lq, pr.H, pr.d, opt.bhld);  // poisoned with NaN
    q.load(pr.q);
    k.load(pr.k);
    v.load(pr.v);
    std::vector<float> lse(static_cast<std::size_t>(pr.B * pr.H * pr.Lq), static_cast<float>(kNaN));
    std::vector<double> bias = pr.bias;
    std::vector<std::int64_t> lens = pr.key_lengths;
    forward_args a;
    a.q = q.view, a.k = k.view, a.v = v.view, a.out = o.view;
    if (opt.want_lse) a.lse = make_view(lse.data(), {pr.B, pr.H, pr.Lq});
    if (pr.has_bias) a.bias = make_view(bias.data(), {pr.bias_b ? pr.B : 1, pr.bias_h ? pr.H : 1, pr.Lq, pr.Lk});
    if (!lens.empty()) a.key_lengths = make_view(lens.data(), {pr.B});
    compressed_store<float> cv;
    compressed_store<std::int32_t> ci;
    compressed_store<std::uint16_t> cm;
    if (opt.compressed) {
      cv.init(pr.B, pr.H, pr.Lq, slots_per_row(pr), opt.bhld, std::numeric_limits<float>::quiet_NaN());
      ci.init(pr.B, pr.H, pr.Lq, slots_per_row(pr), opt.bhld, kPoisonIndex);
      a.compressed_values = cv.view;
      a.compressed_indices = ci.view;
    }
    if (opt.meta) {
      cm.init(pr.B, pr.H, pr.Lq, words_per_row(pr), opt.bhld, kPoisonWord);
      a.compressed_meta = cm.view;
    }
    attention_config cfg;
    cfg.pattern = pr.pat;
    cfg.scale = pr.scale;
    cfg.causal = pr.causal;
    cfg.backend = backend::cpu;
    cfg.num_threads = opt.threads;
    cfg.cpu_algorithm = opt.algorithm;
    cfg.cpu_isa = cpu_isa::generic;
    attention_forward(a, cfg);
    ts_result r;
    r.o = o.packed();
    if (opt.want_lse) r.lse = widen(lse);
    if (opt.compressed) {
      r.values = cv.packed();
      r.indices = ci.packed();
    }
    if (opt.meta) r.meta = cm.packed();
    return r;
  });
}

/// The compressed outputs computed independently: scores in double on the problem's (exactly
/// representable) inputs, masks, a stable sort per group (NaN first, then by value descending,
/// padding positions last), kept positions in increasing order, value = fp32(scale) * score
/// rounded to fp32 (-inf where masked or padding), metadata by dfss::nm_metadata_encode.
struct expected_compressed {
  std::vector<float> values;
  std::vector<std::int32_t> indices;
  std::vector<std::uint16_t> meta;
};

expected_compressed compute_expected(const problem& pr) {
  expected_compressed e;
  const std::int64_t M = pr.pat.m, N = pr.pat.n, G = (pr.Lk + M - 1) / M;
  const float scale = static_cast<float>(pr.resolved_scale());
  for (std::int64_t b = 0; b < pr.B; ++b)
    for (std::int64_t h = 0; h < pr.H; ++h) {
      const std::int64_t hk = h / (pr.H / pr.Hkv);
      for (std::int64_t i = 0; i < pr.Lq; ++i) {
        std::vector<double> s(static_cast<std::size_t>(G * M), -kInf);
        for (std::int64_t j = 0; j < pr.Lk; ++j) {
          double acc = 0;
          for (std::int64_t c = 0; c < pr.d; ++c)
            acc += pr.q[static_cast<std::size_t>(((b * pr.Lq + i) * pr.H + h) * pr.d + c)] *
                   pr.k[static_cast<std::size_t>(((b * pr.Lk + j) * pr.Hkv + hk) * pr.d + c)];
          if (pr.has_bias) {
            const std::int64_t bb = pr.bias_b ? b : 0, hb = pr.bias_h ? h : 0;
            acc += pr.bias[static_cast<std::size_t>(((bb * (pr.bias_h ? pr.H : 1) + hb) * pr.Lq + i) * pr.Lk + j)];
          }
          const bool pad = !pr.key_lengths.empty() && j >= pr.key_lengths[static_cast<std::size_t>(b)];
          const bool fut = pr.causal && j > i + (pr.Lk - pr.Lq);
          s[static_cast<std::size_t>(j)] = (pad || fut) ? -kInf : acc;
        }
        for (std::int64_t g = 0; g < G; ++g) {
          std::vector<std::int64_t> pos;
          for (std::int64_t j = g * M; j < (g + 1) * M; ++j) pos.push_back(j);
          std::stable_sort(pos.begin(), pos.end(), [&](std::int64_t x, std::int64_t y) {
            const bool rx = x < pr.Lk, ry = y < pr.Lk;
            if (rx != ry) return rx;  // real keys before padding
            if (!rx) return false;
            const double sx = s[static_cast<std::size_t>(x)], sy = s[static_cast<std::size_t>(y)];
            if (std::isnan(sx) != std::isnan(sy)) return std::isnan(sx);
            return sx > sy;
          });
          pos.resize(static_cast<std::size_t>(N));
          std::sort(pos.begin(), pos.end());
          for (std::int64_t j : pos) {
            const double sj = s[static_cast<std::size_t>(j)];
            const bool minus_inf = j >= pr.Lk || sj == -kInf;
            e.values.push_back(minus_inf ? -std::numeric_limits<float>::infinity()
                                         : static_cast<float>(static_cast<double>(scale) * sj));
            e.indices.push_back(static_cast<std::int32_t>(j));
          }
        }
      }
    }
  if (hardware_pattern(pr.pat)) {
    const meta_format f = pr.pat.n == 1 ? meta_format::sm80_16bit_1of2 : meta_format::sm80_16bit_2of4;
    e.meta.resize(static_cast<std::size_t>(pr.B * pr.H * pr.Lq * words_per_row(pr)));
    nm_metadata_encode(e.indices.data(), pr.B * pr.H * pr.Lq, pr.Lk, pr.pat, f, e.meta.data());
  }
  return e;
}

bool same_bits(float a, float b) { return std::memcmp(&a, &b, sizeof a) == 0; }

/// Awkward shapes: Lq, Lk not multiples of the query tile (32), the key block (128) or M; Lq != Lk;
/// grouped heads; masks emptying whole groups and rows. Patterns from 1:2 to 7:16 and dense.
std::vector<problem> shapes(std::mt19937_64& rng, bool integers) {
  std::vector<problem> out;
  struct shape {
    std::int64_t B, Lq, Lk, H, Hkv, d;
  };
  const shape list[] = {{1, 1, 1, 1, 1, 1},    {2, 7, 70, 4, 2, 5},   {1, 33, 129, 3, 1, 16},
                        {2, 65, 9, 2, 2, 64},  {1, 4, 200, 2, 1, 3},  {1, 40, 300, 2, 2, 8}};
  const pattern patterns[] = {{1, 2}, {2, 4}, {3, 8}, {7, 16}, {1, 1}, {2, 3}};
  int variant = 0;
  for (const auto& s : list)
    for (const auto& pat : patterns) {
      problem p;
      p.B = s.B, p.Lq = s.Lq, p.Lk = s.Lk, p.H = s.H, p.Hkv = s.Hkv, p.d = s.d, p.pat = pat;
      p.causal = variant % 2 == 1;
      p.has_bias = variant % 3 == 1;
      p.bias_b = variant % 4 < 2;
      p.bias_h = variant % 4 == 1 || variant % 4 == 2;
      if (variant % 5 == 3) {
        for (std::int64_t b = 0; b < p.B; ++b) p.key_lengths.push_back(b == 1 ? 0 : p.Lk - p.Lk / 3);
      }
      fill(p, rng, integers);
      out.push_back(p);
      ++variant;
    }
  return out;
}

void expect_close_to_reference(const problem& pr, const ts_result& got, const forward_result& want, dtype out,
                               const std::string& what) {
  double err = 0;
  for (std::size_t x = 0; x < got.o.size(); ++x) {
    ASSERT_TRUE(std::isfinite(got.o[x])) << what << " at " << x;
    err = std::max(err, std::abs(got.o[x] - want.o[x]));
  }
  EXPECT_LE(err, output_tol(pr, out)) << what;
  for (std::size_t x = 0; x < got.lse.size(); ++x) {
    if (std::isinf(want.lse[x])) {
      ASSERT_EQ(got.lse[x], want.lse[x]) << what << " lse " << x;
    } else {
      ASSERT_NEAR(got.lse[x], want.lse[x], (16.0 + static_cast<double>(pr.Lk)) * kEps32 * (1 + std::abs(want.lse[x])))
          << what << " lse " << x;
    }
  }
}

void expect_compressed_exact(const problem& pr, const ts_result& got, bool meta, const std::string& what) {
  const expected_compressed want = compute_expected(pr);
  ASSERT_EQ(got.values.size(), want.values.size()) << what;
  for (std::size_t x = 0; x < want.values.size(); ++x) {
    ASSERT_TRUE(same_bits(got.values[x], want.values[x]))
        << what << " value " << x << ": got " << got.values[x] << ", want " << want.values[x];
    ASSERT_EQ(got.indices[x], want.indices[x]) << what << " index " << x;
  }
  if (meta) {
    ASSERT_EQ(got.meta.size(), want.meta.size()) << what;
    for (std::size_t x = 0; x < want.meta.size(); ++x)
      ASSERT_EQ(got.meta[x], want.meta[x]) << what << " meta word " << x;
  }
}

TEST(CpuThreeStage, SelectorNamesTheThreeStageKernel) {
  std::vector<float> q(2 * 4 * 8), k(q), v(q), o(q.size());
  forward_args a;
  a.q = make_view(q.data(), {1, 4, 2, 8});
  a.k = make_view(k.data(), {1, 4, 2, 8});
  a.v = make_view(v.data(), {1, 4, 2, 8});
  a.out = make_view(o.data(), {1, 4, 2, 8});
  attention_config cfg;
  cfg.backend = backend::cpu;
  cfg.cpu_algorithm = cpu_algorithm::three_stage;
  const kernel_selection s = select_kernel(a, cfg);
  EXPECT_EQ(s.kind, kernel_kind::cpu_three_stage_forward);
  EXPECT_EQ(s.name, "cpu.three_stage_forward.generic");
}

TEST(CpuThreeStage, MatchesReferenceAndCompressedOutputsAreExactOnIntegerInputs) {
  std::mt19937_64 rng(test_seed() + 21);
  int variant = 0;
  for (const auto& pr : shapes(rng, /*integers=*/true)) {
    const auto want = run_forward(pr);
    for (dtype t : {dtype::f32, dtype::f16, dtype::bf16}) {
      for (dtype out : {t, dtype::f32}) {
        if (t == dtype::f32 && out == dtype::f32 && variant % 2 == 1) continue;  // f32 -> f32 once
        ts_options opt;
        opt.type = t;
        opt.out_type = out;
        opt.bhld = (variant + static_cast<int>(t) + static_cast<int>(out)) % 2 == 1;
        opt.compressed = true;
        opt.meta = hardware_pattern(pr.pat);
        const auto got = run_cpu(pr, opt);
        const std::string what = pr.describe() + " " + dtype_name(t) + "->" + dtype_name(out) +
                                 (opt.bhld ? " [B,H,L,d]" : " [B,L,H,d]");
        expect_close_to_reference(pr, got, want, out, what);
        expect_compressed_exact(pr, got, opt.meta, what);
        if (::testing::Test::HasFatalFailure()) return;
      }
    }
    ++variant;
  }
}


TEST(CpuThreeStage, MatchesReferenceAndFusedOnRandomInputs) {
  // Random reals in every input type, against the fp64 reference on the same (rounded) inputs and
  // against the fused kernel (which shares the selection code, so it is no oracle of it): O and LSE
  // of every row whose selection cannot flip, and the LSE of every row against the fused kernel.
  std::mt19937_64 rng(test_seed() + 22);
  int variant = 0;
  for (auto pr : shapes(rng, /*integers=*/false)) {
    pr.has_bias = false;  // keep the near-tie analysis to Q K^T alone
    for (dtype t : {dtype::f32, dtype::f16, dtype::bf16}) {
      problem rounded = pr;  // the fp64 oracle sees exactly the kernel's inputs
      for (auto* x : {&rounded.q, &rounded.k, &rounded.v}) {
        if (t == dtype::f32) *x = round_through<float>(*x);
        if (t == dtype::f16) *x = round_through<half>(*x);
        if (t == dtype::bf16) *x = round_through<bfloat16>(*x);
      }
      const auto want = run_forward(rounded);
      ts_options opt;
      opt.type = t;
      opt.out_type = dtype::f32;
      opt.bhld = variant++ % 2 == 1;
      const auto got = run_cpu(rounded, opt);
      opt.algorithm = cpu_algorithm::fused;
      const auto fused = run_cpu(rounded, opt);
      const std::string what = rounded.describe() + " " + dtype_name(t);
      // fp32 dot products of d terms in [-1, 1]: error below d * eps_f32 (times 4 for margin). On a
      // near-tie row the fp32 kernels may keep a different key than the fp64 reference (and, with
      // differently contracted arithmetic, than each other); it is skipped and counted.
      const auto ties = near_tie_rows(rounded, 4.0 * static_cast<double>(rounded.d) * kEps32);
      std::size_t skipped = 0;
      ASSERT_TRUE(rows_near_except_ties(got.o, want.o, ties, rounded.d, output_tol(rounded, dtype::f32), &skipped)) << what;
      ASSERT_TRUE(rows_near_except_ties(got.o, fused.o, ties, rounded.d, 2 * output_tol(rounded, dtype::f32))) << what << " vs fused";
      const double lse_tol = (16.0 + static_cast<double>(rounded.Lk)) * kEps32;
      for (std::int64_t b = 0; b < rounded.B; ++b)
        for (std::int64_t h = 0; h < rounded.H; ++h)
          for (std::int64_t i = 0; i < rounded.Lq; ++i) {
            const auto x = static_cast<std::size_t>((b * rounded.H + h) * rounded.Lq + i);
            const bool tie = ties[static_cast<std::size_t>((b * rounded.Lq + i) * rounded.H + h)];
            if (std::isinf(want.lse[x])) {
              ASSERT_EQ(got.lse[x], want.lse[x]) << what;
            } else if (!tie) {
              ASSERT_NEAR(got.lse[x], want.lse[x], lse_tol * (1 + std::abs(want.lse[x]))) << what << " lse " << x;
            }
            // LSE is continuous in the scores, so a flipped selection in a near tie barely moves it.
            if (std::isfinite(fused.lse[x])) {
              ASSERT_NEAR(got.lse[x], fused.lse[x], 2 * lse_tol * (1 + std::abs(fused.lse[x]))) << what << " vs fused";
            } else {
              ASSERT_EQ(got.lse[x], fused.lse[x]) << what << " vs fused";
            }
          }
      EXPECT_LE(skipped, ties.size() / 50 + 1) << "too many near-tie rows to be a meaningful test: " << what;
    }
  }
}

TEST(CpuThreeStage, AgreesWithFusedOnIntegerInputsForEveryType) {
  std::mt19937_64 rng(test_seed() + 23);
  for (const auto& pr : shapes(rng, /*integers=*/true)) {
    for (dtype t : {dtype::f32, dtype::f16, dtype::bf16}) {
      ts_options opt;
      opt.type = t;
      opt.out_type = dtype::f32;
      const auto got = run_cpu(pr, opt);
      opt.algorithm = cpu_algorithm::fused;
      const auto fused = run_cpu(pr, opt);
      for (std::size_t x = 0; x < got.o.size(); ++x)
        ASSERT_NEAR(got.o[x], fused.o[x], 2 * output_tol(pr, dtype::f32)) << pr.describe() << " " << dtype_name(t);
      for (std::size_t x = 0; x < got.lse.size(); ++x) {
        if (std::isinf(fused.lse[x])) {
          ASSERT_EQ(got.lse[x], fused.lse[x]) << pr.describe();
        } else {
          ASSERT_NEAR(got.lse[x], fused.lse[x], 2 * (16.0 + static_cast<double>(pr.Lk)) * kEps32 * (1 + std::abs(fused.lse[x])))
              << pr.describe();
        }
      }
    }
  }
}

TEST(CpuThreeStage, ExportedValuesAreTheOnesTheSoftmaxConsumes) {
  // Rebuild O and LSE in fp64 from the exported values and indices alone: they must reproduce the
  // kernel's output to fp32 rounding, on random inputs where no exact oracle of the selection exists.
  std::mt19937_64 rng(test_seed() + 24);
  problem pr;
  pr.B = 2, pr.Lq = 45, pr.Lk = 150, pr.H = 4, pr.Hkv = 2, pr.d = 24, pr.pat = {2, 4}, pr.causal = true;
  pr.has_bias = true, pr.bias_h = true;
  pr.key_lengths = {150, 77};
  fill(pr, rng);
  pr.v = round_through<float>(pr.v);
  ts_options opt;
  opt.compressed = true;
  opt.meta = true;
  opt.bhld = true;
  const auto got = run_cpu(pr, opt);
  const std::int64_t S = slots_per_row(pr);
  for (std::int64_t b = 0; b < pr.B; ++b)
    for (std::int64_t h = 0; h < pr.H; ++h)
      for (std::int64_t i = 0; i < pr.Lq; ++i) {
        const std::size_t row = static_cast<std::size_t>(((b * pr.H + h) * pr.Lq + i) * S);
        double mx = -kInf;
        for (std::int64_t k = 0; k < S; ++k) mx = std::max(mx, static_cast<double>(got.values[row + static_cast<std::size_t>(k)]));
        const std::size_t lse_at = static_cast<std::size_t>((b * pr.H + h) * pr.Lq + i);
        std::vector<double> o(static_cast<std::size_t>(pr.d), 0.0);
        if (mx == -kInf) {
          ASSERT_EQ(got.lse[lse_at], -kInf);
        } else {
          double sum = 0;
          for (std::int64_t k = 0; k < S; ++k) sum += std::exp(static_cast<double>(got.values[row + static_cast<std::size_t>(k)]) - mx);
          ASSERT_NEAR(got.lse[lse_at], mx + std::log(sum), (16.0 + static_cast<double>(pr.Lk)) * kEps32 * (1 + std::abs(mx)));
          for (std::int64_t k = 0; k < S; ++k) {
            const double val = static_cast<double>(got.values[row + static_cast<std::size_t>(k)]);
            const std::int32_t j = got.indices[row + static_cast<std::size_t>(k)];
            if (val == -kInf) continue;
            ASSERT_LT(j, pr.Lk);
            ASSERT_GE(j, 0);
            for (std::int64_t c = 0; c < pr.d; ++c)
              o[static_cast<std::size_t>(c)] += std::exp(val - mx) / sum *
                                                pr.v[static_cast<std::size_t>(((b * pr.Lk + j) * pr.Hkv + h / 2) * pr.d + c)];
          }
        }
        for (std::int64_t c = 0; c < pr.d; ++c)
          ASSERT_NEAR(got.o[static_cast<std::size_t>(((b * pr.Lq + i) * pr.H + h) * pr.d + c)], o[static_cast<std::size_t>(c)],
                      output_tol(pr, dtype::f32))
              << "b=" << b << " h=" << h << " i=" << i << " seed=" << test_seed();
      }
  // The metadata encodes the exported indices.
  std::vector<std::uint16_t> words(got.meta.size());
  nm_metadata_encode(got.indices.data(), pr.B * pr.H * pr.Lq, pr.Lk, pr.pat, meta_format::sm80_16bit_2of4, words.data());
  EXPECT_EQ(words, got.meta);
}

TEST(CpuThreeStage, ResultsAreBitwiseIdenticalForAnyThreadCount) {
  std::mt19937_64 rng(test_seed() + 25);
  for (pattern pat : {pattern{2, 4}, pattern{1, 2}, pattern{3, 7}}) {
    problem pr;
    pr.B = 2, pr.Lq = 77, pr.Lk = 201, pr.H = 3, pr.Hkv = 1, pr.d = 16, pr.causal = true, pr.pat = pat;
    pr.has_bias = true;
    fill(pr, rng);
    ts_options opt;
    opt.compressed = true;
    opt.meta = hardware_pattern(pat);
    opt.threads = 1;
    const auto one = run_cpu(pr, opt);
    for (int t : {2, 3, 7}) {
      opt.threads = t;
      const auto many = run_cpu(pr, opt);
      EXPECT_EQ(std::memcmp(one.o.data(), many.o.data(), one.o.size() * sizeof(double)), 0) << t << " threads";
      EXPECT_EQ(std::memcmp(one.lse.data(), many.lse.data(), one.lse.size() * sizeof(double)), 0) << t << " threads";
      EXPECT_EQ(std::memcmp(one.values.data(), many.values.data(), one.values.size() * sizeof(float)), 0) << t << " threads";
      EXPECT_EQ(one.indices, many.indices) << t << " threads";
      EXPECT_EQ(one.meta, many.meta) << t << " threads";
    }
  }
}

TEST(CpuThreeStage, EveryOutputIsWrittenWithoutLse) {
  // Outputs are poisoned (NaN, index -7, word 0xFFFF) by the harness; with no LSE requested, a
  // strided compressed layout and tile-crossing rows, every element must still be written.
  std::mt19937_64 rng(test_seed() + 26);
  problem pr;
  pr.B = 1, pr.Lq = 35, pr.Lk = 19, pr.H = 2, pr.Hkv = 1, pr.d = 7, pr.pat = {1, 2};
  fill(pr, rng, true);
  ts_options opt;
  opt.compressed = true;
  opt.meta = true;
  opt.want_lse = false;
  opt.bhld = true;
  const auto got = run_cpu(pr, opt);
  for (double x : got.o) ASSERT_TRUE(std::isfinite(x));
  for (float x : got.values) ASSERT_FALSE(std::isnan(x));
  for (std::int32_t j : got.indices) ASSERT_GE(j, 0);
  for (std::uint16_t w : got.meta) ASSERT_NE(w, kPoisonWord);
  expect_compressed_exact(pr, got, true, pr.describe());
}

TEST(CpuThreeStage, EmptyRowsAndNaN) {
  std::mt19937_64 rng(test_seed() + 27);
  problem pr;
  pr.B = 2, pr.Lq = 12, pr.Lk = 9, pr.d = 4, pr.causal = true;  // rows 0..2 see no key (Lq > Lk)
  pr.key_lengths = {9, 0};
  fill(pr, rng);
  pr.q[static_cast<std::size_t>(10 * 4 + 2)] = kNaN;  // batch 0, row 10
  ts_options opt;
  opt.compressed = true;
  opt.meta = true;
  const auto got = run_cpu(pr, opt);
  const auto want = run_forward(pr);
  EXPECT_LE(max_rel_err(got.lse, want.lse), 1e-5);
  for (std::size_t x = 0; x < got.o.size(); ++x) {
    EXPECT_EQ(std::isnan(got.o[x]), std::isnan(want.o[x])) << x;
    if (want.o[x] == 0.0) {
      EXPECT_EQ(got.o[x], 0.0) << x;
    }
  }
  EXPECT_TRUE(std::isnan(got.o[static_cast<std::size_t>(10 * 4)]));
  EXPECT_TRUE(std::isnan(got.lse[10]));
  EXPECT_EQ(got.lse[0], -kInf);
  // Batch 1 has no valid key: every kept value is -inf, the indices are the lowest positions of
  // each group (and the 9th key's group keeps its padding position 9), metadata all-padding words.
  const std::int64_t S = slots_per_row(pr);
  for (std::int64_t i = 0; i < pr.Lq; ++i) {
    const std::size_t row = static_cast<std::size_t>((pr.Lq + i) * S);
    const std::int32_t want_idx[] = {0, 1, 4, 5, 8, 9};
    for (std::int64_t k = 0; k < S; ++k) {
      EXPECT_EQ(got.values[row + static_cast<std::size_t>(k)], -std::numeric_limits<float>::infinity());
      EXPECT_EQ(got.indices[row + static_cast<std::size_t>(k)], want_idx[k]);
    }
    EXPECT_EQ(got.meta[static_cast<std::size_t>(pr.Lq + i)], 0x4444);
  }
  // Row 10 of batch 0 keeps its NaN scores: exported as NaN.
  bool any_nan = false;
  for (std::int64_t k = 0; k < S; ++k) any_nan = any_nan || std::isnan(got.values[static_cast<std::size_t>(10 * S + k)]);
  EXPECT_TRUE(any_nan);
}

TEST(CpuThreeStage, NaNInValuesReachesOnlyRowsThatKeepTheKey) {
  std::mt19937_64 rng(test_seed() + 28);
  problem pr;
  pr.B = 1, pr.Lq = 40, pr.Lk = 16, pr.d = 3, pr.pat = {1, 4};
  fill(pr, rng, true);
  // Row 0 surely keeps key 5 (its score 9 against -9 for keys 4, 6 and 7); the other rows decide
  // by their random queries.
  for (std::int64_t c = 0; c < pr.d; ++c) {
    pr.q[static_cast<std::size_t>(c)] = 1;
    for (std::int64_t j : {4, 5, 6, 7}) pr.k[static_cast<std::size_t>(j * pr.d + c)] = j == 5 ? 3 : -3;
  }
  pr.v[static_cast<std::size_t>(5 * 3 + 1)] = kNaN;  // key 5, channel 1
  ts_options opt;
  opt.compressed = true;
  const auto got = run_cpu(pr, opt);
  const auto want = run_forward(pr);
  std::size_t nan_rows = 0;
  for (std::int64_t i = 0; i < pr.Lq; ++i) {
    bool keeps5 = false;
    for (std::int64_t k = 0; k < slots_per_row(pr); ++k)
      keeps5 = keeps5 || got.indices[static_cast<std::size_t>(i * slots_per_row(pr) + k)] == 5;
    for (std::int64_t c = 0; c < pr.d; ++c) {
      const std::size_t x = static_cast<std::size_t>(i * pr.d + c);
      EXPECT_EQ(std::isnan(got.o[x]), std::isnan(want.o[x])) << "row " << i;
      EXPECT_EQ(std::isnan(got.o[x]), keeps5 && c == 1) << "row " << i;
    }
    nan_rows += keeps5 ? 1 : 0;
  }
  EXPECT_GT(nan_rows, 0u) << pr.describe();
}

// ---- Validation of the compressed outputs --------------------------------------------------------

struct validation_case {
  std::vector<float> q, k, v, o, values;
  std::vector<std::int32_t> indices;
  std::vector<std::uint16_t> meta;
  std::vector<double> values64;
  forward_args a;
  attention_config cfg;

  // B = 1, Lq = 5, Lk = 10, H = 2, d = 4; 2:4 gives G * N = 3 * 2 = 6 slots and 1 word per row.
  validation_case() : q(40), k(80), v(80), o(40), values(60), indices(60), meta(10), values64(60) {
    a.q = make_view(q.data(), {1, 5, 2, 4});
    a.k = make_view(k.data(), {1, 10, 2, 4});
    a.v = make_view(v.data(), {1, 10, 2, 4});
    a.out = make_view(o.data(), {1, 5, 2, 4});
    a.compressed_values = make_view(values.data(), {1, 2, 5, 6});
    a.compressed_indices = make_view(indices.data(), {1, 2, 5, 6});
    a.compressed_meta = make_view(meta.data(), {1, 2, 5, 1});
    cfg.backend = backend::cpu;
    cfg.cpu_algorithm = cpu_algorithm::three_stage;
  }
};

void expect_invalid(const validation_case& vc, std::initializer_list<const char*> fragments) {
  const status st = try_attention_forward(vc.a, vc.cfg);
  EXPECT_EQ(st.code, status_code::invalid_argument) << st.message;
  for (const char* f : fragments) EXPECT_NE(st.message.find(f), std::string::npos) << st.message << " lacks " << f;
}

TEST(CpuThreeStage, ValidCaseRuns) {
  validation_case vc;
  EXPECT_TRUE(try_attention_forward(vc.a, vc.cfg).ok());
}

TEST(CpuThreeStage, CompressedOutputsNeedTheThreeStageAlgorithm) {
  validation_case vc;
  vc.cfg.cpu_algorithm = cpu_algorithm::fused;
  expect_invalid(vc, {"'compressed_values'", "three_stage"});
  validation_case ref;
  ref.cfg.backend = backend::reference;
  expect_invalid(ref, {"'compressed_values'", "cpu backend"});
  validation_case meta_only;
  meta_only.a.compressed_values = {};
  meta_only.a.compressed_indices = {};
  meta_only.cfg.cpu_algorithm = cpu_algorithm::fused;
  expect_invalid(meta_only, {"'compressed_meta'", "three_stage"});
}

TEST(CpuThreeStage, MetadataOnlyForHardwarePatterns) {
  validation_case vc;
  vc.cfg.pattern = {3, 8};  // G * N = 2 * 3 = 6 slots still
  expect_invalid(vc, {"'compressed_meta'", "1:2 or 2:4", "3:8"});
  vc.a.compressed_meta = {};
  EXPECT_TRUE(try_attention_forward(vc.a, vc.cfg).ok());
}

TEST(CpuThreeStage, CompressedShapesTypesAndPairing) {
  {
    validation_case vc;
    vc.a.compressed_values = make_view(vc.values.data(), {1, 2, 5, 5});
    expect_invalid(vc, {"'compressed_values'", "shape[3]", "ceil(Lk / M) * N", "6", "got 5"});
  }
  {
    validation_case vc;
    vc.a.compressed_values = make_view(vc.values64.data(), {1, 2, 5, 6});
    expect_invalid(vc, {"'compressed_values'", "element type f32", "f64"});
  }
  {
    validation_case vc;
    std::vector<float> other(60);
    vc.a.compressed_indices = make_view(other.data(), {1, 2, 5, 6});
    expect_invalid(vc, {"'compressed_indices'", "element type i32", "f32"});
  }
  {
    validation_case vc;
    vc.a.compressed_indices = {};
    expect_invalid(vc, {"'compressed_indices'", "together"});
  }
  {
    validation_case vc;
    vc.a.compressed_values = {};
    expect_invalid(vc, {"'compressed_values'", "together"});
  }
  {
    validation_case vc;
    vc.a.compressed_indices = make_strided_view(vc.indices.data(), {1, 2, 5, 6}, {60, 6, 12, 1});
    expect_invalid(vc, {"'compressed_indices'", "strides"});
  }
  {
    validation_case vc;
    vc.a.compressed_meta = make_view(vc.meta.data(), {1, 2, 5, 2});
    vc.meta.resize(20);
    vc.a.compressed_meta = make_view(vc.meta.data(), {1, 2, 5, 2});
    expect_invalid(vc, {"'compressed_meta'", "ceil(Lk / 16)", "got 2"});
  }
  {
    validation_case vc;
    vc.a.compressed_meta = make_view(vc.indices.data(), {1, 2, 5, 1});
    expect_invalid(vc, {"'compressed_meta'", "element type u16"});
  }
  {
    validation_case vc;
    vc.a.compressed_indices = make_view(reinterpret_cast<std::int32_t*>(vc.values.data()), {1, 2, 5, 6});
    expect_invalid(vc, {"'compressed_values'", "disjoint", "compressed_indices"});
  }
}

}  // namespace
}  // namespace dfss::testing
