// The CPU kernel of dfss::merge_attention_states (include/dfss/merge.hpp): one validated
// merge_params in, a status out.
#pragma once

#include "dfss/error.hpp"
#include "dfss/merge.hpp"

namespace dfss::cpu {

/// @brief Merges the rows of p.out_a / p.lse_a with those of p.out_b / p.lse_b into p.out / p.lse
/// (which may be exactly out_a / lse_a: each row is read whole before it is written). Parallel
/// over rows; every row is computed in a fixed order, so results do not depend on the threads.
status merge_states(const merge_params& p) noexcept;

}  // namespace dfss::cpu
