#!/usr/bin/env python3
"""The text corpus of the language-model experiment: the Python standard library's .py sources.

Every Debian machine with python3 has them (no download): real code, docstrings and some English
prose (pydoc_data/topics.py is the language reference's text), with long-range structure (a class
and its methods, a module's imports and their uses). The corpus is deterministic:

* the files: every non-empty ``*.py`` under the stdlib directory (``sysconfig`` 'stdlib', e.g.
  /usr/lib/python3.11), in sorted relative-path order, except the top-level directories in
  EXCLUDED_DIRS and every ``__pycache__``. The exclusions keep exactly what Debian's
  libpython3.X-minimal and libpython3.X-stdlib install (the packages behind every ``python3``):
  dist-packages / site-packages hold third-party packages (numpy on some machines, not others);
  test/ grows by thousands of files when libpython3.X-testsuite is installed; lib2to3, distutils,
  ensurepip, idlelib, tkinter and turtledemo come from optional packages (python3-lib2to3,
  python3-distutils, python3.X-venv, idle-python3.X, python3-tk). So two machines with the same
  Python build get the same corpus whatever else they installed.
* the split: by file, from the SHA-256 of the relative path (not the contents, so an edited file
  stays in its split): its first 8 bytes as an integer modulo 100 below 80 train, below 90
  validation, else test. 80/10/10 rather than 90/5/5: the test split's documents are the units of
  the paired bootstrap (lm_report.py), and 10% gives about 60 of them (1.2 MB) instead of 33, while
  the training split (8.2 MB) still exceeds the default training budget, so no byte is seen twice.
* the output: ``{train,val,test}.bin`` (the split's documents concatenated in path order) and
  ``manifest.json``: the Python version, the Debian package versions where dpkg-query exists, and
  per split the file count, bytes, SHA-256 of the .bin and every document's path, offset and size,
  so that documents stay separate (evaluation starts a fresh context at each one) and a run records
  exactly what it trained on.

Documents must not contain byte 0: the model reads NUL as "document starts here" (lm_train.py).

  text_corpus.py build --out runs/lm/corpus                  (the stdlib of this interpreter)
  text_corpus.py build --source DIR --out DIR2
  text_corpus.py synthetic --out DIR --files 40              (a tiny Python-like tree for tests)
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
import sysconfig
from typing import Dict, List, Optional, Tuple

SPLITS = ("train", "val", "test")
# Percent of files per split, by path hash (module docstring: why 80/10/10).
SPLIT_PERCENT = {"train": 80, "val": 10, "test": 10}
# Top-level directories that come from optional Debian packages or hold third-party code (docstring).
EXCLUDED_DIRS = frozenset({"dist-packages", "site-packages", "test", "tests", "lib2to3", "distutils", "ensurepip",
                           "idlelib", "tkinter", "turtledemo"})
# Version 1 of the layout below; loaders refuse other versions rather than misread them.
FORMAT = 1
BOS = 0  # the byte that marks a document start for the model; documents must not contain it


def stdlib_dir() -> str:
    return sysconfig.get_paths()["stdlib"]


def list_files(source: str) -> List[str]:
    """The corpus's files under ``source``: relative POSIX paths, sorted, non-empty ``*.py`` only."""
    if not os.path.isdir(source):
        raise FileNotFoundError(f"text_corpus: source directory {source!r} does not exist")
    out = []
    for root, dirs, files in os.walk(source):
        top = os.path.samefile(root, source)
        dirs[:] = [d for d in dirs if d != "__pycache__" and not (top and d in EXCLUDED_DIRS)]
        for f in files:
            path = os.path.join(root, f)
            if f.endswith(".py") and os.path.isfile(path) and os.path.getsize(path) > 0:
                out.append(os.path.relpath(path, source).replace(os.sep, "/"))
    return sorted(out)


def split_of(relpath: str) -> str:
    """train / val / test from the SHA-256 of the relative path (its first 8 bytes, modulo 100)."""
    bucket = int.from_bytes(hashlib.sha256(relpath.encode("utf-8")).digest()[:8], "big") % 100
    edge = 0
    for name in SPLITS:
        edge += SPLIT_PERCENT[name]
        if bucket < edge:
            return name
    raise AssertionError("SPLIT_PERCENT must sum to 100")


def _package_versions() -> Optional[Dict[str, str]]:
    """Versions of Debian's libpython3.X-minimal / -stdlib (None where dpkg-query is missing)."""
    if shutil.which("dpkg-query") is None:
        return None
    ver = f"{sys.version_info.major}.{sys.version_info.minor}"
    names = [f"libpython{ver}-minimal", f"libpython{ver}-stdlib"]
    r = subprocess.run(["dpkg-query", "-W", "-f", "${Package} ${Version}\\n", *names], capture_output=True, text=True)
    found = dict(line.split(" ", 1) for line in r.stdout.splitlines() if " " in line)
    return found or None


