# DFSS_WITH_TORCH: the LibTorch operator and C++ API (dfss::dfss_torch, src/torch/) and their tests.
# AUTO builds them when find_package(Torch) succeeds (Debian: libtorch-dev), ON requires Torch, OFF
# skips them. The Python package (setup.py) compiles the same sources with torch.utils.cpp_extension
# against the interpreter's torch and does not depend on this option.
# The asan preset sets OFF: an uninstrumented LibTorch in a -fsanitize=address,undefined executable
# reports its own allocations and container overflows as errors; the operator's code is thin glue
# whose arithmetic runs in the dfss core, which the asan build does check.
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
  # The C++ standard the LibTorch headers need: C++17, or C++20 for the releases whose ATen.h
  # says so (read from the header rather than guessed from the version).
  set(DFSS_TORCH_CXX_STANDARD 17)
  foreach(dir ${TORCH_INCLUDE_DIRS})
    if(EXISTS "${dir}/ATen/ATen.h")
      file(STRINGS "${dir}/ATen/ATen.h" _dfss_aten_cxx20 REGEX "C\\+\\+20 or later")
      if(_dfss_aten_cxx20)
        set(DFSS_TORCH_CXX_STANDARD 20)
      endif()
    endif()
  endforeach()
  message(STATUS "dfss: LibTorch operator against Torch ${Torch_VERSION} (${TORCH_LIBRARY})")
endif()
