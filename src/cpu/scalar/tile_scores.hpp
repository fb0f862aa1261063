// The scalar kernels' score function, shared by the scalar forward (attention_forward.cpp) and
// backward (attention_backward.cpp): both call the one compiled instance in tile_scores.cpp, so the
// backward keeps exactly the keys the forward kept, whatever contraction or vectorisation the
// compiler chose for that code.
#pragma once

#include <cstdint>

#include "dfss/numeric.hpp"
#include "dfss/params.hpp"

namespace dfss::cpu::scalar {

/// Key tile width before rounding up to a multiple of M: 64 keys of fp32 scores fit in a few cache
/// lines, and the tile only bounds scratch here (the scalar kernel has no register blocking).
constexpr std::int64_t kKeyTile = 64;

/// @brief Element @p off of @p base (type T) as fp32.
template <typename T>
float load(const void* base, std::int64_t off) {
  return to_float(static_cast<const T*>(base)[off]);
}

/// @brief The scalar kernels' one score computation, shared by the forward and the backward so that
/// both keep exactly the same keys. Fills s[0 .. width) with the fp32 scores of keys j0 .. j0 + width - 1
/// for query row (b, h, i) whose fp32 query is @p q: q . k_j summed in increasing c, plus the bias,
/// -inf for masked keys (j >= end, core::visible_end of the row); then, in every aligned
/// group of M keys (j0 is a multiple of M), the keys not kept set to -inf. Returns whether a kept
/// score is NaN. Never inlined: both directions run the same machine code, whatever contraction or
/// vectorisation the compiler chose for it.
/// Instantiated for float, half and bfloat16 in tile_scores.cpp only.
template <typename T>
bool tile_scores(const attention_params& p, const float* q, std::int64_t b, std::int64_t h, std::int64_t i,
                 std::int64_t j0, std::int64_t width, std::int64_t end, float* s);

extern template bool tile_scores<float>(const attention_params&, const float*, std::int64_t, std::int64_t,
                                        std::int64_t, std::int64_t, std::int64_t, std::int64_t, float*);
extern template bool tile_scores<half>(const attention_params&, const float*, std::int64_t, std::int64_t,
                                       std::int64_t, std::int64_t, std::int64_t, std::int64_t, float*);
extern template bool tile_scores<bfloat16>(const attention_params&, const float*, std::int64_t, std::int64_t,
                                           std::int64_t, std::int64_t, std::int64_t, std::int64_t, float*);

}  // namespace dfss::cpu::scalar
