"""dfss.transformers: DFSS as a Hugging Face ``transformers`` attention implementation.

    import dfss, dfss.transformers
    from transformers import AutoModelForCausalLM
    name = dfss.transformers.register(pattern="2:4")          # returns "dfss"
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=name)
    out = model.generate(input_ids, max_new_tokens=32)         # prefill and KV-cache decode run DFSS

``register`` adds two functions under one name: an attention function (``AttentionInterface``, what
``attn_implementation=...`` selects) and a mask function (``AttentionMaskInterface``). The mask
function does not build transformers' 4-D ``[B, 1, Lq, Lk]`` mask: it returns a ``DFSSMask`` that
says what the operator needs (causal flag, per-sequence key lengths, how many cache slots hold keys,
and for left padding a per-key mask ``[B, Lk]`` broadcast over the query rows), and builds a 4-D
mask, passed to dfss as an additive bias, only when the mask cannot be said that way (custom mask
functions, sliding windows). Packed sequences (position ids restarting, transformers' padding-free
format) become spans that dfss attends to one by one, each as if it were alone. docs/transformers.md
has the mapping.

This module imports transformers only inside ``register``: ``import dfss`` works without it.
CI tests transformers 5.24.0 (tools/scripts/torch2-venv-extras.txt); the mask function also takes
the 4.5x signature (``cache_position`` instead of ``q_length``/``q_offset``), checked by hand with
4.57.6 (dense logits and greedy generation equal SDPA's, dynamic and static caches, left padding).
"""
import math

import torch

from .functional import mask_to_bias

__all__ = ["register", "DFSSMask"]


class DFSSMask:
    """What the mask function hands to the attention function in place of a 4-D mask.

    * ``causal``: dfss's causal flag (bottom-right aligned: key j visible to query i iff
      j <= i + Lk - Lq, with Lk the number of keys after ``key_limit``).
    * ``key_limit``: an int or None: only the first ``key_limit`` keys of the cache can be visible
      (a static cache's unused slots, or the keys after the last query position); the attention
      function slices K and V to them (a view), which makes the bottom-right rule exact.
    * ``key_lengths``: None or an int64 tensor [B]: right padding, valid keys per sequence.
    * ``key_mask``: None or a bool tensor [B, Lk] (True takes part, Lk before ``key_limit``): keys
      a sequence never sees (left padding, holes in the padding mask), on top of the causal flag and
      key lengths; given to dfss as a bias [B, 1, 1, Lk], broadcast over the query rows.
    * ``segments``: None, or per sequence of the batch a list of (start, end) spans: packed sequences
      (transformers' padding-free format: position ids that restart), Lq = Lk. Each span is attended
      to alone (its queries see only its keys, causal per ``causal``), so its N:M groups start at its
      own first token, as for that sequence on its own. The other fields are then unused.
    * ``mask``: None or a bool tensor [B, 1, Lq, Lk] (True takes part): the fallback for masks that
      the fields above cannot express; then the others are unused.
    * ``query_offset``, ``key_offset``: the global positions of query row 0 and key 0 as transformers
      gave them, for inspection (the mapping needs neither the operator's key_offset nor query_offset).
    * ``kv_length``: the key length transformers sized the mask for (checked against K).
    """

    __slots__ = ("causal", "key_limit", "key_lengths", "key_mask", "mask", "query_offset", "key_offset",
                 "kv_length", "segments")

    # generate() with a static (compileable) cache makes the masks before the forward and passes them
    # as the model's attention_mask; transformers' mask preprocessing then calls the mask function
    # again with it, and only asks it for ndim (2 means "a padding mask to convert"). The mask
    # function returns a DFSSMask it receives as it is.
    ndim = 4

    def __init__(self, causal, key_limit, key_lengths, mask, query_offset, key_offset, kv_length, key_mask=None,
                 segments=None):
        self.causal = causal
        self.segments = segments
        self.key_limit = key_limit
        self.key_lengths = key_lengths
        self.key_mask = key_mask
        self.mask = mask
        self.query_offset = query_offset
        self.key_offset = key_offset
        self.kv_length = kv_length

    def __repr__(self):
        if self.mask is not None:
            return f"DFSSMask(mask={list(self.mask.shape)})"
        if self.segments is not None:
            return f"DFSSMask(causal={self.causal}, segments={self.segments})"
        return (f"DFSSMask(causal={self.causal}, key_limit={self.key_limit}, "
                f"key_lengths={None if self.key_lengths is None else self.key_lengths.tolist()}, "
                f"key_mask={None if self.key_mask is None else list(self.key_mask.shape)})")


