// dfss_bench_cuda: the DFSS two-kernel pipeline (SDDMM + N:M selection + first half of the softmax,
// mma.sp SpMM + second half), raw launches and through the public API (dfss::attention_forward), against the dense
// unfused pipeline the paper compared with (cuBLAS strided-batched GEMM + softmax kernel + GEMM), in
// one run. PyTorch SDPA, each backend forced, is timed by tools/gpu/sdpa_backends.py on the same grid.
//
// Fairness: the dense pipeline's softmax is the kernel the DFSS pipeline itself used before its
// softmax was folded into its two kernels (one warp per row, 16-byte vectors, an online max / sum
// pass then a write pass, scores in the base-2 domain: the dense GEMM gets alpha = scale * log2 e);
// the DFSS pipeline's middle stage is empty. Each stage is also reported on its own. Every time is a median over the timed iterations
// after untimed warm-up ones; FLOP and byte conventions are in bench_metrics.hpp.
//
// Grid (--grid, bench_metrics.hpp): "artifact" = the original DFSS benchmark.py (bf16, 4 heads,
// d = 64, L = 256..4096); "bert" = BERT-large shapes with key padding; "all" = both; "smoke" = one
// small shape. Inputs are [B, H, L, d] packed, the layout cuBLAS's batched GEMM wants, passed to the
// DFSS kernels and to the API through their strides.
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "bench_metrics.hpp"
#include "cuda/pipeline.cuh"
#include "cuda/ptx.cuh"
#include "cuda/warp/softmax_fold.hpp"
#include "dfss/dfss.hpp"

namespace {

using i64 = std::int64_t;
using bf16 = __nv_bfloat16;
namespace dc = dfss::cuda;
namespace db = dfss::bench;

#define CHECK_CUDA(expr)                                                                                \
  do {                                                                                                  \
    const cudaError_t e_ = (expr);                                                                      \
    if (e_ != cudaSuccess) {                                                                            \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #expr, cudaGetErrorString(e_));       \
      std::exit(1);                                                                                     \
    }                                                                                                   \
  } while (0)
#define CHECK_CUBLAS(expr)                                                               \
  do {                                                                                   \
    const cublasStatus_t s_ = (expr);                                                    \
    if (s_ != CUBLAS_STATUS_SUCCESS) {                                                   \
      std::fprintf(stderr, "%s:%d: %s: cuBLAS status %d\n", __FILE__, __LINE__, #expr,   \
                   static_cast<int>(s_));                                                \
      std::exit(1);                                                                      \
    }                                                                                    \
  } while (0)

// The dense softmax, written as the DFSS pipeline's own compressed softmax kernel was before the
// softmax was folded into the SDDMM and the SpMM (src/cuda/warp/softmax_fold.hpp): one warp per row
// of S [rows][L] (bf16, in place), 16-byte vectors, an online max / sum pass and a write pass. S is already in the base-2 domain (the GEMM's alpha is scale * log2 e), as the DFSS
// SDDMM's output is; keys at or past the batch's length are masked here (the DFSS SDDMM writes -inf
// for them). Rows without a visible key get zeros, as in the DFSS kernel.
constexpr int kSoftmaxThreads = 128;  // 4 rows per CTA: small CTAs spread short problems over all SMs
constexpr int kSoftmaxRowsPerCta = kSoftmaxThreads / 32;
constexpr int kSoftmaxVec = 8;  // one 16-byte load of bf16 per lane

struct online_sum {
  float m;  // running max (-inf: nothing visible yet)
  float s;  // sum of exp2(x - m)
};

__device__ __forceinline__ online_sum combine(online_sum x, online_sum y) {
  const float m = fmaxf(x.m, y.m);
  if (m == -INFINITY) return {m, 0.0f};
  return {m, x.s * exp2f(x.m - m) + y.s * exp2f(y.m - m)};
}

__global__ void __launch_bounds__(kSoftmaxThreads)
    dense_softmax_kernel(bf16* s, i64 rows_per_bh, i64 heads, i64 L, const std::int32_t* lens) {
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const i64 row = static_cast<i64>(blockIdx.x) * kSoftmaxRowsPerCta + (threadIdx.x >> 5);
  const i64 bh = blockIdx.y;
  if (row >= rows_per_bh) return;
  const i64 len = lens != nullptr ? lens[bh / heads] : L;
  bf16* p = s + (bh * rows_per_bh + row) * L;
  online_sum acc{-INFINITY, 0.0f};
  for (i64 c = static_cast<i64>(lane) * kSoftmaxVec; c < L; c += 32 * kSoftmaxVec) {
    const uint4 raw = *reinterpret_cast<const uint4*>(p + c);
    const std::uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const float2 f = dc::ptx::elem<bf16>::unpack(w[u]);
      const float x0 = c + 2 * u < len ? f.x : -INFINITY;
      const float x1 = c + 2 * u + 1 < len ? f.y : -INFINITY;
      acc = combine(acc, {x0, x0 == -INFINITY ? 0.0f : 1.0f});
      acc = combine(acc, {x1, x1 == -INFINITY ? 0.0f : 1.0f});
    }
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    const online_sum other{__shfl_xor_sync(0xffffffffu, acc.m, off), __shfl_xor_sync(0xffffffffu, acc.s, off)};
    acc = combine(acc, other);
  }
  const bool empty = acc.s == 0.0f;
  const float inv = empty ? 0.0f : 1.0f / acc.s;
  const float m = empty ? 0.0f : acc.m;
  for (i64 c = static_cast<i64>(lane) * kSoftmaxVec; c < L; c += 32 * kSoftmaxVec) {
    uint4 raw = *reinterpret_cast<const uint4*>(p + c);
    std::uint32_t* w = reinterpret_cast<std::uint32_t*>(&raw);
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const float2 f = dc::ptx::elem<bf16>::unpack(w[u]);
      const float x0 = c + 2 * u < len ? exp2f(f.x - m) * inv : 0.0f;
      const float x1 = c + 2 * u + 1 < len ? exp2f(f.y - m) * inv : 0.0f;
      w[u] = dc::ptx::elem<bf16>::pack(x0, x1);
    }
    *reinterpret_cast<uint4*>(p + c) = raw;
  }
}

