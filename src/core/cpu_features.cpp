// CPU feature detection through the compiler's cpuid builtins (gcc and clang).
#include "core/cpu_features.hpp"

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

namespace dfss::core {

std::vector<std::string> detect_cpu_features() {
  std::vector<std::string> out;
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  struct feature {
    const char* name;
    bool present;
  };
  const feature features[] = {
      {"sse4.2", __builtin_cpu_supports("sse4.2") != 0},
      {"avx", __builtin_cpu_supports("avx") != 0},
      {"avx2", __builtin_cpu_supports("avx2") != 0},
      {"fma", __builtin_cpu_supports("fma") != 0},
      // cpuid leaf 1 directly: clang 14's __builtin_cpu_supports does not know "f16c".
      {"f16c", __get_cpuid(1, &eax, &ebx, &ecx, &edx) != 0 && (ecx & bit_F16C) != 0},
      {"avx512f", __builtin_cpu_supports("avx512f") != 0},
      {"avx512bw", __builtin_cpu_supports("avx512bw") != 0},
      {"avx512bf16", __builtin_cpu_supports("avx512bf16") != 0},
  };
  for (const auto& f : features) {
    if (f.present) out.emplace_back(f.name);
  }
#elif defined(__aarch64__)
  out.emplace_back("neon");
#endif
  return out;
}

}  // namespace dfss::core
