// dfss/attention.hpp: batched multi-head attention with dynamic N:M (DFSS) pruning.
//
// The function is fixed by docs/semantics.md: S = Q K^T (+ bias, masks), in every aligned group of M
// keys keep the N largest signed scores (ties to the lower key index), softmax(scale * S_kept), P V.
// Layout: Q [B, Lq, H, d], K and V [B, Lk, Hkv, d] with any element strides (so both [B, L, H, d]
// and [B, H, L, d] memory work without copies); H must be a multiple of Hkv.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "dfss/error.hpp"
#include "dfss/params.hpp"
#include "dfss/tensor.hpp"
#include "dfss/types.hpp"

namespace dfss {

/// @brief How the CPU backend computes the forward pass.
enum class cpu_algorithm : int {
  fused,        ///< single pass, flash style: online softmax over kept scores, no L x L buffer
  three_stage,  ///< the paper's pipeline: Q K^T with fused selection -> compressed softmax -> SpMM
};

/// @brief Instruction set of the CPU kernels. Every value but generic names a Google Highway target
/// of the one SIMD kernel family (src/cpu/simd/); automatic picks the best one this CPU runs.
enum class cpu_isa : int {
  automatic,
  generic,   ///< portable scalar C++ (the twin every SIMD kernel is tested against)
  avx2,      ///< x86-64 AVX2 + FMA + F16C (Highway's AVX2 target)
  portable,  ///< the baseline SIMD target: sse4 on x86-64, neon on AArch64
  sse4,      ///< x86-64 SSE4.2 (Highway's SSE4 target)
  avx3,      ///< x86-64 AVX-512 F/BW/DQ/VL (Highway's AVX3 target)
  neon,      ///< AArch64 NEON
  sve,       ///< AArch64 SVE (any vector length)
  sve2,      ///< AArch64 SVE2
  /// x86-64 AVX3 with AVX512_BF16: the avx3 target, whose bf16 forward computes Q K^T and P V
  /// with bf16 dot products (vdpbf16ps) instead of widening to fp32 (docs/semantics.md, "Precision")
  avx3_bf16,
};

/// @brief Parses "fused" or "three-stage" (also "three_stage"); throws dfss::error naming @p argument.
cpu_algorithm parse_cpu_algorithm(std::string_view text, std::string_view argument = "cpu_algorithm");
/// @brief Parses "automatic" (or "auto"), "generic", "portable" or a Highway target name ("sse4",
/// "avx2", "avx3", "avx3_bf16", "neon", "sve", "sve2"); throws dfss::error naming @p argument otherwise.
cpu_isa parse_cpu_isa(std::string_view text, std::string_view argument = "cpu_isa");
/// @brief The name parse_cpu_isa accepts for @p isa ("automatic", "generic", "avx2", ...).
const char* cpu_isa_name(cpu_isa isa) noexcept;

/// @brief A SIMD instruction set this build of dfss compiled, and whether this CPU can run it.
struct cpu_isa_support {
  dfss::cpu_isa isa;
  bool supported;
  /// Whether cpu_isa::automatic runs it: supported, and not passed over on this CPU (avx3_bf16
  /// where bf16 dot products are slower than fp32 FMAs, e.g. Intel Sapphire Rapids). Exactly one
  /// target has it when any is supported: the best.
  bool automatic = false;
};
/// @brief The SIMD targets compiled into this build, best first (e.g. avx3, avx2, sse4 on x86-64;
/// sve2, sve, neon on AArch64), each with whether this CPU (and OS) runs it and whether
/// cpu_isa::automatic does.
std::vector<cpu_isa_support> cpu_simd_isas();

/// @brief Largest attention_config::num_threads. OpenMP runtimes fail badly rather than cleanly on
/// absurd team sizes (libgomp segfaults creating 100000 threads); 1024 is above every core count a
/// single process sees today and bounds the per-thread scratch the kernels allocate.
inline constexpr int kMaxThreads = 1024;

/// @brief What to compute and where. Defaults: 2:4, scale 1/sqrt(d), no causal mask, automatic
/// backend, all hardware threads.
struct attention_config {
  dfss::pattern pattern{2, 4};
  /// Softmax scale; 0 (the default) means 1/sqrt(head_dim). Must be finite and >= 0.
  double scale = 0.0;
  /// Causal mask: key j is visible to query row i iff key_offset + j <= query_offset[b] + i; the
  /// default query_offset aligns bottom-right (FlashAttention >= 2.1 convention).
  bool causal = false;
  /// Global position of key 0 (docs/semantics.md, "Positions"): when the keys are a shard of a
  /// longer sequence (split-K, context parallelism) or a window of a cache. A multiple of M, so that
  /// the groups stay aligned; >= 0. Key lengths, causal masks and sink/recent windows count in
  /// global positions.
  std::int64_t key_offset = 0;
  /// Dense sink window: every group that intersects global keys [0, sink_tokens) is kept whole
  /// (docs/semantics.md, "Sink and recent windows"). 0: none. Fused CPU kernels and the reference.
  std::int64_t sink_tokens = 0;
  /// Dense recent window: every group that intersects the row's last recent_tokens visible keys
  /// (global positions) is kept whole. 0: none. Fused CPU kernels and the reference.
  std::int64_t recent_tokens = 0;
  dfss::backend backend = dfss::backend::automatic;
  /// Worker threads for CPU backends; 0 means all hardware threads; at most kMaxThreads.
  int num_threads = 0;
  /// CPU backend: fused single pass (default) or the paper's three-stage pipeline.
  dfss::cpu_algorithm cpu_algorithm = dfss::cpu_algorithm::fused;
  /// CPU backend: instruction set (automatic: the best supported by this CPU).
  dfss::cpu_isa cpu_isa = dfss::cpu_isa::automatic;
  /// CUDA backend: the cudaStream_t to enqueue on (null: the legacy default stream). Calls on the
  /// cuda backend return once the work is enqueued; they never synchronise with the host.
  void* cuda_stream = nullptr;
};

/// @brief Arguments of the forward pass. Absent optional views are default-constructed.
struct forward_args {
  tensor_view q;            ///< [B, Lq, H, d], f64 / f32 / f16 / bf16
  tensor_view k;            ///< [B, Lk, Hkv, d], same type as q
  tensor_view v;            ///< [B, Lk, Hkv, d], same type as q
  tensor_view out;          ///< [B, Lq, H, d], written; q's type, or f32 for 16-bit q
  tensor_view lse;          ///< optional [B, H, Lq], written; f32 (f64 for f64 q). -inf for empty rows
  tensor_view bias;         ///< optional [B or 1, H or 1, Lq, Lk] additive bias, any float type
  tensor_view key_lengths;  ///< optional [B] valid keys per batch in global positions, i32 or i64,
                            ///< each >= 0 (keys at key_offset + j >= length are masked)
  tensor_view query_offset;  ///< optional [B] global position of query row 0 per batch, i32 or i64,
                             ///< each >= 0; default key_offset + Lk - Lq (bottom-right)
  /// Optional outputs of the three-stage CPU pipeline (cpu_algorithm::three_stage only): the
  /// compressed score matrix. With G = ceil(Lk / M) groups per row:
  tensor_view compressed_values;   ///< [B, H, Lq, G * N] f32: kept scaled scores (-inf if masked)
  tensor_view compressed_indices;  ///< [B, H, Lq, G * N] i32: key index of each kept value
  tensor_view compressed_meta;     ///< [B, H, Lq, ceil(Lk / 16)] u16: 2:4 or 1:2 sparse tensor core
                                   ///< metadata words in row order (patterns 1:2 and 2:4 only)
};

/// @brief Arguments of the backward pass (gradient with the forward's selection held fixed).
struct backward_args {
  tensor_view q, k, v;      ///< as in forward_args
  tensor_view out;          ///< optional forward output [B, Lq, H, d]; recomputed when absent
  tensor_view lse;          ///< optional forward LSE [B, H, Lq]; recomputed when absent
  tensor_view dout;         ///< [B, Lq, H, d], same type as q
  tensor_view dq;           ///< [B, Lq, H, d], written (q's type, or f32 for 16-bit q)
  tensor_view dk;           ///< [B, Lk, Hkv, d], written; sums over the heads sharing a kv head
  tensor_view dv;           ///< [B, Lk, Hkv, d], written
  tensor_view bias;         ///< optional, as in forward_args
  tensor_view dbias;        ///< optional, written: same shape and type as bias
  tensor_view key_lengths;  ///< optional, as in forward_args
  tensor_view query_offset;  ///< optional, as in forward_args
  tensor_view dlse;         ///< optional gradient of the forward's LSE [B, H, Lq], lse's type; absent = 0
};

/// @brief Computes O (and LSE) in place of args.out (args.lse). Throws dfss::error on bad input,
/// naming the argument, the expected and the received value.
void attention_forward(const forward_args& args, const attention_config& config = {});

/// @brief Computes dQ, dK, dV (and dBias). Throws dfss::error on bad input.
void attention_backward(const backward_args& args, const attention_config& config = {});

/// @brief Non-throwing twins of the calls above.
status try_attention_forward(const forward_args& args, const attention_config& config = {}) noexcept;
status try_attention_backward(const backward_args& args, const attention_config& config = {}) noexcept;

/// @brief Which kernel family runs a call. kind == none means unsupported; reason says why.
enum class kernel_kind : int {
  none,
  reference_forward,
  reference_backward,
  cpu_fused_forward_scalar,
  cpu_fused_forward_avx2,
  cpu_three_stage_forward,
  cpu_fused_forward_portable,
  cpu_fused_backward_avx2,
  cpu_fused_backward_scalar,
  cpu_fused_backward_portable,
  cuda_three_stage_forward,  ///< SDDMM + register N:M selection (softmax folded in) -> mma.sp SpMM
  // The SIMD kernel family (src/cpu/simd/) on each Highway target; avx2 and portable (the baseline
  // target) keep the values above.
  cpu_fused_forward_sse4,
  cpu_fused_backward_sse4,
  cpu_fused_forward_avx3,
  cpu_fused_backward_avx3,
  cpu_fused_forward_neon,
  cpu_fused_backward_neon,
  cpu_fused_forward_sve,
  cpu_fused_backward_sve,
  cpu_fused_forward_sve2,
  cpu_fused_backward_sve2,
  // The decode forward of the SIMD family (few query rows against a long KV cache), per target.
  cpu_decode_forward_sse4,
  cpu_decode_forward_avx2,
  cpu_decode_forward_avx3,
  cpu_decode_forward_neon,
  cpu_decode_forward_sve,
  cpu_decode_forward_sve2,
  cpu_decode_forward_portable,
  cpu_fused_forward_avx3_bf16,
  cpu_fused_backward_avx3_bf16,
  cpu_decode_forward_avx3_bf16,  ///< the avx3 decode forward, requested or picked as avx3_bf16
};

/// @brief The selector's answer: supported or not, and what runs.
struct kernel_selection {
  kernel_kind kind = kernel_kind::none;
  dfss::backend backend = dfss::backend::automatic;
  /// Stable name of what runs, e.g. "reference.forward" or "cpu.fused_forward.scalar".
  std::string name;
  /// Why kind == none ("this build has no CUDA backend", "cpu backend does not take f64 inputs").
  std::string reason;
  bool supported() const noexcept { return kind != kernel_kind::none; }
};

/// @brief The one selector: validates the arguments (throws dfss::error when they are invalid),
/// then answers both "is this supported?" and "what runs?" without computing anything.
kernel_selection select_kernel(const forward_args& args, const attention_config& config = {});
kernel_selection select_kernel(const backward_args& args, const attention_config& config = {});

}  // namespace dfss
