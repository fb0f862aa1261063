// dfss/config.hpp: compiler portability macros shared by host (g++) and device (nvcc) code.
//
// Every header under include/dfss/format/ and the index maths it uses are written once and
// compiled by both compilers, so the CPU test suite checks exactly the code the GPU runs.
#pragma once

#if defined(__CUDACC__)
#define DFSS_HD __host__ __device__ __forceinline__
#else
#define DFSS_HD inline
#endif

#define DFSS_VERSION_MAJOR 0
#define DFSS_VERSION_MINOR 1
#define DFSS_VERSION_PATCH 0
#define DFSS_VERSION_STRING "0.1.0"