/// Samples (ms) of one timed method: per-call totals and, for staged ones, per-stage times.
struct samples {
  std::vector<double> total, stage[3];
  db::result summarize(const std::string& method, const db::counts& c, bool staged) const {
    db::result r;
    r.method = method;
    r.c = c;
    r.has_stages = staged;
    r.ms = db::median(total);
    if (staged) {
      for (int i = 0; i < 3; ++i) r.stage_ms[i] = db::median(stage[i]);
    }
    return r;
  }
};

/// Runs the three stages `iters` times after `warmup` untimed rounds, with events between the
/// stages (so nothing else is measured) and a synchronisation per iteration.
template <typename F1, typename F2, typename F3>
samples time_three(F1 f1, F2 f2, F3 f3, int warmup, int iters, cudaStream_t s) {
  cudaEvent_t ev[4];
  for (auto& e : ev) CHECK_CUDA(cudaEventCreate(&e));
  for (int i = 0; i < warmup; ++i) {
    f1();
    f2();
    f3();
  }
  CHECK_CUDA(cudaStreamSynchronize(s));
  samples t;
  for (int i = 0; i < iters; ++i) {
    CHECK_CUDA(cudaEventRecord(ev[0], s));
    f1();
    CHECK_CUDA(cudaEventRecord(ev[1], s));
    f2();
    CHECK_CUDA(cudaEventRecord(ev[2], s));
    f3();
    CHECK_CUDA(cudaEventRecord(ev[3], s));
    CHECK_CUDA(cudaEventSynchronize(ev[3]));
    float ms[4] = {0, 0, 0, 0};
    for (int k = 0; k < 3; ++k) {
      CHECK_CUDA(cudaEventElapsedTime(&ms[k], ev[k], ev[k + 1]));
      t.stage[k].push_back(ms[k]);
    }
    CHECK_CUDA(cudaEventElapsedTime(&ms[3], ev[0], ev[3]));
    t.total.push_back(ms[3]);
  }
  for (auto& e : ev) CHECK_CUDA(cudaEventDestroy(e));
  return t;
}

