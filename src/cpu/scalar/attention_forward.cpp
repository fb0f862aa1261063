// Generic scalar fused DFSS forward: the portable twin that every SIMD forward is checked against.
//
// Per query row: walk the keys in tiles whose width is a multiple of M; compute the tile's scores in
// fp32, apply bias and masks, select N of every M (tile_scores: dfss/format/nm_select.hpp, the one
// selection rule), then update the online softmax with the kept scores only. Because the maximum of
// each group is always kept, the running maximum equals the row maximum of the unpruned scores.
// The backward (attention_backward.cpp) recomputes the scores with the same tile_scores.
#include <cmath>
#include <cstdint>
#include <limits>

#include "core/element_access.hpp"
#include "cpu/parallel.hpp"
#include "cpu/scalar/attention.hpp"
#include "cpu/scalar/tile_scores.hpp"
#include "dfss/numeric.hpp"

namespace dfss::cpu {
namespace {

using scalar::kKeyTile;
using scalar::load;

template <typename T>
void fused_rows(const attention_params& p) {
  const std::int64_t d = p.head_dim, L = p.seqlen_k;
  const int m = p.pattern_m;
  const std::int64_t tile = (kKeyTile + m - 1) / m * m;
  const std::int64_t group = p.heads / p.heads_kv;
  const std::int64_t rows = p.batch * p.heads * p.seqlen_q;
  const float scale = static_cast<float>(p.scale);
  const float neg_inf = -std::numeric_limits<float>::infinity();

  parallel_for(rows, p.num_threads, schedule::contiguous, [] {}, [&](std::int64_t row) {
    float q[512], acc[512], s[kKeyTile + 16];
    const std::int64_t i = row % p.seqlen_q;
    const std::int64_t h = (row / p.seqlen_q) % p.heads;
    const std::int64_t b = row / (p.seqlen_q * p.heads);
    const std::int64_t hk = h / group;
    for (std::int64_t c = 0; c < d; ++c) {
      q[c] = load<T>(p.q, core::offset4(p.q_stride, b, i, h, c));
      acc[c] = 0.0f;
    }
    const std::int64_t end = core::visible_end(p, b, i);
    float mx = neg_inf, sum = 0.0f;
    bool nan_seen = false;
    for (std::int64_t j0 = 0; j0 < L; j0 += tile) {
      const std::int64_t width = L - j0 < tile ? L - j0 : tile;
      nan_seen |= scalar::tile_scores<T>(p, q, b, h, i, j0, width, end, s);
      // Online softmax over the kept scores of this tile.
      float tile_max = neg_inf;
      for (std::int64_t t = 0; t < width; ++t) tile_max = s[t] > tile_max ? s[t] : tile_max;
      if (tile_max == neg_inf) continue;
      if (tile_max > mx) {
        const float correction = mx == neg_inf ? 0.0f : std::exp(scale * (mx - tile_max));
        sum *= correction;
        for (std::int64_t c = 0; c < d; ++c) acc[c] *= correction;
        mx = tile_max;
      }
      for (std::int64_t t = 0; t < width; ++t) {
        if (s[t] == neg_inf) continue;
        const float e = std::exp(scale * (s[t] - mx));
        sum += e;
        const std::int64_t j = j0 + t;
        for (std::int64_t c = 0; c < d; ++c) acc[c] += e * load<T>(p.v, core::offset4(p.v_stride, b, j, hk, c));
      }
    }
    const float nan = std::numeric_limits<float>::quiet_NaN();
    const bool empty = mx == neg_inf && !nan_seen;
    const float inv = empty ? 0.0f : 1.0f / sum;
    for (std::int64_t c = 0; c < d; ++c) {
      const float o = nan_seen ? nan : acc[c] * inv;
      core::store_from_double(p.o, p.output_type, core::offset4(p.o_stride, b, i, h, c), static_cast<double>(o));
    }
    if (p.lse != nullptr) {
      const float lse = nan_seen ? nan : (empty ? neg_inf : scale * mx + std::log(sum));
      core::store_from_double(p.lse, p.lse_type, b * p.lse_stride[0] + h * p.lse_stride[1] + i * p.lse_stride[2],
                              static_cast<double>(lse));
    }
  });
}

}  // namespace

status fused_forward_scalar(const attention_params& p) noexcept {
  if (p.head_dim > 512) {
    return {status_code::unsupported, "dfss cpu fused forward: head_dim above 512"};
  }
  switch (p.input_type) {
    case dtype::f32: fused_rows<float>(p); break;
    case dtype::f16: fused_rows<half>(p); break;
    case dtype::bf16: fused_rows<bfloat16>(p); break;
    default:
      return {status_code::unsupported,
              std::string("dfss cpu fused forward: input type ") + dtype_name(p.input_type) +
                  " (the cpu backend takes f32, f16 and bf16; use the reference backend for f64)"};
  }
  return status::success();
}

}  // namespace dfss::cpu
