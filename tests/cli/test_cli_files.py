#!/usr/bin/env python3
"""End-to-end tests of how `dfss attention` (and the --json writers of `dfss quality` and `dfss bench`)
treat bad input and their files (docs/testing.md, "Bad input to the CLI"):

- an output path that names an input or another output (same string, ./a.npy, a/../a.npy, a symlink,
  a hard link, a not yet existing file through a symlinked directory) is rejected, exit 2, before
  anything is written; /dev/null may take several outputs;
- bad input (a --dout of the wrong shape, an --lse in a missing directory or that is a directory, a
  --save-compressed prefix in a missing directory) exits 2 with every existing output untouched;
- a short write (RLIMIT_FSIZE) exits 2 and leaves every old output byte for byte, and no temporary
  file; modes and symlinked outputs are kept;
- shapes are checked against each other before outputs are allocated (a 128-byte file announcing a
  [1, 2^26, 4, 0] Q costs no 1 GiB LSE buffer), a failed allocation is exit 2 with the byte count
  (never "internal error"), /dev/zero fails at its magic string, and a pipe is read only as far as
  its header says;
- the --json files of `dfss quality` and `dfss bench` are checked first and replaced atomically.
Empty dimensions are tested in test_cli_empty_dims.py.

Usage: test_cli_files.py DFSS_BINARY. Exits 77 (CTest skip) with a reason when NumPy is not importable.
DFSS_SANITIZE (set by CMake to the build's sanitizers): the tests that cap the address space
(RLIMIT_AS) skip under AddressSanitizer, which reserves terabytes of address space at start-up.
"""
import json
import os
import resource
import stat
import subprocess
import sys
import tempfile
import threading
import unittest

try:
    import numpy as np
except ImportError:  # pragma: no cover - exercised on machines without numpy
    print("SKIP: numpy is not importable by", sys.executable)
    sys.exit(77)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_cli import DfssCliCase  # noqa: E402  (shared helpers)

SANITIZED = "address" in os.environ.get("DFSS_SANITIZE", "")
MiB = 1 << 20
GiB = 1 << 30
# A process that never allocates its big buffers stays far below this peak resident size (the
# largest case here would otherwise zero-fill 1 GiB); sanitizer builds need some 100 MiB more.
RSS_BOUND = 256 * MiB
# Address-space cap for the allocation-failure tests: room for the binary, its libraries and small
# inputs, far below the 8 GiB buffer that must fail to allocate.
ADDRESS_SPACE = 4 * GiB


def limit(resource_id, value):
    """preexec_fn that lowers one soft resource limit in the child."""
    def apply():
        _, hard = resource.getrlimit(resource_id)
        resource.setrlimit(resource_id, (value, hard))
    return apply


