// The README's 15-line C++ example, compiled and run by the test suite so that it stays true.
#include <dfss/dfss.hpp>
#include <vector>

int main() {
  const std::int64_t B = 2, L = 384, H = 16, d = 64;           // [B, L, H, d] layout
  std::vector<float> q(B * L * H * d, 0.1f), k(q), v(q), o(q.size());
  std::vector<std::int32_t> lengths{384, 200};                  // key padding per batch
  dfss::forward_args a;
  a.q = dfss::make_view(q.data(), {B, L, H, d});                // any strides: make_strided_view
  a.k = dfss::make_view(k.data(), {B, L, H, d});
  a.v = dfss::make_view(v.data(), {B, L, H, d});
  a.out = dfss::make_view(o.data(), {B, L, H, d});
  a.key_lengths = dfss::make_view(lengths.data(), {B});
  dfss::attention_config cfg;                                   // 2:4, scale 1/sqrt(d), automatic backend
  dfss::attention_forward(a, cfg);                              // throws dfss::error on bad input
}
