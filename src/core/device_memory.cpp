// The device-pointer probe (see device_memory.hpp): the CUDA driver API through dlopen, so that
// neither the library nor its users link against the driver for it.
#include "core/device_memory.hpp"

#include <dlfcn.h>

#include <atomic>
#include <cstdint>

namespace dfss::core {
namespace {

// The driver API's ABI (cuda.h), stable since CUDA 4: CUresult cuPointerGetAttribute(void* data,
// CUpointer_attribute attribute, CUdeviceptr ptr), with CUdeviceptr a 64-bit integer.
using pointer_get_attribute_fn = int (*)(void*, int, unsigned long long);
constexpr int kCudaSuccess = 0;                        // CUDA_SUCCESS
constexpr int kAttributeMemoryType = 2;                // CU_POINTER_ATTRIBUTE_MEMORY_TYPE
constexpr int kAttributeIsManaged = 8;                 // CU_POINTER_ATTRIBUTE_IS_MANAGED
constexpr unsigned int kMemoryTypeDevice = 2;          // CU_MEMORYTYPE_DEVICE

pointer_get_attribute_fn driver_entry() noexcept {
  // RTLD_NOLOAD: a handle only if the driver is already in the process. Not cached when absent,
  // since the caller may initialise CUDA later; once found, the driver is never unloaded by CUDA.
  static std::atomic<pointer_get_attribute_fn> cached{nullptr};
  if (pointer_get_attribute_fn fn = cached.load(std::memory_order_acquire)) return fn;
  void* handle = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_NOLOAD);
  if (handle == nullptr) return nullptr;
  auto fn = reinterpret_cast<pointer_get_attribute_fn>(dlsym(handle, "cuPointerGetAttribute"));
  dlclose(handle);  // drops only the reference RTLD_NOLOAD added
  cached.store(fn, std::memory_order_release);
  return fn;
}

/// is_device_pointer with the driver's entry point already looked up (null: no driver loaded).
bool on_device(pointer_get_attribute_fn get, const void* ptr) noexcept {
  if (ptr == nullptr || get == nullptr) return false;
  const auto address = static_cast<unsigned long long>(reinterpret_cast<std::uintptr_t>(ptr));
  unsigned int type = 0;
  // Host memory the driver does not know answers CUDA_ERROR_INVALID_VALUE: host.
  if (get(&type, kAttributeMemoryType, address) != kCudaSuccess || type != kMemoryTypeDevice) return false;
  unsigned int managed = 0;
  return get(&managed, kAttributeIsManaged, address) != kCudaSuccess || managed == 0;
}

}  // namespace

bool is_device_pointer(const void* ptr) noexcept { return on_device(driver_entry(), ptr); }

const char* first_device_argument(const attention_params& p) noexcept {
  const struct {
    const char* name;
    const void* ptr;
  } args[] = {{"q", p.q},       {"k", p.k},     {"v", p.v},       {"out", p.o},
              {"lse", p.lse},   {"bias", p.bias}, {"key_lengths", p.key_lengths},
              {"dout", p.dout}, {"dq", p.dq},   {"dk", p.dk},     {"dv", p.dv},
              {"dbias", p.dbias}, {"query_offset", p.query_offset}, {"dlse", p.dlse},
              {"compressed_values", p.compressed_values},
              {"compressed_indices", p.compressed_indices}, {"compressed_meta", p.compressed_meta}};
  // One driver look-up per call, not one per argument: without a loaded driver (the common case)
  // each look-up is a dlopen(RTLD_NOLOAD) under the loader's lock.
  const pointer_get_attribute_fn get = driver_entry();
  if (get == nullptr) return nullptr;
  for (const auto& a : args) {
    if (on_device(get, a.ptr)) return a.name;
  }
  return nullptr;
}

}  // namespace dfss::core
