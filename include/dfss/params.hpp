// dfss/params.hpp: the one plain parameter struct every backend consumes.
//
// The API validates the caller's views and fills this struct; backends (reference, cpu, cuda) read
// nothing else. It holds raw pointers, element strides (int64) and flags only, so kernels stay free
// of framework types and the same struct crosses into CUDA launchers unchanged.
//
// Index conventions: q, o, dout, dq are [batch, seqlen_q, heads, head_dim]; k, v, dk, dv are
// [batch, seqlen_k, heads_kv, head_dim]; lse is [batch, heads, seqlen_q]; bias and dbias are
// [batch, heads, seqlen_q, seqlen_k] with stride 0 in broadcast dimensions. Query head h reads
// key/value head h / (heads / heads_kv).
#pragma once

#include <cstdint>

#include "dfss/types.hpp"

namespace dfss {

struct attention_params {
  // Problem size.
  std::int64_t batch = 0;
  std::int64_t seqlen_q = 0;
  std::int64_t seqlen_k = 0;
  std::int64_t heads = 0;
  std::int64_t heads_kv = 0;
  std::int64_t head_dim = 0;

  /// Element type of q, k, v (and dout).
  dtype input_type = dtype::f32;
  /// Element type of o (and dq, dk, dv): input_type, or f32 for 16-bit inputs.
  dtype output_type = dtype::f32;
  /// Element type of o as given (forward: the output; backward: the forward's output, when given).
  dtype o_type = dtype::f32;
  /// Element type of lse: f64 when input_type is f64, else f32.
  dtype lse_type = dtype::f32;

  const void* q = nullptr;
  std::int64_t q_stride[4] = {};
  const void* k = nullptr;
  std::int64_t k_stride[4] = {};
  const void* v = nullptr;
  std::int64_t v_stride[4] = {};
  /// Forward: written. Backward: read (may be null when the backend recomputes it).
  void* o = nullptr;
  std::int64_t o_stride[4] = {};
  /// Forward: written when non-null. Backward: read (may be null when the backend recomputes it).
  void* lse = nullptr;
  std::int64_t lse_stride[3] = {};

  // The function (see docs/semantics.md).
  int pattern_n = 2;
  int pattern_m = 4;
  /// Softmax scale applied after selection (already resolved: never a default marker here).
  double scale = 0.0;
  /// Causal mask: key j visible to query row i of batch b iff key_offset + j <= query position
  /// (query_offset[b] + i; by default bottom-right aligned: j <= i + (seqlen_k - seqlen_q)).
  bool causal = false;
  /// Global position of local key 0, a multiple of pattern_m (0 unless the keys are a shard).
  std::int64_t key_offset = 0;
  /// Per-batch global position of query row 0, [batch], i32 or i64; null means
  /// key_offset + seqlen_k - seqlen_q for every batch.
  const void* query_offset = nullptr;
  dtype query_offset_type = dtype::i64;
  std::int64_t query_offset_stride = 1;
  /// Groups kept whole (docs/semantics.md, "Sink and recent windows"): those intersecting global
  /// keys [0, sink_tokens) or the last recent_tokens visible keys of the row. 0: none.
  std::int64_t sink_tokens = 0;
  std::int64_t recent_tokens = 0;
  /// Per-batch number of valid keys in global positions, [batch], i32 or i64; null means every key
  /// of the tensor (key_offset + seqlen_k).
  const void* key_lengths = nullptr;
  dtype key_lengths_type = dtype::i64;
  std::int64_t key_lengths_stride = 1;
  /// Additive bias on the scores before selection and scale; null means none.
  const void* bias = nullptr;
  dtype bias_type = dtype::f32;
  std::int64_t bias_stride[4] = {};

  // Backward only.
  const void* dout = nullptr;
  std::int64_t dout_stride[4] = {};
  void* dq = nullptr;
  std::int64_t dq_stride[4] = {};
  void* dk = nullptr;
  std::int64_t dk_stride[4] = {};
  void* dv = nullptr;
  std::int64_t dv_stride[4] = {};
  /// Gradient of the bias, same shape and broadcast as bias (broadcast dimensions are summed over);
  /// written when non-null, type bias_type. Packed strides with 0 in broadcast dimensions.
  void* dbias = nullptr;
  std::int64_t dbias_stride[4] = {};
  /// Optional gradient of the LSE [batch, heads, seqlen_q], type lse_type; null means zero.
  const void* dlse = nullptr;
  std::int64_t dlse_stride[3] = {};

  // Three-stage CPU pipeline only: optional compressed score outputs (see forward_args).
  float* compressed_values = nullptr;
  std::int32_t* compressed_indices = nullptr;
  std::int64_t compressed_stride[4] = {};  ///< [b, h, i, slot], shared by values and indices
  std::uint16_t* compressed_meta = nullptr;
  std::int64_t compressed_meta_stride[4] = {};

  /// Worker threads; 0 means the backend's default (all hardware threads).
  int num_threads = 0;
  /// CPU forward: P V with the weights in fp32 even where the bf16 paths would round them to bf16
  /// (the avx3 forward's P V on AMX tiles). The CPU backend's backward sets it when it recomputes O
  /// for D = rowsum(dO O), so that its gradients keep fp32 accuracy.
  bool fp32_weights = false;
};

}  // namespace dfss