def build(source: str, out: str) -> Dict:
    """Writes {train,val,test}.bin and manifest.json under ``out``; returns the manifest."""
    source = os.path.abspath(source)
    files = list_files(source)
    if not files:
        raise ValueError(f"text_corpus: no non-empty .py files under {source!r}")
    own = os.path.realpath(source) == os.path.realpath(stdlib_dir())
    manifest = {"format": FORMAT, "source": source, "split_percent": SPLIT_PERCENT,
                "excluded_dirs": sorted(EXCLUDED_DIRS),
                # The version of the stdlib read; only known when it is this interpreter's own.
                "python_version": sys.version.split()[0] if own else None,
                "debian_packages": _package_versions() if own else None,
                "splits": {}}
    os.makedirs(out, exist_ok=True)
    by_split: Dict[str, List[Tuple[str, bytes]]] = {s: [] for s in SPLITS}
    for rel in files:
        with open(os.path.join(source, rel), "rb") as f:
            data = f.read()
        if bytes([BOS]) in data:
            raise ValueError(f"text_corpus: {rel} contains byte {BOS}, which marks document starts for the model")
        by_split[split_of(rel)].append((rel, data))
    for name in SPLITS:
        docs, offset, h = [], 0, hashlib.sha256()
        tmp = os.path.join(out, name + ".bin.tmp")
        with open(tmp, "wb") as f:
            for rel, data in by_split[name]:
                f.write(data)
                h.update(data)
                docs.append({"path": rel, "offset": offset, "bytes": len(data)})
                offset += len(data)
        os.replace(tmp, os.path.join(out, name + ".bin"))
        manifest["splits"][name] = {"files": len(docs), "bytes": offset, "sha256": h.hexdigest(), "documents": docs}
    with open(os.path.join(out, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)
    return manifest


def read_manifest(corpus: str) -> Dict:
    path = os.path.join(corpus, "manifest.json")
    if not os.path.exists(path):
        raise FileNotFoundError(f"text_corpus: {path} is missing; build the corpus first "
                                f"(tools/train/text_corpus.py build --out {corpus})")
    with open(path) as f:
        m = json.load(f)
    if m.get("format") != FORMAT:
        raise ValueError(f"text_corpus: {path} has format {m.get('format')}, expected {FORMAT}; rebuild it")
    return m


def load_split(corpus: str, split: str) -> List[Tuple[str, bytes]]:
    """The split's documents as (path, bytes), after checking the .bin against the manifest's SHA-256."""
    if split not in SPLITS:
        raise ValueError(f"text_corpus: split must be one of {', '.join(SPLITS)}, got {split!r}")
    entry = read_manifest(corpus)["splits"][split]
    with open(os.path.join(corpus, split + ".bin"), "rb") as f:
        data = f.read()
    got = hashlib.sha256(data).hexdigest()
    if got != entry["sha256"]:
        raise ValueError(f"text_corpus: {corpus}/{split}.bin has SHA-256 {got}, the manifest says "
                         f"{entry['sha256']}; rebuild the corpus")
    return [(d["path"], data[d["offset"]:d["offset"] + d["bytes"]]) for d in entry["documents"]]


# Synthetic Python-like source for tests and --quick runs: names and statements drawn from small
# vocabularies, so that a tiny model learns something within a few steps.
_NAMES = ["value", "count", "items", "result", "path", "data", "index", "total", "key", "node"]
_OPS = ["+", "-", "*", "//", "%"]


def _synthetic_file(rng: random.Random, functions: int) -> str:
    lines = [f'"""Module {rng.randrange(1000)}: synthetic source for the dfss text-model tests."""', "import os", ""]
    for _ in range(functions):
        a, b = rng.sample(_NAMES, 2)
        lines.append(f"def {a}_{rng.randrange(100)}({a}, {b}={rng.randrange(10)}):")
        lines.append(f'    """Return {a} {rng.choice(_OPS)} {b}."""')
        for _ in range(rng.randrange(1, 5)):
            lines.append(f"    {a} = {a} {rng.choice(_OPS)} {b} {rng.choice(_OPS)} {rng.randrange(100)}")
        lines += [f"    return {a}", ""]
    return "\n".join(lines) + "\n"


def synthetic_tree(out: str, files: int, seed: int = 0, functions: Tuple[int, int] = (1, 12)) -> None:
    """Writes ``files`` Python-like files (in a few packages) under ``out``, plus decoys the corpus
    must skip: an excluded top-level directory, a __pycache__, an empty file and a non-.py file."""
    if files < 1:
        raise ValueError(f"text_corpus: --files must be >= 1, got {files}")
    rng = random.Random(seed)
    for i in range(files):
        sub = ["", "pkg_a/", "pkg_b/sub/"][i % 3]
        path = os.path.join(out, f"{sub}mod_{i:03d}.py")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(_synthetic_file(rng, rng.randint(*functions)))
    for decoy in ("test/test_decoy.py", "pkg_a/__pycache__/mod.py", "site-packages/third.py"):
        os.makedirs(os.path.join(out, os.path.dirname(decoy)), exist_ok=True)
        with open(os.path.join(out, decoy), "w") as f:
            f.write("x = 1\n")
    open(os.path.join(out, "pkg_a", "empty.py"), "w").close()
    with open(os.path.join(out, "notes.txt"), "w") as f:
        f.write("not a .py file\n")


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="build the corpus (train/val/test .bin and manifest.json)")
    b.add_argument("--source", default=None, help="directory of .py files (default: this interpreter's stdlib)")
    b.add_argument("--out", required=True)
    s = sub.add_parser("synthetic", help="write a tiny synthetic Python-like source tree")
    s.add_argument("--out", required=True)
    s.add_argument("--files", type=int, default=40)
    s.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.cmd == "build":
        m = build(args.source or stdlib_dir(), args.out)
        print(json.dumps({"source": m["source"], "python_version": m["python_version"],
                          **{k: {f: v[f] for f in ("files", "bytes", "sha256")} for k, v in m["splits"].items()}}))
    else:
        synthetic_tree(args.out, args.files, args.seed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
