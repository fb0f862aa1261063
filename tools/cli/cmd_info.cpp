// `dfss info`: what this build contains (backends, kernels) and what the machine offers.
#include <omp.h>

#include <iomanip>
#include <iostream>

#include "cli/commands.hpp"
#include "dfss/attention.hpp"
#include "dfss/build_info.hpp"

namespace dfss::cli {
namespace {

void print_list(const char* label, const std::vector<std::string>& items, const char* none) {
  std::cout << label;
  if (items.empty()) std::cout << none;
  for (std::size_t i = 0; i < items.size(); ++i) std::cout << (i ? " " : "") << items[i];
  std::cout << "\n";
}

/// The kernel registry, one kernel a line, in the selector's order of preference: which cpu_isa
/// requests it, the input types it takes, and whether this machine can run it (and if not, why).
void print_kernels(const std::vector<kernel_info>& kernels) {
  std::cout << "kernels:\n";
  for (const kernel_info& k : kernels) {
    std::cout << "  " << std::left << std::setw(34) << k.name << std::setw(9) << k.direction
              << std::setw(10) << (k.isa.empty() ? "-" : k.isa) << std::setw(17) << k.dtypes
              << (k.runs_here ? "runs here" : "not here");
    if (!k.needs.empty()) std::cout << " (needs " << k.needs << ")";
    std::cout << "\n";
  }
}

}  // namespace

int run_info() {
  const build_info info = get_build_info();
  std::cout << "dfss " << info.version << "\n";
  print_list("backends:           ", info.backends, "(none)");
  print_list("cpu features:       ", info.cpu_features, "(none detected)");
  // The SIMD targets of the CPU kernels (names --isa accepts), best first; "automatic" runs the
  // best one this CPU supports, but for avx3_bf16 where its bf16 dot products are slow.
  std::vector<std::string> compiled, runnable, automatic;
  for (const cpu_isa_support& t : cpu_simd_isas()) {
    compiled.emplace_back(cpu_isa_name(t.isa));
    if (t.supported) runnable.emplace_back(cpu_isa_name(t.isa));
    if (t.automatic) automatic.emplace_back(cpu_isa_name(t.isa));
  }
  print_list("cpu isas compiled:  ", compiled, "(none: the generic kernel only)");
  print_list("cpu isas runnable:  ", runnable, "(none: the generic kernel only)");
  print_list("cpu isa automatic:  ", automatic, "(none: the generic kernel)");
  print_list("cuda architectures: ", info.cuda_architectures, "(built without CUDA)");
  std::cout << "threads:            " << omp_get_max_threads() << "\n";
  std::cout << "compiler:           " << info.compiler << "\n";
  print_kernels(info.kernels);
  return kExitOk;
}

}  // namespace dfss::cli
