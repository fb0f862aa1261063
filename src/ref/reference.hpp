// The fp64 scalar reference backend: the oracle of every test and the "reference" backend of the
// public API. It follows docs/semantics.md literally, one query row at a time, in double precision.
#pragma once

#include "dfss/error.hpp"
#include "dfss/params.hpp"

namespace dfss::ref {

/// @brief Forward: writes p.o and, when non-null, p.lse. Parallel over (batch, head) rows with a
/// fixed per-row order, so results do not depend on the thread count.
status reference_forward(const attention_params& p) noexcept;

/// @brief Backward: writes p.dq, p.dk, p.dv and, when non-null, p.dbias. Recomputes the forward in
/// fp64 (p.o and p.lse are not read). Parallel over (batch, kv head); the query heads that share a
/// kv head, and the broadcast dimensions of dbias, are summed in a fixed order.
status reference_backward(const attention_params& p) noexcept;

}  // namespace dfss::ref
