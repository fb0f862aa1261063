"""torch.ops.dfss.attention and dfss.attention against the float64 reference (reference.py)."""
import math

import pytest
import torch

import dfss
from reference import reference_attention

# (B, Lq, Lk, H, Hkv, d): Lq != Lk, lengths not multiples of M (4, 8), grouped heads, one query.
SHAPES = [(2, 5, 7, 4, 2, 8), (1, 13, 9, 3, 1, 16), (3, 1, 11, 2, 2, 4), (2, 17, 17, 2, 1, 32)]
PATTERNS = ["2:4", "1:2", "3:8", "dense"]


def make_inputs(shape, dtype=torch.float64, key_lengths=False, bias=None, empty_row=False):
    b, lq, lk, h, hkv, d = shape
    q = torch.randn(b, lq, h, d, dtype=dtype)
    k = torch.randn(b, lk, hkv, d, dtype=dtype)
    v = torch.randn(b, lk, hkv, d, dtype=dtype)
    kl = None
    if key_lengths:
        kl = torch.randint(1, lk + 1, (b,), dtype=torch.int32)
        if empty_row:
            kl[0] = 0  # batch 0: every row has no visible key
    bias_t = None
    if bias is not None:
        bias_t = torch.randn(*bias(b, h, lq, lk), dtype=dtype)
        bias_t[..., 0, :] = -math.inf  # query 0: every key masked by the bias (an empty row)
    return q, k, v, kl, bias_t


CASES = [
    dict(),
    dict(causal=True),
    dict(key_lengths=True),
    dict(key_lengths=True, empty_row=True, causal=True),
    dict(bias=lambda b, h, lq, lk: (b, h, lq, lk)),
    dict(bias=lambda b, h, lq, lk: (1, h, lq, lk), key_lengths=True),
    dict(bias=lambda b, h, lq, lk: (b, 1, lq, lk), causal=True),
    dict(bias=lambda b, h, lq, lk: (1, 1, lq, lk)),
]


def run(q, k, v, pattern, causal, kl, bias, scale=None):
    return torch.ops.dfss.attention(q, k, v, pattern, causal, scale, kl, bias)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("case", range(len(CASES)))
def test_forward_and_gradients_float64(shape, pattern, case):
    opts = dict(CASES[case])
    causal = opts.pop("causal", False)
    q, k, v, kl, bias = make_inputs(shape, **opts)
    for t in (q, k, v) + ((bias,) if bias is not None else ()):
        t.requires_grad_(True)
    out, lse = run(q, k, v, pattern, causal, kl, bias)
    ref_out, ref_lse = reference_attention(q, k, v, pattern, causal, None, kl, bias)
    # float64 through dfss's fp64 reference backend: only summation order differs.
    torch.testing.assert_close(out, ref_out, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-10, atol=1e-12)
    assert out.dtype == torch.float64 and lse.dtype == torch.float64
    dout = torch.randn_like(out)
    inputs = [q, k, v] + ([bias] if bias is not None else [])
    got = torch.autograd.grad(out, inputs, dout)
    want = torch.autograd.grad(ref_out, inputs, dout)
    for name, g, w in zip(["dq", "dk", "dv", "dbias"], got, want):
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-11, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("pattern", ["2:4", "1:2", "dense"])
def test_fast_kernels_on_exact_scores(dtype, pattern):
    # Small integers: every score q.k + bias is an exact integer in fp32 accumulation, and the
    # inputs are exact in f16/bf16, so the selection must equal the reference's exactly; only the
    # softmax and P V round. Ties (equal integers) are allowed: both sides send them to the lower index.
    b, lq, lk, h, hkv, d = 2, 19, 23, 4, 2, 16
    q = torch.randint(-2, 3, (b, lq, h, d)).to(dtype)
    k = torch.randint(-2, 3, (b, lk, hkv, d)).to(dtype)
    v = torch.randn(b, lk, hkv, d).to(dtype)
    kl = torch.tensor([lk, 14])
    bias = torch.randint(-3, 4, (1, h, lq, lk)).to(dtype)
    for t in (q, k, v):
        t.requires_grad_(True)
    out, lse = run(q, k, v, pattern, True, kl, bias)
    ref_out, ref_lse = reference_attention(q, k, v, pattern, True, None, kl, bias)
    assert out.dtype == dtype and lse.dtype == torch.float32
    # fp32: (16 + Lk) eps accumulation bound (docs/testing.md) ~ 5e-6 relative; 16-bit outputs add
    # half an ulp of the output type (2^-11 f16, 2^-8 bf16) of max|v| ~ 4.
    tol = {torch.float32: 1e-4, torch.float16: 4 * 2**-11, torch.bfloat16: 4 * 2**-8}[dtype]
    torch.testing.assert_close(out.double(), ref_out, rtol=tol, atol=tol)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-5, atol=1e-5)
    dout = torch.randn(out.shape).to(dtype)
    got = torch.autograd.grad(out, (q, k, v), dout)
    want = torch.autograd.grad(ref_out, (q, k, v), dout.double())
    for name, g, w in zip(["dq", "dk", "dv"], got, want):
        assert g.dtype == dtype
        scale = w.abs().max().item()
        # Gradients sum Lk (or H/Hkv * Lq) rounded products: 1e-4 of the largest for fp32, and
        # the 16-bit rounding of dout, out and the result for 16-bit types (a few ulps).
        gtol = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 8e-2}[dtype] * scale
        torch.testing.assert_close(g.double(), w.double(), rtol=0, atol=gtol, msg=lambda m: f"{name}: {m}")


