// CPU tests of dfss_gpu_probe's host side (tests/cuda/probe/probe_host.hpp): the planted-nibble
// experiments, their decoding, and the comparison with the PTX table are run against an emulation
// of mma.sp m16n8k32 written here from the PTX ISA's description of the metadata operand, lane
// first (lane 4g + 2f + h of selector f carries groups 4h..4h+3 of rows g (bits 15:0) and g + 8
// (bits 31:16), one nibble per group), independently of mma_sp_meta_slot. Then the same experiments
// against a "hardware" that reads the other lane of each pair, or the other selector's lanes, must
// report mismatches: a GPU run whose metadata layout differs from the table cannot pass the probe.
// The per-kernel checks (check_sddmm, check_softmax, check_spmm) are run on a CPU simulation of the
// kernels (the SDDMM epilogue through the warp functions for all 32 lanes, the softmax and the SpMM
// in f32 as the kernels compute them): they must pass it, and must catch a value one bit off, a
// wrong metadata nibble, a probability two ulps off and an output off by 1e-3.
#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <set>
#include <utility>
#include <vector>

#include "cuda/probe/probe_host.hpp"
#include "cuda/warp/nm_warp_select.hpp"
#include "cuda/warp/sddmm_epilogue.hpp"
#include "dfss/format.hpp"
#include "dfss/numeric.hpp"

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

// ---------------------------------------------------------------------------------------------
// The per-kernel checks against a CPU simulation of the kernels.
namespace w = dfss::cuda::warp;

struct sim {
  std::vector<float> scores;  // Lq x Lk, exact
  std::vector<dfss::bfloat16> values, probs;
  std::vector<std::uint32_t> meta;
  std::vector<float> lse;
  std::vector<dfss::bfloat16> v;  // Lk x d
  std::vector<float> out;         // Lq x d
};

constexpr int kD = 16;

