// GPU tests of the CUDA attention backend (CTest label gpu). Without a CUDA device the binary
// prints the reason and exits 77 (reported as skipped).
//   - One warp, one mma.sp::ordered_metadata m16n8k32 per case (bf16 and f16, selectors 0 and 1):
//     fragments placed with the warp headers' maps, every one of the six legal nibbles in every
//     lane and register half, the lanes the selector does not name holding a different legal
//     pattern; the result must equal the host's dense product exactly (small-integer inputs).
//   - The whole forward (backend cuda) against the fp64 reference on awkward shapes: Lq != Lk, tails
//     that are not multiples of any tile, key lengths including empty rows, causal, grouped heads,
//     d = 64 and 128, 1:2 and 2:4, f16 and bf16, f32 and 16-bit outputs. Scores are small-integer
//     dot products, exact in f32 and f64, so the selection must match the reference exactly; values
//     are compared with tolerances derived from the kernels' rounding (see run_e2e); every case is
//     run and prints its largest errors ("case ...: out max error ..."), failing or not.
//   - A CUDA graph capture of a call on a non-default stream replays to the same result.
//   - Clear errors: host pointers and unsupported shapes are rejected with the reason; memory or a
//     stream of another device too (with two GPUs); a CUDA error the caller left pending is reported
//     as the caller's, nothing is launched, and the error stays pending.
//   - The intermediates stay mapped in dfss's pool between calls (not returned at each sync).
//   - More than 2^31 intermediate elements (one slice alone has more): a few rows, at and after the
//     2^31 crossing, against the fp64 reference; skipped when the GPU has too little free memory.
// The TESTs sit outside the anonymous namespace: inside it nvcc 13 reports each one's registration
// member as unused (#177-D, an error under -Werror=all-warnings) whenever GoogleTest's headers are
// not system headers, e.g. when GoogleTest is built from source.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "cuda/attention_cuda.hpp"
#include "cuda/ptx.cuh"
#include "cuda/warp/mma_fragments.hpp"
#include "cuda/warp/nm_warp_select.hpp"
#include "dfss/dfss.hpp"

namespace {

namespace w = dfss::cuda::warp;

#define CUDA_OK(expr)                                                                         \
  do {                                                                                        \
    const cudaError_t e_ = (expr);                                                            \
    ASSERT_EQ(e_, cudaSuccess) << #expr << ": " << cudaGetErrorName(e_) << ": " << cudaGetErrorString(e_); \
  } while (0)

template <typename T>
struct device_array {
  T* ptr = nullptr;
  explicit device_array(std::size_t n) {
    if (cudaMalloc(reinterpret_cast<void**>(&ptr), (n > 0 ? n : 1) * sizeof(T)) != cudaSuccess) ptr = nullptr;
  }
  device_array(const device_array&) = delete;
  device_array& operator=(const device_array&) = delete;
  ~device_array() { cudaFree(ptr); }
};

// ---------------------------------------------------------------------------------------------
// One warp, one mma.sp.
template <typename T, int F>
__global__ void one_mma_sp_kernel(const float* a_comp, const std::uint32_t* meta, const float* b, float* d) {
  const int lane = static_cast<int>(threadIdx.x);
  std::uint32_t af[4], bf[4];
  for (int e = 0; e < 8; e += 2) {
    const w::frag_coord c0 = w::mma_sp_a16_coord(lane, e);
    const w::frag_coord c1 = w::mma_sp_a16_coord(lane, e + 1);
    af[e / 2] = dfss::cuda::ptx::elem<T>::pack(a_comp[c0.row * 16 + c0.col], a_comp[c1.row * 16 + c1.col]);
    const w::frag_coord k0 = w::mma_sp_b16_coord(lane, e);
    const w::frag_coord k1 = w::mma_sp_b16_coord(lane, e + 1);
    bf[e / 2] = dfss::cuda::ptx::elem<T>::pack(b[k0.row * 8 + k0.col], b[k1.row * 8 + k1.col]);
  }
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  dfss::cuda::ptx::mma_sp_m16n8k32<T, F>(acc, af, bf, meta[lane]);
  for (int r = 0; r < 4; ++r) {
    const w::frag_coord c = w::mma_c_coord(lane, r);
    d[c.row * 8 + c.col] = acc[r];
  }
}

bool have_gpu(std::string& why) {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    why = std::string("no usable CUDA device: ") + cudaGetErrorName(e) + ": " + cudaGetErrorString(e);
    return false;
  }
  if (n == 0) {
    why = "no CUDA device";
    return false;
  }
  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, 0);
  if (prop.major < 8) {
    why = std::string("device 0 (") + prop.name + ") is older than sm_80: no sparse tensor cores";
    return false;
  }
  return true;
}

