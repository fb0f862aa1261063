// The benchmarks' inputs: [B, L, H, d] tensors of standard normal values in the benchmark's input
// type, from a seeded generator, shared by `dfss bench` and the micro-benchmarks so that both time
// the same kind of data.
#pragma once

#include <cstdint>
#include <random>
#include <vector>

#include "dfss/dfss.hpp"

namespace dfss::harness {

/// @brief One tensor of standard normal values (drawn in fp32, then rounded to f16 or bf16), or an
/// output buffer of one of those types (assign).
struct input_tensor {
  dtype type = dtype::f32;
  std::vector<float> f32;
  std::vector<half> f16;
  std::vector<bfloat16> b16;

  /// @brief @p n values of type @p t drawn from @p rng.
  void fill(std::size_t n, dtype t, std::mt19937_64& rng) {
    type = t;
    std::normal_distribution<float> normal(0.0f, 1.0f);
    f32.resize(n);
    for (auto& x : f32) x = normal(rng);
    if (t == dtype::f16) {
      f16.resize(n);
      for (std::size_t i = 0; i < n; ++i) f16[i] = half{float_to_f16(f32[i])};
      std::vector<float>().swap(f32);
    } else if (t == dtype::bf16) {
      b16.resize(n);
      for (std::size_t i = 0; i < n; ++i) b16[i] = bfloat16{float_to_bf16(f32[i])};
      std::vector<float>().swap(f32);
    }
  }
  /// @brief @p n copies of @p value rounded to type @p t: an output buffer (`dfss bench` writes O
  /// in the inputs' type, as the torch operator and SDPA return it, unless --out-dtype f32).
  void assign(std::size_t n, dtype t, float value) {
    type = t;
    f32.clear();
    f16.clear();
    b16.clear();
    if (t == dtype::f16) {
      f16.assign(n, half{float_to_f16(value)});
    } else if (t == dtype::bf16) {
      b16.assign(n, bfloat16{float_to_bf16(value)});
    } else {
      f32.assign(n, value);
    }
  }
  /// @brief The stored (rounded) value of element @p i, exactly.
  double at(std::size_t i) const {
    switch (type) {
      case dtype::f16:
        return static_cast<double>(f16_to_float(f16[i].bits));
      case dtype::bf16:
        return static_cast<double>(bf16_to_float(b16[i].bits));
      default:
        return static_cast<double>(f32[i]);
    }
  }
  /// @brief A packed [B, L, H, d] view of the values.
  tensor_view view(std::int64_t B, std::int64_t L, std::int64_t H, std::int64_t d) {
    switch (type) {
      case dtype::f16:
        return make_view(f16.data(), {B, L, H, d});
      case dtype::bf16:
        return make_view(b16.data(), {B, L, H, d});
      default:
        return make_view(f32.data(), {B, L, H, d});
    }
  }
  std::size_t bytes() const { return f32.size() * 4 + f16.size() * 2 + b16.size() * 2; }
  /// @brief The first of the bytes() bytes of the values.
  const void* data() const {
    switch (type) {
      case dtype::f16:
        return f16.data();
      case dtype::bf16:
        return b16.data();
      default:
        return f32.data();
    }
  }
};

}  // namespace dfss::harness
