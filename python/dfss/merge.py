"""dfss.merge_attention_states: the exact merge of partial attention results.

DFSS groups are aligned blocks of M keys, so attention over keys split at multiples of M is exactly
the merge of the parts (docs/semantics.md, "Merging partial results"): split-K and context
parallelism lose nothing. The same function as the C++ ``dfss::merge_attention_states``, written
with torch operations so that it runs on any device and is differentiable in every out and lse.
"""
import math

import torch

__all__ = ["merge_attention_states"]


def _check(name, t, dims):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"dfss.merge_attention_states: argument '{name}': expected a torch.Tensor, "
                        f"got {type(t).__name__}")
    if t.dim() != dims:
        raise ValueError(f"dfss.merge_attention_states: argument '{name}': expected {dims} dimensions, "
                         f"got shape {list(t.shape)}")


def _merge2(oa, la, ob, lb):
    """One merge in layout [B, H, L, d] / [B, H, L]; fp32 arithmetic (fp64 for fp64 outputs), out
    returned in that precision (the caller rounds it to the parts' dtype once, after the last merge)."""
    acc = torch.float64 if oa.dtype == torch.float64 else torch.float32
    oa32, ob32, la32, lb32 = oa.to(acc), ob.to(acc), la.to(acc), lb.to(acc)
    inf = math.inf
    nan_row = torch.isnan(la32) | torch.isnan(lb32) | torch.isnan(oa32).any(-1) | torch.isnan(ob32).any(-1)
    empty = (la32 == -inf) & (lb32 == -inf)
    both_inf = (la32 == inf) & (lb32 == inf)
    special = nan_row | empty | both_inf
    # Rows handled specially are computed on stand-in zeros, so that neither the value nor the
    # gradient of the ordinary formula (NaN there) leaks into them: two empty parts give zero
    # gradients.
    zero = torch.zeros_like(la32)
    sa = torch.where(special, zero, la32)
    sb = torch.where(special, zero, lb32)
    # exp(LSE_a - LSE) = sigmoid(LSE_a - LSE_b): exact weights 1 and 0 for an infinite difference.
    d = sa - sb
    wa = torch.sigmoid(d)
    wb = torch.sigmoid(-d)
    lse = torch.logaddexp(sa, sb)
    out = wa.unsqueeze(-1) * torch.where(special.unsqueeze(-1), torch.zeros_like(oa32), oa32) + \
        wb.unsqueeze(-1) * torch.where(special.unsqueeze(-1), torch.zeros_like(ob32), ob32)
    nan = torch.full_like(lse, math.nan)
    lse = torch.where(empty, torch.full_like(lse, -inf), lse)
    lse = torch.where(both_inf, torch.full_like(lse, inf), lse)
    lse = torch.where(nan_row, nan, lse)
    out = torch.where(empty.unsqueeze(-1), torch.zeros_like(out), out)
    out = torch.where((nan_row | both_inf).unsqueeze(-1), torch.full_like(out, math.nan), out)
    return out, lse


def merge_attention_states(out_a, lse_a=None, out_b=None, lse_b=None, *, layout="bhld"):
    """Merges partial attention results of the same query rows computed over disjoint key sets.

    ``merge_attention_states(out_a, lse_a, out_b, lse_b)`` or ``merge_attention_states([(out_0,
    lse_0), (out_1, lse_1), ...])`` (merged in list order). Outputs are [B, H, L, d] (layout="bhld",
    SDPA's; layout="blhd": [B, L, H, d]), LSEs [B, H, L] in natural log, as
    ``dfss.attention(..., return_lse=True)`` returns them. Returns (out, lse): out in the parts'
    dtype and layout (a list of 16-bit parts is merged in float32 and rounded once, at the end),
    lse in float32 (float64 for float64 outputs). Per row: a NaN in any part gives
    a NaN row and LSE; empty parts (LSE -inf) contribute nothing, and all-empty rows give 0 and -inf
    with zero gradients; a part with LSE +inf (its scores overflowed) outweighs finite ones, and two
    such parts give a NaN row with LSE +inf. Differentiable in every out and lse.
    """
    if layout not in ("bhld", "blhd"):
        raise ValueError(f"dfss.merge_attention_states: argument 'layout': expected 'bhld' or 'blhd', "
                         f"got {layout!r}")
    if isinstance(out_a, (list, tuple)):
        if lse_a is not None or out_b is not None or lse_b is not None:
            raise ValueError("dfss.merge_attention_states: a list of parts comes alone: "
                             "merge_attention_states([(out, lse), ...])")
        parts = list(out_a)
        if not parts:
            raise ValueError("dfss.merge_attention_states: argument 'parts': expected at least one "
                             "(out, lse) pair, got an empty list")
    else:
        parts = [(out_a, lse_a), (out_b, lse_b)]
    checked = []
    for i, part in enumerate(parts):
        if not isinstance(part, (list, tuple)) or len(part) != 2:
            raise TypeError(f"dfss.merge_attention_states: part {i}: expected an (out, lse) pair, got {part!r}")
        out, lse = part
        names = ("out_a", "lse_a") if i == 0 and len(parts) == 2 else ("out_b", "lse_b") if len(parts) == 2 \
            else (f"parts[{i}][0]", f"parts[{i}][1]")
        _check(names[0], out, 4)
        _check(names[1], lse, 3)
        o = out if layout == "bhld" else out.transpose(1, 2)
        if tuple(lse.shape) != tuple(o.shape[:3]):
            raise ValueError(f"dfss.merge_attention_states: argument '{names[1]}': expected shape "
                             f"{list(o.shape[:3])} [B, H, L] to match its output, got {list(lse.shape)}")
        if checked:
            o0 = checked[0][0]
            if o.shape != o0.shape or o.dtype != o0.dtype or o.device != o0.device:
                raise ValueError(f"dfss.merge_attention_states: argument '{names[0]}': expected shape "
                                 f"{list(o0.shape)}, dtype {o0.dtype} and device {o0.device} like the first "
                                 f"part, got {list(o.shape)}, {o.dtype}, {o.device}")
        if not o.is_floating_point():
            raise ValueError(f"dfss.merge_attention_states: argument '{names[0]}': expected a floating "
                             f"dtype, got {o.dtype}")
        checked.append((o, lse))
    out, lse = checked[0]
    dtype = out.dtype
    if len(checked) == 1:
        lse = lse.to(torch.float64 if out.dtype == torch.float64 else torch.float32)
    for o, l in checked[1:]:
        out, lse = _merge2(out, lse, o, l)  # 16-bit parts: the running result stays in fp32
    out = out.to(dtype)
    return (out if layout == "bhld" else out.transpose(1, 2)), lse
