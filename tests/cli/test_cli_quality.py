#!/usr/bin/env python3
"""End-to-end tests of `dfss quality` on .npy files.

The DFSS and top-k rows of the --json table are recomputed here with NumPy, independently of the
tool: full softmax attention in float64 with the bottom-right aligned causal mask, the N:M selection
of every aligned group of M keys by a stable descending sort (ties to the lower key index; the inputs
are continuous random values, so ties do not occur), top-k per row, and the metrics (Frobenius
relative error over all heads, mean cosine of output rows, kept mass mean and numpy.percentile 5,
rows without visible keys left out of cosine and mass). Bad inputs must exit with code 2 and name
the argument.

Usage: test_cli_quality.py DFSS_BINARY. Exits 77 (CTest skip) with a reason when NumPy is not
importable.
"""
import json
import os
import sys
import unittest

try:
    import numpy as np
except ImportError:  # pragma: no cover - exercised on machines without numpy
    print("SKIP: numpy is not importable by", sys.executable)
    sys.exit(77)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_cli import DfssCliCase  # noqa: E402  (shared scratch directory, .npy helpers, binary)


def full_probabilities(q, k, causal, scale):
    """Full softmax P [B, H, Lq, Lk] in float64 and the visible mask [1, 1, Lq, Lk]."""
    B, Lq, H, d = q.shape
    Lk, Hkv = k.shape[1], k.shape[2]
    kk = np.repeat(k.astype(np.float64), H // Hkv, axis=2)
    s = np.einsum("bihc,bjhc->bhij", q.astype(np.float64), kk)
    visible = np.ones((1, 1, Lq, Lk), dtype=bool)
    if causal:
        visible &= (np.arange(Lk)[None, :] <= np.arange(Lq)[:, None] + (Lk - Lq))[None, None]
    s = np.where(visible, s, -np.inf)
    mx = s.max(axis=-1, keepdims=True)
    mx = np.where(np.isfinite(mx), mx, 0.0)
    e = np.where(visible, np.exp(scale * (s - mx)), 0.0)
    z = e.sum(axis=-1, keepdims=True)
    return s, e / np.where(z > 0, z, 1.0), visible


def nm_keep(s, n, m):
    """Keep mask of the N:M selection of the masked scores s (-inf where masked)."""
    Lk = s.shape[-1]
    groups = -(-Lk // m)
    padded = np.full(s.shape[:-1] + (groups * m,), -np.inf)
    padded[..., :Lk] = s
    g = padded.reshape(s.shape[:-1] + (groups, m))
    order = np.argsort(-g, axis=-1, kind="stable")  # descending, ties to the lower index
    keep = np.zeros_like(g, dtype=bool)
    np.put_along_axis(keep, order[..., :n], True, axis=-1)
    return keep.reshape(padded.shape)[..., :Lk] & np.isfinite(s)


def topk_keep(s, budget):
    """Keep mask of the budget[row] largest visible scores of every row (budget [Lq])."""
    order = np.argsort(-s, axis=-1, kind="stable")
    ranks = np.empty_like(order)
    np.put_along_axis(ranks, order, np.arange(s.shape[-1])[None, None, None, :], axis=-1)
    return (ranks < budget[None, None, :, None]) & np.isfinite(s)


def attend(p, keep, v, H):
    """Softmax renormalised over the kept keys, times V: O [B, Lq, H, d]."""
    pk = np.where(keep, p, 0.0)
    z = pk.sum(axis=-1, keepdims=True)
    pk = pk / np.where(z > 0, z, 1.0)
    vv = np.repeat(v.astype(np.float64), H // v.shape[2], axis=2)
    return np.einsum("bhij,bjhc->bihc", pk, vv)


def metrics(o, o_full, p, keep, rows_with_keys):
    """rel_error, cosine mean, mass mean, mass p5 as the tool defines them."""
    rel = np.linalg.norm(o - o_full) / np.linalg.norm(o_full)
    a = np.transpose(o, (0, 2, 1, 3))[:, :, rows_with_keys]  # [B, H, rows, d]
    b = np.transpose(o_full, (0, 2, 1, 3))[:, :, rows_with_keys]
    cos = (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))
    mass = np.where(keep, p, 0.0).sum(-1)[:, :, rows_with_keys]
    return rel, cos.mean(), mass.mean(), np.percentile(mass.ravel(), 5)


def nm_budget(visible, n, m):
    return visible // m * n + np.minimum(n, visible % m)


class QualityCliTest(DfssCliCase):

    def operands(self, B=2, Lq=22, Lk=22, H=4, Hkv=2, d=8, dtype=np.float64):
        # Spread 2: peaked attention, so that the methods differ clearly.
        q = (2.0 * self.rng.standard_normal((B, Lq, H, d))).astype(dtype)
        k = (2.0 * self.rng.standard_normal((B, Lk, Hkv, d))).astype(dtype)
        v = self.rng.standard_normal((B, Lk, Hkv, d)).astype(dtype)
        return q, k, v

    def run_quality(self, q, k, v, *extra):
        args = ["quality", "--q", self.save("q.npy", q), "--k", self.save("k.npy", k), "--v", self.save("v.npy", v),
                "--json", self.path("out.json"), *extra]
        r = self.run_dfss(*args)
        self.assertEqual(r.returncode, 0, r.stderr)
        with open(self.path("out.json")) as f:
            table = json.load(f)
        return r, {(row["pattern"], row["method"]): row for row in table["rows"]}, table

    def check_against_numpy(self, q, k, v, causal, tol_output, extra=()):
        """Runs the tool with --patterns 1:2,2:4 and checks the dfss and topk rows against NumPy."""
        _, rows, table = self.run_quality(q, k, v, "--patterns", "1:2,2:4", *(["--causal"] if causal else []), *extra)
        H, d = q.shape[2], q.shape[3]
        scale = 1.0 / np.sqrt(d)
        self.assertAlmostEqual(table["inputs"]["scale"], scale, places=15)
        s, p, visible = full_probabilities(q, k, causal, scale)
        o_full = attend(p, visible, v, H)
        counts = visible[0, 0].sum(-1)
        with_keys = counts > 0
        for n, m in ((1, 2), (2, 4)):
            pattern = f"{n}:{m}"
            keep = nm_keep(s, n, m)
            np.testing.assert_array_equal(keep.sum(-1), np.broadcast_to(nm_budget(counts, n, m), keep.shape[:-1]))
            want = metrics(attend(p, keep, v, H), o_full, p, keep, with_keys)
            got = rows[(pattern, "dfss")]
            # The output-derived numbers carry the kernel's rounding (fp64 reference: ~1e-15; the
            # fp32 CPU kernel: ~1e-7 relative per output); the mass comes from the exact fp64 scores
            # of the same stored inputs, so it matches to fp64 summation error.
            self.assertAlmostEqual(got["rel_error"], want[0], delta=tol_output, msg=pattern)
            self.assertAlmostEqual(got["cosine"], want[1], delta=tol_output, msg=pattern)
            self.assertAlmostEqual(got["mass_mean"], want[2], delta=1e-12, msg=pattern)
            self.assertAlmostEqual(got["mass_p5"], want[3], delta=1e-12, msg=pattern)
            self.assertAlmostEqual(got["function_rel_error"], want[0], delta=1e-12, msg=pattern)
            self.assertEqual(got["budget"], nm_budget(k.shape[1], n, m))
            top = topk_keep(s, nm_budget(counts, n, m))
            want_top = metrics(attend(p, top, v, H), o_full, p, top, with_keys)
            got_top = rows[(pattern, "topk")]
            for key, w in zip(("rel_error", "cosine", "mass_mean", "mass_p5"), want_top):
                # Everything in fp64 on both sides: only summation order differs.
                self.assertAlmostEqual(got_top[key], w, delta=1e-12, msg=(pattern, key))
            # Exact top-k is the best sparse set of its size; the sparse baselines report a mass
            # and the dense ones do not.
            self.assertGreaterEqual(got_top["mass_mean"], got["mass_mean"])
            for method in ("window", "random", "bigbird"):
                self.assertLessEqual(rows[(pattern, method)]["mass_mean"], got_top["mass_mean"] + 1e-12, method)
            self.assertIsNone(rows[(pattern, "performer")]["mass_mean"])
        return rows, table

    def test_float64_inputs_match_numpy(self):
        q, k, v = self.operands()
        rows, table = self.check_against_numpy(q, k, v, causal=False, tol_output=1e-12)
        self.assertEqual(table["kernel"], "reference.forward")
        self.assertTrue(rows[("2:4", "nystrom")]["supported"])
        self.assertIsNotNone(rows[("2:4", "nystrom")]["rel_error"])

    def test_float32_inputs_use_the_cpu_kernel(self):
        q, k, v = self.operands(dtype=np.float32)
        rows, table = self.check_against_numpy(q, k, v, causal=False, tol_output=1e-5)
        self.assertTrue(table["kernel"].startswith("cpu."), table["kernel"])
        # fp32 accumulation against the fp64 function: a relative difference of order 1e-7.
        self.assertLess(rows[("2:4", "dfss")]["kernel_vs_function_rel_error"], 1e-5)

    def test_causal_with_rows_that_see_no_key(self):
        # Lq > Lk with a bottom-right aligned mask: the first 3 query rows see no key and are left
        # out of cosine and mass; Nystromformer has no causal form and is reported unsupported.
        q, k, v = self.operands(Lq=25, Lk=22)
        rows, _ = self.check_against_numpy(q, k, v, causal=True, tol_output=1e-12)
        ny = rows[("1:2", "nystrom")]
        self.assertFalse(ny["supported"])
        self.assertIsNone(ny["rel_error"])
        self.assertIn("causal", ny["reason"])
        r, _, _ = self.run_quality(q, k, v, "--causal", "--methods", "nystrom,dfss")
        self.assertIn("unsupported", r.stdout)

    def test_table_and_options(self):
        q, k, v = self.operands(B=1, H=2, Hkv=2)
        r, rows, table = self.run_quality(q, k, v, "--patterns", "2:4", "--methods", "dfss,random,performer",
                                          "--seed", "7", "--scale", "0.5")
        self.assertEqual(sorted(rows), [("2:4", "dfss"), ("2:4", "performer"), ("2:4", "random")])
        self.assertEqual(table["inputs"]["scale"], 0.5)
        self.assertEqual(table["inputs"]["seed"], 7)
        for word in ("pattern", "method", "rel_err", "cosine", "mass_mean", "mass_p5", "performer", "features"):
            self.assertIn(word, r.stdout)
        # The seed fixes the random methods: the same seed gives the same numbers, another seed others.
        _, again, _ = self.run_quality(q, k, v, "--patterns", "2:4", "--methods", "dfss,random,performer",
                                       "--seed", "7", "--scale", "0.5")
        _, other, _ = self.run_quality(q, k, v, "--patterns", "2:4", "--methods", "dfss,random,performer",
                                       "--seed", "8", "--scale", "0.5")
        self.assertEqual(rows[("2:4", "random")], again[("2:4", "random")])
        self.assertNotEqual(rows[("2:4", "performer")]["rel_error"], other[("2:4", "performer")]["rel_error"])

    def expect_bad_input(self, args, *fragments):
        r = self.run_dfss(*args)
        self.assertEqual(r.returncode, 2, f"stdout={r.stdout} stderr={r.stderr}")
        for f in fragments:
            self.assertIn(f, r.stderr)
        self.assertNotIn("internal error", r.stderr)

    def test_bad_inputs_exit_2_naming_the_argument(self):
        q, k, v = self.operands()
        qp, kp, vp = self.save("q.npy", q), self.save("k.npy", k), self.save("v.npy", v)
        base = ["quality", "--q", qp, "--k", kp, "--v", vp]
        self.expect_bad_input(["quality", "--q", self.path("missing.npy"), "--k", kp, "--v", vp], "missing.npy")
        self.expect_bad_input(base + ["--patterns", "3:2"], "--patterns", "3:2")
        self.expect_bad_input(base + ["--methods", "dfss,linformer"], "--methods", "linformer")
        self.expect_bad_input(["quality", "--q", self.save("qi.npy", q.astype(np.int32)), "--k", kp, "--v", vp],
                              "--q", "float64, float32 or float16")
        bad = q.copy()
        bad[1, 2, 3, 4] = np.nan
        self.expect_bad_input(["quality", "--q", self.save("qn.npy", bad), "--k", kp, "--v", vp], "--q", "finite")
        self.expect_bad_input(["quality", "--q", qp, "--k", self.save("kd.npy", k[..., :3]), "--v", vp], "'k'")
        self.expect_bad_input(["quality", "--q", qp, "--k", self.save("k32.npy", k.astype(np.float32)), "--v", vp],
                              "--k and --v")
        self.expect_bad_input(["quality", "--q", self.save("q3.npy", q[0]), "--k", kp, "--v", vp], "4 dimensions")
        self.expect_bad_input(["quality", "--q", self.save("q0.npy", q[:, :0]), "--k", kp, "--v", vp], "--q", "empty")
        self.expect_bad_input(base + ["--scale", "-2"], "scale")
        self.expect_bad_input(base + ["--threads", "100000"], "--threads", "[0, 1024]", "100000")
        self.expect_bad_input(base + ["--json", self.path("no/such/dir/out.json")], "--json", "out.json")
        self.expect_bad_input(["quality", "--q", qp], "--k")


if __name__ == "__main__":
    DfssCliCase.binary = sys.argv.pop(1)
    unittest.main(verbosity=2)
