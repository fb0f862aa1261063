// Subcommands of the dfss command-line tool. Each returns the process exit code:
// 0 success, 2 bad input (malformed files, invalid or unsupported arguments), 1 internal failure.
#pragma once

#include <string>
#include <vector>

namespace CLI {
class App;
}

namespace dfss::cli {

inline constexpr int kExitOk = 0;
inline constexpr int kExitInternal = 1;
inline constexpr int kExitBadInput = 2;

/// Options of `dfss attention`.
struct attention_options {
  std::string q, k, v, out, lse, key_lengths, bias, query_offset;
  std::string dout, dq, dk, dv, dbias;
  long long key_offset = 0, sink_tokens = 0, recent_tokens = 0;  ///< positions and dense windows
  std::string pattern = "2:4";
  std::string backend = "automatic";
  double scale = 0.0;
  bool causal = false;
  int threads = 0;
  std::string algorithm = "fused";  ///< cpu backend: fused or three-stage
  std::string isa = "automatic";    ///< cpu backend: automatic, generic or avx2
  std::string save_compressed;      ///< three-stage only: PREFIX for .values/.indices/.meta.npy
};

/// Options of `dfss demo` (also what `dfss` with no arguments runs).
struct demo_options {
  long long batch = 1, heads = 12, seq_len = 512, head_dim = 64;  ///< the random rows' problem
  int threads = 0;
  unsigned long long seed = 2023;
  /// The real-attention rows' Q, K, V (NAME-q.npy, NAME-k.npy, NAME-v.npy per input); empty: the
  /// shipped data/text-lm-qkv, looked up next to the executable (an install) or in the source tree.
  std::string real_data;
  bool no_real = false;  ///< --no-real: the random rows only
};

/// Options of `dfss quality`.
struct quality_options {
  std::string q, k, v, json;
  std::vector<std::string> patterns{"1:2", "2:4"};
  std::vector<std::string> methods{"dfss", "topk", "window", "random", "bigbird", "performer", "nystrom"};
  double scale = 0.0;
  bool causal = false;
  int threads = 0;
  unsigned long long seed = 2023;
};

void add_attention_command(CLI::App& app, attention_options& opt);
int run_attention(const attention_options& opt);
int run_info();
void add_quality_command(CLI::App& app, quality_options& opt);
int run_quality(const quality_options& opt);
void add_demo_command(CLI::App& app, demo_options& opt);
int run_demo(const demo_options& opt);

/// `dfss bench`: registers its subcommand (options live in cmd_bench.cpp) and runs it.
void add_bench_command(CLI::App& app);
int run_bench();

}  // namespace dfss::cli
