#!/usr/bin/env python3
"""PyTorch peer of `dfss bench`: times dense attention in PyTorch on the CPU, fp32.

`dfss bench` runs this script once per Python interpreter that can import torch (and, for torch 1.x,
once more with the "tuned" environment of shared/reference/cpu-baselines.md), with the thread
variables OMP_NUM_THREADS / OPENBLAS_NUM_THREADS / MKL_NUM_THREADS already set in the environment.
It prints one line "DFSS_TORCH_JSON {...}" that dfss bench parses; everything else it prints is
informational.

Methods (both non-causal, no mask, scale 1/sqrt(d), under torch.inference_mode / no_grad):
  bmm   q, k, v as [B*H, L, d]: S = bmm(q, k^T); S *= scale; P = softmax(S, -1); O = bmm(P, v)
  sdpa  q, k, v as [B, H, L, d]: torch.nn.functional.scaled_dot_product_attention (torch >= 2.0),
        or the private F._scaled_dot_product_attention of torch 1.13 (labelled "sdpa-private").

Timing: `warmup` untimed calls, then up to `iters` timed calls (time.perf_counter), median, min and
max in milliseconds; when one call is slow, the number of calls is reduced so that a configuration
takes about `budget` seconds (never fewer than 3 timed calls), as dfss bench does for its own rows.
The error column is the max abs difference to the same method computed in float64 on the first
`ref_rows` query rows of every head.

Usage (normally invoked by dfss bench):
  OMP_NUM_THREADS=2 OPENBLAS_NUM_THREADS=2 MKL_NUM_THREADS=2 \
      python3 tools/bench/torch_attention.py --lengths 512,1024 --threads 2
  python3 tools/bench/torch_attention.py --probe      # version information only
"""
import argparse
import json
import math
import os
import platform
import statistics
import sys
import time

PREFIX = "DFSS_TORCH_JSON "


def emit(obj):
    sys.stdout.write(PREFIX + json.dumps(obj) + "\n")
    sys.stdout.flush()


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--probe", action="store_true", help="print version information and exit")
    ap.add_argument("--lengths", default="512,1024,2048,4096")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--iters", type=int, default=7)
    ap.add_argument("--budget", type=float, default=20.0, help="seconds per configuration (soft)")
    ap.add_argument("--seed", type=int, default=2023)
    ap.add_argument("--ref-rows", type=int, default=32)
    ap.add_argument("--methods", default="bmm,sdpa")
    return ap.parse_args(argv)


def env_info():
    keys = ["OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "OMP_WAIT_POLICY",
            "GLIBC_TUNABLES"]
    return {k: os.environ.get(k) for k in keys if os.environ.get(k) is not None}


def main(argv):
    args = parse_args(argv)
    info = {"python": sys.executable, "python_version": platform.python_version(), "env": env_info()}
    try:
        import torch
        import torch.nn.functional as F
    except Exception as e:  # noqa: BLE001 - any import failure means "no torch here"
        info["error"] = "cannot import torch: %s" % (e,)
        emit(info)
        return 0
    info["torch_version"] = torch.__version__
    if hasattr(F, "scaled_dot_product_attention"):
        info["sdpa"] = "public"
    elif hasattr(F, "_scaled_dot_product_attention"):
        info["sdpa"] = "private"
    else:
        info["sdpa"] = None
    if args.probe:
        emit(info)
        return 0

    torch.set_num_threads(args.threads)
    info["torch_threads"] = torch.get_num_threads()
    gen = torch.Generator().manual_seed(args.seed)
    lengths = [int(x) for x in args.lengths.split(",") if x]
    methods = [m for m in args.methods.split(",") if m]
    B, H, d = args.batch, args.heads, args.head_dim
    scale = 1.0 / math.sqrt(d)

    def bmm_attention(q, k, v):  # [B*H, L, d]
        s = torch.bmm(q, k.transpose(1, 2))
        s.mul_(scale)
        p = torch.softmax(s, dim=-1)
        return torch.bmm(p, v)

    if info["sdpa"] == "public":
        def sdpa(q, k, v):  # [B, H, L, d]
            return F.scaled_dot_product_attention(q, k, v)
        sdpa_label = "sdpa"
    elif info["sdpa"] == "private":
        def sdpa(q, k, v):
            return F._scaled_dot_product_attention(q, k, v, None, 0.0, False, False)[0]
        sdpa_label = "sdpa-private"
    else:
        sdpa = None
        sdpa_label = "sdpa"

    results = []
    with torch.inference_mode():
        for L in lengths:
            q = torch.randn(B, H, L, d, generator=gen, dtype=torch.float32)
            k = torch.randn(B, H, L, d, generator=gen, dtype=torch.float32)
            v = torch.randn(B, H, L, d, generator=gen, dtype=torch.float32)
            R = min(args.ref_rows, L)
            for method in methods:
                row = {"B": B, "H": H, "L": L, "d": d}
                if method == "bmm":
                    row["method"] = "bmm+softmax+bmm"
                    fn = bmm_attention
                    inputs = (q.reshape(B * H, L, d), k.reshape(B * H, L, d), v.reshape(B * H, L, d))
                elif method == "sdpa":
                    row["method"] = sdpa_label
                    if sdpa is None:
                        row["error"] = "torch %s has no scaled_dot_product_attention" % torch.__version__
                        results.append(row)
                        continue
                    fn = sdpa
                    inputs = (q, k, v)
                else:
                    row["method"] = method
                    row["error"] = "unknown method"
                    results.append(row)
                    continue
                try:
                    t0 = time.perf_counter()
                    out = fn(*inputs)
                    first = time.perf_counter() - t0
                    warmup = args.warmup if first < 1.0 else 1
                    for _ in range(warmup - 1):
                        out = fn(*inputs)
                    iters = args.iters
                    if first * iters > args.budget:
                        iters = max(3, int(args.budget / max(first, 1e-9)))
                    ms = []
                    for _ in range(iters):
                        t0 = time.perf_counter()
                        out = fn(*inputs)
                        ms.append((time.perf_counter() - t0) * 1e3)
                    # Error on the first R query rows of every head, against float64 of the same math.
                    qd, kd, vd = q[:, :, :R].double(), k.double(), v.double()
                    ref = torch.softmax(torch.matmul(qd, kd.transpose(-1, -2)) * scale, dim=-1) @ vd
                    got = out.reshape(B, H, L, d)[:, :, :R].double()
                    row.update({
                        "ms_median": statistics.median(ms), "ms_min": min(ms), "ms_max": max(ms),
                        "iters": iters, "max_err": float((got - ref).abs().max()),
                    })
                    del out
                except Exception as e:  # noqa: BLE001 - report, keep going
                    row["error"] = "%s: %s" % (type(e).__name__, e)
                results.append(row)
    info["results"] = results
    emit(info)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
