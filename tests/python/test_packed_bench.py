"""tools/bench/packed_attention.py (packed sequences: transformers' sdpa with its 4-D mask against dfss
through the spans and through the same mask) on small packs: its rows, that dense matches sdpa's
output both ways, and its errors for bad arguments. Needs transformers >= 5 (CTest
python_transformers, the torch 2.x venv)."""
import json

import bench_tools
import pytest

pytest.importorskip("transformers", minversion="5.0", reason="needs transformers >= 5 (tools/scripts/torch2-venv.sh)")

packed = bench_tools.load("packed_attention")


def test_rows(tmp_path):
    out = tmp_path / "rows.json"
    rc = packed.main(["--packs", "3x5,1x9", "--heads", "4:2", "--head-dim", "16", "--rounds", "2", "--threads", "1",
                      "--json", str(out)])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert doc["cpu"] and doc["commit"] and doc["dtype"] == "f32"
    impls = ["sdpa (4-D mask)", "dfss dense (spans)", "dfss dense (4-D mask)", "dfss 2:4 (spans)",
             "dfss 2:4 (4-D mask)"]
    rows = doc["rows"]
    assert [(r["sequences"], r["length"], r["implementation"]) for r in rows] == [
        (n, length, impl) for n, length in ((3, 5), (1, 9)) for impl in impls]
    for r in rows:
        assert 0 < r["ms_min"] <= r["ms_median"] <= r["ms_max"] and r["finite"]
        sdpa = next(s for s in rows if s["sequences"] == r["sequences"] and s["implementation"] == "sdpa (4-D mask)")
        assert r["vs_sdpa"] == pytest.approx(sdpa["ms_median"] / r["ms_median"], rel=1e-9)
        if r["implementation"].startswith("dfss dense"):
            assert r["max_diff_vs_sdpa"] < 1e-5, r  # fp32: the same attention both ways
        else:
            assert r["max_diff_vs_sdpa"] is None


@pytest.mark.parametrize("args, says", [(["--packs", "8x0"], "--packs"), (["--packs", "8"], "--packs"),
                                        (["--heads", "32:5"], "--heads"), (["--rounds", "0"], "--rounds")])
def test_bad_arguments(args, says, capsys):
    with pytest.raises(SystemExit) as e:
        packed.main(args)
    assert e.value.code == 2 and says in capsys.readouterr().err
