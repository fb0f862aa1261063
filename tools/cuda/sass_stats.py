#!/usr/bin/env python3
"""Static SASS instruction counts of the CUDA attention kernels: a proxy for their speed that needs
no GPU (issue "GPU: a first run ...", part 2).

The SDDMM is bound by instruction issue, not by memory, so the instructions a warp issues per
32 x 32 tile of scores (32 query rows x 32 keys) are the figure to drive down. This script reads the
SASS of the compiled objects with `cuobjdump -sass`, and per kernel instance and architecture reports

  total     every instruction of the function (trailing NOP padding and the final self-branch left out)
  mma       tensor core instructions (HMMA, of which sparse ones are HMMA.SP)
  loop      instructions of the main loop body (see below), each instruction counted once (static)
  per tile  the warp's instructions per 32 x 32 score tile, from the kernel's tiling (KERNELS below)

The main loop is the outermost loop (a backward branch) that holds the kernel's tensor core
instructions (for the SDDMM, the first of its two such loops: the steady state); for a kernel
without them it is every outermost loop together. Loops nested inside the main loop count once, as
written: this is a static count, a proxy, not a cycle count.

Usage: sass_stats.py [--cuobjdump PATH] [--budget FILE] [--markdown] OBJECT...
With --budget, exits 1 when a kernel's per-tile count exceeds its ceiling in FILE (a regression
guard; the file also states each target). Exits 77 (CTest's "skipped") when no cuobjdump is found.
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field

# Per kernel family (the kernel's base name in the demangled symbol): how its per-tile figure is
# derived from the counts, with the tiling that justifies it. Each comment names the source.
KERNELS = {
    # src/cuda/sddmm_select.cu: each warp loops over 64-key steps, first those every row of the CTA
    # sees whole (the steady state, placed first), then the boundary steps with mask code. The first
    # loop's body holds one or both 32 x 32 units of a step (unrolled for d = 64, not for d = 128)
    # plus the step's copy and barriers; a unit is D / 2 HMMA (2 m16 x 4 n8 tiles x D / 16 k steps),
    # so the body's size times (D / 2) / (its HMMA count) is the cost of one tile (for one unit per
    # body, the step's share is counted whole: an upper bound).
    "sddmm_select_kernel": ("first_loop_per_mma", None),
    # src/cuda/spmm.cu: each step of the main loop covers 64 keys (kStepKeys) for the warp's 32 rows
    # and 64 output columns; a 32 x 32 score tile is half a step (for D = 128 two warps share the
    # tile's rows, one per 64 output columns, so the tile costs twice the per-warp figure).
    "spmm_kernel": ("loop", 0.5),
}

INSTR = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
BRANCH = re.compile(r"^(?:@!?U?P[T0-9]+\s+)?BRA(?:\.[A-Z.]+)?\s+(?:`?\(?\.?L?_?x?_?)?(0x[0-9a-f]+)")


@dataclass
class Function:
    arch: str
    symbol: str
    addrs: list = field(default_factory=list)
    ops: list = field(default_factory=list)


def run_cuobjdump(cuobjdump: str, obj: str) -> str:
    return subprocess.run([cuobjdump, "-sass", obj], check=True, capture_output=True, text=True).stdout


def parse(text: str) -> list[Function]:
    funcs: list[Function] = []
    arch = "?"
    for line in text.splitlines():
        m = re.search(r"code for (sm_\d+a?)", line)
        if m:
            arch = m.group(1)
            continue
        m = re.search(r"Function : (\S+)", line)
        if m:
            funcs.append(Function(arch, m.group(1)))
            continue
        m = INSTR.match(line)
        if m and funcs:
            funcs[-1].addrs.append(int(m.group(1), 16))
            funcs[-1].ops.append(m.group(2).strip())
    for f in funcs:
        # Padding after the last EXIT: a self-branch "BRA <own address>" and NOPs.
        while f.ops and (f.ops[-1] == "NOP" or f.ops[-1].startswith("BRA") and branch_target(f.ops[-1]) == f.addrs[-1]):
            f.ops.pop()
            f.addrs.pop()
    return funcs


def branch_target(op: str):
    m = BRANCH.match(op)
    return int(m.group(1), 16) if m else None


def mnemonic(op: str) -> str:
    parts = op.split()
    if parts and parts[0].startswith("@"):
        parts = parts[1:]
    return parts[0] if parts else ""


def outermost_loops(f: Function) -> list[tuple[int, int]]:
    """Index ranges [start, end] of the loops (backward branches) not nested in another loop."""
    index = {a: i for i, a in enumerate(f.addrs)}
    loops = []
    for i, op in enumerate(f.ops):
        t = branch_target(op)
        if t is not None and t <= f.addrs[i] and t in index:
            loops.append((index[t], i))
    loops.sort(key=lambda r: (r[0], -r[1]))
    outer: list[tuple[int, int]] = []
    for s, e in loops:
        if outer and s >= outer[-1][0] and e <= outer[-1][1]:
            continue
        if outer and s <= outer[-1][1]:  # overlapping, not nested: merge into one region
            outer[-1] = (min(outer[-1][0], s), max(outer[-1][1], e))
            continue
        outer.append((s, e))
    return outer


def demangle(symbols: list[str]) -> dict[str, str]:
    tool = shutil.which("c++filt")
    if tool is None:
        return {s: s for s in symbols}
    out = subprocess.run([tool], input="\n".join(symbols), capture_output=True, text=True, check=True).stdout
    return dict(zip(symbols, out.splitlines()))


def short_name(demangled: str) -> tuple[str, str]:
    """(kernel base name, template arguments in short form) of a demangled kernel symbol."""
    m = re.search(r"(\w+_kernel)<(.*)>\(", demangled)
    if not m:
        return demangled, ""
    args = m.group(2).replace("__nv_bfloat16", "bf16").replace("__half", "f16")
    # src/cuda/warp/nm_warp_select.hpp: enum class sp_pattern { p2of4, p1of2 }.
    args = re.sub(r"\(dfss::cuda::warp::sp_pattern\)0", "2:4", args)
    args = re.sub(r"\(dfss::cuda::warp::sp_pattern\)1", "1:2", args)
    args = args.replace("dfss::cuda::warp::sp_pattern::p1of2", "1:2").replace("dfss::cuda::warp::sp_pattern::p2of4", "2:4")
    return m.group(1), args


def head_dim(args: str):
    """The head dim of a kernel's short template arguments ("bf16, 64, 2:4" -> 64), or None."""
    parts = [p.strip() for p in args.split(",")]
    return int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else None