def _error(what):
    return f"dfss.transformers: {what}"


def _import_transformers():
    try:
        import transformers
        from transformers import masking_utils
    except ImportError as exc:
        raise ImportError(_error(f"register() needs the transformers package ({exc}); "
                                 "pip install transformers")) from exc
    if not (hasattr(transformers, "AttentionInterface") and hasattr(masking_utils, "AttentionMaskInterface")):
        raise ImportError(_error(f"transformers {transformers.__version__} has no AttentionInterface and "
                                 "AttentionMaskInterface, which dfss.transformers registers with; upgrade "
                                 "transformers (CI tests 5.24.0)"))
    return transformers, masking_utils


def _tracing(*tensors):
    """True while torch.compile / torch.export / jit tracing: the mask function then must not branch
    on tensor values (a graph break, or an error with fullgraph=True) and builds the 4-D mask."""
    if torch.jit.is_tracing():
        return True
    compiler = getattr(torch, "compiler", None)
    if compiler is not None and hasattr(compiler, "is_compiling"):
        if compiler.is_compiling():
            return True
    elif hasattr(torch, "_dynamo") and torch._dynamo.is_compiling():
        return True
    try:
        from torch._subclasses.fake_tensor import FakeTensor
    except ImportError:  # pragma: no cover
        return False
    return any(isinstance(t, FakeTensor) for t in tensors if isinstance(t, torch.Tensor))


def _padding_mask(attention_mask, kv_length, kv_offset):
    """The 2-D padding mask [B, T] (True: a real token) as booleans for the keys kv_offset ..
    kv_offset + kv_length - 1, padded with False past T (a static cache's empty slots)."""
    pad = attention_mask.to(torch.bool)
    missing = kv_offset + kv_length - pad.shape[-1]
    if missing > 0:
        pad = torch.nn.functional.pad(pad, (0, missing), value=False)
    return pad[:, kv_offset:kv_offset + kv_length]


def _closure(fn):
    """The names and values of a Python function's closure ({} for anything else)."""
    code, cells = getattr(fn, "__code__", None), getattr(fn, "__closure__", None)
    if code is None or cells is None:
        return {}
    try:
        return {name: cell.cell_contents for name, cell in zip(code.co_freevars, cells)}
    except ValueError:  # an empty cell
        return {}


def _packed_sequences(mask_function, masking_utils, base_functions):
    """transformers' mask function for packed sequences, taken apart: ``and_masks(remap_positions_for_
    packed_sequence(base, position_ids), packed_sequence_mask_function(sequence_ids))`` with ``base``
    one of ``base_functions`` (causal or bidirectional). Returns (base, sequence_ids [B, L]) or None
    for any other function, which then takes the 4-D fallback: the structure is read from the
    functions' names and closures, so a transformers that builds it differently only loses the
    shortcut."""
    def made_by(fn, factory):
        return getattr(fn, "__module__", None) == masking_utils.__name__ and \
            getattr(fn, "__qualname__", "").startswith(factory + ".<locals>.")

    if not made_by(mask_function, "and_masks"):
        return None
    parts = _closure(mask_function).get("mask_functions")
    if not isinstance(parts, tuple) or len(parts) != 2:
        return None
    remap, packed = parts
    if not (made_by(remap, "remap_positions_for_packed_sequence") and made_by(packed, "packed_sequence_mask_function")):
        return None
    base = _closure(remap).get("mask_function")
    ids = _closure(packed).get("packed_sequence_mask")
    if not any(base is f for f in base_functions) or not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        return None
    return base, ids


