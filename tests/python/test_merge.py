"""dfss.merge_attention_states: against a float64 statement of the merge written here, its special
rows and their gradients, the list form, errors, and the exact merge of DFSS over keys split at a
multiple of M (dfss.attention on each part, merged, equals dfss.attention on all keys)."""
import math

import pytest
import torch

import dfss


def oracle(oa, la, ob, lb):
    """The merge in float64, row by row, straight from docs/semantics.md."""
    oa, la, ob, lb = oa.double(), la.double(), ob.double(), lb.double()
    out = torch.empty_like(oa)
    lse = torch.empty_like(la)
    for idx in torch.cartesian_prod(*[torch.arange(n) for n in la.shape]).tolist():
        idx = tuple(idx)
        a, b, xa, xb = float(la[idx]), float(lb[idx]), oa[idx], ob[idx]
        if math.isnan(a) or math.isnan(b) or bool(torch.isnan(xa).any() or torch.isnan(xb).any()):
            out[idx], lse[idx] = math.nan, math.nan
        elif a == b == math.inf:
            out[idx], lse[idx] = math.nan, math.inf
        elif a == b == -math.inf:
            out[idx], lse[idx] = 0.0, -math.inf
        elif math.inf in (a, b):
            out[idx], lse[idx] = (xa if a == math.inf else xb), math.inf
        else:
            m = max(a, b)
            s = m + math.log(math.exp(a - m) + math.exp(b - m))
            out[idx], lse[idx] = math.exp(a - s) * xa + math.exp(b - s) * xb, s
    return out, lse


def close(got, want, tol):
    assert got.shape == want.shape
    both_nan = torch.isnan(got) & torch.isnan(want)
    same_inf = torch.isinf(want) & (got == want)
    ok = both_nan | same_inf | ((got.double() - want).abs() <= tol)
    assert bool(ok.all()), f"max error {(got.double() - want)[~ok].abs().max()}"


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_random_rows_match_the_fp64_merge(dtype, tol):
    oa, ob = torch.randn(2, 3, 5, 8).to(dtype), torch.randn(2, 3, 5, 8).to(dtype)
    la, lb = torch.randn(2, 3, 5) * 10, torch.randn(2, 3, 5) * 10
    out, lse = dfss.merge_attention_states(oa, la, ob, lb)
    assert out.dtype == dtype and lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    want_o, want_l = oracle(oa, la, ob, lb)
    close(out, want_o, tol)
    close(lse, want_l, 1e-5)


def test_special_rows():
    inf, nan = math.inf, math.nan
    la = torch.tensor([[[nan, 1, 2, -inf, -inf, 5, inf, inf]]])
    lb = torch.tensor([[[1, nan, 3, -inf, 4, -inf, 0, inf]]])
    oa, ob = torch.randn(1, 1, 8, 3), torch.randn(1, 1, 8, 3)
    ob[0, 0, 2, 1] = nan
    oa[0, 0, 4, 0] = nan
    out, lse = dfss.merge_attention_states(oa, la, ob, lb)
    want_o, want_l = oracle(oa, la, ob, lb)
    close(out, want_o, 1e-6)
    close(lse, want_l, 1e-6)
    assert torch.isnan(out[0, 0, [0, 1, 2, 4, 7]]).all()
    assert (out[0, 0, 3] == 0).all() and lse[0, 0, 3] == -inf
    assert torch.equal(out[0, 0, 5], oa[0, 0, 5]) and lse[0, 0, 5] == 5


def test_gradients():
    oa = torch.randn(1, 2, 3, 4, dtype=torch.float64, requires_grad=True)
    ob = torch.randn(1, 2, 3, 4, dtype=torch.float64, requires_grad=True)
    la = (torch.randn(1, 2, 3, dtype=torch.float64) * 3).requires_grad_()
    lb = (torch.randn(1, 2, 3, dtype=torch.float64) * 3).requires_grad_()
    assert torch.autograd.gradcheck(lambda *x: dfss.merge_attention_states(*x), (oa, la, ob, lb))


def test_empty_rows_have_zero_gradients():
    la = torch.tensor([[[-math.inf, 0.5]]], requires_grad=True)
    lb = torch.tensor([[[-math.inf, -1.0]]], requires_grad=True)
    oa = torch.randn(1, 1, 2, 3, requires_grad=True)
    ob = torch.randn(1, 1, 2, 3, requires_grad=True)
    out, lse = dfss.merge_attention_states(oa, la, ob, lb)
    (out.sum() + lse[0, 0, 1]).backward()
    for g in (oa.grad, ob.grad):
        assert (g[0, 0, 0] == 0).all() and torch.isfinite(g).all()
    assert la.grad[0, 0, 0] == 0 and lb.grad[0, 0, 0] == 0
    assert torch.isfinite(la.grad).all() and torch.isfinite(lb.grad).all()


def test_list_form_and_layouts():
    parts = [(torch.randn(1, 4, 2, 8), torch.randn(1, 2, 4)) for _ in range(3)]
    o01, l01 = dfss.merge_attention_states(parts[0][0], parts[0][1], parts[1][0], parts[1][1], layout="blhd")
    o012, l012 = dfss.merge_attention_states(o01, l01, *parts[2], layout="blhd")
    out, lse = dfss.merge_attention_states(parts, layout="blhd")
    assert torch.equal(out, o012) and torch.equal(lse, l012)
    bhld = [(o.transpose(1, 2), l) for o, l in parts]
    out2, lse2 = dfss.merge_attention_states(bhld)
    assert torch.equal(out2.transpose(1, 2), out) and torch.equal(lse2, lse)


