// The fused DFSS forward (flash style) over Google Highway, compiled once per SIMD target
// (targets.hpp says which) and dispatched at run time to the target the caller names.
//
// Work is split into tasks of kRowsPerTask query rows of one (batch, head); a worker packs the K and
// V of the (batch, kv head) it works on once (kernel_parts-inl.h). Per task and key tile of W keys
// (W a multiple of the panel width P = 2 vectors and of M, at least forward_key_tile(d): 128 keys
// at d = 64, 64 at d = 128; 256 at least on the AMX tiles, kMinKeyTileAmx):
//   1. S = Q K^T for the task's rows with the register-blocked micro-kernel (kMicroRows x P). Q is
//      not pre-scaled: unscaled scores of integer inputs are exact, so selections (ties included)
//      match the reference exactly; the scale enters the exp2 argument as scale (s - max) log2(e)
//      instead, which stays accurate for scores up to float max (docs/semantics.md, "Non-finite and
//      extreme inputs").
//   2. Per row: bias, masks (-inf), then the N:M selection, which also compacts the kept scores and
//      their key indices, and the tile's maximum (the maximum of a group is always kept, so the
//      maximum over all scores is the maximum over the kept ones): the online softmax update.
//   3. exp2 of the compacted scores only (half the exponentials for 1:2 and 2:4), and
//      acc += p * V[index] over the kept keys only, with the accumulator row in registers.
// A row with a NaN or +inf score (only possible with a bias or with non-finite or huge inputs,
// flagged per task while packing) is written as NaN. Dense (N = M) runs the same code with an
// identity selection, so the sparsity's own speedup is measured against an equally optimised
// dense kernel. Every row is computed by one worker in a fixed order: results are bitwise
// identical for any thread count. A shape with few row tasks and many keys splits each row task's
// keys into chunks of whole key tiles (split_chunk_keys, a rule of the shape only), computed as
// separate tasks and folded exactly in chunk order (docs/design.md, "Split keys").
#include "cpu/simd/targets.hpp"  // first: it fixes the compiled targets

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "cpu/simd/attention_forward.cpp"
#include "hwy/foreach_target.h"  // IWYU pragma: keep

#include "cpu/simd/kernel_parts-inl.h"

#include <vector>

#include "core/cpu_features.hpp"

HWY_BEFORE_NAMESPACE();
namespace dfss::cpu::simd::HWY_NAMESPACE {

#if DFSS_SIMD_KERNEL_TARGET

template <typename T>
class forward_pass : public kernel<T> {
 public:
  using base = kernel<T>;
  /// @p bf16_dot: run Q K^T and P V as bf16 dot products (the avx3_bf16 target, bf16 inputs only;
  /// in other instances the flag is ignored).
  forward_pass(const attention_params& p, bool bf16_dot)
      : base(p, min_tile(p, bf16_dot)),
        dot_(uses_dot(bf16_dot)),
        bias_masks_(bias_only_masks(p)),
        amx_(uses_amx(p, dot_, dp_, bias_masks_)),
        amx_pv_(amx_ && !p.fp32_weights),
        sparse_(p.pattern_n < p.pattern_m),
        dense_tiles_(!HWY_HAVE_SCALABLE && p.pattern_n == p.pattern_m && (!dot_ || dense_dot_fits())),
        pair_tiles_(kPairBlocks && core::cpu_pair_blocks_pay() && p.pattern_n == 1 && p.pattern_m == 2 && !dot_ &&
                    !amx_pv_),
        q_tiles_((p.seqlen_q + kRowsPerTask - 1) / kRowsPerTask),
        chunk_(split_chunk_keys(p, q_tiles_, w_)),
        chunks_(std::max<std::int64_t>(1, (p.seqlen_k + chunk_ - 1) / chunk_)),
        tie_c1_(tie_c1(p.head_dim)),
        tie_norms_(1.0 / (1.0 - (static_cast<double>(dp_) + 3.0) * 0x1p-24)) {}

  static constexpr bool uses_dot(bool bf16_dot) { return DFSS_SIMD_BF16_DOT && bf16_dot && std::is_same_v<T, bfloat16>; }

  /// Whether Q K^T runs on the AMX tiles (amx_tiles.hpp): bf16 inputs without the vdpbf16ps loops,
  /// no bias or one of 0 and -inf only (@p bias_masks: select_amx bounds the raw scores, and any
  /// other bias could reorder a group by less than that; a mask moves no score it compares), a
  /// padded head dim of whole tile steps, on a CPU with AMX. Per task only where the task's scores
  /// cannot overflow (not ws.risky); the others take the fp32 micro-kernel. With a left-padding
  /// key mask, a bf16 causal prefill without AMX took 1.6-2.3x the time of one without the mask
  /// (1.1x with it; tools/bench/mask_bias.py, L = 1024 and 2048, d = 64, 12 heads, 2 threads).
  static bool uses_amx(const attention_params& p, bool dot, int dp, bool bias_masks) {
    return DFSS_SIMD_AMX && std::is_same_v<T, bfloat16> && !dot && (p.bias == nullptr || bias_masks) &&
           dp % (2 * amx::kPairs) == 0 && core::cpu_uses_amx();
  }

  /// The minimum key tile of a call with inputs of type T (@p bf16_dot: see the constructor).
  static int min_tile(const attention_params& p, bool bf16_dot) {
    if (uses_dot(bf16_dot)) return kMinKeyTileBf16Dot;
    const bool amx = uses_amx(p, uses_dot(bf16_dot), base::padded_dim(p.head_dim), bias_only_masks(p));
    return amx ? std::max(forward_key_tile(p.head_dim), kMinKeyTileAmx) : forward_key_tile(p.head_dim);
  }

  /// With the bf16 dot products, dense tiles run blocked when a tile's key pairs fit
  /// bf16dot::pv_tile_rows.
  bool dense_dot_fits() const {
#if DFSS_SIMD_BF16_DOT
    return w_ <= 2 * bf16dot::kTilePairs;
#else
    return false;
#endif
  }

  void run() const {
    const std::int64_t row_tasks = p_.batch * p_.heads * q_tiles_;
    const std::int64_t tasks = row_tasks * chunks_;
    // Split keys: the partial state of every (row task, chunk, row); the task that finishes a row
    // task's last chunk folds them in chunk order (chunked_states).
    const bool split = chunks_ > 1;
    chunked_states chunked(split ? row_tasks : 0, chunks_, split ? tasks * kRowsPerTask : 0, dp_);
    const partial_states parts = chunked.view();
    // Causal tasks differ in cost: handed out dynamically. Otherwise contiguous chunks let each
    // worker pack each (batch, kv head) (or key chunk of it) once. One causal task at a time, every
    // worker packed every head (the workers move through the heads together): with two Zen 3
    // threads (B = 1, H = 12, L = 2048, d = 64, fp32, 1:2) 10.5% of the samples were packing. So
    // where there are at least two heads (with their chunks) per worker, all but the last
    // `workers` heads are handed out whole, one worker taking every query tile of a head in turn,
    // and the last ones a task at a time, so that the workers still finish together: packing 4.4%
    // of the samples (medians of 9 interleaved rounds: 1:2 59.4 -> 56.8 ms; at L = 4096 dense
    // 249 -> 240 ms). A function of the thread count, but which worker runs a task never changes
    // its result.
    const std::int64_t head_units = tasks / q_tiles_;
    const int workers = worker_count(p_.num_threads, tasks);
    const std::int64_t whole = p_.causal && head_units >= 2 * workers ? head_units - workers : 0;
    parallel_for(
        whole + (tasks - whole * q_tiles_), p_.num_threads, p_.causal ? schedule::dynamic : schedule::contiguous,
        [&] {
          this->reserve(worker_scratch<workspace>(), /*backward=*/false);
#if DFSS_SIMD_BF16_DOT
          if (dot_) this->reserve_bf16(worker_scratch<workspace>());
          if (dot_ && dense_tiles_) {
            worker_scratch<workspace>().vpair.resize(static_cast<std::size_t>((this->lk_pad_ / 2 + 1) * dp_));
          }
#endif
          if (amx_) reserve_amx(worker_scratch<workspace>());
          if (pair_tiles_) worker_scratch<workspace>().vn.resize(static_cast<std::size_t>((p_.seqlen_k / 2 + 1) * dp_));
        },
        [&](std::int64_t u) {
          const std::int64_t first = u < whole ? u * q_tiles_ : whole * q_tiles_ + (u - whole);
          const std::int64_t last = u < whole ? first + q_tiles_ : first + 1;
          for (std::int64_t t = first; t < last; ++t) {
            const std::int64_t row_task = task(worker_scratch<workspace>(), t, parts);
            if (split && chunked.finish(row_task)) fold(row_task, parts);
          }
        });
  }

