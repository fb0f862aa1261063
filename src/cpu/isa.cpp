// CPU feature checks through the compiler's cpuid builtins; non-x86 machines report none.
#include "cpu/isa.hpp"

// The AVX2 kernels (fused_forward_avx2.cpp) are compiled by GCC only: a build without them (clang)
// reports no AVX2, so that the selector never picks a kernel the build lacks (clang 14 also has no
// "f16c" for __builtin_cpu_supports).
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define DFSS_ISA_AVX2_KERNELS 1
#endif

namespace dfss::cpu {

bool cpu_supports_avx2() noexcept {
#if DFSS_ISA_AVX2_KERNELS
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
  return false;
#endif
}

bool cpu_supports_f16c() noexcept {
#if DFSS_ISA_AVX2_KERNELS
  __builtin_cpu_init();
  return __builtin_cpu_supports("f16c");
#else
  return false;
#endif
}

}  // namespace dfss::cpu
