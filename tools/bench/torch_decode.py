#!/usr/bin/env python3
"""PyTorch 2.x peer of `dfss bench --decode`: one decode step of SDPA against a KV cache on the CPU.

`dfss bench --decode` runs this script once (torch 2.x interpreter of --python) with the thread
variables OMP_NUM_THREADS / OPENBLAS_NUM_THREADS / MKL_NUM_THREADS set in the environment. It prints
one line "DFSS_TORCH_JSON {...}" that dfss bench parses.

Per (cache length Lk, heads H:Hkv, cache dtype): q [B, H, Lq, d], k and v [B, Hkv, Lk, d] contiguous
(Hugging Face's KV cache layout; dfss reads the same layout through strided views), or with
--cache-layout blhd [B, Lk, Hkv, d] memory (dfss's and flash-attn's layout) that SDPA gets as
transposed views, standard normal,
F.scaled_dot_product_attention(q, k, v, enable_gqa=True) under torch.inference_mode. SDPA aligns
is_causal top-left, dfss bottom-right: for Lq = 1 the causal mask is a no-op and SDPA gets
is_causal=False; for Lq > 1 (speculative drafts) it gets the bottom-right mask as an explicit boolean
attn_mask. Timing: 2 untimed calls, then --iters timed calls (time.perf_counter), each after a read
of 128 MiB elsewhere that empties the CPU's caches (as dfss bench does before each of its calls: a
decode step reads the cache from memory), median, min, max in ms. The error column is the max abs difference to float64 of the same math on the same (rounded)
inputs. kv_bytes = the dense K + V bytes (GB/s = kv_bytes / time, as dfss bench computes it).
"""
import argparse
import json
import math
import platform
import statistics
import sys
import time

PREFIX = "DFSS_TORCH_JSON "


def emit(obj):
    def finite(x):
        if isinstance(x, float) and not math.isfinite(x):
            return None
        if isinstance(x, dict):
            return {k: finite(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [finite(v) for v in x]
        return x
    sys.stdout.write(PREFIX + json.dumps(finite(obj), allow_nan=False) + "\n")
    sys.stdout.flush()


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", default="4096,16384,65536")
    ap.add_argument("--heads", default="32:32,32:8", help="H:Hkv pairs")
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--query-rows", type=int, default=1)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--iters", type=int, default=7)
    ap.add_argument("--seed", type=int, default=2023)
    ap.add_argument("--cache-layout", choices=["bhld", "blhd"], default="bhld")
    ap.add_argument("--ref-max-keys", type=int, default=16384,
                    help="the float64 error check only up to this cache length (its copy is 2x the fp32 cache, "
                         "and 4x for GQA after repeat_interleave)")
    args = ap.parse_args(argv)
    info = {"python": sys.executable, "python_version": platform.python_version()}
    try:
        import torch
        import torch.nn.functional as F
    except Exception as e:  # noqa: BLE001 - any import failure means "no torch here"
        info["error"] = "cannot import torch: %s" % (e,)
        emit(info)
        return 0
    info["torch_version"] = torch.__version__
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(args.seed)
    dtype_of = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    B, Lq, d = args.batch, args.query_rows, args.head_dim
    scale = 1.0 / math.sqrt(d)
    results = []
    flush = torch.ones(32 << 20, dtype=torch.float32)  # 128 MiB, dfss bench's kFlushBytes
    with torch.inference_mode():
        for Lk in [int(x) for x in args.lengths.split(",") if x]:
            mask = None
            if Lq > 1:  # bottom-right causal: query i sees keys j <= i + Lk - Lq
                mask = torch.ones(Lq, Lk, dtype=torch.bool).tril(diagonal=Lk - Lq)
            for hh in [x for x in args.heads.split(",") if x]:
                H, Hkv = (int(x) for x in hh.split(":"))
                for name in [x for x in args.dtypes.split(",") if x]:
                    dt = dtype_of[name]
                    row = {"Lk": Lk, "H": H, "Hkv": Hkv, "dtype": name, "Lq": Lq, "B": B, "d": d,
                           "method": "sdpa enable_gqa" + (" bottom-right mask" if mask is not None else "")}
                    try:
                        q = torch.randn(B, H, Lq, d, generator=gen).to(dt)
                        if args.cache_layout == "blhd":
                            k = torch.randn(B, Lk, Hkv, d, generator=gen).to(dt).transpose(1, 2)
                            v = torch.randn(B, Lk, Hkv, d, generator=gen).to(dt).transpose(1, 2)
                        else:
                            k = torch.randn(B, Hkv, Lk, d, generator=gen).to(dt)
                            v = torch.randn(B, Hkv, Lk, d, generator=gen).to(dt)
                        row["kv_bytes"] = 2 * k.numel() * k.element_size()

                        def step():
                            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=False,
                                                                  enable_gqa=True)
                        out = step()
                        out = step()
                        ms = []
                        for _ in range(args.iters):
                            flush.sum()
                            t0 = time.perf_counter()
                            out = step()
                            ms.append((time.perf_counter() - t0) * 1e3)
                        row.update({"ms_median": statistics.median(ms), "ms_min": min(ms), "ms_max": max(ms),
                                    "iters": len(ms), "max_err": None})
                        if Lk <= args.ref_max_keys:
                            g = H // Hkv
                            kd = k.double().repeat_interleave(g, dim=1)
                            vd = v.double().repeat_interleave(g, dim=1)
                            s = torch.matmul(q.double(), kd.transpose(-1, -2)) * scale
                            if mask is not None:
                                s = s.masked_fill(~mask, float("-inf"))
                            ref = torch.softmax(s, dim=-1) @ vd
                            row["max_err"] = float((out.double() - ref).abs().max())
                            del kd, vd, s, ref
                        del q, k, v, out
                    except Exception as e:  # noqa: BLE001 - report, keep going
                        row["error"] = "%s: %s" % (type(e).__name__, e)
                    results.append(row)
    info["results"] = results
    emit(info)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
