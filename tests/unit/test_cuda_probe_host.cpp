// CPU tests of dfss_gpu_probe's host side (tests/cuda/probe/probe_host.hpp): the planted-nibble
// experiments, their decoding, and the comparison with the PTX table are run against an emulation
// of mma.sp m16n8k32 written here from the PTX ISA's description of the metadata operand, lane
// first (lane 4g + 2f + h of selector f carries groups 4h..4h+3 of rows g (bits 15:0) and g + 8
// (bits 31:16), one nibble per group), independently of mma_sp_meta_slot. Then the same experiments
// against a "hardware" that reads the other lane of each pair, or the other selector's lanes, must
// report mismatches: a GPU run whose metadata layout differs from the table cannot pass the probe.
// The per-kernel checks (check_sddmm, check_spmm) are run on a CPU simulation of the two kernels
// (the SDDMM epilogue through the warp functions for all 32 lanes, the SpMM in f32 as the kernel
// computes it): they must pass it, and must catch a weight two ulps off, a wrong metadata nibble,
// a tile or row maximum one ulp off, and an output or LSE off by 3e-2.
#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <tuple>
#include <set>
#include <utility>
#include <vector>

#include "cuda/probe/probe_host.hpp"
#include "cuda/warp/nm_warp_select.hpp"
#include "cuda/warp/sddmm_epilogue.hpp"
#include "cuda/warp/softmax_fold.hpp"
#include "dfss/mask/visibility.hpp"
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
  std::vector<dfss::bfloat16> values;
  std::vector<std::uint32_t> meta;
  std::vector<float> tile_max, row_max, lse;
  std::vector<dfss::bfloat16> v;  // Lk x d
  std::vector<float> out;         // Lq x d
};

constexpr int kD = 16;
using bf = dfss::bfloat16;

float bf_round(float x) { return static_cast<float>(dfss::to_double(dfss::from_double<bf>(static_cast<double>(x)))); }

