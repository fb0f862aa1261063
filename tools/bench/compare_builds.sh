#!/usr/bin/env bash
# compare_builds.sh [options] OLD_REV [NEW_REV]: is NEW_REV (default HEAD) slower than OLD_REV?
#
# Builds both revisions side by side (git archive into a cache folder: Release, no CUDA, no torch,
# no tests, only the dfss tool; a revision already built is reused), then runs both `dfss bench`
# binaries on the same machine in interleaved rounds: in round r, for each (dtype, head dim), the old
# and the new binary run one after the other (old first in odd rounds, new first in even rounds), so
# that slow drifts of the machine's load fall on both alike. Each run: --no-torch --no-sgemm --no-ref,
# fused rows, the shapes below. Then, per shape and pattern, the median over the rounds of the ratio
# new ms / old ms (each run's own median of --iters calls), with the kernel that ran on each side;
# a ratio above --threshold is flagged.
#
# Options (defaults: the issue's sweep without L = 8192, about 8 minutes on a 2-core machine):
#   --rounds N          interleaved rounds (5)
#   --lengths LIST      sequence lengths (1024,2048,4096; add 8192 for the full sweep, ~4x longer)
#   --head-dims LIST    head dimensions (64,128)
#   --dtypes LIST       dfss input types (f32,bf16)
#   --patterns LIST     N:M patterns (dense,1:2,2:4)
#   --algorithms LIST   cpu algorithms (fused)
#   --isa NAME          the fused kernels' ISA on both sides (automatic); e.g. avx2 compares one
#                       SIMD target across builds (both builds must know the name)
#   --backward          time forward + backward (dfss bench --backward) instead of the forward
#   --causal            causal attention (dfss bench --causal: Lq = Lk, bottom-right mask)
#   --decode            time decode steps (dfss bench --decode, one run per round covers every
#                       cache type and head layout; --head-dims and --algorithms do not apply),
#                       and print each side's median share of the memory sweep of its own runs
#                       (a sweep of the cache itself since commit "dfss bench --decode sweeps the
#                       cache", of another buffer before: shares across that change differ in
#                       kind); --lengths defaults to 16384,65536 there
#   --decode-heads LIST H:Hkv layouts for --decode (32:32,32:8)
#   --threads N         threads of each run (2)
#   --iters N           timed calls per configuration and run (3)
#   --threshold X       flag ratios above this (1.03)
#   --out DIR           where the JSON of every run and the summary go (a new temp folder)
#   --build-root DIR    where the builds are cached (${XDG_CACHE_HOME:-$HOME/.cache}/dfss/compare)
# Exit status: 0 when no ratio is above the threshold, 3 when some are, 1 or 2 on errors.
# Environment: JOBS (build parallelism, default 2).
set -euo pipefail

die() { printf 'compare_builds: error: %s\n' "$*" >&2; exit 2; }
say() { printf 'compare_builds: %s\n' "$*" >&2; }

rounds=5 lengths="" head_dims=64,128 dtypes=f32,bf16 patterns=dense,1:2,2:4
algorithms=fused isa=automatic backward=() causal=() decode=0 decode_heads=32:32,32:8 threads=2 iters=3 threshold=1.03 out="" build_root="${XDG_CACHE_HOME:-$HOME/.cache}/dfss/compare"
positional=()
while [ $# -gt 0 ]; do
  case "$1" in
    --rounds) rounds="${2:?--rounds: expected a number}"; shift 2 ;;
    --lengths) lengths="${2:?--lengths: expected a comma list}"; shift 2 ;;
    --head-dims) head_dims="${2:?--head-dims: expected a comma list}"; shift 2 ;;
    --dtypes) dtypes="${2:?--dtypes: expected a comma list}"; shift 2 ;;
    --patterns) patterns="${2:?--patterns: expected a comma list}"; shift 2 ;;
    --algorithms) algorithms="${2:?--algorithms: expected a comma list}"; shift 2 ;;
    --isa) isa="${2:?--isa: expected an ISA name}"; shift 2 ;;
    --backward) backward=(--backward); shift ;;
    --causal) causal=(--causal); shift ;;
    --decode) decode=1; shift ;;
    --decode-heads) decode_heads="${2:?--decode-heads: expected a comma list}"; shift 2 ;;
    --threads) threads="${2:?--threads: expected a number}"; shift 2 ;;
    --iters) iters="${2:?--iters: expected a number}"; shift 2 ;;
    --threshold) threshold="${2:?--threshold: expected a number}"; shift 2 ;;
    --out) out="${2:?--out: expected a folder}"; shift 2 ;;
    --build-root) build_root="${2:?--build-root: expected a folder}"; shift 2 ;;
    -h | --help) awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"; exit 0 ;;
    -*) die "unknown option '$1' (see --help)" ;;
    *) positional+=("$1"); shift ;;
  esac
