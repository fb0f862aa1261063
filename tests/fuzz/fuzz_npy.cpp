// Fuzz target: the .npy reader (dfss::npy::parse) on arbitrary bytes.
// Contract checked: parse either returns an array or throws dfss::npy::error (anything else escapes
// and is a finding, as are sanitizer reports); a parsed array is consistent (its byte count is
// numel * item size) and survives a serialize/parse round trip unchanged.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>

#include "npy/npy.hpp"

namespace {

[[noreturn]] void finding(const char* what) {
  std::fprintf(stderr, "fuzz_npy: %s\n", what);
  std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  namespace npy = dfss::npy;
  npy::array a;
  try {
    a = npy::parse(data, size, "fuzz input");
  } catch (const npy::error&) {
    return 0;
  }
  if (static_cast<std::size_t>(a.numel()) * a.item_size() != a.bytes.size()) {
    finding("parsed array's byte count differs from numel * item size");
  }
  const std::vector<unsigned char> image = npy::serialize(a);
  const npy::array b = npy::parse(image.data(), image.size(), "round trip");
  if (b.type != a.type || b.shape != a.shape || b.bytes != a.bytes) {
    finding("serialize/parse round trip changed the array");
  }
  return 0;
}
