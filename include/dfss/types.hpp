// dfss/types.hpp: the vocabulary of the public API (element types, N:M patterns, backends).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace dfss {

/// @brief Element type of a tensor. Floating types are the attention operands; integer types are
/// used for key lengths and the sparse formats.
enum class dtype : int {
  f64,   ///< IEEE binary64 (reference backend only for attention)
  f32,   ///< IEEE binary32
  f16,   ///< IEEE binary16, stored as dfss::half
  bf16,  ///< bfloat16, stored as dfss::bfloat16
  i32,   ///< int32_t
  i64,   ///< int64_t
  u8,    ///< uint8_t
  u16,   ///< uint16_t
};

/// @brief Size in bytes of one element of @p t.
std::size_t dtype_size(dtype t) noexcept;
/// @brief Lower-case name of @p t ("f32", "bf16", ...), as used in error messages and the CLI.
const char* dtype_name(dtype t) noexcept;
/// @brief True for f64, f32, f16 and bf16.
bool dtype_is_floating(dtype t) noexcept;

/// @brief An N:M pattern: in every aligned group of M consecutive keys keep the N largest scores.
/// N == M is dense attention. The CPU supports 1 <= N <= M <= 16; sparse tensor cores 1:2 and 2:4.
struct pattern {
  int n = 2;
  int m = 4;

  /// @brief Parses "N:M" (e.g. "2:4") or "dense" (returned as 1:1). Throws dfss::error naming
  /// @p argument on malformed text or on values outside 1 <= N <= M <= 16.
  static pattern parse(std::string_view text, std::string_view argument = "pattern");
  /// @brief "N:M", or "dense" when N == M.
  std::string str() const;
  bool is_dense() const noexcept { return n == m; }
  friend bool operator==(pattern a, pattern b) noexcept { return a.n == b.n && a.m == b.m; }
  friend bool operator!=(pattern a, pattern b) noexcept { return !(a == b); }
};

/// Largest group size M that any backend accepts (group keep-masks are 16-bit words).
inline constexpr int kMaxGroupSize = 16;

/// @brief Which implementation computes a call.
enum class backend : int {
  automatic,  ///< the fastest compiled backend that supports the call (see dfss::select_kernel)
  reference,  ///< fp64 scalar reference: the oracle, always built, slow
  cpu,        ///< CPU backend (fp32 accumulation)
  cuda,       ///< CUDA backend (sparse tensor cores), when built
};

/// @brief "automatic", "reference", "cpu" or "cuda".
const char* backend_name(backend b) noexcept;
/// @brief Parses a backend name; throws dfss::error naming @p argument on anything else.
backend parse_backend(std::string_view text, std::string_view argument = "backend");

}  // namespace dfss
