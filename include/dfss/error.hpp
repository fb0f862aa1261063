// dfss/error.hpp: the status/exception boundary of the API.
//
// Inside the library, launchers return dfss::status; the public API turns a failed status into a
// dfss::error exception. Messages name the argument, the expected value and the value received.
#pragma once

#include <stdexcept>
#include <string>

namespace dfss {

/// @brief Outcome classes. Values are stable (they are also the CLI's diagnostics).
enum class status_code : int {
  ok = 0,
  invalid_argument = 1,  ///< a bad shape, stride, pointer, pattern, length or option
  unsupported = 2,       ///< valid, but no compiled backend can run it (e.g. fp64 on cpu)
  internal = 3,          ///< a bug in dfss: please report it
  cuda_error = 4,        ///< the CUDA runtime reported an error
};

/// @brief Result of a non-throwing call: code plus a human-readable message.
struct status {
  status_code code = status_code::ok;
  std::string message;
  bool ok() const noexcept { return code == status_code::ok; }
  static status success() { return {}; }
};

/// @brief The exception the public API throws. what() reads like
/// "dfss::attention_forward: argument 'k': expected shape[2] (heads_kv) to divide 12, got 5".
class error : public std::runtime_error {
 public:
  error(status_code code, const std::string& message)
      : std::runtime_error(message), code_(code) {}
  status_code code() const noexcept { return code_; }

 private:
  status_code code_;
};

/// @brief Throws dfss::error when @p s is not ok.
inline void throw_if_error(const status& s) {
  if (!s.ok()) throw error(s.code, s.message);
}

}  // namespace dfss