def _nearest_selection_tie(q, k, bias, key_lengths, n, m):
    """The smallest gap between the n-th and (n+1)-th visible score of any group (causal, bottom-right
    aligned, key lengths), in the [B, L, H, d] layout of test_gradcheck_float64."""
    B, Lq, H, _ = q.shape
    Lk, Hkv = k.shape[1], k.shape[2]
    s = torch.einsum("bihd,bjhd->bhij", q, k.repeat_interleave(H // Hkv, dim=2)) + bias
    gap = float("inf")
    for b in range(B):
        for h in range(H):
            for i in range(Lq):
                end = min(int(key_lengths[b]), i + Lk - Lq + 1)
                for g0 in range(0, end, m):
                    top = sorted(s[b, h, i, g0:min(g0 + m, end)].tolist(), reverse=True)
                    if len(top) > n:
                        gap = min(gap, top[n - 1] - top[n])
    return gap


def test_gradcheck_float64():
    # The selection is piecewise constant: gradcheck's finite differences (eps 1e-6) must not flip
    # it, so inputs are drawn again until every group's kept and dropped scores are 1e-3 apart (seed
    # 1270874584 drew a tie 1.5e-6 wide, and gradcheck saw the jump).
    kl = torch.tensor([7, 5])
    while True:
        q = torch.randn(2, 5, 4, 8, dtype=torch.float64)
        k = torch.randn(2, 7, 2, 8, dtype=torch.float64)
        v = torch.randn(2, 7, 2, 8, dtype=torch.float64)
        bias = torch.randn(2, 1, 5, 7, dtype=torch.float64)
        if _nearest_selection_tie(q, k, bias, kl, 2, 4) > 1e-3:
            break
    for t in (q, k, v, bias):
        t.requires_grad_(True)

    def f(q, k, v, bias):
        return torch.ops.dfss.attention(q, k, v, "2:4", True, 0.3, kl, bias)[0]

    assert torch.autograd.gradcheck(f, (q, k, v, bias), eps=1e-6, atol=1e-7)


def softmax_attention(q, k, v, scale, mask=None):
    """Plain dense attention in [B, H, L, d] (what F.scaled_dot_product_attention computes)."""
    s = q @ k.transpose(-1, -2) * scale
    if mask is not None:
        s = s + mask
    return torch.softmax(s, dim=-1) @ v


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_dense_equals_scaled_dot_product_attention(dtype):
    q = torch.randn(2, 3, 10, 16, dtype=dtype)
    k = torch.randn(2, 3, 12, 16, dtype=dtype)
    v = torch.randn(2, 3, 12, 16, dtype=dtype)
    mask = torch.randn(2, 1, 10, 12, dtype=dtype)
    got = dfss.attention(q, k, v, attn_mask=mask, pattern="dense")
    want = softmax_attention(q, k, v, 1 / 4, mask)
    tol = 1e-12 if dtype == torch.float64 else 2e-5  # fp32: online vs two-pass softmax rounding
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    sdpa = getattr(torch.nn.functional, "scaled_dot_product_attention", None)
    if sdpa is not None:  # torch >= 2.0
        torch.testing.assert_close(got, sdpa(q, k, v, attn_mask=mask), rtol=tol, atol=tol)
        lq_eq = torch.randn(2, 3, 12, 16, dtype=dtype)
        torch.testing.assert_close(dfss.attention(lq_eq, k, v, is_causal=True, pattern="dense"),
                                   sdpa(lq_eq, k, v, is_causal=True), rtol=tol, atol=tol)


def test_sdpa_style_api():
    q = torch.randn(2, 4, 9, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 2, 11, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 2, 11, 8, dtype=torch.float64, requires_grad=True)
    keep = torch.rand(9, 11) > 0.3  # bool: True takes part, broadcast over B and H
    out, lse = dfss.attention(q, k, v, attn_mask=keep, scale=0.5, pattern="1:2", return_lse=True)
    bias = torch.zeros(9, 11, dtype=torch.float64).masked_fill(~keep, -math.inf)
    ref, ref_lse = reference_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), "1:2",
                                       False, 0.5, None, bias.view(1, 1, 9, 11))
    torch.testing.assert_close(out, ref.transpose(1, 2), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-10, atol=1e-12)
    assert out.shape == q.shape
    blhd = dfss.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=keep,
                          scale=0.5, pattern="1:2", layout="blhd")
    torch.testing.assert_close(blhd, out.transpose(1, 2), rtol=0, atol=0)
    fmask = torch.randn(2, 1, 9, 11, dtype=torch.float64, requires_grad=True)
    out = dfss.attention(q, k, v, attn_mask=fmask, key_lengths=torch.tensor([11, 6]))
    out.sum().backward()
    assert fmask.grad is not None and fmask.grad.shape == fmask.shape and q.grad is not None


