// The SIMD kernels' row store (cpu/simd/kernel_parts-inl.h: store_row_as, how O, dQ, dK and dV rows
// leave the kernels) on every Highway target this build compiled and this CPU runs: bf16 rows of unit
// stride by vectors (f16 too, on x86 with F16C), the same bits as the scalar rounding
// (dfss/numeric.hpp: float_to_bf16, float_to_f16), and correctly rounded to nearest even by oracles
// of this file; fp32 rows copied; other strides and the tail after the last whole vector element by
// element.
#include "cpu/simd/targets.hpp"  // first: it fixes the compiled targets

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "unit/test_simd_store.cpp"
#include "hwy/foreach_target.h"  // IWYU pragma: keep

#include "cpu/simd/kernel_parts-inl.h"

HWY_BEFORE_NAMESPACE();
namespace dfss::cpu::simd::HWY_NAMESPACE {
/// store_row_as(base, t, off, stride, n, src). Returns false on the static baseline target, which
/// has no kernels.
bool store_row_with(void* base, dtype t, std::int64_t off, std::int64_t stride, int n, const float* src) {
#if DFSS_SIMD_KERNEL_TARGET
  store_row_as(base, t, off, stride, n, src);
  return true;
#else
  (void)base, (void)t, (void)off, (void)stride, (void)n, (void)src;
  return false;
#endif
}
}  // namespace dfss::cpu::simd::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "dfss/numeric.hpp"
#include "hwy/targets.h"
#include "common/testing.hpp"

namespace dfss::cpu::simd {
HWY_EXPORT(store_row_with);
}  // namespace dfss::cpu::simd