// The two kernels as the GPU runs them, through the shared warp functions for all 32 lanes: the
// SDDMM epilogue of every unit its 128-row CTA reaches (mask from each row's visible end, quad row
// maxima, the no-NaN selection, the weights, fragment-order stores, the metadata exchange), then the
// SpMM in f32 (factors rounded to bf16, weights times factors rounded as HMUL2 does, the products
// with V and with the ones column accumulated in f32).
// @p plant may overwrite scores (row, key) before the kernels run.
sim simulate(const pr::slice_case& c, std::mt19937_64& rng,
             const std::vector<std::tuple<std::int64_t, std::int64_t, float>>& plant = {}) {
  const w::intermediate_layout& lay = c.lay;
  std::uniform_int_distribution<int> small(-3, 3);
  std::uniform_real_distribution<double> real(-1.0, 1.0);
  std::vector<float> raw(static_cast<std::size_t>(lay.rows_padded * lay.keys_padded));
  for (auto& x : raw) x = static_cast<float>(small(rng));
  for (const auto& [r, j, x] : plant) raw[static_cast<std::size_t>(r * lay.keys_padded + j)] = x;
  sim o;
  o.scores.resize(static_cast<std::size_t>(c.Lq * c.Lk));
  for (std::int64_t r = 0; r < c.Lq; ++r) {
    for (std::int64_t j = 0; j < c.Lk; ++j) {
      o.scores[static_cast<std::size_t>(r * c.Lk + j)] = raw[static_cast<std::size_t>(r * lay.keys_padded + j)];
    }
  }
  o.values.assign(static_cast<std::size_t>(lay.value_elems()), dfss::from_double<bf>(std::nan("")));
  o.meta.assign(static_cast<std::size_t>(lay.meta_words()), 0u);
  o.tile_max.assign(static_cast<std::size_t>(w::fold_tile_max_elems(lay)), std::nanf(""));
  o.row_max.assign(static_cast<std::size_t>(lay.rows_padded), std::nanf(""));
  const w::sp_pattern p = c.two_of_four ? w::sp_pattern::p2of4 : w::sp_pattern::p1of2;
  for (std::int64_t rb = 0; rb < lay.rows_padded / 32; ++rb) {
    const std::int64_t written = rb * 32 < c.Lq ? pr::sddmm_written_keys(c, rb * 32) : 0;
    float run_max[32][2][2];
    for (auto& l : run_max) for (auto& i : l) for (float& x : i) x = -std::numeric_limits<float>::infinity();
    // The SDDMM's steps of 64 keys, two units each: both units' selections, one maximum per row and
    // step (w::step_lane_row_max, then over the quad), the weights of both units against it.
    for (std::int64_t st = 0; st < written / 64; ++st) {
      static float acc[2][32][2][4][4];
      w::unit16_selection<float> sel[2][32];
      for (int u = 0; u < 2; ++u) {
        const std::int64_t kb = 2 * st + u;
        for (int lane = 0; lane < 32; ++lane) {
          int end[2][2];
          for (int i = 0; i < 2; ++i) {
            for (int j = 0; j < 4; ++j) {
              for (int r = 0; r < 4; ++r) {
                const w::frag_coord fc = w::sddmm16_acc_coord(lane, i, j, r);
                acc[u][lane][i][j][r] =
                    raw[static_cast<std::size_t>((32 * rb + fc.row) * lay.keys_padded + 32 * kb + fc.col)];
              }
            }
            for (int rh = 0; rh < 2; ++rh) {
              const std::int64_t row = 32 * rb + 16 * i + 8 * rh + w::group_of(lane);
              end[i][rh] = w::unit_relative_end(
                  static_cast<int>(dfss::mask::visible_end(c.causal, c.Lq, c.Lk, c.kv, row)), static_cast<int>(32 * kb));
            }
          }
          w::mask_unit16_relative(acc[u][lane], lane, end);
          sel[u][lane] = w::select_unit16_no_nan(acc[u][lane], lane, p);
        }
      }
      float m[32][2][2];
      for (int lane = 0; lane < 32; ++lane) w::step_lane_row_max(sel[0][lane], sel[1][lane], m[lane]);
      for (int lane = 0; lane < 32; ++lane) {
        float mq[2][2];
        for (int i = 0; i < 2; ++i) {
          for (int rh = 0; rh < 2; ++rh) {
            const int q0 = lane & ~3;
            mq[i][rh] = w::max_nan(w::max_nan(m[q0][i][rh], m[q0 + 1][i][rh]), w::max_nan(m[q0 + 2][i][rh], m[q0 + 3][i][rh]));
            run_max[lane][i][rh] = w::max_nan(run_max[lane][i][rh], mq[i][rh]);
          }
        }
        for (int u = 0; u < 2; ++u) {
          for (int i = 0; i < 2; ++i) {
            for (int e = 0; e < 8; ++e) {
              const float ref = w::fold_reference(mq[i][(e >> 1) & 1]);
              o.values[static_cast<std::size_t>(w::fold_value_offset(lay, rb, 2 * st + u, i, lane) + e)] =
                  dfss::from_double<bf>(static_cast<double>(w::fold_weight(sel[u][lane].a[i][e], ref, c.scale_log2)));
            }
          }
        }
        const int t = w::quad_pos_of(lane);
        o.tile_max[static_cast<std::size_t>(w::fold_tile_max_offset(lay, rb, st, w::fold_lane_row(lane)))] = mq[t >> 1][t & 1];
      }
      for (int u = 0; u < 2; ++u) {
        w::host_warp::u32 bits[2][2] = {};
        for (int lane = 0; lane < 32; ++lane) {
          for (int i = 0; i < 2; ++i) {
            for (int h = 0; h < 2; ++h) bits[i][h][lane] = sel[u][lane].meta_bits[i][h];
          }
        }
        const w::host_warp::u32 mw = w::meta_quad_exchange<w::host_warp>(bits[0][0], bits[0][1], bits[1][0], bits[1][1]);
        for (int lane = 0; lane < 32; ++lane) o.meta[static_cast<std::size_t>(lay.meta_offset(rb, 2 * st + u, lane))] = mw[lane];
      }
    }
    for (int lane = 0; lane < 32; ++lane) {
      const int t = w::quad_pos_of(lane);
      o.row_max[static_cast<std::size_t>(32 * rb + w::fold_lane_row(lane))] = run_max[lane][t >> 1][t & 1];
    }
  }
  // The SpMM: the kept keys from the simulated metadata (format module), over the units its loop
  // reaches (the row's visible keys; later kept keys have weight 0 and finite V here).
  o.v.resize(static_cast<std::size_t>(c.Lk * kD));
  for (auto& x : o.v) x = dfss::from_double<bf>(real(rng));
  std::vector<std::int32_t> idx;
  pr::check_sddmm(c, o.scores, o.values.data(), o.meta.data(), o.tile_max.data(), o.row_max.data(), idx,
                  pr::kBf16Bits, -126);
  o.out.assign(static_cast<std::size_t>(c.Lq * kD), 0.0f);
  o.lse.assign(static_cast<std::size_t>(c.Lq), 0.0f);
  const std::int64_t slots = c.slots();
  for (std::int64_t r = 0; r < c.Lq; ++r) {
    const std::int64_t end = dfss::mask::visible_end(c.causal, c.Lq, c.Lk, c.kv, r);
    const float big_m = o.row_max[static_cast<std::size_t>(r)];
    float acc[kD] = {};
    float l = 0.0f;
    for (std::int64_t sl = 0; sl < slots; ++sl) {
      const std::int64_t key = idx[static_cast<std::size_t>(r * slots + sl)];
      if (key >= end) continue;
      const float m_t = o.tile_max[static_cast<std::size_t>(w::fold_tile_max_offset(lay, r / 32, sl / 32, static_cast<int>(r % 32)))];
      const float f = bf_round(w::fold_factor(m_t, big_m, c.scale_log2));
      const float pw = bf_round(static_cast<float>(dfss::to_double(o.values[static_cast<std::size_t>(w::fold_value_index(lay, r, sl))])) * f);
      l += pw;
      for (int x = 0; x < kD; ++x) acc[x] += pw * static_cast<float>(dfss::to_double(o.v[static_cast<std::size_t>(key * kD + x)]));
    }
    for (int x = 0; x < kD; ++x) o.out[static_cast<std::size_t>(r * kD + x)] = l == 0.0f ? 0.0f : acc[x] / l;
    o.lse[static_cast<std::size_t>(r)] =
        l == 0.0f ? -std::numeric_limits<float>::infinity() : 0.69314718f * (big_m * c.scale_log2 + std::log2(l));
  }
  return o;
}

