// The device-pointer probe (see device_memory.hpp): the CUDA driver API through dlopen, so that
// neither the library nor its users link against the driver for it.
#include "core/device_memory.hpp"

#include <dlfcn.h>
#include <link.h>

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>

namespace dfss::core {
namespace {

// The driver API's ABI (cuda.h), stable since CUDA 4: CUresult cuPointerGetAttribute(void* data,
// CUpointer_attribute attribute, CUdeviceptr ptr), with CUdeviceptr a 64-bit integer.
using pointer_get_attribute_fn = int (*)(void*, int, unsigned long long);
constexpr int kCudaSuccess = 0;                        // CUDA_SUCCESS
constexpr int kAttributeMemoryType = 2;                // CU_POINTER_ATTRIBUTE_MEMORY_TYPE
constexpr int kAttributeIsManaged = 8;                 // CU_POINTER_ATTRIBUTE_IS_MANAGED
constexpr unsigned int kMemoryTypeDevice = 2;          // CU_MEMORYTYPE_DEVICE

/// Room for the path of a loaded driver (PATH_MAX on Linux); a longer one counts as no driver.
constexpr std::size_t kPathRoom = 4096;

/// What find_driver walks with: where the path goes, and the loader's counts of objects added and
/// removed at the last walk that found no driver.
struct driver_search {
  char* path;
  unsigned long long known_adds, known_subs;
  unsigned long long adds = 0, subs = 0;
  bool unchanged = false;
  bool first = true;
};

/// dl_iterate_phdr's callback: the path of a loaded CUDA driver (a file named libcuda.so*) into
/// the kPathRoom chars at search->path. Nothing in it can throw (it runs inside the C library).
int find_driver(dl_phdr_info* info, std::size_t size, void* data) {
  auto* search = static_cast<driver_search*>(data);
  if (search->first) {
    search->first = false;
    if (size >= offsetof(dl_phdr_info, dlpi_subs) + sizeof(info->dlpi_subs)) {
      search->adds = info->dlpi_adds;
      search->subs = info->dlpi_subs;
      // No object loaded or unloaded since a walk that found no driver: none now either.
      if (search->adds == search->known_adds && search->subs == search->known_subs) {
        search->unchanged = true;
        return 1;
      }
    }
  }
  const char* path = info->dlpi_name;
  if (path == nullptr) return 0;
  const char* slash = std::strrchr(path, '/');
  const char* file = slash != nullptr ? slash + 1 : path;
  if (std::strncmp(file, "libcuda.so", 10) != 0 || std::strlen(path) >= kPathRoom) return 0;
  std::strcpy(search->path, path);
  return 1;
}

pointer_get_attribute_fn driver_entry() noexcept {
  // Only a driver already in the process counts. Not cached when absent, since the caller may
  // initialise CUDA later; once found, the driver is never unloaded by CUDA.
  static std::atomic<pointer_get_attribute_fn> cached{nullptr};
  // The loader's counts at the last walk that found no driver (~0: none yet).
  static std::atomic<unsigned long long> absent_adds{~0ull}, absent_subs{~0ull};
  if (pointer_get_attribute_fn fn = cached.load(std::memory_order_acquire)) return fn;
  // The loaded objects are walked in memory: dlopen("libcuda.so.1", RTLD_NOLOAD) of a driver that
  // is absent searches the library path first (ld.so.cache mapped and unmapped, four failed opens),
  // 15-18 us per call on a Zen 4 VM, and the unmap's TLB shoot-down interrupts the other threads.
  // A Python process with torch has about 80 objects loaded (about 1 us a walk): the walk is
  // skipped while the loader's counts of added and removed objects stay those of one that found
  // none.
  std::array<char, kPathRoom> path;
  path[0] = 0;
  driver_search search{path.data(), absent_adds.load(std::memory_order_relaxed),
                       absent_subs.load(std::memory_order_relaxed)};
  dl_iterate_phdr(find_driver, &search);
  if (search.unchanged) return nullptr;
  if (path[0] == 0) {
    absent_adds.store(search.adds, std::memory_order_relaxed);
    absent_subs.store(search.subs, std::memory_order_relaxed);
    return nullptr;
  }
  // A path of a loaded object: dlopen matches it against the loaded list, no search.
  void* handle = dlopen(path.data(), RTLD_LAZY | RTLD_NOLOAD);
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
  // each look-up walks the loaded objects under the loader's lock.
  const pointer_get_attribute_fn get = driver_entry();
  if (get == nullptr) return nullptr;
  for (const auto& a : args) {
    if (on_device(get, a.ptr)) return a.name;
  }
  return nullptr;
}

}  // namespace dfss::core
