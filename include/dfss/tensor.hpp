// dfss/tensor.hpp: a non-owning, strided view of caller memory.
//
// dfss never allocates or copies the caller's tensors: a view is a pointer, an element type, a shape
// and per-dimension strides counted in elements (not bytes). Strides may be zero for broadcast inputs
// (the bias) and are validated against overlap for outputs.
#pragma once

#include <array>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <type_traits>

#include "dfss/error.hpp"
#include "dfss/numeric.hpp"
#include "dfss/types.hpp"

namespace dfss {

inline constexpr int kMaxRank = 4;

/// @brief Non-owning view: data pointer, element type, rank <= 4, shape and element strides.
/// A default-constructed view (data == nullptr, rank == 0) means "absent" for optional arguments.
struct tensor_view {
  void* data = nullptr;
  dtype type = dtype::f32;
  int rank = 0;
  std::array<std::int64_t, kMaxRank> shape{};
  std::array<std::int64_t, kMaxRank> stride{};

  bool present() const noexcept { return data != nullptr || rank != 0; }
};

template <typename T>
constexpr dtype dtype_of() noexcept;
template <> constexpr dtype dtype_of<double>() noexcept { return dtype::f64; }
template <> constexpr dtype dtype_of<float>() noexcept { return dtype::f32; }
template <> constexpr dtype dtype_of<half>() noexcept { return dtype::f16; }
template <> constexpr dtype dtype_of<bfloat16>() noexcept { return dtype::bf16; }
template <> constexpr dtype dtype_of<std::int32_t>() noexcept { return dtype::i32; }
template <> constexpr dtype dtype_of<std::int64_t>() noexcept { return dtype::i64; }
template <> constexpr dtype dtype_of<std::uint8_t>() noexcept { return dtype::u8; }
template <> constexpr dtype dtype_of<std::uint16_t>() noexcept { return dtype::u16; }

/// @brief A view of a packed row-major tensor (last dimension contiguous).
/// Example: dfss::make_view(q.data(), {B, L, H, d}).
template <typename T>
tensor_view make_view(T* data, std::initializer_list<std::int64_t> shape) {
  if (shape.size() > static_cast<std::size_t>(kMaxRank)) {
    throw error(status_code::invalid_argument,
                "dfss::make_view: argument 'shape': expected at most " + std::to_string(kMaxRank) +
                    " dimensions, got " + std::to_string(shape.size()));
  }
  tensor_view v;
  v.data = const_cast<void*>(static_cast<const void*>(data));
  v.type = dtype_of<typename std::remove_const<T>::type>();
  v.rank = static_cast<int>(shape.size());
  int i = 0;
  for (std::int64_t s : shape) v.shape[i++] = s;
  // Packed strides; a product that overflows is caught later by validation of the shape itself.
  std::int64_t st = 1;
  for (int d = v.rank - 1; d >= 0; --d) {
    v.stride[d] = st;
    st = static_cast<std::int64_t>(static_cast<std::uint64_t>(st) *
                                   static_cast<std::uint64_t>(v.shape[d]));
  }
  return v;
}

/// @brief A view with explicit element strides, e.g. a [B, H, L, d] buffer seen as [B, L, H, d]:
/// make_strided_view(p, {B, L, H, d}, {H * L * d, d, L * d, 1}).
template <typename T>
tensor_view make_strided_view(T* data, std::initializer_list<std::int64_t> shape,
                              std::initializer_list<std::int64_t> strides) {
  if (strides.size() != shape.size()) {
    throw error(status_code::invalid_argument,
                "dfss::make_strided_view: argument 'strides': expected " +
                    std::to_string(shape.size()) + " strides (one per dimension), got " +
                    std::to_string(strides.size()));
  }
  tensor_view v = make_view(data, shape);
  int i = 0;
  for (std::int64_t s : strides) v.stride[i++] = s;
  return v;
}

}  // namespace dfss
