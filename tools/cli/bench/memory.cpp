// `dfss bench --memory`: peak resident memory of one forward call per row, each in a child process
// (this binary re-executed with the hidden --memory-child option), ru_maxrss before and after.
#include <sys/resource.h>

#include <sstream>

#include "cli/commands.hpp"

#include "cli/bench/bench.hpp"

namespace dfss::cli::bench {

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
  input_tensor out;
  out.assign(n, output_dtype(type), 0.0f);
  forward_args a;
  a.q = q.view(B, L, H, d);
  a.k = k.view(B, L, H, d);
  a.v = v.view(B, L, H, d);
  a.out = out.view(B, L, H, d);
  attention_config cfg;
  cfg.pattern = pattern::parse(g_opt.patterns.at(0), "--patterns");
  cfg.backend = backend::cpu;
  cfg.num_threads = g_opt.threads;
  cfg.cpu_algorithm = parse_cpu_algorithm_arg(g_opt.algorithms.at(0));
  cfg.cpu_isa = parse_cpu_isa_arg(g_opt.isas.at(0));
  const long before = max_rss_kib();
  const std::size_t tensors = q.bytes() + k.bytes() + v.bytes() + out.bytes();
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

}  // namespace dfss::cli::bench
