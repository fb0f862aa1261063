// The DFSS decode forward (few query rows against a long KV cache) over Google Highway, compiled once
// per SIMD target like attention_forward.cpp and picked by the selector for seqlen_q <=
// kDecodeMaxQueryRows (targets.hpp).
//
// The fused forward splits work over query rows and packs the whole K and V of a (batch, kv head)
// per worker: with one query row that is all overhead (the cache is read, written packed, read
// again) and B * H tasks may not fill the threads. Here a task is (batch, kv head, key chunk):
//   1. The Q rows of every query head of the group and every query row (group * Lq rows) are loaded
//      once per task.
//   2. Per key tile of W keys of the chunk, S = Q K^T by one of two paths:
//      - direct (rows of K and V contiguous, d a multiple of the vector, every K value of the tile
//        tame): each key's row is read straight from the cache in address order and dotted with
//        every row of the group (a vector of partial sums per row and key, its lanes summed at
//        once; a bf16 cache on avx3_bf16 by vdpbf16ps, bf16dot::decode_dots). With
//        MHA, bound by the memory's rate: with both threads busy it reads the cache at 80-100% of
//        a plain sweep; with grouped heads, by compute as much.
//      - panel (anything else: a huge or non-finite K value, a risky Q, a bias with values other
//        than 0 and -inf, strided rows): the tile of K is converted into the micro-kernel's panels
//        and S computed with the fused forward's micro-kernel (same summation order, so these
//        scores are bitwise the fused forward's), with software prefetch of the next tile.
//      Then per row bias, masks (key_limit), NaN / +inf detection and the N:M selection with
//      compaction (kernel<T>::compact, the fused forward's code), and the online softmax update.
//      The direct path sums in another order than the fused forward, so where two scores of a group
//      are within rounding of each other the two kernels may keep different keys.
//   3. The V rows of the tile are read only where some row of the group kept the key with a finite
//      score: a direct tile reads them from the cache while it adds p * V[key], row by row for one
//      row, key-major for a group (key_major_accumulate; a bf16 cache on avx3_bf16 by vdpbf16ps with
//      the weights rounded to bf16, bf16dot::decode_pv); a panel tile converts the union of kept
//      rows once into scratch (prefetched when the tile's selection is known, read after the next
//      tile's scores; a dense pattern's V is prefetched with K).
// Where the cache's kv heads are interleaved in memory ([B, L, Hkv, d]: dfss's and flash-attn's
// layout), a task is a block of kv heads of one chunk (decode_head_block), and each tile's direct
// Q K^T and P V go in phases of kDecodePhaseKeys keys (the vdpbf16ps Q K^T: kDecodePhaseKeysDot),
// every head of the block in turn, so that the heads' segments of the same key rows are read close
// together; each head's arithmetic is what a task of that head alone does, in the same order.
// Each task leaves its rows' partial state (max m_c, sum l_c, unnormalised accumulator, NaN flag).
// The task that finishes the last chunk of a (batch, kv head) folds its chunks in increasing order
// with the online softmax rescale (the same update the forward applies between key tiles): m = max(m, m_c),
// l = l e^(scale (m_old - m)) + l_c e^(scale (m_c - m)), likewise the accumulator. This is the exact
// LSE merge of docs/semantics.md (LSE_c = scale m_c + log l_c) held as (m, l) instead of LSE, so a
// chunk whose scale * m_c overflows fp32 (LSE = +inf) still merges to the fused forward's finite O.
//
// The chunk length depends on the shape (and on whether the kv heads are interleaved in memory)
// only (decode_chunk_keys), is a multiple of W (so of M and of the panel), and the fold order is
// fixed: results are bitwise identical for any thread count.
// Memory: per thread O(W d + block group Lq (W + d)) scratch (block: kv heads per task); per call the
// partial states, O(B Hkv chunks group Lq d) floats.
#include "cpu/simd/targets.hpp"  // first: it fixes the compiled targets

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "cpu/simd/attention_decode.cpp"
#include "hwy/foreach_target.h"  // IWYU pragma: keep

#include "cpu/simd/kernel_parts-inl.h"

#include "core/cpu_features.hpp"

#include <memory>


#ifndef DFSS_CPU_SIMD_DECODE_ONCE_
#define DFSS_CPU_SIMD_DECODE_ONCE_
namespace dfss::cpu::simd {

/// Tasks a decode call aims for over all (batch, kv head) pairs: enough for dynamic scheduling to
/// balance up to a few dozen threads (and a padded cache whose sequences end early).
inline constexpr std::int64_t kDecodeTargetTasks = 128;
/// Shortest key chunk: at d = 128 in fp32, 512 keys are 512 KiB of K and V per task, so the per-task
/// cost (loading the group's Q rows, writing and folding one partial state per row) stays below 1%.
inline constexpr std::int64_t kDecodeMinChunk = 512;
/// How far ahead the panel path prefetches K (and a dense pattern's V), in key tiles: one tile (128
/// KiB of fp32 K at d = 128) hides DRAM latency; 3 tiles of 64 keys measured no faster than 1, and
/// keep more of L1 and L2 busy.
inline constexpr std::int64_t kPrefetchTiles = 1;
/// The decode kernel's minimum key tile: its per-tile work per row (selection, maximum, rescale,
/// the exponentials' set-up and sum, the software pipeline's hand-over) weighs most with grouped
/// heads, where the step is bound by compute. Measured (Zen 5, 2 threads, d = 128, GQA 32:8, bf16
/// cache, two interleaved runs each): 64 -> 128 keys, dense 2.9-3.3 -> 2.5-2.6 ms at Lk = 16384
/// and 10.8-11.1 -> 9.5-9.9 ms at 65536; 128 -> 256 keys, 2.5-2.6 -> 2.2-2.3 and 9.5-9.9 -> 8.8-9.1
/// ms; fp32 caches and MHA within the runs' noise both times. 256 -> 1024 keys (Zen 4, 2 threads,
/// GQA 32:8, a driver timing dfss::attention_forward after a 128 MiB read elsewhere, medians of 5-7
/// interleaved rounds): bf16 cache dense 0.82 -> 0.75 ms at Lk = 4096, 2.94 -> 2.65 ms at 16384,
/// 10.8 -> 9.5 ms at 65536, 1:2 and 2:4 7-20% faster at 16384; fp32 caches 3-6% (19.4 -> 19.2 ms at
/// 65536); 512 keys in between. In `perf`, the share that shrank is the wait for the first V rows
/// of a tile, where the hardware prefetcher picks up the V stream after the tile's K (and the K
/// stream after its V): fewer switches between the two streams. Scratch grows with it (the S tile
/// of group * Lq rows, the kept slots: about 100 KiB per kv head of a task at 4 rows; the panel
/// path's K and V tiles, 1 MiB at d = 128). Where the kv heads are interleaved (heads_interleaved)
/// the tile stays kDecodeKeyTileInterleaved.
inline constexpr int kDecodeKeyTile = 1024;
/// The key tile where the kv heads are interleaved ([B, L, Hkv, d]), whose tasks take a block of kv
/// heads of one short chunk in phases of kDecodePhaseKeys keys (heads_interleaved): 1024 keys
/// measured no different there (Zen 4, 2 threads, Lk = 16384, GQA 32:8 bf16 5.8 against 5.9 ms, MHA
/// 32:32 bf16 17.3 against 17.2 ms, GQA fp32 7.5 against 7.9 ms, medians of 5 interleaved rounds),
/// and with 256 a task of the shortest chunk (kDecodeMinChunk) still holds two tiles.
inline constexpr int kDecodeKeyTileInterleaved = 256;
/// Keys per block of the key-major P V (key_major_accumulate): a block's V rows are read once from
/// memory by the first column slice and again from L1 by the others and by further row blocks;
/// 32 rows of fp32 at d = 128 are 16 KiB, half of Zen 4's L1.
inline constexpr int kKeyMajorBlock = 32;

/// Whether the kv heads of a key lie side by side in memory (K's head stride below its key stride:
/// a [B, L, Hkv, d] cache, dfss's and flash-attn's layout, not transformers' [B, Hkv, L, d]). A
/// task then reads every Hkv-th run of d values, and the hardware prefetchers fetch the other
/// heads' rows beside them: those are used only if the tasks of the other kv heads read the same
/// keys soon after, from the cache levels. So the tasks go key chunk by key chunk (all kv heads of
/// a chunk, then the next chunk) and the chunks are the shortest (kDecodeMinChunk keys). Measured
/// (Sapphire Rapids, GQA 32:8, bf16, d = 128, Lk = 65536, 2 threads, alternating calls in one
/// process): 45.2 ms with kv head by kv head and 4096-key chunks, 31.1 ms chunk by chunk, 28.1 ms
/// with 512-key chunks; a [B, Hkv, L, d] cache of the same values: 23.6 ms either way.
inline bool heads_interleaved(const attention_params& p) { return p.heads_kv > 1 && p.k_stride[2] < p.k_stride[1]; }

/// Kv heads per decode task at most where they are interleaved (heads_interleaved): a task keeps one
/// workspace per head (tens of KiB: the panel path's scratch is the task's, panel_scratch).
/// Measured (Sapphire Rapids, d = 128, bf16, 2 threads, alternating calls in one process): against
/// tasks of one kv head, GQA 32:8 at 65536 keys 0.80x the time with blocks of 8 (all) kv heads,
/// 0.82x for 1:2, 0.95x with blocks of 4, 0.88x at 4096 keys; MHA 32:32 at 16384 keys the same time
/// with blocks of 4, 8 or 32 while the heads took whole tiles in turn. With phases
/// (kDecodePhaseKeys), against blocks of 8: MHA 32:32 blocks of 16 0.94x the time (dense) and 0.88x
/// (1:2) at 16384 keys, 0.84x at 65536; blocks of 32 the same as 16. On Zen 4 (bf16 cache,
/// avx3_bf16, 2 threads, Lk = 16384, a driver timing dfss::attention_forward after a 128 MiB read
/// elsewhere, 4 alternating rounds, the same bits) MHA 32:32 blocks of 32 took 11.3-12.1 ms against
/// 13.6-15.0 with 16, the two halves of each key row then read by one thread; fp32 25.7-27.4
/// against 24.9-28.6 ms, within the noise.
inline constexpr std::int64_t kDecodeHeadBlock = 32;
/// Tasks per thread that the kv heads' blocks aim for at least, for dynamic scheduling to balance.
inline constexpr std::int64_t kDecodeTasksPerThread = 4;
/// Keys per phase of a tile where the kv heads are interleaved (heads_interleaved): the tile's Q K^T
/// and its P V go phase by phase, every kv head of the task's block in turn within a phase
/// (decode_pass::task), so that the heads' segments of a key row are read while the lines the
/// hardware prefetchers fetched beside them are still in L1. Head by head over whole tiles of 256
/// keys, those lines were gone by the time the next head read them. A read-only model of the
/// two orders over a bf16 cache (d = 128, blocks of 8 kv heads, 2 Sapphire Rapids threads) read at
/// 0.56-0.60 of a plain sweep's rate head by head, at 1.03-1.22 with phases of 16 or 32 keys and
/// 0.93-1.06 with 64. One key-major block of P V per phase (kKeyMajorBlock), a whole number of
/// vectors of keys on every fixed-width target (so the dot products' blocks are those of whole
/// tiles: the same bits).
inline constexpr int kDecodePhaseKeys = 32;
static_assert(kDecodePhaseKeys == kKeyMajorBlock, "one key-major block of P V per phase");
/// Keys per phase of the Q K^T (not the P V) where the kv heads are interleaved and the direct
/// path's dot products are bf16dot::decode_dots (a bf16 cache on avx3_bf16 without the AMX tiles),
/// whose scores do not depend on how the keys are cut into calls: with every head of a block in
/// turn, a phase of 32 keys reads 32 rows' segments per head, one 4 KiB page each at MHA 32:32, and
/// the hardware prefetcher, which streams within a page, lost track. Measured (Zen 4, 2 threads,
/// bf16 [B, L, Hkv, d] cache, the driver of kDecodeHeadBlock, 3 alternating rounds, the same bits),
/// against 32 keys: Lk = 65536 MHA 32:32 (blocks of 32 heads) 41-44 ms with 16 and 39-42 with 8,
/// against 52-54 with 32 keys and blocks of 16; GQA 32:8 15.7-16.4 -> 13.9-14.8 (16) -> 13.0-13.6
/// ms (8); at 16384 keys 4 or 2 keys per phase were slower than 8 (the per-call work of each head's
/// turn). A read-only model of the orders (bench/head_phases.cpp, the same two threads, three runs
/// on a noisy host) read MHA 32:32 at 0.51-0.77 of a plain sweep's rate with phases of 32 keys and
/// blocks of 16 heads, at 0.93-1.33 with phases of 8 and blocks of 32; GQA 32:8 at 0.49-0.59 with
/// phases of 32 keys, 0.73-0.87 with 8.
inline constexpr int kDecodePhaseKeysDot = 8;

/// Kv heads per task: 1, or where the kv heads are interleaved, up to kDecodeHeadBlock heads of one
/// key chunk, taken tile by tile (decode_pass::task), so that the heads read the same keys one after
/// another: the hardware prefetchers' fetches of the neighbouring heads' rows are then used from L2
/// (measured: kDecodeHeadBlock). Fewer heads per task where there would be fewer than
/// kDecodeTasksPerThread tasks per thread. It changes no result: each head's work is the same.
inline std::int64_t decode_head_block(const attention_params& p, std::int64_t chunks, int threads) {
  if (!heads_interleaved(p)) return 1;
  const std::int64_t units = std::max<std::int64_t>(1, p.batch * chunks);
  const std::int64_t want_blocks = (kDecodeTasksPerThread * std::max(threads, 1) + units - 1) / units;
  const std::int64_t blocks = std::clamp<std::int64_t>(want_blocks, (p.heads_kv + kDecodeHeadBlock - 1) / kDecodeHeadBlock,
                                                       p.heads_kv);
  return (p.heads_kv + blocks - 1) / blocks;
}

/// Keys per chunk: a multiple of the key tile width @p w (so of M), a function of the shape and
/// heads_interleaved only.
inline std::int64_t decode_chunk_keys(const attention_params& p, int w) {
  const std::int64_t pairs = std::max<std::int64_t>(1, p.batch * p.heads_kv);
  const std::int64_t want = (kDecodeTargetTasks + pairs - 1) / pairs;
  const std::int64_t most = std::max<std::int64_t>(1, (p.seqlen_k + kDecodeMinChunk - 1) / kDecodeMinChunk);
  const std::int64_t chunks = heads_interleaved(p) ? most : std::min(want, most);
  const std::int64_t keys = (p.seqlen_k + chunks - 1) / chunks;
  return std::max<std::int64_t>(w, (keys + w - 1) / w * w);
}

}  // namespace dfss::cpu::simd
#endif  // DFSS_CPU_SIMD_DECODE_ONCE_

