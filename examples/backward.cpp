// The README's backward example (API section), compiled and run by the test suite so that it stays
// true: forward with LSE, then dQ, dK, dV for a given dO with the forward's selection held fixed.
#include <dfss/dfss.hpp>

#include <cmath>
#include <cstdio>
#include <vector>

int main() {
  const std::int64_t B = 2, L = 384, H = 16, d = 64;
  std::vector<float> q(B * L * H * d), k(q.size()), v(q.size()), o(q.size()), lse(B * H * L), dout(q.size());
  for (std::size_t x = 0; x < q.size(); ++x) {  // deterministic, non-constant inputs
    q[x] = std::sin(0.37f * static_cast<float>(x));
    k[x] = std::cos(0.11f * static_cast<float>(x));
    v[x] = std::sin(0.05f * static_cast<float>(x) + 1.0f);
    dout[x] = std::cos(0.29f * static_cast<float>(x));
  }
  std::vector<float> dq(q.size()), dk(q.size()), dv(q.size());
  dfss::forward_args a;
  a.q = dfss::make_view(q.data(), {B, L, H, d});
  a.k = dfss::make_view(k.data(), {B, L, H, d});
  a.v = dfss::make_view(v.data(), {B, L, H, d});
  a.out = dfss::make_view(o.data(), {B, L, H, d});
  a.lse = dfss::make_view(lse.data(), {B, H, L});
  dfss::attention_config cfg;
  dfss::attention_forward(a, cfg);

  dfss::backward_args g;                                        // after attention_forward(a, cfg) with a.lse set
  g.q = a.q; g.k = a.k; g.v = a.v; g.out = a.out; g.lse = a.lse; g.key_lengths = a.key_lengths;
  g.dout = dfss::make_view(dout.data(), {B, L, H, d});
  g.dq = dfss::make_view(dq.data(), {B, L, H, d});              // dk, dv: [B, Lk, Hkv, d]
  g.dk = dfss::make_view(dk.data(), {B, L, H, d});
  g.dv = dfss::make_view(dv.data(), {B, L, H, d});
  dfss::attention_backward(g, cfg);                             // same cfg (pattern, scale, causal)

  for (const auto* t : {&dq, &dk, &dv}) {
    for (float x : *t) {
      if (!std::isfinite(x)) {
        std::fprintf(stderr, "non-finite gradient\n");
        return 1;
      }
    }
  }
  return 0;
}