class FilesCase(DfssCliCase):
    """Runs dfss in the scratch directory (relative paths are relative to it)."""

    def setUp(self):
        super().setUp()
        self.q, self.k, self.v = self.operands()
        for name, a in (("q", self.q), ("k", self.k), ("v", self.v), ("do", self.q * 0.5)):
            self.save(name + ".npy", a)
        self.save("lens.npy", np.array([11, 4], dtype=np.int64))
        self.save("b.npy", self.rng.standard_normal((self.q.shape[1], self.k.shape[1])).astype(np.float32))

    def operands(self, B=2, Lq=7, Lk=11, H=4, Hkv=2, d=5, dtype=np.float32):
        return (self.rng.standard_normal((B, Lq, H, d)).astype(dtype),
                self.rng.standard_normal((B, Lk, Hkv, d)).astype(dtype),
                self.rng.standard_normal((B, Lk, Hkv, d)).astype(dtype))

    def run_cli(self, args, **kw):
        kw.setdefault("timeout", 120)
        return subprocess.run([self.binary, *args], cwd=self.dir.name, capture_output=True, text=True, **kw)

    @staticmethod
    def attention(*extra, q="q.npy", k="k.npy", v="v.npy", out="o.npy"):
        return ["attention", "--q", q, "--k", k, "--v", v, "--out", out, *extra]

    @staticmethod
    def backward(dq="dq.npy", dk="dk.npy", dv="dv.npy", dout="do.npy"):
        return ["--dout", dout, "--dq", dq, "--dk", dk, "--dv", dv]

    def snapshot(self):
        """Every entry under the scratch directory: file bytes, link targets, directories."""
        entries = {}
        for root, dirs, files in os.walk(self.dir.name):
            for name in dirs + files:
                full = os.path.join(root, name)
                rel = os.path.relpath(full, self.dir.name)
                if os.path.islink(full):
                    entries[rel] = ("link", os.readlink(full))
                elif os.path.isdir(full):
                    entries[rel] = "dir"
                else:
                    with open(full, "rb") as f:
                        entries[rel] = f.read()
        return entries

    def old_outputs(self, *names):
        """Puts recognisable previous versions of the outputs in place."""
        for name in names:
            with open(self.path(name), "wb") as f:
                f.write(b"previous contents of " + name.encode())

    def expect_bad_input(self, args, *fragments, **kw):
        """Exit code 2, every fragment in the message, and nothing in the directory changed."""
        before = self.snapshot()
        r = self.run_cli(args, **kw)
        self.assertEqual(r.returncode, 2, f"args={args} stdout={r.stdout} stderr={r.stderr}")
        for f in fragments:
            self.assertIn(f, r.stderr, args)
        self.assertNotIn("internal error", r.stderr)
        self.assertEqual(self.snapshot(), before, f"files changed: args={args} stderr={r.stderr}")
        return r

    def expect_ok(self, args, **kw):
        r = self.run_cli(args, **kw)
        self.assertEqual(r.returncode, 0, f"args={args} stdout={r.stdout} stderr={r.stderr}")
        return r

    def run_measured(self, args, **popen_kw):
        """Runs dfss and returns (exit code, stderr, peak resident bytes of that process alone)."""
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
            p = subprocess.Popen([self.binary, *args], cwd=self.dir.name, stdout=out, stderr=err, **popen_kw)
            _, status, usage = os.wait4(p.pid, 0)
            p.returncode = os.waitstatus_to_exitcode(status)
            err.seek(0)
            return p.returncode, err.read().decode(errors="replace"), usage.ru_maxrss * 1024  # KiB on Linux


class AliasedPaths(FilesCase):

    def test_an_output_naming_an_input_or_another_output_is_rejected(self):
        os.mkdir(self.path("sub"))
        os.symlink("sub", self.path("sublink"))
        os.symlink("o.npy", self.path("link.npy"))
        os.link(self.path("q.npy"), self.path("q_hard.npy"))
        self.old_outputs("o.npy")
        three_stage = ["--algorithm", "three-stage", "--backend", "cpu"]
        cases = [
            (self.attention("--lse", "o.npy"), "--lse o.npy", "--out o.npy"),
            (self.attention("--lse", "./o.npy"), "--lse ./o.npy", "--out o.npy"),
            (self.attention("--lse", "sub/../o.npy"), "--lse sub/../o.npy"),
            (self.attention("--lse", "link.npy"), "--lse link.npy", "--out o.npy"),
            (self.attention("--lse", "sublink/new.npy", out="sub/new.npy"), "--lse sublink/new.npy"),
            (self.attention(out="q.npy"), "--out q.npy", "--q q.npy"),
            (self.attention(out="q_hard.npy"), "--out q_hard.npy", "--q q.npy"),
            (self.attention(out=self.path("k.npy")), "--k k.npy"),
            (self.attention(*self.backward(), out="do.npy"), "--out do.npy", "--dout do.npy"),
            (self.attention(*self.backward(dk="dq.npy")), "--dk dq.npy", "--dq dq.npy"),
            (self.attention("--lse", "do.npy", *self.backward()), "--lse do.npy", "--dout do.npy"),
            (self.attention(*self.backward(dv="v.npy")), "--dv v.npy", "--v v.npy"),
            (self.attention("--key-lengths", "lens.npy", "--lse", "lens.npy"), "--lse", "--key-lengths"),
            (self.attention("--bias", "b.npy", *self.backward(), "--dbias", "b.npy"), "--dbias b.npy", "--bias"),
            (self.attention(*three_stage, "--save-compressed", "p", out="p.values.npy"),
             "--save-compressed p.values.npy", "--out p.values.npy"),
            (self.attention(*three_stage, "--save-compressed", "q", "--pattern", "3:8", "--lse", "q.indices.npy"),
             "--save-compressed q.indices.npy", "--lse q.indices.npy"),
        ]
        for args, *fragments in cases:
            with self.subTest(args=args):
                self.expect_bad_input(args, *fragments)

    def test_dev_null_may_take_several_outputs(self):
        null = "/dev/null"
        self.expect_ok(self.attention("--lse", null, *self.backward(dq=null, dk=null, dv=null), out=null))
        self.assertTrue(stat.S_ISCHR(os.stat(null).st_mode), "/dev/null must stay a character device")
        # A regular file is still protected when /dev/null repeats around it.
        self.old_outputs("o.npy")
        self.expect_bad_input(self.attention("--lse", null, *self.backward(dq=null, dk=null, dv="o.npy")),
                              "--dv o.npy", "--out o.npy")


