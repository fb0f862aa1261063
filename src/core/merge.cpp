// dfss::merge_attention_states: validate, refuse device memory, run the CPU kernel.
#include "dfss/merge.hpp"

#include <string>

#include "core/device_memory.hpp"
#include "core/validate.hpp"
#include "cpu/merge_states.hpp"

namespace dfss {
namespace {

constexpr const char* kMergeOp = "dfss::merge_attention_states";

}  // namespace

status try_merge_attention_states(const merge_args& args, int num_threads) noexcept {
  try {
    merge_params p;
    const status st = core::build_merge_params(args, num_threads, kMergeOp, p);
    if (!st.ok()) return st;
    const struct {
      const char* name;
      const void* data;
    } views[] = {{"out_a", p.out_a}, {"lse_a", p.lse_a}, {"out_b", p.out_b},
                 {"lse_b", p.lse_b}, {"out", p.out},     {"lse", p.lse}};
    for (const auto& v : views) {
      if (core::is_device_pointer(v.data)) {
        return {status_code::unsupported, std::string(kMergeOp) + ": argument '" + v.name +
                                              "': expected host memory, got CUDA device memory (the merge runs "
                                              "on the CPU only)"};
      }
    }
    if (p.batch * p.seqlen * p.heads == 0) return status::success();
    return cpu::merge_states(p);
  } catch (const std::exception& e) {
    return {status_code::internal, std::string(kMergeOp) + ": " + e.what()};
  }
}

void merge_attention_states(const merge_args& args, int num_threads) {
  throw_if_error(try_merge_attention_states(args, num_threads));
}

}  // namespace dfss
