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
#include <string>
#include <vector>

#include "cuda/warp/mma_fragments.hpp"

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

}  // namespace dfss::probe
