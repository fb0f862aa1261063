#!/usr/bin/env bash
# Prints the path of a cuobjdump, fetching NVIDIA's PyPI wheels (cuobjdump and the nvdisasm it runs
# for -sass, found next to it) into ~/.cache/dfss/cuda-tools when
# none is on PATH: the CUDA toolkit here (nvcc, ptxas) ships without it, and tools/cuda/sass_stats.py
# needs it to read the kernels' SASS. The wheel is only unpacked (it is a zip), never installed.
set -euo pipefail
if command -v cuobjdump >/dev/null 2>&1; then
  command -v cuobjdump
  exit 0
fi
dir=${DFSS_CUDA_TOOLS:-$HOME/.cache/dfss/cuda-tools}
# Pinned so that CI reads every commit's SASS with the same disassembler.
version=13.5.37
bin=$dir/$version/nvidia/cu13/bin/cuobjdump
if [ ! -x "$bin" ]; then
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  python3 -m pip download --quiet --no-deps --only-binary=:all: --platform manylinux2014_x86_64 \
    "nvidia-cuda-cuobjdump==$version" "nvidia-cuda-nvdisasm==$version" -d "$tmp" >&2
  mkdir -p "$dir/$version"
  for wheel in "$tmp"/*.whl; do python3 -m zipfile -e "$wheel" "$dir/$version"; done
  chmod +x "$bin" "$(dirname "$bin")/nvdisasm"
fi
echo "$bin"