class ValidationBeforeWriting(FilesCase):

    def test_bad_input_replaces_no_output(self):
        os.mkdir(self.path("adir"))
        self.old_outputs("o.npy", "lse.npy", "dq.npy", "dk.npy", "dv.npy")
        self.save("do_shape.npy", self.q[:, :3])
        self.save("do_f64.npy", self.q.astype(np.float64))
        with open(self.path("do_cut.npy"), "wb") as f, open(self.path("do.npy"), "rb") as g:
            f.write(g.read()[:-1])
        self.save("lens_bad.npy", np.array([3, -99], dtype=np.int64))
        self.save("lens_shape.npy", np.array([3, 4, 5], dtype=np.int64))
        three_stage = ["--algorithm", "three-stage", "--backend", "cpu"]
        cases = [
            (self.attention("--lse", "lse.npy", *self.backward(dout="do_shape.npy")),
             "--dout do_shape.npy", "expected the shape of --q [2, 7, 4, 5], got [2, 3, 4, 5]"),
            (self.attention("--lse", "lse.npy", *self.backward(dout="do_f64.npy")), "--dout", "f64"),
            (self.attention("--lse", "lse.npy", *self.backward(dout="do_cut.npy")), "--dout", "do_cut.npy",
             "truncated"),
            (self.attention("--lse", "missing/lse.npy"), "--lse missing/lse.npy", "'missing'"),
            (self.attention("--lse", "adir"), "--lse adir", "directory"),
            (self.attention("--lse", "o.npy/lse.npy"), "--lse o.npy/lse.npy", os.strerror(20)),  # ENOTDIR
            (self.attention(*three_stage, "--save-compressed", "missing/p"), "--save-compressed missing/p.values.npy"),
            (self.attention(*self.backward(dq="missing/dq.npy")), "--dq missing/dq.npy"),
            (self.attention(*self.backward(dv="adir")), "--dv adir", "directory"),
            (self.attention("--key-lengths", "lens_bad.npy", "--lse", "lse.npy"), "key_lengths", "-99"),
            (self.attention("--key-lengths", "lens_shape.npy"), "--key-lengths lens_shape.npy", "[B] = [2]"),
            (self.attention("--bias", "do.npy", *self.backward(), "--dbias", "db.npy"), "--bias do.npy", "Lq, Lk"),
            (self.attention("--backend", "cuda", *self.backward()), "cuda"),
        ]
        for args, *fragments in cases:
            with self.subTest(args=args):
                self.expect_bad_input(args, *fragments)


class AtomicWrites(FilesCase):
    # Why 8 KiB: above the --out file of the small operands (2*7*4*5 floats, 1,248 bytes with the
    # header) and below the big ones used to make a write fail.
    FILE_LIMIT = 8192

    def test_short_write_keeps_every_old_output(self):
        # O of [2, 64, 4, 16] float32 is 32 KiB: writing it fails with EFBIG. The child's SIGXFSZ is
        # left at its default (subprocess restores it), so dfss must ignore it itself to clean up.
        big_q, big_k, big_v = self.operands(Lq=64, Lk=64, d=16)
        self.save("bq.npy", big_q), self.save("bk.npy", big_k), self.save("bv.npy", big_v)
        self.old_outputs("o.npy", "lse.npy", "p.values.npy", "p.indices.npy", "p.meta.npy")
        r = self.expect_bad_input(self.attention("--lse", "lse.npy", q="bq.npy", k="bk.npy", v="bv.npy"),
                                  "--out", "o.npy", os.strerror(27),  # EFBIG: File too large
                                  preexec_fn=limit(resource.RLIMIT_FSIZE, self.FILE_LIMIT))
        self.assertIn("no output file was replaced", r.stderr)
        # Here --out (1.2 KiB) fits and the compressed values (2*4*7*256 floats, 57 KiB) do not: the
        # already written --out must not replace the old one either.
        _, long_k, long_v = self.operands(Lk=512)
        self.save("lk.npy", long_k), self.save("lv.npy", long_v)
        self.expect_bad_input(self.attention("--lse", "lse.npy", "--algorithm", "three-stage", "--backend", "cpu",
                                             "--save-compressed", "p", k="lk.npy", v="lv.npy"),
                              "--save-compressed", "p.values.npy", os.strerror(27),
                              preexec_fn=limit(resource.RLIMIT_FSIZE, self.FILE_LIMIT))

    def test_modes_symlinks_and_no_temporary_files(self):
        self.old_outputs("o.npy", "target.npy")
        os.chmod(self.path("o.npy"), 0o640)
        os.symlink("target.npy", self.path("link.npy"))

        def umask_027():
            os.umask(0o027)
        self.expect_ok(self.attention("--lse", "link.npy", *self.backward()), preexec_fn=umask_027)
        self.assertEqual(stat.S_IMODE(os.stat(self.path("o.npy")).st_mode), 0o640)
        for fresh in ("dq.npy", "dk.npy", "dv.npy"):
            self.assertEqual(stat.S_IMODE(os.stat(self.path(fresh)).st_mode), 0o640, fresh)
        self.assertTrue(os.path.islink(self.path("link.npy")))
        self.assertEqual(np.load(self.path("target.npy")).shape, (2, 4, 7))
        self.assertEqual(np.load(self.path("o.npy")).shape, self.q.shape)
        self.assertEqual(sorted(os.listdir(self.dir.name)),
                         sorted(["q.npy", "k.npy", "v.npy", "do.npy", "lens.npy", "b.npy", "o.npy", "target.npy",
                                 "link.npy", "dq.npy", "dk.npy", "dv.npy"]))


