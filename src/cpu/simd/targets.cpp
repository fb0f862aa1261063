// The list of compiled SIMD targets, CPU support (Highway's run-time detection), and the mapping
// between dfss::cpu_isa values and targets.
#include "cpu/simd/targets.hpp"  // first: it fixes the compiled targets

#include "core/cpu_features.hpp"
#include "cpu/simd/dispatch.hpp"
#include "hwy/targets.h"

namespace dfss::cpu {

const char* simd_target_name(simd_target t) noexcept {
  switch (t) {
    case simd_target::sse4: return "sse4";
    case simd_target::avx2: return "avx2";
    case simd_target::avx3: return "avx3";
    case simd_target::neon: return "neon";
    case simd_target::sve: return "sve";
    case simd_target::sve2: return "sve2";
    case simd_target::avx3_bf16: return "avx3_bf16";
  }
  return "unknown";
}

std::vector<simd_target> compiled_simd_targets() {
  std::vector<simd_target> out;
  // Best first: Highway's lower bits are the better targets.
  for (simd_target t : {simd_target::avx3_bf16, simd_target::avx3, simd_target::avx2, simd_target::sse4, simd_target::sve2, simd_target::sve,
                        simd_target::neon}) {
    const std::int64_t bit = simd::target_bit(t);
    if (bit != 0 && (HWY_TARGETS & bit) != 0) out.push_back(t);
  }
  return out;
}

bool simd_target_supported(simd_target t) noexcept {
  const std::int64_t bit = simd::target_bit(t);
  // Once per process: hwy::SupportedTargets runs CPUID each time, which traps to the hypervisor in
  // a virtual machine (6% of a small decode step, where the selector asks per call).
  static const std::int64_t supported = hwy::SupportedTargets();
  const bool runs = bit != 0 && (HWY_TARGETS & bit) != 0 && (supported & bit) != 0;
  // avx3_bf16: the avx3 instance plus the vdpbf16ps loops, which need the CPU's AVX512_BF16.
  return runs && (t != simd_target::avx3_bf16 || core::cpu_has(core::cpu_feature::avx512bf16));
}

bool simd_target_preferred(simd_target t) noexcept {
  return t != simd_target::avx3_bf16 || core::cpu_has_fast_bf16_dot();
}

std::optional<simd_target> simd_target_of(cpu_isa isa) noexcept {
  switch (isa) {
    case cpu_isa::automatic:
      for (simd_target t : compiled_simd_targets()) {
        if (simd_target_supported(t) && simd_target_preferred(t)) return t;
      }
      return std::nullopt;
    case cpu_isa::generic: return std::nullopt;
    case cpu_isa::portable:
#if HWY_ARCH_ARM
      return simd_target::neon;
#else
      return simd_target::sse4;
#endif
    case cpu_isa::sse4: return simd_target::sse4;
    case cpu_isa::avx2: return simd_target::avx2;
    case cpu_isa::avx3: return simd_target::avx3;
    case cpu_isa::neon: return simd_target::neon;
    case cpu_isa::sve: return simd_target::sve;
    case cpu_isa::sve2: return simd_target::sve2;
    case cpu_isa::avx3_bf16: return simd_target::avx3_bf16;
  }
  return std::nullopt;
}

cpu_isa cpu_isa_of(simd_target t) noexcept {
  switch (t) {
    case simd_target::sse4: return cpu_isa::sse4;
    case simd_target::avx2: return cpu_isa::avx2;
    case simd_target::avx3: return cpu_isa::avx3;
    case simd_target::neon: return cpu_isa::neon;
    case simd_target::sve: return cpu_isa::sve;
    case simd_target::sve2: return cpu_isa::sve2;
    case simd_target::avx3_bf16: return cpu_isa::avx3_bf16;
  }
  return cpu_isa::generic;
}

}  // namespace dfss::cpu

namespace dfss {

std::vector<cpu_isa_support> cpu_simd_isas() {
  std::vector<cpu_isa_support> out;
  bool picked = false;
  for (cpu::simd_target t : cpu::compiled_simd_targets()) {
    const bool supported = cpu::simd_target_supported(t);
    const bool automatic = !picked && supported && cpu::simd_target_preferred(t);
    picked = picked || automatic;
    out.push_back({cpu::cpu_isa_of(t), supported, automatic});
  }
  return out;
}

}  // namespace dfss
