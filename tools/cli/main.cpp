// dfss: command-line front end of the library.
//   dfss                      run the default example (BERT-base-sized attention, dense vs 1:2 vs 2:4)
//   dfss attention ...        compute attention (and optionally its gradients) on .npy files
//   dfss quality ...          approximation quality of DFSS vs full attention and other efficient attentions
//   dfss info                 version, compiled backends, CPU features, CUDA architectures
//   dfss bench                benchmark table (dfss patterns vs dense vs PyTorch), --json FILE
#include <iostream>

#include "cli/app.hpp"

int main(int argc, char** argv) {
  dfss::cli::invocation inv;
  if (const auto rc = dfss::cli::parse_command_line(argc, argv, inv, std::cout, std::cerr)) return *rc;
  return dfss::cli::run_command(inv);
}