HWY_BEFORE_NAMESPACE();
namespace dfss::cpu::simd::HWY_NAMESPACE {

#if DFSS_SIMD_KERNEL_TARGET

/// Accumulators in key_major_accumulate's register block (rows x column vectors): half the
/// registers, leaving room for the block's loaded V vectors and a broadcast weight.
#if HWY_TARGET == HWY_SSE4 || HWY_TARGET == HWY_AVX2
inline constexpr int kKeyMajorAccumulators = 8;
#else
inline constexpr int kKeyMajorAccumulators = 16;
#endif
/// Whether key_major_accumulate reads a whole tile's V rows straight from memory in passes of
/// whole rows (measured on AVX-512 only; see there), instead of touching each block first.
inline constexpr bool kKeyMajorStreamsRows = HWY_TARGET <= HWY_AVX3 && !HWY_HAVE_SCALABLE;
/// Whether key_major_accumulate, touching each block and then computing it in column passes,
/// prefetches the next block's V rows during those passes (measured on AVX2 only; see there).
inline constexpr bool kKeyMajorPrefetchesNext = HWY_TARGET == HWY_AVX2 || HWY_TARGET == HWY_SSE4;
/// Whether key_major_accumulate's vdpbf16ps P V (a bf16 cache on avx3_bf16, bf16dot::decode_pv;
/// kv heads not interleaved) has each block's first call request the next block's V rows into L2,
/// one row per pair of keys it computes, and reads a requested block without touching it first.
/// Touched and then computed from L1, a block left the memory idle while it was computed: with
/// its arithmetic skipped (a diagnostic build) a step took 0.86-0.95x the time. Measured (Zen 4, 2
/// threads, GQA 32:8, d = 128, bf16 [B, Hkv, L, d] cache, Lq = 1, each call after a 128 MiB read
/// elsewhere, the two forms alternating call by call in one process, 11-41 rounds, the median
/// ratio of each round's times to a plain sweep of the cache in the same round; the same bits):
/// dense Lk = 4096 1.29 -> 1.14x the sweep's time, 16384 1.26 -> 1.08x, 65536 1.24 -> 1.09x, 2:4
/// at 16384 1.47 -> 1.26x. Requests alone (still touching) gave about half of that; requests all
/// at once instead of spread, or into L1, less; two blocks ahead, slower than none; requests of K
/// ahead in the Q K^T, and of a tile's first V block during its selection, no faster. Without the
/// arithmetic (diagnostic builds whose loops only load) a step is slower than with it: the loads
/// must not outrun the memory.
inline constexpr bool kKeyMajorRequestsNext = true;

#if HWY_TARGET <= HWY_AVX3 || HWY_TARGET == HWY_AVX2
/// The lane sums of eight 16-lane (AVX-512) or 8-lane (AVX2) vectors, v[i]'s at key i % G of row
/// i / G of s (row stride @p stride): a transposing tree in registers, 26 instructions for the
/// eight 16-lane vectors (21 for 8-lane ones) against about 8 (7) per vector for a sum of its
/// lanes alone.
template <int G>
HWY_INLINE void store_sums8(const VF* v, float* HWY_RESTRICT s, std::int64_t stride) {
  const DF d;
  const hn::Repartition<double, DF> dd;
  VF t[4];
  for (int j = 0; j < 4; ++j) {
    t[j] = hn::Add(hn::InterleaveLower(d, v[2 * j], v[2 * j + 1]), hn::InterleaveUpper(d, v[2 * j], v[2 * j + 1]));
  }
  VF u[2];
  for (int j = 0; j < 2; ++j) {
    const auto a = hn::BitCast(dd, t[2 * j]);
    const auto b = hn::BitCast(dd, t[2 * j + 1]);
    u[j] = hn::Add(hn::BitCast(d, hn::InterleaveLower(dd, a, b)), hn::BitCast(d, hn::InterleaveUpper(dd, a, b)));
  }
  // Block b of u[j]: the partial sums over block b of v[4j .. 4j + 3]; fold the blocks.
  const VF x = hn::Add(hn::ConcatLowerLower(d, u[1], u[0]), hn::ConcatUpperUpper(d, u[1], u[0]));
  if constexpr (hn::MaxLanes(DF()) == 8) {
    // Lane i of x: the sum of v[i].
    if constexpr (G == 8) {
      hn::StoreU(x, d, s);
    } else {
      static_assert(G == 2 || G == 4, "8 / G rows of G keys");
      const hn::Half<DF> dh;
      const auto lo = hn::LowerHalf(dh, x), hi = hn::UpperHalf(dh, x);
      if constexpr (G == 4) {
        hn::StoreU(lo, dh, s);
        hn::StoreU(hi, dh, s + stride);
      } else {
        const hn::Half<decltype(dh)> d2;
        hn::StoreU(hn::LowerHalf(d2, lo), d2, s);
        hn::StoreU(hn::UpperHalf(d2, lo), d2, s + stride);
        hn::StoreU(hn::LowerHalf(d2, hi), d2, s + 2 * stride);
        hn::StoreU(hn::UpperHalf(d2, hi), d2, s + 3 * stride);
      }
    }
    return;
  }
  const hn::Half<DF> dh;
  const hn::Half<decltype(dh)> dq;
  const auto xl = hn::LowerHalf(dh, x);
  const auto xu = hn::UpperHalf(dh, x);
  const auto lo = hn::Add(hn::LowerHalf(dq, xl), hn::UpperHalf(dq, xl));
  const auto hi = hn::Add(hn::LowerHalf(dq, xu), hn::UpperHalf(dq, xu));
  if constexpr (G >= 4) {
    hn::StoreU(lo, dq, s);
    hn::StoreU(hi, dq, s + (G == 4 ? stride : 4));
  } else {
    static_assert(G == 2, "two keys of four rows");
    const hn::Half<decltype(dq)> d2;
    hn::StoreU(hn::LowerHalf(d2, lo), d2, s);
    hn::StoreU(hn::UpperHalf(d2, lo), d2, s + stride);
    hn::StoreU(hn::LowerHalf(d2, hi), d2, s + 2 * stride);
    hn::StoreU(hn::UpperHalf(d2, hi), d2, s + 3 * stride);
  }
}
#endif

#if !HWY_HAVE_SCALABLE
/// Stores the 128-bit blocks of @p v: block b at dst + b * stride.
template <class D>
HWY_INLINE void store_blocks(D d, hn::Vec<D> v, float* dst, std::int64_t stride) {
  if constexpr (hn::MaxLanes(D()) <= 4) {
    hn::StoreU(v, d, dst);
  } else {
    const hn::Half<D> dh;
    store_blocks(dh, hn::LowerHalf(dh, v), dst, stride);
    store_blocks(dh, hn::UpperHalf(dh, v), dst + static_cast<std::int64_t>(hn::MaxLanes(D()) / 8) * stride, stride);
  }
}
#endif

/// decode_pass::key_major_accumulate's plan of a tile, made in its first phase.
struct key_major_plan {
  const float* weights = nullptr;  ///< row r's weight of key t at weights[r * wstride + t]
  std::int64_t wstride = 0;
  int nu = 0;                 ///< keys read (ws.union_keys), 0: none
  bool whole_tile = false;    ///< the tile's keys are read whole, in address order
};

/// The panel path's scratch, used within one call for one kv head (panel_scores, accumulate_tile),
/// so shared by the kv heads of a task: one K tile in panels, the rows being converted, the kept V
/// rows of a tile (row W: the zero row that masked and padding slots point at). Most of a head's
/// scratch (256 of about 270 KiB at d = 128), which blocks of 16 kv heads would otherwise repeat.
struct panel_scratch {
  aligned_buffer<float> kt, rows, vt;
};

/// A kv head's scratch in a decode task: the group's Q rows, the S tile, and per row its compacted
/// kept scores and offsets, accumulator and softmax state; the panel path's at @p panel (the task's).
struct decode_workspace {
  panel_scratch* panel = nullptr;
  aligned_buffer<float> q, q_max, q_l1, s, acc, cv, row_max, row_sum, row_tile_max;
  aligned_buffer<float> weights, acc_saved;  ///< key-major P V of a direct tile: [rows][W] weights, acc before it
  aligned_buffer<std::int32_t> ci, kept, row_nan, used;
  aligned_buffer<std::uint16_t> qb;  ///< avx3_bf16 with a bf16 cache: the group's Q rows as bf16
  aligned_buffer<std::uint32_t> qt;  ///< the AMX tiles (decode_pass::amx_): Q^T as bf16 column pairs
  aligned_buffer<float> qp;          ///< a bf16 cache in the pair layout: the group's Q rows in it
  aligned_buffer<std::int32_t> union_keys, union_mark;  ///< the tile's keys some row kept, and their marks
  aligned_buffer<std::int32_t> slot_next;  ///< per row: its first slot the next phase of direct_accumulate adds
  aligned_buffer<std::uint16_t> touch;  ///< where direct_accumulate's read of a whole V tile ends up
  int tile_keys[2] = {0, 0};            ///< per slot set (parity): keys of the tile before tile_end
  bool direct[2] = {false, false};      ///< per slot set (parity): the tile took the direct path
  key_major_plan key_major;             ///< of the tile whose P V is in progress
};

/// Per-thread scratch of the decode tasks: one workspace per kv head of a task (decode_head_block).
struct decode_heads {
  std::vector<std::unique_ptr<decode_workspace>> ws;  // not movable (aligned buffers): by pointer
  panel_scratch panel;
};

template <typename T>
class decode_pass : public kernel<T> {
 public:
  using base = kernel<T>;

  /// @p bf16_dot: the direct path's Q K^T from a bf16 cache as bf16 dot products (the avx3_bf16
  /// target; other instances and input types ignore it).
  decode_pass(const attention_params& p, bool bf16_dot)
      : base(p, heads_interleaved(p) ? kDecodeKeyTileInterleaved : kDecodeKeyTile),
        rows_(static_cast<int>(group_ * p.seqlen_q)),
        rows_mk_(rows_ <= 2 ? rows_ : (rows_ + 3) / 4 * 4),
        chunk_(decode_chunk_keys(p, w_)),
        chunks_(std::max<std::int64_t>(1, (p.seqlen_k + chunk_ - 1) / chunk_)),
        cstride_(w_ + 2 * lanes_),
        dense_(p.pattern_n == p.pattern_m),
        direct_(!HWY_HAVE_SCALABLE && d_ % lanes_ == 0 && p.k_stride[3] == 1 && p.v_stride[3] == 1),
        dot_(DFSS_SIMD_BF16_DOT && (bf16_dot || tiles_fit()) && std::is_same_v<T, bfloat16> && direct_ && d_ % 32 == 0),
        pairs_(std::is_same_v<T, bfloat16> && direct_ && !dot_ && (d_ / lanes_) % 2 == 0),
        amx_(dot_ && tiles_fit()),
        interleaved_(heads_interleaved(p)),
        bias_masks_(bias_only_masks(p)) {}

  /// Whether the direct path's Q K^T and key-major P V can run on the AMX tiles (amx::decode_qk,
  /// amx::decode_pv): a bf16 cache with rows of K and V contiguous, d a multiple of 32 up to 128, a
  /// group of 2 to 16 task rows (grouped heads, drafts), on a CPU with AMX (core::cpu_uses_amx,
  /// which also has AVX512_BF16). The rest of such a call (keys past the last block of 16, a tile
  /// whose kept keys are read by index) then takes the vdpbf16ps loops on the avx3 target too:
  /// slow on Intel's cores where they would carry a whole step (cpu_has_fast_bf16_dot), but only
  /// the remainders here. Not where the kv heads are interleaved (heads_interleaved): there a tile
  /// goes in phases of 32 keys, every head in turn, and each phase's calls would load their tile
  /// configuration, Q^T and the accumulators again: GQA 32:8 with a [B, L, Hkv, d] bf16 cache
  /// measured 0.95-0.98x the time of the vector path for dense, 1.04-1.06x for 2:4.
  bool tiles_fit() const {
    return DFSS_SIMD_AMX && DFSS_SIMD_BF16_DOT && std::is_same_v<T, bfloat16> && direct_ && d_ % 32 == 0 &&
           d_ <= amx::kDecodeMaxDim && rows_ >= 2 && rows_ <= amx::kDecodeMaxRows && !heads_interleaved(p_) &&
           core::cpu_uses_amx();
  }

  void run() const {
    const std::int64_t pairs = p_.batch * p_.heads_kv;
    const std::int64_t tasks = pairs * chunks_;
    // Tasks cost the same but for masks (key lengths, causal rows): one at a time. The task that
    // finishes the last chunk of a (batch, kv head) folds it (chunked_states; a second parallel
    // region for the folds cost a whole time slice per call whenever the cores were shared).
    // Tasks (b, kv head, chunk), chunk fastest; where the kv heads are interleaved
    // (heads_interleaved), (b, chunk, block of kv heads: decode_head_block), block fastest. Partial
    // states sit at the canonical index (b Hkv + kv head) chunks + chunk either way (end_head).
    chunked_states chunked(pairs, chunks_, tasks * rows_, dp_);
    const partial_states parts = chunked.view();
    const bool by_chunk = interleaved_;
    const std::int64_t hkv = p_.heads_kv;
    const std::int64_t block = decode_head_block(p_, chunks_, worker_count(p_.num_threads, tasks));
    const std::int64_t blocks = (hkv + block - 1) / block;
    parallel_for(
        by_chunk ? p_.batch * chunks_ * blocks : tasks, p_.num_threads, schedule::dynamic,
        [&] {
          decode_heads& heads = worker_scratch<decode_heads>();
          while (heads.ws.size() < static_cast<std::size_t>(block)) heads.ws.push_back(std::make_unique<decode_workspace>());
          reserve(heads.panel);
          for (std::int64_t h = 0; h < block; ++h) reserve(*heads.ws[static_cast<std::size_t>(h)], heads.panel);
        },
        [&](std::int64_t i) {
          std::int64_t b = i / (chunks_ * hkv), hk0 = (i / chunks_) % hkv, chunk = i % chunks_, n = 1;
          if (by_chunk) {
            b = i / (chunks_ * blocks);
            chunk = (i / blocks) % chunks_;
            hk0 = (i % blocks) * block;
            n = std::min(block, hkv - hk0);
          }
          task(worker_scratch<decode_heads>().ws.data(), b, hk0, static_cast<int>(n), chunk, parts);
          for (std::int64_t h = 0; h < n; ++h) {
            const std::int64_t pair = b * hkv + hk0 + h;
            if (chunked.finish(pair)) fold(pair, parts);
          }
        });
  }

 private:
  using base::d_;
  using base::dp_;
  using base::e1_;
  using base::e2_;
  using base::group_;
  using base::lanes_;
  using base::p_;
  using base::panel_;
  using base::scale_;
  using base::w_;

  void reserve(panel_scratch& ps) const {
    const auto dp = static_cast<std::size_t>(dp_), w = static_cast<std::size_t>(w_);
    ps.kt.resize(w * dp);
    ps.rows.resize(static_cast<std::size_t>(panel_) * dp);
    ps.vt.resize((w + 1) * dp);
    std::fill(ps.vt.ptr + w * dp, ps.vt.ptr + (w + 1) * dp, 0.0f);
  }

