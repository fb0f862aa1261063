// dfss_gpu_probe: a self-contained first look at a GPU for the CUDA backend (no GoogleTest), built
// to answer as much as possible in the first seconds of a GPU run. Sections (--section, repeatable;
// default all but profile), each printing one line per finding, "PROBE <section> PASS|FAIL|INFO":
//   info    the device, driver and runtime;
//   meta    which lanes and bits of mma.sp's metadata register the hardware reads, for both sparsity
//           selectors, bf16 and f16: one nibble planted at a time (tests/cuda/probe/probe_host.hpp
//           says how, and tests/unit/test_cuda_probe_host.cpp checks the decoding on the CPU), then
//           every nibble value at one field, against the PTX tables of src/cuda/warp/;
//   nan     whether NaN or Inf in B rows at pruned positions reaches the result;
//   kernels each kernel alone against the host: the SDDMM's metadata and row maxima bit for bit
//           against the format module (nm_compress, nm_metadata_encode and the reordered offsets)
//           and host maxima, its weights within 1 ulp of fp64; the SpMM (with the softmax's second
//           half) against an fp64 evaluation on the SDDMM's own output; max errors per case;
//   timing  mma.sync m16n8k16 against mma.sp m16n8k32 throughput (bf16, f32 accumulators);
//   profile one launch of each kernel on a larger shape, unchecked: the target of ncu.
// --quick runs the two smallest kernel cases only (for compute-sanitizer). Exit: 0 all PASS, 1 any
// FAIL, 77 no usable GPU (the reason printed).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "cuda/pipeline.cuh"
#include "cuda/probe/probe_host.hpp"
#include "cuda/ptx.cuh"
#include "cuda/warp/mma_fragments.hpp"
#include "cuda/warp/sddmm_epilogue.hpp"
#include "cuda/warp/softmax_fold.hpp"
#include "dfss/dfss.hpp"
#include "dfss/format.hpp"