pr::slice_case make_case(std::int64_t Lq, std::int64_t Lk, std::int64_t kv, bool causal, bool two_of_four) {
  return {Lq, Lk, kv, causal, two_of_four, static_cast<float>(1.4426950408889634 / 4.0), w::intermediate_layout::make(Lq, Lk)};
}

std::array<pr::check_report, 2> spmm_check(const pr::slice_case& c, const sim& o, const std::vector<std::int32_t>& idx) {
  return pr::check_spmm(c, idx, o.values.data(), o.tile_max.data(), o.row_max.data(), o.v.data(), kD, o.out.data(), kD,
                        o.lse.data(), kD, pr::kBf16Bits, -126);
}

TEST(CudaProbeHost, KernelChecksPassASimulationOfTheKernels) {
  std::mt19937_64 rng(77);
  // Causal with Lq < Lk and rows past 128 (a second SDDMM CTA), key lengths, no keys, causal Lq > Lk.
  const pr::slice_case cases[] = {make_case(45, 77, 77, true, true), make_case(150, 230, 200, true, false),
                                  make_case(70, 130, 100, false, false), make_case(40, 33, 0, false, true),
                                  make_case(64, 20, 20, true, false)};
  for (const pr::slice_case& c : cases) {
    SCOPED_TRACE("Lq " + std::to_string(c.Lq) + " Lk " + std::to_string(c.Lk) + " kv " + std::to_string(c.kv));
    const sim o = simulate(c, rng);
    std::vector<std::int32_t> idx;
    const pr::check_report s = pr::check_sddmm(c, o.scores, o.values.data(), o.meta.data(), o.tile_max.data(),
                                               o.row_max.data(), idx, pr::kBf16Bits, -126);
    EXPECT_EQ(s.bad, 0) << s.first;
    EXPECT_GE(s.checked, c.kv == 0 ? c.Lq : 2 * c.Lq);  // at least the row maxima, and weights where keys exist
    EXPECT_LE(s.worst, 1.0);
    const auto sp = spmm_check(c, o, idx);
    EXPECT_EQ(sp[0].bad, 0) << sp[0].first;
    EXPECT_EQ(sp[1].bad, 0) << sp[1].first;
    EXPECT_EQ(sp[0].checked, c.Lq * kD);
  }
}

