#!/usr/bin/env python3
"""`dfss bench`: the columns and fields that compare dfss with its peers, and the progress line.

Runs in seconds: tiny shapes, one timed call, no real torch. The PyTorch peer is a stub script given
with --torch-script that answers like tools/bench/torch_attention.py with fixed times, so that the
"vs SDPA" column can be checked exactly (SDPA ms / row ms, same L, same dtype) on any machine.

Usage: test_cli_bench.py DFSS_EXE
"""
import json
import math
import os
import subprocess
import sys
import tempfile

from checks import check, finish  # tests/cli/checks.py, beside this script

# The stub's SDPA medians (ms) per dtype: values no real run produces, so a match is not by chance.
STUB_SDPA_MS = {"fp32": 7.25, "bf16": 3.5}

STUB = r'''
import json, sys
args = sys.argv[1:]
def opt(name, default):
    return args[args.index(name) + 1] if name in args else default
info = {"python": sys.executable, "python_version": "3.0.0", "torch_version": "2.99.0", "sdpa": "public"}
if "--serve" in args:  # a script that does not serve: answers its info without "serving" and ends
    print("DFSS_TORCH_JSON " + json.dumps(info))
    sys.exit(0)
if "--probe" not in args:
    with open(sys.argv[0] + ".args", "a") as f:
        f.write(" ".join(args) + "\n")
    rows = []
    for L in opt("--lengths", "").split(","):
        for dt in opt("--dtypes", "fp32").split(","):
            rows.append({"B": 1, "H": 1, "L": int(L), "d": 64, "dtype": dt, "method": "sdpa",
                         "ms_median": SDPA[dt], "ms_min": SDPA[dt], "ms_max": SDPA[dt], "iters": 1,
                         "max_err": 1e-7})
    info["results"] = rows
print("DFSS_TORCH_JSON " + json.dumps(info))
'''

# The decode peer's stub (torch_decode.py beside the stub above, as the bench finds it): serves the
# requests of `dfss bench --decode` like tools/bench/torch_decode.py --serve, with a fixed time per
# cache type, and logs every request. DIE_AFTER: exit instead of answering that many "time" requests
# (0: never); FAIL: cache types whose setup answers an error.
DECODE_STUB = r'''
import json, sys
log = open(sys.argv[0] + ".log", "a")
def emit(obj):
    sys.stdout.write("DFSS_TORCH_JSON " + json.dumps(obj) + "\n")
    sys.stdout.flush()
print("a warning line the bench must skip")
emit({"python": sys.executable, "torch_version": "2.99.0", "serving": True})
times = 0
dtype = None
for line in sys.stdin:
    req = json.loads(line)
    log.write(json.dumps(req) + "\n")
    log.flush()
    if req["cmd"] == "setup":
        dtype = req["dtype"]
        shared = req.get("shared", {})
        try:  # the bench's own q, K and V: readable, and as long as its offsets say
            with open(shared["file"], "rb") as f:
                f.seek(0, 2)
                readable = f.tell() > shared["v"] > shared["k"] > shared["q"] == 0
        except (KeyError, OSError):
            readable = False
        if not readable:
            emit({"error": "the shared cache is not readable: %r" % (shared,)})
        elif dtype in FAIL:
            emit({"error": "RuntimeError: stub refuses " + dtype})
        else:
            emit({"kv_bytes": 1e6, "method": "stub sdpa"})
    elif req["cmd"] == "time":
        times += 1
        if times == DIE_AFTER:
            sys.exit(3)
        emit({"ms": SDPA[dtype]})
    elif req["cmd"] == "check":
        emit({"max_err": 1.5e-7})
    else:
        emit({})
'''

# A torch_attention.py that serves (--serve, as tools/bench/torch_attention.py does for a torch 2.x
# interpreter): the probe as STUB's; then fixed times per (dtype, method), bmm at twice SDPA's, every
# request logged.
SERVE_STUB = r'''
import json, sys
args = sys.argv[1:]
info = {"python": sys.executable, "python_version": "3.0.0", "torch_version": "2.99.0", "sdpa": "public"}
def emit(obj):
    sys.stdout.write("DFSS_TORCH_JSON " + json.dumps(obj) + "\n")
    sys.stdout.flush()
if "--serve" not in args:
    emit(info)
    sys.exit(0)
with open(sys.argv[0] + ".args", "a") as f:
    f.write(" ".join(args) + "\n")
log = open(sys.argv[0] + ".log", "a")
info["serving"] = True
emit(info)
entries = {}
for line in sys.stdin:
    req = json.loads(line)
    log.write(json.dumps(req) + "\n")
    log.flush()
    if req["cmd"] == "setup":
        key = "%d/%s/%s" % (req["L"], req["dtype"], req["method"])
        entries[key] = SDPA[req["dtype"]] * (2 if req["method"] == "bmm" else 1)
        emit({"id": key, "method": req["method"], "first_ms": 1.0})
    elif req["cmd"] == "time":
        emit({"ms": entries[req["id"]]})
    elif req["cmd"] == "check":
        emit({"max_err": 2.5e-7})
    else:
        entries.clear()
        emit({})
'''


