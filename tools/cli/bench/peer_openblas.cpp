// The OpenBLAS sgemm yardstick of `dfss bench`: cblas_sgemm n^3, loaded with dlopen (no build-time
// dependency; Debian libopenblas0). Its calls are timed inside the dfss rows' round-robin.
#include <dlfcn.h>

#include <cstdlib>
#include <cstring>

#include "cli/bench/bench.hpp"

namespace dfss::cli::bench {

/// Loads OpenBLAS with dlopen (no build-time dependency), fills the operands and warms up.
void setup_sgemm_yardstick(sgemm_result& r, int threads) {
  // OpenBLAS reads OPENBLAS_NUM_THREADS when it is loaded; set it before dlopen (and call
  // openblas_set_num_threads as well, in case the library was already loaded).
  const std::string t = std::to_string(threads);
  setenv("OPENBLAS_NUM_THREADS", t.c_str(), 1);
  // OpenBLAS's worker threads spin after each call until a timeout of 2^28 cycles by default (about
  // 0.1 s): the dfss rows timed right after a yardstick call then shared the cores with them (2
  // threads, L = 128, H = 12, d = 64 on Zen 4: 9.9 ms against 0.60 ms without the yardstick). 2^4
  // cycles, the least OpenBLAS takes, puts them to sleep as soon as their work is done. An explicit
  // setting of the caller's environment is left as it is.
  setenv("OPENBLAS_THREAD_TIMEOUT", "4", 0);
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

}  // namespace dfss::cli::bench
