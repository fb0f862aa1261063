#!/usr/bin/env bash
# torch2-venv.sh [DIR]: a Python venv with PyTorch 2.x from PyPI, used on the CPU only: the peer of
# `dfss bench` (F.scaled_dot_product_attention) and the transformers tests. Idempotent: a second run
# checks what is there and installs only what is missing.
#
# DIR defaults to $DFSS_TORCH2_VENV, else ${XDG_CACHE_HOME:-$HOME/.cache}/dfss/torch2-venv (outside
# the repository; `dfss bench` looks there by default), with the extras of torch2-venv-extras.txt
# (transformers for tests/python/test_transformers.py, pytest, ninja). Environment:
#   DFSS_TORCH_SPEC     the pip requirement for torch (default 'torch>=2,<3': the newest 2.x)
#   DFSS_VENV_PYTHON    the interpreter the venv is made from (default: python3 on PATH)
#   DFSS_WHEEL_CACHE    where the torch wheel and the extras' wheels are kept between runs
#                       (default .../dfss/wheels)
#
# Why not `pip install torch`: the Linux wheel on PyPI is the CUDA build, and its dependencies are
# gigabytes of CUDA libraries. Instead (docs/benchmarks.md, "The PyTorch peers"):
#   1. the torch wheel alone (--no-deps);
#   2. its pure-Python dependencies, read from the wheel's own Requires-Dist (not hard-coded);
#   3. `import torch` in a loop: libtorch links a few CUDA libraries at load time even on a machine
#      without a GPU; for each library the loader reports missing, the one matching requirement of
#      Requires-Dist (exact version) is installed, and nothing else;
#   4. a check: SDPA forward and backward in fp32 and bf16 on the CPU.
# Only PyPI is used (pip's configured index).
set -euo pipefail

cache_root="${XDG_CACHE_HOME:-$HOME/.cache}/dfss"
venv="${1:-${DFSS_TORCH2_VENV:-$cache_root/torch2-venv}}"
torch_spec="${DFSS_TORCH_SPEC:-torch>=2,<3}"
base_python="${DFSS_VENV_PYTHON:-python3}"
wheels="${DFSS_WHEEL_CACHE:-$cache_root/wheels}"
# Each pass of the import loop installs one missing library; libtorch needs 3 on a machine with
# /usr/local/cuda and about 12 without, so 25 passes mean something else is wrong.
max_passes=25
# The wheel is ~540 MB, the venv ~1.5 GB once unpacked (plus any CUDA libraries the loader wants).
need_mib=4096

say() { printf 'torch2-venv: %s\n' "$*"; }
die() { printf 'torch2-venv: error: %s\n' "$*" >&2; exit 1; }

case "${1:-}" in
  -h | --help)
    sed -n '2,22p' "$0" | sed 's/^# \{0,1\}//'
    exit 0
    ;;
esac

mkdir -p "$(dirname "$venv")" "$wheels"
avail_mib=$(df -Pm "$(dirname "$venv")" | awk 'NR == 2 { print $4 }')
say "venv: $venv; wheel cache: $wheels; free disk there: ${avail_mib} MiB"
if [ ! -x "$venv/bin/python" ] && [ "${avail_mib:-0}" -lt "$need_mib" ]; then
  die "DIR $venv: expected at least $need_mib MiB free on its file system, found ${avail_mib} MiB"
fi

# 1. The venv.
if [ -x "$venv/bin/python" ]; then
  say "venv exists ($("$venv/bin/python" --version 2>&1))"
else
  command -v "$base_python" >/dev/null || die "DFSS_VENV_PYTHON: expected an interpreter, got '$base_python' (not found)"
  say "creating the venv with $base_python ($("$base_python" --version 2>&1))"
  "$base_python" -m venv "$venv" || die "'$base_python -m venv $venv' failed (Debian: apt-get install python3-venv)"
fi
py="$venv/bin/python"
pip=("$py" -m pip --disable-pip-version-check --quiet)
# pip install, without pip's complaint that torch's CUDA requirements are not installed (they are
# left out on purpose; its other messages pass).
pip_install() {
  "${pip[@]}" install "$@" 2> >(grep -v -e "^torch .* requires .*, which is not installed" \
    -e "dependency resolver does not currently take into account" >&2)
}

