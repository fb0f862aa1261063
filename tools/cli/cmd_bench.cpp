// `dfss bench`: the benchmark table of the CPU backend, with its peers measured in the same run.
//
// Rows: every (shape, pattern, algorithm) of dfss on the cpu backend, then PyTorch (each Python
// interpreter that imports torch, with the same thread count: the forward's first torch 2.x one as a
// co-process whose calls join the round-robin of each length, torch_server; the others, and the
// backward, as a child process after the dfss rows of each round), then the
// OpenBLAS sgemm 2048^3 yardstick (loaded with dlopen when the library is installed, so the build
// needs no BLAS). Columns: median / min / max milliseconds, dense-equivalent GFLOP/s (4 Lq Lk d per
// head for every pattern, so the column is proportional to 1 / time), speedup against dfss dense
// fused on the same shape in the same run, and the max abs error against the fp64 reference backend
// on the first --ref-rows query rows of every head (the sweep is non-causal, so rows are
// independent and a slice of Q gives the exact reference of those rows).
//
// Fairness rules (docs/benchmarks.md): everything in one run, the same thread count everywhere
// (dfss num_threads, torch.set_num_threads plus OMP/OpenBLAS/MKL variables, OpenBLAS threads),
// medians, and ratios rather than absolute times across runs. The dfss configurations of one shape
// are timed round-robin (one call of each in turn) so that the noise of a shared machine falls on
// all of them alike.
//
// `dfss bench --rounds R` repeats the whole sweep (every dfss row, then the torch children) R times
// and reports each row's median of its rounds' medians and each ratio's median over the rounds, with
// the per-round ratios against SDPA in the notes: on a shared machine the load drifts between the
// dfss phase and a torch child's phase of one sweep, and only repeated rounds show by how much.
//
// `dfss bench --backward` makes the same table for training: every dfss row times one forward call
// (writing O and LSE) followed by one backward call (given O, LSE and a fixed random dO), fused
// algorithm only (the three-stage pipeline has no backward); the torch peers time forward + backward
// through autograd. GFLOP/s counts 4 Lq Lk d (forward) + 10 Lq Lk d (backward: S recomputed, dP, dV,
// dQ, dK) = 14 Lq Lk d per head, dense-equivalent; the speedup is against dfss dense fused forward +
// backward; the error is max |dQ, dK, dV - fp64 reference backward| over all elements of a reduced
// problem of L = min(L, 256) with the same settings (dK and dV depend on every query row, so a slice of
// Q does not give their reference). The default lengths are 512, 1024, 2048.
//
// `dfss bench --memory` runs one forward call per row in a child process (this binary re-executed
// with the hidden --memory-child option) and reports ru_maxrss, so that the memory growth with L of
// the fused forward (linear: no L x L buffer) is visible next to what a score matrix would need.
//
// The units are in tools/cli/bench/ (bench.hpp lists them); this file registers the options and runs
// the command.
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include "cli/bench/bench.hpp"
#include "cli/commands.hpp"
#include "npy/files.hpp"

