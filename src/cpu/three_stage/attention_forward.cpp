// The paper's three-stage DFSS pipeline on the CPU (generic, portable C++).
//
// Chen et al. (PPoPP 2023) compute DFSS attention in three kernels: (a) the dense product Q K^T
// whose epilogue prunes every aligned group of M scores to its N largest and writes the scores in
// a compressed form; (b) a softmax over the compressed rows; (c) the product of the compressed
// probabilities with the dense V (an SpMM whose sparse operand is P). This file runs the same three
// stages per (batch, head, query tile), one tile per task, tasks spread over cpu::parallel_for.
// Stage (a) packs the query tile and, per block of keys, K transposed to [d][block] in fp32, so the
// inner loop of Q K^T runs over contiguous keys; the epilogue adds the bias, applies the key-length
// and bottom-right causal masks (a masked score is -inf), selects with the one selection rule of
// dfss/format/nm_select.hpp and writes the compressed row. The compressed layout of a row of Lk keys
// has G = ceil(Lk / M) groups of N slots: slot k of group g holds the k-th kept key of the group in
// increasing key order, its value is scale * masked score (-inf where the kept key is masked or is
// padding of a partial last group) and its index is the key position (padding positions keep their
// out-of-range position >= Lk, as dfss::nm_compress does). For 1:2 and 2:4 the epilogue also builds
// the row-order 16-bit sparse tensor core metadata words (formats sm80_16bit_1of2 and
// sm80_16bit_2of4 of dfss/format/nm_meta.hpp, one word per 16 keys; groups past the end of the row
// are encoded as all-padding groups). Stage (a) also keeps the unscaled kept scores: stage (b)
// takes the row maximum m over them and computes the probabilities exp(scale (s - m)) / sum and the
// log-sum-exp scale m + log(sum), so that huge scores keep accurate weights and scale * s beyond
// float max (an exported value of +-inf) still gives the reference's output (docs/semantics.md,
// "Non-finite and extreme inputs"); stage (c) accumulates P * V[index] over the kept slots in fp32,
// reading V in packed blocks of keys. The compressed tile lives in per-worker scratch
// (O(threads x tile x G x N) memory, never an L x L buffer); when the caller asked for the compressed
// outputs the scratch is copied there right after stage (a), so the exported values are fp32
// scale * s of exactly the scores stage (b) consumes. Conventions follow the scalar fused kernel: a
// NaN or +inf kept score makes its whole row (output and LSE) NaN, a row whose kept scores are all
// -inf outputs zeros with LSE -inf, and slots with score -inf never touch V (so a NaN in V reaches
// only the rows that keep its key).
// Every row is computed in a fixed order independent of the task schedule, so results are bitwise
// identical for any thread count.
#include <cmath>
#include <cstdint>
#include <limits>
#include <new>
#include <stdexcept>
#include <vector>

#include "core/element_access.hpp"
#include "cpu/three_stage/attention.hpp"
#include "cpu/parallel.hpp"
#include "dfss/format/nm_meta.hpp"
#include "dfss/format/nm_select.hpp"
#include "dfss/numeric.hpp"

