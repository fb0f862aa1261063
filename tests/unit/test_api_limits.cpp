// The API at the edges of its domain (docs/semantics.md, "Shapes" and "Limits"): problems without
// work (B, H, Lq or Lk = 0), the thread cap, the sequence-length bound, and element offsets beyond
// 2^31 that must not be truncated anywhere. Every kernel the selector can pick runs each case.
#include <gtest/gtest.h>
#include <sys/mman.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "common/testing.hpp"
#include "dfss/dfss.hpp"

namespace dfss {
namespace {

constexpr float kPoison = std::numeric_limits<float>::quiet_NaN();

/// Every kernel family the selector can pick for f32 inputs, plus the reference.
struct kernel_choice {
  std::string name;
  attention_config config;
};

std::vector<kernel_choice> every_kernel(bool forward) {
  std::vector<kernel_choice> out;
  auto add = [&](const std::string& name, backend b, cpu_isa isa, cpu_algorithm alg) {
    attention_config c;
    c.backend = b;
    c.cpu_isa = isa;
    c.cpu_algorithm = alg;
    c.num_threads = 2;
    out.push_back({name, c});
  };
  add("reference", backend::reference, cpu_isa::automatic, cpu_algorithm::fused);
  add("automatic", backend::automatic, cpu_isa::automatic, cpu_algorithm::fused);
  add("cpu generic", backend::cpu, cpu_isa::generic, cpu_algorithm::fused);
  add("cpu portable", backend::cpu, cpu_isa::portable, cpu_algorithm::fused);
  // Every SIMD target this CPU runs (tests/common's list).
  for (cpu_isa isa : testing::runnable_cpu_isas()) {
    if (isa == cpu_isa::generic || isa == cpu_isa::portable) continue;
    add(std::string("cpu ") + cpu_isa_name(isa), backend::cpu, isa, cpu_algorithm::fused);
  }
  if (forward) add("cpu three-stage", backend::cpu, cpu_isa::automatic, cpu_algorithm::three_stage);
  return out;
}

/// A forward problem of any shape, with q, k, v filled with small integers (exact scores) and
/// outputs poisoned. Views of zero elements point at a poisoned guard word, to show nothing is
/// written through them.
struct problem {
  std::int64_t B, Lq, Lk, H, Hkv, d;
  std::vector<float> q, k, v, o, lse, dout, dq, dk, dv, bias, dbias;
  float guard = kPoison;