namespace dfss::cli {

using namespace bench;  // the command is the one user of the bench units

namespace {

/// A row's identity across rounds.
std::string row_key(const row& r) {
  return r.source + "|" + std::to_string(r.L) + "|" + r.pattern + "|" + r.algorithm + "|" + r.isa + "|" + r.kernel +
         "|" + r.dtype;
}

/// The ratios of one round's rows: speedup against dfss dense fused (the first ISA listed) of the
/// same shape, and against the SDPA row @p sdpa_peer of the same L and input type.
void derive_ratios(std::vector<row>& rows, const std::string& sdpa_peer) {
  std::map<long long, double> dense_ms;
  for (const row& r : rows)
    if (r.source == "dfss" && r.ok && r.pattern == "dense" && r.algorithm == "fused" && r.isa == g_opt.isas[0])
      dense_ms.emplace(r.L, r.ms.median);
  std::map<std::pair<long long, std::string>, double> sdpa_ms;
  for (const row& r : rows)
    if (r.source == "torch" && r.ok && !sdpa_peer.empty() && r.algorithm == sdpa_peer)
      sdpa_ms.emplace(std::make_pair(r.L, r.dtype), r.ms.median);
  for (row& r : rows) {
    if (!r.ok) continue;
    if (const auto it = dense_ms.find(r.L); it != dense_ms.end()) r.speedup = it->second / r.ms.median;
    if (const auto it = sdpa_ms.find({r.L, r.dtype}); it != sdpa_ms.end()) r.vs_sdpa = it->second / r.ms.median;
  }
}

/// One row per configuration from the rounds (the first round's order and errors): the median of
/// the rounds' medians (GFLOP/s from it), the min and max over all rounds, the median of the
/// per-round ratios. A row that failed in some round is reported as failed. @p per_round gets, with
/// more than one round, a line per dfss row listing its per-round ratios against SDPA.
std::vector<row> merge_rounds(const std::vector<std::vector<row>>& rounds, std::vector<std::string>& per_round) {
  std::vector<row> out = rounds.at(0);
  if (rounds.size() == 1) return out;
  std::map<std::string, std::vector<const row*>> seen;
  for (const auto& round : rounds)
    for (const row& r : round) seen[row_key(r)].push_back(&r);
  per_round.push_back("vs SDPA per round (rounds 1.." + std::to_string(rounds.size()) + "):");
  for (row& r : out) {
    const std::vector<const row*>& all = seen[row_key(r)];
    const bool every = all.size() == rounds.size() &&
                       std::all_of(all.begin(), all.end(), [](const row* x) { return x->ok; });
    if (!every) {
      if (r.ok) {
        r.ok = false;
        r.reason = "failed in some round";
      }
      continue;
    }
    std::vector<double> med, speedup, vs;
    r.iters = 0;
    for (const row* x : all) {
      r.round_ms.push_back(x->ms.median);
      r.round_vs_sdpa.push_back(x->vs_sdpa);
      med.push_back(x->ms.median);
      speedup.push_back(x->speedup);
      vs.push_back(x->vs_sdpa);
      r.ms.min = std::min(r.ms.min, x->ms.min);
      r.ms.max = std::max(r.ms.max, x->ms.max);
      r.iters += x->iters;
    }
    const double old_median = r.ms.median;
    r.ms.median = median_of(med);
    r.gflops *= old_median / r.ms.median;
    r.speedup = median_of(speedup);
    r.vs_sdpa = median_of(vs);
    if (r.source == "dfss" && !std::isnan(r.vs_sdpa)) {
      std::string line = "  L=" + std::to_string(r.L) + " " + r.pattern + " " + r.algorithm + " " + r.isa + ":";
      for (double v : vs) {
        char buf[32];
        std::snprintf(buf, sizeof buf, " %.2fx", v);
        line += buf;
      }
      per_round.push_back(line);
    }
  }
  return out;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Command
// ---------------------------------------------------------------------------------------------

void add_bench_command(CLI::App& app) {
  bench_options& o = g_opt;
  CLI::App* c = app.add_subcommand(
      "bench", "Benchmark table: dfss patterns and algorithms vs dense vs PyTorch, sgemm yardstick");
  c->add_option("--lengths", o.lengths, "sequence lengths (Lq = Lk), comma separated")
      ->delimiter(',')
      ->capture_default_str();
  c->add_option("--patterns", o.patterns, "N:M patterns (dense = 1:1)")
      ->delimiter(',')
      ->capture_default_str();
  c->add_option("--algorithms", o.algorithms,
                "cpu algorithms: fused, three-stage (three-stage rows are made for sparse patterns only)")
      ->delimiter(',')
      ->capture_default_str();
  c->add_option("--isa", o.isas, "fused-kernel ISAs: automatic, generic, portable or SIMD targets (sse4, avx2, avx3, avx3_bf16, neon, sve, sve2; a list compares them)")
      ->delimiter(',')
      ->capture_default_str();
  c->add_option("--batch", o.batch, "batch size")->capture_default_str();
  c->add_option("--heads", o.heads, "attention heads")->capture_default_str();
  c->add_option("--head-dim", o.head_dim, "head dimension (--decode: default 128)")->capture_default_str();
  c->add_option("--threads", o.threads, "threads for dfss, torch and OpenBLAS (0: all)")
      ->capture_default_str();
  c->add_option("--dtype", o.dtype_name,
                "dfss input type: f32, f16, bf16 (torch: fp32 rows, plus SDPA rows in the same 16-bit type)")
      ->capture_default_str();
  c->add_option("--out-dtype", o.out_dtype,
                "type of the dfss output O: input (the inputs' type, as the torch operator and SDPA return it) or "
                "f32 (what the C++ API also accepts for 16-bit inputs)")
      ->check(CLI::IsMember({"input", "f32"}))
      ->capture_default_str();
  c->add_option("--warmup", o.warmup, "untimed calls per configuration")->capture_default_str();
  c->add_option("--iters", o.iters, "timed calls per configuration (median reported)")->capture_default_str();
  c->add_option("--rounds", o.rounds,
                "repeat the whole sweep (dfss rows, then the torch peers) this many times: each row reports the "
                "median of its rounds' medians, each ratio the median of its per-round ratios, and the notes list "
                "the per-round ratios against SDPA (a shared machine's load drifts between the dfss and torch phases)")
      ->capture_default_str();
  c->add_option("--budget", o.budget_s,
                "soft seconds per configuration: slow configurations get fewer timed calls (at least 3)")
      ->capture_default_str();
  c->add_option("--seed", o.seed, "random seed (inputs are standard normal)")->capture_default_str();
  c->add_option("--ref-rows", o.ref_rows, "query rows per head checked against the fp64 reference")
      ->capture_default_str();
  c->add_flag("--no-ref", o.no_ref, "skip the fp64 reference check");
  c->add_option("--json", o.json, "also write the results as JSON to FILE");
  c->add_flag("--no-torch", o.no_torch, "skip the PyTorch peers");
  c->add_flag("--no-torch-tuned", o.no_torch_tuned, "skip the tuned-environment rows of torch 1.x");
  o.python = default_pythons();
  c->add_option("--python", o.python,
                "Python interpreters to try for torch (identical torch versions deduplicated); the default "
                "includes the venv of tools/scripts/torch2-venv.sh when it exists ($DFSS_TORCH2_VENV)")
      ->delimiter(',')
      ->capture_default_str();
  c->add_option("--torch-script", o.torch_script, "path of tools/bench/torch_attention.py (default: found)");
  c->add_flag("--no-sgemm", o.no_sgemm, "skip the OpenBLAS sgemm yardstick");
  c->add_flag("--progress", o.progress,
              "progress line on stderr (row, rows left) also when stderr is not a terminal");
  c->add_flag("--backward", o.backward,
              "time forward + backward (fused rows, torch autograd); default lengths 512,1024,2048");
  c->add_flag("--memory", o.memory, "peak resident memory of the fused forward per length (child processes)");
  c->add_option("--memory-lengths", o.memory_lengths, "lengths for --memory")
      ->delimiter(',')
      ->capture_default_str();
  c->add_option("--memory-patterns", o.memory_patterns, "patterns for --memory")
      ->delimiter(',')
      ->capture_default_str();
  c->add_option("--memory-heads", o.memory_heads, "heads for --memory")->capture_default_str();
  c->add_option("--memory-child", o.memory_child, "internal: one forward call for --memory")->group("");
  c->add_flag("--decode", o.decode,
              "one decode step against a KV cache (B=1, d=128, Lq=--query-rows): dfss rows, SDPA and the memory "
              "bandwidth; --lengths are cache lengths (default 4096,16384,65536)");
  c->add_option("--decode-heads", o.decode_heads, "--decode: H:Hkv query and kv heads (MHA 32:32, GQA 32:8)")
      ->delimiter(',')
      ->capture_default_str();
  c->add_option("--decode-dtypes", o.decode_dtypes, "--decode: cache types (f32, f16, bf16)")
      ->delimiter(',')
      ->capture_default_str();
  c->add_option("--query-rows", o.query_rows, "--decode: query rows per step (speculative drafts > 1)")
      ->capture_default_str();
  c->add_option("--cache-layout", o.cache_layout,
                "--decode: the KV cache's memory, bhld ([B, Hkv, Lk, d]: transformers') or blhd ([B, Lk, Hkv, d]: "
                "dfss's and flash-attn's); SDPA reads the same memory")
      ->check(CLI::IsMember({"bhld", "blhd"}))
      ->capture_default_str();
  c->add_flag("--causal", o.causal,
              "causal mask (prefill; Lq = Lk so bottom-right = top-left): dfss causal, SDPA is_causal=True");
  // Runs at the end of the parse, while the options still exist (run_bench comes after the parser
  // is gone: a pointer to an option kept until then was read after it was freed).
  c->callback([c] {
    g_opt.lengths_given = c->count("--lengths") > 0;
    g_opt.head_dim_given = c->count("--head-dim") > 0;
  });
}

int run_bench() {
  bench_options& o = g_opt;
  try {
    if (o.backward && (o.memory || o.memory_child > 0)) {
      std::fprintf(stderr,
                   "dfss bench: --backward and --memory cannot be combined (--memory measures the forward)\n");
      return kExitBadInput;
    }
    // The backward sweep stops at 2048 by default (it is 3 to 4 times slower per length than the forward).
    if (o.backward && !o.lengths_given) o.lengths = {512, 1024, 2048};
    if (o.decode) {
      if (o.backward || o.memory || o.memory_child > 0 || o.causal) {
        std::fprintf(stderr, "dfss bench: --decode cannot be combined with --backward, --memory or --causal\n");
        return kExitBadInput;
      }
      if (!o.lengths_given) o.lengths = {4096, 16384, 65536};
      if (!o.head_dim_given) o.head_dim = 128;
    }
    if (o.rounds < 1) {
      std::fprintf(stderr, "dfss bench: argument '--rounds': expected a count >= 1, got %d\n", o.rounds);
      return kExitBadInput;
    }
    if (o.rounds > 1 && (o.memory || o.memory_child > 0)) {
      std::fprintf(stderr, "dfss bench: --memory cannot be combined with --rounds (it measures memory, not time)\n");
      return kExitBadInput;
    }
    if (o.batch < 1 || o.heads < 1 || o.head_dim < 1 || o.memory_heads < 1 || o.warmup < 1 || o.iters < 1 ||
        o.threads < 0 || o.ref_rows < 0 || o.lengths.empty() || o.patterns.empty() || o.algorithms.empty() ||
        o.isas.empty()) {
      std::fprintf(
          stderr,
          "dfss bench: --batch, --heads, --head-dim, --memory-heads, --warmup and --iters must be >= 1, "
          "--threads and --ref-rows >= 0, and the lists non-empty\n");
      return kExitBadInput;
    }
    for (long long L : o.lengths)
      if (L < 1) {
        std::fprintf(stderr, "dfss bench: argument '--lengths': expected lengths >= 1, got %lld\n", L);
        return kExitBadInput;
      }
    // Validate the lists up front so that a typo fails before minutes of measuring.
    const dtype type = parse_dtype(o.dtype_name);
    for (const auto& p : o.patterns) pattern::parse(p, "--patterns");
    for (const auto& p : o.memory_patterns) pattern::parse(p, "--memory-patterns");
    for (const auto& a : o.algorithms) parse_cpu_algorithm_arg(a);
    for (const auto& i : o.isas) parse_cpu_isa_arg(i);
    if (o.threads == 0) o.threads = hardware_threads();
    if (!o.json.empty()) {
      try {
        files::check_writable(o.json);  // before minutes of measuring; written atomically at the end
      } catch (const files::write_error& e) {
        std::fprintf(stderr, "dfss bench: --json %s: %s\n", o.json.c_str(), e.what());
        return kExitBadInput;
      }
    }

    if (o.decode) return run_decode();
    if (o.memory_child > 0) return run_memory_child();
    if (o.memory) return run_memory();

    const build_info info = get_build_info();
    machine_info mi;
    mi.cpu = cpu_model();
    mi.kernel = dense_kernel_name(type);
    mi.isa = mi.kernel.substr(mi.kernel.rfind('.') + 1);
    const std::string date = now_utc(), commit = git_commit();
    std::printf("dfss bench: dfss %s, %s; %s%s\n", info.version.c_str(), date.c_str(),
                commit.empty() ? "commit unknown" : "commit ", commit.c_str());
    std::printf("machine: %s, %d hardware threads, features: %s; compiler: %s\n", mi.cpu.c_str(),
                hardware_threads(), join(info.cpu_features, " ").c_str(), info.compiler.c_str());
    std::printf("kernel: --isa %s selects %s (ISA %s) for dense fused %s\n", o.isas[0].c_str(),
                mi.kernel.c_str(), mi.isa.c_str(), o.backward ? "forward (backward: see the kernel column)" : "forward");
    std::printf(
        "run: %s, %d threads, %s inputs (standard normal), %s outputs, warmup %d, median of up to %d calls "
        "(budget %gs per configuration), %s, no other masks\n",
        o.backward ? "forward + backward (--backward)" : "forward", o.threads, o.dtype_name.c_str(),
        dtype_name(output_dtype(type)), o.warmup,
        o.iters, o.budget_s, o.causal ? "causal (--causal)" : "non-causal");
    if (o.rounds > 1) {
      std::printf(
          "rounds: %d (the whole sweep repeated: a row's times are the median of its rounds' medians, the min and "
          "max over all rounds; speedup and vs SDPA the median of the per-round ratios; errors of round 1)\n",
          o.rounds);
    }
    std::printf("load average at start: %s\n", load_average().c_str());
    std::printf("repro: %s\n\n", repro_command().c_str());
    std::fflush(stdout);

    sgemm_result sg;
    if (!o.no_sgemm) {
      log_stderr("  sgemm yardstick: setup\n");
      setup_sgemm_yardstick(sg, o.threads);
    } else {
      sg.reason = "skipped (--no-sgemm)";
    }

    g_progress.enable(o.progress || isatty(STDERR_FILENO) != 0, isatty(STDERR_FILENO) != 0);
    g_progress.add_rows(o.rounds * static_cast<int>(o.lengths.size()) * dfss_rows_per_length());
    std::vector<std::string> notes;
    std::vector<torch_peer> peers;
    if (!o.no_torch) peers = probe_torch_peers(notes);
    // The forward's first torch 2.x peer is served: its calls join the dfss rows' round-robin of each
    // length (torch_server). The others, the backward, and a script that does not serve run as a child
    // after the dfss rows of each round (bench_torch).
    std::unique_ptr<torch_server> served;
    if (!o.backward) {
      for (auto it = peers.begin(); it != peers.end(); ++it) {
        if (!has_public_sdpa(*it)) continue;
        std::ostringstream args;
        args << "--batch " << o.batch << " --heads " << o.heads << " --head-dim " << o.head_dim << " --threads "
             << o.threads << " --warmup " << o.warmup << " --seed " << o.seed << " --ref-rows " << o.ref_rows
             << (o.causal ? " --causal" : "");
        served = std::make_unique<torch_server>(*it, find_torch_script(), args.str());
        if (served->alive()) {
          notes.push_back("torch " + it->version + " (" + it->python + "): timed round-robin with the dfss rows: " +
                          served->command());
          peers.erase(it);
        } else {
          notes.push_back("torch " + it->version + ": not served (" + served->why() + "), run after the dfss rows");
          served.reset();
        }
        break;
      }
    }
    if (served != nullptr)  // its entries are rows of each length
      g_progress.add_rows(o.rounds * static_cast<int>(o.lengths.size() * torch_entries().size()));
    for (const auto& peer : peers) g_progress.add_rows(o.rounds * (runs_tuned(peer) ? 2 : 1));
    // Each round: every dfss row (with the served peer's calls), then the other torch peers (their
    // notes, the same every round, from round 1).
    std::vector<std::vector<row>> rounds(static_cast<std::size_t>(o.rounds));
    const bool no_ref = o.no_ref;
    for (int k = 0; k < o.rounds; ++k) {
      if (k > 0) o.no_ref = true;  // the error columns come from round 1
      for (long long L : o.lengths) bench_length(L, type, rounds[static_cast<std::size_t>(k)], sg, served.get());
      std::vector<std::string> round_notes;
      if (!peers.empty()) bench_torch(peers, rounds[static_cast<std::size_t>(k)], k == 0 ? notes : round_notes);
    }
    served.reset();  // the co-process ends with its input
    o.no_ref = no_ref;
    sg.finish();
    g_progress.done();
    // "vs SDPA": against torch 2.x's public scaled_dot_product_attention as installed (not tuned), the
    // first such peer of --python, same L and same input dtype; > 1 = faster than SDPA.
    for (const row& r : rounds[0])
      if (r.source == "torch" && r.ok && r.algorithm.rfind("torch 1.", 0) != 0 &&
          r.algorithm.size() > 5 && r.algorithm.compare(r.algorithm.size() - 5, 5, " sdpa") == 0) {
        mi.sdpa_peer = r.algorithm;
        break;
      }
    for (auto& round : rounds) derive_ratios(round, mi.sdpa_peer);
    std::vector<std::string> per_round;
    std::vector<row> rows = merge_rounds(rounds, per_round);
    for (row& r : rows)
      if (r.ok && sg.ok) r.sgemm_share = r.gflops / sg.gflops;
    std::stable_sort(rows.begin(), rows.end(), [](const row& x, const row& y) { return x.L < y.L; });

    print_table(rows);
    std::printf("\n");
    for (const auto& n : notes) std::printf("%s\n", n.c_str());
    for (const auto& n : per_round) std::printf("%s\n", n.c_str());
    std::printf("load average at end: %s\n", load_average().c_str());
    if (sg.ok) {
      std::printf(
          "sgemm yardstick: %s (%s) cblas_sgemm %d^3, %d threads: %.1f GFLOP/s (median of %zu calls spread "
          "over the dfss rounds: %.1f ms, min %.1f, max %.1f)\n",
          sg.library.c_str(), sg.corename.c_str(), sg.n, o.threads, sg.gflops, sg.samples.size(),
          sg.ms.median, sg.ms.min, sg.ms.max);
      for (const row& r : rows)
        if (r.source == "dfss" && r.ok && r.pattern == "dense" && r.algorithm == "fused" &&
            r.isa == o.isas[0])
          std::printf("  L=%lld: dense fused%s %.1f GFLOP/s = %.0f%% of sgemm\n", r.L,
                      o.backward ? " forward+backward" : "", r.gflops,
                      100.0 * r.gflops / sg.gflops);
    } else {
      std::printf("sgemm yardstick: %s\n", sg.reason.c_str());
    }
    if (o.backward) {
      std::printf(
          "\n--backward: each row times one forward call (O and LSE) + one backward call (given O, LSE and a\n"
          "random dO); torch rows: forward + O.backward(dO) through autograd, grads set to None per call.\n"
          "Three-stage rows are skipped (the three-stage pipeline has no backward).\n"
          "GFLOP/s counts 14*Lq*Lk*d per head for every pattern (forward 4 + backward 10: Q K^T recomputed,\n"
          "dO V^T, P^T dO, dS K, dS^T Q; dense-equivalent, so it is proportional to 1/time); speedup = dfss\n"
          "dense fused forward+backward ms / row ms, same shape, same run; max err = max |dQ, dK, dV - fp64\n"
          "reference backward| over all elements of the problem with L = min(L, %lld) and the same settings\n"
          "(torch rows: vs float64 autograd of softmax(q k^T * scale) v on that problem).\n",
          kBackwardRefLength);
      print_column_notes(mi);
    } else {
      std::printf(
          "\nGFLOP/s counts 4*Lq*Lk*d per head for every pattern (dense-equivalent, so it is proportional to\n"
          "1/time); speedup = dfss dense fused ms / row ms, same shape, same run; max err = max |out - fp64\n"
          "reference| over the %s %lld query rows of every head (torch rows: vs torch float64).\n",
          o.causal ? "last" : "first", static_cast<long long>(o.ref_rows));
      print_column_notes(mi);
    }
    if (!o.json.empty()) {
      write_json(o.json, rows, sg, info, mi, date, commit, notes);
      std::printf("wrote %s\n", o.json.c_str());
    }
    return kExitOk;
  } catch (const dfss::error& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return e.code() == status_code::invalid_argument || e.code() == status_code::unsupported ? kExitBadInput
                                                                                             : kExitInternal;
  }
}

}  // namespace dfss::cli
