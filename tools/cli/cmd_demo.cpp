// `dfss` with no arguments (or `dfss demo`): DFSS 1:2 and 2:4 next to dense attention, so that a
// newcomer sees at once what the library does, on two kinds of input:
//  - random rows: BERT-base-sized attention on standard normal inputs (--batch, --heads, --seq-len,
//    --head-dim, --seed), where attention is nearly flat: the worst case for pruning, and not what a
//    trained model looks like;
//  - real rows: Q, K, V captured from a trained model, shipped in data/text-lm-qkv (the byte-level
//    causal language model of docs/accuracy.md; installed under share/dfss/text-lm-qkv), or any
//    directory of NAME-q.npy, NAME-k.npy, NAME-v.npy given with --real-data. Besides time and error
//    they show the attention mass DFSS keeps: the dense softmax probability of the kept keys, summed
//    over a row and averaged over rows, computed as exp(LSE_pattern - LSE_dense) from the fp64
//    reference (the kept keys' share of the dense normaliser).
// For each pattern: the time of the CPU backend, how far its output is from dense attention (the
// approximation DFSS makes), and how far it is from the fp64 reference of the same pattern (the
// kernel's own rounding).
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "cli/commands.hpp"
#include "dfss/dfss.hpp"
#include "npy/npy.hpp"

#ifndef DFSS_DEMO_DATA_DIR
#define DFSS_DEMO_DATA_DIR ""  // the source tree's data/text-lm-qkv (set by tools/CMakeLists.txt)
#endif
#ifndef DFSS_DEMO_DATA_INSTALL_REL
#define DFSS_DEMO_DATA_INSTALL_REL "../share/dfss/text-lm-qkv"  // from the installed executable's directory
#endif

namespace dfss::cli {
namespace {

namespace fs = std::filesystem;

template <class A, class B>
double rel_l2(const std::vector<A>& a, const std::vector<B>& b) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    const double diff = static_cast<double>(a[i]) - static_cast<double>(b[i]);
    num += diff * diff;
    den += static_cast<double>(b[i]) * static_cast<double>(b[i]);
  }
  return std::sqrt(num / den);
}

/// A problem with the real-attention data (missing, unreadable, malformed or inconsistent files).
class data_error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// One real input: NAME-q.npy [B, L, H, d], NAME-k.npy and NAME-v.npy [B, Lk, Hkv, d].
struct real_input {
  std::string name;
  std::int64_t B = 0, Lq = 0, Lk = 0, H = 0, Hkv = 0, d = 0;
  std::string file_type;            ///< the files' element type ("float16", "float32")
  std::vector<float> q, k, v;       ///< fp32 (exact for float16 files), for the CPU kernel
  std::vector<double> q64, k64, v64;  ///< the same values in fp64, for the reference
};

struct real_data {
  std::string dir;          ///< where the files were read from
  std::string description;  ///< capture.json's "description", if any
  bool causal = false;      ///< capture.json's "causal" (absent: false)
  std::vector<real_input> inputs;
};

std::string self_dir() {
  char buf[4096];
  const ssize_t n = readlink("/proc/self/exe", buf, sizeof buf - 1);
  if (n <= 0) return {};
  const std::string exe(buf, static_cast<std::size_t>(n));
  return exe.substr(0, exe.rfind('/'));
}

bool is_dir(const std::string& p) {
  std::error_code ec;
  return !p.empty() && fs::is_directory(p, ec);
}

/// The shipped data's directory: next to an installed executable, else the source tree's; empty
/// when neither exists (@p tried lists where it looked).
std::string find_shipped_data(std::vector<std::string>& tried) {
  std::vector<std::string> candidates;
  const std::string dir = self_dir();
  if (!dir.empty()) candidates.push_back(dir + "/" DFSS_DEMO_DATA_INSTALL_REL);
  if (*DFSS_DEMO_DATA_DIR) candidates.push_back(DFSS_DEMO_DATA_DIR);
  for (const auto& c : candidates) {
    std::error_code ec;
    const fs::path p = fs::weakly_canonical(c, ec);
    const std::string shown = ec ? c : p.string();
    tried.push_back(shown);
    if (is_dir(shown)) return shown;
  }
  return {};
}

