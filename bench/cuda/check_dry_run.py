#!/usr/bin/env python3
"""CTest dfss_bench_cuda_dry_run: the host side of the GPU benchmark, without a GPU.

Runs `dfss_bench_cuda --dry-run` and `tools/gpu/sdpa_backends.py --dry-run` on the whole grid, both
with --json and --markdown, and checks: the two cover the same shapes; every FLOP and byte count
equals the conventions of docs/gpu-results.md ("Benchmark method"), recomputed here independently
of bench/cuda/bench_metrics.hpp; every time is null in a dry run; the markdown has one row per
result; bad arguments are refused with exit code 2.

Usage: check_dry_run.py DFSS_BENCH_CUDA WORK_DIR
"""
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
SDPA = os.path.join(HERE, "..", "..", "tools", "gpu", "sdpa_backends.py")
DFSS_METHODS = {"dfss_2of4_kernels": (2, 4), "dfss_2of4_api": (2, 4), "dfss_1of2_kernels": (1, 2),
                "dfss_1of2_api": (1, 2)}


def expected(e):
    """FLOPs and stage bytes by the documented conventions (bf16: 2 bytes an element)."""
    bh, L, d = e["B"] * e["H"], e["L"], e["d"]
    qkvo = bh * L * d * 2
    dense_eq = 4 * bh * L * L * d
    m = e["method"]
    if m in DFSS_METHODS:
        n, mm = DFSS_METHODS[m]
        values = bh * L * L * n // mm * 2
        meta = bh * L * L // 8  # 4 bits per group of 4 keys
        maxima = bh * L * L // 8 + bh * L * 4  # an f32 per row and 32 keys, an f32 per row
        return dense_eq, 2 * bh * L * L * d + 2 * bh * L * L * d * n // mm, [
            2 * qkvo + values + meta + maxima, 0, values + meta + maxima + 2 * qkvo]
    if m == "dense_cublas":
        scores = bh * L * L * 2
        return dense_eq, dense_eq, [2 * qkvo + scores, 2 * scores, scores + 2 * qkvo]
    if m.startswith("sdpa_"):
        return dense_eq, dense_eq, None
    raise AssertionError(f"unknown method {m}")


def run(cmd, want_rc=0):
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if p.returncode != want_rc:
        raise AssertionError(f"{' '.join(cmd)}: exit {p.returncode}, expected {want_rc}:\n{p.stdout}")
    return p.stdout


def check(results, tool):
    for e in results:
        where = f"{tool} {e['method']} {e['grid']} B={e['B']} H={e['H']} L={e['L']}"
        dense_eq, effective, stages = expected(e)
        assert e["flops_dense_equivalent"] == dense_eq, f"{where}: dense-equivalent {e['flops_dense_equivalent']} != {dense_eq}"
        assert e["flops_effective"] == effective, f"{where}: effective {e['flops_effective']} != {effective}"
        io = 4 * e["B"] * e["H"] * e["L"] * e["d"] * 2
        assert e["io_bytes"] == io, f"{where}: io bytes {e['io_bytes']} != {io}"
        if stages is None:
            assert e["bytes"] == io, f"{where}: SDPA bytes {e['bytes']} != io bytes {io}"
        else:
            assert e["stage_bytes"] == stages, f"{where}: stage bytes {e['stage_bytes']} != {stages}"
            assert e["bytes"] == sum(stages), f"{where}: bytes {e['bytes']} != {sum(stages)}"
        for k in ("ms", "tflops_dense_equivalent", "tflops_effective", "gbps"):
            assert e[k] is None, f"{where}: {k} = {e[k]} in a dry run"


def main():
    bench, work = sys.argv[1], sys.argv[2]
    os.makedirs(work, exist_ok=True)
    bj, bm = os.path.join(work, "bench.json"), os.path.join(work, "bench.md")
    sj, sm = os.path.join(work, "sdpa.json"), os.path.join(work, "sdpa.md")
    run([bench, "--dry-run", "--grid", "all", "--json", bj, "--markdown", bm])
    run([sys.executable, SDPA, "--dry-run", "--grid", "all", "--json", sj, "--markdown", sm])
    with open(bj) as f:
        b = json.load(f)
    with open(sj) as f:
        s = json.load(f)
    assert b["dry_run"] is True and s["dry_run"] is True
    for key in ("flops", "bytes", "time"):
        assert key in b["conventions"], f"bench.json conventions lack '{key}'"
    check(b["results"], "dfss_bench_cuda")
    check(s["results"], "sdpa_backends")
    shape = lambda e: (e["grid"], e["B"], e["H"], e["L"], e["d"], e["key_padding"])  # noqa: E731
    b_shapes, s_shapes = sorted({shape(e) for e in b["results"]}), sorted({shape(e) for e in s["results"]})
    assert b_shapes == s_shapes, f"the two grids differ:\n{b_shapes}\n{s_shapes}"
    assert len(b_shapes) == 6, f"expected the 6 shapes of --grid all, got {len(b_shapes)}"
    assert len(b["results"]) == 5 * 6 and len(s["results"]) == 5 * 6
    for path, n in ((bm, len(b["results"])), (sm, len(s["results"]))):
        with open(path) as f:
            rows = [line for line in f if line.startswith("| ") and not line.startswith("| grid")]
        assert len(rows) == n, f"{path}: {len(rows)} rows, expected {n}"
    run([bench, "--dry-run", "--iters", "0"], want_rc=2)
    run([bench, "--dry-run", "--grid", "bogus"], want_rc=2)
    run([bench, "--dry-run", "--warmup", "x"], want_rc=2)
    print(f"dfss_bench_cuda and sdpa_backends dry runs: {len(b['results'])} + {len(s['results'])} results, "
          "counts as documented")
    return 0


if __name__ == "__main__":
    sys.exit(main())
