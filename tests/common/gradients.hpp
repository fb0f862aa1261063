// Comparison of a CPU backward's gradients with the fp64 reference, shared by the backward suites.
//
// Tolerance policy: on small-integer inputs the scores, hence the selections, are exact; gradients
// then differ from fp64 only by fp32 rounding in exp, the D = rowsum(dO O) dot product and sums over
// `terms` terms (Lk for dQ, group * Lq for dK and dV), each bounded by the largest gradient
// magnitude: (64 + terms) * eps_f32 * (1 + max |reference grad|), plus half an ulp of a 16-bit
// output type.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "dfss/types.hpp"

namespace dfss::testing {

inline constexpr double kEps32 = 1.0 / (1 << 23);

inline double max_abs(const std::vector<double>& x) {
  double m = 0;
  for (double v : x) m = std::max(m, std::abs(v));
  return m;
}

inline void expect_grad_close(const std::vector<double>& got, const std::vector<double>& want, double terms,
                              dtype out, const std::string& what) {
  const double ulp_out = out == dtype::f16 ? 1.0 / 1024 : (out == dtype::bf16 ? 1.0 / 128 : 0.0);
  const double tol = ((64.0 + terms) * kEps32 + ulp_out) * (1.0 + max_abs(want));
  ASSERT_EQ(got.size(), want.size()) << what;
  double err = 0;
  for (std::size_t x = 0; x < got.size(); ++x) {
    // The outputs were poisoned with NaN before the call: a finite value means it was written.
    ASSERT_TRUE(std::isfinite(got[x])) << what << " at " << x;
    err = std::max(err, std::abs(got[x] - want[x]));
  }
  EXPECT_LE(err, tol) << what;
}

}  // namespace dfss::testing
