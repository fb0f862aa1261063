# Decides whether the CUDA parts are built. AUTO enables them when a CUDA compiler is found; ON
# fails loudly when none is. Sets DFSS_HAVE_CUDA.
set(DFSS_HAVE_CUDA OFF)
if(NOT DFSS_ENABLE_CUDA STREQUAL "OFF")
  include(CheckLanguage)
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    set(CMAKE_CUDA_ARCHITECTURES ${DFSS_CUDA_ARCHITECTURES})
    enable_language(CUDA)
    find_package(CUDAToolkit REQUIRED)
    set(DFSS_HAVE_CUDA ON)
  elseif(DFSS_ENABLE_CUDA STREQUAL "ON")
    message(FATAL_ERROR "DFSS_ENABLE_CUDA=ON but no CUDA compiler was found (set CMAKE_CUDA_COMPILER "
                        "or put nvcc on PATH)")
  else()
    message(STATUS "dfss: no CUDA compiler found; building without the CUDA parts")
  endif()
endif()