def _spans(sequence_ids):
    """Per row of ``sequence_ids`` [B, L] (non-decreasing sequence numbers, transformers'
    find_packed_sequence_indices), the (start, end) spans of its sequences."""
    spans = []
    for row in sequence_ids:
        _, counts = torch.unique_consecutive(row, return_counts=True)
        ends = torch.cumsum(counts, 0).tolist()
        spans.append(list(zip([0] + ends[:-1], ends)))
    return spans


def _make_mask_function(masking_utils):
    causal_fn = masking_utils.causal_mask_function
    bidirectional_fn = getattr(masking_utils, "bidirectional_mask_function", None)
    sdpa_mask = masking_utils.sdpa_mask

    def dfss_mask(batch_size, *args, **kwargs):
        # transformers >= 5: (batch_size, q_length, kv_length, q_offset, kv_offset, mask_function,
        # attention_mask, ...); 4.5x: (batch_size, cache_position, kv_length, kv_offset, ...). Always
        # called with keywords by transformers; positional arguments are mapped for direct calls.
        call = dict(kwargs)
        if "cache_position" in call or (args and isinstance(args[0], torch.Tensor)):
            names = ("cache_position", "kv_length", "kv_offset", "mask_function", "attention_mask")
        else:
            names = ("q_length", "kv_length", "q_offset", "kv_offset", "mask_function", "attention_mask")
        call.update(zip(names, args))
        mask_function = call.get("mask_function", causal_fn)
        attention_mask = call.get("attention_mask")
        if isinstance(attention_mask, DFSSMask):
            return attention_mask  # made by this function before the forward (generate, static cache)
        kv_length = call["kv_length"]
        kv_offset = call.get("kv_offset", 0)
        if "cache_position" in call:
            cache_position = call["cache_position"]
            q_length = cache_position.shape[0]
            q_offset = cache_position[0] if q_length > 0 else 0
        else:
            q_length = call["q_length"]
            q_offset = call.get("q_offset", 0)

        def materialized():
            # The fallback: transformers' own boolean [B, 1, Lq, Lk] mask (True takes part).
            full = dict(call, batch_size=batch_size, allow_is_causal_skip=False,
                        allow_is_bidirectional_skip=False)
            full.pop("allow_torch_fix", None)
            m = sdpa_mask(**full)
            return DFSSMask(False, None, None, m, q_offset, kv_offset, kv_length)

        if mask_function is causal_fn:
            causal = True
        elif bidirectional_fn is not None and mask_function is bidirectional_fn:
            causal = False
        else:
            packed = _packed_sequences(mask_function, masking_utils,
                                       [f for f in (causal_fn, bidirectional_fn) if f is not None])
            if packed is None:
                return materialized()  # sliding window, chunked, or/and overlays, custom functions, ...
            base, ids = packed
            # transformers packs only without a cache and a 2-D mask: Lq = Lk = the ids' length.
            if attention_mask is not None or _tracing(ids, q_offset, kv_offset) or \
                    not (int(q_offset) == 0 and int(kv_offset) == 0 and q_length == kv_length == ids.shape[-1]
                         and ids.shape[0] == batch_size):
                return materialized()
            return DFSSMask(base is causal_fn, None, None, None, 0, 0, kv_length, segments=_spans(ids))
        tracing = _tracing(attention_mask, q_offset, kv_offset)
        # A static cache gives q_offset as a tensor (it hands every layer its whole buffer).
        static_cache = isinstance(q_offset, torch.Tensor)
        if tracing and (static_cache or isinstance(kv_offset, torch.Tensor)):
            return materialized()  # the mapping would depend on a tensor's value
        q_offset = int(q_offset)
        kv_offset = int(kv_offset)
        key_limit = kv_length
        if causal:
            # Query row i sits at position q_offset + i and key j at kv_offset + j; causal: key j
            # visible iff kv_offset + j <= q_offset + i, i.e. j <= i + delta.
            delta = q_offset - kv_offset
            if delta < 0 or delta + q_length > kv_length:
                return materialized()
            # Keys past delta + Lq - 1 are hidden from every row: dropping them leaves Lk' = delta + Lq,
            # and dfss's bottom-right rule j <= i + Lk' - Lq is then exactly j <= i + delta.
            key_limit = delta + q_length
        key_lengths = key_mask = None
        if attention_mask is not None:
            if attention_mask.dim() != 2:
                return materialized()
            # transformers ands the padding mask with the causal one: key j of sequence b takes part
            # iff pad[b, j] and the causal rule allows it.
            pad = _padding_mask(attention_mask, kv_length, kv_offset)
            if tracing:
                key_mask = pad  # no branch on its values (a bias of zeros where nothing is padded)
            elif not bool(pad[:, :key_limit].all()):
                seen = pad[:, :key_limit]
                lengths = seen.sum(-1)
                prefix = torch.arange(key_limit, device=pad.device)[None, :] < lengths[:, None]
                if bool(torch.equal(prefix, seen)):
                    key_lengths = lengths.to(torch.int64)  # right padding: key lengths
                else:
                    # Left padding or holes: a per-key mask broadcast over the query rows, beside the
                    # causal flag, which keeps each row's window (causal tiles skipped, and the last
                    # visible key that places a recent window) where a [B, 1, Lq, Lk] mask would not.
                    key_mask = pad
        if causal and q_length <= 1 and (key_limit < kv_length or static_cache):
            # One query row (decode): causality is the key limit alone, given as key lengths rather
            # than a slice, so that K and V keep the cache's shape and a compiled decode step with a
            # static cache sees the same kinds of inputs at every position (no re-tracing).
            if key_lengths is None:
                device = call.get("device") or (attention_mask.device if attention_mask is not None else
                                                getattr(call.get("cache_position"), "device", "cpu"))
                key_lengths = torch.full((batch_size,), key_limit, dtype=torch.int64, device=device)
            key_limit = kv_length
        if causal and q_length <= 1:
            causal = False
        return DFSSMask(causal, None if key_limit == kv_length else key_limit, key_lengths, None,
                        q_offset, kv_offset, kv_length, key_mask)

    return dfss_mask


