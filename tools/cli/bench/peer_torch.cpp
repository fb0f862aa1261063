// The PyTorch peer of `dfss bench`: tools/bench/torch_attention.py in a child process per interpreter
// of --python that imports torch (one per torch version), with the same thread count; its rows.
#include <set>

#include "cli/bench/bench.hpp"

namespace dfss::cli::bench {

#ifndef DFSS_BENCH_SCRIPT_DIR
#define DFSS_BENCH_SCRIPT_DIR ""
#endif

std::string find_torch_script() {
  if (!g_opt.torch_script.empty()) return g_opt.torch_script;
  std::vector<std::string> candidates;
  const std::string exe = self_exe();
  if (!exe.empty()) {
    const std::string dir = exe.substr(0, exe.rfind('/'));
    candidates.push_back(dir + "/../../tools/bench/torch_attention.py");    // build/tools/dfss
    candidates.push_back(dir + "/../share/dfss/bench/torch_attention.py");  // an install
  }
  candidates.push_back(std::string(DFSS_BENCH_SCRIPT_DIR) + "/torch_attention.py");
  for (const auto& c : candidates)
    if (file_exists(c)) return c;
  return {};
}

bool read_torch_json(const std::string& output, json& out) {
  const std::string prefix = "DFSS_TORCH_JSON ";
  std::istringstream lines(output);
  std::string line;
  bool found = false;
  while (std::getline(lines, line)) {
    if (line.rfind(prefix, 0) != 0) continue;
    out = json::parse(line.substr(prefix.size()), nullptr, /*allow_exceptions=*/false);
    found = !out.is_discarded() && out.is_object();
  }
  return found;
}


std::string torch_env(bool tuned) {
  const std::string t = std::to_string(g_opt.threads);
  std::string env = "env OMP_NUM_THREADS=" + t + " OPENBLAS_NUM_THREADS=" + t + " MKL_NUM_THREADS=" + t;
  if (tuned) env += " OMP_WAIT_POLICY=passive GLIBC_TUNABLES=glibc.malloc.hugetlb=1";
  return env + " ";
}

/// The interpreters of --python that import torch, one per torch version (asked before the dfss rows
/// so that the progress line knows the number of rows from the start).
std::vector<torch_peer> probe_torch_peers(std::vector<std::string>& notes) {
  std::vector<torch_peer> peers;
  const std::string script = find_torch_script();
  if (script.empty()) {
    notes.push_back("torch: tools/bench/torch_attention.py not found (use --torch-script PATH)");
    return peers;
  }
  std::set<std::string> versions;
  for (const auto& py : g_opt.python) {
    int rc = 0;
    const std::string out =
        capture(torch_env(false) + shell_quote(py) + " " + shell_quote(script) + " --probe 2>/dev/null", &rc);
    json j;
    if (!read_torch_json(out, j)) {
      notes.push_back("torch: " + py + ": not runnable");
      continue;
    }
    if (j.contains("error")) {
      notes.push_back("torch: " + py + " (" + get_str(j, "python") + "): " + get_str(j, "error"));
      continue;
    }
    torch_peer p{py, get_str(j, "torch_version"), get_str(j, "sdpa")};
    if (!versions.insert(p.version).second) {
      notes.push_back("torch: " + py + " (" + get_str(j, "python") + "): torch " + p.version +
                      " already measured, skipped");
      continue;
    }
    notes.push_back("torch: " + py + " (" + get_str(j, "python") + ", Python " + get_str(j, "python_version") +
                    "): torch " + p.version);
    peers.push_back(p);
  }
  return peers;
}

/// torch 1.x is also measured "tuned" (cpu-baselines.md): passive OpenMP waiting and huge pages for
/// glibc malloc, which removes most of its page-fault and spin costs on this kind of VM.
bool runs_tuned(const torch_peer& peer) {
  return !peer.version.empty() && peer.version[0] == '1' && !g_opt.no_torch_tuned;
}

bool has_public_sdpa(const torch_peer& peer) {
  return !peer.version.empty() && peer.version[0] != '1' && peer.sdpa == "public";
}

void bench_torch(const std::vector<torch_peer>& peers, std::vector<row>& rows, std::vector<std::string>& notes) {
  const std::string script = find_torch_script();
  // The torch dtypes: fp32 always (the peer of dfss fp32 and of the fp32 rows), plus the dfss input
  // type when it is 16-bit (SDPA on the same bf16/fp16 inputs is the fair peer of a 16-bit kernel).
  const std::string label = dtype_label(g_opt.dtype_name);
  const std::string torch_dtypes = label == "fp32" ? "fp32" : "fp32," + label;
  for (const auto& peer : peers) {
    for (bool tuned : {false, true}) {
      if (tuned && !runs_tuned(peer)) continue;
      std::ostringstream cmd;
      cmd << torch_env(tuned) << shell_quote(peer.python) << " " << shell_quote(script) << " --lengths "
          << join(g_opt.lengths) << " --batch " << g_opt.batch << " --heads " << g_opt.heads << " --head-dim "
          << g_opt.head_dim << " --threads " << g_opt.threads << " --warmup " << g_opt.warmup << " --iters "
          << g_opt.iters << " --budget " << g_opt.budget_s << " --seed " << g_opt.seed << " --ref-rows "
          << g_opt.ref_rows << " --dtypes " << torch_dtypes;
      if (g_opt.backward) cmd << " --mode backward --ref-length " << kBackwardRefLength;
      if (g_opt.causal) cmd << " --causal";
      log_stderr("  torch %s%s (%s)\n", peer.version.c_str(), tuned ? ", tuned" : "", peer.python.c_str());
      g_progress.show(++g_rows_done, 1,
                      "torch " + peer.version + (tuned ? ", tuned" : "") + " (" + torch_dtypes + ", every length)");
      int rc = 0;
      const std::string out = capture(cmd.str(), &rc);
      json j;
      if (!read_torch_json(out, j) || !j.contains("results") || !j["results"].is_array()) {
        notes.push_back("torch " + peer.version + ": the script failed (exit status " + std::to_string(rc) +
                        "); run it by hand: " + cmd.str());
        continue;
      }
      for (const json& e : j["results"]) {
        row r;
        r.source = "torch";
        r.B = static_cast<long long>(get_num(e, "B"));
        r.H = static_cast<long long>(get_num(e, "H"));
        r.L = static_cast<long long>(get_num(e, "L"));
        r.d = static_cast<long long>(get_num(e, "d"));
        r.pattern = "dense";
        r.algorithm = "torch " + peer.version + " " + get_str(e, "method") + (tuned ? ", tuned" : "");
        r.isa = "-";
        r.dtype = get_str(e, "dtype").empty() ? "fp32" : get_str(e, "dtype");  // older scripts: fp32 only
        r.kernel = "python " + get_str(j, "python_version") + " " + r.dtype;
        if (e.contains("error")) {
          r.reason = get_str(e, "error");
        } else {
          r.ok = true;
          r.ms.median = get_num(e, "ms_median");
          r.ms.min = get_num(e, "ms_min");
          r.ms.max = get_num(e, "ms_max");
          r.iters = static_cast<int>(get_num(e, "iters"));
          r.max_err = get_num(e, "max_err");
          r.gflops = attention_flops(r.B, r.H, r.L, r.d) / (r.ms.median * 1e6);
        }
        rows.push_back(r);
      }
    }
  }
}

torch_server::torch_server(const torch_peer& peer, const std::string& script, const std::string& args) {
  command_ = torch_env(false) + shell_quote(peer.python) + " " + shell_quote(script) + " --serve " + args;
  child_ = std::make_unique<harness::coprocess>(command_);
  const auto line = child_->read_line("DFSS_TORCH_JSON ");
  if (!line || !read_torch_json("DFSS_TORCH_JSON " + *line, hello_) || !hello_.is_object() ||
      !hello_.value("serving", false)) {
    why_ = line ? "its first answer is not a serving one: " + *line : "it gave no answer";
    child_.reset();
  }
}

json torch_server::ask(const json& request) {
  const auto line = alive() ? child_->request(request.dump(), "DFSS_TORCH_JSON ") : std::nullopt;
  if (!line) return json{{"error", "the torch co-process ended (run it by hand: " + command_ + ")"}};
  json answer;
  if (!read_torch_json("DFSS_TORCH_JSON " + *line, answer) || !answer.is_object())
    return json{{"error", "unreadable answer of the torch co-process: " + *line}};
  return answer;
}

std::vector<std::pair<std::string, std::string>> torch_entries() {
  std::vector<std::pair<std::string, std::string>> out = {{"fp32", "bmm"}, {"fp32", "sdpa"}};
  const std::string label = dtype_label(g_opt.dtype_name);
  if (label != "fp32") out.emplace_back(label, "sdpa");
  return out;
}

}  // namespace dfss::cli::bench
