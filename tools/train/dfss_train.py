#!/usr/bin/env python3
"""dfss-train: the accuracy experiment of issue 7 with dfss's own kernels in training and evaluation.

A small transformer encoder classifies long sequences (ListOps, associative recall; see tasks.py).
Its self-attention is dfss.attention with pattern dense, 1:2 or 2:4 (the CPU fused forward and
backward), so the same kernels that users run are the ones trained and evaluated here.

  dfss_train.py train --task listops --attention dense --steps 3000 --out runs/listops-dense
  dfss_train.py train --task listops --attention 2:4 --init runs/listops-dense/final.pt --steps 600 --out runs/listops-ft24
  dfss_train.py eval  --checkpoint runs/listops-dense/final.pt --attention 1:2
  dfss_train.py capture --checkpoint runs/listops-dense/final.pt --out runs/qkv   (for dfss quality)
  dfss_train.py train --quick ...        (CI: a few steps on short sequences, end to end)

Runs are reproducible from --seed (data, initialisation and batch order; dfss's kernels are
deterministic for any thread count). Ctrl-C saves a usable checkpoint (interrupted.pt) and the log.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import time
from typing import Dict, List, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tasks  # noqa: E402
from common import Progress, save_atomic  # noqa: E402

import dfss  # noqa: E402


class Block(nn.Module):
    """Pre-LayerNorm encoder block whose attention is dfss.attention with a switchable pattern."""

    def __init__(self, dim: int, heads: int, ffn: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)
        self.ff = nn.Sequential(nn.Linear(dim, ffn), nn.GELU(), nn.Linear(ffn, dim))

    def forward(self, x: torch.Tensor, key_lengths: torch.Tensor, pattern: str) -> torch.Tensor:
        b, l, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, l, 3, self.heads, d // self.heads).unbind(2)
        # [B, L, H, d] layout; right padding is masked by key_lengths (no L x L mask tensor).
        a = dfss.attention(q, k, v, pattern=pattern, key_lengths=key_lengths, layout="blhd")
        x = x + self.out(a.reshape(b, l, d))
        return x + self.ff(self.ln2(x))


class Encoder(nn.Module):
    def __init__(self, vocab: int, dim: int, heads: int, layers: int, ffn: int, max_len: int, classes: int,
                 pool: str = "mean", factored: bool = False):
        super().__init__()
        self.pool = pool
        self.factored = factored
        if factored:
            # Recall tokens are (key, value slot) pairs: embedded as key + slot, so that a query and
            # the pair it asks for share the key's embedding (tasks.py); other tokens as usual.
            self.embed = nn.Embedding(tasks.RECALL0, dim)
            self.key_embed = nn.Embedding(tasks.NUM_KEYS, dim)
            self.slot_embed = nn.Embedding(tasks.SLOTS, dim)
        else:
            self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(max_len, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, ffn) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)
        self.pattern = "dense"

    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        if not self.factored:
            return self.embed(tokens)
        recall = tokens >= tasks.RECALL0
        rel = (tokens - tasks.RECALL0).clamp(min=0)
        pair = self.key_embed(rel // tasks.SLOTS) + self.slot_embed(rel % tasks.SLOTS)
        return torch.where(recall[..., None], pair, self.embed(tokens.clamp(max=tasks.RECALL0 - 1)))

    def forward(self, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.embed_tokens(tokens) + self.pos(pos)[None]
        for blk in self.blocks:
            x = blk(x, lengths, self.pattern)
        x = self.ln(x)
        if self.pool == "last":
            # The last valid position (recall: the query key, which must fetch its value).
            pooled = x[torch.arange(x.shape[0]), lengths - 1]
        else:
            # Mean over the valid positions: every token's representation can carry the answer.
            mask = (pos[None, :] < lengths[:, None]).to(x.dtype)[..., None]
            pooled = (x * mask).sum(1) / lengths[:, None].to(x.dtype)
        return self.head(pooled)


def batches(split: tasks.Split, batch: int, gen: Optional[torch.Generator]):
    """Length-bucketed batches (sorted within chunks of 50 batches, shuffled order) to limit padding."""
    n = len(split.labels)
    order = torch.randperm(n, generator=gen).tolist() if gen is not None else list(range(n))
    chunk = batch * 50
    groups = []
    for c in range(0, n, chunk):
        part = sorted(order[c:c + chunk], key=lambda i: len(split.tokens[i]))
        groups += [part[i:i + batch] for i in range(0, len(part), batch)]
    if gen is not None:
        groups = [groups[i] for i in torch.randperm(len(groups), generator=gen).tolist()]
    for idx in groups:
        lens = [len(split.tokens[i]) for i in idx]
        t = torch.full((len(idx), max(lens)), tasks.PAD, dtype=torch.long)
        for r, i in enumerate(idx):
            t[r, :lens[r]] = torch.tensor(split.tokens[i])
        yield t, torch.tensor(lens, dtype=torch.int64), torch.tensor([split.labels[i] for i in idx])


@torch.no_grad()
def evaluate(model: Encoder, split: tasks.Split, batch: int) -> float:
    model.eval()
    right = 0
    for t, lens, y in batches(split, batch, None):
        right += (model(t, lens).argmax(-1) == y).sum().item()
    model.train()
    return right / len(split.labels)


def build(cfg: Dict) -> Encoder:
    # Checkpoints record their vocabulary size (44 before the recall task had its own keys) and
    # whether recall tokens are embedded as key + value slot.
    return Encoder(cfg.get("vocab", 44), cfg["dim"], cfg["heads"], cfg["layers"], cfg["ffn"], cfg["max_len"], tasks.NUM_CLASSES,
                   cfg.get("pool", "mean"), cfg.get("embedding", "token") == "factored")


def data_for(cfg: Dict):
    return tasks.make_splits(cfg["task"], cfg["data_seed"], (cfg["train_size"], cfg["val_size"], cfg["test_size"]),
                             cfg["min_len"], cfg["max_len"])


def save(path: str, model: Encoder, opt, cfg: Dict, log: Dict, step: int) -> None:
    save_atomic(path, {"model": model.state_dict(), "opt": opt.state_dict() if opt else None, "config": cfg,
                       "log": log, "step": step})


def cmd_train(args) -> int:
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    init = torch.load(args.init) if args.init else None
    if init is not None:
        cfg = dict(init["config"])  # architecture and data come from the dense-trained model
    else:
        cfg = {"task": args.task, "dim": args.dim, "heads": args.heads, "layers": args.layers, "ffn": args.ffn,
               "min_len": args.min_len, "max_len": args.max_len, "data_seed": args.data_seed,
               "train_size": args.train_size, "val_size": args.val_size, "test_size": args.test_size,
               "pool": "last" if args.task == "recall" else "mean", "vocab": tasks.VOCAB,
               "embedding": "factored" if args.task == "recall" else "token"}
    cfg.update({"attention": args.attention, "steps": args.steps, "lr": args.lr, "batch": args.batch,
                "seed": args.seed, "init": args.init, "curriculum_steps": args.curriculum_steps,
                "curriculum_len": args.curriculum_len})
    train, val, test = data_for(cfg)
    # Curriculum: the first steps train on short sequences of the same task (a fourth, disjoint seed
    # stream), where the one relevant key is a large share of a row's attention from the start.
    short = tasks.TASKS[cfg["task"]](args.curriculum_steps * args.batch, cfg["data_seed"] * 1000 + 3,
                                     min_len=args.curriculum_len[0], max_len=args.curriculum_len[1]) \
        if args.curriculum_steps else None
    model = build(cfg)
    if init is not None:
        model.load_state_dict(init["model"])
    model.pattern = args.attention
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    warm = max(1, args.steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / args.steps))))
    os.makedirs(args.out, exist_ok=True)
    log = {"config": cfg, "val": [], "threads": args.threads}
    if init is not None:
        log["val"].append({"step": 0, "acc": evaluate(model, val, args.batch)})
    stop = {"now": False}
    signal.signal(signal.SIGINT, lambda *_: stop.update(now=True))
    gen = torch.Generator().manual_seed(args.seed)
    prog = Progress(args.steps, args.quiet)
    step, t0, run_loss, run_acc = 0, time.time(), None, None
    it = iter(())  # an exhausted iterator: the loop starts the first epoch (of `short` or `train`)
    in_curriculum = short is not None
    while step < args.steps and not stop["now"]:
        if in_curriculum and step == args.curriculum_steps:
            it, in_curriculum = iter(()), False
        try:
            t, lens, y = next(it)
        except StopIteration:
            it = batches(short if in_curriculum else train, args.batch, gen)
            continue
        logits = model(t, lens)
        loss = F.cross_entropy(logits, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        step += 1
        acc = (logits.argmax(-1) == y).float().mean().item()
        run_loss = loss.item() if run_loss is None else 0.98 * run_loss + 0.02 * loss.item()
        run_acc = acc if run_acc is None else 0.98 * run_acc + 0.02 * acc
        extra = f"val {log['val'][-1]['acc']:.3f}" if log["val"] else ""
        prog.update(step, f"loss {run_loss:.3f} acc {run_acc:.3f} {extra}")
        if step % args.eval_every == 0 or step == args.steps:
            log["val"].append({"step": step, "acc": evaluate(model, val, args.batch), "loss": run_loss,
                               "seconds": time.time() - t0})
            save(os.path.join(args.out, "last.pt"), model, opt, cfg, log, step)
    prog.close()
    log["train_seconds"] = time.time() - t0
    log["steps_done"] = step
    if stop["now"]:
        save(os.path.join(args.out, "interrupted.pt"), model, opt, cfg, log, step)
        print(f"interrupted at step {step}: checkpoint {os.path.join(args.out, 'interrupted.pt')}")
        return 130
    log["test_acc"] = evaluate(model, test, args.batch)
    save(os.path.join(args.out, "final.pt"), model, None, cfg, log, step)
    with open(os.path.join(args.out, "log.json"), "w") as f:
        json.dump(log, f, indent=1)
    print(json.dumps({"task": cfg["task"], "attention": args.attention, "steps": step,
                      "val_acc": log["val"][-1]["acc"] if log["val"] else None, "test_acc": log["test_acc"],
                      "minutes": round(log["train_seconds"] / 60, 2)}))
    return 0


def cmd_eval(args) -> int:
    torch.set_num_threads(args.threads)
    ck = torch.load(args.checkpoint)
    cfg = ck["config"]
    _, val, test = data_for(cfg)
    model = build(cfg)
    model.load_state_dict(ck["model"])
    out = {"checkpoint": args.checkpoint, "trained_with": cfg.get("attention")}
    for pattern in args.attention:
        model.pattern = pattern
        out[pattern] = {"val_acc": evaluate(model, val, args.batch), "test_acc": evaluate(model, test, args.batch)}
    print(json.dumps(out))
    return 0


def cmd_capture(args) -> int:
    """Writes the attention inputs (Q, K, V as [1, L, H, d] float32 .npy) of every layer of the model
    on test examples, for `dfss quality` on real attention inputs."""
    import numpy as np

    torch.set_num_threads(args.threads)
    ck = torch.load(args.checkpoint)
    cfg = ck["config"]
    _, _, test = data_for(cfg)
    model = build(cfg)
    model.load_state_dict(ck["model"])
    model.pattern = args.attention
    model.eval()
    captured: List = []

    def grab(block, inputs, output):
        x = inputs[0]
        b, l, d = x.shape
        q, k, v = block.qkv(block.ln1(x)).view(b, l, 3, block.heads, d // block.heads).unbind(2)
        captured.append((q, k, v))

    hooks = [blk.register_forward_hook(grab) for blk in model.blocks]
    os.makedirs(args.out, exist_ok=True)
    # The longest test examples: the most keys per row, where pruning has the most to choose from.
    order = sorted(range(len(test.labels)), key=lambda i: -len(test.tokens[i]))[:args.examples]
    written = []
    with torch.no_grad():
        for n, i in enumerate(order):
            captured.clear()
            t = torch.tensor([test.tokens[i]])
            model(t, torch.tensor([t.shape[1]]))
            for layer, (q, k, v) in enumerate(captured):
                for name, x in (("q", q), ("k", k), ("v", v)):
                    path = os.path.join(args.out, f"ex{n}-layer{layer}-{name}.npy")
                    np.save(path, x.float().numpy())
                written.append(f"ex{n}-layer{layer}")
    for h in hooks:
        h.remove()
    print(json.dumps({"checkpoint": args.checkpoint, "out": args.out, "inputs": written}))
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    tr = sub.add_parser("train", help="train (or finetune with --init) and evaluate on the test split")
    tr.add_argument("--task", choices=sorted(tasks.TASKS), default="listops")
    tr.add_argument("--attention", default="dense", help="dense, 1:2, 2:4 or any N:M")
    tr.add_argument("--init", help="checkpoint to finetune from (its architecture and data are reused)")
    tr.add_argument("--steps", type=int, default=None, help="optimizer steps (default 3000; 20 with --quick)")
    tr.add_argument("--batch", type=int, default=32)
    tr.add_argument("--lr", type=float, default=1e-3)
    tr.add_argument("--dim", type=int, default=64)
    tr.add_argument("--heads", type=int, default=4)
    tr.add_argument("--layers", type=int, default=2)
    tr.add_argument("--ffn", type=int, default=128)
    tr.add_argument("--min-len", type=int, default=128)
    tr.add_argument("--max-len", type=int, default=512)
    tr.add_argument("--train-size", type=int, default=20000)
    tr.add_argument("--val-size", type=int, default=1000)
    tr.add_argument("--test-size", type=int, default=2000)
    tr.add_argument("--eval-every", type=int, default=250)
    tr.add_argument("--curriculum-steps", type=int, default=0,
                    help="train the first N steps (of --steps) on short sequences (--curriculum-len)")
    tr.add_argument("--curriculum-len", type=int, nargs=2, default=[8, 64], metavar=("MIN", "MAX"))
    tr.add_argument("--seed", type=int, default=0, help="initialisation and batch order")
    tr.add_argument("--data-seed", type=int, default=1, help="dataset generation (splits use disjoint streams)")
    tr.add_argument("--threads", type=int, default=2)
    tr.add_argument("--out", required=True)
    tr.add_argument("--quiet", action="store_true")
    tr.add_argument("--quick", action="store_true", help="CI: tiny data, short sequences, a few steps")
    ev = sub.add_parser("eval", help="evaluate a checkpoint with one or more attention patterns")
    ev.add_argument("--checkpoint", required=True)
    ev.add_argument("--attention", nargs="+", default=["dense", "1:2", "2:4"])
    ev.add_argument("--batch", type=int, default=64)
    ev.add_argument("--threads", type=int, default=2)
    cap = sub.add_parser("capture", help="write Q, K, V of each layer on test examples as .npy (dfss quality)")
    cap.add_argument("--checkpoint", required=True)
    cap.add_argument("--attention", default="dense", help="pattern the model runs with while capturing")
    cap.add_argument("--examples", type=int, default=2)
    cap.add_argument("--threads", type=int, default=2)
    cap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    if args.cmd == "train" and args.quick:
        args.steps = 20 if args.steps is None else args.steps
        args.min_len, args.max_len = 32, 96
        args.train_size, args.val_size, args.test_size, args.eval_every = 640, 64, 64, 10
    elif args.cmd == "train" and args.steps is None:
        args.steps = 3000
    return {"train": cmd_train, "eval": cmd_eval, "capture": cmd_capture}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
