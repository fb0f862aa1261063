// fp64 reference forward (see reference.hpp and docs/semantics.md).
#include <new>

#include "core/element_access.hpp"
#include "cpu/parallel.hpp"
#include "ref/reference.hpp"
#include "ref/reference_row.hpp"

namespace dfss::ref {
namespace {

/// All query rows of (batch, head) = task t.
void forward_task(const attention_params& p, kv_block& kv, row_result& r, std::int64_t t) {
  const std::int64_t b = t / p.heads, h = t % p.heads;
  kv.load(p, b, h / (p.heads / p.heads_kv));
  for (std::int64_t i = 0; i < p.seqlen_q; ++i) {
    compute_row(p, kv, b, h, i, r);
    for (std::int64_t c = 0; c < p.head_dim; ++c) {
      core::store_from_double(p.o, p.output_type, core::offset4(p.o_stride, b, i, h, c),
                              r.out[static_cast<std::size_t>(c)]);
    }
    if (p.lse != nullptr) {
      core::store_from_double(p.lse, p.lse_type,
                              b * p.lse_stride[0] + h * p.lse_stride[1] + i * p.lse_stride[2], r.lse);
    }
  }
}

}  // namespace

status reference_forward(const attention_params& p) noexcept {
  // The reference's buffers live for one task: it is the oracle, not a hot path, and keeps nothing
  // between calls.
  try {
    cpu::parallel_for(p.batch * p.heads, p.num_threads, cpu::schedule::contiguous, [] {}, [&](std::int64_t t) {
      kv_block kv;
      row_result r;
      forward_task(p, kv, r, t);
    });
  } catch (const std::bad_alloc&) {
    return {status_code::internal, "dfss reference forward: out of memory"};
  }
  return status::success();
}

}  // namespace dfss::ref
