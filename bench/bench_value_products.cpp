// dfss_value_bench: the fused forward's P V forms in isolation (Google Benchmark), on the best
// SIMD target this CPU runs, with the kernel's own code (cpu/simd/kernel_parts-inl.h).
//
// One key tile of the forward (W = forward_key_tile(d) keys: 128 at d = 64, 64 at d = 128) for the
// 32 query rows of a task, every buffer small enough to stay in L1/L2, random weights and V:
//   values/rows_dense/d<d>    acc += p V row at a time over all W keys (add_row_combination)
//   values/blocked_dense/d<d> the same products blocked over kValueRows rows (add_tile_rows): what a
//                             dense tile no row masks runs
//   values/rows_1:2/d<d>      row at a time over one kept key per pair (W / 2 element offsets): what
//                             a 1:2 tile runs where the pair blocks do not pay (Intel, Zen 4)
//   values/pairs_1:2/d<d>     the pair blocks (add_tile_rows, Paired): what a 1:2 tile runs on Zen 5
// Counter: FMAs, a rate (shown as FMAs=x/s), the vector MulAdds one call issues; their ratio says
// what a 1:2 tile's P V can gain over dense's on this CPU: half the MulAdds at the same rate would
// be 2x (docs/benchmarks.md, "What bounds the 1:2 P V on the CPU").
//
// One thread: the loops themselves, without the OpenMP team of the forward.
#include "cpu/simd/targets.hpp"  // first: it fixes the compiled targets

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "bench/bench_value_products.cpp"
#include "hwy/foreach_target.h"  // IWYU pragma: keep

#include "cpu/simd/kernel_parts-inl.h"

#include <algorithm>
#include <cstdint>
#include <random>

#ifndef DFSS_VALUE_BENCH_ONCE
#define DFSS_VALUE_BENCH_ONCE
namespace dfss::bench_values {
/// The forms measured (see the file comment).
enum class form : int { rows_dense, blocked_dense, rows_pairs, pair_blocks };
/// Rows of one forward task.
inline constexpr int kRows = cpu::simd::kRowsPerTask;
/// Buffers of one tile: V rows (W + 1, the last zero), the odd keys' V rows negated (pair blocks),
/// per row the dense weights (W), the 1:2 weights (W / 2, signed for the pair blocks) and the kept
/// keys' element offsets, and the accumulators.
struct tile {
  int dp = 0, w = 0;
  cpu::simd::aligned_buffer<float> v, vn, dense_w, pair_w, signed_w, acc;  // aligned: the parts use hn::Load
  cpu::simd::aligned_buffer<std::int32_t> offsets;
};
}  // namespace dfss::bench_values
#endif

HWY_BEFORE_NAMESPACE();
namespace dfss::cpu::simd::HWY_NAMESPACE {
#if DFSS_SIMD_KERNEL_TARGET
/// One call of form @p f over the tile's kRows rows; returns the vector MulAdds it issued, or -1
/// where this target has no such form.
std::int64_t run_form(int f, bench_values::tile& t) {
  using bench_values::form;
  const DF d;
  const int L = static_cast<int>(hn::Lanes(d));
  const int dp = t.dp, w = t.w;
  const std::int64_t per_key = dp / L;
  switch (static_cast<form>(f)) {
    case form::rows_dense:
      for (int r = 0; r < bench_values::kRows; ++r) {
        const float* p = t.dense_w.ptr + static_cast<std::ptrdiff_t>(r) * w;
        const float* v = t.v.ptr;
        add_row_combination(
            t.acc.ptr + static_cast<std::ptrdiff_t>(r) * dp, dp, w, [p](int k) { return p[k]; },
            [v, dp](int k) { return v + static_cast<std::ptrdiff_t>(k) * dp; });
      }
      return bench_values::kRows * w * per_key;
    case form::rows_pairs:
      for (int r = 0; r < bench_values::kRows; ++r) {
        const float* p = t.pair_w.ptr + static_cast<std::ptrdiff_t>(r) * (w / 2);
        const std::int32_t* o = t.offsets.ptr + static_cast<std::ptrdiff_t>(r) * (w / 2);
        const float* v = t.v.ptr;
        add_row_combination(
            t.acc.ptr + static_cast<std::ptrdiff_t>(r) * dp, dp, w / 2, [p](int k) { return p[k]; },
            [v, o](int k) { return v + o[k]; });
      }
      return bench_values::kRows * (w / 2) * per_key;
#if !HWY_HAVE_SCALABLE
    case form::blocked_dense:
    case form::pair_blocks: {
      const bool paired = static_cast<form>(f) == form::pair_blocks;
      for (int r0 = 0; r0 < bench_values::kRows; r0 += kValueRows) {
        float* acc[kValueRows];
        const float* wt[kValueRows];
        for (int i = 0; i < kValueRows; ++i) {
          const int r = std::min(r0 + i, bench_values::kRows - 1);
          acc[i] = t.acc.ptr + static_cast<std::ptrdiff_t>(r) * dp;
          wt[i] = paired ? t.signed_w.ptr + static_cast<std::ptrdiff_t>(r) * (w / 2)
                         : t.dense_w.ptr + static_cast<std::ptrdiff_t>(r) * w;
        }
        if (paired) {
          add_tile_rows<kValueRows, true>(acc, wt, 1, t.v.ptr, t.vn.ptr, dp, w / 2);
        } else {
          add_tile_rows<kValueRows, false>(acc, wt, 1, t.v.ptr, t.v.ptr, dp, w);
        }
      }
      const std::int64_t blocks = (bench_values::kRows + kValueRows - 1) / kValueRows;
      return blocks * kValueRows * (paired ? w / 2 : w) * per_key;
    }
#endif
    default: return -1;
  }
}
#else
std::int64_t run_form(int, bench_values::tile&) { return -1; }
#endif
}  // namespace dfss::cpu::simd::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
#include <benchmark/benchmark.h>