/// Reads one .npy file of a floating type as fp32 values (float16 converts exactly).
std::vector<float> read_floats(const std::string& path, std::vector<std::int64_t>& shape, std::string& type) {
  npy::array a;
  try {
    a = npy::read(path);
  } catch (const npy::error& e) {
    throw data_error(e.what());
  }
  if (a.shape.size() != 4)
    throw data_error(path + ": expected a [B, L, H, d] array (4 dimensions), got " +
                     std::to_string(a.shape.size()));
  for (const auto s : a.shape)
    if (s < 1) throw data_error(path + ": expected every dimension >= 1, got a 0");
  const auto n = static_cast<std::size_t>(a.numel());
  std::vector<float> out(n);
  if (a.type == dtype::f16) {
    const auto* p = a.data<std::uint16_t>();
    for (std::size_t i = 0; i < n; ++i) out[i] = f16_to_float(p[i]);
    type = "float16";
  } else if (a.type == dtype::f32) {
    const auto* p = a.data<float>();
    std::copy(p, p + n, out.begin());
    type = "float32";
  } else {
    throw data_error(path + ": expected float16 or float32 elements, got " + npy::descr(a.type));
  }
  for (std::size_t i = 0; i < n; ++i)
    if (!std::isfinite(out[i]))
      throw data_error(path + ": expected finite values, got " + std::to_string(out[i]) + " at element " +
                       std::to_string(i));
  shape = a.shape;
  return out;
}

std::string shape_str(const std::vector<std::int64_t>& s) {
  std::string r = "[";
  for (std::size_t i = 0; i < s.size(); ++i) r += (i ? ", " : "") + std::to_string(s[i]);
  return r + "]";
}

/// Every NAME-q.npy of @p dir with its NAME-k.npy and NAME-v.npy, in name order, and capture.json.
real_data load_real_data(const std::string& dir) {
  if (!is_dir(dir)) throw data_error(dir + ": not a directory");
  real_data r;
  r.dir = dir;
  const std::string note = dir + "/capture.json";
  std::error_code ec;
  if (fs::exists(note, ec)) {
    std::ifstream f(note);
    if (!f.is_open()) throw data_error(note + ": cannot open it");
    const nlohmann::json j = nlohmann::json::parse(f, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded() || !j.is_object())
      throw data_error(note + ": expected a JSON object (the capture's note), could not parse it");
    if (j.contains("causal")) {
      if (!j["causal"].is_boolean()) throw data_error(note + ": expected \"causal\" to be true or false");
      r.causal = j["causal"].get<bool>();
    }
    if (j.contains("description") && j["description"].is_string()) r.description = j["description"];
  }
  std::vector<std::string> names;
  try {
    for (const auto& e : fs::directory_iterator(dir)) {
      const std::string f = e.path().filename().string();
      if (f.size() > 6 && f.compare(f.size() - 6, 6, "-q.npy") == 0) names.push_back(f.substr(0, f.size() - 6));
    }
  } catch (const fs::filesystem_error& e) {
    throw data_error(dir + ": cannot list the directory: " + e.code().message());
  }
  if (names.empty()) throw data_error(dir + ": expected NAME-q.npy, NAME-k.npy and NAME-v.npy files, found none");
  std::sort(names.begin(), names.end());
  for (const auto& name : names) {
    real_input in;
    in.name = name;
    std::vector<std::int64_t> qs, ks, vs;
    std::string kt, vt;
    const std::string base = dir + "/" + name;
    in.q = read_floats(base + "-q.npy", qs, in.file_type);
    in.k = read_floats(base + "-k.npy", ks, kt);
    in.v = read_floats(base + "-v.npy", vs, vt);
    if (ks != vs) throw data_error(base + "-k.npy and -v.npy: expected the same shape, got " + shape_str(ks) +
                                   " and " + shape_str(vs));
    if (ks[0] != qs[0] || ks[3] != qs[3] || qs[2] % ks[2] != 0)
      throw data_error(base + "-q.npy " + shape_str(qs) + " and -k.npy " + shape_str(ks) +
                       ": expected the same B and d, and K/V heads dividing the query heads");
    if (r.causal && ks[1] < qs[1])
      throw data_error(base + ": causal attention needs at least as many keys as queries, got " +
                       std::to_string(ks[1]) + " keys and " + std::to_string(qs[1]) + " queries");
    in.B = qs[0];
    in.Lq = qs[1];
    in.H = qs[2];
    in.d = qs[3];
    in.Lk = ks[1];
    in.Hkv = ks[2];
    in.q64.assign(in.q.begin(), in.q.end());
    in.k64.assign(in.k.begin(), in.k.end());
    in.v64.assign(in.v.begin(), in.v.end());
    r.inputs.push_back(std::move(in));
  }
  return r;
}

