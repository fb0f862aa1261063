// What the SIMD forward (attention_forward.cpp) and backward (attention_backward.cpp) share, written
// once over Google Highway and compiled once per target by hwy/foreach_target.h: the per-thread
// scratch, packing of K and V, the Q K^T micro-kernel, bias and masks, the N:M selection with
// compaction of the kept scores, the exp2 polynomial, and the online softmax update. The backward
// must keep exactly the keys its forward kept, and near-ties are decided by fp32 rounding, so both
// directions run these functions (same source, same target flags, -ffp-contract=off), never a copy.
//
// Layout, per (batch, kv head), packed by each thread once, in fp32 with the head dimension padded
// to dp (a multiple of the vector length):
//   Kt: [lk_pad / P][dp][P]   P-key panels (P = 2 vectors of floats), transposed, for Q K^T;
//   Vp: [lk_pad + 1][dp]      value rows; rows >= Lk are zero (row lk_pad is the "zero row").
// lk_pad is Lk rounded up to the key tile width W. Extra memory is O(threads x Lk x d).
//
// Per-target include guard (the Highway convention): this file is included once per target.
#if defined(DFSS_CPU_SIMD_KERNEL_PARTS_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef DFSS_CPU_SIMD_KERNEL_PARTS_INL_H_
#undef DFSS_CPU_SIMD_KERNEL_PARTS_INL_H_
#else
#define DFSS_CPU_SIMD_KERNEL_PARTS_INL_H_
#endif

#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <new>
#include <numeric>
#include <type_traits>
#include <vector>

#include "core/element_access.hpp"
#include "cpu/fused_common.hpp"
#include "cpu/scalar/attention.hpp"
#include "cpu/parallel.hpp"
#include "cpu/simd/amx_tiles.hpp"
#include "cpu/simd/bf16_dot.hpp"
#include "cpu/simd/targets.hpp"
#include "dfss/format/nm_select.hpp"
#include "dfss/mask/visibility.hpp"
#include "dfss/numeric.hpp"
#include "hwy/highway.h"

// Shared across targets (defined once, outside the per-target namespace).
#ifndef DFSS_CPU_SIMD_KERNEL_COMMON_ONCE_
#define DFSS_CPU_SIMD_KERNEL_COMMON_ONCE_
namespace dfss::cpu::simd {

/// Query rows per task: enough to amortise the per-tile setup and small enough that the task's Q
/// (32 x dp), S (32 x W) and accumulators (32 x dp) stay in L1/L2 for d = 64. A multiple of every
/// micro-kernel height (4 and 8).
inline constexpr int kRowsPerTask = 32;
/// Bytes per prefetch: the cache line of every x86-64 and AArch64 core dfss targets.
inline constexpr std::int64_t kCacheLine = 64;
/// Rows ahead that pack_head prefetches the K and V rows it converts: a [B, L, H, d] input's
/// rows of one head lie H d elements apart (3 KiB at H = 12, d = 64 in fp32), a pattern the
/// hardware prefetcher followed too late: in perf of a causal fp32 forward (one Zen 3 thread, B = 1,
/// H = 12, L = 2048, d = 64, 1:2) the packing took 10% of the samples without it, 5.8% with 16 rows
/// ahead, 6.3% with 48.
inline constexpr std::int64_t kPackPrefetchRows = 16;
/// Row tasks (kRowsPerTask query rows of a (batch, head)) below which the fused forward splits each
/// row task's keys into chunks (flash-decoding, exact through the LSE merge): enough tasks for up
/// to a few dozen threads. The rule reads the shape only, so a shape splits the same way on every
/// machine and thread count (bitwise identical results).
inline constexpr std::int64_t kSplitTargetTasks = 32;
/// Shortest key chunk of a split forward: 1024 keys are 32 key tiles, so the per-chunk costs
/// (loading the task's Q, writing and folding a partial state per row, one extra pass over the
/// tile's setup) stay around 1% of the chunk's work; as the decode kernel's kDecodeMinChunk, doubled
/// because a forward task has up to 32 rows to fold instead of one group.
inline constexpr std::int64_t kSplitMinChunk = 1024;
/// Minimum key tile width; the real width is a multiple of lcm(M, P) at least this wide. 64 keys of
/// K (16 KiB at d = 64) fit in L1 next to the S tile; 32 and 128 measured slower for dense at d = 64
/// with the AVX2 kernel this one replaces.
inline constexpr int kMinKeyTile = 64;
/// Bytes of fp32 K per key tile the fp32 forward aims for (forward_key_tile).
inline constexpr std::int64_t kForwardKeyTileBytes = 32 * 1024;
/// The fp32 forward's minimum key tile for head dimension @p head_dim: about kForwardKeyTileBytes
/// of fp32 K (128 keys at d = 64, 64 at d = 128), within [kMinKeyTile, 4 kMinKeyTile]. The work
/// each row does per tile (maximum, accumulator rescale, the exponentials' set-up and sum) is then
/// shared by more keys while the tile's K stays within L1 next to the S tile. Measured (Zen 5, one
/// thread, B = 1, H = 12, L = 2048): at d = 64, 64 -> 128 keys took avx3 dense 76.2 -> 73.0 ms, 1:2
/// 73.7 -> 67.8, 2:4 78.8 -> 74.7, and avx2 141.0 -> 137.8, 119.3 -> 112.7, 124.3 -> 118.8 (256 keys:
/// avx3 2% faster again, avx2 2-3% slower); at d = 128, 128 keys (64 KiB) made avx3 1:2 and 2:4 2%
/// and 8% slower, 256 keys slower for every sparse row.
inline int forward_key_tile(std::int64_t head_dim) {
  const std::int64_t keys = kForwardKeyTileBytes / (4 * std::max<std::int64_t>(1, head_dim));
  return static_cast<int>(std::clamp<std::int64_t>(keys, kMinKeyTile, 4 * kMinKeyTile));
}
/// The avx3_bf16 forward's minimum key tile: its Q K^T and P V run at about twice the fp32 rate,
/// so the per-tile work of each row (horizontal max and sum, the rescale of the accumulator row)
/// weighs twice as much; 128 keys halve it (K tile 16 KiB in bf16 at d = 64, as 64 fp32 keys).
/// Measured (Zen 5, L = 2048, d = 64, 2 threads, bf16): 64 -> 128 took the 1:2 forward from 112 to
/// 80 ms, 2:4 from 104 to 82, dense from 120 to 104; 256 measured the same as 128.
inline constexpr int kMinKeyTileBf16Dot = 128;
/// The forward's minimum key tile where Q K^T runs on the AMX tiles (bf16 inputs on a CPU with
/// AMX): as with the bf16 dot products, the products are fast and each row's work per tile (the
/// selection's set-up, the horizontal max and sum, the rescale) and each AMX call's loads and
/// stores of its accumulator tiles weigh more, while K is half the bytes of fp32. Measured
/// (Sapphire Rapids VM, causal bf16, B = 1, H = 12, 2 threads, 5 rounds of
/// tools/bench/compare_builds.sh, L = 1024-4096): at d = 128, 64 -> 128 keys took dense 0.84-0.88x
/// the time, 1:2 0.85-0.89x, 2:4 0.88-0.93x; 128 -> 256 keys (d = 64 and 128) 1:2 0.91-0.98x,
/// dense 0.98-1.00x, 2:4 0.95-1.02x.
inline constexpr int kMinKeyTileAmx = 256;
using fused::kDirectLseLimit;  // shared with the scalar twin (cpu/fused_common.hpp)
using fused::kLn2;
using fused::kLog2e;
/// Buffer alignment: a whole vector of the widest target (2048-bit SVE), so every Load is aligned.
inline constexpr std::size_t kAlign = 256;

/// Key tile width for group size @p m and panel width @p panel: a multiple of the panel (the
/// micro-kernel width) and of M (so groups never straddle tiles), at least kMinKeyTile.
inline int key_tile_width(int m, int panel, int min_tile = kMinKeyTile) {
  const int l = m / std::gcd(m, panel) * panel;
  return (min_tile + l - 1) / l * l;
}

/// kAlign-aligned scratch that only grows; consistent (empty) after a failed allocation.
template <typename E>
struct aligned_buffer {
  E* ptr = nullptr;
  std::size_t size = 0;
  aligned_buffer() = default;
  aligned_buffer(const aligned_buffer&) = delete;
  aligned_buffer& operator=(const aligned_buffer&) = delete;
  void resize(std::size_t n) {
    if (n <= size) return;
    std::free(ptr);
    size = 0;
    ptr = static_cast<E*>(std::aligned_alloc(kAlign, (n * sizeof(E) + kAlign - 1) / kAlign * kAlign));
    if (ptr == nullptr) throw std::bad_alloc();
    size = n;
  }
  ~aligned_buffer() { std::free(ptr); }
};

/// Per-thread state (worker_scratch): the packed keys and values of one (batch, kv head) and the
/// task scratch. It lives as long as the thread, so repeated calls reuse its pages.
struct workspace {
  std::int64_t packed_b = -1, packed_hk = -1;
  std::int64_t packed_k0 = -1;       ///< first key of the packed range (a key chunk of the forward)
  const void* packed_for = nullptr;  ///< the call (its params) the packed head belongs to
  bool kv_risky = false;  ///< the packed K or V holds a non-finite or huge value
  bool risky = false;     ///< the current task can produce NaN or +inf scores
  aligned_buffer<float> kt, vp, pack, q, s, acc, comp_val, row_max, row_sum;
  aligned_buffer<float> vn;  ///< forward, 1:2: the odd keys' V rows negated (pair_values)
  aligned_buffer<std::int32_t> comp_idx, row_nan;
  /// The forward's task rows: each row's visible key limit and groups kept whole, once per task
  /// (core::visible_end and core::whole_groups per row and key tile were 1.4% of a bf16 1:2
  /// prefill's samples on the AMX tiles).
  aligned_buffer<std::int64_t> row_lim;
  aligned_buffer<mask::whole_groups> row_whole;
  // Backward only: K rows, dK and dV accumulators of the (batch, kv head), V^T panels, the dO tile
  // and its dP = dO V^T tile, per-row D = rowsum(dO * O) and LSE * log2(e), the kept probabilities
  // and scaled dS of one row, and the key-major P and scaled dS of one (row tile, key tile) block.
  aligned_buffer<float> kr, dk, dv, vt, dout, dps, row_d, row_lse2, comp_p, comp_ds, p_keys, ds_keys;
  // Backward, 1:2 on AVX-512 (pair_dp): V^T of the even keys, then of the odd keys, in blocks of one
  // vector of pairs, and the rows' dP at their kept keys in slot order.
  aligned_buffer<float> vt_pairs, dpk;
  aligned_buffer<float> dbias_acc;  ///< fp32 sum of a shared 16-bit dBias slice
  // The avx3_bf16 forward (bf16_dot.hpp): K panels and the query tile as bf16 column pairs, V rows
  // in bf16 (in pack_value_row's column order).
  aligned_buffer<std::uint32_t> kb, qb;
  aligned_buffer<std::uint16_t> vb;
  aligned_buffer<std::uint32_t> vpair;  ///< avx3_bf16, dense: V rows of key pairs (pack_value_pair)
  // The forward's Q K^T on AMX tiles (amx_tiles.hpp): K panels and the query tile as bf16 column
  // pairs, the sum of |k_c| and the norm bound of each packed key, the largest |k| of the packed
  // keys and the totals of both per-key values (the forward's select_amx bound, near_tie_bound).
  aligned_buffer<std::uint32_t> k_amx, q_amx, p_amx;  ///< p_amx: a dense tile's weights as bf16 pairs
  aligned_buffer<float> k_amx_l1, k_amx_l2;
  aligned_buffer<float> q_amx_c1, q_amx_c0;  ///< each task row's near-tie bound (near_tie_bound)
  std::uint32_t q_amx_by_norms = 0;          ///< the task rows whose bound goes through the norms
  float k_amx_max = 0.0f, k_amx_l1_total = 0.0f, k_amx_l2_total = 0.0f;
};

/// Partial online-softmax states of rows over chunks of their keys (the decode forward's key chunks,
/// the fused forward's split key ranges): per state the max of the unscaled kept scores, their sum
/// of exponentials, the unnormalised accumulator (dp floats, at state * dp) and a NaN flag.
struct partial_states {
  float* acc;
  float* max;
  float* sum;
  unsigned char* nan;
};

/// The partial states of a call's split tasks, and per group of chunks (a decode (batch, kv head),
/// a forward row task) how many of its chunks are done: the task that completes a group's last
/// chunk folds it, whichever thread that is, so a call stays one parallel region and the folds
/// overlap the other groups' chunks.
class chunked_states {
 public:
  /// @p groups groups of @p chunks chunks each; @p states states of @p dp floats (may throw).
  chunked_states(std::int64_t groups, std::int64_t chunks, std::int64_t states, int dp)
      : chunks_(chunks),
        acc_(static_cast<std::size_t>(states) * static_cast<std::size_t>(dp)),
        max_(static_cast<std::size_t>(states)),
        sum_(static_cast<std::size_t>(states)),
        nan_(static_cast<std::size_t>(states)),
        done_(new std::atomic<std::int64_t>[static_cast<std::size_t>(groups)]) {
    for (std::int64_t g = 0; g < groups; ++g) done_[static_cast<std::size_t>(g)].store(0, std::memory_order_relaxed);
  }

