// Run-time CPU feature detection (cpuid on x86, nothing elsewhere yet).
#pragma once

#include <string>
#include <vector>

namespace dfss::core {

/// @brief Names of the SIMD features this CPU reports and the OS enables, e.g. {"sse4.2", "avx2"}.
std::vector<std::string> detect_cpu_features();

}  // namespace dfss::core