template <class F>
double median_ms(int reps, F&& f) {
  std::vector<double> ms;
  for (int r = 0; r < reps; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

const pattern kPatterns[] = {pattern{1, 1}, pattern{1, 2}, pattern{2, 4}};

/// Attention mass kept, averaged over rows: per row, the sum over kept keys of the dense softmax
/// probabilities = exp(LSE_pattern - LSE_dense). Rows with no visible key (LSE -inf) have no mass
/// to keep and are left out of the mean.
template <class T>
double mean_mass_kept(const std::vector<T>& lse, const std::vector<T>& lse_dense) {
  double mass = 0;
  std::size_t rows = 0;
  for (std::size_t i = 0; i < lse.size(); ++i) {
    if (!std::isfinite(lse_dense[i])) continue;
    mass += std::exp(static_cast<double>(lse[i]) - static_cast<double>(lse_dense[i]));
    ++rows;
  }
  return rows ? mass / static_cast<double>(rows) : std::numeric_limits<double>::quiet_NaN();
}

int run_random_rows(const demo_options& o) {
  const std::int64_t B = o.batch, L = o.seq_len, H = o.heads, d = o.head_dim;
  const auto n = static_cast<std::size_t>(B * L * H * d);
  std::vector<float> q(n), k(n), v(n);
  std::mt19937_64 rng(o.seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (auto* t : {&q, &k, &v})
    for (auto& x : *t) x = normal(rng);

  std::printf("dfss %s: random attention B=%lld H=%lld L=%lld d=%lld, fp32, standard normal inputs\n",
              DFSS_VERSION_STRING, static_cast<long long>(B), static_cast<long long>(H),
              static_cast<long long>(L), static_cast<long long>(d));

  forward_args a;
  a.q = make_view(q.data(), {B, L, H, d});
  a.k = make_view(k.data(), {B, L, H, d});
  a.v = make_view(v.data(), {B, L, H, d});
  std::vector<float> out(n), ref(n), dense(n);
  const auto n_lse = static_cast<std::size_t>(B * H * L);
  std::vector<float> lse(n_lse), lse_dense(n_lse);

  attention_config cfg;
  cfg.num_threads = o.threads;
  a.out = make_view(out.data(), {B, L, H, d});
  const kernel_selection sel = select_kernel(a, cfg);
  std::printf("cpu kernel: %s (median of 3 runs)\n\n", sel.name.c_str());
  std::printf("%-8s %12s %14s %22s %22s\n", "pattern", "cpu ms", "speedup", "error vs dense attn", "error vs fp64 ref");

  double dense_ms = 0;
  std::string masses;
  for (const pattern p : kPatterns) {
    cfg.pattern = p;
    cfg.backend = backend::cpu;
    a.out = make_view(out.data(), {B, L, H, d});
    a.lse = {};
    const double ms = median_ms(3, [&] { attention_forward(a, cfg); });
    if (p.is_dense()) {
      dense_ms = ms;
      dense = out;
    }
    cfg.backend = backend::reference;
    a.out = make_view(ref.data(), {B, L, H, d});
    a.lse = make_view(lse.data(), {B, H, L});
    attention_forward(a, cfg);
    if (p.is_dense()) {
      lse_dense = lse;
    } else {
      char buf[64];
      std::snprintf(buf, sizeof buf, "%s%s %.4f", masses.empty() ? "" : ", ", p.str().c_str(),
                    mean_mass_kept(lse, lse_dense));
      masses += buf;
    }
    std::printf("%-8s %12.2f %13.2fx %22.3e %22.3e\n", p.str().c_str(), ms, dense_ms / ms, rel_l2(out, dense),
                rel_l2(out, ref));
  }
  std::printf("mass kept: %s\n", masses.c_str());
  return kExitOk;
}

void run_real_rows(const demo_options& o, const real_data& data) {
  std::printf("\nreal attention%s%s\n", data.description.empty() ? "" : ": ", data.description.c_str());
  std::printf("data: %s (%zu input%s, %s; cpu ms: median of 5 runs)\n", data.dir.c_str(), data.inputs.size(),
              data.inputs.size() == 1 ? "" : "s", data.causal ? "causal" : "not causal");
  for (const auto& in : data.inputs)
    std::printf("  %s: Q [%lld, %lld, %lld, %lld], K and V [%lld, %lld, %lld, %lld], %s, run as fp32\n",
                in.name.c_str(), static_cast<long long>(in.B), static_cast<long long>(in.Lq),
                static_cast<long long>(in.H), static_cast<long long>(in.d), static_cast<long long>(in.B),
                static_cast<long long>(in.Lk), static_cast<long long>(in.Hkv), static_cast<long long>(in.d),
                in.file_type.c_str());
  std::printf("\n%-12s %-8s %10s %10s %10s %22s %22s\n", "input", "pattern", "cpu ms", "speedup", "mass kept",
              "error vs dense attn", "error vs fp64 ref");
  for (const auto& in : data.inputs) {
    const std::int64_t B = in.B, Lq = in.Lq, Lk = in.Lk, H = in.H, Hkv = in.Hkv, d = in.d;
    const auto n_out = static_cast<std::size_t>(B * Lq * H * d);
    const auto n_lse = static_cast<std::size_t>(B * H * Lq);
    std::vector<float> out(n_out), dense(n_out);
    std::vector<double> ref(n_out), lse(n_lse), lse_dense(n_lse);
    forward_args a;  // fp32: the CPU kernel
    a.q = make_view(in.q.data(), {B, Lq, H, d});
    a.k = make_view(in.k.data(), {B, Lk, Hkv, d});
    a.v = make_view(in.v.data(), {B, Lk, Hkv, d});
    a.out = make_view(out.data(), {B, Lq, H, d});
    forward_args a64;  // fp64: the reference, whose LSE gives the mass kept
    a64.q = make_view(in.q64.data(), {B, Lq, H, d});
    a64.k = make_view(in.k64.data(), {B, Lk, Hkv, d});
    a64.v = make_view(in.v64.data(), {B, Lk, Hkv, d});
    a64.out = make_view(ref.data(), {B, Lq, H, d});
    a64.lse = make_view(lse.data(), {B, H, Lq});
    attention_config cfg;
    cfg.num_threads = o.threads;
    cfg.causal = data.causal;
    double dense_ms = 0;
    for (const pattern p : kPatterns) {
      cfg.pattern = p;
      cfg.backend = backend::cpu;
      const double ms = median_ms(5, [&] { attention_forward(a, cfg); });
      cfg.backend = backend::reference;
      attention_forward(a64, cfg);
      if (p.is_dense()) {
        dense_ms = ms;
        dense = out;
        lse_dense = lse;
      }
      const double mass = mean_mass_kept(lse, lse_dense);
      std::printf("%-12s %-8s %10.2f %9.2fx %10.4f %22.3e %22.3e\n", in.name.c_str(), p.str().c_str(), ms,
                  dense_ms / ms, mass, rel_l2(out, dense), rel_l2(out, ref));
    }
  }
}

int run_demo_checked(const demo_options& o) {
  // The real data is read first, so that a bad --real-data fails before the random rows' seconds.
  real_data data;
  std::vector<std::string> tried;
  bool have_real = false;
  if (!o.no_real) {
    const std::string dir = o.real_data.empty() ? find_shipped_data(tried) : o.real_data;
    if (!dir.empty()) {
      try {
        data = load_real_data(dir);
      } catch (const npy::error& e) {
        throw data_error(e.what());
      }
      have_real = true;
    }
  }
  run_random_rows(o);
  if (have_real) run_real_rows(o, data);
  std::printf("\nerrors are relative L2 norms over all outputs. \"vs dense attn\" is the approximation DFSS\n"
              "makes (finetuning recovers accuracy, per the paper); \"vs fp64 ref\" is the kernel's own\n"
              "rounding error. The \"cpu kernel\" line says which kernel ran; README lists the backends.\n");
  std::printf("\"mass kept\" is the dense softmax probability of the keys DFSS keeps, summed over a row and\n"
              "averaged over rows (1 for dense). Standard normal inputs give nearly flat attention: the\n"
              "dense output averages hundreds of unrelated values and is small, which inflates the\n"
              "relative error.%s\n",
              have_real ? " The real rows are heads of a trained model, whose outputs are not small\n"
                          "(data/text-lm-qkv/README.md; --real-data DIR runs other captured Q, K, V)."
                        : "");
  if (!o.no_real && !have_real) {
    std::string where;
    for (const auto& t : tried) where += "\n  " + t;
    std::fprintf(stderr,
                 "dfss demo: real attention rows skipped: the shipped Q, K, V (text-lm-qkv) were not found; "
                 "looked in:%s\npass --real-data DIR, or --no-real for the random rows only\n",
                 where.empty() ? "\n  (nowhere: no executable path, no source tree)" : where.c_str());
  }
  return kExitOk;
}

}  // namespace

void add_demo_command(CLI::App& app, demo_options& o) {
  CLI::App* c = app.add_subcommand("demo", "The default example (what `dfss` alone runs)");
  c->add_option("--batch", o.batch, "batch size (random rows)")->capture_default_str();
  c->add_option("--heads", o.heads, "attention heads (random rows)")->capture_default_str();
  c->add_option("--seq-len", o.seq_len, "sequence length (random rows)")->capture_default_str();
  c->add_option("--head-dim", o.head_dim, "head dimension (random rows)")->capture_default_str();
  c->add_option("--threads", o.threads, "worker threads (0: all)");
  c->add_option("--seed", o.seed, "random seed (random rows)")->capture_default_str();
  auto* real = c->add_option("--real-data", o.real_data,
                             "directory of NAME-q.npy, NAME-k.npy, NAME-v.npy (float16 or float32, "
                             "[B, L, H, d]) and optionally capture.json ({\"causal\": true}) for the real "
                             "rows (default: the shipped text-lm-qkv)");
  c->add_flag("--no-real", o.no_real, "random rows only")->excludes(real);
}

int run_demo(const demo_options& o) {
  const std::int64_t B = o.batch, L = o.seq_len, H = o.heads, d = o.head_dim;
  if (B < 1 || L < 1 || H < 1 || d < 1) {
    std::fprintf(stderr, "dfss demo: --batch, --seq-len, --heads and --head-dim must be >= 1\n");
    return kExitBadInput;
  }
  if (o.threads < 0 || o.threads > kMaxThreads) {
    std::fprintf(stderr, "dfss demo: --threads: expected a count in [0, %d], got %d\n", kMaxThreads, o.threads);
    return kExitBadInput;
  }
  std::int64_t n = 0;
  if (__builtin_mul_overflow(B, L, &n) || __builtin_mul_overflow(n, H, &n) || __builtin_mul_overflow(n, d, &n)) {
    std::fprintf(stderr, "dfss demo: --batch * --seq-len * --heads * --head-dim overflows 64 bits\n");
    return kExitBadInput;
  }
  try {
    return run_demo_checked(o);
  } catch (const std::bad_alloc&) {
    std::fprintf(stderr, "dfss demo: not enough memory for six fp32 tensors of %lld elements\n",
                 static_cast<long long>(n));
  } catch (const data_error& e) {
    std::fprintf(stderr,
                 "dfss demo: real attention data: %s\n(--real-data DIR reads other Q, K, V; --no-real skips "
                 "these rows)\n",
                 e.what());
  } catch (const error& e) {
    std::fprintf(stderr, "dfss demo: %s\n", e.what());
  }
  return kExitBadInput;
}

}  // namespace dfss::cli
