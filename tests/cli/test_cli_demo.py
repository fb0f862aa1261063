#!/usr/bin/env python3
"""End-to-end tests of the default job (`dfss` alone, `dfss demo`): its random rows and its rows on
real attention (Q, K, V of the text LM shipped in data/text-lm-qkv, or --real-data DIR).

- The shipped data: the real rows exist for layer0 and layer3 under dense, 1:2 and 2:4; the mass
  kept is in (0, 1] (exactly 1 for dense), 2:4 keeps more than 1:2, errors are finite, the kernel's
  error against the fp64 reference is at rounding level, and the rows agree with an independent
  NumPy computation of mass kept and error on the same files.
- A small --real-data directory written here: every printed number recomputed with NumPy (the
  semantics page's selection from test_cli.py), causal and not (capture.json).
- Missing, empty and corrupted data directories: exit code 2 with a message naming the file, never
  a crash or an internal error; --no-real gives the random rows only.

Usage: test_cli_demo.py DFSS_BINARY. Exits 77 (CTest skip) when NumPy is not importable.
"""
import json
import os
import re
import shutil
import sys
import unittest

try:
    import numpy as np
except ImportError:  # pragma: no cover - exercised on machines without numpy
    print("SKIP: numpy is not importable by", sys.executable)
    sys.exit(77)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_cli import DfssCliCase, semantics_forward  # noqa: E402

SHIPPED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "data", "text-lm-qkv")
# A small random-rows problem, so that a test's time is the real rows'.
SMALL = ["demo", "--seq-len", "16", "--heads", "1", "--head-dim", "8", "--threads", "2"]
ROW = re.compile(r"^(\S+)\s+(dense|\d+:\d+)\s+([0-9.]+)\s+([0-9.]+)x\s+([0-9.]+|nan)\s+(\S+)\s+(\S+)\s*$")


def real_rows(stdout):
    """{(input, pattern): (ms, speedup, mass, error vs dense, error vs fp64)} of the real table."""
    if "real attention" not in stdout:
        return {}
    rows = {}
    for line in stdout.split("real attention", 1)[1].splitlines():
        m = ROW.match(line)
        if m:
            rows[(m.group(1), m.group(2))] = tuple(float(m.group(i)) for i in range(3, 8))
    return rows


def numpy_rows(q, k, v, causal):
    """{pattern: (mass kept, error vs dense)} in float64 from the semantics page's selection."""
    q, k, v = (x.astype(np.float64) for x in (q, k, v))
    dense, _, p_dense, _ = semantics_forward(q, k, v, 1, 1, causal=causal)
    out = {}
    for name, n, m in (("dense", 1, 1), ("1:2", 1, 2), ("2:4", 2, 4)):
        o, _, p, _ = semantics_forward(q, k, v, n, m, causal=causal)
        mass = np.where(p > 0, p_dense, 0.0).sum(axis=-1).mean()
        out[name] = (mass, np.linalg.norm(o - dense) / np.linalg.norm(dense))
    return out