# 2. The torch wheel, without dependencies (downloaded once into the wheel cache; pip picks the
# wheel for the venv's Python version).
installed_torch=$("$py" -c 'import importlib.metadata as m; print(m.version("torch"))' 2>/dev/null || true)
if [ -n "$installed_torch" ]; then
  say "torch $installed_torch already installed"
else
  say "downloading '$torch_spec' (no dependencies) into $wheels"
  "${pip[@]}" download --no-deps --dest "$wheels" "$torch_spec"
  wheel=$("$py" - "$wheels" "$torch_spec" <<'EOF'
import sys, pathlib, sysconfig
from pip._vendor.packaging.requirements import Requirement
from pip._vendor.packaging.utils import parse_wheel_filename
from pip._vendor.packaging.tags import sys_tags
req = Requirement(sys.argv[2])
ok_tags = set(sys_tags())
best = None
for w in pathlib.Path(sys.argv[1]).glob("torch-*.whl"):
    name, version, _, tags = parse_wheel_filename(w.name)
    if version in req.specifier and tags & ok_tags and (best is None or version > best[0]):
        best = (version, w)
print(best[1] if best else "")
EOF
)
  [ -n "$wheel" ] || die "no torch wheel matching '$torch_spec' for this Python in $wheels"
  say "installing $(basename "$wheel") --no-deps"
  pip_install --no-deps "$wheel"
fi
torch_version=$("$py" -c 'import importlib.metadata as m; print(m.version("torch"))')

# The wheel's Requires-Dist, split: CUDA packages (installed only when the loader asks, step 3) and
# the rest (installed now, with their own dependencies). Markers are evaluated for this venv.
requirements() {  # $1 = cuda | python
  "$py" - "$1" <<'EOF'
import sys, importlib.metadata as m
from pip._vendor.packaging.requirements import Requirement
for line in m.requires("torch") or []:
    r = Requirement(line)
    if r.marker is not None and not r.marker.evaluate({"extra": ""}):
        continue
    cuda = r.name.startswith(("nvidia-", "cuda-")) or r.name == "triton"
    if (sys.argv[1] == "cuda") == cuda:
        print(line.split(";")[0].strip())
EOF
}
mapfile -t py_deps < <(requirements python)
say "torch $torch_version; pure-Python dependencies from Requires-Dist: ${py_deps[*]}"
pip_install "${py_deps[@]}" numpy

# 3. Load loop: `import torch`; for a missing libX.so.N, install the Requires-Dist entry that ships it.
#    nvidia-<name>-cuNN  ships lib<name>   (cudnn, cusparselt, nccl, nvshmem, ...), installed --no-deps;
#    cuda-toolkit[a,b]   ships lib<a>, ... (cublas -> libcublas and libcublasLt, nvtx -> libnvToolsExt).
mapfile -t cuda_deps < <(requirements cuda)
added=()
for ((pass = 1; pass <= max_passes; pass++)); do
  err=$("$py" -c 'import torch' 2>&1 >/dev/null) && break
  # A missing library ("libnccl.so.2: cannot open shared object file"), or an older copy of it found
  # elsewhere on the machine ("undefined symbol: ncclCommResume"): both name the library's prefix.
  lib=$(printf '%s\n' "$err" | sed -n -e 's/.*\(lib[A-Za-z0-9_]*\)\.so[.0-9]*: cannot open shared object file.*/\1/p' \
    -e 's/.*undefined symbol: \([A-Za-z0-9_]*\).*/lib\1/p' | tail -1)
  [ -n "$lib" ] || die "import torch failed, not for a missing library or symbol: $err"
  req=$("$py" - "$lib" "${cuda_deps[@]}" <<'EOF'
import re, sys
from pip._vendor.packaging.requirements import Requirement
# libcusparseLt -> cusparselt, libnvshmem_host -> nvshmem_host, libncclCommResume -> ncclcommresume
lib = sys.argv[1].lower()[3:]
lib = "nvtx" if lib.startswith("nvtoolsext") else lib
best = ("", "")                        # the longest name that prefixes lib (cusparselt, not cusparse)
for line in sys.argv[2:]:
    r = Requirement(line)
    m = re.fullmatch(r"nvidia-(.+?)-cu\d+", r.name)
    names = [m.group(1).replace("-", "")] if m else sorted(r.extras)
    for name in names:
        if lib.startswith(name) and len(name) > len(best[0]):
            best = (name, ("--no-deps " + r.name if m else r.name + "[" + name + "]") + str(r.specifier))
print(best[1])
EOF
)
  case " ${added[*]} " in *" $req "*) die "import torch: $lib still missing after 'pip install $req': $err" ;; esac
  [ -n "$req" ] || die "import torch: missing $lib, and no Requires-Dist entry of torch $torch_version ships it (entries: ${cuda_deps[*]})"
  say "import torch: ${err##*$'\n'} -> pip install $req"
  # shellcheck disable=SC2086 # $req is "[--no-deps ]requirement", split on purpose
  pip_install $req
  added+=("$req")
