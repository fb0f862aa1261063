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

/// docs/semantics.md, "Positions" and "Sink and recent windows", literally: global key position x
/// is visible to the query at global position qpos iff x < len and (not causal or x <= qpos); the
/// aligned group [g, g + M) is kept whole iff one of its positions is < sink or in (p - recent, p],
/// p the row's last visible position.
TEST(Mask, PositionsAndWholeGroupsMatchTheSemanticsPage) {
  int rows = 0;
  for (const bool causal : {false, true})
    for (std::int64_t m : {1, 2, 4})
      for (std::int64_t ko = 0; ko <= 8; ko += m)
        for (std::int64_t lk = 0; lk <= 7; ++lk)
          for (std::int64_t len = 0; len <= 18; len += 3)
            for (std::int64_t qpos = 0; qpos <= 18; qpos += 2)
              for (std::int64_t sink = 0; sink <= 5; sink += 5)
                for (std::int64_t recent = 0; recent <= 6; recent += 3) {
                  const std::string where = "causal " + std::to_string(causal) + " M " + std::to_string(m) + " ko " +
                                            std::to_string(ko) + " Lk " + std::to_string(lk) + " len " +
                                            std::to_string(len) + " qpos " + std::to_string(qpos) + " sink " +
                                            std::to_string(sink) + " recent " + std::to_string(recent);
                  const auto vis = [&](std::int64_t x) { return x < len && (!causal || x <= qpos); };
                  std::int64_t last = -1;
                  for (std::int64_t x = 0; x < 40; ++x)
                    if (vis(x)) last = x;
                  const std::int64_t gend = dfss::mask::global_visible_end(causal, len, qpos);
                  EXPECT_EQ(gend, last + 1) << where;
                  std::int64_t count = 0;
                  for (std::int64_t j = 0; j < lk; ++j) count += vis(ko + j) ? 1 : 0;
                  EXPECT_EQ(dfss::mask::local_end(gend, ko, lk), count) << where;
                  const auto w = dfss::mask::whole_groups_of(sink, recent, m, ko, lk, gend);
                  for (std::int64_t g = 0; g < lk; g += m) {
                    bool whole = false;
                    for (std::int64_t x = ko + g; x < ko + g + m; ++x) {
                      whole = whole || x < sink || (recent > 0 && last >= 0 && x <= last && x > last - recent);
                    }
                    EXPECT_EQ(dfss::mask::group_is_whole(w, g), whole) << where << " group " << g;
                  }
                  ++rows;
                }
  EXPECT_GT(rows, 10000);  // the loops ran
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
