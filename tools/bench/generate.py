"""dfss in a transformers decoder LM, end to end: the time of one decode step against a KV cache of
L tokens, and of a prompt's prefill, with attn_implementation = "sdpa" and dfss (dense, 2:4, 1:2 via
dfss.transformers.register), on one model with random weights in the geometry of a real one (no
download). The implementations take turns on the same model (set_attn_implementation), the same
cache and the same inputs; each row is the median of its rounds.

    PYTHONPATH=build-cpu/tests/python/work-torch2/site ~/.cache/dfss/torch2-venv/bin/python \\
        tools/bench/generate.py [--geometry llama-3.2-1b] [--contexts 4096,16384,32768] [--prompts 1024] \\
        [--dtype f32|bf16] [--cache dynamic|static]

(the site folder is where CTest python_transformers installs the package against the torch 2.x
venv; any environment with torch 2.x, transformers >= 5 and `import dfss` will do).

What it measures is what a user of model.generate() on the CPU sees per token, attention and all
else: the weights' matrix products, the cache's own update (a DynamicCache, generate()'s default,
concatenates each new key and value row onto the layer's tensors; a StaticCache, what
generate(cache_implementation="static") makes, writes them into preallocated slots and needs a mask
over the unused ones), the LM head. The decode cache is random keys and values
(a prefill of L tokens per configuration would take minutes): the time of a step does not depend
on the values, but which keys a sparse pattern keeps does (GQA: how much of V the heads' union of
kept keys covers), so the sparse rows' gain over dense on real text may differ from these.
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch

GEOMETRIES = {
    # meta-llama/Llama-3.2-1B's config.json: GQA 32:8, d = 64, tied embeddings.
    "llama-3.2-1b": ("llama", dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                                   num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                                   rope_theta=500000.0, max_position_embeddings=131072, tie_word_embeddings=True)),
    # Qwen/Qwen2.5-0.5B's config.json: GQA 14:2, d = 64, tied embeddings, q/k/v biases.
    "qwen2.5-0.5b": ("qwen2", dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                                   num_attention_heads=14, num_key_value_heads=2, rope_theta=1000000.0,
                                   max_position_embeddings=131072, tie_word_embeddings=True, use_sliding_window=False)),
    # For tests: seconds, not minutes.
    "tiny": ("llama", dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
                           tie_word_embeddings=False)),
}
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}
PATTERNS = ("dense", "2:4", "1:2")


def parse_ints(text, what):
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"generate.py: {what}: expected comma-separated integers, got {text!r}")
    if not values or any(v < 1 for v in values):
        raise SystemExit(f"generate.py: {what}: expected positive integers, got {text!r}")
    return values


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--geometry", default="llama-3.2-1b", help="one of " + ", ".join(GEOMETRIES))
    ap.add_argument("--layers", type=int, default=0, help="decoder layers (default: the geometry's)")
    ap.add_argument("--dtype", default="f32", help="weights, activations and cache: f32 or bf16")
    ap.add_argument("--contexts", default="4096,16384,32768", help="cache lengths L of the decode steps")
    ap.add_argument("--prompts", default="1024", help="prompt lengths of the prefills (empty: none)")
    ap.add_argument("--patterns", default="dense,2:4,1:2", help="dfss patterns, besides sdpa")
    ap.add_argument("--cache", default="dynamic", choices=("dynamic", "static"),
                    help="dynamic (generate()'s default: each step is timed against the same L keys) or static "
                         "(generate(cache_implementation=\"static\")'s: the steps go on from L, one key more each)")
    ap.add_argument("--rounds", type=int, default=5, help="timed calls per row, the implementations taking turns")
    ap.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (dfss follows it)")
    ap.add_argument("--seed", type=int, default=2023)
    ap.add_argument("--json", help="also write the rows as JSON to this file")
    args = ap.parse_args(argv)
    if args.geometry not in GEOMETRIES:
        ap.error(f"--geometry: expected one of {', '.join(GEOMETRIES)}, got {args.geometry!r}")
    if args.dtype not in DTYPES:
        ap.error(f"--dtype: expected f32 or bf16, got {args.dtype!r}")
    args.patterns = [p.strip() for p in args.patterns.split(",") if p.strip()]
    for p in args.patterns:
        if p not in PATTERNS:
            ap.error(f"--patterns: expected some of {', '.join(PATTERNS)}, got {p!r}")
    args.contexts = parse_ints(args.contexts, "--contexts")
    args.prompts = parse_ints(args.prompts, "--prompts") if args.prompts.strip() else []
    if args.rounds < 1 or args.threads < 1 or args.layers < 0:
        ap.error("--rounds and --threads: expected >= 1; --layers: expected >= 0")
    return args


def build_model(args):
    import transformers
    kind, geometry = GEOMETRIES[args.geometry]
    config_kwargs = dict(geometry)
    if args.layers:
        config_kwargs["num_hidden_layers"] = args.layers
    config_cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config}[kind]
    torch.manual_seed(args.seed)
    model = transformers.AutoModelForCausalLM.from_config(config_cls(**config_kwargs), attn_implementation="sdpa",
                                                          dtype=DTYPES[args.dtype])
    return model.eval()


def make_cache(model, context, dtype, generator, kind="dynamic", steps=0):
    """A cache holding @p context random keys and values per layer: a DynamicCache (generate()'s
    default), or a StaticCache with room for @p steps more (the keys of the timed decode steps)."""
    import transformers
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    if kind == "static":
        cache = transformers.StaticCache(config=c, max_cache_len=context + steps)
    else:
        cache = transformers.DynamicCache(config=c)
    shape = (1, c.num_key_value_heads, context, head_dim)
    for layer in range(c.num_hidden_layers):
        k = torch.randn(shape, generator=generator).to(dtype)
        v = torch.randn(shape, generator=generator).to(dtype)
        cache.update(k, v, layer)
    return cache


def decode_step(model, cache, context, token, keep=False):
    """One decode step at position @p context. Unless @p keep, the cache is left as it was (the new row
    dropped: a DynamicCache); with @p keep it holds the step's key and value (a StaticCache, which
    writes at its own running position: the next step must come at context + 1)."""
    out = model(input_ids=token, cache=cache, cache_position=torch.tensor([context]), use_cache=True, logits_to_keep=1)
    if not keep:
        cache.crop(-1)
    return out.logits[0, -1].float()


def prefill(model, ids):
    out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
    return out.logits[0, -1].float()


def machine():
    """The CPU's model name and the source tree's commit (where this script sits in a git checkout)."""
    import pathlib
    import platform
    import subprocess
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    try:
        git = ["git", "-C", str(pathlib.Path(__file__).resolve().parent)]
        commit = subprocess.run(git + ["rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                timeout=10).stdout.strip() or "unknown"
        if commit != "unknown" and subprocess.run(git + ["status", "--porcelain", "--untracked-files=no"],
                                                  capture_output=True, text=True, timeout=10).stdout.strip():
            commit += " (uncommitted changes)"
    except (OSError, subprocess.SubprocessError):
        commit = "unknown"
    return cpu, commit


def timed_turns(impls, call, rounds):
    """Medians, minimums and maxima of call(impl) per implementation, the implementations taking turns
    (one untimed call each first); also each one's first output."""
    outputs = {impl: call(impl) for impl in impls}
    times = {impl: [] for impl in impls}
    for _ in range(rounds):
        for impl in impls:
            start = time.perf_counter()
            call(impl)
            times[impl].append(time.perf_counter() - start)
    return times, outputs


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    import transformers
    import dfss
    import dfss.transformers
    torch.set_num_threads(args.threads)
    names = {"sdpa": "sdpa"}
    for pattern in args.patterns:
        names[f"dfss {pattern}"] = dfss.transformers.register(f"dfss-bench-{pattern}", pattern=pattern)
    impls = list(names)
    model = build_model(args)
    dtype = DTYPES[args.dtype]
    c = model.config
    cpu, commit = machine()
    print(f"generate.py: commit {commit}, {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}, {cpu}, "
          f"{torch.get_num_threads()} of {os.cpu_count()} hardware threads")
    print(f"generate.py: {args.geometry} geometry, {c.num_hidden_layers} layers, {args.dtype}, random weights "
          f"(seed {args.seed}); torch {torch.__version__}, transformers {transformers.__version__}, "
          f"{args.threads} threads, {args.cache} cache, {args.rounds} rounds, implementations taking turns")
    print(f"{'mode':8} {'L':>6}  {'implementation':14} {'ms median':>10} {'ms min':>9} {'ms max':>9} "
          f"{'tokens/s':>9} {'vs sdpa':>8}  max |logit - sdpa's|")
    rows = []
    token = torch.tensor([[5]])
    generator = torch.Generator().manual_seed(args.seed)
    configs = [("decode", L) for L in args.contexts] + [("prefill", P) for P in args.prompts]
    with torch.inference_mode():
        for mode, length in configs:
            if mode == "decode":
                static = args.cache == "static"
                cache = make_cache(model, length, dtype, generator, args.cache, len(impls) * (args.rounds + 1))
                position = [length]

                def call(impl):
                    model.set_attn_implementation(names[impl])
                    logits = decode_step(model, cache, position[0], token, keep=static)
                    position[0] += 1 if static else 0
                    return logits
            else:
                ids = torch.randint(3, c.vocab_size, (1, length), generator=generator)

                def call(impl):
                    model.set_attn_implementation(names[impl])
                    return prefill(model, ids)
            times, outputs = timed_turns(impls, call, args.rounds)
            base = statistics.median(times["sdpa"])
            tokens = 1 if mode == "decode" else length
            for impl in impls:
                t = times[impl]
                med = statistics.median(t)
                # A static cache's steps come at different positions: their logits are not comparable.
                compared = not (mode == "decode" and args.cache == "static")
                err = (outputs[impl] - outputs["sdpa"]).abs().max().item() if compared else None
                row = dict(mode=mode, length=length, implementation=impl, ms_median=1e3 * med, ms_min=1e3 * min(t),
                           ms_max=1e3 * max(t), tokens_per_s=tokens / med, vs_sdpa=base / med, max_logit_diff=err,
                           finite=bool(torch.isfinite(outputs[impl]).all()))
                rows.append(row)
                print(f"{mode:8} {length:>6}  {impl:14} {row['ms_median']:>10.2f} {row['ms_min']:>9.2f} "
                      f"{row['ms_max']:>9.2f} {row['tokens_per_s']:>9.1f} {row['vs_sdpa']:>7.2f}x  {'-' if err is None else f'{err:.2e}'}"
                      + ("" if row["finite"] else "  (non-finite logits)"))
            if mode == "decode":
                del cache
    print("vs sdpa = sdpa's median / the row's (> 1: faster than sdpa); decode rows: one step with the cache "
          "holding L tokens (static cache: L to L + calls - 1, each call one more); prefill rows: a prompt of L "
          "tokens (tokens/s = L / time). The logits compared are each implementation's first call's (not for a "
          "static cache's decode steps, which come at different positions); sparse patterns differ from sdpa's "
          "by design.")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(commit=commit, cpu=cpu, geometry=args.geometry, layers=c.num_hidden_layers, dtype=args.dtype, cache=args.cache,
                           threads=args.threads, rounds=args.rounds, torch=torch.__version__,
                           transformers=transformers.__version__, rows=rows), f, indent=1)
    bad = [r for r in rows if not r["finite"]]
    if bad:
        print(f"generate.py: non-finite logits in {len(bad)} rows", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
