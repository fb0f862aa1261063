// Placeholder: the AVX2 fused forward is being written.
#include "cpu/fused_forward.hpp"

namespace dfss::cpu {

status fused_forward_avx2(const attention_params& p) noexcept { return fused_forward_scalar(p); }

}  // namespace dfss::cpu
