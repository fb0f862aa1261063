// The CUDA forward's workspace layout (src/cuda/workspace.hpp), on the CPU: every intermediate gets
// its own kWorkspaceAlign-aligned, non-overlapping range of one block, in request order, each pointer
// lands in its own slot with its own type, and sizes that cannot be represented are refused with a
// message naming the intermediate.
#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <vector>

#include "cuda/workspace.hpp"

namespace {

using dfss::cuda::kWorkspaceAlign;
using dfss::cuda::workspace_entry;
using dfss::cuda::workspace_layout;
using dfss::cuda::workspace_plan;
using dfss::cuda::workspace_request;

struct two_floats {
  float x, y;
};

TEST(CudaWorkspace, PlacesEveryIntermediateAlignedWithoutOverlap) {
  void* values = nullptr;
  std::uint32_t* meta = nullptr;
  two_floats* stats = nullptr;
  // Sizes chosen so that no end is a multiple of the alignment: each start must be rounded up.
  const workspace_request req[] = {
      workspace_entry("compressed values", 1001, 2, values),
      workspace_entry("metadata", 77, sizeof(std::uint32_t), meta),
      workspace_entry("statistics", 3, sizeof(two_floats), stats),
  };
  const workspace_plan plan = workspace_layout(req, 3);
  ASSERT_TRUE(plan.error.empty()) << plan.error;
  EXPECT_EQ(plan.offset[0], 0u);
  EXPECT_EQ(plan.offset[1], 2048u);         // 2002 bytes, rounded up to 256
  EXPECT_EQ(plan.offset[2], 2048u + 512u);  // 308 bytes
  EXPECT_EQ(plan.total_bytes, 2048u + 512u + 256u);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(plan.offset[i] % kWorkspaceAlign, 0u);

  std::vector<char> block(plan.total_bytes);
  dfss::cuda::workspace_assign(req, 3, plan, block.data());
  EXPECT_EQ(static_cast<char*>(values), block.data());
  EXPECT_EQ(reinterpret_cast<char*>(meta), block.data() + 2048);
  EXPECT_EQ(reinterpret_cast<char*>(stats), block.data() + 2048 + 512);
}

TEST(CudaWorkspace, EmptyIntermediatesTakeNoSpace) {
  void* a = nullptr;
  void* b = nullptr;
  const workspace_request req[] = {workspace_entry("a", 0, 2, a), workspace_entry("b", 1, 2, b)};
  const workspace_plan plan = workspace_layout(req, 2);
  ASSERT_TRUE(plan.error.empty()) << plan.error;
  EXPECT_EQ(plan.offset[1], 0u);
  EXPECT_EQ(plan.total_bytes, kWorkspaceAlign);
}

TEST(CudaWorkspace, LargerThan32BitSizesAreExact) {
  // The >2^31-element test's shape (B=1, H=2, rows 65664, keys 65600): 2^32 + ... values.
  void* values = nullptr;
  std::uint32_t* meta = nullptr;
  const std::int64_t slices = 2, rows = 65664, keys = 65600;
  const workspace_request req[] = {workspace_entry("compressed values", slices * rows * (keys / 2), 2, values),
                                   workspace_entry("metadata", slices * rows * (keys / 32), 4, meta)};
  const workspace_plan plan = workspace_layout(req, 2);
  ASSERT_TRUE(plan.error.empty()) << plan.error;
  const std::size_t value_bytes = static_cast<std::size_t>(slices * rows * (keys / 2)) * 2;
  EXPECT_GT(value_bytes, std::size_t{1} << 33);
  EXPECT_EQ(plan.offset[1], (value_bytes + kWorkspaceAlign - 1) / kWorkspaceAlign * kWorkspaceAlign);
  EXPECT_EQ(plan.total_bytes, plan.offset[1] + static_cast<std::size_t>(slices * rows * (keys / 32)) * 4);
}

TEST(CudaWorkspace, RefusesUnrepresentableSizesNamingTheIntermediate) {
  void* a = nullptr;
  void* b = nullptr;
  const std::int64_t huge = std::numeric_limits<std::int64_t>::max();
  workspace_request req[] = {workspace_entry("compressed values", huge, 4, a), workspace_entry("metadata", 1, 4, b)};
  workspace_plan plan = workspace_layout(req, 2);
  EXPECT_NE(plan.error.find("'compressed values'"), std::string::npos) << plan.error;
  EXPECT_NE(plan.error.find("does not fit in size_t"), std::string::npos) << plan.error;

  // Each fits alone, the sum does not.
  req[0] = workspace_entry("compressed values", huge, 1, a);
  req[1] = workspace_entry("metadata", huge, 1, b);
  plan = workspace_layout(req, 2);
  EXPECT_NE(plan.error.find("up to 'metadata'"), std::string::npos) << plan.error;

  req[0] = workspace_entry("compressed values", -1, 2, a);
  plan = workspace_layout(req, 1);
  EXPECT_NE(plan.error.find("negative size (-1 elements)"), std::string::npos) << plan.error;

  std::vector<workspace_request> many(workspace_plan::kMaxWorkspaceRequests + 1, workspace_entry("x", 1, 1, a));
  plan = workspace_layout(many.data(), many.size());
  EXPECT_NE(plan.error.find("at most 8"), std::string::npos) << plan.error;
}

}  // namespace
