"""dfss.patch_attention: run the self-attention of an existing model with DFSS.

The patch replaces the ``forward`` of each matching module instance (the module object, its
parameters, buffers, hooks and state_dict keys stay as they are) and ``PatchHandle.restore()`` puts
the original back. Matched: Hugging Face ``BertSelfAttention`` (and subclasses, e.g. RoBERTa's
copies named ``*SelfAttention`` with the same query/key/value layout) and ``torch.nn.MultiheadAttention``.
"""
import inspect
import math
import warnings

import torch
from torch import nn

from .functional import mask_to_bias

__all__ = ["patch_attention", "PatchHandle"]


class PatchHandle:
    """What ``patch_attention`` patched; ``restore()`` (or leaving a ``with`` block) undoes it."""

    def __init__(self, patched):
        self.patched = patched  # list of (qualified name, module)

    @property
    def names(self):
        return [name for name, _ in self.patched]

    def restore(self):
        for _, module in self.patched:
            module.__dict__.pop("forward", None)
            module.__dict__.pop("_dfss_pattern", None)
        self.patched = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.restore()
        return False


def _check_pattern(pattern):
    if not isinstance(pattern, str):
        raise TypeError(f"dfss.patch_attention: argument 'pattern': expected a str such as '2:4' or "
                        f"'dense', got {type(pattern).__name__}")
    one = torch.ones(1, 1, 1, 1)
    torch.ops.dfss.attention(one, one, one, pattern)  # raises ValueError naming 'pattern' when malformed


def _is_bert_self_attention(module):
    # Hugging Face BERT-style self-attention: separate query/key/value Linear layers and the head
    # counts as attributes. Matched by class name so that transformers stays an optional import.
    return (type(module).__name__.endswith("SelfAttention") and
            all(isinstance(getattr(module, n, None), nn.Linear) for n in ("query", "key", "value")) and
            hasattr(module, "num_attention_heads") and hasattr(module, "attention_head_size"))


def _unsupported(where, what):
    raise NotImplementedError(f"dfss.patch_attention: {where}: {what} is not supported by the DFSS "
                              f"replacement; restore the original module (PatchHandle.restore()) for it")


def _bert_forward(old_style):
    # old_style: transformers < 4.48 (positional head_mask, encoder states, past_key_value,
    # output_attentions; returns a 1-tuple); newer versions return (output, attention weights).
    def forward(self, hidden_states, attention_mask=None, *args, **kwargs):
        where = type(self).__name__
        for i, value in enumerate(args):
            if value is not None and value is not False:
                _unsupported(where, f"extra positional argument {i + 2} (head mask, cross-attention or cache)")
        for key in ("head_mask", "encoder_hidden_states", "encoder_attention_mask", "past_key_value",
                    "past_key_values", "cache", "output_attentions"):
            if kwargs.get(key) is not None and kwargs.get(key) is not False:
                _unsupported(where, f"argument '{key}'")
        b, lq, _ = hidden_states.shape
        h, d = self.num_attention_heads, self.attention_head_size
        q = self.query(hidden_states).view(b, lq, h, d)
        k = self.key(hidden_states).view(b, lq, h, d)
        v = self.value(hidden_states).view(b, lq, h, d)
        scale = 1.0 / math.sqrt(d)
        bias = None
        if attention_mask is not None:
            # bool (True attends) or float added to the scaled scores (scale * S + mask), as in
            # the eager and SDPA paths of transformers; mask_to_bias converts it to dfss's bias.
            bias = mask_to_bias(attention_mask, b, h, lq, lq, q.dtype, scale, name="attention_mask")
        out, _ = torch.ops.dfss.attention(q, k, v, self._dfss_pattern, False, scale, None, bias)
        out = out.reshape(b, lq, h * d)
        return (out,) if old_style else (out, None)
    return forward


def _mha_in_projection(m, query, key, value):
    e = m.embed_dim
    if m._qkv_same_embed_dim:
        wq, wk, wv = m.in_proj_weight.split(e)
    else:
        wq, wk, wv = m.q_proj_weight, m.k_proj_weight, m.v_proj_weight
    bq = bk = bv = None
    if m.in_proj_bias is not None:
        bq, bk, bv = m.in_proj_bias.split(e)
    return (nn.functional.linear(query, wq, bq), nn.functional.linear(key, wk, bk),
            nn.functional.linear(value, wv, bv))


