#!/usr/bin/env bash
# Builds the library and tests/arm/portable_check.cpp for AArch64 (Debian g++-aarch64-linux-gnu)
# and runs the check under qemu-user on every SIMD target qemu's CPU offers (NEON, SVE, SVE2): the
# Highway kernels are what ARM machines run. Highway's headers are architecture-independent (the
# host's /usr/include/hwy); its library (hwy::SupportedTargets) comes from Debian's arm64
# libhwy-dev through multiarch (dpkg --add-architecture arm64; .ci/run installs it). Debian ships no
# static libhwy, so the check links dynamically and runs with the cross sysroot as qemu's prefix.
# Usage: check-aarch64.sh BUILD_CONFIG_HEADER_DIR OUTPUT_DIR. Exits 77 (skipped) with a reason when
# the cross compiler, qemu or the arm64 Highway library is missing.
set -euo pipefail
src="$(cd "$(dirname "$0")/../.." && pwd)"
gen="$1"
out="$2"
cxx=aarch64-linux-gnu-g++
command -v "$cxx" >/dev/null || { echo "SKIP: $cxx not installed (Debian g++-aarch64-linux-gnu)"; exit 77; }
command -v qemu-aarch64 >/dev/null || { echo "SKIP: qemu-aarch64 not installed (Debian qemu-user)"; exit 77; }
arm_lib=/usr/lib/aarch64-linux-gnu
sysroot=/usr/aarch64-linux-gnu
[ -e "$arm_lib/libhwy.so" ] || { echo "SKIP: $arm_lib/libhwy.so missing (dpkg --add-architecture arm64; apt-get install libhwy-dev:arm64)"; exit 77; }
[ -e /usr/include/hwy/highway.h ] || { echo "SKIP: Highway headers missing (Debian libhwy-dev)"; exit 77; }
mkdir -p "$out/include" "$out/hwylib"
ln -sfn /usr/include/hwy "$out/include/hwy"  # only Highway's headers, not the host's /usr/include
ln -sfn "$arm_lib/libhwy.so.1" "$out/hwylib/libhwy.so.1"  # only Highway's library (see below)
# The library's sources as src/CMakeLists.txt lists them (the add_library(dfss ...) block), so that a
# file moved or added there is cross-built here too, plus the check itself.
mapfile -t lib < <(sed -n '/^add_library(dfss$/,/^)$/p' "$src/src/CMakeLists.txt" | sed -n 's/^  *\([^ ]*\.cpp\)$/src\/\1/p')
(( ${#lib[@]} > 0 )) || { echo "no library sources found in src/CMakeLists.txt"; exit 1; }
sources=("${lib[@]}" tests/arm/portable_check.cpp)
objs=()
pids=()
for s in "${sources[@]}"; do
  o="$out/${s//\//_}.o"  # the path in the name: two folders may hold files of the same name
  extra=()
  [[ "$s" == src/cpu/simd/attention_* ]] && extra=(-ffp-contract=off)  # as src/CMakeLists.txt
  "$cxx" -std=c++20 -O2 -fopenmp -Wall -Wextra -Werror "${extra[@]}" -I"$src/include" -I"$src/src" -I"$gen" \
    -isystem "$out/include" \
    -c "$src/$s" -o "$o" &
  pids+=($!)
  objs+=("$o")
done
for p in "${pids[@]}"; do wait "$p"; done  # each wait fails (and set -e stops) if that compile failed
"$cxx" -fopenmp "${objs[@]}" -L"$arm_lib" -lhwy -Wl,-rpath-link,"$arm_lib" -o "$out/portable_check"
# The loader, libc, libstdc++ and libgomp all from the cross sysroot (qemu's -L prefix, and first
# on the library path, ahead of the host's ld.so.cache, which lists the multiarch arm64 libc: a
# loader of one glibc build with the libc of another hangs in pthread_create), libhwy alone from the
# multiarch directory.
qemu-aarch64 -L "$sysroot" -E LD_LIBRARY_PATH="$sysroot/lib:$out/hwylib" "$out/portable_check"