done
"$py" -c 'import torch' 2>/dev/null || die "import torch still fails after $max_passes passes"

# The LLM tests' requirements (transformers, pytest, ninja): tools/scripts/torch2-venv-extras.txt.
# They are installed with a constraint pinning torch to the version above, so that pip never
# replaces this CPU-loadable torch by the full CUDA install. Their wheels are kept in the wheel
# cache too: installed from there (no index) when it has them, else downloaded into it first.
extras="$(cd "$(dirname "$0")" && pwd)/torch2-venv-extras.txt"
if [ -f "$extras" ] && grep -qv '^\s*\(#\|$\)' "$extras"; then
  constraint="$venv/dfss-torch-constraint.txt"
  printf 'torch==%s\n' "$torch_version" >"$constraint"
  say "installing the extras of $extras (torch pinned to $torch_version)"
  if ! "${pip[@]}" install --no-index --find-links "$wheels" --constraint "$constraint" -r "$extras" \
      >/dev/null 2>&1; then
    say "downloading the extras into $wheels"
    "${pip[@]}" download --dest "$wheels" --constraint "$constraint" -r "$extras"
    pip_install --no-index --find-links "$wheels" --constraint "$constraint" -r "$extras"
  fi
fi

# 4. The check: what `dfss bench` will run.
"$py" - <<'EOF'
import torch, torch.nn.functional as F
torch.manual_seed(0)
for dt in (torch.float32, torch.bfloat16):
    q, k, v = (torch.randn(1, 2, 64, 32, dtype=dt, requires_grad=True) for _ in range(3))
    o = F.scaled_dot_product_attention(q, k, v)
    o.sum().backward()
    ref = torch.softmax(q.double() @ k.double().transpose(-1, -2) / 32 ** 0.5, -1) @ v.double()
    err = (o.double() - ref).abs().max().item()
    tol = 1e-5 if dt == torch.float32 else 5e-2  # fp32 rounding vs bf16's 8-bit mantissa
    assert err < tol and q.grad is not None, (dt, err)
    print("torch2-venv: check: torch %s, SDPA forward+backward %s on the CPU, max err %.1e"
          % (torch.__version__, str(dt).split(".")[1], err))
EOF
{
  echo "torch $torch_version ($torch_spec), python $("$py" --version 2>&1 | cut -d' ' -f2)"
  echo "CUDA packages installed for import (by this or an earlier run):"
  "$py" -c 'import importlib.metadata as m
for d in sorted(m.distributions(), key=lambda d: d.metadata["Name"].lower()):
    if d.metadata["Name"].lower().startswith(("nvidia-", "cuda-")):
        print("  %s==%s" % (d.metadata["Name"], d.version))' 
  date -u '+made or checked: %Y-%m-%d %H:%M UTC'
} >"$venv/dfss-torch2.txt"
say "added for import this run: ${added[*]:-nothing}"
say "ready: $py (dfss bench uses it by default; or --python $py)"
