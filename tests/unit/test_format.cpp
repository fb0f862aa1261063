// Tests of the N:M format module: the selection rule (against an independent sort-based brute
// force), the sparse tensor core metadata encodings, compress/decompress, metadata encode/decode,
// the reordered metadata layout (against an independently written slot formula) and argument
// validation.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "dfss/format.hpp"
#include "dfss/format/nm_meta.hpp"
#include "dfss/format/nm_select.hpp"

namespace {

using dfss::meta_format;
using dfss::pattern;

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// ---------------------------------------------------------------------------------------------
// Independent brute force: stable-sort the positions by (class, value), where NaN is class 0,
// numbers class 1 (descending value) and padding class 2; the first n positions are kept. Equal
// keys keep their index order because the sort is stable.
template <typename T>
std::uint32_t brute_select(const T* s, int count, int n, int m) {
  std::vector<int> order(static_cast<std::size_t>(m));
  std::iota(order.begin(), order.end(), 0);
  auto cls = [&](int p) { return p >= count ? 2 : (std::isnan(s[p]) ? 0 : 1); };
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
    const int ca = cls(a);
    const int cb = cls(b);
    if (ca != cb) return ca < cb;
    return ca == 1 && s[a] > s[b];
  });
  std::uint32_t keep = 0;
  for (int k = 0; k < n; ++k) keep |= 1u << order[static_cast<std::size_t>(k)];
  return keep;
}

// Ties (0 and -0 compare equal), infinities and NaN.
const std::vector<double> kAlphabet = {-kInf, -1.0, -0.0, 0.0, 1.0, kInf, kNaN};

std::string describe(const std::vector<double>& v, int count, int n, int m) {
  std::string out =
      std::to_string(n) + ":" + std::to_string(m) + " count " + std::to_string(count) + " [";
  for (double x : v) out += std::to_string(x) + " ";
  return out + "]";
}

// Calls f(tuple) for every tuple of length m over the alphabet.
void for_each_tuple(int m, const std::function<void(const std::vector<double>&)>& f) {
  std::vector<std::size_t> digit(static_cast<std::size_t>(m), 0);
  std::vector<double> v(static_cast<std::size_t>(m));
  while (true) {
    for (std::size_t i = 0; i < v.size(); ++i) v[i] = kAlphabet[digit[i]];
    f(v);
    std::size_t i = 0;
    while (i < digit.size() && ++digit[i] == kAlphabet.size()) digit[i++] = 0;
    if (i == digit.size()) return;
  }
}

TEST(NmSelect, ExhaustiveSmallAlphabetMatchesBruteForce) {
  long checked = 0;
  for (int m = 1; m <= 6; ++m) {
    for_each_tuple(m, [&](const std::vector<double>& v) {
      std::vector<float> vf(v.begin(), v.end());
      for (int n = 1; n <= m; ++n) {
        for (int count = 0; count <= m; ++count) {
          const std::uint32_t expected = brute_select(v.data(), count, n, m);
          const std::uint32_t got = dfss::nm_select_group(v.data(), count, n, m);
          const std::uint32_t got_f = dfss::nm_select_group(vf.data(), count, n, m);
          ASSERT_EQ(got, expected) << describe(v, count, n, m);
          ASSERT_EQ(got_f, expected) << describe(v, count, n, m);
          ASSERT_EQ(dfss::nm_mask_popcount(got), n);
          ++checked;
        }
      }
    });
  }
  EXPECT_GT(checked, 1000000);
}

TEST(NmSelect, SpecialisationsEqualGenericExhaustively) {
  for_each_tuple(2, [](const std::vector<double>& v) {
    std::vector<float> vf(v.begin(), v.end());
    ASSERT_EQ(dfss::nm_select_1of2(v.data()), dfss::nm_select_group(v.data(), 2, 1, 2));
    ASSERT_EQ(dfss::nm_select_1of2(vf.data()), dfss::nm_select_group(vf.data(), 2, 1, 2));
  });
  for_each_tuple(4, [](const std::vector<double>& v) {
    std::vector<float> vf(v.begin(), v.end());
    ASSERT_EQ(dfss::nm_select_2of4(v.data()), dfss::nm_select_group(v.data(), 4, 2, 4))
        << describe(v, 4, 2, 4);
    ASSERT_EQ(dfss::nm_select_2of4(vf.data()), dfss::nm_select_group(vf.data(), 4, 2, 4));
  });
}

TEST(NmSelect, RandomGroupsUpTo16MatchBruteForce) {
  std::mt19937 rng(1234);
  std::uniform_int_distribution<int> small(-3, 3);
  std::uniform_real_distribution<float> real(-4.0f, 4.0f);
  std::uniform_int_distribution<int> special(0, 9);
  for (int iter = 0; iter < 20000; ++iter) {
    const int m = 1 + iter % 16;
    const int n = 1 + static_cast<int>(rng() % static_cast<unsigned>(m));
    const int count = static_cast<int>(rng() % static_cast<unsigned>(m + 1));
    std::vector<float> v(static_cast<std::size_t>(m));
    for (auto& x : v) {
      const int kind = special(rng);
      x = kind == 0   ? std::numeric_limits<float>::quiet_NaN()
          : kind == 1 ? -std::numeric_limits<float>::infinity()
          : kind < 5  ? static_cast<float>(small(rng))
                      : real(rng);
    }
    ASSERT_EQ(dfss::nm_select_group(v.data(), count, n, m), brute_select(v.data(), count, n, m))
        << "iteration " << iter;
  }
}

