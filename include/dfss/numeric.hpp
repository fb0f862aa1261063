// dfss/numeric.hpp: 16-bit floating storage types and exact conversions, shared by host and device.
//
// dfss::half and dfss::bfloat16 are plain 16-bit storage wrappers so the public API needs neither
// <cuda_fp16.h> nor compiler extensions. Conversions round to nearest even and keep NaN and Inf.
#pragma once

#include <cstdint>
#include <cstring>

#include "dfss/config.hpp"

namespace dfss {

/// IEEE binary16 storage.
struct half {
  std::uint16_t bits;
};
/// bfloat16 storage (the upper half of a binary32).
struct bfloat16 {
  std::uint16_t bits;
};

DFSS_HD std::uint32_t float_bits(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}
DFSS_HD float bits_float(std::uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

/// @brief bfloat16 -> float: exact (a shift).
DFSS_HD float bf16_to_float(std::uint16_t b) { return bits_float(static_cast<std::uint32_t>(b) << 16); }

/// @brief float -> bfloat16, round to nearest even; NaN stays a (quiet) NaN.
DFSS_HD std::uint16_t float_to_bf16(float f) {
  std::uint32_t u = float_bits(f);
  if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x007fffffu) != 0) {
    return static_cast<std::uint16_t>((u >> 16) | 0x0040u);
  }
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<std::uint16_t>(u >> 16);
}

/// @brief binary16 -> float: exact, including subnormals, Inf and NaN.
DFSS_HD float f16_to_float(std::uint16_t h) {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  const std::uint32_t exp = (h >> 10) & 0x1fu;
  std::uint32_t man = h & 0x3ffu;
  std::uint32_t out;
  if (exp == 0x1fu) {
    out = sign | 0x7f800000u | (man << 13);
  } else if (exp != 0) {
    out = sign | ((exp + 112u) << 23) | (man << 13);
  } else if (man == 0) {
    out = sign;
  } else {
    // Subnormal: normalise the mantissa.
    std::uint32_t e = 113u;
    while ((man & 0x400u) == 0) {
      man <<= 1;
      --e;
    }
    out = sign | (e << 23) | ((man & 0x3ffu) << 13);
  }
  return bits_float(out);
}

/// @brief float -> binary16, round to nearest even; overflow goes to Inf, NaN stays NaN.
DFSS_HD std::uint16_t float_to_f16(float f) {
  const std::uint32_t u = float_bits(f);
  const std::uint32_t sign = (u >> 16) & 0x8000u;
  const std::uint32_t abs = u & 0x7fffffffu;
  if (abs >= 0x7f800000u) {
    return static_cast<std::uint16_t>(sign | 0x7c00u | (abs > 0x7f800000u ? 0x200u : 0u));
  }
  if (abs >= 0x477ff000u) {  // rounds to >= 65520: overflow to Inf
    return static_cast<std::uint16_t>(sign | 0x7c00u);
  }
  if (abs < 0x38800000u) {  // below the smallest normal half (2^-14): subnormal or zero
    if (abs < 0x33000000u) return static_cast<std::uint16_t>(sign);  // < 2^-25 rounds to zero
    const std::uint32_t e = abs >> 23;
    const std::uint32_t man = (abs & 0x7fffffu) | 0x800000u;
    // value = man * 2^(e-150) and the half subnormal unit is 2^-24, so the count of units is
    // man * 2^(e-126): a right shift by 126 - e (between 14 and 24 here), rounded to nearest even.
    const std::uint32_t shift = 126u - e;
    const std::uint32_t count = man >> shift;
    const std::uint32_t rem = man & ((1u << shift) - 1u);
    const std::uint32_t halfway = 1u << (shift - 1u);
    std::uint32_t r = count + ((rem > halfway || (rem == halfway && (count & 1u))) ? 1u : 0u);
    return static_cast<std::uint16_t>(sign | r);
  }
  std::uint32_t r = abs - 0x38000000u;  // rebias exponent 127 -> 15
  r = (r + 0xfffu + ((r >> 13) & 1u)) >> 13;
  return static_cast<std::uint16_t>(sign | r);
}

DFSS_HD float to_float(half h) { return f16_to_float(h.bits); }
DFSS_HD float to_float(bfloat16 b) { return bf16_to_float(b.bits); }
DFSS_HD float to_float(float f) { return f; }
DFSS_HD double to_double(double d) { return d; }
DFSS_HD double to_double(float f) { return static_cast<double>(f); }
DFSS_HD double to_double(half h) { return static_cast<double>(f16_to_float(h.bits)); }
DFSS_HD double to_double(bfloat16 b) { return static_cast<double>(bf16_to_float(b.bits)); }

/// @brief Stores @p x into storage type T, rounding to nearest even. 16-bit types round through
/// float; that double rounding can differ from a direct rounding by one ulp only when x lies within
/// 2^-29 relative of a half-way point, far below any tolerance that 16-bit outputs are tested with.
template <typename T>
DFSS_HD T from_double(double x);
template <>
DFSS_HD double from_double<double>(double x) { return x; }
template <>
DFSS_HD float from_double<float>(double x) { return static_cast<float>(x); }
template <>
DFSS_HD half from_double<half>(double x) { return half{float_to_f16(static_cast<float>(x))}; }
template <>
DFSS_HD bfloat16 from_double<bfloat16>(double x) {
  return bfloat16{float_to_bf16(static_cast<float>(x))};
}

}  // namespace dfss
