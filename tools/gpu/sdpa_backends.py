#!/usr/bin/env python3
"""PyTorch SDPA with each backend forced (flash, memory-efficient, cuDNN, math) on the grid of
dfss_bench_cuda (tools/bench/cuda_sdpa.py's shapes): the peers dfss is compared against, each on
its own, since unforced SDPA picks one by shape and mask. A backend that refuses a shape prints the
reason instead of a time. Times: CUDA events, `warmup` untimed calls, median of `iters`.

Usage: python3 tools/gpu/sdpa_backends.py [--grid artifact|bert|all|smoke] [--warmup N] [--iters N]
Prints one line per (backend, shape): "sdpa[<backend>] <grid> B=.. H=.. L=.. d=.. pad=.. | <ms> ms".
"""
import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
from cuda_sdpa import shapes  # noqa: E402  (the same grid as dfss_bench_cuda)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--grid", default="all", choices=["artifact", "bert", "all", "smoke"])
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args()
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if not torch.cuda.is_available():
        print("sdpa: no CUDA device visible to PyTorch; skipped")
        return 77
    print(f"sdpa: torch {torch.__version__}, {torch.cuda.get_device_name(0)}")
    backends = [("flash", SDPBackend.FLASH_ATTENTION), ("efficient", SDPBackend.EFFICIENT_ATTENTION),
                ("cudnn", SDPBackend.CUDNN_ATTENTION), ("math", SDPBackend.MATH)]
    gen = torch.Generator(device="cuda").manual_seed(0)
    for grid, B, H, L, d, pad in shapes(args.grid):
        q, k, v = (torch.randn(B, H, L, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
        mask = None
        if pad:
            lens = torch.randint(L // 2, L + 1, (B,), device="cuda", generator=gen)
            mask = (torch.arange(L, device="cuda")[None, :] < lens[:, None])[:, None, None, :]
        for name, be in backends:
            label = f"sdpa[{name}] {grid} B={B} H={H} L={L} d={d} pad={int(pad)}"
            try:
                with sdpa_kernel(be):
                    for _ in range(args.warmup):
                        F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
                    times = []
                    for _ in range(args.iters):
                        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                        s.record()
                        F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
                        e.record()
                        e.synchronize()
                        times.append(s.elapsed_time(e))
                print(f"{label} | {statistics.median(times):.4f} ms", flush=True)
            except RuntimeError as err:
                reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
                print(f"{label} | unsupported: {reason[:160]}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