def _mha_forward(self, query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None,
                 average_attn_weights=True, is_causal=False):
    # need_weights: DFSS never forms the attention matrix; the weights are returned as None.
    # is_causal is only a hint that attn_mask is causal (as in nn.MultiheadAttention): the mask decides.
    if is_causal and attn_mask is None:
        raise RuntimeError("dfss.patch_attention: nn.MultiheadAttention: argument 'is_causal' needs "
                           "attn_mask (as in nn.MultiheadAttention, it is only a hint)")
    unbatched = query.dim() == 2
    if unbatched:
        query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
        if key_padding_mask is not None:
            key_padding_mask = key_padding_mask.unsqueeze(0)
    if self.batch_first and not unbatched:
        query, key, value = query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1)
    lq, b, e = query.shape
    lk = key.shape[0]
    h = self.num_heads
    d = e // h
    q, k, v = _mha_in_projection(self, query, key, value)  # [L, B, E]
    q = q.view(lq, b, h, d).transpose(0, 1)
    k = k.view(lk, b, h, d).transpose(0, 1)
    v = v.view(lk, b, h, d).transpose(0, 1)
    bias = None
    if attn_mask is not None:
        # nn.MultiheadAttention: [Lq, Lk] or [B * H, Lq, Lk]; bool True means "not allowed".
        mask = attn_mask.view(b, h, lq, lk) if attn_mask.dim() == 3 else attn_mask
        mask = ~mask if mask.dtype == torch.bool else mask
        bias = mask_to_bias(mask, b, h, lq, lk, q.dtype, 1.0 / math.sqrt(d))
    if key_padding_mask is not None:
        pad = key_padding_mask
        pad = (torch.zeros(pad.shape, dtype=q.dtype, device=q.device).masked_fill(pad, -math.inf)
               if pad.dtype == torch.bool else pad.to(q.dtype) * math.sqrt(d))  # mask / scale
        pad = pad.view(b, 1, 1, lk).expand(b, 1, lq, lk)
        bias = pad if bias is None else bias + pad
    out, _ = torch.ops.dfss.attention(q, k, v, self._dfss_pattern, False, None, None, bias)
    out = self.out_proj(out.reshape(b, lq, e))  # [B, Lq, E]
    if unbatched:
        out = out.squeeze(0)
    elif not self.batch_first:
        out = out.transpose(0, 1)
    return out, None


def patch_attention(model, pattern="2:4"):
    """Makes every BERT-style self-attention (Hugging Face ``BertSelfAttention``) and every
    ``nn.MultiheadAttention`` inside ``model`` compute DFSS attention with ``pattern`` ("N:M" or
    "dense"; "dense" reproduces the original function). Returns a ``PatchHandle``: ``restore()``
    puts the original forwards back (also usable as ``with dfss.patch_attention(model): ...``).

    Not carried over: attention-probability dropout (DFSS has none: a warning says so when the
    module has p > 0) and attention weights (``need_weights`` / ``output_attentions``: None or an
    error). ``nn.TransformerEncoderLayer`` in eval mode without autograd may bypass its
    ``self_attn.forward`` (PyTorch's fused inference path); train mode or autograd uses the patch.
    Raises ValueError when the model has no such module or one is already patched.
    """
    _check_pattern(pattern)
    found = []
    for name, module in model.named_modules():
        if isinstance(module, nn.MultiheadAttention):
            if module.bias_k is not None or module.add_zero_attn:
                raise ValueError(f"dfss.patch_attention: module '{name}': add_bias_kv and add_zero_attn "
                                 f"are not supported")
            if module.embed_dim % module.num_heads != 0:
                raise ValueError(f"dfss.patch_attention: module '{name}': embed_dim not a multiple of num_heads")
            found.append((name, module, _mha_forward, module.dropout))
        elif _is_bert_self_attention(module):
            if getattr(module, "position_embedding_type", "absolute") != "absolute":
                raise ValueError(f"dfss.patch_attention: module '{name}': position_embedding_type "
                                 f"'{module.position_embedding_type}' is not supported (only 'absolute')")
            params = inspect.signature(type(module).forward).parameters
            dropout = getattr(getattr(module, "dropout", None), "p", 0.0)
            found.append((name, module, _bert_forward("output_attentions" in params), dropout))
    if not found:
        raise ValueError(f"dfss.patch_attention: argument 'model': expected a model containing "
                         f"BertSelfAttention or nn.MultiheadAttention modules, found none in "
                         f"{type(model).__name__}")
    for name, module, _, _ in found:
        if "_dfss_pattern" in module.__dict__:
            raise ValueError(f"dfss.patch_attention: module '{name}' is already patched; restore it first")
    with_dropout = [f"{name} (p={dropout})" for name, _, _, dropout in found if dropout and dropout > 0]
    if with_dropout:
        warnings.warn(f"dfss.patch_attention: attention dropout is not applied by DFSS in "
                      f"{', '.join(with_dropout)}", stacklevel=2)
    patched = []
    for name, module, forward, _ in found:
        module._dfss_pattern = pattern
        module.forward = forward.__get__(module, type(module))
        patched.append((name, module))
    return PatchHandle(patched)
