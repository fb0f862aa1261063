#!/usr/bin/env python3
"""PyTorch peer of `dfss bench`: times dense attention in PyTorch on the CPU (fp32, optionally bf16/fp16).

`dfss bench` runs this script once per Python interpreter that can import torch (and, for torch 1.x,
once more with the "tuned" environment of shared/reference/cpu-baselines.md), with the thread
variables OMP_NUM_THREADS / OPENBLAS_NUM_THREADS / MKL_NUM_THREADS already set in the environment.
It prints one line "DFSS_TORCH_JSON {...}" that dfss bench parses; everything else it prints is
informational. For the forward of a torch 2.x interpreter dfss bench runs it with --serve instead, as
a co-process whose calls are timed round-robin with the dfss rows of the same length (serve()).
It imports torch_serve.py from its own folder (installed beside it).

Methods (both non-causal, no mask, scale 1/sqrt(d), under torch.inference_mode / no_grad):
  bmm   q, k, v as [B*H, L, d]: S = bmm(q, k^T); S *= scale; P = softmax(S, -1); O = bmm(P, v)
  sdpa  q, k, v as [B, H, L, d]: torch.nn.functional.scaled_dot_product_attention (torch >= 2.0),
        or the private F._scaled_dot_product_attention of torch 1.13 (labelled "sdpa-private").

Timing: `warmup` untimed calls, then up to `iters` timed calls (time.perf_counter), median, min and
max in milliseconds; when one call is slow, the number of calls is reduced so that a configuration
takes about `budget` seconds (never fewer than 3 timed calls), as dfss bench does for its own rows.
The error column is the max abs difference to the same method computed in float64 on the first
`ref_rows` query rows of every head.

--dtypes fp32,bf16 (dfss bench --dtype bf16 passes it): every length is also timed with q, k, v (and
dO) rounded to the 16-bit type, for the methods of --low-precision-methods only (default sdpa: the
fair peer of a 16-bit dfss kernel; bmm + softmax + bmm in bf16 is not what anyone would run). The
inputs are the fp32 draws rounded, so the rows of each dtype see the same values up to rounding, and
the error is against float64 of the rounded inputs. Rows carry "dtype".

--mode backward (dfss bench --backward): every timed call is forward + backward through autograd:
q, k, v are leaf tensors with requires_grad, their .grad is set to None before each call (as
optimizer.zero_grad(set_to_none=True) does), then O = method(q, k, v) and O.backward(dO) with a fixed
standard normal dO. Both methods run under autograd (torch 1.13's private SDPA has a math autograd
path). The error column is then the max abs difference of dQ, dK, dV to float64 autograd of the
explicit math (softmax(q k^T * scale) v), computed on a reduced problem of L = min(L, --ref-length)
(default 256) with the same B, H, d, seeded inputs, because dK and dV depend on every query row.

Usage (normally invoked by dfss bench):
  OMP_NUM_THREADS=2 OPENBLAS_NUM_THREADS=2 MKL_NUM_THREADS=2 \
      python3 tools/bench/torch_attention.py --lengths 512,1024 --threads 2
  python3 tools/bench/torch_attention.py --lengths 512 --threads 2 --mode backward
  python3 tools/bench/torch_attention.py --probe      # version information only
"""
import argparse
import math
import os
import platform
import statistics
import sys
import time

from torch_serve import emit, hand_off, serve_requests

def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--probe", action="store_true", help="print version information and exit")
    ap.add_argument("--serve", action="store_true",
                    help="answer dfss bench's requests on standard input (forward only; see serve())")
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
    ap.add_argument("--dtypes", default="fp32", help="comma list of fp32, bf16, fp16")
    ap.add_argument("--low-precision-methods", default="sdpa",
                    help="the methods timed for the 16-bit dtypes of --dtypes")
    ap.add_argument("--mode", default="forward", choices=["forward", "backward"],
                    help="forward: forward calls; backward: forward + backward through autograd")
    ap.add_argument("--causal", action="store_true",
                    help="causal mask (Lq = Lk, so top-left = bottom-right): SDPA is_causal=True, bmm a -inf "
                         "upper triangle; the error is then on the last ref-rows query rows")
    ap.add_argument("--ref-length", type=int, default=256,
                    help="--mode backward: L of the reduced problem the gradient error is computed on")
    return ap.parse_args(argv)


