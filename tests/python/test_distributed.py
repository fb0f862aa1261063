"""dfss.distributed.context_parallel_attention: 2 and 3 processes with the gloo backend, each holding
one contiguous key/value shard, against single-process dfss.attention over all keys, forward and
backward. The processes are this file run as a script (see the bottom)."""
import os
import subprocess
import sys

import pytest
import torch

import dfss

CASES = {
    # causal over a padded batch: the whole sequence's key lengths and query positions
    "causal": dict(pattern="2:4", is_causal=True, key_lengths=[41, 30], query_offset=[36, 25]),
    "windows": dict(pattern="1:2", is_causal=True, sink_tokens=3, recent_tokens=7),
    "bidirectional": dict(pattern="2:4", is_causal=False, key_lengths=[45, 19], recent_tokens=5),
    # more query rows than keys: no query position to place
    "more_queries": dict(pattern="2:4", is_causal=False, recent_tokens=6, lq=47),
}
SHARDS = {2: [20, 25], 3: [16, 12, 17]}  # 45 keys; every shard but the last a multiple of M


def inputs(case):
    g = torch.Generator().manual_seed(1234)
    B, H, Hkv, Lq, Lk, d = 2, 4, 2, CASES[case].get("lq", 5), 45, 8
    q = torch.randn(B, H, Lq, d, dtype=torch.float64, generator=g)
    k = torch.randn(B, Hkv, Lk, d, dtype=torch.float64, generator=g)
    v = torch.randn(B, Hkv, Lk, d, dtype=torch.float64, generator=g)
    w = torch.randn(B, H, Lq, d, dtype=torch.float64, generator=g)
    return q, k, v, w


def kwargs(case):
    kw = dict(CASES[case])
    kw.pop("lq", None)
    for name in ("key_lengths", "query_offset"):
        if name in kw:
            kw[name] = torch.tensor(kw[name])
    return kw


def worker(rank, world, init, case):
    import torch.distributed as dist
    import dfss.distributed
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    q, k, v, w = inputs(case)
    kw = kwargs(case)
    # The single-process result and gradients over all keys.
    qa, ka, va = (t.clone().requires_grad_(True) for t in (q, k, v))
    want, want_lse = dfss.attention(qa, ka, va, return_lse=True, **kw)
    (want * w).sum().backward()
    # This rank's shard.
    k0 = sum(SHARDS[world][:rank])
    k1 = k0 + SHARDS[world][rank]
    qr = q.clone().requires_grad_(True)
    ks = k[:, :, k0:k1].clone().requires_grad_(True)
    vs = v[:, :, k0:k1].clone().requires_grad_(True)
    out, lse = dfss.distributed.context_parallel_attention(qr, ks, vs, return_lse=True, **kw)
    torch.testing.assert_close(out, want, rtol=0, atol=1e-12)
    torch.testing.assert_close(lse, want_lse.double(), rtol=0, atol=1e-12)
    (out * w).sum().backward()
    torch.testing.assert_close(qr.grad, qa.grad, rtol=1e-9, atol=1e-11)
    torch.testing.assert_close(ks.grad, ka.grad[:, :, k0:k1], rtol=1e-9, atol=1e-11)
    torch.testing.assert_close(vs.grad, va.grad[:, :, k0:k1], rtol=1e-9, atol=1e-11)
    dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("case", sorted(CASES))
def test_context_parallel_matches_one_process(world, case, tmp_path):
    init = f"file://{tmp_path / 'store'}"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, __file__, str(r), str(world), init, case], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(world)]
    for r, p in enumerate(procs):
        out, _ = p.communicate(timeout=300)
        assert p.returncode == 0, f"rank {r} of {world} failed:\n{out}"


def test_errors(tmp_path):
    import torch.distributed as dist
    import dfss.distributed
    q = torch.randn(1, 2, 3, 8)
    with pytest.raises(RuntimeError, match="not initialised"):
        dfss.distributed.context_parallel_attention(q, q, q)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        k = torch.randn(1, 2, 2, 8)
        with pytest.raises(ValueError, match="is_causal with 3 query rows against 2 keys in all"):
            dfss.distributed.context_parallel_attention(q, k, k, is_causal=True)
        with pytest.raises(ValueError, match="argument 'layout'"):
            dfss.distributed.context_parallel_attention(q, k, k, layout="bshd")
        # One process: the whole sequence, as dfss.attention (no causal mask: Lq > Lk is fine).
        torch.testing.assert_close(dfss.distributed.context_parallel_attention(q, k, k),
                                   dfss.attention(q, k, k), rtol=0, atol=1e-6)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    worker(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