  void reserve(decode_workspace& ws, panel_scratch& ps) const {
    const auto rows = static_cast<std::size_t>(rows_mk_);
    const auto dp = static_cast<std::size_t>(dp_), w = static_cast<std::size_t>(w_);
    ws.panel = &ps;
    ws.q.resize(rows * dp);
    ws.s.resize(rows * w);
    ws.acc.resize(rows * dp);
    ws.weights.resize(rows * w);
    ws.acc_saved.resize(rows * dp);
    ws.union_keys.resize(w);
    ws.union_mark.resize(w);
    ws.slot_next.resize(rows);
    std::fill(ws.union_mark.ptr, ws.union_mark.ptr + w, 0);
    // Two sets of compacted slots, kept counts and used keys: the tile being selected and the one
    // whose P V is pending.
    ws.cv.resize(2 * rows * static_cast<std::size_t>(cstride_));
    ws.ci.resize(2 * rows * static_cast<std::size_t>(cstride_));
    ws.kept.resize(2 * rows);
    ws.used.resize(2 * w);
    ws.touch.resize(static_cast<std::size_t>(lanes_));
    ws.row_max.resize(rows);
    ws.row_sum.resize(rows);
    ws.row_tile_max.resize(rows);
    ws.row_nan.resize(rows);
    ws.q_max.resize(rows);
    ws.q_l1.resize(rows);
    if (dot_) ws.qb.resize(rows * dp);
    if (amx_) ws.qt.resize(rows * dp / 2);
    if (pairs_) ws.qp.resize(rows * dp);
    std::fill(ws.used.ptr, ws.used.ptr + 2 * w, 0);
  }

  /// Query head and row of task row r (rows are head-major: r = head in group * Lq + row).
  std::int64_t head_of(std::int64_t hk, int r) const { return hk * group_ + r / p_.seqlen_q; }
  std::int64_t row_of(int r) const { return r % p_.seqlen_q; }

  /// Task (batch @p b, key chunk @p chunk, kv heads @p hk0 .. @p hk0 + @p n - 1, workspace *ws[h] for
  /// head hk0 + h): the tiles of the chunk in order, each head's step of the software pipeline per
  /// tile, so that the heads read the same keys one after another (decode_head_block). Each head's
  /// work is what a task of that head alone does, in the same order: the same bits.
  void task(const std::unique_ptr<decode_workspace>* ws, std::int64_t b, std::int64_t hk0, int n, std::int64_t chunk,
            const partial_states& parts) const {
    std::int64_t tile_end = 0;  // keys at or past every row's limit are never read
    for (std::int64_t i = 0; i < p_.seqlen_q; ++i) tile_end = std::max(tile_end, this->key_limit(b, i));
    const std::int64_t j_begin = chunk * chunk_;
    const std::int64_t j_end = std::min(j_begin + chunk_, tile_end);
    bool q_risky[kDecodeHeadBlock];
    for (int h = 0; h < n; ++h) q_risky[h] = begin_head(*ws[h], b, hk0 + h, j_begin < j_end);
    // Software pipeline over the tiles: the V rows a tile kept are prefetched when its selection is
    // known and read one tile later, so the loads of V overlap the next tile's scores (a decode step
    // is bound by memory: without it one thread reached a third of the bandwidth of a plain sweep).
    // Each head's steps of a tile in the same order as a task of that head alone (its selection,
    // the previous tile's P V, the softmax update); the direct path's Q K^T and P V in phases
    // (phase_keys), every head in turn within a phase.
    int parity = 0;
    std::int64_t pending = -1;  // the tile whose P V product is still to do
    bool try_direct[kDecodeHeadBlock], direct[kDecodeHeadBlock];
    for (int h = 0; h < n; ++h) try_direct[h] = direct_ && !q_risky[h];
    const auto accumulate = [&](int slots, std::int64_t j0) {
      const int keys = ws[0]->tile_keys[slots];  // the same tile for every head
      const int phase = phase_keys(keys);
      for (int t0 = 0; t0 < keys; t0 += phase) {
        for (int h = 0; h < n; ++h) {
          if (prefetch_phases()) {
            prefetch_share(p_.v, p_.v_stride, b, j0, hk0, n, h, t0 + phase, std::min(keys, t0 + 2 * phase));
          }
          accumulate_tile(*ws[h], slots, b, hk0 + h, j0, t0, std::min(keys, t0 + phase));
        }
      }
    };
    for (std::int64_t j0 = j_begin; j0 < j_end; j0 += w_) {
      direct_scores(ws, n, b, hk0, j0, tile_end, try_direct, direct);
      for (int h = 0; h < n; ++h) select_tile(*ws[h], parity, b, hk0 + h, j0, j_end, tile_end, q_risky[h], direct[h]);
      if (pending >= 0) accumulate(1 - parity, pending);
      for (int h = 0; h < n; ++h) update_rows(*ws[h], parity, b, hk0 + h, j0);
      pending = j0;
      parity = 1 - parity;
    }
    if (pending >= 0) accumulate(1 - parity, pending);
#if DFSS_SIMD_AMX
    if (amx_) amx::release();  // the OS then saves no tile state when it switches this thread out
#endif
    for (int h = 0; h < n; ++h) end_head(*ws[h], (b * p_.heads_kv + hk0 + h) * chunks_ + chunk, parts);
  }

  /// A head's rows before its first tile: accumulators and softmax state reset, and (where the
  /// chunk has keys: @p load) its Q rows loaded. Returns whether Q is risky (a bias with values
  /// other than 0 and -inf, or a row not tame): then every tile takes the panel path. A bias of 0
  /// and -inf only (a mask given as a bias: left padding from dfss.transformers, a boolean
  /// attn_mask; bias_only_masks, checked once per call) masks keys exactly and changes no other
  /// score, so the direct path's tiles (whose near ties are settled on the scores without the
  /// bias) select what the fused forward selects.
  bool begin_head(decode_workspace& ws, std::int64_t b, std::int64_t hk, bool load) const {
    const float neg_inf = -std::numeric_limits<float>::infinity();
    std::fill(ws.acc.ptr, ws.acc.ptr + static_cast<std::int64_t>(rows_) * dp_, 0.0f);
    for (int r = 0; r < rows_; ++r) {
      ws.row_max.ptr[r] = neg_inf;
      ws.row_sum.ptr[r] = 0.0f;
      ws.row_nan.ptr[r] = 0;
    }
    bool q_risky = p_.bias != nullptr && !bias_masks_;
    if (!load) return q_risky;
    for (int r = 0; r < rows_mk_; ++r) {
      float* q = ws.q.ptr + static_cast<std::int64_t>(r) * dp_;
      this->load_row(p_.q, p_.q_stride, b, r < rows_ ? row_of(r) : 0, r < rows_ ? head_of(hk, r) : 0, r < rows_, q);
      q_risky = q_risky || !this->row_is_tame(q);
      // The largest |q| of the row (zeros pad it to dp) and sum_c |q_c|, for settle_near_ties'
      // bound (a NaN row is risky: never used), in one pass by vectors: scalar chains of maxima
      // and of additions were a tenth and a few percent of a short decode step. The sum is of
      // non-negative fp32 terms, within d 2^-24 of the exact sum, so enlarged by twice that (and
      // the final rounding) it stays at least the exact sum.
      const DF d;
      VF top = hn::Zero(d), l1 = hn::Zero(d);
      for (int c = 0; c < dp_; c += lanes_) {
        const VF a = hn::Abs(hn::Load(d, q + c));
        top = hn::Max(top, a);
        l1 = hn::Add(l1, a);
      }
      ws.q_max.ptr[r] = hn::GetLane(hn::MaxOfLanes(d, top));
      const double sum = static_cast<double>(hn::GetLane(hn::SumOfLanes(d, l1)));
      ws.q_l1.ptr[r] = static_cast<float>(sum * (1.0 + static_cast<double>(dp_ + lanes_) * 0x1p-22));
      if (dot_) {
        std::uint16_t* qb = ws.qb.ptr + static_cast<std::int64_t>(r) * dp_;
        for (int c = 0; c < dp_; ++c) qb[c] = static_cast<std::uint16_t>(std::bit_cast<std::uint32_t>(q[c]) >> 16);
      }
      if (pairs_) to_pairs(q, ws.qp.ptr + static_cast<std::int64_t>(r) * dp_);
      if (amx_ && r < rows_) {
        for (int c = 0; c < d_; c += 2) {
          ws.qt.ptr[(c / 2) * rows_ + r] =
              (std::bit_cast<std::uint32_t>(q[c]) >> 16) | (std::bit_cast<std::uint32_t>(q[c + 1]) & 0xffff0000u);
        }
      }
    }
    return q_risky;
  }

  /// A head's partial state after its last tile, as the partial state of canonical task @p t =
  /// (b Hkv + kv head) chunks + chunk (fold reads them in chunk order).
  void end_head(const decode_workspace& ws, std::int64_t t, const partial_states& parts) const {
    for (int r = 0; r < rows_; ++r) {
      const std::size_t at = static_cast<std::size_t>(t * rows_ + r);
      parts.max[at] = ws.row_max.ptr[r];
      parts.sum[at] = ws.row_sum.ptr[r];
      parts.nan[at] = static_cast<unsigned char>(ws.row_nan.ptr[r] != 0);
      const float* acc = ws.acc.ptr + static_cast<std::int64_t>(r) * dp_;
      float* out = parts.acc + at * static_cast<std::size_t>(dp_);
      if (pairs_) {
        from_pairs(acc, out);
      } else {
        std::copy(acc, acc + dp_, out);
      }
    }
  }

  /// Tile j0, first half: S = Q K^T (the scores direct_scores left where @p direct, else
  /// panel_scores; which one is recorded for the slots of @p parity), and per row bias, masks, NaN
  /// detection and the N:M selection into the compacted slots of @p parity,
  /// with the tile's maximum in row_tile_max (-inf: nothing kept, or the tile is past the row's keys).
  void select_tile(decode_workspace& ws, int parity, std::int64_t b, std::int64_t hk, std::int64_t j0,
                   std::int64_t j_end, std::int64_t tile_end, bool q_risky, bool direct) const {
    const float neg_inf = -std::numeric_limits<float>::infinity();
    bool risky = q_risky;
    ws.direct[parity] = direct;
    ws.tile_keys[parity] = static_cast<int>(std::min<std::int64_t>(w_, tile_end - j0));
    if (!ws.direct[parity]) panel_scores(ws, b, hk, j0, j_end, tile_end, risky);

    for (int r = 0; r < rows_; ++r) {
      const std::int64_t qi = row_of(r), h = head_of(hk, r);
      std::int32_t& kept = ws.kept.ptr[parity * rows_mk_ + r];
      float& tile_max = ws.row_tile_max.ptr[r];
      kept = 0;
      tile_max = neg_inf;
      const std::int64_t lim = this->key_limit(b, qi);
      if (j0 >= lim) continue;  // the whole tile is masked for this row
      float* s = ws.s.ptr + static_cast<std::int64_t>(r) * w_;
      // Only the row's visible keys, rounded up to whole groups and vectors (visible_width): a
      // short tile (the last of a cache whose length is not a multiple of W, the whole tile of a
      // short cache) is not scanned over all W keys. A decode step on 64 keys (GQA 8:2, bf16,
      // one thread, caches warm) had spent a third of its time selecting and exponentiating the
      // masked rest of its tile.
      const int width = this->visible_width(lim, j0);
      this->bias_and_mask(s, b, h, qi, j0, lim, width);
      const bool nan_or_inf = risky && this->row_has_nan_or_inf(s, width);
      if (nan_or_inf) ws.row_nan.ptr[r] = 1;
      // Local key indices (j0 = 0): they address the tile's V rows.
      kept = this->compact(s, 0, slot_val(ws, parity, r), slot_idx(ws, parity, r), tile_max, /*nan_free=*/!nan_or_inf,
                           mask::shifted(core::whole_groups(p_, b, qi), j0), width);
      if (tile_max == neg_inf) kept = 0;
    }
  }

  /// S of tile j0 by the panel path: K converted into the fused forward's panels (the next tile's K
  /// prefetched), then the fused forward's micro-kernel, so the scores are bitwise the fused
  /// forward's; @p risky also records whether some K row is not tame. Keys at or past tile_end are
  /// zeros: every row masks them, and a padded cache's garbage there must not flag the tile as risky.
  void panel_scores(decode_workspace& ws, std::int64_t b, std::int64_t hk, std::int64_t j0, std::int64_t j_end,
                    std::int64_t tile_end, bool& risky) const {
    float* rows = ws.panel->rows.ptr;
    for (int blk = 0; blk < w_ / panel_; ++blk) {
      for (int t = 0; t < panel_; ++t) {
        const std::int64_t j = j0 + blk * panel_ + t;
        if (j + kPrefetchTiles * w_ < j_end) {
          this->prefetch_row(p_.k, p_.k_stride, b, j + kPrefetchTiles * w_, hk);
          // Dense attention reads every V row: prefetched as far ahead as K.
          if (dense_) this->prefetch_row(p_.v, p_.v_stride, b, j + kPrefetchTiles * w_, hk);
        }
        this->load_row(p_.k, p_.k_stride, b, j, hk, j < tile_end, rows + t * dp_);
        risky = risky || !this->row_is_tame(rows + t * dp_);
      }
      transpose_panel(rows, ws.panel->kt.ptr + static_cast<std::int64_t>(blk) * dp_ * panel_);
    }
    scores(ws.q.ptr, ws.panel->kt.ptr, ws.s.ptr);
  }

#if !HWY_HAVE_SCALABLE
  /// Whether the direct path's Q K^T for NV vectors per row reads K in the pair layout (against
  /// ws.qp): a bf16 cache with an even number of vectors known at compile time (then pairs_ holds,
  /// since direct_dots runs only on the direct path and not with vdpbf16ps).
  template <int NV>
  static constexpr bool pair_dots() {
    return std::is_same_v<T, bfloat16> && NV > 0 && NV % 2 == 0;
  }

  /// Rows per block of the direct path's Q K^T for NV vectors per row: on AVX-512 as many rows as
  /// keep their Q in 16 of the 32 registers across a block of keys (2 at d = 128, 4 at d = 64), so
  /// that a key costs one load per vector and FMA chain; elsewhere (and for a d known only at run
  /// time) 4 rows whose Q vectors are read from L1 beside each K vector.
  template <int NV>
  static constexpr int dot_block_rows() {
#if HWY_TARGET <= HWY_AVX3
    return NV > 0 ? std::clamp(16 / NV, 1, 4) : 4;
#else
    // 16 registers: from NV = 16 (d >= 128) Q cannot be held, and 4 rows from L1 per K vector (one
    // load and bf16 conversion for 4 FMAs) beat 1 row (one Zen 4 thread, --isa avx2, GQA 32:8,
    // Lk = 16384: bf16 7.5 -> 6.9 ms, f32 9.9 -> 9.3 ms, an L2-resident bf16 step about 18% faster).
    return NV > 0 ? (NV >= 16 ? 4 : std::clamp(16 / NV, 1, 4)) : 4;
#endif
  }

