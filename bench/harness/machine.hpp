// The machine description every dfss benchmark records with its numbers (`dfss bench`, the Google
// Benchmark micro-benchmarks): CPU model, hardware threads, load, date and the source commit, plus
// the small shell helpers they need. No dependency beyond the standard library and POSIX.
#pragma once

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

}  // namespace dfss::harness
