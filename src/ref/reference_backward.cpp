// fp64 reference backward (see reference.hpp and docs/semantics.md): the selection is held fixed,
//   dV = P^T dO,  dP = dO V^T on kept entries,  dS = P * (dP - rowsum(dO * O) + dLSE),
//   dQ = scale * dS K,  dK = scale * dS^T Q,  dBias = scale * dS (summed over broadcast dimensions).
#include <limits>
#include <new>
#include <vector>

#include "core/element_access.hpp"
#include "cpu/parallel.hpp"
#include "ref/reference.hpp"
#include "ref/reference_row.hpp"

namespace dfss::ref {
namespace {

/// Whether key @p j enters row @p r: kept and not masked. A kept key whose score is -inf (masked,
/// in a group with fewer than N visible keys) has P = 0 and is skipped, not multiplied by 0, as in
/// the forward's O = P V (docs/design.md): a NaN row, or a NaN in V or dO, must not reach a masked
/// key's gradient through 0 * NaN.
bool contributes(const row_result& r, std::int64_t j) {
  return r.kept[static_cast<std::size_t>(j)] && r.s[static_cast<std::size_t>(j)] != -std::numeric_limits<double>::infinity();
}

/// dS of one row (gradient with respect to scale * S_kept), 0 where not kept or masked.
void row_dscore(const attention_params& p, const kv_block& kv, const row_result& r, std::int64_t b,
                std::int64_t h, std::int64_t i, std::vector<double>& dout, std::vector<double>& ds) {
  const std::int64_t L = p.seqlen_k, d = p.head_dim;
  dout.resize(static_cast<std::size_t>(d));
  double rowdot = 0.0;
  for (std::int64_t c = 0; c < d; ++c) {
    const double g = core::load_as_double(p.dout, p.input_type, core::offset4(p.dout_stride, b, i, h, c));
    dout[static_cast<std::size_t>(c)] = g;
    rowdot += g * r.out[static_cast<std::size_t>(c)];
  }
  // d LSE / d (scale s_j) = P_j: a gradient of the LSE adds P * dLSE to dS.
  if (p.dlse != nullptr) {
    rowdot -= core::load_as_double(p.dlse, p.lse_type, b * p.dlse_stride[0] + h * p.dlse_stride[1] + i * p.dlse_stride[2]);
  }
  ds.assign(static_cast<std::size_t>(L), 0.0);
  for (std::int64_t j = 0; j < L; ++j) {
    if (!contributes(r, j)) continue;
    double dp = 0.0;
    for (std::int64_t c = 0; c < d; ++c) dp += dout[static_cast<std::size_t>(c)] * kv.v[static_cast<std::size_t>(j * d + c)];
    ds[static_cast<std::size_t>(j)] = r.prob[static_cast<std::size_t>(j)] * (dp - rowdot);
  }
}

/// dQ of every query head of kv head (b, hk) and the dK, dV of that kv head (task t).
void backward_qkv_task(const attention_params& p, kv_block& kv, row_result& r, std::vector<double>& dout,
                       std::vector<double>& ds, std::vector<double>& dq, std::vector<double>& dk,
                       std::vector<double>& dv, std::int64_t t) {
  const std::int64_t group = p.heads / p.heads_kv;
  const std::int64_t L = p.seqlen_k, d = p.head_dim;
  const std::int64_t b = t / p.heads_kv, hk = t % p.heads_kv;
  kv.load(p, b, hk);
  dk.assign(static_cast<std::size_t>(L * d), 0.0);
  dv.assign(static_cast<std::size_t>(L * d), 0.0);
  for (std::int64_t h = hk * group; h < (hk + 1) * group; ++h) {
    for (std::int64_t i = 0; i < p.seqlen_q; ++i) {
      compute_row(p, kv, b, h, i, r);
      row_dscore(p, kv, r, b, h, i, dout, ds);
      dq.assign(static_cast<std::size_t>(d), 0.0);
      for (std::int64_t j = 0; j < L; ++j) {
        if (!contributes(r, j)) continue;
        const double sj = ds[static_cast<std::size_t>(j)] * p.scale;
        const double pj = r.prob[static_cast<std::size_t>(j)];
        for (std::int64_t c = 0; c < d; ++c) {
          const auto jc = static_cast<std::size_t>(j * d + c);
          dq[static_cast<std::size_t>(c)] += sj * kv.k[jc];
          dk[jc] += sj * r.q[static_cast<std::size_t>(c)];
          dv[jc] += pj * dout[static_cast<std::size_t>(c)];
        }
      }
      for (std::int64_t c = 0; c < d; ++c) {
        core::store_from_double(p.dq, p.output_type, core::offset4(p.dq_stride, b, i, h, c),
                                dq[static_cast<std::size_t>(c)]);
      }
    }
  }
  for (std::int64_t j = 0; j < L; ++j) {
    for (std::int64_t c = 0; c < d; ++c) {
      const auto jc = static_cast<std::size_t>(j * d + c);
      core::store_from_double(p.dk, p.output_type, core::offset4(p.dk_stride, b, j, hk, c), dk[jc]);
      core::store_from_double(p.dv, p.output_type, core::offset4(p.dv_stride, b, j, hk, c), dv[jc]);
    }
  }
}

/// Parallel over (batch, kv head); the buffers live for one task.
void backward_qkv(const attention_params& p) {
  cpu::parallel_for(p.batch * p.heads_kv, p.num_threads, cpu::schedule::contiguous, [] {}, [&](std::int64_t t) {
    kv_block kv;
    row_result r;
    std::vector<double> dout, ds, dq, dk, dv;
    backward_qkv_task(p, kv, r, dout, ds, dq, dk, dv, t);
  });
}

/// dBias rows: each row of dbias sums scale * dS over the (batch, head) pairs it broadcasts to,
/// in increasing (batch, head) order (task t = one (bias batch, bias head) slice).
void backward_bias_task(const attention_params& p, kv_block& kv, row_result& r, std::vector<double>& dout,
                        std::vector<double>& ds, std::vector<double>& acc, std::int64_t t) {
  const std::int64_t group = p.heads / p.heads_kv;
  const std::int64_t bb_count = p.dbias_stride[0] == 0 ? 1 : p.batch;
  const std::int64_t hb_count = p.dbias_stride[1] == 0 ? 1 : p.heads;
  const std::int64_t bb = t / hb_count, hb = t % hb_count;
  const std::int64_t b_lo = bb_count == 1 ? 0 : bb, b_hi = bb_count == 1 ? p.batch : bb + 1;
  const std::int64_t h_lo = hb_count == 1 ? 0 : hb, h_hi = hb_count == 1 ? p.heads : hb + 1;
  for (std::int64_t i = 0; i < p.seqlen_q; ++i) {
    acc.assign(static_cast<std::size_t>(p.seqlen_k), 0.0);
    for (std::int64_t b = b_lo; b < b_hi; ++b) {
      for (std::int64_t h = h_lo; h < h_hi; ++h) {
        kv.load(p, b, h / group);
        compute_row(p, kv, b, h, i, r);
        row_dscore(p, kv, r, b, h, i, dout, ds);
        for (std::int64_t j = 0; j < p.seqlen_k; ++j) {
          acc[static_cast<std::size_t>(j)] += p.scale * ds[static_cast<std::size_t>(j)];
        }
      }
    }
    for (std::int64_t j = 0; j < p.seqlen_k; ++j) {
      core::store_from_double(p.dbias, p.bias_type,
                              bb * p.dbias_stride[0] + hb * p.dbias_stride[1] + i * p.dbias_stride[2] +
                                  j * p.dbias_stride[3],
                              acc[static_cast<std::size_t>(j)]);
    }
  }
}

/// Parallel over the (batch, head) slices of dbias; the buffers live for one task.
void backward_bias(const attention_params& p) {
  const std::int64_t tasks = (p.dbias_stride[0] == 0 ? 1 : p.batch) * (p.dbias_stride[1] == 0 ? 1 : p.heads);
  cpu::parallel_for(tasks, p.num_threads, cpu::schedule::contiguous, [] {}, [&](std::int64_t t) {
    kv_block kv;
    row_result r;
    std::vector<double> dout, ds, acc;
    backward_bias_task(p, kv, r, dout, ds, acc, t);
  });
}

}  // namespace

status reference_backward(const attention_params& p) noexcept {
  try {
    backward_qkv(p);
    if (p.dbias != nullptr) backward_bias(p);
  } catch (const std::bad_alloc&) {
    return {status_code::internal, "dfss reference backward: out of memory"};
  }
  return status::success();
}

}  // namespace dfss::ref
