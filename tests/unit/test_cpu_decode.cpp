// The decode forward of the SIMD family (src/cpu/simd/attention_decode.cpp): few query rows against a
// long KV cache, split over key chunks and merged exactly. Against the fp64 reference on fresh
// random inputs, for every runnable ISA (the selector picks the decode kernel for every SIMD target
// when Lq <= kDecodeMaxQueryRows; generic runs the scalar twin), f32, f16 and bf16 caches, awkward
// cache lengths (several chunks, partial tiles and groups), per-sequence key lengths (0, and ends
// inside a group), grouped and multi-query heads, causal masks with Lq > 1, a bias, and bitwise
// equality across thread counts. Non-finite and extreme inputs: test_extreme_values.cpp
// (ExtremeDecode.SlicesMatchReference).
// The fused forward's split keys (CpuSplitForward): with fewer than kSplitTargetTasks row tasks
// and long key ranges the fused forward splits each row task's keys into chunks merged the same
// exact way; same checks on shapes just above the decode kernel's Lq.
//
// Tolerance policy (test_cpu.cpp's): scores of small-integer inputs are exact in fp32, so the
// selection must be the reference's exactly, and each output is a convex combination of at most Lk
// rows of V with fp32 weights: (16 + Lk) eps_f32 max|v| (the merge of the chunks adds one rescale
// per chunk, far below the Lk term), plus half an ulp of a 16-bit output type.
#include <gtest/gtest.h>

#include <cstring>
#include <string>

#include "common/near_ties.hpp"
#include "common/run.hpp"
#include "common/testing.hpp"

