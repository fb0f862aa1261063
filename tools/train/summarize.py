#!/usr/bin/env python3
"""Summarises run_accuracy.sh results: the markdown table of docs/accuracy.md and an SVG plot of
validation accuracy against finetuning steps. Standard library only (hand-written SVG).

Usage: summarize.py RESULTS_DIR [RESULTS_DIR ...] --svg docs/accuracy_finetune.svg > table.md
Each RESULTS_DIR is run_accuracy.sh's OUT_DIR for one task (dense/, ft-2-4/, ft-1-2/, scratch-2-4/,
scratch-1-2/, dense-eval.json); a from-scratch run that is missing shows as "not run".
"""
import argparse
import json
import math
import os
from xml.sax.saxutils import escape

COLORS = {"ft-2-4": "#1f77b4", "ft-1-2": "#d62728"}


def load(d, name):
    with open(os.path.join(d, name, "log.json")) as f:
        return json.load(f)


def eval_json(d):
    with open(os.path.join(d, "dense-eval.json")) as f:
        return json.loads(f.read().strip().splitlines()[-1])


def label(log):
    c = log["config"]
    return f"{c['task']} (L {c['min_len']}-{c['max_len']})"


def pct(x):
    return f"{100 * x:.1f}"


def pct2(x):
    # Test splits of 2,000 sequences move in steps of 0.05 points: two decimals show them exactly.
    return f"{100 * x:.2f}"


def diff(x, base):
    return f"{100 * (x - base):+.2f}"


def table(dirs):
    out = ["| task | model | attention at test | steps | val acc % | test acc % | vs dense (pp) | wall time |",
           "|---|---|---|---|---|---|---|---|"]
    for d in dirs:
        dense = load(d, "dense")
        task = label(dense)
        ev = eval_json(d)
        base = dense["test_acc"]
        mins = lambda log: f"{log['train_seconds'] / 60:.1f} min"
        out.append(f"| {task} | dense-trained | dense | {dense['steps_done']} | {pct(dense['val'][-1]['acc'])} | "
                   f"{pct2(base)} | - | {mins(dense)} |")
        for p in ("1:2", "2:4"):
            out.append(f"| {task} | dense-trained, no finetuning | DFSS {p} | 0 | {pct(ev[p]['val_acc'])} | "
                       f"{pct2(ev[p]['test_acc'])} | {diff(ev[p]['test_acc'], base)} | - |")
        for p in ("1:2", "2:4"):
            ft = load(d, "ft-" + p.replace(":", "-"))
            out.append(f"| {task} | dense-trained + DFSS finetuning | DFSS {p} | {ft['steps_done']} "
                       f"({100 * ft['steps_done'] / dense['steps_done']:.0f}% of dense) | {pct(ft['val'][-1]['acc'])} | "
                       f"{pct2(ft['test_acc'])} | {diff(ft['test_acc'], base)} | {mins(ft)} |")
        for p in ("1:2", "2:4"):
            name = "scratch-" + p.replace(":", "-")
            if not os.path.exists(os.path.join(d, name, "log.json")):
                out.append(f"| {task} | DFSS-trained from scratch | DFSS {p} | not run | | | | |")
                continue
            sc = load(d, name)
            # The dense run's validation accuracy at the same step count, for a budget shorter than dense's.
            same = [v["acc"] for v in dense["val"] if v["step"] == sc["steps_done"]]
            note = f" (dense at step {sc['steps_done']}: val {pct(same[0])})" if same and sc["steps_done"] != dense["steps_done"] else ""
            out.append(f"| {task} | DFSS-trained from scratch | DFSS {p} | {sc['steps_done']}{note} | {pct(sc['val'][-1]['acc'])} | "
                       f"{pct2(sc['test_acc'])} | {diff(sc['test_acc'], base)} | {mins(sc)} |")
    return "\n".join(out)


def svg(dirs, path):
    panels = len(dirs)
    W, H = 480 * panels, 360
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="12">',
             f'<rect width="{W}" height="{H}" fill="white"/>']
    for n, d in enumerate(dirs):
        dense = load(d, "dense")
        x0, y0, pw, ph = 480 * n + 60, 40, 380, 260
        curves = {k: load(d, k)["val"] for k in ("ft-2-4", "ft-1-2")}
        xmax = max(v[-1]["step"] for v in curves.values())
        parts.append(f'<text x="{x0 + pw / 2}" y="22" text-anchor="middle" font-size="14">'
                     f'{escape(label(dense))}: validation accuracy during DFSS finetuning</text>')
        parts.append(f'<rect x="{x0}" y="{y0}" width="{pw}" height="{ph}" fill="none" stroke="#444"/>')
        # The y axis spans the data (whole points around it), not 0-100%: the differences that
        # matter here are fractions of a point.
        accs = [p["acc"] for v in curves.values() for p in v] + [dense["val"][-1]["acc"]]
        lo, hi = math.floor(100 * min(accs) - 1) / 100, math.ceil(100 * max(accs) + 1) / 100
        sx = lambda s: x0 + pw * s / xmax
        sy = lambda a: y0 + ph * (1 - (a - lo) / (hi - lo))
        for i in range(5):
            a = lo + (hi - lo) * i / 4
            parts.append(f'<line x1="{x0}" x2="{x0 + pw}" y1="{sy(a)}" y2="{sy(a)}" stroke="#ddd"/>')
            parts.append(f'<text x="{x0 - 6}" y="{sy(a) + 4}" text-anchor="end">{100 * a:.1f}%</text>')
        for s in (0, xmax // 2, xmax):
            parts.append(f'<text x="{sx(s)}" y="{y0 + ph + 16}" text-anchor="middle">{s}</text>')
        parts.append(f'<text x="{x0 + pw / 2}" y="{y0 + ph + 34}" text-anchor="middle">finetuning steps</text>')
        base = dense["val"][-1]["acc"]
        parts.append(f'<line x1="{x0}" x2="{x0 + pw}" y1="{sy(base)}" y2="{sy(base)}" stroke="#2ca02c" stroke-dasharray="6,4"/>')
        parts.append(f'<text x="{x0 + pw - 4}" y="{sy(base) - 5}" text-anchor="end" fill="#2ca02c">dense model {pct(base)}%</text>')
        for k, pts in curves.items():
            poly = " ".join(f"{sx(p['step']):.1f},{sy(p['acc']):.1f}" for p in pts)
            parts.append(f'<polyline points="{poly}" fill="none" stroke="{COLORS[k]}" stroke-width="2"/>')
            for p in pts:
                parts.append(f'<circle cx="{sx(p["step"]):.1f}" cy="{sy(p["acc"]):.1f}" r="3" fill="{COLORS[k]}"/>')
        for i, k in enumerate(("ft-2-4", "ft-1-2")):
            parts.append(f'<text x="{x0 + 10}" y="{y0 + 18 + 16 * i}" fill="{COLORS[k]}">'
                         f'DFSS {k[3:].replace("-", ":")} finetuned from dense</text>')
    parts.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(parts) + "\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dirs", nargs="+")
    ap.add_argument("--svg")
    args = ap.parse_args()
    print(table(args.dirs))
    if args.svg:
        svg(args.dirs, args.svg)


if __name__ == "__main__":
    main()
