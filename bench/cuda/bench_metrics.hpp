// bench/cuda/bench_metrics.hpp: the host-side arithmetic of dfss_bench_cuda (plain C++, no CUDA):
// its shape grid, FLOP and byte counts, medians, and JSON / markdown formatting. Run on the CPU by
// `dfss_bench_cuda --dry-run` (CTest dfss_bench_cuda_dry_run recomputes every count independently).
//
// Conventions (docs/gpu-results.md, "Benchmark method"):
//   - FLOPs count multiply-adds as 2 and ignore the softmax. Dense-equivalent FLOPs are the same
//     number for every method, 4 B H Lq Lk d (Q K^T and P V over every key, masks not subtracted),
//     so dense-equivalent TFLOP/s compare times directly. Effective FLOPs are the products a method
//     performs: dense 4 B H Lq Lk d; DFSS 2 B H Lq Lk d (Q K^T, dense) + 2 B H Lq Lk d N/M (P V on
//     the kept N of every M keys).
//   - Bytes count each stage's reads of its inputs and writes of its outputs once (perfect reuse
//     inside a stage, none across stages), at logical sizes (no tile padding, masked keys counted):
//     DFSS: SDDMM reads Q, K and writes the compressed weights (Lq Lk N/M elements per slice), the
//     metadata (4 bits per group of 4 keys: Lk / 8 bytes per row) and the maxima (an f32 per row and
//     32 keys, Lk / 8 bytes per row, and one per row); no softmax stage (folded into the other two);
//     the SpMM reads weights, metadata, maxima and V and writes O. Dense: the first GEMM reads Q, K and
//     writes S (Lq Lk per slice); the softmax reads S and writes P; the second GEMM reads P, V and
//     writes O. GB/s = those bytes / time. io bytes (Q, K, V read once, O written once) are the
//     traffic floor of any method, fused ones included; SDPA is reported against those.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

namespace dfss::bench {

using i64 = std::int64_t;

/// One benchmark shape: [B, H, L, d] self-attention (Lq = Lk = L, H = Hkv), 16-bit elements.
struct shape {
  std::string grid;
  i64 B, H, L, d;
  bool key_padding;
};

/// The grid: "artifact" = the original DFSS benchmark.py (4 heads, d = 64, L = 256..4096, batch 48,
/// 24 at L = 4096); "bert" = BERT-large (16 heads, d = 64, L = 384, batch 32, key padding); "all" =
/// both; "smoke" = one small shape. tools/bench/cuda_sdpa.py's shapes() is the same list.
inline bool grid_shapes(const std::string& grid, std::vector<shape>& out) {
  if (grid != "artifact" && grid != "bert" && grid != "all" && grid != "smoke") return false;
  if (grid == "smoke") out.push_back({"smoke", 2, 4, 256, 64, true});
  if (grid == "artifact" || grid == "all") {
    for (i64 L : {256, 512, 1024, 2048, 4096}) out.push_back({"artifact", L == 4096 ? 24 : 48, 4, L, 64, false});
  }
  if (grid == "bert" || grid == "all") out.push_back({"bert", 32, 16, 384, 64, true});
  return true;
}

inline constexpr double kElemBytes = 2.0;  // bf16 inputs, intermediates and output

/// The FLOP and per-stage byte counts of one method on one shape (see the conventions above).
struct counts {
  double flops_dense_equivalent = 0;
  double flops_effective = 0;
  double stage_bytes[3] = {0, 0, 0};
  double bytes() const { return stage_bytes[0] + stage_bytes[1] + stage_bytes[2]; }
};

inline double slice_elems(const shape& s) { return static_cast<double>(s.B) * static_cast<double>(s.H); }

/// Q, K, V read once and O written once.
inline double io_bytes(const shape& s) { return 4.0 * slice_elems(s) * static_cast<double>(s.L * s.d) * kElemBytes; }

inline double dense_equivalent_flops(const shape& s) {
  return 4.0 * slice_elems(s) * static_cast<double>(s.L) * static_cast<double>(s.L) * static_cast<double>(s.d);
}

/// The DFSS pipeline with pattern N:M.
inline counts dfss_counts(const shape& s, int n, int m) {
  counts c;
  const double bh = slice_elems(s), L = static_cast<double>(s.L), d = static_cast<double>(s.d);
  const double qkvo = bh * L * d * kElemBytes;  // one of Q, K, V, O
  const double values = bh * L * L * n / m * kElemBytes;
  const double meta = bh * L * L / 8.0;
  const double maxima = bh * L * L / 8.0 + bh * L * 4.0;  // tile maxima (f32 per 32 keys) and row maxima
  c.flops_dense_equivalent = dense_equivalent_flops(s);
  c.flops_effective = 2.0 * bh * L * L * d + 2.0 * bh * L * L * d * n / m;
  c.stage_bytes[0] = 2 * qkvo + values + meta + maxima;
  c.stage_bytes[1] = 0;
  c.stage_bytes[2] = values + meta + maxima + 2 * qkvo;
  return c;
}

/// The dense pipeline: GEMM, softmax, GEMM.
inline counts dense_counts(const shape& s) {
  counts c;
  const double bh = slice_elems(s), L = static_cast<double>(s.L), d = static_cast<double>(s.d);
  const double qkvo = bh * L * d * kElemBytes;
  const double scores = bh * L * L * kElemBytes;
  c.flops_dense_equivalent = dense_equivalent_flops(s);
  c.flops_effective = c.flops_dense_equivalent;
  c.stage_bytes[0] = 2 * qkvo + scores;
  c.stage_bytes[1] = 2 * scores;
  c.stage_bytes[2] = scores + 2 * qkvo;
  return c;
}

/// Median of @p x (the mean of the two middle values for an even count); 0 for none.
inline double median(std::vector<double> x) {
  if (x.empty()) return 0;
  std::sort(x.begin(), x.end());
  const std::size_t h = x.size() / 2;
  return x.size() % 2 == 1 ? x[h] : 0.5 * (x[h - 1] + x[h]);
}

/// Throughputs of @p c done in @p ms milliseconds (0 when not measured).
inline double tflops(double flops, double ms) { return ms > 0 ? flops / (ms * 1e-3) / 1e12 : 0; }
inline double gbps(double bytes, double ms) { return ms > 0 ? bytes / (ms * 1e-3) / 1e9 : 0; }

/// One timed method on one shape: medians over the timed iterations (ms; 0 = not measured, as in a
/// dry run), with its counts.
struct result {
  std::string method;  ///< e.g. "dfss_2of4_kernels", "dfss_2of4_api", "dense_cublas"
  counts c;
  bool has_stages = false;  ///< stage_ms are measured (the raw pipelines), not only the total
  double ms = 0;            ///< median of the per-call totals
  double stage_ms[3] = {0, 0, 0};
};

/// A JSON number, or null when not measured.
inline std::string json_number(double x, bool measured) {
  if (!measured) return "null";
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.6g", x);
  return buf;
}

/// A count (FLOPs, bytes): an integer below 2^53 in every grid shape, so exact in a double; printed
/// in full.
inline std::string json_count(double x) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.0f", x);
  return buf;
}

