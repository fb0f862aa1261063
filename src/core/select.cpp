// Kernel selection rules over the kernel registry (core/registry.hpp). Order of preference for
// backend::automatic: cpu (when it supports the call), then the fp64 reference, which supports
// everything that passes validation. Within the cpu backend, cpu_isa::automatic takes the first
// registered kernel marked automatic that this CPU can run.
#include "core/select.hpp"

#include <string>

#include "core/device_memory.hpp"
#include "core/registry.hpp"

namespace dfss::core {
namespace {

kernel_selection make(const kernel_entry& e) {
  kernel_selection s;
  s.kind = e.kind;
  s.backend = e.backend;
  s.name = e.name;
  return s;
}

kernel_selection reject(backend b, std::string reason) {
  kernel_selection s;
  s.backend = b;
  s.reason = std::move(reason);
  return s;
}

/// The first registered kernel of backend @p b and direction @p dir for which @p match holds.
template <typename Match>
const kernel_entry* first(backend b, direction dir, Match&& match) {
  for (const kernel_entry& e : kernel_registry()) {
    if (e.backend == b && e.dir == dir && match(e)) return &e;
  }
  return nullptr;
}

kernel_selection select_reference(direction dir) {
  const kernel_entry* e = first(backend::reference, dir, [](const kernel_entry&) { return true; });
  return e != nullptr ? make(*e) : reject(backend::reference, "this build of dfss has no reference kernel");
}

/// The CPU kernel for the requested algorithm and instruction set. The backward runs on the
/// instruction set the forward would (it recomputes that forward's exact selection): generic ->
/// the scalar twin, a SIMD target (avx3, avx2, sse4, neon, ...) or portable (the baseline target)
/// -> the SIMD family on it when the CPU has it, automatic -> the best target this CPU runs, else
/// the scalar twin; the backward is fused whichever algorithm the forward used. An
/// algorithm with one kernel for every instruction set (the three-stage pipeline) ignores cpu_isa.
kernel_selection select_cpu(const attention_params& p, const attention_config& c, direction dir) {
  const dtype t = p.input_type;
  if (first(backend::cpu, dir, [t](const kernel_entry& e) { return e.takes(t); }) == nullptr) {
    return reject(backend::cpu, std::string("the cpu backend takes f32, f16 and bf16 inputs, got ") + dtype_name(t) +
                                    "; use backend reference");
  }
  const cpu_algorithm algorithm = dir == direction::backward ? cpu_algorithm::fused : c.cpu_algorithm;
  const auto of_algorithm = [&](const kernel_entry& e) {
    return e.algorithm == algorithm && e.takes(t) && (e.applies == nullptr || e.applies(p));
  };
  if (const kernel_entry* e = first(backend::cpu, dir, [&](const kernel_entry& x) { return of_algorithm(x) && x.every_isa; })) {
    return make(*e);
  }
  if (c.cpu_isa == cpu_isa::automatic) {
    const kernel_entry* e = first(backend::cpu, dir, [&](const kernel_entry& x) {
      return of_algorithm(x) && x.automatic && (x.automatic_when == nullptr || x.automatic_when()) &&
             (x.cpu_lacks == nullptr || x.cpu_lacks(t) == nullptr);
    });
    if (e != nullptr) return make(*e);
    return reject(backend::cpu, "no cpu kernel of this build runs on this CPU");
  }
  const kernel_entry* e = first(backend::cpu, dir, [&](const kernel_entry& x) { return of_algorithm(x) && x.isa == c.cpu_isa; });
  if (e == nullptr) {
    const std::string name = cpu_isa_name(c.cpu_isa);
    if (name == "unknown") {
      return reject(backend::cpu, "unknown cpu_isa value " + std::to_string(static_cast<int>(c.cpu_isa)));
    }
    return reject(backend::cpu, "cpu_isa " + name + " was requested but this build did not compile it (it is "
                                    "another architecture's instruction set)");
  }
  if (const char* lacks = e->cpu_lacks != nullptr ? e->cpu_lacks(t) : nullptr) {
    return reject(backend::cpu, std::string("cpu_isa ") + e->isa_name + " was requested but this CPU lacks " + lacks);
  }
  return make(*e);
}

kernel_selection select_cuda(const attention_params& p, direction dir) {
  const auto any = [](const kernel_entry&) { return true; };
  if (first(backend::cuda, direction::forward, any) == nullptr && first(backend::cuda, direction::backward, any) == nullptr) {
    return reject(backend::cuda, "this build of dfss has no CUDA attention kernels");
  }
  const kernel_entry* e = first(backend::cuda, dir, any);
  if (e == nullptr) {
    return reject(backend::cuda, dir == direction::backward
                                     ? "the CUDA backend has no backward kernels yet; use backend cpu or reference"
                                     : "the CUDA backend has no forward kernels");
  }
  if (p.sink_tokens > 0 || p.recent_tokens > 0) {
    return reject(backend::cuda, "the CUDA backend does not take sink_tokens or recent_tokens (its compressed N-of-M "
                                 "format cannot hold a group kept whole); use backend cpu");
  }
  if (p.key_offset != 0 || p.query_offset != nullptr) {
    return reject(backend::cuda, "the CUDA backend does not take key_offset or query_offset yet; use backend cpu");
  }
  const std::string why = e->unsupported_reason != nullptr ? e->unsupported_reason(p) : std::string();
  if (!why.empty()) return reject(backend::cuda, why);
  kernel_selection s = make(*e);
  if (e->instance_name != nullptr) s.name = e->instance_name(p);
  return s;
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
