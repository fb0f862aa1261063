// Shared declarations of the units of `dfss bench` (tools/cli/cmd_bench.cpp is the command; what each
// unit does is said at its top): the options, the rows of the table, the harness (timing,
// statistics, progress line; machine description and inputs from bench/harness/), and the entry points of the dfss rows, the peers
// (PyTorch, OpenBLAS), the memory mode and the output.
#pragma once

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <chrono>
#include <cstdio>
#include <limits>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "dfss/build_info.hpp"
#include "dfss/dfss.hpp"
#include "harness/inputs.hpp"
#include "harness/machine.hpp"

namespace dfss::cli::bench {

// ---------------------------------------------------------------------------------------------
// Options
// ---------------------------------------------------------------------------------------------

struct bench_options {
  std::vector<long long> lengths{512, 1024, 2048, 4096};
  std::vector<std::string> patterns{"dense", "1:2", "2:4"};
  std::vector<std::string> algorithms{"fused", "three-stage"};
  std::vector<std::string> isas{"automatic"};
  long long batch = 1, heads = 12, head_dim = 64;
  int threads = 2;
  std::string dtype_name = "f32";
  // --out-dtype: O in the inputs' type ("input": what the torch operator and SDPA return) or "f32"
  std::string out_dtype = "input";
  int warmup = 2, iters = 7;
  int rounds = 1;  // --rounds: the whole sweep repeated (medians of the rounds' medians and ratios)
  double budget_s = 20.0;
  unsigned long long seed = 2023;
  long long ref_rows = 32;
  std::string json;
  bool no_torch = false, no_torch_tuned = false, no_sgemm = false, no_ref = false;
  std::vector<std::string> python;  // default: default_pythons()
  std::string torch_script;
  bool backward = false;
  bool progress = false;  // the progress line also when stderr is not a terminal
  // --memory
  bool memory = false;
  std::vector<long long> memory_lengths{1024, 16384};
  std::vector<std::string> memory_patterns{"2:4"};
  long long memory_heads = 1;
  long long memory_child = 0;  // hidden: run one forward call of this length and print ru_maxrss
  // --decode
  bool decode = false;
  std::vector<std::string> decode_heads{"32:32", "32:8"};
  std::vector<std::string> decode_dtypes{"f32", "bf16"};
  long long query_rows = 1;
  std::string cache_layout = "bhld";  // --decode: the cache's memory, [B, Hkv, Lk, d] or [B, Lk, Hkv, d]
  // --causal: the sweep with a causal mask (prefill), SDPA with is_causal=True
  bool causal = false;
  // Whether --lengths and --head-dim were given (--backward and --decode change their defaults),
  // recorded while the parser lives: its options are gone when the command runs.
  bool lengths_given = false, head_dim_given = false;
};

extern bench_options g_opt;

/// --backward: the gradient error is computed on a problem of this length (or L when shorter).
inline constexpr long long kBackwardRefLength = 256;

inline constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// ---------------------------------------------------------------------------------------------
// Harness (harness.cpp): small utilities, timing and statistics, progress; the machine description
// and the inputs come from the benchmarks' shared harness (bench/harness/)
// ---------------------------------------------------------------------------------------------

template <typename T>
std::string join(const std::vector<T>& v, const char* sep = ",") {
  std::ostringstream s;
  for (std::size_t i = 0; i < v.size(); ++i) s << (i ? sep : "") << v[i];
  return s.str();
}

std::string torch2_venv_dir();
std::vector<std::string> default_pythons();
std::string dtype_label(const std::string& dfss_name);
std::string self_exe();
bool file_exists(const std::string& path);
// The machine description and shell helpers every benchmark shares (bench/harness/machine.hpp).
using harness::capture;
using harness::cpu_model;
using harness::git_commit;
using harness::hardware_threads;
using harness::load_average;
using harness::now_utc;
using harness::shell_quote;
using harness::trim;

/// On a terminal one line redrawn in place; with --progress and stderr not a terminal, one line per
/// step; otherwise nothing. The other messages on stderr go through log() so the line stays last.
class progress_line {
 public:
  void enable(bool on, bool tty) {
    on_ = on;
    tty_ = tty;
    t0_ = std::chrono::steady_clock::now();
  }
  void add_rows(int n) { total_ += n; }
  /// Row `done + 1` of `total` starts (or, with rows > 1, a group of rows is timed together).
  void show(int first_row, int rows, const std::string& what) {
    if (!on_) return;
    const int last = first_row + rows - 1;
    const int secs = static_cast<int>(elapsed_ms(t0_) / 1e3);
    char head[96];
    if (rows > 1) {
      std::snprintf(head, sizeof head, "[dfss bench] rows %d-%d of %d (%d left)", first_row, last, total_,
                    total_ - last);
    } else {
      std::snprintf(head, sizeof head, "[dfss bench] row %d of %d (%d left)", first_row, total_, total_ - last);
    }
    current_ = std::string(head) + ", " + what + ", " + std::to_string(secs / 60) + "m" +
               (secs % 60 < 10 ? "0" : "") + std::to_string(secs % 60) + "s so far";
    draw();
  }
  /// One message line on stderr, above the progress line.
  void log(const std::string& line) {
    clear();
    std::fprintf(stderr, "%s\n", line.c_str());
    if (tty_) draw();
  }
  void done() {
    clear();
    current_.clear();
  }