namespace dfss::cpu {
namespace {

using i64 = std::int64_t;

/// Query rows per task: the K and V blocks packed for a tile are reused by this many rows.
constexpr i64 kQueryTile = 32;
/// Keys per block before rounding up to a multiple of M: a [d][block] fp32 K block and the tile's
/// [tile][block] scores stay in the L1/L2 caches.
constexpr i64 kKeyBlock = 128;

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

/// Sizes shared by every task of one call.
struct plan {
  i64 d = 0, Lq = 0, Lk = 0;
  int n = 0, m = 0;
  i64 block = 0;       ///< keys per block, a multiple of m
  i64 slots = 0;       ///< kept slots per row: G * N
  i64 groups = 0;      ///< G = ceil(Lk / M)
  bool meta = false;   ///< 1:2 or 2:4 metadata requested
  meta_format format = meta_format::sm80_16bit_2of4;
  i64 words = 0;       ///< metadata words per row, ceil(Lk / 16)
  int groups_per_word = 0;
  float scale = 0.0f;
};

/// Views of one worker's scratch for one query tile.
struct scratch {
  float* q;       ///< [tile][d] the query tile
  float* kt;      ///< [d][block] K block, transposed
  float* s;       ///< [tile][block] scores of one key block
  float* vals;    ///< [tile][slots] compressed values (scaled scores), stage (a) output
  float* raw;     ///< [tile][slots] the same kept scores unscaled (-inf where masked or padding)
  float* prob;    ///< [tile][slots] probabilities, stage (b) output
  std::int32_t* idx;   ///< [tile][slots] key index of each slot
  std::uint16_t* meta; ///< [tile][words] metadata words (when requested)
  float* vb;      ///< [block][d] V block
  float* acc;     ///< [tile][d] fp32 output accumulators
  unsigned char* state;  ///< [tile] row state after stage (b)
};

/// The buffers behind a worker's scratch (cpu::worker_scratch: kept between calls).
struct scratch_buffers {
  std::vector<float> f;
  std::vector<std::int32_t> i;
  std::vector<std::uint16_t> s;
  std::vector<unsigned char> c;
};

enum row_state : unsigned char { row_normal = 0, row_empty = 1, row_nan = 2 };

template <typename T>
float load(const void* base, i64 off) {
  return to_float(static_cast<const T*>(base)[off]);
}

/// Keep mask of group @p s (@p count real positions) with the fast paths for the hardware patterns.
inline std::uint32_t select_group(const float* s, int count, int n, int m) {
  if (count == m) {
    if (n == 1 && m == 2) return nm_select_1of2(s);
    if (n == 2 && m == 4) return nm_select_2of4(s);
  }
  return nm_select_group<float>(s, count, n, m);
}

/// Stage (a): Q K^T for one tile with the N:M selection in the epilogue; fills sc.vals, sc.idx and
/// (when requested) sc.meta for rows [i0, i0 + rows).
template <typename T>
void stage_qk_select(const attention_params& p, const plan& pl, const scratch& sc, i64 b, i64 h,
                     i64 hk, i64 i0, i64 rows) {
  const i64 d = pl.d, KB = pl.block;
  for (i64 r = 0; r < rows; ++r)
    for (i64 c = 0; c < d; ++c) sc.q[r * d + c] = load<T>(p.q, core::offset4(p.q_stride, b, i0 + r, h, c));
  if (pl.meta) {
    for (i64 x = 0; x < rows * pl.words; ++x) sc.meta[x] = 0;
  }
  const i64 tile_end = core::visible_end(p, b, i0 + rows - 1);  // the tile's last row sees most
  for (i64 j0 = 0; j0 < pl.Lk; j0 += KB) {
    const i64 width = pl.Lk - j0 < KB ? pl.Lk - j0 : KB;
    // A block masked for every row of the tile needs no product: its scores are all -inf.
    const bool visible = j0 < tile_end;
    if (visible) {
      for (i64 t = 0; t < width; ++t)
        for (i64 c = 0; c < d; ++c) sc.kt[c * KB + t] = load<T>(p.k, core::offset4(p.k_stride, b, j0 + t, hk, c));
      for (i64 r = 0; r < rows; ++r) {
        float* srow = sc.s + r * KB;
        const float* qrow = sc.q + r * d;
        for (i64 t = 0; t < width; ++t) srow[t] = 0.0f;
        for (i64 c = 0; c < d; ++c) {
          const float qc = qrow[c];
          const float* krow = sc.kt + c * KB;
          for (i64 t = 0; t < width; ++t) srow[t] += qc * krow[t];
        }
      }
    }
    // Epilogue: bias, masks, selection, compressed row (and metadata).
    for (i64 r = 0; r < rows; ++r) {
      const i64 i = i0 + r;
      const i64 end = core::visible_end(p, b, i);
      float* srow = sc.s + r * KB;
      for (i64 t = 0; t < width; ++t) {
        const i64 j = j0 + t;
        if (!visible || j >= end) {
          srow[t] = kNegInf;
        } else if (p.bias != nullptr) {
          srow[t] += static_cast<float>(core::load_as_double(
              p.bias, p.bias_type,
              b * p.bias_stride[0] + h * p.bias_stride[1] + i * p.bias_stride[2] + j * p.bias_stride[3]));
        }
      }
      float* vrow = sc.vals + r * pl.slots;
      std::int32_t* irow = sc.idx + r * pl.slots;
      for (i64 t0 = 0; t0 < width; t0 += pl.m) {
        const int count = static_cast<int>(width - t0 < pl.m ? width - t0 : pl.m);
        const std::uint32_t keep = select_group(srow + t0, count, pl.n, pl.m);
        const i64 g = (j0 + t0) / pl.m;
        i64 slot = g * pl.n;
        for (int x = 0; x < pl.m; ++x) {
          if (((keep >> x) & 1u) == 0) continue;
          const float sv = x < count ? srow[t0 + x] : kNegInf;
          vrow[slot] = sv == kNegInf ? kNegInf : pl.scale * sv;
          sc.raw[r * pl.slots + slot] = sv;
          irow[slot] = static_cast<std::int32_t>(j0 + t0 + x);
          ++slot;
        }
        if (pl.meta) {
          sc.meta[r * pl.words + g / pl.groups_per_word] = static_cast<std::uint16_t>(
              sc.meta[r * pl.words + g / pl.groups_per_word] |
              nm_meta_group_bits(pl.format, static_cast<int>(g % pl.groups_per_word), keep));
        }
      }
    }
  }
  if (pl.meta) {
    // Groups past the end of the row (in the last word) are all-padding groups: lowest N kept.
    const std::uint32_t padding = (1u << pl.n) - 1u;
    for (i64 r = 0; r < rows; ++r)
      for (i64 g = pl.groups; g < pl.words * pl.groups_per_word; ++g) {
        std::uint16_t& w = sc.meta[r * pl.words + g / pl.groups_per_word];
        w = static_cast<std::uint16_t>(w | nm_meta_group_bits(pl.format, static_cast<int>(g % pl.groups_per_word), padding));
      }
  }
}

/// Copies the tile's compressed rows to the caller's compressed outputs (when requested).
void export_compressed(const attention_params& p, const plan& pl, const scratch& sc, i64 b, i64 h, i64 i0,
                       i64 rows) {
  if (p.compressed_values != nullptr) {
    const i64* cs = p.compressed_stride;
    for (i64 r = 0; r < rows; ++r) {
      const i64 base = b * cs[0] + h * cs[1] + (i0 + r) * cs[2];
      for (i64 k = 0; k < pl.slots; ++k) {
        p.compressed_values[base + k * cs[3]] = sc.vals[r * pl.slots + k];
        p.compressed_indices[base + k * cs[3]] = sc.idx[r * pl.slots + k];
      }
    }
  }
  if (pl.meta) {
    const i64* ms = p.compressed_meta_stride;
    for (i64 r = 0; r < rows; ++r) {
      const i64 base = b * ms[0] + h * ms[1] + (i0 + r) * ms[2];
      for (i64 w = 0; w < pl.words; ++w) p.compressed_meta[base + w * ms[3]] = sc.meta[r * pl.words + w];
    }
  }
}

/// Stage (b): softmax over the compressed rows (from the unscaled kept scores); writes sc.prob,
/// sc.state and the LSE.
void stage_softmax(const attention_params& p, const plan& pl, const scratch& sc, i64 b, i64 h, i64 i0,
                   i64 rows) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  for (i64 r = 0; r < rows; ++r) {
    const float* v = sc.raw + r * pl.slots;
    float* pr = sc.prob + r * pl.slots;
    float mx = kNegInf;
    bool nan_seen = false;
    for (i64 k = 0; k < pl.slots; ++k) {
      const float x = v[k];
      if (x != x || x == inf) nan_seen = true;
      else if (x > mx) mx = x;
    }
    float lse = 0.0f;
    if (nan_seen) {
      sc.state[r] = row_nan;
      lse = nan;
    } else if (mx == kNegInf) {
      sc.state[r] = row_empty;
      lse = kNegInf;
    } else {
      sc.state[r] = row_normal;
      float sum = 0.0f;
      for (i64 k = 0; k < pl.slots; ++k) {
        const float e = std::exp(pl.scale * (v[k] - mx));  // exp(-inf) = 0 for masked and padding slots
        pr[k] = e;
        sum += e;
      }
      const float inv = 1.0f / sum;
      for (i64 k = 0; k < pl.slots; ++k) pr[k] *= inv;
      lse = pl.scale * mx + std::log(sum);  // +-inf where the reference's, rounded to fp32, is
    }
    if (p.lse != nullptr) {
      core::store_from_double(p.lse, p.lse_type, b * p.lse_stride[0] + h * p.lse_stride[1] + (i0 + r) * p.lse_stride[2],
                              static_cast<double>(lse));
    }
  }
}

/// Stage (c): O = P V over the kept slots (compressed-by-dense product), fp32 accumulation; stores
/// the tile's output rows.
template <typename T>
void stage_pv(const attention_params& p, const plan& pl, const scratch& sc, i64 b, i64 h, i64 hk, i64 i0,
              i64 rows) {
  const i64 d = pl.d, KB = pl.block;
  for (i64 x = 0; x < rows * d; ++x) sc.acc[x] = 0.0f;
  for (i64 j0 = 0; j0 < pl.Lk; j0 += KB) {
    const i64 width = pl.Lk - j0 < KB ? pl.Lk - j0 : KB;
    const i64 k0 = j0 / pl.m * pl.n;                             // first slot of the block
    const i64 k1 = (j0 + width + pl.m - 1) / pl.m * pl.n;        // one past its last slot
    // Skip packing V when no row of the tile keeps a visible key of this block.
    bool used = false;
    for (i64 r = 0; r < rows && !used; ++r) {
      if (sc.state[r] != row_normal) continue;
      const float* v = sc.raw + r * pl.slots;
      for (i64 k = k0; k < k1; ++k) used = used || v[k] != kNegInf;
    }
    if (!used) continue;
    for (i64 t = 0; t < width; ++t)
      for (i64 c = 0; c < d; ++c) sc.vb[t * d + c] = load<T>(p.v, core::offset4(p.v_stride, b, j0 + t, hk, c));
    for (i64 r = 0; r < rows; ++r) {
      if (sc.state[r] != row_normal) continue;
      const float* v = sc.raw + r * pl.slots;
      const float* pr = sc.prob + r * pl.slots;
      const std::int32_t* ix = sc.idx + r * pl.slots;
      float* acc = sc.acc + r * d;
      for (i64 k = k0; k < k1; ++k) {
        if (v[k] == kNegInf || ix[k] >= pl.Lk) continue;  // masked slot or padding key
        const float pk = pr[k];
        const float* vrow = sc.vb + (ix[k] - j0) * d;
        for (i64 c = 0; c < d; ++c) acc[c] += pk * vrow[c];
      }
    }
  }
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (i64 r = 0; r < rows; ++r) {
    const float* acc = sc.acc + r * d;
    for (i64 c = 0; c < d; ++c) {
      const float o = sc.state[r] == row_nan ? nan : (sc.state[r] == row_empty ? 0.0f : acc[c]);
      core::store_from_double(p.o, p.output_type, core::offset4(p.o_stride, b, i0 + r, h, c), static_cast<double>(o));
    }
  }
}

template <typename T>
status run(const attention_params& p) noexcept {
  plan pl;
  pl.d = p.head_dim;
  pl.Lq = p.seqlen_q;
  pl.Lk = p.seqlen_k;
  pl.n = p.pattern_n;
  pl.m = p.pattern_m;
  pl.block = (kKeyBlock + pl.m - 1) / pl.m * pl.m;
  pl.groups = (pl.Lk + pl.m - 1) / pl.m;
  pl.slots = pl.groups * pl.n;
  pl.meta = p.compressed_meta != nullptr;
  pl.format = pl.n == 1 ? meta_format::sm80_16bit_1of2 : meta_format::sm80_16bit_2of4;
  pl.words = nm_meta_words_per_row(pl.Lk, pl.format);
  pl.groups_per_word = nm_meta_keys_per_word(pl.format) / pl.m;
  pl.scale = static_cast<float>(p.scale);
  if (pl.meta && !((pl.n == 1 && pl.m == 2) || (pl.n == 2 && pl.m == 4))) {
    return {status_code::internal, "dfss cpu three-stage forward: metadata requested for a pattern other than 1:2 or 2:4"};
  }

  const i64 tiles_q = (pl.Lq + kQueryTile - 1) / kQueryTile;
  const i64 tasks = p.batch * p.heads * tiles_q;
  const i64 group = p.heads / p.heads_kv;

  // Per-worker scratch, sized before the worker's first task so that a failed allocation becomes a
  // status.
  const i64 TQ = kQueryTile, d = pl.d, KB = pl.block;
  const i64 floats = TQ * d + d * KB + TQ * KB + 3 * TQ * pl.slots + KB * d + TQ * d;
  const i64 ints = TQ * pl.slots;
  const i64 shorts = pl.meta ? TQ * pl.words : 0;
  const auto prepare = [&] {
    scratch_buffers& buf = worker_scratch<scratch_buffers>();
    buf.f.resize(static_cast<std::size_t>(floats));
    buf.i.resize(static_cast<std::size_t>(ints));
    buf.s.resize(static_cast<std::size_t>(shorts));
    buf.c.resize(static_cast<std::size_t>(TQ));
  };
  const auto run_tile = [&](i64 task) {
    scratch_buffers& buf = worker_scratch<scratch_buffers>();
    scratch sc{};
    float* f = buf.f.data();
    sc.q = f, f += TQ * d;
    sc.kt = f, f += d * KB;
    sc.s = f, f += TQ * KB;
    sc.vals = f, f += TQ * pl.slots;
    sc.raw = f, f += TQ * pl.slots;
    sc.prob = f, f += TQ * pl.slots;
    sc.vb = f, f += KB * d;
    sc.acc = f;
    sc.idx = buf.i.data();
    sc.meta = buf.s.data();
    sc.state = buf.c.data();
    const i64 qt = task % tiles_q;
    const i64 h = (task / tiles_q) % p.heads;
    const i64 b = task / (tiles_q * p.heads);
    const i64 hk = h / group;
    const i64 i0 = qt * TQ;
    const i64 rows = pl.Lq - i0 < TQ ? pl.Lq - i0 : TQ;
    stage_qk_select<T>(p, pl, sc, b, h, hk, i0, rows);
    export_compressed(p, pl, sc, b, h, i0, rows);
    stage_softmax(p, pl, sc, b, h, i0, rows);
    stage_pv<T>(p, pl, sc, b, h, hk, i0, rows);
  };
  try {
    parallel_for(tasks, p.num_threads, schedule::dynamic, prepare, run_tile);
  } catch (const std::bad_alloc&) {
    return {status_code::unsupported, "dfss cpu three-stage forward: could not allocate the per-thread scratch"};
  } catch (const std::length_error&) {
    return {status_code::unsupported, "dfss cpu three-stage forward: could not allocate the per-thread scratch"};
  }
  return status::success();
}

}  // namespace

status three_stage_forward(const attention_params& p) noexcept {
  if (p.head_dim > 512) {
    return {status_code::unsupported, "dfss cpu three-stage forward: head_dim above 512"};
  }
  switch (p.input_type) {
    case dtype::f32: return run<float>(p);
    case dtype::f16: return run<half>(p);
    case dtype::bf16: return run<bfloat16>(p);
    default:
      return {status_code::unsupported,
              std::string("dfss cpu three-stage forward: input type ") + dtype_name(p.input_type) +
                  " (the cpu backend takes f32, f16 and bf16; use the reference backend for f64)"};
  }
}

}  // namespace dfss::cpu
