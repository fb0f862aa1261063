#!/usr/bin/env python3
"""Markdown table of `dfss quality --json` runs on captured attention inputs: relative output error
of every method per input (rows) and pattern budget (column groups); the best non-top-k method of
each row in bold. Standard library only.

Usage: quality_table.py NAME=FILE.json [NAME=FILE.json ...] > table.md
"""
import json
import sys

METHODS = ["dfss", "topk", "window", "random", "bigbird", "performer", "nystrom"]


def main(args):
    runs = [(a.split("=", 1)[0], json.load(open(a.split("=", 1)[1]))) for a in args]
    patterns = sorted({r["pattern"] for _, d in runs for r in d["rows"]})
    head = "| input | pattern | " + " | ".join(METHODS) + " | DFSS lowest except top-k? |"
    print(head)
    print("|" + "---|" * (len(METHODS) + 3))
    for name, d in runs:
        for p in patterns:
            err = {r["method"]: r["rel_error"] for r in d["rows"] if r["pattern"] == p and r.get("supported", True)}
            others = {m: e for m, e in err.items() if m not in ("dfss", "topk")}
            best = min(others, key=others.get)
            cells = []
            for m in METHODS:
                if m not in err:
                    cells.append("n/a")
                    continue
                text = f"{err[m]:.4f}"
                cells.append(f"**{text}**" if m == "dfss" and err[m] < others[best] else text)
            verdict = "yes" if err["dfss"] < others[best] else f"no: {best} {others[best]:.4f}"
            print(f"| {name} | {p} | " + " | ".join(cells) + f" | {verdict} |")


if __name__ == "__main__":
    main(sys.argv[1:])
