// dfss: command-line front end of the library.
//   dfss                      run the default example (BERT-base-sized attention, dense vs 1:2 vs 2:4)
//   dfss attention ...        compute attention (and optionally its gradients) on .npy files
//   dfss quality ...          approximation quality of DFSS vs full attention and other efficient attentions
//   dfss info                 version, compiled backends, CPU features, CUDA architectures
//   dfss bench                benchmark table (dfss patterns vs dense vs PyTorch), --json FILE
#include <CLI/CLI.hpp>

#include <csignal>
#include <iostream>

#include "cli/commands.hpp"
#include "dfss/config.hpp"

int main(int argc, char** argv) {
  // A write past the file size limit (ulimit -f) then fails with EFBIG instead of killing the
  // process with SIGXFSZ, so the atomic writer removes its temporary file and the old output stays.
  std::signal(SIGXFSZ, SIG_IGN);
  CLI::App app{"dfss: dynamic N:M fine-grained structured sparse attention (DFSS)", "dfss"};
  app.set_version_flag("--version", DFSS_VERSION_STRING);
  app.require_subcommand(0, 1);

  dfss::cli::attention_options attn;
  dfss::cli::add_attention_command(app, attn);
  dfss::cli::quality_options quality;
  dfss::cli::add_quality_command(app, quality);
  app.add_subcommand("info", "Print version, compiled backends, CPU features and CUDA architectures");
  dfss::cli::demo_options demo;
  dfss::cli::add_demo_command(app, demo);
  dfss::cli::add_bench_command(app);

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int rc = app.exit(e);
    return rc == 0 ? 0 : dfss::cli::kExitBadInput;
  }
  try {
    if (app.got_subcommand("attention")) return dfss::cli::run_attention(attn);
    if (app.got_subcommand("quality")) return dfss::cli::run_quality(quality);
    if (app.got_subcommand("info")) return dfss::cli::run_info();
    if (app.got_subcommand("bench")) return dfss::cli::run_bench();
    return dfss::cli::run_demo(demo);
  } catch (const std::exception& e) {
    std::cerr << "dfss: internal error: " << e.what() << "\n";
    return dfss::cli::kExitInternal;
  }
}
