// Typed access to the untyped pointers of attention_params, for code that is not hot (the fp64
// reference, validation, tools). Hot kernels are templated on their element types instead.
#pragma once

#include <cstdint>

#include "dfss/mask/visibility.hpp"
#include "dfss/numeric.hpp"
#include "dfss/params.hpp"

namespace dfss::core {

/// @brief Element @p off of @p base, of type @p t, widened to double (exact for every type).
inline double load_as_double(const void* base, dtype t, std::int64_t off) noexcept {
  switch (t) {
    case dtype::f64: return static_cast<const double*>(base)[off];
    case dtype::f32: return static_cast<double>(static_cast<const float*>(base)[off]);
    case dtype::f16: return static_cast<double>(f16_to_float(static_cast<const std::uint16_t*>(base)[off]));
    case dtype::bf16: return static_cast<double>(bf16_to_float(static_cast<const std::uint16_t*>(base)[off]));
    case dtype::i32: return static_cast<const std::int32_t*>(base)[off];
    case dtype::i64: return static_cast<double>(static_cast<const std::int64_t*>(base)[off]);
    case dtype::u8: return static_cast<const std::uint8_t*>(base)[off];
    case dtype::u16: return static_cast<const std::uint16_t*>(base)[off];
  }
  return 0.0;
}

/// @brief Stores @p x into element @p off of @p base, of floating type @p t (round to nearest even).
inline void store_from_double(void* base, dtype t, std::int64_t off, double x) noexcept {
  switch (t) {
    case dtype::f64: static_cast<double*>(base)[off] = x; break;
    case dtype::f32: static_cast<float*>(base)[off] = static_cast<float>(x); break;
    case dtype::f16: static_cast<std::uint16_t*>(base)[off] = from_double<half>(x).bits; break;
    case dtype::bf16: static_cast<std::uint16_t*>(base)[off] = from_double<bfloat16>(x).bits; break;
    default: break;
  }
}

/// @brief Stores @p n values value(c), c = 0 .. n - 1, into elements off + c * stride of @p base, of
/// floating type @p t (round to nearest even; the same result as store_from_double of each value),
/// switching on the type once for the row: a kernel's rows of results (O, dQ, dK, dV), where a
/// switch per element was a tenth of a short decode step.
template <class Value>
inline void store_row_from_float(void* base, dtype t, std::int64_t off, std::int64_t stride, int n,
                                 const Value& value) noexcept {
  const auto write = [&](auto* out, auto convert) {
    for (int c = 0; c < n; ++c) out[off + c * stride] = convert(value(c));
  };
  switch (t) {
    case dtype::f64: write(static_cast<double*>(base), [](float x) { return static_cast<double>(x); }); break;
    case dtype::f32: write(static_cast<float*>(base), [](float x) { return x; }); break;
    case dtype::f16:
      write(static_cast<std::uint16_t*>(base), [](float x) { return from_double<half>(static_cast<double>(x)).bits; });
      break;
    case dtype::bf16:
      write(static_cast<std::uint16_t*>(base),
            [](float x) { return from_double<bfloat16>(static_cast<double>(x)).bits; });
      break;
    default: break;
  }
}

/// @brief Valid keys of batch @p b in global positions (key padding): key_lengths[b], or
/// key_offset + seqlen_k (every key of the tensor) when no lengths were given.
inline std::int64_t valid_keys(const attention_params& p, std::int64_t b) noexcept {
  if (p.key_lengths == nullptr) return p.key_offset + p.seqlen_k;
  const std::int64_t off = b * p.key_lengths_stride;
  return p.key_lengths_type == dtype::i32
             ? static_cast<const std::int32_t*>(p.key_lengths)[off]
             : static_cast<const std::int64_t*>(p.key_lengths)[off];
}

/// @brief Global position of query row @p i of batch @p b: query_offset[b] + i, or by default
/// key_offset + seqlen_k - seqlen_q + i (bottom-right alignment).
inline std::int64_t query_position(const attention_params& p, std::int64_t b, std::int64_t i) noexcept {
  if (p.query_offset == nullptr) return p.key_offset + p.seqlen_k - p.seqlen_q + i;
  const std::int64_t off = b * p.query_offset_stride;
  const std::int64_t q0 = p.query_offset_type == dtype::i32 ? static_cast<const std::int32_t*>(p.query_offset)[off]
                                                            : static_cast<const std::int64_t*>(p.query_offset)[off];
  return q0 + i;
}

/// @brief Global exclusive end of the keys query row @p i of batch @p b sees (the row's last
/// visible key is one before it; it may lie beyond this call's keys).
inline std::int64_t global_visible_end(const attention_params& p, std::int64_t b, std::int64_t i) noexcept {
  return mask::global_visible_end(p.causal, valid_keys(p, b), query_position(p, b, i));
}

/// @brief Exclusive end of the keys query row @p i of batch @p b sees: local keys [0, end) are
/// visible, every later key is masked. The one rule of dfss/mask/visibility.hpp on this call's params.
inline std::int64_t visible_end(const attention_params& p, std::int64_t b, std::int64_t i) noexcept {
  return mask::local_end(global_visible_end(p, b, i), p.key_offset, p.seqlen_k);
}

/// @brief Whether any group of a row may be kept whole (sink or recent window requested).
inline bool has_whole_groups(const attention_params& p) noexcept { return p.sink_tokens > 0 || p.recent_tokens > 0; }

/// @brief The local key ranges of row @p i of batch @p b whose groups are kept whole (sink and
/// recent windows; both empty when neither was requested).
inline mask::whole_groups whole_groups(const attention_params& p, std::int64_t b, std::int64_t i) noexcept {
  if (!has_whole_groups(p)) return {};
  return mask::whole_groups_of(p.sink_tokens, p.recent_tokens, p.pattern_m, p.key_offset, p.seqlen_k,
                               global_visible_end(p, b, i));
}

/// @brief Offset of [b, l, h, d] in a tensor with element strides @p s.
inline std::int64_t offset4(const std::int64_t* s, std::int64_t b, std::int64_t l, std::int64_t h,
                            std::int64_t d) noexcept {
  return b * s[0] + l * s[1] + h * s[2] + d * s[3];
}

}  // namespace dfss::core
