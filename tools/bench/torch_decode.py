#!/usr/bin/env python3
"""PyTorch 2.x peer of `dfss bench --decode`: one decode step of SDPA against a KV cache on the CPU.

`dfss bench --decode` runs this script with --serve (torch 2.x interpreter of --python, the thread
variables OMP_NUM_THREADS / OPENBLAS_NUM_THREADS / MKL_NUM_THREADS set in the environment) as a
co-process: it sets up each configuration when told and times one call per request, so that SDPA's
calls are timed round-robin with the dfss rows and the memory sweep of the same configuration
(serve()). Without --serve it times every configuration in turn and prints one line
"DFSS_TORCH_JSON {...}" with all the rows (for use by hand).

Per (cache length Lk, heads H:Hkv, cache dtype): q [B, H, Lq, d], k and v [B, Hkv, Lk, d] contiguous
(Hugging Face's KV cache layout; dfss reads the same layout through strided views), or with
--cache-layout blhd [B, Lk, Hkv, d] memory (dfss's and flash-attn's layout) that SDPA gets as
transposed views, standard normal,
F.scaled_dot_product_attention(q, k, v, enable_gqa=True) under torch.inference_mode. SDPA aligns
is_causal top-left, dfss bottom-right: for Lq = 1 the causal mask is a no-op and SDPA gets
is_causal=False; for Lq > 1 (speculative drafts) it gets the bottom-right mask as an explicit boolean
attn_mask. Timing: 2 untimed calls, then --iters timed calls (one per request with --serve) (time.perf_counter), each after a read
of 128 MiB elsewhere that empties the CPU's caches (as dfss bench does before each of its calls: a
decode step reads the cache from memory), median, min, max in ms. The error column is the max abs difference to float64 of the same math on the same (rounded)
inputs. kv_bytes = the dense K + V bytes (GB/s = kv_bytes / time, as dfss bench computes it).
"""
import argparse
import math
import platform
import statistics
import sys
import time

from torch_serve import emit, hand_off, serve_requests

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
    ap.add_argument("--serve", action="store_true",
                    help="answer dfss bench --decode's requests on standard input (see serve())")
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
    if args.serve:
        return serve(args, info, torch, F)
    gen = torch.Generator().manual_seed(args.seed)
    results = []
    flush = torch.ones(32 << 20, dtype=torch.float32)  # 128 MiB, dfss bench's kFlushBytes
    with torch.inference_mode():
        for Lk in [int(x) for x in args.lengths.split(",") if x]:
            for hh in [x for x in args.heads.split(",") if x]:
                H, Hkv = (int(x) for x in hh.split(":"))
                for name in [x for x in args.dtypes.split(",") if x]:
                    row = {"Lk": Lk, "H": H, "Hkv": Hkv, "dtype": name}
                    try:
                        case = Case(torch, F, args, Lk, H, Hkv, name, gen)
                        row.update(case.row)
                        ms = [case.timed(flush) for _ in range(args.iters)]
                        row.update({"ms_median": statistics.median(ms), "ms_min": min(ms), "ms_max": max(ms),
                                    "iters": len(ms), "max_err": case.max_err()})
                        del case
                    except Exception as e:  # noqa: BLE001 - report, keep going
                        row["error"] = "%s: %s" % (type(e).__name__, e)
                    results.append(row)
    info["results"] = results
    emit(info)
    return 0


