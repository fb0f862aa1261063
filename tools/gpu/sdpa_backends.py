#!/usr/bin/env python3
"""PyTorch SDPA with each backend forced (flash, memory-efficient, cuDNN, math) and unforced, in one
run, on the grid of dfss_bench_cuda (tools/bench/cuda_sdpa.py's shapes, the same as
bench/cuda/bench_metrics.hpp's): the peers dfss is compared against, each on its own, since
unforced SDPA picks one by shape and mask. A backend that refuses a shape prints the reason instead
of a time.

Inputs: bf16 [B, H, L, d] CUDA tensors, scale 1/sqrt(d) (SDPA's default, as dfss_bench_cuda's),
no mask on the artifact shapes, a boolean key-padding mask [B, 1, 1, L] with lengths drawn from
[L/2, L] on the bert shapes (as dfss_bench_cuda's key lengths). Times: CUDA events around each
call, synchronised per call, `warmup` untimed calls, median of `iters` (dfss_bench_cuda's method).
Counts (dfss_bench_cuda's conventions, docs/gpu-results.md): dense-equivalent FLOPs 4 B H L^2 d,
which is also what every SDPA backend computes (effective = dense-equivalent; masks not
subtracted); bytes = io bytes, Q, K, V read once and O written once (the fused backends' traffic
floor; the math backend moves far more).

Usage: python3 tools/gpu/sdpa_backends.py [--grid artifact|bert|all|smoke] [--warmup N] [--iters N]
                                          [--json FILE] [--markdown FILE] [--dry-run]
Prints one line per (backend, shape): "sdpa[<backend>] <grid> B=.. H=.. L=.. d=.. pad=.. | <ms> ms | ...".
--dry-run: no torch import; prints the shapes and counts and writes the JSON / markdown with null times.
"""
import argparse
import contextlib
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
from cuda_sdpa import shapes  # noqa: E402  (the same grid as dfss_bench_cuda)

BACKENDS = ["flash", "efficient", "cudnn", "math", "default"]
ELEM_BYTES = 2  # bf16


def counts(B, H, L, d):
    """Dense-equivalent (= effective) FLOPs and io bytes of one shape."""
    flops = 4 * B * H * L * L * d
    io_bytes = 4 * B * H * L * d * ELEM_BYTES
    return flops, io_bytes


def entry(grid, B, H, L, d, pad, backend, ms, reason=None):
    flops, io_bytes = counts(B, H, L, d)
    e = {"grid": grid, "B": B, "H": H, "L": L, "d": d, "key_padding": bool(pad), "method": f"sdpa_{backend}",
         "flops_dense_equivalent": flops, "flops_effective": flops, "bytes": io_bytes, "io_bytes": io_bytes,
         "ms": ms, "tflops_dense_equivalent": None, "tflops_effective": None, "gbps": None}
    if ms is not None:
        e["tflops_dense_equivalent"] = e["tflops_effective"] = flops / (ms * 1e-3) / 1e12
        e["gbps"] = io_bytes / (ms * 1e-3) / 1e9
    if reason is not None:
        e["unsupported"] = reason
    return e


def markdown(results, device, args):
    lines = [f"PyTorch SDPA on {device}, median of {args.iters} iterations after {args.warmup} warm-up", "",
             "| grid | B | H | L | d | pad | method | ms (median) | TFLOP/s dense-eq. | GB/s (io) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for e in results:
        if e["ms"] is None:
            reason = e.get("unsupported", "-").replace("|", "/")
            tail = f"{reason} | - | - |"
        else:
            tail = f"{e['ms']:.4f} | {e['tflops_dense_equivalent']:.1f} | {e['gbps']:.0f} |"
        lines.append(f"| {e['grid']} | {e['B']} | {e['H']} | {e['L']} | {e['d']} | {int(e['key_padding'])} | "
                     f"{e['method']} | {tail}")
    return "\n".join(lines) + "\n"


def write_outputs(results, device, args):
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"tool": "sdpa_backends", "device": device, "dry_run": args.dry_run, "warmup": args.warmup,
                       "iters": args.iters, "results": results}, f, indent=1)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(markdown(results, device, args))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--grid", default="all", choices=["artifact", "bert", "all", "smoke"])
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--json", help="write the results as JSON here")
    ap.add_argument("--markdown", help="write the results as a markdown table here")
    ap.add_argument("--dry-run", action="store_true", help="no GPU, no torch: counts only, null times")
    args = ap.parse_args()
    if args.iters < 1 or args.warmup < 0:
        ap.error(f"--iters must be >= 1 and --warmup >= 0, got {args.iters} and {args.warmup}")
    results = []
    if args.dry_run:
        for grid, B, H, L, d, pad in shapes(args.grid):
            flops, io_bytes = counts(B, H, L, d)
            print(f"{grid} B={B} H={H} L={L} d={d} pad={int(pad)}: {flops / 1e9:.3g} GFLOP, io {io_bytes / 1e6:.3g} MB")
            results += [entry(grid, B, H, L, d, pad, name, None) for name in BACKENDS]
        write_outputs(results, "none (dry run)", args)
        return 0

    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if not torch.cuda.is_available():
        print("sdpa: no CUDA device visible to PyTorch; skipped")
        return 77
    device = torch.cuda.get_device_name(0)
    print(f"sdpa: torch {torch.__version__}, {device}")
    forced = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
              "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}
    gen = torch.Generator(device="cuda").manual_seed(0)
    for grid, B, H, L, d, pad in shapes(args.grid):
        q, k, v = (torch.randn(B, H, L, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
        mask = None
        if pad:
            lens = torch.randint(L // 2, L + 1, (B,), device="cuda", generator=gen)
            mask = (torch.arange(L, device="cuda")[None, :] < lens[:, None])[:, None, None, :]
        for name in BACKENDS:
            label = f"sdpa[{name}] {grid} B={B} H={H} L={L} d={d} pad={int(pad)}"
            try:
                with torch.inference_mode(), (sdpa_kernel(forced[name]) if name in forced else contextlib.nullcontext()):
                    for _ in range(args.warmup):
                        F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
                    torch.cuda.synchronize()
                    times = []
                    for _ in range(args.iters):
                        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                        s.record()
                        F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
                        e.record()
                        e.synchronize()
                        times.append(s.elapsed_time(e))
                ms = statistics.median(times)
                r = entry(grid, B, H, L, d, pad, name, ms)
                print(f"{label} | {ms:.4f} ms | {r['tflops_dense_equivalent']:.1f} TFLOP/s | {r['gbps']:.0f} GB/s (io)",
                      flush=True)
            except RuntimeError as err:
                reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
                r = entry(grid, B, H, L, d, pad, name, None, reason[:160])
                print(f"{label} | unsupported: {reason[:160]}", flush=True)
            results.append(r)
        del q, k, v, mask
        torch.cuda.empty_cache()
    write_outputs(results, device, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
