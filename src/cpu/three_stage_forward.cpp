// Placeholder: the three-stage pipeline is being written.
#include "cpu/fused_forward.hpp"

namespace dfss::cpu {

status three_stage_forward(const attention_params&) noexcept {
  return {status_code::unsupported, "dfss cpu three-stage forward: not implemented yet"};
}

}  // namespace dfss::cpu
