// dfss_bench_cuda: the DFSS three-kernel pipeline (SDDMM + N:M selection, compressed softmax, mma.sp
// SpMM) against the dense unfused pipeline the paper compared with (cuBLAS strided-batched GEMM +
// softmax kernel + GEMM), in one run, with per-kernel times from CUDA events. PyTorch SDPA is timed
// by tools/bench/cuda_sdpa.py on the same grid (tools/gpu-check.sh prints both).
//
// Grid (--grid): "artifact" = the original DFSS benchmark.py (bf16, 4 heads, d = 64, L = 256..4096,
// batch 48, 24 at L = 4096, no mask); "bert" = BERT-large shapes (bf16, 16 heads, d = 64, L = 384,
// batch 32, key padding with lengths drawn from [192, 384]); "all" = both; "smoke" = one small shape.
// Inputs are [B, H, L, d] packed, the layout cuBLAS's batched GEMM wants, passed to the DFSS
// kernels through their strides.
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

#include "cuda/pipeline.cuh"
#include "cuda/ptx.cuh"
#include "cuda/warp/softmax_fold.hpp"

namespace {

using i64 = std::int64_t;
using bf16 = __nv_bfloat16;
namespace dc = dfss::cuda;

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

struct shape {
  const char* grid;
  i64 B, H, L, d;
  bool key_padding;
};

// Dense softmax over rows of S [rows][L] (bf16, in place) with the scale and a key-padding length
// per batch; one warp per row, as the DFSS compressed softmax, so the two differ only in row length.
__global__ void dense_softmax_kernel(bf16* s, i64 rows_per_bh, i64 heads, i64 L, const std::int32_t* lens,
                                     float scale_log2) {
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const i64 row = static_cast<i64>(blockIdx.x) * 4 + (threadIdx.x >> 5);
  const i64 bh = blockIdx.y;
  if (row >= rows_per_bh) return;
  const i64 len = lens != nullptr ? lens[bh / heads] : L;
  bf16* p = s + (bh * rows_per_bh + row) * L;
  float m = -INFINITY;
  for (i64 c = lane * 8; c < L; c += 256) {
    const uint4 raw = *reinterpret_cast<const uint4*>(p + c);
    const std::uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
    for (int u = 0; u < 4; ++u) {
      const float2 f = dc::ptx::elem<bf16>::unpack(w[u]);
      if (c + 2 * u < len) m = fmaxf(m, f.x);
      if (c + 2 * u + 1 < len) m = fmaxf(m, f.y);
    }
  }
  for (int off = 16; off > 0; off >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
  float sum = 0.0f;
  for (i64 c = lane * 8; c < L; c += 256) {
    const uint4 raw = *reinterpret_cast<const uint4*>(p + c);
    const std::uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
    for (int u = 0; u < 4; ++u) {
      const float2 f = dc::ptx::elem<bf16>::unpack(w[u]);
      if (c + 2 * u < len) sum += exp2f((f.x - m) * scale_log2);
      if (c + 2 * u + 1 < len) sum += exp2f((f.y - m) * scale_log2);
    }
  }
  for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
  const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
  for (i64 c = lane * 8; c < L; c += 256) {
    uint4 raw = *reinterpret_cast<const uint4*>(p + c);
    std::uint32_t* w = reinterpret_cast<std::uint32_t*>(&raw);
    for (int u = 0; u < 4; ++u) {
      const float2 f = dc::ptx::elem<bf16>::unpack(w[u]);
      const float x0 = c + 2 * u < len ? exp2f((f.x - m) * scale_log2) * inv : 0.0f;
      const float x1 = c + 2 * u + 1 < len ? exp2f((f.y - m) * scale_log2) * inv : 0.0f;
      w[u] = dc::ptx::elem<bf16>::pack(x0, x1);
    }
    *reinterpret_cast<uint4*>(p + c) = raw;
  }
}

struct timing {
  double k1 = 0, k2 = 0, k3 = 0;  // ms per call
  double total() const { return k1 + k2 + k3; }
};

// Runs the three stages `iters` times after `warmup` untimed rounds; stage times are the mean of
// event-to-event times (events sit between the stages, so nothing else is measured).
template <typename F1, typename F2, typename F3>
timing time_three(F1 f1, F2 f2, F3 f3, int warmup, int iters, cudaStream_t s) {
  cudaEvent_t ev[4];
  for (auto& e : ev) CHECK_CUDA(cudaEventCreate(&e));
  for (int i = 0; i < warmup; ++i) {
    f1();
    f2();
    f3();
  }
  timing t;
  for (int i = 0; i < iters; ++i) {
    CHECK_CUDA(cudaEventRecord(ev[0], s));
    f1();
    CHECK_CUDA(cudaEventRecord(ev[1], s));
    f2();
    CHECK_CUDA(cudaEventRecord(ev[2], s));
    f3();
    CHECK_CUDA(cudaEventRecord(ev[3], s));
    CHECK_CUDA(cudaEventSynchronize(ev[3]));
    float a = 0, b = 0, c = 0;
    CHECK_CUDA(cudaEventElapsedTime(&a, ev[0], ev[1]));
    CHECK_CUDA(cudaEventElapsedTime(&b, ev[1], ev[2]));
    CHECK_CUDA(cudaEventElapsedTime(&c, ev[2], ev[3]));
    t.k1 += a;
    t.k2 += b;
    t.k3 += c;
  }
  t.k1 /= iters;
  t.k2 /= iters;
  t.k3 /= iters;
  for (auto& e : ev) CHECK_CUDA(cudaEventDestroy(e));
  return t;
}

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
}

void run_shape(const shape& sh, int warmup, int iters, cublasHandle_t blas, cudaStream_t s, std::FILE* json,
               bool& first_json) {
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
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));

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
  a.scale_log2 = scale * 1.4426950408889634f;
  a.layout = dfss::cuda::warp::intermediate_layout::make(L, L);
  CHECK_CUDA(cudaMalloc(&a.values, static_cast<std::size_t>(BH * a.layout.value_elems()) * 2));
  CHECK_CUDA(cudaMalloc(reinterpret_cast<void**>(&a.meta), static_cast<std::size_t>(BH * a.layout.meta_words()) * 4));
  CHECK_CUDA(cudaMalloc(reinterpret_cast<void**>(&a.tile_max),
                        static_cast<std::size_t>(BH * dfss::cuda::warp::fold_tile_max_elems(a.layout)) * 4));
  CHECK_CUDA(cudaMalloc(reinterpret_cast<void**>(&a.row_max), static_cast<std::size_t>(BH * a.layout.rows_padded) * 4));

  namespace w = dfss::cuda::warp;
  const timing t24 = time_three([&] { check(dc::launch_sddmm_select<bf16, 64, w::sp_pattern::p2of4>(a, s), "sddmm"); },
                                [] {},
                                [&] { check(dc::launch_spmm<bf16, 64>(a, s), "spmm"); }, warmup, iters, s);
  const timing t12 = time_three([&] { check(dc::launch_sddmm_select<bf16, 64, w::sp_pattern::p1of2>(a, s), "sddmm"); },
                                [] {},
                                [&] { check(dc::launch_spmm<bf16, 64>(a, s), "spmm"); }, warmup, iters, s);
  // Dense: S^T (col-major Lk x Lq) = K Q^T; O^T (col-major d x Lq) = V^T P^T.
  const float one = 1.0f, zero = 0.0f;
  const timing td = time_three(
      [&] {
        CHECK_CUBLAS(cublasGemmStridedBatchedEx(blas, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(L), static_cast<int>(L),
                                                static_cast<int>(d), &one, k, CUDA_R_16BF, static_cast<int>(d), L * d, q,
                                                CUDA_R_16BF, static_cast<int>(d), L * d, &zero, sdense, CUDA_R_16BF,
                                                static_cast<int>(L), L * L, static_cast<int>(BH), CUBLAS_COMPUTE_32F,
                                                CUBLAS_GEMM_DEFAULT));
      },
      [&] {
        dense_softmax_kernel<<<dim3(static_cast<unsigned>((L + 3) / 4), static_cast<unsigned>(BH)), 128, 0, s>>>(
            sdense, L, sh.H, L, lens, scale * 1.4426950408889634f);
        check(cudaGetLastError(), "dense softmax");
      },
      [&] {
        CHECK_CUBLAS(cublasGemmStridedBatchedEx(blas, CUBLAS_OP_N, CUBLAS_OP_N, static_cast<int>(d), static_cast<int>(L),
                                                static_cast<int>(L), &one, v, CUDA_R_16BF, static_cast<int>(d), L * d,
                                                sdense, CUDA_R_16BF, static_cast<int>(L), L * L, &zero, o, CUDA_R_16BF,
                                                static_cast<int>(d), L * d, static_cast<int>(BH), CUBLAS_COMPUTE_32F,
                                                CUBLAS_GEMM_DEFAULT));
      },
      warmup, iters, s);

  std::printf("%-8s B=%-3lld H=%-2lld L=%-5lld d=%lld pad=%d | 2:4 %7.3f (%6.3f %6.3f %6.3f) x%.2f | "
              "1:2 %7.3f (%6.3f %6.3f %6.3f) x%.2f | dense %7.3f (%6.3f %6.3f %6.3f) ms\n",
              sh.grid, static_cast<long long>(sh.B), static_cast<long long>(sh.H), static_cast<long long>(L),
              static_cast<long long>(d), sh.key_padding ? 1 : 0, t24.total(), t24.k1, t24.k2, t24.k3,
              td.total() / t24.total(), t12.total(), t12.k1, t12.k2, t12.k3, td.total() / t12.total(), td.total(),
              td.k1, td.k2, td.k3);
  std::fflush(stdout);
  if (json != nullptr) {
    std::fprintf(json,
                 "%s{\"grid\":\"%s\",\"B\":%lld,\"H\":%lld,\"L\":%lld,\"d\":%lld,\"key_padding\":%s,"
                 "\"dfss_2of4_ms\":[%.5f,%.5f,%.5f],\"dfss_1of2_ms\":[%.5f,%.5f,%.5f],\"dense_ms\":[%.5f,%.5f,%.5f]}",
                 first_json ? "" : ",\n", sh.grid, static_cast<long long>(sh.B), static_cast<long long>(sh.H),
                 static_cast<long long>(L), static_cast<long long>(d), sh.key_padding ? "true" : "false", t24.k1,
                 t24.k2, t24.k3, t12.k1, t12.k2, t12.k3, td.k1, td.k2, td.k3);
    first_json = false;
  }
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
}

