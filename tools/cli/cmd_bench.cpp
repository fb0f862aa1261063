// Placeholder: `dfss bench` is being written.
#include <CLI/CLI.hpp>

#include "cli/commands.hpp"

namespace dfss::cli {

void add_bench_command(CLI::App& app) { app.add_subcommand("bench", "Benchmark table (being written)"); }
int run_bench() { return kExitInternal; }

}  // namespace dfss::cli
