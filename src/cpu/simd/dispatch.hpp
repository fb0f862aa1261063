// Run-time dispatch to one named Highway target, without Highway's global "chosen target" state:
// the selector decides which target runs (tests force each one, users pass --isa), and this picks
// that target's entry out of the table HWY_EXPORT built. Included in HWY_ONCE sections only.
#pragma once

#include <cstddef>
#include <cstdint>
#include <exception>
#include <new>
#include <string>

#include "cpu/simd/targets.hpp"
#include "hwy/highway.h"

namespace dfss::cpu::simd {

/// Highway's bit of @p t (HWY_AVX2, ...); 0 for a target of another architecture.
inline std::int64_t target_bit(simd_target t) noexcept {
  switch (t) {
#if HWY_ARCH_X86
    case simd_target::sse4: return HWY_SSE4;
    case simd_target::avx2: return HWY_AVX2;
    case simd_target::avx3: return HWY_AVX3;
#if defined(DFSS_HAVE_BF16_DOT)
    case simd_target::avx3_bf16: return HWY_AVX3;  // the avx3 instance, with its bf16 dot loops
#endif
#endif
#if HWY_ARCH_ARM
    case simd_target::neon: return HWY_NEON;
    case simd_target::sve: return HWY_SVE;
    case simd_target::sve2: return HWY_SVE2;
#endif
    default: return 0;
  }
}

/// The entry of @p table (an HWY_EXPORT dispatch table of this translation unit) compiled for
/// @p t, or nullptr when this build did not compile that target. Highway's table holds an
/// initialising entry first, then one per dynamic target in the order of their bits.
template <typename F, std::size_t N>
F dispatch_entry(F const (&table)[N], simd_target t) noexcept {
  const std::int64_t bit = target_bit(t);
  if (bit == 0 || (HWY_TARGETS & bit) == 0) return nullptr;
  if constexpr (N == 1) {
    return bit == HWY_STATIC_TARGET ? table[0] : nullptr;  // a build with one target
  } else {
    const std::size_t index = hwy::Num0BitsBelowLS1Bit_Nonzero64(static_cast<std::uint64_t>(HWY_CHOSEN_TARGET_SHIFT(bit)));
    return index < N ? table[index] : nullptr;
  }
}

/// Runs @p p on target @p t's entry of @p table (both directions' public entry points; an entry
/// takes the params and the target, so the avx3 instance knows when it runs as avx3_bf16): an absent
/// target and an exception (out of memory for the packed keys and values, or anything else) become
/// statuses naming @p what ("dfss cpu simd fused forward", ...).
template <typename F, std::size_t N>
status run_on_target(F const (&table)[N], simd_target t, const attention_params& p, const char* what) noexcept {
  const F fn = dispatch_entry(table, t);
  if (fn == nullptr) {
    return {status_code::unsupported, std::string(what) + ": this build has no " + simd_target_name(t) + " kernel"};
  }
  try {
    return fn(p, t);
  } catch (const std::bad_alloc&) {
    return {status_code::internal, std::string(what) + ": out of memory for the packed keys and values"};
  } catch (const std::exception& e) {
    return {status_code::internal, std::string(what) + ": " + e.what()};
  }
}

}  // namespace dfss::cpu::simd

/// The HWY_ONCE part of a kernel file, inside namespace dfss::cpu: the dispatch table of the
/// per-target @p entry and the public @p function that runs the entry of a named target, its
/// failures naming @p what.
#define DFSS_SIMD_EXPORT_ENTRY(entry, function, what)                       \
  namespace simd {                                                         \
  HWY_EXPORT(entry);                                                       \
  }                                                                        \
  status function(const attention_params& p, simd_target t) noexcept {     \
    return simd::run_on_target(simd::HWY_DISPATCH_TABLE(entry), t, p, what); \
  }
