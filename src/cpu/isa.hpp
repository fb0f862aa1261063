// Run-time instruction-set checks for the CPU kernels' dispatch.
#pragma once

namespace dfss::cpu {

/// @brief AVX2 and FMA are available (and enabled by the OS).
bool cpu_supports_avx2() noexcept;
/// @brief F16C (half <-> float conversion instructions) is available.
bool cpu_supports_f16c() noexcept;

}  // namespace dfss::cpu
