"""Packed sequences (transformers' padding-free format: several sequences in one row, position ids
restarting at each) through one attention layer: transformers' "sdpa" with the boolean [B, 1, L, L]
mask it builds for them, against dfss as dfss.transformers gives it the row (the spans of the
sequences, one operator call each), and dfss through the same 4-D mask as SDPA (an additive bias: what
dfss did before the spans). The implementations take turns on the same q, K and V (random normal,
GQA); each row is the median of its rounds, with the ratio against sdpa and dense's largest
difference from sdpa's output.

    PYTHONPATH=build-cpu/tests/python/work-torch2/site ~/.cache/dfss/torch2-venv/bin/python \\
        tools/bench/packed_attention.py [--packs 8x512,16x256,8x1024] [--dtype f32|bf16]

(the site folder is where CTest python_transformers installs the package against the torch 2.x
venv; any environment with torch 2.x, transformers >= 5 and `import dfss` will do).

Most of the difference from SDPA is the block-diagonal structure, not DFSS: SDPA given the mask
computes every one of the L x L scores, the spans only each sequence's own causal triangle.
"""
import argparse
import importlib.util
import json
import pathlib
import statistics
import sys
import time

import torch

DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--packs", default="8x512,16x256,8x1024",
                   help="packed rows to time, each COUNTxLENGTH: COUNT sequences of LENGTH tokens (default %(default)s)")
    p.add_argument("--heads", default="32:8", help="query heads:kv heads (default %(default)s, Llama-3.2-1B's)")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="f32")
    p.add_argument("--patterns", default="dense,2:4", help="dfss patterns (default %(default)s)")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=2023)
    p.add_argument("--json", help="also write the rows to this file")
    args = p.parse_args(argv)
    try:
        args.packs = [tuple(int(x) for x in pack.split("x")) for pack in args.packs.split(",")]
        ok = all(len(pk) == 2 and pk[0] >= 1 and pk[1] >= 1 for pk in args.packs)
    except ValueError:
        ok = False
    if not ok:
        p.error(f"argument --packs: expected COUNTxLENGTH items such as 8x512, both >= 1, got {args.packs!r}")
    try:
        args.heads, args.heads_kv = (int(x) for x in args.heads.split(":"))
        ok = args.heads >= 1 and args.heads_kv >= 1 and args.heads % args.heads_kv == 0
    except ValueError:
        ok = False
    if not ok:
        p.error(f"argument --heads: expected H:Hkv with Hkv dividing H, got {args.heads!r}")
    if args.head_dim < 1 or args.rounds < 1 or args.threads < 1:
        p.error("arguments --head-dim, --rounds and --threads must be >= 1")
    args.patterns = args.patterns.split(",")
    return args


def _machine():
    spec = importlib.util.spec_from_file_location("dfss_generate_bench", pathlib.Path(__file__).with_name("generate.py"))
    generate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generate)
    return generate.machine()


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    import transformers
    from transformers import masking_utils
    import dfss.transformers
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    functions = transformers.AttentionInterface()

    class Layer(torch.nn.Module):  # what the attention functions read from the module
        is_causal = True
        num_key_value_groups = args.heads // args.heads_kv

    layer = Layer()
    names = {p: dfss.transformers.register(f"dfss-packed-bench-{p}", pattern=p) for p in args.patterns}
    dtype = DTYPES[args.dtype]
    scale = args.head_dim ** -0.5
    cpu, commit = _machine()
    print(f"packed attention: {cpu}, commit {commit}, torch {torch.__version__}, transformers "
          f"{transformers.__version__}, {args.threads} threads, {args.dtype}, H:Hkv {args.heads}:{args.heads_kv}, "
          f"d = {args.head_dim}, median of {args.rounds} rounds")
    rows = []
    for count, length in args.packs:
        total = count * length
        positions = torch.arange(length).repeat(count)[None]
        cfg = transformers.LlamaConfig()
        cfg._attn_implementation = names[args.patterns[0]]
        spans = masking_utils.create_causal_mask(config=cfg, inputs_embeds=torch.zeros(1, total, 1), attention_mask=None,
                                                 cache=None, position_ids=positions)
        cfg._attn_implementation = "sdpa"
        full = masking_utils.create_causal_mask(config=cfg, inputs_embeds=torch.zeros(1, total, 1), attention_mask=None,
                                                cache=None, position_ids=positions)
        if count > 1 and getattr(spans, "segments", None) is None:
            raise SystemExit(f"packed_attention: the dfss mask function gave {spans!r}, not the spans of {count} "
                             f"sequences (an older dfss?)")
        q = torch.randn(1, args.heads, total, args.head_dim, dtype=dtype)
        k = torch.randn(1, args.heads_kv, total, args.head_dim, dtype=dtype)
        v = torch.randn(1, args.heads_kv, total, args.head_dim, dtype=dtype)
        impls = {"sdpa (4-D mask)": lambda: functions["sdpa"](layer, q, k, v, full, scaling=scale)[0]}
        for p, name in names.items():
            impls[f"dfss {p} (spans)"] = lambda name=name: functions[name](layer, q, k, v, spans, scaling=scale)[0]
            impls[f"dfss {p} (4-D mask)"] = lambda name=name: functions[name](layer, q, k, v, full, scaling=scale)[0]
        with torch.inference_mode():
            outputs = {impl: call() for impl, call in impls.items()}
            times = {impl: [] for impl in impls}
            for _ in range(args.rounds):
                for impl, call in impls.items():
                    start = time.perf_counter()
                    call()
                    times[impl].append(time.perf_counter() - start)
        base = statistics.median(times["sdpa (4-D mask)"])
        for impl, t in times.items():
            ms = statistics.median(t) * 1e3
            diff = None
            if impl.startswith("dfss dense"):
                diff = (outputs[impl].float() - outputs["sdpa (4-D mask)"].float()).abs().max().item()
            rows.append(dict(sequences=count, length=length, implementation=impl, ms_median=ms, ms_min=min(t) * 1e3,
                             ms_max=max(t) * 1e3, vs_sdpa=base * 1e3 / ms, max_diff_vs_sdpa=diff,
                             finite=bool(torch.isfinite(outputs[impl]).all())))
            print(f"{count:>3} x {length:<6} {impl:<22} {ms:10.2f} ms  (min {min(t) * 1e3:.2f}, max "
                  f"{max(t) * 1e3:.2f})  {base * 1e3 / ms:6.2f}x sdpa" +
                  ("" if diff is None else f"  max |out - sdpa's| {diff:.2e}"), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(cpu=cpu, commit=commit, torch=torch.__version__, dtype=args.dtype, threads=args.threads,
                           heads=args.heads, heads_kv=args.heads_kv, head_dim=args.head_dim, rounds=args.rounds,
                           rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
