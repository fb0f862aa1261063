#!/usr/bin/env bash
# The accuracy experiment of docs/accuracy.md for one task: dense training, evaluation of the dense
# model with DFSS 1:2 and 2:4 (no finetuning), DFSS finetuning from the dense model with 20% of the
# dense steps, and DFSS trained from scratch with the dense budget (patterns in $SCRATCH, default
# "2:4 1:2"), with $THREADS threads (default 2). Extra arguments go to the dense and from-scratch runs (e.g. --lr, --curriculum-steps).
# Usage: run_accuracy.sh PYTHON TASK STEPS MIN_LEN MAX_LEN OUT_DIR [extra dfss_train.py train args]
set -euo pipefail
py=$1 task=$2 steps=$3 min_len=$4 max_len=$5 out=$6
shift 6
here=$(cd "$(dirname "$0")" && pwd)
train="$py $here/dfss_train.py"
ft=$(( steps / 5 ))
mkdir -p "$out"
common=(--task "$task" --min-len "$min_len" --max-len "$max_len" --threads "${THREADS:-2}" --quiet "$@")
$train train "${common[@]}" --attention dense --steps "$steps" --out "$out/dense" | tee "$out/dense.json"
$train eval --threads "${THREADS:-2}" --checkpoint "$out/dense/final.pt" --attention dense 1:2 2:4 | tee "$out/dense-eval.json"
for p in 2:4 1:2; do
  $train train --quiet --threads "${THREADS:-2}" --attention "$p" --init "$out/dense/final.pt" --steps "$ft" --eval-every $(( ft / 5 )) \
    --out "$out/ft-${p/:/-}" | tee "$out/ft-${p/:/-}.json"
done
for p in ${SCRATCH-2:4 1:2}; do
  $train train "${common[@]}" --attention "$p" --steps "$steps" --out "$out/scratch-${p/:/-}" | tee "$out/scratch-${p/:/-}.json"
done
