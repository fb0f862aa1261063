// The table of kernels (see registry.hpp). The only file of src/core/ that includes the backends.
#include "core/registry.hpp"

#include <iterator>

#include "core/cpu_features.hpp"
#include "cpu/fused_forward.hpp"
#include "cpu/scalar/attention.hpp"
#include "cpu/three_stage/attention.hpp"
#include "ref/reference.hpp"
#if defined(DFSS_WITH_CUDA_BACKEND)
#include "cuda/attention_cuda.hpp"
#endif

namespace dfss::core {
namespace {

constexpr unsigned kHostFloats = dtype_bit(dtype::f32) | dtype_bit(dtype::f16) | dtype_bit(dtype::bf16);
constexpr unsigned kAllFloats = kHostFloats | dtype_bit(dtype::f64);

/// The AVX2 kernels (cpu/fused_forward_avx2.cpp) are compiled by GCC only: in a build without them
/// (clang) the CPU is reported as lacking AVX2, so the selector never picks a kernel the build lacks.
const char* avx2_lacks(dtype input) noexcept {
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
  const bool base = cpu_has(cpu_feature::avx2) && cpu_has(cpu_feature::fma);
  if (base && (input != dtype::f16 || cpu_has(cpu_feature::f16c))) return nullptr;
#endif
  return input == dtype::f16 ? "AVX2, FMA or F16C" : "AVX2, FMA";
}

constexpr const char* kAvx2Needs = "AVX2, FMA (F16C for f16)";

const kernel_entry kKernels[] = {
    // The fp64 oracle: every call that passes validation.
    {.kind = kernel_kind::reference_forward, .name = "reference.forward", .backend = backend::reference,
     .dir = direction::forward, .dtypes = kAllFloats, .run = ref::reference_forward},
    {.kind = kernel_kind::reference_backward, .name = "reference.backward", .backend = backend::reference,
     .dir = direction::backward, .dtypes = kAllFloats, .run = ref::reference_backward},

    // CPU forward. cpu_isa::automatic takes the first runnable row marked automatic.
    {.kind = kernel_kind::cpu_fused_forward_avx2, .name = "cpu.fused_forward.avx2", .backend = backend::cpu,
     .dir = direction::forward, .isa = cpu_isa::avx2, .isa_name = "avx2", .automatic = true,
     .dtypes = kHostFloats, .needs = kAvx2Needs, .cpu_lacks = avx2_lacks, .run = cpu::fused_forward_avx2},
    {.kind = kernel_kind::cpu_fused_forward_portable, .name = "cpu.fused_forward.portable", .backend = backend::cpu,
     .dir = direction::forward, .isa = cpu_isa::portable, .isa_name = "portable", .automatic = true,
     .dtypes = kHostFloats, .run = cpu::fused_forward_portable},
    {.kind = kernel_kind::cpu_fused_forward_scalar, .name = "cpu.fused_forward.scalar", .backend = backend::cpu,
     .dir = direction::forward, .isa = cpu_isa::generic, .isa_name = "generic", .dtypes = kHostFloats,
     .run = cpu::fused_forward_scalar},
    {.kind = kernel_kind::cpu_three_stage_forward, .name = "cpu.three_stage_forward.generic", .backend = backend::cpu,
     .dir = direction::forward, .algorithm = cpu_algorithm::three_stage, .isa = cpu_isa::generic,
     .isa_name = "generic", .every_isa = true, .automatic = true, .dtypes = kHostFloats,
     .run = cpu::three_stage_forward, .writes_compressed = true},

    // CPU backward: each runs after (or with the O and LSE of) the forward of its instruction set.
    {.kind = kernel_kind::cpu_fused_backward_avx2, .name = "cpu.fused_backward.avx2", .backend = backend::cpu,
     .dir = direction::backward, .isa = cpu_isa::avx2, .isa_name = "avx2", .automatic = true,
     .dtypes = kHostFloats, .needs = kAvx2Needs, .cpu_lacks = avx2_lacks, .run = cpu::fused_backward_avx2,
     .forward = kernel_kind::cpu_fused_forward_avx2},
    {.kind = kernel_kind::cpu_fused_backward_portable, .name = "cpu.fused_backward.portable", .backend = backend::cpu,
     .dir = direction::backward, .isa = cpu_isa::portable, .isa_name = "portable", .automatic = true,
     .dtypes = kHostFloats, .run = cpu::fused_backward_portable, .forward = kernel_kind::cpu_fused_forward_portable},
    {.kind = kernel_kind::cpu_fused_backward_scalar, .name = "cpu.fused_backward.scalar", .backend = backend::cpu,
     .dir = direction::backward, .isa = cpu_isa::generic, .isa_name = "generic", .dtypes = kHostFloats,
     .run = cpu::fused_backward_scalar, .forward = kernel_kind::cpu_fused_forward_scalar},

#if defined(DFSS_WITH_CUDA_BACKEND)
    // CUDA forward: f16 and bf16, d 64 and 128, patterns 1:2 and 2:4 (its own rules, with messages).
    {.kind = kernel_kind::cuda_three_stage_forward, .name = "cuda.three_stage_forward", .backend = backend::cuda,
     .dir = direction::forward, .dtypes = dtype_bit(dtype::f16) | dtype_bit(dtype::bf16),
     .needs = "an sm_80 or newer GPU", .run_on_stream = cuda::attention_forward,
     .unsupported_reason = cuda::forward_unsupported_reason, .instance_name = cuda::forward_kernel_name},
#endif
};

}  // namespace

std::span<const kernel_entry> kernel_registry() noexcept { return {std::begin(kKernels), std::end(kKernels)}; }

const kernel_entry* find_kernel(kernel_kind kind) noexcept {
  for (const kernel_entry& e : kKernels) {
    if (e.kind == kind) return &e;
  }
  return nullptr;
}

}  // namespace dfss::core