def run(exe, args):
    p = subprocess.run([exe, "bench"] + args, capture_output=True, text=True, timeout=120)
    if p.returncode != 0:
        print(p.stdout, p.stderr)
    return p


def main():
    exe = sys.argv[1]
    tmp = tempfile.mkdtemp(prefix="dfss_cli_bench_")
    stub = os.path.join(tmp, "torch_stub.py")
    with open(stub, "w") as f:
        f.write("SDPA = %r\n" % STUB_SDPA_MS + STUB)
    lengths = [32, 48]
    common = ["--lengths", ",".join(map(str, lengths)), "--heads", "1", "--iters", "1", "--warmup", "1",
              "--no-sgemm", "--no-torch-tuned"]

    for dtype, label in (("f32", "fp32"), ("bf16", "bf16")):
        out_json = os.path.join(tmp, "bench_%s.json" % dtype)
        p = run(exe, common + ["--dtype", dtype, "--python", sys.executable, "--torch-script", stub,
                               "--json", out_json, "--progress"])
        check(p.returncode == 0, "%s: exit status 0 (got %d)" % (dtype, p.returncode))
        if p.returncode != 0:
            continue
        header = p.stdout.splitlines()
        check(any(l.startswith("machine: ") and "family" in l for l in header),
              "%s: the header names the CPU model with family and model numbers" % dtype)
        check(any(l.startswith("kernel: ") and "cpu.fused_forward." in l and "(ISA " in l for l in header),
              "%s: the header names the dense fused kernel and its ISA" % dtype)
        table_head = next((l for l in header if l.startswith("B,H,L,d")), "")
        check("vs SDPA" in table_head and "%sgemm" in table_head, "%s: the table has 'vs SDPA' and '%%sgemm'" % dtype)
        check("vs SDPA = median of torch 2.99.0 sdpa" in p.stdout, "%s: the notes name the SDPA peer" % dtype)

        # The stub was asked for fp32 and, for a 16-bit dfss dtype, that dtype too.
        with open(stub + ".args") as f:
            calls = f.read().splitlines()
        want_dtypes = "fp32" if label == "fp32" else "fp32," + label
        check(calls and calls[-1].split("--dtypes ")[1].split()[0] == want_dtypes,
              "%s: the torch script is asked for --dtypes %s (got %r)" % (dtype, want_dtypes, calls[-1:]))

        with open(out_json) as f:
            j = json.load(f)
        check(j["machine"]["kernel"].startswith("cpu.fused_forward.") and
              j["machine"]["kernel"].endswith("." + j["machine"]["isa"]),
              "%s: JSON machine.kernel and machine.isa (%s, %s)" % (dtype, j["machine"]["kernel"], j["machine"]["isa"]))
        check(j["sdpa_peer"] == "torch 2.99.0 sdpa", "%s: JSON sdpa_peer (got %r)" % (dtype, j["sdpa_peer"]))
        dfss_rows = [r for r in j["rows"] if r["source"] == "dfss" and r["ok"]]
        torch_rows = [r for r in j["rows"] if r["source"] == "torch"]
        check(len(dfss_rows) == 5 * len(lengths), "%s: 5 dfss rows per length (got %d)" % (dtype, len(dfss_rows)))
        check(sorted(r["dtype"] for r in torch_rows) == sorted(want_dtypes.split(",") * len(lengths)),
              "%s: one torch row per length and dtype" % dtype)
        for r in dfss_rows:
            want = STUB_SDPA_MS[label] / r["ms_median"]
            got = r["speedup_vs_sdpa"]
            check(r["dtype"] == label and got is not None and math.isclose(got, want, rel_tol=1e-9),
                  "%s: L=%d %s %s: vs SDPA = %s ms / row ms = %.4g (got %r, dtype %s)"
                  % (dtype, r["L"], r["pattern"], r["algorithm"], STUB_SDPA_MS[label], want, got, r["dtype"]))
            check("fraction_of_sgemm" in r and r["fraction_of_sgemm"] is None,
                  "%s: L=%d %s %s: fraction_of_sgemm is null with --no-sgemm" % (dtype, r["L"], r["pattern"], r["algorithm"]))

        # --progress: one line per step on a non-terminal stderr, counting down to 0 left.
        total = 5 * len(lengths) + 1  # dfss configurations + one torch run
        prog = [l for l in p.stderr.splitlines() if l.startswith("[dfss bench] ")]
        check(any(l.startswith("[dfss bench] row 1 of %d (%d left)" % (total, total - 1)) for l in prog),
              "%s: progress starts at row 1 of %d" % (dtype, total))
        check(any(l.startswith("[dfss bench] row %d of %d (0 left), torch 2.99.0" % (total, total)) for l in prog),
              "%s: progress ends at row %d of %d, the torch run" % (dtype, total, total))

    # A torch 2.x script that serves: its calls join the round-robin of each length (setup of fp32
    # bmm and sdpa, and sdpa in the 16-bit dfss dtype; --iters timed calls each, one per turn; the
    # error; free), its rows and the vs SDPA column come from its answers, the notes say so, and no
    # child run follows.
    serve_stub = os.path.join(tmp, "torch_attention.py")
    with open(serve_stub, "w") as f:
        f.write("SDPA = %r\n" % STUB_SDPA_MS + SERVE_STUB)
    for dtype, label in (("f32", "fp32"), ("bf16", "bf16")):
        for extra in (serve_stub + ".log", serve_stub + ".args"):
            if os.path.exists(extra):
                os.remove(extra)
        out_json = os.path.join(tmp, "bench_served_%s.json" % dtype)
        p = run(exe, ["--lengths", "32,48", "--heads", "1", "--iters", "3", "--warmup", "1", "--no-sgemm",
                      "--no-torch-tuned", "--dtype", dtype, "--python", sys.executable, "--torch-script", serve_stub,
                      "--json", out_json, "--causal", "--progress"])
        what = "served %s" % dtype
        check(p.returncode == 0, "%s: exit status 0 (got %d: %s)" % (what, p.returncode, p.stderr[-300:]))
        if p.returncode != 0:
            continue
        entries = [("fp32", "bmm"), ("fp32", "sdpa")] + ([(label, "sdpa")] if label != "fp32" else [])
        want = []
        for L in (32, 48):
            want += [{"cmd": "setup", "L": L, "dtype": dt, "method": m} for dt, m in entries]
            want += [{"cmd": "time", "id": "%d/%s/%s" % (L, dt, m)} for dt, m in entries] * 3
            want += [{"cmd": "check", "id": "%d/%s/%s" % (L, dt, m)} for dt, m in entries]
            want.append({"cmd": "free"})
        reqs = [json.loads(l) for l in open(serve_stub + ".log")]
        check(reqs == want, "%s: setup, one call of each entry per turn, check, free per length (got %r)"
              % (what, reqs[:6]))
        started = open(serve_stub + ".args").read().split()
        check(started.count("--serve") == 1 and "--causal" in started,
              "%s: one co-process for the run, told --causal (got %r)" % (what, started))
        check("timed round-robin with the dfss rows" in p.stdout, "%s: the notes say the peer is served" % what)
        total = 2 * (5 + len(entries))  # per length: the dfss rows and the served entries
        prog = [l for l in p.stderr.splitlines() if l.startswith("[dfss bench] ")]
        check(any(l.startswith("[dfss bench] rows %d-%d of %d (0 left)" % (6 + len(entries), total, total)) for l in prog),
              "%s: the progress line counts the served rows, down to 0 left (got %r)" % (what, prog[-1:]))
        j = json.load(open(out_json))
        torch_rows = [r for r in j["rows"] if r["source"] == "torch"]
        check(sorted((r["L"], r["dtype"], r["algorithm"]) for r in torch_rows) ==
              sorted((L, dt, "torch 2.99.0 " + m) for L in (32, 48) for dt, m in entries) and
              all(r["ok"] and r["iters"] == 3 and r["max_err"] == 2.5e-7 and
                  r["ms_median"] == STUB_SDPA_MS[r["dtype"]] * (2 if r["algorithm"].endswith("bmm") else 1)
                  for r in torch_rows),
              "%s: one torch row per entry and length, from the answers (got %r)"
              % (what, [(r["L"], r["dtype"], r["algorithm"], r["ms_median"]) for r in torch_rows]))
        for r in [r for r in j["rows"] if r["source"] == "dfss" and r["ok"]]:
            want_vs = STUB_SDPA_MS[label] / r["ms_median"]
            check(math.isclose(r["speedup_vs_sdpa"], want_vs, rel_tol=1e-9),
                  "%s: L=%d %s %s: vs SDPA from the served SDPA (got %r, want %r)"
                  % (what, r["L"], r["pattern"], r["algorithm"], r["speedup_vs_sdpa"], want_vs))
    p = run(exe, common + ["--python", sys.executable, "--torch-script", stub])
    check(p.returncode == 0 and "not served (its first answer is not a serving one" in p.stdout,
          "a script that does not serve: the notes say so and its child run gives the rows")

    # --rounds 3: the whole sweep three times, the torch stub answering 7.25, 14.5 and 29 ms in its
    # three calls (a machine whose load drifts). Each dfss row keeps its per-round medians and ratios
    # (SDPA of that round / the row's median of that round) and reports the medians of both.
    stub3 = os.path.join(tmp, "torch_stub_rounds.py")
    with open(stub3, "w") as f:
        f.write("SDPA = %r\n" % STUB_SDPA_MS + STUB.replace(
            '"ms_median": SDPA[dt], "ms_min": SDPA[dt], "ms_max": SDPA[dt]',
            '"ms_median": SDPA[dt] * 2 ** CALL, "ms_min": SDPA[dt] * 2 ** CALL, "ms_max": SDPA[dt] * 2 ** CALL').replace(
            '    rows = []\n',
            '    CALL = sum(1 for _ in open(sys.argv[0] + ".args")) - 1\n    rows = []\n'))
    out_json = os.path.join(tmp, "bench_rounds.json")
    p = run(exe, common + ["--python", sys.executable, "--torch-script", stub3, "--rounds", "3", "--json", out_json])
    check(p.returncode == 0, "rounds: exit status 0 (got %d)" % p.returncode)
    if p.returncode == 0:
        repro = [l for l in p.stdout.splitlines() if l.startswith("repro: ")]
        check(len(repro) == 1 and " --rounds 3" in repro[0], "rounds: named in the repro line (got %r)" % (repro,))
        check("vs SDPA per round (rounds 1..3):" in p.stdout, "rounds: the notes list the per-round ratios")
        j = json.load(open(out_json))
        check(j["config"]["rounds"] == 3, "rounds: JSON config.rounds (got %r)" % j["config"].get("rounds"))
        dfss_rows = [r for r in j["rows"] if r["source"] == "dfss" and r["ok"]]
        check(len(dfss_rows) == 5 * len(lengths), "rounds: 5 dfss rows per length (got %d)" % len(dfss_rows))
        for r in dfss_rows:
            ms, vs = r.get("rounds_ms_median", []), r.get("rounds_speedup_vs_sdpa", [])
            want_vs = [STUB_SDPA_MS["fp32"] * 2 ** k / ms[k] for k in range(len(ms))]
            check(len(ms) == 3 and len(vs) == 3 and all(math.isclose(a, b, rel_tol=1e-9) for a, b in zip(vs, want_vs)),
                  "rounds: L=%d %s %s: per-round vs SDPA = that round's SDPA / that round's median (got %r, want %r)"
                  % (r["L"], r["pattern"], r["algorithm"], vs, want_vs))
            if len(ms) == 3 and len(vs) == 3:
                check(math.isclose(r["ms_median"], sorted(ms)[1], rel_tol=1e-12) and
                      math.isclose(r["speedup_vs_sdpa"], sorted(vs)[1], rel_tol=1e-12),
                      "rounds: L=%d %s %s: the medians of the rounds (ms %r of %r, vs SDPA %r of %r)"
                      % (r["L"], r["pattern"], r["algorithm"], r["ms_median"], ms, r["speedup_vs_sdpa"], vs))
    for bad, why, says in ((["--rounds", "0"], "rounds 0", "expected a count >= 1, got 0"),
                           (["--decode", "--rounds", "0"], "rounds 0 with --decode", "expected a count >= 1, got 0"),
                           (["--memory", "--rounds", "2"], "rounds with --memory", "cannot be combined")):
        p = run(exe, common + ["--no-torch"] + bad)
        check(p.returncode == 2 and "--rounds" in p.stderr and says in p.stderr,
              "%s is refused, naming --rounds (got %d: %s)" % (why, p.returncode, p.stderr[-200:]))

    # Without --progress and with stderr not a terminal: no progress line (logs stay as they were).
    p = run(exe, common + ["--no-torch"])
    check(p.returncode == 0 and "[dfss bench]" not in p.stderr, "no progress line without --progress on a pipe")
    check("no torch 2.x measured" in p.stdout, "without torch the notes say how to get the SDPA peer")

    # --out-dtype: with bf16 inputs O is bf16 by default (as the torch operator and SDPA return it), f32
    # with --out-dtype f32. The rows' error against the fp64 reference (of the same rounded inputs)
    # tells the two apart: the kernels are deterministic, so a bench that ignored the option would
    # report the same errors in both runs, while O's rounding to bf16 (|O| 2^-9) changes each row's.
    # (Both stay small: on an AMX machine the bf16 forward also rounds P to bf16, about 1e-3 here.)
    errors = {}
    for extra, want_type in (([], "bf16"), (["--out-dtype", "f32"], "f32")):
        what = "out-dtype %s" % want_type
        out_json = os.path.join(tmp, "bench_out_%s.json" % want_type)
        p = run(exe, common + ["--no-torch", "--dtype", "bf16", "--patterns", "dense,1:2", "--algorithms", "fused",
                               "--json", out_json] + extra)
        check(p.returncode == 0, "%s: exit status 0 (got %d: %s)" % (what, p.returncode, p.stderr[-300:]))
        if p.returncode != 0:
            continue
        run_line = next((l for l in p.stdout.splitlines() if l.startswith("run: ")), "")
        check("bf16 inputs (standard normal), %s outputs" % want_type in run_line,
              "%s: the run line names the output type (got %r)" % (what, run_line))
        repro = next((l for l in p.stdout.splitlines() if l.startswith("repro: ")), "")
        check((" --out-dtype f32" in repro) == (want_type == "f32"), "%s: the repro line (got %r)" % (what, repro))
        j = json.load(open(out_json))
        check(j["config"].get("out_dtype") == want_type,
              "%s: JSON config.out_dtype (got %r)" % (what, j["config"].get("out_dtype")))
        errors[want_type] = [r["max_err"] for r in j["rows"] if r["source"] == "dfss" and r["ok"]]
    if len(errors) == 2:
        check(len(errors["f32"]) == 2 * len(lengths) and len(errors["bf16"]) == len(errors["f32"]) and
              all(a is not None and b is not None and a != b and max(a, b) < 1e-2
                  for a, b in zip(errors["f32"], errors["bf16"])),
              "out-dtype: every row's error differs between bf16 and f32 outputs, both small (got %r, %r)"
              % (errors["bf16"], errors["f32"]))
    # The same for a decode step (a bf16 cache, one row per kv head): there P stays fp32 on every
    # target, so the f32 outputs are within the kernel's rounding and the bf16 ones add O's rounding.
    # (With grouped heads on avx3_bf16 the key-major P V rounds P to bf16: the blhd check below.)
    errors = {}
    for extra, want_type in (([], "bf16"), (["--out-dtype", "f32"], "f32")):
        out_json = os.path.join(tmp, "decode_out_%s.json" % want_type)
        p = run(exe, ["--decode", "--lengths", "300", "--decode-heads", "4:4", "--decode-dtypes", "bf16",
                      "--patterns", "dense,1:2", "--iters", "1", "--threads", "2", "--no-torch", "--json", out_json] + extra)
        check(p.returncode == 0, "decode out-dtype %s: exit status 0 (got %d: %s)" % (want_type, p.returncode, p.stderr[-300:]))
        if p.returncode == 0:
            j = json.load(open(out_json))
            check(j.get("out_dtype") == ("f32" if extra else "input"),
                  "decode out-dtype %s: JSON out_dtype (got %r)" % (want_type, j.get("out_dtype")))
            errors[want_type] = [r["max_err"] for r in j["rows"] if r["row"].startswith("dfss ")]
    if len(errors) == 2:
        check(len(errors["f32"]) == 2 and all(e is not None and e < 1e-5 for e in errors["f32"]),
              "decode out-dtype f32: the rows' errors are the kernel's rounding (got %r)" % errors["f32"])
        check(len(errors["bf16"]) == 2 and all(e is not None and 1e-5 < e < 1e-2 for e in errors["bf16"]),
              "decode out-dtype bf16: the rows' errors include O's rounding to bf16 (got %r)" % errors["bf16"])
    p = run(exe, common + ["--no-torch", "--out-dtype", "f16"])
    check(p.returncode == 2 and "--out-dtype" in p.stderr and "f16" in p.stderr,
          "--out-dtype f16 is refused, naming the option and the value (got %d: %s)" % (p.returncode, p.stderr[-200:]))

    # --decode: per configuration the three sweeps (the cache's own K and V, the yardstick of "% of bw";
    # another buffer beside it; K and half of V, the floor of a 1:2 step) and the dfss rows, each dfss row's fraction_of_bandwidth its GB/s
    # over the cache sweep's and its error against the fp64 reference small. Three threads: one of
    # them sweeps the end of K and the start of V.
    out = os.path.join(tmp, "decode.json")
    p = run(exe, ["--decode", "--lengths", "70", "--decode-heads", "4:2", "--decode-dtypes", "f32",
                  "--patterns", "dense,1:2", "--iters", "2", "--threads", "3", "--no-torch", "--json", out])
    check(p.returncode == 0, "decode: exit status 0 (got %d)" % p.returncode)
    rows = json.load(open(out))["rows"] if p.returncode == 0 else []
    by_row = {r["row"]: r for r in rows}
    check(sorted(by_row) == ["dfss 1:2", "dfss dense", "memory sweep", "memory sweep, K + half V", "memory sweep, other"],
          "decode: rows are the three sweeps and the dfss rows (got %s)" % sorted(by_row))
    if len(by_row) == 5:
        cache = by_row["memory sweep"]
        check(cache["fraction_of_bandwidth"] is None and cache["vs_dense"] is None,
              "decode: the cache sweep is the yardstick (no ratios)")
        for what in ("memory sweep, other", "memory sweep, K + half V"):
            other = by_row[what]
            check(other["vs_dense"] is None and other["vs_sdpa"] is None and
                  math.isclose(other["fraction_of_bandwidth"], other["gbs"] / cache["gbs"]),
                  "decode: %s's only ratio is its rate against the cache sweep" % what)
        for what in ("dfss dense", "dfss 1:2"):
            r = by_row[what]
            check(math.isclose(r["fraction_of_bandwidth"], r["gbs"] / cache["gbs"]) and r["max_err"] < 1e-5,
                  "decode: %s against the cache sweep, max err %r" % (what, r["max_err"]))
        check("pass over the cache's own K and V" in p.stdout, "decode: the notes say the sweep reads the cache's own K and V")
        check("one random row of every two of V" in p.stdout, "decode: the notes say what the half sweep reads")

    # --decode --rounds 3: every row's times and ratios the medians of its three rounds', listed per
    # round in the JSON and the notes; the yardstick keeps no ratios.
    out = os.path.join(tmp, "decode_rounds.json")
    p = run(exe, ["--decode", "--lengths", "70", "--decode-heads", "4:2", "--decode-dtypes", "f32",
                  "--patterns", "dense,1:2", "--iters", "2", "--threads", "2", "--no-torch", "--rounds", "3",
                  "--json", out])
    check(p.returncode == 0, "decode rounds: exit status 0 (got %d: %s)" % (p.returncode, p.stderr[-300:]))
    if p.returncode == 0:
        repro = [l for l in p.stdout.splitlines() if l.startswith("repro: ")]
        check(len(repro) == 1 and " --rounds 3 " in repro[0], "decode rounds: in the repro line (got %r)" % (repro,))
        check("per round (rounds 1..3), % of bw / vs dense / vs SDPA:" in p.stdout,
              "decode rounds: the notes list the per-round ratios")
        j = json.load(open(out))
        check(j["rounds"] == 3, "decode rounds: JSON rounds (got %r)" % j.get("rounds"))
        by_row = {r["row"]: r for r in j["rows"]}
        for what in ("dfss dense", "dfss 1:2", "memory sweep, K + half V"):
            r = by_row.get(what, {})
            ms, bw = r.get("rounds_ms_median", []), r.get("rounds_fraction_of_bandwidth", [])
            check(len(ms) == 3 and len(bw) == 3 and math.isclose(r["ms_median"], sorted(ms)[1], rel_tol=1e-12) and
                  math.isclose(r["fraction_of_bandwidth"], sorted(bw)[1], rel_tol=1e-12),
                  "decode rounds: %s: the medians of the rounds (ms %r of %r, %% of bw %r of %r)"
                  % (what, r.get("ms_median"), ms, r.get("fraction_of_bandwidth"), bw))
        dense, sparse = by_row.get("dfss dense", {}), by_row.get("dfss 1:2", {})
        if len(dense.get("rounds_ms_median", [])) == 3 and len(sparse.get("rounds_vs_dense", [])) == 3:
            want = [a / b for a, b in zip(dense["rounds_ms_median"], sparse["rounds_ms_median"])]
            check(all(math.isclose(a, b, rel_tol=1e-9) for a, b in zip(sparse["rounds_vs_dense"], want)) and
                  math.isclose(sparse["vs_dense"], sorted(want)[1], rel_tol=1e-9),
                  "decode rounds: 1:2 vs dense per round is that round's dense / 1:2 (got %r, want %r)"
                  % (sparse["rounds_vs_dense"], want))
        check(by_row.get("memory sweep", {}).get("fraction_of_bandwidth", 0) is None,
              "decode rounds: the cache sweep is the yardstick (no ratios)")

    # --decode without --lengths and --head-dim: its own defaults (4096,16384,65536 and 128), told
    # apart from given values while the parser lived.
    p = run(exe, ["--decode", "--decode-heads", "1:1", "--decode-dtypes", "f32", "--patterns", "dense",
                  "--iters", "1", "--threads", "1", "--no-torch", "--no-ref"])
    repro = [l for l in p.stdout.splitlines() if l.startswith("repro: ")]
    check(p.returncode == 0 and len(repro) == 1 and "--lengths 4096,16384,65536 " in repro[0] and
          "--head-dim 128 " in repro[0], "decode: default lengths and head dim (got %r)" % (repro,))

    # --cache-layout blhd: the cache as [B, Lk, Hkv, d] memory (the kv heads of a key side by side,
    # which the decode kernel walks chunk by chunk), same checks against the fp64 reference; named
    # in the repro line; a layout it does not know is refused, naming the option.
    out = os.path.join(tmp, "decode_blhd.json")
    p = run(exe, ["--decode", "--lengths", "1100", "--decode-heads", "8:4", "--decode-dtypes", "f32,bf16",
                  "--patterns", "dense,2:4", "--iters", "1", "--threads", "2", "--no-torch", "--cache-layout", "blhd",
                  "--out-dtype", "f32", "--json", out])
    check(p.returncode == 0, "decode blhd: exit status 0 (got %d: %s)" % (p.returncode, p.stderr[-300:]))
    repro = [l for l in p.stdout.splitlines() if l.startswith("repro: ")]
    check(len(repro) == 1 and "--cache-layout blhd " in repro[0], "decode blhd: in the repro line (got %r)" % (repro,))
    rows = json.load(open(out))["rows"] if p.returncode == 0 else []
    dfss_rows = [r for r in rows if r["row"].startswith("dfss ")]

    def blhd_tol(r):
        # Grouped heads (8:4) with a bf16 cache on avx3_bf16: the key-major P V takes vdpbf16ps with
        # the weights rounded to bf16 (docs/semantics.md, "Precision"), each within 2^-8 of itself,
        # so O within 2^-8 max|v|; max|v| of the 563,200 standard normal values is below 6 but with
        # odds of about 1e-3. Elsewhere P stays fp32: the kernel's rounding, as in the f32 check.
        if r.get("cache") == "bf16" and str(r.get("kernel", "")).endswith("avx3_bf16"):
            return 2.0 ** -8 * 6
        return 1e-5
    check(len(dfss_rows) == 4 and all(r["max_err"] is not None and r["max_err"] < blhd_tol(r) for r in dfss_rows),
          "decode blhd: every dfss row against the fp64 reference (got %r)"
          % [(r["row"], r.get("kernel"), r["max_err"]) for r in dfss_rows])
    check(any(r.get("cache") == "f32" for r in dfss_rows) and all(r["max_err"] < 1e-5 for r in dfss_rows if r.get("cache") == "f32"),
          "decode blhd: the fp32 rows within the kernel's rounding (got %r)" % [(r["row"], r["max_err"]) for r in dfss_rows])
    # --decode with SDPA: the co-process (a stub of torch_decode.py --serve) is told to set up each
    # configuration, then times one call per round-robin turn (--iters per configuration and round),
    # checks the error, frees it; SDPA's row is its times, vs SDPA of every dfss row SDPA / row per
    # round and the median over rounds. A cache type whose setup fails gets a "not run" row; a
    # co-process that dies leaves its rows not run and the dfss rows measured.
    decode_stub = os.path.join(tmp, "torch_decode.py")
    for die_after, fail in ((0, ["bf16"]), (3, [])):
        with open(decode_stub, "w") as f:
            f.write("SDPA = %r\nDIE_AFTER = %d\nFAIL = %r\n" % (STUB_SDPA_MS, die_after, fail) + DECODE_STUB)
        if os.path.exists(decode_stub + ".log"):
            os.remove(decode_stub + ".log")
        out = os.path.join(tmp, "decode_sdpa.json")
        p = run(exe, ["--decode", "--lengths", "70,140", "--decode-heads", "4:2", "--decode-dtypes", "f32,bf16",
                      "--patterns", "dense,1:2", "--iters", "3", "--threads", "2", "--rounds", "3", "--python",
                      sys.executable, "--torch-script", stub, "--json", out])
        what = "decode sdpa (die after %d, fail %r)" % (die_after, fail)
        check(p.returncode == 0, "%s: exit status 0 (got %d: %s)" % (what, p.returncode, p.stderr[-300:]))
        if p.returncode != 0:
            continue
        rows = json.load(open(out))["rows"]
        sdpa = [r for r in rows if r["row"] == "torch 2.99.0 sdpa"]
        reqs = [json.loads(l) for l in open(decode_stub + ".log")]
        shared = [q.pop("shared", None) for q in reqs if q["cmd"] == "setup"]
        check(shared and all(x is not None and x["k"] % 4096 == 0 and x["v"] % 4096 == 0 for x in shared),
              "%s: every setup names the bench's memory of q, K and V, page-aligned (got %r)" % (what, shared[:2]))
        if die_after == 0:
            want = []
            for _ in range(3):
                for lk in (70, 140):
                    for dt in ("fp32", "bf16"):
                        want.append({"cmd": "setup", "Lk": lk, "H": 4, "Hkv": 2, "dtype": dt})
                        if dt not in fail:
                            want += [{"cmd": "time"}] * 3 + [{"cmd": "check"}]
                        want.append({"cmd": "free"})
            check(reqs == want, "%s: setup, 3 timed calls, check, free per configuration and round (got %r)"
                  % (what, reqs[:8]))
            check(len(sdpa) == 4, "%s: one SDPA row per configuration (got %d)" % (what, len(sdpa)))
            for r in sdpa:
                if r["cache"] == "bf16":
                    check(not r["ok"] and "stub refuses bf16" in r["reason"], "%s: the failed setup's reason (got %r)"
                          % (what, r["reason"]))
                    continue
                check(r["ok"] and r["ms_median"] == STUB_SDPA_MS["fp32"] and r["iters"] == 9 and
                      r["max_err"] == 1.5e-7 and math.isclose(r["gbs"], 1e6 / (STUB_SDPA_MS["fp32"] * 1e6)),
                      "%s: SDPA row Lk=%d from the co-process's answers (got %r)" % (what, r["Lk"], r))
                for d in [x for x in rows if x["Lk"] == r["Lk"] and x["cache"] == "f32" and x["row"].startswith("dfss")]:
                    want_vs = sorted(STUB_SDPA_MS["fp32"] / ms for ms in d["rounds_ms_median"])[1]
                    check(math.isclose(d["vs_sdpa"], want_vs, rel_tol=1e-9),
                          "%s: %s Lk=%d vs SDPA is the median of SDPA / row per round (got %r, want %r)"
                          % (what, d["row"], d["Lk"], d["vs_sdpa"], want_vs))
            bf16 = [x for x in rows if x["cache"] == "bf16" and x["row"].startswith("dfss")]
            check(bf16 and all(x["vs_sdpa"] is None for x in bf16), "%s: no vs SDPA without an SDPA time" % what)
        else:
            check(len([q for q in reqs if q["cmd"] == "time"]) == die_after,
                  "%s: the co-process was asked for time until it died" % what)
            check(len(sdpa) == 4 and all(not r["ok"] and "co-process ended" in r["reason"] for r in sdpa),
                  "%s: every configuration's SDPA row is not run, saying why (got %r)"
                  % (what, [r["reason"] for r in sdpa]))
            dfss = [x for x in rows if x["row"].startswith("dfss")]
            # (a bf16 cache's O is bf16: its rounding, |O| 2^-9, is its error)
            check(len(dfss) == 8 and all(x["ok"] and x["max_err"] < (1e-5 if x["cache"] == "f32" else 1e-2)
                                         for x in dfss),
                  "%s: the dfss rows are measured (got %r)" % (what, [(x["cache"], x["max_err"]) for x in dfss]))

    p = run(exe, ["--decode", "--cache-layout", "bthd", "--no-torch"])
    check(p.returncode == 2 and "--cache-layout" in p.stderr, "decode: an unknown layout is refused (got %d: %s)"
          % (p.returncode, p.stderr[-300:]))

    return finish()


if __name__ == "__main__":
    sys.exit(main())