TEST(NmSelect, TieFreeInputsKeepTheNLargest) {
  std::mt19937 rng(7);
  for (int m = 1; m <= 16; ++m) {
    for (int n = 1; n <= m; ++n) {
      for (int rep = 0; rep < 20; ++rep) {
        std::vector<double> v(static_cast<std::size_t>(m));
        std::iota(v.begin(), v.end(), -5.0);
        std::shuffle(v.begin(), v.end(), rng);
        const std::uint32_t keep = dfss::nm_select_group(v.data(), m, n, m);
        const double threshold = -5.0 + (m - n);  // the n largest are -5+m-n .. -5+m-1
        for (int p = 0; p < m; ++p) {
          EXPECT_EQ(((keep >> p) & 1u) != 0, v[static_cast<std::size_t>(p)] >= threshold)
              << n << ":" << m << " position " << p;
        }
      }
    }
  }
}

TEST(NmSelect, DocumentedCases) {
  const double nan_group[4] = {1.0, kNaN, 2.0, 0.0};
  EXPECT_EQ(dfss::nm_select_2of4(nan_group), 0x6u);  // NaN is never pruned away
  const double inf_group[4] = {-kInf, -kInf, -kInf, -kInf};
  EXPECT_EQ(dfss::nm_select_2of4(inf_group), 0x3u);  // -inf ties go to the lower index
  const double tie_group[4] = {1.0, 3.0, 3.0, 3.0};
  EXPECT_EQ(dfss::nm_select_2of4(tie_group), 0x6u);
  const double partial[3] = {-kInf, 5.0, 0.0};
  EXPECT_EQ(dfss::nm_select_group(partial, 2, 3, 4), 0x7u);  // both reals, then padding 2
  EXPECT_EQ(dfss::nm_select_group(partial, 3, 2, 4), 0x6u);  // padding ranks below -inf
  EXPECT_EQ(dfss::nm_select_group(partial, 0, 2, 4), 0x3u);  // all padding: lowest positions
  const double signed_group[2] = {-2.0, -1.0};
  EXPECT_EQ(dfss::nm_select_1of2(signed_group), 0x2u);  // signed, not magnitude
}

// ---------------------------------------------------------------------------------------------
// Metadata encodings.

TEST(NmMeta, NibbleOfEveryTwoBitMaskIsLegalAndRoundTrips) {
  const std::vector<std::uint32_t> legal = {0x4, 0x8, 0xC, 0x9, 0xD, 0xE};
  std::vector<std::uint32_t> produced;
  for (std::uint32_t mask = 0; mask < 16; ++mask) {
    if (dfss::nm_mask_popcount(mask) != 2) continue;
    const std::uint32_t nibble = dfss::nm_nibble_2of4(mask);
    EXPECT_TRUE(dfss::is_legal_ordered_nibble(nibble)) << mask;
    EXPECT_EQ(dfss::nm_mask_2of4(nibble), mask);
    produced.push_back(nibble);
  }
  std::sort(produced.begin(), produced.end());
  std::vector<std::uint32_t> sorted_legal = legal;
  std::sort(sorted_legal.begin(), sorted_legal.end());
  EXPECT_EQ(produced, sorted_legal);
  for (std::uint32_t nibble = 0; nibble < 32; ++nibble) {
    const bool expected = std::find(legal.begin(), legal.end(), nibble) != legal.end();
    EXPECT_EQ(dfss::is_legal_ordered_nibble(nibble), expected) << nibble;
  }
  EXPECT_EQ(dfss::nm_nibble_2of4(0x3), 0x4u);
  EXPECT_EQ(dfss::nm_nibble_2of4(0x5), 0x8u);
  EXPECT_EQ(dfss::nm_nibble_2of4(0x9), 0xCu);
  EXPECT_EQ(dfss::nm_nibble_2of4(0x6), 0x9u);
  EXPECT_EQ(dfss::nm_nibble_2of4(0xA), 0xDu);
  EXPECT_EQ(dfss::nm_nibble_2of4(0xC), 0xEu);
}

TEST(NmMeta, EverySelectedGroupEncodesToALegalNibble) {
  for_each_tuple(4, [](const std::vector<double>& v) {
    for (int count = 0; count <= 4; ++count) {
      const std::uint32_t nibble =
          dfss::nm_nibble_2of4(dfss::nm_select_group(v.data(), count, 2, 4));
      ASSERT_TRUE(dfss::is_legal_ordered_nibble(nibble)) << describe(v, count, 2, 4);
    }
    const std::uint32_t lo = dfss::nm_select_1of2(v.data());
    const std::uint32_t hi = dfss::nm_select_1of2(v.data() + 2);
    ASSERT_TRUE(dfss::is_legal_1of2_as_2of4_nibble(dfss::nm_nibble_1of2_as_2of4(lo, hi)));
  });
}

