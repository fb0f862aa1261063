#!/usr/bin/env bash
# Builds the libFuzzer targets (CMake preset "fuzz": clang, ASan + UBSan) and runs each for SECONDS
# (default 60), starting from its seed corpus and crash reproducers; prints per target the number of
# executions and the result. Exits 1 when any target reports a finding (a crash, a sanitizer report,
# a failed check, a timeout or an out-of-memory), after printing the report and the reproducer in
# base64. New corpus entries and reproducers go to a scratch directory (kept on a finding, printed),
# never into the source tree.
#   bash tests/fuzz/run_fuzzers.sh [SECONDS] [TARGET...]      TARGET: npy, api, cli (default: all)
set -euo pipefail
cd "$(dirname "$0")/../.."

seconds=${1:-60}
shift || true
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(npy api cli)

cmake --preset fuzz >/dev/null
cmake --build --preset fuzz

export LSAN_OPTIONS="suppressions=$PWD/tests/fuzz/lsan.supp"
work=$(mktemp -d "${TMPDIR:-/tmp}/dfss-fuzz.XXXXXX")
status=0
for name in "${targets[@]}"; do
  dir="$work/$name"
  mkdir -p "$dir/corpus"
  seeds=("tests/fuzz/corpus/$name")
  [ -d "tests/fuzz/regressions/$name" ] && seeds+=("tests/fuzz/regressions/$name")
  # -timeout: an input running longer than 25 s is a hang (inputs take milliseconds).
  # -rss_limit_mb: libFuzzer's default (2 GiB) made explicit; more is a memory blow-up.
  # The first corpus directory receives the new inputs; the seed directories are only read.
  started=$(date +%s)
  # TMPDIR: fuzz_cli's private directory lives there, and stays after a finding (abort skips atexit).
  if TMPDIR="$dir" "build-fuzz/tests/fuzz/fuzz_$name" -max_total_time="$seconds" -timeout=25 -rss_limit_mb=2048 \
       -print_final_stats=1 -artifact_prefix="$dir/" "$dir/corpus" "${seeds[@]}" >"$dir/log" 2>&1; then
    result="no finding"
  else
    result="FINDING"
    status=1
    echo "---- fuzz_$name: last lines of its log ($dir/log) ----"
    tail -n 80 "$dir/log"
    for artifact in "$dir"/crash-* "$dir"/leak-* "$dir"/timeout-* "$dir"/oom-*; do
      [ -f "$artifact" ] || continue
      echo "reproducer $artifact (base64):"
      base64 -w 0 "$artifact"
      echo
    done
  fi
  executions=$(sed -n 's/^stat::number_of_executed_units: *//p' "$dir/log")
  echo "fuzz_$name: ${executions:-?} executions in $(($(date +%s) - started)) s: $result"
done
if [ "$status" -eq 0 ]; then
  rm -rf "$work"
else
  echo "fuzzing found something; logs and reproducers are in $work (docs/testing.md, \"Fuzzing\")"
fi
exit "$status"