/// Times one call of @p f per iteration (events around it, synchronised), after `warmup` calls. For
/// the public API this includes its host-side work (argument checks, pointer queries, the workspace
/// allocation): the GPU idles during it, between the two events.
template <typename F>
samples time_call(F f, int warmup, int iters, cudaStream_t s) {
  cudaEvent_t ev[2];
  for (auto& e : ev) CHECK_CUDA(cudaEventCreate(&e));
  for (int i = 0; i < warmup; ++i) f();
  CHECK_CUDA(cudaStreamSynchronize(s));
  samples t;
  for (int i = 0; i < iters; ++i) {
    CHECK_CUDA(cudaEventRecord(ev[0], s));
    f();
    CHECK_CUDA(cudaEventRecord(ev[1], s));
    CHECK_CUDA(cudaEventSynchronize(ev[1]));
    float ms = 0;
    CHECK_CUDA(cudaEventElapsedTime(&ms, ev[0], ev[1]));
    t.total.push_back(ms);
  }
  for (auto& e : ev) CHECK_CUDA(cudaEventDestroy(e));
  return t;
}

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
}

/// The methods of one shape, in report order, with their counts (times filled in by run_shape).
std::vector<db::result> planned_results(const db::shape& sh) {
  std::vector<db::result> r(5);
  r[0].method = "dfss_2of4_kernels";
  r[0].c = db::dfss_counts(sh, 2, 4);
  r[0].has_stages = true;
  r[1].method = "dfss_2of4_api";
  r[1].c = r[0].c;
  r[2].method = "dfss_1of2_kernels";
  r[2].c = db::dfss_counts(sh, 1, 2);
  r[2].has_stages = true;
  r[3].method = "dfss_1of2_api";
  r[3].c = r[2].c;
  r[4].method = "dense_cublas";
  r[4].c = db::dense_counts(sh);
  r[4].has_stages = true;
  return r;
}

