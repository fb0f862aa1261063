#!/usr/bin/env bash
# tools/gpu/build-for-device.sh [BUILD_DIR]: builds, on a machine without a GPU, every binary a GPU
# run needs, so the device machine (no GoogleTest, no package registry, 15 minutes in all) only runs
# them: the GPU tests (linked against this machine's GoogleTest), dfss_gpu_probe and dfss_bench_cuda.
# They land in BUILD_DIR/carry (default build-device/carry, git-ignored): bin/ with the binaries;
# lib/ with the shared libraries a stock machine with a driver may lack (libcudart.so.13, Google
# Highway's libhwy.so.1, and libgomp.so.1 if linked); core/libdfss.a, the static dfss core with the
# CUDA backend, which device-run.sh links into the torch operator it builds there against the
# device's own torch (an extension built here, against another torch, would not load there);
# googletest/ (sources, for a rebuild there); BUILD-INFO.txt. libstdc++
# stays the system's: linked statically, GCC 12's pulls in arc4random (glibc 2.36) and
# _dl_find_object (2.35), while the dynamic one needs GLIBCXX_3.4.29 at most, which Ubuntu 22.04
# (glibc 2.35, the oldest base of the CUDA 13 images) and newer have.
# Carry that folder to the device (`run` with carry ["build-device/carry"]) and run
# tools/gpu/device-run.sh there.
#
# Then it checks each binary with ldd against that lib/: every library must resolve to the C
# library, to lib/, or (dfss_bench_cuda only) to cuBLAS 13, which the device's CUDA toolkit holds
# (libcublas alone is ~100 MiB, libcublasLt ~500 MiB: too large to carry; device-run.sh finds it).
# libcuda.so.1 comes from the driver and is opened at run time by the CUDA runtime, not linked. It
# fails if anything else is needed, or if carry/ exceeds the 64 MiB the device tool carries.
#
# Environment: DFSS_DEVICE_MAX_GLIBC (default 2.35: the newest glibc symbol version a binary may
# need), DFSS_DEVICE_ARCHS (default 90, the H200; "80;90" adds the A100), JOBS (default 2),
# DFSS_GTEST_SOURCE_DIR (GoogleTest sources, when no installed GoogleTest is found).
set -euo pipefail
cd "$(dirname "$0")/../.."
build=${1:-build-device}
archs=${DFSS_DEVICE_ARCHS:-90}
jobs=${JOBS:-2}
max_glibc=${DFSS_DEVICE_MAX_GLIBC:-2.35}
export PATH="/usr/local/cuda/bin:$PATH"

args=(-DCMAKE_BUILD_TYPE=Release -DDFSS_ENABLE_CUDA=ON -DDFSS_CUDA_ARCHITECTURES="$archs" -DDFSS_WITH_TORCH=OFF
      -DDFSS_WERROR=ON -DDFSS_BUILD_TOOLS=OFF -DDFSS_BUILD_BENCH=OFF -DDFSS_BUILD_CUDA_BENCH=ON -DDFSS_BUILD_TESTS=ON
      -DCMAKE_EXE_LINKER_FLAGS=)
if [ -n "${DFSS_GTEST_SOURCE_DIR:-}" ]; then args+=(-DDFSS_GTEST_SOURCE_DIR="$DFSS_GTEST_SOURCE_DIR"); fi
if command -v ccache >/dev/null 2>&1; then
  args+=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_CUDA_COMPILER_LAUNCHER=ccache)
fi
if [ ! -f "$build/CMakeCache.txt" ] && command -v ninja >/dev/null 2>&1; then args+=(-G Ninja); fi
cmake -S . -B "$build" "${args[@]}" >"$build.configure.log" 2>&1 || { tail -n 30 "$build.configure.log"; exit 1; }
rm -f "$build.configure.log"
targets=(test_nm_format_gpu test_attention_gpu dfss_gpu_probe dfss_bench_cuda)
cmake --build "$build" -j "$jobs" --target "${targets[@]}"

carry="$build/carry"
rm -rf "$carry"
mkdir -p "$carry/bin" "$carry/lib" "$carry/core"
cp "$build/tests/cuda/test_nm_format_gpu" "$build/tests/cuda/test_attention_gpu" "$build/tests/cuda/dfss_gpu_probe" \
   "$build/bench/cuda/dfss_bench_cuda" "$carry/bin/"
