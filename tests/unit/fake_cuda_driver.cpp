// A stand-in for the CUDA driver (a file libcuda.so.1) that the device-pointer tests load: it
// answers cuPointerGetAttribute like the real driver does, calling one marked host range "device
// memory", so that CPU-only CI can check how the API routes and refuses device pointers. It
// exports nothing else, so a CUDA runtime that finds it fails to initialise, as without a driver.
#include <cstddef>
#include <cstdint>

namespace {
std::uintptr_t g_begin = 0, g_end = 0;
bool g_managed = false;
}  // namespace

extern "C" {

/// Marks [ptr, ptr + bytes) as device memory (managed: host-readable managed memory).
__attribute__((visibility("default"))) void dfss_fake_cuda_mark(const void* ptr, std::size_t bytes, bool managed) {
  g_begin = reinterpret_cast<std::uintptr_t>(ptr);
  g_end = g_begin + bytes;
  g_managed = managed;
}

// CUresult cuPointerGetAttribute(void*, CUpointer_attribute, CUdeviceptr): 2 = MEMORY_TYPE
// (answer 2 = CU_MEMORYTYPE_DEVICE), 8 = IS_MANAGED; 1 = CUDA_ERROR_INVALID_VALUE for pointers the
// driver does not know.
__attribute__((visibility("default"))) int cuPointerGetAttribute(void* data, int attribute, unsigned long long ptr) {
  if (ptr < g_begin || ptr >= g_end) return 1;
  if (attribute == 2) {
    *static_cast<unsigned int*>(data) = 2;
    return 0;
  }
  if (attribute == 8) {
    *static_cast<unsigned int*>(data) = g_managed ? 1u : 0u;
    return 0;
  }
  return 1;
}
}
