"""The text language-model experiment's tools (tools/train/text_corpus.py, lm_train.py, lm_report.py,
run_lm.sh) on tiny synthetic corpora: the corpus builder against an independent walk and hashlib,
bits per byte against analytic and independent computations, the paired bootstrap on synthetic
data, and the --quick pipeline end to end (train, eval, finetune, control, Ctrl-C and resume)."""
import hashlib
import json
import math
import os
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET

import numpy as np
import pytest
import torch

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
TRAIN_DIR = os.path.join(ROOT, "tools", "train")
sys.path.insert(0, TRAIN_DIR)
import lm_report  # noqa: E402
import lm_train  # noqa: E402
import text_corpus  # noqa: E402

LM = os.path.join(TRAIN_DIR, "lm_train.py")


def run(*args, **kw):
    return subprocess.run([sys.executable, LM, *args], capture_output=True, text=True, timeout=600, **kw)


# ---------------------------------------------------------------- corpus

def independent_split(root):
    """The corpus rule restated without text_corpus: non-empty .py files outside the excluded
    top-level directories and __pycache__, by SHA-256 of the relative path modulo 100 (80/10/10)."""
    excluded = {"dist-packages", "site-packages", "test", "tests", "lib2to3", "distutils", "ensurepip", "idlelib",
                "tkinter", "turtledemo"}
    splits = {"train": [], "val": [], "test": []}
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = os.path.relpath(dirpath, root)
        parts = [] if rel_dir == "." else rel_dir.split(os.sep)
        if "__pycache__" in parts or (parts and parts[0] in excluded):
            continue
        for f in filenames:
            full = os.path.join(dirpath, f)
            if f.endswith(".py") and os.path.getsize(full) > 0:
                rel = "/".join(parts + [f])
                h = int(hashlib.sha256(rel.encode()).hexdigest()[:16], 16) % 100
                splits["train" if h < 80 else "val" if h < 90 else "test"].append(rel)
    return {k: sorted(v) for k, v in splits.items()}


def test_corpus_is_deterministic_and_split_by_file(tmp_path):
    src = tmp_path / "src"
    text_corpus.synthetic_tree(str(src), 60, seed=3)
    m1 = text_corpus.build(str(src), str(tmp_path / "c1"))
    m2 = text_corpus.build(str(src), str(tmp_path / "c2"))
    assert m1["splits"] == m2["splits"]
    for s in text_corpus.SPLITS:
        assert (tmp_path / "c1" / f"{s}.bin").read_bytes() == (tmp_path / "c2" / f"{s}.bin").read_bytes()

    want = independent_split(str(src))
    # 60 files at 80/10/10: every split holds some (the seed is fixed, so this is not luck at run time).
    assert all(len(v) >= 3 for v in want.values()), {k: len(v) for k, v in want.items()}
    assert sum(len(v) for v in want.values()) == 60  # the decoys (test/, __pycache__, empty, .txt) are out
    for s in text_corpus.SPLITS:
        entry = m1["splits"][s]
        assert [d["path"] for d in entry["documents"]] == want[s]
        contents = [(src / p).read_bytes() for p in want[s]]
        assert entry["sha256"] == hashlib.sha256(b"".join(contents)).hexdigest()
        assert entry["files"] == len(want[s]) and entry["bytes"] == sum(map(len, contents))
        assert [d for _, d in text_corpus.load_split(str(tmp_path / "c1"), s)] == contents
    # A file is in one split whatever else is in the tree: adding files moves no existing file.
    (src / "pkg_a" / "added.py").write_text("y = 2\n")
    m3 = text_corpus.build(str(src), str(tmp_path / "c3"))
    for s in text_corpus.SPLITS:
        old = {d["path"] for d in m1["splits"][s]["documents"]}
        new = {d["path"] for d in m3["splits"][s]["documents"]}
        assert old <= new and len(new - old) <= 1


def test_corpus_refuses_a_modified_split_and_nul_bytes(tmp_path):
    src = tmp_path / "src"
    text_corpus.synthetic_tree(str(src), 20, seed=1)
    text_corpus.build(str(src), str(tmp_path / "c"))
    path = tmp_path / "c" / "train.bin"
    data = bytearray(path.read_bytes())
    data[0] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="SHA-256"):
        text_corpus.load_split(str(tmp_path / "c"), "train")
    (src / "nul.py").write_bytes(b"x = 1\x00\n")
    with pytest.raises(ValueError, match="byte 0"):
        text_corpus.build(str(src), str(tmp_path / "c2"))