namespace dfss::testing {
namespace {

constexpr double kEps32 = 1.0 / (1 << 23);

double max_abs_v(const problem& pr) {
  double vmax = 0;
  for (double x : pr.v) vmax = std::max(vmax, std::abs(x));
  return vmax;
}

double output_tol(const problem& pr) { return (16.0 + static_cast<double>(pr.Lk)) * kEps32 * max_abs_v(pr); }

/// output_tol plus, where the forward rounds P to bf16 (forward_rounds_p_to_bf16: a bf16 cache on
/// avx3_bf16, in the decode kernel's key-major P V and in the fused forward), kBf16Roundoff max|v|
/// (tests/common/testing.hpp derives it; vdpbf16ps's denormal flushes, below 2^-126 per step, fit
/// in output_tol's slack).
double value_tol(const problem& pr, cpu_isa isa, dtype t) {
  return output_tol(pr) + (forward_rounds_p_to_bf16(isa, t) ? kBf16Roundoff * max_abs_v(pr) : 0.0);
}

struct shape {
  std::int64_t B, Lq, Lk, H, Hkv, d;
  bool causal;
  bool bias;
  std::vector<std::int64_t> lens;  // empty: none
};

/// Shapes of a decode step: one row and speculative drafts (Lq up to 5), caches of 1 to 4099 keys
/// (1000 and 4099 split into several chunks; none a multiple of a tile or of M), GQA (8 / 2), MQA
/// (4 / 1) and MHA, key lengths with a 0 and ends inside a group of 4, d = 128, an odd d, and
/// d = 256 (on AVX-512 a Q K^T block of one row: eight keys per sum of lanes, store_sums8), and an
/// odd number of rows per kv head at d = 128 (group 3 times 3 drafts: the key-major P V's passes of
/// whole rows end with a pass of one row). The f32 and bf16 caches are [B, L, Hkv, d] memory (kv
/// heads interleaved: tasks of several kv heads, decode_head_block, on one thread, of one head on
/// more), the f16 ones [B, Hkv, L, d]; 3 kv heads make blocks of 2 and 1 on one thread. The last
/// shape has 128 (batch, kv head) pairs, so a [B, Hkv, L, d] cache is one chunk per pair and its
/// tasks walk three or (the shorter sequence) two key tiles of 1024 keys through the software
/// pipeline (a tile's P V after the next tile's scores); the [B, L, Hkv, d] ones two of 256 per task.
std::vector<shape> decode_shapes() {
  return {
      {1, 1, 1, 1, 1, 8, false, false, {}},
      {2, 1, 3, 4, 1, 13, false, false, {3, 1}},
      {2, 2, 63, 8, 2, 16, true, false, {63, 0}},
      {1, 3, 1000, 8, 2, 128, true, true, {}},
      {2, 4, 1000, 4, 1, 24, true, false, {1000, 517}},
      {2, 5, 4099, 8, 2, 64, false, false, {4099, 2053}},
      {1, 1, 4099, 2, 2, 128, false, false, {}},
      {1, 2, 300, 4, 2, 256, false, false, {300}},
      {1, 3, 700, 6, 2, 128, false, false, {}},
      {1, 2, 1300, 6, 3, 64, false, false, {}},
      {2, 2, 3001, 128, 64, 32, true, false, {3001, 2100}},
  };
}

problem make_problem(const shape& s, pattern pat, std::mt19937_64& rng, bool integers) {
  problem p;
  p.B = s.B, p.Lq = s.Lq, p.Lk = s.Lk, p.H = s.H, p.Hkv = s.Hkv, p.d = s.d;
  p.pat = pat;
  p.causal = s.causal;
  p.has_bias = s.bias;
  p.bias_b = true;
  p.bias_h = true;
  p.key_lengths = s.lens;
  fill(p, rng, integers);
  return p;
}

const pattern kPatterns[] = {{1, 2}, {2, 4}, {1, 4}, {3, 4}, {4, 4}};

std::string label(const problem& pr, cpu_isa isa, dtype t) {
  return pr.describe() + " isa=" + cpu_isa_name(isa) + " " + dtype_name(t);
}

/// The kernel the selector runs for @p pr on @p isa.
std::string selected(const problem& pr, cpu_isa isa) {
  std::vector<float> q(static_cast<std::size_t>(pr.q_numel())), kv(static_cast<std::size_t>(pr.kv_numel()));
  std::vector<float> o(q.size());
  forward_args a;
  a.q = make_view(q.data(), {pr.B, pr.Lq, pr.H, pr.d});
  a.k = a.v = make_view(kv.data(), {pr.B, pr.Lk, pr.Hkv, pr.d});
  a.out = make_view(o.data(), {pr.B, pr.Lq, pr.H, pr.d});
  attention_config c;
  c.pattern = pr.pat;
  c.backend = backend::cpu;
  c.cpu_isa = isa;
  return select_kernel(a, c).name;
}

TEST(CpuDecode, SelectorPicksTheDecodeKernelForFewQueryRows) {
  for (cpu_isa isa : runnable_cpu_isas()) {
    if (isa == cpu_isa::generic) continue;  // the scalar twin has no decode kernel
    const std::string name = cpu_isa_name(isa);
    for (std::int64_t lq : {1, 2, 8, 9, 64}) {
      problem pr;
      pr.Lq = lq, pr.Lk = 4096, pr.H = 8, pr.Hkv = 2, pr.d = 64;
      const std::string want = (lq <= 8 ? "cpu.decode_forward." : "cpu.fused_forward.") + name;
      EXPECT_EQ(selected(pr, isa), want) << "Lq=" << lq;
    }
  }
  problem pr;
  pr.Lq = 1, pr.Lk = 100, pr.H = 2, pr.Hkv = 1, pr.d = 32;
  const std::string automatic = selected(pr, cpu_isa::automatic);
  if (cpu_simd_isas().empty() || !cpu_simd_isas().front().supported) GTEST_SKIP() << "no runnable SIMD target";
  EXPECT_EQ(automatic.rfind("cpu.decode_forward.", 0), 0u) << automatic;
}

TEST(CpuDecode, MatchesReferenceOnExactScoresForEveryThreadCount) {
  std::mt19937_64 rng(test_seed() + 101);
  for (const shape& s : decode_shapes()) {
    for (pattern pat : kPatterns) {
      const problem pr = make_problem(s, pat, rng, /*integers=*/true);
      const auto want = run_forward(pr);  // small integers: exact in every storage type
      for (cpu_isa isa : runnable_cpu_isas()) {
        for (dtype t : {dtype::f32, dtype::f16, dtype::bf16}) {
          run_options opt;
          opt.type = t;
          opt.out_type = dtype::f32;
          opt.backend = backend::cpu;
          opt.isa = isa;
          opt.bhld = t == dtype::f16;  // a [B, H, L, d] cache: strided views
          opt.threads = 1;
          const auto one = run_forward(pr, opt);
          double err = 0;
          for (std::size_t x = 0; x < one.o.size(); ++x) {
            ASSERT_TRUE(std::isfinite(one.o[x])) << label(pr, isa, t) << " at " << x;
            err = std::max(err, std::abs(one.o[x] - want.o[x]));
          }
          EXPECT_LE(err, value_tol(pr, isa, t)) << label(pr, isa, t);
          for (std::size_t x = 0; x < one.lse.size(); ++x) {
            if (std::isinf(want.lse[x])) {
              EXPECT_EQ(one.lse[x], want.lse[x]) << label(pr, isa, t) << " LSE " << x;
            } else {
              EXPECT_NEAR(one.lse[x], want.lse[x],
                          (16.0 + static_cast<double>(pr.Lk)) * kEps32 * (1 + std::abs(want.lse[x])))
                  << label(pr, isa, t) << " LSE " << x;
            }
          }
          // The chunking depends on the shape only: the same bits for any thread count (poisoned
          // outputs, so every element must be written in each call).
          for (int threads : {2, 3, 7}) {
            opt.threads = threads;
            opt.poison = 4321.0;
            const auto many = run_forward(pr, opt);
            ASSERT_EQ(many.o.size(), one.o.size());
            EXPECT_EQ(0, std::memcmp(many.o.data(), one.o.data(), one.o.size() * sizeof(double)))
                << label(pr, isa, t) << " " << threads << " threads";
            EXPECT_EQ(0, std::memcmp(many.lse.data(), one.lse.data(), one.lse.size() * sizeof(double)))
                << label(pr, isa, t) << " " << threads << " threads";
          }
        }
      }
    }
  }
}

TEST(CpuDecode, MatchesReferenceOnRandomInputs) {
  // In fp32, and in bf16 (inputs rounded to bf16, so the reference sees what the kernel reads; a
  // bf16 cache on avx3_bf16 takes the bf16 dot products, whose near ties are settled like fp32's).
  std::mt19937_64 rng(test_seed() + 102);
  for (const shape& base : decode_shapes()) {
    shape s = base;
    s.bias = false;  // keep the near-tie analysis to Q K^T alone
    for (pattern pat : kPatterns) {
      const problem pr = make_problem(s, pat, rng, /*integers=*/false);
      for (dtype t : {dtype::f32, dtype::bf16}) {
        problem rt = pr;
        rt.q = t == dtype::f32 ? round_through<float>(pr.q) : round_through<bfloat16>(pr.q);
        rt.k = t == dtype::f32 ? round_through<float>(pr.k) : round_through<bfloat16>(pr.k);
        rt.v = t == dtype::f32 ? round_through<float>(pr.v) : round_through<bfloat16>(pr.v);
        const auto want = run_forward(rt);
        // fp32 dot products of d terms in [-1, 1]: error below d eps_f32 (times 4 for margin).
        const auto ties = near_tie_rows(rt, 4.0 * static_cast<double>(pr.d) * kEps32);
        for (cpu_isa isa : runnable_cpu_isas()) {
          const double tol = value_tol(pr, isa, t);
          run_options opt;
          opt.type = t;
          opt.out_type = dtype::f32;
          opt.backend = backend::cpu;
          opt.isa = isa;
          const auto got = run_forward(rt, opt);
          std::size_t skipped = 0;
          ASSERT_TRUE(rows_near_except_ties(got.o, want.o, ties, pr.d, tol, &skipped)) << label(pr, isa, t);
          // Long rows meet many groups, so a near tie somewhere in a row is not rare; most rows must
          // still be checked for the test to mean something.
          EXPECT_LE(skipped, ties.size() / 2 + 1) << "too many near-tie rows to be a meaningful test";
        }
      }
    }
  }
}

/// Whether a decode step of @p pr with a bf16 cache on @p isa runs its direct tiles on the AMX
/// tiles (decode_pass::tiles_fit): the AVX-512 kernel (avx3 or avx3_bf16) on a CPU with AMX, d a
/// multiple of 32 up to 128, 2 to 16 rows per kv head (group times query rows), kv heads not
/// interleaved in memory (a [B, Hkv, L, d] cache, @p bhld, or a single kv head).
bool decode_on_amx_tiles(const problem& pr, cpu_isa isa, bool bhld) {
  const cpu_isa runs = isa == cpu_isa::automatic ? automatic_cpu_isa() : isa;
  const std::int64_t rows = pr.H / pr.Hkv * pr.Lq;
  return (runs == cpu_isa::avx3 || runs == cpu_isa::avx3_bf16) && avx3_scores_on_amx() && pr.d % 32 == 0 &&
         pr.d <= 128 && rows >= 2 && rows <= 16 && (bhld || pr.Hkv == 1);
}

TEST(CpuDecode, GroupsOfRowsOnTheAmxTilesKeepFp32Weights) {
  // A bf16 cache with 2 to 16 rows per kv head (3 and 16 rows: the scores' transpose by gathers;
  // 12 and 16: two blocks of rows in P V), d = 32 to 128, caches that end inside a block of 16
  // keys, dense and sparse, random normal inputs rounded to bf16. On the AMX tiles each weight goes
  // into P V as two bf16 parts (to within 2^-18 of itself), so O must stay within the fp32 bound plus
  // 2^-18 max|v|, where rounding the weights to bf16 alone moves it by up to 2^-9 max|v|. Elsewhere
  // (no AMX, other ISAs) the usual bound (value_tol). 1 and 3 threads give the same bits.
  std::mt19937_64 rng(test_seed() + 117);
  const shape shapes[] = {
      {1, 1, 47, 4, 2, 32, false, false, {}},     {1, 1, 300, 6, 2, 64, true, false, {}},
      {2, 1, 1000, 8, 2, 128, false, false, {1000, 333}}, {1, 3, 515, 4, 1, 96, true, false, {}},
      {1, 1, 700, 16, 1, 128, false, false, {}},  {1, 1, 15, 8, 2, 128, false, false, {}},
  };
  constexpr double kSplitWeight = 1.0 / 262144;  // 2^-18
  int on_tiles = 0;
  for (const shape& s : shapes) {
    for (pattern pat : {pattern{4, 4}, pattern{1, 2}, pattern{2, 4}}) {
      problem pr = make_problem(s, pat, rng, /*integers=*/false);
      pr.q = round_through<bfloat16>(pr.q);
      pr.k = round_through<bfloat16>(pr.k);
      pr.v = round_through<bfloat16>(pr.v);
      const auto want = run_forward(pr);
      const auto ties = near_tie_rows(pr, 4.0 * static_cast<double>(pr.d) * kEps32);
      for (cpu_isa isa : runnable_cpu_isas()) {
        const bool tiles = decode_on_amx_tiles(pr, isa, /*bhld=*/true);
        on_tiles += tiles ? 1 : 0;
        const double tol = tiles ? output_tol(pr) + kSplitWeight * max_abs_v(pr) : value_tol(pr, isa, dtype::bf16);
        run_options opt;
        opt.bhld = true;  // [B, Hkv, L, d], transformers' cache: kv heads not interleaved
        opt.type = dtype::bf16;
        opt.out_type = dtype::f32;
        opt.backend = backend::cpu;
        opt.isa = isa;
        opt.threads = 1;
        const auto one = run_forward(pr, opt);
        std::size_t skipped = 0;
        ASSERT_TRUE(rows_near_except_ties(one.o, want.o, ties, pr.d, tol, &skipped)) << label(pr, isa, dtype::bf16);
        EXPECT_LE(skipped, ties.size() / 2 + 1) << "too many near-tie rows to be a meaningful test";
        opt.threads = 3;
        opt.poison = 4321.0;
        const auto many = run_forward(pr, opt);
        EXPECT_EQ(0, std::memcmp(many.o.data(), one.o.data(), one.o.size() * sizeof(double)))
            << label(pr, isa, dtype::bf16) << " 3 threads";
      }
    }
  }
  if (avx3_scores_on_amx()) {
    EXPECT_GT(on_tiles, 0) << "a CPU with AMX ran no shape on the tiles";
  }
}

/// Values exactly representable in bf16, as bf16 (a test failure where one is not).
std::vector<bfloat16> exact_bf16(const std::vector<float>& x) {
  std::vector<bfloat16> y(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) {
    y[i].bits = float_to_bf16(x[i]);
    EXPECT_EQ(bf16_to_float(y[i].bits), x[i]) << "value " << i << " is not a bf16";
  }
  return y;
}

/// The keys kept by a decode step of H query heads (one row each, Q [1, 1, H, d]) against one kv
/// head of Lk keys with V = I (d >= Lk; every input of type T), and by the fused backward of it with
/// dO = 1, which recomputes the selection in the fused forward's order: forward[h][j] where O of
/// head h is positive at j (its P), backward[j] where dV_j = sum_h P_hj is non-zero.
struct kept_keys {
  std::vector<std::vector<bool>> forward;
  std::vector<bool> backward;
};

template <typename T>
kept_keys decode_and_backward_keep(const std::vector<T>& q, const std::vector<T>& k, const std::vector<T>& v,
                                   std::int64_t H, std::int64_t Lk, std::int64_t d, pattern pat, cpu_isa isa,
                                   const std::string& where) {
  std::vector<T> dout(q.size());
  for (auto& x : dout) {
    if constexpr (std::is_same_v<T, float>) {
      x = 1.0f;
    } else {
      x.bits = float_to_bf16(1.0f);
    }
  }
  std::vector<float> o(q.size(), -1.0f), lse(static_cast<std::size_t>(H), -1.0f), dq(q.size(), -1.0f), dk(k.size(), -1.0f),
      dv(v.size(), -1.0f);
  forward_args f;
  f.q = make_view(q.data(), {1, 1, H, d});
  f.k = make_view(k.data(), {1, Lk, 1, d});
  f.v = make_view(v.data(), {1, Lk, 1, d});
  f.out = make_view(o.data(), {1, 1, H, d});
  f.lse = make_view(lse.data(), {1, H, 1});
  attention_config cfg;
  cfg.pattern = pat;
  cfg.backend = backend::cpu;
  cfg.cpu_isa = isa;
  EXPECT_EQ(select_kernel(f, cfg).name.rfind("cpu.decode_forward.", 0), 0u) << where;
  attention_forward(f, cfg);
  backward_args b;
  b.q = f.q, b.k = f.k, b.v = f.v, b.out = f.out, b.lse = f.lse;
  b.dout = make_view(dout.data(), {1, 1, H, d});
  b.dq = make_view(dq.data(), {1, 1, H, d});
  b.dk = make_view(dk.data(), {1, Lk, 1, d});
  b.dv = make_view(dv.data(), {1, Lk, 1, d});
  attention_backward(b, cfg);
  kept_keys kept;
  kept.forward.assign(static_cast<std::size_t>(H), std::vector<bool>(static_cast<std::size_t>(Lk)));
  kept.backward.assign(static_cast<std::size_t>(Lk), false);
  for (std::int64_t j = 0; j < Lk; ++j) {
    for (std::int64_t h = 0; h < H; ++h) {
      kept.forward[static_cast<std::size_t>(h)][static_cast<std::size_t>(j)] = o[static_cast<std::size_t>(h * d + j)] > 0.0f;
    }
    kept.backward[static_cast<std::size_t>(j)] = dv[static_cast<std::size_t>(j * d + j)] != 0.0f;
  }
  return kept;
}

TEST(CpuDecode, GroupsOfRowsKeepTheFusedSelectionOnNearTies) {
  // A bf16 cache with 4 query heads per kv head (on a CPU with AMX: the scores on the tiles, whose
  // summation order Intel leaves open) against near ties decided by rounding: every key is one base
  // row of values 1 and 1 + 2^-7 with one pair of neighbouring columns swapped (or none), every
  // query has its pairs of neighbouring columns one bf16 ulp apart, so two keys' exact scores differ
  // by 0 or 2^-14, an eighth of an fp32 ulp of the scores (about 4200, from a first column of 4096):
  // less than the rounding of their 64-term sums. With V = I
  // (d >= Lk) the output row of a head is its P, so key j was kept by a head iff O is positive
  // there; the fused backward recomputes the selection in the fp32 micro-kernel's order, and dV_j =
  // sum_i P_ij dO_i (dO = 1) is non-zero iff some head kept key j. A decode step that selected other
  // keys than the fused kernels (settle_near_ties with a bound too small for its sums) trips it.
  std::mt19937_64 rng(test_seed() + 118);
  const std::int64_t Lk = 48, d = 64, H = 4;
  std::uniform_int_distribution<int> pick(0, d / 2), mantissa(0, 127), sign(0, 1);
  for (cpu_isa isa : runnable_cpu_isas()) {
    if (isa == cpu_isa::generic) continue;  // the scalar twin has no decode kernel
    for (pattern pat : {pattern{1, 2}, pattern{2, 4}}) {
      std::vector<float> q(static_cast<std::size_t>(H * d)), k(static_cast<std::size_t>(Lk * d)),
          v(static_cast<std::size_t>(Lk * d), 0.0f);
      for (std::int64_t h = 0; h < H; ++h) {
        // Column 0 adds 4096 to every score: the sums then need more than fp32's 24 bits, so they
        // round, by an amount that depends on the order of the additions.
        q[static_cast<std::size_t>(h * d)] = 4096.0f;
        q[static_cast<std::size_t>(h * d + 1)] = 1.0f;
        for (std::int64_t c = 2; c < d; c += 2) {
          const float x = 1.0f + static_cast<float>(mantissa(rng)) / 128.0f;  // a bf16 in [1, 2)
          const float y = x + (sign(rng) != 0 ? 1.0f : -1.0f) / 128.0f;       // one ulp away
          q[static_cast<std::size_t>(h * d + c)] = x;
          q[static_cast<std::size_t>(h * d + c + 1)] = y;
        }
      }
      for (std::int64_t j = 0; j < Lk; ++j) {
        float* row = k.data() + j * d;
        for (std::int64_t c = 0; c < d; ++c) row[c] = c % 2 == 0 ? 1.0f : 1.0f + 1.0f / 128.0f;
        row[0] = row[1] = 1.0f;
        const int m = pick(rng);  // 0 and d / 2: no swap
        if (m > 0 && m < d / 2) std::swap(row[2 * m], row[2 * m + 1]);
        v[static_cast<std::size_t>(j * d + j)] = 1.0f;
      }
      const std::string where = pat.str() + " " + cpu_isa_name(isa) + " seed=" + std::to_string(test_seed());
      const kept_keys got = decode_and_backward_keep(exact_bf16(q), exact_bf16(k), exact_bf16(v), H, Lk, d, pat, isa, where);
      int kept_keys = 0;
      for (std::int64_t j = 0; j < Lk; ++j) {
        bool kept = false;
        for (std::int64_t h = 0; h < H; ++h) kept = kept || got.forward[static_cast<std::size_t>(h)][static_cast<std::size_t>(j)];
        kept_keys += kept ? 1 : 0;
        EXPECT_EQ(got.backward[static_cast<std::size_t>(j)], kept) << where << " key " << j;
      }
      EXPECT_LT(kept_keys, Lk) << "some key must be pruned by every head for the test to mean something";
    }
  }
}

TEST(CpuDecode, NearTiesAsFarApartAsTheBoundAllowsFollowTheFusedOrder) {
  // settle_near_ties rescores a group in the fused forward's order when two of its direct scores
  // are within 4 E, E = gamma_d max|k| sum|q| (the rounding bound of either order). The test above
  // cannot tell a bound 64 times too small from the right one: its scores round by far less than
  // E. Here (tests/common/near_ties.hpp) the fused order's rounding moves each score by about 0.64
  // E, up for one kind of key and down for the other, while the direct path's (lanes, tiles) stays
  // within a few ulps of exact, so every group is a near tie more than E wide: with the bound
  // divided by 4 the decode step selects otherwise than the fused kernels (fp32, and bf16 without
  // AMX; the AMX tiles' bound is twice as loose, and dividing it by 8 fails there). The fused
  // backward recomputes the selection in the fused order: dV (V = I, dO = 1) must be non-zero at
  // exactly the keys the forward kept, which must be the contest's.
  std::mt19937_64 rng(test_seed() + 119);
  const std::int64_t Lk = 96, d = 128, H = 4;
  for (cpu_isa isa : runnable_cpu_isas()) {
    if (isa == cpu_isa::generic) continue;  // the scalar twin has no decode kernel
    for (pattern pat : {pattern{1, 2}, pattern{2, 4}}) {
      for (dtype type : {dtype::f32, dtype::bf16}) {
        const rounding_contest contest = make_rounding_contest(pat.m, Lk, d, rng);
        std::vector<float> q(static_cast<std::size_t>(H * d)), k(contest.k.begin(), contest.k.end()),
            v(static_cast<std::size_t>(Lk * d), 0.0f);
        for (std::int64_t h = 0; h < H; ++h) std::copy(contest.q_row.begin(), contest.q_row.end(), q.begin() + h * d);
        for (std::int64_t j = 0; j < Lk; ++j) v[static_cast<std::size_t>(j * d + j)] = 1.0f;  // V = I: O of a head is its P
        const std::string where =
            pat.str() + " " + dtype_name(type) + " " + cpu_isa_name(isa) + " seed=" + std::to_string(test_seed());
        const kept_keys got = type == dtype::f32
                                  ? decode_and_backward_keep(q, k, v, H, Lk, d, pat, isa, where)
                                  : decode_and_backward_keep(exact_bf16(q), exact_bf16(k), exact_bf16(v), H, Lk, d, pat, isa, where);
        for (std::int64_t j = 0; j < Lk; ++j) {
          const bool want = contest.kept[static_cast<std::size_t>(j)];
          for (std::int64_t h = 0; h < H; ++h) {
            EXPECT_EQ(got.forward[static_cast<std::size_t>(h)][static_cast<std::size_t>(j)], want) << where << " head " << h << " key " << j;
          }
          EXPECT_EQ(got.backward[static_cast<std::size_t>(j)], want) << where << " key " << j << " (backward)";
        }
      }
    }
  }
}

TEST(CpuDecode, ManyChunksAndEmptyRows) {
  // One kv head, three sequences: 43 chunks wanted per sequence (decode_chunk_keys), rounded up to
  // whole key tiles, so 35 chunks of 2048 keys, each task walking two tiles and the merge folding
  // 35 partial states per row; batch 1's sequence is empty (O = 0, LSE = -inf) and batch 2's ends
  // inside a group; causal rows of a draft of 3 tokens.
  std::mt19937_64 rng(test_seed() + 103);
  shape s{3, 3, 70001, 4, 1, 8, true, false, {70001, 0, 30001}};
  const problem pr = make_problem(s, pattern{2, 4}, rng, /*integers=*/true);
  const auto want = run_forward(pr);
  for (cpu_isa isa : runnable_cpu_isas()) {
    run_options opt;
    opt.type = dtype::bf16;
    opt.out_type = dtype::f32;
    opt.backend = backend::cpu;
    opt.isa = isa;
    const auto got = run_forward(pr, opt);
    double err = 0;
    for (std::size_t x = 0; x < got.o.size(); ++x) err = std::max(err, std::abs(got.o[x] - want.o[x]));
    EXPECT_LE(err, value_tol(pr, isa, dtype::bf16)) << label(pr, isa, dtype::bf16);
    for (std::int64_t h = 0; h < pr.H; ++h)
      for (std::int64_t i = 0; i < pr.Lq; ++i) {
        EXPECT_EQ(got.lse[static_cast<std::size_t>((1 * pr.H + h) * pr.Lq + i)], -kInf);
        for (std::int64_t c = 0; c < pr.d; ++c)
          EXPECT_EQ(got.o[static_cast<std::size_t>(((1 * pr.Lq + i) * pr.H + h) * pr.d + c)], 0.0);
      }
    EXPECT_LE(max_rel_err(got.lse, want.lse), (16.0 + static_cast<double>(pr.Lk)) * kEps32) << label(pr, isa, dtype::bf16);
  }
}

/// Every runnable ISA on @p pr with 1 thread, in fp32 and, with @p bf16, in bf16 too (inputs of small
/// integers, times powers of two: exact in both; a bf16 cache on avx3_bf16 takes the bf16 dot
/// products, whose rounding of P value_tol allows), against the fp64 reference @p want (the NaN
/// pattern of O element by element, then the output tolerance; with @p check_lse the LSE too), and
/// with 3 threads bitwise equal to 1. The fused forward's shapes pass @p bf16 = false, to keep the
/// test time (CpuSplitForward.SixteenBitInputsAndOutputs covers bf16 there).
void expect_matches_on_every_isa(const problem& pr, const forward_result& want, bool check_lse, bool bf16 = true,
                                 bool bhld = false) {
  for (cpu_isa isa : runnable_cpu_isas()) {
    for (dtype t : {dtype::f32, dtype::bf16}) {
      if (t == dtype::bf16 && !bf16) continue;
      run_options opt;
      opt.bhld = bhld;
      opt.type = t;
      opt.out_type = dtype::f32;
      opt.backend = backend::cpu;
      opt.isa = isa;
      opt.threads = 1;
      const auto one = run_forward(pr, opt);
      double err = 0;
      for (std::size_t x = 0; x < one.o.size(); ++x) {
        ASSERT_EQ(std::isnan(one.o[x]), std::isnan(want.o[x])) << label(pr, isa, t) << " at " << x;
        if (!std::isnan(want.o[x])) err = std::max(err, std::abs(one.o[x] - want.o[x]));
      }
      EXPECT_LE(err, value_tol(pr, isa, t)) << label(pr, isa, t);
      if (check_lse) {
        EXPECT_LE(max_rel_err(one.lse, want.lse), (16.0 + static_cast<double>(pr.Lk)) * kEps32) << label(pr, isa, t);
      }
      opt.threads = 3;
      const auto many = run_forward(pr, opt);
      EXPECT_EQ(0, std::memcmp(many.o.data(), one.o.data(), one.o.size() * sizeof(double))) << label(pr, isa, t);
    }
  }
}

/// @p pr with a bias [B, 1, Lq, Lk] (broadcast over heads) of 0 for the keys @p keep(b, j) and -inf
/// for the others: a mask given as a bias.
template <typename Keep>
void set_mask_bias(problem& pr, Keep keep) {
  pr.has_bias = true;
  pr.bias_b = true;
  pr.bias_h = false;
  pr.bias.assign(static_cast<std::size_t>(pr.bias_numel()), 0.0);
  for (std::int64_t b = 0; b < pr.B; ++b) {
    for (std::int64_t i = 0; i < pr.Lq; ++i) {
      for (std::int64_t j = 0; j < pr.Lk; ++j) {
        if (!keep(b, j)) pr.bias[static_cast<std::size_t>((b * pr.Lq + i) * pr.Lk + j)] = -kInf;
      }
    }
  }
}

TEST(CpuDecode, MaskGivenAsABiasKeepsTheDirectPath) {
  // A bias of 0 and -inf only (left padding from dfss.transformers, a boolean attn_mask) masks keys
  // exactly, so the decode kernel keeps its direct path (bias_only_masks). Random inputs: -inf from
  // each sequence's length on gives the bits that those key lengths give without a bias, 1 and 3
  // threads, f32 and bf16 caches. Both runs take the direct path; the panel path sums in another
  // order, so a bias sent there differs in rounding. The lengths are whole key tiles (the decode
  // kernel's 1024 keys, kDecodeKeyTile), so the tiles both runs compute hold the same keys.
  std::mt19937_64 rng(test_seed() + 107);
  for (pattern pat : kPatterns) {
    shape s{2, 1, 2500, 8, 2, 64, false, false, {2048, 1024}};
    const problem with_lengths = make_problem(s, pat, rng, /*integers=*/false);
    problem with_bias = with_lengths;
    with_bias.key_lengths.clear();
    set_mask_bias(with_bias, [&](std::int64_t b, std::int64_t j) { return j < with_lengths.key_lengths[static_cast<std::size_t>(b)]; });
    for (cpu_isa isa : runnable_cpu_isas()) {
      if (isa == cpu_isa::generic) continue;  // the scalar twin has no decode kernel
      for (dtype t : {dtype::f32, dtype::bf16}) {
        for (int threads : {1, 3}) {
          run_options opt;
          opt.type = t;
          opt.out_type = dtype::f32;
          opt.backend = backend::cpu;
          opt.isa = isa;
          opt.threads = threads;
          const auto want = run_forward(with_lengths, opt);
          const auto got = run_forward(with_bias, opt);
          ASSERT_EQ(got.o.size(), want.o.size());
          EXPECT_EQ(0, std::memcmp(got.o.data(), want.o.data(), want.o.size() * sizeof(double)))
              << label(with_bias, isa, t) << " " << threads << " threads";
          EXPECT_EQ(0, std::memcmp(got.lse.data(), want.lse.data(), want.lse.size() * sizeof(double)))
              << label(with_bias, isa, t) << " " << threads << " threads";
        }
      }
    }
  }
}

TEST(CpuDecode, MaskGivenAsABiasMatchesReference) {
  // Left padding (the first keys of a sequence masked), holes, and a sequence with every key masked
  // (O = 0, LSE = -inf), as a bias of 0 and -inf, with 2 causal draft rows; every pattern, against the
  // fp64 reference on small integers; then one finite bias value in batch 0 (the call takes the
  // panel path) too.
  std::mt19937_64 rng(test_seed() + 108);
  for (pattern pat : kPatterns) {
    shape s{3, 2, 1100, 8, 2, 64, true, false, {}};
    problem pr = make_problem(s, pat, rng, /*integers=*/true);
    const std::int64_t pad[] = {37, 600, 1100};
    set_mask_bias(pr, [&](std::int64_t b, std::int64_t j) { return j >= pad[b] && j % 97 != 5 && j != 701; });
    expect_matches_on_every_isa(pr, run_forward(pr), /*check_lse=*/true);
    for (std::int64_t i = 0; i < pr.Lq; ++i) pr.bias[static_cast<std::size_t>(i * pr.Lk + 900)] = 3.0;
    expect_matches_on_every_isa(pr, run_forward(pr), /*check_lse=*/true);
  }
}

TEST(CpuDecode, PositionsAndWindowsAcrossChunks) {
  // Sink and recent windows (groups kept whole) and key / query offsets on a cache split into 9
  // chunks of 512 keys: the recent window spans chunk boundaries, the sink ends inside a group, the
  // sequences have their own lengths and positions (a draft of 3 rows of a shorter sequence).
  std::mt19937_64 rng(test_seed() + 104);
  for (pattern pat : {pattern{1, 2}, pattern{2, 4}, pattern{3, 4}}) {
    shape s{2, 3, 4099, 4, 2, 16, true, false, {4099, 2050}};
    problem pr = make_problem(s, pat, rng, /*integers=*/true);
    pr.key_offset = 16;
    pr.query_offset = {pr.key_offset + 3001, pr.key_offset + 2050 - pr.Lq};
    pr.sink = 5;
    pr.recent = 600;
    expect_matches_on_every_isa(pr, run_forward(pr), /*check_lse=*/true);
  }
}

TEST(CpuDecode, SparseUnionOfKeptKeys) {
  // Two heads per group keeping 1 of 4 or 1 of 8 keys: the union of the kept keys of a tile is
  // under 3/4 of it, so the key-major P V reads only those V rows, in increasing order with gaps
  // (the other decode shapes have groups of 4 to 20 rows, whose union is the whole tile). Odd and
  // even counts of kept keys per block of 32; d = 64 and 128 for the bf16 dot products' columns.
  // Also as a [B, Hkv, L, d] cache (kv heads not interleaved), where a bf16 cache's P V on
  // avx3_bf16 requests each next block's listed rows while it computes a block
  // (kKeyMajorRequestsNext).
  std::mt19937_64 rng(test_seed() + 108);
  for (std::int64_t d : {64, 128}) {
    for (pattern pat : {pattern{1, 4}, pattern{1, 8}, pattern{2, 8}}) {
      const problem pr = make_problem(shape{1, 1, 1001, 4, 2, d, false, false, {}}, pat, rng, /*integers=*/true);
      const auto want = run_forward(pr);
      expect_matches_on_every_isa(pr, want, /*check_lse=*/true);
      expect_matches_on_every_isa(pr, want, /*check_lse=*/true, /*bf16=*/true, /*bhld=*/true);
    }
  }
}

TEST(CpuDecode, DirectAndPanelTilesInOneTask) {
  // The decode kernel reads tame tiles straight from the cache (dot products) and takes the fused
  // forward's panel path for a tile with a K value beyond 2^50 or non-finite; one task here meets
  // both, in both orders: batch 0's kv head 0 has a huge finite key (2^60 times small integers,
  // exact in fp32, so its score dominates every row of the group that keeps it) in the middle of its
  // cache and a NaN in its last key (seen by the last query row only, under the causal mask: that
  // row is NaN, the other is not), and batch 1's cache holds NaN past
  // its length, in K and V (never read: no NaN may reach its rows). Kv head 1 of batch 0 has a NaN
  // in one key at an even column (its rows are NaN), where the NaN above is at an odd one: a bf16
  // cache read in the pair layout (even columns and odd ones apart) must find both. Against the fp64 reference, with
  // 1 and 3 threads bitwise alike, for d = 64 (a multiple of every target's vector: direct tiles)
  // and each pattern; with grouped heads and drafts (8 rows per kv head), and with one row per kv
  // head (MHA, Lq = 1: on AVX-512 a Q K^T block of its own, Q held in registers).
  std::mt19937_64 rng(test_seed() + 105);
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const shape shapes[] = {shape{2, 2, 3001, 8, 2, 64, true, false, {3001, 1999}},
                         shape{2, 1, 3001, 2, 2, 64, true, false, {3001, 1999}}};
  for (const shape& s : shapes) {
    for (pattern pat : {pattern{1, 2}, pattern{2, 4}, pattern{4, 4}}) {
      problem pr = make_problem(s, pat, rng, /*integers=*/true);
      const auto kv_at = [&pr](std::int64_t b, std::int64_t j, std::int64_t hk, std::int64_t c) {
        return static_cast<std::size_t>(((b * pr.Lk + j) * pr.Hkv + hk) * pr.d + c);
      };
      for (std::int64_t c = 0; c < pr.d; ++c) {
        pr.k[kv_at(0, 1500, 0, c)] *= 0x1p60;
        if (c == 3) pr.k[kv_at(0, 3000, 0, c)] = nan;  // visible to the last row only (causal)
        if (c == 6) pr.k[kv_at(0, 2200, 1, c)] = nan;
        for (std::int64_t j = 1999; j < pr.Lk; ++j) {
          for (std::int64_t hk = 0; hk < pr.Hkv; ++hk) pr.k[kv_at(1, j, hk, c)] = pr.v[kv_at(1, j, hk, c)] = nan;
        }
      }
      // The LSE of the NaN rows is NaN, and the others' are checked through O.
      expect_matches_on_every_isa(pr, run_forward(pr), /*check_lse=*/false);
    }
  }
}

/// How many of the first @p rows rows of @p o (rows of @p d values) are all finite, and how many not.
template <typename Values>
std::pair<std::size_t, std::size_t> finite_and_bad_rows(const Values& o, std::int64_t d, std::size_t rows) {
  std::size_t finite_rows = 0;
  for (std::size_t r = 0; r < rows; ++r) {
    bool finite = true;
    for (std::int64_t c = 0; c < d; ++c) finite = finite && std::isfinite(o[r * static_cast<std::size_t>(d) + static_cast<std::size_t>(c)]);
    finite_rows += finite ? 1 : 0;
  }
  return {finite_rows, rows - finite_rows};
}

TEST(CpuDecode, NonFiniteValuesKeptByOneHeadOfAGroup) {
  // The direct path adds a tile's V rows to every row of the group at once, with weight 0 for a
  // row that did not keep the key; 0 * inf is NaN, so a tile whose kept V rows hold inf or NaN must
  // not reach a row that pruned them. Grouped heads (4 query heads per kv head) with tame integer K,
  // so the heads keep different keys exactly, and V with +inf, -inf and NaN at a few keys:
  // against the fp64 reference, a row is NaN or inf iff it kept such a key.
  std::mt19937_64 rng(test_seed() + 106);
  const double inf = std::numeric_limits<double>::infinity();
  for (pattern pat : {pattern{1, 2}, pattern{2, 4}}) {
    shape s{1, 2, 1500, 8, 2, 64, true, false, {}};
    problem pr = make_problem(s, pat, rng, /*integers=*/true);
    // A few keys only, so that about half of the rows keep none of them (8 rows per kv head).
    const auto v_at = [&pr](std::int64_t j, std::int64_t hk, std::int64_t c) {
      return static_cast<std::size_t>((j * pr.Hkv + hk) * pr.d + c);
    };
    pr.v[v_at(700, 0, 3)] = inf;
    pr.v[v_at(1203, 0, 60)] = -inf;
    pr.v[v_at(1201, 1, 10)] = std::numeric_limits<double>::quiet_NaN();
    const auto want = run_forward(pr);
    const auto [finite_rows, bad_rows] = finite_and_bad_rows(want.o, pr.d, want.o.size() / static_cast<std::size_t>(pr.d));
    // Both kinds of rows must occur for the test to mean something.
    ASSERT_GT(finite_rows, 0u) << pat.n << ":" << pat.m;
    ASSERT_GT(bad_rows, 0u) << pat.n << ":" << pat.m;
    expect_matches_on_every_isa(pr, want, /*check_lse=*/false);
    // [B, Hkv, L, d]: with a bf16 cache on a CPU with AMX, the P V of the tiles (amx::decode_pv).
    expect_matches_on_every_isa(pr, want, /*check_lse=*/false, /*bf16=*/true, /*bhld=*/true);
  }
}

TEST(CpuDecode, NonFiniteValuesPrunedByASingleRow) {
  // One row per kv head (MHA, Lq = 1) that kept half its tile or more (1:2, 2:4) reads every V row
  // of the tile with weight 0 for the keys it pruned; 0 * inf is NaN, so a pruned V row holding inf
  // or NaN must not reach the row. 24 heads, 20 of them with +inf, -inf or NaN at one key each:
  // each head keeps that key or not (about half of them each way; the asserts below fail for
  // 2^-20 of the seeds), and a row is NaN or inf iff it kept it.
  std::mt19937_64 rng(test_seed() + 107);
  const double inf = std::numeric_limits<double>::infinity();
  for (pattern pat : {pattern{1, 2}, pattern{2, 4}}) {
    shape s{1, 1, 1500, 24, 24, 64, false, false, {}};
    problem pr = make_problem(s, pat, rng, /*integers=*/true);
    const double bad[] = {inf, -inf, std::numeric_limits<double>::quiet_NaN()};
    for (std::int64_t h = 0; h < 20; ++h) {
      const std::int64_t j = 100 + 67 * h;  // keys in several tiles and chunks
      pr.v[static_cast<std::size_t>((j * pr.Hkv + h) * pr.d + h % pr.d)] = bad[h % 3];
    }
    const auto want = run_forward(pr);
    const auto [finite_rows, bad_rows] = finite_and_bad_rows(want.o, pr.d, 20);  // the rows of heads 0-19
    ASSERT_GT(finite_rows, 0u) << pat.n << ":" << pat.m;  // a head pruned its non-finite value
    ASSERT_GT(bad_rows, 0u) << pat.n << ":" << pat.m;
    expect_matches_on_every_isa(pr, want, /*check_lse=*/false);
  }
}

/// Shapes the fused forward splits over key chunks (Lq > kDecodeMaxQueryRows, fewer than 32 row
/// tasks of 32 query rows, Lk >= 2048): 2 to 8 chunks of whole key tiles; key lengths ending inside
/// a chunk and a group, and 0; causal rows with Lq < Lk; GQA and MHA; a bias; an odd d.
std::vector<shape> split_shapes() {
  return {
      {1, 9, 2048, 1, 1, 8, false, false, {}},
      {2, 40, 5003, 4, 2, 24, true, false, {5003, 2501}},
      {1, 33, 9001, 2, 1, 64, false, true, {}},
      {3, 20, 4099, 2, 2, 13, true, false, {4099, 0, 1030}},
  };
}

TEST(CpuSplitForward, SelectorPicksTheFusedForward) {
  for (cpu_isa isa : runnable_cpu_isas()) {
    if (isa == cpu_isa::generic) continue;  // the scalar twin does not split
    for (const shape& s : split_shapes()) {
      problem pr;
      pr.B = s.B, pr.Lq = s.Lq, pr.Lk = s.Lk, pr.H = s.H, pr.Hkv = s.Hkv, pr.d = s.d;
      EXPECT_EQ(selected(pr, isa), std::string("cpu.fused_forward.") + cpu_isa_name(isa)) << pr.describe();
    }
  }
}

TEST(CpuSplitForward, MatchesReferenceOnExactScoresForEveryThreadCount) {
  std::mt19937_64 rng(test_seed() + 111);
  for (const shape& s : split_shapes()) {
    for (pattern pat : kPatterns) {
      const problem pr = make_problem(s, pat, rng, /*integers=*/true);
      expect_matches_on_every_isa(pr, run_forward(pr), /*check_lse=*/true, /*bf16=*/false);
    }
  }
}

TEST(CpuSplitForward, SixteenBitInputsAndOutputs) {
  // bf16 and f16 inputs (on avx3_bf16 the bf16 dot products: their own packing of each chunk),
  // small integers (exact in both), fp32 outputs; avx3_bf16 rounds P to bf16 in P V (value_tol).
  std::mt19937_64 rng(test_seed() + 112);
  const shape s{1, 40, 6000, 2, 1, 64, true, false, {}};
  for (pattern pat : {pattern{1, 2}, pattern{2, 4}, pattern{4, 4}}) {
    const problem pr = make_problem(s, pat, rng, /*integers=*/true);
    const auto want = run_forward(pr);
    for (cpu_isa isa : runnable_cpu_isas()) {
      for (dtype t : {dtype::bf16, dtype::f16}) {
        run_options opt;
        opt.type = t;
        opt.out_type = dtype::f32;
        opt.backend = backend::cpu;
        opt.isa = isa;
        const auto got = run_forward(pr, opt);
        double err = 0;
        for (std::size_t x = 0; x < got.o.size(); ++x) err = std::max(err, std::abs(got.o[x] - want.o[x]));
        EXPECT_LE(err, value_tol(pr, isa, t)) << label(pr, isa, t);
      }
    }
  }
}

TEST(CpuSplitForward, PositionsWindowsAndNonFiniteAcrossChunks) {
  // Sink and recent windows spanning a chunk boundary, key and query offsets; then a huge K value
  // (2^60 times a small integer) in one chunk and a NaN key seen by the last causal row only, with
  // NaN in K and V past batch 1's length (never read).
  std::mt19937_64 rng(test_seed() + 113);
  for (pattern pat : {pattern{1, 2}, pattern{2, 4}, pattern{3, 4}}) {
    shape s{2, 12, 4099, 4, 2, 16, true, false, {4099, 2050}};
    problem pr = make_problem(s, pat, rng, /*integers=*/true);
    pr.key_offset = 16;
    pr.query_offset = {pr.key_offset + 3001, pr.key_offset + 2050 - pr.Lq};
    pr.sink = 5;
    pr.recent = 1100;
    expect_matches_on_every_isa(pr, run_forward(pr), /*check_lse=*/true, /*bf16=*/false);
  }
  const double nan = std::numeric_limits<double>::quiet_NaN();
  for (pattern pat : {pattern{1, 2}, pattern{2, 4}, pattern{4, 4}}) {
    shape s{2, 10, 3001, 2, 1, 64, true, false, {3001, 1999}};
    problem pr = make_problem(s, pat, rng, /*integers=*/true);
    const auto kv_at = [&pr](std::int64_t b, std::int64_t j, std::int64_t hk, std::int64_t c) {
      return static_cast<std::size_t>(((b * pr.Lk + j) * pr.Hkv + hk) * pr.d + c);
    };
    for (std::int64_t c = 0; c < pr.d; ++c) {
      pr.k[kv_at(0, 700, 0, c)] *= 0x1p60;
      if (c == 3) pr.k[kv_at(0, 3000, 0, c)] = nan;
      for (std::int64_t j = 1999; j < pr.Lk; ++j) pr.k[kv_at(1, j, 0, c)] = pr.v[kv_at(1, j, 0, c)] = nan;
    }
    expect_matches_on_every_isa(pr, run_forward(pr), /*check_lse=*/false, /*bf16=*/false);
  }
}

}  // namespace
}  // namespace dfss::testing
