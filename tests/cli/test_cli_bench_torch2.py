#!/usr/bin/env python3
"""`dfss bench` against the real PyTorch 2.x peer scripts (tools/bench/torch_attention.py and
torch_decode.py with --serve), the way a benchmark run uses them: tiny shapes, seconds.

test_cli_bench.py checks the columns against stubs of the scripts; this checks that the scripts
themselves serve: every torch row of a causal forward (fp32 bmm and SDPA, bf16 SDPA) and of a
decode step (MHA and GQA, fp32 and bf16; SDPA on the bench's own memory of q, K and V, its output
checked against dfss's fp64 reference) is measured with a small error, and the notes say the peer
was timed round-robin.

The torch 2.x venv is tools/scripts/torch2-venv.sh's (DFSS_TORCH2_VENV, default
~/.cache/dfss/torch2-venv; .ci/run makes it). Without it: skipped (exit 77, reason printed), or a
failure with DFSS_REQUIRE_PYTHON_TESTS=1 (CI).

Usage: test_cli_bench_torch2.py DFSS_EXE
"""
import json
import os
import subprocess
import sys
import tempfile

from checks import check, finish  # tests/cli/checks.py, beside this script


def main():
    exe = sys.argv[1]
    venv = os.environ.get("DFSS_TORCH2_VENV") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "dfss", "torch2-venv")
    py = os.path.join(venv, "bin", "python")
    probe = subprocess.run([py, "-c", "import torch; print(torch.__version__)"], capture_output=True, text=True) \
        if os.access(py, os.X_OK) else None
    if probe is None or probe.returncode != 0:
        print("SKIP: no torch 2.x venv at %s (tools/scripts/torch2-venv.sh makes it)" % venv)
        return 1 if os.environ.get("DFSS_REQUIRE_PYTHON_TESTS") == "1" else 77
    version = probe.stdout.strip()
    tmp = tempfile.mkdtemp(prefix="dfss_cli_bench_torch2_")

    # Forward, causal, bf16 inputs: fp32 bmm and SDPA, and SDPA in bf16, per length.
    out = os.path.join(tmp, "forward.json")
    p = subprocess.run([exe, "bench", "--lengths", "64,100", "--heads", "2", "--iters", "2", "--warmup", "1",
                        "--algorithms", "fused", "--patterns", "dense,2:4", "--dtype", "bf16", "--causal",
                        "--no-sgemm", "--threads", "2", "--python", py, "--json", out],
                       capture_output=True, text=True, timeout=300)
    check(p.returncode == 0, "forward: exit status 0 (got %d: %s)" % (p.returncode, p.stderr[-500:]))
    if p.returncode == 0:
        check("timed round-robin with the dfss rows" in p.stdout, "forward: the notes say torch %s is served" % version)
        rows = [r for r in json.load(open(out))["rows"] if r["source"] == "torch"]
        got = sorted((r["L"], r["dtype"], r["algorithm"].split()[-1]) for r in rows)
        want = sorted((L, dt, m) for L in (64, 100) for dt, m in (("fp32", "bmm+softmax+bmm"), ("fp32", "sdpa"),
                                                                 ("bf16", "sdpa")))
        check(got == want, "forward: one torch row per length and entry (got %r)" % (got,))
        for r in rows:
            # fp32: fp32 sums of a few hundred terms. bf16: SDPA rounds P and O to bf16 (half an ulp
            # of |O| < 2 is 2^-8), inputs the same rounded values as the reference's.
            tol = 1e-5 if r["dtype"] == "fp32" else 8e-3
            check(r["ok"] and r["iters"] == 2 and r["max_err"] is not None and r["max_err"] < tol,
                  "forward: L=%d %s %s measured, error %r < %g" % (r["L"], r["dtype"], r["algorithm"],
                                                                   r.get("max_err"), tol))
        dfss = [r for r in json.load(open(out))["rows"] if r["source"] == "dfss" and r["ok"]]
        check(dfss and all(r["speedup_vs_sdpa"] is not None for r in dfss), "forward: every dfss row has vs SDPA")

    # Decode: MHA and GQA, fp32 and bf16 caches, one query row and three (the bottom-right mask).
    for rows_q in (1, 3):
        out = os.path.join(tmp, "decode%d.json" % rows_q)
        p = subprocess.run([exe, "bench", "--decode", "--lengths", "300", "--decode-heads", "4:4,4:2",
                            "--decode-dtypes", "f32,bf16", "--patterns", "dense", "--query-rows", str(rows_q),
                            "--iters", "2", "--threads", "2", "--python", py, "--json", out],
                           capture_output=True, text=True, timeout=300)
        what = "decode Lq=%d" % rows_q
        check(p.returncode == 0, "%s: exit status 0 (got %d: %s)" % (what, p.returncode, p.stderr[-500:]))
        if p.returncode != 0:
            continue
        check("timed round-robin with the dfss rows" in p.stdout, "%s: the notes say SDPA is served" % what)
        rows = json.load(open(out))["rows"]
        sdpa = [r for r in rows if r["row"].endswith(" sdpa")]
        check(len(sdpa) == 4, "%s: one SDPA row per configuration (got %d)" % (what, len(sdpa)))
        for r in sdpa:
            # Against dfss's dense fp64 reference of the same q, K and V (SDPA's output left in the
            # shared memory): a wrong offset, layout or head mapping there is far off. Tolerances as
            # the forward's.
            tol = 1e-5 if r["cache"] == "f32" else 8e-3
            check(r["ok"] and r["iters"] == 2 and r["max_err"] is not None and r["max_err"] < tol and
                  r["kernel"].endswith(", same memory"),
                  "%s: %d:%d %s measured on the bench's memory, error %r < %g (kernel %r)"
                  % (what, r["H"], r["Hkv"], r["cache"], r.get("max_err"), tol, r["kernel"]))
        dense = [r for r in rows if r["row"] == "dfss dense"]
        check(dense and all(r["vs_sdpa"] is not None for r in dense), "%s: every dfss row has vs SDPA" % what)

    return finish()


if __name__ == "__main__":
    sys.exit(main())
