#!/usr/bin/env python3
"""lm_train: a byte-level causal language model on real text with dfss's kernels in the loop.

A decoder-only transformer (pre-LayerNorm, rotary position embeddings, optional grouped-query
attention, a vocabulary of the 256 byte values) is trained on the Python standard library's sources
(text_corpus.py) and measured in bits per byte on held-out files. Its attention is
``dfss.attention(q, k, v, is_causal=True, pattern=...)`` ("dense" for full attention, "1:2", "2:4"
or any N:M), in training and in evaluation.

  text_corpus.py build --out runs/lm/corpus
  lm_train.py train --corpus runs/lm/corpus --attention dense --out runs/lm/dense
  lm_train.py train --init runs/lm/dense/final.pt --attention 2:4 --steps 160 --lr 3e-4 --out runs/lm/ft-2-4
  lm_train.py train --resume runs/lm/dense/last.pt          (after Ctrl-C)
  lm_train.py eval --checkpoint runs/lm/dense/final.pt --attention dense 1:2 2:4 --out runs/lm/dense-eval.json
  lm_train.py capture --checkpoint runs/lm/dense/final.pt --layers 0 3 --out runs/lm/qkv
  lm_train.py train --quick --out /tmp/q                    (CI: synthetic corpus, tiny model, seconds)

Documents: byte 0 (never in the corpus) marks a document start. Training reads the training split
as one stream (each document preceded by byte 0) cut into windows of ctx + 1 bytes: in each epoch a
random shift and a random permutation of the aligned windows (from --seed and the epoch), so that
within an epoch no byte is trained on twice. A run started from --init continues the data order
where the initialising run stopped (a finetune and its dense control see the same new bytes).

Evaluation: bits per byte = total bits / total bytes over a split. Each document is cut into
non-overlapping windows of ctx bytes; the window at the document start reads byte 0 then the
document, later windows start their context at their own first byte's predecessor, so no context
crosses a window or document boundary. Per-document bits and bytes (for the paired bootstrap of
lm_report.py) and bits by position in the window go to the JSON output.

Runs are reproducible from --seed (initialisation and data order; the learning rate and the batches
are functions of the step, so a resumed run takes the same steps as an uninterrupted one). Ctrl-C
saves last.pt; --resume continues from it.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import signal
import sys
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import text_corpus  # noqa: E402
from common import Progress, save_atomic  # noqa: E402

import dfss  # noqa: E402

VOCAB = 256  # byte values
LN2 = math.log(2.0)
ROPE_BASE = 10000.0  # the usual rotary base (RoFormer); ctx <= 2048 stays far below its longest period
# Mixes the seed and the epoch into one generator seed; distinct for all epochs below this prime.
EPOCH_PRIME = 1_000_003
# The default model and run (docs/accuracy.md, "Text language model"): 4 layers of width 256 at
# batch 8 x 1,024 bytes, the size the issue sized at about 2.5 s a step on 2 cores.
DEFAULTS = {"layers": 4, "dim": 256, "heads": 4, "kv_heads": None, "ffn": 1024, "ctx": 1024, "batch": 8,
            "lr": 1e-3, "warmup": 0.05, "min_lr": 0.1, "weight_decay": 0.01, "tie": False, "seed": 0,
            # 128 KiB of validation documents per evaluation during training: about 1/4 of the
            # validation split (587 KB), some 15 s of forward passes on 2 idle cores, so that ten
            # evaluations cost under 10% of the run.
            "val_bytes": 128 * 1024}
# Bytes of training of a run from scratch: 800 steps of 8 x 1,024 bytes, about 32-35 min of dense
# training on an idle 2-core machine with OpenBLAS (docs/accuracy.md: the timing runs behind it).
DEFAULT_BUDGET = 800 * 8 * 1024
# --quick (CI): a synthetic corpus of 40 files, a 2-layer width-32 model with grouped-query
# attention (2 query heads, 1 K/V head), windows of 64 bytes: 20 steps in a few seconds.
QUICK = {"layers": 2, "dim": 32, "heads": 2, "kv_heads": 1, "ffn": 64, "ctx": 64, "batch": 4, "lr": 3e-3,
         "steps": 20, "val_bytes": 4096, "eval_every": 10, "save_every": 5}
QUICK_FILES = 40
ARCH_KEYS = ("layers", "dim", "heads", "kv_heads", "ffn", "ctx", "tie")  # fixed by --init's checkpoint
RUN_OPTS = ("batch", "lr", "warmup", "min_lr", "weight_decay", "seed", "val_bytes")  # --init's unless given
# Everything that defines a run: --resume takes it from the checkpoint and refuses it on the command line.
RUN_KEYS = ARCH_KEYS + RUN_OPTS + ("corpus", "attention", "init", "steps", "budget_bytes", "eval_every", "quick")


def rope_tables(ctx: int, d: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [ctx, d / 2] of the rotary embedding (rotation of the two halves of a head)."""
    inv = ROPE_BASE ** (-torch.arange(0, d // 2, dtype=torch.float64) / (d // 2))
    ang = torch.arange(ctx, dtype=torch.float64)[:, None] * inv[None, :]
    return ang.cos().float(), ang.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, L, H, d] rotated by position (GPT-NeoX convention: first half with second half)."""
    h = x.shape[-1] // 2
    c, s = cos[:x.shape[1], None, :], sin[:x.shape[1], None, :]
    x1, x2 = x[..., :h], x[..., h:]
    return torch.cat((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1)


def parse_attention(spec: str) -> Tuple[str, Dict[str, int]]:
    """An attention spec: a pattern ("dense", "2:4", ...), optionally with dense windows appended as
    "+sinkN" and "+recentN" (docs/semantics.md, "Sink and recent windows"), e.g. "2:4+sink16+recent64".
    Returns the pattern and the dfss.attention keyword arguments of the windows (none when absent,
    so that a dfss build without windows still runs plain patterns)."""
    pattern, *parts = spec.split("+")
    windows: Dict[str, int] = {}
    for part in parts:
        for name, key in (("sink", "sink_tokens"), ("recent", "recent_tokens")):
            if part.startswith(name) and part[len(name):].isdigit():
                windows[key] = int(part[len(name):])
                break
        else:
            raise ValueError(f"lm_train: attention {spec!r}: expected PATTERN[+sinkN][+recentN], got the part {part!r}")
    return pattern, windows


class Block(nn.Module):
    """Pre-LayerNorm decoder block: causal dfss.attention (grouped-query when kv_heads < heads), GELU MLP."""

    def __init__(self, dim: int, heads: int, kv_heads: int, ffn: int):
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, dim // heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.q = nn.Linear(dim, dim, bias=False)
        self.kv = nn.Linear(dim, 2 * kv_heads * self.hd, bias=False)
        self.out = nn.Linear(dim, dim, bias=False)
        self.ff = nn.Sequential(nn.Linear(dim, ffn, bias=False), nn.GELU(), nn.Linear(ffn, dim, bias=False))
        self.capture: Optional[list] = None  # capture(): a list that receives (q, k, v) as dfss sees them

    def forward(self, x: torch.Tensor, pattern: str, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, l, dim = x.shape
        h = self.ln1(x)
        q = apply_rope(self.q(h).view(b, l, self.heads, self.hd), cos, sin)
        k, v = self.kv(h).view(b, l, 2, self.kv_heads, self.hd).unbind(2)
        k = apply_rope(k, cos, sin)
        if self.capture is not None:
            self.capture.append((q.detach(), k.detach(), v.detach()))
        pattern, windows = parse_attention(pattern)
        a = dfss.attention(q, k, v, is_causal=True, pattern=pattern, layout="blhd", **windows)
        x = x + self.out(a.reshape(b, l, dim))
        return x + self.ff(self.ln2(x))


class ByteLM(nn.Module):
    def __init__(self, cfg: Dict):
        super().__init__()
        dim, heads = cfg["dim"], cfg["heads"]
        kv = cfg["kv_heads"]
        self.embed = nn.Embedding(VOCAB, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, kv, cfg["ffn"]) for _ in range(cfg["layers"]))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, VOCAB, bias=False)
        if cfg["tie"]:
            self.head.weight = self.embed.weight
        cos, sin = rope_tables(cfg["ctx"], dim // heads)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self.pattern = "dense"
        # GPT-2's initialisation: N(0, 0.02), the projections into the residual stream scaled down by
        # sqrt(2 * layers) so that the stream's variance does not grow with depth.
        for name, p in self.named_parameters():
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * cfg["layers"]) if name.endswith(("out.weight", "ff.2.weight")) else 0.02
                nn.init.normal_(p, std=std)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for blk in self.blocks:
            x = blk(x, self.pattern, self.cos, self.sin)
        return self.head(self.ln(x))


def check_config(cfg: Dict) -> None:
    """Clear errors for settings the model cannot take."""
    for key in ("layers", "dim", "heads", "kv_heads", "ffn", "ctx", "batch"):
        if cfg[key] < 1:
            raise ValueError(f"lm_train: --{key.replace('_', '-')} must be >= 1, got {cfg[key]}")
    if cfg["dim"] % cfg["heads"]:
        raise ValueError(f"lm_train: --dim ({cfg['dim']}) must be a multiple of --heads ({cfg['heads']})")
    if (cfg["dim"] // cfg["heads"]) % 2:
        raise ValueError(f"lm_train: the head size dim / heads = {cfg['dim'] // cfg['heads']} must be even (RoPE)")
    if cfg["heads"] % cfg["kv_heads"]:
        raise ValueError(f"lm_train: --kv-heads ({cfg['kv_heads']}) must divide --heads ({cfg['heads']})")
    if not cfg["lr"] > 0:
        raise ValueError(f"lm_train: --lr must be > 0, got {cfg['lr']}")
    if not 0 <= cfg["warmup"] < 1 or not 0 <= cfg["min_lr"] <= 1:
        raise ValueError(f"lm_train: --warmup must be in [0, 1) and --min-lr in [0, 1], got {cfg['warmup']}, "
                         f"{cfg['min_lr']}")


def lr_at(cfg: Dict, step: int) -> float:
    """Linear warmup over the first `warmup` of the steps, then cosine decay to min_lr x lr."""
    steps = cfg["steps"]
    warm = max(1, round(cfg["warmup"] * steps))
    decay = 0.5 * (1 + math.cos(math.pi * min(1.0, step / steps)))
    return cfg["lr"] * min(1.0, (step + 1) / warm) * (cfg["min_lr"] + (1 - cfg["min_lr"]) * decay)


def doc_stream(docs: Sequence[Tuple[str, bytes]]) -> torch.Tensor:
    """The documents as one uint8 stream, each preceded by the document-start byte."""
    parts = bytearray()
    for _, data in docs:
        parts.append(text_corpus.BOS)
        parts += data
    return torch.frombuffer(parts, dtype=torch.uint8).clone()


class Batches:
    """Training batches as a function of the (global) data step: epoch e reads the stream from a
    random shift in [0, ctx] in windows of ctx + 1 bytes, in a random order (both from seed and e)."""

    def __init__(self, stream: torch.Tensor, ctx: int, batch: int, seed: int):
        self.stream, self.ctx, self.batch, self.seed = stream, ctx, batch, seed
        self.windows = (len(stream) - ctx) // (ctx + 1)  # so that every shift <= ctx leaves them in the stream
        if self.windows < batch:
            raise ValueError(f"lm_train: the training split ({len(stream)} bytes) holds {max(self.windows, 0)} "
                             f"windows of {ctx + 1} bytes, fewer than a batch of {batch}")
        self._epoch: Tuple[int, int, List[int]] = (-1, 0, [])

    def _order(self, epoch: int) -> Tuple[int, List[int]]:
        if self._epoch[0] != epoch:
            gen = torch.Generator().manual_seed(self.seed * EPOCH_PRIME + epoch)
            shift = int(torch.randint(0, self.ctx + 1, (1,), generator=gen))
            self._epoch = (epoch, shift, torch.randperm(self.windows, generator=gen).tolist())
        return self._epoch[1], self._epoch[2]

    def get(self, step: int) -> Tuple[torch.Tensor, torch.Tensor]:
        rows = []
        for i in range(step * self.batch, (step + 1) * self.batch):
            shift, order = self._order(i // self.windows)
            start = shift + order[i % self.windows] * (self.ctx + 1)
            rows.append(self.stream[start:start + self.ctx + 1])
        x = torch.stack(rows).long()
        return x[:, :-1], x[:, 1:]


def windows_of(docs: Sequence[Tuple[str, bytes]], ctx: int) -> List[Tuple[int, int, int]]:
    """(document index, first byte, length) of each evaluation window: non-overlapping, ctx bytes
    (the last one of a document shorter), never across a document boundary."""
    return [(i, s, min(ctx, len(data) - s)) for i, (_, data) in enumerate(docs) for s in range(0, len(data), ctx)]


@torch.no_grad()
def score(logits_fn: Callable[[torch.Tensor], torch.Tensor], docs: Sequence[Tuple[str, bytes]], ctx: int,
          batch: int) -> Dict:
    """Bits of every document under a model and bits by position in the window.

    logits_fn maps tokens [B, L] to logits [B, L, 256] (causal: position p sees tokens 0..p only).
    A window of document bytes [s, s + n) reads the tokens [s - 1, s + n - 1) (token -1 being the
    document-start byte) and is scored on the bytes [s, s + n). Windows are batched longest first;
    shorter ones are padded at the end, which a causal model never reads from earlier positions."""
    wins = sorted(windows_of(docs, ctx), key=lambda w: -w[2])
    doc_bits = [0.0] * len(docs)
    pos_bits = torch.zeros(ctx, dtype=torch.float64)
    pos_count = torch.zeros(ctx, dtype=torch.float64)
    padded = [bytes([text_corpus.BOS]) + data for _, data in docs]
    for b0 in range(0, len(wins), batch):
        group = wins[b0:b0 + batch]
        width = group[0][2]
        tokens = torch.zeros(len(group), width, dtype=torch.long)
        targets = torch.zeros(len(group), width, dtype=torch.long)
        mask = torch.zeros(len(group), width, dtype=torch.bool)
        for r, (d, s, n) in enumerate(group):
            row = torch.frombuffer(bytearray(padded[d][s:s + n + 1]), dtype=torch.uint8).long()
            tokens[r, :n], targets[r, :n], mask[r, :n] = row[:-1], row[1:], True
        logp = torch.log_softmax(logits_fn(tokens).double(), dim=-1)
        bits = -logp.gather(-1, targets[..., None])[..., 0] / LN2 * mask
        for r, (d, _, n) in enumerate(group):
            doc_bits[d] += float(bits[r, :n].sum())
        pos_bits[:width] += bits.sum(0)
        pos_count[:width] += mask.sum(0)
    total_bits, total_bytes = sum(doc_bits), sum(len(data) for _, data in docs)
    return {"bpb": total_bits / total_bytes, "bits": total_bits, "bytes": total_bytes,
            "docs": [{"path": p, "bytes": len(data), "bits": b} for (p, data), b in zip(docs, doc_bits)],
            "position": {"bits": pos_bits.tolist(), "bytes": pos_count.tolist()}}


def val_subset(docs: Sequence[Tuple[str, bytes]], limit: int) -> List[Tuple[str, bytes]]:
    """Validation documents in the order of their path's SHA-256 (a fixed shuffle of packages) until
    `limit` bytes are reached: the subset evaluated during training."""
    out, total = [], 0
    for path, data in sorted(docs, key=lambda d: hashlib.sha256(d[0].encode()).hexdigest()):
        if total >= limit:
            break
        out.append((path, data))
        total += len(data)
    return out


def blas_libraries() -> List[str]:
    """The BLAS libraries loaded in this process (Linux: /proc/self/maps), for the log and a warning."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "blas" in line.lower() and "/" in line}
    except OSError:
        return []
    return sorted(paths)


def warn_slow_blas(paths: List[str]) -> None:
    """Debian's reference BLAS (libblas3) makes torch's matrix products about 12x slower than
    OpenBLAS: 0.84 s against 0.07 s for [8192 x 256] x [256 x 1024] on 2 threads, the default
    model's FFN product (docs/accuracy.md)."""
    fast = ("openblas", "mkl", "blis", "atlas")
    if paths and not any(name in p.lower() for p in paths for name in fast):
        print(f"lm_train: warning: torch uses the reference BLAS ({', '.join(paths)}); the default model trains "
              f"about 12x slower than with OpenBLAS (Debian: apt-get install libopenblas0-pthread)", file=sys.stderr)


def quick_corpus(out: str) -> str:
    """The --quick corpus: a synthetic source tree built into out/corpus (seconds)."""
    src, corpus = os.path.join(out, "corpus-src"), os.path.join(out, "corpus")
    if not os.path.exists(os.path.join(corpus, "manifest.json")):
        text_corpus.synthetic_tree(src, QUICK_FILES, seed=0)
        text_corpus.build(src, corpus)
    return corpus


def load_checkpoint(path: str) -> Dict:
    if not os.path.exists(path):
        raise FileNotFoundError(f"lm_train: checkpoint {path!r} does not exist")
    ck = torch.load(path)
    if ck.get("kind") != "lm":
        raise ValueError(f"lm_train: {path} is not a checkpoint of lm_train.py")
    return ck


def corpus_for(cfg: Dict, split: str, override: Optional[str] = None) -> List[Tuple[str, bytes]]:
    """A split of the run's corpus (or of `override`), checked against the SHA-256 the run recorded."""
    corpus = override or cfg["corpus"]
    docs = text_corpus.load_split(corpus, split)
    want = cfg["corpus_sha256"][split]
    got = text_corpus.read_manifest(corpus)["splits"][split]["sha256"]
    if got != want:
        raise ValueError(f"lm_train: {corpus} split {split} has SHA-256 {got}, but the model was trained with "
                         f"a corpus whose {split} split has {want}")
    return docs


def build_config(args) -> Dict:
    """The run's settings. From scratch: the command line, else --quick's or the default values.
    From --init: the architecture, corpus and data position of the initialising run, and its other
    settings (batch, lr, ...) unless given; the steps must be given (--steps or --budget-bytes)."""
    base = dict(DEFAULTS, **QUICK) if args.quick else dict(DEFAULTS)
    given = {k: getattr(args, k) for k in ARCH_KEYS + RUN_OPTS if getattr(args, k) is not None}
    if args.steps is not None and args.budget_bytes is not None:
        raise ValueError("lm_train: give --steps or --budget-bytes, not both")
    if args.init:
        init = load_checkpoint(args.init)
        cfg = dict(init["config"])
        clash = [k for k in ARCH_KEYS if k in given and given[k] != cfg[k]] + (["corpus"] if args.corpus else [])
        if clash:
            raise ValueError(f"lm_train: --init takes the architecture and corpus from {args.init}; "
                             f"drop --{', --'.join(k.replace('_', '-') for k in clash)}")
        cfg.update(given)
        cfg.update({"data_start": cfg["data_start"] + init["step"], "init": os.path.abspath(args.init),
                    "init_step": init["step"]})
    else:
        cfg = {k: given.get(k, base[k]) for k in ARCH_KEYS + RUN_OPTS}
        if cfg["kv_heads"] is None:
            cfg["kv_heads"] = cfg["heads"]
        corpus = args.corpus or (quick_corpus(args.out) if args.quick else None)
        if corpus is None:
            raise ValueError("lm_train: --corpus is required (build one with tools/train/text_corpus.py build)")
        manifest = text_corpus.read_manifest(corpus)
        cfg.update({"corpus": os.path.abspath(corpus), "python_version": manifest["python_version"],
                    "corpus_sha256": {s: v["sha256"] for s, v in manifest["splits"].items()},
                    "data_start": 0, "init": None, "init_step": 0})
    cfg["attention"] = args.attention or "dense"
    if args.steps is not None:
        cfg["steps"] = args.steps
    elif args.budget_bytes is not None:
        cfg["steps"] = args.budget_bytes // (cfg["batch"] * cfg["ctx"])
    elif args.quick:
        cfg["steps"] = QUICK["steps"]
    elif args.init:
        raise ValueError("lm_train: a run from --init needs --steps or --budget-bytes")
    else:
        cfg["steps"] = DEFAULT_BUDGET // (cfg["batch"] * cfg["ctx"])
    if cfg["steps"] < 1:
        raise ValueError(f"lm_train: the run has {cfg['steps']} steps; it needs at least one "
                         f"(--budget-bytes at least --batch x --ctx = {cfg['batch'] * cfg['ctx']})")
    cfg["train_bytes"] = cfg["steps"] * cfg["batch"] * cfg["ctx"]
    cfg["eval_every"] = args.eval_every or (QUICK["eval_every"] if args.quick else max(1, cfg["steps"] // 10))
    cfg["quick"] = bool(args.quick)
    check_config(cfg)
    return cfg


def cmd_train(args) -> int:
    torch.set_num_threads(args.threads)
    if args.resume:
        clash = [k for k in RUN_KEYS if getattr(args, k, None) not in (None, False)]
        if clash:
            raise ValueError(f"lm_train: --resume continues {args.resume} with its own settings; drop "
                             f"--{', --'.join(k.replace('_', '-') for k in clash)}")
        ck = load_checkpoint(args.resume)
        if ck.get("opt") is None:
            raise ValueError(f"lm_train: {args.resume} is a finished run's final checkpoint; resume from last.pt")
        cfg, log, start = ck["config"], ck["log"], ck["step"]
        out = args.out or os.path.dirname(os.path.abspath(args.resume))
    else:
        if not args.out:
            raise ValueError("lm_train: --out is required")
        cfg = build_config(args)
        log, start, ck, out = {"val": [], "seconds": 0.0, "cpu_seconds": 0.0, "eval_seconds": 0.0, "wall_seconds": 0.0,
                               "resumes": 0}, 0, None, args.out
    os.makedirs(out, exist_ok=True)
    torch.manual_seed(cfg["seed"])
    model = ByteLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], betas=(0.9, 0.95), weight_decay=cfg["weight_decay"])
    if ck is not None:
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        log["resumes"] += 1
    elif cfg["init"]:
        model.load_state_dict(load_checkpoint(cfg["init"])["model"])
    model.pattern = cfg["attention"]
    batches = Batches(doc_stream(corpus_for(cfg, "train")), cfg["ctx"], cfg["batch"], cfg["seed"])
    val = val_subset(corpus_for(cfg, "val"), cfg["val_bytes"])
    log["val_docs"], log["val_bytes"] = len(val), sum(len(d) for _, d in val)
    log.setdefault("blas", []).append(blas_libraries())  # per process: a resumed run may differ
    if not cfg["quick"]:
        warn_slow_blas(log["blas"][-1])

    def validate(step: int) -> None:
        t = time.time()
        bpb = score(model, val, cfg["ctx"], cfg["batch"])["bpb"]
        log["eval_seconds"] += time.time() - t
        # The training bpb averaged over the steps since the previous validation (None at step 0).
        since = log.pop("since", None)
        train_bpb = since[0] / since[1] if since else None
        log["val"].append({"step": step, "bpb": bpb, "train_bpb": train_bpb, "seconds": log["seconds"]})

    if start == 0 and cfg["init"] and not log["val"]:
        validate(0)  # the initialising model under this run's attention, before any update
    t_proc, wall0 = time.time(), log["wall_seconds"]

    def checkpoint(name: str, opt_state) -> str:
        log["wall_seconds"] = wall0 + time.time() - t_proc
        path = os.path.join(out, name)
        save_atomic(path, {"kind": "lm", "model": model.state_dict(), "opt": opt_state, "config": cfg, "log": log,
                           "step": step})
        return path

    stop = {"now": False}
    signal.signal(signal.SIGINT, lambda *_: stop.update(now=True))
    prog = Progress(cfg["steps"], args.quiet, start)
    step = start
    while step < cfg["steps"] and not stop["now"]:
        t, c = time.time(), time.process_time()
        x, y = batches.get(cfg["data_start"] + step)
        for g in opt.param_groups:
            g["lr"] = lr_at(cfg, step)
        loss = F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        log["seconds"] += time.time() - t
        # CPU time of all threads: with wall time, says how much of the machine a run had.
        log["cpu_seconds"] += time.process_time() - c
        bpb = loss.item() / LN2
        # Running training bpb: an exponential average over about the last 50 steps.
        log["run_bpb"] = bpb if log.get("run_bpb") is None else 0.98 * log["run_bpb"] + 0.02 * bpb
        since = log.get("since", [0.0, 0])
        log["since"] = [since[0] + bpb, since[1] + 1]
        if step % cfg["eval_every"] == 0 or step == cfg["steps"]:
            validate(step)
        val_text = f" val {log['val'][-1]['bpb']:.3f}" if log["val"] else ""
        prog.update(step, f"train bpb {log['run_bpb']:.3f}{val_text}")
        if step % args.save_every == 0 and step < cfg["steps"]:
            checkpoint("last.pt", opt.state_dict())
    prog.close()
    if stop["now"] and step < cfg["steps"]:
        path = checkpoint("last.pt", opt.state_dict())
        print(f"interrupted at step {step}: checkpoint {path}; continue with "
              f"lm_train.py train --resume {path}", flush=True)
        return 130
    log["steps_done"] = step
    log["seconds_per_step"], log["cpu_seconds_per_step"] = log["seconds"] / step, log["cpu_seconds"] / step
    checkpoint("final.pt", None)
    with open(os.path.join(out, "log.json"), "w") as f:
        json.dump({"config": cfg, **log}, f, indent=1)
    print(json.dumps({"attention": cfg["attention"], "steps": step, "train_bytes": cfg["train_bytes"],
                      "val_bpb": log["val"][-1]["bpb"], "minutes": round(log["seconds"] / 60, 2),
                      "seconds_per_step": round(log["seconds_per_step"], 3),
                      "cpu_seconds_per_step": round(log["cpu_seconds_per_step"], 3), "out": out}))
    return 0


def cmd_eval(args) -> int:
    torch.set_num_threads(args.threads)
    ck = load_checkpoint(args.checkpoint)
    cfg = ck["config"]
    docs = corpus_for(cfg, args.split, args.corpus)
    model = ByteLM(cfg)
    model.load_state_dict(ck["model"])
    result = {"checkpoint": os.path.abspath(args.checkpoint), "trained_with": cfg["attention"], "step": ck["step"],
              "split": args.split, "split_sha256": cfg["corpus_sha256"][args.split], "ctx": cfg["ctx"],
              "results": {}}
    summary = {}
    for pattern in args.attention:
        model.pattern = pattern
        t = time.time()
        r = score(model, docs, cfg["ctx"], args.batch)
        r["seconds"] = time.time() - t
        result["results"][pattern] = r
        summary[pattern] = round(r["bpb"], 5)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f)
    print(json.dumps({"checkpoint": args.checkpoint, "split": args.split, "bpb": summary}))
    return 0


