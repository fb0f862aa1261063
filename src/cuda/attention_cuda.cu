// The CUDA backend's forward: argument checks, the intermediates' workspace (a dfss-owned
// stream-ordered pool), error attribution, and the two-kernel pipeline (see pipeline.cuh).
#include "cuda/attention_cuda.hpp"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "cuda/pipeline.cuh"
#include "cuda/warp/softmax_fold.hpp"
#include "cuda/workspace.hpp"

namespace dfss::cuda {
namespace {

using i64 = std::int64_t;

// CUDA's limit on gridDim.y and gridDim.z: batch * heads is a grid dimension of every kernel.
constexpr i64 kMaxGridYZ = 65535;
// The kernels index keys in 32 bits (their masks compare int offsets): Lk < 2^31, less the 64-key
// padding of the intermediates. (At that length one row block's weights alone would be 256 GB.)
constexpr i64 kMaxKeys = 2147483647 - 64;

std::string runtime_error_text(cudaError_t e) {
  return std::string(cudaGetErrorName(e)) + ": " + cudaGetErrorString(e);
}

/// Why @p ptr cannot be read by kernels running on @p device (empty when it can): it must be device
/// memory of that very device, or managed memory. Memory of another device would be reached, if at
/// all, over peer access at a fraction of the bandwidth, or fault; the caller selects the device
/// (cudaSetDevice, torch.cuda.device) and dfss runs there.
std::string pointer_reason(const char* name, const void* ptr, int device) {
  if (ptr == nullptr) return "";
  cudaPointerAttributes attr{};
  const cudaError_t e = cudaPointerGetAttributes(&attr, ptr);
  if (e != cudaSuccess) {
    cudaGetLastError();  // clear the error so it does not leak into the caller's next CUDA call
    return std::string("the CUDA backend needs '") + name + "' in CUDA device memory, but the CUDA runtime " +
           "could not inspect the pointer: " + runtime_error_text(e);
  }
  if (attr.type != cudaMemoryTypeDevice && attr.type != cudaMemoryTypeManaged) {
    return std::string("the CUDA backend needs '") + name +
           "' in CUDA device (or managed) memory, got a host pointer";
  }
  if (attr.type == cudaMemoryTypeDevice && attr.device != device) {
    return std::string("the CUDA backend needs '") + name + "' on the current CUDA device " + std::to_string(device) +
           " (the kernels run there), got memory of device " + std::to_string(attr.device) +
           ": make that device current (cudaSetDevice) or move the tensor";
  }
  return "";
}

bool aligned(const void* p, std::uintptr_t bytes) { return reinterpret_cast<std::uintptr_t>(p) % bytes == 0; }

std::string view_reason(const char* name, const void* ptr, const i64 (&stride)[4], i64 align_elems,
                        std::uintptr_t align_bytes) {
  if (stride[3] != 1) {
    return std::string("the CUDA backend needs '") + name + "' contiguous along head_dim (stride[3] = 1), got " +
           std::to_string(stride[3]);
  }
  for (int d = 0; d < 3; ++d) {
    if (stride[d] % align_elems != 0) {
      return std::string("the CUDA backend needs the strides of '") + name + "' to be multiples of " +
             std::to_string(align_elems) + " elements (" + std::to_string(align_bytes) +
             "-byte vector access), got stride[" + std::to_string(d) + "] = " + std::to_string(stride[d]);
    }
  }
  if (!aligned(ptr, align_bytes)) {
    return std::string("the CUDA backend needs '") + name + "' aligned to " + std::to_string(align_bytes) +
           " bytes";
  }
  return "";
}

template <typename T>
cudaError_t launch_all(const pipeline_args& a, const attention_params& p, cudaStream_t s, const char*& step) {
  const bool two_of_four = p.pattern_n == 2;
  cudaError_t e = cudaSuccess;
  step = "SDDMM + N:M selection kernel";
  if (p.head_dim == 64) {
    e = two_of_four ? launch_sddmm_select<T, 64, warp::sp_pattern::p2of4>(a, s)
                    : launch_sddmm_select<T, 64, warp::sp_pattern::p1of2>(a, s);
  } else {
    e = two_of_four ? launch_sddmm_select<T, 128, warp::sp_pattern::p2of4>(a, s)
                    : launch_sddmm_select<T, 128, warp::sp_pattern::p1of2>(a, s);
  }
  if (e != cudaSuccess) return e;
  step = "SpMM (mma.sp) kernel";
  return p.head_dim == 64 ? launch_spmm<T, 64>(a, s) : launch_spmm<T, 128>(a, s);
}

/// Errors that the CUDA runtime reports asynchronously, at a later call, once a kernel has faulted;
/// they are sticky (every later call returns them). A launch that returns one did not cause it:
/// some earlier kernel on the device did, ours or the caller's.
bool asynchronous_error(cudaError_t e) {
  switch (e) {
    case cudaErrorIllegalAddress:
    case cudaErrorLaunchFailure:
    case cudaErrorMisalignedAddress:
    case cudaErrorIllegalInstruction:
    case cudaErrorInvalidAddressSpace:
    case cudaErrorInvalidPc:
    case cudaErrorHardwareStackError:
    case cudaErrorAssert:
    case cudaErrorLaunchTimeout:
    case cudaErrorECCUncorrectable:
      return true;
    default:
      return false;
  }
}

status cuda_failure(const char* step, cudaError_t e) {
  std::string msg = std::string("dfss::attention_forward (cuda): ") + step + ": " + runtime_error_text(e);
  if (asynchronous_error(e)) {
    msg += " (an asynchronous, sticky error: a kernel that ran earlier on this device faulted, which may be "
           "one of dfss's or one of the caller's; the CUDA context is unusable from here on)";
  }
  return {status_code::cuda_error, std::move(msg)};
}

std::mutex pool_mutex;
std::vector<cudaMemPool_t> pools;  // by device; null until first use

/// The dfss-owned memory pool of @p device, created at first use and kept for the process's
/// lifetime (destroying it at exit could run after the driver has unloaded). Its release threshold
/// is unlimited: memory freed at the end of a call stays mapped in the pool and serves the next call,
/// instead of going back to the OS at every synchronisation (what the default pool does, whose
/// threshold is 0) and being mapped again. The pool thus holds the largest concurrent intermediates
/// of the calls so far. It is dfss's own, so the caller's default pool keeps its own settings.
cudaError_t workspace_pool(int device, cudaMemPool_t& pool) {
  const std::lock_guard<std::mutex> lock(pool_mutex);
  if (static_cast<std::size_t>(device) >= pools.size()) pools.resize(static_cast<std::size_t>(device) + 1, nullptr);
  cudaMemPool_t& slot = pools[static_cast<std::size_t>(device)];
  if (slot == nullptr) {
    cudaMemPoolProps props{};
    props.allocType = cudaMemAllocationTypePinned;
    props.handleTypes = cudaMemHandleTypeNone;
    props.location.type = cudaMemLocationTypeDevice;
    props.location.id = device;
    cudaMemPool_t created = nullptr;
    cudaError_t e = cudaMemPoolCreate(&created, &props);
    if (e != cudaSuccess) return e;
    std::uint64_t keep_all = std::numeric_limits<std::uint64_t>::max();
    e = cudaMemPoolSetAttribute(created, cudaMemPoolAttrReleaseThreshold, &keep_all);
    if (e != cudaSuccess) {
      cudaMemPoolDestroy(created);
      return e;
    }
    slot = created;
  }
  pool = slot;
  return cudaSuccess;
}

/// The intermediates of one call, in one stream-ordered block from workspace_pool: acquire places
/// every request (workspace_layout) and points it into the block, release frees the block in stream
/// order after the kernels that use it.
class stream_workspace {
 public:
  status acquire(const workspace_request* req, std::size_t n, int device, cudaStream_t stream) {
    const workspace_plan plan = workspace_layout(req, n);
    if (!plan.error.empty()) return {status_code::unsupported, "dfss::attention_forward (cuda): " + plan.error};
    cudaMemPool_t pool = nullptr;
    cudaError_t e = workspace_pool(device, pool);
    if (e != cudaSuccess) {
      cudaGetLastError();  // reported in the status: not left for the caller's next check to find
      return cuda_failure("creating dfss's stream-ordered memory pool", e);
    }
    e = cudaMallocFromPoolAsync(&block_, plan.total_bytes > 0 ? plan.total_bytes : 1, pool, stream);
    if (e != cudaSuccess) {
      cudaGetLastError();
      block_ = nullptr;
      return cuda_failure(("cudaMallocFromPoolAsync of the intermediates (" + std::to_string(plan.total_bytes) +
                           " bytes)").c_str(),
                          e);
    }
    workspace_assign(req, n, plan, block_);
    return status::success();
  }
  cudaError_t release(cudaStream_t stream) {
    if (block_ == nullptr) return cudaSuccess;
    const cudaError_t e = cudaFreeAsync(block_, stream);
    block_ = nullptr;
    if (e != cudaSuccess) cudaGetLastError();
    return e;
  }

