// The API boundary: every class of bad argument gets a dfss::error naming the argument, the expected
// and the received value; the selector answers "supported?" and "what runs"; overlap rules.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "common/testing.hpp"
#include "dfss/dfss.hpp"

namespace dfss {
namespace {

/// A valid forward call (B=2, Lq=5, Lk=6, H=4, Hkv=2, d=8, f32) that each test breaks in one way.
struct fixture {
  std::int64_t B = 2, Lq = 5, Lk = 6, H = 4, Hkv = 2, d = 8;
  std::vector<float> q, k, v, o, lse, bias, dout, dq, dk, dv, dbias;
  std::vector<std::int64_t> lens{6, 3};
  forward_args f;
  backward_args bw;

  fixture() { reset(); }
  fixture(const fixture&) = delete;  // the views point into this object's own buffers
  fixture& operator=(const fixture&) = delete;

  void reset() {
    lens = {6, 3};
    f = forward_args{};
    bw = backward_args{};
    q.assign(static_cast<std::size_t>(B * Lq * H * d), 0.5f);
    k.assign(static_cast<std::size_t>(B * Lk * Hkv * d), 0.25f);
    v = k;
    o.assign(q.size(), 0.0f);
    dout = q;
    dq = q;
    dk = k;
    dv = k;
    lse.assign(static_cast<std::size_t>(B * H * Lq), 0.0f);
    bias.assign(static_cast<std::size_t>(H * Lq * Lk), 0.0f);
    dbias = bias;
    f.q = make_view(q.data(), {B, Lq, H, d});
    f.k = make_view(k.data(), {B, Lk, Hkv, d});
    f.v = make_view(v.data(), {B, Lk, Hkv, d});
    f.out = make_view(o.data(), {B, Lq, H, d});
    f.lse = make_view(lse.data(), {B, H, Lq});
    f.bias = make_view(bias.data(), {1, H, Lq, Lk});
    f.key_lengths = make_view(lens.data(), {B});
    bw.q = f.q, bw.k = f.k, bw.v = f.v, bw.bias = f.bias, bw.key_lengths = f.key_lengths;
    bw.dout = make_view(dout.data(), {B, Lq, H, d});
    bw.dq = make_view(dq.data(), {B, Lq, H, d});
    bw.dk = make_view(dk.data(), {B, Lk, Hkv, d});
    bw.dv = make_view(dv.data(), {B, Lk, Hkv, d});
    bw.dbias = make_view(dbias.data(), {1, H, Lq, Lk});
  }
};

/// Runs @p call and checks that it throws dfss::error with @p code whose message contains every
/// fragment of @p fragments (argument name, expected value, received value).
void expect_error(const std::function<void()>& call, status_code code,
                  const std::vector<std::string>& fragments) {
  try {
    call();
    ADD_FAILURE() << "no error; expected one mentioning '" << fragments.front() << "'";
  } catch (const error& e) {
    EXPECT_EQ(e.code(), code) << e.what();
    for (const auto& frag : fragments) EXPECT_NE(std::string(e.what()).find(frag), std::string::npos) << "missing '" << frag << "' in: " << e.what();
  }
}

TEST(Api, ValidCallRunsOnEveryBackendThatSupportsIt) {
  fixture fx;
  for (backend b : {backend::automatic, backend::reference, backend::cpu}) {
    attention_config cfg;
    cfg.backend = b;
    std::fill(fx.o.begin(), fx.o.end(), std::numeric_limits<float>::quiet_NaN());
    attention_forward(fx.f, cfg);
    for (float x : fx.o) ASSERT_TRUE(std::isfinite(x)) << backend_name(b);
  }
  attention_backward(fx.bw);
  for (float x : fx.dq) ASSERT_TRUE(std::isfinite(x));
}

TEST(Api, ShapeMismatchesNameTheArgument) {
  fixture fx;
  auto fwd = [&] { attention_forward(fx.f); };
  fx.f.k = make_view(fx.k.data(), {2, 6, 2, 4});
  expect_error(fwd, status_code::invalid_argument, {"'k'", "head_dim", "== 8", "got 4"});
  fx.reset();
  fx.f.k = make_view(fx.k.data(), {1, 6, 2, 8});
  expect_error(fwd, status_code::invalid_argument, {"'k'", "batch", "== 2", "got 1"});
  fx.reset();
  fx.f.v = make_view(fx.v.data(), {2, 3, 4, 8});
  expect_error(fwd, status_code::invalid_argument, {"'v'", "seqlen_k", "== 6", "got 3"});
  fx.reset();
  fx.f.out = make_view(fx.o.data(), {2, 5, 2, 16});
  expect_error(fwd, status_code::invalid_argument, {"'out'", "[2, 5, 4, 8]", "[2, 5, 2, 16]"});
  fx.reset();
  fx.f.q = make_view(fx.q.data(), {2, 5, 32});
  expect_error(fwd, status_code::invalid_argument, {"'q'", "4 dimensions", "got 3"});
  fx.reset();
  fx.f.lse = make_view(fx.lse.data(), {2, 5, 4});
  expect_error(fwd, status_code::invalid_argument, {"'lse'", "heads", "== 4", "got 5"});
  fx.reset();
  fx.f.bias = make_view(fx.bias.data(), {1, 2, 5, 6});
  expect_error(fwd, status_code::invalid_argument, {"'bias'", "heads or 1", "got 2"});
  fx.reset();
  fx.f.q = make_view(fx.q.data(), {2, 5, 4, -1});
  expect_error(fwd, status_code::invalid_argument, {"'q'", "shape[3] >= 0", "got -1"});
}

TEST(Api, GroupedHeadsMustDivide) {
  fixture fx;
  std::vector<float> k3(static_cast<std::size_t>(2 * 6 * 3 * 8));
  fx.f.k = make_view(k3.data(), {2, 6, 3, 8});
  expect_error([&] { attention_forward(fx.f); }, status_code::invalid_argument,
               {"'k'", "heads_kv", "divide the 4", "got 3"});
}

TEST(Api, UnsupportedHeadDimAndPattern) {
  std::vector<float> big(static_cast<std::size_t>(1 * 1 * 1 * 1024));
  forward_args a;
  a.q = a.k = a.v = make_view(big.data(), {1, 1, 1, 1024});
  std::vector<float> o(big.size());
  a.out = make_view(o.data(), {1, 1, 1, 1024});
  expect_error([&] { attention_forward(a); }, status_code::unsupported, {"'q'", "head_dim", "<= 512", "1024"});
  fixture fx;
  attention_config cfg;
  cfg.pattern = {3, 2};
  expect_error([&] { attention_forward(fx.f, cfg); }, status_code::invalid_argument, {"'config.pattern'", "1 <= N <= M <= 16", "3:2"});
  cfg.pattern = {2, 17};
  expect_error([&] { attention_forward(fx.f, cfg); }, status_code::invalid_argument, {"'config.pattern'", "2:17"});
  expect_error([] { pattern::parse("2-4"); }, status_code::invalid_argument, {"'pattern'", "N:M", "2-4"});
  expect_error([] { pattern::parse("0:4"); }, status_code::invalid_argument, {"'pattern'", "0:4"});
  EXPECT_EQ(pattern::parse("2:4"), (pattern{2, 4}));
  EXPECT_EQ(pattern::parse("dense"), (pattern{1, 1}));
  expect_error([] { parse_backend("gpu"); }, status_code::invalid_argument, {"'backend'", "reference", "gpu"});
}

TEST(Api, NullMisalignedAndWrongTypes) {
  fixture fx;
  auto fwd = [&] { attention_forward(fx.f); };
  fx.f.q.data = nullptr;
  expect_error(fwd, status_code::invalid_argument, {"'q'", "non-null", "nullptr"});
  fx.reset();
  fx.f.k.data = reinterpret_cast<char*>(fx.k.data()) + 2;
  expect_error(fwd, status_code::invalid_argument, {"'k'", "aligned to 4 bytes"});
  fx.reset();
  std::vector<double> k64(fx.k.size());
  fx.f.k = make_view(k64.data(), {2, 6, 2, 8});
  expect_error(fwd, status_code::invalid_argument, {"'k'", "element type f32", "got f64"});
  fx.reset();
  std::vector<std::int32_t> q32(fx.q.size());
  fx.f.q = make_view(q32.data(), {2, 5, 4, 8});
  expect_error(fwd, status_code::invalid_argument, {"'q'", "f64, f32, f16 or bf16", "got i32"});
  fx.reset();
  std::vector<double> lse64(fx.lse.size());
  fx.f.lse = make_view(lse64.data(), {2, 4, 5});
  expect_error(fwd, status_code::invalid_argument, {"'lse'", "element type f32", "got f64"});
  fx.reset();
  std::vector<half> o16(fx.o.size());
  fx.f.out = make_view(o16.data(), {2, 5, 4, 8});
  expect_error(fwd, status_code::invalid_argument, {"'out'", "element type f32", "got f16"});
  fx.reset();
  std::vector<float> lensf{1.0f, 2.0f};
  fx.f.key_lengths = make_view(lensf.data(), {2});
  expect_error(fwd, status_code::invalid_argument, {"'key_lengths'", "i32 or i64", "got f32"});
}

TEST(Api, KeyLengthsOutOfRange) {
  fixture fx;
  fx.lens[0] = (std::int64_t{1} << 62) + 1;  // beyond every global position
  expect_error([&] { attention_forward(fx.f); }, status_code::invalid_argument,
               {"'key_lengths'", "[0, 4611686018427387904]", "got 4611686018427387905 at index 0"});
  fx.lens[0] = 2;
  fx.lens[1] = -1;
  expect_error([&] { attention_forward(fx.f); }, status_code::invalid_argument, {"'key_lengths'", "got -1 at index 1"});
}

TEST(Api, OptionsAreChecked) {
  fixture fx;
  attention_config cfg;
  cfg.scale = -1.0;
  expect_error([&] { attention_forward(fx.f, cfg); }, status_code::invalid_argument, {"'config.scale'", ">= 0", "-1"});
  cfg.scale = std::numeric_limits<double>::quiet_NaN();
  expect_error([&] { attention_forward(fx.f, cfg); }, status_code::invalid_argument, {"'config.scale'", "nan"});
  // A positive scale below the smallest normal float rounds to 0 (or loses precision) in the fp32
  // kernels: rejected for f32 inputs (the fuzzer found all-NaN rows from -inf * 0 there).
  cfg.scale = 1e-300;
  expect_error([&] { attention_forward(fx.f, cfg); }, status_code::invalid_argument,
               {"'config.scale'", "0 or a value in [1.17549e-38, 3.40282e+38]", "for f32 inputs", "got 1e-300"});
  cfg.scale = 1.2e-38;
  EXPECT_NO_THROW(attention_forward(fx.f, cfg));
  cfg = {};
  cfg.cpu_algorithm = static_cast<cpu_algorithm>(7);  // used to run as fused, unnoticed (fuzz_api)
  expect_error([&] { attention_forward(fx.f, cfg); }, status_code::invalid_argument,
               {"'config.cpu_algorithm'", "fused or three_stage", "value 7"});
  cfg = {};
  cfg.num_threads = -2;
  expect_error([&] { attention_forward(fx.f, cfg); }, status_code::invalid_argument, {"'config.num_threads'", "-2"});
}

TEST(Api, SizesWhoseProductsOverflow) {
  fixture fx;
  const std::int64_t huge = std::int64_t{1} << 40;
  fx.f.q.shape = {huge, huge, 4, 8};
  expect_error([&] { attention_forward(fx.f); }, status_code::invalid_argument, {"'q'", "64 bits", "overflows"});
  fx.reset();
  fx.f.k.stride = {std::int64_t{1} << 62, 16, 8, 1};
  expect_error([&] { attention_forward(fx.f); }, status_code::invalid_argument, {"'k'", "overflows"});
  fx.reset();
  // The largest offset exactly INT64_MAX: one more element overflows (found by fuzz_api, UBSan).
  fx.f.q.shape = {2, 1, 1, 1};
  fx.f.q.stride = {std::numeric_limits<std::int64_t>::max(), 1, 1, 1};
  expect_error([&] { attention_forward(fx.f); }, status_code::invalid_argument, {"'q'", "overflows"});
  fx.reset();
  fx.f.v.stride = {96, -16, 8, 1};
  expect_error([&] { attention_forward(fx.f); }, status_code::invalid_argument, {"'v'", "stride[1] >= 0", "-16"});
  expect_error([] { std::vector<float> x(4); (void)make_view(x.data(), {1, 1, 1, 1, 4}); },
               status_code::invalid_argument, {"'shape'", "at most 4", "got 5"});
  expect_error([] { std::vector<float> x(4); (void)make_strided_view(x.data(), {2, 2}, {2}); },
               status_code::invalid_argument, {"'strides'", "expected 2", "got 1"});
}

TEST(Api, OutputsMustNotOverlapInputsOrEachOther) {
  fixture fx;
  fx.f.out = make_view(fx.q.data(), {2, 5, 4, 8});
  expect_error([&] { attention_forward(fx.f); }, status_code::invalid_argument, {"'out'", "disjoint from input 'q'"});
  fx.reset();
  fx.f.lse = make_view(fx.o.data() + 8, {2, 4, 5});
  expect_error([&] { attention_forward(fx.f); }, status_code::invalid_argument, {"'out'", "disjoint from output 'lse'"});
  fx.reset();
  fx.f.out.stride = {160, 32, 0, 1};
  expect_error([&] { attention_forward(fx.f); }, status_code::invalid_argument, {"'out'", "do not alias each other"});
  fx.reset();
  fx.bw.dk = fx.bw.dv;
  expect_error([&] { attention_backward(fx.bw); }, status_code::invalid_argument, {"'dk'", "disjoint from output 'dv'"});
}

TEST(Api, PackedGradientsInOneBufferAreAccepted) {
  // dq, dk, dv interleaved in one [B, L, 3, H, d] buffer (Lq == Lk, H == Hkv): disjoint elements,
  // overlapping byte ranges. The exact overlap test must accept it.
  const std::int64_t B = 2, L = 5, H = 2, d = 4;
  std::vector<float> q(static_cast<std::size_t>(B * L * H * d), 0.1f), g(static_cast<std::size_t>(B * L * 3 * H * d));
  backward_args a;
  a.q = a.k = a.v = a.dout = make_view(q.data(), {B, L, H, d});
  const std::int64_t s0 = L * 3 * H * d, s1 = 3 * H * d;
  a.dq = make_strided_view(g.data(), {B, L, H, d}, {s0, s1, d, 1});
  a.dk = make_strided_view(g.data() + H * d, {B, L, H, d}, {s0, s1, d, 1});
  a.dv = make_strided_view(g.data() + 2 * H * d, {B, L, H, d}, {s0, s1, d, 1});
  EXPECT_NO_THROW(attention_backward(a));
  // Shifting dk by one element makes it collide with dq.
  a.dk = make_strided_view(g.data() + H * d - 1, {B, L, H, d}, {s0, s1, d, 1});
  expect_error([&] { attention_backward(a); }, status_code::invalid_argument, {"'dq'", "disjoint from output 'dk'"});
}

TEST(Api, BackwardArgumentChecks) {
  fixture fx;
  fx.bw.dbias = tensor_view{};
  fx.bw.bias = tensor_view{};
  EXPECT_NO_THROW(attention_backward(fx.bw));
  fixture fy;
  fy.bw.bias = tensor_view{};
  expect_error([&] { attention_backward(fy.bw); }, status_code::invalid_argument, {"'dbias'", "absent when no 'bias'"});
  fixture fz;
  fz.bw.dout = make_view(fz.dout.data(), {2, 5, 4, 4});
  expect_error([&] { attention_backward(fz.bw); }, status_code::invalid_argument, {"'dout'", "[2, 5, 4, 8]"});
}

TEST(Api, SelectorAnswersSupportAndWhatRuns) {
  fixture fx;
  attention_config cfg;
  auto s = select_kernel(fx.f, cfg);
  EXPECT_TRUE(s.supported());
  // automatic: the best SIMD target this CPU runs (testing::automatic_cpu_isa), the scalar twin
  // when there is none.
  // The fixture has Lq = 5 query rows, so a SIMD target runs its decode forward
  // (cpu::kDecodeMaxQueryRows; test_cpu_decode.cpp checks the rule on both sides).
  const cpu_isa best = testing::automatic_cpu_isa();
  EXPECT_EQ(s.name, best == cpu_isa::generic ? testing::fused_kernel_name(best, true)
                                             : std::string("cpu.decode_forward.") + cpu_isa_name(best));
  // The library's own answer agrees: exactly one target is marked automatic, the same one.
  int marked = 0;
  for (const cpu_isa_support& t : cpu_simd_isas()) {
    if (!t.automatic) continue;
    ++marked;
    EXPECT_EQ(t.isa, best);
  }
  EXPECT_EQ(marked, best == cpu_isa::generic ? 0 : 1);
  cfg.cpu_isa = cpu_isa::generic;
  EXPECT_EQ(select_kernel(fx.f, cfg).name, "cpu.fused_forward.scalar");
  cfg.cpu_isa = cpu_isa::avx2;  // without AVX2 the automatic backend falls back to the reference
  EXPECT_EQ(select_kernel(fx.f, cfg).name,
            testing::cpu_isa_skip_reason(cpu_isa::avx2).empty() ? "cpu.decode_forward.avx2" : "reference.forward");
  cfg.cpu_isa = cpu_isa::automatic;
  cfg.cpu_algorithm = cpu_algorithm::three_stage;
  EXPECT_EQ(select_kernel(fx.f, cfg).name, "cpu.three_stage_forward.generic");
  cfg.cpu_algorithm = cpu_algorithm::fused;
  cfg.backend = backend::reference;
  EXPECT_EQ(select_kernel(fx.f, cfg).name, "reference.forward");
  cfg.backend = backend::cuda;
  s = select_kernel(fx.f, cfg);
  EXPECT_FALSE(s.supported());
  EXPECT_NE(s.reason.find("CUDA"), std::string::npos);
  expect_error([&] { attention_forward(fx.f, cfg); }, status_code::unsupported, {"backend 'cuda'", "CUDA"});
  const status st = try_attention_forward(fx.f, cfg);
  EXPECT_EQ(st.code, status_code::unsupported);
  // Backward: the cpu kernel of the forward's ISA, dbias broadcast over the batch included, on both
  // the automatic and the cpu backend.
  cfg.backend = backend::automatic;
  const std::string bw_kernel = testing::fused_kernel_name(best, false);
  EXPECT_EQ(select_kernel(fx.bw, cfg).name, bw_kernel);
  cfg.backend = backend::cpu;
  EXPECT_EQ(select_kernel(fx.bw, cfg).name, bw_kernel);
  fx.bw.dbias = tensor_view{};
  EXPECT_EQ(select_kernel(fx.bw, cfg).name, bw_kernel);
  // f64 runs on the reference only.
  std::vector<double> q(fx.q.size()), k(fx.k.size()), o(fx.o.size());
  forward_args a;
  a.q = make_view(q.data(), {2, 5, 4, 8});
  a.k = a.v = make_view(k.data(), {2, 6, 2, 8});
  a.out = make_view(o.data(), {2, 5, 4, 8});
  cfg.backend = backend::cpu;
  s = select_kernel(a, cfg);
  EXPECT_FALSE(s.supported());
  EXPECT_NE(s.reason.find("f64"), std::string::npos);
  cfg.backend = backend::automatic;
  EXPECT_EQ(select_kernel(a, cfg).name, "reference.forward");
  // Invalid arguments are errors, not "unsupported".
  a.q.data = nullptr;
  EXPECT_THROW((void)select_kernel(a, cfg), error);
  EXPECT_EQ(try_attention_forward(a, cfg).code, status_code::invalid_argument);
}

TEST(Api, BuildInfoListsBackends) {
  const auto info = get_build_info();
  EXPECT_EQ(info.version, DFSS_VERSION_STRING);
  EXPECT_NE(std::find(info.backends.begin(), info.backends.end(), "reference"), info.backends.end());
}

}  // namespace
}  // namespace dfss
