"""An independent float64 PyTorch implementation of docs/semantics.md (shares no code with dfss).

Dense score matrix, masks, per-group top-N by explicit pairwise ranking (ties to the lower key
index, NaN ranks highest), softmax over the kept scores, P V. Differentiable by autograd with the
selection held fixed (it is computed on detached scores), which is the gradient the page defines.
"""
import math

import torch


def parse_pattern(pattern):
    if pattern == "dense":
        return 1, 1
    n, m = pattern.split(":")
    return int(n), int(m)


def select(scores, n, m):
    """Keep mask [..., Lk] of the N largest of every aligned group of M keys."""
    lk = scores.shape[-1]
    groups = -(-lk // m)
    pad = groups * m - lk
    s = torch.nn.functional.pad(scores, (0, pad), value=-math.inf) if pad else scores
    s = s.reshape(*s.shape[:-1], groups, m)
    a = s.unsqueeze(-1)  # candidate a (rows) beats b (columns)?
    b = s.unsqueeze(-2)
    nan_a, nan_b = torch.isnan(a), torch.isnan(b)
    greater = (a > b) | (nan_a & ~nan_b)
    equal = (a == b) | (nan_a & nan_b)
    idx = torch.arange(m, device=scores.device)
    lower = (idx.view(m, 1) < idx.view(1, m))  # a has the lower index than b
    beats = greater | (equal & lower)
    rank = beats.sum(dim=-2)  # how many candidates rank above each b
    keep = rank < n
    return keep.reshape(*keep.shape[:-2], groups * m)[..., :lk]


def reference_attention(q, k, v, pattern="2:4", causal=False, scale=None, key_lengths=None, bias=None):
    """q [B, Lq, H, d], k and v [B, Lk, Hkv, d] -> (out [B, Lq, H, d], lse [B, H, Lq]), float64."""
    n, m = parse_pattern(pattern)
    q, k, v = q.double(), k.double(), v.double()
    bsz, lq, h, d = q.shape
    lk, hkv = k.shape[1], k.shape[2]
    k = k.repeat_interleave(h // hkv, dim=2)
    v = v.repeat_interleave(h // hkv, dim=2)
    s = torch.einsum("bihd,bjhd->bhij", q, k)
    if bias is not None:
        s = s + bias.double()
    i = torch.arange(lq).view(lq, 1)
    j = torch.arange(lk).view(1, lk)
    visible = torch.ones(bsz, 1, lq, lk, dtype=torch.bool)
    if key_lengths is not None:
        visible = visible & (j.view(1, 1, 1, lk) < key_lengths.view(bsz, 1, 1, 1).long())
    if causal:
        visible = visible & (j <= i + (lk - lq)).view(1, 1, lq, lk)
    s = s.masked_fill(~visible, -math.inf)
    keep = select(s.detach(), n, m)
    kept = s.masked_fill(~keep, -math.inf)
    empty = ~(kept.detach() > -math.inf).any(dim=-1) & ~torch.isnan(kept.detach()).any(dim=-1)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    z = (scale * kept).masked_fill(empty.unsqueeze(-1), 0.0)
    lse = torch.logsumexp(z, dim=-1).masked_fill(empty, -math.inf)
    p = torch.softmax(z, dim=-1).masked_fill(empty.unsqueeze(-1), 0.0)
    out = torch.einsum("bhij,bjhd->bihd", p, v)
    return out, lse