# ---------------------------------------------------------------- bits per byte

DOCS = [("a.py", bytes(range(65, 70))), ("b.py", bytes((7 * i + 3) % 251 + 1 for i in range(40))),
        ("c.py", b"x" * 16), ("d.py", bytes((11 * i) % 200 + 20 for i in range(17)))]


def test_uniform_logits_give_exactly_8_bits_per_byte():
    r = lm_train.score(lambda t: torch.zeros(*t.shape, 256), DOCS, ctx=16, batch=3)
    assert abs(r["bpb"] - 8.0) < 1e-12
    assert r["bytes"] == sum(len(d) for _, d in DOCS)
    assert [d["bits"] for d in r["docs"]] == pytest.approx([8.0 * len(d) for _, d in DOCS], rel=1e-12)
    # Bytes by position: every document restarts at position 0 and wraps every 16 bytes.
    count = np.zeros(16)
    for _, d in DOCS:
        for i in range(len(d)):
            count[i % 16] += 1
    assert r["position"]["bytes"] == count.tolist()


def test_bpb_matches_an_independent_computation_of_windows_and_fresh_context():
    """A model whose logits depend on the current token, the first token of its window and the
    position: its bits, restated byte by byte, check the windows (ctx bytes, aligned at document
    starts, each reading only its own tokens) and the document-start byte 0."""
    ctx = 8
    g = torch.Generator().manual_seed(0)
    cur, first, pos = (torch.randn(n, 256, generator=g, dtype=torch.float64) for n in (256, 256, ctx))

    def logits(t):
        return cur[t] + first[t[:, :1]].expand(-1, t.shape[1], -1) + pos[:t.shape[1]][None]

    r = lm_train.score(logits, DOCS, ctx=ctx, batch=2)
    bits = []
    for _, d in DOCS:
        total = 0.0
        for i, byte in enumerate(d):
            prev = d[i - 1] if i > 0 else 0
            w0 = (i // ctx) * ctx
            start = d[w0 - 1] if w0 > 0 else 0
            logp = torch.log_softmax(cur[prev] + first[start] + pos[i % ctx], dim=0)
            total -= float(logp[byte]) / math.log(2)
        bits.append(total)
    assert [d["bits"] for d in r["docs"]] == pytest.approx(bits, rel=1e-12)
    assert r["bpb"] == pytest.approx(sum(bits) / sum(len(d) for _, d in DOCS), rel=1e-12)
    # Batching does not change a window's bits.
    r1 = lm_train.score(logits, DOCS, ctx=ctx, batch=1)
    assert [d["bits"] for d in r1["docs"]] == pytest.approx(bits, rel=1e-12)


@pytest.mark.parametrize("pattern", ["dense", "2:4"])
def test_a_short_document_is_evaluated_alone(pattern):
    """Under a real (random) ByteLM, a document shorter than the window gets the same bits whether
    it is scored with others (padded in a batch after a longer window) or alone, and those are the
    bits of one forward pass over byte 0 + the document."""
    cfg = dict(lm_train.DEFAULTS, layers=2, dim=32, heads=2, kv_heads=1, ffn=64, ctx=32)
    torch.manual_seed(0)
    model = lm_train.ByteLM(cfg)
    model.pattern = pattern
    short = ("short.py", b"def f(x):\n    return x\n")
    docs = [("long.py", bytes(range(32, 112))), short]
    both = lm_train.score(model, docs, ctx=32, batch=4)
    alone = lm_train.score(model, [short], ctx=32, batch=1)
    tokens = torch.tensor([[0] + list(short[1][:-1])])
    with torch.no_grad():
        logp = torch.log_softmax(model(tokens).double(), dim=-1)[0]
    direct = -sum(float(logp[i, b]) for i, b in enumerate(short[1])) / math.log(2)
    assert alone["docs"][0]["bits"] == pytest.approx(direct, rel=1e-6)
    assert both["docs"][1]["bits"] == pytest.approx(direct, rel=1e-5)
    # The long document's later windows read their own tokens only: its bits differ from scoring
    # the same bytes as one stream with the short document before it.
    joined = lm_train.score(model, [("joined.py", short[1] + docs[0][1])], ctx=32, batch=4)
    assert abs(joined["bits"] - both["bits"]) > 1e-3


def test_attention_specs_with_windows():
    assert lm_train.parse_attention("2:4") == ("2:4", {})
    assert lm_train.parse_attention("1:2+sink16+recent64") == ("1:2", {"sink_tokens": 16, "recent_tokens": 64})
    with pytest.raises(ValueError, match="sinkN"):
        lm_train.parse_attention("2:4+window8")
    cfg = dict(lm_train.DEFAULTS, layers=2, dim=32, heads=2, kv_heads=1, ffn=64, ctx=32)
    torch.manual_seed(0)
    model = lm_train.ByteLM(cfg)
    tokens = torch.randint(0, 256, (2, 32))
    logits = {}
    with torch.no_grad():
        for spec in ("dense", "2:4", "2:4+sink32", "2:4+recent32", "2:4+sink4+recent8"):
            model.pattern = spec
            logits[spec] = model(tokens)
    # Windows covering the whole context keep every group whole: dense attention.
    torch.testing.assert_close(logits["2:4+sink32"], logits["dense"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits["2:4+recent32"], logits["dense"], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(logits["2:4+sink4+recent8"], logits["2:4"], atol=1e-6)


# ---------------------------------------------------------------- bootstrap

def synthetic_pairs(seed, docs=150, delta=0.02):
    rng = np.random.default_rng(seed)
    nbytes = rng.integers(200, 20000, docs).astype(float)
    per_doc = rng.normal(2.0, 0.3, docs)  # documents differ in difficulty
    a = nbytes * per_doc + rng.normal(0, 30, docs)
    b = nbytes * (per_doc + delta) + rng.normal(0, 30, docs)
    return a, b, nbytes


def test_bootstrap_is_deterministic_and_contains_the_true_difference():
    a, b, n = synthetic_pairs(0)
    s1 = lm_report.paired_bootstrap(a, b, n, boot=4000, seed=7)
    s2 = lm_report.paired_bootstrap(a, b, n, boot=4000, seed=7)
    assert s1 == s2
    assert s1["diff_lo"] < 0.02 < s1["diff_hi"]
    assert s1["diff_lo"] > 0  # the pairing resolves a 1% difference that document spread would hide
    assert s1["diff"] == pytest.approx((b.sum() - a.sum()) / n.sum())
    assert s1["rel"] == pytest.approx(100 * (b.sum() / a.sum() - 1))
    assert s1["rel_lo"] < s1["rel"] < s1["rel_hi"]
    assert lm_report.paired_bootstrap(a, b, n, boot=4000, seed=8) != s1
    # Without pairing the same data would not separate: the unpaired spread of document bpb is wide.
    assert np.std(a / n) / math.sqrt(len(n)) > 0.02


def test_bootstrap_coverage_is_near_95_percent():
    """Over 200 synthetic experiments with a true bpb difference of 0.02, the interval contains it
    in 88-99% of them (a 95% interval; 200 trials have a binomial s.d. of 1.5 points)."""
    hits = 0
    for seed in range(200):
        a, b, n = synthetic_pairs(seed, docs=60)
        s = lm_report.paired_bootstrap(a, b, n, boot=1000, seed=seed)
        hits += s["diff_lo"] <= 0.02 <= s["diff_hi"]  # the noise has mean 0: the true difference is delta
    assert 176 <= hits <= 198, hits


def test_bootstrap_rejects_bad_input():
    with pytest.raises(ValueError, match="equal-length"):
        lm_report.paired_bootstrap([1.0, 2.0], [1.0], [1.0, 1.0])
    with pytest.raises(ValueError, match="--boot"):
        lm_report.paired_bootstrap([1.0, 2.0], [1.0, 2.0], [1.0, 1.0], boot=0)


# ---------------------------------------------------------------- pipeline

def test_quick_pipeline_train_eval_finetune_control_report(tmp_path):
    dense = tmp_path / "dense"
    r = run("train", "--quick", "--quiet", "--threads", "1", "--out", str(dense))
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 20 and summary["train_bytes"] == 20 * 4 * 64
    log = json.loads((dense / "log.json").read_text())
    assert [v["step"] for v in log["val"]] == [10, 20]
    # 20 steps of a tiny model on Python-like text move it well below uniform (8 bits per byte).
    assert log["val"][-1]["bpb"] < 7.0
    cfg = log["config"]
    manifest = json.loads((dense / "corpus" / "manifest.json").read_text())
    assert cfg["corpus_sha256"] == {s: manifest["splits"][s]["sha256"] for s in ("train", "val", "test")}

    ev_path = tmp_path / "dense-eval.json"
    r = run("eval", "--checkpoint", str(dense / "final.pt"), "--attention", "dense", "2:4", "--threads", "1",
            "--out", str(ev_path))
    assert r.returncode == 0, r.stderr
    ev = json.loads(ev_path.read_text())
    test_bytes = manifest["splits"]["test"]["bytes"]
    for p in ("dense", "2:4"):
        res = ev["results"][p]
        assert res["bytes"] == test_bytes == sum(d["bytes"] for d in res["docs"]) == sum(res["position"]["bytes"])
        assert res["bits"] == pytest.approx(sum(d["bits"] for d in res["docs"]), rel=1e-12)
        assert res["bits"] == pytest.approx(sum(res["position"]["bits"]), rel=1e-9)
        assert [d["path"] for d in res["docs"]] == [d["path"] for d in manifest["splits"]["test"]["documents"]]
    assert ev["results"]["2:4"]["bpb"] != ev["results"]["dense"]["bpb"]

    runs = {}
    for name, pattern in (("ft-2-4", "2:4"), ("control", "dense")):
        r = run("train", "--init", str(dense / "final.pt"), "--attention", pattern, "--steps", "4", "--eval-every",
                "2", "--lr", "1e-3", "--quiet", "--threads", "1", "--out", str(tmp_path / name))
        assert r.returncode == 0, r.stderr
        runs[name] = json.loads((tmp_path / name / "log.json").read_text())
        r = run("eval", "--checkpoint", str(tmp_path / name / "final.pt"), "--attention", pattern, "--threads", "1",
                "--out", str(tmp_path / f"{name}-eval.json"))
        assert r.returncode == 0, r.stderr
    for name, log2 in runs.items():
        c = log2["config"]
        # Both continue the data where the dense run stopped, with the dense run's architecture.
        assert c["data_start"] == 20 and c["init_step"] == 20 and c["steps"] == 4 and c["lr"] == 1e-3
        assert c["dim"] == cfg["dim"] and c["kv_heads"] == cfg["kv_heads"] == 1
        assert [v["step"] for v in log2["val"]] == [0, 2, 4]
    # The control's step-0 validation is the dense model's final one (same model, same pattern).
    assert runs["control"]["val"][0]["bpb"] == pytest.approx(log["val"][-1]["bpb"], rel=1e-9)
    assert runs["ft-2-4"]["val"][0]["bpb"] != runs["control"]["val"][0]["bpb"]

    svg = tmp_path / "ft.svg"
    rep = subprocess.run([sys.executable, os.path.join(TRAIN_DIR, "lm_report.py"), str(tmp_path), "--svg", str(svg),
                          "--boot", "500"], capture_output=True, text=True, timeout=300)
    assert rep.returncode == 0, rep.stderr
    lines = rep.stdout.splitlines()
    row = next(line for line in lines if line.startswith("| dense-trained + DFSS finetuning | DFSS 2:4 |"))
    ft_bpb = json.loads((tmp_path / "ft-2-4-eval.json").read_text())["results"]["2:4"]["bpb"]
    assert "4 (20% of dense)" in row and f"| {ft_bpb:.4f} |" in row
    assert any(line.startswith("| DFSS-trained from scratch | DFSS 1:2 | not run") for line in lines)
    root = ET.parse(str(svg)).getroot()
    assert len([e for e in root.iter() if e.tag.endswith("polyline")]) == 2  # ft-2-4 and control


def test_ctrl_c_then_resume_matches_an_uninterrupted_run(tmp_path):
    out = tmp_path / "run"
    p = subprocess.Popen([sys.executable, LM, "train", "--quick", "--threads", "1", "--steps", "300", "--out",
                          str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    seen = ""
    while time.time() < deadline and "3/300" not in seen:  # the progress bar (stderr) shows steps
        seen += p.stderr.read(1) or ""
    p.send_signal(signal.SIGINT)
    stdout, _ = p.communicate(timeout=300)
    assert p.returncode == 130, stdout
    assert "--resume" in stdout
    ck = torch.load(str(out / "last.pt"))
    assert 3 <= ck["step"] < 300 and ck["opt"] is not None
    assert not (out / "final.pt").exists()

    r = run("train", "--resume", str(out / "last.pt"), "--lr", "1e-2")
    assert r.returncode == 2 and "--lr" in r.stderr  # a resumed run keeps its own settings
    r = run("train", "--resume", str(out / "last.pt"), "--threads", "1", "--quiet")
    assert r.returncode == 0, r.stderr
    resumed = torch.load(str(out / "final.pt"))
    assert resumed["step"] == 300 and resumed["log"]["resumes"] == 1

    r = run("train", "--quick", "--threads", "1", "--quiet", "--steps", "300", "--out", str(tmp_path / "straight"))
    assert r.returncode == 0, r.stderr
    straight = torch.load(str(tmp_path / "straight" / "final.pt"))
    for k, v in straight["model"].items():
        assert torch.equal(v, resumed["model"][k]), k
    assert [v["bpb"] for v in straight["log"]["val"]] == [v["bpb"] for v in resumed["log"]["val"]]


def test_capture_writes_what_dfss_attention_receives(tmp_path):
    out = tmp_path / "run"
    r = run("train", "--quick", "--quiet", "--threads", "1", "--steps", "3", "--out", str(out))
    assert r.returncode == 0, r.stderr
    r = run("capture", "--checkpoint", str(out / "final.pt"), "--layers", "0", "1", "--out", str(tmp_path / "qkv"))
    assert r.returncode == 0, r.stderr
    note = json.loads((tmp_path / "qkv" / "capture.json").read_text())
    assert [i["name"] for i in note["inputs"]] == ["w0-layer0", "w0-layer1"]
    q = np.load(str(tmp_path / "qkv" / "w0-layer0-q.npy"))
    k = np.load(str(tmp_path / "qkv" / "w0-layer0-k.npy"))
    assert q.dtype == np.float16 and q.shape == (1, 64, 2, 16) and k.shape == (1, 64, 1, 16)
    # Layer 0's queries restated from the weights: RoPE(LN(embed(tokens)) W_q^T), tokens = byte 0 +
    # the longest test document's first 63 bytes.
    ck = torch.load(str(out / "final.pt"))
    docs = lm_train.corpus_for(ck["config"], "test")
    doc = sorted(docs, key=lambda d: (-len(d[1]), d[0]))[0]  # the longest (ties: the first path)
    assert note["inputs"][0]["document"] == doc[0]
    tokens = torch.tensor([0] + list(doc[1][:63]))
    sd = ck["model"]
    h = torch.nn.functional.layer_norm(sd["embed.weight"][tokens], (32,), sd["blocks.0.ln1.weight"],
                                       sd["blocks.0.ln1.bias"])
    qq = (h @ sd["blocks.0.q.weight"].T).view(64, 2, 16)
    cos, sin = lm_train.rope_tables(64, 16)
    x1, x2 = qq[..., :8], qq[..., 8:]
    want = torch.cat((x1 * cos[:, None] - x2 * sin[:, None], x1 * sin[:, None] + x2 * cos[:, None]), -1)
    assert np.allclose(q[0].astype(np.float32), want.numpy(), atol=2e-3, rtol=2e-3)


def test_make_default_qkv_regenerates_the_default_jobs_data(tmp_path):
    """tools/train/make_default_qkv.sh (data/text-lm-qkv): the capture's layers renamed, byte for byte
    the same on a second run and from an existing capture (CAPTURE=), with checksums and the note."""
    out = tmp_path / "run"
    r = run("train", "--quick", "--quiet", "--threads", "1", "--steps", "3", "--out", str(out))
    assert r.returncode == 0, r.stderr
    script = os.path.join(TRAIN_DIR, "make_default_qkv.sh")
    env = dict(os.environ, LAYERS="0 1", THREADS="1")
    r = run("capture", "--threads", "1", "--checkpoint", str(out / "final.pt"), "--layers", "0", "1",
            "--out", str(tmp_path / "qkv"))
    assert r.returncode == 0, r.stderr
    for name, extra in (("a", {}), ("b", {}), ("c", {"CAPTURE": str(tmp_path / "qkv")})):
        r = subprocess.run(["bash", script, sys.executable, str(out / "final.pt"), str(tmp_path / name)],
                           env=dict(env, **extra), capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr
    npys = [f"layer{l}-{x}.npy" for l in (0, 1) for x in "qkv"]
    assert sorted(os.listdir(tmp_path / "a")) == sorted(npys + ["SHA256SUMS", "capture.json"])
    sums = [line.split() for line in (tmp_path / "a" / "SHA256SUMS").read_text().splitlines()]
    assert [s[1] for s in sums] == npys
    for (digest, name) in sums:
        data = (tmp_path / "a" / name).read_bytes()
        assert hashlib.sha256(data).hexdigest() == digest
        assert data == (tmp_path / "b" / name).read_bytes() == (tmp_path / "c" / name).read_bytes()
        assert data == (tmp_path / "qkv" / f"w0-{name}").read_bytes()  # the capture's file, renamed
    note = json.loads((tmp_path / "a" / "capture.json").read_text())
    assert note["causal"] is True
    assert [i["name"] for i in note["inputs"]] == ["layer0", "layer1"]
    assert note["checkpoint_sha256"] == hashlib.sha256((out / "final.pt").read_bytes()).hexdigest()
    assert "--layers 0 1" in note["command"]
    # A capture without the requested layer is refused with a message.
    r = subprocess.run(["bash", script, sys.executable, str(out / "final.pt"), str(tmp_path / "d")],
                       env=dict(env, LAYERS="0 3", CAPTURE=str(tmp_path / "qkv")), capture_output=True, text=True,
                       timeout=600)
    assert r.returncode != 0 and "no w0-layer3" in r.stderr


def test_bad_arguments_are_clear_errors(tmp_path):
    r = run("train", "--quick", "--quiet", "--heads", "2", "--kv-heads", "3", "--out", str(tmp_path / "a"))
    assert r.returncode == 2 and "--kv-heads (3) must divide --heads (2)" in r.stderr
    r = run("train", "--quick", "--quiet", "--steps", "5", "--budget-bytes", "100", "--out", str(tmp_path / "b"))
    assert r.returncode == 2 and "not both" in r.stderr
    r = run("train", "--corpus", str(tmp_path / "missing"), "--out", str(tmp_path / "c"))
    assert r.returncode == 2 and "manifest.json is missing" in r.stderr
    r = run("eval", "--checkpoint", str(tmp_path / "none.pt"))
    assert r.returncode == 2 and "does not exist" in r.stderr


@pytest.mark.skipif(not os.path.exists("/bin/bash"), reason="run_lm.sh needs bash")
def test_run_lm_sh_quick_chain(tmp_path):
    env = dict(os.environ, QUICK="1", THREADS="1")
    r = subprocess.run(["bash", os.path.join(TRAIN_DIR, "run_lm.sh"), sys.executable, str(tmp_path)],
                       capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    for name in ("dense", "ft-2-4", "ft-1-2", "control", "scratch-2-4", "scratch-1-2"):
        assert (tmp_path / name / "final.pt").exists() and (tmp_path / f"{name}-eval.json").exists()
    ft = torch.load(str(tmp_path / "ft-1-2" / "final.pt"))
    assert ft["step"] == 4 and ft["config"]["attention"] == "1:2" and ft["config"]["lr"] == 3e-4
    report = (tmp_path / "report.md").read_text()
    assert "not run" not in report and (tmp_path / "lm_finetune.svg").exists()
    assert sorted(os.listdir(tmp_path / "qkv")) == sorted(
        ["capture.json"] + [f"w0-layer{l}-{t}.npy" for l in (0, 1) for t in "qkv"])
    # Started again, every stage is found done: nothing is retrained.
    mtime = (tmp_path / "dense" / "final.pt").stat().st_mtime
    r = subprocess.run(["bash", os.path.join(TRAIN_DIR, "run_lm.sh"), sys.executable, str(tmp_path)],
                       capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "dense: done" in r.stdout and (tmp_path / "dense" / "final.pt").stat().st_mtime == mtime


def test_tied_output_layer_stays_tied(tmp_path):
    r = run("train", "--quick", "--quiet", "--threads", "1", "--tie", "--steps", "3", "--out", str(tmp_path / "t"))
    assert r.returncode == 0, r.stderr
    ck = torch.load(str(tmp_path / "t" / "final.pt"))
    assert ck["config"]["tie"] is True
    model = lm_train.ByteLM(ck["config"])
    model.load_state_dict(ck["model"])
    assert model.head.weight is model.embed.weight
    # Trained: the tied matrix moved away from its initialisation.
    torch.manual_seed(ck["config"]["seed"])
    assert not torch.equal(lm_train.ByteLM(ck["config"]).embed.weight, model.embed.weight)
