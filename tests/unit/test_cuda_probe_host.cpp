// CPU tests of dfss_gpu_probe's host side (tests/cuda/probe/probe_host.hpp): the planted-nibble
// experiments, their decoding, and the comparison with the PTX table are run against an emulation
// of mma.sp m16n8k32 written here from the PTX ISA's description of the metadata operand, lane
// first (lane 4g + 2f + h of selector f carries groups 4h..4h+3 of rows g (bits 15:0) and g + 8
// (bits 31:16), one nibble per group), independently of mma_sp_meta_slot. Then the same experiments
// against a "hardware" that reads the other lane of each pair, or the other selector's lanes, must
// report mismatches: a GPU run whose metadata layout differs from the table cannot pass the probe.
#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <set>
#include <utility>
#include <vector>

#include "cuda/probe/probe_host.hpp"
#include "dfss/format.hpp"

namespace {

namespace pr = dfss::probe;

enum class hw { ptx, swapped_pair, other_selector };

// nibble[row][group] as the emulated hardware reads it from the 32 registers.
std::array<std::array<std::uint32_t, 8>, 16> read_fields(const std::array<std::uint32_t, 32>& m, int f, hw kind) {
  std::array<std::array<std::uint32_t, 8>, 16> fields{};
  const int sel = kind == hw::other_selector ? 1 - f : f;
  for (int lane = 0; lane < 32; ++lane) {
    if ((lane % 4) / 2 != sel) continue;
    const int g = lane / 4;
    const int h = (lane % 2) ^ (kind == hw::swapped_pair ? 1 : 0);
    for (int bit = 0; bit < 32; bit += 4) {
      const int row = g + (bit >= 16 ? 8 : 0);
      const int group = 4 * h + (bit % 16) / 4;
      fields[static_cast<std::size_t>(row)][static_cast<std::size_t>(group)] = (m[static_cast<std::size_t>(lane)] >> bit) & 0xFu;
    }
  }
  return fields;
}

// D = A B of the probe's operands (row-major 16 x 8), A decompressed with the emulated fields.
std::vector<float> emulate(const std::array<std::uint32_t, 32>& m, int f, hw kind, const std::vector<float>& b) {
  const auto fields = read_fields(m, f, kind);
  std::vector<float> d(16 * 8, 0.0f);
  for (int r = 0; r < 16; ++r) {
    for (int n = 0; n < 8; ++n) {
      float s = 0.0f;
      for (int q = 0; q < 8; ++q) {
        const pr::pair_idx p = pr::nibble_pair(fields[static_cast<std::size_t>(r)][static_cast<std::size_t>(q)]);
        s += pr::meta_probe_a(r, 2 * q) * b[static_cast<std::size_t>((4 * q + p.first) * 8 + n)];
        s += pr::meta_probe_a(r, 2 * q + 1) * b[static_cast<std::size_t>((4 * q + p.second) * 8 + n)];
      }
      d[static_cast<std::size_t>(r * 8 + n)] = s;
    }
  }
  return d;
}

std::vector<float> probe_b() {
  std::vector<float> b(32 * 8);
  for (int k = 0; k < 32; ++k) {
    for (int n = 0; n < 8; ++n) b[static_cast<std::size_t>(k * 8 + n)] = pr::meta_probe_b(k, n);
  }
  return b;
}

pr::meta_map_report run_plants(int f, hw kind) {
  const std::vector<pr::experiment> ex = pr::plant_experiments();
  std::vector<std::vector<pr::field_change>> changes;
  for (const pr::experiment& e : ex) changes.push_back(pr::changed_fields(emulate(pr::experiment_meta(e), f, kind, probe_b()).data()));
  return pr::check_meta_map(ex, changes, f);
}

TEST(CudaProbeHost, DecodePairInvertsEveryPairAndRejectsTheRest) {
  for (int i0 = 0; i0 < 4; ++i0) {
    for (int i1 = 0; i1 < 4; ++i1) {
      const pr::pair_idx p = pr::decode_pair(static_cast<float>((1 << i0) + 16 * (1 << i1)));
      EXPECT_EQ(p.first, i0);
      EXPECT_EQ(p.second, i1);
    }
  }
  for (float x : {0.0f, 3.0f, 1.0f, 16.0f, std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()}) {
    EXPECT_EQ(pr::decode_pair(x), (pr::pair_idx{-1, -1})) << x;
  }
}

TEST(CudaProbeHost, ExperimentsPlantOneNibbleEach) {
  const std::vector<pr::experiment> ex = pr::plant_experiments();
  ASSERT_EQ(ex.size(), 256u);
  std::set<std::pair<int, int>> where;
  for (const pr::experiment& e : ex) {
    where.insert({e.lane, e.shift});
    const auto m = pr::experiment_meta(e);
    int differing = 0;
    for (int lane = 0; lane < 32; ++lane) {
      for (int s = 0; s < 32; s += 4) {
        const std::uint32_t nib = (m[static_cast<std::size_t>(lane)] >> s) & 0xFu;
        differing += nib != 0x4u;
        if (lane == e.lane && s == e.shift) {
          EXPECT_EQ(nib, pr::kPlantNibble);
        }
      }
    }
    EXPECT_EQ(differing, 1);
  }
  EXPECT_EQ(where.size(), 256u);
  // Both nibbles the probe plants are legal ordered-metadata codes.
  EXPECT_TRUE(dfss::is_legal_ordered_nibble(0x4u));
  EXPECT_TRUE(dfss::is_legal_ordered_nibble(pr::kPlantNibble));
}

TEST(CudaProbeHost, BaseRegistersChangeNoField) {
  std::array<std::uint32_t, 32> base{};
  base.fill(pr::kBaseWord);
  for (int f = 0; f < 2; ++f) {
    EXPECT_TRUE(pr::changed_fields(emulate(base, f, hw::ptx, probe_b()).data()).empty());
  }
}

TEST(CudaProbeHost, PtxLayoutMatchesTheTableForBothSelectors) {
  for (int f = 0; f < 2; ++f) {
    const pr::meta_map_report rep = run_plants(f, hw::ptx);
    EXPECT_EQ(rep.experiments, 256);
    EXPECT_EQ(rep.mismatches, 0) << (rep.lines.empty() ? "" : rep.lines[0]);
    EXPECT_EQ(rep.lanes_read, 16);
  }
}

TEST(CudaProbeHost, OtherLayoutsAreReported) {
  for (int f = 0; f < 2; ++f) {
    const pr::meta_map_report swapped = run_plants(f, hw::swapped_pair);
    EXPECT_EQ(swapped.mismatches, 128);  // every read nibble lands in the other half's group
    EXPECT_EQ(swapped.lanes_read, 16);
    EXPECT_EQ(swapped.lines.size(), 16u);
    const pr::meta_map_report other = run_plants(f, hw::other_selector);
    EXPECT_EQ(other.mismatches, 256);  // 128 expected fields unchanged, 128 unexpected changes
    EXPECT_FALSE(other.lines.empty());
  }
}

TEST(CudaProbeHost, NibbleValuesDecodeToTheirPositions) {
  for (int f = 0; f < 2; ++f) {
    for (const pr::experiment& e : pr::nibble_value_experiments(f)) {
      const std::vector<float> d = emulate(pr::experiment_meta(e), f, hw::ptx, probe_b());
      EXPECT_EQ(pr::decode_pair(d[0]), pr::nibble_pair(e.nibble)) << "nibble " << e.nibble << " selector " << f;
    }
  }
}

TEST(CudaProbeHost, UlpOfTheSixteenBitTypes) {
  EXPECT_EQ(pr::ulp_at(1.0, pr::kBf16Bits, -126), std::ldexp(1.0, -7));
  EXPECT_EQ(pr::ulp_at(0.75, pr::kBf16Bits, -126), std::ldexp(1.0, -8));
  EXPECT_EQ(pr::ulp_at(1.0, pr::kF16Bits, -14), std::ldexp(1.0, -10));
  EXPECT_EQ(pr::ulp_at(-3.0, pr::kF16Bits, -14), std::ldexp(1.0, -9));
  EXPECT_EQ(pr::ulp_at(1e-6, pr::kF16Bits, -14), std::ldexp(1.0, -24));  // f16 subnormal spacing
  EXPECT_EQ(pr::ulp_at(0.0, pr::kF16Bits, -14), std::ldexp(1.0, -24));
}

}  // namespace
