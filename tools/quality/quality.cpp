// quality/quality.cpp: the baselines and metrics of quality.hpp (fp64, one head at a time).
#include "quality/quality.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <stdexcept>

#include "dfss/format/nm_select.hpp"
#include "dfss/mask/visibility.hpp"

namespace dfss::quality {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

/// splitmix64 (Steele, Lea, Flood 2014): a small generator with a fully specified output, so that
/// random baselines give the same keys and features on every platform and standard library (the
/// std:: distributions are implementation-defined).
class rng {
 public:
  explicit rng(std::uint64_t seed) : state_(seed) {}
  std::uint64_t next() {
    std::uint64_t z = (state_ += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  /// Uniform in [0, n) without modulo bias (rejection of the incomplete last range).
  std::uint64_t below(std::uint64_t n) {
    const std::uint64_t limit = std::numeric_limits<std::uint64_t>::max() - std::numeric_limits<std::uint64_t>::max() % n;
    std::uint64_t x;
    do {
      x = next();
    } while (x >= limit);
    return x % n;
  }
  /// Uniform in (0, 1]: 53 random bits, never 0 (Box-Muller takes its logarithm).
  double unit() { return (static_cast<double>(next() >> 11) + 1.0) * 0x1.0p-53; }
  /// Standard normal (Box-Muller; the second value of each pair is discarded for simplicity).
  double normal() {
    const double r = std::sqrt(-2.0 * std::log(unit()));
    return r * std::cos(2.0 * 3.14159265358979323846 * unit());
  }

 private:
  std::uint64_t state_;
};

/// One seed from several keys: each key is folded in through a splitmix64 step.
std::uint64_t mix(std::initializer_list<std::uint64_t> keys) {
  std::uint64_t h = 0x243F6A8885A308D3ull;
  for (std::uint64_t k : keys) h = rng(h ^ k).next();
  return h;
}

/// Row-wise softmax of scale * x over the finite entries (in place); an all -inf row becomes 0.
void softmax_rows(matrix& x, double scale) {
  for (std::int64_t i = 0; i < x.rows; ++i) {
    double* r = x.row(i);
    const double mx = *std::max_element(r, r + x.cols);
    if (mx == -kInf) {
      std::fill(r, r + x.cols, 0.0);
      continue;
    }
    double z = 0.0;
    for (std::int64_t j = 0; j < x.cols; ++j) {
      r[j] = r[j] == -kInf ? 0.0 : std::exp(scale * (r[j] - mx));
      z += r[j];
    }
    for (std::int64_t j = 0; j < x.cols; ++j) r[j] /= z;
  }
}

/// Scores x y^T of the rows of two matrices with the same column count.
matrix dot_rows(const matrix& x, const matrix& y) {
  matrix s(x.rows, y.rows);
  for (std::int64_t i = 0; i < x.rows; ++i) {
    for (std::int64_t j = 0; j < y.rows; ++j) {
      double acc = 0.0;
      for (std::int64_t c = 0; c < x.cols; ++c) acc += x(i, c) * y(j, c);
      s(i, j) = acc;
    }
  }
  return s;
}

/// Means of m near-equal consecutive row segments of x: segment s is rows [s L / m, (s + 1) L / m).
matrix segment_means(const matrix& x, std::int64_t m) {
  matrix out(m, x.cols);
  for (std::int64_t s = 0; s < m; ++s) {
    const std::int64_t lo = s * x.rows / m, hi = (s + 1) * x.rows / m;
    for (std::int64_t i = lo; i < hi; ++i) {
      for (std::int64_t c = 0; c < x.cols; ++c) out(s, c) += x(i, c);
    }
    for (std::int64_t c = 0; c < x.cols; ++c) out(s, c) /= static_cast<double>(hi - lo);
  }
  return out;
}

/// Start of a window of @p width consecutive keys for query @p i (see select_window).
std::int64_t window_start(std::int64_t i, std::int64_t lq, std::int64_t lk, bool causal, std::int64_t visible,
                          std::int64_t width) {
  if (causal) return visible - width;
  const std::int64_t center = (2 * i + 1) * lk / (2 * lq);
  return std::clamp<std::int64_t>(center - width / 2, 0, lk - width);
}

/// The first @p k of @p n positions of a partial Fisher-Yates shuffle of [0, n).
std::vector<std::int64_t> sample_without_replacement(std::int64_t n, std::int64_t k, rng& g) {
  std::vector<std::int64_t> pool(static_cast<std::size_t>(n));
  std::iota(pool.begin(), pool.end(), std::int64_t{0});
  for (std::int64_t t = 0; t < k; ++t) {
    const auto r = t + static_cast<std::int64_t>(g.below(static_cast<std::uint64_t>(n - t)));
    std::swap(pool[static_cast<std::size_t>(t)], pool[static_cast<std::size_t>(r)]);
  }
  pool.resize(static_cast<std::size_t>(k));
  return pool;
}

std::vector<std::int64_t> all_keys(std::int64_t n) {
  std::vector<std::int64_t> keys(static_cast<std::size_t>(n));
  std::iota(keys.begin(), keys.end(), std::int64_t{0});
  return keys;
}

}  // namespace

std::int64_t visible_keys(std::int64_t i, std::int64_t lq, std::int64_t lk, bool causal) {
  return mask::causal_end(causal, lq, lk, i);
}

std::int64_t nm_budget(std::int64_t visible, pattern p) {
  return visible / p.m * p.n + std::min<std::int64_t>(p.n, visible % p.m);
}

std::vector<std::int64_t> row_budgets(const head& h, pattern p) {
  std::vector<std::int64_t> b(static_cast<std::size_t>(h.lq()));
  for (std::int64_t i = 0; i < h.lq(); ++i) b[static_cast<std::size_t>(i)] = nm_budget(visible_keys(i, h.lq(), h.lk(), h.causal), p);
  return b;
}

matrix scores(const head& h) {
  matrix s = dot_rows(h.q, h.k);
  for (std::int64_t i = 0; i < s.rows; ++i) {
    for (std::int64_t j = visible_keys(i, h.lq(), h.lk(), h.causal); j < s.cols; ++j) s(i, j) = -kInf;
  }
  return s;
}

matrix full_probabilities(const head& h) {
  matrix p = scores(h);
  softmax_rows(p, h.scale);
  return p;
}

matrix full_attention(const head& h) { return matmul(full_probabilities(h), h.v); }

matrix matmul(const matrix& a, const matrix& b) {
  matrix c(a.rows, b.cols);
  for (std::int64_t i = 0; i < a.rows; ++i) {
    double* ci = c.row(i);
    for (std::int64_t p = 0; p < a.cols; ++p) {
      const double aip = a(i, p);
      const double* bp = b.row(p);
      for (std::int64_t j = 0; j < b.cols; ++j) ci[j] += aip * bp[j];
    }
  }
  return c;
}

key_sets select_nm(const matrix& s, pattern p) {
  key_sets keep(static_cast<std::size_t>(s.rows));
  for (std::int64_t i = 0; i < s.rows; ++i) {
    const double* r = s.row(i);
    auto& out = keep[static_cast<std::size_t>(i)];
    for (std::int64_t g0 = 0; g0 < s.cols; g0 += p.m) {
      const int count = static_cast<int>(std::min<std::int64_t>(p.m, s.cols - g0));
      const std::uint32_t mask = nm_select_group(r + g0, count, p.n, p.m);
      for (int q = 0; q < count; ++q) {
        // A kept masked key (-inf) carries no probability: it is not part of the kept set.
        if (((mask >> q) & 1u) && r[g0 + q] != -kInf) out.push_back(g0 + q);
      }
    }
  }
  return keep;
}

key_sets select_topk(const matrix& s, const std::vector<std::int64_t>& budget) {
  key_sets keep(static_cast<std::size_t>(s.rows));
  for (std::int64_t i = 0; i < s.rows; ++i) {
    const double* r = s.row(i);
    std::vector<std::int64_t> idx;
    for (std::int64_t j = 0; j < s.cols; ++j) {
      if (r[j] != -kInf) idx.push_back(j);
    }
    const auto k = std::min<std::int64_t>(budget[static_cast<std::size_t>(i)], static_cast<std::int64_t>(idx.size()));
    std::partial_sort(idx.begin(), idx.begin() + k, idx.end(), [r](std::int64_t a, std::int64_t b) {
      return r[a] > r[b] || (r[a] == r[b] && a < b);
    });
    idx.resize(static_cast<std::size_t>(k));
    std::sort(idx.begin(), idx.end());
    keep[static_cast<std::size_t>(i)] = std::move(idx);
  }
  return keep;
}

key_sets select_window(std::int64_t lq, std::int64_t lk, bool causal, const std::vector<std::int64_t>& budget) {
  key_sets keep(static_cast<std::size_t>(lq));
  for (std::int64_t i = 0; i < lq; ++i) {
    const std::int64_t c = visible_keys(i, lq, lk, causal);
    const std::int64_t w = std::min(budget[static_cast<std::size_t>(i)], c);
    const std::int64_t start = window_start(i, lq, lk, causal, c, w);
    auto& out = keep[static_cast<std::size_t>(i)];
    for (std::int64_t j = start; j < start + w; ++j) out.push_back(j);
  }
  return keep;
}

key_sets select_random(std::int64_t lq, std::int64_t lk, bool causal, const std::vector<std::int64_t>& budget,
                       std::uint64_t seed, std::uint64_t stream) {
  key_sets keep(static_cast<std::size_t>(lq));
  for (std::int64_t i = 0; i < lq; ++i) {
    const std::int64_t c = visible_keys(i, lq, lk, causal);
    rng g(mix({seed, stream, static_cast<std::uint64_t>(i)}));
    auto keys = sample_without_replacement(c, std::min(budget[static_cast<std::size_t>(i)], c), g);
    std::sort(keys.begin(), keys.end());
    keep[static_cast<std::size_t>(i)] = std::move(keys);
  }
  return keep;
}

std::int64_t bigbird_block(std::int64_t k) {
  // BigBird's block size is 64 with 2 global + 3 window + 3 random blocks per query block; shorter
  // budgets keep the 8-block structure with smaller blocks instead of collapsing to fewer blocks.
  std::int64_t b = 64;
  while (b > 1 && 8 * b > k) b /= 2;
  return b;
}

key_sets select_bigbird(std::int64_t lq, std::int64_t lk, bool causal, const std::vector<std::int64_t>& budget,
                        std::uint64_t seed, std::uint64_t stream) {
  key_sets keep(static_cast<std::size_t>(lq));
  for (std::int64_t i = 0; i < lq; ++i) {
    const std::int64_t c = visible_keys(i, lq, lk, causal);
    const std::int64_t k = std::min(budget[static_cast<std::size_t>(i)], c);
    auto& out = keep[static_cast<std::size_t>(i)];
    if (k == c) {
      out = all_keys(c);
      continue;
    }
    std::vector<char> taken(static_cast<std::size_t>(c), 0);
    std::int64_t count = 0;
    auto take = [&](std::int64_t j) {
      if (count < k && !taken[static_cast<std::size_t>(j)]) {
        taken[static_cast<std::size_t>(j)] = 1;
        ++count;
      }
    };
    // BigBird's 2 global : 3 window : 3 random blocks, as shares of the key budget.
    const std::int64_t n_window = 3 * k / 8, n_global = k / 4;
    const std::int64_t start = window_start(i, lq, lk, causal, c, n_window);
    for (std::int64_t j = start; j < start + n_window; ++j) take(j);
    for (std::int64_t j = 0; j < c && count < n_window + n_global; ++j) take(j);
    // Random aligned key blocks, the same draw for every row of a query block (as in BigBird); a
    // drawn block contributes its untaken keys until the budget is met. The blocks cover [0, c), so
    // the budget k < c is always met.
    const std::int64_t b = bigbird_block(k);
    const std::int64_t blocks = (c + b - 1) / b;
    rng g(mix({seed, stream, static_cast<std::uint64_t>(i / b)}));
    const auto order = sample_without_replacement(blocks, blocks, g);
    for (std::int64_t blk : order) {
      for (std::int64_t j = blk * b; j < std::min(c, (blk + 1) * b); ++j) take(j);
      if (count == k) break;
    }
    for (std::int64_t j = 0; j < c; ++j) {
      if (taken[static_cast<std::size_t>(j)]) out.push_back(j);
    }
  }
  return keep;
}

matrix sparse_attention(const head& h, const key_sets& keep) {
  const std::int64_t d = h.v.cols;
  matrix o(h.lq(), d);
  std::vector<double> e;
  for (std::int64_t i = 0; i < h.lq(); ++i) {
    const auto& ks = keep[static_cast<std::size_t>(i)];
    if (ks.empty()) continue;
    e.assign(ks.size(), 0.0);
    double mx = -kInf;
    for (std::size_t t = 0; t < ks.size(); ++t) {
      double acc = 0.0;
      for (std::int64_t c = 0; c < h.q.cols; ++c) acc += h.q(i, c) * h.k(ks[t], c);
      e[t] = acc;
      mx = std::max(mx, acc);
    }
    double z = 0.0;
    for (double& x : e) z += (x = std::exp(h.scale * (x - mx)));
    double* oi = o.row(i);
    for (std::size_t t = 0; t < ks.size(); ++t) {
      const double p = e[t] / z;
      const double* vj = h.v.row(ks[t]);
      for (std::int64_t c = 0; c < d; ++c) oi[c] += p * vj[c];
    }
  }
  return o;
}

std::vector<double> kept_mass(const matrix& p, const key_sets& keep) {
  std::vector<double> mass(static_cast<std::size_t>(p.rows), 0.0);
  for (std::int64_t i = 0; i < p.rows; ++i) {
    for (std::int64_t j : keep[static_cast<std::size_t>(i)]) mass[static_cast<std::size_t>(i)] += p(i, j);
  }
  return mass;
}

matrix performer_attention(const head& h, std::int64_t features, std::uint64_t seed, std::uint64_t stream) {
  if (features < 1) throw std::invalid_argument("performer_attention: features must be >= 1");
  const std::int64_t d = h.q.cols, m = features, dv = h.v.cols;
  // Orthogonal random features: blocks of d Gaussian rows orthonormalised by Gram-Schmidt, each row
  // then scaled to the norm of an independent Gaussian d-vector, so every w is marginally N(0, I)
  // (unbiased estimator) while the rows of a block are exactly orthogonal (lower variance).
  rng g(mix({seed, stream}));
  matrix w(m, d);
  for (std::int64_t b0 = 0; b0 < m; b0 += d) {
    matrix blk(d, d);
    for (auto& x : blk.a) x = g.normal();
    for (std::int64_t r = 0; r < d; ++r) {
      for (std::int64_t p = 0; p < r; ++p) {
        double dot = 0.0;
        for (std::int64_t c = 0; c < d; ++c) dot += blk(r, c) * blk(p, c);
        for (std::int64_t c = 0; c < d; ++c) blk(r, c) -= dot * blk(p, c);
      }
      double nrm = 0.0;
      for (std::int64_t c = 0; c < d; ++c) nrm += blk(r, c) * blk(r, c);
      nrm = std::sqrt(nrm);
      for (std::int64_t c = 0; c < d; ++c) blk(r, c) /= nrm;
    }
    for (std::int64_t r = 0; r < d && b0 + r < m; ++r) {
      double len = 0.0;
      for (std::int64_t c = 0; c < d; ++c) {
        const double z = g.normal();
        len += z * z;
      }
      len = std::sqrt(len);
      for (std::int64_t c = 0; c < d; ++c) w(b0 + r, c) = len * blk(r, c);
    }
  }
  // log phi(x) up to a stabiliser: w . x - |x|^2 / 2 with x = sqrt(scale) row. The queries'
  // stabiliser (per row) and the keys' (one for all keys) cancel in the ratio, as in FAVOR+.
  const double rs = std::sqrt(h.scale);
  auto log_features = [&](const matrix& x) {
    matrix f(x.rows, m);
    for (std::int64_t i = 0; i < x.rows; ++i) {
      double nrm2 = 0.0;
      for (std::int64_t c = 0; c < d; ++c) nrm2 += rs * x(i, c) * rs * x(i, c);
      for (std::int64_t r = 0; r < m; ++r) {
        double dot = 0.0;
        for (std::int64_t c = 0; c < d; ++c) dot += w(r, c) * rs * x(i, c);
        f(i, r) = dot - 0.5 * nrm2;
      }
    }
    return f;
  };
  matrix fq = log_features(h.q), fk = log_features(h.k);
  for (std::int64_t i = 0; i < fq.rows; ++i) {
    double* r = fq.row(i);
    const double mx = *std::max_element(r, r + m);
    for (std::int64_t t = 0; t < m; ++t) r[t] = std::exp(r[t] - mx);
  }
  const double kmax = fk.a.empty() ? 0.0 : *std::max_element(fk.a.begin(), fk.a.end());
  for (double& x : fk.a) x = std::exp(x - kmax);
  // Prefix sums over keys: kv = sum_j phi(k_j) v_j^T [m, dv], ks = sum_j phi(k_j) [m]. Visible key
  // counts never decrease with the row, so one pass serves causal and non-causal heads alike.
  matrix kv(m, dv);
  std::vector<double> ks(static_cast<std::size_t>(m), 0.0);
  matrix o(h.lq(), dv);
  std::int64_t added = 0;
  for (std::int64_t i = 0; i < h.lq(); ++i) {
    const std::int64_t c = visible_keys(i, h.lq(), h.lk(), h.causal);
    for (; added < c; ++added) {
      for (std::int64_t t = 0; t < m; ++t) {
        const double f = fk(added, t);
        ks[static_cast<std::size_t>(t)] += f;
        for (std::int64_t e = 0; e < dv; ++e) kv(t, e) += f * h.v(added, e);
      }
    }
    if (c == 0) continue;
    double den = 0.0;
    for (std::int64_t t = 0; t < m; ++t) den += fq(i, t) * ks[static_cast<std::size_t>(t)];
    if (den <= 0.0) continue;  // every feature product underflowed: no estimate, the row stays 0
    for (std::int64_t t = 0; t < m; ++t) {
      const double f = fq(i, t) / den;
      for (std::int64_t e = 0; e < dv; ++e) o(i, e) += f * kv(t, e);
    }
  }
  return o;
}

matrix nystrom_attention(const head& h, std::int64_t landmarks, int iterations) {
  if (h.causal) throw std::invalid_argument("nystrom_attention: Nystromformer has no causal form");
  if (landmarks < 1) throw std::invalid_argument("nystrom_attention: landmarks must be >= 1");
  const std::int64_t m = std::min({landmarks, h.lq(), h.lk()});
  const matrix ql = segment_means(h.q, m), kl = segment_means(h.k, m);
  matrix f = dot_rows(h.q, kl), a = dot_rows(ql, kl), b = dot_rows(ql, h.k);
  softmax_rows(f, h.scale);
  softmax_rows(a, h.scale);
  softmax_rows(b, h.scale);
  // Z0 = A^T / (||A||_1 ||A||_inf), then Z <- Z (13 I - A Z (15 I - A Z (7 I - A Z))) / 4 (Razavi
  // et al. 2014, as in the Nystromformer code).
  double norm1 = 0.0, norm_inf = 0.0;
  for (std::int64_t j = 0; j < m; ++j) {
    double col = 0.0, row = 0.0;
    for (std::int64_t i = 0; i < m; ++i) {
      col += std::abs(a(i, j));
      row += std::abs(a(j, i));
    }
    norm1 = std::max(norm1, col);
    norm_inf = std::max(norm_inf, row);
  }
  matrix z(m, m);
  for (std::int64_t i = 0; i < m; ++i) {
    for (std::int64_t j = 0; j < m; ++j) z(i, j) = a(j, i) / (norm1 * norm_inf);
  }
  auto c_minus = [m](double c, const matrix& x) {
    matrix r(m, m);
    for (std::int64_t i = 0; i < m; ++i) {
      for (std::int64_t j = 0; j < m; ++j) r(i, j) = (i == j ? c : 0.0) - x(i, j);
    }
    return r;
  };
  for (int it = 0; it < iterations; ++it) {
    const matrix az = matmul(a, z);
    const matrix inner = matmul(az, c_minus(15.0, matmul(az, c_minus(7.0, az))));
    z = matmul(z, c_minus(13.0, inner));
    for (double& x : z.a) x *= 0.25;
  }
  return matmul(f, matmul(z, matmul(b, h.v)));
}

void error_sums::add(const matrix& approx, const matrix& exact) {
  for (std::size_t t = 0; t < exact.a.size(); ++t) {
    const double dlt = approx.a[t] - exact.a[t];
    diff2 += dlt * dlt;
    ref2 += exact.a[t] * exact.a[t];
  }
}

double error_sums::relative() const {
  if (ref2 == 0.0) return diff2 == 0.0 ? 0.0 : kInf;
  return std::sqrt(diff2 / ref2);
}

double relative_error(const matrix& approx, const matrix& exact) {
  error_sums e;
  e.add(approx, exact);
  return e.relative();
}

double cosine(const double* a, const double* b, std::int64_t n) {
  double ab = 0.0, aa = 0.0, bb = 0.0;
  for (std::int64_t t = 0; t < n; ++t) {
    ab += a[t] * b[t];
    aa += a[t] * a[t];
    bb += b[t] * b[t];
  }
  if (aa == 0.0 && bb == 0.0) return 1.0;
  if (aa == 0.0 || bb == 0.0) return 0.0;
  return ab / (std::sqrt(aa) * std::sqrt(bb));
}

double percentile(std::vector<double> values, double pct) {
  if (values.empty()) return std::numeric_limits<double>::quiet_NaN();
  std::sort(values.begin(), values.end());
  const double pos = pct / 100.0 * static_cast<double>(values.size() - 1);
  const auto lo = static_cast<std::size_t>(std::floor(pos));
  const std::size_t hi = std::min(lo + 1, values.size() - 1);
  const double frac = pos - static_cast<double>(lo);
  return values[lo] + frac * (values[hi] - values[lo]);
}

double mean(const std::vector<double>& values) {
  if (values.empty()) return std::numeric_limits<double>::quiet_NaN();
  return std::accumulate(values.begin(), values.end(), 0.0) / static_cast<double>(values.size());
}

const char* method_name(method m) noexcept {
  switch (m) {
    case method::dfss: return "dfss";
    case method::topk: return "topk";
    case method::window: return "window";
    case method::random: return "random";
    case method::bigbird: return "bigbird";
    case method::performer: return "performer";
    case method::nystrom: return "nystrom";
  }
  return "?";
}

method parse_method(const std::string& text, const std::string& argument) {
  for (method m : {method::dfss, method::topk, method::window, method::random, method::bigbird, method::performer,
                   method::nystrom}) {
    if (text == method_name(m)) return m;
  }
  throw std::invalid_argument("argument '" + argument + "': expected one of dfss, topk, window, random, bigbird, "
                              "performer, nystrom, got '" + text + "'");
}

bool is_sparse(method m) noexcept { return m != method::performer && m != method::nystrom; }

}  // namespace dfss::quality
