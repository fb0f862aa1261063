#!/usr/bin/env bash
# One prepared GPU check for the CUDA backend, in at most 6 minutes, with only CMake, nvcc, g++ and
# PyTorch, for a GPU machine with a full toolchain and GoogleTest (sources will do). For the lent
# GPU machines (15 minutes, no GoogleTest) build elsewhere with tools/gpu/build-for-device.sh and
# run tools/gpu/device-run.sh there instead (docs/gpu-results.md). This script builds dfss for this
# machine's GPU, runs dfss_gpu_probe and the GPU tests (CTest label gpu), compute-sanitizer
# memcheck and racecheck on small cases (when compute-sanitizer is installed), then the benchmark
# (DFSS 2:4 and 1:2 vs the dense cuBLAS pipeline, per-kernel times) and PyTorch SDPA on the same grid,
# and prints a short table last.
#
# GoogleTest: the installed package when CMake finds it, else a source tree from $DFSS_GTEST_SOURCE_DIR,
# .gpu-deps/googletest or /usr/src/googletest (copy /usr/src/googletest of a Debian machine into
# .gpu-deps/ and carry it to a GPU machine that lacks it).
#
# Usage: bash tools/gpu-check.sh [--quick]     (--quick: smoke benchmark grid only)
# Logs go to $OUT (when set) or build-gpu/logs.
set -euo pipefail
cd "$(dirname "$0")/.."

quick=0
if [ "${1:-}" = "--quick" ]; then quick=1; fi
start=$(date +%s)
elapsed() { echo $(( $(date +%s) - start )); }
logdir="${OUT:-build-gpu/logs}"
mkdir -p "$logdir"
logdir=$(cd "$logdir" && pwd)
export PATH="/usr/local/cuda/bin:$PATH"

if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi >/dev/null 2>&1; then
  echo "gpu-check: no NVIDIA GPU visible (nvidia-smi failed); nothing to check"
  exit 77
fi
gpu=$(nvidia-smi --query-gpu=name,compute_cap,driver_version --format=csv,noheader | head -n 1)
arch=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -n 1 | tr -d ' .')
echo "gpu-check: $gpu (sm_$arch), nvcc $(nvcc --version | sed -n 's/.*release \([0-9.]*\).*/\1/p')"

gtest_args=()
for dir in "${DFSS_GTEST_SOURCE_DIR:-}" .gpu-deps/googletest /usr/src/googletest; do
  if [ -n "$dir" ] && [ -f "$dir/CMakeLists.txt" ]; then gtest_args=(-DDFSS_GTEST_SOURCE_DIR="$(cd "$dir" && pwd)"); break; fi
done

# 1. Build (about 1-2 minutes on 16 cores): the library, the GPU tests and the benchmark only.
#    DFSS_WERROR=OFF: the host compiler there is unknown, and a new warning of it must not stop the
#    GPU run; the CUDA targets keep their own -Werror=all-warnings (nvcc is the one CI builds with).
jobs=$(nproc)
timeout 200 cmake -S . -B build-gpu -DCMAKE_BUILD_TYPE=Release -DDFSS_ENABLE_CUDA=ON \
  -DDFSS_CUDA_ARCHITECTURES="$arch" -DDFSS_BUILD_TOOLS=OFF -DDFSS_BUILD_BENCH=OFF \
  -DDFSS_BUILD_CUDA_BENCH=ON -DDFSS_WERROR=OFF "${gtest_args[@]}" >"$logdir/configure.log" 2>&1 \
  || { tail -n 30 "$logdir/configure.log"; exit 1; }
timeout 240 cmake --build build-gpu -j "$jobs" --target test_nm_format_gpu test_attention_gpu \
  dfss_gpu_probe test_cuda_warp dfss_bench_cuda >"$logdir/build.log" 2>&1 || { grep -E "error|warning" "$logdir/build.log" | head -n 40; exit 1; }
echo "gpu-check: built in $(elapsed) s"

# 2. The probe, the GPU tests (and the CPU simulation of the warp maths, as a sanity check of this build).
tests_rc=0
timeout 60 build-gpu/tests/cuda/dfss_gpu_probe >"$logdir/probe.log" 2>&1 || tests_rc=$?
grep -E '^PROBE|^SKIP' "$logdir/probe.log"
(cd build-gpu && timeout 150 ctest -L gpu --output-on-failure >"$logdir/ctest-gpu.log" 2>&1) || tests_rc=$?
build-gpu/tests/test_cuda_warp >"$logdir/test_cuda_warp.log" 2>&1 || tests_rc=$?
tail -n 15 "$logdir/ctest-gpu.log"

# 3. compute-sanitizer on the small cases (the one-warp MMAs and one awkward small forward).
san_summary="compute-sanitizer not installed: skipped"
if command -v compute-sanitizer >/dev/null 2>&1; then
  san_summary=""
  for tool in memcheck racecheck; do
    rc=0
    timeout 90 compute-sanitizer --tool "$tool" --error-exitcode 9 build-gpu/tests/cuda/test_attention_gpu \
      --gtest_filter='CudaMmaSp.*:CudaAttention.SmallAwkwardCase*' >"$logdir/sanitizer-$tool.log" 2>&1 || rc=$?
    san_summary="$san_summary $tool=$([ $rc -eq 0 ] && echo clean || echo "FAILED(rc=$rc)")"
    tail -n 3 "$logdir/sanitizer-$tool.log"
  done
fi
echo "gpu-check: tests and sanitizers done at $(elapsed) s"

# 4. Benchmarks: DFSS vs dense cuBLAS pipeline, then PyTorch SDPA (each backend forced) on the same grid.
grid=all
if [ $quick -eq 1 ]; then grid=smoke; fi
bench_rc=0
timeout 120 build-gpu/bench/cuda/dfss_bench_cuda --grid "$grid" --warmup 5 --iters 20 \
  --json "$logdir/bench.json" --markdown "$logdir/bench.md" >"$logdir/bench.log" 2>&1 || bench_rc=$?
timeout 90 python3 tools/gpu/sdpa_backends.py --grid "$grid" --warmup 5 --iters 20 --json "$logdir/sdpa.json" \
  --markdown "$logdir/sdpa.md" >"$logdir/sdpa.log" 2>&1 || true

echo
echo "==================== gpu-check summary ($(elapsed) s) ===================="
echo "GPU: $gpu"
echo "GPU tests: $([ $tests_rc -eq 0 ] && echo passed || echo "FAILED (rc=$tests_rc, see $logdir/ctest-gpu.log)")"
echo "sanitizers:$san_summary"
echo "benchmark (rc=$bench_rc):"
cat "$logdir/bench.log"
cat "$logdir/sdpa.log"
[ $tests_rc -eq 0 ] && [ $bench_rc -eq 0 ]