  /// Dot products of R task rows (Q at @p q, row stride dp) with @p n <= lanes cache rows
  /// k + t * step into s[r * W + t]: per (row, key) one vector of partial sums over the columns in
  /// vector steps, in two chains (even and odd vectors, added at the end: half the FMA latency per
  /// key; one Zen 4 thread, GQA 32:8, an L2-resident fp32 step 8% faster on AVX-512, a bf16 one
  /// 10-15% on AVX2), its lanes summed at once. Summing the lanes of 16 keys' vectors later, by a
  /// transposing tree over vectors stored to scratch (fewer instructions), read the cache more
  /// slowly from memory: GQA 32:8, fp32, Lk = 65536, Zen 4, AVX-512, one thread 54-56 against
  /// 42-43 ms, two threads 28.3 against 24.6 ms (a plain sweep: 22.8); AVX2 and L2-resident steps
  /// the same either way. On AVX-512 with Q held in registers, keys go 8 / R at a time, one chain
  /// per (row, key) (the keys' chains are independent), and their eight vectors are summed by one
  /// tree in registers right after (store_sums8); the keys left over go one at a time. On AVX2 one
  /// row (MHA) does the same, 8 keys at a time with Q read from L1 (MHA 32:32, fp32, Lk = 16384, 2
  /// Zen 3 threads: 0.92 -> 0.96-0.97 of the cache's sweep, two runs of 5 and 7 interleaved rounds;
  /// a step in L3 10% faster; bf16 the same within the noise); 4 rows (GQA), 2 keys at a time, made
  /// a step in L3 10% slower, so groups of rows keep the per-key sums there.
  /// A key's row is read whole before the next key's, so the loads run in address order:
  /// interleaving the rows of a few keys (more independent FMA chains) made the hardware prefetcher
  /// lose the stream, 19 against 30 GB/s on one Zen 5 core. NV: vectors per row (0: d / lanes at
  /// run time). With Check, @p top gets the largest magnitude bits of the K values read
  /// (row_is_tame's test on the bits, so that NaN and inf compare above every finite magnitude).
  template <int R, int NV, bool Check>
  HWY_INLINE void dot_block(const float* HWY_RESTRICT q, const T* HWY_RESTRICT k, std::int64_t step, int n,
                            float* HWY_RESTRICT s, VI& top) const {
    const DF d;
    const DI di;
    // The vector's width as a constant (fixed-width targets only), so that column offsets are
    // immediate displacements rather than multiplications by lanes_.
    constexpr int L = static_cast<int>(hn::MaxLanes(DF()));
    const int nv = NV > 0 ? NV : d_ / L;
    const VI magnitude = hn::Set(di, 0x7fffffff);
    // On AVX-512 fewer rows than a block's (one row: MHA) hold their Q too, so that one row's keys
    // go 8 at a time with their lanes summed by one tree (Sapphire Rapids, MHA 32:32, d = 128, 2
    // threads, 5 interleaved rounds against the commit before: bf16 0.85x the time at 4096 keys and
    // 0.96x at 16384, 80 -> 90% and 89 -> 95% of the cache's sweep; fp32 0.87x and 0.92x).
#if HWY_TARGET <= HWY_AVX3
    constexpr bool kHeld = NV > 0 && R <= dot_block_rows<NV>() && R * NV <= 16;
#else
    constexpr bool kHeld = NV > 0 && dot_block_rows<NV>() == R && R * NV <= 16;
#endif
    VI t_top = top;
    // In the pair layout, Check keeps the largest magnitude bits of the bf16 values themselves per
    // 16-bit lane (one AND and one maximum per two vectors, not per vector), widened into top at
    // the end.
    const hn::Repartition<std::uint16_t, DF> d16;
    auto top16 = hn::Zero(d16);
    // K vectors c and c + 1 (c even): in the pair layout when direct_dots gave Q in it.
    const auto load_two = [&](const T* at, VF& k0, VF& k1) {
      if constexpr (pair_dots<NV>()) {
        const auto both = load_pair(at, k0, k1);
        if constexpr (Check) top16 = hn::Max(top16, hn::And(hn::BitCast(d16, both), hn::Set(d16, 0x7fff)));
      } else {
        k0 = base::load_value(at);
        k1 = base::load_value(at + L);
        if constexpr (Check) {
          t_top = hn::Max(t_top, hn::Max(hn::And(hn::BitCast(di, k0), magnitude), hn::And(hn::BitCast(di, k1), magnitude)));
        }
      }
    };
    VF qv[kHeld ? R : 1][kHeld ? NV : 1];
    if constexpr (kHeld) {
      for (int r = 0; r < R; ++r) {
        for (int c = 0; c < NV; ++c) qv[r][c] = hn::Load(d, q + static_cast<std::int64_t>(r) * dp_ + c * L);
      }
    }
    const auto q_at = [&](int r, int c) {
      if constexpr (kHeld) return qv[r][c];
      else return hn::Load(d, q + static_cast<std::int64_t>(r) * dp_ + c * L);
    };
    int t = 0;
#if HWY_TARGET <= HWY_AVX3 || HWY_TARGET == HWY_AVX2
    // AVX-512: Q held in registers; AVX2: Q read from L1 beside each K vector (held, it would
    // leave no room for the eight chains).
    constexpr bool kSums8 = HWY_TARGET == HWY_AVX2 ? R == 1 && !kHeld && NV > 0 : kHeld && hn::MaxLanes(DF()) == 16;
    if constexpr (kSums8 && (R == 1 || R == 2 || R == 4)) {
      constexpr int G = 8 / R;
      for (; t + G <= n; t += G) {
        VF acc[8];
        for (VF& x : acc) x = hn::Zero(d);
        // Unrolled whole, so that the accumulators stay in registers.
#pragma GCC unroll 8
        for (int g = 0; g < G; ++g) {
          const T* row = k + (t + g) * step;
          static_assert(NV % 2 == 0, "K vectors loaded two at a time");
#pragma GCC unroll 8
          for (int c = 0; c < NV; c += 2) {
            VF k0, k1;
            load_two(row + c * L, k0, k1);
            for (int r = 0; r < R; ++r) {
              acc[r * G + g] = hn::MulAdd(q_at(r, c), k0, acc[r * G + g]);
              acc[r * G + g] = hn::MulAdd(q_at(r, c + 1), k1, acc[r * G + g]);
            }
          }
        }
        store_sums8<G>(acc, s + t, w_);
      }
    }
#endif
    for (; t < n; ++t) {
      const T* row = k + t * step;
      VF a[R], b[R];
      for (int r = 0; r < R; ++r) a[r] = b[r] = hn::Zero(d);
      int c = 0;
      for (; c + 1 < nv; c += 2) {
        VF k0, k1;
        load_two(row + c * L, k0, k1);
        for (int r = 0; r < R; ++r) {
          a[r] = hn::MulAdd(q_at(r, c), k0, a[r]);
          b[r] = hn::MulAdd(q_at(r, c + 1), k1, b[r]);
        }
      }
      if (c < nv) {
        const VF kc = this->load_value(row + c * L);
        if constexpr (Check) t_top = hn::Max(t_top, hn::And(hn::BitCast(di, kc), magnitude));
        for (int r = 0; r < R; ++r) a[r] = hn::MulAdd(q_at(r, c), kc, a[r]);
      }
      for (int r = 0; r < R; ++r) s[static_cast<std::int64_t>(r) * w_ + t] = hn::GetLane(hn::SumOfLanes(d, hn::Add(a[r], b[r])));
    }
    if constexpr (pair_dots<NV>() && Check) {
      // Each 32-bit lane holds two maxima of bf16 magnitude bits: as fp32 bits, the low one shifted
      // up, the high one with the low half cleared (both non-negative as int32).
      const hn::RebindToUnsigned<DF> du;
      const auto both = hn::BitCast(du, top16);
      t_top = hn::Max(t_top, hn::BitCast(di, hn::Max(hn::ShiftLeft<16>(both), hn::And(both, hn::Set(du, 0xffff0000u)))));
    }
    top = t_top;
  }

  /// The direct tile's block loop over keys [@p t_begin, @p t_end) (t_begin a multiple of the
  /// vector's lanes), written once for both ways of taking the dot products: per
  /// block of one vector's lanes of keys (t0, n of them) and per block of rows (r0, rb of them,
  /// rb = @p block_rows(rows left)), @p dots(r0, rb, t0, n) writes the rows' scores of those keys
  /// into s[r * W + t].
  template <typename BlockRows, typename Dots>
  void dot_blocks(int t_begin, int t_end, const BlockRows& block_rows, const Dots& dots) const {
    for (int t0 = t_begin; t0 < t_end; t0 += lanes_) {
      const int n = std::min(lanes_, t_end - t0);
      for (int r0 = 0; r0 < rows_;) {
        const int rb = block_rows(rows_ - r0);
        dots(r0, rb, t0, n);
        r0 += rb;
      }
    }
  }

  /// The direct tile's scores of keys [@p t_begin, @p t_end) of @p keys into s[r * W + t] for NV
  /// vectors per row (dot_blocks): per key block every row block's dot products, the first row
  /// block checking the K values as they stream in from memory, the others reading them from L1.
  /// Returns the largest magnitude bits of the K values read (fp32 bits; NaN and inf above every
  /// finite magnitude: finish_direct's test).
  template <int NV>
  std::uint32_t direct_dots(decode_workspace& ws, const T* k, std::int64_t step, int t_begin, int t_end, int keys) const {
#if DFSS_SIMD_BF16_DOT
    if constexpr (std::is_same_v<T, bfloat16>) {
      if (dot_) return direct_dots_bf16(ws, k, step, t_begin, t_end);
    }
#endif
    constexpr int R = dot_block_rows<NV>();
    const DI di;
    VI top = hn::Zero(di);
    const auto block_rows = [](int left) { return left >= R ? R : (left >= 2 ? 2 : 1); };
    // K rows not back to back (the [B, L, Hkv, d] layout: each kv head's rows Hkv d apart), which
    // the hardware prefetcher follows late: the next key block's rows requested ahead. Measured
    // (Sapphire Rapids, bf16 cache, d = 128, Lk = 65536 from memory, 2 threads, alternating calls
    // in one process): GQA 32:8 dense and 1:2 0.92-0.95x the time, MHA 0.94x; 32 keys ahead
    // alike, V rows requested with K 1.05-1.08x. Rows back to back (a [B, Hkv, L, d] cache such as
    // transformers') gained nothing (0.96-1.03x) and lost with 32 keys ahead (1.09-1.14x).
    const bool spread = step != d_;
    dot_blocks(t_begin, t_end, block_rows, [&](int r0, int rb, int t0, int n) {
      const T* kb = k + t0 * step;
      if (spread && r0 == 0) {
        for (int t = t0 + lanes_; t < std::min(keys, t0 + 2 * lanes_); ++t) this->prefetch_lines(k + t * step);
      }
      const float* q = (pair_dots<NV>() ? ws.qp.ptr : ws.q.ptr) + static_cast<std::int64_t>(r0) * dp_;
      float* s = ws.s.ptr + static_cast<std::int64_t>(r0) * w_ + t0;
      if (r0 == 0) {
        if (rb == R) {
          dot_block<R, NV, true>(q, kb, step, n, s, top);
        } else if (rb == 2) {
          dot_block<2, NV, true>(q, kb, step, n, s, top);
        } else {
          dot_block<1, NV, true>(q, kb, step, n, s, top);
        }
      } else if (rb == R) {
        dot_block<R, NV, false>(q, kb, step, n, s, top);
      } else if (rb == 2) {
        dot_block<2, NV, false>(q, kb, step, n, s, top);
      } else {
        dot_block<1, NV, false>(q, kb, step, n, s, top);
      }
    });
    return static_cast<std::uint32_t>(hn::GetLane(hn::MaxOfLanes(di, top)));  // magnitudes: non-negative
  }
#endif

#if DFSS_SIMD_BF16_DOT
  /// direct_dots by vdpbf16ps (bf16dot::decode_dots, blocks of 16 keys and 4 rows), the lanes of
  /// each (row, key) summed at once as in dot_block, and the largest magnitude bits of the K values
  /// read (widened from bf16 to fp32 bits). Summed later by the transposing tree of vectors in scratch, GQA 32:8 with a
  /// bf16 cache (Lk = 65536, Zen 4) took 23.1 against 19.0 ms on one thread, 14.3 against 11.9 ms
  /// on two (a plain sweep over the cache: 16.3 and 11.0 ms).
  std::uint32_t direct_dots_bf16(decode_workspace& ws, const T* k, std::int64_t step, int t_begin, int t_end) const {
    static_assert(bf16dot::kDecodeKeys == HWY_LANES(float), "a block of keys per vector of lanes");
    const auto* kb = reinterpret_cast<const std::uint16_t*>(k);
    std::uint16_t top = 0;
#if DFSS_SIMD_AMX
    if (amx_) {
      const int n = (t_end - t_begin) / 16 * 16;
      amx::decode_qk(ws.qt.ptr, rows_, d_, kb + t_begin * step, step, n, ws.s.ptr + t_begin, w_, &top);
      t_begin += n;
    }
#endif
    const auto block_rows = [](int left) { return std::min(bf16dot::kDecodeRows, left); };
    dot_blocks(t_begin, t_end, block_rows, [&](int r0, int rb, int t0, int n) {
      bf16dot::decode_dots(ws.qb.ptr + static_cast<std::int64_t>(r0) * dp_, rb, dp_, d_, kb + t0 * step, step, n,
                           ws.s.ptr + static_cast<std::int64_t>(r0) * w_ + t0, w_, r0 == 0, &top);
    });
    return static_cast<std::uint32_t>(top) << 16;  // the bf16 magnitude's bits as fp32 bits
  }
#endif

