"""dfss.nn.DFSSAttention and dfss.patch_attention (nn.MultiheadAttention; Hugging Face BERT when
transformers is importable)."""
import math

import pytest
import torch
from torch import nn

import dfss
from reference import reference_attention


def test_dfss_attention_module_matches_reference():
    m = dfss.nn.DFSSAttention(32, 4, num_kv_heads=2, pattern="2:4").double()
    x = torch.randn(3, 10, 32, dtype=torch.float64)
    pad = torch.zeros(3, 10, dtype=torch.bool)
    pad[1, 7:] = True
    out = m(x, key_padding_mask=pad)
    q = m.q_proj(x).view(3, 10, 4, 8)
    k = m.k_proj(x).view(3, 10, 2, 8)
    v = m.v_proj(x).view(3, 10, 2, 8)
    ref, _ = reference_attention(q, k, v, "2:4", False, None, torch.tensor([10, 7, 10]))
    torch.testing.assert_close(out, m.out_proj(ref.reshape(3, 10, 32)), rtol=1e-10, atol=1e-12)
    out.sum().backward()
    assert all(p.grad is not None for p in m.parameters())


class TinyEncoder(nn.Module):
    """A BERT-style post-norm encoder block built on torch's nn.MultiheadAttention."""

    def __init__(self, e=32, h=4, batch_first=True):
        super().__init__()
        self.attn = nn.MultiheadAttention(e, h, batch_first=batch_first)
        self.norm1, self.norm2 = nn.LayerNorm(e), nn.LayerNorm(e)
        self.ff = nn.Sequential(nn.Linear(e, 64), nn.GELU(), nn.Linear(64, e))

    def forward(self, x, pad=None):
        a, _ = self.attn(x, x, x, key_padding_mask=pad, need_weights=False)
        x = self.norm1(x + a)
        return self.norm2(x + self.ff(x))


@pytest.mark.parametrize("batch_first", [True, False])
def test_patch_multihead_attention(batch_first):
    model = TinyEncoder(batch_first=batch_first).double()
    x = torch.randn(2, 9, 32, dtype=torch.float64)
    if not batch_first:
        x = x.transpose(0, 1)
    pad = torch.zeros(2, 9, dtype=torch.bool)
    pad[0, 6:] = True
    want = model(x, pad)
    handle = dfss.patch_attention(model, pattern="dense")
    assert handle.names == ["attn"]
    torch.testing.assert_close(model(x, pad), want, rtol=1e-10, atol=1e-10)
    handle.restore()
    with dfss.patch_attention(model, pattern="2:4"):
        sparse = model(x, pad)
        assert not torch.allclose(sparse, want, atol=1e-3)  # 2:4 prunes: a different function
        sparse.sum().backward()
        assert model.attn.in_proj_weight.grad is not None
    assert "forward" not in model.attn.__dict__
    torch.testing.assert_close(model(x, pad), want, rtol=0, atol=0)


def test_patch_multihead_attention_2_4_matches_reference():
    mha = nn.MultiheadAttention(16, 2, batch_first=True).double()
    x = torch.randn(2, 7, 16, dtype=torch.float64)
    mask = torch.triu(torch.ones(7, 7, dtype=torch.bool), 1)  # MHA: True = not allowed
    with dfss.patch_attention(mha, pattern="1:2"):
        out, weights = mha(x, x, x, attn_mask=mask)
    assert weights is None
    q, k, v = nn.functional.linear(x, mha.in_proj_weight, mha.in_proj_bias).split(16, dim=-1)
    ref, _ = reference_attention(q.reshape(2, 7, 2, 8), k.reshape(2, 7, 2, 8), v.reshape(2, 7, 2, 8),
                                 "1:2", causal=True)
    torch.testing.assert_close(out, mha.out_proj(ref.reshape(2, 7, 16)), rtol=1e-10, atol=1e-12)


def test_patch_hugging_face_bert():
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    try:
        from transformers import BertConfig, BertModel
    except ImportError as exc:  # e.g. a transformers too new for this torch
        pytest.skip(f"transformers cannot load BERT with this torch: {exc}")
    config = BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=48, max_position_embeddings=32)
    model = BertModel(config).double().eval()  # eval: no dropout, so outputs are deterministic
    ids = torch.randint(0, 50, (2, 11))
    mask = torch.ones(2, 11, dtype=torch.long)
    mask[1, 8:] = 0
    want = model(input_ids=ids, attention_mask=mask).last_hidden_state
    with pytest.warns(UserWarning, match=r"attention dropout is not applied by DFSS in encoder\.layer\.0"):
        handle = dfss.patch_attention(model, pattern="dense")
    with handle:
        assert len(handle.names) == 2
        got = model(input_ids=ids, attention_mask=mask).last_hidden_state
    # Padded keys get -inf (or finfo.min) in both; the unpadded output positions must agree.
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
    # The gradient flows through BERT's last LayerNorm, whose weight starts at ones: the gradient of
    # out.sum() is zero up to rounding there (exactly zero for some seeds), so weight the output.
    weight = torch.randn_like(want)
    model.zero_grad(set_to_none=True)
    (model(input_ids=ids, attention_mask=mask).last_hidden_state * weight).sum().backward()
    grad_want = model.encoder.layer[0].attention.self.query.weight.grad
    model.zero_grad(set_to_none=True)
    with pytest.warns(UserWarning), dfss.patch_attention(model, pattern="dense"):
        (model(input_ids=ids, attention_mask=mask).last_hidden_state * weight).sum().backward()
    grad = model.encoder.layer[0].attention.self.query.weight.grad
    assert grad_want.abs().max() > 1e-6
    torch.testing.assert_close(grad, grad_want, rtol=1e-9, atol=1e-12)
    model.zero_grad(set_to_none=True)
    with pytest.warns(UserWarning), dfss.patch_attention(model, pattern="2:4"):
        model.train()
        out = model(input_ids=ids, attention_mask=mask).last_hidden_state
        (out * weight).sum().backward()
        model.eval()
    grad = model.encoder.layer[0].attention.self.query.weight.grad
    assert grad is not None and torch.isfinite(grad).all() and grad.abs().max() > 1e-6
    torch.testing.assert_close(model(input_ids=ids, attention_mask=mask).last_hidden_state, want,
                               rtol=0, atol=0)
