// CPU tests of the CUDA backend's warp-level maths (src/cuda/warp/): all 32 lanes of a warp are
// simulated with the same host+device functions the kernels run. Checked against the format module
// (dfss/format.hpp: nm_select_*, nm_compress, nm_metadata_encode, nm_metadata_reorder) and against
// an emulation of mma.sp written here from the PTX ISA's fragment tables (anchors.md C.3, C.4),
// independently of the functions under test:
//   - fragment maps are bijections onto their tiles and agree with the PTX tables;
//   - the kept set of every lane-local selection equals the format module's selection, on tie-free,
//     tied, -inf and NaN score tiles, for 2:4 and 1:2 on 16-bit types and 1:2 on tf32;
//   - the metadata registers assembled by the quad exchange equal the format module's encoded and
//     reordered words, at the lane and bit positions of anchors.md C.4;
//   - the sparse A fragments with those registers, fed to the mma.sp emulation, give the dense
//     product of the pruned score tile;
//   - the SDDMM epilogue's masking, tails and global stores over whole awkward-size matrices give
//     exactly nm_compress's values and the reordered metadata.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "cuda/warp/mma_fragments.hpp"
#include "cuda/warp/nm_warp_select.hpp"
#include "cuda/warp/sddmm_epilogue.hpp"
#include "cuda/warp/softmax_fold.hpp"
#include "dfss/format.hpp"
#include "dfss/mask/visibility.hpp"

