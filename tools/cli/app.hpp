// The `dfss` command line as two steps, so that a test can parse without running: parse_command_line
// fills an invocation (which command, with which options), run_command runs it.
#pragma once

#include <optional>
#include <ostream>

#include "cli/commands.hpp"

namespace dfss::cli {

/// @brief The subcommands of `dfss`; demo is also what `dfss` alone runs.
enum class command { demo, attention, quality, info, bench };

/// @brief A parsed command line. `dfss bench` keeps its options in cmd_bench.cpp.
struct invocation {
  command cmd = command::demo;
  attention_options attention;
  quality_options quality;
  demo_options demo;
};

/// @brief Parses @p argv (argv[0] is the program name) into @p inv. Returns std::nullopt when a
/// command is to run, else the exit code parsing ends with: 0 after --help or --version (printed to
/// @p out), kExitBadInput after a usage error (printed to @p err).
std::optional<int> parse_command_line(int argc, const char* const* argv, invocation& inv, std::ostream& out,
                                      std::ostream& err);

/// @brief Runs the parsed command and returns the process exit code; an exception that escapes the
/// command is reported on std::cerr as an internal error (kExitInternal).
int run_command(const invocation& inv);

}  // namespace dfss::cli