TEST(NmMeta, OneOfTwoAsTwoOfFour) {
  const std::uint32_t expected[2][2] = {{0x8, 0xC}, {0x9, 0xD}};  // [lo kept][hi kept]
  for (std::uint32_t lo = 0; lo < 2; ++lo) {
    for (std::uint32_t hi = 0; hi < 2; ++hi) {
      const std::uint32_t nibble = dfss::nm_nibble_1of2_as_2of4(1u << lo, 1u << hi);
      EXPECT_EQ(nibble, expected[lo][hi]);
      EXPECT_TRUE(dfss::is_legal_ordered_nibble(nibble));
      EXPECT_TRUE(dfss::is_legal_1of2_as_2of4_nibble(nibble));
      EXPECT_EQ(dfss::nm_mask_2of4(nibble), (1u << lo) | (4u << hi));
    }
  }
  int one_per_half = 0;
  for (std::uint32_t nibble = 0; nibble < 16; ++nibble) {
    one_per_half += dfss::is_legal_1of2_as_2of4_nibble(nibble) ? 1 : 0;
  }
  EXPECT_EQ(one_per_half, 4);
  EXPECT_FALSE(dfss::is_legal_1of2_as_2of4_nibble(0x4));  // (0,1): both in the low half
  EXPECT_FALSE(dfss::is_legal_1of2_as_2of4_nibble(0xE));  // (2,3): both in the high half
}

TEST(NmMeta, Tf32Codes) {
  EXPECT_EQ(dfss::nm_code_tf32_1of2(0x1), 0x4u);
  EXPECT_EQ(dfss::nm_code_tf32_1of2(0x2), 0xEu);
  EXPECT_EQ(dfss::nm_mask_tf32_1of2(0x4), 0x1u);
  EXPECT_EQ(dfss::nm_mask_tf32_1of2(0xE), 0x2u);
  for (std::uint32_t code = 0; code < 16; ++code) {
    if (code != 0x4 && code != 0xE) {
      EXPECT_EQ(dfss::nm_mask_tf32_1of2(code), 0u) << code;
    }
  }
}