done
if [ ${#positional[@]} -lt 1 ] || [ ${#positional[@]} -gt 2 ]; then
  die "expected OLD_REV [NEW_REV], got ${#positional[@]} arguments: ${positional[*]:-none}"
fi
if [ -z "$lengths" ]; then
  lengths=1024,2048,4096
  [ "$decode" = 1 ] && lengths=16384,65536
fi
[ "$decode" = 1 ] && [ ${#backward[@]} -gt 0 ] && die "--decode and --backward: a decode step has no backward"
for v in rounds threads iters; do
  [[ "${!v}" =~ ^[1-9][0-9]*$ ]] || die "--${v}: expected an integer >= 1, got '${!v}'"
done

repo=$(git -C "$(dirname "$0")" rev-parse --show-toplevel)
old_rev="${positional[0]}" new_rev="${positional[1]:-HEAD}"
old_sha=$(git -C "$repo" rev-parse --verify "$old_rev^{commit}" 2>/dev/null) || die "OLD_REV: '$old_rev' is not a commit"
new_sha=$(git -C "$repo" rev-parse --verify "$new_rev^{commit}" 2>/dev/null) || die "NEW_REV: '$new_rev' is not a commit"
[ -n "$out" ] || out=$(mktemp -d "${TMPDIR:-/tmp}/dfss-compare.XXXXXX")
mkdir -p "$out" "$build_root"

# build SHA -> prints the path of its dfss binary. The source is `git archive` of the commit (no
# worktree bookkeeping in the repository); the build folder is keyed by the full commit id.
build() {
  local sha="$1" dir="$build_root/$1"
  if [ -x "$dir/build/tools/dfss" ]; then
    say "$(git -C "$repo" log -1 --format='%h %s' "$sha" | cut -c1-72): already built in $dir"
  else
    say "building $(git -C "$repo" log -1 --format='%h %s' "$sha" | cut -c1-72) in $dir"
    rm -rf "$dir" && mkdir -p "$dir/src"
    git -C "$repo" archive "$sha" | tar -x -C "$dir/src"
    local launcher=()
    command -v ccache >/dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
    cmake -S "$dir/src" -B "$dir/build" -DCMAKE_BUILD_TYPE=Release -DDFSS_ENABLE_CUDA=OFF \
      -DDFSS_WITH_TORCH=OFF -DDFSS_BUILD_TESTS=OFF -DDFSS_BUILD_BENCH=OFF -DDFSS_BUILD_CUDA_BENCH=OFF \
      "${launcher[@]}" >"$dir/configure.log" 2>&1 || die "configure of $sha failed: see $dir/configure.log"
    cmake --build "$dir/build" -j "${JOBS:-2}" --target dfss_cli >"$dir/build.log" 2>&1 ||
      die "build of $sha failed: see $dir/build.log"
  fi
  printf '%s\n' "$dir/build/tools/dfss"
}
old_bin=$(build "$old_sha")
new_bin=$(build "$new_sha")

cpu=$(sed -n 's/^model name\s*:\s*//p' /proc/cpuinfo | head -1)
family=$(sed -n 's/^cpu family\s*:\s*//p' /proc/cpuinfo | head -1)
model=$(sed -n 's/^model\s*:\s*//p' /proc/cpuinfo | head -1)
{
  echo "old: $old_sha ($old_rev)"
  echo "new: $new_sha ($new_rev)"
  echo "cpu: $cpu (family $family model $model), $(nproc) hardware threads; load average at start: $(cut -d' ' -f1 /proc/loadavg)"
  if [ "$decode" = 1 ]; then
    echo "decode: cache lengths $lengths, heads $decode_heads, cache types $dtypes, patterns $patterns,"
  else
    echo "sweep: lengths $lengths, head dims $head_dims, dtypes $dtypes, patterns $patterns, algorithms $algorithms,${causal:+ causal,}${backward:+ forward + backward,}"
  fi
  echo "       $threads threads, $iters timed calls per run, $rounds interleaved rounds"
} | tee "$out/setup.txt" >&2

IFS=, read -r -a dim_list <<<"$head_dims"
IFS=, read -r -a dtype_list <<<"$dtypes"
start=$SECONDS
for ((r = 1; r <= rounds; r++)); do
  sides=(old new)
  ((r % 2 == 0)) && sides=(new old)
  if [ "$decode" = 1 ]; then
    for side in "${sides[@]}"; do
      bin=$old_bin
      [ "$side" = new ] && bin=$new_bin
      say "round $r/$rounds, decode: $side ($((SECONDS - start)) s so far)"
      "$bin" bench --decode --lengths "$lengths" --decode-heads "$decode_heads" --decode-dtypes "$dtypes" \
        --patterns "$patterns" --isa "$isa" --threads "$threads" --iters "$iters" --no-torch \
        --json "$out/r$r-$side-decode.json" >"$out/r$r-$side-decode.txt" 2>/dev/null ||
        die "round $r, $side binary ($bin), decode failed: see $out/r$r-$side-decode.txt"
    done
    continue
  fi
  for t in "${dtype_list[@]}"; do
    for d in "${dim_list[@]}"; do
      for side in "${sides[@]}"; do
        bin=$old_bin
        [ "$side" = new ] && bin=$new_bin
        say "round $r/$rounds, $t d=$d: $side ($((SECONDS - start)) s so far)"
        "$bin" bench --lengths "$lengths" --patterns "$patterns" --algorithms "$algorithms" --head-dim "$d" \
          --isa "$isa" "${backward[@]}" "${causal[@]}" --dtype "$t" --threads "$threads" --warmup 1 --iters "$iters" --no-torch --no-sgemm --no-ref \
          --json "$out/r$r-$side-$t-d$d.json" >"$out/r$r-$side-$t-d$d.txt" 2>/dev/null ||
          die "round $r, $side binary ($bin), $t d=$d failed: see $out/r$r-$side-$t-d$d.txt"
      done
    done
  done
done
echo "load average at end: $(cut -d' ' -f1 /proc/loadavg); $((SECONDS - start)) s of runs" | tee -a "$out/setup.txt" >&2

python3 - "$out" "$threshold" "$decode" <<'EOF' | tee "$out/summary.txt"
import glob, json, os, re, statistics, sys
out, threshold, decode = sys.argv[1], float(sys.argv[2]), sys.argv[3] == "1"
if decode:
    # (cache, H, Hkv, Lk, row) -> side -> round -> (ms, share of the sweep)
    ms = {}
    for path in sorted(glob.glob(os.path.join(out, "r*-*-decode.json"))):
        rnd, side = re.fullmatch(r"r(\d+)-(old|new)-decode\.json", os.path.basename(path)).groups()
        with open(path) as f:
            for row in json.load(f)["rows"]:
                if not row["ok"]:
                    continue
                key = (row["cache"], row["H"], row["Hkv"], row["Lk"], row["row"])
                ms.setdefault(key, {}).setdefault(side, {})[int(rnd)] = (row["ms_median"], row["fraction_of_bandwidth"])
    print("decode: median over rounds of new ms / old ms per cache, heads, Lk and row; > %.2f is flagged;" % threshold)
    print("'of sweep' = median over rounds of that side's share of its own run's memory sweep")
    print("%-5s %6s %6s %-24s %9s %9s %7s %9s %9s %6s" % ("cache", "H:Hkv", "Lk", "row", "old ms", "new ms", "ratio",
                                                       "old sweep", "new sweep", "rounds"))
    flagged = 0
    sweep = lambda what: what.startswith("memory sweep")  # the yardsticks: never flagged
    for key in sorted(ms, key=lambda k: (k[0], -k[2], k[3], not sweep(k[4]), k[4])):
        cache, h, hkv, lk, what = key
        sides = ms[key]
        common = sorted(set(sides.get("old", {})) & set(sides.get("new", {})))
        if not common:
            continue
        ratio = statistics.median(sides["new"][r][0] / sides["old"][r][0] for r in common)
        share = lambda side: ("%8.0f%%" % (100 * statistics.median(sides[side][r][1] for r in common))
                              if all(sides[side][r][1] is not None for r in common) else "%9s" % "-")
        flag = ratio > threshold and not sweep(what)
        flagged += flag
        print("%-5s %6s %6d %-24s %9.3f %9.3f %7.3f %s %s %6d%s" % (
            cache, "%d:%d" % (h, hkv), lk, what, statistics.median(sides["old"][r][0] for r in common),
            statistics.median(sides["new"][r][0] for r in common), ratio, share("old"), share("new"), len(common),
            "   SLOWER" if flag else ""))
    print("%d of %d dfss ratios above %.2f" % (flagged, sum(not sweep(k[4]) for k in ms), threshold))
    sys.exit(3 if flagged else 0)
runs = {}  # (side, dtype, d) -> [json of each round]
for path in sorted(glob.glob(os.path.join(out, "r*-*-*-d*.json"))):
    rnd, side, dtype, d = re.fullmatch(r"r(\d+)-(old|new)-(\w+)-d(\d+)\.json", os.path.basename(path)).groups()
    with open(path) as f:
        runs.setdefault((side, dtype, int(d)), []).append((int(rnd), json.load(f)))
ms, kernels = {}, {}
for (side, dtype, d), items in runs.items():
    for rnd, j in items:
        for row in j["rows"]:
            if row["source"] != "dfss" or not row["ok"]:
                continue
            key = (dtype, d, row["L"], row["pattern"], row["algorithm"], row["isa"])
            ms.setdefault(key, {}).setdefault(side, {})[rnd] = row["ms_median"]
            kernels.setdefault(key, {})[side] = row["kernel"]
print("median over rounds of new ms / old ms per shape (B=1, H=12) and pattern; > %.2f is flagged" % threshold)
print("%-5s %4s %6s %-6s %-12s %9s %9s %7s %6s  %s" % ("dtype", "d", "L", "pattern", "algorithm", "old ms",
                                                     "new ms", "ratio", "rounds", "kernel old -> new"))
flagged = 0
for key in sorted(ms, key=lambda k: (k[0], k[1], k[2], k[3], k[4])):
    dtype, d, L, pattern, algorithm, isa = key
    sides = ms[key]
    common = sorted(set(sides.get("old", {})) & set(sides.get("new", {})))
    if not common:
        print("%-5s %4d %6d %-6s %-12s only in the %s build" % (dtype, d, L, pattern, algorithm,
                                                                "new" if "new" in sides else "old"))
        continue
    ratio = statistics.median(sides["new"][r] / sides["old"][r] for r in common)
    old_ms = statistics.median(sides["old"][r] for r in common)
    new_ms = statistics.median(sides["new"][r] for r in common)
    flag = ratio > threshold
    flagged += flag
    k = kernels[key]
    print("%-5s %4d %6d %-6s %-12s %9.2f %9.2f %7.3f %6d  %s -> %s%s" % (
        dtype, d, L, pattern, algorithm, old_ms, new_ms, ratio, len(common), k.get("old", "-"),
        k.get("new", "-"), "   SLOWER" if flag else ""))
print("%d of %d ratios above %.2f" % (flagged, len(ms), threshold))
sys.exit(3 if flagged else 0)
EOF
status=${PIPESTATUS[0]}
say "runs and summary in $out"
exit "$status"