  /// S of tile j0 by the direct path for the task's kv heads hk0 .. hk0 + n - 1 (workspace *ws[h]),
  /// those where @p try_direct[h]: each key's row is read straight from the cache, once and in
  /// address order, and dotted with every row of the head's group (direct_dots). That is the order
  /// the hardware prefetcher streams at the memory's rate: the panel path (a copy and a transpose
  /// per key, and software prefetch to make up for it) read the cache at 30-49% of a plain sweep
  /// on one thread. Where the kv heads are interleaved, phase by phase (score_phase_keys keys, every
  /// head in turn); the dot products' blocks are the same either way. The scores differ from the
  /// fused forward's in rounding (another summation order), so the selection may differ from it
  /// where two scores of a group are within rounding of each other (settle_near_ties makes it the
  /// fused forward's). @p direct[h] gets whether head h's tile took the direct path: not where some
  /// K value of its tile is not tame, leaving the tile to the panel path, where the non-finite and
  /// overflow cases are handled as in the fused forward.
  void direct_scores(const std::unique_ptr<decode_workspace>* ws, int n, std::int64_t b, std::int64_t hk0,
                     std::int64_t j0, std::int64_t tile_end, const bool* try_direct, bool* direct) const {
    for (int h = 0; h < n; ++h) direct[h] = false;
#if !HWY_HAVE_SCALABLE
    const int keys = static_cast<int>(std::min<std::int64_t>(w_, tile_end - j0));
    const std::int64_t step = p_.k_stride[1];
    const int phase = score_phase_keys(keys);
    std::uint32_t top[kDecodeHeadBlock] = {};
    const auto k_of = [&](int h) { return static_cast<const T*>(p_.k) + core::offset4(p_.k_stride, b, j0, hk0 + h, 0); };
    for (int t0 = 0; t0 < keys; t0 += phase) {
      const int t1 = std::min(keys, t0 + phase);
      for (int h = 0; h < n; ++h) {
        if (prefetch_phases()) prefetch_share(p_.k, p_.k_stride, b, j0, hk0, n, h, t1, std::min(keys, t1 + phase));
        if (!try_direct[h]) continue;
        decode_workspace& w = *ws[h];
        std::uint32_t t = 0;
        switch (d_ / lanes_) {
          case 4: t = direct_dots<4>(w, k_of(h), step, t0, t1, keys); break;
          case 8: t = direct_dots<8>(w, k_of(h), step, t0, t1, keys); break;
          case 16: t = direct_dots<16>(w, k_of(h), step, t0, t1, keys); break;
          default: t = direct_dots<0>(w, k_of(h), step, t0, t1, keys); break;
        }
        top[h] = std::max(top[h], t);
      }
    }
    for (int h = 0; h < n; ++h) {
      // Tame: every |k| at most 2^50 (row_is_tame's bound; the bits of 2^50 are 0x58800000).
      if (!try_direct[h] || top[h] > 0x58800000u) continue;
      decode_workspace& w = *ws[h];
      if (p_.pattern_n < p_.pattern_m) settle_near_ties(w, k_of(h), step, keys, std::bit_cast<float>(top[h]));
      // Keys at or past tile_end are masked for every row (the panel path's zero rows), as far as
      // select_tile reads them (visible_width).
      const int read = this->visible_width(j0 + keys, j0);
      for (int rr = 0; rr < rows_; ++rr) {
        std::fill(w.s.ptr + static_cast<std::int64_t>(rr) * w_ + keys, w.s.ptr + static_cast<std::int64_t>(rr) * w_ + read, 0.0f);
      }
      direct[h] = true;
    }
#else
    (void)ws, (void)b, (void)hk0, (void)j0, (void)tile_end, (void)try_direct;
#endif
  }

  /// Keys per phase of a tile of @p keys keys (kDecodePhaseKeys where the kv heads are interleaved,
  /// else the whole tile): a function of the shape and the layout only, like the chunks.
  int phase_keys(int keys) const { return interleaved_ ? kDecodePhaseKeys : std::max(keys, 1); }

  /// Keys per phase of a tile's direct Q K^T: phase_keys, but kDecodePhaseKeysDot for the
  /// vdpbf16ps dot products (the AMX tiles take blocks of 16 keys: they keep phase_keys).
  int score_phase_keys(int keys) const { return interleaved_ && dot_ && !amx_ ? kDecodePhaseKeysDot : phase_keys(keys); }

  /// Whether each phase requests the next phase's K and V rows of the task's kv heads into L2
  /// (prefetch_share): where the kv heads are interleaved and the direct path's Q K^T is
  /// bf16dot::decode_dots (a bf16 cache on avx3_bf16). A phase reads its keys (32; in the Q K^T 8
  /// since kDecodePhaseKeysDot, 32 when measured below) of each head in turn, each head's rows Hkv d
  /// apart, and the hardware prefetcher does not run ahead of that; the
  /// Highway dot products request their next block's rows themselves (direct_dots), the vdpbf16ps
  /// ones did not. Zen 4, 2 threads, bf16 [B, L, Hkv, d] cache, Lk = 16384, a driver timing
  /// dfss::attention_forward after a 128 MiB read elsewhere, medians of 5 interleaved rounds, the
  /// same bits): GQA 32:8 dense 6.26 -> 4.86 ms, 2:4 6.27 -> 5.01 ms, 1:2 6.87 -> 5.49 ms; MHA 32:32
  /// dense 16.1 -> 14.6 ms, 1:2 16.0 -> 15.0 ms (a [B, Hkv, L, d] cache: 2.4 and 8.2 ms dense), the
  /// requests all at the start of a phase; spread over its heads (prefetch_share) then GQA 4.82 ->
  /// 4.54 ms and MHA 14.9 -> 13.9 ms. Two phases ahead measured between none and one, four no gain;
  /// in fp32 (the Highway path, which requests its next block's rows already) 2-4% faster, within
  /// the noise, so left as it was (25.1 -> 24.2 ms MHA, 7.4 -> 7.3 ms GQA).
  bool prefetch_phases() const { return interleaved_ && dot_; }

  /// Head @p h's share (of @p n) of prefetch_heads over keys [@p t_begin, @p t_end): the keys split
  /// evenly over the heads of the task, so that the requests go out while the phase computes, not
  /// all before it.
  void prefetch_share(const void* base, const std::int64_t* st, std::int64_t b, std::int64_t j0, std::int64_t hk0, int n,
                      int h, int t_begin, int t_end) const {
    const int span = std::max(0, t_end - t_begin);
    prefetch_heads(base, st, b, j0, hk0, n, t_begin + h * span / n, t_begin + (h + 1) * span / n);
  }

  /// Requests keys [@p t_begin, @p t_end) of tile j0 of kv heads hk0 .. hk0 + n - 1 into L2, in
  /// address order: the heads of a key are side by side (heads_interleaved), d values each.
  void prefetch_heads(const void* base, const std::int64_t* st, std::int64_t b, std::int64_t j0, std::int64_t hk0, int n,
                      int t_begin, int t_end) const {
    const T* x = static_cast<const T*>(base);
    for (int t = t_begin; t < t_end; ++t) {
      const auto* first = reinterpret_cast<const char*>(x + core::offset4(st, b, j0 + t, hk0, 0));
      const auto* end = reinterpret_cast<const char*>(x + core::offset4(st, b, j0 + t, hk0 + n - 1, 0) + d_);
      const auto* line = reinterpret_cast<const char*>(reinterpret_cast<std::uintptr_t>(first) / kCacheLine * kCacheLine);
      for (; line < end; line += kCacheLine) this->prefetch_line_l2(line);
    }
  }

  /// Makes a direct tile's selection the fused forward's (and so the fused backward's, which
  /// recomputes it): each direct score is within E = gamma_d sum_c |q_c k_c| <= gamma_d max|k|
  /// sum_c |q_c| (gamma_d = d u / (1 - d u), u = 2^-24, plus 2^-149 per product for underflow) of
  /// the exact dot product, and so is the fused forward's, so a direct score and the fused
  /// forward's score of the same key differ by at most 2 E, and where every two direct scores of a
  /// group differ by more than 4 E (twice that: each of the two may move by 2 E) both orders rank
  /// the group alike. (The bound was 2 E until 2026-12-03, which let two scores between 2 E and 4 E
  /// apart rank either way; E is so loose that no test found it.) A group with two scores closer
  /// than that (a near tie: rare on real data, every exact tie of integer inputs) has its scores
  /// recomputed in the fused forward's order (fused_order_scores). Checked by
  /// CpuBackward.UsesExactlyTheForwardSelection and CpuDecode.GroupsOfRowsKeepTheFusedSelectionOnNearTies,
  /// whose near ties are decided by rounding, and by
  /// CpuDecode.NearTiesAsFarApartAsTheBoundAllowsFollowTheFusedOrder, whose are wider than E (it
  /// fails with the bound divided by 4). Until 2026-12-06 the bound took
  /// sum_c |q_c k_c| <= d max|q| max|k|, several times looser on random rows: with the AMX tiles'
  /// gamma_d(2u) on top, 2:4 with grouped heads spent 30% of a step rescoring.
  void settle_near_ties(decode_workspace& ws, const T* k, std::int64_t step, int keys, float max_k) const {
    const DF d;
    const int m = p_.pattern_m;
    const double u = 0x1p-24, dd = static_cast<double>(d_);
    const double gamma = dd * u / (1.0 - dd * u);
    for (int r = 0; r < rows_; ++r) {
      const float* q = ws.q.ptr + static_cast<std::int64_t>(r) * dp_;
      const double a = static_cast<double>(ws.q_l1.ptr[r]) * static_cast<double>(max_k);  // >= sum_c |q_c k_c|
      double e = gamma * a + dd * 0x1p-149;
      // vdpbf16ps reads a denormal bf16 operand as 0 (an error below 2^-126 times the other
      // operand per product) and flushes a denormal partial sum to 0 (below 2^-126 per step, two
      // steps per column pair): at most d 2^-126 (max|q| + max|k| + 1) more.
      if (dot_) e += dd * 0x1p-126 * (static_cast<double>(ws.q_max.ptr[r]) + static_cast<double>(max_k) + 1.0);
      // On the AMX tiles (amx_tiles.hpp's assumption: each of the d additions within 2u, and the
      // same denormal flushing) a score is within gamma(2u) A + z of the exact dot product (z: the
      // term above, A: sum_c |q_c k_c|), the fused forward's within gamma(u) A + d 2^-149:
      // E = gamma(2u) A + z + d 2^-149 is at least half their sum, so 4 E still separates two keys
      // whose order either kernel could flip.
      if (amx_) e += (2.0 * dd * u / (1.0 - 2.0 * dd * u) - gamma) * a;
      // In fp32, 4 E enlarged by 2^-20 covers the rounding of the subtraction and of the bound.
      const float lim = static_cast<float>(4.0 * e * (1.0 + 0x1p-20));
      float* s = ws.s.ptr + static_cast<std::int64_t>(r) * w_;
      const auto settle = [&](int g0) {  // group [g0, g0 + m): recomputed if two scores are near
        const int g1 = std::min(keys, g0 + m);
        bool near = false;
        for (int i = g0; i < g1 && !near; ++i) {
          for (int j = i + 1; j < g1 && !near; ++j) near = std::abs(s[i] - s[j]) <= lim;
        }
        if (!near) return;
        for (int t = g0; t < g1; t += 4) fused_order_scores(q, k + t * step, step, std::min(4, g1 - t), s + t);
      };
      if ((m == 2 || m == 4) && lanes_ >= 4) {
        // Groups of 2 or 4 lie inside 128-bit blocks (tiles and rows start at multiples of the
        // vector): every pair of a group compared at once with in-block shuffles; the scalar test
        // only for a vector that has a near pair. Lanes past the tile's keys hold stale scores:
        // at worst a needless scalar test.
        const VF vlim = hn::Set(d, lim);
        for (int t0 = 0; t0 < keys; t0 += lanes_) {
          const VF x = hn::Load(d, s + t0);
          auto near = hn::Le(hn::Abs(hn::Sub(x, hn::Shuffle2301(x))), vlim);
          if (m == 4) {
            near = hn::Or(near, hn::Le(hn::Abs(hn::Sub(x, hn::Shuffle1032(x))), vlim));
            near = hn::Or(near, hn::Le(hn::Abs(hn::Sub(x, hn::Shuffle0123(x))), vlim));
          }
          if (hn::AllFalse(d, near)) continue;
          for (int g0 = t0; g0 < std::min(keys, t0 + lanes_); g0 += m) settle(g0);
        }
      } else {
        for (int g0 = 0; g0 < keys; g0 += m) settle(g0);
      }
    }
  }

  /// q . k of the @p n <= 4 keys k + t * step (t < n) into out[t], each in the fused forward's
  /// micro-kernel order: one MulAdd per column, in increasing order, from zero (the same Highway op,
  /// so the same rounding on every target, FMA or not). The keys' chains are interleaved, so that
  /// none waits on another's latency: with one chain at a time settle_near_ties took 6.9% of the
  /// samples of a GQA 32:8 2:4 decode step, with four 4.7% (perf, Zen 4, one thread, bf16 cache
  /// of 4096 keys in L3, random normal Q and K; the rest of it is the vector test for near pairs),
  /// and the step 0.952x the time (median of 8 alternating pairs of calls, 0.827 -> 0.785 ms).
  /// The keys' values converted to fp32 64 columns at a time first, rather than one scalar
  /// conversion per MulAdd: another 0.979x (8 pairs, 7 of them faster). Missing keys (n < 4)
  /// repeat the first.
  void fused_order_scores(const float* q, const T* k, std::int64_t step, int n, float* out) const {
    const DF d;
    const T* k1 = k + (n > 1 ? step : 0);
    const T* k2 = k + (n > 2 ? 2 * step : 0);
    const T* k3 = k + (n > 3 ? 3 * step : 0);
    VF a0 = hn::Zero(d), a1 = hn::Zero(d), a2 = hn::Zero(d), a3 = hn::Zero(d);
    alignas(64) float kf[4][64];
    for (int c0 = 0; c0 < d_; c0 += 64) {
      const int cn = std::min(64, d_ - c0);
      for (int c = 0; c < cn; ++c) {
        kf[0][c] = to_float(k[c0 + c]);
        kf[1][c] = to_float(k1[c0 + c]);
        kf[2][c] = to_float(k2[c0 + c]);
        kf[3][c] = to_float(k3[c0 + c]);
      }
      for (int c = 0; c < cn; ++c) {
        const VF qc = hn::Set(d, q[c0 + c]);
        a0 = hn::MulAdd(qc, hn::Set(d, kf[0][c]), a0);
        a1 = hn::MulAdd(qc, hn::Set(d, kf[1][c]), a1);
        a2 = hn::MulAdd(qc, hn::Set(d, kf[2][c]), a2);
        a3 = hn::MulAdd(qc, hn::Set(d, kf[3][c]), a3);
      }
    }
    const float x[4] = {hn::GetLane(a0), hn::GetLane(a1), hn::GetLane(a2), hn::GetLane(a3)};
    for (int t = 0; t < n; ++t) out[t] = x[t];
  }

