// The fused DFSS backward over Google Highway, compiled once per SIMD target like the forward
// (attention_forward.cpp) and dispatched to the target the caller names.
//
// One task per (batch, kv head) packs K (panels and rows) and V (rows and V^T panels) once, then
// for each query head of the group, each 32-row query tile and each key tile recomputes S with the
// forward's micro-kernel and selects with the forward's bias_and_mask and compact
// (kernel_parts-inl.h), so it keeps exactly the keys the forward on the same target kept.
// dP = dO V^T runs on the same micro-kernel over V^T panels (on AVX-512, a 1:2 tile's dP only at
// each row's kept keys: pair_dp, between the rows' selection and their gradients); P =
// exp(scale S - LSE) from the forward's LSE, or, for a row with |LSE| > kDirectLseLimit (huge
// scores, or LSE +-inf because scale * max overflowed fp32), from the row's own maximum m and sum
// l recomputed with the forward's code: P = exp(scale (S - m)) / l. dS = P (dP - D) with
// D = rowsum(dO O). Entries with P = 0 (masked keys, padding, underflow) are dropped, not
// multiplied by 0, so a NaN or inf in a masked key's K, V or dP reaches no gradient. The products
// touch only kept entries:
//   dQ += scale dS K: per query row, a combination of the kept keys' K rows (dQ row in registers);
//   dV += P^T dO, dK += scale dS^T Q: the row pass writes each kept entry's P and scaled dS into a
//     key-major block [key tile][32 rows]; then per key, the rows with P != 0 are combined with the
//     key's dK and dV rows in registers, each read and written once per (row tile, key tile).
// Accumulation order is fixed (heads of the group, then row tiles, then rows within a key's mask),
// so gradients are bitwise identical for any thread count. dBias is written per kept entry; when it
// broadcasts over the batch or the heads, one task owns every (batch, kv head) that adds into the
// same dBias slice and visits them in a fixed order (a 16-bit dBias is summed in fp32 scratch and
// rounded once).
#include "cpu/simd/targets.hpp"  // first: it fixes the compiled targets

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "cpu/simd/attention_backward.cpp"
#include "hwy/foreach_target.h"  // IWYU pragma: keep

#include "cpu/simd/kernel_parts-inl.h"

HWY_BEFORE_NAMESPACE();
namespace dfss::cpu::simd::HWY_NAMESPACE {

#if DFSS_SIMD_KERNEL_TARGET

template <typename T>
class backward_pass : public kernel<T> {
 public:
  using base = kernel<T>;
  explicit backward_pass(const attention_params& p)
      : base(p),
        dense_tiles_(!HWY_HAVE_SCALABLE && p.pattern_n == p.pattern_m),
        pair_slots_(p.pattern_n == 1 && p.pattern_m == 2) {}

