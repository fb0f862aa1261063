// Device pointers on the host backends (docs/semantics.md, "Memory"): backend::automatic sends a
// call whose data is CUDA device memory to the CUDA backend (or refuses it clearly where this
// build has none); cpu and reference refuse it; nothing dereferences it. A stand-in driver
// (fake_cuda_driver.cpp, a file named libcuda.so.1) marks an ordinary host buffer as device memory, so
// a kernel that read it anyway would compute a result instead of crashing: the tests check that no
// output was written.
#include <gtest/gtest.h>
#include <dlfcn.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "dfss/dfss.hpp"

namespace dfss {
namespace {

using mark_fn = void (*)(const void*, std::size_t, bool);

/// Loads the stand-in driver once; its file name makes the library's probe find it.
mark_fn fake_driver() {
  static mark_fn mark = [] {
    void* h = dlopen(DFSS_FAKE_CUDA_DRIVER, RTLD_NOW | RTLD_GLOBAL);
    return h == nullptr ? nullptr : reinterpret_cast<mark_fn>(dlsym(h, "dfss_fake_cuda_mark"));
  }();
  return mark;
}

struct call {
  std::vector<float> q, k, v, o, lens_f;
  std::vector<std::int32_t> lens{3};
  forward_args a;
  call() : q(1 * 2 * 2 * 4, 0.5f), k(1 * 3 * 1 * 4, 0.25f), v(k), o(q.size(), std::numeric_limits<float>::quiet_NaN()) {
    a.q = make_view(q.data(), {1, 2, 2, 4});
    a.k = make_view(k.data(), {1, 3, 1, 4});
    a.v = make_view(v.data(), {1, 3, 1, 4});
    a.out = make_view(o.data(), {1, 2, 2, 4});
  }
  bool untouched() const {
    for (float x : o)
      if (!std::isnan(x)) return false;
    return true;
  }
};

std::string message_of(const forward_args& a, const attention_config& c) {
  try {
    attention_forward(a, c);
  } catch (const error& e) {
    return e.what();
  }
  return "";
}

// First in the file, so that (in the default order) the probe has already found no driver, and
// remembered the loader's counts, when the stand-in is loaded: a driver loaded after earlier calls
// must still be found.
TEST(DeviceMemory, ADriverLoadedAfterEarlierCallsIsFound) {
  call before;
  attention_config cfg;
  cfg.backend = backend::cpu;
  for (int i = 0; i < 2; ++i) ASSERT_NO_THROW(attention_forward(before.a, cfg));  // no driver yet
  mark_fn mark = fake_driver();
  ASSERT_NE(mark, nullptr) << dlerror();
  call c;
  mark(c.k.data(), c.k.size() * sizeof(float), false);
  const std::string m = message_of(c.a, cfg);
  EXPECT_NE(m.find("argument 'k' is CUDA device memory"), std::string::npos) << m;
  EXPECT_TRUE(c.untouched());
  mark(nullptr, 0, false);
}

TEST(DeviceMemory, HostBackendsRefuseDevicePointers) {
  mark_fn mark = fake_driver();
  ASSERT_NE(mark, nullptr) << dlerror();
  call c;
  mark(c.v.data(), c.v.size() * sizeof(float), false);
  for (backend b : {backend::cpu, backend::reference}) {
    attention_config cfg;
    cfg.backend = b;
    const std::string m = message_of(c.a, cfg);
    EXPECT_NE(m.find("argument 'v' is CUDA device memory, but this backend reads host memory"), std::string::npos)
        << backend_name(b) << ": " << m;
    EXPECT_TRUE(c.untouched()) << backend_name(b);
  }
  mark(nullptr, 0, false);
}

TEST(DeviceMemory, AutomaticRoutesDevicePointersToTheCudaBackend) {
  mark_fn mark = fake_driver();
  ASSERT_NE(mark, nullptr) << dlerror();
  call c;
  mark(c.q.data(), c.q.size() * sizeof(float), false);
  const kernel_selection s = select_kernel(c.a, attention_config{});
  EXPECT_EQ(s.backend, backend::cuda) << s.name << s.reason;
  // No real GPU behind the stand-in: the cuda backend cannot run it (or this build has none), and
  // the error says why the call went there.
  const std::string m = message_of(c.a, attention_config{});
  EXPECT_NE(m.find("argument 'q' is CUDA device memory, so only the cuda backend can run this call"), std::string::npos) << m;
  EXPECT_TRUE(c.untouched());
  mark(nullptr, 0, false);
}

TEST(DeviceMemory, DeviceKeyLengthsAreNotReadByValidation) {
  mark_fn mark = fake_driver();
  ASSERT_NE(mark, nullptr) << dlerror();
  call c;
  c.lens = {99};  // out of range: validation would report it if it read the "device" value
  c.a.key_lengths = make_view(c.lens.data(), {1});
  mark(c.lens.data(), sizeof(std::int32_t), false);
  attention_config cfg;
  cfg.backend = backend::cpu;
  const std::string m = message_of(c.a, cfg);
  EXPECT_NE(m.find("argument 'key_lengths' is CUDA device memory"), std::string::npos) << m;
  mark(nullptr, 0, false);
}

TEST(DeviceMemory, ManagedMemoryIsHostReadable) {
  mark_fn mark = fake_driver();
  ASSERT_NE(mark, nullptr) << dlerror();
  call c;
  mark(c.k.data(), c.k.size() * sizeof(float), true);
  attention_config cfg;
  cfg.backend = backend::cpu;
  ASSERT_NO_THROW(attention_forward(c.a, cfg));
  for (float x : c.o) EXPECT_TRUE(std::isfinite(x));
  mark(nullptr, 0, false);
}

}  // namespace
}  // namespace dfss
