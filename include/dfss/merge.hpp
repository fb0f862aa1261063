// dfss/merge.hpp: the exact merge of partial attention results (split-K, context parallelism).
//
// DFSS groups are aligned blocks of M keys, so DFSS over keys split at multiples of M is exactly
// the merge of DFSS over each part (docs/semantics.md, "Merging partial results"): given each
// part's output O_x and log-sum-exp LSE_x of the same query rows,
//   LSE = log(exp(LSE_a) + exp(LSE_b)),   O = exp(LSE_a - LSE) O_a + exp(LSE_b - LSE) O_b.
#pragma once

#include "dfss/error.hpp"
#include "dfss/params.hpp"
#include "dfss/tensor.hpp"

namespace dfss {

/// @brief Arguments of merge_attention_states. O views are [B, L, H, d] and LSE views [B, H, L]
/// (natural log), with any element strides, as the forward writes them.
struct merge_args {
  tensor_view out_a;  ///< part a's output: f64, f32, f16 or bf16
  tensor_view lse_a;  ///< part a's LSE: f32 (f64 for f64 outputs)
  tensor_view out_b;  ///< part b's output, same shape and type as out_a
  tensor_view lse_b;  ///< part b's LSE, same shape and type as lse_a
  tensor_view out;    ///< written, same shape and type as out_a; may be exactly out_a (in place)
  tensor_view lse;    ///< written, same shape and type as lse_a; may be exactly lse_a (in place)
};

/// @brief Merges two partial results of the same query rows, row by row, accumulating in fp32 (f64
/// for f64 outputs). Per row: a NaN in either part (its LSE or any output element) gives a NaN row
/// and NaN LSE; two empty parts (LSE -inf) give O = 0 and LSE = -inf; a part whose LSE is +inf (its
/// scores overflowed) outweighs a finite one, and two such parts give a NaN row with LSE +inf.
/// @p num_threads as attention_config::num_threads (0: all hardware threads; at most kMaxThreads).
/// `out` and `lse` may be exactly `out_a` and `lse_a`; any other overlap of an output with an
/// input or the other output is rejected. Throws dfss::error on bad input, before writing anything.
void merge_attention_states(const merge_args& args, int num_threads = 0);

/// @brief Non-throwing twin of merge_attention_states.
status try_merge_attention_states(const merge_args& args, int num_threads = 0) noexcept;

/// @brief The validated merge, as the CPU kernel reads it (element strides, raw pointers).
struct merge_params {
  std::int64_t batch = 0, seqlen = 0, heads = 0, head_dim = 0;
  dtype out_type = dtype::f32;  ///< of out_a, out_b and out
  dtype lse_type = dtype::f32;  ///< of lse_a, lse_b and lse
  const void* out_a = nullptr;
  const void* out_b = nullptr;
  void* out = nullptr;
  std::int64_t out_a_stride[4] = {}, out_b_stride[4] = {}, out_stride[4] = {};
  const void* lse_a = nullptr;
  const void* lse_b = nullptr;
  void* lse = nullptr;
  std::int64_t lse_a_stride[3] = {}, lse_b_stride[3] = {}, lse_stride[3] = {};
  int num_threads = 0;
};

}  // namespace dfss
