"""dfss.nn: modules built on DFSS attention."""
import math

import torch
from torch import nn

from .functional import mask_to_bias

__all__ = ["DFSSAttention"]


class DFSSAttention(nn.Module):
    """Multi-head (or grouped-query) self/cross attention with DFSS N:M pruning of the scores.

    ``DFSSAttention(embed_dim, num_heads, pattern="2:4")``; ``forward(query, key=None, value=None,
    key_padding_mask=None, attn_mask=None)`` with inputs [B, L, E] (``batch_first=True``, the
    default) or [L, B, E]. ``key_padding_mask`` [B, Lk] is bool with True marking padding (as in
    ``nn.MultiheadAttention``); ``attn_mask`` follows ``dfss.attention`` (bool True = attend, or
    additive float, added to the scaled scores) broadcastable to [B, H, Lq, Lk]. ``num_kv_heads`` < ``num_heads`` gives
    grouped-query attention. Returns the output [B, Lq, E] (or [Lq, B, E]).
    """

    def __init__(self, embed_dim, num_heads, *, num_kv_heads=None, pattern="2:4", causal=False,
                 bias=True, batch_first=True, scale=None, device=None, dtype=None):
        super().__init__()
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if embed_dim % num_heads != 0:
            raise ValueError(f"DFSSAttention: argument 'num_heads': expected a divisor of embed_dim = "
                             f"{embed_dim}, got {num_heads}")
        if num_kv_heads < 1 or num_heads % num_kv_heads != 0:
            raise ValueError(f"DFSSAttention: argument 'num_kv_heads': expected a divisor of num_heads = "
                             f"{num_heads}, got {num_kv_heads}")
        factory = {"device": device, "dtype": dtype}
        self.embed_dim, self.num_heads, self.num_kv_heads = embed_dim, num_heads, num_kv_heads
        self.head_dim = embed_dim // num_heads
        self.pattern, self.causal, self.batch_first, self.scale = pattern, causal, batch_first, scale
        kv_dim = self.head_dim * num_kv_heads
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **factory)
        self.k_proj = nn.Linear(embed_dim, kv_dim, bias=bias, **factory)
        self.v_proj = nn.Linear(embed_dim, kv_dim, bias=bias, **factory)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **factory)

    def forward(self, query, key=None, value=None, key_padding_mask=None, attn_mask=None):
        key = query if key is None else key
        value = key if value is None else value
        if not self.batch_first:
            query, key, value = (t.transpose(0, 1) for t in (query, key, value))
        b, lq, _ = query.shape
        lk = key.shape[1]
        q = self.q_proj(query).view(b, lq, self.num_heads, self.head_dim)
        k = self.k_proj(key).view(b, lk, self.num_kv_heads, self.head_dim)
        v = self.v_proj(value).view(b, lk, self.num_kv_heads, self.head_dim)
        scale = 1.0 / math.sqrt(self.head_dim) if self.scale is None else self.scale
        bias = None
        if attn_mask is not None:
            bias = mask_to_bias(attn_mask, b, self.num_heads, lq, lk, q.dtype, scale)
        if key_padding_mask is not None:
            if key_padding_mask.shape != (b, lk):
                raise ValueError(f"DFSSAttention: argument 'key_padding_mask': expected shape {[b, lk]} "
                                 f"[B, Lk], got {list(key_padding_mask.shape)}")
            if key_padding_mask.dtype == torch.bool:
                pad = torch.zeros((b, lk), dtype=q.dtype, device=q.device).masked_fill(key_padding_mask, -math.inf)
            else:
                pad = key_padding_mask.to(q.dtype) / scale  # added to the scaled scores
            pad = pad.view(b, 1, 1, lk).expand(b, 1, lq, lk)
            bias = pad if bias is None else bias + pad
        out, _ = torch.ops.dfss.attention(q, k, v, self.pattern, self.causal, self.scale, None, bias)
        out = self.out_proj(out.reshape(b, lq, self.embed_dim))
        return out if self.batch_first else out.transpose(0, 1)

    def extra_repr(self):
        return (f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, "
                f"pattern='{self.pattern}', causal={self.causal}")
