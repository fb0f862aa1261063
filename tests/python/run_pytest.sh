#!/usr/bin/env bash
# The Python package end to end, as a user installs it: a fresh venv on PYTHON (sharing its torch and
# pytest through --system-site-packages), `pip install --no-build-isolation` of the source tree (offline,
# no dependency resolution: torch must already be there), then pytest on tests/python.
# Usage: run_pytest.sh PYTHON SOURCE_DIR WORK_DIR [CORE_LIBRARY]
# CORE_LIBRARY (optional): a prebuilt libdfss.a for setup.py to link instead of building the core again.
# Exit 77 (skipped, reason printed) when PYTHON cannot import torch or pytest, unless
# DFSS_REQUIRE_PYTHON_TESTS=1 (tools/scripts/test.sh, CI), which makes that a failure.
set -euo pipefail
python=$1 src=$2 work=$3 core=${4:-}
missing=77
if [ "${DFSS_REQUIRE_PYTHON_TESTS:-0}" = 1 ]; then missing=1; fi
if ! "$python" -c "import torch" 2>/dev/null; then
  echo "SKIP: $python cannot import torch (Debian: apt-get install python3-torch)"; exit $missing
fi
if ! "$python" -c "import pytest" 2>/dev/null; then
  echo "SKIP: $python cannot import pytest (Debian: apt-get install python3-pytest)"; exit $missing
fi
rm -rf "$work"
"$python" -m venv --system-site-packages "$work/venv"
export DFSS_PYTHON_BUILD_DIR="$work/build" MAX_JOBS=${MAX_JOBS:-2}
# ccache (.ci/run installs it) through Debian's compiler links, as torch 2.x's extension builder
# uses it by itself: the operator's files against torch's headers took most of this test's 3-4
# minutes on 2 cores, compiled anew in every run; paths relative to the source tree, so that
# another clone of it hits the cache too.
if [ -d /usr/lib/ccache ] && command -v ccache >/dev/null; then
  export PATH="/usr/lib/ccache:$PATH" CCACHE_BASEDIR="$src"
fi
if [ -n "$core" ]; then export DFSS_CORE_LIBRARY="$core"; fi
start=$(date +%s)
(cd "$src" && "$work/venv/bin/python" -m pip install --quiet --no-build-isolation --no-deps --no-index \
  --no-cache-dir .)
echo "pip install: $(( $(date +%s) - start )) s"
# Out of the source tree, so that `import dfss` is the installed package.
cd "$work"
exec "$work/venv/bin/python" -m pytest -q -rs -p no:cacheprovider "$src/tests/python"
