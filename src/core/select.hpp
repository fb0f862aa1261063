// The one kernel selector: from validated params and the requested backend, decides whether a call
// is supported and what runs. Dispatch (api.cpp) and the tests both ask it.
#pragma once

#include "dfss/attention.hpp"
#include "dfss/params.hpp"

namespace dfss::core {

enum class direction { forward, backward };

/// @brief Never throws; returns kind == none with a reason when nothing compiled can run the call.
kernel_selection select(const attention_params& p, const attention_config& config, direction dir);

}  // namespace dfss::core