class MemoryAndStreams(FilesCase):

    def test_zero_head_dim_fails_before_allocating(self):
        # 128 bytes announcing Q [1, 2^26, 4, 0]: the old CLI zero-filled a 1 GiB LSE [B, H, Lq] first.
        self.save("qz.npy", np.empty((1, 1 << 26, 4, 0), dtype=np.float32))
        self.save("kz.npy", np.empty((1, 5, 4, 0), dtype=np.float32))
        self.assertEqual(os.path.getsize(self.path("qz.npy")), 128)
        code, err, rss = self.run_measured(self.attention("--lse", "lse.npy", q="qz.npy", k="kz.npy", v="kz.npy"))
        self.assertEqual(code, 2, err)
        self.assertIn("--q qz.npy: expected shape [B, Lq, H, d] with head_dim d = shape[3] >= 1", err)
        self.assertLess(rss, RSS_BOUND)

    def test_huge_empty_shapes_are_bad_input_not_internal_error(self):
        # [1, 2^40, 2^10, 0]: an LSE of 2^50 floats cannot be allocated; the old CLI said "internal error".
        self.save("qz.npy", np.empty((1, 1 << 40, 1 << 10, 0), dtype=np.float32))
        self.save("kz.npy", np.empty((1, 5, 1 << 10, 0), dtype=np.float32))
        self.expect_bad_input(self.attention("--lse", "lse.npy", q="qz.npy", k="kz.npy", v="kz.npy"), "--q", "head_dim")

    def test_huge_header_without_the_data_is_truncated(self):
        with open(self.path("qh.npy"), "wb") as f:
            header = "{'descr': '<f4', 'fortran_order': False, 'shape': (1048576, 1048576, 8, 64), }"
            header += " " * (117 - len(header)) + "\n"
            f.write(b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header.encode() + b"\0" * 64)
        code, err, rss = self.run_measured(self.attention(q="qh.npy"))
        self.assertEqual(code, 2, err)
        self.assertIn("--q: npy file 'qh.npy': truncated data", err)
        self.assertLess(rss, RSS_BOUND)

    @unittest.skipIf(SANITIZED, "AddressSanitizer cannot run under an address-space limit (RLIMIT_AS)")
    def test_compressed_scores_that_do_not_fit_are_reported(self):
        # Q [1, 4096, 16, 1] and K, V [1, 65536, 1, 1] (256 KiB each) make 2:4 compressed values of
        # [1, 16, 4096, 32768] float32 = 8 GiB, beyond the 4 GiB address space given to the process.
        self.save("q1.npy", np.ones((1, 4096, 16, 1), dtype=np.float32))
        self.save("k1.npy", np.ones((1, 65536, 1, 1), dtype=np.float32))
        self.expect_bad_input(self.attention("--algorithm", "three-stage", "--backend", "cpu", "--save-compressed", "p",
                                             q="q1.npy", k="k1.npy", v="k1.npy"),
                              "--save-compressed p.values.npy: cannot allocate 8589934592 bytes",
                              "[1, 16, 4096, 32768] f32", "out of memory",
                              preexec_fn=limit(resource.RLIMIT_AS, ADDRESS_SPACE))

    def test_dev_zero_fails_fast(self):
        # The address-space cap only matters for a reader that does not stop (it then fails instead
        # of filling the machine's memory); the timeout catches one that neither stops nor fails.
        kw = {} if SANITIZED else {"preexec_fn": limit(resource.RLIMIT_AS, ADDRESS_SPACE)}
        self.expect_bad_input(self.attention(q="/dev/zero"), "--q: npy file '/dev/zero': bad magic", timeout=60, **kw)

    def test_pipes_are_read_as_far_as_the_header_says(self):
        with open(self.path("q.npy"), "rb") as f:
            image = f.read()
        # A pipe delivering exactly the file works like the file.
        r = subprocess.run([self.binary, *self.attention(q="/dev/stdin")], cwd=self.dir.name, input=image,
                           capture_output=True, timeout=120)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(np.load(self.path("o.npy")).shape, self.q.shape)
        # A pipe that goes on after the data: dfss reads one byte past it, reports trailing bytes and
        # exits, so the writer is stopped (EPIPE) after about a pipe buffer, not after 64 MiB.
        p = subprocess.Popen([self.binary, *self.attention(q="/dev/stdin")], cwd=self.dir.name,
                             stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        written = [0]

        def feed():
            data = image + b"\x55" * (64 * MiB)
            try:
                for start in range(0, len(data), 65536):
                    p.stdin.write(data[start:start + 65536])
                    p.stdin.flush()
                    written[0] = start + 65536
                p.stdin.close()
            except OSError:  # BrokenPipeError: dfss stopped reading
                pass
        writer = threading.Thread(target=feed)
        writer.start()
        err = p.stderr.read()  # until dfss exits
        p.wait(timeout=120)
        writer.join()
        p.stderr.close()
        try:
            p.stdin.close()
        except OSError:  # the unflushed rest of a broken pipe
            pass
        self.assertEqual(p.returncode, 2, err)
        self.assertIn(b"trailing bytes", err)
        self.assertLess(written[0], len(image) + 2 * MiB)


class JsonWriters(FilesCase):

    def test_quality_json_is_replaced_only_when_complete(self):
        with open(self.path("report.json"), "w") as f:
            f.write('{"previous": true}\n')
        quality = ["quality", "--q", "q.npy", "--k", "k.npy", "--v", "v.npy", "--methods", "dfss,window"]
        # A bad input found after the --json check: the old report stays (the old CLI truncated it).
        self.expect_bad_input(["quality", "--q", "missing.npy", "--k", "k.npy", "--v", "v.npy",
                               "--json", "report.json"], "missing.npy")
        self.expect_bad_input(quality + ["--json", "missing/r.json"], "--json missing/r.json")
        self.expect_bad_input(quality + ["--json", "./q.npy"], "--json ./q.npy", "--q q.npy")
        # Why 64 bytes: less than the report, more than nothing.
        self.expect_bad_input(quality + ["--json", "report.json"], "--json report.json", os.strerror(27),
                              preexec_fn=limit(resource.RLIMIT_FSIZE, 64))
        self.expect_ok(quality + ["--json", "report.json"])
        with open(self.path("report.json")) as f:
            self.assertEqual([row["method"] for row in json.load(f)["rows"]], ["dfss", "window"] * 2)

    def test_bench_json_is_checked_before_measuring_and_replaced_atomically(self):
        bench = ["bench", "--lengths", "64", "--heads", "2", "--iters", "1", "--warmup", "1", "--no-torch",
                 "--no-sgemm", "--patterns", "2:4", "--algorithms", "fused", "--isa", "automatic"]
        r = self.expect_bad_input(bench + ["--json", "missing/b.json"], "--json missing/b.json", "'missing'")
        self.assertEqual(r.stdout, "", "the benchmark must not run when its --json cannot be written")
        with open(self.path("b.json"), "w") as f:
            f.write('{"previous": true}\n')
        self.expect_bad_input(bench + ["--json", "b.json"], "--json b.json", os.strerror(27),
                              preexec_fn=limit(resource.RLIMIT_FSIZE, 64))


if __name__ == "__main__":
    DfssCliCase.binary = os.path.abspath(sys.argv.pop(1))
    unittest.main(verbosity=2)
