"""What the PyTorch peer scripts of `dfss bench` share (torch_attention.py, torch_decode.py): the
DFSS_TORCH_JSON lines they print, and their --serve mode, in which dfss bench keeps one of them as a
co-process and asks it for one timed call at a time (tools/cli/bench/bench.hpp, torch_server).
Imported from the scripts' own folder (installed beside them)."""
import json
import math
import sys
import time

PREFIX = "DFSS_TORCH_JSON "


def _finite(x):
    """@p x with non-finite floats as None (JSON has no inf or NaN), through dicts and lists."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def emit(obj):
    """One DFSS_TORCH_JSON line of @p obj, flushed."""
    sys.stdout.write(PREFIX + json.dumps(_finite(obj), allow_nan=False) + "\n")
    sys.stdout.flush()


def hand_off(torch, seconds=0.02):
    """Keeps torch's threads busy for @p seconds before a timed call that follows dfss bench's: the
    other process's OpenMP threads spin for a few ms after their last parallel region and would
    share the cores with the call, and an idle gap instead would be timed into it (the idle vCPUs
    wake slowly; kHandOff of tools/cli/bench/bench.hpp). Sums of 1 MiB, each split over the
    intra-op threads."""
    x = torch.ones(1 << 18)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        x.sum()


def serve_requests(info, handle):
    """--serve: prints @p info with "serving": true, then for each line of standard input (a JSON
    request) prints @p handle(request)'s answer, or {"error"} where it raises, until end of input."""
    info["serving"] = True
    emit(info)
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            answer = handle(json.loads(line))
        except Exception as e:  # noqa: BLE001 - report, keep serving
            answer = {"error": "%s: %s" % (type(e).__name__, e)}
        emit(answer)
    return 0