def stats(f: Function, name: str, args: str = "") -> dict:
    mn = [mnemonic(op) for op in f.ops]
    mma = [i for i, m in enumerate(mn) if m.startswith("HMMA")]
    sparse = sum(1 for i in mma if mn[i].startswith("HMMA.SP"))
    loops = outermost_loops(f)
    main = [r for r in loops if any(r[0] <= i <= r[1] for i in mma)]
    if not mma:
        main = loops
    how, factor = KERNELS[name]
    if how.startswith("first_loop"):
        main = main[:1]
    loop = sum(e - s + 1 for s, e in main)
    if how == "first_loop_per_mma":
        loop_mma = sum(1 for i in mma if main and main[0][0] <= i <= main[0][1])
        d = head_dim(args)
        per_tile = None if not loop_mma or d is None else loop * (d / 2) / loop_mma
        return {"total": len(f.ops), "mma": len(mma), "mma_sparse": sparse, "loop": loop, "per_tile": per_tile}
    per_tile = None if factor is None else (len(f.ops) if how == "total" else loop) * factor
    return {"total": len(f.ops), "mma": len(mma), "mma_sparse": sparse, "loop": loop, "per_tile": per_tile}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("objects", nargs="+", help="object files or fatbins with the kernels' SASS")
    ap.add_argument("--cuobjdump", default=shutil.which("cuobjdump"), help="cuobjdump to use")
    ap.add_argument("--budget", help="JSON file of per-kernel ceilings (per-tile instructions)")
    ap.add_argument("--json", help="also write the rows to this JSON file")
    args = ap.parse_args()
    if not args.cuobjdump:
        print("sass_stats: no cuobjdump found (PATH or --cuobjdump); tools/cuda/get-cuobjdump.sh fetches one",
              file=sys.stderr)
        return 77
    funcs = [f for obj in args.objects for f in parse(run_cuobjdump(args.cuobjdump, obj))]
    if not funcs:
        print("sass_stats: the objects hold no SASS", file=sys.stderr)
        return 2
    names = demangle([f.symbol for f in funcs])
    rows = []
    for f in funcs:
        base, targs = short_name(names[f.symbol])
        if base not in KERNELS:
            continue
        rows.append({"kernel": base, "args": targs, "arch": f.arch, **stats(f, base, targs)})
    rows.sort(key=lambda r: (r["kernel"], r["arch"], r["args"]))
    print("| kernel | template | arch | total | mma (sparse) | main loop | per warp per 32x32 tile |")
    print("|---|---|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['kernel']} | {r['args']} | {r['arch']} | {r['total']} | {r['mma']} ({r['mma_sparse']}) | "
              f"{r['loop']} | {'n/a' if r['per_tile'] is None else round(r['per_tile'])} |")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)
    if not rows:
        print("sass_stats: no dfss attention kernels found in the objects", file=sys.stderr)
        return 2
    status = 0
    if args.budget:
        with open(args.budget) as fh:
            budget = json.load(fh)
        for name, target in budget.get("targets", {}).items():
            counted = [r for r in rows if r["kernel"] == name and r["per_tile"] is not None]
            if not counted:
                continue
            chosen = [r for r in counted if target["instances"] in r["args"]]
            limit, scope = target["at_most"], f"instances '{target['instances'].strip(', ')}'"
            top = max(counted, key=lambda r: r["per_tile"])
            if chosen:
                worst = max(r["per_tile"] for r in chosen)
                print(f"{name}: {scope}: worst {worst:.0f} instructions per warp per 32x32 tile, target {limit}: "
                      f"{'met' if worst <= limit else 'not met'}")
            print(f"{name}: worst of all instances {top['per_tile']:.0f} ({top['args']}, {top['arch']})")
        for r in rows:
            cap = budget["ceilings"].get(r["kernel"])
            if cap is not None and r["per_tile"] is not None and r["per_tile"] > cap:
                print(f"sass_stats: {r['kernel']}<{r['args']}> on {r['arch']}: {r['per_tile']:.0f} instructions per "
                      f"tile, above its ceiling {cap} in {args.budget}", file=sys.stderr)
                status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())