 private:
  void draw() {
    if (!on_ || current_.empty()) return;
    if (tty_) {
      std::fprintf(stderr, "\r\033[K%s", current_.c_str());  // ESC[K: erase to the end of the line
    } else {
      std::fprintf(stderr, "%s\n", current_.c_str());
    }
    std::fflush(stderr);
  }
  void clear() {
    if (on_ && tty_ && !current_.empty()) std::fprintf(stderr, "\r\033[K");
  }
  static double elapsed_ms(std::chrono::steady_clock::time_point t0) {
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  }
  bool on_ = false, tty_ = false;
  int total_ = 0;
  std::string current_;
  std::chrono::steady_clock::time_point t0_;
};

extern progress_line g_progress;
extern int g_rows_done;  // rows measured so far (dfss configurations, torch runs)
/// printf to stderr through the progress line.
[[gnu::format(printf, 1, 2)]] void log_stderr(const char* format, ...);

struct stats {
  double median = kNaN, min = kNaN, max = kNaN;
};

stats summarize(std::vector<double> v);
/// The median of @p v without its NaNs (NaN when none is left): medians of rounds (--rounds).
double median_of(std::vector<double> v);
double elapsed_ms(std::chrono::steady_clock::time_point t0);
int timed_iterations(double first_ms);

using json = nlohmann::json;
std::string get_str(const json& j, const char* key);
double get_num(const json& j, const char* key);

// ---------------------------------------------------------------------------------------------
// Rows of the table
// ---------------------------------------------------------------------------------------------

struct row {
  std::string source;  // "dfss" or "torch"
  long long B = 0, H = 0, L = 0, d = 0;
  std::string pattern;    // "dense", "1:2", ...
  std::string algorithm;  // "fused", "three-stage", or the torch label
  std::string isa;        // requested ISA (dfss rows)
  std::string kernel;     // selector name, or the torch interpreter
  std::string dtype;      // input type: fp32, bf16, fp16 (dfss: --dtype; torch: the script's row)
  bool ok = false;
  std::string reason;  // why not ok
  int iters = 0;
  stats ms;
  double gflops = kNaN, speedup = kNaN, max_err = kNaN;
  double vs_sdpa = kNaN;       // median of the SDPA row (torch 2.x, same L and dtype) / this row's
  double sgemm_share = kNaN;   // GFLOP/s / the sgemm yardstick's GFLOP/s
  // --rounds > 1: each round's median and ratio against SDPA, in round order (merged into the above)
  std::vector<double> round_ms, round_vs_sdpa;
};

double flops_factor();
double attention_flops(long long B, long long H, long long L, long long d);

/// One [B, L, H, d] tensor of standard normal values in the benchmark's input type (the harness's,
/// shared with the micro-benchmarks).
using harness::input_tensor;

dtype parse_dtype(const std::string& s);
/// The type of O for inputs of type @p input (--out-dtype).
dtype output_dtype(dtype input);
cpu_algorithm parse_cpu_algorithm_arg(const std::string& s);
cpu_isa parse_cpu_isa_arg(const std::string& s);

// ---------------------------------------------------------------------------------------------
// Peers: the OpenBLAS sgemm yardstick (peer_openblas.cpp), PyTorch (peer_torch.cpp)
// ---------------------------------------------------------------------------------------------

using sgemm_fn = void (*)(int, int, int, int, int, int, float, const float*, int, const float*, int, float,
                          float*, int);

/// The yardstick: cblas_sgemm n^3. Its calls are timed inside the round-robin of every length
/// (time_one), so its samples see the same machine load as the attention rows; the median of all
/// samples is reported.
struct sgemm_result {
  bool ok = false;
  std::string library, corename, reason;
  int n = 2048;
  sgemm_fn sgemm = nullptr;
  std::vector<float> a, b, c;
  std::vector<double> samples;
  stats ms;
  double gflops = kNaN;

