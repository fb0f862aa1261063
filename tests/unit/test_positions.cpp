// Positions (key_offset, query_offset), dense sink and recent windows, and the LSE gradient
// (docs/semantics.md, "Positions", "Sink and recent windows", "Backward"): the reference against the
// naive oracle of tests/common (which states the rules key by key and shares no code with the
// library), every fused CPU kernel against the reference, and the exact merge of key shards, forward
// and backward.
//
// Tolerances: the policy of test_cpu.cpp (forward) and tests/common/gradients.hpp (backward) on
// small-integer inputs, whose scores, hence selections, are exact in fp32.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "common/gradients.hpp"
#include "common/run.hpp"
#include "common/testing.hpp"
#include "dfss/build_info.hpp"
#include "dfss/merge.hpp"

namespace dfss::testing {
namespace {

constexpr double kFp64Tol = 1e-9;  // fp64 reference vs fp64 oracle: summation order only

double forward_tol(const problem& pr) { return (16.0 + static_cast<double>(pr.Lk)) * kEps32 * (1.0 + max_abs(pr.v)); }

void expect_forward_close(const forward_result& got, const forward_result& want, double tol, const std::string& what) {
  ASSERT_EQ(got.o.size(), want.o.size()) << what;
  for (std::size_t x = 0; x < got.o.size(); ++x) {
    ASSERT_TRUE(std::isfinite(got.o[x])) << what << " o[" << x << "]";
    ASSERT_NEAR(got.o[x], want.o[x], tol) << what << " o[" << x << "]";
  }
  for (std::size_t x = 0; x < got.lse.size(); ++x) {
    if (std::isinf(want.lse[x])) {
      ASSERT_EQ(got.lse[x], want.lse[x]) << what << " lse[" << x << "]";
    } else {
      ASSERT_NEAR(got.lse[x], want.lse[x], tol * std::max(1.0, std::abs(want.lse[x]))) << what << " lse[" << x << "]";
    }
  }
}

/// Problems that use every position feature: shards (key_offset), speculative decoding against a
/// padded cache (query_offset per sequence with key lengths), sink and recent windows that cover
/// part of a group, key lengths beyond the tensor (global lengths of a shard), rows without keys.
std::vector<problem> position_problems(std::mt19937_64& rng) {
  std::vector<problem> out;
  const pattern patterns[] = {{2, 4}, {1, 2}, {1, 4}, {3, 4}, {3, 8}, {1, 1}};
  int variant = 0;
  for (const pattern& pat : patterns) {
    for (int v = 0; v < 4; ++v, ++variant) {
      problem p;
      p.pat = pat;
      p.B = 2, p.H = 4, p.Hkv = v % 2 == 0 ? 2 : 4, p.d = 5 + v;
      p.Lq = 1 + 3 * v, p.Lk = 37 + 13 * v;
      p.causal = v != 2;
      p.key_offset = pat.m * (v * 5);
      const std::int64_t end = p.key_offset + p.Lk;
      switch (v) {
        case 0:  // a decode step against a padded cache: each sequence's own length and position
          p.key_lengths = {end - 9, end - 20};
          p.query_offset = {end - 9 - p.Lq, end - 20 - p.Lq};
          p.sink = 4, p.recent = 6;
          break;
        case 1:  // a shard of a longer sequence: global lengths beyond the tensor, queries after it
          p.key_lengths = {end + 50, end - 7};
          p.query_offset = {end + 40, end - 7 - p.Lq};
          p.recent = 2 * pat.m + 1;
          break;
        case 2:  // no causal mask: the recent window ends at each sequence's last key
          p.key_lengths = {end - 3, p.key_offset};  // batch 1 sees no key at all
          p.sink = p.key_offset + 5, p.recent = 3;
          break;
        default:  // queries before the keys: every row empty or nearly so
          p.query_offset = {p.key_offset - p.Lq + 2, p.key_offset + 11};
          p.sink = 1;
          break;
      }
      p.has_bias = variant % 5 == 2;
      p.bias_h = true;
      fill(p, rng, /*integers=*/true);
      p.dlse.resize(static_cast<std::size_t>(p.B * p.H * p.Lq));
      std::uniform_int_distribution<int> u(-3, 3);
      for (double& x : p.dlse) x = u(rng);
      out.push_back(p);
    }
  }
  return out;
}

TEST(Positions, ReferenceMatchesTheNaiveOracle) {
  std::mt19937_64 rng(test_seed() + 101);
  for (const problem& pr : position_problems(rng)) {
    const forward_result got = run_forward(pr);
    const naive_result want = naive_forward(pr);
    expect_forward_close(got, {want.o, want.lse}, kFp64Tol, pr.describe());
    const backward_result g = run_backward(pr);
    const backward_result w = naive_backward(pr);
    for (auto [a, b, name] : {std::tuple{&g.dq, &w.dq, "dq"}, std::tuple{&g.dk, &w.dk, "dk"},
                              std::tuple{&g.dv, &w.dv, "dv"}, std::tuple{&g.dbias, &w.dbias, "dbias"}}) {
      ASSERT_EQ(a->size(), b->size());
      for (std::size_t x = 0; x < a->size(); ++x) ASSERT_NEAR((*a)[x], (*b)[x], kFp64Tol) << name << "[" << x << "] " << pr.describe();
    }
  }
}

TEST(Positions, WindowsMatterAndTheLseGradientMatters) {
  // Guards against a test that cannot fail: the oracle does see the windows and dLSE.
  std::mt19937_64 rng(test_seed() + 102);
  problem pr = position_problems(rng)[0];
  problem plain = pr;
  plain.sink = plain.recent = 0;
  plain.dlse.clear();
  const naive_result a = naive_forward(pr), b = naive_forward(plain);
  EXPECT_NE(a.keep, b.keep) << pr.describe();
  EXPECT_NE(naive_backward(pr).dq, naive_backward(plain).dq) << pr.describe();
}

TEST(Positions, FusedKernelsMatchTheReference) {
  std::mt19937_64 rng(test_seed() + 103);
  for (const problem& pr : position_problems(rng)) {
    const forward_result want = run_forward(pr);
    const backward_result wg = run_backward(pr);
    for (cpu_isa isa : runnable_cpu_isas()) {
      for (int threads : {1, 3}) {
        run_options opt;
        opt.isa = isa;
        opt.type = dtype::f32;
        opt.backend = backend::cpu;
        opt.threads = threads;
        opt.bhld = threads == 3;
        const std::string what = pr.describe() + " isa=" + cpu_isa_name(isa) + " threads=" + std::to_string(threads);
        expect_forward_close(run_forward(pr, opt), want, forward_tol(pr), what);
        const backward_result g = run_backward(pr, opt);
        const double group = static_cast<double>(pr.H / pr.Hkv);
        expect_grad_close(g.dq, wg.dq, static_cast<double>(pr.Lk), dtype::f32, what + " dq");
        expect_grad_close(g.dk, wg.dk, group * static_cast<double>(pr.Lq), dtype::f32, what + " dk");
        expect_grad_close(g.dv, wg.dv, group * static_cast<double>(pr.Lq), dtype::f32, what + " dv");
        if (pr.has_bias) expect_grad_close(g.dbias, wg.dbias, 1.0, dtype::f32, what + " dbias");
      }
    }
    // The three-stage pipeline takes positions too (its N-of-M format has no room for windows).
    problem plain = pr;
    plain.sink = plain.recent = 0;
    run_options opt;
    opt.type = dtype::f32, opt.backend = backend::cpu, opt.algorithm = cpu_algorithm::three_stage;
    expect_forward_close(run_forward(plain, opt), run_forward(plain), forward_tol(pr), plain.describe() + " three-stage");
  }
}

TEST(Positions, DefaultQueryOffsetIsBottomRightAndKeyLengthsClampToTheTensor) {
  std::mt19937_64 rng(test_seed() + 104);
  problem pr;
  pr.B = 2, pr.Lq = 9, pr.Lk = 50, pr.H = 2, pr.Hkv = 1, pr.d = 8, pr.causal = true, pr.key_offset = 8;
  pr.key_lengths = {58, 30};
  fill(pr, rng);
  problem explicit_pr = pr;
  explicit_pr.query_offset = {pr.key_offset + pr.Lk - pr.Lq, pr.key_offset + pr.Lk - pr.Lq};
  explicit_pr.key_lengths = {1000, 30};  // beyond the tensor: every key valid, as 58
  for (cpu_isa isa : runnable_cpu_isas()) {
    run_options opt;
    opt.isa = isa, opt.type = dtype::f32, opt.backend = backend::cpu;
    const forward_result a = run_forward(pr, opt), b = run_forward(explicit_pr, opt);
    EXPECT_EQ(a.o, b.o) << cpu_isa_name(isa);
    EXPECT_EQ(a.lse, b.lse) << cpu_isa_name(isa);
  }
}

TEST(Positions, WindowsCoveringEveryKeyAreDenseAttention) {
  std::mt19937_64 rng(test_seed() + 105);
  problem pr;
  pr.B = 1, pr.Lq = 6, pr.Lk = 45, pr.H = 2, pr.Hkv = 2, pr.d = 8, pr.pat = {1, 2}, pr.causal = true;
  fill(pr, rng, /*integers=*/true);
  problem dense = pr;
  dense.pat = {1, 1};
  const forward_result want = run_forward(dense);
  for (int which = 0; which < 2; ++which) {
    problem w = pr;
    (which == 0 ? w.sink : w.recent) = pr.Lk;
    for (cpu_isa isa : runnable_cpu_isas()) {
      run_options opt;
      opt.isa = isa, opt.type = dtype::f32, opt.backend = backend::cpu;
      expect_forward_close(run_forward(w, opt), want, forward_tol(w), w.describe() + " " + cpu_isa_name(isa));
    }
  }
}

/// The API's packed f32 buffers of one key shard [k0, k1) of @p pr, with positions made global:
/// key_offset k0, the whole problem's key lengths and query offsets.
problem shard(const problem& pr, std::int64_t k0, std::int64_t k1) {
  problem part = pr;
  take_keys(part, pr, k0, k1);
  part.key_offset = pr.key_offset + k0;
  if (part.query_offset.empty()) part.query_offset.assign(static_cast<std::size_t>(pr.B), pr.key_offset + pr.Lk - pr.Lq);
  if (part.key_lengths.empty()) part.key_lengths.assign(static_cast<std::size_t>(pr.B), pr.key_offset + pr.Lk);
  part.has_bias = false;
  return part;
}

std::vector<float> to_f32(const std::vector<double>& x) { return {x.begin(), x.end()}; }

TEST(Positions, KeyShardsMergeExactlyForwardAndBackward) {
  std::mt19937_64 rng(test_seed() + 106);
  for (const problem& base : position_problems(rng)) {
    problem pr = base;
    pr.has_bias = false;
    pr.bias.clear();
    pr.dlse.clear();
    const std::int64_t m = pr.pat.m;
    run_options opt;
    opt.type = dtype::f32, opt.backend = backend::cpu;
    const forward_result whole = run_forward(pr, opt);
    const backward_result wg = run_backward(pr, opt);
    for (std::int64_t split = m; split < pr.Lk; split += 5 * m) {
      SCOPED_TRACE(pr.describe() + " split=" + std::to_string(split));
      const problem a = shard(pr, 0, split), b = shard(pr, split, pr.Lk);
      const forward_result ra = run_forward(a, opt), rb = run_forward(b, opt);
      std::vector<float> oa = to_f32(ra.o), ob = to_f32(rb.o), la = to_f32(ra.lse), lb = to_f32(rb.lse);
      std::vector<float> o(oa.size()), lse(la.size());
      merge_args ma;
      ma.out_a = make_view(oa.data(), {pr.B, pr.Lq, pr.H, pr.d});
      ma.out_b = make_view(ob.data(), {pr.B, pr.Lq, pr.H, pr.d});
      ma.out = make_view(o.data(), {pr.B, pr.Lq, pr.H, pr.d});
      ma.lse_a = make_view(la.data(), {pr.B, pr.H, pr.Lq});
      ma.lse_b = make_view(lb.data(), {pr.B, pr.H, pr.Lq});
      ma.lse = make_view(lse.data(), {pr.B, pr.H, pr.Lq});
      merge_attention_states(ma);
      expect_forward_close({{o.begin(), o.end()}, {lse.begin(), lse.end()}}, whole, 2.0 * forward_tol(pr), "merge");

      // Backward per shard with the whole result's O and LSE (as ring attention does): dQ is the
      // sum over the shards, dK and dV are the shards' own.
      std::vector<float> wo = to_f32(whole.o), wl = to_f32(whole.lse), dout = to_f32(pr.dout), q = to_f32(pr.q);
      std::vector<double> dq(wg.dq.size(), 0.0), dk, dv;
      for (const problem* part : {&a, &b}) {
        std::vector<float> k = to_f32(part->k), v = to_f32(part->v);
        std::vector<float> pdq(q.size(), kNaN), pdk(k.size(), kNaN), pdv(k.size(), kNaN);
        std::vector<std::int64_t> lens = part->key_lengths, qoff = part->query_offset;
        backward_args ba;
        ba.q = make_view(q.data(), {pr.B, pr.Lq, pr.H, pr.d});
        ba.k = make_view(k.data(), {pr.B, part->Lk, pr.Hkv, pr.d});
        ba.v = make_view(v.data(), {pr.B, part->Lk, pr.Hkv, pr.d});
        ba.out = make_view(wo.data(), {pr.B, pr.Lq, pr.H, pr.d});
        ba.lse = make_view(wl.data(), {pr.B, pr.H, pr.Lq});
        ba.dout = make_view(dout.data(), {pr.B, pr.Lq, pr.H, pr.d});
        ba.dq = make_view(pdq.data(), {pr.B, pr.Lq, pr.H, pr.d});
        ba.dk = make_view(pdk.data(), {pr.B, part->Lk, pr.Hkv, pr.d});
        ba.dv = make_view(pdv.data(), {pr.B, part->Lk, pr.Hkv, pr.d});
        ba.key_lengths = make_view(lens.data(), {pr.B});
        ba.query_offset = make_view(qoff.data(), {pr.B});
        attention_config cfg;
        cfg.pattern = pr.pat, cfg.causal = pr.causal, cfg.backend = backend::cpu;
        cfg.key_offset = part->key_offset, cfg.sink_tokens = pr.sink, cfg.recent_tokens = pr.recent;
        attention_backward(ba, cfg);
        for (std::size_t x = 0; x < dq.size(); ++x) dq[x] += static_cast<double>(pdq[x]);
        // Shards as [B, Lk_part, Hkv, d]: interleave back into the whole's [B, Lk, Hkv, d].
        dk.resize(wg.dk.size()), dv.resize(wg.dv.size());
        const std::int64_t row = pr.Hkv * pr.d, k0 = part->key_offset - pr.key_offset;
        for (std::int64_t bb = 0; bb < pr.B; ++bb)
          for (std::int64_t x = 0; x < part->Lk * row; ++x) {
            dk[static_cast<std::size_t>((bb * pr.Lk + k0) * row + x)] = pdk[static_cast<std::size_t>(bb * part->Lk * row + x)];
            dv[static_cast<std::size_t>((bb * pr.Lk + k0) * row + x)] = pdv[static_cast<std::size_t>(bb * part->Lk * row + x)];
          }
      }
      const double group = static_cast<double>(pr.H / pr.Hkv);
      expect_grad_close(dq, wg.dq, 2.0 * static_cast<double>(pr.Lk), dtype::f32, "dq");
      expect_grad_close(dk, wg.dk, group * static_cast<double>(pr.Lq), dtype::f32, "dk");
      expect_grad_close(dv, wg.dv, group * static_cast<double>(pr.Lq), dtype::f32, "dv");
    }
  }
}

/// Runs @p f and expects a dfss::error whose message holds every string of @p parts.
template <typename F>
void expect_error(F&& f, std::initializer_list<const char*> parts) {
  try {
    f();
    ADD_FAILURE() << "no error; expected one mentioning '" << *parts.begin() << "'";
  } catch (const dfss::error& e) {
    for (const char* p : parts) EXPECT_NE(std::string(e.what()).find(p), std::string::npos) << e.what() << "\nmissing: " << p;
  }
}

TEST(Positions, BadArgumentsAreNamed) {
  std::vector<float> q(2 * 3 * 2 * 4, 0.5f), k(2 * 8 * 2 * 4, 0.25f), o(q.size()), lse(2 * 2 * 3);
  std::vector<std::int64_t> qoff{0, 5};
  std::vector<double> qoff_f{0, 5};
  forward_args a;
  a.q = make_view(q.data(), {2, 3, 2, 4});
  a.k = a.v = make_view(k.data(), {2, 8, 2, 4});
  a.out = make_view(o.data(), {2, 3, 2, 4});
  attention_config cfg;
  cfg.key_offset = 6;  // not a multiple of M = 4
  expect_error([&] { attention_forward(a, cfg); }, {"'config.key_offset'", "a multiple of M = 4", "got 6"});
  cfg.key_offset = -4;
  expect_error([&] { attention_forward(a, cfg); }, {"'config.key_offset'", "got -4"});
  cfg = {};
  cfg.sink_tokens = -1;
  expect_error([&] { attention_forward(a, cfg); }, {"'config.sink_tokens'", "got -1"});
  cfg = {};
  cfg.recent_tokens = 4, cfg.cpu_algorithm = cpu_algorithm::three_stage;
  expect_error([&] { attention_forward(a, cfg); }, {"'config.recent_tokens'", "three_stage", "fused"});
  cfg = {};
  qoff[1] = -1;
  a.query_offset = make_view(qoff.data(), {2});
  expect_error([&] { attention_forward(a, cfg); }, {"'query_offset'", "got -1 at index 1"});
  a.query_offset = make_view(qoff.data(), {1});
  expect_error([&] { attention_forward(a, cfg); }, {"'query_offset'", "batch"});
  a.query_offset = make_view(qoff_f.data(), {2});
  expect_error([&] { attention_forward(a, cfg); }, {"'query_offset'", "i32 or i64", "f64"});
  a.query_offset = {};
  // The CUDA backend names what it lacks (asked of the selector, which needs no GPU).
  cfg.sink_tokens = 4, cfg.backend = backend::cuda;
  const kernel_selection s = select_kernel(a, cfg);
  EXPECT_FALSE(s.supported());
  if (!get_build_info().cuda_architectures.empty()) {
    EXPECT_NE(s.reason.find("sink_tokens"), std::string::npos) << s.reason;
  }
  // dlse without the forward's out and lse.
  std::vector<float> dq(q.size()), dk(k.size()), dv(k.size()), dlse(lse.size());
  backward_args ba;
  ba.q = a.q, ba.k = a.k, ba.v = a.v, ba.dout = a.q;
  ba.dq = make_view(dq.data(), {2, 3, 2, 4});
  ba.dk = make_view(dk.data(), {2, 8, 2, 4});
  ba.dv = make_view(dv.data(), {2, 8, 2, 4});
  ba.dlse = make_view(dlse.data(), {2, 2, 3});
  expect_error([&] { attention_backward(ba, {}); }, {"'dlse'", "'out' and 'lse'"});
}

}  // namespace
}  // namespace dfss::testing
