// A downstream program: builds against the installed dfss package (C++17), runs 2:4 attention on
// the automatic backend and checks the result against the fp64 reference backend.
#include <dfss/dfss.hpp>

#include <cmath>
#include <cstdio>
#include <vector>

int main() {
  const std::int64_t B = 1, L = 40, H = 2, d = 16;
  std::vector<float> q(B * L * H * d), k(q.size()), v(q.size()), o(q.size()), r(q.size());
  for (std::size_t i = 0; i < q.size(); ++i) {
    q[i] = std::sin(0.37f * static_cast<float>(i));
    k[i] = std::cos(0.11f * static_cast<float>(i));
    v[i] = std::sin(0.05f * static_cast<float>(i) + 1.0f);
  }
  dfss::forward_args args;
  args.q = dfss::make_view(q.data(), {B, L, H, d});
  args.k = dfss::make_view(k.data(), {B, L, H, d});
  args.v = dfss::make_view(v.data(), {B, L, H, d});
  args.out = dfss::make_view(o.data(), {B, L, H, d});
  dfss::attention_config cfg;
  cfg.pattern = dfss::pattern::parse("2:4");
  dfss::attention_forward(args, cfg);
  args.out = dfss::make_view(r.data(), {B, L, H, d});
  cfg.backend = dfss::backend::reference;
  dfss::attention_forward(args, cfg);
  double err = 0;
  for (std::size_t i = 0; i < o.size(); ++i) err = std::fmax(err, std::fabs(static_cast<double>(o[i] - r[i])));
  std::printf("dfss %s consumer: max |automatic - reference| = %.3g\n", DFSS_VERSION_STRING, err);
  return err < 1e-4 ? 0 : 1;
}
