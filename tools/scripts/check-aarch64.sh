#!/usr/bin/env bash
# Builds the library and tests/arm/portable_check.cpp for AArch64 (Debian g++-aarch64-linux-gnu,
# static) and runs the check under qemu-user: the portable-SIMD kernel is what ARM machines run.
# Usage: check-aarch64.sh BUILD_CONFIG_HEADER_DIR OUTPUT_DIR. Exits 77 (skipped) with a reason when
# the cross compiler or qemu is missing.
set -euo pipefail
src="$(cd "$(dirname "$0")/../.." && pwd)"
gen="$1"
out="$2"
cxx=aarch64-linux-gnu-g++
command -v "$cxx" >/dev/null || { echo "SKIP: $cxx not installed (Debian g++-aarch64-linux-gnu)"; exit 77; }
command -v qemu-aarch64 >/dev/null || { echo "SKIP: qemu-aarch64 not installed (Debian qemu-user)"; exit 77; }
mkdir -p "$out"
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
  [[ "$s" == *portable.cpp ]] && extra=(-ffp-contract=fast -Wno-psabi)
  "$cxx" -std=c++20 -O2 -fopenmp -Wall -Wextra -Werror "${extra[@]}" -I"$src/include" -I"$src/src" -I"$gen" \
    -c "$src/$s" -o "$o" &
  pids+=($!)
  objs+=("$o")
done
for p in "${pids[@]}"; do wait "$p"; done  # each wait fails (and set -e stops) if that compile failed
"$cxx" -static -fopenmp "${objs[@]}" -o "$out/portable_check"
qemu-aarch64 "$out/portable_check"
