"""tools/bench/generate.py (dfss against sdpa in a transformers model, end to end) on its tiny geometry:
the rows it reports, that each implementation really ran (dense matches sdpa's logits, the sparse
patterns do not), that a timed decode step leaves the cache as it found it, and its errors for bad
arguments. Needs transformers >= 5 (CTest python_transformers, the torch 2.x venv)."""
import json

import bench_tools
import pytest
import torch

pytest.importorskip("transformers", minversion="5.0", reason="needs transformers >= 5 (tools/scripts/torch2-venv.sh)")

generate = bench_tools.load("generate")


def test_rows_and_ratios(tmp_path):
    out = tmp_path / "rows.json"
    rc = generate.main(["--geometry", "tiny", "--contexts", "40,70", "--prompts", "24", "--rounds", "2",
                        "--threads", "1", "--json", str(out)])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert doc["geometry"] == "tiny" and doc["layers"] == 2 and doc["dtype"] == "f32" and doc["cache"] == "dynamic"
    assert doc["cpu"] and doc["commit"]
    rows = doc["rows"]
    impls = ["sdpa", "dfss dense", "dfss 2:4", "dfss 1:2"]
    assert [(r["mode"], r["length"], r["implementation"]) for r in rows] == [
        (mode, length, impl) for mode, length in (("decode", 40), ("decode", 70), ("prefill", 24)) for impl in impls]
    for r in rows:
        assert 0 < r["ms_min"] <= r["ms_median"] <= r["ms_max"]
        assert r["finite"]
        sdpa = next(s for s in rows if s["mode"] == r["mode"] and s["length"] == r["length"]
                    and s["implementation"] == "sdpa")
        assert r["vs_sdpa"] == pytest.approx(sdpa["ms_median"] / r["ms_median"], rel=1e-9)
        tokens = 1 if r["mode"] == "decode" else r["length"]
        assert r["tokens_per_s"] == pytest.approx(1e3 * tokens / r["ms_median"], rel=1e-9)
        if r["implementation"] == "sdpa":
            assert r["max_logit_diff"] == 0.0
        elif r["implementation"] == "dfss dense":
            # fp32, a 2-layer model of width 64: rounding only.
            assert r["max_logit_diff"] < 1e-4
        else:
            # The sparse patterns drop keys of every group: their logits move (had the switch of
            # implementation not happened, they would equal sdpa's).
            assert r["max_logit_diff"] > 1e-3


def test_decode_step_leaves_the_cache_as_it_was():
    args = generate.parse_args(["--geometry", "tiny", "--layers", "1"])
    model = generate.build_model(args)
    assert model.config.num_hidden_layers == 1
    cache = generate.make_cache(model, 33, torch.float32, torch.Generator().manual_seed(3))
    token = torch.tensor([[7]])
    with torch.inference_mode():
        first = generate.decode_step(model, cache, 33, token)
        assert cache.get_seq_length() == 33
        second = generate.decode_step(model, cache, 33, token)
    assert torch.equal(first, second)


@pytest.mark.parametrize("argv, message", [
    (["--geometry", "gpt-9"], "--geometry: expected one of"),
    (["--dtype", "f16"], "--dtype: expected f32 or bf16"),
    (["--patterns", "dense,3:4"], "--patterns: expected some of"),
    (["--contexts", "4096,x"], "--contexts: expected comma-separated integers"),
    (["--contexts", "0"], "--contexts: expected positive integers"),
    (["--rounds", "0"], "--rounds and --threads: expected >= 1"),
    (["--cache", "paged"], "invalid choice"),
])
def test_bad_arguments(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        generate.parse_args(argv)
    assert message in str(info.value.code) + capsys.readouterr().err


def test_static_cache_steps():
    """--cache static: steps go on from L (each keeps its key and value); dfss dense's first step
    matches sdpa's on a copy of the same cache."""
    import dfss.transformers
    dense = dfss.transformers.register("dfss-bench-test-dense", pattern="dense")
    args = generate.parse_args(["--geometry", "tiny", "--layers", "1"])
    model = generate.build_model(args)
    token = torch.tensor([[9]])
    logits = {}
    with torch.inference_mode():
        for name in ("sdpa", dense):
            cache = generate.make_cache(model, 50, torch.float32, torch.Generator().manual_seed(4), "static", 2)
            model.set_attn_implementation(name)
            logits[name] = generate.decode_step(model, cache, 50, token, keep=True)
            assert cache.get_seq_length() == 51
            # The next step comes at 51, into the last slot.
            assert torch.isfinite(generate.decode_step(model, cache, 51, token, keep=True)).all()
    assert (logits[dense] - logits["sdpa"]).abs().max().item() < 1e-4


def test_static_cache_rows(tmp_path):
    out = tmp_path / "rows.json"
    assert generate.main(["--geometry", "tiny", "--contexts", "40", "--prompts", "", "--cache", "static",
                          "--patterns", "dense", "--rounds", "1", "--threads", "1", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["cache"] == "static"
    assert [(r["implementation"], r["max_logit_diff"], r["finite"]) for r in doc["rows"]] == [
        ("sdpa", None, True), ("dfss dense", None, True)]
