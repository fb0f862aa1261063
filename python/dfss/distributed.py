"""DFSS across processes with torch.distributed: context parallelism over key/value shards.

DFSS groups are aligned blocks of M keys, so attention over keys split at multiples of M is exactly
the merge of attention over each part (docs/semantics.md, "Merging partial results"). Here every
rank holds the same queries and one contiguous shard of the keys and values, computes its partial
result with its global ``key_offset``, and the partial results are combined with the exact merge::

    import torch.distributed as dist, dfss.distributed
    dist.init_process_group("gloo")            # CPU tensors: the CUDA backend refuses key_offset
    out, lse = dfss.distributed.context_parallel_attention(q, k_shard, v_shard, is_causal=True,
                                                           pattern="2:4", return_lse=True)

Gradients: the output is replicated (every rank returns the same ``out`` and ``lse``), as after a
tensor-parallel layer, so the loss downstream is assumed to be computed identically on every rank.
Each rank's ``k_shard`` and ``v_shard`` receive their own exact gradient, and ``q`` receives the full
gradient (its shard contributions are summed over the ranks with an all-reduce).
"""
import torch
import torch.distributed as dist

from .functional import attention
from .merge import merge_attention_states

__all__ = ["context_parallel_attention"]


def _error(what):
    return f"dfss.distributed.context_parallel_attention: {what}"


class _ReplicatedInput(torch.autograd.Function):
    """Identity forward; the backward sums the gradient over the ranks (q is replicated, each rank's
    shard contributes a part of its gradient)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group)
        return grad, None


class _GatherReplicated(torch.autograd.Function):
    """All-gather of each rank's part (a list in rank order); the downstream computation is
    replicated, so the backward keeps this rank's slice of the (identical) gradients."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        ctx.rank = dist.get_rank(group)
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return tuple(parts)

    @staticmethod
    def backward(ctx, *grads):
        return grads[ctx.rank], None


def context_parallel_attention(q, k_shard, v_shard, group=None, *, pattern="2:4", is_causal=False,
                               scale=None, key_lengths=None, query_offset=None, sink_tokens=0,
                               recent_tokens=0, layout="bhld", return_lse=False):
    """DFSS attention of the replicated queries ``q`` over the keys and values whose contiguous
    shards the ranks of ``group`` (default: the world) hold in rank order, every shard's length a
    multiple of M except the last rank's. Returns the full ``out`` (and ``lse`` when
    ``return_lse``) on every rank, equal to single-process ``dfss.attention`` over the concatenated
    keys (to fp32 rounding of the merge).

    Shapes as ``dfss.attention`` (``layout="bhld"``: q [B, H, Lq, d], shards [B, Hkv, Ls, d]).
    Positions are global: ``key_lengths`` ([B], valid keys of the whole sequence; default all of
    them) and ``query_offset`` ([B], position of query row 0; default total keys - Lq, the
    bottom-right rule) refer to the concatenated keys, as do ``sink_tokens`` and ``recent_tokens``.
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(_error("torch.distributed is not initialised; call "
                                  "torch.distributed.init_process_group first"))
    if layout not in ("bhld", "blhd"):
        raise ValueError(_error(f"argument 'layout': expected 'bhld' or 'blhd', got {layout!r}"))
    for name, t in (("q", q), ("k_shard", k_shard), ("v_shard", v_shard)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(_error(f"argument '{name}': expected a 4-dimensional tensor, got "
                                    f"{getattr(t, 'shape', type(t).__name__)}"))
    seq_dim = 2 if layout == "bhld" else 1
    try:
        m = 1 if pattern == "dense" else int(str(pattern).split(":")[1])
    except (IndexError, ValueError):
        m = 1  # a malformed pattern: dfss.attention below names it
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    # Every rank's shard length, to place the shards (key_offset) and check their alignment.
    mine = torch.tensor([k_shard.shape[seq_dim]], dtype=torch.int64)
    lengths = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(lengths, mine, group=group)
    lengths = [int(x) for x in lengths]
    for r, n in enumerate(lengths[:-1]):
        if n % m != 0:
            raise ValueError(_error(f"the key shard of rank {r} has {n} keys, expected a multiple of "
                                    f"M = {m} (only the last rank's shard may end inside a group)"))
    key_offset = sum(lengths[:rank])
    total = sum(lengths)
    batch, lq = q.shape[0], q.shape[seq_dim]
    if key_lengths is None:
        key_lengths = torch.full((batch,), total, dtype=torch.int64, device=q.device)
    if query_offset is None:
        # The bottom-right rule, total keys - Lq, as global positions (which start at 0). Without a
        # causal mask query positions place nothing (a row's last visible key is its sequence's last).
        if total < lq and is_causal:
            raise ValueError(_error(f"is_causal with {lq} query rows against {total} keys in all: the "
                                    f"bottom-right rule would put query row 0 at position {total - lq}, "
                                    f"and positions start at 0; pass query_offset"))
        query_offset = torch.full((batch,), max(total - lq, 0), dtype=torch.int64, device=q.device)
    q_in = _ReplicatedInput.apply(q, group) if q.requires_grad else q
    out, lse = attention(q_in, k_shard, v_shard, is_causal=is_causal, scale=scale, pattern=pattern,
                         key_lengths=key_lengths, query_offset=query_offset, key_offset=key_offset,
                         sink_tokens=sink_tokens, recent_tokens=recent_tokens, layout=layout,
                         return_lse=True)
    outs = _GatherReplicated.apply(out, group)
    lses = _GatherReplicated.apply(lse, group)
    out, lse = merge_attention_states(list(zip(outs, lses)), layout=layout)
    return (out, lse) if return_lse else out
