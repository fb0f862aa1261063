#!/usr/bin/env bash
# tools/gpu/device-run.sh: the one prepared script of a GPU run, run ON the device machine over the
# binaries tools/gpu/build-for-device.sh built elsewhere (carried in build-device/carry). No build
# unless --build, but for the torch operator (an extension must be built against the torch that
# loads it). Every step has its own time-out, all of them share one budget (default 330 s, so
# the first call of a 15-minute lease leaves room for a second, corrective one while the machine is
# still warm), and every step ends with one summary line. Steps, most informative first:
#   info      the GPU, driver, kernel (gVisor or not), and ldd of the carried binaries;
#   probe     dfss_gpu_probe: mma.sp metadata lanes and bits, NaN at pruned rows, each kernel alone
#             against the host, mma.sync vs mma.sp;
#   tests     the GPU tests (test_nm_format_gpu, test_attention_gpu), every case with its max error;
#   torch     torch.ops.dfss.attention on CUDA: the operator built here against this machine's own
#             torch (pip install of the source tree, linking the carried core/libdfss.a: only the
#             four src/torch/*.cpp are compiled), then tests/python/test_cuda.py;
#   bench     dfss_bench_cuda --grid all (DFSS 2:4 and 1:2, raw kernels and the public API, vs the
#             dense cuBLAS pipeline; medians, TFLOP/s and GB/s);
#   sdpa      PyTorch SDPA with each backend forced, and unforced (tools/gpu/sdpa_backends.py);
#   ncu       Nsight Compute (--clock-control none) on one launch of each kernel, after a short probe
#             of whether ncu can read the counters here at all;
#   sanitize  compute-sanitizer memcheck and racecheck on small cases, after a short probe.
# A tool that does not work on this kind of machine (ncu and compute-sanitizer fail under gVisor) is
# skipped with the reason printed.
#
# Output: $OUT (or build-device/run-out) gets summary.txt, logs.tar.gz (every step's full log), and
# when they were made bench.json and bench.md (dfss_bench_cuda), sdpa.json and sdpa.md
# (sdpa_backends.py), ncu.ncu-rep: at most 7 of the 8 files a run brings back.
#
# Usage: bash tools/gpu/device-run.sh [--build] [--budget SECONDS] [--carry DIR]
#   --build   rebuild the binaries here first (cmake, nvcc; GoogleTest from the carried sources),
#             e.g. when the carried ones do not load; takes about 1-2 minutes of the budget.
# Exit: 0 when the probe, the GPU tests and the torch operator's build and tests passed, 1 otherwise,
# 2 when there is nothing to run.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 2
start=$(date +%s)
budget=330
build=0
carry="build-device/carry"
while [ $# -gt 0 ]; do
  case "$1" in
    --build) build=1;;
    --budget) budget=$2; shift;;
    --carry) carry=$2; shift;;
    *) echo "usage: bash tools/gpu/device-run.sh [--build] [--budget SECONDS] [--carry DIR]"; exit 2;;
  esac
  shift