def test_non_contiguous_inputs():
    base_q = torch.randn(2, 6, 9, 16, dtype=torch.float64)
    q = base_q[:, ::2].transpose(1, 2)[..., :8]  # [2, 9, 3, 8], strided in every dimension
    k = torch.randn(2, 4, 11, 8, dtype=torch.float64).transpose(1, 2)
    v = torch.randn(2, 11, 8, 4, dtype=torch.float64).permute(0, 1, 3, 2)[:, :, ::4]  # [2, 11, 1, 8]
    k = k[:, :, :1]
    bias = torch.randn(1, 3, 1, 11, dtype=torch.float64).expand(2, 3, 9, 11)  # stride-0 broadcast
    assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous())
    for t in (q, k, v):
        t.requires_grad_(True)
    out, lse = torch.ops.dfss.attention(q, k, v, "2:4", False, None, None, bias)
    ref, ref_lse = reference_attention(q, k, v, "2:4", False, None, None, bias)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    got = torch.autograd.grad(out.sum(), (q, k, v))  # dout is a stride-0 expanded tensor
    want = torch.autograd.grad(ref.sum(), (q, k, v))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-11)


def test_lse_is_differentiable():
    # d LSE / d (scale s_j) = P_j: the gradient through the LSE (alone, and with the output's).
    q, k, v, kl, _ = make_inputs((2, 6, 11, 4, 2, 8), key_lengths=True, empty_row=True)
    for t in (q, k, v):
        t.requires_grad_(True)
    out, lse = torch.ops.dfss.attention(q, k, v, "2:4", True, None, kl)
    ref, ref_lse = reference_attention(q, k, v, "2:4", True, None, kl)
    w = torch.randn_like(lse)
    for loss, ref_loss in ((lse.masked_fill(lse.isinf(), 0) * w).sum(), (ref_lse.masked_fill(ref_lse.isinf(), 0) * w).sum()), \
            ((out * 0.5).sum() + (lse.masked_fill(lse.isinf(), 0) * w).sum(), (ref * 0.5).sum() + (ref_lse.masked_fill(ref_lse.isinf(), 0) * w).sum()):
        got = torch.autograd.grad(loss, (q, k, v), retain_graph=True)
        want = torch.autograd.grad(ref_loss, (q, k, v), allow_unused=True, retain_graph=True)  # the LSE alone ignores v
        for g, wt, t in zip(got, want, (q, k, v)):
            torch.testing.assert_close(g, torch.zeros_like(t) if wt is None else wt, rtol=1e-9, atol=1e-11)


POSITION_CASES = [
    # a decode step against a padded cache: per-sequence lengths and positions, windows
    dict(causal=True, key_offset=8, key_lengths=[40, 25], query_offset=[37, 22], sink_tokens=3, recent_tokens=6),
    # a shard of a longer sequence: lengths past the keys, queries after them
    dict(causal=True, key_offset=16, key_lengths=[90, 30], query_offset=[80, 27], recent_tokens=9),
    # no causal mask: the recent window ends at each sequence's last key
    dict(causal=False, key_offset=4, key_lengths=[20, 4], sink_tokens=9, recent_tokens=3),
]


