// dfss_decode_overlap: whether a core hides memory behind a decode step's amount of arithmetic
// (docs/benchmarks.md, "Zen 4: the lanes of two keys summed by one tree, and where a grouped bf16
// decode step from memory loses its time"). Not a test: no dfss code runs.
//
//   build/bench/dfss_decode_overlap [threads=2] [MiB per thread=128] [tile KiB=256]
//
// Each thread reads its own buffer once, every 64-byte line by one vector load followed by W
// multiply-adds on it into 12 accumulators held in registers (independent chains: the rate of the
// arithmetic is its throughput, not its latency, unlike dfss_memory_streams). On Zen 4 a 512-bit
// FMA and a 512-bit vdpbf16ps both issue one per cycle, so W = 8 is about the arithmetic a grouped
// bf16 decode step (GQA 32:8, d = 128) does per byte of its cache: 64 cycles per 512 bytes. Three
// read orders: "one stream" (the buffer in order); "K, V tiles" (the buffer's halves as K and V,
// a tile of each in turn, as the decode kernel's Q K^T and P V take a key tile); "V touched" (the
// same, but each 8 KiB block of the V half is first read whole by one load per line and then
// computed from L1, as key_major_accumulate does with a block of 32 bf16 V rows). Every timed pass
// follows a 512 MiB write elsewhere, so the buffer comes from memory; medians of 5 passes. "in L2":
// the one-stream loop over 256 KiB per thread, repeated: the arithmetic's own rate.
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace {

/// One cache line of floats as a vector.
typedef float line_vec __attribute__((vector_size(64), aligned(64)));  // NOLINT(modernize-use-using)

/// Accumulators: enough independent chains to cover an FMA's latency at two per cycle, all in
/// registers (a line is one 512-bit register with AVX-512, two 256-bit ones without).
#if defined(__AVX512F__)
constexpr int kChains = 12;
#else
constexpr int kChains = 6;
#endif
/// Bytes a touched V block holds: 32 bf16 rows at d = 128 (kKeyMajorBlock).
constexpr std::size_t kTouchBlock = 8192;

volatile float g_sink[256];

enum class order { one_stream, tiles, touched };

/// W multiply-adds on every line of [p, p + bytes), round robin over the accumulators.
template <int W>
inline void compute(const char* p, std::size_t bytes, line_vec (&acc)[kChains]) {
  // A multiplier per chain, so that the compiler cannot share x * w between chains.
  line_vec w[kChains];
  for (int k = 0; k < kChains; ++k) w[k] = line_vec{} + 1e-3f * static_cast<float>(k + 1);
  for (std::size_t off = 0; off < bytes; off += 4 * sizeof(line_vec)) {
#pragma GCC unroll 4
    for (int l = 0; l < 4; ++l) {
      const line_vec x = *reinterpret_cast<const line_vec*>(p + off + l * sizeof(line_vec));
      if constexpr (W == 0) acc[l] += x;
#pragma GCC unroll 16
      for (int k = 0; k < W; ++k) acc[(l * W + k) % kChains] = x * w[(l * W + k) % kChains] + acc[(l * W + k) % kChains];
    }
  }
}

/// One load per line of [p, p + bytes), added into @p any (one cheap operation per line, as the
/// kernel's OR).
inline void touch(const char* p, std::size_t bytes, line_vec& any) {
  for (std::size_t off = 0; off < bytes; off += sizeof(line_vec)) any += *reinterpret_cast<const line_vec*>(p + off);
}

template <int W>
double pass(const char* buf, std::size_t bytes_per_thread, order how, std::size_t tile, int reps, int threads) {
  const auto start = std::chrono::steady_clock::now();
#pragma omp parallel num_threads(threads)
  {
    const int id = omp_get_thread_num();
    const char* base = buf + static_cast<std::size_t>(id) * bytes_per_thread;
    line_vec acc[kChains] = {};
    line_vec any = {};
    for (int r = 0; r < reps; ++r) {
      if (how == order::one_stream) {
        compute<W>(base, bytes_per_thread, acc);
        continue;
      }
      const std::size_t half = bytes_per_thread / 2;
      for (std::size_t t = 0; t + tile <= half; t += tile) {
        compute<W>(base + t, tile, acc);
        const char* v = base + half + t;
        if (how == order::tiles) {
          compute<W>(v, tile, acc);
          continue;
        }
        for (std::size_t b = 0; b < tile; b += kTouchBlock) {
          touch(v + b, kTouchBlock, any);
          compute<W>(v + b, kTouchBlock, acc);
        }
      }
    }
    line_vec t = acc[0] + any;
    for (int i = 1; i < kChains; ++i) t += acc[i];
    float sum = 0.0f;
    for (int i = 0; i < 16; ++i) sum += t[i];
    g_sink[id % 256] = sum;
  }
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

template <int W>
void row(char* buf, std::size_t bytes, std::size_t tile, int threads, char* flush, std::size_t flush_bytes) {
  const std::size_t small = std::size_t{256} << 10;
  const int reps = 256;
  const double t_l2 = pass<W>(buf, small, order::one_stream, tile, reps, threads);
  const double l2 = static_cast<double>(small) * threads * reps / t_l2 / 1e9;
  std::printf("W = %2d  in L2 %6.1f |", W, l2);
  for (const order how : {order::one_stream, order::tiles, order::touched}) {
    std::vector<double> times;
    for (int r = 0; r < 5; ++r) {
      std::memset(flush, r, flush_bytes);
      times.push_back(pass<W>(buf, bytes, how, tile, 1, threads));
    }
    std::sort(times.begin(), times.end());
    std::printf(" %6.1f", static_cast<double>(bytes) * threads / times[2] / 1e9);
  }
  std::printf("\n");
}

}  // namespace

int main(int argc, char** argv) {
  const int threads = argc > 1 ? std::atoi(argv[1]) : 2;
  const std::size_t mib = argc > 2 ? static_cast<std::size_t>(std::atoll(argv[2])) : 128;
  const std::size_t tile_kib = argc > 3 ? static_cast<std::size_t>(std::atoll(argv[3])) : 256;
  if (threads < 1 || threads > 256 || mib < 1 || tile_kib < 8 || tile_kib % 8 != 0 || 2 * (tile_kib << 10) > (mib << 20)) {
    std::fprintf(stderr,
                 "usage: decode_overlap [threads 1..256] [MiB per thread >= 1] [tile KiB, a multiple of 8, at most half "
                 "the buffer]\n");
    return 2;
  }
  const std::size_t bytes = mib << 20, tile = tile_kib << 10;
  auto* buf = static_cast<char*>(std::aligned_alloc(4096, bytes * static_cast<std::size_t>(threads)));
  const std::size_t flush_bytes = std::size_t{512} << 20;
  auto* flush = static_cast<char*>(std::aligned_alloc(4096, flush_bytes));
  if (buf == nullptr || flush == nullptr) {
    std::fprintf(stderr, "decode_overlap: out of memory\n");
    return 1;
  }
  // Not zeros: the loads feed multiply-adds.
  for (std::size_t i = 0; i < bytes * static_cast<std::size_t>(threads); i += sizeof(float)) {
    const float x = 1.0f + static_cast<float>(i % 4099) * 1e-4f;
    std::memcpy(buf + i, &x, sizeof x);
  }
  std::printf("threads %d, %zu MiB per thread, tiles of %zu KiB; GB/s of the buffer's bytes, medians of 5 passes\n",
              threads, mib, tile_kib);
  std::printf("W per line      | one stream  K, V tiles  V touched\n");
  row<0>(buf, bytes, tile, threads, flush, flush_bytes);
  row<2>(buf, bytes, tile, threads, flush, flush_bytes);
  row<4>(buf, bytes, tile, threads, flush, flush_bytes);
  row<8>(buf, bytes, tile, threads, flush, flush_bytes);
  row<12>(buf, bytes, tile, threads, flush, flush_bytes);
  std::free(buf);
  std::free(flush);
  return 0;
}