  /// Tile j0, second half (after the previous tile's P V): the online softmax update of every row,
  /// the exponentials of its kept scores, and the prefetch of the V rows some row kept.
  void update_rows(decode_workspace& ws, int parity, std::int64_t b, std::int64_t hk, std::int64_t j0) const {
    const float neg_inf = -std::numeric_limits<float>::infinity();
    std::int32_t* used = ws.used.ptr + static_cast<std::int64_t>(parity) * w_;
    for (int r = 0; r < rows_; ++r) {
      const int n = ws.kept.ptr[parity * rows_mk_ + r];
      if (n == 0) continue;
      const float tile_max = ws.row_tile_max.ptr[r];
      float& mx = ws.row_max.ptr[r];
      float& sum = ws.row_sum.ptr[r];
      if (tile_max > mx) {
        const float corr = mx == neg_inf ? 0.0f : std::exp2(((mx - tile_max) * e1_) * e2_);
        scale_row(ws.acc.ptr + static_cast<std::int64_t>(r) * dp_, corr);
        sum *= corr;
        mx = tile_max;
      }
      float* cv = slot_val(ws, parity, r);
      std::int32_t* ci = slot_idx(ws, parity, r);
      if (ws.direct[parity]) {
        int& live = ws.kept.ptr[parity * rows_mk_ + r];
        sum += e2_ == 1.0f ? exp_live<false>(cv, ci, n, mx, live) : exp_live<true>(cv, ci, n, mx, live);
      } else {
        sum += e2_ == 1.0f ? exp_kept<false>(cv, ci, n, mx, used) : exp_kept<true>(cv, ci, n, mx, used);
      }
    }
    if (!dense_ && !ws.direct[parity]) {
      for (int t = 0; t < w_; ++t) {
        if (used[t] != 0) this->prefetch_row(p_.v, p_.v_stride, b, j0 + t, hk);
      }
    }
  }

  /// acc += p V over the kept keys of tile j0 (slots of @p parity) in [@p t_lo, @p t_hi), one phase
  /// of the tile (phase_keys; the phases come in order, the last one ends at the tile's keys): a
  /// direct tile's V rows from the cache (direct_accumulate), else, all in the first phase, the V
  /// rows some row kept, converted once; the rest of the tile's V is never read.
  void accumulate_tile(decode_workspace& ws, int parity, std::int64_t b, std::int64_t hk, std::int64_t j0, int t_lo,
                       int t_hi) const {
    std::int32_t* used = ws.used.ptr + static_cast<std::int64_t>(parity) * w_;
    if (ws.direct[parity]) {  // its slots mark nothing in used (exp_live)
      direct_accumulate(ws, parity, b, hk, j0, t_lo, t_hi);
      return;
    }
    if (t_lo != 0) return;
    float* vt = ws.panel->vt.ptr;
    for (int t = 0; t < w_; ++t) {
      if (used[t] == 0) continue;
      used[t] = 0;
      float* row = vt + static_cast<std::int64_t>(t) * dp_;
      if (pairs_) {  // the accumulators' layout, by way of the (here unused) panel scratch
        this->load_row(p_.v, p_.v_stride, b, j0 + t, hk, true, ws.panel->rows.ptr);
        to_pairs(ws.panel->rows.ptr, row);
      } else {
        this->load_row(p_.v, p_.v_stride, b, j0 + t, hk, true, row);
      }
    }
    for (int r = 0; r < rows_; ++r) {
      const int n = ws.kept.ptr[parity * rows_mk_ + r];
      if (n == 0) continue;
      const float* cv = slot_val(ws, parity, r);
      const std::int32_t* ci = slot_idx(ws, parity, r);
      add_row_combination(
          ws.acc.ptr + static_cast<std::int64_t>(r) * dp_, dp_, n, [cv](int k) { return cv[k]; },
          [vt, ci](int k) { return vt + ci[k]; });
    }
  }

  /// acc += p V over the kept keys of a direct tile in [@p t_lo, @p t_hi) (one phase:
  /// accumulate_tile): V rows straight from the cache (slot offsets are key indices in the tile,
  /// masked slots dropped), converted on the fly. Per row the keys are added in the order of
  /// its slots whatever the phases (one chain of sums per column vector), so phases change no bit.
  void direct_accumulate(decode_workspace& ws, int parity, std::int64_t b, std::int64_t hk, std::int64_t j0, int t_lo,
                         int t_hi) const {
#if !HWY_HAVE_SCALABLE
    const T* v = static_cast<const T*>(p_.v);
    const std::int64_t row0 = core::offset4(p_.v_stride, b, j0, hk, 0), step = p_.v_stride[1];
    const int keys = ws.tile_keys[parity];
    if (rows_ >= 2) {
      if (key_major_accumulate(ws, parity, v + row0, step, t_lo, t_hi)) return;
      t_lo = 0;  // a non-finite V value (found after the last phase): the whole tile row by row
    }
    // A row that kept at least half the tile reads all of it (below); the others read their kept
    // rows only.
    bool some_by_index = false;
    for (int r = 0; r < rows_; ++r) some_by_index = some_by_index || 2 * ws.kept.ptr[parity * rows_mk_ + r] < keys;
    if (!dense_ && sizeof(T) == 2 && some_by_index) {
      // A 16-bit cache's V tile is first read whole, in address order, one load per cache line
      // (OR-ed into a value nobody uses), then the kept rows from L1. The hardware prefetcher
      // fetches the pruned rows between kept ones anyway, so this costs no memory traffic, but it
      // keeps the stream ascending: on one Zen 5 core (bf16, d = 128, Lk = 16384, MHA) 1:2 went from
      // 14.2 to 12.1 ms and 2:4 from 15.8 to 11.3 ms (2 threads: 7.5 to 6.4 and 8.8 to 6.5), where
      // dense takes 9.7 (5.1). fp32 caches measured no gain (d = 64 and 128): they skip this.
      touch_rows(ws, v + row0, step, t_hi - t_lo, [t_lo](int t) { return t_lo + t; });
    }
    for (int r = 0; r < rows_; ++r) {
      const int n = ws.kept.ptr[parity * rows_mk_ + r];
      if (n == 0) continue;
      const float* cv = slot_val(ws, parity, r);
      const std::int32_t* ci = slot_idx(ws, parity, r);
      float* acc = ws.acc.ptr + static_cast<std::int64_t>(r) * dp_;
      // A row that kept every key of the tile (a dense pattern, no mask inside it) has the keys in
      // order as its slots, so its rows are addressed from the key itself, not through the slot's
      // index: MHA dense, fp32, Lk = 16384, 2 Zen 4 threads, against a stand-alone loop of the same
      // arithmetic in the same process, 0.89-0.94 -> 1.02-1.05 of its rate (7-round interleaved
      // runs; with the index, each row's address waits for a load and a multiply). A row that
      // kept at least half the tile (1:2, 2:4) reads every row of it the same way, with weight 0
      // for the keys it did not keep: the hardware prefetcher fetches the pruned rows anyway, so
      // this costs FMAs but no memory traffic. Against the cache's own sweep, 1:2 0.95 -> 0.98
      // (fp32) and 0.83 -> 0.98 (bf16, whose tile was touched and then read by index), dense
      // 0.97. A weight of 0 is exact only against a finite V value (0 * inf is NaN): a row whose
      // accumulator comes out non-finite is redone by index, where only its kept rows count.
      const bool every_key = dense_ && n == keys;
      const bool whole = !every_key && 2 * n >= keys;
      // acc += weight(t) V row t over t in [k_begin, k_end), rows addressed from the key, by blocks
      // of kKeyMajorBlock keys: where a row is more than one slice of 8 vectors (d = 128 on AVX2),
      // the later slices read the block's rows from L1 rather than the whole tile's from L2 (a bf16
      // tile is 64 KiB at d = 128). 2 Zen 3 threads, MHA 32:32, against a sweep of the cache in the
      // same process, medians of 7 interleaved rounds: bf16 16384 keys dense 0.82 -> 0.87, 1:2
      // 0.81 -> 0.90; fp32 8192 keys dense 0.81 -> 0.85, 1:2 0.82 -> 0.85.
      const auto by_key = [&](const float* weight, int k_begin, int k_end) {
        for (int k0 = k_begin; k0 < k_end; k0 += kKeyMajorBlock) {
          const int nk = std::min(kKeyMajorBlock, k_end - k0);
          for (int c0 = 0; c0 < dp_; c0 += 8 * lanes_) {
            const T* base = v + row0 + c0;
            with_slice((dp_ - c0) / lanes_, [&](auto nv, auto pairs) {
              add_keys_to_rows<1, decltype(nv)::value, decltype(pairs)::value>(
                  acc + c0, weight, 0, [k0](int k) { return k0 + k; }, nk, base, step);
            });
          }
        }
      };
      // acc += the slots [s_begin, s_end) by index.
      const auto by_index = [&](int s_begin, int s_end) {
        for (int c0 = 0; c0 < dp_; c0 += 8 * lanes_) {
          const T* base = v + row0 + c0;
          with_slice((dp_ - c0) / lanes_, [&](auto nv, auto pairs) {
            add_cache_rows<decltype(nv)::value, decltype(pairs)::value>(
                acc + c0, s_end - s_begin, cv + s_begin, [base, step, ci, s_begin](int k) { return base + ci[s_begin + k] * step; });
          });
        }
      };
      if (every_key) {
        by_key(cv, t_lo, t_hi);
        continue;
      }
      if (whole) {
        float* wr = ws.weights.ptr + static_cast<std::int64_t>(r) * w_;
        float* saved = ws.acc_saved.ptr + static_cast<std::int64_t>(r) * dp_;
        if (t_lo == 0) {
          std::fill(wr, wr + keys, 0.0f);
          for (int k = 0; k < n; ++k) wr[ci[k]] = cv[k];
          std::copy(acc, acc + dp_, saved);
        }
        by_key(wr, t_lo, t_hi);
        if (t_hi < keys || all_finite(acc, dp_)) continue;
        std::copy(saved, saved + dp_, acc);  // a non-finite V value: by index
        by_index(0, n);
        continue;
      }
      // The slots of this phase: those from where the last phase stopped up to the first one of a
      // key at or past t_hi (all that are left in the last phase). The slots ascend by key but for
      // the order inside a group (compact), so this is a contiguous run of them in slot order.
      std::int32_t& next = ws.slot_next.ptr[r];
      if (t_lo == 0) next = 0;
      int s_end = next;
      if (t_hi >= keys) {
        s_end = n;
      } else {
        while (s_end < n && ci[s_end] < t_hi) ++s_end;
      }
      by_index(next, s_end);
      next = s_end;
    }
#else
    (void)ws, (void)parity, (void)b, (void)hk, (void)j0, (void)t_lo, (void)t_hi;
#endif
  }

#if !HWY_HAVE_SCALABLE
  /// How many of the @p n marks at @p mark are not 0.
  static int count_marked(const std::int32_t* mark, int n) {
    const DI di;
    const int lanes = static_cast<int>(hn::Lanes(di));
    std::size_t count = 0;
    int t = 0;
    for (; t + lanes <= n; t += lanes) count += hn::CountTrue(di, hn::Ne(hn::LoadU(di, mark + t), hn::Zero(di)));
    for (; t < n; ++t) count += mark[t] != 0 ? 1 : 0;
    return static_cast<int>(count);
  }

  /// key_major_accumulate's plan of tile @p parity (its first phase): each row's weight of key t
  /// at weights[r * wstride + t], and the nu keys read at ws.union_keys (none: nothing to add);
  /// the accumulators saved in ws.acc_saved where there are keys to read.
  key_major_plan plan_key_major(decode_workspace& ws, int parity) const {
    const int keys = ws.tile_keys[parity];
    std::int32_t* ukeys = ws.union_keys.ptr;
    const float* weights = ws.weights.ptr;
    std::int64_t wstride = w_;
    bool every_key = dense_;
    for (int r = 0; r < rows_ && every_key; ++r) every_key = ws.kept.ptr[parity * rows_mk_ + r] == keys;
    // Whether the whole tile is read, in address order (ukeys = 0, 1, ..., keys - 1).
    bool whole_tile = every_key;
    int nu = keys;
    if (every_key) {
      // Every row kept every key of the tile (a dense pattern, no mask inside it): the slots are
      // the keys in order (the dense compaction's), so they are the weights as they stand. The
      // scatter and the union below took a tenth of a GQA step's time (one Zen 4 thread, bf16
      // cache in L3).
      weights = slot_val(ws, parity, 0);
      wstride = cstride_;
    } else {
      float* wt = ws.weights.ptr;
      std::int32_t* mark = ws.union_mark.ptr;
      for (int r = 0; r < rows_; ++r) {
        float* wr = wt + static_cast<std::int64_t>(r) * w_;
        std::fill(wr, wr + keys, 0.0f);
        const int n = ws.kept.ptr[parity * rows_mk_ + r];
        const float* cv = slot_val(ws, parity, r);
        const std::int32_t* ci = slot_idx(ws, parity, r);
        for (int k = 0; k < n; ++k) {
          wr[ci[k]] = cv[k];
          mark[ci[k]] = 1;
        }
      }
      // The union's size by vectors; its list (and the marks' reset by it) only where it is not
      // the whole tile. The branch per key of a list made for every tile took 3% of a GQA 2:4 step
      // (one Zen 4 thread, bf16 cache in L3), most tiles being read whole.
      const int count = count_marked(mark, keys);
      if (count == 0) return {};
      // Most of the tile kept by some row (random 1:2 or 2:4 scores with 4 heads per group keep
      // about 15 keys in 16): the whole tile is read, in address order, with weight 0 for the few
      // keys no row kept. Skipping them broke the hardware prefetcher's stream: GQA 32:8, 1:2,
      // fp32 cache, Lk = 16384, one Zen 4 thread, 12.1-13.0 -> 10.3-10.5 ms (dense: 10.0-10.4).
      whole_tile = 4 * count >= 3 * keys;
      if (whole_tile) {
        std::fill(mark, mark + keys, 0);
      } else {
        nu = 0;
        for (int t = 0; t < keys; ++t) {
          if (mark[t] == 0) continue;
          mark[t] = 0;
          ukeys[nu++] = t;
        }
      }
    }
    if (whole_tile) {
      for (int t = 0; t < keys; ++t) ukeys[t] = t;
    }
    std::copy(ws.acc.ptr, ws.acc.ptr + static_cast<std::int64_t>(rows_) * dp_, ws.acc_saved.ptr);
    return {weights, wstride, nu, whole_tile};
  }