// The SDDMM epilogue of every 32 x 32 unit through the kernels' warp functions (as
// test_cuda_warp.cpp's epilogue test does), the softmax and the SpMM in f32 like the kernels.
sim simulate(const pr::slice_case& c, std::mt19937_64& rng) {
  const w::intermediate_layout& lay = c.lay;
  std::uniform_int_distribution<int> small(-3, 3);
  std::uniform_real_distribution<double> real(-1.0, 1.0);
  std::vector<float> raw(static_cast<std::size_t>(lay.rows_padded * lay.keys_padded));
  for (auto& x : raw) x = static_cast<float>(small(rng));
  sim o;
  o.scores.resize(static_cast<std::size_t>(c.Lq * c.Lk));
  for (std::int64_t r = 0; r < c.Lq; ++r) {
    for (std::int64_t j = 0; j < c.Lk; ++j) {
      o.scores[static_cast<std::size_t>(r * c.Lk + j)] = raw[static_cast<std::size_t>(r * lay.keys_padded + j)];
    }
  }
  o.values.resize(static_cast<std::size_t>(lay.value_elems()));
  o.meta.resize(static_cast<std::size_t>(lay.meta_words()));
  const w::score_mask mask{c.Lq, c.Lk, c.kv, c.causal};
  const w::sp_pattern p = c.two_of_four ? w::sp_pattern::p2of4 : w::sp_pattern::p1of2;
  for (std::int64_t rb = 0; rb < lay.rows_padded / 32; ++rb) {
    for (std::int64_t kb = 0; kb < lay.keys_padded / 32; ++kb) {
      w::host_warp::u32 bits[2][2] = {};
      for (int lane = 0; lane < 32; ++lane) {
        float acc[2][4][4];
        for (int i = 0; i < 2; ++i) {
          for (int j = 0; j < 4; ++j) {
            for (int r = 0; r < 4; ++r) {
              const w::frag_coord fc = w::sddmm16_acc_coord(lane, i, j, r);
              acc[i][j][r] = raw[static_cast<std::size_t>((32 * rb + fc.row) * lay.keys_padded + 32 * kb + fc.col)];
            }
          }
        }
        w::apply_unit16_mask(acc, lane, 32 * rb, 32 * kb, mask);
        const w::unit16_selection<float> sel = w::select_unit16(acc, lane, p);
        for (int i = 0; i < 2; ++i) {
          for (int e = 0; e < 8; e += 2) {
            const w::unit16_store st = w::unit16_value_store(lane, i, e, 32 * rb, 32 * kb);
            o.values[static_cast<std::size_t>(lay.value_offset(st.row, st.ccol))] =
                dfss::from_double<dfss::bfloat16>(static_cast<double>(sel.a[i][e] * c.scale_log2));
            o.values[static_cast<std::size_t>(lay.value_offset(st.row, st.ccol + 1))] =
                dfss::from_double<dfss::bfloat16>(static_cast<double>(sel.a[i][e + 1] * c.scale_log2));
          }
          for (int h = 0; h < 2; ++h) bits[i][h][lane] = sel.meta_bits[i][h];
        }
      }
      const w::host_warp::u32 m = w::meta_quad_exchange<w::host_warp>(bits[0][0], bits[0][1], bits[1][0], bits[1][1]);
      for (int lane = 0; lane < 32; ++lane) o.meta[static_cast<std::size_t>(lay.meta_offset(rb, kb, lane))] = m[lane];
    }
  }
  // Softmax in f32, as softmax_compressed.cu: max, sum of exp2f, p = exp2f(x - max) / sum.
  const std::int64_t cols = lay.keys_padded / 2;
  o.probs = o.values;
  o.lse.assign(static_cast<std::size_t>(c.Lq), 0.0f);
  for (std::int64_t r = 0; r < c.Lq; ++r) {
    float m = -std::numeric_limits<float>::infinity(), sum = 0.0f;
    for (std::int64_t x = 0; x < cols; ++x) m = std::max(m, static_cast<float>(dfss::to_double(o.values[static_cast<std::size_t>(lay.value_offset(r, x))])));
    const bool empty = std::isinf(m);
    for (std::int64_t x = 0; x < cols && !empty; ++x) {
      sum += std::exp2(static_cast<float>(dfss::to_double(o.values[static_cast<std::size_t>(lay.value_offset(r, x))])) - m);
    }
    const float inv = empty ? 0.0f : 1.0f / sum;
    const float mm = empty ? 0.0f : m;
    for (std::int64_t x = 0; x < cols; ++x) {
      const std::size_t at = static_cast<std::size_t>(lay.value_offset(r, x));
      o.probs[at] = dfss::from_double<dfss::bfloat16>(static_cast<double>(std::exp2(static_cast<float>(dfss::to_double(o.values[at])) - mm) * inv));
    }
    o.lse[static_cast<std::size_t>(r)] =
        empty ? -std::numeric_limits<float>::infinity() : 0.69314718f * (m + std::log2(sum));
  }
  // SpMM in f32 over the kept keys (decoded from the simulated metadata via the format module).
  o.v.resize(static_cast<std::size_t>(c.Lk * kD));
  for (auto& x : o.v) x = dfss::from_double<dfss::bfloat16>(real(rng));
  std::vector<std::int32_t> idx;
  pr::check_sddmm(c, o.scores, o.values.data(), o.meta.data(), idx);
  o.out.assign(static_cast<std::size_t>(c.Lq * kD), 0.0f);
  const std::int64_t slots = c.slots();
  for (std::int64_t r = 0; r < c.Lq; ++r) {
    for (int x = 0; x < kD; ++x) {
      float acc = 0.0f;
      for (std::int64_t s = 0; s < slots; ++s) {
        const std::int64_t key = idx[static_cast<std::size_t>(r * slots + s)];
        if (key >= c.kv) continue;
        acc += static_cast<float>(dfss::to_double(o.probs[static_cast<std::size_t>(lay.value_offset(r, s))])) *
               static_cast<float>(dfss::to_double(o.v[static_cast<std::size_t>(key * kD + x)]));
      }
      o.out[static_cast<std::size_t>(r * kD + x)] = acc;
    }
  }
  return o;
}

