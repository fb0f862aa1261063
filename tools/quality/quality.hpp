// quality/quality.hpp: approximation quality of DFSS next to other efficient attentions.
//
// Everything here works on one attention head at a time, in fp64, with row-major matrices:
// Q [Lq, d], K [Lk, d], V [Lk, d]. The exact function is full softmax attention
// O = softmax(scale Q K^T) V with an optional bottom-right aligned causal mask (query i sees the keys
// j < visible_keys(i)). Every approximation is measured against it:
//
//   - sparse methods keep a set of keys per row and take the softmax over the kept keys only:
//     DFSS (the N:M selection rule of dfss/format/nm_select.hpp on the exact scores), exact top-k,
//     a local window, uniformly random keys, and a BigBird-like block-sparse set (window + global +
//     random blocks). All of them keep the same number of keys in a row: the row's N:M budget, the
//     number of keys DFSS keeps there (N per full group of M visible keys, min(N, r) for a last
//     group of r visible keys; c N / M when M divides the c visible keys).
//   - dense approximations: Performer's FAVOR+ (positive orthogonal random features) and
//     Nystromformer (segment-mean landmarks, iterative Moore-Penrose pseudo-inverse).
//
// Metrics: relative output error ||O_approx - O||_F / ||O||_F, cosine similarity of output rows,
// and for sparse methods the kept softmax mass of a row (the sum of the full-softmax probabilities
// of its kept keys; the semantics page bounds the row's output error by 2 (1 - mass) max |v|).
//
// No framework: plain std::vector, so that each baseline can be unit-tested on its own.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "dfss/types.hpp"

namespace dfss::quality {

/// @brief A dense row-major matrix of doubles.
struct matrix {
  std::int64_t rows = 0, cols = 0;
  std::vector<double> a;

  matrix() = default;
  matrix(std::int64_t r, std::int64_t c, double fill = 0.0)
      : rows(r), cols(c), a(static_cast<std::size_t>(r * c), fill) {}
  double& operator()(std::int64_t i, std::int64_t j) { return a[static_cast<std::size_t>(i * cols + j)]; }
  double operator()(std::int64_t i, std::int64_t j) const { return a[static_cast<std::size_t>(i * cols + j)]; }
  const double* row(std::int64_t i) const { return a.data() + i * cols; }
  double* row(std::int64_t i) { return a.data() + i * cols; }
};

/// @brief One attention head: Q [Lq, d], K [Lk, d], V [Lk, d], a resolved (positive) scale and the
/// causal flag (bottom-right aligned, as in dfss::attention_config).
struct head {
  matrix q, k, v;
  double scale = 1.0;
  bool causal = false;

