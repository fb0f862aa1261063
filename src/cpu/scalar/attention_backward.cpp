// Generic scalar fused DFSS backward: the portable twin of the SIMD backwards.
//
// Per (batch, kv head): for every query row of the heads sharing that kv head, the forward's key
// tiles go through the forward's score function (scalar::tile_scores, one compiled instance for
// both directions, so the backward keeps exactly the forward's keys); then per kept key
// P = exp(scale s - LSE) from the forward's LSE (or, for |LSE| > kDirectLseLimit, from the row's
// own maximum and sum), dS = P (dO . v_j - rowsum(dO O)), and dQ, dK, dV, dBias accumulate in a
// fixed order (heads, rows, keys), bitwise identical for any thread count. A dBias with broadcast
// dimensions gets a second pass over its rows (scalar_dbias_task).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <new>
#include <vector>

#include "core/element_access.hpp"
#include "cpu/fused_common.hpp"
#include "cpu/parallel.hpp"
#include "cpu/scalar/attention.hpp"
#include "cpu/scalar/tile_scores.hpp"
#include "dfss/numeric.hpp"

namespace dfss::cpu {
namespace {

using scalar::kKeyTile;
using scalar::load;

/// Whether dbias is summed over a broadcast batch or head dimension (then it is written by its own
/// pass, scalar_backward_dbias, instead of by the (batch, kv head) tasks).
bool dbias_broadcast(const attention_params& p) {
  return p.dbias != nullptr && ((p.dbias_stride[0] == 0 && p.batch > 1) || (p.dbias_stride[1] == 0 && p.heads > 1));
}

/// The per-row inputs of the backward: the fp32 query and dO rows, D = rowsum(dO * O) summed in
/// increasing c (less dLSE when given), and the forward's LSE.
template <typename T>
void scalar_row_inputs(const attention_params& p, std::int64_t b, std::int64_t h, std::int64_t i, float* q, float* dout,
                       float& rowsum_do, float& lse) {
  rowsum_do = 0.0f;
  for (std::int64_t c = 0; c < p.head_dim; ++c) {
    q[c] = load<T>(p.q, core::offset4(p.q_stride, b, i, h, c));
    dout[c] = load<T>(p.dout, core::offset4(p.dout_stride, b, i, h, c));
    rowsum_do += dout[c] * static_cast<float>(core::load_as_double(p.o, p.o_type, core::offset4(p.o_stride, b, i, h, c)));
  }
  lse = static_cast<float>(
      core::load_as_double(p.lse, p.lse_type, b * p.lse_stride[0] + h * p.lse_stride[1] + i * p.lse_stride[2]));
  // dS = P (dP - D + dLSE): a gradient of the LSE enters as D - dLSE.
  if (p.dlse != nullptr) {
    rowsum_do -= static_cast<float>(
        core::load_as_double(p.dlse, p.lse_type, b * p.dlse_stride[0] + h * p.dlse_stride[1] + i * p.dlse_stride[2]));
  }
}

/// One query row of the backward: recomputes the row's scores and selection with the forward's
/// scalar::tile_scores, then calls visit(j, P_j, scale dS_j) for every kept key j with P_j != 0 in
/// increasing j, dS = P (dO . v_j - D); @p v_row(j) gives v_j in fp32. P = exp(scale s - LSE) from
/// the forward's LSE while |LSE| <= kDirectLseLimit; otherwise (large or overflowed scores,
/// docs/semantics.md "Non-finite and extreme inputs") a first pass finds the row's maximum m and
/// sum l and P = exp(scale (s - m) - log l). An empty row visits nothing; keys at or past the mask
/// limit are never kept with a finite score, so their tiles are skipped. In a NaN row (LSE NaN, or a
/// NaN or +inf kept score) every kept key that is not masked gets P and dS NaN, so the NaN reaches
/// exactly the gradients the reference's does. Returns whether the row is NaN.
template <typename T, typename VRow, typename Visit>
bool scalar_backward_row(const attention_params& p, std::int64_t b, std::int64_t h, std::int64_t i, const float* q,
                         const float* dout, float rowsum_do, float lse, VRow&& v_row, Visit&& visit) {
  const std::int64_t d = p.head_dim, L = p.seqlen_k;
  const std::int64_t tile = (kKeyTile + p.pattern_m - 1) / p.pattern_m * p.pattern_m;
  const float scale = static_cast<float>(p.scale);
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const float inf = std::numeric_limits<float>::infinity();
  float s[kKeyTile + 16];
  bool row_nan = lse != lse;
  const std::int64_t lim = core::visible_end(p, b, i);
  float shift = 0.0f, offset = lse;  // P = exp(scale (s - shift) - offset)
  if (!row_nan && !(std::abs(lse) <= fused::kDirectLseLimit)) {
    float mx = neg_inf, sum = 0.0f;
    for (std::int64_t j0 = 0; j0 < lim; j0 += tile) {
      const std::int64_t width = L - j0 < tile ? L - j0 : tile;
      row_nan |= scalar::tile_scores<T>(p, q, b, h, i, j0, width, lim, s);
      for (std::int64_t x = 0; x < width; ++x) {
        if (s[x] == neg_inf) continue;
        row_nan |= s[x] == inf;
        if (s[x] > mx) {
          sum = mx == neg_inf ? 0.0f : sum * std::exp(scale * (mx - s[x]));
          mx = s[x];
        }
        sum += std::exp(scale * (s[x] - mx));
      }
    }
    if (row_nan) {
      offset = std::numeric_limits<float>::quiet_NaN();
    } else {
      shift = mx;
      offset = mx == neg_inf ? neg_inf : std::log(sum);
    }
  }
  for (std::int64_t j0 = 0; j0 < (offset == neg_inf ? 0 : lim); j0 += tile) {
    const std::int64_t width = L - j0 < tile ? L - j0 : tile;
    row_nan |= scalar::tile_scores<T>(p, q, b, h, i, j0, width, lim, s);
    for (std::int64_t x = 0; x < width; ++x) {
      if (s[x] == neg_inf) continue;  // pruned or masked: never contributes
      const float pj = row_nan ? std::numeric_limits<float>::quiet_NaN() : std::exp(scale * (s[x] - shift) - offset);
      if (pj == 0.0f) continue;  // underflowed: no contribution, as in the forward's P V
      const std::int64_t j = j0 + x;
      const float* vrow = v_row(j);
      float dp = 0.0f;
      for (std::int64_t c = 0; c < d; ++c) dp += dout[c] * vrow[c];
      visit(j, pj, scale * (pj * (dp - rowsum_do)));
    }
  }
  return row_nan;
}

/// Per-worker scratch of the scalar backward (cpu::worker_scratch, kept between calls): the fp32 K
/// and V rows of one (batch, kv head) and their gradient accumulators, [seqlen_k][head_dim] each.
struct scalar_backward_scratch {
  std::vector<float> k, v, dk, dv;
};

/// Backward of kv head (b, hk) (task t): dQ (and dBias without broadcast dimensions) of every query
/// head of its group, then its dK and dV.
template <typename T>
void scalar_backward_task(const attention_params& p, scalar_backward_scratch& ws, std::int64_t t) {
  const std::int64_t d = p.head_dim, L = p.seqlen_k;
  const std::int64_t group = p.heads / p.heads_kv;
  const std::int64_t b = t / p.heads_kv, hk = t % p.heads_kv;
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const bool write_dbias = p.dbias != nullptr && !dbias_broadcast(p);
  const auto kv_size = static_cast<std::size_t>(L * d);
  ws.k.resize(kv_size);
  ws.v.resize(kv_size);
  ws.dk.assign(kv_size, 0.0f);
  ws.dv.assign(kv_size, 0.0f);
  for (std::int64_t j = 0; j < L; ++j) {
    for (std::int64_t c = 0; c < d; ++c) {
      ws.k[static_cast<std::size_t>(j * d + c)] = load<T>(p.k, core::offset4(p.k_stride, b, j, hk, c));
      ws.v[static_cast<std::size_t>(j * d + c)] = load<T>(p.v, core::offset4(p.v_stride, b, j, hk, c));
    }
  }
  float q[512], dout[512], dq[512];
  for (std::int64_t h = hk * group; h < (hk + 1) * group; ++h) {
    for (std::int64_t i = 0; i < p.seqlen_q; ++i) {
      float rowsum_do = 0.0f, lse = 0.0f;
      scalar_row_inputs<T>(p, b, h, i, q, dout, rowsum_do, lse);
      std::fill(dq, dq + d, 0.0f);
      const std::int64_t dbias_row = b * p.dbias_stride[0] + h * p.dbias_stride[1] + i * p.dbias_stride[2];
      if (write_dbias) {
        for (std::int64_t j = 0; j < L; ++j) core::store_from_double(p.dbias, p.bias_type, dbias_row + j * p.dbias_stride[3], 0.0);
      }
      const bool row_nan = scalar_backward_row<T>(
          p, b, h, i, q, dout, rowsum_do, lse, [&](std::int64_t j) { return ws.v.data() + j * d; },
          [&](std::int64_t j, float pj, float sds) {
            const float* krow = ws.k.data() + j * d;
            float* dkrow = ws.dk.data() + j * d;
            float* dvrow = ws.dv.data() + j * d;
            for (std::int64_t c = 0; c < d; ++c) {
              dq[c] += sds * krow[c];
              dkrow[c] += sds * q[c];
              dvrow[c] += pj * dout[c];
            }
            if (write_dbias) {
              core::store_from_double(p.dbias, p.bias_type, dbias_row + j * p.dbias_stride[3], static_cast<double>(sds));
            }
          });
      // A NaN row's dQ is NaN; its dK, dV and dBias are NaN at the keys it kept (the visits).
      for (std::int64_t c = 0; c < d; ++c) {
        core::store_from_double(p.dq, p.output_type, core::offset4(p.dq_stride, b, i, h, c),
                                static_cast<double>(row_nan ? nan : dq[c]));
      }
    }
  }
  for (std::int64_t j = 0; j < L; ++j) {
    for (std::int64_t c = 0; c < d; ++c) {
      const auto at = static_cast<std::size_t>(j * d + c);
      core::store_from_double(p.dk, p.output_type, core::offset4(p.dk_stride, b, j, hk, c),
                              static_cast<double>(ws.dk[at]));
      core::store_from_double(p.dv, p.output_type, core::offset4(p.dv_stride, b, j, hk, c),
                              static_cast<double>(ws.dv[at]));
    }
  }
}

/// One row (bb, hb, i) of a dbias with broadcast dimensions (task t): the sum of scale dS over the
/// (batch, head) pairs it broadcasts to, in increasing (batch, head) order, in fp32.
template <typename T>
void scalar_dbias_task(const attention_params& p, std::vector<float>& acc, std::int64_t t) {
  const std::int64_t d = p.head_dim, L = p.seqlen_k;
  const std::int64_t group = p.heads / p.heads_kv;
  const std::int64_t hb_count = p.dbias_stride[1] == 0 ? 1 : p.heads;
  const std::int64_t i = t % p.seqlen_q, hb = (t / p.seqlen_q) % hb_count, bb = t / (p.seqlen_q * hb_count);
  const std::int64_t b_lo = p.dbias_stride[0] == 0 ? 0 : bb, b_hi = p.dbias_stride[0] == 0 ? p.batch : bb + 1;
  const std::int64_t h_lo = hb_count == 1 ? 0 : hb, h_hi = hb_count == 1 ? p.heads : hb + 1;
  acc.assign(static_cast<std::size_t>(L), 0.0f);
  float q[512], dout[512], vrow[512];
  for (std::int64_t b = b_lo; b < b_hi; ++b) {
    for (std::int64_t h = h_lo; h < h_hi; ++h) {
      const std::int64_t hk = h / group;
      float rowsum_do = 0.0f, lse = 0.0f;
      scalar_row_inputs<T>(p, b, h, i, q, dout, rowsum_do, lse);
      scalar_backward_row<T>(
          p, b, h, i, q, dout, rowsum_do, lse,
          [&](std::int64_t j) {
            for (std::int64_t c = 0; c < d; ++c) vrow[c] = load<T>(p.v, core::offset4(p.v_stride, b, j, hk, c));
            return static_cast<const float*>(vrow);
          },
          [&](std::int64_t j, float, float sds) { acc[static_cast<std::size_t>(j)] += sds; });
    }
  }
  const std::int64_t row = bb * p.dbias_stride[0] + hb * p.dbias_stride[1] + i * p.dbias_stride[2];
  for (std::int64_t j = 0; j < L; ++j) {
    core::store_from_double(p.dbias, p.bias_type, row + j * p.dbias_stride[3], static_cast<double>(acc[static_cast<std::size_t>(j)]));
  }
}

/// Per-worker scratch of the broadcast dBias pass: one row of sums.
struct scalar_dbias_scratch {
  std::vector<float> acc;
};

/// Parallel over (batch, kv head): each task owns its dK, dV rows and its heads' dQ (and dBias)
/// rows, so no two threads write the same element and the summation order is fixed. A dbias with
/// broadcast dimensions then gets its own pass, parallel over its rows, each summed by one thread
/// in a fixed order. False when an allocation failed.
template <typename T>
bool scalar_backward(const attention_params& p) {
  try {
    parallel_for(p.batch * p.heads_kv, p.num_threads, schedule::contiguous, [] {}, [&](std::int64_t t) {
      scalar_backward_task<T>(p, worker_scratch<scalar_backward_scratch>(), t);
    });
    if (!dbias_broadcast(p)) return true;
    const std::int64_t rows =
        (p.dbias_stride[0] == 0 ? 1 : p.batch) * (p.dbias_stride[1] == 0 ? 1 : p.heads) * p.seqlen_q;
    parallel_for(rows, p.num_threads, schedule::contiguous, [] {}, [&](std::int64_t t) {
      scalar_dbias_task<T>(p, worker_scratch<scalar_dbias_scratch>().acc, t);
    });
  } catch (const std::bad_alloc&) {
    return false;
  }
  return true;
}

}  // namespace

status fused_backward_scalar(const attention_params& p) noexcept {
  if (p.head_dim > 512) {
    return {status_code::unsupported, "dfss cpu scalar backward: head_dim above 512"};
  }
  if (p.o == nullptr || p.lse == nullptr) {
    return {status_code::internal, "dfss cpu scalar backward: called without the forward's output and LSE"};
  }
  bool ok = false;
  switch (p.input_type) {
    case dtype::f32: ok = scalar_backward<float>(p); break;
    case dtype::f16: ok = scalar_backward<half>(p); break;
    case dtype::bf16: ok = scalar_backward<bfloat16>(p); break;
    default:
      return {status_code::unsupported, std::string("dfss cpu scalar backward: input type ") + dtype_name(p.input_type) +
                                            " (the cpu backend takes f32, f16 and bf16; use the reference backend for f64)"};
  }
  if (!ok) return {status_code::internal, "dfss cpu scalar backward: out of memory for the fp32 keys and values"};
  return status::success();
}

}  // namespace dfss::cpu