template <typename T, int F>
void check_one_mma_sp(int rotation) {
  const std::uint32_t kNibbles[6] = {0x4, 0x8, 0xC, 0x9, 0xD, 0xE};
  std::mt19937 rng(1234u + static_cast<unsigned>(rotation));
  std::uniform_int_distribution<int> val(-4, 4);
  std::vector<float> a_comp(16 * 16), b(32 * 8), dense(16 * 32, 0.0f);
  std::vector<std::uint32_t> meta(32, 0xEEEEEEEEu);  // lanes the selector does not name
  for (int r = 0; r < 16; ++r) {
    for (int c = 0; c < 8; ++c) {
      const std::uint32_t nib = kNibbles[(r + c + rotation) % 6];
      const float v0 = static_cast<float>(val(rng));
      const float v1 = static_cast<float>(val(rng));
      a_comp[static_cast<std::size_t>(r * 16 + 2 * c)] = v0;
      a_comp[static_cast<std::size_t>(r * 16 + 2 * c + 1)] = v1;
      dense[static_cast<std::size_t>(r * 32 + 4 * c + static_cast<int>(nib & 3u))] = v0;
      dense[static_cast<std::size_t>(r * 32 + 4 * c + static_cast<int>(nib >> 2))] = v1;
      const w::meta_slot s = w::mma_sp_meta_slot(r, c, F);
      std::uint32_t& word = meta[static_cast<std::size_t>(s.lane)];
      if (word == 0xEEEEEEEEu) word = 0;
      word |= nib << s.shift;
    }
  }
  for (auto& x : b) x = static_cast<float>(val(rng));
  device_array<float> da(a_comp.size()), db(b.size()), dd(16 * 8);
  device_array<std::uint32_t> dm(32);
  CUDA_OK(cudaMemcpy(da.ptr, a_comp.data(), a_comp.size() * 4, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(db.ptr, b.data(), b.size() * 4, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(dm.ptr, meta.data(), 32 * 4, cudaMemcpyHostToDevice));
  one_mma_sp_kernel<T, F><<<1, 32>>>(da.ptr, dm.ptr, db.ptr, dd.ptr);
  CUDA_OK(cudaGetLastError());
  std::vector<float> d(16 * 8);
  CUDA_OK(cudaMemcpy(d.data(), dd.ptr, d.size() * 4, cudaMemcpyDeviceToHost));
  // Exact (small-integer products and sums); every element is compared, the first difference named.
  int bad = 0;
  std::string first;
  for (int r = 0; r < 16; ++r) {
    for (int n = 0; n < 8; ++n) {
      double want = 0.0;
      for (int k = 0; k < 32; ++k) want += dense[static_cast<std::size_t>(r * 32 + k)] * b[static_cast<std::size_t>(k * 8 + n)];
      const float got = d[static_cast<std::size_t>(r * 8 + n)];
      if (got != want && bad++ == 0) {
        first = "row " + std::to_string(r) + " col " + std::to_string(n) + ": got " + std::to_string(got) + ", want " +
                std::to_string(want);
      }
    }
  }
  EXPECT_EQ(bad, 0) << "selector " << F << " rotation " << rotation << ", first: " << first;
}

}  // namespace

TEST(CudaMmaSp, OneWarpAllSixNibblesBothSelectors) {
  for (int rot = 0; rot < 6; ++rot) {
    check_one_mma_sp<__nv_bfloat16, 0>(rot);
    check_one_mma_sp<__nv_bfloat16, 1>(rot);
    check_one_mma_sp<__half, 0>(rot);
    check_one_mma_sp<__half, 1>(rot);
  }
}

namespace {

// ---------------------------------------------------------------------------------------------
// End to end against the fp64 reference.
struct e2e_case {
  std::int64_t B, Lq, Lk, H, Hkv, d;
  dfss::pattern pat;
  bool causal;
  bool bf16;
  bool out_f32;
  std::vector<std::int64_t> lens;  // empty: none
  // Plant non-finite inputs (batch 0): NaN in q row 5 of head 0 (that row NaN), NaN in the k and v
  // rows of key Lk - 1 (masked: the case sets a key length below Lk), which may leak nowhere.
  bool special = false;
};

// Tolerances, from the kernels' own rounding (src/cuda/warp/softmax_fold.hpp). The scores are exact
// (small integers), and so is the selection and every maximum. The SDDMM forms each kept weight
// exp2((s - m_t) c) in f32 (the difference exact, the product 2^-24, ex2.approx about 2^-22
// relative) and rounds it to the 16-bit type T (relative u, the unit roundoff: bf16 2^-8, f16
// 2^-11); the SpMM rounds its factor exp2((m_t - M) c) to T (u) and the product of the two (u). So
// every weight p_j is within a factor 1 + e of exact, e = 3u + 2^-20, and O = sum p v / sum p, both
// sums of exactly the same p in f32 over at most Lk keys (Lk 2^-24 each): with |v| <= vmax,
//   |out error| <= vmax (2 e + 2 Lk 2^-24) + 2^-23 |out|   (+ u |out| when the output is 16-bit).
// LSE = ln 2 (M c + log2 L): ln(L (1 + e')) moves by at most e' = e + Lk 2^-24, and the f32
// products and log2 add 2^-22 (|lse| + 1).
double out_tolerance(double u, double vmax, std::int64_t Lk, bool out_f32, double out_ref) {
  const double e = 3 * u + std::ldexp(1.0, -20);
  const double f32_sum = static_cast<double>(Lk) * std::ldexp(1.0, -24);
  return vmax * (2 * e + 2 * f32_sum) + std::ldexp(1.0, -23) * std::fabs(out_ref) + (out_f32 ? 0.0 : u * std::fabs(out_ref));
}
double lse_tolerance(double u, std::int64_t Lk, double lse_ref) {
  const double e = 3 * u + std::ldexp(1.0, -20);
  return e + static_cast<double>(Lk) * std::ldexp(1.0, -24) + std::ldexp(1.0, -22) * (std::fabs(lse_ref) + 1);
}

template <typename T>
void run_e2e(const e2e_case& c) {
  const std::string what = "B=" + std::to_string(c.B) + " Lq=" + std::to_string(c.Lq) + " Lk=" + std::to_string(c.Lk) +
                           " H=" + std::to_string(c.H) + " Hkv=" + std::to_string(c.Hkv) + " d=" + std::to_string(c.d) +
                           " " + c.pat.str() + " causal=" + std::to_string(c.causal) + (c.bf16 ? " bf16" : " f16") +
                           (c.out_f32 ? " out f32" : " out 16-bit") + " lens=" + std::to_string(c.lens.size());
  SCOPED_TRACE(what);
  std::mt19937 rng(99u);
  std::uniform_int_distribution<int> small(-2, 2);
  std::uniform_real_distribution<double> real(-1.0, 1.0);
  const std::size_t nq = static_cast<std::size_t>(c.B * c.Lq * c.H * c.d);
  const std::size_t nkv = static_cast<std::size_t>(c.B * c.Lk * c.Hkv * c.d);
  std::vector<T> q(nq), k(nkv), v(nkv);
  for (auto& x : q) x = dfss::from_double<T>(small(rng));
  for (auto& x : k) x = dfss::from_double<T>(small(rng));
  for (auto& x : v) x = dfss::from_double<T>(real(rng));
  if (c.special) {
    const T nan = dfss::from_double<T>(std::nan(""));
    q[static_cast<std::size_t>(5 * c.H * c.d)] = nan;
    for (std::int64_t x = 0; x < c.d; ++x) {
      k[static_cast<std::size_t>((c.Lk - 1) * c.Hkv * c.d + x)] = nan;
      v[static_cast<std::size_t>((c.Lk - 1) * c.Hkv * c.d + x)] = nan;
    }
  }

  // Reference on the host (same 16-bit inputs, fp64 maths).
  std::vector<float> o_ref(nq), lse_ref(static_cast<std::size_t>(c.B * c.H * c.Lq));
  dfss::forward_args ra;
  ra.q = dfss::make_view(q.data(), {c.B, c.Lq, c.H, c.d});
  ra.k = dfss::make_view(k.data(), {c.B, c.Lk, c.Hkv, c.d});
  ra.v = dfss::make_view(v.data(), {c.B, c.Lk, c.Hkv, c.d});
  ra.out = dfss::make_view(o_ref.data(), {c.B, c.Lq, c.H, c.d});
  ra.lse = dfss::make_view(lse_ref.data(), {c.B, c.H, c.Lq});
  std::vector<std::int64_t> lens = c.lens;
  if (!lens.empty()) ra.key_lengths = dfss::make_view(lens.data(), {c.B});
  dfss::attention_config cfg;
  cfg.pattern = c.pat;
  cfg.causal = c.causal;
  cfg.backend = dfss::backend::reference;
  dfss::attention_forward(ra, cfg);

  // Device run.
  device_array<T> dq(nq), dk(nkv), dv(nkv);
  device_array<float> dlse(lse_ref.size());
  device_array<float> do32(c.out_f32 ? nq : 0);
  device_array<T> do16(c.out_f32 ? 0 : nq);
  device_array<std::int64_t> dlens(lens.size());
  CUDA_OK(cudaMemcpy(dq.ptr, q.data(), nq * sizeof(T), cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(dk.ptr, k.data(), nkv * sizeof(T), cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(dv.ptr, v.data(), nkv * sizeof(T), cudaMemcpyHostToDevice));
  if (!lens.empty()) CUDA_OK(cudaMemcpy(dlens.ptr, lens.data(), lens.size() * 8, cudaMemcpyHostToDevice));
  dfss::forward_args ga;
  ga.q = dfss::make_view(dq.ptr, {c.B, c.Lq, c.H, c.d});
  ga.k = dfss::make_view(dk.ptr, {c.B, c.Lk, c.Hkv, c.d});
  ga.v = dfss::make_view(dv.ptr, {c.B, c.Lk, c.Hkv, c.d});
  ga.out = c.out_f32 ? dfss::make_view(do32.ptr, {c.B, c.Lq, c.H, c.d}) : dfss::make_view(do16.ptr, {c.B, c.Lq, c.H, c.d});
  ga.lse = dfss::make_view(dlse.ptr, {c.B, c.H, c.Lq});
  if (!lens.empty()) ga.key_lengths = dfss::make_view(dlens.ptr, {c.B});
  cfg.backend = dfss::backend::cuda;
  const dfss::kernel_selection sel = dfss::select_kernel(ga, cfg);
  ASSERT_TRUE(sel.supported()) << sel.reason;
  dfss::attention_forward(ga, cfg);
  CUDA_OK(cudaDeviceSynchronize());
  std::vector<float> o(nq), lse(lse_ref.size());
  if (c.out_f32) {
    CUDA_OK(cudaMemcpy(o.data(), do32.ptr, nq * 4, cudaMemcpyDeviceToHost));
  } else {
    std::vector<T> o16(nq);
    CUDA_OK(cudaMemcpy(o16.data(), do16.ptr, nq * sizeof(T), cudaMemcpyDeviceToHost));
    for (std::size_t i = 0; i < nq; ++i) o[i] = static_cast<float>(dfss::to_double(o16[i]));
  }
  CUDA_OK(cudaMemcpy(lse.data(), dlse.ptr, lse.size() * 4, cudaMemcpyDeviceToHost));
  // Tolerances: see out_tolerance and lse_tolerance.
  const double u = c.bf16 ? std::ldexp(1.0, -8) : std::ldexp(1.0, -11);
  double vmax = 0;
  for (const T& x : v) {
    if (!std::isnan(dfss::to_double(x))) vmax = std::max(vmax, std::fabs(dfss::to_double(x)));
  }
  // Every element is compared (no early exit); a NaN in the reference must be NaN here too.; the largest error and error / tolerance are reported.
  double out_max = 0, out_ratio = 0, lse_max = 0, lse_ratio = 0;
  std::size_t out_bad = 0, lse_bad = 0, first_out = nq, first_lse = lse.size();
  for (std::size_t i = 0; i < nq; ++i) {
    if (std::isnan(o_ref[i]) || std::isnan(o[i])) {
      if (!(std::isnan(o_ref[i]) && std::isnan(o[i])) && out_bad++ == 0) first_out = i;
      continue;
    }
    const double tol = out_tolerance(u, vmax, c.Lk, c.out_f32, o_ref[i]);
    const double err = std::fabs(static_cast<double>(o[i]) - o_ref[i]);
    out_max = std::max(out_max, err);
    out_ratio = std::max(out_ratio, err / tol);
    if (!(err <= tol) && out_bad++ == 0) first_out = i;
  }
  for (std::size_t i = 0; i < lse.size(); ++i) {
    if (std::isnan(lse_ref[i]) || std::isnan(lse[i])) {
      if (!(std::isnan(lse_ref[i]) && std::isnan(lse[i])) && lse_bad++ == 0) first_lse = i;
      continue;
    }
    if (std::isinf(lse_ref[i])) {
      if (!(std::isinf(lse[i]) && lse[i] < 0) && lse_bad++ == 0) first_lse = i;
      continue;
    }
    const double tol = lse_tolerance(u, c.Lk, lse_ref[i]);
    const double err = std::fabs(static_cast<double>(lse[i]) - lse_ref[i]);
    lse_max = std::max(lse_max, err);
    lse_ratio = std::max(lse_ratio, err / tol);
    if (!(err <= tol) && lse_bad++ == 0) first_lse = i;
  }
  std::printf("case %s: out max error %.3g (%.2f of its tolerance), %zu out of tolerance; lse max error %.3g (%.2f of "
              "its tolerance), %zu out of tolerance\n",
              what.c_str(), out_max, out_ratio, out_bad, lse_max, lse_ratio, lse_bad);
  EXPECT_EQ(out_bad, 0u) << "first: out element " << first_out << " = "
                         << (first_out < nq ? o[first_out] : 0.0f) << ", reference "
                         << (first_out < nq ? o_ref[first_out] : 0.0f);
  EXPECT_EQ(lse_bad, 0u) << "first: lse " << first_lse << " = " << (first_lse < lse.size() ? lse[first_lse] : 0.0f)
                         << ", reference " << (first_lse < lse.size() ? lse_ref[first_lse] : 0.0f);
}

}  // namespace

TEST(CudaAttention, MatchesTheReferenceOnAwkwardShapes) {
  const dfss::pattern p24{2, 4}, p12{1, 2};
  const std::vector<e2e_case> cases = {
      {1, 1, 1, 1, 1, 64, p24, false, true, true, {}},
      {2, 45, 77, 2, 1, 64, p24, false, true, true, {}},
      {2, 45, 77, 2, 2, 128, p12, false, false, false, {}},
      {2, 130, 129, 4, 2, 64, p24, true, true, false, {}},
      {3, 70, 200, 2, 1, 128, p24, false, false, true, {200, 0, 131}},
      {2, 200, 70, 1, 1, 64, p12, true, true, true, {}},
      {1, 384, 384, 2, 2, 64, p24, false, true, false, {300}},
      {1, 256, 1000, 1, 1, 128, p24, true, true, true, {}},
  };
  for (const e2e_case& c : cases) {
    if (c.bf16) {
      run_e2e<dfss::bfloat16>(c);
    } else {
      run_e2e<dfss::half>(c);
    }
  }
}

// Non-finite inputs (e2e_case::special): a NaN query row is NaN (O and LSE) as in the reference;
// NaN keys and values past the key length change nothing.
TEST(CudaAttention, NonFiniteInputsFollowTheSemantics) {
  run_e2e<dfss::half>({1, 40, 70, 1, 1, 64, dfss::pattern{2, 4}, false, false, true, {60}, true});
  run_e2e<dfss::bfloat16>({1, 150, 130, 2, 1, 128, dfss::pattern{1, 2}, false, true, false, {129}, true});
}

// A small case with a tail in both directions, a causal mask, key lengths and an empty batch: the
// case tools/gpu-check.sh runs under compute-sanitizer memcheck and racecheck.
TEST(CudaAttention, SmallAwkwardCase) {
  run_e2e<dfss::bfloat16>({2, 45, 77, 2, 1, 64, dfss::pattern{2, 4}, true, true, true, {77, 0}});
}

TEST(CudaAttention, GraphCaptureOnAStreamReplaysTheSameResult) {
  const std::int64_t B = 2, L = 300, H = 2, d = 64;
  const std::size_t n = static_cast<std::size_t>(B * L * H * d);
  std::mt19937 rng(7u);
  std::uniform_real_distribution<double> real(-1.0, 1.0);
  std::vector<dfss::bfloat16> h(n);
  for (auto& x : h) x = dfss::from_double<dfss::bfloat16>(real(rng));
  device_array<dfss::bfloat16> q(n), o1(n), o2(n);
  CUDA_OK(cudaMemcpy(q.ptr, h.data(), n * 2, cudaMemcpyHostToDevice));
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  dfss::forward_args a;
  a.q = a.k = a.v = dfss::make_view(q.ptr, {B, L, H, d});
  a.out = dfss::make_view(o1.ptr, {B, L, H, d});
  dfss::attention_config cfg;
  cfg.backend = dfss::backend::cuda;
  cfg.cuda_stream = stream;
  dfss::attention_forward(a, cfg);
  a.out = dfss::make_view(o2.ptr, {B, L, H, d});
  cudaGraph_t graph;
  CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  dfss::attention_forward(a, cfg);
  CUDA_OK(cudaStreamEndCapture(stream, &graph));
  cudaGraphExec_t exec;
  CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  CUDA_OK(cudaGraphLaunch(exec, stream));
  CUDA_OK(cudaStreamSynchronize(stream));
  std::vector<dfss::bfloat16> r1(n), r2(n);
  CUDA_OK(cudaMemcpy(r1.data(), o1.ptr, n * 2, cudaMemcpyDeviceToHost));
  CUDA_OK(cudaMemcpy(r2.data(), o2.ptr, n * 2, cudaMemcpyDeviceToHost));
  EXPECT_EQ(std::memcmp(r1.data(), r2.data(), n * 2), 0);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

TEST(CudaAttention, RejectsWhatItCannotRunWithAReason) {
  const std::int64_t B = 1, L = 32, H = 1;
  std::vector<dfss::bfloat16> host(static_cast<std::size_t>(B * L * H * 96));
  dfss::forward_args a;
  a.q = a.k = a.v = dfss::make_view(host.data(), {B, L, H, 64});
  std::vector<float> out(static_cast<std::size_t>(B * L * H * 64));
  a.out = dfss::make_view(out.data(), {B, L, H, 64});
  dfss::attention_config cfg;
  cfg.backend = dfss::backend::cuda;
  dfss::kernel_selection s = dfss::select_kernel(a, cfg);
  EXPECT_FALSE(s.supported());
  EXPECT_NE(s.reason.find("device"), std::string::npos) << s.reason;
  device_array<dfss::bfloat16> dev(host.size());
  a.q = a.k = a.v = dfss::make_view(dev.ptr, {B, L, H, 96});
  device_array<float> dout(host.size());
  a.out = dfss::make_view(dout.ptr, {B, L, H, 96});
  s = dfss::select_kernel(a, cfg);
  EXPECT_FALSE(s.supported());
  EXPECT_NE(s.reason.find("head_dim 64 and 128, got 96"), std::string::npos) << s.reason;
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
}

namespace {

__global__ void noop_kernel() {}

// A small bf16 problem on the device, [1, L, 1, 64], self-attention, for the tests below.
struct small_problem {
  static constexpr std::int64_t L = 64, d = 64;
  device_array<dfss::bfloat16> q{static_cast<std::size_t>(L * d)};
  device_array<dfss::bfloat16> out{static_cast<std::size_t>(L * d)};
  dfss::forward_args args() const {
    dfss::forward_args a;
    a.q = a.k = a.v = dfss::make_view(q.ptr, {1, L, 1, d});
    a.out = dfss::make_view(out.ptr, {1, L, 1, d});
    return a;
  }
};

dfss::attention_config cuda_config() {
  dfss::attention_config cfg;
  cfg.backend = dfss::backend::cuda;
  return cfg;
}

}  // namespace

TEST(CudaAttention, AnErrorTheCallerLeftPendingIsReportedAsSuchAndLeftPending) {
  small_problem pr;
  ASSERT_NE(pr.q.ptr, nullptr);
  CUDA_OK(cudaMemset(pr.q.ptr, 0, static_cast<std::size_t>(pr.L * pr.d) * 2));
  // 4096 threads per block exceeds every GPU's limit (1024): the launch fails with a non-sticky
  // cudaErrorInvalidConfiguration, which stays pending since nobody reads it.
  noop_kernel<<<1, 4096>>>();
  ASSERT_EQ(cudaPeekAtLastError(), cudaErrorInvalidConfiguration);
  const dfss::status st = dfss::try_attention_forward(pr.args(), cuda_config());
  EXPECT_EQ(st.code, dfss::status_code::cuda_error) << st.message;
  EXPECT_NE(st.message.find("already pending before dfss launched anything: cudaErrorInvalidConfiguration"),
            std::string::npos)
      << st.message;
  EXPECT_NE(st.message.find("earlier CUDA work of the caller"), std::string::npos) << st.message;
  // Left pending for the caller's own check; once cleared, the call runs.
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidConfiguration);
  const dfss::status again = dfss::try_attention_forward(pr.args(), cuda_config());
  EXPECT_TRUE(again.ok()) << again.message;
  CUDA_OK(cudaDeviceSynchronize());
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
}

TEST(CudaAttention, MemoryOrAStreamOfAnotherDeviceIsRejected) {
  int n = 0;
  CUDA_OK(cudaGetDeviceCount(&n));
  if (n < 2) GTEST_SKIP() << "needs two CUDA devices, this machine has " << n;
  CUDA_OK(cudaSetDevice(1));
  small_problem on1;
  cudaStream_t stream1;
  CUDA_OK(cudaStreamCreateWithFlags(&stream1, cudaStreamNonBlocking));
  CUDA_OK(cudaSetDevice(0));
  dfss::kernel_selection s = dfss::select_kernel(on1.args(), cuda_config());
  EXPECT_FALSE(s.supported());
  EXPECT_NE(s.reason.find("'q' on the current CUDA device 0"), std::string::npos) << s.reason;
  EXPECT_NE(s.reason.find("got memory of device 1"), std::string::npos) << s.reason;
  small_problem on0;
  dfss::attention_config cfg = cuda_config();
  cfg.cuda_stream = stream1;
  const dfss::status st = dfss::try_attention_forward(on0.args(), cfg);
  EXPECT_EQ(st.code, dfss::status_code::invalid_argument) << st.message;
  EXPECT_NE(st.message.find("argument 'cuda_stream': expected a stream of the current device 0, got a stream of device 1"),
            std::string::npos)
      << st.message;
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  CUDA_OK(cudaSetDevice(1));
  CUDA_OK(cudaStreamDestroy(stream1));
  CUDA_OK(cudaSetDevice(0));
}

TEST(CudaAttention, IntermediatesStayMappedBetweenCalls) {
  // [4, 2048, 8, 64]: 32 slices of 2048 x 1024 compressed values (128 MiB) plus metadata, larger
  // than the intermediates of every test before, so the pool must grow and then keep that size.
  const std::int64_t B = 4, L = 2048, H = 8, d = 64;
  const std::size_t n = static_cast<std::size_t>(B * L * H * d);
  device_array<dfss::bfloat16> q(n), out(n);
  ASSERT_NE(q.ptr, nullptr);
  CUDA_OK(cudaMemset(q.ptr, 0, n * 2));
  dfss::forward_args a;
  a.q = a.k = a.v = dfss::make_view(q.ptr, {B, L, H, d});
  a.out = dfss::make_view(out.ptr, {B, L, H, d});
  const w::intermediate_layout lay = w::intermediate_layout::make(L, L);
  const std::size_t needed = static_cast<std::size_t>(B * H * (lay.value_elems() * 2 + lay.meta_words() * 4));
  dfss::attention_forward(a, cuda_config());
  CUDA_OK(cudaDeviceSynchronize());
  const std::size_t after_first = dfss::cuda::workspace_pool_reserved_bytes();
  EXPECT_GE(after_first, needed) << "the pool gave its memory back at the synchronisation";
  dfss::attention_forward(a, cuda_config());
  CUDA_OK(cudaDeviceSynchronize());
  EXPECT_EQ(dfss::cuda::workspace_pool_reserved_bytes(), after_first) << "the second call mapped memory again";
}

// More than 2^31 intermediate elements: B = 1, H = 2 (one kv head), Lq = Lk = 65600, d = 64, f16,
// 2:4, f32 output and LSE. One slice alone holds 65664 x 32800 compressed values (> 2^31), so row
// offsets inside a slice cross 2^31 (row 65472's values straddle it) and head 1's slice starts past
// it: any 32-bit index on the way wraps. 9.7 GB of intermediates, ~1.1 TFLOP: a few ms on an H100.
// Rows 0, 65472, 65473 and the last of both heads are checked against the fp64 reference on one
// query row each (non-causal, so a row's result depends on that row only).
TEST(CudaAttention, MoreThan2To31IntermediateElements) {
  using T = dfss::half;
  const std::int64_t B = 1, H = 2, Hkv = 1, L = 65600, d = 64;
  const w::intermediate_layout lay = w::intermediate_layout::make(L, L);
  ASSERT_GT(lay.value_elems(), std::int64_t{1} << 31);
  const std::size_t nq = static_cast<std::size_t>(B * L * H * d), nkv = static_cast<std::size_t>(B * L * Hkv * d);
  const std::size_t inter = static_cast<std::size_t>(B * H * (lay.value_elems() * 2 + lay.meta_words() * 4));
  // 1 GiB on top: the pool grows in 2 MiB-or-larger steps, and the runtime keeps some memory of its own.
  const std::size_t margin = std::size_t{1} << 30;
  const std::size_t needed = inter + (nq + 2 * nkv) * sizeof(T) + nq * 4 + static_cast<std::size_t>(B * H * L) * 4 + margin;
  std::size_t free_bytes = 0, total_bytes = 0;
  CUDA_OK(cudaMemGetInfo(&free_bytes, &total_bytes));
  if (free_bytes < needed) {
    GTEST_SKIP() << "needs " << (needed >> 20) << " MiB of free GPU memory, the device has " << (free_bytes >> 20)
                 << " MiB free of " << (total_bytes >> 20);
  }
  std::mt19937 rng(2024u);
  std::uniform_int_distribution<int> small(-2, 2);
  std::uniform_real_distribution<double> real(-1.0, 1.0);
  std::vector<T> q(nq), k(nkv), v(nkv);
  for (auto& x : q) x = dfss::from_double<T>(small(rng));
  for (auto& x : k) x = dfss::from_double<T>(small(rng));
  for (auto& x : v) x = dfss::from_double<T>(real(rng));
  device_array<T> dq(nq), dk(nkv), dv(nkv);
  device_array<float> dout(nq), dlse(static_cast<std::size_t>(B * H * L));
  ASSERT_TRUE(dq.ptr && dk.ptr && dv.ptr && dout.ptr && dlse.ptr) << "cudaMalloc of the inputs failed";
  CUDA_OK(cudaMemcpy(dq.ptr, q.data(), nq * sizeof(T), cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(dk.ptr, k.data(), nkv * sizeof(T), cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(dv.ptr, v.data(), nkv * sizeof(T), cudaMemcpyHostToDevice));
  dfss::forward_args ga;
  ga.q = dfss::make_view(dq.ptr, {B, L, H, d});
  ga.k = dfss::make_view(dk.ptr, {B, L, Hkv, d});
  ga.v = dfss::make_view(dv.ptr, {B, L, Hkv, d});
  ga.out = dfss::make_view(dout.ptr, {B, L, H, d});
  ga.lse = dfss::make_view(dlse.ptr, {B, H, L});
  const dfss::status st = dfss::try_attention_forward(ga, cuda_config());
  ASSERT_TRUE(st.ok()) << st.message;
  CUDA_OK(cudaDeviceSynchronize());

  const double u = std::ldexp(1.0, -11);  // f16
  double vmax = 0;
  for (const T& x : v) vmax = std::max(vmax, std::fabs(dfss::to_double(x)));
  for (std::int64_t h = 0; h < H; ++h) {
    const std::int64_t hk = h / (H / Hkv);
    for (const std::int64_t row : {std::int64_t{0}, std::int64_t{65472}, std::int64_t{65473}, L - 1}) {
      SCOPED_TRACE("head " + std::to_string(h) + " row " + std::to_string(row));
      const T* q_row = q.data() + (row * H + h) * d;
      // The reference on this one query row against all keys of kv head hk.
      std::vector<float> o_ref(static_cast<std::size_t>(d));
      float lse_ref = 0;
      dfss::forward_args ra;
      ra.q = dfss::make_view(q_row, {1, 1, 1, d});
      ra.k = dfss::make_strided_view(k.data() + hk * d, {1, L, 1, d}, {L * Hkv * d, Hkv * d, d, 1});
      ra.v = dfss::make_strided_view(v.data() + hk * d, {1, L, 1, d}, {L * Hkv * d, Hkv * d, d, 1});
      ra.out = dfss::make_view(o_ref.data(), {1, 1, 1, d});
      ra.lse = dfss::make_view(&lse_ref, {1, 1, 1});
      dfss::attention_config rc;
      rc.backend = dfss::backend::reference;
      dfss::attention_forward(ra, rc);
      std::vector<float> o(static_cast<std::size_t>(d));
      float lse = 0;
      CUDA_OK(cudaMemcpy(o.data(), dout.ptr + (row * H + h) * d, static_cast<std::size_t>(d) * 4, cudaMemcpyDeviceToHost));
      CUDA_OK(cudaMemcpy(&lse, dlse.ptr + h * L + row, 4, cudaMemcpyDeviceToHost));
      double out_max = 0;
      for (std::int64_t x = 0; x < d; ++x) {
        const double err = std::fabs(static_cast<double>(o[static_cast<std::size_t>(x)]) - o_ref[static_cast<std::size_t>(x)]);
        out_max = std::max(out_max, err);
        EXPECT_LE(err, out_tolerance(u, vmax, L, true, o_ref[static_cast<std::size_t>(x)]))
            << "out[" << x << "] = " << o[static_cast<std::size_t>(x)] << ", reference " << o_ref[static_cast<std::size_t>(x)];
      }
      const double lse_err = std::fabs(static_cast<double>(lse) - lse_ref);
      EXPECT_LE(lse_err, lse_tolerance(u, L, lse_ref)) << "lse " << lse << ", reference " << lse_ref;
      std::printf("case >2^31 head %lld row %lld: out max error %.3g, lse error %.3g\n", static_cast<long long>(h),
                  static_cast<long long>(row), out_max, lse_err);
    }
  }
}

int main(int argc, char** argv) {
  std::string why;
  if (!have_gpu(why)) {
    std::printf("SKIP: %s\n", why.c_str());
    return 77;
  }
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
