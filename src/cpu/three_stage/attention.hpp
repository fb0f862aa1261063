// Entry point of the CPU three-stage pipeline (attention_forward.cpp): the paper's algorithm, forward
// only, portable C++.
#pragma once

#include "dfss/error.hpp"
#include "dfss/params.hpp"

namespace dfss::cpu {

/// @brief The paper's three-stage pipeline on the CPU: (a) Q K^T with the N:M selection fused into
/// the tile epilogue, writing compressed values, indices and (1:2, 2:4) metadata; (b) softmax over
/// the compressed rows; (c) compressed-by-dense product with V. Writes p.compressed_* when non-null.
status three_stage_forward(const attention_params& p) noexcept;

}  // namespace dfss::cpu