def causal_mask_of(torch, lq, lk):
    """An additive float32 mask [lq, lk]: -inf above the bottom-right aligned diagonal (dfss's rule)."""
    keep = torch.ones(lq, lk, dtype=torch.bool).tril(diagonal=lk - lq)
    return torch.zeros(lq, lk).masked_fill(~keep, float("-inf"))


def env_info():
    keys = ["OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "OMP_WAIT_POLICY",
            "GLIBC_TUNABLES"]
    return {k: os.environ.get(k) for k in keys if os.environ.get(k) is not None}


def main(argv):
    args = parse_args(argv)
    if args.serve and args.mode != "forward":
        raise SystemExit("--serve: the forward only (got --mode %s)" % args.mode)
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
    info["mode"] = args.mode
    gen = torch.Generator().manual_seed(args.seed)
    lengths = [int(x) for x in args.lengths.split(",") if x]
    methods = [m for m in args.methods.split(",") if m]
    B, H, d = args.batch, args.heads, args.head_dim
    dtype_of = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    dtypes = [x for x in args.dtypes.split(",") if x]
    for name in dtypes:
        if name not in dtype_of:
            raise SystemExit("--dtypes: expected fp32, bf16 or fp16, got '%s'" % name)
    low_methods = [m for m in args.low_precision_methods.split(",") if m]

    def plan():  # (dtype name, torch dtype, method) in timing order
        return [(name, dtype_of[name], m) for name in dtypes for m in methods
                if name == "fp32" or m in low_methods]
    scale = 1.0 / math.sqrt(d)

    def causal_mask(lq, lk):
        return causal_mask_of(torch, lq, lk)

    def bmm_attention(q, k, v):  # [B*H, L, d]
        s = torch.bmm(q, k.transpose(1, 2))
        s.mul_(scale)
        if args.causal:
            s.add_(causal_mask(s.shape[1], s.shape[2]).to(s.dtype))
        p = torch.softmax(s, dim=-1)
        return torch.bmm(p, v)

    if info["sdpa"] == "public":
        def sdpa(q, k, v):  # [B, H, L, d]
            return F.scaled_dot_product_attention(q, k, v, is_causal=args.causal)
        sdpa_label = "sdpa"
    elif info["sdpa"] == "private":
        def sdpa(q, k, v):
            return F._scaled_dot_product_attention(q, k, v, None, 0.0, False, args.causal)[0]
        sdpa_label = "sdpa-private"
    else:
        sdpa = None
        sdpa_label = "sdpa"

    if args.mode == "backward":
        info["results"] = run_backward(torch, args, lengths, plan(), B, H, d, scale, bmm_attention, sdpa,
                                       sdpa_label)
        emit(info)
        return 0

    def entry(L, dtype_name, method, draws):
        return Entry(torch, args, B, H, L, d, scale, dtype_name, dtype_of[dtype_name], method, draws, bmm_attention,
                     sdpa, sdpa_label, causal_mask)

    if args.serve:
        return serve(torch, args, info, entry)

    results = []
    with torch.inference_mode():
        for L in lengths:
            draws = [torch.randn(B, H, L, d, generator=gen, dtype=torch.float32) for _ in range(3)]
            for dtype_name, _, method in plan():
                row = {"B": B, "H": H, "L": L, "d": d, "dtype": dtype_name}
                try:
                    e = entry(L, dtype_name, method, draws)
                    row["method"] = e.label
                    iters = args.iters
                    if e.first * iters > args.budget:
                        iters = max(3, int(args.budget / max(e.first, 1e-9)))
                    ms = [e.timed() for _ in range(iters)]
                    row.update({
                        "ms_median": statistics.median(ms), "ms_min": min(ms), "ms_max": max(ms),
                        "iters": iters, "max_err": e.max_err(),
                    })
                    del e
                except Unsupported as x:
                    row["method"], row["error"] = x.args
                except Exception as x:  # noqa: BLE001 - report, keep going
                    row.setdefault("method", method)
                    row["error"] = "%s: %s" % (type(x).__name__, x)
                results.append(row)
    info["results"] = results
    emit(info)
    return 0


class Unsupported(Exception):
    """(method label, why): a method this torch does not have."""


