#!/usr/bin/env python3
"""Plots `dfss bench --json` output as an SVG: speedup vs dfss dense fused against L.

One line per dfss pattern/algorithm (and ISA when several were measured) and per PyTorch peer;
the dense fused baseline is the horizontal line at 1. The x axis is log2(L); the y axis is linear
and starts at 0. Standard library only (hand-written SVG, no matplotlib).

Usage:
  build/tools/dfss bench --json bench.json
  python3 tools/bench/plot_speedup.py bench.json docs/bench_speedup.svg [--title TEXT]
"""
import argparse
import json
import math
import sys
from xml.sax.saxutils import escape

PALETTE = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf",
           "#7f7f7f", "#bcbd22", "#393b79", "#637939"]


def series_name(r):
    if r["source"] == "dfss":
        name = "dfss %s %s" % (r["pattern"], r["algorithm"])
        if r.get("isa") not in (None, "-", "automatic"):
            name += " (%s)" % r["isa"]
        return name
    return r["algorithm"]


def nice_step(span, ticks=6):
    raw = span / ticks
    mag = 10 ** math.floor(math.log10(raw))
    for m in (1, 2, 2.5, 5, 10):
        if raw <= m * mag:
            return m * mag
    return 10 * mag


def plot(data, title):
    series = {}
    order = []
    for r in data["rows"]:
        if not r.get("ok") or r.get("speedup_vs_dense_fused") is None:
            continue
        name = series_name(r)
        if name not in series:
            series[name] = []
            order.append(name)
        series[name].append((r["L"], r["speedup_vs_dense_fused"]))
    if not series:
        raise SystemExit("plot_speedup.py: no rows with a speedup in the input")
    lengths = sorted({L for pts in series.values() for L, _ in pts})
    ymax = max(s for pts in series.values() for _, s in pts)
    step = nice_step(max(ymax, 1.0) * 1.1)
    ytop = step * math.ceil(max(ymax, 1.0) * 1.05 / step)

    W, H = 1000, 520
    left, right, top, bottom = 70, 360, 50, 60
    pw, ph = W - left - right, H - top - bottom
    lo, hi = math.log2(lengths[0]), math.log2(lengths[-1])
    if hi == lo:
        lo, hi = lo - 1, hi + 1

    def x(L):
        return left + (math.log2(L) - lo) / (hi - lo) * pw

    def y(s):
        return top + ph - s / ytop * ph

    out = []
    out.append('<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" viewBox="0 0 %d %d" '
               'font-family="DejaVu Sans, Arial, sans-serif" font-size="12">' % (W, H, W, H))
    out.append('<rect width="100%" height="100%" fill="white"/>')
    out.append('<text x="%d" y="24" font-size="15" font-weight="bold">%s</text>' % (left, escape(title)))
    # Grid and axes.
    v = 0.0
    while v <= ytop + 1e-9:
        out.append('<line x1="%.1f" y1="%.1f" x2="%.1f" y2="%.1f" stroke="#e0e0e0"/>' % (left, y(v), left + pw, y(v)))
        out.append('<text x="%.1f" y="%.1f" text-anchor="end">%g</text>' % (left - 6, y(v) + 4, round(v, 3)))
        v += step
    for L in lengths:
        out.append('<line x1="%.1f" y1="%.1f" x2="%.1f" y2="%.1f" stroke="#e0e0e0"/>' % (x(L), top, x(L), top + ph))
        out.append('<text x="%.1f" y="%.1f" text-anchor="middle">%d</text>' % (x(L), top + ph + 18, L))
    out.append('<rect x="%d" y="%d" width="%d" height="%d" fill="none" stroke="#333"/>' % (left, top, pw, ph))
    out.append('<line x1="%.1f" y1="%.1f" x2="%.1f" y2="%.1f" stroke="#333" stroke-dasharray="4 3"/>'
               % (left, y(1.0), left + pw, y(1.0)))
    out.append('<text x="%.1f" y="%d" text-anchor="middle">sequence length L (log scale)</text>'
               % (left + pw / 2, H - 18))
    out.append('<text transform="translate(18 %.1f) rotate(-90)" text-anchor="middle">'
               'speedup vs dfss dense fused (higher is faster)</text>' % (top + ph / 2))
    # Series.
    for i, name in enumerate(order):
        color = PALETTE[i % len(PALETTE)]
        dash = "" if name.startswith("dfss") else ' stroke-dasharray="6 3"'
        pts = sorted(series[name])
        path = " ".join("%.1f,%.1f" % (x(L), y(s)) for L, s in pts)
        out.append('<polyline points="%s" fill="none" stroke="%s" stroke-width="2"%s/>' % (path, color, dash))
        for L, s in pts:
            out.append('<circle cx="%.1f" cy="%.1f" r="3" fill="%s"><title>%s L=%d: %.2fx</title></circle>'
                       % (x(L), y(s), color, escape(name), L, s))
        ly = top + 10 + i * 20
        out.append('<line x1="%d" y1="%d" x2="%d" y2="%d" stroke="%s" stroke-width="2"%s/>'
                   % (left + pw + 15, ly, left + pw + 40, ly, color, dash))
        out.append('<text x="%d" y="%d">%s</text>' % (left + pw + 46, ly + 4, escape(name)))
    # Footer: where the numbers come from.
    foot = "%s; %s; commit %s" % (data.get("date", ""), data.get("machine", {}).get("cpu", ""), data.get("commit", ""))
    out.append('<text x="%d" y="%d" font-size="10" fill="#555">%s</text>' % (left, H - 4, escape(foot)))
    out.append("</svg>")
    return "\n".join(out) + "\n"


def main(argv):
    ap = argparse.ArgumentParser(description="SVG of speedup vs dfss dense fused against L")
    ap.add_argument("json", help="output of dfss bench --json")
    ap.add_argument("svg", help="SVG file to write")
    ap.add_argument("--title", default=None)
    a = ap.parse_args(argv)
    with open(a.json) as f:
        data = json.load(f)
    cfg = data.get("config", {})
    rows = [r for r in data.get("rows", []) if r.get("source") == "dfss"]
    shape = ""
    if rows:
        shape = "B=%d H=%d d=%d, " % (rows[0]["B"], rows[0]["H"], rows[0]["d"])
    title = a.title or "DFSS attention forward on the CPU: %s%s, %s threads" % (
        shape, cfg.get("dtype", "f32"), cfg.get("threads", "?"))
    with open(a.svg, "w") as f:
        f.write(plot(data, title))
    print("wrote %s" % a.svg)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
