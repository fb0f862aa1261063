// Near ties as far apart as the rounding bounds allow: keys whose N:M selection the fp32
// micro-kernel's order of additions (one per column, from column 0: the fused forward's, which the
// fused backward recomputes) decides against the exact scores. Kernels that score in another order
// (the decode step's lanes, the AMX tiles) must settle such groups in the micro-kernel's order
// (settle_near_ties, select_amx); these keys tell a settling bound a few times too small from the
// right one, which near ties of a few ulps cannot.
#pragma once

#include <algorithm>
#include <cstdint>
#include <random>
#include <vector>

namespace dfss::testing {

/// Query row, keys and the keys the micro-kernel's order keeps (make_rounding_contest).
struct rounding_contest {
  std::vector<double> q_row;  // d values, for every query row
  std::vector<double> k;      // Lk rows of d
  std::vector<bool> kept;     // per key
};

/// Keys for 1:2 (@p m = 2) or 2:4 (@p m = 4), d >= 8, every value a bf16 (so fp32 and bf16 inputs
/// score alike). With B = 6144 = 1.5 2^12 (fp32 ulp 2^-11 there), n = d - 1 and s = @p q_small (a
/// power of two; 2^-14 by default):
/// - q_0 = 1, q_c = s (c >= 1): the decode step's bound E = gamma_d max|k| sum|q| is about
///   d 2^-24 B (1 + n s) ulp-wise 0.75 d (1 + n s) ulp: 96.7 ulp at d = 128 with s = 2^-14;
/// - a key "up": k_0 = B, k_c = t / s (c >= 1), t = (0.5 + 2^-7) ulp: exact score B + 0.508 n ulp,
///   and the micro-kernel rounds every addition up: B + n ulp;
/// - a key "down": k_0 = B, k_1 = g ulp / s, k_c = -t / s (c >= 2): exact B + g - 0.508 (n - 1)
///   ulp, micro-kernel B + g - (n - 1) ulp;
/// - with 2:4 also a key "high" (k_1 = 4 d ulp / s: exact in any order, kept) and one "low"
///   (k_1 = -2 d ulp / s: pruned), so that "up" and "down" contest the second place.
/// g is drawn in [0.92 (2n - 1), 2n - 6]: the exact order (and any order whose rounding stays a few
/// ulps from it) ranks "down" first by 0.41 to 0.50 (2n - 1) ulp, and the micro-kernel "up" first
/// by 5 to 0.08 (2n - 1) ulp; every two exact scores of a group are further apart than that. A
/// small s keeps sum|q| (the decode step's bound) near 1, s = 1 keeps sum|k| (select_amx's per-key
/// bound, max|q| sum|k|) near B: each test takes the one that makes its kernel's bound tightest.
inline rounding_contest make_rounding_contest(int m, std::int64_t Lk, std::int64_t d, std::mt19937_64& rng,
                                              double q_small = 1.0 / 16384.0) {
  const double B = 6144.0, ulp = 1.0 / 2048.0, t = (0.5 + 1.0 / 128.0) * ulp / q_small;
  const std::int64_t n = d - 1;
  std::uniform_int_distribution<std::int64_t> offset((92 * (2 * n - 1) + 99) / 100, 2 * n - 6);
  rounding_contest c;
  c.q_row.assign(static_cast<std::size_t>(d), q_small);
  c.q_row[0] = 1.0;
  c.k.assign(static_cast<std::size_t>(Lk * d), 0.0);
  c.kept.assign(static_cast<std::size_t>(Lk), false);
  enum class kind { up, down, high, low };
  for (std::int64_t g0 = 0; g0 < Lk; g0 += m) {
    std::vector<kind> group = {kind::up, kind::down};
    if (m == 4) group = {kind::up, kind::down, kind::high, kind::low};
    std::shuffle(group.begin(), group.end(), rng);
    for (std::int64_t x = 0; x < m && g0 + x < Lk; ++x) {
      const kind kj = group[static_cast<std::size_t>(x)];
      double* row = c.k.data() + (g0 + x) * d;
      row[0] = B;
      for (std::int64_t col = 1; col < d; ++col) row[col] = kj == kind::up ? t : (kj == kind::down ? -t : 0.0);
      // Offsets of whole ulps through column 1.
      if (kj == kind::down) row[1] = static_cast<double>(offset(rng)) * ulp / q_small;
      if (kj == kind::high) row[1] = static_cast<double>(4 * d) * ulp / q_small;
      if (kj == kind::low) row[1] = -static_cast<double>(2 * d) * ulp / q_small;
      c.kept[static_cast<std::size_t>(g0 + x)] = kj == kind::up || kj == kind::high;
    }
  }
  return c;
}

}  // namespace dfss::testing
