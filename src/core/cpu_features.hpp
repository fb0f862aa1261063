// Run-time CPU feature detection, the one place the library asks the CPU what it can run (cpuid
// through the compiler's builtins on x86; NEON is architectural on AArch64). The kernel registry
// (core/registry.cpp) turns these answers into "this CPU can run kernel X"; `dfss info` and
// dfss::get_build_info list them by name.
#pragma once

#include <string>
#include <vector>

namespace dfss::core {

/// @brief The SIMD features the kernels or `dfss info` care about.
/// amx_bf16: the AMX tile registers with their bf16 dot products (cpuid's AMX-TILE and AMX-BF16,
/// the OS's XCR0 tile state, and Linux's per-process permission, which the detection requests).
enum class cpu_feature { sse4_2, avx, avx2, fma, f16c, avx512f, avx512bw, avx512bf16, neon, amx_bf16 };

/// @brief Whether this CPU reports @p f and the OS enables it. Detected once, then cached.
bool cpu_has(cpu_feature f) noexcept;

/// @brief Whether the forward's 1:2 pair blocks (a blend beside each FMA of the P V) measured
/// faster than its row-at-a-time P V on this CPU (docs/design.md, "The forward"): AMD CPUs that
/// run 512-bit vectors at full width (Zen 5: family 1Ah and later), not Zen 4 (family 19h, which
/// splits 512-bit operations in halves) nor Intel's (Sapphire Rapids: blends and 512-bit FMAs
/// share two ports, and row at a time measured 4-13% faster). Detected once; the environment
/// variable DFSS_CPU_PAIR_BLOCKS = 0 or 1, read once, overrides the detection so that tests and
/// benchmarks can run either form on any AVX-512 machine.
bool cpu_pair_blocks_pay() noexcept;

/// @brief Whether this CPU has AVX512_BF16 and its bf16 dot products (vdpbf16ps) are faster than
/// fp32 FMAs on widened values: AMD's (Zen 4, Zen 5: the avx3_bf16 forward about 1.5x the avx3
/// one), not Intel's (Sapphire Rapids: one core issued 1.1 vdpbf16ps per ns against 4.1 fp32 FMAs,
/// so half the products per second, and the avx3_bf16 forward took 1.25x to 1.8x the avx3 one's
/// time, docs/benchmarks.md). Decides whether cpu_isa::automatic picks avx3_bf16. The environment
/// variable DFSS_CPU_BF16_DOT = 0 or 1, read once, overrides the vendor rule (1 only where the CPU
/// has AVX512_BF16).
bool cpu_has_fast_bf16_dot() noexcept;

/// @brief Whether the fused forward computes a bf16 call's Q K^T and P V on the AMX tiles (tdpbf16ps):
/// where the CPU has cpu_feature::amx_bf16 (Sapphire Rapids and later Intel Xeons; one tile
/// instruction does 16 x 16 x 32 products). The environment variable DFSS_CPU_AMX = 0 or 1, read
/// once, overrides it (1 only where the CPU has AMX), so that tests and benchmarks run both paths.
bool cpu_uses_amx() noexcept;

/// @brief Lower-case name of @p f as `dfss info` prints it, e.g. "sse4.2", "avx2", "f16c".
const char* cpu_feature_name(cpu_feature f) noexcept;

/// @brief Names of the features this CPU has, in enum order, e.g. {"sse4.2", "avx", "avx2", "fma"}.
std::vector<std::string> detect_cpu_features();

}  // namespace dfss::core
