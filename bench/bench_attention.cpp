// dfss_microbench: Google Benchmark micro-benchmarks of the CPU forward kernels.
//
// Shapes: B = 1, H = 12, d = 64, L = Lq = Lk in {1024, 2048}, fp32, standard normal inputs,
// non-causal. Benchmarks:
//   fused/<isa>/<pattern>/L      the fused forward with cpu_isa generic, avx2 or portable, patterns dense,
//                                1:2 and 2:4
//   three_stage/<pattern>/L      the three-stage forward (1:2, 2:4)
// Counters: GFLOP, a rate (shown as GFLOP=x/s), counts 4 * Lq * Lk * d per head for every pattern
// (dense-equivalent, so it is proportional to 1 / time); items_per_second are query rows per
// second. Times are wall clock (UseRealTime), since the kernels run on an OpenMP team. An unsupported
// configuration (e.g. avx2 on a CPU without it) is reported with SkipWithError and its reason.
//
// The inputs and the machine description (CPU model, commit, load average, printed in the context
// header and the JSON output's "context") come from the benchmarks' shared harness (bench/harness/),
// as in `dfss bench`.
//
// Threads: DFSS_BENCH_THREADS (default 0 = all hardware threads), e.g.
//   DFSS_BENCH_THREADS=2 build/bench/dfss_microbench --benchmark_filter='fused/avx2'
#include <benchmark/benchmark.h>

#include <cstdint>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "dfss/dfss.hpp"
#include "harness/inputs.hpp"
#include "harness/machine.hpp"

namespace {

constexpr std::int64_t kBatch = 1, kHeads = 12, kHeadDim = 64;

int bench_threads() {
  const char* env = std::getenv("DFSS_BENCH_THREADS");
  return env ? std::atoi(env) : 0;
}

/// Inputs of one length, made once and shared by every benchmark of that length.
struct inputs {
  std::int64_t L;
  dfss::harness::input_tensor q, k, v;
  std::vector<float> out;
  explicit inputs(std::int64_t len) : L(len) {
    const auto n = static_cast<std::size_t>(kBatch * len * kHeads * kHeadDim);
    std::mt19937_64 rng(2023 + static_cast<unsigned long long>(len));
    for (auto* t : {&q, &k, &v}) t->fill(n, dfss::dtype::f32, rng);
    out.assign(n, 0.0f);
  }
};

inputs& inputs_for(std::int64_t L) {
  static inputs i1024(1024), i2048(2048);
  return L == 1024 ? i1024 : i2048;
}

void run_forward(benchmark::State& state, dfss::attention_config cfg) {
  const std::int64_t L = state.range(0);
  inputs& in = inputs_for(L);
  dfss::forward_args a;
  a.q = in.q.view(kBatch, L, kHeads, kHeadDim);
  a.k = in.k.view(kBatch, L, kHeads, kHeadDim);
  a.v = in.v.view(kBatch, L, kHeads, kHeadDim);
  a.out = dfss::make_view(in.out.data(), {kBatch, L, kHeads, kHeadDim});
  cfg.backend = dfss::backend::cpu;
  cfg.num_threads = bench_threads();
  const dfss::kernel_selection sel = dfss::select_kernel(a, cfg);
  if (!sel.supported()) {
    state.SkipWithError(("unsupported: " + sel.reason).c_str());
    return;
  }
  // One untimed call: first-touch of the output and the kernel's scratch, and an early error.
  const dfss::status first = dfss::try_attention_forward(a, cfg);
  if (!first.ok()) {
    state.SkipWithError(("unsupported: " + first.message).c_str());
    return;
  }
  for (auto _ : state) {
    dfss::try_attention_forward(a, cfg);
    benchmark::DoNotOptimize(in.out.data());
    benchmark::ClobberMemory();
  }
  const double flops =
      4.0 * static_cast<double>(kBatch * kHeads * kHeadDim) * static_cast<double>(L) * static_cast<double>(L);
  state.counters["GFLOP"] =
      benchmark::Counter(flops * 1e-9 * static_cast<double>(state.iterations()), benchmark::Counter::kIsRate);
  state.SetItemsProcessed(state.iterations() * kBatch * kHeads * L);
  state.SetLabel(sel.name);
}

void register_all() {
  struct named_pattern {
    const char* name;
    dfss::pattern p;
  };
  const named_pattern patterns[] = {{"dense", {1, 1}}, {"1:2", {1, 2}}, {"2:4", {2, 4}}};
  // The generic twin and every SIMD target this CPU runs.
  std::vector<std::pair<std::string, dfss::cpu_isa>> isas{{"generic", dfss::cpu_isa::generic}};
  for (const dfss::cpu_isa_support& t : dfss::cpu_simd_isas()) {
    if (t.supported) isas.emplace_back(dfss::cpu_isa_name(t.isa), t.isa);
  }
  for (const auto& [isa_name, isa] : isas) {
    for (const auto& np : patterns) {
      dfss::attention_config cfg;
      cfg.pattern = np.p;
      cfg.cpu_algorithm = dfss::cpu_algorithm::fused;
      cfg.cpu_isa = isa;
      const std::string name = std::string("fused/") + isa_name + "/" + np.name;
      benchmark::RegisterBenchmark(name.c_str(), [cfg](benchmark::State& s) { run_forward(s, cfg); })
          ->Arg(1024)
          ->Arg(2048)
          ->Unit(benchmark::kMillisecond)
          ->UseRealTime();
    }
  }
  for (const auto& np : patterns) {
    if (np.p.is_dense()) continue;
    dfss::attention_config cfg;
    cfg.pattern = np.p;
    cfg.cpu_algorithm = dfss::cpu_algorithm::three_stage;
    const std::string name = std::string("three_stage/") + np.name;
    benchmark::RegisterBenchmark(name.c_str(), [cfg](benchmark::State& s) { run_forward(s, cfg); })
        ->Arg(1024)
        ->Arg(2048)
        ->Unit(benchmark::kMillisecond)
        ->UseRealTime();
  }
}

}  // namespace

int main(int argc, char** argv) {
  register_all();
  // The machine description `dfss bench` records, in the context header and the JSON output.
  benchmark::AddCustomContext("cpu_model", dfss::harness::cpu_model());
  benchmark::AddCustomContext("cpu_features", [] {
    std::string f;
    for (const std::string& x : dfss::get_build_info().cpu_features) f += (f.empty() ? "" : " ") + x;
    return f;
  }());
  benchmark::AddCustomContext("dfss_commit", dfss::harness::git_commit());
  benchmark::AddCustomContext("load_average", dfss::harness::load_average());
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
