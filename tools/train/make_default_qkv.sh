#!/usr/bin/env bash
# Regenerates data/text-lm-qkv: the Q, K, V that `dfss` (the default job) shows DFSS on, captured from
# the dense text language model of docs/accuracy.md ("Text language model").
#
# Usage: make_default_qkv.sh PYTHON CHECKPOINT [OUT_DIR]
#   PYTHON      an interpreter with torch, numpy and the dfss package (lm_train.py's)
#   CHECKPOINT  the dense model, runs/lm/dense/final.pt of tools/train/run_lm.sh
#   OUT_DIR     default: data/text-lm-qkv of this repository (its .npy files, capture.json and
#               SHA256SUMS are replaced; README.md is left alone)
# Environment: THREADS (2, as run_lm.sh), CAPTURE (an existing `lm_train.py capture --layers 0 3
# --windows 1` directory of the same checkpoint, e.g. runs/lm/qkv: copied instead of captured again),
# LAYERS ("0 3": the layers shipped; the tests set "0 1" for their 2-layer model).
#
# What it does, deterministically for a given checkpoint, torch build and thread count:
#   1. lm_train.py capture --checkpoint CHECKPOINT --layers 0 3 --windows 1 --split test: the model
#      runs dense on the first 1,024 bytes of the longest test document (inspect.py) and writes Q, K, V
#      of layers 0 and 3 as they reach dfss.attention (q and k after RoPE), [1, 1024, 4, 64] float16;
#   2. copies them as layer0-{q,k,v}.npy and layer3-{q,k,v}.npy (all 4 heads: 6 x 512 KiB = 3 MiB),
#      checking dtype and shape;
#   3. writes capture.json (the capture's note plus the checkpoint's SHA-256, the commit, the command
#      and the versions) and SHA256SUMS of the .npy files.
set -euo pipefail
if [ $# -lt 2 ] || [ $# -gt 3 ]; then
  sed -n '2,13p' "$0" >&2
  exit 2
fi
py=$1 checkpoint=$2
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
out=${3:-$repo/data/text-lm-qkv}
threads=${THREADS:-2}
layers=${LAYERS:-0 3}
export OMP_NUM_THREADS=$threads OPENBLAS_NUM_THREADS=$threads MKL_NUM_THREADS=$threads
[ -f "$checkpoint" ] || { echo "make_default_qkv.sh: no checkpoint at $checkpoint" >&2; exit 2; }

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
if [ -n "${CAPTURE:-}" ]; then
  src=$CAPTURE
  command="lm_train.py capture (an existing capture: $CAPTURE)"
else
  src=$tmp/capture
  # shellcheck disable=SC2086  # $layers: one argument per layer
  "$py" "$here/lm_train.py" capture --threads "$threads" --checkpoint "$checkpoint" --layers $layers --windows 1 \
    --split test --out "$src" >&2
  command="OMP_NUM_THREADS=$threads python3 tools/train/lm_train.py capture --threads $threads --checkpoint CHECKPOINT --layers $layers --windows 1 --split test --out DIR"
fi
commit=$(git -C "$repo" rev-parse --short=12 HEAD 2>/dev/null || echo unknown)
if [ "$commit" != unknown ] && [ -n "$(git -C "$repo" status --porcelain --untracked-files=no -- tools/train 2>/dev/null)" ]; then
  commit="$commit (tools/train modified)"
fi
mkdir -p "$out"

"$py" - "$src" "$out" "$checkpoint" "$commit" "$command" "$layers" <<'EOF'
import hashlib, json, os, sys
import numpy as np
src, out, checkpoint, commit, command, layers = sys.argv[1:]
layers = [int(l) for l in layers.split()]
note = json.load(open(os.path.join(src, "capture.json")))
if note.get("attention") != "dense" or note.get("causal") is not True:
    sys.exit(f"make_default_qkv.sh: {src}/capture.json: expected a dense, causal capture, got {note}")
names = {w["name"] for w in note["inputs"]}
written = []
for layer in layers:
    if f"w0-layer{layer}" not in names:
        sys.exit(f"make_default_qkv.sh: {src}: no w0-layer{layer} (capture with --layers {' '.join(map(str, layers))})")
    for x in "qkv":
        a = np.load(os.path.join(src, f"w0-layer{layer}-{x}.npy"))
        if a.dtype != np.float16 or a.ndim != 4 or a.shape[0] != 1 or not np.isfinite(a).all():
            sys.exit(f"make_default_qkv.sh: w0-layer{layer}-{x}.npy: expected finite float16 [1, L, H, d], "
                     f"got {a.dtype} {a.shape}")
        np.save(os.path.join(out, f"layer{layer}-{x}.npy"), np.ascontiguousarray(a))
        written.append(f"layer{layer}-{x}.npy")
h = hashlib.sha256()
with open(checkpoint, "rb") as f:
    for block in iter(lambda: f.read(1 << 20), b""):
        h.update(block)
import torch  # versions only
doc = note["inputs"][0]
result = {
    "description": f"Q, K, V of layers {' and '.join(map(str, layers))} of the byte-level text LM "
                   f"(docs/accuracy.md), dense, on the first {doc['tokens']} bytes of {doc['document']} (test split)",
    "causal": True,
    "layout": "[1, L, H, d] float16, q and k after RoPE (as dfss.attention receives them)",
    "inputs": [{"name": f"layer{l}", "layer": l, "document": doc["document"], "tokens": doc["tokens"]}
               for l in layers],
    "checkpoint": os.path.basename(os.path.dirname(os.path.abspath(checkpoint))) + "/" + os.path.basename(checkpoint),
    "checkpoint_sha256": h.hexdigest(),
    "split": note["split"],
    "split_sha256": note["split_sha256"],
    "commit": commit,
    "command": command,
    "torch": torch.__version__,
    "numpy": np.__version__,
    "regenerate": "bash tools/train/make_default_qkv.sh PYTHON runs/lm/dense/final.pt",
}
with open(os.path.join(out, "capture.json"), "w") as f:
    json.dump(result, f, indent=1)
    f.write("\n")
with open(os.path.join(out, "SHA256SUMS"), "w") as f:
    for name in written:
        with open(os.path.join(out, name), "rb") as g:
            f.write(f"{hashlib.sha256(g.read()).hexdigest()}  {name}\n")
EOF
echo "make_default_qkv.sh: wrote $out" >&2
cat "$out/SHA256SUMS"
