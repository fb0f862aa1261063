// dfss_memory_streams: how fast threads read memory when they compute between their loads, reading
// one sequential stream or several interleaved ones (docs/benchmarks.md, "Sapphire Rapids: where
// the causal 1:2 prefill's time goes, and several read streams"). Not a test: no dfss code runs.
//
//   build/bench/dfss_memory_streams [threads=2] [MiB per thread=256]
//
// Each thread reads its own buffer once, every 64-byte line by one 64-byte vector load followed by W
// more multiply-adds on it (W = 0: a plain read; more W: more arithmetic per byte, as a grouped
// decode step does more per key than a one-row step). GCC vector extensions, so that it builds for
// any target: one 512-bit FMA per line on AVX-512, two 256-bit ones on AVX2. The buffer is cut into S equal parts read in
// turn, `visit` bytes of one part at a time (S = 1: one sequential stream). Every timed pass
// follows a 512 MiB write elsewhere, so the buffer comes from memory; medians of 3 passes. "in L2"
// is the same loop over 256 KiB per thread, repeated: the arithmetic's own rate.
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

volatile float g_sink[256];

double pass(const float* buf, std::size_t floats_per_thread, int streams, int visit_bytes, int work, int threads) {
  const auto start = std::chrono::steady_clock::now();
#pragma omp parallel num_threads(threads)
  {
    const int id = omp_get_thread_num();
    const float* base = buf + static_cast<std::size_t>(id) * floats_per_thread;
    const std::size_t part = floats_per_thread / static_cast<std::size_t>(streams);
    const std::size_t visit = static_cast<std::size_t>(visit_bytes) / sizeof(float);
    line_vec acc[8] = {};
    const line_vec w = line_vec{} + 1e-3f;
    for (std::size_t off = 0; off + visit <= part; off += visit) {
      for (int s = 0; s < streams; ++s) {
        const float* p = base + static_cast<std::size_t>(s) * part + off;
        for (std::size_t l = 0; l < visit; l += 16) {
          const line_vec x = *reinterpret_cast<const line_vec*>(p + l);
          acc[(l / 16) % 8] = x * w + acc[(l / 16) % 8];
          for (int k = 0; k < work; ++k) acc[(k + 1) % 8] = x * w + acc[(k + 1) % 8];
        }
      }
    }
    line_vec t = acc[0];
    for (int i = 1; i < 8; ++i) t += acc[i];
    float sum = 0.0f;
    for (int i = 0; i < 16; ++i) sum += t[i];
    g_sink[id % 256] = sum;
  }
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace

int main(int argc, char** argv) {
  const int threads = argc > 1 ? std::atoi(argv[1]) : 2;
  const std::size_t mib = argc > 2 ? static_cast<std::size_t>(std::atoll(argv[2])) : 256;
  if (threads < 1 || threads > 256 || mib < 1) {
    std::fprintf(stderr, "usage: memory_streams [threads 1..256] [MiB per thread >= 1]\n");
    return 2;
  }
  const std::size_t bytes = mib << 20, floats = bytes / sizeof(float);
  auto* buf = static_cast<float*>(std::aligned_alloc(4096, bytes * static_cast<std::size_t>(threads)));
  const std::size_t flush_bytes = std::size_t{512} << 20;
  auto* flush = static_cast<char*>(std::aligned_alloc(4096, flush_bytes));
  if (buf == nullptr || flush == nullptr) {
    std::fprintf(stderr, "memory_streams: out of memory\n");
    return 1;
  }
  std::fill(buf, buf + floats * static_cast<std::size_t>(threads), 1.0f);
  std::printf("threads %d, %zu MiB per thread; GB/s of the buffer's bytes, medians of 3 passes\n", threads, mib);
  for (const int work : {0, 2, 4, 8}) {
    const std::size_t small = (std::size_t{256} << 10) / sizeof(float);
    const int reps = 256;
    double t = 0;
    for (int r = 0; r < reps; ++r) t += pass(buf, small, 1, 1024, work, threads);
    std::printf("W = %d  in L2 %6.1f |", work, static_cast<double>(small * sizeof(float)) * threads * reps / t / 1e9);
    for (const int visit : {1024, 4096}) {
      for (const int streams : {1, 2, 4, 8}) {
        std::vector<double> times;
        for (int r = 0; r < 3; ++r) {
          std::memset(flush, r, flush_bytes);
          times.push_back(pass(buf, floats, streams, visit, work, threads));
        }
        std::sort(times.begin(), times.end());
        std::printf("  %d KiB S=%d %5.1f", visit / 1024, streams, static_cast<double>(bytes) * threads / times[1] / 1e9);
      }
      std::printf(" |");
    }
    std::printf("\n");
  }
  std::free(buf);
  std::free(flush);
  return 0;
}