std::vector<db::result> run_shape(const db::shape& sh, int warmup, int iters, cublasHandle_t blas, cudaStream_t s) {
  const i64 BH = sh.B * sh.H, L = sh.L, d = sh.d;
  const std::size_t n = static_cast<std::size_t>(BH * L * d);
  std::vector<bf16> h(n);
  std::mt19937 rng(42u);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (auto& x : h) x = __float2bfloat16(nd(rng));
  bf16 *q, *k, *v, *o, *sdense;
  std::int32_t* lens = nullptr;
  CHECK_CUDA(cudaMalloc(&q, n * 2));
  CHECK_CUDA(cudaMalloc(&k, n * 2));
  CHECK_CUDA(cudaMalloc(&v, n * 2));
  CHECK_CUDA(cudaMalloc(&o, n * 2));
  CHECK_CUDA(cudaMalloc(&sdense, static_cast<std::size_t>(BH * L * L) * 2));
  CHECK_CUDA(cudaMemcpy(q, h.data(), n * 2, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(k, h.data(), n * 2, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(v, h.data(), n * 2, cudaMemcpyHostToDevice));
  if (sh.key_padding) {
    std::vector<std::int32_t> hl(static_cast<std::size_t>(sh.B));
    std::uniform_int_distribution<std::int32_t> ld(static_cast<std::int32_t>(L / 2), static_cast<std::int32_t>(L));
    for (auto& x : hl) x = ld(rng);
    CHECK_CUDA(cudaMalloc(&lens, hl.size() * 4));
    CHECK_CUDA(cudaMemcpy(lens, hl.data(), hl.size() * 4, cudaMemcpyHostToDevice));
  }
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  const float scale_log2 = static_cast<float>(scale * 1.4426950408889634);

  // DFSS pipeline arguments: [B, H, L, d] packed means stride (b, l, h) = (H L d, d, L d).
  dc::pipeline_args a{};
  a.batch = sh.B;
  a.heads = a.heads_kv = sh.H;
  a.seqlen_q = a.seqlen_k = L;
  const i64 st[3] = {sh.H * L * d, d, L * d};
  for (int i = 0; i < 3; ++i) a.q_stride[i] = a.k_stride[i] = a.v_stride[i] = a.o_stride[i] = st[i];
  a.q = q;
  a.k = k;
  a.v = v;
  a.o = o;
  a.o_is_f32 = false;
  a.key_lengths = lens;
  a.key_lengths_i32 = true;
  a.key_lengths_stride = 1;
  a.scale_log2 = scale_log2;
  a.layout = dfss::cuda::warp::intermediate_layout::make(L, L);
  CHECK_CUDA(cudaMalloc(&a.values, static_cast<std::size_t>(BH * a.layout.value_elems()) * 2));
  CHECK_CUDA(cudaMalloc(reinterpret_cast<void**>(&a.meta), static_cast<std::size_t>(BH * a.layout.meta_words()) * 4));
  CHECK_CUDA(cudaMalloc(reinterpret_cast<void**>(&a.tile_max),
                        static_cast<std::size_t>(BH * dfss::cuda::warp::fold_tile_max_elems(a.layout)) * 4));
  CHECK_CUDA(cudaMalloc(reinterpret_cast<void**>(&a.row_max), static_cast<std::size_t>(BH * a.layout.rows_padded) * 4));

  // The same problem through the public API (the same memory seen as [B, L, H, d] by strides).
  dfss::forward_args fa;
  fa.q = dfss::make_strided_view(reinterpret_cast<dfss::bfloat16*>(q), {sh.B, L, sh.H, d}, {st[0], st[1], st[2], 1});
  fa.k = dfss::make_strided_view(reinterpret_cast<dfss::bfloat16*>(k), {sh.B, L, sh.H, d}, {st[0], st[1], st[2], 1});
  fa.v = dfss::make_strided_view(reinterpret_cast<dfss::bfloat16*>(v), {sh.B, L, sh.H, d}, {st[0], st[1], st[2], 1});
  fa.out = dfss::make_strided_view(reinterpret_cast<dfss::bfloat16*>(o), {sh.B, L, sh.H, d}, {st[0], st[1], st[2], 1});
  if (lens != nullptr) fa.key_lengths = dfss::make_view(lens, {sh.B});
  auto api_call = [&](dfss::pattern pat) {
    dfss::attention_config cfg;
    cfg.backend = dfss::backend::cuda;
    cfg.pattern = pat;
    cfg.scale = scale;
    cfg.cuda_stream = s;
    return [fa, cfg] {
      const dfss::status r = dfss::try_attention_forward(fa, cfg);
      if (!r.ok()) {
        std::fprintf(stderr, "dfss_bench_cuda: dfss::attention_forward failed: %s\n", r.message.c_str());
        std::exit(1);
      }
    };
  };

  std::vector<db::result> out = planned_results(sh);
  namespace w = dfss::cuda::warp;
  out[0] = time_three([&] { check(dc::launch_sddmm_select<bf16, 64, w::sp_pattern::p2of4>(a, s), "sddmm"); },
                      [] {},  // no softmax stage: it is folded into the SDDMM and the SpMM
                      [&] { check(dc::launch_spmm<bf16, 64>(a, s), "spmm"); }, warmup, iters, s)
               .summarize(out[0].method, out[0].c, true);
  out[1] = time_call(api_call({2, 4}), warmup, iters, s).summarize(out[1].method, out[1].c, false);
  out[2] = time_three([&] { check(dc::launch_sddmm_select<bf16, 64, w::sp_pattern::p1of2>(a, s), "sddmm"); },
                      [] {},  // no softmax stage: it is folded into the SDDMM and the SpMM
                      [&] { check(dc::launch_spmm<bf16, 64>(a, s), "spmm"); }, warmup, iters, s)
               .summarize(out[2].method, out[2].c, true);
  out[3] = time_call(api_call({1, 2}), warmup, iters, s).summarize(out[3].method, out[3].c, false);
  // Dense: S^T (col-major Lk x Lq) = alpha K Q^T with alpha = scale log2 e (the base-2 domain the
  // softmax expects); O^T (col-major d x Lq) = V^T P^T.
  const float alpha = scale_log2, one = 1.0f, zero = 0.0f;
  out[4] = time_three(
               [&] {
                 CHECK_CUBLAS(cublasGemmStridedBatchedEx(
                     blas, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(L), static_cast<int>(L), static_cast<int>(d), &alpha,
                     k, CUDA_R_16BF, static_cast<int>(d), L * d, q, CUDA_R_16BF, static_cast<int>(d), L * d, &zero,
                     sdense, CUDA_R_16BF, static_cast<int>(L), L * L, static_cast<int>(BH), CUBLAS_COMPUTE_32F,
                     CUBLAS_GEMM_DEFAULT));
               },
               [&] {
                 dense_softmax_kernel<<<dim3(static_cast<unsigned>((L + kSoftmaxRowsPerCta - 1) / kSoftmaxRowsPerCta),
                                             static_cast<unsigned>(BH)),
                                        kSoftmaxThreads, 0, s>>>(sdense, L, sh.H, L, lens);
                 check(cudaGetLastError(), "dense softmax");
               },
               [&] {
                 CHECK_CUBLAS(cublasGemmStridedBatchedEx(
                     blas, CUBLAS_OP_N, CUBLAS_OP_N, static_cast<int>(d), static_cast<int>(L), static_cast<int>(L), &one,
                     v, CUDA_R_16BF, static_cast<int>(d), L * d, sdense, CUDA_R_16BF, static_cast<int>(L), L * L, &zero, o,
                     CUDA_R_16BF, static_cast<int>(d), L * d, static_cast<int>(BH), CUBLAS_COMPUTE_32F,
                     CUBLAS_GEMM_DEFAULT));
               },
               warmup, iters, s)
               .summarize(out[4].method, out[4].c, true);

  cudaFree(a.values);
  cudaFree(a.meta);
  cudaFree(a.tile_max);
  cudaFree(a.row_max);
  cudaFree(q);
  cudaFree(k);
  cudaFree(v);
  cudaFree(o);
  cudaFree(sdense);
  cudaFree(lens);
  return out;
}

/// One line per shape: each method's median total (and stages), dense-equivalent TFLOP/s and GB/s.
void print_shape(const db::shape& sh, const std::vector<db::result>& r, bool measured) {
  std::printf("%-8s B=%lld H=%lld L=%lld d=%lld pad=%d: dense-equivalent %.3g GFLOP, io %.3g MB\n", sh.grid.c_str(),
              static_cast<long long>(sh.B), static_cast<long long>(sh.H), static_cast<long long>(sh.L),
              static_cast<long long>(sh.d), sh.key_padding ? 1 : 0, db::dense_equivalent_flops(sh) / 1e9,
              db::io_bytes(sh) / 1e6);
  const double dense_ms = r.back().ms;
  for (const db::result& x : r) {
    if (!measured) {
      std::printf("  %-18s effective %.3g GFLOP, pipeline %.3g MB (stages %.3g %.3g %.3g MB)\n", x.method.c_str(),
                  x.c.flops_effective / 1e9, x.c.bytes() / 1e6, x.c.stage_bytes[0] / 1e6, x.c.stage_bytes[1] / 1e6,
                  x.c.stage_bytes[2] / 1e6);
      continue;
    }
    std::printf("  %-18s %8.4f ms", x.method.c_str(), x.ms);
    if (x.has_stages) std::printf(" (%7.4f %7.4f %7.4f)", x.stage_ms[0], x.stage_ms[1], x.stage_ms[2]);
    else std::printf("                          ");
    std::printf(" | %6.1f TFLOP/s dense-eq., %6.1f effective | %6.0f GB/s | dense/this x%.2f\n",
                db::tflops(x.c.flops_dense_equivalent, x.ms), db::tflops(x.c.flops_effective, x.ms),
                db::gbps(x.c.bytes(), x.ms), x.ms > 0 ? dense_ms / x.ms : 0.0);
  }
  std::fflush(stdout);
}

void usage() {
  std::printf(
      "usage: dfss_bench_cuda [--grid artifact|bert|all|smoke] [--warmup N] [--iters N] [--json FILE]\n"
      "                       [--markdown FILE] [--dry-run]\n"
      "  Times, bf16, d = 64: the DFSS 2:4 and 1:2 pipelines as raw kernel launches (per stage: SDDMM+select,\n"
      "  none (the softmax is folded into the other two), SpMM) and through dfss::attention_forward (the public API, host-side work included), and\n"
      "  the dense cuBLAS GEMM + softmax + GEMM pipeline (one-warp-per-row online softmax).\n"
      "  artifact: H=4, L=256..4096, B=48 (24 at 4096); bert: H=16, L=384, B=32, key padding.\n"
      "  Times are medians over --iters synchronised calls after --warmup untimed ones; TFLOP/s are\n"
      "  dense-equivalent (4 B H L^2 d for every method) and effective (products performed); GB/s count\n"
      "  each stage's reads and writes once (bench/cuda/bench_metrics.hpp, docs/gpu-results.md).\n"
      "  --dry-run: no GPU; prints the shapes with their FLOP and byte counts and writes the JSON and\n"
      "  markdown with null times. Defaults: --grid all --warmup 10 --iters 30.\n");
}

}  // namespace

int main(int argc, char** argv) {
  std::string grid = "all", json_path, md_path;
  int warmup = 10, iters = 30;
  bool dry_run = false;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    auto value = [&](const char* name) -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "dfss_bench_cuda: %s needs a value\n", name);
        std::exit(2);
      }
      return argv[++i];
    };
    auto count = [&](const char* name, int min) {
      const std::string text = value(name);
      char* end = nullptr;
      const long x = std::strtol(text.c_str(), &end, 10);
      if (text.empty() || *end != '\0' || x < min || x > 1000000) {
        std::fprintf(stderr, "dfss_bench_cuda: %s expects an integer in [%d, 1000000], got '%s'\n", name, min,
                     text.c_str());
        std::exit(2);
      }
      return static_cast<int>(x);
    };
    if (arg == "--help" || arg == "-h") {
      usage();
      return 0;
    } else if (arg == "--grid") {
      grid = value("--grid");
    } else if (arg == "--warmup") {
      warmup = count("--warmup", 0);
    } else if (arg == "--iters") {
      iters = count("--iters", 1);
    } else if (arg == "--json") {
      json_path = value("--json");
    } else if (arg == "--markdown") {
      md_path = value("--markdown");
    } else if (arg == "--dry-run") {
      dry_run = true;
    } else {
      std::fprintf(stderr, "dfss_bench_cuda: unknown argument '%s'\n", arg.c_str());
      usage();
      return 2;
    }
  }
  std::vector<db::shape> shapes;
  if (!db::grid_shapes(grid, shapes)) {
    std::fprintf(stderr, "dfss_bench_cuda: --grid expects artifact, bert, all or smoke, got '%s'\n", grid.c_str());
    return 2;
  }
  std::string device = "none (dry run)";
  cudaStream_t s = nullptr;
  cublasHandle_t blas = nullptr;
  if (!dry_run) {
    int devices = 0;
    if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
      std::fprintf(stderr, "dfss_bench_cuda: no CUDA device (--dry-run runs without one)\n");
      return 77;
    }
    cudaDeviceProp prop{};
    CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
    device = prop.name;
    CHECK_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    CHECK_CUBLAS(cublasCreate(&blas));
    CHECK_CUBLAS(cublasSetStream(blas, s));
  }
  std::FILE* json = json_path.empty() ? nullptr : std::fopen(json_path.c_str(), "w");
  std::FILE* md = md_path.empty() ? nullptr : std::fopen(md_path.c_str(), "w");
  if ((!json_path.empty() && json == nullptr) || (!md_path.empty() && md == nullptr)) {
    std::fprintf(stderr, "dfss_bench_cuda: cannot write '%s'\n", json == nullptr ? json_path.c_str() : md_path.c_str());
    return 2;
  }
  if (json != nullptr) {
    std::fprintf(json, "{\"tool\":\"dfss_bench_cuda\",\"device\":\"%s\",\"dry_run\":%s,\"warmup\":%d,\"iters\":%d,\n",
                 device.c_str(), dry_run ? "true" : "false", warmup, iters);
    std::fprintf(json, "\"conventions\":%s,\n\"results\":[\n", db::json_conventions());
  }
  if (md != nullptr) {
    std::fprintf(md, "dfss_bench_cuda on %s, median of %d iterations after %d warm-up\n\n%s", device.c_str(), iters,
                 warmup, db::markdown_header());
  }
  std::printf("dfss_bench_cuda on %s: ms per call, median of %d after %d warm-up; stages (SDDMM+select, -, "
              "SpMM) for DFSS, (QK^T GEMM, softmax, PV GEMM) for dense\n",
              device.c_str(), iters, warmup);
  bool first = true;
  for (const db::shape& sh : shapes) {
    const std::vector<db::result> r = dry_run ? planned_results(sh) : run_shape(sh, warmup, iters, blas, s);
    print_shape(sh, r, !dry_run);
    for (const db::result& x : r) {
      if (json != nullptr) std::fprintf(json, "%s%s", first ? "" : ",\n", db::json_result(sh, x, !dry_run).c_str());
      if (md != nullptr) std::fputs(db::markdown_row(sh, x, !dry_run).c_str(), md);
      first = false;
    }
  }
  if (json != nullptr) {
    std::fprintf(json, "\n]}\n");
    std::fclose(json);
  }
  if (md != nullptr) std::fclose(md);
  if (!dry_run) {
    cublasDestroy(blas);
    cudaStreamDestroy(s);
  }
  return 0;
}
