// Fuzz target: the `dfss` command line (tools/cli/app.cpp: CLI11 parsing of every subcommand and
// option, then the commands' own checks of the parsed values).
//
// The input is split at '\n' into arguments, argv[1..] (the seed corpus is one argument per line).
// Contract checked: parsing either yields a command or ends with exit code 0 (--help, --version) or
// kExitBadInput (a usage error); no other exception escapes. Then, in a private empty directory:
//  - `attention` and `quality` run: no input file exists there, so after checking their options
//    they must fail with kExitBadInput, never kExitInternal (which the CLI reserves for its bugs);
//  - `info` runs and must succeed;
//  - `demo` runs when its sizes are in [1, 8] and --threads at most 4 (tiny problems), with exit
//    code 0 or kExitBadInput; without --real-data it runs with --no-real (the shipped real rows are
//    seconds of work, not a tiny problem), with --real-data DIR it reads DIR, which resolves inside
//    the private directory (or is "..", $TMPDIR) and fails the data checks;
//  - `bench` is parsed only (it times large problems and starts Python).
// Nothing real can be overwritten: inputs with a '/' in any argument are skipped, so every path the
// CLI could write resolves inside the private directory (".." and "." are directories and cannot be
// opened as files); its contents are deleted after each input and the directory at exit (after a
// finding, which aborts, it stays behind, empty, under $TMPDIR).
// Output of the commands is discarded (std::cout and std::cerr, and stdout for the demo's printf);
// the target's own messages and the sanitizers' reports go to stderr.
#include <fcntl.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <optional>
#include <streambuf>
#include <string>
#include <vector>

#include "cli/app.hpp"

namespace {

namespace fs = std::filesystem;

// Arguments beyond this are ignored: CLI11's work grows with the count, not its kinds.
constexpr std::size_t kMaxArgs = 64;
// Demo problems run only with sizes in [1, 8] and at most 4 threads, so that an input stays fast
// (sizes below 1 are refused with a message printed by fprintf, which would flood the fuzzer's log).
constexpr long long kMaxDemoSize = 8;
constexpr int kMaxDemoThreads = 4;

fs::path g_dir;   // the private working directory of the commands
int g_home = -1;  // the working directory the fuzzer started in

class null_buffer : public std::streambuf {
 protected:
  int overflow(int c) override { return c; }
};

[[noreturn]] void finding(const std::string& what, const std::vector<std::string>& args) {
  std::string line = "dfss";
  for (const auto& a : args) line += " '" + a + "'";
  std::fprintf(stderr, "fuzz_cli: %s\n  argv: %s\n", what.c_str(), line.c_str());
  std::abort();
}

void remove_directory() {
  std::error_code ec;
  fs::remove_all(g_dir, ec);
}

/// Runs @p cmd inside the private directory and empties it afterwards.
int run_in_private_directory(const dfss::cli::invocation& inv) {
  if (::chdir(g_dir.c_str()) != 0) std::abort();
  const int rc = dfss::cli::run_command(inv);
  if (::fchdir(g_home) != 0) std::abort();
  for (const auto& entry : fs::directory_iterator(g_dir)) fs::remove_all(entry.path());
  return rc;
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  std::string dir = (fs::temp_directory_path() / "dfss-fuzz-cli-XXXXXX").string();
  if (::mkdtemp(dir.data()) == nullptr) std::abort();
  g_dir = dir;
  std::atexit(remove_directory);
  g_home = ::open(".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (g_home < 0) std::abort();
  // The demo prints its table with printf; neither libFuzzer nor the sanitizers write to stdout.
  const int null_fd = ::open("/dev/null", O_WRONLY | O_CLOEXEC);
  if (null_fd < 0 || ::dup2(null_fd, STDOUT_FILENO) < 0) std::abort();
  ::close(null_fd);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  std::vector<std::string> args;
  std::string current;
  for (std::size_t i = 0; i < size && args.size() < kMaxArgs; ++i) {
    if (data[i] == '\n') {
      args.push_back(current);
      current.clear();
    } else {
      current += static_cast<char>(data[i]);
    }
  }
  if (!current.empty() && args.size() < kMaxArgs) args.push_back(current);
  for (const auto& a : args)
    if (a.find('/') != std::string::npos) return 0;

  std::vector<const char*> argv{"dfss"};
  for (const auto& a : args) argv.push_back(a.c_str());

  null_buffer sink;
  std::ostream null(&sink);
  std::streambuf* const cout_buffer = std::cout.rdbuf(&sink);
  std::streambuf* const cerr_buffer = std::cerr.rdbuf(&sink);
  dfss::cli::invocation inv;
  const std::optional<int> parsed =
      dfss::cli::parse_command_line(static_cast<int>(argv.size()), argv.data(), inv, null, null);
  std::optional<int> ran;
  using dfss::cli::command;
  if (!parsed) {
    const auto& demo = inv.demo;
    bool small_demo = demo.threads <= kMaxDemoThreads;
    for (const long long s : {demo.batch, demo.heads, demo.seq_len, demo.head_dim}) {
      small_demo = small_demo && s >= 1 && s <= kMaxDemoSize;
    }
    if (inv.cmd == command::demo && inv.demo.real_data.empty()) inv.demo.no_real = true;
    if (inv.cmd == command::attention || inv.cmd == command::quality || inv.cmd == command::info ||
        (inv.cmd == command::demo && small_demo)) {
      ran = run_in_private_directory(inv);
    }
  }
  std::cout.rdbuf(cout_buffer);
  std::cerr.rdbuf(cerr_buffer);

  if (parsed && *parsed != dfss::cli::kExitOk && *parsed != dfss::cli::kExitBadInput) {
    finding("parsing ended with exit code " + std::to_string(*parsed), args);
  }
  if (!ran) return 0;
  const bool needs_files = inv.cmd == command::attention || inv.cmd == command::quality;
  const bool ok = needs_files                ? *ran == dfss::cli::kExitBadInput
                  : inv.cmd == command::info ? *ran == dfss::cli::kExitOk
                                             : *ran == dfss::cli::kExitOk || *ran == dfss::cli::kExitBadInput;
  if (!ok) {
    finding(std::string(needs_files                ? "a command whose input files do not exist"
                        : inv.cmd == command::info ? "info"
                                                   : "the demo") +
                " ended with exit code " + std::to_string(*ran),
            args);
  }
  return 0;
}
