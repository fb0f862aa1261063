# DFSS_WITH_TORCH: the LibTorch operator and C++ API (dfss::dfss_torch, src/torch/) and their tests.
# AUTO builds them when find_package(Torch) succeeds (Debian: libtorch-dev), ON requires Torch, OFF
# skips them. The Python package (setup.py) compiles the same sources with torch.utils.cpp_extension
# against the interpreter's torch and does not depend on this option.
set(DFSS_WITH_TORCH "AUTO" CACHE STRING "Build the LibTorch operator: AUTO (when Torch is found), ON, OFF")
set_property(CACHE DFSS_WITH_TORCH PROPERTY STRINGS AUTO ON OFF)

set(DFSS_HAVE_TORCH OFF)
if(DFSS_WITH_TORCH STREQUAL "ON")
  find_package(Torch REQUIRED)
  set(DFSS_HAVE_TORCH ON)
elseif(DFSS_WITH_TORCH STREQUAL "AUTO")
  find_package(Torch QUIET)
  if(Torch_FOUND)
    set(DFSS_HAVE_TORCH ON)
  endif()
elseif(NOT DFSS_WITH_TORCH STREQUAL "OFF")
  message(FATAL_ERROR "DFSS_WITH_TORCH: expected AUTO, ON or OFF, got '${DFSS_WITH_TORCH}'")
endif()
if(DFSS_HAVE_TORCH)
  message(STATUS "dfss: LibTorch operator against Torch ${Torch_VERSION} (${TORCH_LIBRARY})")
endif()
