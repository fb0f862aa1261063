// Kernel selection rules. Order of preference for backend::automatic: cpu (when it supports the call),
// then the fp64 reference, which supports everything that passes validation.
#include "core/select.hpp"

#include <string>

#include "core/device_memory.hpp"
#include "core/cpu_features.hpp"
#if defined(DFSS_WITH_CUDA_BACKEND)
#include "cuda/attention_cuda.hpp"
#endif

namespace dfss::core {
namespace {

kernel_selection make(kernel_kind kind, backend b, const char* name) {
  kernel_selection s;
  s.kind = kind;
  s.backend = b;
  s.name = name;
  return s;
}

kernel_selection reject(backend b, std::string reason) {
  kernel_selection s;
  s.backend = b;
  s.reason = std::move(reason);
  return s;
}

kernel_selection select_reference(direction dir) {
  return dir == direction::forward
             ? make(kernel_kind::reference_forward, backend::reference, "reference.forward")
             : make(kernel_kind::reference_backward, backend::reference, "reference.backward");
}

/// The backward runs on the instruction set the forward would (its twin recomputes that forward's
/// exact selection): generic -> scalar, portable -> portable, avx2 -> avx2 (when the CPU has it),
/// automatic -> avx2 when the CPU has it, else portable. All three write dbias with broadcast
/// dimensions.
kernel_selection select_cpu_backward(const attention_params& p, const attention_config& c, bool avx2_ok) {
  const auto avx2 = make(kernel_kind::cpu_fused_backward_avx2, backend::cpu, "cpu.fused_backward.avx2");
  const auto portable = make(kernel_kind::cpu_fused_backward_portable, backend::cpu, "cpu.fused_backward.portable");
  switch (c.cpu_isa) {
    case cpu_isa::generic:
      return make(kernel_kind::cpu_fused_backward_scalar, backend::cpu, "cpu.fused_backward.scalar");
    case cpu_isa::portable:
      return portable;
    case cpu_isa::avx2:
      if (!avx2_ok) {
        return reject(backend::cpu, "cpu_isa avx2 was requested but this CPU lacks AVX2, FMA" +
                                        std::string(p.input_type == dtype::f16 ? " or F16C" : ""));
      }
      return avx2;
    case cpu_isa::automatic:
      return avx2_ok ? avx2 : portable;
  }
  return reject(backend::cpu, "unknown cpu_isa value " + std::to_string(static_cast<int>(c.cpu_isa)));
}

/// The AVX2 kernels (cpu/fused_forward_avx2.cpp) are compiled by GCC only: a build without them
/// (clang) reports that the CPU cannot run them, so the selector never picks a kernel the build lacks.
bool avx2_kernels_run(dtype input) {
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
  return cpu_has(cpu_feature::avx2) && cpu_has(cpu_feature::fma) && (input != dtype::f16 || cpu_has(cpu_feature::f16c));
#else
  (void)input;
  return false;
#endif
}

kernel_selection select_cpu(const attention_params& p, const attention_config& c, direction dir) {
  if (p.input_type == dtype::f64) {
    return reject(backend::cpu,
                  "the cpu backend takes f32, f16 and bf16 inputs, got f64; use backend reference");
  }
  const bool avx2_ok = avx2_kernels_run(p.input_type);
  if (dir == direction::backward) return select_cpu_backward(p, c, avx2_ok);
  if (c.cpu_algorithm == cpu_algorithm::three_stage) {
    return make(kernel_kind::cpu_three_stage_forward, backend::cpu, "cpu.three_stage_forward.generic");
  }
  switch (c.cpu_isa) {
    case cpu_isa::generic:
      return make(kernel_kind::cpu_fused_forward_scalar, backend::cpu, "cpu.fused_forward.scalar");
    case cpu_isa::avx2:
      if (!avx2_ok) {
        return reject(backend::cpu, "cpu_isa avx2 was requested but this CPU lacks AVX2, FMA" +
                                        std::string(p.input_type == dtype::f16 ? " or F16C" : ""));
      }
      return make(kernel_kind::cpu_fused_forward_avx2, backend::cpu, "cpu.fused_forward.avx2");
    case cpu_isa::portable:
      return make(kernel_kind::cpu_fused_forward_portable, backend::cpu, "cpu.fused_forward.portable");
    case cpu_isa::automatic:
      return avx2_ok ? make(kernel_kind::cpu_fused_forward_avx2, backend::cpu, "cpu.fused_forward.avx2")
                     : make(kernel_kind::cpu_fused_forward_portable, backend::cpu, "cpu.fused_forward.portable");
  }
  return reject(backend::cpu, "unknown cpu_isa value " + std::to_string(static_cast<int>(c.cpu_isa)));
}

kernel_selection select_cuda(const attention_params& p, direction dir) {
#if defined(DFSS_WITH_CUDA_BACKEND)
  if (dir == direction::backward) {
    return reject(backend::cuda, "the CUDA backend has no backward kernels yet; use backend cpu or reference");
  }
  const std::string why = cuda::forward_unsupported_reason(p);
  if (!why.empty()) return reject(backend::cuda, why);
  kernel_selection s = make(kernel_kind::cuda_three_stage_forward, backend::cuda, "");
  s.name = cuda::forward_kernel_name(p);
  return s;
#else
  (void)p;
  (void)dir;
  return reject(backend::cuda, "this build of dfss has no CUDA attention kernels");
#endif
}

}  // namespace

kernel_selection select(const attention_params& p, const attention_config& config, direction dir) {
  // Host backends would dereference device memory: automatic sends such calls to the CUDA
  // backend, an explicit host backend refuses them (the cuda backend checks its own pointers).
  const char* on_device = config.backend == backend::cuda ? nullptr : first_device_argument(p);
  if (on_device != nullptr && config.backend != backend::automatic) {
    return reject(config.backend, std::string("argument '") + on_device +
                                      "' is CUDA device memory, but this backend reads host memory; use "
                                      "backend cuda (or automatic)");
  }
  switch (config.backend) {
    case backend::reference: return select_reference(dir);
    case backend::cpu: return select_cpu(p, config, dir);
    case backend::cuda: return select_cuda(p, dir);
    case backend::automatic: {
      if (on_device != nullptr) {
        kernel_selection s = select_cuda(p, dir);
        if (!s.supported()) {
          s.reason = std::string("argument '") + on_device + "' is CUDA device memory, so only the cuda backend " +
                     "can run this call, and it cannot: " + s.reason;
        }
        return s;
      }
      kernel_selection s = select_cpu(p, config, dir);
      return s.supported() ? s : select_reference(dir);
    }
  }
  return reject(config.backend, "unknown backend value " + std::to_string(static_cast<int>(config.backend)));
}

}  // namespace dfss::core