pr::slice_case make_case(std::int64_t Lq, std::int64_t Lk, std::int64_t kv, bool causal, bool two_of_four) {
  return {Lq, Lk, kv, causal, two_of_four, static_cast<float>(1.4426950408889634 / 4.0), w::intermediate_layout::make(Lq, Lk)};
}

TEST(CudaProbeHost, KernelChecksPassASimulationOfTheKernels) {
  std::mt19937_64 rng(77);
  const pr::slice_case cases[] = {make_case(45, 77, 77, true, true), make_case(70, 130, 100, false, false),
                                  make_case(40, 33, 0, false, true), make_case(64, 20, 20, true, false)};
  for (const pr::slice_case& c : cases) {
    SCOPED_TRACE("Lq " + std::to_string(c.Lq) + " Lk " + std::to_string(c.Lk) + " kv " + std::to_string(c.kv));
    const sim o = simulate(c, rng);
    std::vector<std::int32_t> idx;
    const pr::check_report s = pr::check_sddmm(c, o.scores, o.values.data(), o.meta.data(), idx);
    EXPECT_EQ(s.bad, 0) << s.first;
    EXPECT_GT(s.checked, c.Lq);
    const auto soft = pr::check_softmax(c, o.values.data(), o.probs.data(), o.lse.data(), pr::kBf16Bits, -126);
    EXPECT_EQ(soft[0].bad, 0) << soft[0].first;
    EXPECT_EQ(soft[1].bad, 0) << soft[1].first;
    EXPECT_LE(soft[0].worst, 1.0);
    const pr::check_report sp = pr::check_spmm(c, idx, o.probs.data(), o.v.data(), kD, o.out.data(), kD, kD);
    EXPECT_EQ(sp.bad, 0) << sp.first;
    EXPECT_EQ(sp.checked, c.Lq * kD);
  }
}

TEST(CudaProbeHost, KernelChecksCatchSmallErrors) {
  std::mt19937_64 rng(78);
  const pr::slice_case c = make_case(45, 77, 77, true, true);
  sim o = simulate(c, rng);
  std::vector<std::int32_t> idx;
  // One kept value one bit off.
  std::size_t at = static_cast<std::size_t>(c.lay.value_offset(40, 3));
  o.values[at].bits ^= 1u;
  EXPECT_EQ(pr::check_sddmm(c, o.scores, o.values.data(), o.meta.data(), idx).bad, 1);
  o.values[at].bits ^= 1u;
  // One metadata nibble another legal code (0x4 <-> 0x8): the word differs, every nibble legal.
  o.meta[0] ^= 0xCu;
  const pr::check_report m = pr::check_sddmm(c, o.scores, o.values.data(), o.meta.data(), idx);
  EXPECT_GE(m.bad, 1);
  o.meta[0] ^= 0xCu;
  // A probability two ulps off, and an LSE off by 1e-3.
  at = static_cast<std::size_t>(c.lay.value_offset(44, 5));
  o.probs[at].bits = static_cast<std::uint16_t>(o.probs[at].bits + 2);
  o.lse[7] += 1e-3f;
  const auto soft = pr::check_softmax(c, o.values.data(), o.probs.data(), o.lse.data(), pr::kBf16Bits, -126);
  EXPECT_EQ(soft[0].bad, 1);
  EXPECT_EQ(soft[1].bad, 1);
  o.probs[at].bits = static_cast<std::uint16_t>(o.probs[at].bits - 2);
  // An output off by 1e-3.
  o.out[100] += 1e-3f;
  EXPECT_EQ(pr::check_spmm(c, idx, o.probs.data(), o.v.data(), kD, o.out.data(), kD, kD).bad, 1);
}

}  // namespace
