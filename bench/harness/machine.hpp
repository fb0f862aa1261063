// The machine description every dfss benchmark records with its numbers (`dfss bench`, the Google
// Benchmark micro-benchmarks): CPU model, hardware threads, load, date and the source commit, plus
// the small shell helpers they need. No dependency beyond the standard library and POSIX.
#pragma once

#include <cstdio>
#include <optional>
#include <string>

namespace dfss::harness {

/// @brief "AMD EPYC (family 25 model 17)": the model name of /proc/cpuinfo with the family and
/// model numbers, which tell apart CPUs that a VM names alike (Zen 3 is family 25 model 1, Zen 4
/// model 17).
std::string cpu_model();
/// @brief Hardware threads of this machine (OpenMP's count of processors).
int hardware_threads();
/// @brief The 1-minute load average (other processes on the cores make every number noisier).
std::string load_average();
/// @brief "2026-11-30 12:00:00 UTC".
std::string now_utc();
/// @brief "abc1234" (+ " (uncommitted changes)") of the source tree this binary was built from, or "".
std::string git_commit();

/// @brief @p s without leading and trailing white space.
std::string trim(std::string s);
/// @brief @p s quoted for a POSIX shell.
std::string shell_quote(const std::string& s);
/// @brief Runs a shell command and returns its standard output (standard error is not captured);
/// @p exit_status receives pclose's status when non-null.
std::string capture(const std::string& command, int* exit_status = nullptr);

/// @brief A child process talked to line by line: `/bin/sh -c command` with its standard input and
/// output on pipes (standard error inherited). A request is one line written; its answer the next
/// line of output that starts with a given prefix (other lines, e.g. warnings, are skipped). Used
/// where a peer's calls must be timed round-robin with ours (`dfss bench`'s served torch peer).
/// SIGPIPE is ignored while one lives, so that a child that died makes a request fail, not the
/// process.
class coprocess {
 public:
  explicit coprocess(const std::string& command);
  ~coprocess();
  coprocess(const coprocess&) = delete;
  coprocess& operator=(const coprocess&) = delete;
  /// Whether the child started and has not closed its output.
  bool alive() const { return out_ != nullptr; }
  /// The next line that starts with @p prefix, without it and the line end; nullopt once the
  /// child's output has ended (then alive() is false).
  std::optional<std::string> read_line(const std::string& prefix);
  /// Writes @p line and a line end, then read_line(@p prefix); nullopt if the child is gone.
  std::optional<std::string> request(const std::string& line, const std::string& prefix);

 private:
  void close_output();
  int pid_ = -1;
  std::FILE* in_ = nullptr;   // the child's standard input
  std::FILE* out_ = nullptr;  // the child's standard output
  void (*old_sigpipe_)(int) = nullptr;
};

}  // namespace dfss::harness
