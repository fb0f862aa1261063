// Kernel selection rules. Order of preference for backend::automatic: cpu (when it supports the call),
// then the fp64 reference, which supports everything that passes validation.
#include "core/select.hpp"

#include <string>

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

kernel_selection select_cpu(const attention_params& p, direction dir) {
  if (dir == direction::backward) {
    return reject(backend::cpu, "the cpu backend has no backward pass yet; use backend reference");
  }
  if (p.input_type == dtype::f64) {
    return reject(backend::cpu,
                  "the cpu backend takes f32, f16 and bf16 inputs, got f64; use backend reference");
  }
  return make(kernel_kind::cpu_fused_forward_scalar, backend::cpu, "cpu.fused_forward.scalar");
}

}  // namespace

kernel_selection select(const attention_params& p, backend requested, direction dir) {
  switch (requested) {
    case backend::reference: return select_reference(dir);
    case backend::cpu: return select_cpu(p, dir);
    case backend::cuda:
      return reject(backend::cuda, "this build of dfss has no CUDA attention kernels");
    case backend::automatic: {
      kernel_selection s = select_cpu(p, dir);
      return s.supported() ? s : select_reference(dir);
    }
  }
  return reject(requested, "unknown backend value " + std::to_string(static_cast<int>(requested)));
}

}  // namespace dfss::core