# Keyword arguments transformers models pass to the attention function that dfss does not implement:
# (name, test for "in use", what it is). Unknown keyword arguments (position_ids, cu_seq_lens_*, ...)
# are accepted and unused, as by transformers' SDPA function.
_UNSUPPORTED = (
    ("sliding_window", lambda v: v is not None, "sliding-window attention (a local window of keys)"),
    ("softcap", lambda v: v is not None and v != 0, "attention logit soft-capping"),
    ("s_aux", lambda v: v is not None, "learned attention sinks (s_aux)"),
    ("sinks", lambda v: v is not None, "learned attention sinks"),
    ("position_bias", lambda v: v is not None, "an additive position bias (T5-style relative attention)"),
    ("head_mask", lambda v: v is not None, "a head mask"),
    ("output_attentions", lambda v: bool(v), "output_attentions=True (DFSS never forms the attention "
                                             "probabilities)"),
)


def _packed_attention(query, key, value, segments, pattern, causal, scaling, sink_tokens, recent_tokens, where):
    """Packed sequences: each span of each row attended to alone (views of q, K and V, one operator
    call per span), the outputs concatenated back into [B, L, H, d]."""
    b, lq = query.shape[0], query.shape[2]
    if len(segments) != b or any(not spans or spans[-1][1] != lq for spans in segments):
        raise ValueError(_error(f"{where}: the packed-sequence mask was made for {len(segments)} rows of "
                                f"{[s[-1][1] if s else 0 for s in segments]} tokens, got query of shape "
                                f"{list(query.shape)}"))
    rows = []
    for i, spans in enumerate(segments):
        parts = []
        for s, e in spans:
            o, _ = torch.ops.dfss.attention(query[i:i + 1, :, s:e].transpose(1, 2), key[i:i + 1, :, s:e].transpose(1, 2),
                                            value[i:i + 1, :, s:e].transpose(1, 2), pattern, causal,
                                            None if scaling is None else float(scaling), None, None, 0, None,
                                            sink_tokens, recent_tokens)
            parts.append(o)
        rows.append(parts[0] if len(parts) == 1 else torch.cat(parts, 1))
    return rows[0] if b == 1 else torch.cat(rows, 0)