  /// One task per (batch, kv head), or per group of them when dBias broadcasts over the batch or
  /// the heads: a task then owns every (batch, kv head) that adds into the same dBias entries and
  /// visits them in a fixed order (deterministic, no atomics).
  void run() const {
    const bool dbias_over_b = p_.dbias != nullptr && p_.dbias_stride[0] == 0 && p_.batch > 1;
    const bool dbias_over_h = p_.dbias != nullptr && p_.dbias_stride[1] == 0 && p_.heads > 1;
    const std::int64_t task_b = dbias_over_b ? 1 : p_.batch, task_hk = dbias_over_h ? 1 : p_.heads_kv;
    // A shared 16-bit dBias is summed in fp32 scratch and rounded once, like the reference's single
    // rounding; f32 and f64 dBias are summed in place.
    const bool shared = dbias_over_b || dbias_over_h;
    const bool scratch = shared && p_.bias_type != dtype::f32 && p_.bias_type != dtype::f64;
    const std::int64_t slice = p_.seqlen_q * p_.seqlen_k;
    parallel_for(
        task_b * task_hk, p_.num_threads, schedule::contiguous,
        [&] {
          workspace& ws = worker_scratch<workspace>();
          this->reserve(ws, /*backward=*/true);
          if (scratch) ws.dbias_acc.resize(static_cast<std::size_t>((dbias_over_h ? 1 : group_) * slice));
        },
        [&](std::int64_t t) {
          workspace& ws = worker_scratch<workspace>();
          const std::int64_t tb = t / task_hk, thk = t % task_hk;
          // The scratch holds the task's dBias slices: one [Lq, Lk] slice, or (shared over the batch
          // only) one per head of the kv head's group, indexed from its first head.
          dbias_sink sink = direct_dbias_sink();
          if (scratch) {
            sink = {ws.dbias_acc.ptr, dtype::f32, {0, dbias_over_h ? 0 : slice, p_.seqlen_k, 1}, dbias_over_h ? 0 : thk * group_};
          }
          for (std::int64_t b = dbias_over_b ? 0 : tb; b < (dbias_over_b ? p_.batch : tb + 1); ++b) {
            for (std::int64_t hk = dbias_over_h ? 0 : thk; hk < (dbias_over_h ? p_.heads_kv : thk + 1); ++hk) {
              backward_task(ws, b, hk, sink, /*first_b=*/!dbias_over_b || b == 0);
            }
          }
          if (scratch) {
            for (std::int64_t g = 0; g < (dbias_over_h ? 1 : group_); ++g) {
              flush_dbias(ws.dbias_acc.ptr + g * slice, tb, dbias_over_h ? 0 : thk * group_ + g);
            }
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
  using base::lk_pad_;
  using base::p_;
  using base::panel_;
  using base::scale_;
  using base::w_;

  /// Where dBias goes: the output itself, or an fp32 [Lq, Lk] scratch for a shared 16-bit dBias.
  struct dbias_sink {
    void* base;
    dtype type;
    std::int64_t stride[4];  ///< [b, h, i, j]; 0 for a dimension that is summed over
    std::int64_t h0;         ///< first head held (the scratch holds a kv head group's heads)
    std::int64_t at(std::int64_t b, std::int64_t h, std::int64_t i, std::int64_t j) const {
      return b * stride[0] + (h - h0) * stride[1] + i * stride[2] + j * stride[3];
    }
  };

  dbias_sink direct_dbias_sink() const {
    return {p_.dbias, p_.bias_type, {p_.dbias_stride[0], p_.dbias_stride[1], p_.dbias_stride[2], p_.dbias_stride[3]}, 0};
  }

  /// Rounds the fp32 scratch sum of a shared dBias slice (batch b, head h unless broadcast) into dBias.
  void flush_dbias(const float* acc, std::int64_t b, std::int64_t h) const {
    const std::int64_t base = b * p_.dbias_stride[0] + h * p_.dbias_stride[1];
    for (std::int64_t i = 0; i < p_.seqlen_q; ++i) {
      for (std::int64_t j = 0; j < p_.seqlen_k; ++j) {
        core::store_from_double(p_.dbias, p_.bias_type, base + i * p_.dbias_stride[2] + j * p_.dbias_stride[3],
                                static_cast<double>(acc[i * p_.seqlen_k + j]));
      }
    }
  }

  /// dQ, dK, dV of (batch b, kv head hk), and its heads' dBias into @p sink: written by the first
  /// contributor to an entry (@p first_b and, for a dBias shared over heads, head 0), added after.
  void backward_task(workspace& ws, std::int64_t b, std::int64_t hk, const dbias_sink& sink, bool first_b) const {
    this->pack_head(ws, b, hk);
    for (std::int64_t j = 0; j <= lk_pad_; ++j) {
      this->load_row(p_.k, p_.k_stride, b, j, hk, j < p_.seqlen_k, ws.kr.ptr + j * dp_);
    }
    // V^T in panels like K, so that dP = dO V^T runs on the same micro-kernel as S = Q K^T
    // (contiguous stores, as in pack_head).
    for (std::int64_t blk = 0; blk < lk_pad_ / panel_; ++blk) {
      float* panel = ws.vt.ptr + blk * dp_ * panel_;
      const float* rows = ws.vp.ptr + blk * panel_ * dp_;
      for (int c = 0; c < dp_; ++c) {
        for (int key = 0; key < panel_; ++key) panel[c * panel_ + key] = rows[key * dp_ + c];
      }
    }
#if DFSS_SIMD_PAIR_DP
    if (pair_slots_) {
      // pair_dp's V^T: pair g's even key at [g / L][c][g % L] of the first half, its odd key in the
      // second half (lk_pad_ is a multiple of the panel, 2 L keys).
      const std::int64_t pairs = lk_pad_ / 2, half = pairs * dp_;
      const std::int64_t lanes = lanes_;
      for (std::int64_t g = 0; g < pairs; ++g) {
        float* even = ws.vt_pairs.ptr + (g / lanes) * dp_ * lanes + g % lanes;
        const float* v_even = ws.vp.ptr + 2 * g * dp_;
        for (int c = 0; c < dp_; ++c) {
          even[c * lanes] = v_even[c];
          even[half + c * lanes] = v_even[dp_ + c];
        }
      }
    }
#endif
    std::fill(ws.dk.ptr, ws.dk.ptr + (lk_pad_ + 1) * dp_, 0.0f);
    std::fill(ws.dv.ptr, ws.dv.ptr + (lk_pad_ + 1) * dp_, 0.0f);
    const std::int64_t q_tiles = (p_.seqlen_q + kRowsPerTask - 1) / kRowsPerTask;
    for (std::int64_t h = hk * group_; h < (hk + 1) * group_; ++h) {
      const bool first = first_b && (sink.stride[1] != 0 || h == 0);
      for (std::int64_t qt = 0; qt < q_tiles; ++qt) backward_tile(ws, b, h, qt * kRowsPerTask, sink, first);
    }
    // A NaN row's P and dS are NaN at the keys it kept (nan_row_keys), so its NaN reaches exactly
    // those keys' dK and dV, as in the reference.
    for (std::int64_t j = 0; j < p_.seqlen_k; ++j) {
      const float* dk = ws.dk.ptr + j * dp_;
      const float* dv = ws.dv.ptr + j * dp_;
      store_row_as(p_.dk, p_.output_type, core::offset4(p_.dk_stride, b, j, hk, 0), p_.dk_stride[3], d_, dk);
      store_row_as(p_.dv, p_.output_type, core::offset4(p_.dv_stride, b, j, hk, 0), p_.dv_stride[3], d_, dv);
    }
  }

  /// Query rows i0 .. i0 + 31 of head h: dQ written, dK and dV accumulated. Per row,
  /// P = exp2((scale (s - shift)) log2(e) - offset) with shift = 0 and offset = LSE log2(e) (the
  /// forward's LSE) while |LSE| <= kDirectLseLimit; for the other rows row_statistics first finds
  /// the row's maximum m and sum l: shift = m, offset = log2(l).
  void backward_tile(workspace& ws, std::int64_t b, std::int64_t h, std::int64_t i0, const dbias_sink& sink,
                     bool first) const {
    const int rows = static_cast<int>(std::min<std::int64_t>(kRowsPerTask, p_.seqlen_q - i0));
    const int rows_mk = (rows + kMicroRows - 1) / kMicroRows * kMicroRows;
    float* q = ws.q.ptr;
    float* dout = ws.dout.ptr;
    std::int64_t tile_end = 0;
    for (int i = 0; i < rows_mk; ++i) {
      this->load_row(p_.q, p_.q_stride, b, i0 + i, h, i < rows, q + i * dp_);
      this->load_row(p_.dout, p_.dout_stride, b, i0 + i, h, i < rows, dout + i * dp_);
    }
    std::uint32_t recompute = 0;  // bit i: row i needs its own maximum and sum
    for (int i = 0; i < rows; ++i) {
      float dsum = 0.0f;
      for (int c = 0; c < d_; ++c) {
        dsum += dout[i * dp_ + c] *
                static_cast<float>(core::load_as_double(p_.o, p_.o_type, core::offset4(p_.o_stride, b, i0 + i, h, c)));
      }
      // dS = P (dP - D + dLSE): a gradient of the LSE enters as D - dLSE.
      if (p_.dlse != nullptr) {
        dsum -= static_cast<float>(core::load_as_double(
            p_.dlse, p_.lse_type, b * p_.dlse_stride[0] + h * p_.dlse_stride[1] + (i0 + i) * p_.dlse_stride[2]));
      }
      ws.row_d.ptr[i] = dsum;
      const auto lse = static_cast<float>(core::load_as_double(
          p_.lse, p_.lse_type, b * p_.lse_stride[0] + h * p_.lse_stride[1] + (i0 + i) * p_.lse_stride[2]));
      ws.row_max.ptr[i] = 0.0f;
      ws.row_lse2.ptr[i] = lse * kLog2e;
      ws.row_nan.ptr[i] = lse != lse ? 1 : 0;
      const std::int64_t lim = this->key_limit(b, i0 + i);
      // LSE -inf is an empty row, or a row whose scale * max overflowed: only a row that sees a key
      // can be the latter.
      if (lse == lse && !(std::abs(lse) <= kDirectLseLimit) && lim > 0) recompute |= 1u << i;
      tile_end = std::max(tile_end, lim);
    }
    if (recompute != 0) row_statistics(ws, b, h, i0, rows_mk, tile_end, recompute);
    std::fill(ws.acc.ptr, ws.acc.ptr + rows * dp_, 0.0f);
    if (p_.dbias != nullptr && first) {
      for (int i = 0; i < rows; ++i) {
        for (std::int64_t j = 0; j < p_.seqlen_k; ++j) {
          core::store_from_double(sink.base, sink.type, sink.at(b, h, i0 + i, j), 0.0);
        }
      }
    }
    int kept[kRowsPerTask];
    for (std::int64_t j0 = 0; j0 < tile_end; j0 += w_) {
      this->tile_product(q, rows_mk, ws.kt.ptr, j0, ws.s.ptr);
      std::fill(ws.p_keys.ptr, ws.p_keys.ptr + w_ * kRowsPerTask, 0.0f);
      // Every row's selection first (kept[i] < 0: the row has no gradient here); then dP = dO V^T:
      // rows whose 1:2 tile is compacted one slot per pair only at their kept keys (pair_dp), the
      // others from the dense product.
      std::uint32_t paired = 0, other = 0;
      for (int i = 0; i < rows; ++i) {
        kept[i] = select_row(ws, b, h, i0 + i, i, j0, sink);
        if (kept[i] < 0) continue;
        if (kept[i] == kPairedRow) {
          paired |= 1u << i;
        } else {
          other |= 1u << i;
        }
      }
      if (other != 0 || (!DFSS_SIMD_PAIR_DP && paired != 0)) {
        this->tile_product(dout, rows_mk, ws.vt.ptr, j0, ws.dps.ptr);
      }
#if DFSS_SIMD_PAIR_DP
      if (paired != 0) pair_dp(ws, paired, j0);
#endif
      std::uint32_t blocked = 0;  // rows that keep the whole dense tile (backward_row)
      for (int i = 0; i < rows; ++i) {
        if (kept[i] >= 0) backward_row(ws, b, h, i0 + i, i, j0, kept[i], sink, first, blocked);
      }
      if (blocked != 0) blocked_dq(ws, blocked, j0);
      if (blocked == (rows == 32 ? ~0u : (1u << rows) - 1u)) {
        whole_tile_dk_dv(ws, j0, rows);
      } else {
        if (blocked != 0) to_key_major(ws, blocked);
        accumulate_dk_dv(ws, j0);
      }
    }
    const float nan = std::numeric_limits<float>::quiet_NaN();
    for (int i = 0; i < rows; ++i) {
      const bool is_nan = ws.row_nan.ptr[i] != 0;
      const float* dq = ws.acc.ptr + static_cast<std::int64_t>(i) * dp_;
      const std::int64_t off = core::offset4(p_.dq_stride, b, i0 + i, h, 0);
      if (is_nan) {
        core::store_row_from_float(p_.dq, p_.output_type, off, p_.dq_stride[3], d_, [nan](int) { return nan; });
      } else {
        store_row_as(p_.dq, p_.output_type, off, p_.dq_stride[3], d_, dq);
      }
    }
  }

  /// The maximum m and sum l = sum of exp(scale (s - m)) over the kept scores of the rows in
  /// @p rows_mask (the forward's scores, selection and online update), stored as the rows' shift
  /// (m) and offset (log2 l); offset -inf for a row without a finite kept score, row_nan for a row
  /// with a NaN or +inf score. Costs one more pass of S = Q K^T over the row tile: only tiles with
  /// such rows take it.
  void row_statistics(workspace& ws, std::int64_t b, std::int64_t h, std::int64_t i0, int rows_mk,
                      std::int64_t tile_end, std::uint32_t rows_mask) const {
    const float neg_inf = -std::numeric_limits<float>::infinity();
    for (std::uint32_t r = rows_mask; r != 0; r &= r - 1) {
      const int i = __builtin_ctz(r);
      ws.row_max.ptr[i] = neg_inf;
      ws.row_sum.ptr[i] = 0.0f;
    }
    for (std::int64_t j0 = 0; j0 < tile_end; j0 += w_) {
      this->tile_product(ws.q.ptr, rows_mk, ws.kt.ptr, j0, ws.s.ptr);
      for (std::uint32_t r = rows_mask; r != 0; r &= r - 1) {
        const int i = __builtin_ctz(r);
        const std::int64_t lim = this->key_limit(b, i0 + i);
        if (j0 >= lim || ws.row_nan.ptr[i] != 0) continue;
        float* s = ws.s.ptr + static_cast<std::int64_t>(i) * w_;
        this->bias_and_mask(s, b, h, i0 + i, j0, lim);
        if (this->row_has_nan_or_inf(s)) {
          ws.row_nan.ptr[i] = 1;
          continue;
        }
        float tile_max = neg_inf;
        const int kept = this->compact(s, static_cast<std::int32_t>(j0), ws.comp_val.ptr, ws.comp_idx.ptr, tile_max,
                                      /*nan_free=*/true, core::whole_groups(p_, b, i0 + i));  // NaN rows were diverted above
        if (tile_max == neg_inf) continue;
        float& mx = ws.row_max.ptr[i];
        float& sum = ws.row_sum.ptr[i];
        if (tile_max > mx) {
          sum = mx == neg_inf ? 0.0f : sum * std::exp2(((mx - tile_max) * e1_) * e2_);
          mx = tile_max;
        }
        sum += this->exp_sum(ws.comp_val.ptr, kept, mx);
      }
    }
    for (std::uint32_t r = rows_mask; r != 0; r &= r - 1) {
      const int i = __builtin_ctz(r);
      const float mx = ws.row_max.ptr[i];
      ws.row_lse2.ptr[i] = mx == neg_inf ? neg_inf : std::log2(ws.row_sum.ptr[i]);
    }
  }

  /// The kept-count value select_row returns for a row whose 1:2 tile its compaction holds one slot
  /// per pair, pair g in slot g (compact's two-vector form; every key of the tile has a pair): its
  /// dP at the kept keys comes from pair_dp where that is compiled, else by pair parity.
  static constexpr int kPairedRow = std::numeric_limits<int>::max();

  /// One row against one key tile, first step: the forward's scores and selection, compacted into
  /// the row's slot of ws.comp_val / ws.comp_idx. Returns the number of kept slots (kPairedRow for
  /// a 1:2 tile in pair order, w / 2 slots), or -1 for a row with no gradient from this tile: past
  /// its last key, empty, or NaN (its keys then taken by nan_row_keys).
  int select_row(workspace& ws, std::int64_t b, std::int64_t h, std::int64_t qi, int i, std::int64_t j0,
                 const dbias_sink& sink) const {
    const std::int64_t lim = this->key_limit(b, qi);
    const float offset = ws.row_lse2.ptr[i];
    // Empty rows (offset -inf) have zero gradients.
    if (j0 >= lim || offset == -std::numeric_limits<float>::infinity()) return -1;
    float* s = ws.s.ptr + static_cast<std::int64_t>(i) * w_;
    this->bias_and_mask(s, b, h, qi, j0, lim);
    if (this->row_has_nan_or_inf(s)) ws.row_nan.ptr[i] = 1;
    if (ws.row_nan.ptr[i] != 0) {
      nan_row_keys(ws, b, h, qi, i, j0, s, sink);
      return -1;
    }
    const std::int64_t slot = static_cast<std::int64_t>(i) * this->comp_stride();
    float tile_max = 0.0f;
    const mask::whole_groups whole = core::whole_groups(p_, b, qi);
    const int kept = this->compact(s, static_cast<std::int32_t>(j0), ws.comp_val.ptr + slot, ws.comp_idx.ptr + slot,
                                   tile_max, /*nan_free=*/true, whole);  // NaN rows diverted
    return pair_slots_ && !mask::tile_has_whole_groups(whole, j0, w_) ? kPairedRow : kept;
  }

  /// One row against one key tile, second step (after select_row gave @p kept_slots and dP is in
  /// place): P = exp2((scale (S - shift)) log2(e) - offset) (see backward_tile), dS = P (dO . V - D),
  /// dQ += scale dS K, and P, scale dS into the key-major block for dK and dV.
  /// A dense row whose every key of the tile has P != 0 leaves its products to the tile's end: its
  /// bit set in @p blocked, its P and scaled dS in its slots of ws.comp_p and ws.comp_ds, in key
  /// order (blocked_dq, then whole_tile_dk_dv or to_key_major).
  void backward_row(workspace& ws, std::int64_t b, std::int64_t h, std::int64_t qi, int i, std::int64_t j0,
                    int kept_slots, const dbias_sink& sink, bool first, std::uint32_t& blocked) const {
    const float offset = ws.row_lse2.ptr[i];
    const std::int64_t row_slot = static_cast<std::int64_t>(i) * this->comp_stride();
    float* cv = ws.comp_val.ptr + row_slot;
    std::int32_t* ci = ws.comp_idx.ptr + row_slot;
    const std::int64_t slot = dense_tiles_ ? row_slot : 0;
    float* cp = ws.comp_p.ptr + slot;
    float* cds = ws.comp_ds.ptr + slot;
    const bool pair_slots = kept_slots == kPairedRow;
    const int kept = pair_slots ? w_ / 2 : kept_slots;
    const float d_row = ws.row_d.ptr[i];
    const float* dp_row = ws.dps.ptr + static_cast<std::int64_t>(i) * w_;
    const DF d;
    const DI di;
    const VF vshift = hn::Set(d, ws.row_max.ptr[i]), ve1 = hn::Set(d, e1_), ve2 = hn::Set(d, e2_),
             voffset = hn::Set(d, offset), vd = hn::Set(d, d_row), vscale = hn::Set(d, scale_);
    const VI vj0 = hn::Set(di, static_cast<std::int32_t>(j0)), vlast = hn::Set(di, w_ - 1);
    bool zero_p = false;  // some kept slot has P = 0
    for (int t = 0; t < kept; t += lanes_) {
      // P of the kept keys (masked slots: exp2(-inf) = 0) and their dO . V from the dP tile
      // (padding slots point past the tile: clamped, their P is 0).
      const VF arg = hn::Mul(hn::Mul(hn::Sub(hn::Load(d, cv + t), vshift), ve1), ve2);
      const VF pv = exp2_clamped(hn::Sub(arg, voffset));
      // Dense: kept slot t is key j0 + t.
      VF dpv;
      if (dense_tiles_) {
        dpv = hn::Load(d, dp_row + t);
      } else if (pair_slots && DFSS_SIMD_PAIR_DP) {
        dpv = hn::Load(d, ws.dpk.ptr + static_cast<std::int64_t>(i) * (w_ / 2) + t);  // pair_dp, slot order
      } else if (pair_slots) {
        // Slots t .. t + L - 1 are pairs t .. t + L - 1, keys 2 t .. 2 t + 2 L - 1; j0 is even, so
        // the kept key is odd iff its index is.
        const VF x0 = hn::Load(d, dp_row + 2 * t), x1 = hn::Load(d, dp_row + 2 * t + lanes_);
        const auto odd = hn::RebindMask(d, hn::Ne(hn::And(hn::LoadU(di, ci + t), hn::Set(di, 1)), hn::Zero(di)));
        dpv = hn::IfThenElse(odd, hn::ConcatOdd(d, x1, x0), hn::ConcatEven(d, x1, x0));
      } else {
        dpv = hn::GatherIndex(d, dp_row, hn::Min(hn::Sub(hn::LoadU(di, ci + t), vj0), vlast));
      }
      const VF ds = hn::Mul(pv, hn::Sub(dpv, vd));
      hn::Store(pv, d, cp + t);
      hn::Store(hn::Mul(vscale, ds), d, cds + t);
      zero_p = zero_p || !hn::AllFalse(d, hn::Eq(pv, hn::Zero(d)));
    }
    // Slots with P = 0 (masked keys, padding, underflow) contribute nothing and are dropped, not
    // multiplied by 0: a masked key's K row or dP may be NaN or inf (as in the reference).
    int live = kept;
    if (zero_p) {
      live = 0;
      for (int t = 0; t < kept; ++t) {
        if (cp[t] == 0.0f) continue;
        cp[live] = cp[t], cds[live] = cds[t], ci[live] = ci[t];
        ++live;
      }
    }
    // A dense row that keeps the whole tile (keys j0 .. j0 + W - 1 in order) leaves its products to
    // the tile's end.
    const bool whole_tile = dense_tiles_ && live == w_;
    if (whole_tile) blocked |= 1u << i;
    // dQ += scale dS K over the kept keys (a combination of K rows, the dQ row in registers).
    if (!whole_tile) {
      const float* kr = ws.kr.ptr;
      const int dp = dp_;
      add_row_combination(
          ws.acc.ptr + static_cast<std::int64_t>(i) * dp_, dp_, live, [cds](int t) { return cds[t]; },
          [kr, ci, dp](int t) { return kr + static_cast<std::int64_t>(ci[t]) * dp; });
      // P and dS go to the key-major block for accumulate_dk_dv.
      float* pk = ws.p_keys.ptr;
      float* dsk = ws.ds_keys.ptr;
      for (int t = 0; t < live; ++t) {
        const std::int64_t at = (ci[t] - j0) * kRowsPerTask + i;  // live slots are keys of this tile
        pk[at] = cp[t];
        dsk[at] = cds[t];
      }
    }
    if (p_.dbias != nullptr) {
      for (int t = 0; t < live; ++t) {
        const std::int64_t at = sink.at(b, h, qi, ci[t]);
        const double prior = first ? 0.0 : core::load_as_double(sink.base, sink.type, at);
        core::store_from_double(sink.base, sink.type, at, prior + static_cast<double>(cds[t]));
      }
    }
  }

#if DFSS_SIMD_PAIR_DP
  /// Rows per pair_dp_block: R accumulators, R masks (of the 7 usable mask registers), the two
  /// V^T vectors and a broadcast fit the 32 vector registers (4 rows measured the same on Zen 4).
  static constexpr int kPairDpRows = 6;

  /// dP = dO V^T at the kept keys of the rows in @p rows_mask, whose 1:2 tile at @p j0 select_row
  /// compacted one slot per pair: into ws.dpk, row i's at i * W / 2, in slot order. Per vector of
  /// pairs and kPairDpRows rows, each row takes each pair's even or odd V^T column by the parity of
  /// its kept key: per row and column one blend and one FMA, where the dense product has two FMAs.
  /// Sums from zero in increasing c, as the micro-kernel's: bitwise the dense dP at those keys.
  void pair_dp(workspace& ws, std::uint32_t rows_mask, std::int64_t j0) const {
    int list[kRowsPerTask];
    int n = 0;
    for (; rows_mask != 0; rows_mask &= rows_mask - 1) list[n++] = hwy::Num0BitsBelowLS1Bit_Nonzero32(rows_mask);
    const std::int64_t half = (lk_pad_ / 2) * dp_;
    // j0 is a multiple of the key tile, so of 2 L: its first pair starts a block.
    const float* even = ws.vt_pairs.ptr + (j0 / 2) * dp_;
    for (int g0 = 0; g0 < w_ / 2; g0 += lanes_) {
      const float* e = even + static_cast<std::int64_t>(g0) * dp_;
      const float* o = e + half;
      int r = 0;
      for (; r + kPairDpRows <= n; r += kPairDpRows) pair_dp_block<kPairDpRows>(ws, list + r, e, o, g0);
      switch (n - r) {
        case 5: pair_dp_block<5>(ws, list + r, e, o, g0); break;
        case 4: pair_dp_block<4>(ws, list + r, e, o, g0); break;
        case 3: pair_dp_block<3>(ws, list + r, e, o, g0); break;
        case 2: pair_dp_block<2>(ws, list + r, e, o, g0); break;
        case 1: pair_dp_block<1>(ws, list + r, e, o, g0); break;
        default: break;
      }
    }
  }

  /// pair_dp for R rows (@p rows) and the vector of pairs g0 .. g0 + L - 1 (V^T columns @p e, @p o).
  template <int R>
  HWY_INLINE void pair_dp_block(workspace& ws, const int* rows, const float* HWY_RESTRICT e, const float* HWY_RESTRICT o,
                                int g0) const {
    const DF d;
    const DI di;
    const std::size_t L = hn::Lanes(d);
    hn::Mask<DF> odd[R];
    VF acc[R];
    const float* x[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const std::int32_t* ci = ws.comp_idx.ptr + static_cast<std::int64_t>(rows[r]) * this->comp_stride() + g0;
      odd[r] = hn::RebindMask(d, hn::Ne(hn::And(hn::LoadU(di, ci), hn::Set(di, 1)), hn::Zero(di)));
      acc[r] = hn::Zero(d);
      x[r] = ws.dout.ptr + static_cast<std::int64_t>(rows[r]) * dp_;
    }
    for (int c = 0; c < dp_; ++c) {
      VF ve = hn::Load(d, e + c * L);
      VF vo = hn::Load(d, o + c * L);
      keep_in_register(ve);
      keep_in_register(vo);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) acc[r] = hn::MulAdd(hn::Set(d, x[r][c]), hn::IfThenElse(odd[r], vo, ve), acc[r]);
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) hn::Store(acc[r], d, ws.dpk.ptr + static_cast<std::int64_t>(rows[r]) * (w_ / 2) + g0);
  }
#endif

  /// dQ += scale dS K of the dense key tile at @p j0 for the rows in @p blocked (their scaled dS in
  /// their slots of ws.comp_ds) with the forward's blocked product, kValueRows rows per K load;
  /// bitwise as backward_row's row-at-a-time combination.
  void blocked_dq(workspace& ws, std::uint32_t blocked, std::int64_t j0) const {
#if !HWY_HAVE_SCALABLE
    const float* k = ws.kr.ptr + j0 * dp_;
    float* acc[kValueRows];
    const float* w[kValueRows];
    int n = 0;
    for (; blocked != 0; blocked &= blocked - 1) {
      const int i = hwy::Num0BitsBelowLS1Bit_Nonzero32(blocked);
      acc[n] = ws.acc.ptr + static_cast<std::int64_t>(i) * dp_;
      w[n] = ws.comp_ds.ptr + static_cast<std::int64_t>(i) * this->comp_stride();
      if (++n == kValueRows) {
        add_tile_rows<kValueRows, false>(acc, w, 1, k, k, dp_, w_);
        n = 0;
      }
    }
    for (int r = 0; r < n; ++r) add_tile_rows<1, false>(acc + r, w + r, 1, k, k, dp_, w_);
#else
    (void)ws, (void)blocked, (void)j0;
#endif
  }

  /// dV += P^T dO and dK += scale dS^T Q of a dense key tile that every one of the task's @p rows
  /// keeps whole: kValueRows keys at a time with the blocked product, reading P and dS of key k
  /// from the rows' slots (row t's at t * comp_stride() + k); bitwise as accumulate_dk_dv.
  void whole_tile_dk_dv(workspace& ws, std::int64_t j0, int rows) const {
#if !HWY_HAVE_SCALABLE
    const std::ptrdiff_t stride = this->comp_stride();
    float* dv[kValueRows];
    float* dk[kValueRows];
    const float* p[kValueRows];
    const float* ds[kValueRows];
    const auto run = [&](auto keys, int k0) {
      constexpr int R = decltype(keys)::value;
      for (int r = 0; r < R; ++r) {
        dv[r] = ws.dv.ptr + (j0 + k0 + r) * dp_;
        dk[r] = ws.dk.ptr + (j0 + k0 + r) * dp_;
        p[r] = ws.comp_p.ptr + k0 + r;
        ds[r] = ws.comp_ds.ptr + k0 + r;
      }
      add_tile_rows<R, false>(dv, p, stride, ws.dout.ptr, ws.dout.ptr, dp_, rows);
      add_tile_rows<R, false>(dk, ds, stride, ws.q.ptr, ws.q.ptr, dp_, rows);
    };
    int k = 0;
    for (; k + kValueRows <= w_; k += kValueRows) run(std::integral_constant<int, kValueRows>(), k);
    for (; k < w_; ++k) run(std::integral_constant<int, 1>(), k);
#else
    (void)ws, (void)j0, (void)rows;
#endif
  }

  /// The key-major block entries of the rows in @p blocked (whole dense tiles, their P and dS in
  /// their slots), for accumulate_dk_dv when other rows of the tile did not keep it whole.
  void to_key_major(workspace& ws, std::uint32_t blocked) const {
    for (; blocked != 0; blocked &= blocked - 1) {
      const int i = hwy::Num0BitsBelowLS1Bit_Nonzero32(blocked);
      const float* cp = ws.comp_p.ptr + static_cast<std::int64_t>(i) * this->comp_stride();
      const float* cds = ws.comp_ds.ptr + static_cast<std::int64_t>(i) * this->comp_stride();
      for (int t = 0; t < w_; ++t) {
        ws.p_keys.ptr[t * kRowsPerTask + i] = cp[t];
        ws.ds_keys.ptr[t * kRowsPerTask + i] = cds[t];
      }
    }
  }

  /// A NaN row against one key tile: P and dS are NaN at every key it keeps that is not masked (as
  /// in the reference), so dK, dV (through the key-major block) and dBias turn NaN at exactly those
  /// keys; its dQ row is written NaN by backward_tile. The kept keys come from the scalar rule.
  void nan_row_keys(workspace& ws, std::int64_t b, std::int64_t h, std::int64_t qi, int i, std::int64_t j0,
                    const float* s, const dbias_sink& sink) const {
    const int n = p_.pattern_n, m = p_.pattern_m;
    const float nan = std::numeric_limits<float>::quiet_NaN();
    const std::int64_t keys = std::min<std::int64_t>(w_, p_.seqlen_k - j0);
    for (int g = 0; g < keys; g += m) {
      const std::uint32_t keep = n == m ? (1u << m) - 1u : select_group_generic(s + g, n, m);
      for (int x = 0; x < m && g + x < keys; ++x) {
        if (!((keep >> x) & 1u) || s[g + x] == -std::numeric_limits<float>::infinity()) continue;
        const std::int64_t slot = static_cast<std::int64_t>(g + x) * kRowsPerTask + i;
        ws.p_keys.ptr[slot] = nan;
        ws.ds_keys.ptr[slot] = nan;
        if (p_.dbias != nullptr) {
          core::store_from_double(sink.base, sink.type, sink.at(b, h, qi, j0 + g + x), static_cast<double>(nan));
        }
      }
    }
  }

  /// dV += P^T dO and dK += scale dS^T Q for the keys of the tile at j0, from the key-major block the
  /// rows of the tile filled: per key, a combination over the query rows that kept it, so that each
  /// dK and dV row is read and written once per (row tile, key tile) and pruned entries cost nothing.
  /// Keys whose live rows are the first n rows of the tile (every row, on a dense tile no row masks)
  /// run kValueRows keys at a time with the forward's blocked product (one dO and Q load for all of
  /// them); the sums come out bitwise as key by key.
  void accumulate_dk_dv(workspace& ws, std::int64_t j0) const {
    const std::int64_t keys = std::min<std::int64_t>(w_, p_.seqlen_k - j0);
    int rows[kRowsPerTask];
    const float* dout = ws.dout.ptr;
    const float* q = ws.q.ptr;
    const int dp = dp_;
#if !HWY_HAVE_SCALABLE
    float* block_dv[kValueRows];
    float* block_dk[kValueRows];
    const float* block_p[kValueRows];
    const float* block_ds[kValueRows];
    int block = 0, block_rows = 0;
    const auto run_block = [&](auto keys_in_block, int first) {
      constexpr int R = decltype(keys_in_block)::value;
      add_tile_rows<R, false>(block_dv + first, block_p + first, 1, dout, dout, dp, block_rows);
      add_tile_rows<R, false>(block_dk + first, block_ds + first, 1, q, q, dp, block_rows);
    };
    const auto flush_singly = [&] {
      for (int r = 0; r < block; ++r) run_block(std::integral_constant<int, 1>(), r);
      block = 0;
    };
#endif
    for (std::int64_t k = 0; k < keys; ++k) {
      const float* pk = ws.p_keys.ptr + k * kRowsPerTask;
      const float* dsk = ws.ds_keys.ptr + k * kRowsPerTask;
      // Rows with P != 0: kept, unmasked and not underflowed (P = 0 contributes nothing to either),
      // as a bit mask from vector compares, then its set bits in increasing order: a scalar test
      // per row mispredicts on sparse patterns (it took 70% of this function for 1:2 on AVX2).
      int n = 0;
      if (kRowsPerTask % lanes_ == 0) {
        const DF d;
        std::uint64_t live = 0;
        for (int r = 0; r < kRowsPerTask; r += lanes_) {
          std::uint64_t bits = 0;
          // Not(Eq): a NaN P (a NaN row's kept key) counts as live; Highway's Ne is ordered (false for NaN).
          hn::StoreMaskBits(d, hn::Not(hn::Eq(hn::Load(d, pk + r), hn::Zero(d))), reinterpret_cast<std::uint8_t*>(&bits));
          live |= bits << r;
        }
#if !HWY_HAVE_SCALABLE
        if (dense_tiles_ && live != 0 && (live & (live + 1)) == 0) {
          // Rows 0 .. n - 1: contiguous dO and Q rows, as add_tile_rows reads them.
          const int prefix = static_cast<int>(hwy::PopCount(live));
          if (block > 0 && prefix != block_rows) flush_singly();
          block_rows = prefix;
          block_dv[block] = ws.dv.ptr + (j0 + k) * dp_;
          block_dk[block] = ws.dk.ptr + (j0 + k) * dp_;
          block_p[block] = pk;
          block_ds[block] = dsk;
          if (++block == kValueRows) {
            run_block(std::integral_constant<int, kValueRows>(), 0);
            block = 0;
          }
          continue;
        }
#endif
        for (; live != 0; live &= live - 1) rows[n++] = static_cast<int>(hwy::Num0BitsBelowLS1Bit_Nonzero64(live));
      } else {
        for (int r = 0; r < kRowsPerTask; ++r) {
          if (pk[r] != 0.0f) rows[n++] = r;
        }
      }
      if (n == 0) continue;
      const std::int64_t j = j0 + k;
      const auto p_of = [pk, &rows](int t) { return pk[rows[t]]; };
      const auto dout_of = [dout, &rows, dp](int t) { return dout + static_cast<std::int64_t>(rows[t]) * dp; };
      const auto ds_of = [dsk, &rows](int t) { return dsk[rows[t]]; };
      const auto q_of = [q, &rows, dp](int t) { return q + static_cast<std::int64_t>(rows[t]) * dp; };
#if !HWY_HAVE_SCALABLE
      add_row_combination_pair(ws.dv.ptr + j * dp_, ws.dk.ptr + j * dp_, dp_, n, p_of, dout_of, ds_of, q_of);
#else
      add_row_combination(ws.dv.ptr + j * dp_, dp_, n, p_of, dout_of);
      add_row_combination(ws.dk.ptr + j * dp_, dp_, n, ds_of, q_of);
#endif
    }
#if !HWY_HAVE_SCALABLE
    flush_singly();
#endif
  }

  /// Dense pattern on a fixed-width target: whole-tile rows and keys take the blocked products.
  const bool dense_tiles_;
  /// 1:2: tiles outside the sink and recent windows hold one kept slot per pair (select_row).
  const bool pair_slots_;
};

/// avx3_bf16 (@p t) runs the avx3 backward: 16-bit inputs are widened to fp32 as on every target.
/// Its scores are still the avx3_bf16 forward's bit for bit (bf16_dot.hpp: the same FMA chain)
/// except below 2^-126, so it keeps that forward's selection.
status backward_entry(const attention_params& p, simd_target t) {
  (void)t;
  if (!kernel<float>::fits_int32(p)) {
    return {status_code::unsupported, "dfss cpu simd backward: more than 2^31 packed key elements per head"};
  }
  if (p.o == nullptr || p.lse == nullptr) {
    return {status_code::internal, "dfss cpu simd backward: called without the forward's output and LSE"};
  }
  return run_pass<backward_pass>(p, "dfss cpu simd backward");
}

#else  // the static baseline target: never dispatched to (see targets.hpp)

DFSS_SIMD_BASELINE_ENTRY(backward_entry, "dfss cpu simd backward")

#endif  // DFSS_SIMD_KERNEL_TARGET

}  // namespace dfss::cpu::simd::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
#include "cpu/simd/dispatch.hpp"

namespace dfss::cpu {
DFSS_SIMD_EXPORT_ENTRY(backward_entry, fused_backward_simd, "dfss cpu simd backward")

}  // namespace dfss::cpu
#endif  // HWY_ONCE