  /// Keys per chunk when the forward splits each row task's keys (flash-decoding): when the shape
  /// has fewer than kSplitTargetTasks row tasks and at least 2 kSplitMinChunk keys, into chunks of
  /// at least kSplitMinChunk keys, a multiple of the key tile @p w (so of M: the split is exact), to
  /// make about kSplitTargetTasks tasks; else all keys (lk_pad). A function of the shape only, never
  /// of the thread count, so results stay bitwise identical for any thread count.
  static std::int64_t split_chunk_keys(const attention_params& p, std::int64_t q_tiles, int w) {
    const std::int64_t all = (p.seqlen_k + w - 1) / w * w;
    const std::int64_t row_tasks = p.batch * p.heads * q_tiles;
    if (row_tasks >= kSplitTargetTasks || p.seqlen_k < 2 * kSplitMinChunk) return all;
    const std::int64_t want = (kSplitTargetTasks + row_tasks - 1) / row_tasks;
    const std::int64_t chunks = std::min(want, p.seqlen_k / kSplitMinChunk);
    const std::int64_t keys = (p.seqlen_k + chunks - 1) / chunks;
    return std::min(all, (keys + w - 1) / w * w);
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
  using base::zero_row_;
  const bool dot_;
  /// The bias holds 0 and -inf only (a mask; bias_only_masks): it makes no task risky, and keeps
  /// the AMX tiles.
  const bool bias_masks_;
  /// Q K^T on the AMX tiles (uses_amx), P V too (blocked_values_amx; not with p.fp32_weights), and
  /// whether the pattern selects (select_amx then settles near ties).
  const bool amx_, amx_pv_, sparse_;
  /// Dense pattern on a fixed-width target: a key tile that no row masks runs P V as a blocked
  /// product over the task's rows (blocked_values; with the bf16 dot products, bf16dot::pv_tile_rows).
  const bool dense_tiles_;
  /// 1:2 on a fixed-width target (and not the bf16 dot products): a key tile that no row masks
  /// runs P V as a blocked product over the task's rows, each row's kept key of a pair selected by
  /// its weight's sign (blocked_values).
  const bool pair_tiles_;
  /// Row tasks of the shape, query tiles per (batch, head), key chunk length and count
  /// (split_chunk_keys; one chunk of all keys unless the forward splits).
  const std::int64_t q_tiles_, chunk_, chunks_;
  /// near_tie_bound's constants of the shape (c1, and the factor of the norms), computed once
  /// rather than per row and task (their four divisions).
  const double tie_c1_, tie_norms_;
  static_assert(kRowsPerTask <= 32, "rows of a task are bits of a std::uint32_t");

  /// Task @p t: query tile qt of (batch b, head h), key chunk c, ordered (b, kv head, c, head of
  /// the group, qt) so that consecutive tasks share the packed keys. Returns the row task
  /// ((b, h, qt), as numbered without chunks). One chunk: writes O and LSE; else leaves the rows'
  /// partial states in @p parts.
  std::int64_t task(workspace& ws, std::int64_t t, const partial_states& parts) const {
    const std::int64_t qt = t % q_tiles_;
    const std::int64_t hg = (t / q_tiles_) % group_;
    const std::int64_t c = (t / (q_tiles_ * group_)) % chunks_;
    const std::int64_t hk = (t / (q_tiles_ * group_ * chunks_)) % p_.heads_kv;
    const std::int64_t b = t / (q_tiles_ * group_ * chunks_ * p_.heads_kv);
    const std::int64_t h = hk * group_ + hg;
    const std::int64_t row_task = (b * p_.heads + h) * q_tiles_ + qt;
    const std::int64_t i0 = qt * kRowsPerTask;
    const int rows = static_cast<int>(std::min<std::int64_t>(kRowsPerTask, p_.seqlen_q - i0));
    const int rows_mk = (rows + kMicroRows - 1) / kMicroRows * kMicroRows;
    const std::int64_t k0 = c * chunk_, k1 = std::min(this->lk_pad_, k0 + chunk_);
    std::int64_t tile_end = 0;  // keys beyond the last visible key of any row of the task are skipped
    for (int i = 0; i < rows; ++i) {
      ws.row_max.ptr[i] = -std::numeric_limits<float>::infinity();
      ws.row_sum.ptr[i] = 0.0f;
      ws.row_nan.ptr[i] = 0;
      ws.row_lim.ptr[i] = this->key_limit(b, i0 + i);
      ws.row_whole.ptr[i] = core::whole_groups(p_, b, i0 + i);
      tile_end = std::max(tile_end, ws.row_lim.ptr[i]);
    }
    tile_end = std::min(tile_end, k1);
    std::fill(ws.acc.ptr, ws.acc.ptr + rows * dp_, 0.0f);
    // A chunk past every row's last visible key (causal, key lengths) leaves empty states.
    if (k0 < tile_end) {
      pack(ws, b, hk, k0, k1);
      float* q = ws.q.ptr;
      // A bias may make a score NaN or +inf, but not one of 0 and -inf only (bias_masks_).
      ws.risky = ws.kv_risky || (p_.bias != nullptr && !bias_masks_);
      // The task's Q rows (H d apart in the [B, L, H, d] layout: no stream the hardware prefetcher
      // follows) requested all at once, so that their misses overlap instead of arriving one row at
      // a time: in perf (one Zen 4 thread, bf16, d = 64, L = 2048, 1:2) the stall on these loads
      // went from 13-16% to 7% of the task's samples; whole calls about 1% faster (minimums, fp32,
      // d = 128), inside this host's noise.
      for (int i = 0; i < rows; ++i) this->prefetch_row(p_.q, p_.q_stride, b, i0 + i, h);
      for (int i = 0; i < rows_mk; ++i) {
        this->load_row(p_.q, p_.q_stride, b, i0 + i, h, i < rows, q + i * dp_);
        ws.risky = ws.risky || !this->row_is_tame(q + i * dp_);
        if (dot_) pack_query_row(ws, q, i);
      }
      if (amx_ && !ws.risky) pack_query_amx(ws, rows_mk);
    }
    const bool tiles = amx_ && !ws.risky && k0 < tile_end;
    if (tiles) amx_configure(rows_mk);
    for (std::int64_t j0 = k0; j0 < tile_end; j0 += w_) {
      scores(ws, rows_mk, j0, tile_end);
      // Rows whose P V for this tile is left to blocked_values.
      std::uint32_t blocked = 0, paired_amx = 0;
      for (int i = 0; i < rows; ++i) row_epilogue(ws, b, h, i0 + i, i, j0, blocked, paired_amx);
      if (blocked != 0) blocked_values(ws, blocked, paired_amx, j0);
    }
    if (tiles) amx_release();

    if (chunks_ == 1) {
      for (int i = 0; i < rows; ++i) {
        this->store_row(b, i0 + i, h, ws.acc.ptr + i * dp_, ws.row_max.ptr[i], ws.row_sum.ptr[i], ws.row_nan.ptr[i] != 0);
      }
      return row_task;
    }
    for (int i = 0; i < rows; ++i) {
      const auto at = static_cast<std::size_t>((row_task * chunks_ + c) * kRowsPerTask + i);
      std::copy(ws.acc.ptr + i * dp_, ws.acc.ptr + (i + 1) * dp_, parts.acc + at * static_cast<std::size_t>(dp_));
      parts.max[at] = ws.row_max.ptr[i];
      parts.sum[at] = ws.row_sum.ptr[i];
      parts.nan[at] = ws.row_nan.ptr[i] != 0 ? 1 : 0;
    }
    return row_task;
  }

  /// Folds the chunks of row task @p row_task (split keys) in increasing order and writes O and LSE.
  void fold(std::int64_t row_task, const partial_states& parts) const {
    const std::int64_t qt = row_task % q_tiles_;
    const std::int64_t h = (row_task / q_tiles_) % p_.heads;
    const std::int64_t b = row_task / (q_tiles_ * p_.heads);
    const std::int64_t i0 = qt * kRowsPerTask;
    const int rows = static_cast<int>(std::min<std::int64_t>(kRowsPerTask, p_.seqlen_q - i0));
    std::vector<float> acc(static_cast<std::size_t>(dp_));
    for (int i = 0; i < rows; ++i) {
      float mx = 0.0f, sum = 0.0f;
      bool is_nan = false;
      this->fold_states(parts, static_cast<std::size_t>(row_task * chunks_ * kRowsPerTask + i), kRowsPerTask, chunks_,
                        acc.data(), mx, sum, is_nan);
      this->store_row(b, i0 + i, h, acc.data(), mx, sum, is_nan);
    }
  }

  /// exp(scale (x - max)) of the @p kept compacted scores @p cv, in place; returns their sum. Key
  /// indices @p ci become element offsets into the packed V here (one multiply per vector instead
  /// of one per key in the P V loop). Only a tile that holds masked keys (@p masked_tile: a
  /// boundary tile, or any tile with a bias, which may be -inf) can keep a -inf slot: there it
  /// becomes 0 and points at the zero row. The exponent is (x - max) e1 (times e2 when Split):
  /// x - max is exact when it matters (Sterbenz) and at most 0, so huge scores keep accurate
  /// weights; the form x c - max c would cancel away eps |c max| of them.
  /// What exp_kept leaves besides the weights: V offsets in ci, nothing (a dense tile no row masks,
  /// scores in key order), or, for a 1:2 tile no row masks (kept scores in pair order), each
  /// weight negated where its key is odd (blocked_values).
  enum class exp_out { offsets, weights, pair_signs };

  template <bool Split>
  HWY_INLINE float exp_kept(float* cv, std::int32_t* ci, int kept, float mx, bool masked_tile, exp_out out) const {
    const DF d;
    const DI di;
    const VF vmx = hn::Set(d, mx), ve1 = hn::Set(d, e1_), ve2 = hn::Set(d, e2_);
    const VI vdp = hn::Set(di, dp_);
    VF vsum = hn::Zero(d);
    if (masked_tile) {
      const VI vzero_row = hn::Set(di, zero_row_ * dp_);
      const VF neg_inf = hn::Set(d, -std::numeric_limits<float>::infinity());
      for (int t = 0; t < kept; t += lanes_) {
        const VF x = hn::Load(d, cv + t);
        VF y = hn::Mul(hn::Sub(x, vmx), ve1);
        if constexpr (Split) y = hn::Mul(y, ve2);
        const VF e = exp2_poly(y);
        hn::Store(e, d, cv + t);
        vsum = hn::Add(vsum, e);
        const auto masked = hn::RebindMask(di, hn::Eq(x, neg_inf));
        const VI off = hn::Mul(hn::LoadU(di, ci + t), vdp);
        hn::StoreU(hn::IfThenElse(masked, vzero_row, off), di, ci + t);
      }
    } else {
      for (int t = 0; t < kept; t += lanes_) {
        VF y = hn::Mul(hn::Sub(hn::Load(d, cv + t), vmx), ve1);
        if constexpr (Split) y = hn::Mul(y, ve2);
        const VF e = exp2_poly(y);
        vsum = hn::Add(vsum, e);
        if (out == exp_out::offsets) {
          hn::Store(e, d, cv + t);
          hn::StoreU(hn::Mul(hn::LoadU(di, ci + t), vdp), di, ci + t);
        } else if (out == exp_out::weights) {
          hn::Store(e, d, cv + t);
        } else {
          const VI odd = hn::ShiftLeft<31>(hn::LoadU(di, ci + t));
          hn::Store(hn::Or(e, hn::BitCast(d, odd)), d, cv + t);
        }
      }
    }
    return hn::GetLane(hn::SumOfLanes(d, vsum));
  }

  /// Always inlined into task, as the AVX2 kernel this replaces did (GCC 12 otherwise keeps it out
  /// of line, and the call per row and tile measured a few percent of the dense forward).
  /// A row whose P V is left to blocked_values (a dense or 1:2 tile it does not mask)
  /// gets its bit set in @p blocked: its dense weights left in place of its scores, or its signed
  /// 1:2 weights (exp_kept) in its slot of ws.comp_val; and also in @p paired_amx where its weights
  /// are in its row of ws.p_amx already (1:2 on the AMX tiles: select_amx_pairs).
  HWY_INLINE void row_epilogue(workspace& ws, std::int64_t b, std::int64_t h, std::int64_t qi, int i, std::int64_t j0,
                               std::uint32_t& blocked, std::uint32_t& paired_amx) const {
    const std::int64_t lim = ws.row_lim.ptr[i];
    if (j0 >= lim) return;  // the whole tile is masked for this row
    float* s = ws.s.ptr + static_cast<std::int64_t>(i) * w_;
    const float neg_inf = -std::numeric_limits<float>::infinity();
    this->bias_and_mask(s, b, h, qi, j0, lim);

    // A NaN or +inf score can only come from non-finite or huge inputs (flagged while packing) or a
    // bias; the row's output is then NaN whatever the arithmetic below does with it.
    const bool nan_or_inf = ws.risky && this->row_has_nan_or_inf(s);
    if (nan_or_inf) ws.row_nan.ptr[i] = 1;

    // Only a tile that holds masked keys (a boundary tile, or a -inf from the bias) can keep a -inf
    // slot. A bias row with no -inf in the tile (a key mask's rows past the padding, any finite
    // bias) leaves it to the blocked P V forms as without a bias: where every tile counted as
    // masked, a left-padding mask made a dense causal prefill 1.3x the time of an unmasked one
    // (1.1x now; tools/bench/mask_bias.py).
    const bool masked_tile = j0 + w_ > lim || (p_.bias != nullptr && this->row_has_neg_inf(s));
    // A dense tile the row does not mask keeps its scores in place and in key order, which is what
    // compact would copy out. So does every tile when P V runs on the AMX tiles: a masked key's
    // -inf becomes a zero weight there (exp2_poly), and the whole tile is one tile product (the
    // causal diagonal's tiles row by row in fp32 were a tenth of a dense bf16 forward's time); a
    // sparse pattern's pruned keys become -inf too (select_in_place), the AMX tiles having no
    // sparse form. Compacting the kept scores and scattering their weights back into a zeroed row
    // instead made 1:2 2.5x the time of dense (one thread, causal, L = 2048, d = 64).
    const bool amx_tile = amx_pv_ && !ws.risky;
    const bool in_place = amx_tile || (dense_tiles_ && !masked_tile);
    const mask::whole_groups& whole = ws.row_whole.ptr[i];
    // A 1:2 tile the row does not mask, without whole groups (sink and recent windows): one kept
    // key per pair, in pair order.
    const bool paired = pair_tiles_ && !masked_tile && !mask::tile_has_whole_groups(whole, j0, w_);
    const std::int64_t slot = paired ? static_cast<std::int64_t>(i) * this->comp_stride() : 0;
    float* cv = in_place ? s : ws.comp_val.ptr + slot;
    std::int32_t* ci = in_place ? nullptr : ws.comp_idx.ptr + slot;
    float tile_max = neg_inf;
    int kept = w_;
    // 1:2 on the AMX tiles: one kept score per pair, compacted with the half of the pair it takes,
    // so that only the kept keys' exponentials are computed (kept_weights_to_pairs then places each
    // weight in its pair, the pruned half 0: the words weights_to_pairs makes of the dense row).
    const bool amx_pairs = amx_tile && p_.pattern_m == 2 && this->pairs_in_vectors(static_cast<std::int32_t>(j0), whole);
    if (amx_pairs) {
      cv = ws.comp_val.ptr + static_cast<std::int64_t>(i) * this->comp_stride();
      ci = ws.comp_idx.ptr + static_cast<std::int64_t>(i) * this->comp_stride();
      kept = w_ / 2;
      tile_max = select_amx_pairs(ws, i, j0, s, cv, ci);
    } else if (amx_tile) {
      tile_max = select_amx(ws, i, j0, s, whole);
    } else if (in_place) {
      tile_max = this->select_in_place(s, static_cast<std::int32_t>(j0), whole);  // dense: the maximum
    } else {
      // Scored on the tiles but P V not (p.fp32_weights: the backward's O): the near ties settled in
      // place first, so that the compaction keeps the fp32 micro-kernel's keys as select_amx does.
      // Without it the backward's O came from other keys than its own selection on near ties.
      if (amx_ && sparse_ && !ws.risky) select_amx<false>(ws, i, j0, s, whole);
      kept = this->compact(s, static_cast<std::int32_t>(j0), cv, ci, tile_max, /*nan_free=*/!nan_or_inf, whole,
                           this->visible_width(lim, j0));
    }
    if (tile_max == neg_inf) return;
    float& mx = ws.row_max.ptr[i];
    float& sum = ws.row_sum.ptr[i];
    float* acc = ws.acc.ptr + static_cast<std::int64_t>(i) * dp_;
    if (tile_max > mx) {
      const float corr = mx == neg_inf ? 0.0f : std::exp2(((mx - tile_max) * e1_) * e2_);
      const DF d;
      const VF vc = hn::Set(d, corr);
      for (int c = 0; c < dp_; c += lanes_) hn::Store(hn::Mul(vc, hn::Load(d, acc + c)), d, acc + c);
      sum *= corr;
      mx = tile_max;
    }

    // exp(scale (x - max)) of the kept scores; the second multiply only for a scale above
    // float max / log2(e).
    // (An AMX tile is in place, its weights in key order or, for amx_pairs, one per pair.)
    const exp_out out = in_place ? exp_out::weights : (paired ? exp_out::pair_signs : exp_out::offsets);
    // -inf slots whose offsets go to the zero row.
    const bool masked_slots = masked_tile && !in_place;
    sum += e2_ == 1.0f ? exp_kept<false>(cv, ci, kept, mx, masked_slots, out)
                       : exp_kept<true>(cv, ci, kept, mx, masked_slots, out);
    if (amx_pairs) {
#if DFSS_SIMD_AMX
      amx::kept_weights_to_pairs(cv, ci, kept, ws.p_amx.ptr + static_cast<std::int64_t>(i) * (w_ / 2));
      paired_amx |= 1u << i;
#endif
    }
#if !DFSS_SIMD_AMX
    (void)paired_amx;
#endif

    // acc += p * V[index] over the kept keys (ci holds element offsets now).
    if (in_place || paired) {
      blocked |= 1u << i;
    } else {
      values(ws, acc, kept, cv, ci);
    }
  }

  /// acc += P V of the key tile at @p j0 for the rows in @p blocked with add_tile_block,
  /// kValueRows rows per block: a dense tile (weights in ws.s, in key order) or a 1:2 one (signed
  /// weights in the rows' slots of ws.comp_val, the odd keys' V rows negated in ws.vn). Each row's
  /// sums come out bitwise as from values().
  void blocked_values(workspace& ws, std::uint32_t blocked, std::uint32_t paired_amx, std::int64_t j0) const {
#if DFSS_SIMD_BF16_DOT
    if (dot_) return blocked_values_bf16(ws, blocked, j0);
#endif
#if DFSS_SIMD_AMX
    if (amx_pv_ && !ws.risky) return blocked_values_amx(ws, blocked, paired_amx, j0);
#else
    (void)paired_amx;
#endif
#if !HWY_HAVE_SCALABLE
    const float* v0 = ws.vp.ptr + j0 * dp_;
    const float* v1 = pair_tiles_ ? ws.vn.ptr + (j0 / 2) * dp_ : v0;
    float* acc[kValueRows];
    const float* w[kValueRows];
    const auto run = [&](auto rows, float* const* a, const float* const* x) {
      if (pair_tiles_) {
        add_tile_rows<decltype(rows)::value, true>(a, x, 1, v0, v1, dp_, w_ / 2);
      } else {
        add_tile_rows<decltype(rows)::value, false>(a, x, 1, v0, v1, dp_, w_);
      }
    };
    int n = 0;
    for (; blocked != 0; blocked &= blocked - 1) {
      const int i = hwy::Num0BitsBelowLS1Bit_Nonzero32(blocked);
      acc[n] = ws.acc.ptr + static_cast<std::int64_t>(i) * dp_;
      w[n] = pair_tiles_ ? ws.comp_val.ptr + static_cast<std::int64_t>(i) * this->comp_stride()
                         : ws.s.ptr + static_cast<std::int64_t>(i) * w_;
      if (++n == kValueRows) {
        run(std::integral_constant<int, kValueRows>(), acc, w);
        n = 0;
      }
    }
    for (int r = 0; r < n; ++r) run(std::integral_constant<int, 1>(), acc + r, w + r);
#else
    (void)ws, (void)blocked, (void)j0;
#endif
  }

  /// AMX, every pattern: blocked_values on the tiles (amx::pv_tile), the weights rounded to bf16
  /// (amx::weights_to_pairs; the row sums keep the unrounded ones), value pairs from ws.vpair. The
  /// task's rows all go through the tiles: rows not in @p blocked (masked in this tile, or whose
  /// P V was done row by row) get zero weights, which leave their sums unchanged; rows in
  /// @p paired_amx have their pairs already (select_amx_pairs). (The rounding in
  /// Highway vector code, as bf16dot::pv_tile_rows does it, was 7% of a dense call's task samples;
  /// vcvtne2ps2bf16 rounds 32 weights in one instruction: causal L = 2048, d = 64, medians of 20
  /// interleaved calls 2.6-3.9% faster, 1 and 2 threads, dense and 1:2, the same output bits.)
  void blocked_values_amx(workspace& ws, std::uint32_t blocked, std::uint32_t paired_amx, std::int64_t j0) const {
#if DFSS_SIMD_AMX
    const int pairs = w_ / 2;
    int rows = 0;
    for (std::uint32_t bits = blocked; bits != 0; bits &= bits - 1) rows = hwy::Num0BitsBelowLS1Bit_Nonzero32(bits) + 1;
    rows = (rows + kMicroRows - 1) / kMicroRows * kMicroRows;  // within the task's configured rows_mk
    for (int i = 0; i < rows; ++i) {
      std::uint32_t* out = ws.p_amx.ptr + static_cast<std::int64_t>(i) * pairs;
      if ((blocked >> i & 1u) == 0) {
        std::fill(out, out + pairs, 0u);
      } else if ((paired_amx >> i & 1u) == 0) {
        amx::weights_to_pairs(ws.s.ptr + static_cast<std::int64_t>(i) * w_, pairs, out);
      }
    }
    amx::pv_tile(ws.p_amx.ptr, rows, pairs, ws.vpair.ptr + (j0 / 2) * dp_, dp_, ws.acc.ptr);
#else
    (void)ws, (void)blocked, (void)paired_amx, (void)j0;
#endif
  }

  /// avx3_bf16, dense: blocked_values with bf16 dot products (bf16dot::pv_tile_rows: the weights
  /// rounded to bf16, key pairs from ws.vpair), bf16dot::kTileRows rows per call.
  void blocked_values_bf16(workspace& ws, std::uint32_t blocked, std::int64_t j0) const {
#if DFSS_SIMD_BF16_DOT
    const std::uint32_t* v = ws.vpair.ptr + (j0 / 2) * dp_;
    float* acc[bf16dot::kTileRows];
    const float* w[bf16dot::kTileRows];
    int n = 0;
    for (; blocked != 0; blocked &= blocked - 1) {
      const int i = hwy::Num0BitsBelowLS1Bit_Nonzero32(blocked);
      acc[n] = ws.acc.ptr + static_cast<std::int64_t>(i) * dp_;
      w[n] = ws.s.ptr + static_cast<std::int64_t>(i) * w_;
      if (++n == bf16dot::kTileRows) {
        bf16dot::pv_tile_rows(acc, n, dp_, w, v, w_ / 2);
        n = 0;
      }
    }
    if (n > 0) bf16dot::pv_tile_rows(acc, n, dp_, w, v, w_ / 2);
#else
    (void)ws, (void)blocked, (void)j0;
#endif
  }

  // The three steps the avx3_bf16 forward does with bf16 dot products (bf16_dot.hpp); every other
  // instance, and avx3_bf16 on f32 and f16 inputs, runs the fp32 code.

  /// Packs keys [k0, k1) of K and V of (batch b, kv head hk) into the thread's scratch.
  void pack(workspace& ws, std::int64_t b, std::int64_t hk, std::int64_t k0, std::int64_t k1) const {
    const bool fresh = !this->is_packed(ws, b, hk, k0);
    const std::int64_t keys = std::min(k1, p_.seqlen_k);
#if DFSS_SIMD_BF16_DOT
    if (dot_) {
      this->pack_head_bf16(ws, b, hk, k0, k1);
      if (dense_tiles_ && fresh) {
        // blocked_values_bf16's key pairs (rows past the keys are zero).
        float* rows = ws.pack.ptr;
        for (std::int64_t g = k0 / 2; 2 * g < keys; ++g) {
          this->load_row(p_.v, p_.v_stride, b, 2 * g, hk, true, rows);
          this->load_row(p_.v, p_.v_stride, b, 2 * g + 1, hk, 2 * g + 1 < p_.seqlen_k, rows + dp_);
          bf16dot::pack_value_pair(rows, rows + dp_, dp_, ws.vpair.ptr + g * dp_);
        }
      }
      return;
    }
#endif
    this->pack_head(ws, b, hk, k0, k1);
    if (amx_ && fresh) pack_keys_amx(ws, k0, k1);
    if (amx_pv_ && fresh) pack_value_pairs_amx(ws, k0, k1);
    if (pair_tiles_ && fresh) {
      // blocked_values' odd keys of 1:2 pairs: V row 2 g + 1 negated, as row g of ws.vn.
      const DF d;
      for (std::int64_t g = k0 / 2; 2 * g + 1 < keys; ++g) {
        const float* src = ws.vp.ptr + (2 * g + 1) * dp_;
        for (int c = 0; c < dp_; c += lanes_) hn::Store(hn::Neg(hn::Load(d, src + c)), d, ws.vn.ptr + g * dp_ + c);
      }
    }
  }

  /// avx3_bf16: row @p i of the query tile (already in fp32 in ws.q) as bf16 column pairs.
  void pack_query_row(workspace& ws, const float* q, int i) const {
#if DFSS_SIMD_BF16_DOT
    bf16dot::pack_query_row(q + i * dp_, dp_, ws.qb.ptr + i * (dp_ / 2));
#else
    (void)ws, (void)q, (void)i;
#endif
  }

  /// S = Q K^T of the task's query tile (@p rows_mk rows with the zero padding) and the key
  /// tile at @p j0, into ws.s.
  /// The fp32 product stops at the panel that holds key tile_end - 1, the last key any row of the
  /// task sees: the causal diagonal's tile is computed only up to the task's last row (on average
  /// half a tile less per task; 6% of the causal Q K^T at L = 2048 with 128-key tiles). Scores past
  /// it are never read: every row masks them to -inf first (bias_and_mask).
  void scores(workspace& ws, int rows_mk, std::int64_t j0, std::int64_t tile_end) const {
#if DFSS_SIMD_BF16_DOT
    if (dot_) return bf16dot::qk_tile(ws.qb.ptr, rows_mk, dp_, ws.kb.ptr, j0, w_, ws.s.ptr);
#endif
    const std::int64_t visible = (tile_end - j0 + panel_ - 1) / panel_ * panel_;
    const int width = static_cast<int>(std::min<std::int64_t>(w_, visible));
#if DFSS_SIMD_AMX
    if (amx_ && !ws.risky) {
      const std::int64_t panel_at = (j0 / panel_) * (dp_ / 2) * panel_;
      amx::qk_tile(ws.q_amx.ptr, rows_mk, dp_, ws.k_amx.ptr + panel_at, width, w_, ws.s.ptr);
      return;
    }
#endif
    this->tile_product(ws.q.ptr, rows_mk, ws.kt.ptr, j0, ws.s.ptr, width);
  }

  // The Q K^T on AMX tiles (amx_tiles.hpp): packing, and the settling of near ties.

  /// The thread's AMX tiles configured for @p rows rows (amx::configure), and released.
  static void amx_configure(int rows) {
#if DFSS_SIMD_AMX
    amx::configure(rows);
#else
    (void)rows;
#endif
  }
  static void amx_release() {
#if DFSS_SIMD_AMX
    amx::release();
#endif
  }

  /// Sizes the AMX scratch (after reserve).
  void reserve_amx(workspace& ws) const {
    const auto panels = static_cast<std::size_t>((this->lk_pad_ / panel_) * (dp_ / 2) * panel_);
    const auto rows = static_cast<std::size_t>(kRowsPerTask * dp_ / 2);
    ws.k_amx.resize(panels);
    ws.q_amx.resize(rows);
    ws.q_amx_c1.resize(kRowsPerTask);
    ws.q_amx_c0.resize(kRowsPerTask);
    if (amx_pv_) {
      ws.p_amx.resize(static_cast<std::size_t>(kRowsPerTask * w_ / 2));
      ws.vpair.resize(static_cast<std::size_t>((this->lk_pad_ / 2 + 1) * dp_));
    }
    if (sparse_) {
      ws.k_amx_l1.resize(static_cast<std::size_t>(this->lk_pad_));
      ws.k_amx_l2.resize(static_cast<std::size_t>(this->lk_pad_));
    }
  }

  /// Keys [k0, k1) of the fp32 panels (pack_head; bf16 values, so the low 16 bits are zero) as
  /// panels of column pairs (column c in the low half, c + 1 in the high one), the largest |k|, and
  /// with a selecting pattern each key's sum of |k_c| (in fp32, so at least (1 - gamma(u)) times
  /// the exact sum) and its norm_bound (near_tie_bound).
  void pack_keys_amx(workspace& ws, std::int64_t k0, std::int64_t k1) const {
#if DFSS_SIMD_AMX
    static_assert(2 * HWY_LANES(float) == amx::kPanel, "the AVX3 panel is two 16-key tiles");
    const DF d;
    const hn::RebindToUnsigned<DF> du;
    VF top = hn::Zero(d), l1_total = hn::Zero(d), l2_total = hn::Zero(d);
    const VF slack = hn::Set(d, norm_slack());
    for (std::int64_t blk = k0 / panel_; blk < k1 / panel_; ++blk) {
      const float* src = ws.kt.ptr + blk * dp_ * panel_;
      const std::int64_t at = blk * (dp_ / 2) * panel_;
      VF l1[2] = {hn::Zero(d), hn::Zero(d)}, l2[2] = {hn::Zero(d), hn::Zero(d)};
      for (int c = 0; c < dp_; c += 2) {
        for (int t = 0; t < panel_; t += lanes_) {
          const VF lo = hn::Load(d, src + c * panel_ + t), hi = hn::Load(d, src + (c + 1) * panel_ + t);
          const VF mag = hn::Max(hn::Abs(lo), hn::Abs(hi));
          top = hn::Max(top, mag);
          l1[t / lanes_] = hn::Add(l1[t / lanes_], hn::Add(hn::Abs(lo), hn::Abs(hi)));
          l2[t / lanes_] = hn::MulAdd(hi, hi, hn::MulAdd(lo, lo, l2[t / lanes_]));
          const auto pair = hn::Or(hn::ShiftRight<16>(hn::BitCast(du, lo)), hn::BitCast(du, hi));
          hn::Store(pair, du, ws.k_amx.ptr + at + (c / 2) * panel_ + t);
        }
      }
      if (sparse_) {
        hn::Store(l1[0], d, ws.k_amx_l1.ptr + blk * panel_);
        hn::Store(l1[1], d, ws.k_amx_l1.ptr + blk * panel_ + lanes_);
        const VF n0 = hn::Sqrt(hn::Add(l2[0], slack)), n1 = hn::Sqrt(hn::Add(l2[1], slack));
        hn::Store(n0, d, ws.k_amx_l2.ptr + blk * panel_);
        hn::Store(n1, d, ws.k_amx_l2.ptr + blk * panel_ + lanes_);
        l1_total = hn::Add(l1_total, hn::Add(l1[0], l1[1]));
        l2_total = hn::Add(l2_total, hn::Add(n0, n1));
      }
    }
    ws.k_amx_max = hn::GetLane(hn::MaxOfLanes(d, top));
    ws.k_amx_l1_total = hn::GetLane(hn::SumOfLanes(d, l1_total));
    ws.k_amx_l2_total = hn::GetLane(hn::SumOfLanes(d, l2_total));
#else
    (void)ws, (void)k0, (void)k1;
#endif
  }

  /// Values [k0, k1) of the fp32 rows (pack_head; bf16 values) as pairs of keys for
  /// blocked_values_amx: column c of keys 2g and 2g + 1 in one word, 2g in the low half.
  void pack_value_pairs_amx(workspace& ws, std::int64_t k0, std::int64_t k1) const {
    const DF d;
    const hn::RebindToUnsigned<DF> du;
    for (std::int64_t g = k0 / 2; g < k1 / 2; ++g) {
      const float* even = ws.vp.ptr + 2 * g * dp_;
      for (int c = 0; c < dp_; c += lanes_) {
        const auto lo = hn::ShiftRight<16>(hn::BitCast(du, hn::Load(d, even + c)));
        hn::Store(hn::Or(lo, hn::BitCast(du, hn::Load(d, even + dp_ + c))), du, ws.vpair.ptr + g * dp_ + c);
      }
    }
  }

  /// The task's query rows (fp32 in ws.q, bf16 values) as column pairs, and with a selecting pattern
  /// each row's near-tie bound (near_tie_bound, from its largest |q| and its norm_bound).
  void pack_query_amx(workspace& ws, int rows_mk) const {
    ws.q_amx_by_norms = 0;
    for (int i = 0; i < rows_mk; ++i) {
      const float* q = ws.q.ptr + static_cast<std::int64_t>(i) * dp_;
      std::uint32_t* out = ws.q_amx.ptr + static_cast<std::int64_t>(i) * (dp_ / 2);
      float top = 0.0f;
      for (int c = 0; c < dp_; c += 2) {
        out[c / 2] = (std::bit_cast<std::uint32_t>(q[c]) >> 16) | std::bit_cast<std::uint32_t>(q[c + 1]);
        top = std::max(top, std::max(std::abs(q[c]), std::abs(q[c + 1])));
      }
      if (sparse_) {
        // Once per row and task (after the head's pack_keys_amx, which gives max|k|), not per row
        // and tile in select_amx: causal bf16, L = 2048 and 4096, d = 64 and 128, 2 threads, 7
        // interleaved rounds (tools/bench/compare_builds.sh): 1:2 and 2:4 0.95-0.99x the time.
        // The squares by vectors, then across the lanes (norm_bound's sum), not one scalar chain
        // of dp dependent FMAs per row.
        const DF d;
        VF squares = hn::Zero(d);
        for (int c = 0; c < dp_; c += lanes_) {
          const VF x = hn::Load(d, q + c);
          squares = hn::MulAdd(x, x, squares);
        }
        const float q_norm = std::sqrt(hn::GetLane(hn::SumOfLanes(d, squares)) + norm_slack());
        const tie_bound tb = near_tie_bound(ws, top, q_norm);
        ws.q_amx_c1.ptr[i] = tb.c1;
        ws.q_amx_c0.ptr[i] = tb.c0;
        if (tb.keys == ws.k_amx_l2.ptr) ws.q_amx_by_norms |= 1u << i;
      }
    }
  }

  /// select_amx's bound of key j's score difference, c1 X_j + c0 (key_bounds), for a row whose
  /// largest |q| is @p q_top and whose norm_bound is @p q_norm, against the packed keys of @p ws.
  /// sum_c |q_c k_c| is at most max|q| sum_c |k_c| and at most ||q|| ||k|| (Cauchy-Schwarz); on
  /// Gaussian rows the first is about 3.4 times the sum (d = 64 and 128), the second 1.6 times,
  /// but a row with one large |q_c| favours the first. Per row, the one smaller over the packed
  /// keys (their totals): X_j = K1_j (ws.k_amx_l1) and c1 = c1' max|q|, or X_j = N_j (ws.k_amx_l2,
  /// norm_bound) and c1 = c1' N_q / (1 - (dp + 3) u). Either bounds the difference; which one only
  /// decides how many groups are rescored (and is a function of the row and the packed keys, so
  /// the same for any thread count). The minimum of both per key took 1.01-1.09x the time of
  /// this (1:2, bf16, causal, d = 64, L = 2048, 2 threads, three alternating runs): the
  /// selection loop is a few instructions per vector, and the minimum adds a load, a multiply and
  /// a minimum to it. c0 = z + d 2^-149 (select_amx). c1' and c0 are enlarged by 2^-18, which covers the
  /// fp32 rounding of E and of the comparisons made with it.
  struct tie_bound {
    float c1, c0;
    const float* keys;  ///< X: ws.k_amx_l1 or ws.k_amx_l2
  };
  tie_bound near_tie_bound(const workspace& ws, float q_top, float q_norm) const {
    const double dd = static_cast<double>(d_), margin = 1.0 + 0x1p-18;
    const double q_max = static_cast<double>(q_top);
    const double z = dd * 0x1p-126 * (q_max + static_cast<double>(ws.k_amx_max) + 1.0);
    const auto c0 = static_cast<float>((tie_c1_ * z + z + dd * 0x1p-149) * margin);
    const double by_sum = tie_c1_ * q_max;
    // norm_bound: ||q|| ||k|| <= N_q N_k / (1 - u)^(dp + 3) <= N_q N_k / (1 - (dp + 3) u) (tie_norms_).
    const double by_norms = tie_c1_ * tie_norms_ * static_cast<double>(q_norm);
    if (by_norms * static_cast<double>(ws.k_amx_l2_total) < by_sum * static_cast<double>(ws.k_amx_l1_total)) {
      return {static_cast<float>(by_norms), c0, ws.k_amx_l2.ptr};
    }
    return {static_cast<float>(by_sum), c0, ws.k_amx_l1.ptr};
  }

  /// near_tie_bound's c1 = (gamma(2u) + gamma(u)) / (1 - gamma(u)) for head dim @p d, with the margin.
  static double tie_c1(int d) {
    const double u = 0x1p-24, dd = static_cast<double>(d), margin = 1.0 + 0x1p-18;
    const double gamma_a = dd * 2.0 * u / (1.0 - dd * 2.0 * u), gamma_f = dd * u / (1.0 - dd * u);
    return (gamma_a + gamma_f) / (1.0 - gamma_f) * margin;
  }

  /// What norm_bound adds to a sum of squares before its square root: 2 dp 2^-126. A vector x's
  /// norm bound is N = fl(sqrt(fl(S + 2 dp 2^-126))), S its dp squares summed in fp32 by FMAs and
  /// additions at most dp deep (a chain over the columns in pack_keys_amx; lanes, then across
  /// them, in pack_query_amx). Each step of S loses at most u of its sum or, where the sum
  /// or an operand falls below 2^-126 (flushed or read as 0 under FTZ / DAZ, which the caller may
  /// have set), at most 2 2^-126; so S >= (1 - u)^dp ||x||^2 - 2 dp 2^-126, and with the addition
  /// and the square root rounded, N >= (1 - u)^((dp + 3) / 2) ||x||. Values are tame (at most
  /// 2^50: row_is_tame), so no sum of squares overflows.
  float norm_slack() const { return static_cast<float>(2.0 * static_cast<double>(dp_) * 0x1p-126); }

  /// select_amx's bound E (near_tie_bound) of the vector of keys from @p j (a packed key index) for
  /// the row whose bound is @p tb.
  static HWY_INLINE VF key_bounds(const tie_bound& tb, std::int64_t j) {
    const DF d;
    return hn::MulAdd(hn::Set(d, tb.c1), hn::Load(d, tb.keys + j), hn::Set(d, tb.c0));
  }

  /// Row @p r's tie_bound (pack_query_amx).
  static tie_bound row_bound(const workspace& ws, int r) {
    return {ws.q_amx_c1.ptr[r], ws.q_amx_c0.ptr[r], (ws.q_amx_by_norms >> r) & 1u ? ws.k_amx_l2.ptr : ws.k_amx_l1.ptr};
  }

  /// The selection of a row of a tile scored on AMX tiles (@p r its row in the task, @p s its masked
  /// scores; without @p Prune only the settling below, the scores left for compact), made the fp32
  /// micro-kernel's (so the selection of every other CPU kernel, and of the
  /// fused backward, which recomputes it in fp32), in place as select_in_place leaves it; returns
  /// the tile's largest score. With A = sum_c |q_c k_c|, u = 2^-24 and
  /// gamma(x) = d x / (1 - d x): an AMX score is within gamma(2u) A + z of the exact dot product,
  /// z = d 2^-126 (max|q| + max|k| + 1) (amx_tiles.hpp's assumption: at most d additions within 2u,
  /// denormal operands read as 0, denormal sums flushed), the micro-kernel's within gamma(u) A +
  /// d 2^-149. So an AMX score and the micro-kernel's score of the same key differ by at most E =
  /// c1 max|q| K1 + z + d 2^-149 and at most c1 ||q|| ||k|| + z + d 2^-149 (near_tie_bound picks
  /// one per row; key_bounds), with K1 the key's computed sum of |k_c| (ws.k_amx_l1), the norms
  /// bounded from above through norm_bound (ws.k_amx_l2) and c1 = (gamma(2u) + gamma(u)) /
  /// (1 - gamma(u)). Where every kept key i of a
  /// group and every pruned one j are apart by more than E_i + E_j, the micro-kernel keeps the same
  /// keys. A group where they are not (a near tie: rare on real data, every tie of integer inputs)
  /// gets its scores recomputed in the micro-kernel's order, bitwise (fused_order_scores), and is
  /// selected again. Masked keys (-inf) are never near: the micro-kernel masks them alike.
  ///
  /// Measured (2 threads, causal bf16, L = 2048, d = 64, random normal inputs): with the cruder A <=
  /// d max|q| max|k| settling was 22% of a 2:4 call and 2:4 slower than without AMX; with A from a
  /// second tile product of |Q| and |K| (tighter still) the product and the pass cost more than this
  /// per-key bound does. Checked by Cpu.AmxKeepsTheFp32Selection (which fails with the settling
  /// removed), Cpu.NearTiesAsFarApartAsTheBoundsAllowFollowTheFusedOrder (which fails with either
  /// of near_tie_bound's two bounds divided by 6) and by the CPU tests, which run with AMX wherever
  /// the CPU has it. Against max|q| K1 alone, choosing the norms' bound where it is smaller took
  /// 0.93-0.99x the time (1:2 and 2:4, causal bf16, L = 2048 and 4096, d = 64 and 128, 2 threads,
  /// 5 rounds of tools/bench/compare_builds.sh; the most at d = 128, L = 4096).
  template <bool Prune = true>
  float select_amx(workspace& ws, int r, std::int64_t j0, float* s, const mask::whole_groups& whole) const {
#if DFSS_SIMD_AMX
    const auto j = static_cast<std::int32_t>(j0);
    if (!sparse_) return Prune ? this->select_in_place(s, j, whole) : 0.0f;
    const tie_bound tb = row_bound(ws, r);
    if (this->pairs_in_vectors(j, whole)) {
      return p_.pattern_m == 2 ? select_amx_vectors<2, Prune>(ws, r, j0, s, tb)
                               : select_amx_vectors<4, Prune>(ws, r, j0, s, tb);
    }
    // Other N:M, and tiles with groups kept whole: every pair of a group compared (-inf against
    // anything gives inf or NaN: never near), then select_in_place.
    const int m = p_.pattern_m;
    const float* x = tb.keys + j0;
    const auto bound = [&](int key) { return tb.c1 * x[key] + tb.c0; };
    for (int g = 0; g < w_; g += m) {
      bool near = false;
      for (int a = g; a < g + m && !near; ++a) {
        for (int b = a + 1; b < g + m && !near; ++b) near = std::abs(s[a] - s[b]) <= bound(a) + bound(b);
      }
      if (near) settle_group(ws, r, s, j0, g, g + m);
    }
    return Prune ? this->select_in_place(s, j, whole) : 0.0f;
#else
    (void)ws, (void)r;
    return Prune ? this->select_in_place(s, static_cast<std::int32_t>(j0), whole) : 0.0f;
#endif
  }

  /// select_amx for 1:2 (M = 2) or 2:4 (M = 4) tiles without whole groups, a vector at a time. A
  /// group is near where its kept and pruned scores are apart by at most twice the largest bound
  /// of its keys (1:2: the sum of the pair's bounds): the N-th and (N+1)-th largest scores, b_N and
  /// b_N+1, with b_N - b_N+1 > 2 max E ranks every kept key above every pruned one in the
  /// micro-kernel too. A group that is not near has no tie at its boundary, so x >= b_N is its kept
  /// set (and its -inf keys, if fewer than N are finite: zero weights either way), without
  /// pruned_lanes' tie rules; a near group takes the micro-kernel's scores and pruned_lanes.
  /// Measured (one thread, causal bf16, L = 2048, d = 64, medians of 12 interleaved calls): with a
  /// pass of its own before the masking, comparing every pair of a group (the near groups rescored
  /// key by key), then pruned_lanes, 1:2 took 49.7 and 2:4 92 ms (the pass alone 15% of a 2:4
  /// call's samples); as here 47.2 and 63.4 ms; dense 54.8 (the machine's noise: minimums 47.5,
  /// 62.0 / 45.0, 52.6 / 41.5 ms).
  template <int M, bool Prune>
  float select_amx_vectors(workspace& ws, int r, std::int64_t j0, float* s, tie_bound tb) const {
#if DFSS_SIMD_AMX
    const DF d;
    const VF neg_inf = hn::Set(d, -std::numeric_limits<float>::infinity());
    VF vmax = neg_inf;
    for (int t = 0; t < w_; t += lanes_) {
      VF x = hn::Load(d, s + t);
      const auto pruned = settle_vector<M>(ws, r, j0, t, key_bounds(tb, j0 + t), x);
      vmax = hn::Max(vmax, x);
      hn::Store(Prune ? hn::IfThenElse(pruned, neg_inf, x) : x, d, s + t);
    }
    return hn::GetLane(hn::MaxOfLanes(d, vmax));
#else
    (void)ws, (void)r, (void)j0, (void)s, (void)tb;
    return 0.0f;
#endif
  }

  /// select_amx_vectors' selection of the vector of row @p r's scores @p x from key @p t of the
  /// tile at @p j0, whose keys' bounds are @p e: returns the lanes it prunes, and leaves in @p x
  /// the micro-kernel's scores of its near groups (their finite keys).
  template <int M>
  HWY_INLINE hn::Mask<DF> settle_vector(const workspace& ws, int r, std::int64_t j0, int t, VF e, VF& x) const {
    const DF d;
    const VF xs = hn::Shuffle2301(x);
    VF gap, bound, kept_min;
    if constexpr (M == 2) {
      gap = hn::Sub(x, xs);
      bound = hn::Add(e, hn::Shuffle2301(e));
      kept_min = hn::Max(x, xs);
    } else {
      // Per pair its larger and smaller score; b_2 and b_3 are the larger and the smaller of
      // (the smaller of the two larger ones) and (the larger of the two smaller ones).
      const VF hi = hn::Max(x, xs), lo = hn::Min(x, xs);
      const VF a = hn::Min(hi, hn::Shuffle1032(hi)), b = hn::Max(lo, hn::Shuffle1032(lo));
      gap = hn::Sub(a, b);
      const VF e2 = hn::Max(e, hn::Shuffle2301(e));
      const VF e4 = hn::Max(e2, hn::Shuffle1032(e2));
      bound = hn::Add(e4, e4);
      kept_min = hn::Max(a, b);
    }
    // (-inf against anything gives a gap of inf or NaN: never near.)
    const auto near = hn::Le(hn::Abs(gap), bound);
    if (hn::AllFalse(d, near)) return hn::Lt(x, kept_min);
    // The near groups' keys (their finite ones) take the micro-kernel's scores.
    x = hn::IfThenElse(hn::And(near, hn::Gt(x, hn::Set(d, -std::numeric_limits<float>::infinity()))),
                       fused_order_scores(ws, r, j0 + t), x);
    return base::template pruned_lanes<M>(x, base::partner_first(1), base::partner_first(2));
  }

  /// select_amx for a 1:2 tile without whole groups, compacted: for each pair of keys of row @p r's
  /// scores @p s, its kept score in @p cv (pair order) and in @p shift 0 where the even key is kept,
  /// 16 where the odd one is (its half of a bf16 pair); returns the tile's largest score. The same
  /// kept keys as select_amx_vectors<2> (a pair both of whose keys are masked keeps -inf: a zero
  /// weight either way). Against select_amx_vectors and the exponentials of the whole tile (causal
  /// bf16, 5 interleaved rounds of tools/bench/compare_builds.sh): 0.93-0.97x the time at d = 64,
  /// 1.00x at d = 128 (docs/design.md, "AMX tiles for the bf16 forward").
  HWY_INLINE float select_amx_pairs(workspace& ws, int r, std::int64_t j0, const float* s, float* cv,
                                    std::int32_t* shift) const {
#if DFSS_SIMD_AMX
    const DF d;
    const DI di;
    const tie_bound tb = row_bound(ws, r);
    const VI half = hn::Set(di, 16), none = hn::Zero(di);
    VF vmax = hn::Set(d, -std::numeric_limits<float>::infinity());
    // Per vector of keys from t: each even lane's kept score, and its shift.
    const auto select = [&](int t, VF& kept, VI& sh) {
      VF x = hn::Load(d, s + t);
      // Even lanes: whether the even key is pruned, so the odd one kept.
      const auto odd = settle_vector<2>(ws, r, j0, t, key_bounds(tb, j0 + t), x);
      kept = hn::IfThenElse(odd, hn::Shuffle2301(x), x);
      sh = hn::IfThenElse(hn::RebindMask(di, odd), half, none);
    };
    for (int t = 0; t < w_; t += 2 * lanes_) {
      VF k0, k1v;
      VI s0, s1;
      select(t, k0, s0);
      select(t + lanes_, k1v, s1);
      vmax = hn::Max(vmax, hn::Max(k0, k1v));
      hn::Store(hn::ConcatEven(d, k1v, k0), d, cv + t / 2);
      hn::StoreU(hn::ConcatEven(di, s1, s0), di, shift + t / 2);
    }
    return hn::GetLane(hn::MaxOfLanes(d, vmax));
#else
    (void)ws, (void)r, (void)j0, (void)s, (void)cv, (void)shift;
    return 0.0f;
#endif
  }

  /// Row @p r's scores of the vector of keys from @p j (a multiple of the vector length) in the
  /// fp32 micro-kernel's order, bitwise its scores: per lane one MulAdd per padded column, in
  /// increasing order, from zero (a dependent chain: a whole vector costs what one key would).
  VF fused_order_scores(const workspace& ws, int r, std::int64_t j) const {
    const DF d;
    const float* q = ws.q.ptr + static_cast<std::int64_t>(r) * dp_;
    const float* kt = ws.kt.ptr + (j / panel_) * dp_ * panel_ + j % panel_;
    VF acc = hn::Zero(d);
    for (int c = 0; c < dp_; ++c) acc = hn::MulAdd(hn::Set(d, q[c]), hn::Load(d, kt + c * panel_), acc);
    return acc;
  }

  /// The scores of keys [g0, g1) of the tile at @p j0 in row @p r, where not masked (-inf),
  /// recomputed in the fp32 micro-kernel's order (fused_order_scores of the vectors they lie in).
  void settle_group(const workspace& ws, int r, float* s, std::int64_t j0, int g0, int g1) const {
    const DF d;
    HWY_ALIGN float fresh[hn::MaxLanes(d)];
    for (int v0 = g0 / lanes_ * lanes_; v0 < g1; v0 += lanes_) {
      hn::Store(fused_order_scores(ws, r, j0 + v0), d, fresh);
      for (int k = std::max(g0, v0); k < std::min(g1, v0 + lanes_); ++k) {
        if (s[k] != -std::numeric_limits<float>::infinity()) s[k] = fresh[k - v0];
      }
    }
  }

  /// acc += p * V[offset] over the @p kept compacted weights @p cv and V element offsets @p ci.
  /// avx3_bf16: p rounded to bf16 and V in bf16 (the row sum keeps the unrounded p, as GPU flash
  /// attention does; docs/semantics.md, "Precision").
  HWY_INLINE void values(workspace& ws, float* acc, int kept, const float* cv, const std::int32_t* ci) const {
#if DFSS_SIMD_BF16_DOT
    if (dot_) return bf16dot::pv_row(acc, dp_, kept, cv, ci, ws.vb.ptr);
#endif
    const float* vp = ws.vp.ptr;
    add_row_combination(
        acc, dp_, kept, [cv](int t) { return cv[t]; }, [vp, ci](int t) { return vp + ci[t]; });
  }
};

status forward_entry(const attention_params& p, simd_target t) {
  const bool dot = t == simd_target::avx3_bf16;
  // int32 offsets would overflow: the scalar twin (with the key tile the call will use).
  const int tile = p.input_type == dtype::bf16 ? forward_pass<bfloat16>::min_tile(p, dot)
                                                : forward_pass<float>::min_tile(p, false);
  if (!kernel<float>::fits_int32(p, tile)) return fused_forward_scalar(p);
  return run_pass<forward_pass>(p, "dfss cpu simd fused forward", dot);
}

#else  // the static baseline target: never dispatched to (see targets.hpp)

DFSS_SIMD_BASELINE_ENTRY(forward_entry, "dfss cpu simd fused forward")

#endif  // DFSS_SIMD_KERNEL_TARGET

}  // namespace dfss::cpu::simd::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
#include "cpu/simd/dispatch.hpp"

namespace dfss::cpu {
DFSS_SIMD_EXPORT_ENTRY(forward_entry, fused_forward_simd, "dfss cpu simd fused forward")

}  // namespace dfss::cpu
#endif  // HWY_ONCE