namespace {

namespace w = dfss::cuda::warp;
using dfss::meta_format;
using dfss::pattern;

constexpr float kInfF = std::numeric_limits<float>::infinity();
constexpr float kNaNF = std::numeric_limits<float>::quiet_NaN();

std::uint64_t seed_for(const char* name) {
  std::uint64_t h = 1469598103934665603ull;
  for (const char* c = name; *c != 0; ++c) h = (h ^ static_cast<unsigned char>(*c)) * 1099511628211ull;
  return h;
}

// ---------------------------------------------------------------------------------------------
// Score tiles.
enum class tile_kind { tie_free, small_ints, ties_inf_nan };

// rows x keys scores in natural key order.
std::vector<float> make_tile(std::mt19937_64& rng, int rows, int keys, tile_kind kind) {
  std::vector<float> s(static_cast<std::size_t>(rows * keys));
  if (kind == tile_kind::tie_free) {
    // A random permutation of distinct integers per tile: no ties anywhere.
    for (std::size_t i = 0; i < s.size(); ++i) s[i] = static_cast<float>(static_cast<int>(i) - rows * keys / 2);
    std::shuffle(s.begin(), s.end(), rng);
    return s;
  }
  std::uniform_int_distribution<int> small(-2, 2);
  std::uniform_int_distribution<int> pick(0, 9);
  for (auto& x : s) {
    const int k = kind == tile_kind::ties_inf_nan ? pick(rng) : 9;
    x = k == 0 ? -kInfF : k == 1 ? kNaNF : k == 2 ? kInfF : static_cast<float>(small(rng));
  }
  return s;
}

bool same_float(float a, float b) {
  return (std::isnan(a) && std::isnan(b)) || (a == b && std::signbit(a) == std::signbit(b));
}

// ---------------------------------------------------------------------------------------------
// Fragment maps.

template <typename F>
void expect_bijection(F coord, int regs, int rows, int cols, const char* what) {
  std::set<std::pair<int, int>> seen;
  for (int lane = 0; lane < 32; ++lane) {
    for (int e = 0; e < regs; ++e) {
      const w::frag_coord c = coord(lane, e);
      ASSERT_GE(c.row, 0) << what;
      ASSERT_LT(c.row, rows) << what;
      ASSERT_GE(c.col, 0) << what;
      ASSERT_LT(c.col, cols) << what;
      EXPECT_TRUE(seen.insert({c.row, c.col}).second)
          << what << ": lane " << lane << " element " << e << " duplicates (" << c.row << "," << c.col << ")";
    }
  }
  EXPECT_EQ(seen.size(), static_cast<std::size_t>(rows * cols)) << what;
}

TEST(CudaWarpFragments, EveryMapIsABijectionOntoItsTile) {
  expect_bijection(w::mma_c_coord, 4, 16, 8, "C of m16n8k16/k8");
  expect_bijection(w::mma_a16_coord, 8, 16, 16, "A of m16n8k16");
  expect_bijection(w::mma_b16_coord, 4, 16, 8, "B of m16n8k16");
  expect_bijection(w::mma_a_tf32_coord, 4, 16, 8, "A of m16n8k8 tf32");
  expect_bijection(w::mma_b_tf32_coord, 2, 8, 8, "B of m16n8k8 tf32");
  expect_bijection(w::mma_sp_a16_coord, 8, 16, 16, "sparse A of m16n8k32 (compressed)");
  expect_bijection(w::mma_sp_b16_coord, 8, 32, 8, "B of m16n8k32");
  expect_bijection(w::mma_sp_a_tf32_coord, 4, 16, 8, "sparse A of m16n8k16 tf32 (compressed)");
}

TEST(CudaWarpFragments, AgreeWithThePtxTables) {
  // Literal entries of the PTX figures (groupID g, threadID_in_group t): lane 13 is g = 3, t = 1.
  EXPECT_EQ(w::mma_c_coord(13, 0).row, 3);
  EXPECT_EQ(w::mma_c_coord(13, 1).col, 3);
  EXPECT_EQ(w::mma_c_coord(13, 2).row, 11);
  EXPECT_EQ(w::mma_a16_coord(13, 5).col, 11);   // a5: row g, col 2t + 1 + 8
  EXPECT_EQ(w::mma_a16_coord(13, 6).row, 11);   // a6: row g + 8
  EXPECT_EQ(w::mma_b16_coord(13, 3).row, 11);   // b3: k = 2t + 9
  EXPECT_EQ(w::mma_b16_coord(13, 3).col, 3);    // n = g
  // Sparse A m16n8k32: a4,a5 are row g, chunk t + 4 = keys 16 + 4t .. 19 + 4t (compressed 8 + 2t).
  EXPECT_EQ(w::mma_sp_a16_coord(13, 4).row, 3);
  EXPECT_EQ(w::mma_sp_a16_coord(13, 4).col, 10);
  EXPECT_EQ(w::mma_sp_a16_coord(13, 7).row, 11);
  EXPECT_EQ(w::mma_sp_a16_coord(13, 7).col, 11);
  // B m16n8k32: b7 at k = 2t + 1 + 24.
  EXPECT_EQ(w::mma_sp_b16_coord(13, 7).row, 27);
  // tf32: a3 of m16n8k8 / sparse m16n8k16 is row g + 8, column (pair) t + 4.
  EXPECT_EQ(w::mma_a_tf32_coord(13, 3).row, 11);
  EXPECT_EQ(w::mma_a_tf32_coord(13, 3).col, 5);
  EXPECT_EQ(w::mma_b_tf32_coord(13, 1).row, 5);
  // Metadata (anchors C.4): selector 1, row 11 (g = 3, upper half), chunk 6 -> lane 4*3 + 2 + 1,
  // bits 16 + 4 * 2.
  const w::meta_slot m = w::mma_sp_meta_slot(11, 6, 1);
  EXPECT_EQ(m.lane, 15);
  EXPECT_EQ(m.shift, 24);
  EXPECT_EQ(w::mma_sp_meta_slot(0, 0, 0).lane, 0);
  EXPECT_EQ(w::mma_sp_meta_slot(0, 4, 0).lane, 1);
  EXPECT_EQ(w::mma_sp_meta_slot(7, 3, 1).lane, 30);
}

TEST(CudaWarpFragments, KeyPermutationGivesEachLaneWholeGroups) {
  std::set<int> keys;
  for (int s = 0; s < 32; ++s) {
    const int k = w::sddmm16_key_of_column(s);
    keys.insert(k);
    EXPECT_EQ(w::sddmm16_column_of_key(k), s);
  }
  EXPECT_EQ(keys.size(), 32u);
  // The original artifact's permutation within 16 keys.
  const int artifact[16] = {0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15};
  for (int s = 0; s < 16; ++s) EXPECT_EQ(w::sddmm16_key_of_column(s), artifact[s]) << s;
  // Lane t holds, in every row, keys 4t..4t+3 (chunk t) and 16+4t..19+4t (chunk t+4): exactly the
  // chunks of its sparse A fragment.
  for (int lane = 0; lane < 32; ++lane) {
    std::set<int> chunk_keys;
    for (int j = 0; j < 4; ++j) {
      for (int r = 0; r < 4; ++r) chunk_keys.insert(w::sddmm16_acc_coord(lane, 0, j, r).col);
    }
    const int t = lane & 3;
    const std::set<int> want = {4 * t, 4 * t + 1, 4 * t + 2, 4 * t + 3,
                                16 + 4 * t, 17 + 4 * t, 18 + 4 * t, 19 + 4 * t};
    EXPECT_EQ(chunk_keys, want) << "lane " << lane;
  }
}

// ---------------------------------------------------------------------------------------------
// mma.sp emulation, written from the PTX fragment tables (not from the functions under test).
// a[lane][e]: kept values; e_reg[lane]: metadata registers; f: sparsity selector; b: dense B
// [K][8]. Returns D = A B as [16][8] in double, or fails on an illegal ordered-metadata nibble.

// m16n8k32 f16/bf16: row r = g or g + 8; chunk c (4 keys) of row r has its values in lane
// 4g + (c % 4), registers {0,1} (c < 4, row g), {2,3} (c < 4, row g + 8), {4,5}, {6,7} (c >= 4);
// its nibble in lane 4g + 2f + (c / 4), bits 16 * (r / 8) + 4 * (c % 4).
::testing::AssertionResult emulate_mma_sp_k32(const std::array<std::array<float, 8>, 32>& a,
                                              const std::array<std::uint32_t, 32>& e_reg, int f,
                                              const std::vector<double>& b,
                                              std::vector<double>& d) {
  d.assign(16 * 8, 0.0);
  for (int r = 0; r < 16; ++r) {
    const int g = r % 8;
    const int half = r / 8;
    std::vector<double> arow(32, 0.0);
    for (int c = 0; c < 8; ++c) {
      const int meta_lane = 4 * g + 2 * f + c / 4;
      const std::uint32_t nib = (e_reg[static_cast<std::size_t>(meta_lane)] >> (16 * half + 4 * (c % 4))) & 0xFu;
      const std::uint32_t i0 = nib & 3u;
      const std::uint32_t i1 = nib >> 2;
      if (!(i0 < i1)) {
        return ::testing::AssertionFailure()
               << "illegal ordered nibble 0x" << std::hex << nib << std::dec << " row " << r << " chunk " << c;
      }
      const int val_lane = 4 * g + c % 4;
      const int reg = (c >= 4 ? 4 : 0) + 2 * half;
      arow[static_cast<std::size_t>(4 * c + static_cast<int>(i0))] =
          static_cast<double>(a[static_cast<std::size_t>(val_lane)][static_cast<std::size_t>(reg)]);
      arow[static_cast<std::size_t>(4 * c + static_cast<int>(i1))] =
          static_cast<double>(a[static_cast<std::size_t>(val_lane)][static_cast<std::size_t>(reg + 1)]);
    }
    for (int n = 0; n < 8; ++n) {
      double acc = 0.0;
      for (int k = 0; k < 32; ++k) acc += arow[static_cast<std::size_t>(k)] * b[static_cast<std::size_t>(k * 8 + n)];
      d[static_cast<std::size_t>(r * 8 + n)] = acc;
    }
  }
  return ::testing::AssertionSuccess();
}

// m16n8k16 tf32: row r = g or g + 8; pair c (2 keys, 0..7) of row r has its value in lane
// 4g + (c % 4), register (r / 8) + 2 * (c / 4); its code in lane 4g + 2f + (c / 4), bits
// 16 * (r / 8) + 4 * (c % 4), legal codes 0x4 (position 0) and 0xE (position 1).
::testing::AssertionResult emulate_mma_sp_tf32_k16(const std::array<std::array<float, 4>, 32>& a,
                                                   const std::array<std::uint32_t, 32>& e_reg, int f,
                                                   const std::vector<double>& b,
                                                   std::vector<double>& d) {
  d.assign(16 * 8, 0.0);
  for (int r = 0; r < 16; ++r) {
    const int g = r % 8;
    const int half = r / 8;
    std::vector<double> arow(16, 0.0);
    for (int c = 0; c < 8; ++c) {
      const int meta_lane = 4 * g + 2 * f + c / 4;
      const std::uint32_t code = (e_reg[static_cast<std::size_t>(meta_lane)] >> (16 * half + 4 * (c % 4))) & 0xFu;
      if (code != 0x4u && code != 0xEu) {
        return ::testing::AssertionFailure() << "illegal tf32 code 0x" << std::hex << code << std::dec
                                             << " row " << r << " pair " << c;
      }
      const int pos = code == 0x4u ? 0 : 1;
      arow[static_cast<std::size_t>(2 * c + pos)] =
          static_cast<double>(a[static_cast<std::size_t>(4 * g + c % 4)][static_cast<std::size_t>(half + 2 * (c / 4))]);
    }
    for (int n = 0; n < 8; ++n) {
      double acc = 0.0;
      for (int k = 0; k < 16; ++k) acc += arow[static_cast<std::size_t>(k)] * b[static_cast<std::size_t>(k * 8 + n)];
      d[static_cast<std::size_t>(r * 8 + n)] = acc;
    }
  }
  return ::testing::AssertionSuccess();
}

// ---------------------------------------------------------------------------------------------
// 16-bit units.

struct unit16_run {
  std::array<std::array<std::array<float, 8>, 32>, 2> a{};  // [tile][lane][e]
  std::array<std::uint32_t, 32> meta{};                      // per lane, after the exchange
};

// Simulates the 32 lanes of one unit: loads each lane's accumulators from the natural-order
// tile s[32][32] through the fragment maps, selects (with the kernel's no-NaN rule when @p no_nan,
// else the general one), and runs the quad exchange.
unit16_run run_unit16(const std::vector<float>& s, w::sp_pattern p, bool no_nan = false) {
  unit16_run out;
  w::host_warp::u32 bits[2][2] = {};
  for (int lane = 0; lane < 32; ++lane) {
    float acc[2][4][4];
    for (int i = 0; i < 2; ++i) {
      for (int j = 0; j < 4; ++j) {
        for (int r = 0; r < 4; ++r) {
          const w::frag_coord c = w::sddmm16_acc_coord(lane, i, j, r);
          acc[i][j][r] = s[static_cast<std::size_t>(c.row * 32 + c.col)];
        }
      }
    }
    const w::unit16_selection<float> sel = no_nan ? w::select_unit16_no_nan(acc, lane, p) : w::select_unit16(acc, lane, p);
    for (int i = 0; i < 2; ++i) {
      for (int e = 0; e < 8; ++e) out.a[static_cast<std::size_t>(i)][static_cast<std::size_t>(lane)][static_cast<std::size_t>(e)] = sel.a[i][e];
      for (int h = 0; h < 2; ++h) bits[i][h][lane] = sel.meta_bits[i][h];
    }
  }
  const w::host_warp::u32 m = w::meta_quad_exchange<w::host_warp>(bits[0][0], bits[0][1], bits[1][0], bits[1][1]);
  for (int lane = 0; lane < 32; ++lane) out.meta[static_cast<std::size_t>(lane)] = m[lane];
  return out;
}

pattern to_pattern(w::sp_pattern p) { return p == w::sp_pattern::p2of4 ? pattern{2, 4} : pattern{1, 2}; }
meta_format to_format(w::sp_pattern p) {
  return p == w::sp_pattern::p2of4 ? meta_format::sm80_16bit_2of4 : meta_format::sm80_16bit_1of2;
}

void check_unit16(const std::vector<float>& s, w::sp_pattern p, bool check_product, const std::string& what,
                  bool no_nan = false) {
  SCOPED_TRACE(what + (no_nan ? " (no-NaN rule)" : ""));
  const unit16_run run = run_unit16(s, p, no_nan);
  const pattern pat = to_pattern(p);

  // Format module: compressed values and indices (16 per row), row-order words (2 per row), and
  // the reordered layout of those words.
  std::vector<float> values(32 * 16);
  std::vector<std::int32_t> indices(32 * 16);
  dfss::nm_compress(s.data(), 32, 32, 32, pat, values.data(), indices.data());
  std::vector<std::uint16_t> words(32 * 2);
  dfss::nm_metadata_encode(indices.data(), 32, 32, pat, to_format(p), words.data());
  std::vector<std::uint16_t> reordered(static_cast<std::size_t>(dfss::nm_metadata_reordered_size(32, 32)));
  dfss::nm_metadata_reorder(words.data(), 32, 32, reordered.data());

  // (a) kept values: every lane's sparse A element at its (row, compressed col) equals the format
  // module's compressed value there (so the kept set and its order agree). The no-NaN rule takes a
  // pair's value as its maximum, which may return +0 for a kept -0 (or the reverse) in a tie of
  // zeros: the same weight exp2(0 - m), and the metadata (b) still names the exact key, so there
  // the values are compared as numbers.
  for (int i = 0; i < 2; ++i) {
    for (int lane = 0; lane < 32; ++lane) {
      for (int e = 0; e < 8; ++e) {
        const w::frag_coord c = w::mma_sp_a16_coord(lane, e);
        const float want = values[static_cast<std::size_t>((16 * i + c.row) * 16 + c.col)];
        const float got = run.a[static_cast<std::size_t>(i)][static_cast<std::size_t>(lane)][static_cast<std::size_t>(e)];
        ASSERT_TRUE(no_nan ? (got == want || (std::isnan(got) && std::isnan(want))) : same_float(got, want))
            << "tile " << i << " lane " << lane << " e " << e << ": " << got << " vs " << want;
      }
    }
  }
  // (b) metadata, two ways. First the anchors C.4 positions: lane 4g + 2f + h holds
  // W(16f + g, h) | W(16f + g + 8, h) << 16.
  for (int lane = 0; lane < 32; ++lane) {
    const int g = lane >> 2;
    const int f = (lane >> 1) & 1;
    const int h = lane & 1;
    const std::uint32_t want = words[static_cast<std::size_t>((16 * f + g) * 2 + h)] |
                               (static_cast<std::uint32_t>(words[static_cast<std::size_t>((16 * f + g + 8) * 2 + h)]) << 16);
    ASSERT_EQ(run.meta[static_cast<std::size_t>(lane)], want) << "lane " << lane;
    // Then the reordered global layout: the int32 at slot `lane` of column pair 0.
    const std::uint32_t stored = reordered[static_cast<std::size_t>(2 * lane)] |
                                 (static_cast<std::uint32_t>(reordered[static_cast<std::size_t>(2 * lane + 1)]) << 16);
    ASSERT_EQ(run.meta[static_cast<std::size_t>(lane)], stored) << "lane " << lane;
    // Every field is legal for the pattern.
    for (int q = 0; q < 8; ++q) {
      const std::uint32_t nib = (run.meta[static_cast<std::size_t>(lane)] >> (4 * q)) & 0xFu;
      ASSERT_TRUE(p == w::sp_pattern::p2of4 ? dfss::is_legal_ordered_nibble(nib)
                                            : dfss::is_legal_1of2_as_2of4_nibble(nib)) << std::hex << nib;
    }
  }
  // Cross-check with mma_sp_meta_slot: the slot of (row, chunk) holds the format module's nibble.
  for (int r = 0; r < 32; ++r) {
    for (int c = 0; c < 8; ++c) {
      const w::meta_slot m = w::mma_sp_meta_slot(r % 16, c, r / 16);
      const std::uint32_t nib = (run.meta[static_cast<std::size_t>(m.lane)] >> m.shift) & 0xFu;
      const std::uint32_t want = (words[static_cast<std::size_t>(r * 2 + c / 4)] >> (4 * (c % 4))) & 0xFu;
      ASSERT_EQ(nib, want) << "row " << r << " chunk " << c;
    }
  }
  if (!check_product) return;
  // (c) the emulated mma.sp of each m16 tile (selector f = tile) times a random B equals the dense
  // product of the pruned tile (pruned entries 0).
  std::mt19937_64 rng(seed_for(what.c_str()));
  std::uniform_int_distribution<int> bd(-3, 3);
  std::vector<double> b(32 * 8);
  for (auto& x : b) x = bd(rng);
  for (int i = 0; i < 2; ++i) {
    std::vector<double> d;
    ASSERT_TRUE(emulate_mma_sp_k32(run.a[static_cast<std::size_t>(i)], run.meta, i, b, d));
    for (int r = 0; r < 16; ++r) {
      const int row = 16 * i + r;
      for (int n = 0; n < 8; ++n) {
        double want = 0.0;
        for (int slot = 0; slot < 16; ++slot) {
          const std::size_t o = static_cast<std::size_t>(row * 16 + slot);
          want += static_cast<double>(values[o]) * b[static_cast<std::size_t>(indices[o] * 8 + n)];
        }
        ASSERT_EQ(d[static_cast<std::size_t>(r * 8 + n)], want) << "row " << row << " n " << n;
      }
    }
  }
}

TEST(CudaWarpSelect16, TieFreeTiles2of4And1of2) {
  std::mt19937_64 rng(seed_for("tie_free16"));
  for (int rep = 0; rep < 50; ++rep) {
    const std::vector<float> s = make_tile(rng, 32, 32, tile_kind::tie_free);
    for (bool no_nan : {false, true}) {
      check_unit16(s, w::sp_pattern::p2of4, true, "2:4 tie-free " + std::to_string(rep), no_nan);
      check_unit16(s, w::sp_pattern::p1of2, true, "1:2 tie-free " + std::to_string(rep), no_nan);
    }
  }
}

TEST(CudaWarpSelect16, TiedSmallIntegerTiles) {
  std::mt19937_64 rng(seed_for("ties16"));
  for (int rep = 0; rep < 50; ++rep) {
    const std::vector<float> s = make_tile(rng, 32, 32, tile_kind::small_ints);
    for (bool no_nan : {false, true}) {
      check_unit16(s, w::sp_pattern::p2of4, true, "2:4 ties " + std::to_string(rep), no_nan);
      check_unit16(s, w::sp_pattern::p1of2, true, "1:2 ties " + std::to_string(rep), no_nan);
    }
  }
}

TEST(CudaWarpSelect16, InfAndNaNTiles) {
  std::mt19937_64 rng(seed_for("infnan16"));
  for (int rep = 0; rep < 100; ++rep) {
    const std::vector<float> s = make_tile(rng, 32, 32, tile_kind::ties_inf_nan);
    check_unit16(s, w::sp_pattern::p2of4, false, "2:4 inf/nan " + std::to_string(rep));
    check_unit16(s, w::sp_pattern::p1of2, false, "1:2 inf/nan " + std::to_string(rep));
  }
  // Whole rows of -inf (fully masked): every group keeps its lowest positions (nibble 0x4 for 2:4,
  // 0x8 for 1:2), which are legal.
  std::vector<float> s(32 * 32, -kInfF);
  for (bool no_nan : {false, true}) {
    check_unit16(s, w::sp_pattern::p2of4, false, "2:4 all -inf", no_nan);
    check_unit16(s, w::sp_pattern::p1of2, false, "1:2 all -inf", no_nan);
  }
}

TEST(CudaWarpSelect16, NoNanRuleWithInfinitiesAndSignedZeros) {
  // The kernel's rule equals the general ranking on every NaN-free input, infinities, ties of
  // -inf and +-0 included; with NaN it still yields legal nibbles and keeps a NaN value.
  std::mt19937_64 rng(seed_for("nonan16"));
  for (int rep = 0; rep < 100; ++rep) {
    std::vector<float> s = make_tile(rng, 32, 32, tile_kind::ties_inf_nan);
    std::vector<float> no_nan = s;
    for (std::size_t x = 0; x < no_nan.size(); ++x) {
      if (std::isnan(no_nan[x])) no_nan[x] = (x % 3 == 0) ? kInfF : ((x % 3 == 1) ? -0.0f : 0.0f);
    }
    check_unit16(no_nan, w::sp_pattern::p2of4, false, "2:4 inf/zeros " + std::to_string(rep), true);
    check_unit16(no_nan, w::sp_pattern::p1of2, false, "1:2 inf/zeros " + std::to_string(rep), true);
    for (w::sp_pattern p : {w::sp_pattern::p2of4, w::sp_pattern::p1of2}) {
      const unit16_run run = run_unit16(s, p, true);
      for (std::uint32_t m : run.meta) {
        for (int q = 0; q < 8; ++q) ASSERT_TRUE(dfss::is_legal_ordered_nibble((m >> (4 * q)) & 0xFu));
      }
      // A group (a pair for 1:2) holding a NaN keeps a NaN value: the row maximum over kept values
      // is then NaN, which makes the row NaN.
      for (int i = 0; i < 2; ++i) {
        for (int lane = 0; lane < 32; ++lane) {
          for (int e = 0; e < 8; e += 2) {
            const w::frag_coord c = w::mma_sp_a16_coord(lane, e);
            const int row = 16 * i + c.row, group = c.col / 2;
            const float* g = &s[static_cast<std::size_t>(row * 32 + 4 * group)];
            const auto& a = run.a[static_cast<std::size_t>(i)][static_cast<std::size_t>(lane)];
            const bool kept_nan = std::isnan(a[static_cast<std::size_t>(e)]) || std::isnan(a[static_cast<std::size_t>(e + 1)]);
            if (p == w::sp_pattern::p2of4) {
              if (std::isnan(g[0]) || std::isnan(g[1]) || std::isnan(g[2]) || std::isnan(g[3])) {
                ASSERT_TRUE(kept_nan);
              }
            } else {
              if (std::isnan(g[0]) || std::isnan(g[1])) {
                ASSERT_TRUE(std::isnan(a[static_cast<std::size_t>(e)]));
              }
              if (std::isnan(g[2]) || std::isnan(g[3])) {
                ASSERT_TRUE(std::isnan(a[static_cast<std::size_t>(e + 1)]));
              }
            }
          }
        }
      }
    }
  }
}

TEST(CudaWarpSelect16, AllSixNibblesAppearAndMultiplyCorrectly) {
  // Rows built so that group c of row r keeps nibble kNibbles[(r + c) % 6]: each of the six legal
  // ordered nibbles reaches every lane, every register half and both selectors.
  const std::uint32_t kNibbles[6] = {0x4, 0x8, 0xC, 0x9, 0xD, 0xE};
  std::vector<float> s(32 * 32);
  for (int r = 0; r < 32; ++r) {
    for (int c = 0; c < 8; ++c) {
      const std::uint32_t keep = dfss::nm_mask_2of4(kNibbles[(r + c) % 6]);
      for (int p = 0; p < 4; ++p) {
        s[static_cast<std::size_t>(r * 32 + 4 * c + p)] = ((keep >> p) & 1u) ? static_cast<float>(10 + p + r) : static_cast<float>(-p - c);
      }
    }
  }
  check_unit16(s, w::sp_pattern::p2of4, true, "six nibbles");
  check_unit16(s, w::sp_pattern::p2of4, true, "six nibbles", true);
  const unit16_run run = run_unit16(s, w::sp_pattern::p2of4);
  std::set<std::uint32_t> seen;
  for (std::uint32_t m : run.meta) {
    for (int q = 0; q < 8; ++q) seen.insert((m >> (4 * q)) & 0xFu);
  }
  EXPECT_EQ(seen, (std::set<std::uint32_t>{0x4, 0x8, 0xC, 0x9, 0xD, 0xE}));
}

// ---------------------------------------------------------------------------------------------
// tf32 units (32 rows x 16 keys, 1:2).

void check_unit_tf32(const std::vector<float>& s, bool check_product, const std::string& what) {
  SCOPED_TRACE(what);
  std::array<std::array<std::array<float, 4>, 32>, 2> a{};
  w::host_warp::u32 bits[2][2] = {};
  for (int lane = 0; lane < 32; ++lane) {
    float acc[2][2][4];
    for (int i = 0; i < 2; ++i) {
      for (int j = 0; j < 2; ++j) {
        for (int r = 0; r < 4; ++r) {
          const w::frag_coord c = w::sddmm_tf32_acc_coord(lane, i, j, r);
          acc[i][j][r] = s[static_cast<std::size_t>(c.row * 16 + c.col)];
        }
      }
    }
    const w::unit_tf32_selection<float> sel = w::select_unit_tf32(acc, lane);
    for (int i = 0; i < 2; ++i) {
      for (int e = 0; e < 4; ++e) a[static_cast<std::size_t>(i)][static_cast<std::size_t>(lane)][static_cast<std::size_t>(e)] = sel.a[i][e];
      for (int h = 0; h < 2; ++h) bits[i][h][lane] = sel.meta_bits[i][h];
    }
  }
  const w::host_warp::u32 meta = w::meta_quad_exchange<w::host_warp>(bits[0][0], bits[0][1], bits[1][0], bits[1][1]);
  std::array<std::uint32_t, 32> e_reg{};
  for (int lane = 0; lane < 32; ++lane) e_reg[static_cast<std::size_t>(lane)] = meta[lane];

  std::vector<float> values(32 * 8);
  std::vector<std::int32_t> indices(32 * 8);
  dfss::nm_compress(s.data(), 32, 16, 16, pattern{1, 2}, values.data(), indices.data());
  std::vector<std::uint16_t> words(32 * 2);
  dfss::nm_metadata_encode(indices.data(), 32, 16, pattern{1, 2}, meta_format::sm80_tf32_1of2, words.data());
  for (int i = 0; i < 2; ++i) {
    for (int lane = 0; lane < 32; ++lane) {
      for (int e = 0; e < 4; ++e) {
        const w::frag_coord c = w::mma_sp_a_tf32_coord(lane, e);
        ASSERT_TRUE(same_float(a[static_cast<std::size_t>(i)][static_cast<std::size_t>(lane)][static_cast<std::size_t>(e)],
                               values[static_cast<std::size_t>((16 * i + c.row) * 8 + c.col)]))
            << "tile " << i << " lane " << lane << " e " << e;
      }
    }
  }
  for (int lane = 0; lane < 32; ++lane) {
    const int g = lane >> 2;
    const int f = (lane >> 1) & 1;
    const int h = lane & 1;
    const std::uint32_t want = words[static_cast<std::size_t>((16 * f + g) * 2 + h)] |
                               (static_cast<std::uint32_t>(words[static_cast<std::size_t>((16 * f + g + 8) * 2 + h)]) << 16);
    ASSERT_EQ(e_reg[static_cast<std::size_t>(lane)], want) << "lane " << lane;
  }
  if (!check_product) return;
  std::mt19937_64 rng(seed_for(what.c_str()));
  std::uniform_int_distribution<int> bd(-3, 3);
  std::vector<double> b(16 * 8);
  for (auto& x : b) x = bd(rng);
  for (int i = 0; i < 2; ++i) {
    std::vector<double> d;
    ASSERT_TRUE(emulate_mma_sp_tf32_k16(a[static_cast<std::size_t>(i)], e_reg, i, b, d));
    for (int r = 0; r < 16; ++r) {
      const int row = 16 * i + r;
      for (int n = 0; n < 8; ++n) {
        double want = 0.0;
        for (int slot = 0; slot < 8; ++slot) {
          const std::size_t o = static_cast<std::size_t>(row * 8 + slot);
          want += static_cast<double>(values[o]) * b[static_cast<std::size_t>(indices[o] * 8 + n)];
        }
        ASSERT_EQ(d[static_cast<std::size_t>(r * 8 + n)], want) << "row " << row << " n " << n;
      }
    }
  }
}

TEST(CudaWarpSelectTf32, TieFreeTiedAndNaNTiles) {
  std::mt19937_64 rng(seed_for("tf32"));
  for (int rep = 0; rep < 50; ++rep) {
    check_unit_tf32(make_tile(rng, 32, 16, tile_kind::tie_free), true, "tie-free " + std::to_string(rep));
    check_unit_tf32(make_tile(rng, 32, 16, tile_kind::small_ints), true, "ties " + std::to_string(rep));
    check_unit_tf32(make_tile(rng, 32, 16, tile_kind::ties_inf_nan), false, "inf/nan " + std::to_string(rep));
  }
}

// ---------------------------------------------------------------------------------------------
// The quad exchange alone: lane 4g + 2i + h ends with the OR of b[i][h] over its quad, for random
// bits (no structure to lean on).
TEST(CudaWarpExchange, ReduceScatterOverEachQuad) {
  std::mt19937_64 rng(seed_for("exchange"));
  for (int rep = 0; rep < 100; ++rep) {
    w::host_warp::u32 b[2][2];
    for (auto& row : b) {
      for (auto& x : row) {
        for (int l = 0; l < 32; ++l) x[l] = static_cast<std::uint32_t>(rng());
      }
    }
    const w::host_warp::u32 out = w::meta_quad_exchange<w::host_warp>(b[0][0], b[0][1], b[1][0], b[1][1]);
    for (int lane = 0; lane < 32; ++lane) {
      const int i = (lane >> 1) & 1;
      const int h = lane & 1;
      std::uint32_t want = 0;
      for (int q = 0; q < 4; ++q) want |= b[i][h][(lane & ~3) + q];
      ASSERT_EQ(out[lane], want) << "lane " << lane;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// The SDDMM epilogue over whole matrices: masks (key lengths, causal), tails (Lq, Lk not
// multiples of anything), and the global stores of kept scores (in the fragment order of
// softmax_fold.hpp, before the weights are formed) and metadata, simulated tile by tile with the
// kernel's own functions, against nm_compress and nm_metadata_reorder of the masked dense matrix.
struct epilogue_case {
  int rows, keys, kv_len;
  bool causal;
  w::sp_pattern p;
};

void check_epilogue(const epilogue_case& ec, std::mt19937_64& rng) {
  const std::string what = "rows " + std::to_string(ec.rows) + " keys " + std::to_string(ec.keys) + " kv_len " +
                           std::to_string(ec.kv_len) + " causal " + std::to_string(ec.causal) +
                           (ec.p == w::sp_pattern::p2of4 ? " 2:4" : " 1:2");
  SCOPED_TRACE(what);
  const w::intermediate_layout lay = w::intermediate_layout::make(ec.rows, ec.keys);
  // Raw scores over the padded extent (what the MMA would produce: finite garbage past the ends).
  std::vector<float> raw(static_cast<std::size_t>(lay.rows_padded * lay.keys_padded));
  std::uniform_int_distribution<int> small(-3, 3);
  for (auto& x : raw) x = static_cast<float>(small(rng));
  std::vector<float> values(static_cast<std::size_t>(lay.value_elems()), kNaNF);
  std::vector<std::uint32_t> meta(static_cast<std::size_t>(lay.meta_words()), 0xFFFFFFFFu);
  for (std::int64_t rb = 0; rb < lay.rows_padded / 32; ++rb) {
    for (std::int64_t kb = 0; kb < lay.keys_padded / 32; ++kb) {
      w::host_warp::u32 bits[2][2] = {};
      for (int lane = 0; lane < 32; ++lane) {
        float acc[2][4][4];
        for (int i = 0; i < 2; ++i) {
          for (int j = 0; j < 4; ++j) {
            for (int r = 0; r < 4; ++r) {
              const w::frag_coord c = w::sddmm16_acc_coord(lane, i, j, r);
              acc[i][j][r] = raw[static_cast<std::size_t>((32 * rb + c.row) * lay.keys_padded + 32 * kb + c.col)];
            }
          }
        }
        int end[2][2];
        for (int i = 0; i < 2; ++i) {
          for (int rh = 0; rh < 2; ++rh) {
            const std::int64_t row = 32 * rb + 16 * i + 8 * rh + w::group_of(lane);
            end[i][rh] = w::unit_relative_end(
                static_cast<int>(dfss::mask::visible_end(ec.causal, ec.rows, ec.keys, ec.kv_len, row)), static_cast<int>(32 * kb));
          }
        }
        w::mask_unit16_relative(acc, lane, end);
        const w::unit16_selection<float> sel = w::select_unit16_no_nan(acc, lane, ec.p);
        for (int i = 0; i < 2; ++i) {
          for (int e = 0; e < 8; ++e) values[static_cast<std::size_t>(w::fold_value_offset(lay, rb, kb, i, lane) + e)] = sel.a[i][e];
          for (int h = 0; h < 2; ++h) bits[i][h][lane] = sel.meta_bits[i][h];
        }
      }
      const w::host_warp::u32 m = w::meta_quad_exchange<w::host_warp>(bits[0][0], bits[0][1], bits[1][0], bits[1][1]);
      for (int lane = 0; lane < 32; ++lane) meta[static_cast<std::size_t>(lay.meta_offset(rb, kb, lane))] = m[lane];
    }
  }

  // Expected: the masked dense matrix (rows x keys) through the format module.
  std::vector<float> dense(static_cast<std::size_t>(ec.rows * ec.keys));
  for (int r = 0; r < ec.rows; ++r) {
    for (int k = 0; k < ec.keys; ++k) {
      const bool visible = k < ec.kv_len && (!ec.causal || k <= r + (ec.keys - ec.rows));
      dense[static_cast<std::size_t>(r * ec.keys + k)] =
          visible ? raw[static_cast<std::size_t>(r * lay.keys_padded + k)] : -kInfF;
    }
  }
  const pattern pat = to_pattern(ec.p);
  const std::int64_t slots = (ec.keys + pat.m - 1) / pat.m * pat.n;
  std::vector<float> want_v(static_cast<std::size_t>(ec.rows * slots));
  std::vector<std::int32_t> want_i(want_v.size());
  dfss::nm_compress(dense.data(), ec.rows, ec.keys, ec.keys, pat, want_v.data(), want_i.data());
  for (int r = 0; r < ec.rows; ++r) {
    for (std::int64_t c = 0; c < slots; ++c) {
      // nm_compress's slot c is compressed column c for both patterns (two kept per 4 keys).
      ASSERT_TRUE(same_float(values[static_cast<std::size_t>(w::fold_value_index(lay, r, c))],
                             want_v[static_cast<std::size_t>(r * slots + c)]))
          << "row " << r << " slot " << c;
    }
  }
  std::vector<std::uint16_t> words(static_cast<std::size_t>(ec.rows * dfss::nm_metadata_words_per_row(ec.keys, to_format(ec.p))));
  dfss::nm_metadata_encode(want_i.data(), ec.rows, ec.keys, pat, to_format(ec.p), words.data());
  const std::int64_t wpr = dfss::nm_metadata_words_per_row(ec.keys, to_format(ec.p));
  for (int r = 0; r < ec.rows; ++r) {
    for (std::int64_t c = 0; c < wpr; ++c) {
      // Word c of row r through the format module's reordered offset with this layout's padding.
      const std::int64_t o16 = dfss::nm_meta_reordered_offset(r, c, lay.rows_padded);
      const std::uint32_t word32 = meta[static_cast<std::size_t>(o16 / 2)];
      const std::uint32_t got = (o16 % 2 == 0) ? (word32 & 0xFFFFu) : (word32 >> 16);
      ASSERT_EQ(got, words[static_cast<std::size_t>(r * wpr + c)]) << "row " << r << " word " << c;
    }
  }
  // Every int32 of the slice was written with legal fields (padding rows and keys included).
  for (std::uint32_t m : meta) {
    for (int q = 0; q < 8; ++q) ASSERT_TRUE(dfss::is_legal_ordered_nibble((m >> (4 * q)) & 0xFu)) << std::hex << m;
  }
}

TEST(CudaWarpEpilogue, AwkwardShapesMasksAndTails) {
  std::mt19937_64 rng(seed_for("epilogue"));
  const epilogue_case cases[] = {
      {1, 1, 1, false, w::sp_pattern::p2of4},    {45, 77, 77, false, w::sp_pattern::p2of4},
      {45, 77, 50, false, w::sp_pattern::p1of2}, {70, 33, 33, true, w::sp_pattern::p2of4},
      {33, 70, 70, true, w::sp_pattern::p1of2},  {130, 129, 0, false, w::sp_pattern::p2of4},
      {64, 64, 3, true, w::sp_pattern::p2of4},   {100, 200, 131, true, w::sp_pattern::p1of2},
  };
  for (const epilogue_case& ec : cases) check_epilogue(ec, rng);
}

TEST(CudaWarpEpilogue, LayoutSizesAndOffsetsAre64Bit) {
  const w::intermediate_layout lay = w::intermediate_layout::make(70000, 70001);
  EXPECT_EQ(lay.rows_padded % w::kIntermediateRowAlign, 0);
  EXPECT_EQ(lay.keys_padded % w::kIntermediateKeyAlign, 0);
  EXPECT_GE(lay.rows_padded, 70000);
  EXPECT_GE(lay.keys_padded, 70001);
  EXPECT_GT(lay.value_elems(), std::int64_t{1} << 31);
  EXPECT_EQ(w::fold_value_offset(lay, lay.rows_padded / 32 - 1, lay.keys_padded / 32 - 1, 1, 31) + 7, lay.value_elems() - 1);
  EXPECT_EQ(w::fold_value_index(lay, lay.rows_padded - 1, lay.keys_padded / 2 - 1), lay.value_elems() - 1);
  EXPECT_EQ(w::fold_tile_max_offset(lay, lay.rows_padded / 32 - 1, lay.keys_padded / w::kFoldStepKeys - 1, 31),
            w::fold_tile_max_elems(lay) - 1);
  EXPECT_EQ(lay.meta_offset(lay.rows_padded / 32 - 1, lay.keys_padded / 32 - 1, 31), lay.meta_words() - 1);
}

TEST(CudaWarpEpilogue, FoldValueIndexInvertsTheFragmentOrder) {
  // Every element e of lane l's sparse A fragment of m16 tile i, unit (rb, kb), sits at row 32 rb +
  // 16 i + row, compressed column 16 kb + col (mma_sp_a16_coord); fold_value_index of that position
  // must be its fragment-order offset, and the map must cover a slice exactly once.
  const w::intermediate_layout lay = w::intermediate_layout::make(130, 100);
  std::vector<int> hits(static_cast<std::size_t>(lay.value_elems()), 0);
  for (std::int64_t rb = 0; rb < lay.rows_padded / 32; ++rb) {
    for (std::int64_t kb = 0; kb < lay.keys_padded / 32; ++kb) {
      for (int i = 0; i < 2; ++i) {
        for (int lane = 0; lane < 32; ++lane) {
          for (int e = 0; e < 8; ++e) {
            const w::frag_coord c = w::mma_sp_a16_coord(lane, e);
            const std::int64_t at = w::fold_value_index(lay, 32 * rb + 16 * i + c.row, 16 * kb + c.col);
            ASSERT_EQ(at, w::fold_value_offset(lay, rb, kb, i, lane) + e);
            ++hits[static_cast<std::size_t>(at)];
          }
        }
      }
    }
  }
  for (int h : hits) ASSERT_EQ(h, 1);
}

TEST(CudaWarpFold, FactorsReferencesAndLaneRows) {
  const float inf = std::numeric_limits<float>::infinity();
  // A unit that masks the whole row (m = -inf) has a finite reference, so its -inf scores weigh 0
  // (exp2(-inf - ref)), not NaN (-inf - -inf); finite maxima are their own reference, NaN stays.
  EXPECT_EQ(w::fold_reference(-inf), -std::numeric_limits<float>::max());
  EXPECT_EQ(w::fold_weight(-inf, w::fold_reference(-inf), 0.5f), 0.0f);
  EXPECT_EQ(w::fold_weight(-inf, w::fold_reference(-inf), 1e30f), 0.0f);
  EXPECT_EQ(w::fold_reference(3.5f), 3.5f);
  EXPECT_EQ(w::fold_reference(-3e38f), -3e38f);
  EXPECT_TRUE(std::isnan(w::fold_reference(std::nanf(""))));
  EXPECT_EQ(w::fold_weight(-inf, 0.0f, 0.5f), 0.0f);             // masked score: weight 0
  EXPECT_EQ(w::fold_weight(3e38f, 3e38f, 0.18f), 1.0f);          // huge finite: difference first
  EXPECT_EQ(w::fold_weight(-3e38f, 3e38f, 0.18f), 0.0f);
  EXPECT_EQ(w::fold_factor(-inf, -inf, 0.5f), 0.0f);             // masked unit of an empty row
  EXPECT_EQ(w::fold_factor(-inf, 2.0f, 0.5f), 0.0f);
  EXPECT_EQ(w::fold_factor(2.0f, 2.0f, 0.5f), 1.0f);
  EXPECT_TRUE(std::isnan(w::fold_factor(1.0f, std::nanf(""), 0.5f)));  // NaN row stays NaN
  EXPECT_TRUE(std::isnan(w::max_nan(1.0f, std::nanf(""))));
  EXPECT_TRUE(std::isnan(w::max_nan(std::nanf(""), -inf)));
  EXPECT_EQ(w::max_nan(-inf, 2.0f), 2.0f);
  // Lane 4 g + 2 i + rh stores row 16 i + 8 rh + g: a bijection onto the unit's 32 rows.
  std::set<int> rows;
  for (int lane = 0; lane < 32; ++lane) {
    const int t = lane & 3;
    EXPECT_EQ(w::fold_lane_row(lane), 16 * (t >> 1) + 8 * (t & 1) + (lane >> 2));
    rows.insert(w::fold_lane_row(lane));
  }
  EXPECT_EQ(rows.size(), 32u);
  EXPECT_EQ(w::unit_relative_end(100, 64), 32);
  EXPECT_EQ(w::unit_relative_end(70, 64), 6);
  EXPECT_EQ(w::unit_relative_end(10, 64), 0);
}

}  // namespace
