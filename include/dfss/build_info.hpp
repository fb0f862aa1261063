// dfss/build_info.hpp: what this build of dfss contains and what the machine offers.
#pragma once

#include <string>
#include <vector>

namespace dfss {

/// @brief One kernel of this build, as the selector knows it (dfss info lists these).
struct kernel_info {
  std::string name;       ///< stable name, e.g. "cpu.fused_forward.avx2" (CUDA: the family's name)
  std::string backend;    ///< "reference", "cpu" or "cuda"
  std::string direction;  ///< "forward" or "backward"
  std::string algorithm;  ///< cpu only: "fused" or "three-stage"; empty otherwise
  std::string isa;        ///< cpu only: the cpu_isa value that requests it ("every" for all); empty otherwise
  std::string dtypes;     ///< input types it takes, e.g. "f32 f16 bf16"
  std::string needs;      ///< what the machine must have, e.g. "AVX2, FMA (F16C for f16)"; empty for nothing
  bool runs_here = true;  ///< this CPU can run it (f32 inputs; for CUDA: compiled, the device is checked per call)
};

struct build_info {
  std::string version;                       ///< "0.1.0"
  std::vector<std::string> backends;         ///< compiled backends, e.g. {"reference", "cpu"}
  std::vector<std::string> cpu_features;     ///< detected on this machine: "avx2", "fma", "f16c", ...
  std::vector<std::string> cuda_architectures;  ///< compiled SASS targets, e.g. {"sm_80", "sm_90"}
  std::string compiler;                      ///< host compiler and version
  std::vector<kernel_info> kernels;          ///< the kernel registry, in the selector's order of preference
};

/// @brief The build's contents and the machine's CPU features (detected at run time).
build_info get_build_info();

}  // namespace dfss
