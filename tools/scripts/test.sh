#!/usr/bin/env bash
# The project's test command (README.md): the CI build (warnings as errors, the LibTorch operator,
# CUDA compiled when nvcc is present) with all tests, including the Python package's pytest suite
# and the transformers tests in the torch 2.x venv (both must run here, not skip), then the
# AddressSanitizer + UBSan build with all tests, then each libFuzzer target (tests/fuzz, clang) for
# DFSS_FUZZ_SECONDS seconds (default 60).
set -euo pipefail
cd "$(dirname "$0")/../.."
jobs=$(nproc 2>/dev/null || echo 2)
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$jobs}
export CTEST_PARALLEL_LEVEL=${CTEST_PARALLEL_LEVEL:-$jobs}
export DFSS_REQUIRE_PYTHON_TESTS=1
# ccache (.ci/run installs it) in front of every compiler of the builds below (CMake reads these
# variables when it first configures a build tree), with paths relative to this checkout so that
# a fresh clone elsewhere hits the cache too: CI builds the same tree three times over (ci, asan,
# fuzz), about 14 of its minutes on 2 cores, nearly all of it unchanged between runs. A compile that
# fails (a warning, a CUDA register spill) is never cached, so those checks still run.
# CCACHE_NOHASHDIR: the ci and asan builds carry debug information (-g1), for which ccache would
# otherwise hash the build directory's absolute path and miss in every other clone (measured); the
# cost is that a cached object's debug information names the directory it was first built in.
if command -v ccache >/dev/null; then
  export CMAKE_C_COMPILER_LAUNCHER=ccache CMAKE_CXX_COMPILER_LAUNCHER=ccache CMAKE_CUDA_COMPILER_LAUNCHER=ccache
  export CCACHE_BASEDIR="$PWD" CCACHE_NOHASHDIR=1
fi
cmake --workflow --preset ci
# The CUDA kernels' static SASS counts per 32 x 32 tile (a speed proxy; issue 16 part 2) into the log.
if ctest --test-dir build-ci -N -R '^cuda_sass_stats$' | grep -q 'Total Tests: 1'; then
  ctest --test-dir build-ci -R '^cuda_sass_stats$' -V | sed -n 's/^[0-9]*: //p' | grep -E '^\||target' || true
fi
cmake --workflow --preset asan
bash tests/fuzz/run_fuzzers.sh "${DFSS_FUZZ_SECONDS:-60}"
