#!/usr/bin/env python3
"""End-to-end tests of `dfss attention` on empty dimensions: B, H or Lq = 0 give empty outputs (and
gradients), Lk = 0 gives O = 0, LSE = -inf and zero gradients, d = 0 is bad input (exit 2, naming
head_dim) found by the CLI before it allocates anything.

All but the d = 0 test need the library to accept empty dimensions (views of zero elements, whose
data pointer may be null); a library that rejects them fails these tests with "expected a non-null
data pointer".

Usage: test_cli_empty_dims.py DFSS_BINARY. Exits 77 (CTest skip) with a reason when NumPy is not
importable.
"""
import os
import sys
import unittest

try:
    import numpy as np
except ImportError:  # pragma: no cover - exercised on machines without numpy
    print("SKIP: numpy is not importable by", sys.executable)
    sys.exit(77)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_cli import DfssCliCase  # noqa: E402  (shared helpers)
from test_cli_files import FilesCase  # noqa: E402


class EmptyDimensions(FilesCase):
    def run_empty(self, q, k, v, backward=True):
        self.save("qe.npy", q), self.save("ke.npy", k), self.save("ve.npy", v)
        self.save("doe.npy", np.ones_like(q))
        args = self.attention("--lse", "lse.npy", q="qe.npy", k="ke.npy", v="ve.npy")
        if backward:
            args += self.backward(dout="doe.npy")
        self.expect_ok(args)
        B, Lq, H, _ = q.shape
        o, lse = np.load(self.path("o.npy")), np.load(self.path("lse.npy"))
        self.assertEqual(o.shape, q.shape)
        self.assertEqual(lse.shape, (B, H, Lq))
        if backward:
            for name, like in (("dq", q), ("dk", k), ("dv", v)):
                self.assertEqual(np.load(self.path(name + ".npy")).shape, like.shape, name)
        return o, lse

    def test_empty_batch_heads_or_queries_give_empty_outputs(self):
        for B, Lq, H, Hkv in ((0, 7, 4, 2), (2, 7, 0, 1), (2, 0, 4, 2)):
            with self.subTest(B=B, Lq=Lq, H=H):
                q, k, v = self.operands(B=B, Lq=Lq, H=H, Hkv=Hkv)
                self.run_empty(q, k, v)

    def test_no_keys_give_zero_output_and_minus_infinity_lse(self):
        q, k, v = self.operands(Lk=0)
        o, lse = self.run_empty(q, k, v)
        self.assertTrue(np.all(o == 0))
        self.assertTrue(np.all(np.isneginf(lse)))
        self.assertTrue(np.all(np.load(self.path("dq.npy")) == 0))

    def test_zero_head_dim_is_bad_input(self):
        q, k, v = self.operands(d=0)
        self.save("qe.npy", q), self.save("ke.npy", k)
        self.expect_bad_input(self.attention(q="qe.npy", k="ke.npy", v="ke.npy"),
                              "--q qe.npy: expected shape [B, Lq, H, d] with head_dim d = shape[3] >= 1, "
                              "got [2, 7, 4, 0]")


if __name__ == "__main__":
    DfssCliCase.binary = os.path.abspath(sys.argv.pop(1))
    unittest.main(verbosity=2)