  std::int64_t lq() const { return q.rows; }
  std::int64_t lk() const { return k.rows; }
};

/// @brief Keys visible to query row @p i: all @p lk keys, or with @p causal those of the causal
/// window (dfss::mask::causal_end, the library's one rule). Visible keys are always the prefix
/// [0, count).
std::int64_t visible_keys(std::int64_t i, std::int64_t lq, std::int64_t lk, bool causal);

/// @brief Keys DFSS keeps out of @p visible visible keys (a prefix of the row) with pattern @p p:
/// N per full group of M, min(N, r) for a last partial group of r visible keys.
std::int64_t nm_budget(std::int64_t visible, pattern p);

/// @brief The budget of every row of @p h: nm_budget(visible_keys(i), p).
std::vector<std::int64_t> row_budgets(const head& h, pattern p);

/// @brief Unscaled scores S = Q K^T [Lq, Lk]; masked entries are -inf.
matrix scores(const head& h);

/// @brief Full softmax probabilities softmax(scale S) [Lq, Lk] over the visible keys (0 elsewhere;
/// a row without visible keys is all 0).
matrix full_probabilities(const head& h);

/// @brief Exact attention O = P V [Lq, d] (rows without visible keys are 0).
matrix full_attention(const head& h);

/// @brief The product A B of A [n, k] and B [k, m] (e.g. O = P V from full_probabilities).
matrix matmul(const matrix& a, const matrix& b);

/// @brief Kept keys of every row, each list in increasing key order.
using key_sets = std::vector<std::vector<std::int64_t>>;

/// @brief DFSS: the N:M selection of dfss/format/nm_select.hpp on the masked scores @p s
/// (from scores()), groups aligned at key 0, ties to the lower key index.
key_sets select_nm(const matrix& s, pattern p);

/// @brief Exact top-k: the budget[i] largest scores of row i among its visible keys (ties to the
/// lower key index). The best sparse set of that size: no other set keeps more softmax mass.
key_sets select_topk(const matrix& s, const std::vector<std::int64_t>& budget);

/// @brief Local window of budget[i] consecutive keys. Without a causal mask the window is centred
/// on key floor((i + 1/2) Lk / Lq) (the diagonal when Lq = Lk) and shifted to stay inside [0, Lk);
/// with one it is the budget[i] most recent visible keys.
key_sets select_window(std::int64_t lq, std::int64_t lk, bool causal, const std::vector<std::int64_t>& budget);

/// @brief budget[i] distinct keys drawn uniformly from the visible keys of row i (partial
/// Fisher-Yates), from a generator seeded by (@p seed, @p stream, i).
key_sets select_random(std::int64_t lq, std::int64_t lk, bool causal, const std::vector<std::int64_t>& budget,
                       std::uint64_t seed, std::uint64_t stream);

/// @brief BigBird-like block-sparse keys (Zaheer et al. 2020, ITC): of a row's budget k, 3/8 (rounded
/// down) go to a local window of consecutive keys (placed as in select_window), 1/4 to global keys
/// (the first visible keys), and the rest to random aligned key blocks of size bigbird_block(k),
/// drawn without replacement per query block of that size from the blocks still holding untaken
/// keys (seeded by @p seed, @p stream and the query block), so exactly k keys are kept.
key_sets select_bigbird(std::int64_t lq, std::int64_t lk, bool causal, const std::vector<std::int64_t>& budget,
                        std::uint64_t seed, std::uint64_t stream);

/// @brief Block size of select_bigbird for a budget of @p k keys: BigBird's 64, halved until a row
/// holds at least 8 blocks (BigBird's 2 global + 3 window + 3 random), at least 1.
std::int64_t bigbird_block(std::int64_t k);

/// @brief Sparse attention: softmax(scale S) restricted to the keys of @p keep (renormalised), times
/// V. Rows with no kept key are 0.
matrix sparse_attention(const head& h, const key_sets& keep);

/// @brief Kept softmax mass of every row: sum of @p p (from full_probabilities) over the kept keys.
std::vector<double> kept_mass(const matrix& p, const key_sets& keep);

/// @brief Performer FAVOR+ (Choromanski et al. 2021): positive random features
/// phi(x) = exp(w . x - |x|^2 / 2) / sqrt(m) of x = sqrt(scale) q and sqrt(scale) k, with @p features
/// orthogonal Gaussian directions w (blocks of d orthonormal rows, each scaled by the norm of an
/// independent Gaussian d-vector), seeded by (@p seed, @p stream). O_i = phi(q_i) sum_j phi(k_j) v_j /
/// phi(q_i) sum_j phi(k_j) over the visible keys; with a causal mask through prefix sums.
/// Requires features >= 1.
matrix performer_attention(const head& h, std::int64_t features, std::uint64_t seed, std::uint64_t stream);

/// @brief Default iteration count of nystrom_attention's pseudo-inverse: 6, the official
/// Nystromformer code's default (the method as published, not a converged pseudo-inverse).
inline constexpr int kNystromIterations = 6;

/// @brief Nystromformer (Xiong et al. 2021): m = min(@p landmarks, Lq, Lk) landmarks, the means of
/// m near-equal consecutive segments of Q and of K; O = softmax(s Q K~^T) Z softmax(s Q~ K^T) V with
/// Z the iterative pseudo-inverse of softmax(s Q~ K~^T) after @p iterations steps from
/// Z0 = A^T / (||A||_1 ||A||_inf). Non-causal only: throws std::invalid_argument with a causal head
/// (the method has no causal form). Requires landmarks >= 1.
matrix nystrom_attention(const head& h, std::int64_t landmarks, int iterations = kNystromIterations);

/// @brief Sum of squared differences and of squared reference entries (for a Frobenius relative
/// error accumulated over heads).
struct error_sums {
  double diff2 = 0.0, ref2 = 0.0;
  void add(const matrix& approx, const matrix& exact);
  /// sqrt(diff2 / ref2); 0 when both are 0, +inf when only the reference is 0.
  double relative() const;
};

/// @brief ||approx - exact||_F / ||exact||_F (see error_sums::relative).
double relative_error(const matrix& approx, const matrix& exact);

/// @brief Cosine similarity of @p n-vectors a and b: a.b / (|a| |b|); 1 when both are zero, 0 when
/// exactly one is.
double cosine(const double* a, const double* b, std::int64_t n);

/// @brief The @p pct percentile (0..100) of @p values with linear interpolation between the closest
/// ranks (NumPy's default): position pct/100 (n - 1) of the sorted values. NaN when empty.
double percentile(std::vector<double> values, double pct);

/// @brief Mean of @p values; NaN when empty.
double mean(const std::vector<double>& values);

/// @brief The methods of the quality table, in table order.
enum class method : int { dfss, topk, window, random, bigbird, performer, nystrom };

/// @brief "dfss", "topk", "window", "random", "bigbird", "performer", "nystrom".
const char* method_name(method m) noexcept;
/// @brief Parses a method name; throws std::invalid_argument naming @p argument otherwise.
method parse_method(const std::string& text, const std::string& argument);
/// @brief True for the methods that keep a set of keys per row (they report a kept mass).
bool is_sparse(method m) noexcept;

}  // namespace dfss::quality