  /// P V of a direct tile for a group of rows (grouped heads, draft rows), key-major: each V row
  /// some row of the group kept (or, where that is most of the tile, every row of the tile) is read
  /// once and added to every row of the group, with weight 0 where a row did not keep the key. Row
  /// by row (the single-row loop below) every row re-read the whole tile of V, 128 KiB at d = 128
  /// in fp32, from L2: that was half of a GQA decode step's time in a profile (Zen 4, 32:8, fp32
  /// cache), more than its Q K^T. Per row the keys are added in increasing order. A weight of 0
  /// leaves an accumulator unchanged only against a finite V value (0 * inf is NaN), so a tile
  /// whose accumulators come out non-finite is undone (@p acc restored) and left to the row-by-row
  /// loop, which reads only each row's own keys. Returns whether the tile was done here.
  /// Phases (accumulate_tile's [@p t_lo, @p t_hi), in order): the first one plans the tile (the
  /// weights and the keys read, in ws.key_major), each one adds the blocks of kKeyMajorBlock keys read
  /// that start in it (the same blocks whatever the phases: the same bits), and the last one checks
  /// the accumulators. Returns false only after the last phase, the tile undone.
  bool key_major_accumulate(decode_workspace& ws, int parity, const T* v, std::int64_t step, int t_lo, int t_hi) const {
    const int keys = ws.tile_keys[parity];
    std::int32_t* ukeys = ws.union_keys.ptr;
    key_major_plan& plan = ws.key_major;
    const std::int64_t acc_floats = static_cast<std::int64_t>(rows_) * dp_;
    if (t_lo == 0) plan = plan_key_major(ws, parity);
    if (plan.nu == 0) return true;
    // The blocks of this phase: phases and blocks both start at multiples of kKeyMajorBlock (of the
    // tile's keys and of the keys read, which the tile's keys outnumber or equal).
    const int u_lo = std::min(t_lo, plan.nu), u_hi = t_hi >= keys ? plan.nu : std::min(t_hi, plan.nu);
    const float* weights = plan.weights;
    const std::int64_t wstride = plan.wstride;
    const bool whole_tile = plan.whole_tile;
    const int nu = plan.nu;
    const int nv = dp_ / lanes_;
    // Whole rows: on AVX-512, where a block of rows holds a whole V row per row in its
    // accumulators (d <= 128), a whole tile's V is read by the FMAs themselves, row after row in
    // address order, the first block of rows from memory and the others from L1, with no touch
    // first. Touching a block's rows and then computing from L1 left the memory idle while the
    // block was computed: GQA 32:8, fp32, Lk = 16384, 2 Zen 4 threads, against a stand-alone
    // loop of the same dot products and P V on the same cache in the same process, 0.85-0.87 ->
    // 0.89-0.90 of its rate (9 interleaved rounds). A bf16 cache keeps the touch: its P V
    // (vdpbf16ps, 4 rows per pass) is bound by compute, and passes of 2 rows read straight from
    // memory measured slower (0.87 -> 0.78 of the sweep).
    const int rows_per_pass = kKeyMajorStreamsRows && whole_tile && nv <= 8 ? kKeyMajorAccumulators / nv : 0;
    bool streamed = rows_per_pass >= 1;
    bool requests_next = false;
#if DFSS_SIMD_BF16_DOT
    if constexpr (std::is_same_v<T, bfloat16>) {
      streamed = streamed && !dot_;
      requests_next = kKeyMajorRequestsNext && dot_ && !amx_ && !interleaved_;
    }
#endif
    // The register blocks (below): rows of a block given the rows left (both paths), and the touch
    // path's column vectors per pass given its rows and its passes over a block, for the prefetch
    // of the next.
    const auto block_rows = [](int left) { return left >= 4 ? 4 : (left >= 2 ? 2 : 1); };
    const auto block_columns = [](int rr) { return std::min(8, kKeyMajorAccumulators / rr); };
    static_assert(kKeyMajorAccumulators / 4 % 2 == 0, "even column passes for the pair layout (with_slice)");
    int passes = 0;
    for (int r0 = 0; r0 < rows_; r0 += block_rows(rows_ - r0)) {
      const int cmax = block_columns(block_rows(rows_ - r0));
      passes += (nv + cmax - 1) / cmax;
    }
    // On the AMX tiles (amx_), the phase's keys in one call: its blocks of 32 keys start at
    // multiples of 32 of the keys read, as this loop's do, so the bits do not depend on the phases.
#if DFSS_SIMD_AMX
    if (amx_ && u_lo < u_hi) {
      amx::decode_pv(ws.acc.ptr, rows_, dp_, d_, weights + (whole_tile ? u_lo : 0), wstride,
                     whole_tile ? nullptr : ukeys + u_lo, u_hi - u_lo,
                     reinterpret_cast<const std::uint16_t*>(v) + (whole_tile ? u_lo * step : 0), step);
    }
#endif
    for (int k0 = amx_ ? u_hi : u_lo; k0 < u_hi; k0 += kKeyMajorBlock) {
      const int n = std::min(kKeyMajorBlock, nu - k0);
      if (streamed) {
        for (int r0 = 0; r0 < rows_;) {
          const int rr = block_rows(std::min(rows_ - r0, rows_per_pass));
          float* acc = ws.acc.ptr + static_cast<std::int64_t>(r0) * dp_;
          const float* wt = weights + static_cast<std::int64_t>(r0) * wstride;
          const auto key = [k0](int k) { return k0 + k; };
          with_slice(nv, [&](auto cv, auto pairs) {
            add_keys_to_row_block<decltype(cv)::value, decltype(pairs)::value>(rr, acc, wt, wstride, key, n, v, step);
          });
          r0 += rr;
        }
        continue;
      }
      const auto key = [ukeys, k0](int k) { return ukeys[k0 + k]; };
      // Otherwise the block's V rows are touched whole, in address order, and the column slices
      // below read them from L1. Slices straight from memory (one 64-byte line of each 512-byte
      // row at a time on AVX2, four on AVX-512) lost the hardware prefetcher's stream: GQA 32:8,
      // fp32, one Zen 4 thread, AVX2 15.4 -> 9.2 ms, AVX-512 12.3-15.1 -> 9.8-12.8 ms (a noisy hour).
      // Not where the previous block's decode_pv requested these rows into L2 (requests_next).
      if (!(requests_next && k0 > u_lo)) touch_rows(ws, v, step, n, key);
#if DFSS_SIMD_BF16_DOT
      if constexpr (std::is_same_v<T, bfloat16>) {
        if (dot_) {
          // A bf16 cache on avx3_bf16: vdpbf16ps over pairs of keys, the weights rounded to bf16 as
          // in the fused forward's P V (docs/semantics.md, "Precision"); a non-finite V value still
          // makes the accumulators non-finite (0 * inf is NaN there too), so the undo below holds.
          // The first call requests the next block's rows of this phase (requests_next).
          static_assert(bf16dot::kDecodePvKeys == kKeyMajorBlock, "one call per key block");
          const int ahead = requests_next ? std::clamp(u_hi - k0 - kKeyMajorBlock, 0, kKeyMajorBlock) : 0;
          const std::int32_t* next = ahead > 0 ? ukeys + k0 + kKeyMajorBlock : nullptr;
          for (int r0 = 0; r0 < rows_; r0 += bf16dot::kDecodeRows) {
            bf16dot::decode_pv(ws.acc.ptr + static_cast<std::int64_t>(r0) * dp_, std::min(bf16dot::kDecodeRows, rows_ - r0),
                               dp_, d_, weights + static_cast<std::int64_t>(r0) * wstride, wstride, ukeys + k0, n,
                               reinterpret_cast<const std::uint16_t*>(v), step, r0 == 0 ? next : nullptr,
                               r0 == 0 ? ahead : 0);
          }
          continue;
        }
      }
#endif
      // On AVX2 the next block's V rows are prefetched during this block's passes, a share of its
      // rows before each pass, so that the memory works while the block is computed from L1
      // (touched, then computed, it idled then): GQA 32:8, Lk = 16384, 2 Zen 3 threads, against a
      // sweep of the cache in the same run, 0.74 -> 0.80 (fp32) and 0.54 -> 0.57-0.61 (bf16); fp32
      // at Lk = 65536 0.79 -> 0.81 (5-7 interleaved rounds). Two blocks ahead measured no better.
      const int next = kKeyMajorPrefetchesNext && k0 + kKeyMajorBlock < nu ? std::min(kKeyMajorBlock, nu - k0 - kKeyMajorBlock) : 0;
      int pass = 0;
      for (int r0 = 0; r0 < rows_;) {
        const int rr = block_rows(rows_ - r0);
        const int cmax = block_columns(rr);
        for (int c = 0; c < nv; c += cmax) {
          for (int k = next * pass / passes; k < next * (pass + 1) / passes; ++k) {
            this->prefetch_lines(v + ukeys[k0 + kKeyMajorBlock + k] * step);
          }
          ++pass;
          float* acc = ws.acc.ptr + static_cast<std::int64_t>(r0) * dp_ + c * lanes_;
          const float* wt = weights + static_cast<std::int64_t>(r0) * wstride;
          const T* base = v + c * lanes_;
          with_slice(std::min(cmax, nv - c), [&](auto cv, auto pairs) {
            add_keys_to_row_block<decltype(cv)::value, decltype(pairs)::value>(rr, acc, wt, wstride, key, n, base, step);
          });
        }
        r0 += rr;
      }
    }
    // A non-finite V value read reaches every row's accumulator in its column (w inf or 0 inf), so
    // finite accumulators mean every value read was finite.
    if (t_hi < keys || all_finite(ws.acc.ptr, acc_floats)) return true;
    std::copy(ws.acc_saved.ptr, ws.acc_saved.ptr + acc_floats, ws.acc.ptr);
    return false;
  }

  /// The pair layout (pairs_) of the 2 L bf16 values at @p src (L lanes): @p even gets the values
  /// at even offsets, @p odd those at odd offsets, as fp32. Each 32-bit lane of one load holds two
  /// values, the even one in its low half (little-endian): shifted up by 16 bits it is that value
  /// in fp32, and the lane with its low half cleared is the odd one. Two integer operations per 2 L
  /// values, where PromoteTo takes a widening load and a shift per L: on Zen 3 both of those run
  /// on the two vector pipes that also do half the FMAs, and a bf16 decode step is bound by its
  /// arithmetic more than an fp32 one (docs/benchmarks.md, "Zen 3: a bf16 cache in the pair
  /// layout").
  /// Returns the bits loaded.
  static HWY_INLINE hn::Vec<hn::RebindToUnsigned<DF>> load_pair(const T* src, VF& even, VF& odd) {
    static_assert(std::endian::native == std::endian::little, "the even value in the low half");
    const DF d;
    const hn::RebindToUnsigned<DF> du;
    const auto both = hn::LoadU(du, reinterpret_cast<const std::uint32_t*>(src));
    even = hn::BitCast(d, hn::ShiftLeft<16>(both));
    odd = hn::BitCast(d, hn::And(both, hn::Set(du, 0xffff0000u)));
    return both;
  }

  /// Calls f(std::integral_constant<int, C>(), std::bool_constant<P>()) for a slice of @p nv column
  /// vectors of V: C = min(8, nv) as with_column_vectors, P = pairs_ (the slice read in the pair
  /// layout). Under pairs_ every slice has an even width (rows have an even number of vectors,
  /// slices are 8 vectors but a row's last, or key_major_accumulate's even block_columns).
  template <typename F>
  HWY_INLINE void with_slice(int nv, const F& f) const {
    if constexpr (std::is_same_v<T, bfloat16>) {
      if (pairs_) {
        switch (std::min(8, nv)) {
          case 2: f(std::integral_constant<int, 2>(), std::true_type()); return;
          case 4: f(std::integral_constant<int, 4>(), std::true_type()); return;
          case 6: f(std::integral_constant<int, 6>(), std::true_type()); return;
          case 8: f(std::integral_constant<int, 8>(), std::true_type()); return;
          default: HWY_ABORT("dfss decode: a slice of %d vectors in the pair layout", nv);
        }
      }
    }
    with_column_vectors(nv, [&](auto c) { f(c, std::false_type()); });
  }

  /// One load per cache line of the @p n V rows base + key(k) * step, k = 0, 1, ... (OR-ed into a
  /// value nobody uses), so that the rows are then read from L1.
  template <typename Key>
  void touch_rows(decode_workspace& ws, const T* base, std::int64_t step, int n, const Key& key) const {
    const hn::Rebind<std::uint16_t, DF> du;
    auto any = hn::Zero(du);
    constexpr std::int64_t kPerLine = kCacheLine / static_cast<std::int64_t>(sizeof(std::uint16_t));
    const std::int64_t units = static_cast<std::int64_t>(d_) * static_cast<std::int64_t>(sizeof(T) / 2);
    const std::int64_t last = units - static_cast<std::int64_t>(hn::Lanes(du));
    for (int k = 0; k < n; ++k) {
      const auto* row = reinterpret_cast<const std::uint16_t*>(base + key(k) * step);
      for (std::int64_t x = 0; x < units; x += kPerLine) any = hn::Or(any, hn::LoadU(du, row + std::min(x, last)));
    }
    hn::StoreU(any, du, reinterpret_cast<std::uint16_t*>(ws.touch.ptr));
  }

  /// Whether the @p n floats at @p x are all finite.
  static bool all_finite(const float* x, std::int64_t n) {
    const DF d;
    const DI di;
    const VI exponent = hn::Set(di, 0x7f800000);
    auto bad = hn::Lt(hn::Zero(di), hn::Zero(di));
    std::int64_t i = 0;
    for (; i + static_cast<std::int64_t>(hn::Lanes(d)) <= n; i += static_cast<std::int64_t>(hn::Lanes(d))) {
      bad = hn::Or(bad, hn::Eq(hn::And(hn::BitCast(di, hn::LoadU(d, x + i)), exponent), exponent));
    }
    bool ok = hn::AllFalse(di, bad);
    for (; i < n; ++i) ok = ok && std::isfinite(x[i]);
    return ok;
  }

  /// The C vectors of V at @p src: in the pair layout (load_pair) when P, else in column order.
  template <int C, bool P>
  static HWY_INLINE void load_vectors(const T* HWY_RESTRICT src, VF (&x)[C]) {
    constexpr std::int64_t L = static_cast<std::int64_t>(hn::MaxLanes(DF()));  // fixed-width targets only
    if constexpr (P) {
      static_assert(std::is_same_v<T, bfloat16> && C % 2 == 0, "pairs of bf16 vectors");
      for (int c = 0; c < C; c += 2) load_pair(src + c * L, x[c], x[c + 1]);
    } else {
      for (int c = 0; c < C; ++c) x[c] = base::load_value(src + c * L);
    }
  }

  /// add_keys_to_rows for @p rows (4, 2 or 1) rows.
  template <int C, bool P, typename Key>
  HWY_INLINE void add_keys_to_row_block(int rows, float* HWY_RESTRICT acc, const float* HWY_RESTRICT wt,
                                        std::int64_t wstride, const Key& key, int n, const T* HWY_RESTRICT base,
                                        std::int64_t step) const {
    if (rows == 4) {
      add_keys_to_rows<4, C, P>(acc, wt, wstride, key, n, base, step);
    } else if (rows == 2) {
      add_keys_to_rows<2, C, P>(acc, wt, wstride, key, n, base, step);
    } else {
      add_keys_to_rows<1, C, P>(acc, wt, wstride, key, n, base, step);
    }
  }

  /// acc row r (stride dp), columns [0, C vectors) += sum over the @p n keys t = key(k), k in
  /// increasing order, of wt[r * wstride + t] * V row t (at base + t * step), for R rows; V read
  /// in the pair layout when P (load_vectors).
  template <int R, int C, bool P, typename Key>
  HWY_INLINE void add_keys_to_rows(float* HWY_RESTRICT acc, const float* HWY_RESTRICT wt, std::int64_t wstride,
                                   const Key& key, int n, const T* HWY_RESTRICT base, std::int64_t step) const {
    const DF d;
    constexpr std::int64_t L = static_cast<std::int64_t>(hn::MaxLanes(DF()));  // fixed-width targets only
    VF a[R][C];
    for (int r = 0; r < R; ++r) {
      for (int c = 0; c < C; ++c) a[r][c] = hn::Load(d, acc + r * dp_ + c * L);
    }
    for (int k = 0; k < n; ++k) {
      const std::int64_t t = key(k);
      VF x[C];
      load_vectors<C, P>(base + t * step, x);
      for (int r = 0; r < R; ++r) {
        const VF w = hn::Set(d, wt[r * wstride + t]);
        for (int c = 0; c < C; ++c) a[r][c] = hn::MulAdd(w, x[c], a[r][c]);
      }
    }
    for (int r = 0; r < R; ++r) {
      for (int c = 0; c < C; ++c) hn::Store(a[r][c], d, acc + r * dp_ + c * L);
    }
  }

