// Pieces shared by the fused CPU kernels (AVX2 and portable): tile sizes, the key tile width rule,
// typed element loads and an aligned scratch buffer. Included before the AVX2 file's target pragma,
// so nothing here is ever compiled with AVX2 instructions.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <new>
#include <numeric>

#include "dfss/numeric.hpp"

namespace dfss::cpu::fused {

/// Query rows per task: enough to amortise the per-tile epilogue setup and small enough that the
/// task's Q (32 x dp), S (32 x W) and accumulators (32 x dp) stay in L1/L2 for d = 64.
inline constexpr int kRowsPerTask = 32;
/// Minimum key tile width; the real width is a multiple of lcm(M, 16) at least this wide. 64 keys of
/// K (16 KiB at d = 64) fit in L1 next to the S tile; 32 and 128 measured slower for dense at d = 64.
inline constexpr int kMinKeyTile = 64;
/// Widest key tile: lcm(M, 16) <= 240 for M <= 16, times 1.
inline constexpr int kMaxKeyTile = 256;
inline constexpr float kLog2e = 1.4426950408889634f;
inline constexpr float kLn2 = 0.6931471805599453f;
/// The backward computes P = exp(scale * s - LSE) straight from the forward's fp32 LSE only while
/// |LSE| <= this. The rounding of LSE and of scale * s puts about eps_f32 |LSE| of relative error
/// into P: up to ~64 eps_f32 here, of the order of the backward's other fp32 errors, while ordinary
/// attention rows (|LSE| a few tens at most) stay on the direct path. Beyond it (large or
/// overflowed scores, docs/semantics.md "Non-finite and extreme inputs") the backward recomputes
/// the row's maximum and sum itself and uses P = exp(scale * (s - max)) / sum.
inline constexpr float kDirectLseLimit = 64.0f;

/// Key tile width for group size @p m: a multiple of 16 (the micro-kernel width) and of M (so
/// groups never straddle tiles), at least kMinKeyTile.
inline int key_tile_width(int m) {
  const int l = m / std::gcd(m, 16) * 16;
  return (kMinKeyTile + l - 1) / l * l;
}

/// Element @p off of a T tensor as float.
template <typename T>
inline float load_f32(const void* base, std::int64_t off) {
  return to_float(static_cast<const T*>(base)[off]);
}

/// 32-byte aligned scratch that only grows; consistent (empty) after a failed allocation.
template <typename E>
struct aligned_buffer {
  E* ptr = nullptr;
  std::size_t size = 0;
  aligned_buffer() = default;
  aligned_buffer(const aligned_buffer&) = delete;
  aligned_buffer& operator=(const aligned_buffer&) = delete;
  void resize(std::size_t n) {
    if (n <= size) return;
    std::free(ptr);
    size = 0;
    ptr = static_cast<E*>(std::aligned_alloc(32, (n * sizeof(E) + 31) / 32 * 32));
    if (ptr == nullptr) throw std::bad_alloc();
    size = n;
  }
  E& operator[](std::size_t i) { return ptr[i]; }
  ~aligned_buffer() { std::free(ptr); }
};

}  // namespace dfss::cpu::fused
