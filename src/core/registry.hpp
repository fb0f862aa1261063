// The kernel registry: one table of every attention kernel this build contains, what each takes and
// needs, and how to call it. The selector (core/select.cpp) chooses a row of it, the API
// (core/api.cpp) calls the chosen row's function, and `dfss info` lists it
// (dfss::get_build_info().kernels). registry.cpp is the only file of src/core/ that includes the
// backend folders (ref/, cpu/, cuda/).
//
// Adding a kernel: a kernel_kind value (include/dfss/attention.hpp), then one row in registry.cpp's
// table. For a CPU kernel the row names its direction, algorithm and the cpu_isa value that
// requests it, whether cpu_isa::automatic may pick it (rows earlier in the table win), and what the
// CPU must have (cpu_lacks); the selector needs no new case.
#pragma once

#include <span>
#include <string>

#include "dfss/attention.hpp"
#include "dfss/error.hpp"
#include "dfss/params.hpp"

namespace dfss::core {

enum class direction { forward, backward };

/// A host kernel: reads only @p p, returns a status, never throws.
using host_kernel_fn = status (*)(const attention_params& p) noexcept;
/// A device kernel: enqueues on @p stream (a cudaStream_t), returns without synchronising.
using stream_kernel_fn = status (*)(const attention_params& p, void* stream);

/// @brief Bit of @p t in kernel_entry::dtypes.
constexpr unsigned dtype_bit(dtype t) noexcept { return 1u << static_cast<unsigned>(t); }

/// @brief One row of the registry.
struct kernel_entry {
  kernel_kind kind = kernel_kind::none;
  /// Stable name (kernel_selection::name), e.g. "cpu.fused_forward.avx2". For a family with
  /// compile-time instances (CUDA) the family's name; instance_name names the instance.
  const char* name = "";
  dfss::backend backend = dfss::backend::reference;
  direction dir = direction::forward;
  /// CPU only: the algorithm (attention_config::cpu_algorithm) it implements.
  dfss::cpu_algorithm algorithm = dfss::cpu_algorithm::fused;
  /// CPU only: the cpu_isa value that requests it, and its spelling in messages and `dfss info`.
  dfss::cpu_isa isa = dfss::cpu_isa::generic;
  const char* isa_name = "";
  /// CPU only: the algorithm's one kernel, run for every cpu_isa value (the three-stage pipeline).
  bool every_isa = false;
  /// CPU only: a candidate of cpu_isa::automatic; the first runnable candidate in table order runs.
  bool automatic = false;
  /// CPU only: a candidate of cpu_isa::automatic only where this holds on this CPU (null: always),
  /// for a target that runs but is not the fastest there (avx3_bf16 where bf16 dot products are
  /// slow: core::cpu_has_fast_bf16_dot). A request by name still gets it.
  bool (*automatic_when)() noexcept = nullptr;
  /// Only for the shapes where applies(p) holds (null: every shape), a rule of the shape alone: the
  /// decode kernels, for few query rows. The selector skips a row whose rule does not hold.
  bool (*applies)(const attention_params& p) noexcept = nullptr;
  /// Input types it takes (dtype_bit of each).
  unsigned dtypes = 0;
  /// What the machine must have, for `dfss info` ("" when nothing), e.g. "AVX2, FMA (F16C for f16)".
  const char* needs = "";
  /// What this CPU (or this build) lacks to run the kernel on @p input, e.g. "AVX2, FMA", or
  /// nullptr when it can run it. Null: runs on every CPU.
  const char* (*cpu_lacks)(dtype input) noexcept = nullptr;
  /// The kernel (host backends), or null.
  host_kernel_fn run = nullptr;
  /// The kernel (CUDA: needs attention_config::cuda_stream), or null.
  stream_kernel_fn run_on_stream = nullptr;
  /// CPU backward only: the forward of the same instruction set, whose O and LSE it consumes
  /// (the API runs it first when the caller gave neither), so that it keeps that forward's keys.
  kernel_kind forward = kernel_kind::none;
  /// Whether it fills the optional compressed outputs (forward_args::compressed_*).
  bool writes_compressed = false;
  /// Families with their own support rules (CUDA): why @p p cannot run ("" when it can).
  std::string (*unsupported_reason)(const attention_params& p) = nullptr;
  /// Families with compile-time instances (CUDA): the stable name of the instance that runs @p p.
  std::string (*instance_name)(const attention_params& p) = nullptr;

  bool takes(dtype t) const noexcept { return (dtypes & dtype_bit(t)) != 0; }
};

/// @brief Every kernel of this build, in order of preference within a (backend, direction).
std::span<const kernel_entry> kernel_registry() noexcept;

/// @brief The row of @p kind, or nullptr when this build has no such kernel.
const kernel_entry* find_kernel(kernel_kind kind) noexcept;

}  // namespace dfss::core
