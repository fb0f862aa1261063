// Where a pointer lives: host memory, or memory only a CUDA device can read.
//
// The API cannot tell from a tensor_view whether its data is host or device memory, and a CPU
// kernel that dereferences a device pointer crashes. This probe asks the CUDA driver, but only
// when the driver is already loaded into the process: device memory cannot exist otherwise, so a
// process that never touched CUDA pays a look at the loader's counts of loaded objects per call
// (dl_iterate_phdr, no system call; a walk of the objects when they changed) and never loads a
// driver.
// It works the same in builds with and without the CUDA backend.
#pragma once

#include "dfss/params.hpp"

namespace dfss::core {

/// @brief True when @p ptr points into CUDA device memory that the host cannot read (managed
/// memory counts as host-readable). False for null, for host memory, and when no CUDA driver is
/// loaded.
bool is_device_pointer(const void* ptr) noexcept;

/// @brief The name of the first argument of @p p whose data is CUDA device memory ("q", "out",
/// ...), or nullptr when all are host memory.
const char* first_device_argument(const attention_params& p) noexcept;

}  // namespace dfss::core
