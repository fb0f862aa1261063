// `dfss` command-line parsing and dispatch (see app.hpp; main.cpp is the program around them).
#include "cli/app.hpp"

#include <CLI/CLI.hpp>

#include <exception>
#include <iostream>

#include "dfss/config.hpp"

namespace dfss::cli {

std::optional<int> parse_command_line(int argc, const char* const* argv, invocation& inv, std::ostream& out,
                                      std::ostream& err) {
  CLI::App app{"dfss: dynamic N:M fine-grained structured sparse attention (DFSS)", "dfss"};
  app.set_version_flag("--version", DFSS_VERSION_STRING);
  app.require_subcommand(0, 1);

  add_attention_command(app, inv.attention);
  add_quality_command(app, inv.quality);
  app.add_subcommand("info", "Print version, compiled backends, CPU features and CUDA architectures");
  add_demo_command(app, inv.demo);
  add_bench_command(app);

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int rc = app.exit(e, out, err);
    return rc == 0 ? kExitOk : kExitBadInput;
  }
  inv.cmd = app.got_subcommand("attention") ? command::attention
            : app.got_subcommand("quality") ? command::quality
            : app.got_subcommand("info")    ? command::info
            : app.got_subcommand("bench")   ? command::bench
                                            : command::demo;
  return std::nullopt;
}

int run_command(const invocation& inv) {
  try {
    switch (inv.cmd) {
      case command::attention: return run_attention(inv.attention);
      case command::quality: return run_quality(inv.quality);
      case command::info: return run_info();
      case command::bench: return run_bench();
      case command::demo: break;
    }
    return run_demo(inv.demo);
  } catch (const std::exception& e) {
    std::cerr << "dfss: internal error: " << e.what() << "\n";
    return kExitInternal;
  }
}

}  // namespace dfss::cli
