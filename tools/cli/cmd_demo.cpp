// `dfss` with no arguments (or `dfss demo`): BERT-base-sized attention on random inputs, DFSS 1:2
// and 2:4 next to dense attention, so a newcomer sees at once what the library does: the time of
// each pattern on the CPU backend, how far the pruned output is from dense attention, and how far
// the fast kernel is from the fp64 reference of the same pattern.
#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "cli/commands.hpp"
#include "dfss/dfss.hpp"

namespace dfss::cli {
namespace {

double rel_l2(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    const double diff = static_cast<double>(a[i]) - static_cast<double>(b[i]);
    num += diff * diff;
    den += static_cast<double>(b[i]) * static_cast<double>(b[i]);
  }
  return std::sqrt(num / den);
}

}  // namespace

void add_demo_command(CLI::App& app, demo_options& o) {
  CLI::App* c = app.add_subcommand("demo", "The default example (what `dfss` alone runs)");
  c->add_option("--batch", o.batch, "batch size")->capture_default_str();
  c->add_option("--heads", o.heads, "attention heads")->capture_default_str();
  c->add_option("--seq-len", o.seq_len, "sequence length")->capture_default_str();
  c->add_option("--head-dim", o.head_dim, "head dimension")->capture_default_str();
  c->add_option("--threads", o.threads, "worker threads (0: all)");
  c->add_option("--seed", o.seed, "random seed")->capture_default_str();
}

namespace {

int run_demo_checked(const demo_options& o);

}  // namespace

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
  } catch (const error& e) {
    std::fprintf(stderr, "dfss demo: %s\n", e.what());
  }
  return kExitBadInput;
}

namespace {

int run_demo_checked(const demo_options& o) {
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

  auto timed = [&](attention_config cfg, std::vector<float>& dst) {
    a.out = make_view(dst.data(), {B, L, H, d});
    std::vector<double> ms;
    const int reps = cfg.backend == backend::reference ? 1 : 3;
    for (int r = 0; r < reps; ++r) {
      const auto t0 = std::chrono::steady_clock::now();
      attention_forward(a, cfg);
      ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    }
    std::sort(ms.begin(), ms.end());
    return ms[ms.size() / 2];
  };

  attention_config cfg;
  cfg.num_threads = o.threads;
  a.out = make_view(out.data(), {B, L, H, d});
  const kernel_selection sel = select_kernel(a, cfg);
  std::printf("cpu kernel: %s (median of 3 runs)\n\n", sel.name.c_str());
  std::printf("%-8s %12s %14s %22s %22s\n", "pattern", "cpu ms", "speedup", "error vs dense attn", "error vs fp64 ref");

  double dense_ms = 0;
  for (pattern p : {pattern{1, 1}, pattern{1, 2}, pattern{2, 4}}) {
    cfg.pattern = p;
    cfg.backend = backend::cpu;
    const double ms = timed(cfg, out);
    if (p.is_dense()) {
      dense_ms = ms;
      dense = out;
    }
    cfg.backend = backend::reference;
    timed(cfg, ref);
    std::printf("%-8s %12.2f %13.2fx %22.3e %22.3e\n", p.str().c_str(), ms, dense_ms / ms, rel_l2(out, dense),
                rel_l2(out, ref));
  }
  std::printf("\nerrors are relative L2 norms over all outputs. \"vs dense attn\" is the approximation DFSS\n"
              "makes (finetuning recovers accuracy, per the paper); \"vs fp64 ref\" is the kernel's own\n"
              "rounding error. The \"cpu kernel\" line says which kernel ran; README lists the backends.\n");
  return kExitOk;
}

}  // namespace

}  // namespace dfss::cli
