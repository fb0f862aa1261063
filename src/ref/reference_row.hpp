// One query row of the reference: scores, masks, N:M selection and softmax in fp64.
// Shared by the reference forward and backward so that both use exactly the same selection.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "core/element_access.hpp"
#include "dfss/format/nm_select.hpp"
#include "dfss/params.hpp"

namespace dfss::ref {

/// Keys and values of one (batch, kv head) widened to double: [seqlen_k][head_dim] each.
struct kv_block {
  std::vector<double> k, v;

  void load(const attention_params& p, std::int64_t b, std::int64_t hk) {
    const std::int64_t n = p.seqlen_k * p.head_dim;
    k.resize(static_cast<std::size_t>(n));
    v.resize(static_cast<std::size_t>(n));
    for (std::int64_t j = 0; j < p.seqlen_k; ++j) {
      for (std::int64_t c = 0; c < p.head_dim; ++c) {
        const auto at = static_cast<std::size_t>(j * p.head_dim + c);
        k[at] = core::load_as_double(p.k, p.input_type, core::offset4(p.k_stride, b, j, hk, c));
        v[at] = core::load_as_double(p.v, p.input_type, core::offset4(p.v_stride, b, j, hk, c));
      }
    }
  }
};

/// The state of one query row after the forward: kept mask, probabilities, output and LSE.
struct row_result {
  std::vector<double> q;       ///< [head_dim] the query, widened
  std::vector<double> s;       ///< [seqlen_k] masked scores (before scale); -inf when masked
  std::vector<unsigned char> kept;  ///< [seqlen_k] 1 where the N:M selection keeps the key
  std::vector<double> prob;    ///< [seqlen_k] softmax probabilities (0 where not kept)
  std::vector<double> out;     ///< [head_dim]
  double lse = 0.0;            ///< log-sum-exp of scale * kept scores; -inf for an empty row
};

/// @brief Computes row @p i of (batch @p b, head @p h) per docs/semantics.md.
inline void compute_row(const attention_params& p, const kv_block& kv, std::int64_t b, std::int64_t h,
                        std::int64_t i, row_result& r) {
  const std::int64_t L = p.seqlen_k, d = p.head_dim;
  r.q.resize(static_cast<std::size_t>(d));
  r.s.assign(static_cast<std::size_t>(L), 0.0);
  r.kept.assign(static_cast<std::size_t>(L), 0);
  r.prob.assign(static_cast<std::size_t>(L), 0.0);
  r.out.assign(static_cast<std::size_t>(d), 0.0);
  for (std::int64_t c = 0; c < d; ++c) {
    r.q[static_cast<std::size_t>(c)] =
        core::load_as_double(p.q, p.input_type, core::offset4(p.q_stride, b, i, h, c));
  }
  const double neg_inf = -std::numeric_limits<double>::infinity();
  const std::int64_t end = core::visible_end(p, b, i);  // keys [0, end) are visible

  // 1-2. Scores and masks.
  for (std::int64_t j = 0; j < L; ++j) {
    double acc = 0.0;
    for (std::int64_t c = 0; c < d; ++c) acc += r.q[static_cast<std::size_t>(c)] * kv.k[static_cast<std::size_t>(j * d + c)];
    if (p.bias != nullptr) {
      acc += core::load_as_double(p.bias, p.bias_type,
                                  b * p.bias_stride[0] + h * p.bias_stride[1] +
                                      i * p.bias_stride[2] + j * p.bias_stride[3]);
    }
    if (j >= end) acc = neg_inf;
    r.s[static_cast<std::size_t>(j)] = acc;
  }

  // 3. Selection in aligned groups of M keys (a partial last group is padded with -inf); groups
  // of the sink and recent windows are kept whole.
  const int n = p.pattern_n, m = p.pattern_m;
  const mask::whole_groups whole = core::whole_groups(p, b, i);
  for (std::int64_t g0 = 0; g0 < L; g0 += m) {
    const int count = static_cast<int>(L - g0 < m ? L - g0 : m);
    const std::uint32_t keep =
        mask::group_is_whole(whole, g0) ? (1u << count) - 1u : nm_select_group<double>(r.s.data() + g0, count, n, m);
    for (int t = 0; t < count; ++t) r.kept[static_cast<std::size_t>(g0 + t)] = (keep >> t) & 1u;
  }

  // 4. Softmax over kept entries. The row is empty when every kept score is -inf; a NaN score
  // makes the maximum NaN and so propagates to the whole row.
  double mx = neg_inf;
  bool any = false;
  for (std::int64_t j = 0; j < L; ++j) {
    if (!r.kept[static_cast<std::size_t>(j)]) continue;
    const double sj = r.s[static_cast<std::size_t>(j)];
    if (sj != neg_inf) any = true;
    if (std::isnan(sj)) {
      mx = sj;
    } else if (!std::isnan(mx) && sj > mx) {
      mx = sj;
    }
  }
  if (!any) {
    r.lse = neg_inf;
    return;
  }
  double sum = 0.0;
  for (std::int64_t j = 0; j < L; ++j) {
    if (!r.kept[static_cast<std::size_t>(j)]) continue;
    const double e = std::exp(p.scale * (r.s[static_cast<std::size_t>(j)] - mx));
    r.prob[static_cast<std::size_t>(j)] = e;
    sum += e;
  }
  for (std::int64_t j = 0; j < L; ++j) r.prob[static_cast<std::size_t>(j)] /= sum;
  r.lse = p.scale * mx + std::log(sum);

  // 5. O = P V over kept keys only. A pruned key, or a kept key whose score is -inf (masked), has
  // P = 0 and never enters the row, so a NaN in its value row cannot leak in as 0 * NaN.
  for (std::int64_t j = 0; j < L; ++j) {
    if (!r.kept[static_cast<std::size_t>(j)] || r.s[static_cast<std::size_t>(j)] == neg_inf) continue;
    const double pj = r.prob[static_cast<std::size_t>(j)];
    for (std::int64_t c = 0; c < d; ++c) r.out[static_cast<std::size_t>(c)] += pj * kv.v[static_cast<std::size_t>(j * d + c)];
  }
}

}  // namespace dfss::ref
