// What this build contains (generated configuration) and what the machine offers.
#include "dfss/build_info.hpp"

#include <sstream>

#include "core/cpu_features.hpp"
#include "dfss/config.hpp"
#include "dfss_build_config.hpp"

namespace dfss {

build_info get_build_info() {
  build_info info;
  info.version = DFSS_VERSION_STRING;
  info.backends = {"reference", "cpu"};
  info.cpu_features = core::detect_cpu_features();
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
