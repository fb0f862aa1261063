#!/usr/bin/env python3
"""PyTorch SDPA on the GPU for the grid of dfss_bench_cuda, unforced; its shapes() is that grid for
tools/gpu/sdpa_backends.py, which times every backend forced (what tools/gpu-check.sh and
tools/gpu/device-run.sh run).

Times torch.nn.functional.scaled_dot_product_attention (whatever backend PyTorch picks: flash,
memory-efficient or cuDNN) on bf16 [B, H, L, d] CUDA tensors with CUDA events: `warmup` untimed
calls, then `iters` timed calls, median in milliseconds. BERT shapes use a boolean key-padding mask
[B, 1, 1, L] with the same length distribution as dfss_bench_cuda ([L/2, L]); note that a mask can
make PyTorch choose a different (slower) SDPA backend than the unmasked artifact shapes.

Usage: python3 tools/bench/cuda_sdpa.py [--grid artifact|bert|all|smoke] [--warmup N] [--iters N]
Prints one line per shape: "sdpa <grid> B=.. H=.. L=.. d=.. pad=.. | <median> ms".
"""
import argparse
import statistics
import sys


def shapes(grid):
    out = []
    if grid == "smoke":
        out.append(("smoke", 2, 4, 256, 64, True))
    if grid in ("artifact", "all"):
        for L in (256, 512, 1024, 2048, 4096):
            out.append(("artifact", 24 if L == 4096 else 48, 4, L, 64, False))
    if grid in ("bert", "all"):
        out.append(("bert", 32, 16, 384, 64, True))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--grid", default="all", choices=["artifact", "bert", "all", "smoke"])
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--iters", type=int, default=30)
    args = ap.parse_args()
    try:
        import torch
        import torch.nn.functional as F
    except ImportError as e:
        print(f"sdpa: PyTorch is not importable ({e}); skipped")
        return 0
    if not torch.cuda.is_available():
        print("sdpa: torch.cuda.is_available() is False; skipped")
        return 0
    print(f"sdpa: torch {torch.__version__}, device {torch.cuda.get_device_name(0)}")
    gen = torch.Generator(device="cuda").manual_seed(42)
    for grid, B, H, L, d, pad in shapes(args.grid):
        q, k, v = (torch.randn(B, H, L, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
        mask = None
        if pad:
            lens = torch.randint(L // 2, L + 1, (B,), device="cuda", generator=gen)
            mask = (torch.arange(L, device="cuda")[None, :] < lens[:, None])[:, None, None, :]
        with torch.inference_mode():
            for _ in range(args.warmup):
                F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            times = []
            for _ in range(args.iters):
                a = torch.cuda.Event(enable_timing=True)
                b = torch.cuda.Event(enable_timing=True)
                a.record()
                F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
                b.record()
                b.synchronize()
                times.append(a.elapsed_time(b))
        print(f"sdpa {grid:<8} B={B:<3} H={H:<2} L={L:<5} d={d} pad={int(pad)} | {statistics.median(times):7.3f} ms")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
