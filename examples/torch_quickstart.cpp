// LibTorch: DFSS attention with autograd (README "PyTorch"). Build against an installed dfss with
// find_package(Torch) + find_package(dfss COMPONENTS torch), link dfss::dfss_torch.
#include <dfss/torch.hpp>
#include <torch/torch.h>

#include <iostream>

int main() {
  auto q = torch::randn({2, 128, 8, 64}, torch::requires_grad());  // [B, L, H, d]
  auto k = torch::randn({2, 128, 8, 64}, torch::requires_grad());
  auto v = torch::randn({2, 128, 8, 64}, torch::requires_grad());
  dfss::torch::attention_options opt;                               // 2:4, scale 1/sqrt(d)
  opt.causal = true;
  auto [out, lse] = dfss::torch::attention(q, k, v, opt);           // out [B, L, H, d], lse [B, H, L]
  out.sum().backward();                                             // q.grad(), k.grad(), v.grad()
  std::cout << "out " << out.sizes() << ", |dq| = " << q.grad().norm().item<float>() << "\n";
}