@pytest.mark.parametrize("case", POSITION_CASES)
@pytest.mark.parametrize("pattern", ["2:4", "1:2", "dense"])
def test_positions_and_windows_match_reference(case, pattern):
    q, k, v, _, _ = make_inputs((2, 3, 29, 4, 2, 8))
    for t in (q, k, v):
        t.requires_grad_(True)
    kw = dict(case)
    causal = kw.pop("causal")
    kl = torch.tensor(kw.pop("key_lengths"))
    qo = kw.pop("query_offset", None)
    qo = None if qo is None else torch.tensor(qo, dtype=torch.int32)
    out, lse = dfss.attention(q, k, v, is_causal=causal, pattern=pattern, key_lengths=kl, query_offset=qo,
                              layout="blhd", return_lse=True, **kw)
    ref, ref_lse = reference_attention(q, k, v, pattern, causal, None, kl, None, query_offset=qo, **kw)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-10, atol=1e-12)
    w = torch.randn_like(out)
    got = torch.autograd.grad((out * w).sum(), (q, k, v))
    want = torch.autograd.grad((ref * w).sum(), (q, k, v))
    for g, wt in zip(got, want):
        torch.testing.assert_close(g, wt, rtol=1e-9, atol=1e-11)


def test_position_arguments_are_checked():
    q = torch.randn(2, 3, 2, 8)
    with pytest.raises(ValueError, match="key_offset.*multiple of M = 4.*got 3"):
        torch.ops.dfss.attention(q, q, q, key_offset=3)
    with pytest.raises(ValueError, match="query_offset.*int32 or int64"):
        torch.ops.dfss.attention(q, q, q, query_offset=torch.zeros(2))
    with pytest.raises(ValueError, match="query_offset.*batch"):
        torch.ops.dfss.attention(q, q, q, query_offset=torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="sink_tokens.*got -2"):
        torch.ops.dfss.attention(q, q, q, sink_tokens=-2)


def test_empty_rows_and_no_keys():
    q = torch.randn(2, 3, 2, 4, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 5, 2, 4, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 5, 2, 4, dtype=torch.float64, requires_grad=True)
    out, lse = torch.ops.dfss.attention(q, k, v, key_lengths=torch.tensor([0, 5]))
    assert torch.equal(out[0], torch.zeros_like(out[0])) and torch.isneginf(lse[0]).all()
    out.sum().backward()
    assert torch.isfinite(q.grad).all() and torch.equal(q.grad[0], torch.zeros_like(q.grad[0]))
    no_keys = torch.zeros(2, 0, 2, 4, dtype=torch.float64)
    out, lse = torch.ops.dfss.attention(q, no_keys, no_keys)
    assert out.shape == q.shape and torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()


def test_nan_propagates():
    q = torch.randn(1, 4, 1, 8)
    k = torch.randn(1, 8, 1, 8)
    q[0, 2, 0, 3] = math.nan
    out, _ = torch.ops.dfss.attention(q, k, k)
    assert torch.isnan(out[0, 2]).all() and torch.isfinite(out[0, [0, 1, 3]]).all()


def test_threads_follow_torch_set_num_threads():
    q = torch.randn(2, 33, 4, 16)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = torch.ops.dfss.attention(q, q, q)[0]
        torch.set_num_threads(2)
        two = torch.ops.dfss.attention(q, q, q)[0]
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)  # dfss is bitwise deterministic across thread counts


def test_meta_tensors_give_shapes_and_dtypes():
    # The Meta kernels let PyTorch trace the operator (fake tensors) without running it.
    q = torch.empty(2, 5, 4, 8, dtype=torch.bfloat16, device="meta", requires_grad=True)
    k = torch.empty(2, 7, 2, 8, dtype=torch.bfloat16, device="meta")
    out, lse = torch.ops.dfss.attention(q, k, k)
    assert out.device.type == "meta" and out.shape == q.shape and out.dtype == torch.bfloat16
    assert lse.shape == (2, 4, 5) and lse.dtype == torch.float32
    (dq,) = torch.autograd.grad(out.sum(), q)
    assert dq.shape == q.shape and dq.device.type == "meta"
    with pytest.raises(ValueError, match=r"argument 'k': expected shape\[2\] \(heads_kv\) to divide"):
        torch.ops.dfss.attention(q, k[:, :, :1].expand(2, 7, 3, 8), k[:, :, :1].expand(2, 7, 3, 8))
