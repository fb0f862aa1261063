#!/usr/bin/env bash
# The transformers integration (tests/python/test_transformers.py), the BERT patch
# (test_modules.py) and the operator's CUDA kernels (test_cuda.py) against PyPI torch 2.x and a
# pinned transformers, in the venv of
# tools/scripts/torch2-venv.sh (cached outside the build tree, shared with `dfss bench`).
# Usage: run_pytest_torch2.sh SOURCE_DIR WORK_DIR [CORE_LIBRARY]
# 1. the venv: used as it is when it imports torch, transformers and pytest; otherwise
#    torch2-venv.sh makes or completes it (downloads about 1 GB on a fresh machine; .ci/run makes
#    it before the tests). When that fails (offline, no disk), exit 77 (skipped, reason printed)
#    unless DFSS_REQUIRE_PYTHON_TESTS=1 (tools/scripts/test.sh, CI), which makes it a failure.
# 2. `pip install --no-build-isolation --target WORK_DIR/site` of the source tree with that torch:
#    the venv itself is left untouched, and WORK_DIR/build is kept between runs, so a rebuild only
#    compiles what changed. CORE_LIBRARY (optional): a prebuilt libdfss.a to link instead of
#    building the core again (used when its C++ ABI matches the venv's torch).
# 3. pytest with PYTHONPATH=WORK_DIR/site, and test_cuda.py: PyPI torch is a CUDA build, so with a
#    core that has the CUDA backend the operator's CUDA kernels (src/torch/cuda.cpp) are compiled
#    here, and their host side is tested (the GPU side skips without a GPU).
set -euo pipefail
src=$1 work=$2 core=${3:-}
missing=77
if [ "${DFSS_REQUIRE_PYTHON_TESTS:-0}" = 1 ]; then missing=1; fi
venv="${DFSS_TORCH2_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/dfss/torch2-venv}"
py="$venv/bin/python"
mkdir -p "$work"
start=$(date +%s)
ready() {  # prints the versions when the venv has what the tests need
  [ -x "$py" ] && "$py" -c 'import torch, transformers, pytest
print("torch2 venv: torch %s, transformers %s" % (torch.__version__, transformers.__version__))' 2>/dev/null
}
if ! ready; then
  echo "torch2 venv $venv: not ready, running tools/scripts/torch2-venv.sh (log: $work/torch2-venv.log)"
  if ! bash "$src/tools/scripts/torch2-venv.sh" "$venv" >"$work/torch2-venv.log" 2>&1 || ! ready; then
    tail -n 20 "$work/torch2-venv.log"
    echo "SKIP: cannot make the torch 2.x venv with transformers at $venv (offline? see above)"
    exit $missing
  fi
fi
echo "venv check: $(( $(date +%s) - start )) s"
# The prebuilt core only when its libstdc++ ABI is the torch's (PyPI torch >= 2.7 and the CI build
# both use the C++11 ABI); otherwise setup.py builds a core with the torch's ABI.
if [ -n "$core" ] && [ "$("$py" -c 'import torch; print(int(torch._C._GLIBCXX_USE_CXX11_ABI))')" = 1 ]; then
  export DFSS_CORE_LIBRARY="$core"
fi
export DFSS_PYTHON_BUILD_DIR="$work/build" MAX_JOBS=${MAX_JOBS:-2}
# The venv's ninja (an extra of torch2-venv.sh) lets torch's extension builder compile in parallel.
export PATH="$venv/bin:$PATH"
rm -rf "$work/site"
start=$(date +%s)
(cd "$src" && "$py" -m pip install --quiet --disable-pip-version-check --no-build-isolation --no-deps \
  --no-index --no-cache-dir --target "$work/site" .)
echo "pip install: $(( $(date +%s) - start )) s"
# Out of the source tree, so that `import dfss` is the installed package.
cd "$work"
export PYTHONPATH="$work/site"
exec "$py" -m pytest -q -rs -p no:cacheprovider "$src/tests/python/test_transformers.py" \
  "$src/tests/python/test_modules.py" "$src/tests/python/test_cuda.py" \
  "$src/tests/python/test_generate_bench.py" "$src/tests/python/test_packed_bench.py"
