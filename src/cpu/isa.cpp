// CPU feature checks through the compiler's cpuid builtins; non-x86 machines report none.
#include "cpu/isa.hpp"

namespace dfss::cpu {

bool cpu_supports_avx2() noexcept {
#if defined(__x86_64__)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
  return false;
#endif
}

bool cpu_supports_f16c() noexcept {
#if defined(__x86_64__)
  __builtin_cpu_init();
  return __builtin_cpu_supports("f16c");
#else
  return false;
#endif
}

}  // namespace dfss::cpu
