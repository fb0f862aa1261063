// `dfss bench`: the benchmark table of the CPU backend, with its peers measured in the same run.
//
// Rows: every (shape, pattern, algorithm) of dfss on the cpu backend, then PyTorch (each Python
// interpreter that imports torch, run as a child process with the same thread count), then the
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
#include <dlfcn.h>
#include <omp.h>
#include <sys/resource.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <fstream>
#include <limits>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "cli/commands.hpp"
#include "dfss/build_info.hpp"
#include "dfss/dfss.hpp"
#include "npy/files.hpp"

#ifndef DFSS_BENCH_SCRIPT_DIR
#define DFSS_BENCH_SCRIPT_DIR ""
#endif
#ifndef DFSS_BENCH_SOURCE_DIR
#define DFSS_BENCH_SOURCE_DIR ""
#endif

namespace dfss::cli {
namespace {

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
  int warmup = 2, iters = 7;
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
};

bench_options g_opt;
CLI::Option* g_lengths_option = nullptr;  // to tell a given --lengths from the default

/// --backward: the gradient error is computed on a problem of this length (or L when shorter).
constexpr long long kBackwardRefLength = 256;

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

/// The venv of tools/scripts/torch2-venv.sh: $DFSS_TORCH2_VENV, else
/// ${XDG_CACHE_HOME:-$HOME/.cache}/dfss/torch2-venv (the script's default).
std::string torch2_venv_dir() {
  if (const char* v = std::getenv("DFSS_TORCH2_VENV"); v != nullptr && *v != '\0') return v;
  if (const char* x = std::getenv("XDG_CACHE_HOME"); x != nullptr && *x != '\0')
    return std::string(x) + "/dfss/torch2-venv";
  if (const char* h = std::getenv("HOME"); h != nullptr && *h != '\0') return std::string(h) + "/.cache/dfss/torch2-venv";
  return {};
}

/// --python's default: Debian's python3 (torch 1.13), the torch 2.x venv when it exists, python3 on PATH.
std::vector<std::string> default_pythons() {
  std::vector<std::string> v{"/usr/bin/python3"};
  const std::string venv = torch2_venv_dir();
  if (!venv.empty() && access((venv + "/bin/python").c_str(), X_OK) == 0) v.push_back(venv + "/bin/python");
  v.push_back("python3");
  return v;
}

/// The canonical name of a dtype as the table and the torch script write it (fp32, bf16, fp16).
std::string dtype_label(const std::string& dfss_name) {
  if (dfss_name == "bf16" || dfss_name == "bfloat16") return "bf16";
  if (dfss_name == "f16" || dfss_name == "fp16" || dfss_name == "float16") return "fp16";
  return "fp32";
}

// ---------------------------------------------------------------------------------------------
// Small utilities
// ---------------------------------------------------------------------------------------------

template <typename T>
std::string join(const std::vector<T>& v, const char* sep = ",") {
  std::ostringstream s;
  for (std::size_t i = 0; i < v.size(); ++i) s << (i ? sep : "") << v[i];
  return s.str();
}

std::string shell_quote(const std::string& s) {
  std::string out = "'";
  for (char c : s) {
    if (c == '\'') {
      out += "'\\''";
    } else {
      out += c;
    }
  }
  return out + "'";
}

/// Runs a shell command and returns its standard output (standard error is not captured).
std::string capture(const std::string& command, int* exit_status = nullptr) {
  std::string out;
  FILE* p = popen(command.c_str(), "r");
  if (p == nullptr) {
    if (exit_status) *exit_status = -1;
    return out;
  }
  char buf[4096];
  std::size_t got;
  while ((got = std::fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, got);
  const int rc = pclose(p);
  if (exit_status) *exit_status = rc;
  return out;
}

std::string trim(std::string s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.pop_back();
  std::size_t i = 0;
  while (i < s.size() && std::isspace(static_cast<unsigned char>(s[i]))) ++i;
  return s.substr(i);
}

std::string self_exe() {
  char buf[4096];
  const ssize_t n = readlink("/proc/self/exe", buf, sizeof buf - 1);
  if (n <= 0) return {};
  return std::string(buf, static_cast<std::size_t>(n));
}

bool file_exists(const std::string& path) { return !path.empty() && access(path.c_str(), R_OK) == 0; }

/// "AMD EPYC (family 25 model 17)": the model name of /proc/cpuinfo, with the family and model
/// numbers, which tell apart CPUs that a VM names alike (Zen 3 is family 25 model 1, Zen 4 model 17).
std::string cpu_model() {
  std::ifstream f("/proc/cpuinfo");
  std::string line, name, family, model;
  auto value = [&line] {
    const auto colon = line.find(':');
    return colon == std::string::npos ? std::string{} : trim(line.substr(colon + 1));
  };
  while (std::getline(f, line) && line != "") {
    if (line.rfind("model name", 0) == 0) {
      name = value();
    } else if (line.rfind("cpu family", 0) == 0) {
      family = value();
    } else if (line.rfind("model", 0) == 0 && line.find(':') != std::string::npos &&
               trim(line.substr(0, line.find(':'))) == "model") {
      model = value();
    }
  }
  if (name.empty()) name = "unknown";
  if (!family.empty() && !model.empty()) name += " (family " + family + " model " + model + ")";
  return name;
}

/// The 1-minute load average (other processes competing for the cores make every number noisier).
std::string load_average() {
  std::ifstream f("/proc/loadavg");
  std::string one;
  f >> one;
  return one.empty() ? "unknown" : one;
}

std::string now_utc() {
  const std::time_t t = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[64];
  std::strftime(buf, sizeof buf, "%Y-%m-%d %H:%M:%S UTC", &tm);
  return buf;
}

/// "abc1234" (+ " (uncommitted changes)") of the source tree this binary was built from, or "".
std::string git_commit() {
  const std::string dir = DFSS_BENCH_SOURCE_DIR;
  if (dir.empty()) return {};
  const std::string q = shell_quote(dir);
  std::string head = trim(capture("git -C " + q + " rev-parse --short HEAD 2>/dev/null"));
  if (head.empty()) return {};
  if (!trim(capture("git -C " + q + " status --porcelain --untracked-files=no 2>/dev/null")).empty()) {
    head += " (uncommitted changes)";
  }
  return head;
}

// ---------------------------------------------------------------------------------------------
// The progress line (stderr): which row, how many left, time so far
// ---------------------------------------------------------------------------------------------

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

progress_line g_progress;
int g_rows_done = 0;  // rows measured so far (dfss configurations, torch runs)

/// printf to stderr through the progress line.
[[gnu::format(printf, 1, 2)]] void log_stderr(const char* format, ...) {
  char buf[1024];
  va_list ap;
  va_start(ap, format);
  std::vsnprintf(buf, sizeof buf, format, ap);
  va_end(ap);
  std::string line = buf;
  if (!line.empty() && line.back() == '\n') line.pop_back();
  g_progress.log(line);
}

struct stats {
  double median = kNaN, min = kNaN, max = kNaN;
};

stats summarize(std::vector<double> v) {
  stats s;
  if (v.empty()) return s;
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  s.median = n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
  s.min = v.front();
  s.max = v.back();
  return s;
}

double elapsed_ms(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

/// Timed calls for a configuration whose first call took @p first_ms: --iters, reduced so that the
/// configuration stays near --budget seconds, never below 3.
int timed_iterations(double first_ms) {
  int iters = g_opt.iters;
  if (first_ms * iters > g_opt.budget_s * 1e3) {
    iters = std::max(3, static_cast<int>(g_opt.budget_s * 1e3 / std::max(first_ms, 1e-6)));
  }
  return std::min(iters, g_opt.iters);
}

// ---------------------------------------------------------------------------------------------
// JSON (nlohmann-json): the torch script's output in, the --json file out
// ---------------------------------------------------------------------------------------------

using json = nlohmann::json;

/// j[key] as a string, or empty when absent or not a string.
std::string get_str(const json& j, const char* key) {
  const auto it = j.find(key);
  return it != j.end() && it->is_string() ? it->get<std::string>() : std::string{};
}

/// j[key] as a number, or NaN when absent or null (the script writes non-finite floats as null).
double get_num(const json& j, const char* key) {
  const auto it = j.find(key);
  return it != j.end() && it->is_number() ? it->get<double>() : kNaN;
}

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
};

/// Dense-equivalent flops per head and Lq Lk d: 4 for a forward call (Q K^T and P V), 14 for forward +
/// backward (--backward: the backward recomputes Q K^T and computes dO V^T, P^T dO, dS K, dS^T Q).
double flops_factor() { return g_opt.backward ? 14.0 : 4.0; }

double attention_flops(long long B, long long H, long long L, long long d) {
  return flops_factor() * static_cast<double>(B) * static_cast<double>(H) * static_cast<double>(L) *
         static_cast<double>(L) * static_cast<double>(d);
}

// ---------------------------------------------------------------------------------------------
// Inputs
// ---------------------------------------------------------------------------------------------

/// One [B, L, H, d] tensor of standard normal values in the benchmark's input type.
struct input_tensor {
  dtype type = dtype::f32;
  std::vector<float> f32;
  std::vector<half> f16;
  std::vector<bfloat16> b16;

  void fill(std::size_t n, dtype t, std::mt19937_64& rng) {
    type = t;
    std::normal_distribution<float> normal(0.0f, 1.0f);
    f32.resize(n);
    for (auto& x : f32) x = normal(rng);
    if (t == dtype::f16) {
      f16.resize(n);
      for (std::size_t i = 0; i < n; ++i) f16[i] = half{float_to_f16(f32[i])};
      std::vector<float>().swap(f32);
    } else if (t == dtype::bf16) {
      b16.resize(n);
      for (std::size_t i = 0; i < n; ++i) b16[i] = bfloat16{float_to_bf16(f32[i])};
      std::vector<float>().swap(f32);
    }
  }
  /// The stored (rounded) value of element i, exactly.
  double at(std::size_t i) const {
    switch (type) {
      case dtype::f16:
        return static_cast<double>(f16_to_float(f16[i].bits));
      case dtype::bf16:
        return static_cast<double>(bf16_to_float(b16[i].bits));
      default:
        return static_cast<double>(f32[i]);
    }
  }
  tensor_view view(std::int64_t B, std::int64_t L, std::int64_t H, std::int64_t d) {
    switch (type) {
      case dtype::f16:
        return make_view(f16.data(), {B, L, H, d});
      case dtype::bf16:
        return make_view(b16.data(), {B, L, H, d});
      default:
        return make_view(f32.data(), {B, L, H, d});
    }
  }
  std::size_t bytes() const { return f32.size() * 4 + f16.size() * 2 + b16.size() * 2; }
};

dtype parse_dtype(const std::string& s) {
  if (s == "f32" || s == "fp32" || s == "float32") return dtype::f32;
  if (s == "f16" || s == "fp16" || s == "float16") return dtype::f16;
  if (s == "bf16" || s == "bfloat16") return dtype::bf16;
  throw error(status_code::invalid_argument,
              "dfss bench: argument '--dtype': expected f32, f16 or bf16, got '" + s + "'");
}



cpu_algorithm parse_cpu_algorithm_arg(const std::string& s) { return parse_cpu_algorithm(s, "--algorithms"); }
cpu_isa parse_cpu_isa_arg(const std::string& s) { return parse_cpu_isa(s, "--isa"); }

// ---------------------------------------------------------------------------------------------
// The OpenBLAS sgemm yardstick (dlopen: no build-time dependency)
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

/// Loads OpenBLAS with dlopen (no build-time dependency), fills the operands and warms up.
void setup_sgemm_yardstick(sgemm_result& r, int threads) {
  // OpenBLAS reads OPENBLAS_NUM_THREADS when it is loaded; set it before dlopen (and call
  // openblas_set_num_threads as well, in case the library was already loaded).
  const std::string t = std::to_string(threads);
  setenv("OPENBLAS_NUM_THREADS", t.c_str(), 1);
  void* lib = nullptr;
  for (const char* name : {"libopenblas.so.0", "libopenblas.so"}) {
    lib = dlopen(name, RTLD_NOW | RTLD_LOCAL);
    if (lib) {
      r.library = name;
      break;
    }
  }
  if (!lib) {
    r.reason = "OpenBLAS not found (Debian: apt-get install libopenblas-dev)";
    return;
  }
  using set_threads_fn = void (*)(int);
  using corename_fn = char* (*)();
  auto sym = [&](const char* name, auto& fn) {
    void* p = dlsym(lib, name);
    std::memcpy(&fn, &p, sizeof fn);
    return p != nullptr;
  };
  set_threads_fn set_threads = nullptr;
  corename_fn corename = nullptr;
  if (!sym("cblas_sgemm", r.sgemm)) {
    r.reason = "cblas_sgemm not found in " + r.library;
    return;
  }
  if (sym("openblas_set_num_threads", set_threads)) set_threads(threads);
  if (sym("openblas_get_corename", corename)) r.corename = corename();

  const auto nn = static_cast<std::size_t>(r.n) * static_cast<std::size_t>(r.n);
  r.a.resize(nn);
  r.b.resize(nn);
  r.c.assign(nn, 0.0f);
  std::mt19937_64 rng(g_opt.seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (auto& x : r.a) x = normal(rng);
  for (auto& x : r.b) x = normal(rng);
  for (int i = 0; i < g_opt.warmup; ++i) r.call();
  r.ok = true;
}

// ---------------------------------------------------------------------------------------------
// dfss rows
// ---------------------------------------------------------------------------------------------

struct run_state {
  row r;
  attention_config cfg;
  std::vector<float> out;
  std::vector<float> lse, dq, dk, dv;  // --backward
  std::vector<double> ms;
  int target = 0;
};

/// --backward: the backward arguments of one configuration (its outputs, the forward's O and LSE).
backward_args make_backward_args(const forward_args& a, run_state& s, const tensor_view& dout,
                                 std::int64_t B, std::int64_t L, std::int64_t H, std::int64_t d) {
  backward_args b;
  b.q = a.q;
  b.k = a.k;
  b.v = a.v;
  b.out = make_view(s.out.data(), {B, L, H, d});
  b.lse = make_view(s.lse.data(), {B, H, L});
  b.dout = dout;
  b.dq = make_view(s.dq.data(), {B, L, H, d});
  b.dk = make_view(s.dk.data(), {B, L, H, d});
  b.dv = make_view(s.dv.data(), {B, L, H, d});
  return b;
}

/// One timed unit of a configuration: the forward call, then with --backward the backward call.
status call_once(forward_args& a, run_state& s, const tensor_view& dout, std::int64_t B, std::int64_t L,
                 std::int64_t H, std::int64_t d) {
  a.out = make_view(s.out.data(), {B, L, H, d});
  if (!g_opt.backward) return try_attention_forward(a, s.cfg);
  a.lse = make_view(s.lse.data(), {B, H, L});
  const status st = try_attention_forward(a, s.cfg);
  if (!st.ok()) return st;
  return try_attention_backward(make_backward_args(a, s, dout, B, L, H, d), s.cfg);
}

/// --backward: max |dQ, dK, dV - fp64 reference| over every element, on the problem of length
/// Le = min(L, kBackwardRefLength) with the same B, H, d, dtype, seed convention and configuration
/// (at L = Le these are the timed row's own inputs). Cached per (pattern, ISA, Le).
double backward_max_error(const attention_config& cfg, long long L, dtype type) {
  static std::map<std::string, double> cache;
  const std::int64_t B = g_opt.batch, H = g_opt.heads, d = g_opt.head_dim;
  const std::int64_t Le = std::min(L, kBackwardRefLength);
  const std::string key = cfg.pattern.str() + "|" + std::to_string(static_cast<int>(cfg.cpu_isa)) + "|" +
                          std::to_string(Le);
  if (const auto it = cache.find(key); it != cache.end()) return it->second;
  log_stderr("  L=%lld %s: gradient error vs fp64 reference backward at L=%lld\n", L,
               cfg.pattern.str().c_str(), static_cast<long long>(Le));
  const auto n = static_cast<std::size_t>(B * Le * H * d);
  std::mt19937_64 rng(g_opt.seed + static_cast<unsigned long long>(Le));
  input_tensor q, k, v, dout;
  q.fill(n, type, rng);
  k.fill(n, type, rng);
  v.fill(n, type, rng);
  dout.fill(n, type, rng);
  run_state s;
  s.cfg = cfg;
  s.out.assign(n, 0.0f);
  s.lse.assign(static_cast<std::size_t>(B * H * Le), 0.0f);
  s.dq.assign(n, 0.0f);
  s.dk.assign(n, 0.0f);
  s.dv.assign(n, 0.0f);
  forward_args a;
  a.q = q.view(B, Le, H, d);
  a.k = k.view(B, Le, H, d);
  a.v = v.view(B, Le, H, d);
  const status st = call_once(a, s, dout.view(B, Le, H, d), B, Le, H, d);
  if (!st.ok()) return kNaN;

  std::vector<double> qd(n), kd(n), vd(n), dod(n), dqd(n, 0.0), dkd(n, 0.0), dvd(n, 0.0);
  for (std::size_t i = 0; i < n; ++i) {
    qd[i] = q.at(i);
    kd[i] = k.at(i);
    vd[i] = v.at(i);
    dod[i] = dout.at(i);
  }
  backward_args rb;  // O and LSE are recomputed by the reference
  rb.q = make_view(qd.data(), {B, Le, H, d});
  rb.k = make_view(kd.data(), {B, Le, H, d});
  rb.v = make_view(vd.data(), {B, Le, H, d});
  rb.dout = make_view(dod.data(), {B, Le, H, d});
  rb.dq = make_view(dqd.data(), {B, Le, H, d});
  rb.dk = make_view(dkd.data(), {B, Le, H, d});
  rb.dv = make_view(dvd.data(), {B, Le, H, d});
  attention_config rc = cfg;
  rc.backend = backend::reference;
  attention_backward(rb, rc);
  double err = 0;
  auto compare = [&err](const std::vector<float>& got, const std::vector<double>& want) {
    for (std::size_t i = 0; i < got.size(); ++i) {
      const double e = std::fabs(static_cast<double>(got[i]) - want[i]);
      err = (std::isnan(e) || e > err) ? e : err;
    }
  };
  compare(s.dq, dqd);
  compare(s.dk, dkd);
  compare(s.dv, dvd);
  cache.emplace(key, err);
  return err;
}

/// Whether (algorithm, pattern, index of the ISA in --isa) is a row of the table. Three-stage rows are
/// made for the sparse patterns (the three-stage pipeline of dense attention is not the paper's),
/// once, not per ISA (the selector has one three-stage kernel), and not with --backward (no backward).
bool makes_row(cpu_algorithm algorithm, const pattern& p, std::size_t isa_index) {
  return algorithm != cpu_algorithm::three_stage || !(p.is_dense() || isa_index > 0 || g_opt.backward);
}

/// dfss rows per length (for the progress line).
int dfss_rows_per_length() {
  int n = 0;
  for (std::size_t ii = 0; ii < g_opt.isas.size(); ++ii)
    for (const auto& pat : g_opt.patterns)
      for (const auto& alg : g_opt.algorithms)
        n += makes_row(parse_cpu_algorithm_arg(alg), pattern::parse(pat, "--patterns"), ii) ? 1 : 0;
  return n;
}

void bench_length(long long L, dtype type, std::vector<row>& rows, sgemm_result& sg) {
  const std::int64_t B = g_opt.batch, H = g_opt.heads, d = g_opt.head_dim;
  const auto n = static_cast<std::size_t>(B * L * H * d);
  std::mt19937_64 rng(g_opt.seed + static_cast<unsigned long long>(L));
  input_tensor q, k, v;
  q.fill(n, type, rng);
  k.fill(n, type, rng);
  v.fill(n, type, rng);
  input_tensor dout;  // --backward: dO, standard normal
  tensor_view dout_view;
  if (g_opt.backward) {
    dout.fill(n, type, rng);
    dout_view = dout.view(B, L, H, d);
  }
  forward_args a;
  a.q = q.view(B, L, H, d);
  a.k = k.view(B, L, H, d);
  a.v = v.view(B, L, H, d);

  // The configurations of this shape (makes_row).
  std::vector<std::unique_ptr<run_state>> runs;
  for (std::size_t ii = 0; ii < g_opt.isas.size(); ++ii) {
    for (const auto& pat : g_opt.patterns) {
      for (const auto& alg : g_opt.algorithms) {
        const cpu_algorithm algorithm = parse_cpu_algorithm_arg(alg);
        const pattern p = pattern::parse(pat, "--patterns");
        if (!makes_row(algorithm, p, ii)) continue;
        auto s = std::make_unique<run_state>();
        s->cfg.pattern = p;
        s->cfg.backend = backend::cpu;
        s->cfg.num_threads = g_opt.threads;
        s->cfg.cpu_algorithm = algorithm;
        s->cfg.cpu_isa = parse_cpu_isa(g_opt.isas[ii], "--isa");
        s->r.source = "dfss";
        s->r.B = B;
        s->r.H = H;
        s->r.L = L;
        s->r.d = d;
        s->r.dtype = dtype_label(g_opt.dtype_name);
        s->r.pattern = p.str();
        s->r.algorithm = algorithm == cpu_algorithm::fused ? "fused" : "three-stage";
        s->r.isa = algorithm == cpu_algorithm::fused ? g_opt.isas[ii] : "-";
        runs.push_back(std::move(s));
      }
    }
  }

  // Selection, first call (which also sizes the iteration count) and warmup.
  const int first_row = g_rows_done + 1;
  for (std::size_t ri = 0; ri < runs.size(); ++ri) {
    auto& s = runs[ri];
    g_progress.show(first_row + static_cast<int>(ri), 1,
                    "L=" + std::to_string(L) + " " + s->r.pattern + " " + s->r.algorithm + ": first call and warmup");
    s->out.assign(n, 0.0f);
    a.out = make_view(s->out.data(), {B, L, H, d});
    kernel_selection sel = select_kernel(a, s->cfg);
    if (g_opt.backward) {
      // The kernel column names both calls: "forward kernel+backward kernel".
      s->lse.assign(static_cast<std::size_t>(B * H * L), 0.0f);
      s->dq.assign(n, 0.0f);
      s->dk.assign(n, 0.0f);
      s->dv.assign(n, 0.0f);
      a.lse = make_view(s->lse.data(), {B, H, L});
      if (sel.supported()) {
        const kernel_selection bsel = select_kernel(make_backward_args(a, *s, dout_view, B, L, H, d), s->cfg);
        if (bsel.supported()) {
          sel.name += "+" + bsel.name;
        } else {
          sel.kind = kernel_kind::none;
          sel.reason = "backward: " + bsel.reason;
        }
      }
    }
    s->r.kernel = sel.supported() ? sel.name : "-";
    if (!sel.supported()) {
      s->r.reason = sel.reason;
      continue;
    }
    log_stderr("  L=%lld %s %s (%s): warmup\n", L, s->r.pattern.c_str(), s->r.algorithm.c_str(),
               s->r.kernel.c_str());
    const auto t0 = std::chrono::steady_clock::now();
    const status st = call_once(a, *s, dout_view, B, L, H, d);
    const double first = elapsed_ms(t0);
    if (!st.ok()) {
      s->r.reason = st.message;
      continue;
    }
    const int warmup = first > 1000.0 ? 1 : g_opt.warmup;
    for (int i = 1; i < warmup; ++i) call_once(a, *s, dout_view, B, L, H, d);
    s->target = timed_iterations(first);
    s->r.ok = true;
  }
  // Timed calls, round-robin over the configurations (and one sgemm yardstick call per round).
  for (int it = 0;; ++it) {
    if (it < g_opt.iters)
      g_progress.show(first_row, static_cast<int>(runs.size()),
                      "L=" + std::to_string(L) + ": timed round " + std::to_string(it + 1) + " of up to " +
                          std::to_string(g_opt.iters));
    if (it < g_opt.iters) sg.time_one();
    bool any = false;
    for (auto& s : runs) {
      if (!s->r.ok || it >= s->target) continue;
      any = true;
      const auto t0 = std::chrono::steady_clock::now();
      const status st = call_once(a, *s, dout_view, B, L, H, d);
      const double t = elapsed_ms(t0);
      if (!st.ok()) {
        s->r.ok = false;
        s->r.reason = st.message;
        continue;
      }
      s->ms.push_back(t);
    }
    if (!any) break;
  }

  g_rows_done += static_cast<int>(runs.size());
  // --backward: the gradient error on the reduced problem (see backward_max_error).
  if (g_opt.backward) {
    for (auto& s : runs) {
      row& r = s->r;
      r.iters = static_cast<int>(s->ms.size());
      if (!r.ok) continue;
      r.ms = summarize(s->ms);
      r.gflops = attention_flops(B, H, L, d) / (r.ms.median * 1e6);
      if (!g_opt.no_ref && g_opt.ref_rows > 0) r.max_err = backward_max_error(s->cfg, L, type);
    }
    for (auto& s : runs) rows.push_back(std::move(s->r));
    return;
  }

  // fp64 reference on the first R query rows of every head (one per pattern).
  const std::int64_t R = std::min<std::int64_t>(g_opt.ref_rows, L);
  std::map<std::string, std::vector<double>> refs;
  std::vector<double> qd, kd, vd;
  if (!g_opt.no_ref && R > 0) {
    qd.resize(static_cast<std::size_t>(B * R * H * d));
    for (std::int64_t b = 0; b < B; ++b)
      for (std::int64_t i = 0; i < R * H * d; ++i)
        qd[static_cast<std::size_t>(b * R * H * d + i)] = q.at(static_cast<std::size_t>(b * L * H * d + i));
    kd.resize(n);
    vd.resize(n);
    for (std::size_t i = 0; i < n; ++i) {
      kd[i] = k.at(i);
      vd[i] = v.at(i);
    }
  }
  for (auto& s : runs) {
    row& r = s->r;
    r.iters = static_cast<int>(s->ms.size());
    if (!r.ok) continue;
    r.ms = summarize(s->ms);
    r.gflops = attention_flops(B, H, L, d) / (r.ms.median * 1e6);
    if (g_opt.no_ref || R == 0) continue;
    auto [it, inserted] = refs.try_emplace(r.pattern);
    if (inserted) {
      log_stderr("  L=%lld %s: fp64 reference on %lld query rows per head\n", L, r.pattern.c_str(),
                 static_cast<long long>(R));
      it->second.assign(static_cast<std::size_t>(B * R * H * d), 0.0);
      forward_args ra;
      ra.q = make_view(qd.data(), {B, R, H, d});
      ra.k = make_view(kd.data(), {B, L, H, d});
      ra.v = make_view(vd.data(), {B, L, H, d});
      ra.out = make_view(it->second.data(), {B, R, H, d});
      attention_config rc = s->cfg;
      rc.backend = backend::reference;
      attention_forward(ra, rc);
    }
    double err = 0;
    for (std::int64_t b = 0; b < B; ++b)
      for (std::int64_t i = 0; i < R * H * d; ++i) {
        const double got = static_cast<double>(s->out[static_cast<std::size_t>(b * L * H * d + i)]);
        const double want = it->second[static_cast<std::size_t>(b * R * H * d + i)];
        const double e = std::fabs(got - want);
        err = (std::isnan(e) || e > err) ? e : err;
      }
    r.max_err = err;
  }
  for (auto& s : runs) rows.push_back(std::move(s->r));
}

// ---------------------------------------------------------------------------------------------
// PyTorch rows
// ---------------------------------------------------------------------------------------------

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

struct torch_peer {
  std::string python, version, sdpa;
};

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

// ---------------------------------------------------------------------------------------------
// Output
// ---------------------------------------------------------------------------------------------

std::string repro_command() {
  std::ostringstream c;
  c << "dfss bench --lengths " << join(g_opt.lengths) << " --patterns " << join(g_opt.patterns)
    << " --algorithms " << join(g_opt.algorithms) << " --isa " << join(g_opt.isas) << " --batch "
    << g_opt.batch << " --heads " << g_opt.heads << " --head-dim " << g_opt.head_dim << " --threads "
    << g_opt.threads << " --dtype " << g_opt.dtype_name << " --warmup " << g_opt.warmup << " --iters "
    << g_opt.iters << " --budget " << g_opt.budget_s << " --seed " << g_opt.seed << " --ref-rows "
    << g_opt.ref_rows;
  if (g_opt.backward) c << " --backward";
  if (g_opt.no_torch) c << " --no-torch";
  if (!g_opt.no_torch) c << " --python " << join(g_opt.python);
  if (g_opt.no_torch_tuned) c << " --no-torch-tuned";
  if (g_opt.no_sgemm) c << " --no-sgemm";
  if (g_opt.no_ref) c << " --no-ref";
  if (!g_opt.json.empty()) c << " --json " << g_opt.json;
  return c.str();
}

/// Fixed (or, with sci, scientific) notation with @p digits decimals; "-" for NaN.
std::string fmt(double x, int digits, bool sci = false, const char* suffix = "") {
  if (std::isnan(x)) return "-";
  char buf[64];
  if (sci) {
    std::snprintf(buf, sizeof buf, "%.*e%s", digits, x, suffix);
  } else {
    std::snprintf(buf, sizeof buf, "%.*f%s", digits, x, suffix);
  }
  return buf;
}

std::string fmt_ms(double x) { return fmt(x, x < 1.0 ? 3 : x < 100.0 ? 2 : 1); }

/// What the header and the JSON say about the machine and the kernel that runs.
struct machine_info {
  std::string cpu;          // /proc/cpuinfo model name
  std::string kernel;       // the selector's dense fused forward kernel for the first --isa, this shape
  std::string isa;          // its last component (avx2, portable, generic, ...)
  std::string sdpa_peer;    // the algorithm label of the rows behind the "vs SDPA" column, or ""
};

/// The selector's kernel for dense fused attention of the sweep's first shape and --isa (the header's
/// "kernel:" line): the name ends with the ISA that runs, e.g. cpu.fused_forward.avx2.
std::string dense_kernel_name(dtype type) {
  const std::int64_t B = 1, L = 16, H = 1, d = g_opt.head_dim;  // the selector looks at types and d, not L
  const auto n = static_cast<std::size_t>(B * L * H * d);
  std::vector<float> out(n);
  std::mt19937_64 rng(g_opt.seed);
  input_tensor q;
  q.fill(n, type, rng);
  forward_args a;
  a.q = a.k = a.v = q.view(B, L, H, d);
  a.out = make_view(out.data(), {B, L, H, d});
  attention_config cfg;
  cfg.backend = backend::cpu;
  cfg.pattern = pattern::parse("dense", "--patterns");
  cfg.cpu_algorithm = cpu_algorithm::fused;
  cfg.cpu_isa = parse_cpu_isa_arg(g_opt.isas.at(0));
  const kernel_selection sel = select_kernel(a, cfg);
  return sel.supported() ? sel.name : "unsupported (" + sel.reason + ")";
}

void print_column_notes(const machine_info& mi) {
  std::printf(
      "vs SDPA = median of %s (same L, same input dtype) / row median: > 1 = faster than SDPA%s.\n"
      "%%sgemm = row GFLOP/s / the sgemm yardstick's GFLOP/s (below).\n",
      mi.sdpa_peer.empty() ? "torch 2.x SDPA" : mi.sdpa_peer.c_str(),
      mi.sdpa_peer.empty() ? " (no torch 2.x measured: run tools/scripts/torch2-venv.sh, or --python)" : "");
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
                  {"hardware_threads", omp_get_num_procs()},
                  {"cpu_features", info.cpu_features},
                  {"compiler", info.compiler},
                  {"kernel", m.kernel},
                  {"isa", m.isa}};
  j["sdpa_peer"] = m.sdpa_peer;
  j["config"] = {
      {"threads", g_opt.threads},
      {"dtype", g_opt.dtype_name},
      {"warmup", g_opt.warmup},
      {"iters", g_opt.iters},
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
  }
  // Non-finite numbers (a row without an error estimate) are written as null.
  const std::string text = j.dump(2) + "\n";
  try {
    files::replace(path, {files::piece(reinterpret_cast<const unsigned char*>(text.data()), text.size())});
  } catch (const files::write_error& e) {
    throw error(status_code::invalid_argument, "dfss bench: --json " + path + ": " + e.what());
  }
}

// ---------------------------------------------------------------------------------------------
// --memory
// ---------------------------------------------------------------------------------------------

long max_rss_kib() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return u.ru_maxrss;  // KiB on Linux
}

/// Child side of --memory: one forward call at length --memory-child, then one line on stdout.
int run_memory_child() {
  const std::int64_t B = g_opt.batch, H = g_opt.memory_heads, d = g_opt.head_dim, L = g_opt.memory_child;
  const dtype type = parse_dtype(g_opt.dtype_name);
  const auto n = static_cast<std::size_t>(B * L * H * d);
  std::mt19937_64 rng(g_opt.seed);
  input_tensor q, k, v;
  q.fill(n, type, rng);
  k.fill(n, type, rng);
  v.fill(n, type, rng);
  std::vector<float> out(n, 0.0f);
  forward_args a;
  a.q = q.view(B, L, H, d);
  a.k = k.view(B, L, H, d);
  a.v = v.view(B, L, H, d);
  a.out = make_view(out.data(), {B, L, H, d});
  attention_config cfg;
  cfg.pattern = pattern::parse(g_opt.patterns.at(0), "--patterns");
  cfg.backend = backend::cpu;
  cfg.num_threads = g_opt.threads;
  cfg.cpu_algorithm = parse_cpu_algorithm_arg(g_opt.algorithms.at(0));
  cfg.cpu_isa = parse_cpu_isa_arg(g_opt.isas.at(0));
  const long before = max_rss_kib();
  const std::size_t tensors = q.bytes() + k.bytes() + v.bytes() + out.size() * sizeof(float);
  const kernel_selection sel = select_kernel(a, cfg);
  if (!sel.supported()) {
    std::printf("DFSS_MEMCHILD %ld %ld %zu 0 - unsupported: %s\n", before, before, tensors,
                sel.reason.c_str());
    return kExitOk;
  }
  const auto t0 = std::chrono::steady_clock::now();
  const status st = try_attention_forward(a, cfg);
  const double ms = elapsed_ms(t0);
  const long peak = max_rss_kib();
  std::printf("DFSS_MEMCHILD %ld %ld %zu %.1f %s %s\n", before, peak, tensors, ms, sel.name.c_str(),
              st.ok() ? "ok" : ("unsupported: " + st.message).c_str());
  return kExitOk;
}

int run_memory() {
  const std::string exe = self_exe();
  if (exe.empty()) {
    std::fprintf(stderr, "dfss bench --memory: cannot find this executable (/proc/self/exe)\n");
    return kExitInternal;
  }
  std::printf("dfss bench --memory: peak resident memory of one forward call, each row in its own process\n");
  std::printf("B=%lld H=%lld d=%lld %s, %d threads; MiB = 2^20 bytes; ru_maxrss of the child process\n\n",
              g_opt.batch, g_opt.memory_heads, g_opt.head_dim, g_opt.dtype_name.c_str(), g_opt.threads);
  std::printf("%-7s %-7s %-12s %-31s %10s %11s %10s %14s %13s %16s %9s\n", "L", "pattern", "algorithm",
              "kernel", "Q+K+V+O", "RSS before", "peak RSS", "forward extra", "peak-tensors", "H*L*L fp32",
              "ms");
  for (long long L : g_opt.memory_lengths) {
    for (const auto& pat : g_opt.memory_patterns) {
      for (const auto& alg : g_opt.algorithms) {
        if (parse_cpu_algorithm_arg(alg) == cpu_algorithm::three_stage &&
            pattern::parse(pat, "--memory-patterns").is_dense())
          continue;
        std::ostringstream cmd;
        cmd << shell_quote(exe) << " bench --memory-child " << L << " --memory-heads " << g_opt.memory_heads
            << " --batch " << g_opt.batch << " --head-dim " << g_opt.head_dim << " --threads "
            << g_opt.threads << " --dtype " << g_opt.dtype_name << " --patterns " << shell_quote(pat)
            << " --algorithms " << alg << " --isa " << g_opt.isas.at(0) << " --seed " << g_opt.seed;
        const std::string out = capture(cmd.str());
        const auto pos = out.find("DFSS_MEMCHILD ");
        if (pos == std::string::npos) {
          std::printf("%-7lld %-7s %-12s child failed: %s\n", L, pat.c_str(), alg.c_str(), cmd.str().c_str());
          continue;
        }
        std::istringstream in(out.substr(pos + 14));
        long before = 0, peak = 0;
        double tensors = 0, ms = 0;
        std::string kernel, rest;
        in >> before >> peak >> tensors >> ms >> kernel;
        std::getline(in, rest);
        rest = trim(rest);
        constexpr double kMiB = 1024.0 * 1024.0;
        const double scores = 4.0 * static_cast<double>(g_opt.batch * g_opt.memory_heads) *
                              static_cast<double>(L) * static_cast<double>(L) / kMiB;
        if (rest != "ok") {
          std::printf("%-7lld %-7s %-12s %-31s %s\n", L, pat.c_str(), alg.c_str(), kernel.c_str(),
                      rest.c_str());
          continue;
        }
        std::printf("%-7lld %-7s %-12s %-31s %10.1f %11.1f %10.1f %14.1f %13.1f %16.1f %9.0f\n", L,
                    pat.c_str(), alg.c_str(), kernel.c_str(), tensors / kMiB,
                    static_cast<double>(before) / 1024.0, static_cast<double>(peak) / 1024.0,
                    static_cast<double>(peak - before) / 1024.0,
                    static_cast<double>(peak) / 1024.0 - tensors / kMiB, scores, ms);
        std::fflush(stdout);
      }
    }
  }
  std::printf(
      "\nAll sizes in MiB. forward extra = peak RSS - RSS once the inputs and the output were allocated and\n"
      "filled: the working memory of the call (thread stacks, scratch). H*L*L fp32 is what one score matrix\n"
      "per head would take (the quadratic growth that a fused or tiled forward avoids).\n");
  return kExitOk;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Command
// ---------------------------------------------------------------------------------------------

void add_bench_command(CLI::App& app) {
  bench_options& o = g_opt;
  CLI::App* c = app.add_subcommand(
      "bench", "Benchmark table: dfss patterns and algorithms vs dense vs PyTorch, sgemm yardstick");
  g_lengths_option = c->add_option("--lengths", o.lengths, "sequence lengths (Lq = Lk), comma separated")
                         ->delimiter(',')
                         ->capture_default_str();
  c->add_option("--patterns", o.patterns, "N:M patterns (dense = 1:1)")
      ->delimiter(',')
      ->capture_default_str();
  c->add_option("--algorithms", o.algorithms,
                "cpu algorithms: fused, three-stage (three-stage rows are made for sparse patterns only)")
      ->delimiter(',')
      ->capture_default_str();
  c->add_option("--isa", o.isas, "fused-kernel ISAs: automatic, generic, avx2, portable (a list compares them)")
      ->delimiter(',')
      ->capture_default_str();
  c->add_option("--batch", o.batch, "batch size")->capture_default_str();
  c->add_option("--heads", o.heads, "attention heads")->capture_default_str();
  c->add_option("--head-dim", o.head_dim, "head dimension")->capture_default_str();
  c->add_option("--threads", o.threads, "threads for dfss, torch and OpenBLAS (0: all)")
      ->capture_default_str();
  c->add_option("--dtype", o.dtype_name,
                "dfss input type: f32, f16, bf16 (torch: fp32 rows, plus SDPA rows in the same 16-bit type)")
      ->capture_default_str();
  c->add_option("--warmup", o.warmup, "untimed calls per configuration")->capture_default_str();
  c->add_option("--iters", o.iters, "timed calls per configuration (median reported)")->capture_default_str();
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
    if (o.backward && g_lengths_option != nullptr && g_lengths_option->count() == 0)
      o.lengths = {512, 1024, 2048};
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
    if (o.threads == 0) o.threads = omp_get_num_procs();
    if (!o.json.empty()) {
      try {
        files::check_writable(o.json);  // before minutes of measuring; written atomically at the end
      } catch (const files::write_error& e) {
        std::fprintf(stderr, "dfss bench: --json %s: %s\n", o.json.c_str(), e.what());
        return kExitBadInput;
      }
    }

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
                omp_get_num_procs(), join(info.cpu_features, " ").c_str(), info.compiler.c_str());
    std::printf("kernel: --isa %s selects %s (ISA %s) for dense fused %s\n", o.isas[0].c_str(),
                mi.kernel.c_str(), mi.isa.c_str(), o.backward ? "forward (backward: see the kernel column)" : "forward");
    std::printf(
        "run: %s, %d threads, %s inputs (standard normal), warmup %d, median of up to %d calls (budget %gs "
        "per configuration), non-causal, no masks\n",
        o.backward ? "forward + backward (--backward)" : "forward", o.threads, o.dtype_name.c_str(), o.warmup,
        o.iters, o.budget_s);
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
    g_progress.add_rows(static_cast<int>(o.lengths.size()) * dfss_rows_per_length());
    std::vector<std::string> notes;
    std::vector<torch_peer> peers;
    if (!o.no_torch) peers = probe_torch_peers(notes);
    for (const auto& peer : peers) g_progress.add_rows(runs_tuned(peer) ? 2 : 1);
    std::vector<row> rows;
    for (long long L : o.lengths) bench_length(L, type, rows, sg);
    sg.finish();
    if (!peers.empty()) bench_torch(peers, rows, notes);
    g_progress.done();

    // Speedup against dfss dense fused (the first ISA listed) of the same shape.
    std::map<long long, double> dense_ms;
    for (const row& r : rows)
      if (r.source == "dfss" && r.ok && r.pattern == "dense" && r.algorithm == "fused" && r.isa == o.isas[0])
        dense_ms.emplace(r.L, r.ms.median);
    for (row& r : rows) {
      const auto it = dense_ms.find(r.L);
      if (r.ok && it != dense_ms.end()) r.speedup = it->second / r.ms.median;
    }
    // "vs SDPA": against torch 2.x's public scaled_dot_product_attention as installed (not tuned), the
    // first such peer of --python, same L and same input dtype; > 1 = faster than SDPA.
    for (const row& r : rows)
      if (r.source == "torch" && r.ok && r.algorithm.rfind("torch 1.", 0) != 0 &&
          r.algorithm.size() > 5 && r.algorithm.compare(r.algorithm.size() - 5, 5, " sdpa") == 0) {
        mi.sdpa_peer = r.algorithm;
        break;
      }
    std::map<std::pair<long long, std::string>, double> sdpa_ms;
    for (const row& r : rows)
      if (r.source == "torch" && r.ok && r.algorithm == mi.sdpa_peer) sdpa_ms.emplace(std::make_pair(r.L, r.dtype), r.ms.median);
    for (row& r : rows) {
      const auto it = sdpa_ms.find({r.L, r.dtype});
      if (r.ok && it != sdpa_ms.end()) r.vs_sdpa = it->second / r.ms.median;
      if (r.ok && sg.ok) r.sgemm_share = r.gflops / sg.gflops;
    }
    std::stable_sort(rows.begin(), rows.end(), [](const row& x, const row& y) { return x.L < y.L; });

    print_table(rows);
    std::printf("\n");
    for (const auto& n : notes) std::printf("%s\n", n.c_str());
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
          "reference| over the first %lld query rows of every head (torch rows: vs torch float64).\n",
          static_cast<long long>(o.ref_rows));
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
