// src/cuda/workspace.hpp: how the CUDA forward's intermediates (compressed values, metadata, and
// whatever a kernel adds) are laid out in one workspace allocation. Plain C++ (no CUDA types), so the
// layout arithmetic is unit-tested on the CPU (tests/unit/test_cuda_workspace.cpp); the allocation
// itself (a dfss-owned stream-ordered pool) is in attention_cuda.cu.
//
// A call lists its intermediates as workspace_entry(name, element count, element size, pointer)
// rows. workspace_layout places them one after another in a single block, each at
// a multiple of kWorkspaceAlign bytes, so that adding an intermediate is one more row and one
// allocation serves them all.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace dfss::cuda {

/// Alignment of every intermediate inside the workspace. 256 bytes: what cudaMalloc guarantees, so a
/// buffer carved from the block is aligned as a buffer of its own would be (the kernels' 16-byte
/// vector accesses and cp.async need 16), and no two intermediates share a 256-byte segment.
inline constexpr std::size_t kWorkspaceAlign = 256;

/// One intermediate: @p count elements of @p elem_bytes bytes; assign(slot, address) stores its
/// address in the caller's pointer (made by workspace_entry, with the pointer's own type).
struct workspace_request {
  const char* name;
  std::int64_t count;
  std::size_t elem_bytes;
  void* slot;
  void (*assign)(void* slot, void* address);
};

/// @brief The request for an intermediate whose address goes to @p ptr (any pointer type, void*
/// included: @p elem_bytes is given, not sizeof(T)).
template <typename T>
workspace_request workspace_entry(const char* name, std::int64_t count, std::size_t elem_bytes, T*& ptr) {
  return {name, count, elem_bytes, &ptr, [](void* slot, void* address) { *static_cast<T**>(slot) = static_cast<T*>(address); }};
}

/// The block's size and where each request starts in it.
struct workspace_plan {
  std::size_t total_bytes = 0;
  /// Offsets of the requests, in request order (valid for the first kMaxWorkspaceRequests).
  static constexpr std::size_t kMaxWorkspaceRequests = 8;
  std::size_t offset[kMaxWorkspaceRequests] = {};
  /// Empty when the plan is valid; else why not (naming the request).
  std::string error;
};

/// @brief Places @p n requests one after another, each at a multiple of kWorkspaceAlign. Fails (plan
/// .error names the request) on a negative count, more than kMaxWorkspaceRequests requests, or a
/// total that does not fit in size_t: sizes come from products of the caller's dimensions.
inline workspace_plan workspace_layout(const workspace_request* req, std::size_t n) {
  workspace_plan plan;
  if (n > workspace_plan::kMaxWorkspaceRequests) {
    plan.error = "the CUDA forward has " + std::to_string(n) + " intermediates, at most " +
                 std::to_string(workspace_plan::kMaxWorkspaceRequests) + " are planned for";
    return plan;
  }
  constexpr std::size_t kMax = static_cast<std::size_t>(-1);
  std::size_t at = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const workspace_request& r = req[i];
    if (r.count < 0) {
      plan.error = std::string("the CUDA forward's intermediate '") + r.name + "' has a negative size (" +
                   std::to_string(r.count) + " elements)";
      return plan;
    }
    const auto count = static_cast<std::size_t>(r.count);
    if (r.elem_bytes != 0 && count > kMax / r.elem_bytes) {
      plan.error = std::string("the CUDA forward's intermediate '") + r.name + "' (" + std::to_string(r.count) +
                   " elements of " + std::to_string(r.elem_bytes) + " bytes) does not fit in size_t";
      return plan;
    }
    const std::size_t bytes = count * r.elem_bytes;
    // at is a multiple of kWorkspaceAlign here; the next start rounds at + bytes up to one, which
    // must not wrap: at + bytes + (kWorkspaceAlign - 1) <= kMax, written without overflowing.
    constexpr std::size_t kRoundUp = kWorkspaceAlign - 1;
    if (at > kMax - kRoundUp || bytes > kMax - kRoundUp - at) {
      plan.error = std::string("the CUDA forward's intermediates up to '") + r.name + "' exceed size_t";
      return plan;
    }
    plan.offset[i] = at;
    at = (at + bytes + kWorkspaceAlign - 1) / kWorkspaceAlign * kWorkspaceAlign;
  }
  plan.total_bytes = at;
  return plan;
}

/// @brief Points every request at its place in the block at @p base (as planned by workspace_layout).
inline void workspace_assign(const workspace_request* req, std::size_t n, const workspace_plan& plan, void* base) {
  for (std::size_t i = 0; i < n; ++i) req[i].assign(req[i].slot, static_cast<char*>(base) + plan.offset[i]);
}

}  // namespace dfss::cuda