namespace {

using dfss::dtype;

/// Nearest bf16 to finite @p x, ties to the even mantissa, magnitudes from 2^128 - 2^119 (half a
/// bf16 ulp above the largest bf16) on to infinity: by distances in double, not by bit arithmetic.
std::uint16_t nearest_bf16(float x) {
  const std::uint32_t u = std::bit_cast<std::uint32_t>(x);
  const std::uint32_t sign = u & 0x80000000u, mag = u & 0x7fffffffu;
  const std::uint32_t lo = mag & 0xffff0000u, hi = lo + 0x10000u;  // the candidates, by magnitude
  const auto value = [](std::uint32_t m) {
    return m == 0x7f800000u ? std::ldexp(1.0, 128) : static_cast<double>(std::bit_cast<float>(m));
  };
  const double a = std::fabs(static_cast<double>(x));
  const double below = a - value(lo), above = value(hi) - a;
  const bool up = above < below || (above == below && ((lo >> 16) & 1u) != 0);
  return static_cast<std::uint16_t>((sign | (up ? hi : lo)) >> 16);
}

/// Specials and every rounding case, then random bit patterns of every exponent: a length that is
/// no multiple of any vector, so that the tail runs too.
std::vector<float> inputs() {
  std::vector<std::uint32_t> b = {
      0x00000000u, 0x80000000u,                // +-0
      0x7f800000u, 0xff800000u,                // +-inf
      0x7fc00000u, 0xffc00001u, 0x7f800001u,   // quiet NaNs, a signalling NaN (quieted, payload kept)
      0x7fa5a5a5u, 0xff812345u,                // NaN payloads in the top bits
      0x7f7fffffu, 0xff7fffffu,                // the largest floats: round up to inf
      0x7f7f7fffu, 0x7f7f8000u, 0x7f7e8000u,   // below the tie, the tie to odd (inf), the tie to even
      0x00000001u, 0x807fffffu, 0x00008000u,   // subnormals, a subnormal tie (to even: 0)
      0x00018000u, 0x3f808000u, 0x3f818000u,   // ties to even (up) and odd...
      0x3f807fffu, 0x3f808001u, 0xbf808000u};  // ...and their neighbours, a negative tie
  std::mt19937 rng(dfss::testing::test_seed() + 61);
  for (int i = 0; i < 4093; ++i) b.push_back(static_cast<std::uint32_t>(rng()));
  std::vector<float> x;
  for (const std::uint32_t v : b) x.push_back(std::bit_cast<float>(v));
  return x;
}

std::string hex(std::uint32_t v) {
  char s[16];
  std::snprintf(s, sizeof s, "0x%08x", v);
  return s;
}

TEST(SimdStore, Bf16RowsRoundToNearestEvenLikeTheScalarRounding) {
  const std::vector<float> x = inputs();
  int targets = 0;
  for (const std::int64_t target : hwy::SupportedAndGeneratedTargets()) {
    hwy::SetSupportedTargetsForTest(target);
    for (const std::int64_t stride : {std::int64_t{1}, std::int64_t{3}}) {
      const std::int64_t off = 5;
      std::vector<std::uint16_t> out(static_cast<std::size_t>(off + stride * static_cast<std::int64_t>(x.size())),
                                     0xdeadu);  // poisoned
      if (!HWY_DYNAMIC_DISPATCH(dfss::cpu::simd::store_row_with)(out.data(), dtype::bf16, off, stride,
                                                                   static_cast<int>(x.size()), x.data())) {
        continue;
      }
      targets += stride == 1 ? 1 : 0;
      for (std::int64_t k = 0; k < static_cast<std::int64_t>(out.size()); ++k) {
        if (k < off || (k - off) % stride != 0) {
          ASSERT_EQ(out[static_cast<std::size_t>(k)], 0xdeadu) << "wrote outside the row at " << k;
        }
      }
      for (std::size_t i = 0; i < x.size(); ++i) {
        const std::uint16_t got = out[static_cast<std::size_t>(off + stride * static_cast<std::int64_t>(i))];
        const std::uint32_t u = std::bit_cast<std::uint32_t>(x[i]);
        const std::string where = std::string(hwy::TargetName(target)) + " stride " + std::to_string(stride) +
                                  ": " + hex(u);
        ASSERT_EQ(got, dfss::float_to_bf16(x[i])) << where;
        if (std::isnan(x[i])) {
          // Quiet, same sign, the payload's top bits kept.
          ASSERT_EQ(got, static_cast<std::uint16_t>((u >> 16) | 0x0040u)) << where;
        } else {
          ASSERT_EQ(got, nearest_bf16(x[i])) << where;
        }
      }
    }
  }
  hwy::SetSupportedTargetsForTest(0);  // back to the CPU's own targets
  ASSERT_GT(targets, 0) << "no SIMD target compiled and supported";
}

/// Nearest binary16 to finite @p x, ties to the even pattern, from 65520 (half an ulp above 65504,
/// the largest) on to infinity: a search over the 31744 finite non-negative halves by value.
std::uint16_t nearest_f16(float x) {
  static const std::vector<double> values = [] {
    std::vector<double> v;
    for (std::uint32_t h = 0; h < 0x7c00u; ++h) {
      const int e = static_cast<int>(h >> 10), m = static_cast<int>(h & 0x3ffu);
      v.push_back(e == 0 ? std::ldexp(m, -24) : std::ldexp(1024 + m, e - 25));
    }
    return v;
  }();
  const std::uint16_t sign = std::signbit(x) ? 0x8000u : 0u;
  const double a = std::fabs(static_cast<double>(x));
  if (a >= 65520.0) return static_cast<std::uint16_t>(sign | 0x7c00u);
  const auto it = std::lower_bound(values.begin(), values.end(), a);  // first >= a
  std::uint32_t hi = static_cast<std::uint32_t>(it - values.begin());
  if (hi == values.size() || values[hi] == a) return static_cast<std::uint16_t>(sign | std::min<std::uint32_t>(hi, 0x7bffu));
  const std::uint32_t lo = hi - 1;
  const double below = a - values[lo], above = values[hi] - a;
  const bool up = above < below || (above == below && (lo & 1u) != 0);
  return static_cast<std::uint16_t>(sign | (up ? hi : lo));
}

/// Values in binary16's range: random ones of every exponent from 2^-26 to 2^17, the midpoints of
/// neighbouring halves (ties) and their float neighbours, specials, and the bf16 inputs (mostly far
/// outside it).
std::vector<float> f16_inputs() {
  std::vector<float> x = {0.0f, -0.0f, 65504.0f, 65519.99f, 65520.0f, -65520.0f, 1e-8f, 2.9802322e-8f,
                          std::numeric_limits<float>::infinity(), std::bit_cast<float>(0x7fa5a5a5u),
                          std::bit_cast<float>(0xff812345u), std::bit_cast<float>(0x7fc00000u)};
  std::mt19937 rng(dfss::testing::test_seed() + 67);
  std::uniform_int_distribution<int> exponent(-26, 17);
  std::uniform_real_distribution<float> mantissa(1.0f, 2.0f);
  for (int i = 0; i < 3000; ++i) {
    const float v = std::ldexp(mantissa(rng), exponent(rng));
    x.push_back(rng() % 2 ? v : -v);
  }
  std::uniform_int_distribution<std::uint32_t> pattern(0, 0x7bfeu);
  for (int i = 0; i < 1000; ++i) {
    const std::uint32_t h = pattern(rng);
    const int e = static_cast<int>(h >> 10), m = static_cast<int>(h & 0x3ffu);
    const double lo = e == 0 ? std::ldexp(m, -24) : std::ldexp(1024 + m, e - 25);
    const int e1 = static_cast<int>((h + 1) >> 10), m1 = static_cast<int>((h + 1) & 0x3ffu);
    const double hi = e1 == 0 ? std::ldexp(m1, -24) : std::ldexp(1024 + m1, e1 - 25);
    const float mid = static_cast<float>((lo + hi) / 2);  // exact: 12 significant bits at most
    x.push_back(mid);
    x.push_back(std::nextafter(mid, 0.0f));
    x.push_back(-std::nextafter(mid, 1e9f));
  }
  const std::vector<float> more = inputs();
  x.insert(x.end(), more.begin(), more.end());
  return x;
}

TEST(SimdStore, F16RowsRoundToNearestEvenLikeTheScalarRounding) {
  const std::vector<float> x = f16_inputs();
  for (const std::int64_t target : hwy::SupportedAndGeneratedTargets()) {
    hwy::SetSupportedTargetsForTest(target);
    for (const std::int64_t stride : {std::int64_t{1}, std::int64_t{2}}) {
      std::vector<std::uint16_t> out(static_cast<std::size_t>(stride * static_cast<std::int64_t>(x.size())), 0xdeadu);
      if (!HWY_DYNAMIC_DISPATCH(dfss::cpu::simd::store_row_with)(out.data(), dtype::f16, 0, stride,
                                                                   static_cast<int>(x.size()), x.data())) {
        continue;
      }
      for (std::size_t i = 0; i < x.size(); ++i) {
        const std::uint16_t got = out[static_cast<std::size_t>(stride * static_cast<std::int64_t>(i))];
        const std::string where = std::string(hwy::TargetName(target)) + " stride " + std::to_string(stride) +
                                  ": " + hex(std::bit_cast<std::uint32_t>(x[i]));
        ASSERT_EQ(got, dfss::float_to_f16(x[i])) << where;
        if (std::isnan(x[i])) {
          ASSERT_EQ(got, std::signbit(x[i]) ? 0xfe00u : 0x7e00u) << where;
        } else {
          ASSERT_EQ(got, nearest_f16(x[i])) << where;
        }
        if (stride == 2) {
          ASSERT_EQ(out[2 * i + 1], 0xdeadu) << "wrote between the row's elements";
        }
      }
    }
  }
  hwy::SetSupportedTargetsForTest(0);
}

TEST(SimdStore, Fp32RowsAreCopied) {
  const std::vector<float> x = inputs();
  for (const std::int64_t target : hwy::SupportedAndGeneratedTargets()) {
    hwy::SetSupportedTargetsForTest(target);
    std::vector<float> out(x.size() + 2, 1.5f);
    if (!HWY_DYNAMIC_DISPATCH(dfss::cpu::simd::store_row_with)(out.data(), dtype::f32, 1, 1,
                                                                 static_cast<int>(x.size()), x.data())) {
      continue;
    }
    EXPECT_EQ(out.front(), 1.5f);
    EXPECT_EQ(out.back(), 1.5f);
    for (std::size_t i = 0; i < x.size(); ++i) {
      ASSERT_EQ(std::bit_cast<std::uint32_t>(out[i + 1]), std::bit_cast<std::uint32_t>(x[i]))
          << hwy::TargetName(target) << " at " << i;
    }
  }
  hwy::SetSupportedTargetsForTest(0);
}

}  // namespace
#endif  // HWY_ONCE
