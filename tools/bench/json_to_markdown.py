#!/usr/bin/env python3
"""Turns `dfss bench --json` output into the Markdown table kept in docs/benchmarks.md.

Usage: json_to_markdown.py bench.json > table.md   (standard library only)
"""
import json
import sys


def fmt_err(x):
    return "n/a" if x is None else f"{x:.1e}"


def main(path):
    d = json.load(open(path))
    print(f"- Date: {d['date']}. Commit: `{d['commit']}`. Command: `{d['command']}`.")
    m = d.get("machine", {})
    if m:
        print(f"- Machine: {json.dumps(m)}")
    s = d.get("sgemm") or {}
    if s.get("ok"):
        print(f"- sgemm yardstick: `cblas_sgemm` {s['n']}^3 ({s['library']}, {s['corename']}), median of "
              f"{s['calls']} calls spread over the run: {s['gflops']:.1f} GFLOP/s.")
    print()
    print("| L | pattern | algorithm / peer | kernel | iters | ms median | ms min | ms max | GFLOP/s | speedup | max err |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in d["rows"]:
        if not r.get("ok", True):
            print(f"| {r['L']} | {r['pattern']} | {r.get('algorithm', r.get('peer', ''))} | unsupported: {r.get('reason', '')} |"
                  " | | | | | | |")
            continue
        name = r.get("algorithm") if r.get("source") == "dfss" else r.get("peer", r.get("algorithm", ""))
        print(f"| {r['L']} | {r['pattern']} | {name} | {r.get('kernel', '')} | {r['iters']} | {r['ms_median']:.4g} | "
              f"{r['ms_min']:.4g} | {r['ms_max']:.4g} | {r['gflops']:.1f} | {r['speedup_vs_dense_fused']:.2f}x | "
              f"{fmt_err(r.get('max_err'))} |")


if __name__ == "__main__":
    main(sys.argv[1])