def _make_attention_function(name, pattern, sink_tokens, recent_tokens):
    def dfss_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                       is_causal=None, **kwargs):
        where = f"attn_implementation '{name}' ({type(module).__name__})"
        for arg, used, what in _UNSUPPORTED:
            if used(kwargs.get(arg)):
                raise NotImplementedError(_error(f"{where}: {what} is not implemented by dfss (argument "
                                                 f"'{arg}'={kwargs.get(arg)!r}); use attn_implementation="
                                                 f"'sdpa' or 'eager' for this model"))
        if dropout:
            raise NotImplementedError(_error(
                f"{where}: attention dropout (p={dropout}) is not implemented by dfss; set the config's "
                f"attention_dropout to 0 or call model.eval()"))
        if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
            raise ValueError(_error(f"{where}: expected query, key and value of 4 dimensions [B, H, L, d], "
                                    f"got {list(query.shape)}, {list(key.shape)}, {list(value.shape)}"))
        b, h, lq, d = query.shape
        key_lengths = bias = None
        four_d = False  # a [B, 1, Lq, Lk] mask, not the key mask of left padding
        if isinstance(attention_mask, DFSSMask):
            m = attention_mask
            if key.shape[2] != m.kv_length:
                raise ValueError(_error(f"{where}: the mask was made for {m.kv_length} keys, got key of "
                                        f"shape {list(key.shape)} (a mask of another layer type?)"))
            if m.segments is not None:
                causal = m.causal if is_causal is not False else False
                return _packed_attention(query, key, value, m.segments, pattern, causal, scaling, sink_tokens,
                                         recent_tokens, where), None
            if m.mask is not None:
                mask, causal, four_d = m.mask, False, True
            else:
                mask, causal = None, m.causal
                key_lengths = m.key_lengths
                if m.key_limit is not None:
                    key, value = key[:, :, :m.key_limit], value[:, :, :m.key_limit]
                if m.key_mask is not None:
                    mask = m.key_mask[:, None, None, :key.shape[2]]
            # transformers' "bidirectional decoder" switch (is_causal=False in the model's kwargs).
            if is_causal is False:
                causal = False
        elif attention_mask is None:
            mask = None
            causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
            causal = causal and lq > 1
        elif isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 4:
            # A user's 4-D mask (bool, or float added to the scores).
            mask, causal, four_d = attention_mask, False, True
        else:
            raise ValueError(_error(f"{where}: expected the mask of the '{name}' mask function, None or a 4-D "
                                    f"mask, got {type(attention_mask).__name__}"
                                    f"{list(attention_mask.shape) if hasattr(attention_mask, 'shape') else ''}"
                                    f" (was the model loaded with attn_implementation='{name}'?)"))
        if recent_tokens and four_d:
            raise NotImplementedError(_error(
                f"{where}: recent_tokens={recent_tokens} with a mask that reaches dfss only as a 4-D "
                f"[B, 1, Lq, Lk] mask (a custom mask function, packed sequences or a static cache's mask "
                f"made while tracing, or a 4-D attention_mask): a recent window is placed from each "
                f"query's last visible key, which dfss knows from the causal flag and key lengths, not "
                f"from a 4-D mask; pass a 2-D padding mask, or register with recent_tokens=0"))
        if mask is not None:
            eff_scale = 1.0 / math.sqrt(d) if scaling is None else scaling
            bias = mask_to_bias(mask, b, h, lq, key.shape[2], query.dtype, eff_scale, name="attention_mask")
        # transformers passes [B, H, L, d] (usually a transposed view of [B, L, H, d]); the operator
        # takes [B, L, H, d] with any strides, and its output [B, Lq, H, d] is what transformers wants
        # back, so no copy either way. Grouped-query K/V (Hkv dividing H) go in as they are.
        out, _ = torch.ops.dfss.attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                                          pattern, causal, None if scaling is None else float(scaling),
                                          key_lengths, bias, 0, None, sink_tokens, recent_tokens)
        return out, None

    dfss_attention.__name__ = f"dfss_attention_{name}"
    return dfss_attention


