// 16-bit conversions checked exhaustively against an independent formula (ldexp arithmetic).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>

#include "dfss/numeric.hpp"

namespace dfss {
namespace {

/// binary16 value by definition: (-1)^s * 2^(e-15) * (1 + m/1024), subnormals 2^-14 * m/1024.
double half_by_definition(std::uint16_t h) {
  const int s = h >> 15, e = (h >> 10) & 0x1f, m = h & 0x3ff;
  double v;
  if (e == 0x1f) v = m ? std::numeric_limits<double>::quiet_NaN() : std::numeric_limits<double>::infinity();
  else if (e == 0) v = std::ldexp(m / 1024.0, -14);
  else v = std::ldexp(1.0 + m / 1024.0, e - 15);
  return s ? -v : v;
}

TEST(Numeric, HalfToFloatExhaustive) {
  for (std::uint32_t h = 0; h < 65536; ++h) {
    const double want = half_by_definition(static_cast<std::uint16_t>(h));
    const double got = static_cast<double>(f16_to_float(static_cast<std::uint16_t>(h)));
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got)) << h;
    } else {
      EXPECT_EQ(got, want) << h;
      EXPECT_EQ(std::signbit(got), std::signbit(want)) << h;
    }
  }
}

TEST(Numeric, FloatToHalfRoundsToNearestEven) {
  // Every finite half round-trips; the midpoint between two neighbours rounds to the even one; a
  // value just above or below the midpoint rounds to the nearer one.
  for (std::uint32_t h = 0; h < 0x7c00; ++h) {
    const auto a = static_cast<std::uint16_t>(h);
    const float fa = f16_to_float(a);
    EXPECT_EQ(float_to_f16(fa), a) << h;
    EXPECT_EQ(float_to_f16(-fa), a | 0x8000) << h;
    if (h + 1 < 0x7c00) {
      const float fb = f16_to_float(static_cast<std::uint16_t>(h + 1));
      const double mid = (static_cast<double>(fa) + static_cast<double>(fb)) / 2;
      const auto even = static_cast<std::uint16_t>((h & 1) ? h + 1 : h);
      EXPECT_EQ(float_to_f16(static_cast<float>(mid)), even) << h;
      EXPECT_EQ(float_to_f16(std::nextafter(static_cast<float>(mid), fb)), h + 1) << h;
      EXPECT_EQ(float_to_f16(std::nextafter(static_cast<float>(mid), fa)), a) << h;
    }
  }
  EXPECT_EQ(float_to_f16(65520.0f), 0x7c00);  // the first value that rounds to infinity
  EXPECT_EQ(float_to_f16(65519.99f), 0x7bff);
  EXPECT_EQ(float_to_f16(std::numeric_limits<float>::infinity()), 0x7c00);
  EXPECT_EQ(float_to_f16(1e-9f), 0x0000);
  EXPECT_TRUE(std::isnan(f16_to_float(float_to_f16(std::numeric_limits<float>::quiet_NaN()))));
}

TEST(Numeric, BFloat16RoundsToNearestEven) {
  for (std::uint32_t b = 0; b < 0x7f80; ++b) {
    const auto a = static_cast<std::uint16_t>(b);
    const float fa = bf16_to_float(a);
    EXPECT_EQ(float_to_bf16(fa), a) << b;
    const float fb = bf16_to_float(static_cast<std::uint16_t>(b + 1));
    const double mid = (static_cast<double>(fa) + static_cast<double>(fb)) / 2;
    EXPECT_EQ(float_to_bf16(static_cast<float>(mid)), (b & 1) ? b + 1 : b) << b;
  }
  EXPECT_TRUE(std::isnan(bf16_to_float(float_to_bf16(std::numeric_limits<float>::quiet_NaN()))));
  // A NaN whose payload sits only in the low bits must not round to infinity.
  EXPECT_TRUE(std::isnan(bf16_to_float(float_to_bf16(bits_float(0x7f800001u)))));
}

}  // namespace
}  // namespace dfss
