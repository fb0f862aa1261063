"""dfss.attention: DFSS attention with the calling convention of F.scaled_dot_product_attention."""
import math

import torch

__all__ = ["attention", "mask_to_bias"]


def _check_4d(name, t, layout):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"dfss.attention: argument '{name}': expected a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 4:
        dims = "[B, H, L, d]" if layout == "bhld" else "[B, L, H, d]"
        raise ValueError(f"dfss.attention: argument '{name}': expected 4 dimensions {dims} "
                         f"(layout='{layout}'), got {t.dim()} dimensions with shape {list(t.shape)}")


def mask_to_bias(mask, batch, heads, seqlen_q, seqlen_k, dtype, scale, name="attn_mask"):
    """An SDPA-style mask (bool: True takes part in attention; float: added to the scaled scores,
    scale * S + mask), broadcastable to [B, H, Lq, Lk], as the operator's bias [B or 1, H or 1,
    Lq, Lk], which is added before the scale (scale * (S + bias)): a float mask becomes mask / scale.
    Differentiable for float masks."""
    if mask.dim() > 4:
        raise ValueError(f"dfss.attention: argument '{name}': expected at most 4 dimensions "
                         f"broadcastable to [B, H, Lq, Lk], got shape {list(mask.shape)}")
    if mask.dtype == torch.bool:
        bias = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
        bias = bias.masked_fill(~mask, -math.inf)
    elif mask.is_floating_point():
        bias = mask / scale
    else:
        raise ValueError(f"dfss.attention: argument '{name}': expected a bool or floating mask, "
                         f"got dtype {mask.dtype}")
    bias = bias.reshape((1,) * (4 - bias.dim()) + tuple(bias.shape))
    want = (batch, heads, seqlen_q, seqlen_k)
    for d, (got, full) in enumerate(zip(bias.shape, want)):
        if got not in (1, full):
            raise ValueError(f"dfss.attention: argument '{name}': expected a shape broadcastable to "
                             f"{list(want)} [B, H, Lq, Lk], got {list(mask.shape)} (dimension {d})")
    # The operator takes size 1 for B and H (it sums dbias over them) but full Lq and Lk.
    return bias.expand(bias.shape[0], bias.shape[1], seqlen_q, seqlen_k)


def attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, *,
              pattern="2:4", key_lengths=None, layout="bhld", return_lse=False, key_offset=0,
              query_offset=None, sink_tokens=0, recent_tokens=0):
    """DFSS attention: in every aligned group of M keys of a row keep the N largest scores, then
    softmax and the product with V over the kept ones (docs/semantics.md).

    Mirrors ``torch.nn.functional.scaled_dot_product_attention``: query [B, H, Lq, d], key and value
    [B, Hkv, Lk, d] (layout="bhld", the default; layout="blhd" takes [B, L, H, d] as FlashAttention
    does), ``attn_mask`` bool (True takes part) or float (added to the scaled scores) broadcastable to
    [B, H, Lq, Lk], ``scale`` default 1/sqrt(d). Differences: ``pattern`` ("N:M" or "dense"),
    ``key_lengths`` ([B] valid keys per batch entry, in global positions), grouped-query K/V (Hkv
    dividing H) always allowed; ``is_causal`` is bottom-right aligned (FlashAttention >= 2.1; SDPA
    aligns top-left, which differs only when Lq != Lk); ``dropout_p`` must be 0. Rows with no
    visible key give 0.

    Positions (docs/semantics.md, "Positions"): ``key_offset`` is the global position of key 0 (a
    multiple of M: shards of a longer sequence, windows of a cache), ``query_offset`` ([B] int tensor)
    the global position of query row 0 per batch entry (default ``key_offset + Lk - Lq``). Dense
    windows: every group touching the first ``sink_tokens`` keys or a row's last ``recent_tokens``
    visible keys is kept whole ("Sink and recent windows").

    Returns the output in query's layout and dtype, plus LSE [B, H, Lq] when ``return_lse``.
    Gradients flow to query, key, value, a float ``attn_mask``, and through the LSE (so that
    ``dfss.merge_attention_states`` of key shards is differentiable end to end).
    """
    if layout not in ("bhld", "blhd"):
        raise ValueError(f"dfss.attention: argument 'layout': expected 'bhld' or 'blhd', got {layout!r}")
    if dropout_p != 0.0:
        raise ValueError(f"dfss.attention: argument 'dropout_p': expected 0.0 (DFSS has no attention "
                         f"dropout), got {dropout_p}")
    for name, t in (("query", query), ("key", key), ("value", value)):
        _check_4d(name, t, layout)
    if layout == "bhld":
        q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    else:
        q, k, v = query, key, value
    if scale is not None and not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"dfss.attention: argument 'scale': expected a finite value > 0 (or None for "
                         f"1/sqrt(d)), got {scale}")
    bias = None
    if attn_mask is not None:
        eff_scale = 1.0 / math.sqrt(q.shape[3]) if scale is None else scale
        bias = mask_to_bias(attn_mask, q.shape[0], q.shape[2], q.shape[1], k.shape[1], q.dtype, eff_scale)
    for name, value in (("key_offset", key_offset), ("sink_tokens", sink_tokens), ("recent_tokens", recent_tokens)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"dfss.attention: argument '{name}': expected an int, got {type(value).__name__}")
    out, lse = torch.ops.dfss.attention(q, k, v, pattern, bool(is_causal),
                                        None if scale is None else float(scale), key_lengths, bias,
                                        key_offset, query_offset, sink_tokens, recent_tokens)
    if layout == "bhld":
        out = out.transpose(1, 2)
    return (out, lse) if return_lse else out