class Entry:
    """One (L, dtype, method) of the forward: the fp32 @p draws rounded to the dtype, the first call
    timed (self.first, seconds), then the warm-up calls."""

    def __init__(self, torch, args, B, H, L, d, scale, dtype_name, dtype, method, draws, bmm_attention, sdpa,
                 sdpa_label, causal_mask):
        self.torch, self.args, self.scale, self.causal_mask = torch, args, scale, causal_mask
        self.shape = (B, H, L, d)
        q, k, v = (x.to(dtype) for x in draws)
        self.q, self.k, self.v = q, k, v
        if method == "bmm":
            self.label, self.fn = "bmm+softmax+bmm", bmm_attention
            self.inputs = (q.reshape(B * H, L, d), k.reshape(B * H, L, d), v.reshape(B * H, L, d))
        elif method == "sdpa":
            if sdpa is None:
                raise Unsupported(sdpa_label, "torch %s has no scaled_dot_product_attention" % torch.__version__)
            self.label, self.fn, self.inputs = sdpa_label, sdpa, (q, k, v)
        else:
            raise Unsupported(method, "unknown method")
        with torch.inference_mode():
            t0 = time.perf_counter()
            self.out = self.fn(*self.inputs)
            self.first = time.perf_counter() - t0
            warmup = args.warmup if self.first < 1.0 else 1
            for _ in range(warmup - 1):
                self.out = self.fn(*self.inputs)

    def timed(self):
        """One timed call, in ms."""
        with self.torch.inference_mode():
            t0 = time.perf_counter()
            self.out = self.fn(*self.inputs)
            return (time.perf_counter() - t0) * 1e3

    def max_err(self):
        """Error on the first R query rows of every head (causal: the last R, whose keys under the
        bottom-right mask are those of the full problem), against float64 of the same math."""
        torch = self.torch
        B, H, L, d = self.shape
        R = min(self.args.ref_rows, L)
        r0 = L - R if self.args.causal else 0
        with torch.inference_mode():
            qd, kd, vd = self.q[:, :, r0:r0 + R].double(), self.k.double(), self.v.double()
            sc = torch.matmul(qd, kd.transpose(-1, -2)) * self.scale
            if self.args.causal:
                sc = sc + self.causal_mask(R, L).double()
            ref = torch.softmax(sc, dim=-1) @ vd
            got = self.out.reshape(B, H, L, d)[:, :, r0:r0 + R].double()
            return float((got - ref).abs().max())


def serve(torch, args, info, entry):
    """--serve: dfss bench's co-process for the forward (not --mode backward), so that the torch
    calls are timed round-robin with the dfss rows of the same length. Prints the info line with
    "serving": true, then answers one request per line of standard input (JSON), one
    DFSS_TORCH_JSON line each, until end of input:
      {"cmd": "setup", "L", "dtype", "method"} -> {"id", "method", "first_ms"} (inputs drawn from
          --seed + L, the first call timed, the warm-up calls made), or {"method", "error"}
      {"cmd": "time", "id"} -> {"ms"}: one timed call
      {"cmd": "check", "id"} -> {"max_err"}
      {"cmd": "free"} -> {}: every entry released
    Before a timed call it keeps torch's threads busy for 20 ms (torch_serve.hand_off)."""
    entries, draws = {}, {}

    def handle(req):
        cmd = req.get("cmd")
        if cmd == "setup":
            L, name, method = req["L"], req["dtype"], req["method"]
            if L not in draws:
                gen = torch.Generator().manual_seed(args.seed + L)
                draws[L] = [torch.randn(args.batch, args.heads, L, args.head_dim, generator=gen,
                                        dtype=torch.float32) for _ in range(3)]
            key = "%d/%s/%s" % (L, name, method)
            try:
                entries[key] = entry(L, name, method, draws[L])
            except Unsupported as x:
                return {"method": x.args[0], "error": x.args[1]}
            return {"id": key, "method": entries[key].label, "first_ms": entries[key].first * 1e3}
        if cmd in ("time", "check") and req.get("id") not in entries:
            return {"error": "no entry %r set up" % (req.get("id"),)}
        if cmd == "time":
            hand_off(torch)
            return {"ms": entries[req["id"]].timed()}
        if cmd == "check":
            return {"max_err": entries[req["id"]].max_err()}
        if cmd == "free":
            entries.clear()
            draws.clear()
            return {}
        return {"error": "unknown request %r" % (cmd,)}

    return serve_requests(info, handle)


