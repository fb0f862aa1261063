// tests/cuda/probe/probe_host.hpp: the host side of dfss_gpu_probe (plain C++, no CUDA): what the
// probe plants in mma.sp's operands, how it decodes the results, and what it expects from the PTX
// tables that src/cuda/warp/mma_fragments.hpp encodes. Kept apart from the .cu so the CPU tests
// (tests/unit/test_cuda_probe_host.cpp) run the decoding against an emulation of mma.sp: a probe
// run on a GPU then only has to produce numbers, and what they mean is already checked in CI.
//
// The metadata probe. One warp runs one mma.sp m16n8k32 (A 16 x 32 stored as 16 x 16, B 32 x 8):
//   - compressed A: slot 0 of every 4-key group holds 1, slot 1 holds 16;
//   - B column n reads only group n: B[4n + j][n] = 2^j, every other entry 0.
// Then D[r][n] = 2^i0 + 16 * 2^i1, where (i0, i1) are the key positions that the metadata field of
// row r, group n names for slots 0 and 1: every field of the tile can be read off D exactly (sums
// of two powers of two below 2^8 are exact in f32, bf16 and f16 inputs hold 1, 2, 4, 8, 16 exactly).
// Every lane's register starts as 0x44444444 (positions 0 and 1, "keep the first two"); one
// experiment per (lane, nibble) plants 0xE (positions 2 and 3) there, and the field that changes,
// if any, is where that lane and bit range land in the hardware.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "cuda/warp/mma_fragments.hpp"
#include "cuda/warp/nm_warp_select.hpp"
#include "cuda/warp/sddmm_epilogue.hpp"
#include "cuda/warp/softmax_fold.hpp"
#include "dfss/mask/visibility.hpp"
#include "dfss/format.hpp"
#include "dfss/numeric.hpp"

