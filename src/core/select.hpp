// The one kernel selector: from validated params and the requested backend, decides whether a call
// is supported and which kernel of the registry (core/registry.hpp) runs. Dispatch (api.cpp) and the
// tests both ask it.
#pragma once

#include "core/registry.hpp"
#include "dfss/attention.hpp"
#include "dfss/params.hpp"

namespace dfss::core {

/// @brief Never throws; returns kind == none with a reason when nothing compiled can run the call.
kernel_selection select(const attention_params& p, const attention_config& config, direction dir);

}  // namespace dfss::core