def test_list_of_16_bit_parts_is_rounded_once():
    # Eight bf16 parts merged in one call: the running result stays in fp32, so the output is the fp64
    # merge rounded once to bf16 (within 2^-8 of it, with 2^-7 of slack for the fp32 arithmetic), not
    # seven times (a running bf16 result drifts by up to 7 roundings).
    parts = [(torch.randn(2, 3, 64, 16).to(torch.bfloat16), torch.randn(2, 3, 64) * 3) for _ in range(8)]
    out, lse = dfss.merge_attention_states(parts)
    want_o, want_l = parts[0][0].double(), parts[0][1].double()
    for o, l in parts[1:]:
        want_o, want_l = oracle(want_o, want_l, o, l)
    assert out.dtype == torch.bfloat16
    err = (out.double() - want_o).abs()
    bound = want_o.abs() * 2.0 ** -8 + 2.0 ** -7 * 2.0 ** -8
    assert bool((err <= bound).all()), f"max error over the bound {(err - bound).max()}"
    close(lse, want_l, 1e-5)


@pytest.mark.parametrize("call,message", [
    (lambda o, l: dfss.merge_attention_states(o, l[:, :, :3], o, l), "argument 'lse_a': expected shape"),
    (lambda o, l: dfss.merge_attention_states(o, l, o.double(), l), "argument 'out_b': expected shape"),
    (lambda o, l: dfss.merge_attention_states([], layout="bhld"), "at least one"),
    (lambda o, l: dfss.merge_attention_states(o, l, o, l, layout="bl"), "argument 'layout'"),
    (lambda o, l: dfss.merge_attention_states(o[0], l, o, l), "argument 'out_a': expected 4 dimensions"),
])
def test_errors(call, message):
    with pytest.raises(ValueError, match=message):
        call(torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4))


@pytest.mark.parametrize("pattern", ["1:2", "2:4", "3:8", "dense"])
def test_dfss_over_key_shards_merges_exactly(pattern):
    m = {"1:2": 2, "2:4": 4, "3:8": 8, "dense": 1}[pattern]
    B, H, Hkv, Lq, Lk, d = 2, 4, 2, 7, 45, 16
    q = torch.randn(B, H, Lq, d, dtype=torch.float64)
    k = torch.randn(B, Hkv, Lk, d, dtype=torch.float64)
    v = torch.randn(B, Hkv, Lk, d, dtype=torch.float64)
    lengths = torch.tensor([Lk - 6, 3])
    whole, whole_lse = dfss.attention(q, k, v, pattern=pattern, key_lengths=lengths, return_lse=True)
    cuts = [0, 3 * m, 5 * m, Lk] if 5 * m < Lk else [0, m, Lk]
    parts = []
    for k0, k1 in zip(cuts, cuts[1:]):
        part_len = (lengths - k0).clamp(0, k1 - k0)
        parts.append(dfss.attention(q, k[:, :, k0:k1], v[:, :, k0:k1], pattern=pattern, key_lengths=part_len,
                                    return_lse=True))
    out, lse = dfss.merge_attention_states(parts)
    torch.testing.assert_close(out, whole, rtol=0, atol=1e-12)
    torch.testing.assert_close(lse, whole_lse.double(), rtol=0, atol=1e-12)


@pytest.mark.parametrize("pattern", ["1:2", "2:4"])
def test_causal_shards_with_positions_merge_exactly_forward_and_backward(pattern):
    # Each shard passes its key_offset and the whole sequence's key lengths and query positions;
    # gradients flow through the merge and the shards' LSEs to q, k and v.
    m = {"1:2": 2, "2:4": 4}[pattern]
    B, H, Hkv, Lq, Lk, d = 2, 4, 2, 5, 46, 8
    q = torch.randn(B, H, Lq, d, dtype=torch.float64, requires_grad=True)
    k = torch.randn(B, Hkv, Lk, d, dtype=torch.float64, requires_grad=True)
    v = torch.randn(B, Hkv, Lk, d, dtype=torch.float64, requires_grad=True)
    lengths = torch.tensor([Lk - 5, 30])
    qoff = lengths - Lq
    kw = dict(pattern=pattern, is_causal=True, key_lengths=lengths, query_offset=qoff, sink_tokens=3,
              recent_tokens=7, return_lse=True)
    whole, whole_lse = dfss.attention(q, k, v, **kw)
    w = torch.randn_like(whole)
    want = torch.autograd.grad((whole * w).sum(), (q, k, v))
    cuts = [0, 3 * m, 7 * m, Lk]
    parts = [dfss.attention(q, k[:, :, k0:k1], v[:, :, k0:k1], key_offset=k0, **kw) for k0, k1 in zip(cuts, cuts[1:])]
    out, lse = dfss.merge_attention_states(parts)
    torch.testing.assert_close(out, whole, rtol=0, atol=1e-12)
    torch.testing.assert_close(lse, whole_lse.double(), rtol=0, atol=1e-12)
    got = torch.autograd.grad((out * w).sum(), (q, k, v))
    for g, wt in zip(got, want):
        torch.testing.assert_close(g, wt, rtol=1e-9, atol=1e-11)