namespace dfss::probe {

inline constexpr int kRows = 16;    // m16
inline constexpr int kCols = 8;     // n8
inline constexpr int kGroups = 8;   // 4-key groups of k32
inline constexpr int kKeys = 32;    // k32
inline constexpr std::uint32_t kBaseWord = 0x44444444u;  // every field "positions 0 and 1"
inline constexpr std::uint32_t kPlantNibble = 0xEu;      // positions 2 and 3

/// Compressed A of the metadata probe: slot 0 of a group 1, slot 1 16 (so the two are told apart).
inline float meta_probe_a(int /*row*/, int ccol) { return (ccol & 1) != 0 ? 16.0f : 1.0f; }
/// B of the metadata probe: column n reads only group n, key 4n + j holds 2^j.
inline float meta_probe_b(int k, int n) { return k / 4 == n ? static_cast<float>(1 << (k % 4)) : 0.0f; }

/// Key positions (within a group) of slots 0 and 1; -1 when a result is not of the probe's form.
struct pair_idx {
  int first;
  int second;
  bool operator==(const pair_idx& o) const { return first == o.first && second == o.second; }
  bool operator!=(const pair_idx& o) const { return !(*this == o); }
};

/// The positions an ordered-metadata nibble names: bits 1:0 slot 0, bits 3:2 slot 1.
inline pair_idx nibble_pair(std::uint32_t nibble) {
  return {static_cast<int>(nibble & 3u), static_cast<int>((nibble >> 2) & 3u)};
}

/// Inverse of D = 2^i0 + 16 * 2^i1 (exact comparison; NaN, Inf and anything else give {-1, -1}).
inline pair_idx decode_pair(float d) {
  for (int i0 = 0; i0 < 4; ++i0) {
    for (int i1 = 0; i1 < 4; ++i1) {
      if (d == static_cast<float>((1 << i0) + 16 * (1 << i1))) return {i0, i1};
    }
  }
  return {-1, -1};
}

/// One planted nibble: lane @p lane's register is kBaseWord with bits shift..shift+3 = nibble.
struct experiment {
  int lane;
  int shift;
  std::uint32_t nibble;
};

/// The 256 experiments that locate every (lane, nibble) of the metadata register.
inline std::vector<experiment> plant_experiments() {
  std::vector<experiment> ex;
  for (int lane = 0; lane < 32; ++lane) {
    for (int shift = 0; shift < 32; shift += 4) ex.push_back({lane, shift, kPlantNibble});
  }
  return ex;
}

/// The 16 experiments that decode every nibble value at the field of row 0, group 0 of selector f.
inline std::vector<experiment> nibble_value_experiments(int f) {
  const cuda::warp::meta_slot s = cuda::warp::mma_sp_meta_slot(0, 0, f);
  std::vector<experiment> ex;
  for (std::uint32_t v = 0; v < 16; ++v) ex.push_back({s.lane, s.shift, v});
  return ex;
}

/// The 32 metadata registers of experiment @p e.
inline std::array<std::uint32_t, 32> experiment_meta(const experiment& e) {
  std::array<std::uint32_t, 32> m{};
  m.fill(kBaseWord);
  m[static_cast<std::size_t>(e.lane)] = (kBaseWord & ~(0xFu << e.shift)) | (e.nibble << e.shift);
  return m;
}

/// A field of D (row-major 16 x 8) whose decoded pair is not the base (0, 1).
struct field_change {
  int row;
  int group;
  pair_idx got;
};

inline std::vector<field_change> changed_fields(const float* d) {
  std::vector<field_change> out;
  for (int r = 0; r < kRows; ++r) {
    for (int n = 0; n < kCols; ++n) {
      const pair_idx p = decode_pair(d[r * kCols + n]);
      if (p != pair_idx{0, 1}) out.push_back({r, n, p});
    }
  }
  return out;
}

/// Result of comparing the located fields with the PTX table (mma_sp_meta_slot).
struct meta_map_report {
  int experiments = 0;
  int mismatches = 0;
  int lanes_read = 0;           ///< lanes whose planted nibbles changed a field
  std::vector<std::string> lines;  ///< one line per mismatch (at most 16 kept)
};

/// @p changes[i] is changed_fields of experiment @p ex[i] run with selector @p f. Expectation: the
/// table's (row, group) for (lane, shift) changes to (2, 3) and nothing else does; a (lane, shift)
/// the table does not name (a lane the selector leaves out) changes nothing.
inline meta_map_report check_meta_map(const std::vector<experiment>& ex,
                                      const std::vector<std::vector<field_change>>& changes, int f) {
  meta_map_report rep;
  std::array<bool, 32> read{};
  for (std::size_t i = 0; i < ex.size() && i < changes.size(); ++i) {
    ++rep.experiments;
    const experiment& e = ex[i];
    int want_row = -1, want_group = -1;
    for (int r = 0; r < kRows; ++r) {
      for (int g = 0; g < kGroups; ++g) {
        const cuda::warp::meta_slot s = cuda::warp::mma_sp_meta_slot(r, g, f);
        if (s.lane == e.lane && s.shift == e.shift) {
          want_row = r;
          want_group = g;
        }
      }
    }
    const std::vector<field_change>& c = changes[i];
    if (!c.empty()) read[static_cast<std::size_t>(e.lane)] = true;
    const bool ok = want_row < 0 ? c.empty()
                                 : (c.size() == 1 && c[0].row == want_row && c[0].group == want_group &&
                                    c[0].got == nibble_pair(e.nibble));
    if (ok) continue;
    ++rep.mismatches;
    if (rep.lines.size() >= 16) continue;
    std::string line = "lane " + std::to_string(e.lane) + " bits " + std::to_string(e.shift) + ".." +
                       std::to_string(e.shift + 3) + ": table says " +
                       (want_row < 0 ? std::string("not read")
                                     : "row " + std::to_string(want_row) + " group " + std::to_string(want_group)) +
                       ", hardware changed";
    if (c.empty()) line += " nothing";
    for (const field_change& fc : c) {
      line += " (row " + std::to_string(fc.row) + " group " + std::to_string(fc.group) + " -> " +
              std::to_string(fc.got.first) + "," + std::to_string(fc.got.second) + ")";
    }
    rep.lines.push_back(line);
  }
  for (bool b : read) rep.lanes_read += b ? 1 : 0;
  return rep;
}

// ---------------------------------------------------------------------------------------------
// Tolerances of the per-kernel checks, from the kernels' own rounding.

/// Significand bits (with the implicit one) of the 16-bit types: bf16 8, f16 11.
inline constexpr int kBf16Bits = 8;
inline constexpr int kF16Bits = 11;

/// One unit in the last place of a value of magnitude |x| stored with @p bits significand bits and
/// smallest normal exponent @p min_exp (f16: -14; bf16: -126), subnormals included.
inline double ulp_at(double x, int bits, int min_exp) {
  const int e = (x == 0.0 || !std::isfinite(x)) ? min_exp : std::max(std::ilogb(x), min_exp);
  return std::ldexp(1.0, e - (bits - 1));
}

// ---------------------------------------------------------------------------------------------
// The per-kernel checks of one (batch, head) slice of the kernels' intermediates, as read back from
// the device: the SDDMM's weights, metadata and maxima; the SpMM's output and LSE.

/// One slice: its sizes, the batch's valid keys, the mask, the pattern and the layout.
struct slice_case {
  std::int64_t Lq, Lk, kv;
  bool causal;
  bool two_of_four;
  float scale_log2;
  cuda::warp::intermediate_layout lay;