done
out=${OUT:-build-device/run-out}
mkdir -p "$out"
out=$(cd "$out" && pwd)
logs=$(mktemp -d)
summary="$out/summary.txt"
: >"$summary"
ncu_dir=$(ls -d /opt/nvidia/nsight-compute/*/ 2>/dev/null | tail -n 1)
export PATH="/usr/local/cuda/bin:$PATH${ncu_dir:+:$ncu_dir}"

now() { echo $(( $(date +%s) - start )); }
say() { echo "$*" | tee -a "$summary"; }
# step LOG MAX CMD...: runs CMD with a time-out of MAX seconds or what is left of the budget, output
# to $logs/LOG; sets rc (124: timed out) and secs. Returns 1 (rc=-1) when the budget is spent.
step() {
  local log=$1 max=$2; shift 2
  local left=$(( budget - $(now) ))
  if [ "$left" -lt 8 ]; then rc=-1; secs=0; return 1; fi
  local t=$(( max < left ? max : left ))
  local s
  s=$(date +%s)
  timeout -k 5 "$t" "$@" >"$logs/$log" 2>&1
  rc=$?
  secs=$(( $(date +%s) - s ))
  return 0
}
verdict() { case "$rc" in 0) echo "ok";; 124|137) echo "TIMED OUT";; 77) echo "skipped (77)";; -1) echo "skipped: budget spent";; *) echo "FAILED rc=$rc";; esac; }
finish() {
  say "total: $(now) s of a $budget s budget"
  tar czf "$out/logs.tar.gz" -C "$logs" . 2>/dev/null
  echo
  echo "==================== device-run summary ===================="
  cat "$summary"
}

# ---- info
if [ $build -eq 1 ]; then
  # Built where it runs, so no limit on the glibc symbol versions.
  step build.log 240 env JOBS="$(nproc)" DFSS_GTEST_SOURCE_DIR="$carry/googletest" DFSS_DEVICE_MAX_GLIBC=999 \
    bash tools/gpu/build-for-device.sh build-device-native
  say "build: $(verdict) in ${secs} s (build-device-native/carry)"
  carry="build-device-native/carry"
fi
bin="$carry/bin"
if [ ! -x "$bin/dfss_gpu_probe" ]; then
  say "info: no binaries in $bin: run tools/gpu/build-for-device.sh on the build machine and carry build-device/carry, or pass --build"
  finish
  exit 2
fi
# cuBLAS (dfss_bench_cuda only) comes from the device's toolkit, or from PyTorch's pip package.
cublas_dir=""
if ! ldconfig -p 2>/dev/null | grep -q 'libcublas.so.13 ' && [ ! -e /usr/local/cuda/lib64/libcublas.so.13 ]; then
  cublas_dir=$(timeout 30 python3 -c 'import nvidia.cublas as m, os; print(os.path.join(list(m.__path__)[0], "lib"))' 2>/dev/null)
fi
libpath="$(cd "$carry/lib" && pwd):/usr/local/cuda/lib64${cublas_dir:+:$cublas_dir}"
# Only the carried binaries (and the tools that start them) see these libraries; python3 does not.
run_bin=(env "LD_LIBRARY_PATH=$libpath${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}")

gpu=$(timeout 20 nvidia-smi --query-gpu=name,compute_cap,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv,noheader 2>&1 | head -n 1)
kernel=$(uname -r)
case "$kernel" in 4.4.0*) runtime="gVisor";; *) runtime="not gVisor (Firecracker?)";; esac
{ nvidia-smi; uname -a; cat /etc/os-release; ldd --version | head -n 1; cat "$carry/BUILD-INFO.txt"; } >"$logs/info.log" 2>&1
missing=""
for b in "$bin"/*; do
  { echo "== $b"; "${run_bin[@]}" ldd "$b"; } >>"$logs/ldd.log" 2>&1
  m=$("${run_bin[@]}" ldd "$b" 2>&1 | awk '/not found/ { print $1 }' | tr '\n' ' ')
  [ -n "$m" ] && missing="$missing $(basename "$b"): $m"
done
say "info: $gpu | kernel $kernel ($runtime) | $(ldd --version | head -n 1 | sed 's/.* //') glibc | $(grep -m1 PRETTY_NAME /etc/os-release | cut -d'"' -f2) | ldd: ${missing:-every library found}"
say "info: carried build: $(head -n 1 "$carry/BUILD-INFO.txt")"

# ---- probe
step probe.log 60 "${run_bin[@]}" "$bin/dfss_gpu_probe"
say "probe: $(verdict) in ${secs} s, $(grep -c ' PASS ' "$logs/probe.log") PASS, $(grep -c ' FAIL ' "$logs/probe.log") FAIL"
grep -E '^PROBE|^SKIP' "$logs/probe.log" | sed 's/^/  /' | tee -a "$summary"
probe_rc=$rc

# ---- GPU tests: every case is checked and reported even after a failure.
tests_rc=0
for t in test_nm_format_gpu test_attention_gpu; do
  step "$t.log" 90 "${run_bin[@]}" "$bin/$t"
  [ "$rc" -ne 0 ] && tests_rc=1
  say "tests: $t $(verdict) in ${secs} s; $(grep -E '^\[  (PASSED|FAILED)  \]' "$logs/$t.log" | tr '\n' ' ')"
  grep -E '^\[  FAILED  \] [A-Za-z]|^case |SKIP|skipped:' "$logs/$t.log" | head -n 30 | sed 's/^/  /' | tee -a "$summary"
done

# ---- torch operator: built against this machine's torch (pip's --target, nothing installed into
# its environment), linked with the carried core, so only the operator's .cpp files are compiled;
# then its CUDA tests. libhwy.so.1 (carried) is in a folder of its own, with the libhwy.so link the
# linker's -lhwy wants, so that the Python process sees no other carried library.
torch_rc=0
if [ ! -f "$carry/core/libdfss.a" ]; then
  say "torch: skipped: no carried core ($carry/core/libdfss.a; rerun tools/gpu/build-for-device.sh)"
else
  tdir=$(mktemp -d)
  mkdir -p "$tdir/hwy"
  cp "$carry/lib/libhwy.so.1" "$tdir/hwy/" && ln -s libhwy.so.1 "$tdir/hwy/libhwy.so"
  step torch-build.log 180 env DFSS_CUDA=ON DFSS_CORE_LIBRARY="$(cd "$carry/core" && pwd)/libdfss.a" \
    DFSS_CORE_LINK_LIBS="$tdir/hwy/libhwy.so.1" LDFLAGS="-L$tdir/hwy" DFSS_PYTHON_BUILD_DIR="$tdir/build" \
    MAX_JOBS="$(nproc)" python3 -m pip install --no-build-isolation --no-deps --no-index --no-cache-dir \
    --target "$tdir/site" .
  build_line="build $(verdict) in ${secs} s"
  if [ "$rc" -eq 0 ]; then
    step torch-tests.log 90 env PYTHONPATH="$tdir/site" LD_LIBRARY_PATH="$tdir/hwy" DFSS_EXPECT_CUDA_OPERATOR=1 \
      PYTHONUNBUFFERED=1 python3 -m pytest -q -rfEs -p no:cacheprovider tests/python/test_cuda.py tests/python/test_errors.py
    [ "$rc" -ne 0 ] && torch_rc=1
    say "torch: $build_line; test_cuda.py + test_errors.py $(verdict) in ${secs} s: $(tail -n 1 "$logs/torch-tests.log" | cut -c1-200)"
    grep -E '^(FAILED|ERROR|SKIPPED)' "$logs/torch-tests.log" | head -n 20 | cut -c1-300 | sed 's/^/  /' | tee -a "$summary"
  else
    torch_rc=1
    say "torch: $build_line: $(grep -m1 -E 'error|Error' "$logs/torch-build.log" | cut -c1-200)"
  fi
fi

# ---- benchmark
step bench.log 75 "${run_bin[@]}" "$bin/dfss_bench_cuda" --grid all --warmup 5 --iters 20 --json "$out/bench.json" \
  --markdown "$out/bench.md"
say "bench: $(verdict) in ${secs} s"
tail -n 40 "$logs/bench.log" | sed 's/^/  /' | tee -a "$summary"

# ---- SDPA, each backend forced
step sdpa.log 75 env PYTHONUNBUFFERED=1 python3 tools/gpu/sdpa_backends.py --grid all --warmup 3 --iters 10 \
  --json "$out/sdpa.json" --markdown "$out/sdpa.md"
say "sdpa: $(verdict) in ${secs} s$([ "$rc" -ne 0 ] && echo ": $(tail -n 1 "$logs/sdpa.log" | cut -c1-200)")"
grep -E '^sdpa' "$logs/sdpa.log" | sed 's/^/  /' | tee -a "$summary"

# ---- Nsight Compute: a few seconds to see whether it reads counters here, then the three kernels.
kernels_re='regex:sddmm_select_kernel|spmm_kernel'
if ! command -v ncu >/dev/null 2>&1; then
  say "ncu: not installed: skipped"
else
  step ncu-probe.log 30 "${run_bin[@]}" ncu --clock-control none -c 1 --section SpeedOfLight "$bin/dfss_gpu_probe" --section nan
  if [ "$rc" -ne 0 ] || grep -qE '==ERROR==|==WARNING== No kernels were profiled' "$logs/ncu-probe.log"; then
    say "ncu: skipped, its few-second trial run failed ($(verdict)): $(grep -m1 -E 'ERROR|WARNING|rror' "$logs/ncu-probe.log" | cut -c1-200)"
  else
    step ncu.log 90 "${run_bin[@]}" ncu --clock-control none -k "$kernels_re" -c 3 -f -o "$out/ncu" "$bin/dfss_gpu_probe" --section profile
    say "ncu: $(verdict) in ${secs} s (ncu.ncu-rep: sddmm, softmax, spmm of B1 L4096 H8 d64 bf16 2:4)"
    if [ -f "$out/ncu.ncu-rep" ]; then
      timeout 60 ncu -i "$out/ncu.ncu-rep" --page details >"$logs/ncu-details.txt" 2>&1
      grep -E '^  [a-z_]+.*\(|Duration|Compute \(SM\) Throughput|Memory Throughput|Registers Per Thread|Achieved Occupancy' \
        "$logs/ncu-details.txt" | sed 's/^ */  /' | head -n 30 | tee -a "$summary"
    fi
  fi
fi

# ---- compute-sanitizer: a few seconds to see whether it supports the device, then small cases.
if ! command -v compute-sanitizer >/dev/null 2>&1; then
  say "sanitize: compute-sanitizer not installed: skipped"
else
  step sanitizer-probe.log 30 "${run_bin[@]}" compute-sanitizer --tool memcheck --error-exitcode 9 "$bin/dfss_gpu_probe" --section nan
  if [ "$rc" -ne 0 ]; then
    say "sanitize: skipped, its few-second trial run failed ($(verdict)): $(grep -m1 -iE 'error|not supported' "$logs/sanitizer-probe.log" | cut -c1-200)"
  else
    for tool in memcheck racecheck; do
      step "sanitizer-$tool-probe.log" 90 "${run_bin[@]}" compute-sanitizer --tool "$tool" --error-exitcode 9 "$bin/dfss_gpu_probe" --section kernels --quick
      line="$tool: dfss_gpu_probe --section kernels --quick $(verdict) in ${secs} s"
      if [ "$tool" = memcheck ]; then
        step "sanitizer-$tool-attention.log" 60 "${run_bin[@]}" compute-sanitizer --tool "$tool" --error-exitcode 9 \
          "$bin/test_attention_gpu" --gtest_filter='CudaMmaSp.*:CudaAttention.SmallAwkwardCase'
        line="$line; test_attention_gpu (small cases) $(verdict) in ${secs} s"
      fi
      say "sanitize: $line"
      grep -h -m3 -E '========= (Invalid|Race|ERROR SUMMARY)' "$logs"/sanitizer-"$tool"-*.log | sed 's/^/  /' | tee -a "$summary"
    done
  fi
fi

finish
[ "$probe_rc" -eq 0 ] && [ "$tests_rc" -eq 0 ] && [ "$torch_rc" -eq 0 ]