 private:
  void* block_ = nullptr;
};

}  // namespace

std::string forward_unsupported_reason(const attention_params& p) {
  if (p.input_type != dtype::f16 && p.input_type != dtype::bf16) {
    return std::string("the CUDA backend takes f16 and bf16 inputs, got ") + dtype_name(p.input_type) +
           " (tf32 for f32 inputs is not implemented yet)";
  }
  if (p.head_dim != 64 && p.head_dim != 128) {
    return "the CUDA backend has kernels for head_dim 64 and 128, got " + std::to_string(p.head_dim);
  }
  if (!((p.pattern_n == 2 && p.pattern_m == 4) || (p.pattern_n == 1 && p.pattern_m == 2))) {
    return "the CUDA backend runs the sparse tensor core patterns 1:2 and 2:4, got " +
           std::to_string(p.pattern_n) + ":" + std::to_string(p.pattern_m);
  }
  if (p.bias != nullptr) return "the CUDA backend does not take an additive bias yet";
  if (p.compressed_values != nullptr || p.compressed_meta != nullptr) {
    return "the CUDA backend does not write the compressed outputs";
  }
  if (p.seqlen_k > kMaxKeys) {
    return "the CUDA backend needs seqlen_k <= " + std::to_string(kMaxKeys) + " (32-bit key indices), got " +
           std::to_string(p.seqlen_k);
  }
  if (p.batch * p.heads > kMaxGridYZ) {
    return "the CUDA backend needs batch * heads <= 65535 (a CUDA grid dimension), got " +
           std::to_string(p.batch * p.heads);
  }
  std::string r = view_reason("q", p.q, p.q_stride, 8, 16);
  if (r.empty()) r = view_reason("k", p.k, p.k_stride, 8, 16);
  if (r.empty()) r = view_reason("v", p.v, p.v_stride, 8, 16);
  if (r.empty()) {
    // Outputs are written two elements at a time.
    r = p.o_type == dtype::f32 ? view_reason("out", p.o, p.o_stride, 2, 8) : view_reason("out", p.o, p.o_stride, 2, 4);
  }
  if (!r.empty()) return r;
  int device = 0;
  const cudaError_t e = cudaGetDevice(&device);
  if (e != cudaSuccess) {
    cudaGetLastError();
    return "the CUDA backend could not read the current CUDA device: " + runtime_error_text(e);
  }
  for (const auto& [name, ptr] : {std::pair<const char*, const void*>{"q", p.q}, {"k", p.k}, {"v", p.v},
                                  {"out", p.o}, {"lse", p.lse}, {"key_lengths", p.key_lengths}}) {
    r = pointer_reason(name, ptr, device);
    if (!r.empty()) return r;
  }
  return "";
}

std::string forward_kernel_name(const attention_params& p) {
  return std::string("cuda.three_stage_forward.") + dtype_name(p.input_type) + ".d" + std::to_string(p.head_dim) +
         (p.pattern_n == 2 ? ".2of4" : ".1of2");
}

status attention_forward(const attention_params& p, void* stream_ptr) {
  const cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  if (p.batch == 0 || p.heads == 0 || p.seqlen_q == 0) return status::success();
  pipeline_args a{};
  a.batch = p.batch;
  a.heads = p.heads;
  a.heads_kv = p.heads_kv;
  a.seqlen_q = p.seqlen_q;
  a.seqlen_k = p.seqlen_k;
  a.q = p.q;
  a.k = p.k;
  a.v = p.v;
  a.o = p.o;
  for (int d = 0; d < 3; ++d) {
    a.q_stride[d] = p.q_stride[d];
    a.k_stride[d] = p.k_stride[d];
    a.v_stride[d] = p.v_stride[d];
    a.o_stride[d] = p.o_stride[d];
    a.lse_stride[d] = p.lse_stride[d];
  }
  a.o_is_f32 = p.o_type == dtype::f32;
  a.lse = static_cast<float*>(p.lse);
  a.key_lengths = p.key_lengths;
  a.key_lengths_i32 = p.key_lengths_type == dtype::i32;
  a.key_lengths_stride = p.key_lengths_stride;
  a.causal = p.causal;
  a.scale_log2 = static_cast<float>(p.scale * 1.4426950408889634);
  // Lk = 0 still runs one (fully masked) key tile, so every row gets zeros and LSE -inf.
  a.layout = warp::intermediate_layout::make(p.seqlen_q, p.seqlen_k > 0 ? p.seqlen_k : 1);
  const i64 slices = p.batch * p.heads;
  // The intermediates, one slice per (batch, head): one row each (weights are 16-bit, T).
  const workspace_request intermediates[] = {
      workspace_entry("compressed weights", slices * a.layout.value_elems(), 2, a.values),
      workspace_entry("metadata", slices * a.layout.meta_words(), sizeof(std::uint32_t), a.meta),
      workspace_entry("tile maxima", slices * warp::fold_tile_max_elems(a.layout), sizeof(float), a.tile_max),
      workspace_entry("row maxima", slices * a.layout.rows_padded, sizeof(float), a.row_max),
  };

  // An error already pending here was left by earlier CUDA work that nobody checked: our first
  // launch's cudaGetLastError would return it and blame our kernel. So nothing is launched, the
  // status says where it comes from, and it is left pending (peeked, not cleared), so the caller's own
  // checks still see it. A sticky error (a kernel faulted) is found here too, and may come from any
  // kernel that ran before, dfss's included.
  cudaError_t e = cudaPeekAtLastError();
  if (e != cudaSuccess) {
    return {status_code::cuda_error,
            "dfss::attention_forward (cuda): a CUDA error was already pending before dfss launched anything: " +
                runtime_error_text(e) +
                (asynchronous_error(e)
                     ? "; a sticky error: a kernel that ran earlier on this device faulted, and the CUDA context is "
                       "unusable from here on"
                     : "; it was left by earlier CUDA work of the caller that was not checked") +
                ". Nothing was launched, and the error is left pending as found (cudaGetLastError clears it)"};
  }
  int device = 0;
  e = cudaGetDevice(&device);
  if (e != cudaSuccess) {
    cudaGetLastError();
    return cuda_failure("cudaGetDevice", e);
  }
#if CUDART_VERSION >= 12080
  // A stream of another device: the launches would fail with an invalid resource handle, or, for the
  // pool, allocate on the wrong device. The special handles (legacy, per-thread) follow the current
  // device.
  if (stream != nullptr && stream != cudaStreamLegacy && stream != cudaStreamPerThread) {
    int stream_device = 0;
    e = cudaStreamGetDevice(stream, &stream_device);
    if (e != cudaSuccess) {
      cudaGetLastError();
      return {status_code::invalid_argument,
              "dfss::attention_forward (cuda): argument 'cuda_stream': expected a CUDA stream, but the runtime "
              "cannot read its device: " + runtime_error_text(e)};
    }
    if (stream_device != device) {
      return {status_code::invalid_argument,
              "dfss::attention_forward (cuda): argument 'cuda_stream': expected a stream of the current device " +
                  std::to_string(device) + ", got a stream of device " + std::to_string(stream_device)};
    }
  }
#endif

  stream_workspace ws;
  status st = ws.acquire(intermediates, sizeof(intermediates) / sizeof(intermediates[0]), device, stream);
  if (!st.ok()) return st;
  const char* step = "";
  e = p.input_type == dtype::bf16 ? launch_all<__nv_bfloat16>(a, p, stream, step)
                                  : launch_all<__half>(a, p, stream, step);
  // Freed in stream order even after a failed launch: the kernels enqueued before it still use it.
  const cudaError_t f = ws.release(stream);
  if (e != cudaSuccess) return cuda_failure(step, e);
  if (f != cudaSuccess) return cuda_failure("cudaFreeAsync of the intermediates", f);
  return status::success();
}

std::size_t workspace_pool_reserved_bytes() {
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  const std::lock_guard<std::mutex> lock(pool_mutex);
  if (static_cast<std::size_t>(device) >= pools.size() || pools[static_cast<std::size_t>(device)] == nullptr) return 0;
  std::uint64_t reserved = 0;
  if (cudaMemPoolGetAttribute(pools[static_cast<std::size_t>(device)], cudaMemPoolAttrReservedMemCurrent, &reserved) !=
      cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return static_cast<std::size_t>(reserved);
}

}  // namespace dfss::cuda