TEST(CudaProbeHost, KernelChecksCatchSmallErrors) {
  std::mt19937_64 rng(78);
  const pr::slice_case c = make_case(45, 77, 77, true, true);
  sim o = simulate(c, rng);
  std::vector<std::int32_t> idx;
  const auto sddmm_bad = [&] {
    return pr::check_sddmm(c, o.scores, o.values.data(), o.meta.data(), o.tile_max.data(), o.row_max.data(), idx,
                           pr::kBf16Bits, -126).bad;
  };
  // One kept weight two ulps off (row 40 sees keys 0..72: slot 3 is a kept key there).
  const std::size_t at = static_cast<std::size_t>(w::fold_value_index(c.lay, 40, 3));
  o.values[at].bits = static_cast<std::uint16_t>(o.values[at].bits + 2);
  EXPECT_EQ(sddmm_bad(), 1);
  o.values[at].bits = static_cast<std::uint16_t>(o.values[at].bits - 2);
  // One metadata nibble another legal code (0x4 <-> 0x8): the word differs, every nibble legal.
  o.meta[0] ^= 0xCu;
  EXPECT_GE(sddmm_bad(), 1);
  o.meta[0] ^= 0xCu;
  // A tile maximum and a row maximum one f32 ulp off (row 40 = row block 1, row 8; its step 1 holds
  // visible keys 64..72, so the maximum is finite).
  float& tm = o.tile_max[static_cast<std::size_t>(w::fold_tile_max_offset(c.lay, 1, 1, 8))];
  ASSERT_TRUE(std::isfinite(tm));
  tm = std::nextafter(tm, 1e9f);
  EXPECT_EQ(sddmm_bad(), 1);
  tm = std::nextafter(tm, -1e9f);
  o.row_max[3] = std::nextafter(o.row_max[3], 1e9f);
  EXPECT_EQ(sddmm_bad(), 1);
  o.row_max[3] = std::nextafter(o.row_max[3], -1e9f);
  ASSERT_EQ(sddmm_bad(), 0);
  // An output and an LSE off by 3e-2 (the tolerances allow about one bf16 ulp, 2^-8 relative, per
  // weight: the device's factors come from ex2.approx).
  o.out[100] += 3e-2f;
  o.lse[7] += 3e-2f;
  const auto sp = spmm_check(c, o, idx);
  EXPECT_EQ(sp[0].bad, 1);
  EXPECT_EQ(sp[1].bad, 1);
}

TEST(CudaProbeHost, FoldedSoftmaxOfSpecialRows) {
  // Through the simulated kernels: a NaN visible score makes its row NaN (O and LSE), a +inf one
  // too (exp2(inf - inf)); a row whose visible scores are all -inf gives O = 0, LSE = -inf; a huge
  // finite score (3e38) takes the whole weight, O = its V row exactly, LSE = ln 2 (3e38 c) finite; a
  // NaN or +inf at a masked key (past the key length) changes nothing. Every other row is bit for bit
  // the run without these scores. (A NaN row's kept set is unspecified, so no metadata check here.)
  const pr::slice_case c = make_case(40, 70, 60, false, true);
  const float inf = std::numeric_limits<float>::infinity();
  std::vector<std::tuple<std::int64_t, std::int64_t, float>> plant = {
      {5, 10, std::nanf("")}, {9, 45, inf}, {14, 3, 3e38f}, {20, 62, std::nanf("")}, {21, 65, inf}};
  for (std::int64_t j = 0; j < 70; ++j) plant.emplace_back(30, j, -inf);
  std::mt19937_64 r1(79), r2(79);
  const sim base = simulate(c, r1);
  const sim o = simulate(c, r2, plant);
  for (std::int64_t r = 0; r < c.Lq; ++r) {
    SCOPED_TRACE("row " + std::to_string(r));
    const float lse = o.lse[static_cast<std::size_t>(r)];
    for (int x = 0; x < kD; ++x) {
      const float got = o.out[static_cast<std::size_t>(r * kD + x)];
      if (r == 5 || r == 9) {
        EXPECT_TRUE(std::isnan(got));
      } else if (r == 14) {
        EXPECT_EQ(got, static_cast<float>(dfss::to_double(o.v[static_cast<std::size_t>(3 * kD + x)])));
      } else if (r == 30) {
        EXPECT_EQ(got, 0.0f);
      } else {
        EXPECT_EQ(got, base.out[static_cast<std::size_t>(r * kD + x)]);
      }
    }
    if (r == 5 || r == 9) {
      EXPECT_TRUE(std::isnan(lse));
    } else if (r == 14) {
      EXPECT_FLOAT_EQ(lse, static_cast<float>(std::log(2.0) * (3e38 * static_cast<double>(c.scale_log2))));
    } else if (r == 30) {
      EXPECT_TRUE(std::isinf(lse) && lse < 0);
    } else {
      EXPECT_EQ(lse, base.lse[static_cast<std::size_t>(r)]);
    }
  }
}

}  // namespace
