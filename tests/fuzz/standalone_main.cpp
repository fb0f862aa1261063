// The driver the fuzz targets are linked with when they are not built with libFuzzer (the ordinary
// g++ builds, ci and asan presets): it runs LLVMFuzzerTestOneInput once on every file named on the
// command line, and on every file in every directory named, so that the seed corpus and the crash
// reproducers replay as an ordinary CTest test. The command line matches libFuzzer's for files, so
// the same CTest command serves both builds. Exits non-zero when a path cannot be read; a finding
// aborts (the targets call std::abort, the sanitizers stop the process).
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size);
// Optional in a target, as with libFuzzer.
extern "C" __attribute__((weak)) int LLVMFuzzerInitialize(int* argc, char*** argv);

namespace {

bool run_file(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    std::fprintf(stderr, "cannot read %s\n", path.c_str());
    return false;
  }
  const std::vector<char> bytes{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
  std::fprintf(stderr, "Running: %s (%zu bytes)\n", path.c_str(), bytes.size());
  // A copy in a buffer of exactly the input's size, so that ASan catches a read past its end.
  std::vector<std::uint8_t> input(bytes.begin(), bytes.end());
  LLVMFuzzerTestOneInput(input.data(), input.size());
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  if (LLVMFuzzerInitialize != nullptr) LLVMFuzzerInitialize(&argc, &argv);
  std::vector<std::filesystem::path> files;
  for (int i = 1; i < argc; ++i) {
    const std::filesystem::path path(argv[i]);
    std::error_code ec;
    if (std::filesystem::is_directory(path, ec)) {
      for (const auto& entry : std::filesystem::directory_iterator(path)) {
        if (entry.is_regular_file()) files.push_back(entry.path());
      }
    } else {
      files.push_back(path);
    }
  }
  std::sort(files.begin(), files.end());
  bool ok = true;
  for (const auto& f : files) ok = run_file(f) && ok;
  std::fprintf(stderr, "Executed %zu inputs\n", files.size());
  return ok ? 0 : 1;
}