  partial_states view() { return {acc_.data(), max_.data(), sum_.data(), nan_.data()}; }

  /// Marks one chunk of @p group done; true for the call that completes the group. acq_rel: that
  /// call sees every state the group's other chunks wrote.
  bool finish(std::int64_t group) {
    return done_[static_cast<std::size_t>(group)].fetch_add(1, std::memory_order_acq_rel) + 1 == chunks_;
  }

 private:
  std::int64_t chunks_;
  std::vector<float> acc_, max_, sum_;
  std::vector<unsigned char> nan_;
  std::unique_ptr<std::atomic<std::int64_t>[]> done_;
};

/// The entry point of a kernel file in the static baseline target Highway always compiles (see
/// targets.hpp): never dispatched to, it only says so.
#define DFSS_SIMD_BASELINE_ENTRY(entry, what)                                       \
  status entry(const attention_params&, simd_target) {                             \
    return {status_code::unsupported, what ": no kernel for the baseline target"}; \
  }

/// The generic N:M selection, called out of line (compiled once, without any target's flags).
[[gnu::noinline]] inline std::uint32_t select_group_generic(const float* s, int n, int m) {
  return nm_select_group<float>(s, m, n, m);
}

}  // namespace dfss::cpu::simd
#endif  // DFSS_CPU_SIMD_KERNEL_COMMON_ONCE_

HWY_BEFORE_NAMESPACE();
namespace dfss::cpu::simd::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

using DF = hn::ScalableTag<float>;
using DI = hn::RebindToSigned<DF>;
using VF = hn::Vec<DF>;
using VI = hn::Vec<DI>;

/// Whether this target is one the kernels are written for. The static baseline Highway always
/// compiles (HWY_SCALAR / HWY_EMU128: 1-lane or emulated vectors) gets an empty stub instead.
#undef DFSS_SIMD_KERNEL_TARGET
#if HWY_TARGET == HWY_SCALAR || HWY_TARGET == HWY_EMU128
#define DFSS_SIMD_KERNEL_TARGET 0
#else
#define DFSS_SIMD_KERNEL_TARGET 1
#endif

/// Whether this instance has the avx3_bf16 loops (bf16_dot.hpp): the AVX3 instance of a build whose
/// compiler has AVX512_BF16. The loops themselves run only when the selector picked avx3_bf16.
#undef DFSS_SIMD_BF16_DOT
#if DFSS_SIMD_KERNEL_TARGET && HWY_TARGET == HWY_AVX3 && defined(DFSS_HAVE_BF16_DOT)
#define DFSS_SIMD_BF16_DOT 1
#else
#define DFSS_SIMD_BF16_DOT 0
#endif

/// Whether this instance has the forward's Q K^T on AMX tiles (amx_tiles.hpp): the AVX3 instance of
/// a build whose compiler has the tile instructions. It runs only where core::cpu_uses_amx().
#undef DFSS_SIMD_AMX
#if DFSS_SIMD_KERNEL_TARGET && HWY_TARGET == HWY_AVX3 && defined(DFSS_HAVE_AMX)
#define DFSS_SIMD_AMX 1
#else
#define DFSS_SIMD_AMX 0
#endif

/// Whether this instance computes the backward's dP of a 1:2 tile only at the kept keys
/// (backward_pass::pair_dp): AVX-512, where a mask register makes the per-row choice of a pair's
/// even or odd V column one blend beside the FMA; on Zen 4 a blend and an FMA issue together (an
/// isolated loop: 2.9 blend + FMA pairs per ns against 3.6 FMAs per ns), so half the FMAs of the
/// dense dP cost at best 62% of its time; measured about 70% (docs/design.md, "The backward").
#undef DFSS_SIMD_PAIR_DP
#if DFSS_SIMD_KERNEL_TARGET && HWY_TARGET == HWY_AVX3
#define DFSS_SIMD_PAIR_DP 1
#else
#define DFSS_SIMD_PAIR_DP 0
#endif

#if DFSS_SIMD_KERNEL_TARGET

/// Query rows per Q K^T micro-kernel call: the accumulators are rows x 2 vectors, plus 2 panel
/// vectors and 1 broadcast. 4 rows (8 + 3 registers) on the 16-register targets (SSE4, AVX2); 8
/// rows (16 + 3) where there are 32 registers (AVX-512, NEON and SVE on AArch64), which halves the
/// panel loads per FMA.
#if HWY_TARGET == HWY_SSE4 || HWY_TARGET == HWY_AVX2
inline constexpr int kMicroRows = 4;
#else
inline constexpr int kMicroRows = 8;
#endif

/// 2^f for |f| <= 0.5: degree-7 Taylor polynomial, truncation error 5e-9 relative, below half an
/// fp32 ulp.
HWY_INLINE VF exp2_fraction(VF f) {
  const DF d;
  VF p = hn::Set(d, 1.5252734e-05f);
  p = hn::MulAdd(p, f, hn::Set(d, 1.5403530e-04f));
  p = hn::MulAdd(p, f, hn::Set(d, 1.3333558e-03f));
  p = hn::MulAdd(p, f, hn::Set(d, 9.6181291e-03f));
  p = hn::MulAdd(p, f, hn::Set(d, 5.5504109e-02f));
  p = hn::MulAdd(p, f, hn::Set(d, 2.4022651e-01f));
  p = hn::MulAdd(p, f, hn::Set(d, 6.9314718e-01f));
  return hn::MulAdd(p, f, hn::Set(d, 1.0f));
}

/// 2^x for x <= 127 (a larger x would wrap the exponent field): the forward's exponents
/// scale (s - max) log2(e) are <= 0 by construction, the backward clamps its own (exp2_clamped).
/// Below -125 the result flushes to 0: the true value is under 2.4e-38 while the row's largest term
/// is 1. 2^round(x) times exp2_fraction(x - round(x)) (round to nearest even): the same bits on
/// every target with FMA (tests/unit/test_simd_exp2.cpp; SSE4 rounds the polynomial's multiplies
/// and adds apart). A NaN x gives an unspecified value: the forward flags NaN rows separately and
/// writes them as NaN, the backward uses exp2_clamped.
HWY_INLINE VF exp2_poly(VF x) {
  const DF d;
  const VF lo = hn::Set(d, -125.0f);
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX3
  // AVX-512: round by vrndscaleps, scale and flush in one vscalefps with a zeroing mask (p 2^n is
  // exact where it is a normal number, which it is for n >= -125): 11 instructions where the
  // integer form below takes 16. Measured (Sapphire Rapids, fp32, causal, L = 2048-8192, 1 and 2
  // threads, alternating calls of two builds in one process, bitwise the same outputs): dense
  // 0.955-0.978x the time at d = 64 and 0.989x at d = 128, 1:2 0.974-0.979x.
  const VF n = hn::Round(x);
  return VF{_mm512_maskz_scalef_ps(hn::Ge(x, lo).raw, exp2_fraction(hn::Sub(x, n)).raw, n.raw)};
#else
  const DI di;
  const auto under = hn::Lt(x, lo);
  x = hn::IfThenElse(under, lo, x);
  // n = round(x) (to nearest even) and its integer bits by the 1.5 * 2^23 trick (exact for
  // |x| < 2^22): cheaper than Round + ConvertTo, whose overflow fix-ups cost 4 more instructions per
  // vector in Highway 1.0.3 (measured 2% of the dense forward on AVX2); x is in [-125, 127] here.
  const VF magic = hn::Set(d, 12582912.0f);
  const VF shifted = hn::Add(x, magic);
  const VF n = hn::Sub(shifted, magic);
  const VF p = exp2_fraction(hn::Sub(x, n));
  const VI e = hn::ShiftLeft<23>(hn::Sub(hn::BitCast(di, shifted), hn::BitCast(di, magic)));
  const VF r = hn::BitCast(d, hn::Add(hn::BitCast(di, p), e));
  return hn::IfThenZeroElse(under, r);
#endif
}

/// exp2_poly for any x: above 127 it saturates at 2^127 (the backward's scale s - LSE exceeds 0
/// only by rounding, unless the caller's LSE is not the forward's); a NaN stays NaN.
HWY_INLINE VF exp2_clamped(VF x) {
  const DF d;
  const VF r = exp2_poly(hn::Min(x, hn::Set(d, 127.0f)));
  return hn::IfThenElse(hn::IsNaN(x), x, r);
}

