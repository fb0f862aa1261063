#!/usr/bin/env bash
# The text language-model experiment of docs/accuracy.md ("Text language model"), stage by stage:
#   corpus    text_corpus.py build of this interpreter's standard library (QUICK=1: a synthetic tree)
#   dense     dense training with the default budget, then its test bpb under dense, 1:2 and 2:4
#             (DFSS without finetuning)
#   ft        DFSS 2:4 and 1:2 finetuned from the dense model for 20% of its steps (lr $FT_LR)
#   control   the dense model trained on, dense, for the same steps and lr (the finetunes' control)
#   scratch   DFSS trained from scratch with the dense budget (patterns in $SCRATCH, default "2:4 1:2")
#   windows   the dense model's test bpb under DFSS with dense sink and recent windows, no finetuning
#             (attention specs in $WINDOWS, default "2:4+sink16+recent64 1:2+sink16+recent64")
#   capture   Q, K, V of the dense model's first and last layer on the longest test document (fp16)
#   report    lm_report.py: the table with paired bootstrap intervals, bpb by position, the SVG plot
# A stage whose output exists is skipped and an interrupted run (Ctrl-C: last.pt) is resumed, so the
# script can simply be started again; STAGES runs a subset (e.g. STAGES="dense ft control").
# Usage: run_lm.sh PYTHON OUT_DIR [extra lm_train.py train args for the dense and from-scratch runs]
# Environment: THREADS (2), BUDGET (training bytes of the dense and from-scratch runs; default
# lm_train.py's), FT_LR (3e-4), SCRATCH ("2:4 1:2"), WINDOWS (see above), STAGES (all), QUICK=1 (CI:
# --quick runs).
set -euo pipefail
py=$1 out=$2
shift 2
here=$(cd "$(dirname "$0")" && pwd)
threads=${THREADS:-2}
# torch.set_num_threads does not bound OpenBLAS's own threads: the environment does.
export OMP_NUM_THREADS=$threads OPENBLAS_NUM_THREADS=$threads MKL_NUM_THREADS=$threads
stages=" ${STAGES:-corpus dense ft control scratch windows capture report} "
quick=()
if [ "${QUICK:-0}" = 1 ]; then quick=(--quick --quiet); fi
lm=("$py" "$here/lm_train.py")
mkdir -p "$out"

# train NAME ARGS...: final.pt there: done; last.pt there: resume it; else a new run with ARGS.
train() {
  local name=$1
  shift
  if [ -f "$out/$name/final.pt" ]; then
    echo "$name: done ($out/$name/final.pt)"
  elif [ -f "$out/$name/last.pt" ]; then
    "${lm[@]}" train --resume "$out/$name/last.pt" --threads "$threads" | tee "$out/$name.json"
  else
    "${lm[@]}" train --threads "$threads" --out "$out/$name" "$@" | tee "$out/$name.json"
  fi
}
# evaluate NAME PATTERNS...: test bpb of NAME/final.pt under each pattern, per document, into NAME-eval.json.
evaluate() {
  local name=$1
  shift
  if [ ! -f "$out/$name-eval.json" ]; then
    "${lm[@]}" eval --threads "$threads" --checkpoint "$out/$name/final.pt" --attention "$@" \
      --out "$out/$name-eval.json.tmp"
    mv "$out/$name-eval.json.tmp" "$out/$name-eval.json"
  fi
}
has() { [[ $stages == *" $1 "* ]]; }

if has corpus && [ ! -f "$out/corpus/manifest.json" ]; then
  if [ "${QUICK:-0}" = 1 ]; then
    "$py" "$here/text_corpus.py" synthetic --out "$out/corpus-src" --files 40
    "$py" "$here/text_corpus.py" build --source "$out/corpus-src" --out "$out/corpus"
  else
    "$py" "$here/text_corpus.py" build --out "$out/corpus"
  fi
fi
if has dense; then
  budget=()
  if [ -n "${BUDGET:-}" ]; then budget=(--budget-bytes "$BUDGET"); fi
  train dense --corpus "$out/corpus" --attention dense "${budget[@]}" "${quick[@]}" "$@"
  evaluate dense dense 1:2 2:4
fi
dense_steps() { "$py" -c "import json, sys; print(json.load(open(sys.argv[1]))['steps_done'])" "$out/dense/log.json"; }
if has ft || has control; then
  ft=$(( $(dense_steps) / 5 ))
  # About 8 validation points along the finetune (the plot), at least one step apart.
  every=$(( ft / 8 > 0 ? ft / 8 : 1 ))
  runs=()
  if has ft; then runs+=("ft-2-4:2:4" "ft-1-2:1:2"); fi
  if has control; then runs+=("control:dense"); fi
  for r in "${runs[@]}"; do
    name=${r%%:*} pattern=${r#*:}
    train "$name" --init "$out/dense/final.pt" --attention "$pattern" --steps "$ft" --lr "${FT_LR:-3e-4}" \
      --eval-every "$every" "${quick[@]}"
    evaluate "$name" "$pattern"
  done
fi
if has scratch; then
  for p in ${SCRATCH-2:4 1:2}; do
    train "scratch-${p/:/-}" --corpus "$out/corpus" --attention "$p" --steps "$(dense_steps)" "${quick[@]}" "$@"
    evaluate "scratch-${p/:/-}" "$p"
  done
fi
if has windows && [ ! -f "$out/dense-windows-eval.json" ]; then
  # shellcheck disable=SC2086  # the specs are words
  "${lm[@]}" eval --threads "$threads" --checkpoint "$out/dense/final.pt" \
    --attention ${WINDOWS:-2:4+sink16+recent64 1:2+sink16+recent64} --out "$out/dense-windows-eval.json.tmp"
  mv "$out/dense-windows-eval.json.tmp" "$out/dense-windows-eval.json"
fi
if has capture && [ ! -f "$out/qkv/capture.json" ]; then
  last=$(( $("$py" -c "import json, sys; print(json.load(open(sys.argv[1]))['config']['layers'])" \
    "$out/dense/log.json") - 1 ))
  "${lm[@]}" capture --threads "$threads" --checkpoint "$out/dense/final.pt" --layers 0 "$last" --windows 1 \
    --out "$out/qkv"
fi
if has report; then
  "$py" "$here/lm_report.py" "$out" --svg "$out/lm_finetune.svg" > "$out/report.md"
  cat "$out/report.md"
fi