void usage() {
  std::printf(
      "usage: dfss_bench_cuda [--grid artifact|bert|all|smoke] [--warmup N] [--iters N] [--json FILE]\n"
      "  Times the DFSS 2:4 and 1:2 three-kernel pipelines (SDDMM+select, softmax, SpMM) and the dense\n"
      "  cuBLAS GEMM + softmax + GEMM pipeline, bf16, d = 64, with per-kernel times (CUDA events).\n"
      "  artifact: H=4, L=256..4096, B=48 (24 at 4096); bert: H=16, L=384, B=32, key padding.\n"
      "  Speedups (xN) are dense time / DFSS time. Defaults: --grid all --warmup 10 --iters 30.\n");
}

}  // namespace

int main(int argc, char** argv) {
  std::string grid = "all", json_path;
  int warmup = 10, iters = 30;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    auto value = [&](const char* name) -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "dfss_bench_cuda: %s needs a value\n", name);
        std::exit(2);
      }
      return argv[++i];
    };
    if (arg == "--help" || arg == "-h") {
      usage();
      return 0;
    } else if (arg == "--grid") {
      grid = value("--grid");
    } else if (arg == "--warmup") {
      warmup = std::atoi(value("--warmup").c_str());
    } else if (arg == "--iters") {
      iters = std::atoi(value("--iters").c_str());
    } else if (arg == "--json") {
      json_path = value("--json");
    } else {
      std::fprintf(stderr, "dfss_bench_cuda: unknown argument '%s'\n", arg.c_str());
      usage();
      return 2;
    }
  }
  if (grid != "artifact" && grid != "bert" && grid != "all" && grid != "smoke") {
    std::fprintf(stderr, "dfss_bench_cuda: --grid expects artifact, bert, all or smoke, got '%s'\n", grid.c_str());
    return 2;
  }
  if (iters < 1 || warmup < 0) {
    std::fprintf(stderr, "dfss_bench_cuda: --iters must be >= 1 and --warmup >= 0\n");
    return 2;
  }
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::fprintf(stderr, "dfss_bench_cuda: no CUDA device\n");
    return 77;
  }
  std::vector<shape> shapes;
  if (grid == "smoke") shapes.push_back({"smoke", 2, 4, 256, 64, true});
  if (grid == "artifact" || grid == "all") {
    for (i64 L : {256, 512, 1024, 2048, 4096}) shapes.push_back({"artifact", L == 4096 ? 24 : 48, 4, L, 64, false});
  }
  if (grid == "bert" || grid == "all") shapes.push_back({"bert", 32, 16, 384, 64, true});
  cudaStream_t s;
  CHECK_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cublasHandle_t blas;
  CHECK_CUBLAS(cublasCreate(&blas));
  CHECK_CUBLAS(cublasSetStream(blas, s));
  std::FILE* json = json_path.empty() ? nullptr : std::fopen(json_path.c_str(), "w");
  if (json != nullptr) std::fprintf(json, "[\n");
  bool first = true;
  std::printf("times in ms per call: total (SDDMM+select, softmax, SpMM) for DFSS; (QK^T GEMM, softmax, PV GEMM) for dense\n");
  for (const shape& sh : shapes) run_shape(sh, warmup, iters, blas, s, json, first);
  if (json != nullptr) {
    std::fprintf(json, "\n]\n");
    std::fclose(json);
  }
  cublasDestroy(blas);
  cudaStreamDestroy(s);
  return 0;
}