/// Stores @p n floats of @p src into element @p off of @p base (output type @p t, element stride
/// @p stride): an fp32, bf16 or (x86 with F16C) f16 row of unit stride by vectors, rounded to nearest
/// even, bit for bit float_to_bf16 / float_to_f16 (dfss/numeric.hpp); any other row element by element
/// (core::store_row_from_float), as is a tail shorter than a vector. Element by element, through a
/// call per element that cannot be inlined across the target attribute, a bf16 O row's store was
/// 13% of a bf16 causal prefill's samples on the AMX tiles (one Sapphire Rapids thread, GQA 14:2,
/// d = 64, L = 1024), more than its P V.
HWY_INLINE void store_row_as(void* base, dtype t, std::int64_t off, std::int64_t stride, int n, const float* src) {
  const DF d;
  const int lanes = static_cast<int>(hn::Lanes(d));
  int c = 0;
  if (stride == 1 && t == dtype::f32) {
    float* out = static_cast<float*>(base) + off;
    for (; c + lanes <= n; c += lanes) hn::StoreU(hn::LoadU(d, src + c), d, out + c);
  } else if (stride == 1 && t == dtype::bf16) {
    const hn::RebindToUnsigned<DF> du;
    const hn::Rebind<std::uint16_t, DF> dh;
    std::uint16_t* out = static_cast<std::uint16_t*>(base) + off;
    const auto half_ulp = hn::Set(du, 0x7fffu), one = hn::Set(du, 1u), quiet = hn::Set(du, 0x40u);
    for (; c + lanes <= n; c += lanes) {
      const VF x = hn::LoadU(d, src + c);
      const auto u = hn::BitCast(du, x);
      const auto high = hn::ShiftRight<16>(u);
      const auto rounded = hn::ShiftRight<16>(hn::Add(u, hn::Add(half_ulp, hn::And(high, one))));
      const auto bits = hn::IfThenElse(hn::RebindMask(du, hn::IsNaN(x)), hn::Or(high, quiet), rounded);
      hn::StoreU(hn::TruncateTo(dh, bits), dh, out + c);
    }
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX2
  } else if (stride == 1 && t == dtype::f16) {
    // F16C's vcvtps2ph rounds to nearest even, subnormals and overflow to inf included, as
    // float_to_f16 does; a NaN keeps its payload's top bits there, so NaNs get float_to_f16's quiet
    // NaN instead: a NaN becomes the float quiet NaN of its sign first, which converts to 0x7e00 or
    // 0xfe00. (Highway's SSE4 emulation truncates: that target stays element by element.)
    const hn::Rebind<hwy::float16_t, DF> dh;
    hwy::float16_t* out = static_cast<hwy::float16_t*>(base) + off;
    const VF quiet_nan = hn::BitCast(d, hn::Set(hn::RebindToUnsigned<DF>(), 0x7fc00000u));
    for (; c + lanes <= n; c += lanes) {
      const VF x = hn::LoadU(d, src + c);
      hn::StoreU(hn::DemoteTo(dh, hn::IfThenElse(hn::IsNaN(x), hn::CopySign(quiet_nan, x), x)), dh, out + c);
    }
#endif
  }
  if (c < n) {
    core::store_row_from_float(base, t, off + c * stride, stride, n - c, [src, c](int k) { return src[c + k]; });
  }
}

