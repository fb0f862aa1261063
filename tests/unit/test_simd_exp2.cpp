// The SIMD kernels' exponential (cpu/simd/kernel_parts-inl.h: exp2_poly, exp2_clamped) on every
// Highway target this build compiled and this CPU runs: against std::exp2 in double, and bitwise
// the same on every target with fused multiply-add (AVX-512 scales by vscalefps, the others by
// adding to the exponent bits; SSE4 rounds each multiply and add of the polynomial separately), so
// that a score weighs the same whichever of those targets the selector picks.
#include "cpu/simd/targets.hpp"  // first: it fixes the compiled targets

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "unit/test_simd_exp2.cpp"
#include "hwy/foreach_target.h"  // IWYU pragma: keep

#include "cpu/simd/kernel_parts-inl.h"

#include <cstddef>

HWY_BEFORE_NAMESPACE();
namespace dfss::cpu::simd::HWY_NAMESPACE {
/// out[i] = exp2_poly(x[i]) (@p clamped: exp2_clamped) for n a multiple of the widest vector.
/// Returns 1 on a target with fused multiply-add, 0 on one without, -1 on the static baseline
/// target, which has no kernels.
int exp2_of(const float* x, float* out, std::size_t n, bool clamped) {
#if DFSS_SIMD_KERNEL_TARGET
  const DF d;
  for (std::size_t i = 0; i < n; i += hn::Lanes(d)) {
    const VF v = hn::LoadU(d, x + i);
    hn::StoreU(clamped ? exp2_clamped(v) : exp2_poly(v), d, out + i);
  }
  return HWY_NATIVE_FMA ? 1 : 0;
#else
  (void)x, (void)out, (void)n, (void)clamped;
  return -1;
#endif
}
}  // namespace dfss::cpu::simd::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "hwy/targets.h"

namespace dfss::cpu::simd {
HWY_EXPORT(exp2_of);
}  // namespace dfss::cpu::simd

namespace {

/// Every 1/2048 from -131 to 127 (fractions near 0 and +-0.5 included), the rounding boundaries'
/// neighbours (k + 0.5 and the floats beside it), and -inf; a multiple of 64 values.
std::vector<float> grid() {
  std::vector<float> x;
  for (int k = -131 * 2048; k <= 127 * 2048; ++k) x.push_back(static_cast<float>(k) / 2048.0f);
  for (int k = -131; k < 127; ++k) {
    const float half = static_cast<float>(k) + 0.5f;
    x.push_back(std::nextafter(half, -1000.0f));
    x.push_back(std::nextafter(half, 1000.0f));
  }
  x.push_back(-std::numeric_limits<float>::infinity());
  while (x.size() % 64 != 0) x.push_back(0.0f);
  return x;
}

struct target_result {
  const char* name;
  bool fma;
  std::vector<float> y;
};

/// The results of exp2_of on each compiled target this CPU runs (the static baseline skipped).
std::vector<target_result> per_target(const std::vector<float>& x, bool clamped) {
  std::vector<target_result> out;
  for (const std::int64_t target : hwy::SupportedAndGeneratedTargets()) {
    hwy::SetSupportedTargetsForTest(target);
    std::vector<float> y(x.size(), std::numeric_limits<float>::quiet_NaN());  // poisoned
    const int kind = HWY_DYNAMIC_DISPATCH(dfss::cpu::simd::exp2_of)(x.data(), y.data(), x.size(), clamped);
    if (kind >= 0) out.push_back({hwy::TargetName(target), kind == 1, std::move(y)});
  }
  hwy::SetSupportedTargetsForTest(0);  // back to the CPU's own targets
  return out;
}

std::uint32_t bits(float v) {
  std::uint32_t b = 0;
  std::memcpy(&b, &v, sizeof b);
  return b;
}

TEST(SimdExp2, MatchesStdExp2AndFlushesBelowMinus125) {
  const std::vector<float> x = grid();
  const auto results = per_target(x, /*clamped=*/false);
  ASSERT_FALSE(results.empty()) << "no SIMD target compiled and supported";
  for (const auto& [name, fma, y] : results) {
    double worst = 0.0;
    for (std::size_t i = 0; i < x.size(); ++i) {
      if (x[i] < -125.0f) {
        ASSERT_EQ(bits(y[i]), 0u) << name << ": exp2(" << x[i] << ") must flush to +0";
        continue;
      }
      const double want = std::exp2(static_cast<double>(x[i]));
      // In ulps of the result: the polynomial's truncation (5e-9 relative) plus the rounding of
      // its seven fp32 FMAs stays within 2 ulp; the forward's weights need no better (the fp64
      // reference tests allow ~1e-6 relative).
      const double ulp = std::ldexp(1.0, std::ilogb(want) - 23);
      const double err = std::fabs(static_cast<double>(y[i]) - want) / ulp;
      worst = std::max(worst, err);
      ASSERT_LE(err, 2.0) << name << ": exp2(" << x[i] << ") = " << y[i] << ", want " << want;
    }
    EXPECT_GT(worst, 0.0) << name << ": an exact exponential on a million points is not this polynomial";
  }
}

TEST(SimdExp2, BitwiseTheSameOnEveryTargetWithFma) {
  const std::vector<float> x = grid();
  for (const bool clamped : {false, true}) {
    std::vector<target_result> results = per_target(x, clamped);
    results.erase(std::remove_if(results.begin(), results.end(), [](const target_result& r) { return !r.fma; }),
                  results.end());
    if (results.size() < 2) {
      GTEST_SKIP() << "this CPU runs fewer than two compiled SIMD targets with FMA: nothing to compare";
    }
    for (std::size_t t = 1; t < results.size(); ++t) {
      for (std::size_t i = 0; i < x.size(); ++i) {
        ASSERT_EQ(bits(results[t].y[i]), bits(results[0].y[i]))
            << (clamped ? "exp2_clamped(" : "exp2_poly(") << x[i] << "): " << results[t].name << " gives "
            << results[t].y[i] << ", " << results[0].name << " " << results[0].y[i];
      }
    }
  }
}

TEST(SimdExp2, ClampedSaturatesAndKeepsNaN) {
  std::vector<float> x(64, 0.0f);
  x[0] = 127.0f;
  x[1] = 200.0f;
  x[2] = std::numeric_limits<float>::infinity();
  x[3] = std::numeric_limits<float>::quiet_NaN();
  x[4] = -std::numeric_limits<float>::infinity();
  for (const auto& [name, fma, y] : per_target(x, /*clamped=*/true)) {
    EXPECT_EQ(y[0], std::ldexp(1.0f, 127)) << name;
    EXPECT_EQ(y[1], std::ldexp(1.0f, 127)) << name << ": above 127 saturates at 2^127";
    EXPECT_EQ(y[2], std::ldexp(1.0f, 127)) << name << ": +inf saturates at 2^127";
    EXPECT_TRUE(std::isnan(y[3])) << name << ": NaN stays NaN";
    EXPECT_EQ(bits(y[4]), 0u) << name << ": -inf gives +0";
  }
}

}  // namespace
#endif  // HWY_ONCE