#include <string>
#include <utility>

namespace dfss::cpu::simd {
HWY_EXPORT(run_form);
}  // namespace dfss::cpu::simd

namespace {

using dfss::bench_values::form;
using dfss::bench_values::kRows;

/// A tile of head dim @p dp with the forward's key tile; random weights (never zeros), V in
/// [-1, 1), each row keeping a random key of every pair.
void make_tile(int dp, dfss::bench_values::tile& t) {
  t.dp = dp;
  t.w = dfss::cpu::simd::forward_key_tile(dp);  // the fp32 forward's: 128 keys at d = 64, 64 at d = 128
  std::mt19937 gen(2023);
  std::uniform_real_distribution<float> uni(-1.0f, 1.0f), weight(1e-3f, 1.0f);
  t.v.resize(static_cast<std::size_t>((t.w + 1) * dp));
  std::fill(t.v.ptr, t.v.ptr + t.v.size, 0.0f);
  for (int k = 0; k < t.w * dp; ++k) t.v.ptr[k] = uni(gen);
  t.vn.resize(static_cast<std::size_t>((t.w / 2) * dp));
  for (int g = 0; g < t.w / 2; ++g) {
    for (int c = 0; c < dp; ++c) {
      t.vn.ptr[g * dp + c] = -t.v.ptr[(2 * g + 1) * dp + c];
    }
  }
  t.dense_w.resize(static_cast<std::size_t>(kRows * t.w));
  for (std::size_t i = 0; i < t.dense_w.size; ++i) t.dense_w.ptr[i] = weight(gen);
  const std::size_t half = static_cast<std::size_t>(kRows * (t.w / 2));
  t.pair_w.resize(half);
  t.signed_w.resize(half);
  t.offsets.resize(half);
  for (std::size_t s = 0; s < half; ++s) {
    const int pair = static_cast<int>(s % static_cast<std::size_t>(t.w / 2));
    const bool odd = (gen() & 1u) != 0;
    t.pair_w.ptr[s] = weight(gen);
    t.signed_w.ptr[s] = odd ? -t.pair_w.ptr[s] : t.pair_w.ptr[s];
    t.offsets.ptr[s] = (2 * pair + (odd ? 1 : 0)) * dp;
  }
  t.acc.resize(static_cast<std::size_t>(kRows * dp));
  std::fill(t.acc.ptr, t.acc.ptr + t.acc.size, 0.0f);
}

void bm_form(benchmark::State& state, form f, int dp) {
  dfss::bench_values::tile t;
  make_tile(dp, t);
  auto* run = HWY_DYNAMIC_DISPATCH(dfss::cpu::simd::run_form);
  const std::int64_t fmas = run(static_cast<int>(f), t);
  if (fmas < 0) {
    state.SkipWithError("this SIMD target has no such form (scalable vectors have no blocked products)");
    return;
  }
  for (auto _ : state) {
    run(static_cast<int>(f), t);
    benchmark::DoNotOptimize(t.acc.ptr);
    benchmark::ClobberMemory();
  }
  state.counters["FMAs"] =
      benchmark::Counter(static_cast<double>(fmas), benchmark::Counter::kIsIterationInvariantRate);
}

void register_all() {
  const std::pair<form, const char*> forms[] = {{form::rows_dense, "rows_dense"},
                                                {form::blocked_dense, "blocked_dense"},
                                                {form::rows_pairs, "rows_1:2"},
                                                {form::pair_blocks, "pairs_1:2"}};
  for (const int dp : {64, 128}) {
    for (const auto& [f, name] : forms) {
      const std::string label = std::string("values/") + name + "/d" + std::to_string(dp);
      benchmark::RegisterBenchmark(label.c_str(), [f = f, dp](benchmark::State& s) { bm_form(s, f, dp); });
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  register_all();
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
#endif  // HWY_ONCE
