// fp64 reference forward (see reference.hpp and dfss-semantics.md).
#include <omp.h>

#include "core/element_access.hpp"
#include "ref/reference.hpp"
#include "ref/reference_row.hpp"

namespace dfss::ref {

status reference_forward(const attention_params& p) noexcept {
  try {
    const std::int64_t group = p.heads / p.heads_kv;
    const std::int64_t tasks = p.batch * p.heads;
    const int threads = p.num_threads > 0 ? p.num_threads : omp_get_max_threads();
#pragma omp parallel num_threads(threads)
    {
      kv_block kv;
      row_result r;
#pragma omp for schedule(static)
      for (std::int64_t t = 0; t < tasks; ++t) {
        const std::int64_t b = t / p.heads, h = t % p.heads;
        kv.load(p, b, h / group);
        for (std::int64_t i = 0; i < p.seqlen_q; ++i) {
          compute_row(p, kv, b, h, i, r);
          for (std::int64_t c = 0; c < p.head_dim; ++c) {
            core::store_from_double(p.o, p.output_type, core::offset4(p.o_stride, b, i, h, c),
                                    r.out[static_cast<std::size_t>(c)]);
          }
          if (p.lse != nullptr) {
            core::store_from_double(p.lse, p.lse_type,
                                    b * p.lse_stride[0] + h * p.lse_stride[1] + i * p.lse_stride[2],
                                    r.lse);
          }
        }
      }
    }
  } catch (const std::exception& e) {
    return {status_code::internal, std::string("dfss reference forward: ") + e.what()};
  }
  return status::success();
}

}  // namespace dfss::ref
