// `dfss info`: what this build contains and what the machine offers.
#include <omp.h>

#include <iostream>

#include "cli/commands.hpp"
#include "dfss/build_info.hpp"

namespace dfss::cli {
namespace {

void print_list(const char* label, const std::vector<std::string>& items, const char* none) {
  std::cout << label;
  if (items.empty()) std::cout << none;
  for (std::size_t i = 0; i < items.size(); ++i) std::cout << (i ? " " : "") << items[i];
  std::cout << "\n";
}

}  // namespace

int run_info() {
  const build_info info = get_build_info();
  std::cout << "dfss " << info.version << "\n";
  print_list("backends:           ", info.backends, "(none)");
  print_list("cpu features:       ", info.cpu_features, "(none detected)");
  print_list("cuda architectures: ", info.cuda_architectures, "(built without CUDA)");
  std::cout << "threads:            " << omp_get_max_threads() << "\n";
  std::cout << "compiler:           " << info.compiler << "\n";
  return kExitOk;
}

}  // namespace dfss::cli
