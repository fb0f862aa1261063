// CPU feature detection through the compiler's cpuid builtins (gcc and clang).
#include "core/cpu_features.hpp"

#include <cstdlib>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif
#if defined(__linux__) && defined(__x86_64__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace dfss::core {
namespace {

constexpr cpu_feature kAll[] = {cpu_feature::sse4_2,  cpu_feature::avx,      cpu_feature::avx2,
                                cpu_feature::fma,     cpu_feature::f16c,     cpu_feature::avx512f,
                                cpu_feature::avx512bw, cpu_feature::avx512bf16, cpu_feature::neon,
                                cpu_feature::amx_bf16};

#if defined(__x86_64__) || defined(__i386__)
/// AMX-TILE and AMX-BF16 in cpuid, the tile state (XCR0 bits 17 and 18) enabled by the OS, and on
/// Linux the process's permission to use it, requested here (arch_prctl ARCH_REQ_XCOMP_PERM for
/// XFEATURE_XTILEDATA, kernel 5.16 and later): without it the first tile instruction faults.
bool detect_amx() noexcept {
#if defined(__linux__) && defined(__x86_64__)
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (__get_cpuid(1, &eax, &ebx, &ecx, &edx) == 0 || (ecx & bit_OSXSAVE) == 0) return false;
  if (__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) == 0) return false;
  constexpr unsigned kAmxBf16 = 1u << 22, kAmxTile = 1u << 24;
  if ((edx & kAmxBf16) == 0 || (edx & kAmxTile) == 0) return false;
  unsigned lo = 0, hi = 0;
  asm volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  constexpr unsigned kTileState = (1u << 17) | (1u << 18);
  if ((lo & kTileState) != kTileState) return false;
  constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
#else
  return false;
#endif
}
#endif

bool detect(cpu_feature f) noexcept {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  switch (f) {
    case cpu_feature::sse4_2: return __builtin_cpu_supports("sse4.2") != 0;
    case cpu_feature::avx: return __builtin_cpu_supports("avx") != 0;
    case cpu_feature::avx2: return __builtin_cpu_supports("avx2") != 0;
    case cpu_feature::fma: return __builtin_cpu_supports("fma") != 0;
    case cpu_feature::f16c: {
      // cpuid leaf 1 directly: clang 14's __builtin_cpu_supports does not know "f16c".
      unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
      return __get_cpuid(1, &eax, &ebx, &ecx, &edx) != 0 && (ecx & bit_F16C) != 0;
    }
    case cpu_feature::avx512f: return __builtin_cpu_supports("avx512f") != 0;
    case cpu_feature::avx512bw: return __builtin_cpu_supports("avx512bw") != 0;
    case cpu_feature::avx512bf16: return __builtin_cpu_supports("avx512bf16") != 0;
    case cpu_feature::neon: return false;
    case cpu_feature::amx_bf16: return detect_amx();
  }
  return false;
#elif defined(__aarch64__)
  return f == cpu_feature::neon;
#else
  (void)f;
  return false;
#endif
}

/// The value of environment variable @p name when it is exactly "0" or "1" (a forced answer of
/// the detections below), else -1.
int forced_answer(const char* name) noexcept {
  const char* v = std::getenv(name);
  return v != nullptr && (v[0] == '0' || v[0] == '1') && v[1] == '\0' ? v[0] - '0' : -1;
}

}  // namespace

bool cpu_has(cpu_feature f) noexcept {
  // One detection per feature for the process (thread-safe static initialisation).
  static const auto present = [] {
    unsigned bits = 0;
    for (const cpu_feature g : kAll) bits |= detect(g) ? 1u << static_cast<unsigned>(g) : 0u;
    return bits;
  }();
  return ((present >> static_cast<unsigned>(f)) & 1u) != 0;
}

bool cpu_has_fast_bf16_dot() noexcept {
  static const bool fast = [] {
    const bool has = cpu_has(cpu_feature::avx512bf16);
    if (const int forced = forced_answer("DFSS_CPU_BF16_DOT"); forced >= 0) return has && forced == 1;
#if defined(__x86_64__) || defined(__i386__)
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    if (!has || __get_cpuid(0, &eax, &ebx, &ecx, &edx) == 0) return false;
    // "GenuineIntel" in ebx, edx, ecx.
    const bool intel = ebx == 0x756e6547u && edx == 0x49656e69u && ecx == 0x6c65746eu;
    return !intel;
#else
    return false;
#endif
  }();
  return fast;
}

bool cpu_uses_amx() noexcept {
  static const bool use = [] {
    // (amx::weights_to_pairs converts with AVX512-BF16, which every CPU with AMX-BF16 has so far.)
    const bool has = cpu_has(cpu_feature::amx_bf16) && cpu_has(cpu_feature::avx512bf16);
    if (const int forced = forced_answer("DFSS_CPU_AMX"); forced >= 0) return has && forced == 1;
    return has;
  }();
  return use;
}

bool cpu_pair_blocks_pay() noexcept {
  static const bool pay = [] {
    if (const int forced = forced_answer("DFSS_CPU_PAIR_BLOCKS"); forced >= 0) return forced == 1;
#if defined(__x86_64__) || defined(__i386__)
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    if (!cpu_has(cpu_feature::avx512f) || __get_cpuid(0, &eax, &ebx, &ecx, &edx) == 0) return false;
    // "AuthenticAMD" in ebx, edx, ecx.
    const bool amd = ebx == 0x68747541u && edx == 0x69746e65u && ecx == 0x444d4163u;
    if (!amd || __get_cpuid(1, &eax, &ebx, &ecx, &edx) == 0) return false;
    const unsigned base = (eax >> 8) & 0xfu;
    const unsigned family = base == 0xfu ? base + ((eax >> 20) & 0xffu) : base;
    return family >= 0x1au;  // Zen 5 and later (Zen 4, 19h, splits 512-bit operations)
#else
    return false;
#endif
  }();
  return pay;
}

const char* cpu_feature_name(cpu_feature f) noexcept {
  switch (f) {
    case cpu_feature::sse4_2: return "sse4.2";
    case cpu_feature::avx: return "avx";
    case cpu_feature::avx2: return "avx2";
    case cpu_feature::fma: return "fma";
    case cpu_feature::f16c: return "f16c";
    case cpu_feature::avx512f: return "avx512f";
    case cpu_feature::avx512bw: return "avx512bw";
    case cpu_feature::avx512bf16: return "avx512bf16";
    case cpu_feature::neon: return "neon";
    case cpu_feature::amx_bf16: return "amx-bf16";
  }
  return "unknown";
}

std::vector<std::string> detect_cpu_features() {
  std::vector<std::string> out;
  for (const cpu_feature f : kAll) {
    if (cpu_has(f)) out.emplace_back(cpu_feature_name(f));
  }
  return out;
}

}  // namespace dfss::core