def cmd_capture(args) -> int:
    """Q, K, V (after RoPE, as dfss.attention receives them) of chosen layers on the first window of
    the longest documents of a split, as [1, ctx, H, d] float16 .npy files for `dfss quality --causal`."""
    import numpy as np

    torch.set_num_threads(args.threads)
    ck = load_checkpoint(args.checkpoint)
    cfg = ck["config"]
    docs = corpus_for(cfg, args.split, args.corpus)
    layers = args.layers if args.layers is not None else list(range(cfg["layers"]))
    bad = [l for l in layers if not 0 <= l < cfg["layers"]]
    if bad:
        raise ValueError(f"lm_train: --layers {bad} out of range: the model has layers 0..{cfg['layers'] - 1}")
    if args.windows < 1:
        raise ValueError(f"lm_train: --windows must be >= 1, got {args.windows}")
    model = ByteLM(cfg)
    model.load_state_dict(ck["model"])
    model.pattern = args.attention
    model.eval()
    longest = sorted(range(len(docs)), key=lambda i: (-len(docs[i][1]), docs[i][0]))[:args.windows]
    os.makedirs(args.out, exist_ok=True)
    written = []
    for n, i in enumerate(longest):
        path, data = docs[i]
        tokens = torch.frombuffer(bytearray(bytes([text_corpus.BOS]) + data[:cfg["ctx"] - 1]), dtype=torch.uint8)
        captured: list = []
        for blk in model.blocks:
            blk.capture = captured
        with torch.no_grad():
            model(tokens.long()[None])
        for blk in model.blocks:
            blk.capture = None
        for layer in layers:
            for name, x in zip("qkv", captured[layer]):
                np.save(os.path.join(args.out, f"w{n}-layer{layer}-{name}.npy"), x.to(torch.float16).numpy())
            written.append({"name": f"w{n}-layer{layer}", "document": path, "tokens": len(tokens)})
    note = {"checkpoint": os.path.abspath(args.checkpoint), "attention": args.attention, "split": args.split,
            "split_sha256": cfg["corpus_sha256"][args.split], "layout": "[1, L, H, d] float16, q and k after RoPE",
            "causal": True, "inputs": written}
    with open(os.path.join(args.out, "capture.json"), "w") as f:
        json.dump(note, f, indent=1)
    print(json.dumps({"out": args.out, "inputs": [w["name"] for w in written]}))
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    tr = sub.add_parser("train", help="train, finetune (--init) or continue (--resume) a model")
    tr.add_argument("--corpus", help="text_corpus.py build's output directory")
    tr.add_argument("--attention", help="dense (default), 1:2, 2:4 or any N:M")
    tr.add_argument("--init", help="checkpoint to start from (architecture, corpus and data position reused)")
    tr.add_argument("--resume", help="last.pt of an interrupted run: continue it with its own settings")
    tr.add_argument("--budget-bytes", type=int, help=f"training bytes, steps = bytes / (batch x ctx) "
                                                     f"(default {DEFAULT_BUDGET})")
    tr.add_argument("--steps", type=int, help="optimizer steps (instead of --budget-bytes)")
    tr.add_argument("--layers", type=int)
    tr.add_argument("--dim", type=int)
    tr.add_argument("--heads", type=int)
    tr.add_argument("--kv-heads", type=int, help="K/V heads (grouped-query attention; default --heads)")
    tr.add_argument("--ffn", type=int)
    tr.add_argument("--ctx", type=int, help="context (window) length in bytes")
    tr.add_argument("--tie", action="store_const", const=True, help="tie the output layer to the byte embedding")
    tr.add_argument("--batch", type=int)
    tr.add_argument("--lr", type=float)
    tr.add_argument("--warmup", type=float, help="warmup, a fraction of the steps")
    tr.add_argument("--min-lr", type=float, help="final learning rate of the cosine, a fraction of --lr")
    tr.add_argument("--weight-decay", type=float)
    tr.add_argument("--seed", type=int, help="initialisation and data order")
    tr.add_argument("--val-bytes", type=int, help="validation bytes evaluated during training")
    tr.add_argument("--eval-every", type=int, help="steps between validations (default steps / 10)")
    tr.add_argument("--save-every", type=int, default=None, help="steps between last.pt checkpoints (default 50)")
    tr.add_argument("--threads", type=int, default=2)
    tr.add_argument("--out", help="run directory (default with --resume: the checkpoint's)")
    tr.add_argument("--quiet", action="store_true")
    tr.add_argument("--quick", action="store_const", const=True,
                    help="CI: synthetic corpus (unless --corpus), tiny model, 20 steps")
    ev = sub.add_parser("eval", help="bits per byte of a checkpoint on a split under one or more patterns")
    ev.add_argument("--checkpoint", required=True)
    ev.add_argument("--attention", nargs="+", default=["dense", "1:2", "2:4"])
    ev.add_argument("--split", default="test", choices=text_corpus.SPLITS)
    ev.add_argument("--corpus", help="the corpus directory, if not where the run recorded it (hashes are checked)")
    ev.add_argument("--batch", type=int, default=8)
    ev.add_argument("--threads", type=int, default=2)
    ev.add_argument("--out", help="JSON file: per-document bits and bytes, bits by position")
    cap = sub.add_parser("capture", help="Q, K, V of chosen layers as float16 .npy for dfss quality --causal")
    cap.add_argument("--checkpoint", required=True)
    cap.add_argument("--layers", type=int, nargs="+", help="layers to write (default all)")
    cap.add_argument("--windows", type=int, default=1, help="one window from each of the N longest documents")
    cap.add_argument("--attention", default="dense", help="pattern the model runs with while capturing")
    cap.add_argument("--split", default="test", choices=text_corpus.SPLITS)
    cap.add_argument("--corpus")
    cap.add_argument("--threads", type=int, default=2)
    cap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    if args.cmd == "train" and args.save_every is None:
        args.save_every = QUICK["save_every"] if args.quick else 50  # 50 steps: about 2 min of the default run
    if getattr(args, "threads", 1) < 1:
        ap.error(f"--threads must be >= 1, got {args.threads}")
    if args.cmd == "train" and args.save_every < 1:
        ap.error(f"--save-every must be >= 1, got {args.save_every}")
    try:
        return {"train": cmd_train, "eval": cmd_eval, "capture": cmd_capture}[args.cmd](args)
    except (ValueError, FileNotFoundError) as exc:
        print(str(exc), file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
