// A dfss::tensor_view of a packed .npy array held in memory (shared by the CLI commands).
#pragma once

#include <cstddef>
#include <cstdint>

#include "dfss/tensor.hpp"
#include "npy/npy.hpp"

namespace dfss::cli {

/// Row-major packed view of @p a's bytes with its type and shape.
inline tensor_view view_of(npy::array& a) {
  tensor_view v;
  v.data = a.bytes.data();
  v.type = a.type;
  v.rank = static_cast<int>(a.shape.size());
  std::int64_t stride = 1;
  for (int d = v.rank - 1; d >= 0; --d) {
    v.shape[static_cast<std::size_t>(d)] = a.shape[static_cast<std::size_t>(d)];
    v.stride[static_cast<std::size_t>(d)] = stride;
    stride *= a.shape[static_cast<std::size_t>(d)];
  }
  return v;
}

}  // namespace dfss::cli