  void call() {
    constexpr int kRowMajor = 101, kNoTrans = 111;
    sgemm(kRowMajor, kNoTrans, kNoTrans, n, n, n, 1.0f, a.data(), n, b.data(), n, 0.0f, c.data(), n);
  }
  void time_one() {
    if (!ok) return;
    const auto t0 = std::chrono::steady_clock::now();
    call();
    samples.push_back(elapsed_ms(t0));
  }
  void finish() {
    if (!ok) return;
    ms = summarize(samples);
    gflops = 2.0 * n * static_cast<double>(n) * n / (ms.median * 1e6);
  }
};

void setup_sgemm_yardstick(sgemm_result& r, int threads);

struct torch_peer {
  std::string python, version, sdpa;
};

std::vector<torch_peer> probe_torch_peers(std::vector<std::string>& notes);
bool runs_tuned(const torch_peer& peer);
/// Whether @p peer is torch 2.x with the public scaled_dot_product_attention (the SDPA a user would
/// pick, and the one peer dfss bench serves).
bool has_public_sdpa(const torch_peer& peer);
std::string find_torch_script();
bool read_torch_json(const std::string& output, json& out);
std::string torch_env(bool tuned);
void bench_torch(const std::vector<torch_peer>& peers, std::vector<row>& rows, std::vector<std::string>& notes);

/// How long hand_off() keeps the threads busy before a timed call that follows the other process's
/// (dfss's after torch's, torch's after dfss's): an OpenMP runtime's threads spin for a while after
/// their last parallel region (libgomp's default: 4-7 ms of CPU measured on the 2-core Sapphire
/// Rapids VM) and would share the cores with the other process's timed call. Busy, not asleep: on
/// that VM the first parallel region after 20 ms of sleep took 4.5-7 ms instead of 2 us (the idle
/// vCPUs wake slowly), so an idle gap would be timed into the next call.
inline constexpr auto kHandOff = std::chrono::milliseconds(20);
/// Keeps --threads OpenMP threads busy for kHandOff (see there). The served scripts do as much
/// with torch's threads before each of their timed calls.
void hand_off();

/// A torch script of tools/bench/ run with --serve as a co-process for the whole run
/// (harness::coprocess), so that torch's calls are timed one at a time, round-robin with the dfss
/// rows they are compared with, instead of in a child after all of them (the host moves between the
/// two phases by more than the kernels' margins). Requests and answers are JSON lines.
class torch_server {
 public:
  /// Starts `@p script --serve @p args` under @p peer's interpreter with the thread variables; not
  /// alive(), the reason in why(), unless it answers a first line with "serving": true (a script
  /// that does not serve falls back to the child run of bench_torch).
  torch_server(const torch_peer& peer, const std::string& script, const std::string& args);
  bool alive() const { return child_ != nullptr && child_->alive(); }
  const std::string& command() const { return command_; }
  const std::string& why() const { return why_; }
  /// The first line's fields (python_version, torch_version, ...).
  const json& hello() const { return hello_; }
  /// One request's answer, or {"error": why} (the co-process gone, or an unreadable answer).
  json ask(const json& request);

 private:
  std::string command_, why_;
  json hello_;
  std::unique_ptr<harness::coprocess> child_;
};

// ---------------------------------------------------------------------------------------------
// dfss rows (dfss_rows.cpp)
// ---------------------------------------------------------------------------------------------

int dfss_rows_per_length();
/// The dfss rows of length @p L, timed round-robin with one sgemm yardstick call per turn and, when
/// @p torch is alive, one call of each of its entries for L (torch_entries) per turn.
void bench_length(long long L, dtype type, std::vector<row>& rows, sgemm_result& sg, torch_server* torch);
/// The (torch dtype, method) entries the forward times per length: fp32 bmm and sdpa, plus sdpa in the
/// dfss input type when it is 16-bit (what bench_torch asks the child for).
std::vector<std::pair<std::string, std::string>> torch_entries();
std::string dense_kernel_name(dtype type);

// ---------------------------------------------------------------------------------------------
// Output (output.cpp), --memory (memory.cpp)
// ---------------------------------------------------------------------------------------------

/// What the header and the JSON say about the machine and the kernel that runs.
struct machine_info {
  std::string cpu;          // /proc/cpuinfo model name
  std::string kernel;       // the selector's dense fused forward kernel for the first --isa, this shape
  std::string isa;          // its last component (avx2, portable, generic, ...)
  std::string sdpa_peer;    // the algorithm label of the rows behind the "vs SDPA" column, or ""
};

std::string repro_command();
void print_column_notes(const machine_info& mi);
void print_table(const std::vector<row>& rows);
void write_json(const std::string& path, const std::vector<row>& rows, const sgemm_result& sg,
                const build_info& info, const machine_info& m, const std::string& date,
                const std::string& commit, const std::vector<std::string>& notes);
int run_memory_child();
int run_memory();
/// --decode (decode.cpp): one decode step against a KV cache, with the memory sweep and SDPA.
int run_decode();

}  // namespace dfss::cli::bench
