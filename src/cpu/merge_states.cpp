// dfss::merge_attention_states on the CPU: per (batch, row, head), the log-sum-exp merge of two
// partial results in fp32 (f64 for f64 outputs). See include/dfss/merge.hpp for the row rules.
#include "cpu/merge_states.hpp"

#include <cmath>
#include <limits>
#include <new>
#include <vector>

#include "core/element_access.hpp"
#include "cpu/parallel.hpp"

namespace dfss::cpu {
namespace {

/// Rows per task: enough to amortise the task hand-out, few enough to spread short merges (decode:
/// B * H rows of one query) over the threads.
constexpr std::int64_t kRowsPerTask = 64;

template <typename Acc>
void merge_row(const merge_params& p, std::int64_t b, std::int64_t l, std::int64_t h, std::vector<Acc>& oa,
               std::vector<Acc>& ob) {
  const std::int64_t d = p.head_dim;
  const auto lse_at = [&](const void* base, const std::int64_t* s) {
    return static_cast<Acc>(core::load_as_double(base, p.lse_type, b * s[0] + h * s[1] + l * s[2]));
  };
  const Acc la = lse_at(p.lse_a, p.lse_a_stride), lb = lse_at(p.lse_b, p.lse_b_stride);
  bool nan = std::isnan(la) || std::isnan(lb);
  // Both rows are read whole before anything is written: out may be out_a.
  for (std::int64_t c = 0; c < d; ++c) {
    oa[static_cast<std::size_t>(c)] = static_cast<Acc>(core::load_as_double(p.out_a, p.out_type, core::offset4(p.out_a_stride, b, l, h, c)));
    ob[static_cast<std::size_t>(c)] = static_cast<Acc>(core::load_as_double(p.out_b, p.out_type, core::offset4(p.out_b_stride, b, l, h, c)));
    nan = nan || std::isnan(oa[static_cast<std::size_t>(c)]) || std::isnan(ob[static_cast<std::size_t>(c)]);
  }
  constexpr Acc inf = std::numeric_limits<Acc>::infinity();
  Acc lse, wa, wb;
  if (nan || (la == inf && lb == inf)) {
    // NaN anywhere, or two overflowed parts whose weights are unknown: a NaN row.
    lse = nan ? std::numeric_limits<Acc>::quiet_NaN() : inf;
    wa = wb = std::numeric_limits<Acc>::quiet_NaN();
  } else if (la == -inf && lb == -inf) {
    lse = -inf;  // two empty parts: an empty row, O = 0
    wa = wb = 0;
  } else {
    // Weights exp(LSE_x - LSE) = sigmoid(+-(LSE_a - LSE_b)), formed from the larger LSE so that
    // nothing overflows; an infinite difference gives the weights 1 and 0 exactly.
    const Acc m = la > lb ? la : lb;
    const Acc ea = la == m ? Acc(1) : std::exp(la - m), eb = lb == m && la != m ? Acc(1) : std::exp(lb - m);
    const Acc sum = ea + eb;
    lse = m == inf ? inf : m + std::log(sum);
    wa = ea / sum;
    wb = eb / sum;
  }
  for (std::int64_t c = 0; c < d; ++c) {
    const Acc x = wa * oa[static_cast<std::size_t>(c)] + wb * ob[static_cast<std::size_t>(c)];
    core::store_from_double(p.out, p.out_type, core::offset4(p.out_stride, b, l, h, c), static_cast<double>(x));
  }
  core::store_from_double(p.lse, p.lse_type, b * p.lse_stride[0] + h * p.lse_stride[1] + l * p.lse_stride[2],
                          static_cast<double>(lse));
}

template <typename Acc>
void merge_all(const merge_params& p) {
  const std::int64_t rows = p.batch * p.seqlen * p.heads;
  const std::int64_t tasks = (rows + kRowsPerTask - 1) / kRowsPerTask;
  struct scratch {
    std::vector<Acc> oa, ob;
  };
  parallel_for(
      tasks, p.num_threads, schedule::contiguous,
      [&] {
        scratch& s = worker_scratch<scratch>();
        s.oa.resize(static_cast<std::size_t>(p.head_dim));
        s.ob.resize(static_cast<std::size_t>(p.head_dim));
      },
      [&](std::int64_t t) {
        scratch& s = worker_scratch<scratch>();
        const std::int64_t end = (t + 1) * kRowsPerTask < rows ? (t + 1) * kRowsPerTask : rows;
        for (std::int64_t r = t * kRowsPerTask; r < end; ++r) {
          // Row r is (b, l, h) in O's [B, L, H] order.
          const std::int64_t h = r % p.heads, l = (r / p.heads) % p.seqlen, b = r / (p.heads * p.seqlen);
          merge_row<Acc>(p, b, l, h, s.oa, s.ob);
        }
      });
}

}  // namespace

status merge_states(const merge_params& p) noexcept {
  try {
    if (p.out_type == dtype::f64) {
      merge_all<double>(p);
    } else {
      merge_all<float>(p);
    }
  } catch (const std::bad_alloc&) {
    return {status_code::internal, "dfss::merge_attention_states: out of memory for the per-thread scratch"};
  }
  return {};
}

}  // namespace dfss::cpu