class Case:
    """One configuration's SDPA step: q [B, H, Lq, d] and the cache (standard normal from @p gen) in
    --cache-layout memory, the bottom-right causal mask for Lq > 1, two untimed calls."""

    def __init__(self, torch, F, args, Lk, H, Hkv, name, gen, shared=None):
        dt = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[name]
        B, Lq, d = args.batch, args.query_rows, args.head_dim
        self.torch, self.F, self.H, self.Hkv, self.Lk = torch, F, H, Hkv, Lk
        self.scale = 1.0 / math.sqrt(d)
        self.ref_max_keys = args.ref_max_keys
        self.mask = None
        if Lq > 1:  # bottom-right causal: query i sees keys j <= i + Lk - Lq
            self.mask = torch.ones(Lq, Lk, dtype=torch.bool).tril(diagonal=Lk - Lq)
        cache_shape = (B, Lk, Hkv, d) if args.cache_layout == "blhd" else (B, Hkv, Lk, d)
        if shared is not None:
            # dfss bench's own q ([B, Lq, H, d]), K and V, mapped from its memory (shared_cache).
            n_q, n_kv = B * Lq * H * d, B * Hkv * Lk * d
            size = dt.itemsize if hasattr(dt, "itemsize") else torch.tensor([], dtype=dt).element_size()
            raw = torch.from_file(shared["file"], shared=True, size=shared["out"] + n_q * 4, dtype=torch.uint8)
            self.shared_out = raw[shared["out"]:shared["out"] + n_q * 4].view(torch.float32).view(B, Lq, H, d)

            def part(at, n, shape):
                return raw[at:at + n * size].view(dt).view(shape)
            self.q = part(shared["q"], n_q, (B, Lq, H, d)).transpose(1, 2)
            self.k = part(shared["k"], n_kv, cache_shape)
            self.v = part(shared["v"], n_kv, cache_shape)
        else:
            self.shared_out = None
            self.q = torch.randn(B, H, Lq, d, generator=gen).to(dt)
            self.k = torch.randn(*cache_shape, generator=gen).to(dt)
            self.v = torch.randn(*cache_shape, generator=gen).to(dt)
        if args.cache_layout == "blhd":
            self.k, self.v = self.k.transpose(1, 2), self.v.transpose(1, 2)
        self.row = {"Lq": Lq, "B": B, "d": d, "kv_bytes": 2 * self.k.numel() * self.k.element_size(),
                    "method": "sdpa enable_gqa" + (" bottom-right mask" if self.mask is not None else "") +
                    (", same memory" if shared is not None else "")}
        self.out = self.step()
        self.out = self.step()

    def step(self):
        with self.torch.inference_mode():
            return self.F.scaled_dot_product_attention(self.q, self.k, self.v, attn_mask=self.mask, is_causal=False,
                                                       enable_gqa=True)

    def timed(self, flush):
        """One timed call (ms) after a read of @p flush, which empties the CPU's caches."""
        flush.sum()
        t0 = time.perf_counter()
        self.out = self.step()
        return (time.perf_counter() - t0) * 1e3

    def max_err(self):
        """Max |out - float64 of the same math on the same rounded inputs|, or None past --ref-max-keys."""
        if self.Lk > self.ref_max_keys:
            return None
        torch = self.torch
        g = self.H // self.Hkv
        kd = self.k.double().repeat_interleave(g, dim=1)
        vd = self.v.double().repeat_interleave(g, dim=1)
        s = torch.matmul(self.q.double(), kd.transpose(-1, -2)) * self.scale
        if self.mask is not None:
            s = s.masked_fill(~self.mask, float("-inf"))
        ref = torch.softmax(s, dim=-1) @ vd
        return float((self.out.double() - ref).abs().max())


def serve(args, info, torch, F):
    """--serve: dfss bench --decode's co-process. Prints the info line, then answers one request per
    line of standard input (JSON), one DFSS_TORCH_JSON line each, until end of input:
      {"cmd": "setup", "Lk", "H", "Hkv", "dtype"[, "shared": {"file", "q", "k", "v"}]} -> the row's
          fields, or {"error"}; with "shared" q ([B, Lq, H, d]), K and V are read from that file
          (dfss bench's memory) at those byte offsets, otherwise drawn here
      {"cmd": "time"} -> {"ms"}: one timed call of the configuration set up last
      {"cmd": "check"} -> {"max_err"} (null past --ref-max-keys), and with "shared" the output
          written there at byte offset "out" (fp32 [B, Lq, H, d]) and "wrote_out": true
      {"cmd": "free"} -> {} (the configuration's tensors released)
    Before a timed call it keeps torch's threads busy for 20 ms (torch_serve.hand_off). The first
    line, the info, carries "serving": true."""
    flush = torch.ones(32 << 20, dtype=torch.float32)  # 128 MiB, dfss bench's kFlushBytes
    state = {"case": None}

    def handle(req):
        cmd = req.get("cmd")
        case = state["case"]
        if cmd == "setup":
            state["case"] = None
            gen = torch.Generator().manual_seed(args.seed + req["Lk"] * 131 + req["Hkv"])
            state["case"] = Case(torch, F, args, req["Lk"], req["H"], req["Hkv"], req["dtype"], gen, req.get("shared"))
            return state["case"].row
        if cmd in ("time", "check") and case is None:
            return {"error": "no configuration set up"}
        if cmd == "time":
            hand_off(torch)
            return {"ms": case.timed(flush)}
        if cmd == "check":
            answer = {"max_err": case.max_err()}
            if case.shared_out is not None:  # the output for dfss bench's own fp64 reference
                case.shared_out.copy_(case.out.transpose(1, 2))
                answer["wrote_out"] = True
            return answer
        if cmd == "free":
            state["case"] = None
            return {}
        return {"error": "unknown request %r" % (cmd,)}

    return serve_requests(info, handle)

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
