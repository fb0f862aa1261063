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


def reference_attention(q, k, v, pattern="2:4", causal=False, scale=None, key_lengths=None, bias=None,
                        key_offset=0, query_offset=None, sink_tokens=0, recent_tokens=0):
    """q [B, Lq, H, d], k and v [B, Lk, Hkv, d] -> (out [B, Lq, H, d], lse [B, H, Lq]), float64.
    Positions are global: key j at key_offset + j, query row i at query_offset[b] + i (default
    key_offset + Lk - Lq); key lengths count global positions."""
    n, m = parse_pattern(pattern)
    q, k, v = q.double(), k.double(), v.double()
    bsz, lq, h, d = q.shape
    lk, hkv = k.shape[1], k.shape[2]
    k = k.repeat_interleave(h // hkv, dim=2)
    v = v.repeat_interleave(h // hkv, dim=2)
    s = torch.einsum("bihd,bjhd->bhij", q, k)
    if bias is not None:
        s = s + bias.double()
    i = torch.arange(lq).view(1, lq, 1)
    kpos = key_offset + torch.arange(lk).view(1, 1, lk)
    q0 = (query_offset.long().view(bsz, 1, 1) if query_offset is not None
          else torch.full((bsz, 1, 1), key_offset + lk - lq))
    qpos = q0 + i                                                     # [B, Lq, 1]
    length = (key_lengths.long().view(bsz, 1, 1) if key_lengths is not None
              else torch.full((bsz, 1, 1), key_offset + lk))
    visible = kpos < length
    if causal:
        visible = visible & (kpos <= qpos)
    s = s.masked_fill(~visible.unsqueeze(1), -math.inf)
    keep = select(s.detach(), n, m)
    if sink_tokens or recent_tokens:
        # A group (M global positions from its start) touching [0, sink) or (last - recent, last] is
        # kept whole; last = the row's last visible position.
        last = torch.minimum(length - 1, qpos) if causal else (length - 1).expand(bsz, lq, 1)
        start = key_offset + (torch.arange(lk) // m * m).view(1, 1, lk)
        whole = start < sink_tokens
        if recent_tokens:
            whole = whole | ((last >= 0) & (start <= last) & (start + m - 1 > last - recent_tokens))
        keep = keep | whole.unsqueeze(1)
    kept = s.masked_fill(~keep, -math.inf)
    empty = ~(kept.detach() > -math.inf).any(dim=-1) & ~torch.isnan(kept.detach()).any(dim=-1)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    z = (scale * kept).masked_fill(empty.unsqueeze(-1), 0.0)
    lse = torch.logsumexp(z, dim=-1).masked_fill(empty, -math.inf)
    p = torch.softmax(z, dim=-1).masked_fill(empty.unsqueeze(-1), 0.0)
    out = torch.einsum("bhij,bjhd->bihd", p, v)
    return out, lse