cp "$build/src/libdfss.a" "$carry/core/"
# The libraries to carry, resolved from the binaries' own dependencies on this machine: the CUDA
# runtime and Highway (the core's CPU dispatch; the torch operator links it too) always, the OpenMP
# runtime when the linker kept it.
for lib in libcudart.so.13 libhwy.so.1 libgomp.so.1; do
  path=$(for b in "$carry"/bin/*; do ldd "$b"; done | awk -v l="$lib" '$1 == l { print $3; exit }')
  if [ -n "$path" ]; then cp -L "$path" "$carry/lib/$lib"
  elif [ "$lib" != libgomp.so.1 ]; then echo "build-for-device: $lib not found by ldd"; exit 1; fi
done
# GoogleTest's sources, for `device-run.sh --build` (a rebuild on the device, which has CMake and
# nvcc but no GoogleTest) should these binaries not load there.
gtest_src=${DFSS_GTEST_SOURCE_DIR:-/usr/src/googletest}
if [ -f "$gtest_src/CMakeLists.txt" ]; then cp -r "$gtest_src" "$carry/googletest"; fi

{
  echo "commit: $(git rev-parse HEAD)$(git diff --quiet HEAD -- src include tests bench || echo ' (with uncommitted changes)')"
  echo "built: $(date -u +%Y-%m-%dT%H:%MZ) on $(uname -m), $(ldd --version | head -n 1)"
  echo "nvcc: $(nvcc --version | sed -n 's/.*release \([0-9.]*\).*/\1/p'), archs: $archs"
  echo "host compiler: $(c++ --version | head -n 1)"
} >"$carry/BUILD-INFO.txt"

status=0
echo "build-for-device: ldd of each binary (LD_LIBRARY_PATH=$carry/lib)"
for b in "$carry"/bin/*; do
  name=$(basename "$b")
  needs_glibc=$(objdump -T "$b" | grep -o 'GLIBC_[0-9.]*' | sort -uV | tail -n 1)
  needs_cxx=$(objdump -T "$b" | grep -o 'GLIBCXX_[0-9.]*' | sort -uV | tail -n 1)
  echo "  $name ($(du -k "$b" | cut -f1) KiB; newest symbols $needs_glibc, ${needs_cxx:-no GLIBCXX}):"
  if [ "$(printf '%s\n' "GLIBC_$max_glibc" "$needs_glibc" | sort -V | tail -n 1)" != "GLIBC_$max_glibc" ]; then
    echo "    needs $needs_glibc, newer than glibc $max_glibc"; status=1
  fi
  while read -r lib _ path _; do
    case "$lib" in
      linux-vdso.so.*|/lib64/ld-linux-x86-64.so.2|libc.so.6|libm.so.6|libdl.so.2|libpthread.so.0|librt.so.1)
        echo "    $lib: C library";;
      libgcc_s.so.1|libstdc++.so.6)  # the compiler runtime of every glibc system
        echo "    $lib: C++ runtime";;
      libcudart.so.13|libgomp.so.1|libhwy.so.1)
        case "$path" in "$carry"/lib/*|"$(cd "$carry/lib" && pwd)"/*) echo "    $lib: carried";;
          *) echo "    $lib: NOT resolved to carry/lib ($path)"; status=1;; esac;;
      libcublas.so.13|libcublasLt.so.13)
        if [ "$name" = dfss_bench_cuda ]; then echo "    $lib: from the device's CUDA 13 toolkit (not carried)";
        else echo "    $lib: unexpected"; status=1; fi;;
      libcuda.so.1) echo "    $lib: from the driver";;
      *) echo "    $lib => $path: NOT on a stock machine with a driver"; status=1;;
    esac
  done < <(LD_LIBRARY_PATH="$carry/lib" ldd "$b" | sed 's/(0x[0-9a-f]*)//')
done
size_kib=$(du -sk "$carry" | cut -f1)
echo "build-for-device: $carry holds $((size_kib / 1024)) MiB ($size_kib KiB; the device tool carries 64 MiB in all)"
if [ "$size_kib" -gt $((60 * 1024)) ]; then echo "build-for-device: too large to carry"; status=1; fi
[ $status -eq 0 ] && echo "build-for-device: ready; on the device: bash tools/gpu/device-run.sh"
exit $status