namespace {

namespace w = dfss::cuda::warp;
namespace pr = dfss::probe;
using i64 = std::int64_t;

int g_failures = 0;

void line(const char* section, const char* verdict, const std::string& detail) {
  std::printf("PROBE %-8s %-4s %s\n", section, verdict, detail.c_str());
  std::fflush(stdout);
}
void verdict(const char* section, bool ok, const std::string& detail) {
  line(section, ok ? "PASS" : "FAIL", detail);
  if (!ok) ++g_failures;
}

bool cuda_ok(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return true;
  verdict("cuda", false, std::string(what) + ": " + cudaGetErrorName(e) + ": " + cudaGetErrorString(e));
  return false;
}
#define CUDA_OK(expr) cuda_ok((expr), #expr)

template <typename T>
struct dbuf {
  T* ptr = nullptr;
  explicit dbuf(std::size_t n) { CUDA_OK(cudaMalloc(reinterpret_cast<void**>(&ptr), (n > 0 ? n : 1) * sizeof(T))); }
  dbuf(const dbuf&) = delete;
  dbuf& operator=(const dbuf&) = delete;
  ~dbuf() { cudaFree(ptr); }
};

template <typename T>
dbuf<T>* upload(const std::vector<T>& h, dbuf<T>& d) {
  CUDA_OK(cudaMemcpy(d.ptr, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
  return &d;
}
template <typename T>
std::vector<T> download(const T* d, std::size_t n) {
  std::vector<T> h(n);
  CUDA_OK(cudaMemcpy(h.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost));
  return h;
}

template <typename T>
const char* type_name();
template <>
const char* type_name<__nv_bfloat16>() { return "bf16"; }
template <>
const char* type_name<__half>() { return "f16"; }

// ---------------------------------------------------------------------------------------------
// info
bool device_info() {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess || n == 0) {
    std::printf("SKIP: no usable CUDA device (%s)\n", e != cudaSuccess ? cudaGetErrorString(e) : "none found");
    return false;
  }
  cudaDeviceProp p{};
  cudaGetDeviceProperties(&p, 0);
  int drv = 0, rt = 0;
  cudaDriverGetVersion(&drv);
  cudaRuntimeGetVersion(&rt);
  int clock_khz = 0, mem_khz = 0;
  cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, 0);
  cudaDeviceGetAttribute(&mem_khz, cudaDevAttrMemoryClockRate, 0);
  line("info", "INFO",
       std::string(p.name) + " sm_" + std::to_string(p.major) + std::to_string(p.minor) + ", " +
           std::to_string(p.multiProcessorCount) + " SMs, " + std::to_string(p.totalGlobalMem >> 20) + " MiB, L2 " +
           std::to_string(p.l2CacheSize >> 20) + " MiB, smem/block opt-in " +
           std::to_string(p.sharedMemPerBlockOptin >> 10) + " KiB, SM clock " + std::to_string(clock_khz / 1000) +
           " MHz, driver " + std::to_string(drv) + ", runtime " + std::to_string(rt));
  if (p.major < 8) {
    std::printf("SKIP: device 0 (%s) is older than sm_80: no sparse tensor cores\n", p.name);
    return false;
  }
  return true;
}

// ---------------------------------------------------------------------------------------------
// meta and nan: one warp per experiment, one mma.sp each, fragments placed with the warp headers.
template <typename T, int F>
__global__ void mma_sp_experiments(const float* a_comp, const float* b, const std::uint32_t* meta, float* d) {
  const int lane = static_cast<int>(threadIdx.x);
  std::uint32_t af[4], bf[4];
  DFSS_UNROLL
  for (int e = 0; e < 8; e += 2) {
    const w::frag_coord c0 = w::mma_sp_a16_coord(lane, e);
    const w::frag_coord c1 = w::mma_sp_a16_coord(lane, e + 1);
    af[e / 2] = dfss::cuda::ptx::elem<T>::pack(a_comp[c0.row * 16 + c0.col], a_comp[c1.row * 16 + c1.col]);
    const w::frag_coord k0 = w::mma_sp_b16_coord(lane, e);
    const w::frag_coord k1 = w::mma_sp_b16_coord(lane, e + 1);
    bf[e / 2] = dfss::cuda::ptx::elem<T>::pack(b[k0.row * 8 + k0.col], b[k1.row * 8 + k1.col]);
  }
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  dfss::cuda::ptx::mma_sp_m16n8k32<T, F>(acc, af, bf, meta[blockIdx.x * 32 + static_cast<unsigned>(lane)]);
  float* out = d + static_cast<std::size_t>(blockIdx.x) * pr::kRows * pr::kCols;
  DFSS_UNROLL
  for (int r = 0; r < 4; ++r) {
    const w::frag_coord c = w::mma_c_coord(lane, r);
    out[c.row * 8 + c.col] = acc[r];
  }
}

// Runs one warp per experiment; returns the 16 x 8 result of each, row-major, one after another.
template <typename T, int F>
std::vector<float> run_experiments(const std::vector<std::array<std::uint32_t, 32>>& metas, const std::vector<float>& b) {
  std::vector<float> a(16 * 16);
  for (int r = 0; r < 16; ++r) {
    for (int c = 0; c < 16; ++c) a[static_cast<std::size_t>(r * 16 + c)] = pr::meta_probe_a(r, c);
  }
  std::vector<std::uint32_t> m;
  for (const auto& x : metas) m.insert(m.end(), x.begin(), x.end());
  dbuf<float> da(a.size()), db(b.size()), dd(metas.size() * 128);
  dbuf<std::uint32_t> dm(m.size());
  upload(a, da);
  upload(b, db);
  upload(m, dm);
  mma_sp_experiments<T, F><<<static_cast<unsigned>(metas.size()), 32>>>(da.ptr, db.ptr, dm.ptr, dd.ptr);
  CUDA_OK(cudaGetLastError());
  CUDA_OK(cudaDeviceSynchronize());
  return download(dd.ptr, metas.size() * 128);
}

std::vector<float> probe_b() {
  std::vector<float> b(32 * 8);
  for (int k = 0; k < 32; ++k) {
    for (int n = 0; n < 8; ++n) b[static_cast<std::size_t>(k * 8 + n)] = pr::meta_probe_b(k, n);
  }
  return b;
}

template <typename T, int F>
void meta_section() {
  const std::string what = std::string(type_name<T>()) + " selector " + std::to_string(F);
  const std::vector<float> b = probe_b();
  // Base: every register 0x44444444 decodes to (0, 1) in every field.
  std::array<std::uint32_t, 32> base{};
  base.fill(pr::kBaseWord);
  const std::vector<float> d0 = run_experiments<T, F>({base}, b);
  const std::size_t base_changes = pr::changed_fields(d0.data()).size();
  verdict("meta", base_changes == 0, what + ": base registers 0x44444444 -> " + std::to_string(base_changes) +
                                         " of 128 fields not (0,1)");
  // One nibble at a time.
  const std::vector<pr::experiment> ex = pr::plant_experiments();
  std::vector<std::array<std::uint32_t, 32>> metas;
  for (const auto& e : ex) metas.push_back(pr::experiment_meta(e));
  const std::vector<float> d = run_experiments<T, F>(metas, b);
  std::vector<std::vector<pr::field_change>> changes;
  for (std::size_t i = 0; i < ex.size(); ++i) changes.push_back(pr::changed_fields(d.data() + i * 128));
  const pr::meta_map_report rep = pr::check_meta_map(ex, changes, F);
  // The table: lanes 4g + 2F and 4g + 2F + 1 are read (16 lanes), every nibble of theirs one field.
  verdict("meta", rep.mismatches == 0,
          what + ": " + std::to_string(rep.experiments) + " planted nibbles, " + std::to_string(rep.mismatches) +
              " differ from the PTX table; lanes read " + std::to_string(rep.lanes_read) + "/32 (table: 16)");
  for (const std::string& l : rep.lines) line("meta", "INFO", what + ": " + l);
  // Every nibble value at the field of row 0, group 0.
  const std::vector<pr::experiment> vx = pr::nibble_value_experiments(F);
  metas.clear();
  for (const auto& e : vx) metas.push_back(pr::experiment_meta(e));
  const std::vector<float> dv = run_experiments<T, F>(metas, b);
  std::string decoded;
  int legal_wrong = 0;
  for (std::size_t i = 0; i < vx.size(); ++i) {
    const pr::pair_idx p = pr::decode_pair(dv[i * 128]);  // row 0, column (group) 0
    char buf[48];
    std::snprintf(buf, sizeof buf, " %X:%d%d", vx[i].nibble, p.first, p.second);
    decoded += buf;
    if (dfss::is_legal_ordered_nibble(vx[i].nibble) && p != pr::nibble_pair(vx[i].nibble)) ++legal_wrong;
  }
  verdict("meta", legal_wrong == 0,
          what + ": nibble -> positions (slot0 slot1; -1 undecodable):" + decoded + "; legal nibbles wrong: " +
              std::to_string(legal_wrong));
}

template <typename T>
void nan_section() {
  // Registers keep positions (0, 1) (0x4) or (2, 3) (0xE); B rows at the other two positions of
  // every group hold NaN or +Inf. A leak shows as a field that no longer decodes to the kept pair.
  for (const std::uint32_t nib : {0x4u, 0xEu}) {
    for (const float poison : {std::nanf(""), INFINITY}) {
      std::vector<float> b = probe_b();
      const pr::pair_idx kept = pr::nibble_pair(nib);
      for (int k = 0; k < 32; ++k) {
        if (k % 4 != kept.first && k % 4 != kept.second) {
          for (int n = 0; n < 8; ++n) b[static_cast<std::size_t>(k * 8 + n)] = poison;
        }
      }
      std::array<std::uint32_t, 32> m{};
      m.fill(nib * 0x11111111u);
      const std::vector<float> d0 = run_experiments<T, 0>({m}, b);
      const std::vector<float> d1 = run_experiments<T, 1>({m}, b);
      int leaked = 0;
      for (std::size_t i = 0; i < 128; ++i) leaked += (pr::decode_pair(d0[i]) != kept) + (pr::decode_pair(d1[i]) != kept);
      line("nan", "INFO",
           std::string(type_name<T>()) + ": " + (std::isnan(poison) ? "NaN" : "+Inf") + " in B rows at pruned positions " +
               "(nibbles 0x" + (nib == 0x4u ? "4" : "E") + "): " +
               (leaked == 0 ? "no leak, all 256 fields exact" : std::to_string(leaked) + " of 256 fields changed: LEAKS"));
    }
  }
}

// ---------------------------------------------------------------------------------------------
// kernels: SDDMM, softmax and SpMM, each alone against the host.
template <typename T>
struct host_of;
template <>
struct host_of<__nv_bfloat16> {
  using type = dfss::bfloat16;
  static constexpr int kBits = pr::kBf16Bits;
  static constexpr int kMinExp = -126;
};
template <>
struct host_of<__half> {
  using type = dfss::half;
  static constexpr int kBits = pr::kF16Bits;
  static constexpr int kMinExp = -14;
};

struct kcase {
  i64 B, Lq, Lk, H, Hkv;
  int d;
  bool two_of_four;
  bool causal;
  bool bf16;
  std::vector<i64> lens;  // empty: none
};

std::string case_name(const kcase& c) {
  std::string s = "B" + std::to_string(c.B) + " Lq" + std::to_string(c.Lq) + " Lk" + std::to_string(c.Lk) + " H" +
                  std::to_string(c.H) + "/" + std::to_string(c.Hkv) + " d" + std::to_string(c.d) +
                  (c.two_of_four ? " 2:4" : " 1:2") + (c.causal ? " causal" : "") + (c.bf16 ? " bf16" : " f16");
  if (!c.lens.empty()) {
    s += " lens";
    for (i64 l : c.lens) s += " " + std::to_string(l);
  }
  return s;
}

// Adds one slice's report to a case's, keeping the first bad element's description.
void merge(pr::check_report& all, const pr::check_report& r, i64 slice) {
  if (r.bad > 0 && all.bad == 0) all.first = "slice " + std::to_string(slice) + " " + r.first;
  all.checked += r.checked;
  all.bad += r.bad;
  all.max_err = std::max(all.max_err, r.max_err);
  all.worst = std::max(all.worst, r.worst);
}

template <typename T, int D, w::sp_pattern P>
void kernels_case(const kcase& c, bool profile_only) {
  using HT = typename host_of<T>::type;
  const std::string what = case_name(c);
  const i64 nq = c.B * c.Lq * c.H * D, nkv = c.B * c.Lk * c.Hkv * D;
  std::mt19937 rng(2024u);
  std::uniform_int_distribution<int> small(-2, 2);
  std::uniform_real_distribution<double> real(-1.0, 1.0);
  // Small-integer Q and K: every score is an integer of magnitude <= 4 D, exact in f32, so the
  // device's selection and values can be compared bit for bit.
  std::vector<HT> q(static_cast<std::size_t>(nq)), k(static_cast<std::size_t>(nkv)), v(static_cast<std::size_t>(nkv));
  for (auto& x : q) x = dfss::from_double<HT>(small(rng));
  for (auto& x : k) x = dfss::from_double<HT>(small(rng));
  for (auto& x : v) x = dfss::from_double<HT>(real(rng));
  dbuf<HT> dq(q.size()), dk(k.size()), dv(v.size());
  dbuf<float> dout(static_cast<std::size_t>(nq)), dlse(static_cast<std::size_t>(c.B * c.H * c.Lq));
  dbuf<i64> dlens(c.lens.size());
  upload(q, dq);
  upload(k, dk);
  upload(v, dv);
  if (!c.lens.empty()) upload(c.lens, dlens);

  dfss::cuda::pipeline_args a{};
  a.batch = c.B;
  a.heads = c.H;
  a.heads_kv = c.Hkv;
  a.seqlen_q = c.Lq;
  a.seqlen_k = c.Lk;
  a.q = dq.ptr;
  a.k = dk.ptr;
  a.v = dv.ptr;
  a.o = dout.ptr;
  const i64 qs[3] = {c.Lq * c.H * D, c.H * D, D}, ks[3] = {c.Lk * c.Hkv * D, c.Hkv * D, D};
  for (int i = 0; i < 3; ++i) {
    a.q_stride[i] = qs[i];
    a.o_stride[i] = qs[i];
    a.k_stride[i] = ks[i];
    a.v_stride[i] = ks[i];
  }
  a.o_is_f32 = true;
  a.lse = dlse.ptr;
  a.lse_stride[0] = c.H * c.Lq;
  a.lse_stride[1] = c.Lq;
  a.lse_stride[2] = 1;
  a.key_lengths = c.lens.empty() ? nullptr : dlens.ptr;
  a.key_lengths_i32 = false;
  a.key_lengths_stride = 1;
  a.causal = c.causal;
  a.scale_log2 = static_cast<float>(1.0 / std::sqrt(static_cast<double>(D)) * 1.4426950408889634);
  a.layout = w::intermediate_layout::make(c.Lq, c.Lk);
  const i64 slices = c.B * c.H;
  const std::size_t nvals = static_cast<std::size_t>(slices * a.layout.value_elems());
  const std::size_t nmeta = static_cast<std::size_t>(slices * a.layout.meta_words());
  const std::size_t ntile = static_cast<std::size_t>(slices * w::fold_tile_max_elems(a.layout));
  const std::size_t nrow = static_cast<std::size_t>(slices * a.layout.rows_padded);
  dbuf<HT> dvals(nvals);
  dbuf<std::uint32_t> dmeta(nmeta);
  dbuf<float> dtile(ntile), drow(nrow);
  a.values = dvals.ptr;
  a.meta = dmeta.ptr;
  a.tile_max = dtile.ptr;
  a.row_max = drow.ptr;

  const bool sddmm_ok = CUDA_OK((dfss::cuda::launch_sddmm_select<T, D, P>(a, nullptr))) && CUDA_OK(cudaDeviceSynchronize());
  if (profile_only) {
    CUDA_OK((dfss::cuda::launch_spmm<T, D>(a, nullptr)));
    CUDA_OK(cudaDeviceSynchronize());
    line("profile", "INFO", what + ": one launch of each kernel done");
    return;
  }
  if (!sddmm_ok) return;
  const std::vector<HT> s_dev = download(dvals.ptr, nvals);
  const std::vector<std::uint32_t> m_dev = download(dmeta.ptr, nmeta);
  const std::vector<float> t_dev = download(dtile.ptr, ntile);
  const std::vector<float> r_dev = download(drow.ptr, nrow);

  // Each kernel against the host (tests/cuda/probe/probe_host.hpp: what is expected, and the
  // tolerances' derivation), slice by slice; the SpMM on the SDDMM's own device output.
  std::vector<std::vector<std::int32_t>> kept(static_cast<std::size_t>(slices));
  std::vector<pr::slice_case> sc(static_cast<std::size_t>(slices));
  pr::check_report sddmm;
  for (i64 b = 0; b < c.B; ++b) {
    const i64 kv = c.lens.empty() ? c.Lk : std::clamp<i64>(c.lens[static_cast<std::size_t>(b)], 0, c.Lk);
    for (i64 h = 0; h < c.H; ++h) {
      const i64 bh = b * c.H + h, hk = h / (c.H / c.Hkv);
      sc[static_cast<std::size_t>(bh)] = {c.Lq, c.Lk, kv, c.causal, c.two_of_four, a.scale_log2, a.layout};
      std::vector<float> scores(static_cast<std::size_t>(c.Lq * c.Lk));
      for (i64 r = 0; r < c.Lq; ++r) {
        for (i64 j = 0; j < c.Lk; ++j) {
          double s = 0;
          for (int x = 0; x < D; ++x) {
            s += dfss::to_double(q[static_cast<std::size_t>(((b * c.Lq + r) * c.H + h) * D + x)]) *
                 dfss::to_double(k[static_cast<std::size_t>(((b * c.Lk + j) * c.Hkv + hk) * D + x)]);
          }
          scores[static_cast<std::size_t>(r * c.Lk + j)] = static_cast<float>(s);
        }
      }
      const pr::check_report r = pr::check_sddmm(
          sc[static_cast<std::size_t>(bh)], scores, s_dev.data() + bh * a.layout.value_elems(),
          m_dev.data() + bh * a.layout.meta_words(), t_dev.data() + bh * w::fold_tile_max_elems(a.layout),
          r_dev.data() + bh * a.layout.rows_padded, kept[static_cast<std::size_t>(bh)], host_of<T>::kBits,
          host_of<T>::kMinExp);
      merge(sddmm, r, bh);
    }
  }
  char buf[512];
  std::snprintf(buf, sizeof buf,
                "sddmm %s: %lld of %lld weights (1 ulp), maxima and metadata words/nibbles off (max %.2f ulp)%s%s",
                what.c_str(), static_cast<long long>(sddmm.bad), static_cast<long long>(sddmm.checked), sddmm.worst,
                sddmm.first.empty() ? "" : "; first: ", sddmm.first.c_str());
  verdict("kernels", sddmm.bad == 0, buf);

  CUDA_OK((dfss::cuda::launch_spmm<T, D>(a, nullptr)));
  CUDA_OK(cudaDeviceSynchronize());
  const std::vector<float> o_dev = download(dout.ptr, static_cast<std::size_t>(nq));
  const std::vector<float> lse_dev = download(dlse.ptr, static_cast<std::size_t>(c.B * c.H * c.Lq));
  std::array<pr::check_report, 2> spmm;
  for (i64 b = 0; b < c.B; ++b) {
    for (i64 h = 0; h < c.H; ++h) {
      const i64 bh = b * c.H + h, hk = h / (c.H / c.Hkv);
      const std::array<pr::check_report, 2> r = pr::check_spmm(
          sc[static_cast<std::size_t>(bh)], kept[static_cast<std::size_t>(bh)], s_dev.data() + bh * a.layout.value_elems(),
          t_dev.data() + bh * w::fold_tile_max_elems(a.layout), r_dev.data() + bh * a.layout.rows_padded,
          v.data() + (b * c.Lk * c.Hkv + hk) * D, c.Hkv * D, o_dev.data() + (b * c.Lq * c.H + h) * D, c.H * D,
          lse_dev.data() + bh * c.Lq, D, host_of<T>::kBits, host_of<T>::kMinExp);
      for (int i = 0; i < 2; ++i) merge(spmm[static_cast<std::size_t>(i)], r[static_cast<std::size_t>(i)], bh);
    }
  }
  std::snprintf(buf, sizeof buf,
                "spmm %s: %lld of %lld outputs out of tolerance (max abs error %.3g, max %.2f of tol), %lld of %lld lse "
                "(max %.2f of tol)%s%s",
                what.c_str(), static_cast<long long>(spmm[0].bad), static_cast<long long>(spmm[0].checked), spmm[0].max_err,
                spmm[0].worst, static_cast<long long>(spmm[1].bad), static_cast<long long>(spmm[1].checked), spmm[1].worst,
                spmm[0].first.empty() ? "" : "; first: ", spmm[0].first.c_str());
  verdict("kernels", spmm[0].bad == 0 && spmm[1].bad == 0, buf);
}

void kernels_dispatch(const kcase& c, bool profile_only) {
  const auto p24 = w::sp_pattern::p2of4;
  const auto p12 = w::sp_pattern::p1of2;
  if (c.bf16) {
    if (c.d == 64) {
      c.two_of_four ? kernels_case<__nv_bfloat16, 64, p24>(c, profile_only) : kernels_case<__nv_bfloat16, 64, p12>(c, profile_only);
    } else {
      c.two_of_four ? kernels_case<__nv_bfloat16, 128, p24>(c, profile_only) : kernels_case<__nv_bfloat16, 128, p12>(c, profile_only);
    }
  } else {
    if (c.d == 64) {
      c.two_of_four ? kernels_case<__half, 64, p24>(c, profile_only) : kernels_case<__half, 64, p12>(c, profile_only);
    } else {
      c.two_of_four ? kernels_case<__half, 128, p24>(c, profile_only) : kernels_case<__half, 128, p12>(c, profile_only);
    }
  }
}

void kernels_section(bool quick) {
  // Tails in both directions, Lq != Lk, grouped heads, key lengths (one empty batch), causal, both
  // patterns, both types, both head dims; the first two are the small ones --quick keeps.
  const std::vector<kcase> cases = {
      {2, 45, 77, 2, 1, 64, true, true, true, {77, 0}},
      {1, 70, 130, 2, 2, 128, false, false, false, {100}},
      {2, 130, 200, 2, 2, 128, false, false, false, {200, 131}},
      {1, 256, 1000, 1, 1, 128, true, true, true, {}},
      {2, 200, 70, 1, 1, 64, false, true, true, {70, 3}},
      {1, 384, 384, 2, 2, 64, true, false, false, {}},
  };
  const std::size_t n = quick ? 2 : cases.size();
  for (std::size_t i = 0; i < n; ++i) kernels_dispatch(cases[i], false);
}

// ---------------------------------------------------------------------------------------------
// timing: independent MMA chains per warp, enough warps to fill every SM.
constexpr int kChains = 8;  // independent accumulators per warp: hides the MMA latency

template <bool Sparse>
__global__ void __launch_bounds__(256) mma_throughput(int iters, std::uint32_t seed, float* sink) {
  const std::uint32_t x = seed ^ threadIdx.x;
  const std::uint32_t a[4] = {x, x + 1u, x + 2u, x + 3u};
  const std::uint32_t b[4] = {x * 3u, x * 5u, x * 7u, x * 9u};
  float acc[kChains][4] = {};
  for (int it = 0; it < iters; ++it) {
    DFSS_UNROLL
    for (int c = 0; c < kChains; ++c) {
      if constexpr (Sparse) {
        dfss::cuda::ptx::mma_sp_m16n8k32<__nv_bfloat16, 0>(acc[c], a, b, 0x44444444u);
      } else {
        dfss::cuda::ptx::mma_m16n8k16<__nv_bfloat16>(acc[c], a, b[0], b[1]);
      }
    }
  }
  float s = 0.f;
  DFSS_UNROLL
  for (int c = 0; c < kChains; ++c) s += acc[c][0] + acc[c][1] + acc[c][2] + acc[c][3];
  sink[blockIdx.x * blockDim.x + threadIdx.x] = s;
}

template <bool Sparse>
double time_mma(int blocks, int iters, float* sink) {
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  mma_throughput<Sparse><<<blocks, 256>>>(iters / 8, 1u, sink);  // warm-up, clocks up
  float best = 1e30f;
  for (int rep = 0; rep < 5; ++rep) {
    cudaEventRecord(e0);
    mma_throughput<Sparse><<<blocks, 256>>>(iters, static_cast<std::uint32_t>(rep), sink);
    cudaEventRecord(e1);
    cudaEventSynchronize(e1);
    float ms = 0.f;
    cudaEventElapsedTime(&ms, e0, e1);
    best = std::min(best, ms);
  }
  CUDA_OK(cudaGetLastError());
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  return best;
}

void timing_section() {
  cudaDeviceProp p{};
  cudaGetDeviceProperties(&p, 0);
  const int blocks = 4 * p.multiProcessorCount;  // 32 warps per SM
  const int iters = 4096;
  dbuf<float> sink(static_cast<std::size_t>(blocks) * 256);
  const double ms_dense = time_mma<false>(blocks, iters, sink.ptr);
  const double ms_sparse = time_mma<true>(blocks, iters, sink.ptr);
  const double instr = static_cast<double>(blocks) * 8 * iters * kChains;  // per warp-level MMA
  // Dense m16n8k16: 2*16*8*16 flops; sparse m16n8k32: 2*16*8*32 dense-equivalent flops.
  const double tf_dense = instr * 4096 / (ms_dense * 1e-3) / 1e12;
  const double tf_sparse = instr * 8192 / (ms_sparse * 1e-3) / 1e12;
  char buf[256];
  std::snprintf(buf, sizeof buf,
                "bf16 mma.sync m16n8k16 %.1f TFLOP/s (%.3f ms), mma.sp m16n8k32 %.1f dense-equivalent TFLOP/s (%.3f ms); "
                "sparse/dense instruction time %.2f (2:4 gains when < 2)",
                tf_dense, ms_dense, tf_sparse, ms_sparse, ms_sparse / ms_dense);
  line("timing", "INFO", buf);
}

}  // namespace