  /// acc[0, NV vectors) += sum over k < n of wt[k] * row(k), keys in slot order (add_rows' order);
  /// V read in the pair layout when P (load_vectors).
  template <int NV, bool P, typename Row>
  HWY_INLINE void add_cache_rows(float* HWY_RESTRICT acc, int n, const float* HWY_RESTRICT wt, const Row& row) const {
    const DF d;
    constexpr std::int64_t L = static_cast<std::int64_t>(hn::MaxLanes(DF()));  // fixed-width targets only
    VF a[NV];
    for (int x = 0; x < NV; ++x) a[x] = hn::Load(d, acc + x * L);
    for (int k = 0; k < n; ++k) {
      VF v[NV];
      load_vectors<NV, P>(row(k), v);
      const VF w = hn::Set(d, wt[k]);
      for (int x = 0; x < NV; ++x) a[x] = hn::MulAdd(w, v[x], a[x]);
    }
    for (int x = 0; x < NV; ++x) hn::Store(a[x], d, acc + x * L);
  }
#endif

  /// @p src (dp_ floats in column order) into the pair layout (pairs_) at @p dst (another row).
  void to_pairs(const float* HWY_RESTRICT src, float* HWY_RESTRICT dst) const {
    for (int c0 = 0; c0 < dp_; c0 += 2 * lanes_) {
      for (int i = 0; i < lanes_; ++i) {
        dst[c0 + i] = src[c0 + 2 * i];
        dst[c0 + lanes_ + i] = src[c0 + 2 * i + 1];
      }
    }
  }

  /// @p src (dp_ floats in the pair layout) in column order at @p dst (another row).
  void from_pairs(const float* HWY_RESTRICT src, float* HWY_RESTRICT dst) const {
    for (int c0 = 0; c0 < dp_; c0 += 2 * lanes_) {
      for (int i = 0; i < lanes_; ++i) {
        dst[c0 + 2 * i] = src[c0 + i];
        dst[c0 + 2 * i + 1] = src[c0 + lanes_ + i];
      }
    }
  }

  float* slot_val(decode_workspace& ws, int parity, int r) const {
    return ws.cv.ptr + (static_cast<std::int64_t>(parity) * rows_mk_ + r) * cstride_;
  }
  std::int32_t* slot_idx(decode_workspace& ws, int parity, int r) const {
    return ws.ci.ptr + (static_cast<std::int64_t>(parity) * rows_mk_ + r) * cstride_;
  }

  /// The panel [dp][P] of the P key rows at @p rows (row stride dp): 4 rows at a time are
  /// transposed in registers (4 x 4 within every 128-bit block) and stored a block at a time, a
  /// quarter of the loads and stores of an element-wise transpose, which was the largest cost of a
  /// one-row decode step in a profile (AVX-512, d = 128). Scalable (SVE) vectors take the
  /// element-wise loop.
  void transpose_panel(const float* rows, float* panel) const {
#if !HWY_HAVE_SCALABLE
    const DF d;
    const hn::Repartition<std::uint64_t, DF> du;
    for (int t0 = 0; t0 < panel_; t0 += 4) {
      const float* r = rows + static_cast<std::int64_t>(t0) * dp_;
      float* dst = panel + t0;
      for (int c0 = 0; c0 < dp_; c0 += lanes_) {
        const VF v0 = hn::Load(d, r + c0), v1 = hn::Load(d, r + dp_ + c0);
        const VF v2 = hn::Load(d, r + 2 * dp_ + c0), v3 = hn::Load(d, r + 3 * dp_ + c0);
        const auto t01l = hn::BitCast(du, hn::InterleaveLower(d, v0, v1));  // a0 b0 a1 b1 per block
        const auto t01u = hn::BitCast(du, hn::InterleaveUpper(d, v0, v1));  // a2 b2 a3 b3
        const auto t23l = hn::BitCast(du, hn::InterleaveLower(d, v2, v3));  // c0 d0 c1 d1
        const auto t23u = hn::BitCast(du, hn::InterleaveUpper(d, v2, v3));  // c2 d2 c3 d3
        const std::int64_t stride = 4 * static_cast<std::int64_t>(panel_);  // block b: c0 + 4 b
        store_blocks(d, hn::BitCast(d, hn::InterleaveLower(du, t01l, t23l)), dst + c0 * panel_, stride);
        store_blocks(d, hn::BitCast(d, hn::InterleaveUpper(du, t01l, t23l)), dst + (c0 + 1) * panel_, stride);
        store_blocks(d, hn::BitCast(d, hn::InterleaveLower(du, t01u, t23u)), dst + (c0 + 2) * panel_, stride);
        store_blocks(d, hn::BitCast(d, hn::InterleaveUpper(du, t01u, t23u)), dst + (c0 + 3) * panel_, stride);
      }
    }
#else
    for (int c = 0; c < dp_; ++c) {
      for (int t = 0; t < panel_; ++t) panel[c * panel_ + t] = rows[t * dp_ + c];
    }
#endif
  }

  /// S = Q Kt for the task's rows_mk_ rows against the tile's panels: 8 (where the target's
  /// micro-kernel is 8 high) or 4 rows per call, and 1 or 2 rows for a group that small.
  void scores(const float* q, const float* kt, float* s) const {
    for (int i = 0; i < rows_mk_;) {
      const int left = rows_mk_ - i;
      const int r = left >= 8 && kMicroRows == 8 ? 8 : (left >= 4 ? 4 : left);
      for (int jb = 0; jb < w_; jb += panel_) {
        const float* x = q + static_cast<std::int64_t>(i) * dp_;
        const float* panel = kt + static_cast<std::int64_t>(jb / panel_) * dp_ * panel_;
        float* out = s + static_cast<std::int64_t>(i) * w_ + jb;
        switch (r) {
          case 8: microkernel<8>(x, dp_, panel, dp_, out, w_); break;
          case 4: microkernel<4>(x, dp_, panel, dp_, out, w_); break;
          case 2: microkernel<2>(x, dp_, panel, dp_, out, w_); break;
          default: microkernel<1>(x, dp_, panel, dp_, out, w_); break;
        }
      }
      i += r;
    }
  }

  void scale_row(float* acc, float corr) const {
    const DF d;
    const VF vc = hn::Set(d, corr);
    for (int c = 0; c < dp_; c += lanes_) hn::Store(hn::Mul(vc, hn::Load(d, acc + c)), d, acc + c);
  }

  /// exp(scale (x - max)) of the @p kept compacted scores @p cv in place (the fused forward's
  /// exponent, (x - max) e1 [e2]); returns their sum. The local key indices @p ci become offsets
  /// into the tile's V rows, -inf slots (masked keys, padding) the zero row's; every other slot
  /// marks its key in @p used.
  template <bool Split>
  HWY_INLINE float exp_kept(float* cv, std::int32_t* ci, int kept, float mx, std::int32_t* used) const {
    const DF d;
    const DI di;
    const VF vmx = hn::Set(d, mx), ve1 = hn::Set(d, e1_), ve2 = hn::Set(d, e2_);
    const VI vdp = hn::Set(di, dp_), vzero_row = hn::Set(di, w_ * dp_);
    const VF neg_inf = hn::Set(d, -std::numeric_limits<float>::infinity());
    VF vsum = hn::Zero(d);
    for (int t = 0; t < kept; t += lanes_) {
      const VF x = hn::Load(d, cv + t);
      for (int u = 0; u < lanes_; ++u) {
        if (cv[t + u] != -std::numeric_limits<float>::infinity()) used[ci[t + u]] = 1;
      }
      VF y = hn::Mul(hn::Sub(x, vmx), ve1);
      if constexpr (Split) y = hn::Mul(y, ve2);
      const VF e = exp2_poly(y);
      hn::Store(e, d, cv + t);
      vsum = hn::Add(vsum, e);
      const auto masked = hn::RebindMask(di, hn::Eq(x, neg_inf));
      hn::StoreU(hn::IfThenElse(masked, vzero_row, hn::Mul(hn::LoadU(di, ci + t), vdp)), di, ci + t);
    }
    return hn::GetLane(hn::SumOfLanes(d, vsum));
  }

  /// exp_kept for a direct tile, whose V rows come straight from the cache: masked keys (-inf) are
  /// first dropped from the @p kept slots rather than given weight 0 against a row that may hold
  /// anything (those at the end cut off, any others by a scalar pass: Highway 1.0.3's
  /// CompressStore is slow on AVX2, see compact), then the exponentials replace the scores in
  /// place, the key indices left as they are. @p live gets the slots left. Returns the sum of the
  /// exponentials.
  template <bool Split>
  HWY_INLINE float exp_live(float* cv, std::int32_t* ci, int kept, float mx, int& live) const {
    const DF d;
    const VF neg_inf = hn::Set(d, -std::numeric_limits<float>::infinity());
    // Per vector of slots: how many are masked, and where the last one not masked is.
    std::size_t masked = 0;
    int last = -1;  // the first slot of the last vector holding a slot not masked
    for (int t = 0; t < kept; t += lanes_) {
      // Slots past kept are padding: only the first kept - t lanes count.
      const auto in = hn::FirstN(d, static_cast<std::size_t>(kept - t));
      const auto m = hn::And(hn::Eq(hn::Load(d, cv + t), neg_inf), in);
      masked += hn::CountTrue(d, m);
      if (!hn::AllFalse(d, hn::AndNot(m, in))) last = t;
    }
    int n = kept;  // a local, not the caller's slot count, so that the loops keep it in a register
    if (masked != 0) {
      // Masked slots at the end (keys past a short tile's end or a row's key limit) are cut off by
      // vectors, then within the last one. Without a bias those are all of a direct tile's masked
      // slots; others (a mask given as a bias: bias_only_masks) are compacted one by one.
      n = last < 0 ? 0 : std::min(kept, last + lanes_);
      while (n > 0 && cv[n - 1] == -std::numeric_limits<float>::infinity()) --n;
      if (masked != static_cast<std::size_t>(kept - n)) {
        int out = 0;
        for (int k = 0; k < n; ++k) {
          if (cv[k] == -std::numeric_limits<float>::infinity()) continue;
          cv[out] = cv[k];
          ci[out++] = ci[k];
        }
        n = out;
      }
    }
    live = n;
    const VF vmx = hn::Set(d, mx), ve1 = hn::Set(d, e1_), ve2 = hn::Set(d, e2_);
    VF vsum = hn::Zero(d);
    for (int t = 0; t < n; t += lanes_) {
      VF y = hn::Mul(hn::Sub(hn::Load(d, cv + t), vmx), ve1);
      if constexpr (Split) y = hn::Mul(y, ve2);
      // Lanes past n: whatever the slots held (scores, padding); computed, never summed or read.
      const VF e = hn::IfThenElseZero(hn::FirstN(d, static_cast<std::size_t>(n - t)), exp2_poly(y));
      hn::Store(e, d, cv + t);
      vsum = hn::Add(vsum, e);
    }
    return hn::GetLane(hn::SumOfLanes(d, vsum));
  }

  /// Folds the chunks of (batch, kv head) @p pair in increasing order and writes O and LSE.
  void fold(std::int64_t pair, const partial_states& parts) const {
    const std::int64_t hk = pair % p_.heads_kv, b = pair / p_.heads_kv;
    std::vector<float> acc(static_cast<std::size_t>(dp_));
    for (int r = 0; r < rows_; ++r) {
      float mx = 0.0f, sum = 0.0f;
      bool is_nan = false;
      this->fold_states(parts, static_cast<std::size_t>(pair * chunks_ * rows_ + r), static_cast<std::size_t>(rows_),
                        chunks_, acc.data(), mx, sum, is_nan);
      this->store_row(b, row_of(r), head_of(hk, r), acc.data(), mx, sum, is_nan);
    }
  }

  const int rows_, rows_mk_;
  const std::int64_t chunk_, chunks_;
  const int cstride_;  ///< per-row stride of the compacted scores and offsets (W + 2 vectors)
  const bool dense_;   ///< N = M: every V row is read, so V is prefetched with K (panel path)
  /// The direct path can run: rows of K and V contiguous, d a multiple of the vector (no tails) and
  /// a target with fixed-size vectors (it keeps arrays of vectors). Else every tile takes the panel path.
  const bool direct_;
  /// The direct path's Q K^T by vdpbf16ps (bf16dot::decode_dots): a bf16 cache on avx3_bf16, d a
  /// multiple of 32. Q is bf16 too (the inputs share one type), so its bf16 copy is exact.
  const bool dot_;
  /// A bf16 cache read in the pair layout (load_pair; the direct path and no vdpbf16ps, an even
  /// number of vectors per row): in every block of two vectors' columns the even columns come
  /// first, then the odd ones. The task's accumulators are in it (every P V, direct and panel,
  /// adds rows in it) and are put back in column order as the task ends (from_pairs).
  const bool pairs_;
  /// The direct path's Q K^T and key-major P V on the AMX tiles (amx::decode_qk, amx::decode_pv)
  /// where tiles_fit; the rest of the call takes the vdpbf16ps loops (dot_).
  const bool amx_;
  /// The kv heads are interleaved in memory (heads_interleaved): tiles go in phases (phase_keys).
  const bool interleaved_;
  /// The bias holds 0 and -inf only (a mask; bias_only_masks): it keeps the direct path.
  const bool bias_masks_;
};

/// The decode forward has one instance per Highway target; avx3_bf16 runs the avx3 one with the
/// bf16 dot products for a bf16 cache (decode_pass::dot_).
status decode_entry(const attention_params& p, simd_target t) {
  return run_pass<decode_pass>(p, "dfss cpu simd decode forward", t == simd_target::avx3_bf16);
}

#else  // the static baseline target: never dispatched to (see targets.hpp)

DFSS_SIMD_BASELINE_ENTRY(decode_entry, "dfss cpu simd decode forward")

#endif  // DFSS_SIMD_KERNEL_TARGET

}  // namespace dfss::cpu::simd::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
#include "cpu/simd/dispatch.hpp"

namespace dfss::cpu {
DFSS_SIMD_EXPORT_ENTRY(decode_entry, decode_forward_simd, "dfss cpu simd decode forward")

bool decode_forward_applies(const attention_params& p) noexcept { return p.seqlen_q <= kDecodeMaxQueryRows; }

}  // namespace dfss::cpu
#endif  // HWY_ONCE
