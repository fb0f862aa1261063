// npy_roundtrip: reads an .npy file with dfss::npy and writes it back to a second path, so that
// tests/cli/npy_interop.py can check the reader and writer against NumPy itself.
//
// Usage: npy_roundtrip <input.npy> <output.npy>
// Exit status: 0 on success, 1 when the input cannot be read or the output cannot be written
// (the npy::error message is printed), 2 on a usage error.
#include <cstdio>
#include <exception>

#include "npy/npy.hpp"

int main(int argc, char** argv) {
  if (argc != 3) {
    const char* self = argc > 0 ? argv[0] : "npy_roundtrip";
    std::fprintf(stderr, "usage: %s <input.npy> <output.npy>\n", self);
    return 2;
  }
  try {
    dfss::npy::write(argv[2], dfss::npy::read(argv[1]));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "npy_roundtrip: %s\n", e.what());
    return 1;
  }
  return 0;
}
