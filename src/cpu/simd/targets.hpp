// The Highway targets the SIMD kernels are compiled for, and the small interface the selector and
// the API use to run one of them. Include this header before any Highway header in a kernel
// translation unit: it fixes HWY_DISABLED_TARGETS, which decides what hwy/foreach_target.h compiles.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "dfss/attention.hpp"
#include "dfss/error.hpp"
#include "dfss/params.hpp"

// Targets compiled (Highway 1.0.3 defaults minus the ones that do not pay):
// - x86-64: SSE4 (the floor of every x86-64 CPU dfss runs SIMD code on), AVX2 and AVX3 (AVX-512
//   F/BW/DQ/VL). SSSE3 is left out: no CPU without SSE4.1 is worth a kernel of its own, and the
//   scalar twin covers it. AVX3_DL is not compiled (Highway only builds it with HWY_WANT_AVX3_DL):
//   its additions (VNNI, VBMI2, VPOPCNTDQ, ...) are integer and byte instructions the fp32 kernel
//   never uses, so it would cost a fourth instantiation for the AVX3 machine code.
// - AArch64: NEON, SVE and SVE2 (Highway's defaults) without the fixed-width SVE_256 / SVE2_128
//   specialisations, which would double the ARM compile time for the same code.
// - Highway always also compiles its static baseline (HWY_SCALAR with GCC < 12.3, HWY_EMU128 with
//   clang, on x86-64 without -msse4): that instance is an empty stub here (the scalar twin is the
//   fallback), and it is never listed or dispatched to.
#ifndef HWY_DISABLED_TARGETS
#define HWY_DISABLED_TARGETS (HWY_SSSE3 | HWY_SVE_256 | HWY_SVE2_128)
#endif

namespace dfss::cpu {

/// A Highway target of the SIMD kernels (lower-case Highway names: "sse4", "avx2", ...).
/// avx3_bf16 is not a Highway target of its own (Highway 1.0.3 has none with AVX512_BF16): it runs
/// the avx3 instance, whose bf16 forward then takes the vdpbf16ps loops of bf16_dot.hpp. It is
/// compiled where the compiler has -mavx512bf16 (DFSS_HAVE_BF16_DOT) and supported where the CPU
/// also reports AVX512_BF16.
enum class simd_target : int { sse4, avx2, avx3, neon, sve, sve2, avx3_bf16 };

/// @brief Highway's lower-case name of @p t ("sse4", "avx2", "avx3", "neon", "sve", "sve2"), or
/// "avx3_bf16".
const char* simd_target_name(simd_target t) noexcept;

/// @brief The targets this build compiled, best first.
std::vector<simd_target> compiled_simd_targets();

/// @brief Whether this build compiled @p t and this CPU (and OS) can run it (hwy::SupportedTargets).
bool simd_target_supported(simd_target t) noexcept;

/// @brief Whether cpu_isa::automatic may take target @p t on this CPU where it is supported: every
/// target but avx3_bf16 where the CPU's bf16 dot products are slow (core::cpu_has_fast_bf16_dot).
/// The one rule behind the registry rows' automatic_when and cpu_isa_support::automatic.
bool simd_target_preferred(simd_target t) noexcept;

/// @brief The target a cpu_isa value runs: automatic -> the best supported and preferred target
/// (simd_target_preferred), portable -> the
/// baseline (sse4 on x86-64, neon on AArch64), avx2, sse4, avx3, ... -> themselves; generic (the
/// scalar twin) and values naming another architecture -> nullopt. Does not check CPU support.
std::optional<simd_target> simd_target_of(cpu_isa isa) noexcept;

/// @brief The cpu_isa value naming @p t.
cpu_isa cpu_isa_of(simd_target t) noexcept;

/// @brief Fused DFSS forward on target @p t (the caller checked simd_target_supported): same
/// contract as fused_forward_scalar (f32, f16, bf16 inputs; any N:M with M <= 16; bitwise identical
/// results for every thread count).
status fused_forward_simd(const attention_params& p, simd_target t) noexcept;

/// @brief Largest seqlen_q the decode kernel is selected for (decode_forward_applies). Measured on
/// Zen 5 (avx3, 2 threads, d = 128, Lk = 4096, H = Hkv = 32 and H = 32, Hkv = 8; docs/benchmarks.md):
/// the decode kernel is faster than the fused forward up to this many query rows (speculative
/// decoding drafts), the fused forward from about twice as many, where its whole-head packing is
/// shared by enough rows.
inline constexpr std::int64_t kDecodeMaxQueryRows = 8;

/// @brief Whether the selector runs the decode kernel for @p p (a shape rule only, never the thread
/// count, so a shape always runs the same kernel): seqlen_q <= kDecodeMaxQueryRows.
bool decode_forward_applies(const attention_params& p) noexcept;

/// @brief DFSS decode forward on target @p t (src/cpu/simd/attention_decode.cpp): the function of
/// fused_forward_simd (same scores and selection, same non-finite semantics) with tasks over
/// (batch, kv head, key chunk) and an exact merge of the chunks; bitwise identical results for
/// every thread count. Forward only (the fused backward handles training).
status decode_forward_simd(const attention_params& p, simd_target t) noexcept;

/// @brief Fused DFSS backward on target @p t: dQ, dK, dV and dBias (summed over its broadcast
/// dimensions). Requires p.o and p.lse from fused_forward_simd on the same target: it recomputes
/// that forward's scores and selection with the same code, so it keeps exactly the same keys.
status fused_backward_simd(const attention_params& p, simd_target t) noexcept;

}  // namespace dfss::cpu
