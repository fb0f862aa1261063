// The harness of `dfss bench`: the options' storage, small utilities (files, the torch venv), timing
// and statistics (median, the iteration budget) and the progress line. The machine description
// (CPU model, load average, date, commit) and the inputs are the benchmarks' shared harness
// (bench/harness/).
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdarg>
#include <cstdlib>
#include <ctime>
#include <fstream>

#include "cli/bench/bench.hpp"

namespace dfss::cli::bench {

bench_options g_opt;

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

std::string self_exe() {
  char buf[4096];
  const ssize_t n = readlink("/proc/self/exe", buf, sizeof buf - 1);
  if (n <= 0) return {};
  return std::string(buf, static_cast<std::size_t>(n));
}

bool file_exists(const std::string& path) { return !path.empty() && access(path.c_str(), R_OK) == 0; }

progress_line g_progress;
int g_rows_done = 0;  // rows measured so far (dfss configurations, torch runs)

/// printf to stderr through the progress line.
void log_stderr(const char* format, ...) {
  char buf[1024];
  va_list ap;
  va_start(ap, format);
  std::vsnprintf(buf, sizeof buf, format, ap);
  va_end(ap);
  std::string line = buf;
  if (!line.empty() && line.back() == '\n') line.pop_back();
  g_progress.log(line);
}

double median_of(std::vector<double> v) {
  v.erase(std::remove_if(v.begin(), v.end(), [](double x) { return std::isnan(x); }), v.end());
  if (v.empty()) return kNaN;
  return summarize(std::move(v)).median;
}

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
/// Dense-equivalent flops per head and Lq Lk d: 4 for a forward call (Q K^T and P V), 14 for forward +
/// backward (--backward: the backward recomputes Q K^T and computes dO V^T, P^T dO, dS K, dS^T Q).
double flops_factor() { return g_opt.backward ? 14.0 : 4.0; }

double attention_flops(long long B, long long H, long long L, long long d) {
  return flops_factor() * static_cast<double>(B) * static_cast<double>(H) * static_cast<double>(L) *
         static_cast<double>(L) * static_cast<double>(d);
}
dtype parse_dtype(const std::string& s) {
  if (s == "f32" || s == "fp32" || s == "float32") return dtype::f32;
  if (s == "f16" || s == "fp16" || s == "float16") return dtype::f16;
  if (s == "bf16" || s == "bfloat16") return dtype::bf16;
  throw error(status_code::invalid_argument,
              "dfss bench: argument '--dtype': expected f32, f16 or bf16, got '" + s + "'");
}



dtype output_dtype(dtype input) { return g_opt.out_dtype == "f32" ? dtype::f32 : input; }

cpu_algorithm parse_cpu_algorithm_arg(const std::string& s) { return parse_cpu_algorithm(s, "--algorithms"); }
cpu_isa parse_cpu_isa_arg(const std::string& s) { return parse_cpu_isa(s, "--isa"); }

void hand_off() {
  const auto end = std::chrono::steady_clock::now() + kHandOff;
#pragma omp parallel num_threads(g_opt.threads)
  {
    while (std::chrono::steady_clock::now() < end) {
    }
  }
}

}  // namespace dfss::cli::bench