def run_backward(torch, args, lengths, plan, B, H, d, scale, bmm_attention, sdpa, sdpa_label):
    """--mode backward: forward + backward through autograd, timed together; see the module docstring."""

    def bmm_leaves(q, k, v):  # leaves [B, H, L, d] -> the bmm layout [B*H, L, d] (views, differentiable)
        L = q.shape[2]
        return q.reshape(B * H, L, d), k.reshape(B * H, L, d), v.reshape(B * H, L, d)

    def same(q, k, v):
        return q, k, v

    def leaves_of(L, gen):
        return [torch.randn(B, H, L, d, generator=gen, dtype=torch.float32) for _ in range(4)]

    def as_leaves(ts, dtype):  # fp32 draws -> leaves of dtype (q, k, v require grad), dO
        out = [t.detach().to(dtype) for t in ts]
        for t in out[:3]:
            t.requires_grad_(True)
        return out

    def fwd_bwd(fn, layout, q, k, v, dout):
        for t in (q, k, v):
            t.grad = None
        out = fn(*layout(q, k, v))
        out.backward(dout.reshape(out.shape))

    def grad_error(fn, layout, L, dtype):
        # The reduced problem: the method's gradients in dtype against float64 autograd of the math
        # on the same (rounded) inputs.
        gen = torch.Generator().manual_seed(args.seed + L)
        q, k, v, dout = as_leaves(leaves_of(L, gen), dtype)
        fwd_bwd(fn, layout, q, k, v, dout)
        got = [t.grad.double() for t in (q, k, v)]
        qd, kd, vd = (t.detach().double().requires_grad_(True) for t in (q, k, v))
        sc = torch.matmul(qd, kd.transpose(-1, -2)) * scale
        if args.causal:
            sc = sc + causal_mask_of(torch, L, L).double()
        ref = torch.softmax(sc, dim=-1) @ vd
        ref.backward(dout.double())
        want = [qd.grad, kd.grad, vd.grad]
        return max(float((g - w).abs().max()) for g, w in zip(got, want))

    gen = torch.Generator().manual_seed(args.seed)
    results = []
    with torch.enable_grad():
        for L in lengths:
            draws = leaves_of(L, gen)
            Le = min(args.ref_length, L)
            for dtype_name, dtype, method in plan:
                q, k, v, dout = as_leaves(draws, dtype)
                row = {"B": B, "H": H, "L": L, "d": d, "ref_length": Le, "dtype": dtype_name}
                if method == "bmm":
                    row["method"] = "bmm+softmax+bmm"
                    fn, layout = bmm_attention, bmm_leaves
                elif method == "sdpa":
                    row["method"] = sdpa_label
                    if sdpa is None:
                        row["error"] = "torch %s has no scaled_dot_product_attention" % torch.__version__
                        results.append(row)
                        continue
                    fn, layout = sdpa, same
                else:
                    row["method"] = method
                    row["error"] = "unknown method"
                    results.append(row)
                    continue
                try:
                    t0 = time.perf_counter()
                    fwd_bwd(fn, layout, q, k, v, dout)
                    first = time.perf_counter() - t0
                    warmup = args.warmup if first < 1.0 else 1
                    for _ in range(warmup - 1):
                        fwd_bwd(fn, layout, q, k, v, dout)
                    iters = args.iters
                    if first * iters > args.budget:
                        iters = max(3, int(args.budget / max(first, 1e-9)))
                    ms = []
                    for _ in range(iters):
                        t0 = time.perf_counter()
                        fwd_bwd(fn, layout, q, k, v, dout)
                        ms.append((time.perf_counter() - t0) * 1e3)
                    row.update({
                        "ms_median": statistics.median(ms), "ms_min": min(ms), "ms_max": max(ms),
                        "iters": iters, "max_err": grad_error(fn, layout, Le, dtype) if args.ref_rows > 0 else None,
                    })
                except Exception as e:  # noqa: BLE001 - report, keep going
                    row["error"] = "%s: %s" % (type(e).__name__, e)
                results.append(row)
    return results


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
