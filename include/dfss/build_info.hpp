// dfss/build_info.hpp: what this build of dfss contains and what the machine offers.
#pragma once

#include <string>
#include <vector>

namespace dfss {

struct build_info {
  std::string version;                       ///< "0.1.0"
  std::vector<std::string> backends;         ///< compiled backends, e.g. {"reference", "cpu"}
  std::vector<std::string> cpu_features;     ///< detected on this machine: "avx2", "fma", "f16c", ...
  std::vector<std::string> cuda_architectures;  ///< compiled SASS targets, e.g. {"sm_80", "sm_90"}
  std::string compiler;                      ///< host compiler and version
};

/// @brief The build's contents and the machine's CPU features (detected at run time).
build_info get_build_info();

}  // namespace dfss
