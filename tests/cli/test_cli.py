#!/usr/bin/env python3
"""End-to-end tests of the `dfss attention` command on .npy files.

The expected values come from an independent NumPy implementation of docs/semantics.md written here
(dense score matrix, masks, stable-sort selection per group, softmax over kept entries, and the
matrix-form backward), so the reference backend is checked against a third formulation to 1e-12.

Usage: test_cli.py DFSS_BINARY. Exits 77 (CTest skip) with a reason when NumPy is not importable.
"""
import os
import subprocess
import sys
import tempfile
import unittest

try:
    import numpy as np
except ImportError:  # pragma: no cover - exercised on machines without numpy
    print("SKIP: numpy is not importable by", sys.executable)
    sys.exit(77)


def masked_scores(q, k, causal=False, lens=None, bias=None):
    """Masked scores S [B, H, Lq, Lk] in float64 (-inf where masked), as in docs/semantics.md."""
    B, Lq, H, _ = q.shape
    Lk, Hkv = k.shape[1], k.shape[2]
    kk = np.repeat(k.astype(np.float64), H // Hkv, axis=2)
    s = np.einsum("bihc,bjhc->bhij", q.astype(np.float64), kk)
    if bias is not None:
        s = s + bias
    visible = np.ones((B, 1, Lq, Lk), dtype=bool)
    if lens is not None:
        visible &= (np.arange(Lk)[None, :] < np.asarray(lens)[:, None])[:, None, None, :]
    if causal:
        visible &= (np.arange(Lk)[None, :] <= np.arange(Lq)[:, None] + (Lk - Lq))[None, None]
    return np.where(visible, s, -np.inf)


def semantics_forward(q, k, v, n, m, causal=False, scale=None, lens=None, bias=None):
    """O [B, Lq, H, d], LSE [B, H, Lq] and the keep mask [B, H, Lq, Lk] per docs/semantics.md."""
    H, d = q.shape[2], q.shape[3]
    Lk, Hkv = k.shape[1], k.shape[2]
    scale = 1.0 / np.sqrt(d) if scale is None else scale
    vv = np.repeat(v, H // Hkv, axis=2)
    s = masked_scores(q, k, causal=causal, lens=lens, bias=bias)
    groups = -(-Lk // m)
    padded = np.full(s.shape[:-1] + (groups * m,), -np.inf)
    padded[..., :Lk] = s
    g = padded.reshape(s.shape[:-1] + (groups, m))
    order = np.argsort(-g, axis=-1, kind="stable")  # descending; ties keep the lower index first
    keep = np.zeros_like(g, dtype=bool)
    np.put_along_axis(keep, order[..., :n], True, axis=-1)
    keep = keep.reshape(padded.shape)[..., :Lk]
    kept = np.where(keep, s, -np.inf)
    mx = kept.max(axis=-1, keepdims=True)
    empty = ~np.isfinite(mx)
    e = np.where(keep & ~empty, np.exp(scale * (kept - np.where(empty, 0, mx))), 0.0)
    z = e.sum(axis=-1, keepdims=True)
    p = np.where(empty, 0.0, e / np.where(empty, 1.0, z))
    o = np.einsum("bhij,bjhc->bihc", p, vv)
    with np.errstate(divide="ignore"):
        lse = np.where(empty[..., 0], -np.inf, scale * mx[..., 0] + np.log(np.where(empty[..., 0], 1.0, z[..., 0])))
    return o, lse, p, scale


def semantics_backward(q, k, v, dout, n, m, **kw):
    o, _, p, scale = semantics_forward(q, k, v, n, m, **kw)
    H, Hkv = q.shape[2], k.shape[2]
    kk = np.repeat(k, H // Hkv, axis=2)
    vv = np.repeat(v, H // Hkv, axis=2)
    dv_full = np.einsum("bhij,bihc->bjhc", p, dout)
    dp = np.einsum("bihc,bjhc->bhij", dout, vv)
    rowdot = np.einsum("bihc,bihc->bhi", dout, o)[..., None]
    ds = p * (dp - rowdot)
    dq = scale * np.einsum("bhij,bjhc->bihc", ds, kk)
    dk_full = scale * np.einsum("bhij,bihc->bjhc", ds, q)
    B, Lk, _, d = k.shape
    dk = dk_full.reshape(B, Lk, Hkv, H // Hkv, d).sum(axis=3)
    dv = dv_full.reshape(B, Lk, Hkv, H // Hkv, d).sum(axis=3)
    return dq, dk, dv, scale * ds


def selection_margin(s, n, m):
    """The smallest gap, over the groups of M keys of the masked scores s with more than N visible
    keys, between the N-th and (N+1)-th largest visible score: how far the inputs are from a tie that
    fp32 rounding could resolve either way (inf when no group selects)."""
    Lk = s.shape[-1]
    groups = -(-Lk // m)
    padded = np.full(s.shape[:-1] + (groups * m,), -np.inf)
    padded[..., :Lk] = s
    g = -np.sort(-padded.reshape(s.shape[:-1] + (groups, m)), axis=-1)
    selecting = np.isfinite(g[..., n])
    if not selecting.any():
        return np.inf
    return float(np.min(g[..., n - 1][selecting] - g[..., n][selecting]))


def rel_err(a, b):
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    assert a.shape == b.shape, (a.shape, b.shape)
    same_inf = np.isinf(a) & np.isinf(b) & (np.sign(a) == np.sign(b))
    if np.any(np.isinf(a) != np.isinf(b)) or np.any(np.isnan(a)) or np.any(np.isnan(b)):
        return np.inf
    with np.errstate(invalid="ignore"):  # inf - inf where both are the same infinity
        diff = np.where(same_inf, 0.0, np.abs(a - b) / (1.0 + np.abs(b)))
    return float(diff.max()) if diff.size else 0.0


class DfssCliCase(unittest.TestCase):
    """Scratch directory, random generator, .npy helpers and the dfss binary under test (set by main)."""
    binary = None

    def setUp(self):
        self.dir = tempfile.TemporaryDirectory()
        self.rng = np.random.default_rng()

    def tearDown(self):
        self.dir.cleanup()

    def path(self, name):
        return os.path.join(self.dir.name, name)

    def save(self, name, array):
        np.save(self.path(name), array)
        return self.path(name)

    def run_dfss(self, *args):
        return subprocess.run([self.binary, *args], capture_output=True, text=True, timeout=300)


class CliTest(DfssCliCase):

    def operands(self, B=2, Lq=7, Lk=11, H=4, Hkv=2, d=5, dtype=np.float64):
        q = self.rng.standard_normal((B, Lq, H, d)).astype(dtype)
        k = self.rng.standard_normal((B, Lk, Hkv, d)).astype(dtype)
        v = self.rng.standard_normal((B, Lk, Hkv, d)).astype(dtype)
        return q, k, v

    def test_reference_forward_reproduces_semantics(self):
        cases = [
            dict(pattern="2:4", n=2, m=4),
            dict(pattern="1:2", n=1, m=2, causal=True),
            dict(pattern="3:8", n=3, m=8, lens=[11, 4]),
            dict(pattern="dense", n=1, m=1, causal=True, lens=[0, 9]),
            dict(pattern="2:4", n=2, m=4, bias=True, scale=0.3),
        ]
        for case in cases:
            with self.subTest(case=case):
                q, k, v = self.operands(Lq=9 if case.get("causal") else 7)
                args = ["attention", "--q", self.save("q.npy", q), "--k", self.save("k.npy", k),
                        "--v", self.save("v.npy", v), "--pattern", case["pattern"], "--backend", "reference",
                        "--out", self.path("o.npy"), "--lse", self.path("lse.npy")]
                kw = {}
                if case.get("causal"):
                    args.append("--causal")
                    kw["causal"] = True
                if "scale" in case:
                    args += ["--scale", repr(case["scale"])]
                    kw["scale"] = case["scale"]
                if "lens" in case:
                    args += ["--key-lengths", self.save("lens.npy", np.array(case["lens"], dtype=np.int32))]
                    kw["lens"] = case["lens"]
                if case.get("bias"):
                    bias = self.rng.standard_normal((1, 4, q.shape[1], k.shape[1]))
                    bias[0, 1, 2, 3:6] = -np.inf
                    args += ["--bias", self.save("bias.npy", bias)]
                    kw["bias"] = bias
                r = self.run_dfss(*args)
                self.assertEqual(r.returncode, 0, r.stderr)
                o, lse = np.load(self.path("o.npy")), np.load(self.path("lse.npy"))
                self.assertEqual(o.dtype, np.float64)
                self.assertEqual(lse.shape, (q.shape[0], q.shape[2], q.shape[1]))
                want_o, want_lse, _, _ = semantics_forward(q, k, v, case["n"], case["m"], **kw)
                self.assertLessEqual(rel_err(o, want_o), 1e-12)
                self.assertLessEqual(rel_err(lse, want_lse), 1e-12)

    def test_key_shards_with_positions_merge_to_the_whole(self):
        # --key-offset, --query-offset and the windows: two shards at a multiple of M, merged with
        # the log-sum-exp rule written here, give the call over all keys.
        q, k, v = self.operands(Lq=3, Lk=23)
        qoff = self.save("qoff.npy", np.array([19, 12], dtype=np.int64))
        lens = self.save("lens.npy", np.array([23, 15], dtype=np.int64))
        common = ["--q", self.save("q.npy", q), "--pattern", "2:4", "--causal", "--backend", "reference",
                  "--query-offset", qoff, "--key-lengths", lens, "--sink-tokens", "2", "--recent-tokens", "5"]
        def run(k_part, v_part, offset, name):
            r = self.run_dfss("attention", *common, "--k", self.save(name + "k.npy", k_part),
                              "--v", self.save(name + "v.npy", v_part), "--key-offset", str(offset),
                              "--out", self.path(name + "o.npy"), "--lse", self.path(name + "lse.npy"))
            self.assertEqual(r.returncode, 0, r.stderr)
            return np.load(self.path(name + "o.npy")), np.load(self.path(name + "lse.npy"))
        whole_o, whole_lse = run(k, v, 0, "w")
        oa, la = run(k[:, :12], v[:, :12], 0, "a")
        ob, lb = run(k[:, 12:], v[:, 12:], 12, "b")
        lse = np.logaddexp(la, lb)                                  # [B, H, Lq]
        wa = np.exp(la - lse).transpose(0, 2, 1)[..., None]         # [B, Lq, H, 1]
        wb = np.exp(lb - lse).transpose(0, 2, 1)[..., None]
        self.assertLessEqual(rel_err(wa * oa + wb * ob, whole_o), 1e-12)
        self.assertLessEqual(rel_err(lse, whole_lse), 1e-12)
        # The windows change the result (the test above would pass vacuously otherwise).
        r = self.run_dfss("attention", *common[:-4], "--k", self.path("wk.npy"), "--v", self.path("wv.npy"),
                          "--out", self.path("plain.npy"))
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertGreater(np.abs(np.load(self.path("plain.npy")) - whole_o).max(), 1e-6)

    def test_reference_backward_reproduces_semantics(self):
        q, k, v = self.operands()
        dout = self.rng.standard_normal(q.shape)
        bias = self.rng.standard_normal((1, 1, q.shape[1], k.shape[1]))
        r = self.run_dfss("attention", "--q", self.save("q.npy", q), "--k", self.save("k.npy", k),
                          "--v", self.save("v.npy", v), "--pattern", "2:4", "--causal", "--out", self.path("o.npy"),
                          "--bias", self.save("bias.npy", bias[0, 0]),
                          "--dout", self.save("do.npy", dout), "--dq", self.path("dq.npy"),
                          "--dk", self.path("dk.npy"), "--dv", self.path("dv.npy"), "--dbias", self.path("db.npy"))
        self.assertEqual(r.returncode, 0, r.stderr)
        dq, dk, dv, dbias = semantics_backward(q, k, v, dout, 2, 4, causal=True, bias=bias)
        self.assertLessEqual(rel_err(np.load(self.path("dq.npy")), dq), 1e-12)
        self.assertLessEqual(rel_err(np.load(self.path("dk.npy")), dk), 1e-12)
        self.assertLessEqual(rel_err(np.load(self.path("dv.npy")), dv), 1e-12)
        self.assertLessEqual(rel_err(np.load(self.path("db.npy")), dbias.sum(axis=(0, 1))), 1e-12)

    def test_float32_backward_uses_the_fast_backend(self):
        # Small-integer inputs: exact scores, so the fast CPU backward keeps the fp64 selection and
        # only fp32 rounding separates it from the NumPy gradients.
        rng = self.rng
        q = rng.integers(-3, 4, (2, 9, 4, 8)).astype(np.float32)
        k = rng.integers(-3, 4, (2, 13, 2, 8)).astype(np.float32)
        v = rng.integers(-3, 4, (2, 13, 2, 8)).astype(np.float32)
        dout = rng.integers(-3, 4, q.shape).astype(np.float32)
        r = self.run_dfss("attention", "--q", self.save("q.npy", q), "--k", self.save("k.npy", k),
                          "--v", self.save("v.npy", v), "--pattern", "2:4", "--causal", "--out", self.path("o.npy"),
                          "--dout", self.save("do.npy", dout), "--dq", self.path("dq.npy"),
                          "--dk", self.path("dk.npy"), "--dv", self.path("dv.npy"))
        self.assertEqual(r.returncode, 0, r.stderr)
        dq, dk, dv, _ = semantics_backward(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64),
                                           dout.astype(np.float64), 2, 4, causal=True)
        for name, want in (("dq", dq), ("dk", dk), ("dv", dv)):
            got = np.load(self.path(name + ".npy"))
            self.assertEqual(got.dtype, np.float32)
            self.assertLessEqual(rel_err(got, want), 1e-4, name)

    def test_float32_and_float16_inputs_write_float32(self):
        for dt, tol in ((np.float32, 1e-4), (np.float16, 1e-4)):
            with self.subTest(dtype=dt):
                # Inputs without a near-tie at any group's selection boundary (after rounding to
                # dt): two scores within fp32 rounding (~1e-6) of each other may be kept either way
                # by the kernel and by the float64 semantics. 1e-4 leaves a hundredfold margin.
                for _ in range(100):
                    q, k, v = self.operands(dtype=dt)
                    if selection_margin(masked_scores(q, k), 1, 2) > 1e-4:
                        break
                else:
                    self.fail("no tie-free input in 100 draws")
                r = self.run_dfss("attention", "--q", self.save("q.npy", q), "--k", self.save("k.npy", k),
                                  "--v", self.save("v.npy", v), "--pattern", "1:2", "--backend", "cpu",
                                  "--out", self.path("o.npy"), "--lse", self.path("lse.npy"))
                self.assertEqual(r.returncode, 0, r.stderr)
                o = np.load(self.path("o.npy"))
                self.assertEqual(o.dtype, np.float32)
                self.assertEqual(np.load(self.path("lse.npy")).dtype, np.float32)
                want, _, _, _ = semantics_forward(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), 1, 2)
                # The fp64 expectation sees the same (rounded) inputs and, tie-free, keeps the same keys,
                # so only fp32 arithmetic differs.
                self.assertLessEqual(rel_err(o, want), tol)

    def expect_bad_input(self, args, *fragments):
        r = self.run_dfss(*args)
        self.assertEqual(r.returncode, 2, f"stdout={r.stdout} stderr={r.stderr}")
        for f in fragments:
            self.assertIn(f, r.stderr)
        self.assertNotIn("internal error", r.stderr)

    def base_args(self, q=None, k=None, v=None):
        qq, kk, vv = self.operands()
        return ["attention", "--q", q or self.save("q.npy", qq), "--k", k or self.save("k.npy", kk),
                "--v", v or self.save("v.npy", vv), "--out", self.path("o.npy")]

    def test_malformed_npy_files(self):
        q, _, _ = self.operands()
        good = self.save("good.npy", q)
        data = open(good, "rb").read()
        for cut in (0, 5, 9, 40, len(data) - 1):
            with self.subTest(cut=cut):
                bad = self.path(f"cut{cut}.npy")
                open(bad, "wb").write(data[:cut])
                self.expect_bad_input(self.base_args(q=bad), bad)
        junk = self.path("junk.npy")
        open(junk, "wb").write(b"not a numpy file at all, just text")
        self.expect_bad_input(self.base_args(q=junk), junk)
        self.expect_bad_input(self.base_args(q=self.path("missing.npy")), "missing.npy")
        fortran = self.save("f.npy", np.asfortranarray(q))
        self.expect_bad_input(self.base_args(q=fortran), "f.npy")

    def test_mismatched_and_invalid_inputs(self):
        q, k, v = self.operands()
        self.expect_bad_input(self.base_args(q=self.save("qi.npy", q.astype(np.int32))), "float64, float32 or float16")
        self.expect_bad_input(self.base_args(q=self.save("q3.npy", q[0])), "4 dimensions")
        self.expect_bad_input(self.base_args(k=self.save("kd.npy", k[..., :3])), "--k", "kd.npy", "head_dim")
        self.expect_bad_input(self.base_args(k=self.save("k32.npy", k.astype(np.float32))), "--k and --v")
        self.expect_bad_input(self.base_args(k=self.save("kh.npy", np.concatenate([k, k[:, :, :1]], axis=2))), "heads_kv")
        self.expect_bad_input(self.base_args() + ["--pattern", "3:2"], "--pattern", "3:2")
        self.expect_bad_input(self.base_args() + ["--pattern", "17:17"], "--pattern")
        self.expect_bad_input(self.base_args() + ["--backend", "tpu"], "--backend", "tpu")
        self.expect_bad_input(self.base_args() + ["--backend", "cuda"], "cuda")
        self.expect_bad_input(self.base_args() + ["--key-lengths", self.save("l.npy", np.array([3, -99], dtype=np.int64))],
                              "key_lengths", "-99")
        self.expect_bad_input(self.base_args() + ["--key-lengths", self.save("lf.npy", np.array([3.0, 9.0]))],
                              "int32 or int64")
        self.expect_bad_input(self.base_args() + ["--key-offset", "3"], "key_offset", "multiple of M = 4", "got 3")
        self.expect_bad_input(self.base_args() + ["--query-offset", self.save("qo.npy", np.array([1.0, 2.0]))],
                              "--query-offset", "int32 or int64")
        self.expect_bad_input(self.base_args() + ["--query-offset", self.save("qo3.npy", np.array([1, 2, 3]))],
                              "--query-offset", "[B] = [2]")
        self.expect_bad_input(self.base_args() + ["--sink-tokens", "-1"], "sink_tokens", "-1")
        self.expect_bad_input(self.base_args() + ["--bias", self.save("b.npy", np.zeros((3, 5)))], "--bias", "[3, 5]")
        self.expect_bad_input(self.base_args() + ["--dout", self.save("do.npy", q)], "--dq")
        self.expect_bad_input(self.base_args() + ["--scale", "-2"], "scale")
        # A thread count beyond the cap used to crash inside the OpenMP runtime, forward and backward.
        for threads in ("100000", "1025"):
            self.expect_bad_input(self.base_args() + ["--threads", threads], "num_threads", "[0, 1024]", threads)
            self.expect_bad_input(self.base_args() + ["--backend", "reference", "--threads", threads], "num_threads")
        self.expect_bad_input(self.base_args() + ["--dout", self.save("do2.npy", q), "--dq", self.path("dq.npy"),
                                                  "--dk", self.path("dk.npy"), "--dv", self.path("dv.npy"),
                                                  "--threads", "100000"], "num_threads")
        self.expect_bad_input(["attention", "--q", "x.npy"], "--k")

    def test_demo_bad_arguments_exit_2(self):
        # Found by fuzzing: a thread count the library rejects used to escape as "internal error".
        self.expect_bad_input(["demo", "--batch", "1", "--heads", "1", "--seq-len", "4", "--head-dim", "2",
                               "--threads", "-1"], "--threads", "[0, 1024]", "-1")
        self.expect_bad_input(["demo", "--batch", "100000000000", "--heads", "100000", "--seq-len", "100000",
                               "--head-dim", "2"], "overflows")

    def test_info_and_default_job(self):
        r = self.run_dfss("info")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("backends:", r.stdout)
        self.assertIn("reference", r.stdout)
        r = self.run_dfss("demo", "--seq-len", "64", "--heads", "2", "--no-real")  # real rows: test_cli_demo.py
        self.assertEqual(r.returncode, 0, r.stderr)
        for pat in ("dense", "1:2", "2:4"):
            self.assertIn(pat, r.stdout)


if __name__ == "__main__":
    DfssCliCase.binary = sys.argv.pop(1)
    unittest.main(verbosity=2)
