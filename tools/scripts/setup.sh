#!/usr/bin/env bash
# Fresh-machine setup for the main job: installs the build dependencies (Debian) and builds dfss in
# build/ (Release). Then `build/tools/dfss` runs the default example. libopenblas0 is the sgemm
# yardstick of `dfss bench` (loaded at run time); PyTorch 2.x for the bench is
# tools/scripts/torch2-venv.sh (not run here: it downloads about 1 GB).
set -euo pipefail
cd "$(dirname "$0")/../.."
if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends cmake make g++ libhwy-dev libgtest-dev libgmock-dev \
    libbenchmark-dev libopenblas0 libcli11-dev nlohmann-json3-dev python3 python3-numpy >/dev/null
fi
if [ -x /usr/local/cuda/bin/nvcc ]; then export PATH="/usr/local/cuda/bin:$PATH"; fi
cmake --preset default >/dev/null
cmake --build --preset default -j "$(nproc 2>/dev/null || echo 2)"
