// src/cuda/ptx.cuh: inline-PTX wrappers of the sm_80 instructions the kernels use (nvcc only):
// cp.async with zero fill, ldmatrix, dense mma.sync m16n8k16 and sparse
// mma.sp::ordered_metadata m16n8k32, for f16 and bf16 with f32 accumulators.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace dfss::cuda::ptx {

/// Element-type traits: the PTX type name and float conversions.
template <typename T>
struct elem;
template <>
struct elem<__half> {
  using pair = __half2;
  __device__ __forceinline__ static std::uint32_t pack(float lo, float hi) {
    const __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const std::uint32_t*>(&h);
  }
  __device__ __forceinline__ static float2 unpack(std::uint32_t v) {
    return __half22float2(*reinterpret_cast<const __half2*>(&v));
  }
  __device__ __forceinline__ static __half from_float(float x) { return __float2half_rn(x); }
  __device__ __forceinline__ static std::uint32_t pack_same(float x) {
    const __half2 h = __float2half2_rn(x);
    return *reinterpret_cast<const std::uint32_t*>(&h);
  }
};
template <>
struct elem<__nv_bfloat16> {
  using pair = __nv_bfloat162;
  __device__ __forceinline__ static std::uint32_t pack(float lo, float hi) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const std::uint32_t*>(&h);
  }
  __device__ __forceinline__ static float2 unpack(std::uint32_t v) {
    return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&v));
  }
  __device__ __forceinline__ static __nv_bfloat16 from_float(float x) { return __float2bfloat16_rn(x); }
  __device__ __forceinline__ static std::uint32_t pack_same(float x) {
    const __nv_bfloat162 h = __float2bfloat162_rn(x);
    return *reinterpret_cast<const std::uint32_t*>(&h);
  }
};

__device__ __forceinline__ std::uint32_t smem_addr(const void* p) {
  return static_cast<std::uint32_t>(__cvta_generic_to_shared(p));
}

/// 16-byte global -> shared copy on a shared-memory address and a global address held as integers;
/// when @p valid is false the 16 bytes are zero-filled and @p src is not read (a zero-filled chunk
/// may name an address past the tensor).
__device__ __forceinline__ void cp_async_16(std::uint32_t dst, std::uint64_t src, bool valid) {
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
/// cp_async_16 on pointers (@p src must still be a valid address expression).
__device__ __forceinline__ void cp_async_16(void* dst, const void* src, bool valid) {
  cp_async_16(smem_addr(dst), reinterpret_cast<std::uint64_t>(src), valid);
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int Pending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(Pending) : "memory");
}

/// ldmatrix.x4: lane l gives the (shared-memory) address of row l % 8 of matrix l / 8; register m
/// receives lane's part of matrix m (row lane / 4, columns 2 (lane % 4), +1).
__device__ __forceinline__ void ldmatrix_x4(std::uint32_t (&r)[4], std::uint32_t row_addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(row_addr));
}
/// ldmatrix.x4.trans: as ldmatrix_x4 with every 8x8 matrix transposed.
__device__ __forceinline__ void ldmatrix_x4_trans(std::uint32_t (&r)[4], const void* row_addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(row_addr)));
}

/// D += A B, dense m16n8k16, 16-bit inputs, f32 accumulators.
template <typename T>
__device__ __forceinline__ void mma_m16n8k16(float (&d)[4], const std::uint32_t (&a)[4],
                                             std::uint32_t b0, std::uint32_t b1);
template <>
__device__ __forceinline__ void mma_m16n8k16<__nv_bfloat16>(float (&d)[4], const std::uint32_t (&a)[4],
                                                            std::uint32_t b0, std::uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <>
__device__ __forceinline__ void mma_m16n8k16<__half>(float (&d)[4], const std::uint32_t (&a)[4],
                                                     std::uint32_t b0, std::uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

/// D += A B with sparse A, mma.sp::ordered_metadata m16n8k32, 16-bit inputs, f32 accumulators.
/// @p a holds the lane's 8 kept values (mma_sp_a16_coord), @p b its 8 B values, @p e its metadata
/// register; Selector (0 or 1) names the lane pair of each quad whose register is read. The
/// selector must be an immediate, hence the template parameter.
template <typename T, int Selector>
__device__ __forceinline__ void mma_sp_m16n8k32(float (&d)[4], const std::uint32_t (&a)[4],
                                                const std::uint32_t (&b)[4], std::uint32_t e);
#define DFSS_MMA_SP_K32(CTYPE, PTXTYPE)                                                           \
  template <>                                                                                     \
  __device__ __forceinline__ void mma_sp_m16n8k32<CTYPE, 0>(                                      \
      float(&d)[4], const std::uint32_t(&a)[4], const std::uint32_t(&b)[4], std::uint32_t e) {    \
    asm volatile("mma.sp::ordered_metadata.sync.aligned.m16n8k32.row.col.f32." PTXTYPE          \
                 "." PTXTYPE ".f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9,%10,%11}, "             \
                 "{%0,%1,%2,%3}, %12, 0x0;\n"                                                    \
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])                                 \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "r"(b[2]),  \
                   "r"(b[3]), "r"(e));                                                            \
  }                                                                                               \
  template <>                                                                                     \
  __device__ __forceinline__ void mma_sp_m16n8k32<CTYPE, 1>(                                      \
      float(&d)[4], const std::uint32_t(&a)[4], const std::uint32_t(&b)[4], std::uint32_t e) {    \
    asm volatile("mma.sp::ordered_metadata.sync.aligned.m16n8k32.row.col.f32." PTXTYPE          \
                 "." PTXTYPE ".f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9,%10,%11}, "             \
                 "{%0,%1,%2,%3}, %12, 0x1;\n"                                                    \
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])                                 \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "r"(b[2]),  \
                   "r"(b[3]), "r"(e));                                                            \
  }
DFSS_MMA_SP_K32(__nv_bfloat16, "bf16")
DFSS_MMA_SP_K32(__half, "f16")
#undef DFSS_MMA_SP_K32

}  // namespace dfss::cuda::ptx
