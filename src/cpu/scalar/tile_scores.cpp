// The scalar kernels' score function (see tile_scores.hpp): one compiled instance per element type,
// called by both directions.
#include "cpu/scalar/tile_scores.hpp"

#include <cmath>
#include <limits>

#include "core/element_access.hpp"
#include "dfss/format/nm_select.hpp"

namespace dfss::cpu::scalar {

template <typename T>
[[gnu::noinline]] bool tile_scores(const attention_params& p, const float* q, std::int64_t b, std::int64_t h,
                                   std::int64_t i, std::int64_t j0, std::int64_t width, std::int64_t end, float* s) {
  const std::int64_t d = p.head_dim;
  const std::int64_t hk = h / (p.heads / p.heads_kv);
  const int n = p.pattern_n, m = p.pattern_m;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  for (std::int64_t t = 0; t < width; ++t) {
    const std::int64_t j = j0 + t;
    float dot = 0.0f;
    for (std::int64_t c = 0; c < d; ++c) dot += q[c] * load<T>(p.k, core::offset4(p.k_stride, b, j, hk, c));
    if (p.bias != nullptr) {
      dot += static_cast<float>(core::load_as_double(
          p.bias, p.bias_type, b * p.bias_stride[0] + h * p.bias_stride[1] + i * p.bias_stride[2] + j * p.bias_stride[3]));
    }
    s[t] = j >= end ? neg_inf : dot;
  }
  bool nan_seen = false;
  const mask::whole_groups whole = core::whole_groups(p, b, i);
  for (std::int64_t g = 0; g < width; g += m) {
    const int count = static_cast<int>(width - g < m ? width - g : m);
    const std::uint32_t keep =
        mask::group_is_whole(whole, j0 + g) ? (1u << count) - 1u : nm_select_group<float>(s + g, count, n, m);
    for (int t = 0; t < count; ++t) {
      if (!((keep >> t) & 1u)) s[g + t] = neg_inf;
      else if (std::isnan(s[g + t])) nan_seen = true;
    }
  }
  return nan_seen;
}

template bool tile_scores<float>(const attention_params&, const float*, std::int64_t, std::int64_t, std::int64_t,
                                 std::int64_t, std::int64_t, std::int64_t, float*);
template bool tile_scores<half>(const attention_params&, const float*, std::int64_t, std::int64_t, std::int64_t,
                                std::int64_t, std::int64_t, std::int64_t, float*);
template bool tile_scores<bfloat16>(const attention_params&, const float*, std::int64_t, std::int64_t, std::int64_t,
                                    std::int64_t, std::int64_t, std::int64_t, float*);

}  // namespace dfss::cpu::scalar
