// Kernel selection rules. Order of preference for backend::automatic: cpu (when it supports the call),
// then the fp64 reference, which supports everything that passes validation.
#include "core/select.hpp"

#include <algorithm>
#include <optional>
#include <string>

#include "core/device_memory.hpp"
#include "cpu/simd/targets.hpp"
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

/// The CPU kernel for @p c.cpu_isa: generic -> the scalar twin; every other value -> the SIMD kernel
/// family on the Highway target it names (cpu/simd/targets.hpp: portable is the baseline target,
/// automatic the best this CPU runs). The names keep the values scripts know: avx2 and portable run
/// as "cpu.fused_forward.avx2" / ".portable", any other target as ".<target>" (e.g. ".avx3"). The
/// backward runs on the target the forward would (it recomputes that forward's exact selection).
kernel_selection select_cpu_fused(const attention_params& p, const attention_config& c, direction dir) {
  const bool fwd = dir == direction::forward;
  if (c.cpu_isa == cpu_isa::generic) {
    return fwd ? make(kernel_kind::cpu_fused_forward_scalar, backend::cpu, "cpu.fused_forward.scalar")
               : make(kernel_kind::cpu_fused_backward_scalar, backend::cpu, "cpu.fused_backward.scalar");
  }
  const std::optional<cpu::simd_target> t = cpu::simd_target_of(c.cpu_isa);
  if (!t) {
    if (c.cpu_isa == cpu_isa::automatic) {
      return fwd ? make(kernel_kind::cpu_fused_forward_scalar, backend::cpu, "cpu.fused_forward.scalar")
                 : make(kernel_kind::cpu_fused_backward_scalar, backend::cpu, "cpu.fused_backward.scalar");
    }
    return reject(backend::cpu, "unknown cpu_isa value " + std::to_string(static_cast<int>(c.cpu_isa)));
  }
  if (!cpu::simd_target_supported(*t)) {
    const auto compiled = cpu::compiled_simd_targets();
    const bool built = std::find(compiled.begin(), compiled.end(), *t) != compiled.end();
    return reject(backend::cpu, std::string("cpu_isa ") + cpu_isa_name(c.cpu_isa) + " (SIMD target " +
                                    cpu::simd_target_name(*t) + ") was requested but " +
                                    (built ? "this CPU lacks it" : "this build did not compile it"));
  }
  const std::string suffix = c.cpu_isa == cpu_isa::portable ? "portable" : cpu::simd_target_name(*t);
  kernel_kind kind = fwd ? kernel_kind::cpu_fused_forward_simd : kernel_kind::cpu_fused_backward_simd;
  if (suffix == "avx2") kind = fwd ? kernel_kind::cpu_fused_forward_avx2 : kernel_kind::cpu_fused_backward_avx2;
  if (suffix == "portable") kind = fwd ? kernel_kind::cpu_fused_forward_portable : kernel_kind::cpu_fused_backward_portable;
  kernel_selection s = make(kind, backend::cpu, "");
  s.name = std::string(fwd ? "cpu.fused_forward." : "cpu.fused_backward.") + suffix;
  (void)p;
  return s;
}

kernel_selection select_cpu(const attention_params& p, const attention_config& c, direction dir) {
  if (p.input_type == dtype::f64) {
    return reject(backend::cpu,
                  "the cpu backend takes f32, f16 and bf16 inputs, got f64; use backend reference");
  }
  if (dir == direction::forward && c.cpu_algorithm == cpu_algorithm::three_stage) {
    return make(kernel_kind::cpu_three_stage_forward, backend::cpu, "cpu.three_stage_forward.generic");
  }
  return select_cpu_fused(p, c, dir);
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