class DemoTest(DfssCliCase):

    def expect_data_error(self, data_dir, *fragments):
        r = self.run_dfss(*SMALL, "--real-data", data_dir)
        self.assertEqual(r.returncode, 2, f"stdout={r.stdout} stderr={r.stderr}")
        self.assertIn("dfss demo: real attention data:", r.stderr)
        for f in fragments:
            self.assertIn(f, r.stderr)
        self.assertNotIn("internal error", r.stderr)
        self.assertNotIn("real attention", r.stdout)  # checked before any table is printed

    def copy_shipped(self, name="data"):
        dst = self.path(name)
        shutil.copytree(SHIPPED, dst)
        return dst

    def test_default_job_real_rows_on_shipped_data(self):
        r = self.run_dfss(*SMALL)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("random attention", r.stdout)
        self.assertIn("mass kept", r.stdout)
        self.assertIn("causal", r.stdout)
        # The random rows' mass kept: in (0, 1], and 2:4 >= 1:2 (the top 2 of a group of 4 include
        # the top 1 of each of its pairs).
        m = re.search(r"^mass kept: 1:2 ([0-9.]+), 2:4 ([0-9.]+)$", r.stdout, re.M)
        self.assertIsNotNone(m, r.stdout)
        self.assertTrue(0 < float(m.group(1)) <= float(m.group(2)) <= 1, m.group(0))
        self.assertLess(r.stdout.index("mass kept: 1:2"), r.stdout.index("real attention"))
        rows = real_rows(r.stdout)
        self.assertEqual(set(rows), {(i, p) for i in ("layer0", "layer3") for p in ("dense", "1:2", "2:4")},
                         r.stdout)
        for layer in ("layer0", "layer3"):
            q, k, v = (np.load(os.path.join(SHIPPED, f"{layer}-{x}.npy")) for x in "qkv")
            expected = numpy_rows(q, k, v, causal=True)
            for pat in ("dense", "1:2", "2:4"):
                ms, speedup, mass, err_dense, err_ref = rows[(layer, pat)]
                with self.subTest(layer=layer, pattern=pat):
                    self.assertTrue(0 < mass <= 1, mass)
                    self.assertTrue(np.isfinite(err_dense) and np.isfinite(err_ref) and ms > 0 and speedup > 0)
                    self.assertLess(err_ref, 1e-5)  # fp32 kernel vs fp64 reference: rounding only
                    self.assertAlmostEqual(mass, expected[pat][0], delta=1e-4)
                    self.assertAlmostEqual(err_dense, expected[pat][1], delta=2e-3 * expected[pat][1] + 1e-6)
            self.assertEqual(rows[(layer, "dense")][2], 1.0)
            self.assertEqual(rows[(layer, "dense")][3], 0.0)
            self.assertGreater(rows[(layer, "2:4")][2], rows[(layer, "1:2")][2])
            self.assertLess(rows[(layer, "1:2")][2], 1.0)

    def test_real_rows_recomputed_on_small_data(self):
        for causal in (True, False):
            with self.subTest(causal=causal):
                d = self.path(f"small-{causal}")
                os.makedirs(d)
                rng = np.random.default_rng(7)
                # Peaked attention: scaled queries, K/V heads shared by two query heads (grouped).
                q = (3 * rng.standard_normal((2, 37, 4, 16))).astype(np.float16)
                k = rng.standard_normal((2, 37, 2, 16)).astype(np.float16)
                v = rng.standard_normal((2, 37, 2, 16)).astype(np.float32)
                for x, a in zip("qkv", (q, k, v)):
                    np.save(os.path.join(d, f"a-{x}.npy"), a)
                with open(os.path.join(d, "capture.json"), "w") as f:
                    json.dump({"causal": causal, "description": "test heads"}, f)
                r = self.run_dfss(*SMALL, "--real-data", d)
                self.assertEqual(r.returncode, 0, r.stderr)
                self.assertIn("real attention: test heads", r.stdout)
                self.assertIn("(1 input, causal;" if causal else "(1 input, not causal;", r.stdout)
                rows = real_rows(r.stdout)
                self.assertEqual(set(rows), {("a", p) for p in ("dense", "1:2", "2:4")})
                expected = numpy_rows(q, k, v, causal=causal)
                for pat, (mass, err) in expected.items():
                    self.assertAlmostEqual(rows[("a", pat)][2], mass, delta=1e-4)
                    self.assertAlmostEqual(rows[("a", pat)][3], err, delta=2e-3 * err + 1e-6)

    def test_no_real(self):
        r = self.run_dfss(*SMALL, "--no-real")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("random attention", r.stdout)
        self.assertNotIn("real attention", r.stdout)
        self.assertIn("mass kept: 1:2", r.stdout)  # the random rows' line
        self.assertNotIn("data/text-lm-qkv", r.stdout)
        r = self.run_dfss(*SMALL, "--no-real", "--real-data", SHIPPED)
        self.assertEqual(r.returncode, 2)
        self.assertIn("excludes", r.stderr)

    def test_missing_and_empty_data_directories(self):
        self.expect_data_error(self.path("nowhere"), "nowhere", "not a directory")
        os.makedirs(self.path("empty"))
        self.expect_data_error(self.path("empty"), "empty", "NAME-q.npy", "found none")

    def test_corrupted_data(self):
        d = self.copy_shipped("missing-v")
        os.remove(os.path.join(d, "layer3-v.npy"))
        self.expect_data_error(d, "layer3-v.npy")

        d = self.copy_shipped("truncated")
        path = os.path.join(d, "layer0-k.npy")
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) // 2)
        self.expect_data_error(d, "layer0-k.npy")

        d = self.copy_shipped("junk")
        with open(os.path.join(d, "layer0-q.npy"), "wb") as f:
            f.write(b"not a numpy file")
        self.expect_data_error(d, "layer0-q.npy")

        d = self.copy_shipped("nan")
        q = np.load(os.path.join(d, "layer3-q.npy"))
        q[0, 5, 1, 3] = np.nan
        np.save(os.path.join(d, "layer3-q.npy"), q)
        self.expect_data_error(d, "layer3-q.npy", "finite")

        d = self.copy_shipped("shape")
        np.save(os.path.join(d, "layer0-v.npy"), np.zeros((1, 1024, 4, 32), dtype=np.float16))
        self.expect_data_error(d, "layer0-k.npy and -v.npy", "same shape")

        d = self.copy_shipped("rank")
        np.save(os.path.join(d, "layer0-q.npy"), np.zeros((1024, 4, 64), dtype=np.float16))
        self.expect_data_error(d, "layer0-q.npy", "4 dimensions")

        d = self.copy_shipped("dtype")
        np.save(os.path.join(d, "layer0-q.npy"), np.zeros((1, 1024, 4, 64), dtype=np.int32))
        self.expect_data_error(d, "layer0-q.npy", "float16 or float32")

        d = self.copy_shipped("note")
        with open(os.path.join(d, "capture.json"), "w") as f:
            f.write("{ not json")
        self.expect_data_error(d, "capture.json")
        with open(os.path.join(d, "capture.json"), "w") as f:
            json.dump({"causal": "yes"}, f)
        self.expect_data_error(d, "capture.json", "causal")

    def test_shipped_data_matches_its_checksums(self):
        import hashlib
        with open(os.path.join(SHIPPED, "SHA256SUMS")) as f:
            sums = [line.split() for line in f if line.strip()]
        self.assertEqual(len(sums), 6)
        for digest, name in sums:
            with open(os.path.join(SHIPPED, name), "rb") as f:
                self.assertEqual(hashlib.sha256(f.read()).hexdigest(), digest, name)
        with open(os.path.join(SHIPPED, "capture.json")) as f:
            note = json.load(f)
        self.assertIs(note["causal"], True)


if __name__ == "__main__":
    DfssCliCase.binary = sys.argv.pop(1)
    unittest.main(verbosity=2)
