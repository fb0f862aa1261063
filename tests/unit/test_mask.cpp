// The one visibility rule (include/dfss/mask/visibility.hpp) against a brute-force statement of
// docs/semantics.md, "The forward function", step 2: row i sees key j iff j < len_b and (not causal
// or j <= i + Lk - Lq). Every small shape: Lq > Lk, Lq == Lk, Lq < Lk, key lengths 0 .. Lk.
#include <gtest/gtest.h>

#include <cstdint>
#include <string>

#include "dfss/mask/visibility.hpp"

namespace {

/// docs/semantics.md, literally.
bool semantics_visible(bool causal, std::int64_t lq, std::int64_t lk, std::int64_t len, std::int64_t i, std::int64_t j) {
  return j < len && (!causal || j <= i + lk - lq);
}

TEST(Mask, MatchesTheSemanticsPageOnEverySmallShape) {
  int rows = 0;
  for (const bool causal : {false, true}) {
    for (std::int64_t lq = 1; lq <= 7; ++lq) {
      for (std::int64_t lk = 0; lk <= 7; ++lk) {
        for (std::int64_t len = 0; len <= lk; ++len) {
          for (std::int64_t i = 0; i < lq; ++i) {
            const std::string where = "causal " + std::to_string(causal) + " Lq " + std::to_string(lq) + " Lk " +
                                      std::to_string(lk) + " len " + std::to_string(len) + " row " + std::to_string(i);
            std::int64_t count = 0;
            for (std::int64_t j = 0; j < lk; ++j) {
              const bool want = semantics_visible(causal, lq, lk, len, i, j);
              EXPECT_EQ(dfss::mask::visible(causal, lq, lk, len, i, j), want) << where << " key " << j;
              count += want ? 1 : 0;
              // The visible keys are a prefix: a key is visible only if every earlier key is.
              if (want) {
                EXPECT_EQ(count, j + 1) << where << " key " << j;
              }
            }
            EXPECT_EQ(dfss::mask::visible_end(causal, lq, lk, len, i), count) << where;
            // causal_end is the rule without key lengths, clamped to [0, Lk].
            std::int64_t causal_count = 0;
            for (std::int64_t j = 0; j < lk; ++j) causal_count += semantics_visible(causal, lq, lk, lk, i, j) ? 1 : 0;
            EXPECT_EQ(dfss::mask::causal_end(causal, lq, lk, i), causal_count) << where;
            ++rows;
          }
        }
      }
    }
  }
  EXPECT_GT(rows, 1000);  // the loops ran
}

TEST(Mask, BottomRightAlignmentExamples) {
  using dfss::mask::visible_end;
  // Lq == Lk: top-left and bottom-right agree, row i sees keys 0..i.
  EXPECT_EQ(visible_end(true, 4, 4, 4, 0), 1);
  EXPECT_EQ(visible_end(true, 4, 4, 4, 3), 4);
  // Lq < Lk (decoding with a cache): the last query row sees every key.
  EXPECT_EQ(visible_end(true, 2, 5, 5, 1), 5);
  EXPECT_EQ(visible_end(true, 2, 5, 5, 0), 4);
  // Lq > Lk: the first Lq - Lk rows see no key (empty rows).
  EXPECT_EQ(visible_end(true, 5, 2, 2, 0), 0);
  EXPECT_EQ(visible_end(true, 5, 2, 2, 2), 0);
  EXPECT_EQ(visible_end(true, 5, 2, 2, 3), 1);
  EXPECT_EQ(visible_end(true, 5, 2, 2, 4), 2);
  // Key lengths bound every row, causal or not; length 0 empties the row.
  EXPECT_EQ(visible_end(false, 3, 6, 4, 2), 4);
  EXPECT_EQ(visible_end(true, 3, 6, 0, 2), 0);
  EXPECT_EQ(visible_end(false, 3, 6, 6, 0), 6);
}

}  // namespace
