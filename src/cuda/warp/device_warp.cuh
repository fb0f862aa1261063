// src/cuda/warp/device_warp.cuh: the device warp policy of the warp-level functions in
// nm_warp_select.hpp (nvcc only). The host twin, host_warp, simulates the same operations on 32
// lane values, which is how the CPU tests run the code below for a whole warp.
#pragma once

#include <cstdint>

namespace dfss::cuda::warp {

struct device_warp {
  using u32 = std::uint32_t;
  __device__ __forceinline__ static u32 shfl_xor(u32 x, int mask) {
    return __shfl_xor_sync(0xffffffffu, x, mask);
  }
  __device__ __forceinline__ static u32 select(u32 c, u32 a, u32 b) { return c != 0u ? a : b; }
  __device__ __forceinline__ static u32 lane_bit(int bit) {
    return (static_cast<u32>(threadIdx.x) >> bit) & 1u;
  }
};

}  // namespace dfss::cuda::warp
