#!/usr/bin/env python3
"""Interoperability check of dfss's .npy reader/writer (tools/npy) against NumPy itself.

Usage: npy_interop.py <dir> [<npy_roundtrip binary>]

NumPy writes one file per case into <dir>: every supported dtype ('<f8', '<f4', '<f2', '<i4',
'<i8', '<u2', '|u1', '|b1'), big-endian variants, format versions 2.0 and 3.0, and shapes from 0-d
to 4-d including empty ones; each file is read back with NumPy as a self-check. Given the
npy_roundtrip binary (tools/npy/npy_roundtrip.cpp), each file is also passed through it and the
copy must be exactly the file numpy.save writes for the same array in little-endian C order (so
NumPy reads back identical values, and the header matches NumPy byte for byte). Inputs the reader
must reject (Fortran order, an unsupported dtype, truncation, trailing bytes) must make the binary
fail with exit status 1 and a message saying why.

Exit status: 0 when everything matches, 1 with a message on the first class of mismatch (all
mismatches are listed), 2 on a usage error, 77 (skipped) when numpy cannot be imported. NumPy is
installed for Debian's /usr/bin/python3 (python3-numpy); another python3 on PATH may lack it.
"""

import io
import os
import subprocess
import sys

SKIP = 77


def cases(np):
    """(name, array, descr, version) for every file NumPy writes; descr None means arr.dtype."""
    rng = np.random.default_rng(7)
    shapes = [(), (0,), (7,), (2, 3), (2, 0, 3), (2, 3, 4, 5)]
    out = []

    def floats(dtype, shape):
        a = np.array(rng.standard_normal(shape), dtype=dtype)
        flat = a.reshape(-1)
        specials = [np.nan, np.inf, -np.inf, -0.0, np.finfo(dtype).tiny / 2, np.finfo(dtype).max]
        flat[: min(len(flat), len(specials))] = specials[: len(flat)]
        return a

    def ints(dtype, shape):
        info = np.iinfo(dtype)
        a = np.array(rng.integers(info.min, info.max, size=shape, dtype=dtype, endpoint=True))
        flat = a.reshape(-1)
        specials = [info.min, info.max, 0, 1]
        flat[: min(len(flat), len(specials))] = specials[: len(flat)]
        return a

    makers = {
        "f8": lambda s: floats(np.float64, s),
        "f4": lambda s: floats(np.float32, s),
        "f2": lambda s: floats(np.float16, s),
        "i4": lambda s: ints(np.int32, s),
        "i8": lambda s: ints(np.int64, s),
        "u2": lambda s: ints(np.uint16, s),
        "u1": lambda s: ints(np.uint8, s),
        "b1": lambda s: rng.integers(0, 2, size=s).astype(np.bool_),
    }
    for code, make in makers.items():
        for shape in shapes:
            label = "x".join(str(d) for d in shape) or "scalar"
            out.append((f"{code}_{label}", make(shape), (1, 0)))
    for code in ("f8", "f4", "f2", "i4", "i8", "u2"):
        a = makers[code]((3, 5))
        out.append((f"big_{code}", a.astype(a.dtype.newbyteorder(">")), (1, 0)))
    out.append(("version2_f4", makers["f4"]((4, 6)), (2, 0)))
    out.append(("version3_i8", makers["i8"]((5,)), (3, 0)))
    out.append(("version2_big_u2", makers["u2"]((2, 2)).astype(">u2"), (2, 0)))
    out.append(("noncontiguous_f4", makers["f4"]((6, 8))[::2, 1::3], (1, 0)))
    return out


def little_endian_copy(np, a):
    """The array dfss writes back for @p a: little-endian, C order, bool as uint8."""
    if a.dtype == np.bool_:
        a = a.astype(np.uint8)
    return a.astype(a.dtype.newbyteorder("<"), order="C")


def numpy_save_bytes(np, a):
    buffer = io.BytesIO()
    np.save(buffer, a)
    return buffer.getvalue()


def write_case(np, path, a, version):
    with open(path, "wb") as f:
        np.lib.format.write_array(f, a, version=version)


def main(argv):
    if len(argv) not in (2, 3):
        print(__doc__.strip().splitlines()[2], file=sys.stderr)
        return 2
    try:
        import numpy as np
    except ImportError as e:
        print(f"npy_interop: skipped: numpy is not importable by {sys.executable} ({e}); "
              "run it with /usr/bin/python3 (Debian python3-numpy)")
        return SKIP

    directory = argv[1]
    binary = argv[2] if len(argv) == 3 else None
    os.makedirs(directory, exist_ok=True)
    failures = []

    all_cases = cases(np)
    for name, a, version in all_cases:
        source = os.path.join(directory, name + ".npy")
        write_case(np, source, a, version)
        back = np.load(source)
        if back.dtype != a.dtype or back.shape != a.shape or back.tobytes() != a.tobytes():
            failures.append(f"{name}: numpy does not read back its own file {source}")
            continue
        if binary is None:
            continue
        copy = os.path.join(directory, name + ".roundtrip.npy")
        run = subprocess.run([binary, source, copy], capture_output=True, text=True)
        if run.returncode != 0:
            failures.append(f"{name}: {binary} failed with status {run.returncode}: "
                            f"{run.stderr.strip()}")
            continue
        expected = little_endian_copy(np, a)
        got = np.load(copy)
        if got.dtype != expected.dtype or got.shape != expected.shape:
            failures.append(f"{name}: expected {expected.dtype.str} {expected.shape}, "
                            f"found {got.dtype.str} {got.shape} in {copy}")
        elif got.tobytes() != expected.tobytes():
            failures.append(f"{name}: values differ from numpy's in {copy}")
        with open(copy, "rb") as f:
            written = f.read()
        if written != numpy_save_bytes(np, expected):
            failures.append(f"{name}: {copy} is not byte-identical to numpy.save's file")

    if binary is not None:
        rejects = []
        fortran = os.path.join(directory, "reject_fortran.npy")
        np.save(fortran, np.asfortranarray(np.arange(6, dtype=np.float32).reshape(2, 3)))
        rejects.append((fortran, "C order"))
        complex_file = os.path.join(directory, "reject_complex.npy")
        np.save(complex_file, np.zeros(3, dtype=np.complex64))
        rejects.append((complex_file, "unsupported descr"))
        full = numpy_save_bytes(np, np.arange(10, dtype=np.int32))
        truncated = os.path.join(directory, "reject_truncated.npy")
        with open(truncated, "wb") as f:
            f.write(full[:-3])
        rejects.append((truncated, "truncated"))
        trailing = os.path.join(directory, "reject_trailing.npy")
        with open(trailing, "wb") as f:
            f.write(full + b"\0")
        rejects.append((trailing, "trailing bytes"))
        missing = os.path.join(directory, "reject_missing.npy")
        rejects.append((missing, os.strerror(2)))
        for path, needle in rejects:
            out = os.path.join(directory, "rejected.out.npy")
            run = subprocess.run([binary, path, out], capture_output=True, text=True)
            if run.returncode != 1 or needle not in run.stderr or path not in run.stderr:
                failures.append(f"{os.path.basename(path)}: expected status 1 and a message "
                                f"naming the file and containing {needle!r}, found status "
                                f"{run.returncode}: {run.stderr.strip()!r}")

    if failures:
        print("npy_interop: FAILED", file=sys.stderr)
        for line in failures:
            print("  " + line, file=sys.stderr)
        return 1
    mode = f"round-tripped through {binary}" if binary else "written and checked with numpy"
    print(f"npy_interop: ok: {len(all_cases)} files {mode} in {directory}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