  dfss::pattern pat() const { return two_of_four ? dfss::pattern{2, 4} : dfss::pattern{1, 2}; }
  dfss::meta_format fmt() const {
    return two_of_four ? dfss::meta_format::sm80_16bit_2of4 : dfss::meta_format::sm80_16bit_1of2;
  }
  /// nm_compress's kept slots per row; slot s is compressed column s of the layout.
  std::int64_t slots() const { return (Lk + pat().m - 1) / pat().m * pat().n; }
};

/// How many checked elements were out of tolerance, the largest error and error / tolerance, and a
/// description of the first bad element.
struct check_report {
  std::int64_t checked = 0;
  std::int64_t bad = 0;
  double max_err = 0;
  double worst = 0;
  std::string first;
  void add(double err, double tol, const std::string& where) {
    ++checked;
    max_err = std::max(max_err, err);
    if (tol > 0) worst = std::max(worst, err / tol);
    if (!(err <= tol) && bad++ == 0) first = where;
  }
};

/// Keys of row @p r whose units the SDDMM wrote: up to the last key any row of its 128-row CTA
/// sees, in whole 64-key steps (src/cuda/sddmm_select.cu; units past it hold nothing).
inline std::int64_t sddmm_written_keys(const slice_case& c, std::int64_t r) {
  const std::int64_t last = std::min(r / 128 * 128 + 127, c.Lq - 1);
  return (dfss::mask::visible_end(c.causal, c.Lq, c.Lk, c.kv, last) + 63) / 64 * 64;
}

/// The slice's scores with the mask applied (-inf where masked), Lq x Lk.
inline std::vector<float> masked_scores(const slice_case& c, const std::vector<float>& scores) {
  std::vector<float> dense(scores.size());
  for (std::int64_t r = 0; r < c.Lq; ++r) {
    const std::int64_t end = dfss::mask::visible_end(c.causal, c.Lq, c.Lk, c.kv, r);
    for (std::int64_t j = 0; j < c.Lk; ++j) {
      const std::size_t at = static_cast<std::size_t>(r * c.Lk + j);
      dense[at] = j < end ? scores[at] : -std::numeric_limits<float>::infinity();
    }
  }
  return dense;
}

/// NaN-propagating max, as the kernels' max.NaN.
inline float max_nan(float a, float b) { return a != a ? a : (b != b ? b : std::max(a, b)); }

/// @brief SDDMM with the first half of the softmax (src/cuda/warp/softmax_fold.hpp). @p scores
/// are the slice's exact, unmasked Q K^T (Lq x Lk, row-major; small integers, so exact in f32 and
/// without NaN). Expected, for every unit the kernel wrote: the metadata words of nm_metadata_encode
/// of nm_compress (the format module, not the kernel's code) at the reordered offsets and every
/// nibble legal; each row's step maximum m_t (64 keys) and overall maximum M of its visible scores, bit for
/// bit (-inf where none); each kept value exp2((s - ref) scale_log2) with ref = m_t (0 when -inf),
/// computed in fp64 and compared within 1 ulp of HT (@p bits significand bits, smallest normal
/// exponent @p min_exp): the kernel's ex2.approx is within 2 ulp of f32, far below half an ulp of
/// HT, so it rounds to the correctly rounded value or its neighbour. @p idx receives nm_compress's
/// kept keys.
template <typename HT>
check_report check_sddmm(const slice_case& c, const std::vector<float>& scores, const HT* values,
                         const std::uint32_t* meta, const float* tile_max, const float* row_max,
                         std::vector<std::int32_t>& idx, int bits, int min_exp) {
  check_report rep;
  const std::vector<float> dense = masked_scores(c, scores);
  const std::int64_t slots = c.slots();
  std::vector<float> vals(static_cast<std::size_t>(c.Lq * slots));
  idx.assign(vals.size(), 0);
  dfss::nm_compress(dense.data(), c.Lq, c.Lk, c.Lk, c.pat(), vals.data(), idx.data());
  const std::int64_t wpr = dfss::nm_metadata_words_per_row(c.Lk, c.fmt());
  std::vector<std::uint16_t> words(static_cast<std::size_t>(c.Lq * wpr));
  dfss::nm_metadata_encode(idx.data(), c.Lq, c.Lk, c.pat(), c.fmt(), words.data());
  for (std::int64_t r = 0; r < c.Lq; ++r) {
    const std::int64_t written = sddmm_written_keys(c, r);
    const std::string row = "row " + std::to_string(r);
    float m_all = -std::numeric_limits<float>::infinity();
    // One maximum per 64-key step (the SDDMM writes whole steps: written is a multiple of 64).
    std::vector<float> m_step(static_cast<std::size_t>(written / 64), -std::numeric_limits<float>::infinity());
    for (std::int64_t j = 0; j < std::min(written, c.Lk); ++j) {
      const float x = dense[static_cast<std::size_t>(r * c.Lk + j)];
      m_step[static_cast<std::size_t>(j / 64)] = max_nan(m_step[static_cast<std::size_t>(j / 64)], x);
      m_all = max_nan(m_all, x);
    }
    const auto same = [](float a, float b) { return (a != a && b != b) || a == b; };
    for (std::int64_t st = 0; st < written / 64; ++st) {
      const float got = tile_max[cuda::warp::fold_tile_max_offset(c.lay, r / 32, st, static_cast<int>(r % 32))];
      rep.add(same(got, m_step[static_cast<std::size_t>(st)]) ? 0.0 : 1.0, 0.0,
              row + " step " + std::to_string(st) + ": tile max " + std::to_string(got) + ", want " +
                  std::to_string(m_step[static_cast<std::size_t>(st)]));
    }
    rep.add(same(row_max[r], m_all) ? 0.0 : 1.0, 0.0,
            row + ": row max " + std::to_string(row_max[r]) + ", want " + std::to_string(m_all));
    for (std::int64_t sl = 0; sl < std::min(slots, written / 2); ++sl) {
      const float x = vals[static_cast<std::size_t>(r * slots + sl)];
      const float m = m_step[static_cast<std::size_t>(sl / 32)];  // 32 slots per 64 keys
      const double ref = std::isinf(m) && m < 0 ? 0.0 : static_cast<double>(m);
      const double want = std::exp2((static_cast<double>(x) - ref) * static_cast<double>(c.scale_log2));
      const double got = dfss::to_double(values[cuda::warp::fold_value_index(c.lay, r, sl)]);
      rep.add(std::fabs(got - want), ulp_at(want, bits, min_exp),
              row + " slot " + std::to_string(sl) + ": got " + std::to_string(got) + ", want " + std::to_string(want));
    }
    for (std::int64_t x = 0; x < std::min(wpr, written / 16); ++x) {
      const std::int64_t o16 = dfss::nm_meta_reordered_offset(r, x, c.lay.rows_padded);
      const std::uint32_t w32 = meta[o16 / 2];
      const std::uint32_t got = (o16 % 2 == 0) ? (w32 & 0xFFFFu) : (w32 >> 16);
      rep.add(got == words[static_cast<std::size_t>(r * wpr + x)] ? 0.0 : 1.0, 0.0, row + " metadata word " + std::to_string(x));
    }
  }
  for (std::int64_t rb = 0; rb < c.lay.rows_padded / 32; ++rb) {
    for (std::int64_t u = 0; u < (rb * 32 < c.Lq ? sddmm_written_keys(c, rb * 32) / 32 : 0); ++u) {
      for (int lane = 0; lane < 32; ++lane) {
        const std::uint32_t w32 = meta[c.lay.meta_offset(rb, u, lane)];
        for (int q = 0; q < 8; ++q) {
          rep.add(dfss::is_legal_ordered_nibble((w32 >> (4 * q)) & 0xFu) ? 0.0 : 1.0, 0.0,
                  "illegal nibble in row block " + std::to_string(rb) + " unit " + std::to_string(u));
        }
      }
    }
  }
  return rep;
}

/// What the SpMM must give for one row, from the SDDMM's own intermediates: the weights
/// p = round_HT(w round_HT(f)), f = exp2((m_t - M) scale_log2) (0 where m_t = -inf), summed over the
/// kept keys the row sees, and the tolerance terms of the checks below.
template <typename HT>
struct spmm_row_expect {
  double sum = 0;           ///< L
  double sum_ulps = 0;      ///< sum of ulp(p): a weight may be one ulp off (f from ex2.approx)
  std::int64_t n = 0;       ///< kept keys
  std::vector<std::pair<std::int64_t, double>> p;  ///< (key, p)
};

template <typename HT>
spmm_row_expect<HT> spmm_row(const slice_case& c, const std::vector<std::int32_t>& idx, const HT* values,
                             const float* tile_max, const float* row_max, std::int64_t r, int bits, int min_exp) {
  spmm_row_expect<HT> e;
  const std::int64_t slots = c.slots();
  const std::int64_t end = dfss::mask::visible_end(c.causal, c.Lq, c.Lk, c.kv, r);
  const double big_m = static_cast<double>(row_max[r]);
  for (std::int64_t sl = 0; sl < slots; ++sl) {
    const std::int64_t key = idx[static_cast<std::size_t>(r * slots + sl)];
    if (key >= end) continue;  // masked or padding: stored weight 0 (and V zero-filled past kv)
    const float m_t = tile_max[cuda::warp::fold_tile_max_offset(c.lay, r / 32, sl / 32, static_cast<int>(r % 32))];
    const double f = std::isinf(m_t) && m_t < 0 ? 0.0 : std::exp2((static_cast<double>(m_t) - big_m) * static_cast<double>(c.scale_log2));
    const double w = dfss::to_double(values[cuda::warp::fold_value_index(c.lay, r, sl)]);
    const double p = dfss::to_double(dfss::from_double<HT>(w * dfss::to_double(dfss::from_double<HT>(f))));
    e.p.emplace_back(key, p);
    e.sum += p;
    e.sum_ulps += ulp_at(p, bits, min_exp);
    ++e.n;
  }
  return e;
}

/// @brief SpMM with the second half of the softmax, on the SDDMM's own intermediates and
/// nm_compress's kept keys @p idx (the device's metadata when check_sddmm passed): O[r][x] =
/// sum_j p_j v[key_j][x] / L, L = sum_j p_j (0 rows: O = 0, LSE = -inf), LSE = ln 2 (M scale_log2 +
/// log2 L). V rows @p v_row elements apart, O rows @p o_row apart, @p d columns. Tolerances: each p
/// may be one ulp of HT off (the kernel's factor comes from ex2.approx), which moves O by at most
/// (sum ulp(p) |v| + sum ulp(p) |O|) / L; products of two 16-bit values are exact in f32 and summed
/// in f32 over n kept keys, |error| <= n 2^-24 sum |p v| with round-to-nearest additions, doubled
/// since tensor cores may truncate inside an MMA, the same for L; the final division and f32 store
/// add 2^-23 |O|. LSE: ln(1 + sum ulp(p) / L) <= sum ulp(p) / L, plus 2n 2^-24 for L and 2^-22
/// (|M scale_log2| + 1) for the f32 products. Returns {O, LSE}.
template <typename HT>
std::array<check_report, 2> check_spmm(const slice_case& c, const std::vector<std::int32_t>& idx, const HT* values,
                                       const float* tile_max, const float* row_max, const HT* v, std::int64_t v_row,
                                       const float* o, std::int64_t o_row, const float* lse, int d, int bits,
                                       int min_exp) {
  std::array<check_report, 2> rep;
  const double f32_sum_unit = std::ldexp(1.0, -24);
  for (std::int64_t r = 0; r < c.Lq; ++r) {
    const spmm_row_expect<HT> e = spmm_row(c, idx, values, tile_max, row_max, r, bits, min_exp);
    const double nsum = 2.0 * static_cast<double>(std::max<std::int64_t>(e.n, 1)) * f32_sum_unit;
    for (int x = 0; x < d; ++x) {
      double num = 0, mag = 0, ulp_v = 0;
      for (const auto& [key, p] : e.p) {
        const double vx = key < c.kv ? dfss::to_double(v[key * v_row + x]) : 0.0;
        num += p * vx;
        mag += std::fabs(p * vx);
        ulp_v += ulp_at(p, bits, min_exp) * std::fabs(vx);
      }
      const double want = e.sum == 0 ? 0.0 : num / e.sum;
      const double tol = e.sum == 0 ? 0.0
                                    : (ulp_v + e.sum_ulps * std::fabs(want) + nsum * (mag + e.sum * std::fabs(want))) / e.sum +
                                          std::ldexp(1.0, -23) * std::fabs(want);
      const double got = static_cast<double>(o[r * o_row + x]);
      rep[0].add(std::fabs(got - want), tol,
                 "row " + std::to_string(r) + " column " + std::to_string(x) + ": got " + std::to_string(got) + ", want " +
                     std::to_string(want));
    }
    if (lse == nullptr) continue;
    const double got = static_cast<double>(lse[r]);
    if (e.sum == 0) {
      rep[1].add(std::isinf(got) && got < 0 ? 0.0 : 1.0, 0.0, "row " + std::to_string(r) + ": want -inf");
    } else {
      const double mc = static_cast<double>(row_max[r]) * static_cast<double>(c.scale_log2);
      const double want = std::log(2.0) * (mc + std::log2(e.sum));
      const double tol = e.sum_ulps / e.sum + nsum + std::ldexp(1.0, -22) * (std::fabs(mc) + 1);
      rep[1].add(std::fabs(got - want), tol,
                 "row " + std::to_string(r) + ": got " + std::to_string(got) + ", want " + std::to_string(want));
    }
  }
  return rep;
}

}  // namespace dfss::probe