int main(int argc, char** argv) {
  std::set<std::string> sections;
  bool quick = false;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--quick") {
      quick = true;
    } else if (arg == "--section" && i + 1 < argc) {
      sections.insert(argv[++i]);
    } else {
      std::printf("usage: dfss_gpu_probe [--section info|meta|nan|kernels|timing|profile]... [--quick]\n");
      return arg == "--help" ? 0 : 2;
    }
  }
  if (sections.empty()) sections = {"info", "meta", "nan", "kernels", "timing"};
  if (!device_info()) return 77;
  if (sections.count("meta") != 0) {
    meta_section<__nv_bfloat16, 0>();
    meta_section<__nv_bfloat16, 1>();
    meta_section<__half, 0>();
    meta_section<__half, 1>();
  }
  if (sections.count("nan") != 0) {
    nan_section<__nv_bfloat16>();
    nan_section<__half>();
  }
  if (sections.count("kernels") != 0) kernels_section(quick);
  if (sections.count("timing") != 0) timing_section();
  if (sections.count("profile") != 0) {
    kernels_dispatch({1, 4096, 4096, 8, 8, 64, true, false, true, {}}, true);
  }
  std::printf("PROBE done: %d failure(s)\n", g_failures);
  return g_failures == 0 ? 0 : 1;
}
