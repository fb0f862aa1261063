// dfss_head_phases: a read-only model of the decode kernel's order over a cache whose kv heads are
// interleaved ([L, Hkv, d], d = 128 in bf16: 256 bytes per head and key), against a plain sweep
// (docs/benchmarks.md, "Zen 4: head blocks of 32 and Q K^T phases of 8 keys"). Not a test: no dfss
// code runs.
//
//   build/bench/dfss_head_phases [threads=2] [keys=16384] [kv heads=32]
//
// The order modelled is the decode kernel's (src/cpu/simd/attention_decode.cpp): tasks of (chunk of
// 512 keys, block of `hb` kv heads), chunk-major, dealt to the threads in turn; per task, tiles of
// 256 keys; per tile the K rows and then the V rows, each in phases of `ph` keys, every head of the
// block in turn within a phase reading its 256 bytes of each key of the phase. One 64-byte vector
// load per line and one add (GCC vector extensions, so that it builds for any target). Every timed
// pass follows a 512 MiB write elsewhere, so the cache comes from memory; medians of 3 passes, in GB/s
// of the K and V bytes.
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

constexpr std::size_t kHeadBytes = 256;   // d = 128 bf16 values
constexpr std::size_t kChunkKeys = 512;   // kDecodeMinChunk
constexpr std::size_t kTileKeys = 256;    // kDecodeKeyTileInterleaved

volatile float g_sink[256];

/// Adds the 4 lines of one head's row at @p p to @p acc.
inline void read_row(const char* p, line_vec (&acc)[4]) {
  for (int l = 0; l < 4; ++l) acc[l] += *reinterpret_cast<const line_vec*>(p + 64 * l);
}

/// One pass: @p hb = 0 is the plain sweep (each thread its contiguous share of K, then of V).
double pass(const char* k, const char* v, std::size_t keys, std::size_t heads, std::size_t hb, std::size_t ph,
            int threads) {
  const std::size_t row = heads * kHeadBytes;
  const auto start = std::chrono::steady_clock::now();
#pragma omp parallel num_threads(threads)
  {
    const auto id = static_cast<std::size_t>(omp_get_thread_num());
    line_vec acc[4] = {};
    if (hb == 0) {
      const std::size_t share = keys * row / static_cast<std::size_t>(threads);
      for (const char* base : {k, v}) {
        for (std::size_t x = id * share; x + 256 <= (id + 1) * share; x += 256) read_row(base + x, acc);
      }
    } else {
      const std::size_t blocks = heads / hb;
      std::size_t task = 0;
      for (std::size_t c0 = 0; c0 < keys; c0 += kChunkKeys) {
        for (std::size_t blk = 0; blk < blocks; ++blk, ++task) {
          if (task % static_cast<std::size_t>(threads) != id) continue;
          for (std::size_t j0 = c0; j0 < std::min(keys, c0 + kChunkKeys); j0 += kTileKeys) {
            const std::size_t j1 = std::min(keys, j0 + kTileKeys);
            for (const char* base : {k, v}) {
              for (std::size_t t0 = j0; t0 < j1; t0 += ph) {
                for (std::size_t h = blk * hb; h < (blk + 1) * hb; ++h) {
                  for (std::size_t t = t0; t < std::min(j1, t0 + ph); ++t) read_row(base + t * row + h * kHeadBytes, acc);
                }
              }
            }
          }
        }
      }
    }
    line_vec s = acc[0] + acc[1] + acc[2] + acc[3];
    float sum = 0.0f;
    for (int i = 0; i < 16; ++i) sum += s[i];
    g_sink[id % 256] = sum;
  }
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace

int main(int argc, char** argv) {
  const int threads = argc > 1 ? std::atoi(argv[1]) : 2;
  const long long keys_arg = argc > 2 ? std::atoll(argv[2]) : 16384;
  const long long heads_arg = argc > 3 ? std::atoll(argv[3]) : 32;
  if (threads < 1 || threads > 256 || keys_arg < 512 || keys_arg % 512 != 0 || heads_arg < 1 || heads_arg > 1024) {
    std::fprintf(stderr, "usage: head_phases [threads 1..256] [keys: a multiple of 512] [kv heads 1..1024]\n");
    return 2;
  }
  const auto keys = static_cast<std::size_t>(keys_arg), heads = static_cast<std::size_t>(heads_arg);
  const std::size_t bytes = keys * heads * kHeadBytes;
  auto* k = static_cast<char*>(std::aligned_alloc(4096, bytes));
  auto* v = static_cast<char*>(std::aligned_alloc(4096, bytes));
  const std::size_t flush_bytes = std::size_t{512} << 20;
  auto* flush = static_cast<char*>(std::aligned_alloc(4096, flush_bytes));
  if (k == nullptr || v == nullptr || flush == nullptr) {
    std::fprintf(stderr, "head_phases: out of memory\n");
    return 1;
  }
  std::fill(reinterpret_cast<float*>(k), reinterpret_cast<float*>(k + bytes), 1.0f);
  std::fill(reinterpret_cast<float*>(v), reinterpret_cast<float*>(v + bytes), 1.0f);
  const auto rate = [&](std::size_t hb, std::size_t ph) {
    std::vector<double> times;
    for (int r = 0; r < 3; ++r) {
      std::memset(flush, r, flush_bytes);
      times.push_back(pass(k, v, keys, heads, hb, ph, threads));
    }
    std::sort(times.begin(), times.end());
    return 2.0 * static_cast<double>(bytes) / times[1] / 1e9;
  };
  std::printf("threads %d, %zu keys, %zu kv heads, d = 128 bf16 (%zu MiB of K and V); GB/s, medians of 3 passes\n",
              threads, keys, heads, 2 * bytes >> 20);
  std::printf("sweep %.1f\n", rate(0, 0));
  for (const std::size_t hb : {std::size_t{8}, std::size_t{16}, std::size_t{32}}) {
    if (hb > heads || heads % hb != 0) continue;
    std::printf("blocks of %2zu heads:", hb);
    for (const std::size_t ph : {std::size_t{4}, std::size_t{8}, std::size_t{16}, std::size_t{32}}) {
      std::printf("  %2zu keys per phase %5.1f", ph, rate(hb, ph));
    }
    std::printf("\n");
  }
  std::free(k);
  std::free(v);
  std::free(flush);
  return 0;
}
