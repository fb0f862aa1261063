// The table of kernels (see registry.hpp). The only file of src/core/ that includes the backends.
#include "core/registry.hpp"

#include <iterator>

#include "core/cpu_features.hpp"
#include "cpu/scalar/attention.hpp"
#include "cpu/simd/targets.hpp"
#include "cpu/three_stage/attention.hpp"
#include "ref/reference.hpp"
#if defined(DFSS_WITH_CUDA_BACKEND)
#include "cuda/attention_cuda.hpp"
#endif

namespace dfss::core {
namespace {

constexpr unsigned kHostFloats = dtype_bit(dtype::f32) | dtype_bit(dtype::f16) | dtype_bit(dtype::bf16);
constexpr unsigned kAllFloats = kHostFloats | dtype_bit(dtype::f64);

/// What a SIMD target needs, in the words `dfss info` and the selector's messages use.
constexpr const char* needs_of(cpu::simd_target t) noexcept {
  switch (t) {
    case cpu::simd_target::sse4: return "SSE4.2";
    case cpu::simd_target::avx2: return "AVX2, FMA, F16C";
    case cpu::simd_target::avx3: return "AVX-512 F/BW/DQ/VL";
    case cpu::simd_target::neon: return "NEON";
    case cpu::simd_target::sve: return "SVE";
    case cpu::simd_target::sve2: return "SVE2";
    case cpu::simd_target::avx3_bf16: return "AVX-512 F/BW/DQ/VL, AVX512_BF16";
  }
  return "";
}

/// cpu_lacks of a SIMD target's kernels: Highway's run-time check (hwy::SupportedTargets), which
/// also knows whether this build compiled the target at all.
template <cpu::simd_target T>
const char* simd_lacks(dtype) noexcept {
  return cpu::simd_target_supported(T) ? nullptr : needs_of(T);
}

/// The automatic rule of SIMD target @p T (kernel_entry::automatic_when): cpu::simd_target_preferred.
template <cpu::simd_target T>
bool simd_preferred() noexcept {
  return cpu::simd_target_preferred(T);
}

template <cpu::simd_target T>
status simd_forward(const attention_params& p) noexcept {
  return cpu::fused_forward_simd(p, T);
}

template <cpu::simd_target T>
status simd_decode(const attention_params& p) noexcept {
  return cpu::decode_forward_simd(p, T);
}

template <cpu::simd_target T>
status simd_backward(const attention_params& p) noexcept {
  return cpu::fused_backward_simd(p, T);
}

/// The decode forward of SIMD target @p T (few query rows: cpu::decode_forward_applies), before the
/// target's fused forward so that it wins where it applies.
#define DFSS_DECODE_ROW(T, ISA, NAME, KIND, AUTOMATIC)                                                       \
  {.kind = kernel_kind::KIND, .name = "cpu.decode_forward." NAME, .backend = backend::cpu,                    \
   .dir = direction::forward, .isa = cpu_isa::ISA, .isa_name = NAME, .automatic = AUTOMATIC,                  \
   .automatic_when = simd_preferred<T>, .applies = cpu::decode_forward_applies, .dtypes = kHostFloats,         \
   .needs = needs_of(T), .cpu_lacks = simd_lacks<T>, .run = simd_decode<T>}

/// The rows of SIMD target @p T: forward and backward under their own cpu_isa value, in the
/// automatic preference order of the table; the backward consumes the O and LSE of forward PAIRED
/// (FWD itself, except for avx3_bf16, see there).
#define DFSS_SIMD_ROWS(T, ISA, NAME, FWD, BWD) DFSS_SIMD_ROWS_PAIRED(T, ISA, NAME, FWD, BWD, FWD)
#define DFSS_SIMD_ROWS_PAIRED(T, ISA, NAME, FWD, BWD, PAIRED)                                                \
  {.kind = kernel_kind::FWD, .name = "cpu.fused_forward." NAME, .backend = backend::cpu,                      \
   .dir = direction::forward, .isa = cpu_isa::ISA, .isa_name = NAME, .automatic = true,                       \
   .automatic_when = simd_preferred<T>, .dtypes = kHostFloats, .needs = needs_of(T),                           \
   .cpu_lacks = simd_lacks<T>, .run = simd_forward<T>},                                                        \
  {.kind = kernel_kind::BWD, .name = "cpu.fused_backward." NAME, .backend = backend::cpu,                     \
   .dir = direction::backward, .isa = cpu_isa::ISA, .isa_name = NAME, .automatic = true,                      \
   .automatic_when = simd_preferred<T>, .dtypes = kHostFloats, .needs = needs_of(T),                           \
   .cpu_lacks = simd_lacks<T>, .run = simd_backward<T>,                                                        \
   .forward = kernel_kind::PAIRED}

// cpu_isa::portable: the baseline SIMD target of the architecture, under its own kernel names.
#if defined(__aarch64__)
constexpr cpu::simd_target kBaseline = cpu::simd_target::neon;
#else
constexpr cpu::simd_target kBaseline = cpu::simd_target::sse4;
#endif

const kernel_entry kKernels[] = {
    // The fp64 oracle: every call that passes validation.
    {.kind = kernel_kind::reference_forward, .name = "reference.forward", .backend = backend::reference,
     .dir = direction::forward, .dtypes = kAllFloats, .run = ref::reference_forward},
    {.kind = kernel_kind::reference_backward, .name = "reference.backward", .backend = backend::reference,
     .dir = direction::backward, .dtypes = kAllFloats, .run = ref::reference_backward},

    // CPU, the SIMD family best target first: cpu_isa::automatic takes the first runnable row
    // marked automatic, so the order is the preference. Each backward runs after (or with the O and
    // LSE of) the forward of its target.
#if defined(__x86_64__)
    // avx3_bf16 first: for bf16 inputs its forward runs Q K^T and P V as bf16 dot products (about
    // 1.5x the avx3 rate on Zen 4 and Zen 5, docs/benchmarks.md; automatic only where they are
    // fast, core::cpu_has_fast_bf16_dot); f32 and f16 inputs run the avx3 code itself. Its
    // backward is the avx3 backward; when the caller gives no O and LSE it gets them from the avx3
    // forward, whose scores and selection are the avx3_bf16 forward's bit for bit (bf16_dot.hpp)
    // but whose P is not rounded to bf16, so the gradients are the avx3 ones. Its decode forward is
    // the avx3 one (a decode step reads the cache once: it is bound by memory, not by products).
#if defined(DFSS_HAVE_BF16_DOT)
    DFSS_DECODE_ROW(cpu::simd_target::avx3_bf16, avx3_bf16, "avx3_bf16", cpu_decode_forward_avx3_bf16, true),
    DFSS_SIMD_ROWS_PAIRED(cpu::simd_target::avx3_bf16, avx3_bf16, "avx3_bf16", cpu_fused_forward_avx3_bf16,
                          cpu_fused_backward_avx3_bf16, cpu_fused_forward_avx3),
#endif
    DFSS_DECODE_ROW(cpu::simd_target::avx3, avx3, "avx3", cpu_decode_forward_avx3, true),
    DFSS_SIMD_ROWS(cpu::simd_target::avx3, avx3, "avx3", cpu_fused_forward_avx3, cpu_fused_backward_avx3),
    DFSS_DECODE_ROW(cpu::simd_target::avx2, avx2, "avx2", cpu_decode_forward_avx2, true),
    DFSS_SIMD_ROWS(cpu::simd_target::avx2, avx2, "avx2", cpu_fused_forward_avx2, cpu_fused_backward_avx2),
    DFSS_DECODE_ROW(cpu::simd_target::sse4, sse4, "sse4", cpu_decode_forward_sse4, true),
    DFSS_SIMD_ROWS(cpu::simd_target::sse4, sse4, "sse4", cpu_fused_forward_sse4, cpu_fused_backward_sse4),
#elif defined(__aarch64__)
    DFSS_DECODE_ROW(cpu::simd_target::sve2, sve2, "sve2", cpu_decode_forward_sve2, true),
    DFSS_SIMD_ROWS(cpu::simd_target::sve2, sve2, "sve2", cpu_fused_forward_sve2, cpu_fused_backward_sve2),
    DFSS_DECODE_ROW(cpu::simd_target::sve, sve, "sve", cpu_decode_forward_sve, true),
    DFSS_SIMD_ROWS(cpu::simd_target::sve, sve, "sve", cpu_fused_forward_sve, cpu_fused_backward_sve),
    DFSS_DECODE_ROW(cpu::simd_target::neon, neon, "neon", cpu_decode_forward_neon, true),
    DFSS_SIMD_ROWS(cpu::simd_target::neon, neon, "neon", cpu_fused_forward_neon, cpu_fused_backward_neon),
#endif
    DFSS_DECODE_ROW(kBaseline, portable, "portable", cpu_decode_forward_portable, false),
    {.kind = kernel_kind::cpu_fused_forward_portable, .name = "cpu.fused_forward.portable", .backend = backend::cpu,
     .dir = direction::forward, .isa = cpu_isa::portable, .isa_name = "portable", .dtypes = kHostFloats,
     .needs = needs_of(kBaseline), .cpu_lacks = simd_lacks<kBaseline>, .run = simd_forward<kBaseline>},
    {.kind = kernel_kind::cpu_fused_backward_portable, .name = "cpu.fused_backward.portable", .backend = backend::cpu,
     .dir = direction::backward, .isa = cpu_isa::portable, .isa_name = "portable", .dtypes = kHostFloats,
     .needs = needs_of(kBaseline), .cpu_lacks = simd_lacks<kBaseline>, .run = simd_backward<kBaseline>,
     .forward = kernel_kind::cpu_fused_forward_portable},

    // CPU, the scalar twins (cpu_isa::generic; automatic only where no SIMD target runs) and the
    // three-stage pipeline (every cpu_isa).
    {.kind = kernel_kind::cpu_fused_forward_scalar, .name = "cpu.fused_forward.scalar", .backend = backend::cpu,
     .dir = direction::forward, .isa = cpu_isa::generic, .isa_name = "generic", .automatic = true,
     .dtypes = kHostFloats, .run = cpu::fused_forward_scalar},
    {.kind = kernel_kind::cpu_fused_backward_scalar, .name = "cpu.fused_backward.scalar", .backend = backend::cpu,
     .dir = direction::backward, .isa = cpu_isa::generic, .isa_name = "generic", .automatic = true,
     .dtypes = kHostFloats, .run = cpu::fused_backward_scalar, .forward = kernel_kind::cpu_fused_forward_scalar},
    {.kind = kernel_kind::cpu_three_stage_forward, .name = "cpu.three_stage_forward.generic", .backend = backend::cpu,
     .dir = direction::forward, .algorithm = cpu_algorithm::three_stage, .isa = cpu_isa::generic,
     .isa_name = "generic", .every_isa = true, .automatic = true, .dtypes = kHostFloats,
     .run = cpu::three_stage_forward, .writes_compressed = true},

#if defined(DFSS_WITH_CUDA_BACKEND)
    // CUDA forward: f16 and bf16, d 64 and 128, patterns 1:2 and 2:4 (its own rules, with messages).
    {.kind = kernel_kind::cuda_three_stage_forward, .name = "cuda.three_stage_forward", .backend = backend::cuda,
     .dir = direction::forward, .dtypes = dtype_bit(dtype::f16) | dtype_bit(dtype::bf16),
     .needs = "an sm_80 or newer GPU", .run_on_stream = cuda::attention_forward,
     .unsupported_reason = cuda::forward_unsupported_reason, .instance_name = cuda::forward_kernel_name},
#endif
};

#undef DFSS_SIMD_ROWS
#undef DFSS_DECODE_ROW
#undef DFSS_SIMD_ROWS_PAIRED

}  // namespace

std::span<const kernel_entry> kernel_registry() noexcept { return {std::begin(kKernels), std::end(kKernels)}; }

const kernel_entry* find_kernel(kernel_kind kind) noexcept {
  for (const kernel_entry& e : kKernels) {
    if (e.kind == kind) return &e;
  }
  return nullptr;
}

}  // namespace dfss::core
