// What this build contains (generated configuration) and what the machine offers.
#include "dfss/build_info.hpp"

#include <algorithm>
#include <sstream>

#include "core/cpu_features.hpp"
#include "core/registry.hpp"
#include "dfss/config.hpp"
#include "dfss_build_config.hpp"

namespace dfss {
namespace {

kernel_info describe(const core::kernel_entry& e) {
  kernel_info k;
  k.name = e.name;
  k.backend = backend_name(e.backend);
  k.direction = e.dir == core::direction::forward ? "forward" : "backward";
  if (e.backend == backend::cpu) {
    k.algorithm = e.algorithm == cpu_algorithm::three_stage ? "three-stage" : "fused";
    k.isa = e.every_isa ? "every" : e.isa_name;
  }
  for (const dtype t : {dtype::f64, dtype::f32, dtype::f16, dtype::bf16}) {
    if (e.takes(t)) k.dtypes += std::string(k.dtypes.empty() ? "" : " ") + dtype_name(t);
  }
  k.needs = e.needs;
  k.runs_here = e.cpu_lacks == nullptr || e.cpu_lacks(dtype::f32) == nullptr;
  return k;
}

}  // namespace

build_info get_build_info() {
  build_info info;
  info.version = DFSS_VERSION_STRING;
  info.cpu_features = core::detect_cpu_features();
  for (const core::kernel_entry& e : core::kernel_registry()) {
    info.kernels.push_back(describe(e));
    const std::string b = backend_name(e.backend);
    if (std::find(info.backends.begin(), info.backends.end(), b) == info.backends.end()) info.backends.push_back(b);
  }
  std::stringstream archs(DFSS_BUILD_CUDA_ARCHS);
  for (std::string a; std::getline(archs, a, ';');) {
    if (!a.empty()) info.cuda_architectures.push_back("sm_" + a);
  }
#if defined(__clang__)
  info.compiler = "clang " __clang_version__;
#elif defined(__GNUC__)
  info.compiler = "gcc " __VERSION__;
#else
  info.compiler = "unknown";
#endif
  return info;
}

}  // namespace dfss