inline std::string json_result(const shape& s, const result& r, bool measured) {
  std::string o = "{\"grid\":\"" + s.grid + "\",\"B\":" + std::to_string(s.B) + ",\"H\":" + std::to_string(s.H) +
                  ",\"L\":" + std::to_string(s.L) + ",\"d\":" + std::to_string(s.d) +
                  ",\"key_padding\":" + (s.key_padding ? "true" : "false") + ",\"method\":\"" + r.method + "\"" +
                  ",\"flops_dense_equivalent\":" + json_count(r.c.flops_dense_equivalent) +
                  ",\"flops_effective\":" + json_count(r.c.flops_effective) + ",\"bytes\":" + json_count(r.c.bytes()) +
                  ",\"io_bytes\":" + json_count(io_bytes(s)) + ",\"stage_bytes\":[" + json_count(r.c.stage_bytes[0]) +
                  "," + json_count(r.c.stage_bytes[1]) + "," + json_count(r.c.stage_bytes[2]) + "]" +
                  ",\"ms\":" + json_number(r.ms, measured);
  if (r.has_stages) {
    o += ",\"stage_ms\":[" + json_number(r.stage_ms[0], measured) + "," + json_number(r.stage_ms[1], measured) + "," +
         json_number(r.stage_ms[2], measured) + "]";
    o += ",\"stage_gbps\":[" + json_number(gbps(r.c.stage_bytes[0], r.stage_ms[0]), measured) + "," +
         json_number(gbps(r.c.stage_bytes[1], r.stage_ms[1]), measured) + "," +
         json_number(gbps(r.c.stage_bytes[2], r.stage_ms[2]), measured) + "]";
  }
  o += ",\"tflops_dense_equivalent\":" + json_number(tflops(r.c.flops_dense_equivalent, r.ms), measured) +
       ",\"tflops_effective\":" + json_number(tflops(r.c.flops_effective, r.ms), measured) +
       ",\"gbps\":" + json_number(gbps(r.c.bytes(), r.ms), measured) + "}";
  return o;
}

/// The conventions, as the JSON's "conventions" object (one line each).
inline const char* json_conventions() {
  return "{\"flops\":\"multiply-add = 2, softmax not counted; dense-equivalent = 4 B H Lq Lk d for every method; "
         "effective = the products performed (DFSS: 2 B H Lq Lk d (1 + N/M))\","
         "\"bytes\":\"each stage reads its inputs and writes its outputs once, logical sizes (no padding, masked keys "
         "counted), bf16 elements, metadata Lk/8 bytes per row; io_bytes = Q, K, V read + O written\","
         "\"time\":\"CUDA events around each call (or stage), synchronised per iteration, median over the timed "
         "iterations after untimed warm-up ones\"}";
}

/// A markdown row: shape, method, median ms, dense-equivalent and effective TFLOP/s, GB/s.
inline std::string markdown_row(const shape& s, const result& r, bool measured) {
  char buf[512];
  if (measured) {
    std::snprintf(buf, sizeof buf, "| %s | %lld | %lld | %lld | %lld | %d | %s | %.4f | %.1f | %.1f | %.0f |\n",
                  s.grid.c_str(), static_cast<long long>(s.B), static_cast<long long>(s.H), static_cast<long long>(s.L),
                  static_cast<long long>(s.d), s.key_padding ? 1 : 0, r.method.c_str(), r.ms,
                  tflops(r.c.flops_dense_equivalent, r.ms), tflops(r.c.flops_effective, r.ms), gbps(r.c.bytes(), r.ms));
  } else {
    std::snprintf(buf, sizeof buf, "| %s | %lld | %lld | %lld | %lld | %d | %s | - | - | - | - |\n", s.grid.c_str(),
                  static_cast<long long>(s.B), static_cast<long long>(s.H), static_cast<long long>(s.L),
                  static_cast<long long>(s.d), s.key_padding ? 1 : 0, r.method.c_str());
  }
  return buf;
}

inline const char* markdown_header() {
  return "| grid | B | H | L | d | pad | method | ms (median) | TFLOP/s dense-eq. | TFLOP/s effective | GB/s |\n"
         "|---|---|---|---|---|---|---|---|---|---|---|\n";
}

}  // namespace dfss::bench