TEST(NmMeta, GroupBitsRoundTripForAllFormats) {
  const meta_format formats[] = {meta_format::sm80_16bit_2of4, meta_format::sm80_16bit_1of2,
                                 meta_format::sm80_tf32_1of2};
  for (meta_format f : formats) {
    const int m = dfss::nm_meta_group_size(f);
    const int n = dfss::nm_meta_keep_count(f);
    const int groups = dfss::nm_meta_keys_per_word(f) / m;
    std::mt19937 rng(static_cast<unsigned>(f) + 5u);
    for (int rep = 0; rep < 500; ++rep) {
      std::uint32_t masks[8] = {};
      std::uint32_t word = 0;
      for (int q = 0; q < groups; ++q) {
        do {
          masks[q] = static_cast<std::uint32_t>(rng()) & ((1u << m) - 1u);
        } while (dfss::nm_mask_popcount(masks[q]) != n);
        word |= dfss::nm_meta_group_bits(f, q, masks[q]);
      }
      ASSERT_LE(word, 0xFFFFu);
      for (int q = 0; q < groups; ++q) {
        ASSERT_EQ(dfss::nm_meta_group_mask(f, q, word), masks[q]) << dfss::meta_format_name(f);
      }
      for (int t = 0; t < 4; ++t) {  // every nibble of the word is a legal 2:4 nibble
        ASSERT_TRUE(dfss::is_legal_ordered_nibble((word >> (4 * t)) & 0xFu));
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Compress / decompress.

std::vector<float> random_matrix(std::mt19937& rng, std::int64_t rows, std::int64_t ld,
                                 bool specials) {
  std::uniform_int_distribution<int> small(-4, 4);
  std::uniform_int_distribution<int> kind(0, 19);
  std::uniform_real_distribution<float> real(-3.0f, 3.0f);
  std::vector<float> v(static_cast<std::size_t>(rows * ld));
  for (auto& x : v) {
    const int k = kind(rng);
    if (specials && k == 0) {
      x = std::numeric_limits<float>::quiet_NaN();
    } else if (specials && k == 1) {
      x = -std::numeric_limits<float>::infinity();
    } else {
      x = k < 8 ? static_cast<float>(small(rng)) : real(rng);
    }
  }
  return v;
}

bool same_float(float a, float b) { return (std::isnan(a) && std::isnan(b)) || a == b; }

const pattern kPatterns[] = {{1, 2},   {2, 4},  {3, 8},   {5, 16}, {1, 1}, {4, 4},
                             {16, 16}, {1, 16}, {15, 16}, {2, 3},  {7, 7}, {1, 4}};

TEST(NmCompress, RoundTripAndSelectionOnRandomRows) {
  std::mt19937 rng(99);
  for (const pattern p : kPatterns) {
    for (std::int64_t cols = 1; cols <= 70; ++cols) {
      const std::int64_t rows = 1 + static_cast<std::int64_t>(rng() % 5);
      const std::int64_t ld = cols + static_cast<std::int64_t>(rng() % 3);
      const std::vector<float> dense = random_matrix(rng, rows, ld, true);
      const std::int64_t groups = (cols + p.m - 1) / p.m;
      const std::int64_t out_cols = groups * p.n;
      std::vector<float> values(static_cast<std::size_t>(rows * out_cols), 42.0f);
      std::vector<std::int32_t> indices(values.size(), -7);
      dfss::nm_compress(dense.data(), rows, cols, ld, p, values.data(), indices.data());

      for (std::int64_t r = 0; r < rows; ++r) {
        for (std::int64_t g = 0; g < groups; ++g) {
          // Expected selection from the brute force on the group's scores.
          const int count = static_cast<int>(std::min<std::int64_t>(p.m, cols - g * p.m));
          const float* s = dense.data() + r * ld + g * p.m;
          const std::uint32_t keep = brute_select(s, count, p.n, p.m);
          int k = 0;
          for (int q = 0; q < p.m; ++q) {
            if (((keep >> q) & 1u) == 0) continue;
            const std::size_t o = static_cast<std::size_t>(r * out_cols + g * p.n + k);
            ASSERT_EQ(indices[o], g * p.m + q) << p.n << ":" << p.m << " cols " << cols;
            if (q < count) {
              ASSERT_TRUE(same_float(values[o], s[q]));
            } else {
              ASSERT_GE(indices[o], cols);
              ASSERT_EQ(values[o], -std::numeric_limits<float>::infinity());
            }
            ++k;
          }
          ASSERT_EQ(k, p.n);
        }
      }

      // Decompress into a buffer whose ld gap holds a sentinel that must survive.
      const float sentinel = 777.0f;
      for (const float fill : {-std::numeric_limits<float>::infinity(), 12345.0f}) {
        std::vector<float> back(static_cast<std::size_t>(rows * ld), sentinel);
        if (fill == 12345.0f) {
          dfss::nm_decompress(values.data(), indices.data(), rows, cols, p, back.data(), ld, fill);
        } else {
          dfss::nm_decompress(values.data(), indices.data(), rows, cols, p, back.data(), ld);
        }
        for (std::int64_t r = 0; r < rows; ++r) {
          for (std::int64_t j = 0; j < ld; ++j) {
            const std::size_t a = static_cast<std::size_t>(r * ld + j);
            if (j >= cols) {
              ASSERT_EQ(back[a], sentinel);
              continue;
            }
            const std::int64_t g = j / p.m;
            const int count = static_cast<int>(std::min<std::int64_t>(p.m, cols - g * p.m));
            const std::uint32_t keep =
                brute_select(dense.data() + r * ld + g * p.m, count, p.n, p.m);
            const bool kept = ((keep >> (j - g * p.m)) & 1u) != 0;
            ASSERT_TRUE(same_float(back[a], kept ? dense[a] : fill))
                << p.n << ":" << p.m << " cols " << cols << " r " << r << " j " << j;
          }
        }
      }
    }
  }
}

TEST(NmCompress, DenseIsIdentityAndDoubleWorks) {
  std::mt19937 rng(3);
  const std::int64_t rows = 3;
  const std::int64_t cols = 37;
  std::vector<double> dense(static_cast<std::size_t>(rows * cols));
  for (auto& x : dense) x = std::uniform_real_distribution<double>(-1.0, 1.0)(rng);
  dense[5] = kNaN;
  for (const pattern p : {pattern{1, 1}, pattern{8, 8}, pattern{16, 16}}) {
    const std::int64_t out_cols = (cols + p.m - 1) / p.m * p.n;
    std::vector<double> values(static_cast<std::size_t>(rows * out_cols));
    std::vector<std::int32_t> indices(values.size());
    dfss::nm_compress(dense.data(), rows, cols, cols, p, values.data(), indices.data());
    std::vector<double> back(dense.size());
    dfss::nm_decompress(values.data(), indices.data(), rows, cols, p, back.data(), cols);
    for (std::size_t i = 0; i < dense.size(); ++i) {
      EXPECT_TRUE((std::isnan(dense[i]) && std::isnan(back[i])) || dense[i] == back[i]) << i;
    }
  }
  // 2:4 on doubles: the two largest of every group.
  const double row[8] = {0.5, -1.0, 2.0, 1.0, -kInf, -kInf, -3.0, -kInf};
  double values[4];
  std::int32_t indices[4];
  dfss::nm_compress(row, 1, 8, 8, pattern{2, 4}, values, indices);
  EXPECT_EQ(indices[0], 2);
  EXPECT_EQ(indices[1], 3);
  EXPECT_EQ(indices[2], 4);
  EXPECT_EQ(indices[3], 6);
  EXPECT_EQ(values[2], -kInf);
  EXPECT_EQ(values[3], -3.0);
}

TEST(NmCompress, EmptyShapesAreNoOps) {
  dfss::nm_compress(static_cast<const float*>(nullptr), 0, 10, 10, pattern{2, 4}, nullptr, nullptr);
  dfss::nm_compress(static_cast<const float*>(nullptr), 4, 0, 0, pattern{2, 4}, nullptr, nullptr);
  dfss::nm_decompress(static_cast<const float*>(nullptr), nullptr, 0, 10, pattern{2, 4},
                      static_cast<float*>(nullptr), 10);
  EXPECT_EQ(dfss::nm_metadata_reordered_size(0, 0), 0);
}

// ---------------------------------------------------------------------------------------------
// Metadata encode / decode.

// Independent word builder: for 16-bit formats the nibble of group-of-4 t is built from the two
// kept key positions in [16c + 4t, 16c + 4t + 4) (lower index in bits [1:0]); for tf32 the code of
// pair t is 0x4 or 0xE at bits 4t. Keys past the row end keep the lowest positions.
std::vector<std::uint16_t> expected_words(const std::vector<std::int32_t>& indices,
                                          std::int64_t rows, std::int64_t cols, pattern p,
                                          meta_format f) {
  const std::int64_t groups = (cols + p.m - 1) / p.m;
  const std::int64_t per_word = f == meta_format::sm80_tf32_1of2 ? 8 : 16;
  const std::int64_t words = (cols + per_word - 1) / per_word;
  std::vector<std::uint16_t> out;
  for (std::int64_t r = 0; r < rows; ++r) {
    std::vector<bool> kept(static_cast<std::size_t>(words * per_word), false);
    for (std::int64_t k = 0; k < groups * p.n; ++k) {
      kept[static_cast<std::size_t>(indices[static_cast<std::size_t>(r * groups * p.n + k)])] =
          true;
    }
    for (std::int64_t g = groups; g * p.m < words * per_word; ++g) {
      for (int k = 0; k < p.n; ++k) kept[static_cast<std::size_t>(g * p.m + k)] = true;
    }
    for (std::int64_t w = 0; w < words; ++w) {
      unsigned word = 0;
      if (f == meta_format::sm80_tf32_1of2) {
        for (unsigned t = 0; t < 4; ++t) {
          word |= (kept[static_cast<std::size_t>(8 * w + 2 * t)] ? 0x4u : 0xEu) << (4 * t);
        }
      } else {
        for (unsigned t = 0; t < 4; ++t) {
          std::vector<unsigned> pos;
          for (unsigned i = 0; i < 4; ++i) {
            if (kept[static_cast<std::size_t>(16 * w + 4 * t + i)]) pos.push_back(i);
          }
          EXPECT_EQ(pos.size(), 2u);
          word |= (pos[0] | (pos[1] << 2)) << (4 * t);
        }
      }
      out.push_back(static_cast<std::uint16_t>(word));
    }
  }
  return out;
}

TEST(NmMetadata, EncodeDecodeRoundTripAllFormats) {
  std::mt19937 rng(2024);
  const meta_format formats[] = {meta_format::sm80_16bit_2of4, meta_format::sm80_16bit_1of2,
                                 meta_format::sm80_tf32_1of2};
  for (meta_format f : formats) {
    const pattern p{dfss::nm_meta_keep_count(f), dfss::nm_meta_group_size(f)};
    for (std::int64_t cols = 1; cols <= 70; ++cols) {
      const std::int64_t rows = 1 + static_cast<std::int64_t>(rng() % 4);
      const std::vector<float> dense = random_matrix(rng, rows, cols, true);
      const std::int64_t out_cols = (cols + p.m - 1) / p.m * p.n;
      std::vector<float> values(static_cast<std::size_t>(rows * out_cols));
      std::vector<std::int32_t> indices(values.size());
      dfss::nm_compress(dense.data(), rows, cols, cols, p, values.data(), indices.data());

      const std::int64_t wpr = dfss::nm_metadata_words_per_row(cols, f);
      ASSERT_EQ(wpr, (cols + (f == meta_format::sm80_tf32_1of2 ? 7 : 15)) /
                         (f == meta_format::sm80_tf32_1of2 ? 8 : 16));
      std::vector<std::uint16_t> words(static_cast<std::size_t>(rows * wpr), 0xFFFF);
      dfss::nm_metadata_encode(indices.data(), rows, cols, p, f, words.data());
      ASSERT_EQ(words, expected_words(indices, rows, cols, p, f))
          << dfss::meta_format_name(f) << " cols " << cols;
      for (std::uint16_t w : words) {
        for (int t = 0; t < 4; ++t) {
          const unsigned nibble = (w >> (4 * t)) & 0xFu;
          ASSERT_TRUE(dfss::is_legal_ordered_nibble(nibble));
          if (f == meta_format::sm80_16bit_1of2) {
            ASSERT_TRUE(dfss::is_legal_1of2_as_2of4_nibble(nibble));
          }
        }
      }
      std::vector<std::int32_t> decoded(indices.size(), -1);
      dfss::nm_metadata_decode(words.data(), rows, cols, f, decoded.data());
      ASSERT_EQ(decoded, indices) << dfss::meta_format_name(f) << " cols " << cols;
    }
  }
}

TEST(NmMetadata, KnownWords) {
  // 2:4 over 16 keys: groups keep (2,3), (0,1) [all -inf], (1,3), (0,2).
  const float inf = std::numeric_limits<float>::infinity();
  const float row[16] = {0, 1, 2, 3, -inf, -inf, -inf, -inf, 0, 5, 0, 6, 9, 1, 8, 1};
  float values[8];
  std::int32_t indices[8];
  dfss::nm_compress(row, 1, 16, 16, pattern{2, 4}, values, indices);
  std::uint16_t word = 0;
  dfss::nm_metadata_encode(indices, 1, 16, pattern{2, 4}, meta_format::sm80_16bit_2of4, &word);
  EXPECT_EQ(word, 0x8D4Eu);
  // Partial row of 5 keys, 2:4: group 0 keeps (2,3); group 1 = key 4 + padding keeps (0,1);
  // groups 2 and 3 are all padding: 0x4.
  dfss::nm_compress(row, 1, 5, 16, pattern{2, 4}, values, indices);
  dfss::nm_metadata_encode(indices, 1, 5, pattern{2, 4}, meta_format::sm80_16bit_2of4, &word);
  EXPECT_EQ(word, 0x444Eu);
  // 1:2 as 2:4 over 16 keys: pairs keep 1,1 | 0,0 | 1,1 | 0,0 -> nibbles 0xD 0x8 0xD 0x8.
  dfss::nm_compress(row, 1, 16, 16, pattern{1, 2}, values, indices);
  dfss::nm_metadata_encode(indices, 1, 16, pattern{1, 2}, meta_format::sm80_16bit_1of2, &word);
  EXPECT_EQ(word, 0x8D8Du);
  // tf32 1:2 over the first 8 keys: pairs keep 1, 1, 0, 0 -> codes 0xE 0xE 0x4 0x4.
  dfss::nm_compress(row, 1, 8, 16, pattern{1, 2}, values, indices);
  dfss::nm_metadata_encode(indices, 1, 8, pattern{1, 2}, meta_format::sm80_tf32_1of2, &word);
  EXPECT_EQ(word, 0x44EEu);
}

TEST(NmMetadata, DecodeRejectsIllegalCodes) {
  std::int32_t indices[8];
  const std::uint16_t bad_2of4 = 0x4F44;  // 0xF repeats index 3
  EXPECT_THROW(dfss::nm_metadata_decode(&bad_2of4, 1, 16, meta_format::sm80_16bit_2of4, indices),
               dfss::error);
  const std::uint16_t bad_1of2 = 0x8884;  // 0x4 keeps two keys of the low half
  EXPECT_THROW(dfss::nm_metadata_decode(&bad_1of2, 1, 16, meta_format::sm80_16bit_1of2, indices),
               dfss::error);
  const std::uint16_t bad_tf32 = 0x4484;  // 0x8 is not a tf32 code
  EXPECT_THROW(dfss::nm_metadata_decode(&bad_tf32, 1, 8, meta_format::sm80_tf32_1of2, indices),
               dfss::error);
}

// ---------------------------------------------------------------------------------------------
// Reordered layout.

// Word W(r, c) of the logical matrix, with padding rows/chunks reading as the padding word.
std::uint16_t logical_word(const std::vector<std::uint16_t>& w, std::int64_t rows,
                           std::int64_t chunks, std::int64_t r, std::int64_t c) {
  if (r >= rows || c >= chunks) return 0x4444;
  return w[static_cast<std::size_t>(r * chunks + c)];
}

std::vector<std::uint16_t> random_legal_words(std::mt19937& rng, std::size_t count) {
  const std::uint16_t legal[6] = {0x4, 0x8, 0xC, 0x9, 0xD, 0xE};
  std::vector<std::uint16_t> w(count);
  for (auto& x : w) {
    unsigned v = 0;
    for (unsigned t = 0; t < 4; ++t) v |= static_cast<unsigned>(legal[rng() % 6]) << (4 * t);
    x = static_cast<std::uint16_t>(v);
  }
  return w;
}

TEST(NmReorder, MatchesIndependentSlotFormula) {
  std::mt19937 rng(11);
  for (const std::int64_t rows : {1, 5, 8, 17, 31, 32, 33, 64, 70, 96}) {
    for (const std::int64_t cols : {1, 16, 17, 32, 40, 64, 65, 100}) {
      const std::int64_t chunks = (cols + 15) / 16;
      const std::vector<std::uint16_t> words =
          random_legal_words(rng, static_cast<std::size_t>(rows * chunks));
      const std::int64_t rows_padded = (rows + 31) / 32 * 32;
      const std::int64_t pairs = (chunks + 1) / 2;
      const std::int64_t size = dfss::nm_metadata_reordered_size(rows, cols);
      ASSERT_EQ(size, rows_padded * pairs * 2);
      std::vector<std::uint16_t> reordered(static_cast<std::size_t>(size), 0xFFFF);
      dfss::nm_metadata_reorder(words.data(), rows, cols, reordered.data());

      // Column pair p is a run of rows_padded int32 slots; slot 32k + 4g + 2i + j holds
      // W(32k + 16i + g, 2p + j) in the low half and W(32k + 16i + 8 + g, 2p + j) in the high.
      for (std::int64_t p = 0; p < pairs; ++p) {
        for (std::int64_t k = 0; k < rows_padded / 32; ++k) {
          for (std::int64_t g = 0; g < 8; ++g) {
            for (std::int64_t i = 0; i < 2; ++i) {
              for (std::int64_t j = 0; j < 2; ++j) {
                const std::int64_t slot = p * rows_padded + 32 * k + 4 * g + 2 * i + j;
                std::uint32_t got = 0;
                std::memcpy(&got, reordered.data() + 2 * slot, sizeof got);
                const std::uint32_t lo =
                    logical_word(words, rows, chunks, 32 * k + 16 * i + g, 2 * p + j);
                const std::uint32_t hi =
                    logical_word(words, rows, chunks, 32 * k + 16 * i + 8 + g, 2 * p + j);
                ASSERT_EQ(got, lo | (hi << 16))
                    << "rows " << rows << " cols " << cols << " pair " << p << " slot " << slot;
              }
            }
          }
        }
      }
      // Fully written: every nibble is legal (the 0xFFFF poison would show as 0xF).
      for (std::uint16_t w : reordered) {
        for (int t = 0; t < 4; ++t)
          ASSERT_TRUE(dfss::is_legal_ordered_nibble((w >> (4 * t)) & 0xFu));
      }
      std::vector<std::uint16_t> back(words.size(), 0);
      dfss::nm_metadata_unreorder(reordered.data(), rows, cols, back.data());
      ASSERT_EQ(back, words) << "rows " << rows << " cols " << cols;
    }
  }
}

TEST(NmReorder, HandComputedOffsets) {
  // From the artifact's formula for a 32-row matrix: R = 4 (r mod 8) + (r mod 32) / 8, swap in 2x2
  // blocks, offset = 2 * 32 * (c / 2) + 2R + (c mod 2).
  EXPECT_EQ(dfss::nm_meta_reordered_offset(0, 0, 32), 0);
  EXPECT_EQ(dfss::nm_meta_reordered_offset(8, 0, 32), 1);
  EXPECT_EQ(dfss::nm_meta_reordered_offset(0, 1, 32), 2);
  EXPECT_EQ(dfss::nm_meta_reordered_offset(8, 1, 32), 3);
  EXPECT_EQ(dfss::nm_meta_reordered_offset(16, 0, 32), 4);
  EXPECT_EQ(dfss::nm_meta_reordered_offset(24, 0, 32), 5);
  EXPECT_EQ(dfss::nm_meta_reordered_offset(16, 1, 32), 6);
  EXPECT_EQ(dfss::nm_meta_reordered_offset(24, 1, 32), 7);
  EXPECT_EQ(dfss::nm_meta_reordered_offset(1, 0, 32), 8);
  EXPECT_EQ(dfss::nm_meta_reordered_offset(31, 3, 32), 64 + 63);
  EXPECT_EQ(dfss::nm_meta_reordered_offset(32, 2, 64), 128 + 64);
}

// ---------------------------------------------------------------------------------------------
// Argument validation.

template <typename F>
void expect_invalid(F&& f, const std::string& fragment) {
  try {
    f();
    ADD_FAILURE() << "no exception; expected one containing: " << fragment;
  } catch (const dfss::error& e) {
    EXPECT_EQ(e.code(), dfss::status_code::invalid_argument);
    EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos)
        << "message: " << e.what() << "\nexpected to contain: " << fragment;
  }
}

TEST(NmValidation, CompressAndDecompress) {
  std::vector<float> dense(64, 1.0f);
  std::vector<float> values(64);
  std::vector<std::int32_t> indices(64);
  auto compress = [&](std::int64_t rows, std::int64_t cols, std::int64_t ld, pattern p,
                      const float* d, float* v, std::int32_t* i) {
    return [=] { dfss::nm_compress(d, rows, cols, ld, p, v, i); };
  };
  const float* d = dense.data();
  float* v = values.data();
  std::int32_t* ix = indices.data();
  expect_invalid(compress(2, 8, 8, pattern{3, 2}, d, v, ix),
                 "dfss::nm_compress: argument 'pattern': expected 1 <= N <= M <= 16, got 3:2");
  expect_invalid(compress(2, 8, 8, pattern{0, 4}, d, v, ix), "got 0:4");
  expect_invalid(compress(2, 8, 8, pattern{2, 17}, d, v, ix), "got 2:17");
  expect_invalid(compress(-1, 8, 8, pattern{2, 4}, d, v, ix),
                 "dfss::nm_compress: argument 'rows': expected >= 0, got -1");
  expect_invalid(compress(2, -3, 8, pattern{2, 4}, d, v, ix),
                 "argument 'cols': expected >= 0, got -3");
  expect_invalid(compress(2, 8, 5, pattern{2, 4}, d, v, ix),
                 "argument 'ld': expected >= cols (8), got 5");
  expect_invalid(compress(2, 8, 8, pattern{2, 4}, nullptr, v, ix),
                 "argument 'dense': expected a non-null pointer");
  expect_invalid(compress(2, 8, 8, pattern{2, 4}, d, nullptr, ix), "argument 'values'");
  expect_invalid(compress(2, 8, 8, pattern{2, 4}, d, v, nullptr), "argument 'indices'");
  expect_invalid(compress(std::int64_t{1} << 40, std::int64_t{1} << 30, std::int64_t{1} << 30,
                          pattern{2, 4}, d, v, ix),
                 "argument 'ld': expected a size that fits in int64");
  expect_invalid(compress(1, std::int64_t{1} << 31, std::int64_t{1} << 31, pattern{2, 4}, d, v, ix),
                 "argument 'cols': expected <= 2147483644 (int32 key indices)");

  std::vector<std::int32_t> bad = {0, 1, 5, 4};  // group 1 not increasing
  expect_invalid(
      [&] {
        dfss::nm_decompress(v, bad.data(), 1, 8, pattern{2, 4}, dense.data(), 8);
      },
      "dfss::nm_decompress: argument 'indices': expected increasing key indices in "
      "[4, 8) for row 0 group 1, got 4 at slot 1");
  bad = {0, 4, 5, 6};  // key 4 is outside group 0
  expect_invalid(
      [&] {
        dfss::nm_decompress(v, bad.data(), 1, 8, pattern{2, 4}, dense.data(), 8);
      },
      "got 4 at slot 1");
  expect_invalid(
      [&] {
        dfss::nm_decompress(v, ix, 1, 8, pattern{2, 4}, dense.data(), 7);
      },
      "dfss::nm_decompress: argument 'ld'");
  expect_invalid(
      [&] {
        dfss::nm_decompress(v, ix, 1, 8, pattern{2, 4}, static_cast<float*>(nullptr), 8);
      },
      "argument 'dense': expected a non-null pointer");
}

TEST(NmValidation, Metadata) {
  std::vector<std::int32_t> indices = {0, 1, 4, 5, 8, 9, 12, 13};
  std::uint16_t words[4] = {};
  expect_invalid(
      [&] {
        dfss::nm_metadata_encode(indices.data(), 1, 16, pattern{2, 4}, meta_format::sm80_tf32_1of2,
                                 words);
      },
      "dfss::nm_metadata_encode: argument 'pattern': expected 1:2 for meta_format "
      "sm80_tf32_1of2, got 2:4");
  expect_invalid(
      [&] {
        dfss::nm_metadata_encode(indices.data(), 1, 16, pattern{1, 2}, meta_format::sm80_16bit_2of4,
                                 words);
      },
      "expected 2:4 for meta_format sm80_16bit_2of4, got 1:2");
  expect_invalid(
      [&] {
        dfss::nm_metadata_encode(indices.data(), 1, 16, pattern{2, 8}, meta_format::sm80_16bit_1of2,
                                 words);
      },
      "expected 1:2 for meta_format sm80_16bit_1of2, got 2:8");
  expect_invalid(
      [&] {
        dfss::nm_metadata_encode(indices.data(), 1, 16, pattern{2, 4}, static_cast<meta_format>(9),
                                 words);
      },
      "argument 'format'");
  expect_invalid(
      [&] {
        dfss::nm_metadata_encode(indices.data(), 1, 16, pattern{2, 4}, meta_format::sm80_16bit_2of4,
                                 nullptr);
      },
      "argument 'words': expected a non-null pointer");
  indices[3] = 3;  // group 1 names key 3
  expect_invalid(
      [&] {
        dfss::nm_metadata_encode(indices.data(), 1, 16, pattern{2, 4}, meta_format::sm80_16bit_2of4,
                                 words);
      },
      "argument 'indices'");
  const std::uint16_t bad = 0x444F;
  expect_invalid(
      [&] { dfss::nm_metadata_decode(&bad, 1, 16, meta_format::sm80_16bit_2of4, indices.data()); },
      "dfss::nm_metadata_decode: argument 'words': expected legal sm80_16bit_2of4 codes (row 0, "
      "word 0, group 0), got 0x444F");
  expect_invalid([&] { dfss::nm_metadata_words_per_row(-1, meta_format::sm80_tf32_1of2); },
                 "dfss::nm_metadata_words_per_row: argument 'cols': expected >= 0, got -1");
  expect_invalid([&] { dfss::nm_metadata_reordered_size(-2, 16); },
                 "dfss::nm_metadata_reordered_size: argument 'rows': expected >= 0, got -2");
  expect_invalid([&] { dfss::nm_metadata_reorder(nullptr, 1, 16, words); },
                 "dfss::nm_metadata_reorder: argument 'row_words': expected a non-null pointer");
  expect_invalid([&] { dfss::nm_metadata_unreorder(words, 1, 16, nullptr); },
                 "dfss::nm_metadata_unreorder: argument 'row_words'");
}

}  // namespace
