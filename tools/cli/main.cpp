// dfss: command-line front end of the library.
//   dfss                      run the default example (dense vs 1:2 vs 2:4 on random and on real attention)
//   dfss attention ...        compute attention (and optionally its gradients) on .npy files
//   dfss quality ...          approximation quality of DFSS vs full attention and other efficient attentions
//   dfss info                 version, compiled backends, CPU features, CUDA architectures
//   dfss bench                benchmark table (dfss patterns vs dense vs PyTorch), --json FILE
#include <csignal>
#include <iostream>

#include "cli/app.hpp"

int main(int argc, char** argv) {
  // A write past the file size limit (ulimit -f) then fails with EFBIG instead of killing the
  // process with SIGXFSZ, so the atomic writer removes its temporary file and the old output stays.
  std::signal(SIGXFSZ, SIG_IGN);
  dfss::cli::invocation inv;
  if (const auto rc = dfss::cli::parse_command_line(argc, argv, inv, std::cout, std::cerr)) return *rc;
  return dfss::cli::run_command(inv);
}
