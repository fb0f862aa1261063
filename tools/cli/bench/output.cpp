// The output of `dfss bench`: the repro command, the table, its notes, and the --json file.
#include <algorithm>
#include <cmath>

#include "npy/files.hpp"

#include "cli/bench/bench.hpp"

namespace dfss::cli::bench {

std::string repro_command() {
  std::ostringstream c;
  c << "dfss bench --lengths " << join(g_opt.lengths) << " --patterns " << join(g_opt.patterns)
    << " --algorithms " << join(g_opt.algorithms) << " --isa " << join(g_opt.isas) << " --batch "
    << g_opt.batch << " --heads " << g_opt.heads << " --head-dim " << g_opt.head_dim << " --threads "
    << g_opt.threads << " --dtype " << g_opt.dtype_name << " --warmup " << g_opt.warmup << " --iters "
    << g_opt.iters << " --budget " << g_opt.budget_s << " --seed " << g_opt.seed << " --ref-rows "
    << g_opt.ref_rows;
  if (g_opt.out_dtype != "input") c << " --out-dtype " << g_opt.out_dtype;
  if (g_opt.rounds > 1) c << " --rounds " << g_opt.rounds;
  if (g_opt.backward) c << " --backward";
  if (g_opt.causal) c << " --causal";
  if (g_opt.no_torch) c << " --no-torch";
  if (!g_opt.no_torch) c << " --python " << join(g_opt.python);
  if (g_opt.no_torch_tuned) c << " --no-torch-tuned";
  if (g_opt.no_sgemm) c << " --no-sgemm";
  if (g_opt.no_ref) c << " --no-ref";
  if (!g_opt.json.empty()) c << " --json " << g_opt.json;
  return c.str();
}

/// Fixed (or, with sci, scientific) notation with @p digits decimals; "-" for NaN.
static std::string fmt(double x, int digits, bool sci = false, const char* suffix = "") {
  if (std::isnan(x)) return "-";
  char buf[64];
  if (sci) {
    std::snprintf(buf, sizeof buf, "%.*e%s", digits, x, suffix);
  } else {
    std::snprintf(buf, sizeof buf, "%.*f%s", digits, x, suffix);
  }
  return buf;
}

static std::string fmt_ms(double x) { return fmt(x, x < 1.0 ? 3 : x < 100.0 ? 2 : 1); }

void print_column_notes(const machine_info& mi) {
  std::printf(
      "vs SDPA = median of %s (same L, same input dtype) / row median: > 1 = faster than SDPA%s%s.\n"
      "%%sgemm = row GFLOP/s / the sgemm yardstick's GFLOP/s (below).\n",
      mi.sdpa_peer.empty() ? "torch 2.x SDPA" : mi.sdpa_peer.c_str(),
      mi.sdpa_peer.empty() ? " (no torch 2.x measured: run tools/scripts/torch2-venv.sh, or --python)" : "",
      g_opt.rounds > 1 ? "; with --rounds, this ratio in each round and the median of those (listed above)" : "");
}

void print_table(const std::vector<row>& rows) {
  int kw = 31;  // the kernel column (--backward names two kernels)
  for (const row& r : rows) kw = std::max(kw, static_cast<int>(r.kernel.size()));
  std::printf("%-14s %-7s %-38s %-*s %5s %9s %9s %9s %8s %8s %8s %7s %9s\n", "B,H,L,d", "pattern",
              "algorithm / peer", kw, "kernel", "iters", "ms median", "ms min", "ms max", "GFLOP/s", "speedup",
              "vs SDPA", "%sgemm", "max err");
  long long last_L = -1;
  for (const row& r : rows) {
    if (r.L != last_L && last_L != -1) std::printf("\n");
    last_L = r.L;
    char shape[64];
    std::snprintf(shape, sizeof shape, "%lld,%lld,%lld,%lld", r.B, r.H, r.L, r.d);
    std::string alg = r.algorithm;
    if (r.source == "dfss" && r.isa != "-" && r.isa != "automatic") alg += " (" + r.isa + ")";
    if (!r.ok) {
      std::printf("%-14s %-7s %-38s %-*s unsupported: %s\n", shape, r.pattern.c_str(), alg.c_str(), kw,
                  r.kernel.c_str(), r.reason.c_str());
      continue;
    }
    std::printf("%-14s %-7s %-38s %-*s %5d %9s %9s %9s %8s %8s %8s %7s %9s\n", shape, r.pattern.c_str(),
                alg.c_str(), kw, r.kernel.c_str(), r.iters, fmt_ms(r.ms.median).c_str(), fmt_ms(r.ms.min).c_str(),
                fmt_ms(r.ms.max).c_str(), fmt(r.gflops, 1).c_str(), fmt(r.speedup, 2, false, "x").c_str(),
                fmt(r.vs_sdpa, 2, false, "x").c_str(), fmt(100.0 * r.sgemm_share, 0, false, "%").c_str(),
                fmt(r.max_err, 2, true).c_str());
  }
}

void write_json(const std::string& path, const std::vector<row>& rows, const sgemm_result& sg,
                const build_info& info, const machine_info& m, const std::string& date,
                const std::string& commit, const std::vector<std::string>& notes) {
  json j;
  j["tool"] = "dfss bench";
  j["mode"] = g_opt.backward ? "backward" : "forward";
  j["version"] = info.version;
  j["date"] = date;
  j["load_average_end"] = load_average();
  j["commit"] = commit;
  j["command"] = repro_command();
  j["machine"] = {{"cpu", m.cpu},
                  {"hardware_threads", hardware_threads()},
                  {"cpu_features", info.cpu_features},
                  {"compiler", info.compiler},
                  {"kernel", m.kernel},
                  {"isa", m.isa}};
  j["sdpa_peer"] = m.sdpa_peer;
  j["config"] = {
      {"threads", g_opt.threads},
      {"dtype", g_opt.dtype_name},
      {"out_dtype", std::string(dtype_name(output_dtype(parse_dtype(g_opt.dtype_name))))},
      {"warmup", g_opt.warmup},
      {"iters", g_opt.iters},
      {"rounds", g_opt.rounds},
      {"budget_s", g_opt.budget_s},
      {"ref_rows", g_opt.ref_rows},
      {"seed", g_opt.seed},
      {"flops_per_head", g_opt.backward ? "14 * Lq * Lk * d (forward 4 + backward 10)" : "4 * Lq * Lk * d"},
      {"max_err", g_opt.backward ? "max |dQ, dK, dV - fp64 reference backward| over all elements at L = min(L, " +
                                       std::to_string(kBackwardRefLength) + ")"
                                 : std::string("max |O - fp64 reference| over the first ref_rows query rows of every head")}};
  j["sgemm"] = {{"ok", sg.ok},          {"library", sg.library},        {"corename", sg.corename},
                {"n", sg.n},            {"ms_median", sg.ms.median},    {"ms_min", sg.ms.min},
                {"ms_max", sg.ms.max},  {"calls", sg.samples.size()},   {"gflops", sg.gflops},
                {"reason", sg.reason}};
  j["notes"] = notes;
  j["rows"] = json::array();
  for (const row& r : rows) {
    j["rows"].push_back({{"source", r.source},   {"B", r.B},
                         {"H", r.H},             {"L", r.L},
                         {"d", r.d},             {"pattern", r.pattern},
                         {"algorithm", r.algorithm}, {"isa", r.isa},
                         {"kernel", r.kernel},   {"ok", r.ok},
                         {"reason", r.reason},   {"iters", r.iters},
                         {"ms_median", r.ms.median}, {"ms_min", r.ms.min},
                         {"ms_max", r.ms.max},   {"gflops", r.gflops},
                         {"speedup_vs_dense_fused", r.speedup}, {"speedup_vs_sdpa", r.vs_sdpa},
                         {"dtype", r.dtype},     {"fraction_of_sgemm", r.sgemm_share},
                         {"max_err", r.max_err}});
    if (!r.round_ms.empty()) {
      j["rows"].back()["rounds_ms_median"] = r.round_ms;
      j["rows"].back()["rounds_speedup_vs_sdpa"] = r.round_vs_sdpa;
    }
  }
  // Non-finite numbers (a row without an error estimate) are written as null.
  const std::string text = j.dump(2) + "\n";
  try {
    files::replace(path, {files::piece(reinterpret_cast<const unsigned char*>(text.data()), text.size())});
  } catch (const files::write_error& e) {
    throw error(status_code::invalid_argument, "dfss bench: --json " + path + ": " + e.what());
  }
}

}  // namespace dfss::cli::bench