  problem(std::int64_t b, std::int64_t lq, std::int64_t lk, std::int64_t h, std::int64_t hkv, std::int64_t dd)
      : B(b), Lq(lq), Lk(lk), H(h), Hkv(hkv), d(dd) {
    auto filled = [](std::int64_t n, int salt) {
      std::vector<float> x(static_cast<std::size_t>(n));
      for (std::size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(static_cast<int>((i * 7 + static_cast<std::size_t>(salt)) % 5) - 2);
      return x;
    };
    q = filled(B * Lq * H * d, 1);
    k = filled(B * Lk * Hkv * d, 2);
    v = filled(B * Lk * Hkv * d, 3);
    dout = filled(B * Lq * H * d, 4);
    bias = filled(B * 1 * Lq * Lk, 5);
    o.assign(q.size(), kPoison);
    dq.assign(q.size(), kPoison);
    dk.assign(k.size(), kPoison);
    dv.assign(v.size(), kPoison);
    dbias.assign(bias.size(), kPoison);
    lse.assign(static_cast<std::size_t>(B * H * Lq), kPoison);
  }

  tensor_view view(std::vector<float>& x, std::initializer_list<std::int64_t> shape) {
    tensor_view t = make_view(x.empty() ? &guard : x.data(), shape);
    return t;
  }

  forward_args fwd() {
    forward_args a;
    a.q = view(q, {B, Lq, H, d});
    a.k = view(k, {B, Lk, Hkv, d});
    a.v = view(v, {B, Lk, Hkv, d});
    a.out = view(o, {B, Lq, H, d});
    a.lse = view(lse, {B, H, Lq});
    return a;
  }

  backward_args bwd(bool with_bias) {
    backward_args a;
    a.q = view(q, {B, Lq, H, d});
    a.k = view(k, {B, Lk, Hkv, d});
    a.v = view(v, {B, Lk, Hkv, d});
    a.dout = view(dout, {B, Lq, H, d});
    a.dq = view(dq, {B, Lq, H, d});
    a.dk = view(dk, {B, Lk, Hkv, d});
    a.dv = view(dv, {B, Lk, Hkv, d});
    if (with_bias) {  // broadcast over heads: a head count of 0 still sums into it (to zero)
      a.bias = view(bias, {B, 1, Lq, Lk});
      a.dbias = view(dbias, {B, 1, Lq, Lk});
    }
    return a;
  }
};

TEST(ApiLimits, ProblemsWithoutRowsWriteNothing) {
  // {B, Lq, Lk, H, Hkv}: no batch, no query rows, no heads (then no kv heads either).
  const std::int64_t shapes[][5] = {{0, 3, 5, 2, 1}, {2, 0, 5, 2, 1}, {2, 3, 5, 0, 0}};
  for (const auto& s : shapes) {
    for (const auto& kc : every_kernel(true)) {
      problem pb(s[0], s[1], s[2], s[3], s[4], 4);
      forward_args a = pb.fwd();
      ASSERT_NO_THROW(attention_forward(a, kc.config)) << kc.name;
      EXPECT_TRUE(std::isnan(pb.guard)) << kc.name;  // nothing written through an empty view
    }
  }
}

TEST(ApiLimits, NullDataIsAcceptedOnlyForViewsWithoutElements) {
  problem pb(0, 3, 5, 2, 1, 4);
  forward_args a = pb.fwd();
  a.q.data = a.k.data = a.v.data = a.out.data = a.lse.data = nullptr;
  EXPECT_NO_THROW(attention_forward(a));
  problem full(1, 3, 5, 2, 1, 4);
  forward_args b = full.fwd();
  b.v.data = nullptr;
  try {
    attention_forward(b);
    ADD_FAILURE() << "a null v with 40 elements was accepted";
  } catch (const error& e) {
    EXPECT_NE(std::string(e.what()).find("argument 'v'"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("nullptr with shape [1, 5, 1, 4]"), std::string::npos) << e.what();
  }
}

TEST(ApiLimits, NoKeysGiveZeroOutputAndMinusInfinityLse) {
  for (const auto& kc : every_kernel(true)) {
    problem pb(2, 3, 0, 4, 2, 5);
    forward_args a = pb.fwd();
    ASSERT_NO_THROW(attention_forward(a, kc.config)) << kc.name;
    for (float x : pb.o) ASSERT_EQ(x, 0.0f) << kc.name;
    for (float x : pb.lse) ASSERT_EQ(x, -std::numeric_limits<float>::infinity()) << kc.name;
  }
}

TEST(ApiLimits, NoKeysInTheThreeStageExportGiveEmptyCompressedOutputs) {
  problem pb(1, 3, 0, 2, 1, 4);
  forward_args a = pb.fwd();
  float guard_values = kPoison;
  std::int32_t guard_indices = -7;
  std::uint16_t guard_meta = 0xBEEF;
  a.compressed_values = make_view(&guard_values, {1, 2, 3, 0});
  a.compressed_indices = make_view(&guard_indices, {1, 2, 3, 0});
  a.compressed_meta = make_view(&guard_meta, {1, 2, 3, 0});
  attention_config c;
  c.backend = backend::cpu;
  c.cpu_algorithm = cpu_algorithm::three_stage;
  ASSERT_NO_THROW(attention_forward(a, c));
  for (float x : pb.o) EXPECT_EQ(x, 0.0f);
  EXPECT_TRUE(std::isnan(guard_values));
  EXPECT_EQ(guard_indices, -7);
  EXPECT_EQ(guard_meta, 0xBEEF);
}

TEST(ApiLimits, BackwardWithoutWorkGivesZeroGradients) {
  // {B, Lq, Lk, H, Hkv}: no keys (dQ = 0), no query rows (dK = dV = 0), no heads (dBias, broadcast
  // over heads, = 0).
  const std::int64_t shapes[][5] = {{2, 3, 0, 4, 2}, {2, 0, 5, 4, 2}, {2, 3, 5, 0, 0}};
  for (const auto& s : shapes) {
    for (const auto& kc : every_kernel(false)) {
      problem pb(s[0], s[1], s[2], s[3], s[4], 4);
      backward_args a = pb.bwd(true);
      ASSERT_NO_THROW(attention_backward(a, kc.config)) << kc.name;
      for (const auto* g : {&pb.dq, &pb.dk, &pb.dv, &pb.dbias})
        for (float x : *g) ASSERT_EQ(x, 0.0f) << kc.name << " shape " << s[0] << "," << s[1] << "," << s[2];
      EXPECT_TRUE(std::isnan(pb.guard)) << kc.name;
    }
  }
}

TEST(ApiLimits, HeadDimZeroAndKvHeadsZeroAreErrors) {
  problem pb(1, 3, 5, 2, 1, 0);
  forward_args a = pb.fwd();
  try {
    attention_forward(a);
    ADD_FAILURE() << "d = 0 was accepted";
  } catch (const error& e) {
    EXPECT_EQ(e.code(), status_code::invalid_argument);
    EXPECT_NE(std::string(e.what()).find("argument 'q': expected shape[3] (head_dim) >= 1, got 0"), std::string::npos)
        << e.what();
  }
  problem kv(1, 3, 5, 2, 0, 4);
  forward_args b = kv.fwd();
  try {
    attention_forward(b);
    ADD_FAILURE() << "heads_kv = 0 with 2 query heads was accepted";
  } catch (const error& e) {
    EXPECT_NE(std::string(e.what()).find("argument 'k': expected shape[2] (heads_kv) >= 1 for 2 query heads, got 0"),
              std::string::npos)
        << e.what();
  }
}

TEST(ApiLimits, ThreadCountIsCapped) {
  problem pb(1, 3, 5, 2, 1, 4);
  forward_args a = pb.fwd();
  for (int threads : {1025, 100000, std::numeric_limits<int>::max()}) {
    attention_config c;
    c.num_threads = threads;
    try {
      attention_forward(a, c);
      ADD_FAILURE() << threads << " threads accepted";
    } catch (const error& e) {
      EXPECT_NE(std::string(e.what()).find("argument 'config.num_threads': expected a value in [0, 1024]"),
                std::string::npos)
          << e.what();
      EXPECT_NE(std::string(e.what()).find("got " + std::to_string(threads)), std::string::npos) << e.what();
    }
  }
  // The cap itself runs, on the kernels that spawn a team (and allocate scratch) per thread.
  for (auto kc : every_kernel(true)) {
    kc.config.num_threads = 1024;
    std::fill(pb.o.begin(), pb.o.end(), kPoison);
    ASSERT_NO_THROW(attention_forward(a, kc.config)) << kc.name;
    for (float x : pb.o) ASSERT_TRUE(std::isfinite(x)) << kc.name;
  }
}

TEST(ApiLimits, SequencesBeyondThe32BitIndexBoundAreRejectedAtValidation) {
  // Stride-0 (broadcast) views: 2^31 + 5 keys without the memory; validation fails before any
  // kernel reads them.
  std::vector<float> one(4, 1.0f), o(4);
  const std::int64_t huge = (std::int64_t{1} << 31) + 5;
  forward_args a;
  a.q = make_view(one.data(), {1, 1, 1, 4});
  a.k = a.v = make_strided_view(one.data(), {1, huge, 1, 4}, {0, 0, 0, 1});
  a.out = make_view(o.data(), {1, 1, 1, 4});
  for (const auto& kc : every_kernel(true)) {
    try {
      attention_forward(a, kc.config);
      ADD_FAILURE() << kc.name << ": 2^31 + 5 keys accepted";
    } catch (const error& e) {
      EXPECT_EQ(e.code(), status_code::unsupported);
      EXPECT_NE(std::string(e.what()).find("argument 'k': expected shape[1] (seqlen_k) <= 2147418112"), std::string::npos)
          << e.what();
      EXPECT_NE(std::string(e.what()).find("got 2147483653"), std::string::npos) << e.what();
    }
  }
  forward_args b;
  b.q = make_strided_view(one.data(), {1, huge, 1, 4}, {0, 0, 0, 1});
  b.k = b.v = make_view(one.data(), {1, 1, 1, 4});
  b.out = make_view(o.data(), {1, 1, 1, 4});
  try {
    attention_forward(b);
    ADD_FAILURE() << "2^31 + 5 queries accepted";
  } catch (const error& e) {
    EXPECT_NE(std::string(e.what()).find("argument 'q': expected shape[1] (seqlen_q) <= 2147418112"), std::string::npos)
        << e.what();
  }
}

/// Address space reserved without memory: only the pages a test touches are ever backed.
class reserved_space {
 public:
  explicit reserved_space(std::size_t bytes) : bytes_(bytes) {
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    base_ = p == MAP_FAILED ? nullptr : static_cast<float*>(p);
  }
  ~reserved_space() {
    if (base_ != nullptr) munmap(base_, bytes_);
  }
  reserved_space(const reserved_space&) = delete;
  reserved_space& operator=(const reserved_space&) = delete;
  float* base() const { return base_; }

 private:
  std::size_t bytes_;
  float* base_;
};

TEST(ApiLimits, ElementOffsetsBeyond32BitsAreNotTruncated) {
  // Batch stride 2^31 + 64 elements (byte offsets beyond 2^33): an index or offset held in 32 bits
  // anywhere makes batch 1 read or write batch 0's rows (or fault). Inputs and outputs live in two
  // reserved 8.6 GB ranges; only the first and last rows' pages are touched.
  const std::int64_t B = 2, L = 6, H = 1, d = 8;
  const std::int64_t far = (std::int64_t{1} << 31) + 64;
  const std::size_t bytes = static_cast<std::size_t>(far + L * d) * sizeof(float);
  reserved_space in(bytes), out(bytes);
  ASSERT_NE(in.base(), nullptr) << "could not reserve address space";
  ASSERT_NE(out.base(), nullptr) << "could not reserve address space";
  // q, k, v share the input rows (inputs may alias); batch 1 holds different values than batch 0,
  // so a truncated offset shows in the output.
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t i = 0; i < L * d; ++i)
      in.base()[b * far + i] = static_cast<float>((i * 3 + b * 5) % 7) - 3.0f;
  const std::initializer_list<std::int64_t> shape = {B, L, H, d};
  const std::initializer_list<std::int64_t> strides = {far, H * d, d, 1};
  forward_args a;
  a.q = a.k = a.v = make_strided_view(in.base(), shape, strides);
  a.out = make_strided_view(out.base(), shape, strides);

  // The oracle: the reference on packed copies.
  std::vector<double> packed(static_cast<std::size_t>(B * L * d)), ref(packed.size());
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t i = 0; i < L * d; ++i) {
      packed[static_cast<std::size_t>(b * L * d + i)] = static_cast<double>(in.base()[b * far + i]);
    }
  forward_args r;
  r.q = r.k = r.v = make_view(packed.data(), shape);
  r.out = make_view(ref.data(), shape);
  attention_config rc;
  rc.backend = backend::reference;
  attention_forward(r, rc);

  for (const auto& kc : every_kernel(true)) {
    for (std::int64_t b = 0; b < B; ++b)
      for (std::int64_t i = 0; i < L * d; ++i) out.base()[b * far + i] = kPoison;
    ASSERT_NO_THROW(attention_forward(a, kc.config)) << kc.name;
    for (std::int64_t b = 0; b < B; ++b)
      for (std::int64_t i = 0; i < L * d; ++i) {
        const double want = ref[static_cast<std::size_t>(b * L * d + i)];
        // Small-integer inputs: exact scores, so only the softmax and P V round (fp32).
        ASSERT_NEAR(out.base()[b * far + i], want, 1e-5 * (1.0 + std::fabs(want))) << kc.name << " batch " << b;
      }
  }
}

}  // namespace
}  // namespace dfss