def _check_window(arg, value):
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(_error(f"register: argument '{arg}': expected an int >= 0, got {value!r}"))


def register(name="dfss", pattern="2:4", sink_tokens=0, recent_tokens=0):
    """Registers DFSS attention with ``pattern`` ("N:M" or "dense") under ``name`` in transformers'
    ``AttentionInterface`` and ``AttentionMaskInterface``, and returns ``name``: then
    ``AutoModelForCausalLM.from_config(cfg, attn_implementation=name)`` (or ``from_pretrained``, or
    ``model.set_attn_implementation(name)``) runs DFSS in prefill and in KV-cache decode.

    Registering the same name again replaces it (for models created afterwards, and for existing
    models at their next forward: transformers looks the function up by name at every call).
    ``sink_tokens`` and ``recent_tokens`` keep dense every group that touches the first
    ``sink_tokens`` cache slots or a query's last ``recent_tokens`` visible keys (docs/semantics.md,
    "Sink and recent windows"; as NVIDIA Model Optimizer's N:M prefill masking does). Positions count
    cache slots: with left padding the sink covers the padding slots, not a sequence's first tokens.
    A recent window ends at each row's own position, which dfss reads from the causal flag: with a
    mask that reaches it only as a 4-D mask (custom mask functions, a user's 4-D ``attention_mask``)
    ``recent_tokens > 0`` raises NotImplementedError. Packed sequences (position ids that restart,
    no attention mask) are attended to sequence by sequence, each as if alone: its N:M groups, sink
    and recent windows start from its own first token.
    Not implemented, raising NotImplementedError at the forward: sliding-window layers, logit
    soft-capping, learned sinks (``s_aux``), T5-style position bias, ``head_mask``, attention dropout
    (training with ``attention_dropout > 0``) and ``output_attentions=True``.
    """
    if not isinstance(name, str) or not name or name in ("eager", "sdpa", "flex_attention") \
            or name.startswith(("flash_attention", "paged")):
        raise ValueError(_error(f"register: argument 'name': expected a new non-empty name (not one of "
                                f"transformers' own implementations), got {name!r}"))
    if not isinstance(pattern, str):
        raise TypeError(_error(f"register: argument 'pattern': expected a str such as '2:4' or 'dense', "
                               f"got {type(pattern).__name__}"))
    one = torch.ones(1, 1, 1, 1)
    try:
        torch.ops.dfss.attention(one, one, one, pattern)
    except (ValueError, RuntimeError) as exc:
        raise ValueError(_error(f"register: argument 'pattern': {exc}")) from None
    _check_window("sink_tokens", sink_tokens)
    _check_window("recent_tokens", recent_tokens)
    transformers, masking_utils = _import_transformers()
    transformers.AttentionInterface.register(name, _make_attention_function(name, pattern, sink_tokens,
                                                                             recent_tokens))
    masking_utils.AttentionMaskInterface.register(name, _make_mask_function(masking_utils))
    return name