/// S[R][P] (row stride lds) = Q[R][dp] (row stride ldq) x Kt panel [dp][P], P = 2 vectors, for
/// R = 1, 2, 4 or 8 rows (kMicroRows in the forward and backward; 1 or 2 in a decode step, which
/// would waste 3/4 or 7/8 of the multiplies on zero rows). The accumulators are named variables (not
/// an array) so that the code also compiles for SVE, whose vectors are sizeless. Sums run over c in
/// increasing order, one MulAdd per term, whatever R: a row's scores are bitwise the same at every
/// height.
template <int R>
HWY_INLINE void microkernel(const float* HWY_RESTRICT q, std::int64_t ldq, const float* HWY_RESTRICT kt, int dp,
                            float* HWY_RESTRICT s, std::int64_t lds) {
  static_assert(R == 1 || R == 2 || R == 4 || R == 8, "micro-kernel heights 1, 2, 4 and 8");
  const DF d;
  const std::size_t L = hn::Lanes(d);
  const std::size_t P = 2 * L;
  VF c00 = hn::Zero(d), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00, c30 = c00, c31 = c00;
  VF c40 = c00, c41 = c00, c50 = c00, c51 = c00, c60 = c00, c61 = c00, c70 = c00, c71 = c00;
// One row r of the panel product: its two accumulators cr0, cr1 (r >= R: nothing).
#define DFSS_MICROKERNEL_ROW(r)                  \
  if constexpr (r < R) {                         \
    const VF a = hn::Set(d, q[r * ldq + c]);     \
    c##r##0 = hn::MulAdd(a, b0, c##r##0);        \
    c##r##1 = hn::MulAdd(a, b1, c##r##1);        \
  }
  for (int c = 0; c < dp; ++c) {
    const VF b0 = hn::Load(d, kt + c * P);
    const VF b1 = hn::Load(d, kt + c * P + L);
    DFSS_MICROKERNEL_ROW(0)
    DFSS_MICROKERNEL_ROW(1)
    DFSS_MICROKERNEL_ROW(2)
    DFSS_MICROKERNEL_ROW(3)
    DFSS_MICROKERNEL_ROW(4)
    DFSS_MICROKERNEL_ROW(5)
    DFSS_MICROKERNEL_ROW(6)
    DFSS_MICROKERNEL_ROW(7)
  }
#undef DFSS_MICROKERNEL_ROW
#define DFSS_MICROKERNEL_STORE(r)             \
  if constexpr (r < R) {                      \
    hn::Store(c##r##0, d, s + r * lds);       \
    hn::Store(c##r##1, d, s + r * lds + L);   \
  }
  DFSS_MICROKERNEL_STORE(0)
  DFSS_MICROKERNEL_STORE(1)
  DFSS_MICROKERNEL_STORE(2)
  DFSS_MICROKERNEL_STORE(3)
  DFSS_MICROKERNEL_STORE(4)
  DFSS_MICROKERNEL_STORE(5)
  DFSS_MICROKERNEL_STORE(6)
  DFSS_MICROKERNEL_STORE(7)
#undef DFSS_MICROKERNEL_STORE
}

/// acc[0, NV vectors) += sum over t < n of weight(t) * row(t)[0, NV vectors), the accumulator held
/// in NV <= 8 registers (read and written once per call). Two terms per iteration when @p n is
/// even (the forward's kept counts always are), in increasing t either way.
template <int NV, typename Weight, typename Row>
HWY_INLINE void add_rows(float* HWY_RESTRICT acc, int n, const Weight& weight, const Row& row) {
  const DF d;
  const std::size_t L = hn::Lanes(d);
  VF a0 = hn::Load(d, acc), a1 = hn::Zero(d), a2 = a1, a3 = a1, a4 = a1, a5 = a1, a6 = a1, a7 = a1;
  if constexpr (NV > 1) a1 = hn::Load(d, acc + L);
  if constexpr (NV > 2) a2 = hn::Load(d, acc + 2 * L);
  if constexpr (NV > 3) a3 = hn::Load(d, acc + 3 * L);
  if constexpr (NV > 4) a4 = hn::Load(d, acc + 4 * L);
  if constexpr (NV > 5) a5 = hn::Load(d, acc + 5 * L);
  if constexpr (NV > 6) a6 = hn::Load(d, acc + 6 * L);
  if constexpr (NV > 7) a7 = hn::Load(d, acc + 7 * L);
#define DFSS_ADD_ROW_TERM(W, X)                                     \
  a0 = hn::MulAdd(W, hn::Load(d, X), a0);                           \
  if constexpr (NV > 1) a1 = hn::MulAdd(W, hn::Load(d, X + L), a1); \
  if constexpr (NV > 2) a2 = hn::MulAdd(W, hn::Load(d, X + 2 * L), a2); \
  if constexpr (NV > 3) a3 = hn::MulAdd(W, hn::Load(d, X + 3 * L), a3); \
  if constexpr (NV > 4) a4 = hn::MulAdd(W, hn::Load(d, X + 4 * L), a4); \
  if constexpr (NV > 5) a5 = hn::MulAdd(W, hn::Load(d, X + 5 * L), a5); \
  if constexpr (NV > 6) a6 = hn::MulAdd(W, hn::Load(d, X + 6 * L), a6); \
  if constexpr (NV > 7) a7 = hn::MulAdd(W, hn::Load(d, X + 7 * L), a7);
  int t = 0;
  if (n % 2 == 0) {
    for (; t < n; t += 2) {
      const float* x = row(t);
      const float* u = row(t + 1);
      const VF wx = hn::Set(d, weight(t));
      const VF wu = hn::Set(d, weight(t + 1));
      DFSS_ADD_ROW_TERM(wx, x)
      DFSS_ADD_ROW_TERM(wu, u)
    }
  } else {
    for (; t < n; ++t) {
      const float* x = row(t);
      const VF wx = hn::Set(d, weight(t));
      DFSS_ADD_ROW_TERM(wx, x)
    }
  }
#undef DFSS_ADD_ROW_TERM
  hn::Store(a0, d, acc);
  if constexpr (NV > 1) hn::Store(a1, d, acc + L);
  if constexpr (NV > 2) hn::Store(a2, d, acc + 2 * L);
  if constexpr (NV > 3) hn::Store(a3, d, acc + 3 * L);
  if constexpr (NV > 4) hn::Store(a4, d, acc + 4 * L);
  if constexpr (NV > 5) hn::Store(a5, d, acc + 5 * L);
  if constexpr (NV > 6) hn::Store(a6, d, acc + 6 * L);
  if constexpr (NV > 7) hn::Store(a7, d, acc + 7 * L);
}

/// Calls f(std::integral_constant<int, NV>()) with NV = min(8, @p nv) (nv >= 1): the width, in
/// vectors, of a block of columns whose accumulators stay in registers (8 vectors: a whole d = 64 row
/// on AVX2, d = 128 on AVX-512), as a compile-time constant for the unrolled row combinations.
template <typename F>
HWY_INLINE void with_column_vectors(int nv, const F& f) {
  switch (std::min(8, nv)) {
    case 1: f(std::integral_constant<int, 1>()); break;
    case 2: f(std::integral_constant<int, 2>()); break;
    case 3: f(std::integral_constant<int, 3>()); break;
    case 4: f(std::integral_constant<int, 4>()); break;
    case 5: f(std::integral_constant<int, 5>()); break;
    case 6: f(std::integral_constant<int, 6>()); break;
    case 7: f(std::integral_constant<int, 7>()); break;
    default: f(std::integral_constant<int, 8>()); break;
  }
}

/// acc[0, dp) += sum over t < n of weight(t) * row(t)[0, dp), 8 vectors of columns at a time (a
/// whole d = 64 row on AVX2, d = 128 on AVX-512): the P V product of the forward (over a row's kept
/// keys) and the dQ, dK, dV products of the backward. row(t) must be dp-aligned rows.
template <typename Weight, typename Row>
HWY_INLINE void add_row_combination(float* acc, int dp, int n, const Weight& weight, const Row& row) {
  const DF d;
  const int L = static_cast<int>(hn::Lanes(d));
  for (int c0 = 0; c0 < dp; c0 += 8 * L) {
    const auto shifted = [&](int t) { return row(t) + c0; };
    with_column_vectors((dp - c0) / L, [&](auto nv) { add_rows<decltype(nv)::value>(acc + c0, n, weight, shifted); });
  }
}

#if !HWY_HAVE_SCALABLE
/// Transposes the N x N block held by @p v (vector i = row i) in registers: afterwards vector j holds
/// column j. log2(N) rounds of ConcatEven / ConcatOdd over pairs of vectors: each round rotates the
/// (vector, lane) bits of every element's position by one, so log2(N) rounds swap the two halves.
template <int N>
HWY_INLINE void transpose_square(VF* HWY_RESTRICT v) {
  const DF d;
  for (int round = 1; round < N; round *= 2) {
    VF t[N];
#pragma GCC unroll 16
    for (int i = 0; i < N / 2; ++i) {
      t[i] = hn::ConcatEven(d, v[2 * i + 1], v[2 * i]);
      t[i + N / 2] = hn::ConcatOdd(d, v[2 * i + 1], v[2 * i]);
    }
#pragma GCC unroll 16
    for (int i = 0; i < N; ++i) v[i] = t[i];
  }
}

/// Column vectors per output of add_rows_pair's register block: two outputs of this many
/// accumulators plus two broadcasts fit 16 registers at 4 (SSE4, AVX2) and 32 at 8.
#if HWY_TARGET == HWY_SSE4 || HWY_TARGET == HWY_AVX2
inline constexpr int kPairRowVectors = 4;
#else
inline constexpr int kPairRowVectors = 8;
#endif

/// add_rows for two outputs over the same terms: a[0, NV) += sum wa(t) ra(t), b[0, NV) += sum wb(t)
/// rb(t), in increasing t, one MulAdd per term: each output bitwise as add_rows gives it. Twice the
/// independent accumulator chains of add_rows (an FMA's latency is 4 cycles on Zen 4 and 5, so 4
/// chains leave half of Zen 5's two FMA pipes idle) and one index computation for both.
template <int NV, typename WA, typename RA, typename WB, typename RB>
HWY_INLINE void add_rows_pair(float* HWY_RESTRICT a_out, float* HWY_RESTRICT b_out, int n, const WA& wa, const RA& ra,
                              const WB& wb, const RB& rb) {
  const DF d;
  const std::size_t L = hn::Lanes(d);
  VF a[NV], b[NV];
#pragma GCC unroll 8
  for (int c = 0; c < NV; ++c) {
    a[c] = hn::Load(d, a_out + c * L);
    b[c] = hn::Load(d, b_out + c * L);
  }
  for (int t = 0; t < n; ++t) {
    const float* x = ra(t);
    const float* y = rb(t);
    const VF vx = hn::Set(d, wa(t));
    const VF vy = hn::Set(d, wb(t));
#pragma GCC unroll 8
    for (int c = 0; c < NV; ++c) {
      a[c] = hn::MulAdd(vx, hn::Load(d, x + c * L), a[c]);
      b[c] = hn::MulAdd(vy, hn::Load(d, y + c * L), b[c]);
    }
  }
#pragma GCC unroll 8
  for (int c = 0; c < NV; ++c) {
    hn::Store(a[c], d, a_out + c * L);
    hn::Store(b[c], d, b_out + c * L);
  }
}

/// add_row_combination for two outputs over the same n terms (the backward's dV and dK of a key
/// over the rows that kept it), kPairRowVectors columns at a time.
template <typename WA, typename RA, typename WB, typename RB>
HWY_INLINE void add_row_combination_pair(float* a_out, float* b_out, int dp, int n, const WA& wa, const RA& ra,
                                         const WB& wb, const RB& rb) {
  const DF d;
  const int L = static_cast<int>(hn::Lanes(d));
  for (int c0 = 0; c0 < dp; c0 += kPairRowVectors * L) {
    const auto ra_c = [&](int t) { return ra(t) + c0; };
    const auto rb_c = [&](int t) { return rb(t) + c0; };
    with_column_vectors(std::min(kPairRowVectors, (dp - c0) / L), [&](auto nv) {
      add_rows_pair<decltype(nv)::value>(a_out + c0, b_out + c0, n, wa, ra_c, wb, rb_c);
    });
  }
}
#endif  // !HWY_HAVE_SCALABLE

/// Whether the forward's 1:2 tiles may run add_tile_block (Paired). Its selects compete with the FMAs
/// for the same ports on AVX2, and on the AVX-512 CPUs other than AMD's Zen 5 and later (Zen 4,
/// Intel: core::cpu_pair_blocks_pay, checked at run time), where the row-at-a-time combination
/// measured faster (docs/design.md); scalable vectors (SVE) have no blocked products.
#if HWY_HAVE_SCALABLE || HWY_TARGET == HWY_SSE4 || HWY_TARGET == HWY_AVX2
inline constexpr bool kPairBlocks = false;
#else
inline constexpr bool kPairBlocks = true;
#endif

#if !HWY_HAVE_SCALABLE
/// Query rows per block of the forward's blocked P V products (add_tile_rows): each V vector loaded
/// serves this many rows. The accumulators are rows x kValueVectors, plus 1 V vector and a
/// broadcast per row: 3 rows (12 + 4 registers) on the 16-register targets, 4 rows (16 + 5; 16 + 6
/// for 1:2) on the 32-register ones. Against the row-at-a-time combination (1 broadcast and 8 loads
/// per 8 FMAs) this is 7 loads per 12 FMAs on AVX2 and 8 per 16 on AVX-512 (docs/design.md,
/// "The forward"). 2 rows on AVX2 measured 3% slower than 3.
#if HWY_TARGET == HWY_SSE4 || HWY_TARGET == HWY_AVX2
inline constexpr int kValueRows = 3;
#else
inline constexpr int kValueRows = 4;
#endif
/// Column vectors per accumulator block of add_tile_rows (see kValueRows).
inline constexpr int kValueVectors = 4;

/// Makes the compiler keep @p v in a register rather than fold the load that made it into each
/// instruction that uses it (x86 allows one memory operand per arithmetic instruction).
HWY_INLINE void keep_in_register(VF& v) {
#if HWY_ARCH_X86
  asm("" : "+v"(v.raw));
#else
  (void)v;
#endif
}

/// The P V product of a key tile for R rows, NV column vectors, with each V vector loaded once for
/// all rows. Dense (Paired = false): acc[r] += sum over t < n of w[r][t] * v0[t dp]. 1:2 (Paired):
/// pair t's even key is row v0[2 t dp], its odd key row v1[t dp] holds that V row negated, and
/// w[r][t] is the row's weight of the key it kept, negated when that key is odd; so
/// w * (w < 0 ? v1 : v0) is exactly p * V of the kept key. Increasing t, one MulAdd per term: each
/// row's sums come out bitwise as from add_rows over its kept keys. Row r's weights are
/// w[r][t * ws] (ws = 1, or a row stride for weights stored transposed).
template <int R, int NV, bool Paired>
HWY_INLINE void add_tile_block(float* const* acc, const float* const* w, std::ptrdiff_t ws, const float* HWY_RESTRICT v0,
                               const float* HWY_RESTRICT v1, int dp, int n) {
  const DF d;
  const std::size_t L = hn::Lanes(d);
  VF a[R][NV];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 8
    for (int c = 0; c < NV; ++c) a[r][c] = hn::Load(d, acc[r] + c * L);
  }
  for (int t = 0; t < n; ++t) {
    const float* x0 = v0 + static_cast<std::ptrdiff_t>(Paired ? 2 * t : t) * dp;
    const float* x1 = v1 + static_cast<std::ptrdiff_t>(t) * dp;
    VF wr[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) wr[r] = hn::Set(d, w[r][t * ws]);
#pragma GCC unroll 8
    for (int c = 0; c < NV; ++c) {
      VF e = hn::Load(d, x0 + c * L);
      // One load per V vector: GCC would otherwise fold the load into every row's FMA (a memory
      // operand), R loads where the blocking means one.
      keep_in_register(e);
      if constexpr (Paired) {
        VF o = hn::Load(d, x1 + c * L);
        keep_in_register(o);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) a[r][c] = hn::MulAdd(wr[r], hn::IfNegativeThenElse(wr[r], o, e), a[r][c]);
      } else {
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) a[r][c] = hn::MulAdd(wr[r], e, a[r][c]);
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 8
    for (int c = 0; c < NV; ++c) hn::Store(a[r][c], d, acc[r] + c * L);
  }
}

/// add_tile_block over whole rows of dp columns, kValueVectors at a time.
template <int R, bool Paired>
HWY_INLINE void add_tile_rows(float* const* acc, const float* const* w, std::ptrdiff_t ws, const float* v0,
                              const float* v1, int dp, int n) {
  const DF d;
  const int L = static_cast<int>(hn::Lanes(d));
  for (int c0 = 0; c0 < dp; c0 += kValueVectors * L) {
    float* shifted[R];
    for (int r = 0; r < R; ++r) shifted[r] = acc[r] + c0;
    const float* x1 = Paired ? v1 + c0 : v1;
    switch (std::min(kValueVectors, (dp - c0) / L)) {
      case 1: add_tile_block<R, 1, Paired>(shifted, w, ws, v0 + c0, x1, dp, n); break;
      case 2: add_tile_block<R, 2, Paired>(shifted, w, ws, v0 + c0, x1, dp, n); break;
      case 3: add_tile_block<R, 3, Paired>(shifted, w, ws, v0 + c0, x1, dp, n); break;
      default: add_tile_block<R, kValueVectors, Paired>(shifted, w, ws, v0 + c0, x1, dp, n); break;
    }
  }
}
#endif  // !HWY_HAVE_SCALABLE

/// A total-order key of a score for the N:M ranking (dfss/format/nm_select.hpp): signed integers
/// that compare as the ranking does. +0 and -0 map to the same key (x + 0 turns -0 into +0), every
/// NaN to INT32_MAX (NaN ranks above every number; two NaNs tie), numbers by signed value.
HWY_INLINE VI rank_key(VF x) {
  const DF d;
  const DI di;
  const VI bits = hn::BitCast(di, hn::Add(x, hn::Zero(d)));
  const VI key = hn::Xor(bits, hn::And(hn::ShiftRight<31>(bits), hn::Set(di, 0x7fffffff)));
  return hn::IfThenElse(hn::RebindMask(di, hn::IsNaN(x)), hn::Set(di, std::numeric_limits<std::int32_t>::max()), key);
}

/// f16 -> f32 for every f16 value. Where the CPU converts natively (F16C on AVX2 and AVX3, NEON,
/// SVE) Highway's PromoteTo does; on SSE4 Highway 1.0.3 emulates it without inf and NaN (they come
/// out as finite numbers near 2^16), so there the bits are widened here: the exponent and mantissa
/// shifted into place and scaled by 2^(127 - 15) (exact for normal and subnormal halves), with
/// exponent 31 (inf, NaN) mapped to 255.
template <class DH>
HWY_INLINE VF promote_f16(DH dh, const hwy::float16_t* HWY_RESTRICT src) {
  const DF d;
#if HWY_TARGET == HWY_SSE4
  const hn::RebindToUnsigned<DF> du;
  const hn::Rebind<std::uint16_t, DF> du16;
  (void)dh;
  const auto h = hn::PromoteTo(du, hn::LoadU(du16, reinterpret_cast<const std::uint16_t*>(src)));
  const auto em = hn::And(h, hn::Set(du, 0x7fffu));
  const auto sign = hn::ShiftLeft<16>(hn::And(h, hn::Set(du, 0x8000u)));
  const auto shifted = hn::ShiftLeft<13>(em);
  const VF finite = hn::Mul(hn::BitCast(d, shifted), hn::Set(d, 0x1p112f));
  const VF special = hn::BitCast(d, hn::Or(shifted, hn::Set(du, 0x7f800000u)));
  const auto is_special = hn::RebindMask(d, hn::Gt(hn::BitCast(DI(), em), hn::Set(DI(), 0x7bff)));
  return hn::Or(hn::IfThenElse(is_special, special, finite), hn::BitCast(d, sign));
#else
  return hn::PromoteTo(d, hn::LoadU(dh, src));
#endif
}

/// Whether the @p n contiguous bias elements of type U (the unsigned integer of their width) at
/// @p src are all +0, -0 or -inf (bits @p neg_inf), by whole vectors; @p j (from 0) is left at the
/// first element not checked.
template <typename U>
HWY_INLINE bool mask_bits(const U* HWY_RESTRICT src, std::int64_t& j, std::int64_t n, U neg_inf) {
  const hn::Repartition<U, DF> du;
  const auto lanes = static_cast<std::int64_t>(hn::Lanes(du));
  const auto sign = hn::Set(du, static_cast<U>(U{1} << (sizeof(U) * 8 - 1)));
  const auto inf = hn::Set(du, neg_inf);
  auto ok = hn::Eq(hn::Zero(du), hn::Zero(du));
  for (; j + lanes <= n; j += lanes) {
    const auto x = hn::LoadU(du, src + j);
    ok = hn::And(ok, hn::Or(hn::Eq(hn::AndNot(sign, x), hn::Zero(du)), hn::Eq(x, inf)));
  }
  return hn::AllTrue(du, ok);
}

/// Whether the @p n bias values of @p p from element @p at, @p stride apart, are all 0 or -inf: a
/// mask given as a bias (left padding, a boolean attn_mask), which masks keys exactly and moves no
/// other score. Contiguous f32, bf16 and f16 values by vectors of their bits (value by value, the
/// type switch of load_as_double made the check a tenth of a masked GQA decode step).
inline bool bias_run_only_masks(const attention_params& p, std::int64_t at, std::int64_t n, std::int64_t stride) {
  std::int64_t j = 0;
  if (stride == 1) {
    if (p.bias_type == dtype::f32) {
      if (!mask_bits<std::uint32_t>(static_cast<const std::uint32_t*>(p.bias) + at, j, n, 0xff800000u)) return false;
    } else if (p.bias_type == dtype::bf16) {
      if (!mask_bits<std::uint16_t>(static_cast<const std::uint16_t*>(p.bias) + at, j, n, 0xff80u)) return false;
    } else if (p.bias_type == dtype::f16) {
      if (!mask_bits<std::uint16_t>(static_cast<const std::uint16_t*>(p.bias) + at, j, n, 0xfc00u)) return false;
    }
  }
  for (; j < n; ++j) {
    const double x = core::load_as_double(p.bias, p.bias_type, at + j * stride);
    if (x != 0.0 && x != -std::numeric_limits<double>::infinity()) return false;
  }
  return true;
}

/// Whether the whole bias of @p p (each element once: broadcast dimensions, stride 0, read at index
/// 0) is 0 and -inf only (bias_run_only_masks). False without a bias.
inline bool bias_only_masks(const attention_params& p) {
  if (p.bias == nullptr) return false;
  const std::int64_t* st = p.bias_stride;
  const std::int64_t nb = st[0] == 0 ? 1 : p.batch, nh = st[1] == 0 ? 1 : p.heads, nq = st[2] == 0 ? 1 : p.seqlen_q;
  const std::int64_t nk = st[3] == 0 ? 1 : p.seqlen_k;
  for (std::int64_t b = 0; b < nb; ++b) {
    for (std::int64_t h = 0; h < nh; ++h) {
      for (std::int64_t i = 0; i < nq; ++i) {
        if (!bias_run_only_masks(p, b * st[0] + h * st[1] + i * st[2], nk, st[3])) return false;
      }
    }
  }
  return true;
}

/// Shared state and code of the forward and backward of one call, for input element type T.
template <typename T>
struct kernel {
  /// @p min_tile: the minimum key tile width (kMinKeyTile, kMinKeyTileBf16Dot or kMinKeyTileAmx).
  explicit kernel(const attention_params& p, int min_tile = kMinKeyTile)
      : p_(p),
        d_(static_cast<int>(p.head_dim)),
        lanes_(static_cast<int>(hn::Lanes(DF()))),
        panel_(2 * lanes_),
        dp_(padded_dim(p.head_dim)),
        w_(key_tile_width(p.pattern_m, panel_, min_tile)),
        lk_pad_((p.seqlen_k + w_ - 1) / w_ * w_),
        zero_row_(static_cast<std::int32_t>(lk_pad_)),
        scale_(static_cast<float>(p.scale)),
        e1_(std::isfinite(scale_ * kLog2e) ? scale_ * kLog2e : scale_),
        e2_(std::isfinite(scale_ * kLog2e) ? 1.0f : kLog2e),
        group_(p.heads / p.heads_kv) {}

  /// The head dim padded to whole vectors (dp_).
  static int padded_dim(std::int64_t head_dim) {
    const auto lanes = static_cast<std::int64_t>(hn::Lanes(DF()));
    return static_cast<int>((head_dim + lanes - 1) / lanes * lanes);
  }

  /// Whether the packed V fits int32 element offsets (the compacted key indices become offsets).
  static bool fits_int32(const attention_params& p, int min_tile = kMinKeyTile) {
    const int lanes = static_cast<int>(hn::Lanes(DF()));
    const std::int64_t dp = padded_dim(p.head_dim);
    const std::int64_t w = key_tile_width(p.pattern_m, 2 * lanes, min_tile);
    return (p.seqlen_k + 2 * w + 1) * dp <= std::numeric_limits<std::int32_t>::max();
  }

  /// Sizes the scratch for this call (may throw std::bad_alloc).
  void reserve(workspace& ws, bool backward) const {
    ws.packed_b = ws.packed_hk = ws.packed_k0 = -1;  // a new call: the packed head may be stale
    ws.packed_for = nullptr;
    const auto rows_pad = static_cast<std::size_t>((lk_pad_ + 1) * dp_);
    const auto panels = static_cast<std::size_t>((lk_pad_ / panel_) * dp_ * panel_);
    const auto tile_rows = static_cast<std::size_t>(kRowsPerTask * dp_);
    const auto compact = static_cast<std::size_t>(comp_stride());
    ws.kt.resize(panels);
    ws.vp.resize(rows_pad);
    ws.pack.resize(static_cast<std::size_t>(panel_ * dp_));
    ws.q.resize(std::max(tile_rows, static_cast<std::size_t>(dp_)));
    ws.s.resize(static_cast<std::size_t>(kRowsPerTask * w_));
    ws.acc.resize(tile_rows);
    // The forward keeps every row's compacted tile until the tile's P V (kRowsPerTask slots of
    // comp_stride()); so does the backward, between select_row and backward_row.
    ws.comp_val.resize(kRowsPerTask * compact);
    ws.comp_idx.resize(kRowsPerTask * compact);
    ws.row_max.resize(kRowsPerTask);
    ws.row_sum.resize(kRowsPerTask);
    ws.row_lim.resize(kRowsPerTask);
    ws.row_whole.resize(kRowsPerTask);
    ws.row_nan.resize(kRowsPerTask);
    if (backward) {
      ws.vt.resize(panels);
      ws.dps.resize(static_cast<std::size_t>(kRowsPerTask * w_));
      ws.kr.resize(rows_pad);
      ws.dk.resize(rows_pad);
      ws.dv.resize(rows_pad);
      ws.dout.resize(tile_rows);
      // A slot per row: dense rows that keep the whole tile leave their products to the tile's end.
      ws.comp_p.resize(kRowsPerTask * compact);
      ws.comp_ds.resize(kRowsPerTask * compact);
      const auto block = static_cast<std::size_t>(w_ * kRowsPerTask);
      ws.p_keys.resize(block);
      ws.ds_keys.resize(block);
      ws.row_d.resize(kRowsPerTask);
      ws.row_lse2.resize(kRowsPerTask);
      if (DFSS_SIMD_PAIR_DP && p_.pattern_n == 1 && p_.pattern_m == 2) {
        ws.vt_pairs.resize(static_cast<std::size_t>(lk_pad_) * static_cast<std::size_t>(dp_));
        ws.dpk.resize(static_cast<std::size_t>(kRowsPerTask * (w_ / 2)));
      }
    }
  }

  /// Slots of one row's compacted tile (kept scores, key indices): the tile, plus room for a
  /// whole vector written past the last kept slot.
  int comp_stride() const { return w_ + 2 * lanes_; }

  /// The granule of compact's width: whole pairs of vectors (its 1:2 and 2:4 loop) and whole groups.
  /// W is a multiple of it.
  int compact_step() const { return key_tile_width(p_.pattern_m, panel_, 1); }

  /// compact's width for a row whose keys from @p lim on are masked, in the tile at @p j0 (lim > j0):
  /// the visible keys rounded up to compact_step(), at most W. On the causal diagonal a row sees
  /// half the tile on average, and the keys past its last visible one would otherwise be kept as
  /// zero weights: exponentials, and a P V row by row (the masked tile's form) over the zero row.
  int visible_width(std::int64_t lim, std::int64_t j0) const {
    if (lim - j0 >= w_) return w_;
    const int step = compact_step();
    return static_cast<int>((lim - j0 + step - 1) / step * step);
  }

  /// Keys visible to query row qi: j < key_limit (key padding, causal and the sequence end).
  std::int64_t key_limit(std::int64_t b, std::int64_t qi) const { return core::visible_end(p_, b, qi); }

  /// Writes output row (batch b, query row i, head h) = acc / sum and its LSE from the row's final
  /// online-softmax state (max @p mx of the unscaled kept scores, @p sum, unnormalised @p acc: dp
  /// floats, overwritten with the normalised row).
  void store_row(std::int64_t b, std::int64_t i, std::int64_t h, float* acc, float mx, float sum, bool is_nan) const {
    const float nan = std::numeric_limits<float>::quiet_NaN();
    const float neg_inf = -std::numeric_limits<float>::infinity();
    const bool empty = mx == neg_inf;
    const float inv = empty ? 0.0f : 1.0f / sum;
    // The row is normalised in place, then stored (store_row_as: fp32, bf16 and f16 rows of unit
    // stride by vectors). Element by element the fp32 stores were 5-7% of a causal fp32 forward's
    // samples (one Zen 3 thread, L = 2048, d = 64).
    const DF d;
    const VF vinv = hn::Set(d, inv);
    for (int c = 0; c < dp_; c += lanes_) {
      hn::StoreU(is_nan ? hn::Set(d, nan) : hn::Mul(hn::LoadU(d, acc + c), vinv), d, acc + c);
    }
    store_row_as(p_.o, p_.output_type, core::offset4(p_.o_stride, b, i, h, 0), p_.o_stride[3], d_, acc);
    if (p_.lse != nullptr) {
      // scale * max overflows to +-inf exactly where the reference's LSE, rounded to fp32, does.
      const float lse = is_nan ? nan : (empty ? neg_inf : scale_ * mx + std::log2(sum) * kLn2);
      core::store_from_double(p_.lse, p_.lse_type, b * p_.lse_stride[0] + h * p_.lse_stride[1] + i * p_.lse_stride[2],
                              static_cast<double>(lse));
    }
  }

  /// Folds @p count partial states of one row (its keys split into chunks), at @p first,
  /// first + stride, ... of @p parts, in that order, into @p acc (dp floats), @p mx, @p sum and
  /// @p is_nan, with the online softmax rescale the kernels apply between key tiles: the exact LSE
  /// merge of docs/semantics.md held as (max, sum), so a chunk whose scale * max overflows fp32
  /// still merges to a finite O. A fixed order for a shape: bitwise the same for any thread count.
  void fold_states(const partial_states& parts, std::size_t first, std::size_t stride, std::int64_t count, float* acc,
                   float& mx, float& sum, bool& is_nan) const {
    const float neg_inf = -std::numeric_limits<float>::infinity();
    mx = neg_inf;
    sum = 0.0f;
    is_nan = false;
    std::fill(acc, acc + dp_, 0.0f);
    for (std::int64_t c = 0; c < count; ++c) {
      const std::size_t at = first + static_cast<std::size_t>(c) * stride;
      const float* pa = parts.acc + at * static_cast<std::size_t>(dp_);
      const float pm = parts.max[at], ps = parts.sum[at];
      is_nan = is_nan || parts.nan[at] != 0;
      if (pm == neg_inf) continue;  // nothing kept in this chunk
      if (mx == neg_inf) {
        mx = pm;
        sum = ps;
        std::copy(pa, pa + dp_, acc);
      } else if (pm > mx) {
        const float corr = std::exp2(((mx - pm) * e1_) * e2_);
        for (int k = 0; k < dp_; ++k) acc[k] = acc[k] * corr + pa[k];
        sum = sum * corr + ps;
        mx = pm;
      } else {
        const float corr = std::exp2(((pm - mx) * e1_) * e2_);
        for (int k = 0; k < dp_; ++k) acc[k] += pa[k] * corr;
        sum += ps * corr;
      }
    }
  }

  /// Whether every value of a packed row is finite and at most 2^50 in magnitude: then no product
  /// or sum of d <= 512 such values overflows, so scores are finite and NaN-free.
  bool row_is_tame(const float* row) const {
    const DF d;
    const VF lim = hn::Set(d, 0x1p50f);
    auto ok = hn::Le(hn::Abs(hn::Load(d, row)), lim);
    for (int c = lanes_; c < dp_; c += lanes_) ok = hn::And(ok, hn::Le(hn::Abs(hn::Load(d, row + c)), lim));
    return hn::AllTrue(d, ok);
  }

  /// One vector of contiguous T values at @p src as fp32: f16 by promote_f16, bf16 by Highway's
  /// PromoteTo (a shift).
  static HWY_INLINE VF load_value(const T* src) {
    const DF d;
    if constexpr (std::is_same_v<T, float>) {
      return hn::LoadU(d, src);
    } else if constexpr (std::is_same_v<T, half>) {
      return promote_f16(hn::Rebind<hwy::float16_t, DF>(), reinterpret_cast<const hwy::float16_t*>(src));
    } else {
      const hn::Rebind<hwy::bfloat16_t, DF> dh;
      return hn::PromoteTo(d, hn::LoadU(dh, reinterpret_cast<const hwy::bfloat16_t*>(src)));
    }
  }

  /// Prefetches the bytes of row (b, j, h) of a [B, L, H, d] input with element strides @p st.
  void prefetch_row(const void* base, const std::int64_t* st, std::int64_t b, std::int64_t j, std::int64_t h) const {
    if (st[3] != 1) return;  // a strided row: left to the hardware
    prefetch_lines(static_cast<const T*>(base) + core::offset4(st, b, j, h, 0));
  }

  /// Prefetches every cache line that the d_ contiguous values at @p row touch.
  HWY_INLINE void prefetch_lines(const T* row) const {
    const auto at = reinterpret_cast<std::uintptr_t>(row);
    const std::uintptr_t first = at / kCacheLine * kCacheLine, end = at + sizeof(T) * static_cast<std::uintptr_t>(d_);
    for (std::uintptr_t x = first; x < end; x += kCacheLine) prefetch_line(reinterpret_cast<const char*>(x));
  }

  /// GCC 12 emits nothing for __builtin_prefetch (and so for hwy::Prefetch) inside functions compiled
  /// under Highway's per-target `#pragma GCC target`, so on x86-64 the instruction is written out.
  static HWY_INLINE void prefetch_line(const char* p) {
#if HWY_ARCH_X86
    asm volatile("prefetcht0 %0" : : "m"(*p));
#else
    __builtin_prefetch(p);
#endif
  }

  /// prefetch_line into L2 (and the last level), not L1: for reads a few hundred KiB ahead.
  static HWY_INLINE void prefetch_line_l2(const char* p) {
#if HWY_ARCH_X86
    asm volatile("prefetcht1 %0" : : "m"(*p));
#else
    __builtin_prefetch(p, 0, 2);
#endif
  }

  /// Row (b, j, h, :) of a [B, L, H, d] tensor as dp floats (zero padded; all zero when !valid).
  void load_row(const void* base, const std::int64_t* st, std::int64_t b, std::int64_t j, std::int64_t h, bool valid,
                float* out) const {
    if (!valid) {
      std::memset(out, 0, sizeof(float) * static_cast<std::size_t>(dp_));
      return;
    }
    const DF d;
    const std::int64_t off = core::offset4(st, b, j, h, 0);
    int c = 0;
    if (st[3] == 1) {
      const T* src = static_cast<const T*>(base) + off;
      for (; c + lanes_ <= d_; c += lanes_) hn::Store(load_value(src + c), d, out + c);
    }
    for (; c < d_; ++c) out[c] = to_float(static_cast<const T*>(base)[off + c * st[3]]);
    for (; c < dp_; ++c) out[c] = 0.0f;
  }

  /// Whether the thread's scratch already holds keys [k0, ...) of (batch b, kv head hk) of this call.
  bool is_packed(const workspace& ws, std::int64_t b, std::int64_t hk, std::int64_t k0) const {
    return ws.packed_for == &p_ && ws.packed_b == b && ws.packed_hk == hk && ws.packed_k0 == k0;
  }

  void mark_packed(workspace& ws, std::int64_t b, std::int64_t hk, std::int64_t k0, bool risky) const {
    ws.kv_risky = risky;
    ws.packed_b = b;
    ws.packed_hk = hk;
    ws.packed_k0 = k0;
    ws.packed_for = &p_;
  }

  /// Packs K (panels) and V (rows) of (batch b, kv head hk) into the thread's scratch, once per
  /// call and head (a worker's consecutive tasks mostly share the head): keys [k0, k1) (multiples of
  /// the key tile; by default all), at their places in the whole head's layout, and the zero row.
  /// The panel of K (P keys, column c of the P rows at @p panel + c P) from @p rows (P rows of dp
  /// floats). By N x N blocks transposed in registers (transpose_square): one element at a time, the
  /// strided loads were a quarter of the packing's samples (perf, one thread, bf16 causal prefill at
  /// L = 256, where packing was a fifth of the call).
  void transpose_panel(const float* HWY_RESTRICT rows, float* HWY_RESTRICT panel) const {
#if !HWY_HAVE_SCALABLE
    constexpr int N = static_cast<int>(HWY_LANES(float));
    const DF d;
    for (int t0 = 0; t0 < panel_; t0 += N) {
      for (int c0 = 0; c0 < dp_; c0 += N) {
        VF v[N];
#pragma GCC unroll 16
        for (int i = 0; i < N; ++i) v[i] = hn::Load(d, rows + (t0 + i) * dp_ + c0);
        transpose_square<N>(v);
#pragma GCC unroll 16
        for (int j = 0; j < N; ++j) hn::Store(v[j], d, panel + (c0 + j) * panel_ + t0);
      }
    }
#else
    for (int c = 0; c < dp_; ++c) {
      for (int t = 0; t < panel_; ++t) panel[c * panel_ + t] = rows[t * dp_ + c];
    }
#endif
  }

  void pack_head(workspace& ws, std::int64_t b, std::int64_t hk, std::int64_t k0 = 0, std::int64_t k1 = -1) const {
    if (is_packed(ws, b, hk, k0)) return;
    if (k1 < 0) k1 = lk_pad_;
    float* kt = ws.kt.ptr;
    float* vp = ws.vp.ptr;
    const std::int64_t lk = p_.seqlen_k;
    // K: a panel's P rows are converted into contiguous scratch first, then transposed with
    // contiguous stores (storing each row's values P floats apart touched a cache line per value).
    float* rows = ws.pack.ptr;
    bool risky = false;
    for (std::int64_t blk = k0 / panel_; blk < k1 / panel_; ++blk) {
      float* panel = kt + blk * dp_ * panel_;
      for (int t = 0; t < panel_; ++t) {
        const std::int64_t j = blk * panel_ + t;
        if (j + kPackPrefetchRows < lk) prefetch_row(p_.k, p_.k_stride, b, j + kPackPrefetchRows, hk);
        load_row(p_.k, p_.k_stride, b, j, hk, j < lk, rows + t * dp_);
        risky |= !row_is_tame(rows + t * dp_);
      }
      transpose_panel(rows, panel);
    }
    for (std::int64_t j = k0; j < k1; ++j) {
      if (j + kPackPrefetchRows < lk) prefetch_row(p_.v, p_.v_stride, b, j + kPackPrefetchRows, hk);
      load_row(p_.v, p_.v_stride, b, j, hk, j < lk, vp + j * dp_);
      risky |= !row_is_tame(vp + j * dp_);
    }
    std::fill(vp + lk_pad_ * dp_, vp + (lk_pad_ + 1) * dp_, 0.0f);  // the zero row
    mark_packed(ws, b, hk, k0, risky);
  }

#if DFSS_SIMD_BF16_DOT
  /// pack_head for the avx3_bf16 forward: K as panels of bf16 column pairs, V as bf16 rows (the
  /// same key and value rows as pack_head, the same risky flag), nothing in fp32.
  void pack_head_bf16(workspace& ws, std::int64_t b, std::int64_t hk, std::int64_t k0, std::int64_t k1) const {
    static_assert(2 * HWY_LANES(float) == bf16dot::kPanel && kMicroRows == bf16dot::kRows,
                  "the bf16 loops keep the AVX3 panel and micro-kernel shape");
    if (is_packed(ws, b, hk, k0)) return;
    const std::int64_t lk = p_.seqlen_k;
    float* rows = ws.pack.ptr;
    bool risky = false;
    for (std::int64_t blk = k0 / panel_; blk < k1 / panel_; ++blk) {
      for (int t = 0; t < panel_; ++t) {
        const std::int64_t j = blk * panel_ + t;
        load_row(p_.k, p_.k_stride, b, j, hk, j < lk, rows + t * dp_);
        risky |= !row_is_tame(rows + t * dp_);
      }
      bf16dot::pack_key_panel(rows, dp_, ws.kb.ptr + blk * (dp_ / 2) * panel_);
    }
    for (std::int64_t j = k0; j < k1; ++j) {
      load_row(p_.v, p_.v_stride, b, j, hk, j < lk, rows);
      risky |= !row_is_tame(rows);
      bf16dot::pack_value_row(rows, dp_, ws.vb.ptr + j * dp_);
    }
    std::fill(rows, rows + dp_, 0.0f);  // the zero row
    bf16dot::pack_value_row(rows, dp_, ws.vb.ptr + lk_pad_ * dp_);
    mark_packed(ws, b, hk, k0, risky);
  }

  /// Sizes the avx3_bf16 forward's scratch (after reserve).
  void reserve_bf16(workspace& ws) const {
    ws.kb.resize(static_cast<std::size_t>((lk_pad_ / panel_) * (dp_ / 2) * panel_));
    ws.vb.resize(static_cast<std::size_t>((lk_pad_ + 1) * dp_));
    ws.qb.resize(static_cast<std::size_t>(kRowsPerTask * dp_ / 2));
  }
#endif

  /// S = X Kt for rows [0, rows) of the tile @p x (row stride dp, rows padded to a multiple of
  /// kMicroRows with zeros) against the key tile at j0 of the panels @p panels, into @p s (row
  /// stride W). Also computes dP = dO V^T in the backward (x = dO, panels = V^T). Panel by panel,
  /// every row block against a panel (dp P floats, 4 KiB at d = 64 on AVX2) while it is in L1: row
  /// block by row block, each re-read the whole K tile (32 KiB at d = 64, all of Zen 3's L1D). The
  /// two orders measured alike within the host's noise (one Zen 3 thread, causal, L = 2048); the
  /// panel's address is stepped instead of divided out per call (an idiv per micro-kernel call).
  /// Only the first @p width keys of the tile (a multiple of the panel; default all W) are
  /// computed: the causal forward's last tile stops at the task's last visible key.
  void tile_product(const float* x, int rows, const float* panels, std::int64_t j0, float* s, int width = -1) const {
    if (width < 0) width = w_;
    const float* panel = panels + (j0 / panel_) * dp_ * panel_;
    const std::int64_t panel_floats = static_cast<std::int64_t>(dp_) * panel_;
    for (int jb = 0; jb < width; jb += panel_, panel += panel_floats) {
      for (int i = 0; i < rows; i += kMicroRows) {
        microkernel<kMicroRows>(x + i * dp_, dp_, panel, dp_, s + i * w_ + jb, w_);
      }
    }
  }

  /// Adds the bias to the tile row @p s of query qi and sets masked keys (j >= lim) to -inf, those
  /// of the first @p end keys of the tile (default all W) where the caller reads no further.
  HWY_INLINE void bias_and_mask(float* s, std::int64_t b, std::int64_t h, std::int64_t qi, std::int64_t j0, std::int64_t lim,
                                std::int64_t end = -1) const {
    const std::int64_t visible = std::max<std::int64_t>(0, lim - j0);  // keys of the tile below lim
    if (p_.bias != nullptr) {
      // Keys from lim on are set to -inf below: their bias is never read.
      const std::int64_t n = std::min<std::int64_t>({w_, p_.seqlen_k - j0, visible});
      const std::int64_t base = b * p_.bias_stride[0] + h * p_.bias_stride[1] + qi * p_.bias_stride[2];
      std::int64_t t = p_.bias_stride[3] == 1 ? add_bias_vectors(s, base + j0, n) : 0;
      for (; t < n; ++t) {
        s[t] += static_cast<float>(core::load_as_double(p_.bias, p_.bias_type, base + (j0 + t) * p_.bias_stride[3]));
      }
    }
    const std::int64_t last = end < 0 ? w_ : end;
    for (std::int64_t t = visible; t < last; ++t) s[t] = -std::numeric_limits<float>::infinity();
  }

  /// Adds the first whole vectors of @p n contiguous bias values from element @p at (f32, bf16 or
  /// f16; other types: none) to @p s, each value converted to fp32 exactly as the scalar path does;
  /// returns how many were added (the caller adds the rest). Value by value, through the type
  /// switch of load_as_double, a key mask (tools/bench/mask_bias.py) took a causal prefill from
  /// 1.41-1.56x the time without one to 1.27-1.32x (the rest: forward's masked_tile).
  HWY_INLINE std::int64_t add_bias_vectors(float* s, std::int64_t at, std::int64_t n) const {
    const DF d;
    std::int64_t t = 0;
    if (p_.bias_type == dtype::f32) {
      const float* src = static_cast<const float*>(p_.bias) + at;
      for (; t + lanes_ <= n; t += lanes_) hn::StoreU(hn::Add(hn::LoadU(d, s + t), hn::LoadU(d, src + t)), d, s + t);
    } else if (p_.bias_type == dtype::bf16) {
      const hn::Rebind<hwy::bfloat16_t, DF> dh;
      const auto* src = static_cast<const hwy::bfloat16_t*>(p_.bias) + at;
      for (; t + lanes_ <= n; t += lanes_) hn::StoreU(hn::Add(hn::LoadU(d, s + t), hn::PromoteTo(d, hn::LoadU(dh, src + t))), d, s + t);
    } else if (p_.bias_type == dtype::f16) {
      const hn::Rebind<hwy::float16_t, DF> dh;
      const auto* src = static_cast<const hwy::float16_t*>(p_.bias) + at;
      for (; t + lanes_ <= n; t += lanes_) hn::StoreU(hn::Add(hn::LoadU(d, s + t), promote_f16(dh, src + t)), d, s + t);
    }
    return t;
  }

  /// Whether the tile row @p s holds a NaN or +inf score: either makes its row NaN
  /// (docs/semantics.md, "Non-finite and extreme inputs"), kept or pruned. @p width: the first keys
  /// of the row to look at (default all W), a multiple of the vector's lanes.
  bool row_has_nan_or_inf(const float* s, int width = 0) const {
    const DF d;
    const VF inf = hn::Set(d, std::numeric_limits<float>::infinity());
    auto bad = hn::FirstN(d, 0);  // all false
    const int w = width > 0 ? width : w_;
    for (int t = 0; t < w; t += lanes_) {
      const VF x = hn::Load(d, s + t);
      bad = hn::Or(bad, hn::Or(hn::IsNaN(x), hn::Eq(x, inf)));
    }
    return !hn::AllFalse(d, bad);
  }

  /// Whether the tile row @p s holds a -inf score (a masked key: a bias of -inf, or one so large
  /// and negative that the sum overflows).
  bool row_has_neg_inf(const float* s) const {
    const DF d;
    const VF neg_inf = hn::Set(d, -std::numeric_limits<float>::infinity());
    auto found = hn::Eq(hn::Load(d, s), neg_inf);
    for (int t = lanes_; t < w_; t += lanes_) found = hn::Or(found, hn::Eq(hn::Load(d, s + t), neg_inf));
    return !hn::AllFalse(d, found);
  }

  /// Selects N of every M keys of the tile row @p s and writes the kept scores and key indices to
  /// @p cv / @p ci (padded with -inf / the zero row to a multiple of the vector length); @p max_out
  /// receives the largest score of the tile (the maximum of a group is always kept; meaningful for
  /// NaN-free rows only). Returns the count. Exactly the rule of nm_select_group, ties and NaN
  /// included. @p nan_free: the caller knows the row holds no NaN (it checked, or no input of the
  /// task can produce one); the kept set is the same either way, only the cost differs.
  ///
  /// 1:2 and 2:4 run in registers. A row that may hold a NaN takes select_pairs: every lane
  /// compares its rank key
  /// (rank_key) with its group partners (Shuffle2301: position ^ 1, Shuffle1032: ^ 2,
  /// Shuffle0123: ^ 3, all inside one 128-bit block, so an aligned group of 4 is one block), counts
  /// the partners that rank above it (a higher key, or an equal key at a lower index) and keeps
  /// itself iff fewer than N do. Each group's kept keys are then moved to its even lanes with the
  /// same shuffles and ConcatEven packs the even lanes of two vectors into one. (Highway 1.0.3's
  /// CompressStore was tried first: on AVX2 with GCC 12 it copies its 1 KiB permutation table onto
  /// the stack on every call, and made 1:2 and 2:4 3.3x slower than the AVX2 kernel it replaces.)
  /// A NaN-free row takes select_pairs_nan_free, the cheaper pairwise form of the same rule (the
  /// hand-written AVX2 kernel's): about half the instructions, which measured 2:4 about 10% faster
  /// on AVX2. Other N:M go through the scalar nm_select_group; N = M keeps everything. @p whole:
  /// the row's groups kept whole (sink and recent windows, core::whole_groups). @p width: the first
  /// keys of the tile to take (default all W), a multiple of compact_step(); the caller knows the
  /// others are masked (-inf), which would be kept as zero weights.
  HWY_INLINE int compact(const float* s, std::int32_t j0, float* cv, std::int32_t* ci, float& max_out, bool nan_free,
                         const mask::whole_groups& whole, int width = 0) const {
    const DF d;
    const DI di;
    const int n = p_.pattern_n, m = p_.pattern_m;
    const int w = width > 0 ? width : w_;
    int kept = 0;
    VF vmax = hn::Set(d, -std::numeric_limits<float>::infinity());
    // Key indices as iota + offset: Highway 1.0.3's Iota fills a stack array lane by lane, and the
    // vector load of it stalls on store forwarding, so it is built once per call.
    const VI iota = hn::Iota(di, 0);
    if (n == m) {
      for (int t = 0; t < w; t += lanes_) {
        const VF x = hn::Load(d, s + t);
        vmax = hn::Max(vmax, x);
        hn::Store(x, d, cv + t);
        hn::StoreU(hn::Add(iota, hn::Set(di, j0 + t)), di, ci + t);
      }
      kept = w;
    } else if (((n == 1 && m == 2) || (n == 2 && m == 4)) && !mask::tile_has_whole_groups(whole, j0, w)) {
      // W is a multiple of the panel (2 vectors): two vectors of keys give one vector of kept keys.
      for (int t = 0; t < w; t += 2 * lanes_) {
        const VF x0 = hn::Load(d, s + t);
        const VF x1 = hn::Load(d, s + t + lanes_);
        vmax = hn::Max(vmax, hn::Max(x0, x1));
        VF v0 = x0, v1 = x1;
        VI i0 = hn::Add(iota, hn::Set(di, j0 + t)), i1 = hn::Add(iota, hn::Set(di, j0 + t + lanes_));
        if (nan_free) {
          if (m == 2) {
            select_pairs_nan_free<2>(iota, v0, i0);
            select_pairs_nan_free<2>(iota, v1, i1);
          } else {
            select_pairs_nan_free<4>(iota, v0, i0);
            select_pairs_nan_free<4>(iota, v1, i1);
          }
        } else if (m == 2) {
          select_pairs<2>(iota, v0, i0);
          select_pairs<2>(iota, v1, i1);
        } else {
          select_pairs<4>(iota, v0, i0);
          select_pairs<4>(iota, v1, i1);
        }
        hn::Store(hn::ConcatEven(d, v1, v0), d, cv + kept);
        hn::StoreU(hn::ConcatEven(di, i1, i0), di, ci + kept);
        kept += lanes_;
      }
    } else {
      // Other N:M, and tiles touching the sink or recent window (docs/semantics.md), whose whole
      // groups keep every key: few tiles per row, so the scalar rule serves.
      const bool whole_tile = mask::tile_has_whole_groups(whole, j0, w);
      for (int g = 0; g < w; g += m) {
        const std::uint32_t keep = whole_tile && mask::group_is_whole(whole, j0 + g) ? (1u << m) - 1u
                                                                                   : select_group_generic(s + g, n, m);
        for (int x = 0; x < m; ++x) {
          if ((keep >> x) & 1u) {
            cv[kept] = s[g + x];
            ci[kept] = j0 + g + x;
            ++kept;
          }
        }
      }
      for (int t = 0; t < w; t += lanes_) vmax = hn::Max(vmax, hn::Load(d, s + t));
    }
    for (; kept % lanes_ != 0; ++kept) {
      cv[kept] = -std::numeric_limits<float>::infinity();
      ci[kept] = zero_row_;
    }
    max_out = hn::GetLane(hn::MaxOfLanes(d, vmax));
    return kept;
  }

  /// compact's selection without the compaction, for a NaN-free tile row @p s: the keys it does not
  /// keep become -inf in place (a zero weight after exp2_poly), so that the row is a dense tile
  /// again (the AMX P V, which has no sparse form, takes every key of the tile anyway). Returns the
  /// largest score of the tile. The same kept set as compact (nm_select_group's rule).
  HWY_INLINE float select_in_place(float* s, std::int32_t j0, const mask::whole_groups& whole) const {
    const DF d;
    const int n = p_.pattern_n, m = p_.pattern_m;
    const VF neg_inf = hn::Set(d, -std::numeric_limits<float>::infinity());
    VF vmax = neg_inf;
    if (pairs_in_vectors(j0, whole)) {
      const auto after1 = partner_first(1), after2 = partner_first(2);
      for (int t = 0; t < w_; t += lanes_) {
        const VF x = hn::Load(d, s + t);
        vmax = hn::Max(vmax, x);
        const auto pruned = m == 2 ? pruned_lanes<2>(x, after1, after2) : pruned_lanes<4>(x, after1, after2);
        hn::Store(hn::IfThenElse(pruned, neg_inf, x), d, s + t);
      }
    } else {
      for (int t = 0; t < w_; t += lanes_) vmax = hn::Max(vmax, hn::Load(d, s + t));
      if (n < m) {
        const bool whole_tile = mask::tile_has_whole_groups(whole, j0, w_);
        for (int g = 0; g < w_; g += m) {
          if (whole_tile && mask::group_is_whole(whole, j0 + g)) continue;
          const std::uint32_t keep = select_group_generic(s + g, n, m);
          for (int x = 0; x < m; ++x) {
            if (((keep >> x) & 1u) == 0) s[g + x] = -std::numeric_limits<float>::infinity();
          }
        }
      }
    }
    return hn::GetLane(hn::MaxOfLanes(d, vmax));
  }

  /// Whether the tile at @p j0 selects 1:2 or 2:4 with no group kept whole (@p whole): its groups
  /// then lie inside 128-bit blocks (tiles start at multiples of the vector), which pruned_lanes
  /// selects in registers.
  bool pairs_in_vectors(std::int32_t j0, const mask::whole_groups& whole) const {
    const int n = p_.pattern_n, m = p_.pattern_m;
    return ((n == 1 && m == 2) || (n == 2 && m == 4)) && !mask::tile_has_whole_groups(whole, j0, w_);
  }

  /// Per lane whether its group partners p ^ 1 (@p bit 1) or p ^ 2 and p ^ 3 (@p bit 2) come before
  /// it (pruned_lanes' after1 and after2). (Functions, not a struct of masks, and no lambdas capturing
  /// vectors: SVE's sizeless types can be neither members nor captured by copy.)
  static HWY_INLINE hn::Mask<DF> partner_first(int bit) {
    const DF d;
    const DI di;
    return hn::RebindMask(d, hn::Ne(hn::And(hn::Iota(di, 0), hn::Set(di, bit)), hn::Zero(di)));
  }

  /// Whether @p y ranks above @p x: higher, or equal and first (@p y_first).
  static HWY_INLINE hn::Mask<DF> ranks_above(VF y, VF x, hn::Mask<DF> y_first) {
    return hn::Or(hn::Gt(y, x), hn::And(y_first, hn::Eq(y, x)));
  }

  /// The lanes of one vector of NaN-free scores @p x that 1:2 (M = 2) or 2:4 (M = 4) prunes: lane p
  /// is kept iff fewer than N of its group's partners rank above it (a higher score, or an equal one
  /// at a lower index: nm_select_group's rule, -inf lowest, +0 == -0). @p after1, @p after2:
  /// partner_first(1) and partner_first(2).
  template <int M>
  static HWY_INLINE hn::Mask<DF> pruned_lanes(VF x, hn::Mask<DF> after1, hn::Mask<DF> after2) {
    const auto above1 = ranks_above(hn::Shuffle2301(x), x, after1);
    if constexpr (M == 2) {
      (void)after2;
      return above1;
    } else {
      // Pruned iff at least two of the three partners rank above: a majority of three.
      const auto above2 = ranks_above(hn::Shuffle1032(x), x, after2);
      const auto above3 = ranks_above(hn::Shuffle0123(x), x, after2);
      return hn::Or(hn::And(above1, above2), hn::And(hn::Or(above1, above2), above3));
    }
  }

  /// select_pairs for scores without NaN (plain float compares rank them: -inf lowest, +0 == -0),
  /// in the pairwise form: per pair its winner hi and loser lo (ties to the lower index). 1:2
  /// keeps hi. 2:4 keeps {hi0, hi1}, except {hi0, lo0} when lo0 ranks above hi1 (lo0 >= hi1: lo0
  /// has the lower index) and {hi1, lo1} when lo1 ranks above hi0 (lo1 > hi0). So lane 0 of a group
  /// takes (lo0 above hi1 ? lo0 : hi1) and lane 2 takes (lo1 above hi0 ? lo1 : hi0): the same kept
  /// set as select_pairs, not always in key order (which no caller needs).
  template <int M>
  static HWY_INLINE void select_pairs_nan_free(VI iota, VF& x, VI& idx) {
    const DF d;
    const DI di;
    const VF xs = hn::Shuffle2301(x);
    const VI is = hn::Shuffle2301(idx);
    if constexpr (M == 2) {
      (void)iota;
      // Even lane: keep its own key unless the odd partner is strictly larger.
      const auto partner = hn::Gt(xs, x);
      x = hn::IfThenElse(partner, xs, x);
      idx = hn::IfThenElse(hn::RebindMask(di, partner), is, idx);
    } else {
      const auto even_wins = hn::Ge(x, xs);  // meaningful in even lanes
      const auto even_wins_i = hn::RebindMask(di, even_wins);
      const VF hi = hn::IfThenElse(even_wins, x, xs), lo = hn::IfThenElse(even_wins, xs, x);
      const VI hi_i = hn::IfThenElse(even_wins_i, idx, is), lo_i = hn::IfThenElse(even_wins_i, is, idx);
      const VF hi_other = hn::Shuffle1032(hi);
      const VI hi_other_i = hn::Shuffle1032(hi_i);
      // lo wins over the other pair's hi: >= in the first pair (lo0 has the lower index), > in the second.
      const auto first_pair = hn::RebindMask(d, hn::Eq(hn::And(iota, hn::Set(di, 2)), hn::Zero(di)));
      const auto lo_wins = hn::Or(hn::Gt(lo, hi_other), hn::And(first_pair, hn::Eq(lo, hi_other)));
      x = hn::IfThenElse(lo_wins, lo, hi_other);
      idx = hn::IfThenElse(hn::RebindMask(di, lo_wins), lo_i, hi_other_i);
    }
  }

  /// 1:2 (M = 2) or 2:4 (M = 4) selection of the aligned groups of one vector of scores @p x with
  /// key indices @p idx (@p iota: 0, 1, 2, ...): afterwards the even lanes of every group hold its kept scores and indices
  /// in key order (1:2: lane 0 of each pair; 2:4: lanes 0 and 2 of each group of 4), odd lanes are
  /// don't-care.
  template <int M>
  static HWY_INLINE void select_pairs(VI iota, VF& x, VI& idx) {
    const DF d;
    const DI di;
    const VI pos = hn::And(iota, hn::Set(di, M - 1));
    const auto lower1 = hn::Ne(hn::And(pos, hn::Set(di, 1)), hn::Zero(di));  // partner p ^ 1 comes first
    const VI k = rank_key(x);
    const VI k1 = hn::Shuffle2301(k);
    const auto above1 = hn::Or(hn::Gt(k1, k), hn::And(lower1, hn::Eq(k1, k)));
    const VF x1 = hn::Shuffle2301(x);
    const VI idx1 = hn::Shuffle2301(idx);
    if constexpr (M == 2) {
      // Exactly one key of each pair is kept: the even lane's unless its partner ranks above it.
      const auto keep_f = hn::RebindMask(d, above1);  // true: take the partner (the odd key)
      x = hn::IfThenElse(keep_f, x1, x);
      idx = hn::IfThenElse(above1, idx1, idx);
    } else {
      // Partners p ^ 2 and p ^ 3 come first where bit 1 of p is set.
      const auto lower2 = hn::Ne(hn::And(pos, hn::Set(di, 2)), hn::Zero(di));
      const VI k2 = hn::Shuffle1032(k);
      const VI k3 = hn::Shuffle0123(k);
      VI above = hn::VecFromMask(di, above1);
      above = hn::Add(above, hn::VecFromMask(di, hn::Or(hn::Gt(k2, k), hn::And(lower2, hn::Eq(k2, k)))));
      above = hn::Add(above, hn::VecFromMask(di, hn::Or(hn::Gt(k3, k), hn::And(lower2, hn::Eq(k3, k)))));
      // keep: fewer than 2 partners rank above (the sum of -1 masks is -(count)).
      const VI keep = hn::VecFromMask(di, hn::Gt(above, hn::Set(di, -2)));
      const auto keep_here = hn::MaskFromVec(keep);       // lane p kept
      const auto keep_next = hn::MaskFromVec(hn::Shuffle2301(keep));  // lane p ^ 1 kept
      // Exactly two of the four are kept. Lane 0 takes the first kept key: 0, else 1, else 2;
      // lane 2 takes the second: 3, else 2, else 1 (lane 2 sees key 3 through Shuffle2301, key 1
      // through Shuffle0123, key 0 through Shuffle1032).
      const VF x2 = hn::Shuffle1032(x), x3 = hn::Shuffle0123(x);
      const VI idx2 = hn::Shuffle1032(idx), idx3 = hn::Shuffle0123(idx);
      const auto first = hn::Eq(pos, hn::Zero(di));
      const VI first_idx = hn::IfThenElse(keep_here, idx, hn::IfThenElse(keep_next, idx1, idx2));
      const VI second_idx = hn::IfThenElse(keep_next, idx1, hn::IfThenElse(keep_here, idx, idx3));
      const auto keep_here_f = hn::RebindMask(d, keep_here);
      const auto keep_next_f = hn::RebindMask(d, keep_next);
      const VF first_x = hn::IfThenElse(keep_here_f, x, hn::IfThenElse(keep_next_f, x1, x2));
      const VF second_x = hn::IfThenElse(keep_next_f, x1, hn::IfThenElse(keep_here_f, x, x3));
      x = hn::IfThenElse(hn::RebindMask(d, first), first_x, second_x);
      idx = hn::IfThenElse(first, first_idx, second_idx);
    }
  }

  /// Sum of exp(scale (x - mx)) over the @p kept compacted scores (the backward's row statistics;
  /// the forward fuses this with its index conversion in exp_kept).
  float exp_sum(const float* cv, int kept, float mx) const {
    const DF d;
    const VF vmx = hn::Set(d, mx), ve1 = hn::Set(d, e1_), ve2 = hn::Set(d, e2_);
    VF vsum = hn::Zero(d);
    for (int t = 0; t < kept; t += lanes_) {
      vsum = hn::Add(vsum, exp2_poly(hn::Mul(hn::Mul(hn::Sub(hn::Load(d, cv + t), vmx), ve1), ve2)));
    }
    return hn::GetLane(hn::SumOfLanes(d, vsum));
  }

  const attention_params& p_;
  const int d_, lanes_, panel_, dp_, w_;
  const std::int64_t lk_pad_;
  const std::int32_t zero_row_;
  const float scale_;
  /// exp(scale * x) = exp2((x * e1_) * e2_): e1_ = scale log2(e) and e2_ = 1, or, when scale
  /// log2(e) overflows fp32 (scale above float max / log2(e), up to float max), e1_ = scale and
  /// e2_ = log2(e), which stays finite for every |x| the product can take.
  const float e1_, e2_;
  const std::int64_t group_;
};

/// Pass<T>(p, args...).run() for the call's input type (a pass of this family takes f32, f16 and
/// bf16 inputs); any other type is refused with a status naming @p what.
template <template <typename> class Pass, typename... Args>
status run_pass(const attention_params& p, const char* what, const Args&... args) {
  switch (p.input_type) {
    case dtype::f32: Pass<float>(p, args...).run(); break;
    case dtype::f16: Pass<half>(p, args...).run(); break;
    case dtype::bf16: Pass<bfloat16>(p, args...).run(); break;
    default:
      return {status_code::unsupported,
              std::string(what) + ": input type " + dtype_name(p.input_type) + " (takes f32, f16, bf16)"};
  }
  return status::success();
}

#endif  // DFSS_SIMD_KERNEL_TARGET

}  // namespace dfss::cpu::simd::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // per-target include guard
