"""dfss.transformers: DFSS as a transformers attention implementation, on small randomly initialised
decoder LMs built from configs (no download): Llama (GQA 4:2), Qwen2 (MQA, q/k/v biases) and Qwen3
(GQA, q/k norms), all with RoPE. Needs transformers >= 5 (run by CTest python_transformers in the
torch 2.x venv of tools/scripts/torch2-venv.sh); skipped elsewhere, e.g. with Debian's torch 1.13."""
import pytest
import torch

import dfss
import dfss.transformers
from reference import reference_attention

transformers = pytest.importorskip("transformers", minversion="5.0",
                                   reason="needs transformers >= 5 (tools/scripts/torch2-venv.sh)")
from transformers import AutoModelForCausalLM  # noqa: E402
from transformers import masking_utils  # noqa: E402

DENSE = dfss.transformers.register("dfss-dense", pattern="dense")
SPARSE = dfss.transformers.register("dfss-2:4", pattern="2:4")
VOCAB = 96


def _config(kind, **extra):
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, max_position_embeddings=256, pad_token_id=0, bos_token_id=1,
                  eos_token_id=2, tie_word_embeddings=False)
    common.update(extra)
    if kind == "llama":
        return transformers.LlamaConfig(num_key_value_heads=2, head_dim=16, **common)
    if kind == "qwen2":
        return transformers.Qwen2Config(**{"num_key_value_heads": 1, "use_sliding_window": False, **common})
    if kind == "qwen3":
        return transformers.Qwen3Config(**{"num_key_value_heads": 2, "head_dim": 24, "use_sliding_window": False,
                                           **common})
    raise AssertionError(kind)


def _models(kind, names, dtype=torch.float64, **extra):
    """One random model per attention implementation in `names`, all with the same weights. Each model
    gets its own config: from_config records the implementation in the config object it is given,
    so models sharing one would all run the last name."""
    first = AutoModelForCausalLM.from_config(_config(kind, **extra), attn_implementation=names[0], dtype=dtype).eval()
    models = [first]
    for name in names[1:]:
        m = AutoModelForCausalLM.from_config(_config(kind, **extra), attn_implementation=name, dtype=dtype).eval()
        m.load_state_dict(first.state_dict())
        models.append(m)
    for m, name in zip(models, names):
        assert m.config._attn_implementation == name, (m.config._attn_implementation, name)
    return models


def _ids(b, length):
    return torch.randint(3, VOCAB, (b, length))


def _generate(model, ids, mask, n=16):
    out = model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                         pad_token_id=0, return_dict_in_generate=True, output_logits=True)
    return out.sequences, torch.stack(out.logits, 1)


KINDS = ["llama", "qwen2", "qwen3"]


@pytest.mark.parametrize("kind", KINDS)
def test_dense_logits_match_sdpa(kind):
    sdpa, dense = _models(kind, ["sdpa", DENSE])
    ids = _ids(2, 23)  # not a multiple of 4: a partial group of keys
    with torch.no_grad():
        want = sdpa(ids).logits
        got = dense(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("kind", KINDS)
def test_dense_greedy_generation_matches_sdpa(kind):
    sdpa, dense = _models(kind, ["sdpa", DENSE])
    ids = _ids(2, 9)
    mask = torch.ones_like(ids)
    want, want_logits = _generate(sdpa, ids, mask)
    got, got_logits = _generate(dense, ids, mask)
    assert got.shape == (2, 9 + 16)
    assert torch.equal(got, want)
    torch.testing.assert_close(got_logits, want_logits, rtol=1e-6, atol=1e-6)  # generate: fp32 logits


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_sparse_generation_runs_and_decode_matches_prefill(kind):
    (model,) = _models(kind, [SPARSE])
    ids = _ids(2, 13)
    seq, logits = _generate(model, ids, torch.ones_like(ids))
    assert seq.shape == (2, 13 + 16) and torch.isfinite(logits).all()
    # DFSS is a function of each query row and the keys it sees: the logits of every decode step
    # against the KV cache equal those of one causal forward over the whole sequence.
    with torch.no_grad():
        full = model(seq[:, :-1]).logits[:, 12:]
    torch.testing.assert_close(logits, full.to(logits.dtype), rtol=1e-6, atol=1e-6)  # generate: fp32 logits
    (dense,) = _models(kind, [DENSE])
    dense.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert not torch.allclose(dense(seq).logits, model(seq).logits, atol=1e-6)  # 2:4 prunes


def test_sparse_float32_generation_runs():
    (model,) = _models("qwen2", [SPARSE], dtype=torch.float32)
    ids = _ids(3, 10)
    seq, logits = _generate(model, ids, torch.ones_like(ids), n=8)
    assert seq.shape == (3, 18) and torch.isfinite(logits).all()


@pytest.mark.parametrize("pattern", ["dense", "2:4"])
def test_right_padding_is_key_lengths(pattern):
    name = DENSE if pattern == "dense" else SPARSE
    sdpa, model = _models("llama", ["sdpa", name])
    ids = _ids(3, 11)
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0
    mask[2, 1:] = 0
    with torch.no_grad():
        got = model(ids, attention_mask=mask).logits
        # The same mask given as a 4-D boolean mask goes to dfss as a bias: the same function.
        causal = torch.ones(11, 11, dtype=torch.bool).tril()
        full = (causal[None] & mask.bool()[:, None, :])[:, None]
        via_bias = model(ids, attention_mask=full).logits
        want = sdpa(ids, attention_mask=mask).logits
    valid = mask.bool()
    torch.testing.assert_close(got[valid], via_bias[valid], rtol=1e-10, atol=1e-10)
    if pattern == "dense":
        torch.testing.assert_close(got[valid], want[valid], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_left_padding_generation_dense_matches_sdpa(kind):
    # Left padding (what generate() wants for decoder LMs) is not a key length: the mask function
    # falls back to a boolean mask ([B, 1, Lq, Lk]; [B, 1, 1, Lk] in decode) passed as a bias.
    sdpa, dense = _models(kind, ["sdpa", DENSE])
    ids = _ids(3, 10)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    mask[2, :6] = 0
    ids[mask == 0] = 0
    want, want_logits = _generate(sdpa, ids, mask)
    got, got_logits = _generate(dense, ids, mask)
    assert torch.equal(got, want)
    torch.testing.assert_close(got_logits, want_logits, rtol=1e-6, atol=1e-6)  # generate: fp32 logits
    (sparse,) = _models(kind, [SPARSE])
    sparse.load_state_dict(dense.state_dict())
    seq, logits = _generate(sparse, ids, mask)
    assert torch.isfinite(logits).all()


def _mask_for(name, attention_mask, q_length, past=0):
    cfg = _config("llama")
    cfg._attn_implementation = name
    embeds = torch.zeros(attention_mask.shape[0], q_length, 8)
    cache = None
    if past:
        cache = transformers.DynamicCache(config=cfg)
        kv = torch.zeros(attention_mask.shape[0], 2, past, 16)
        for layer in range(cfg.num_hidden_layers):
            cache.update(kv, kv, layer)
    return masking_utils.create_causal_mask(config=cfg, inputs_embeds=embeds, attention_mask=attention_mask,
                                            cache=cache)


def test_mask_function_maps_padding_and_causality():
    ones = torch.ones(2, 12, dtype=torch.long)
    m = _mask_for(DENSE, ones, 12)
    assert isinstance(m, dfss.transformers.DFSSMask)
    assert m.mask is None and m.causal and m.key_lengths is None and m.key_limit is None
    right = ones.clone()
    right[1, 9:] = 0
    m = _mask_for(DENSE, right, 12)
    assert m.mask is None and m.causal and m.key_lengths.tolist() == [12, 9]
    # Decode: one query row against 11 cached keys: no causal flag needed, all 12 keys visible.
    m = _mask_for(DENSE, ones, 1, past=11)
    assert m.mask is None and not m.causal and m.key_lengths is None and m.kv_length == 12
    # Speculative decoding: 3 rows against 9 cached keys: bottom-right causal.
    m = _mask_for(DENSE, ones, 3, past=9)
    assert m.mask is None and m.causal and m.key_limit is None
    # Left padding and holes: the causal flag and a per-key mask (broadcast over the query rows), never
    # a [B, 1, Lq, Lk] mask; together they are transformers' own mask (causal and padding).
    causal = torch.ones(12, 12, dtype=torch.bool).tril()
    for holes in ([(0, 0, 4)], [(0, 0, 4), (1, 5, 7)], [(1, 3, 4)]):
        pad = ones.clone()
        for b, start, end in holes:
            pad[b, start:end] = 0
        m = _mask_for(DENSE, pad, 12)
        assert m.mask is None and m.causal and m.key_lengths is None and m.key_limit is None, holes
        assert torch.equal(m.key_mask, pad.bool()), holes
        want = masking_utils.sdpa_mask(batch_size=2, q_length=12, kv_length=12, q_offset=0, kv_offset=0,
                                       mask_function=masking_utils.causal_mask_function, attention_mask=pad,
                                       allow_is_causal_skip=False)
        assert torch.equal(causal[None, None] & m.key_mask[:, None, None, :], want), holes
    # Decode of a left-padded batch: one row, every cached key but the padding.
    left = ones.clone()
    left[0, :4] = 0
    m = _mask_for(DENSE, left, 1, past=11)
    assert m.mask is None and not m.causal and m.key_lengths is None and torch.equal(m.key_mask, left.bool())


@pytest.mark.parametrize("pattern", ["dense", "2:4"])
def test_left_padding_with_windows_matches_reference(pattern):
    # Left padding reaches dfss as the causal flag and a key mask, so each query row's recent window
    # sits below its own position (docs/semantics.md, "Sink and recent windows"), as in the reference.
    name = dfss.transformers.register(f"dfss-test-left-windows-{pattern}", pattern=pattern, sink_tokens=3,
                                      recent_tokens=6)
    fn = _attention_function(name)
    pad = torch.ones(3, 21, dtype=torch.long)
    pad[0, :5] = 0
    pad[2, :12] = 0
    mask = _mask_for(name, pad, 21)
    assert isinstance(mask, dfss.transformers.DFSSMask) and mask.mask is None and mask.key_mask is not None
    q = torch.randn(3, 4, 21, 16, dtype=torch.float64)
    k = torch.randn(3, 2, 21, 16, dtype=torch.float64)
    v = torch.randn(3, 2, 21, 16, dtype=torch.float64)
    out, _ = fn(_Module(), q, k, v, mask, scaling=0.3)
    bias = torch.zeros(3, 4, 21, 21, dtype=torch.float64).masked_fill(~pad.bool()[:, None, None, :], float("-inf"))
    want, _ = reference_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), pattern=pattern,
                                  causal=True, scale=0.3, bias=bias, sink_tokens=3, recent_tokens=6)
    rows = pad.bool()  # padded query rows see no key: 0 in both
    torch.testing.assert_close(out[rows], want[rows], rtol=1e-12, atol=1e-12)
    assert torch.equal(out[~rows], torch.zeros_like(out[~rows]))


def test_left_padding_generation_with_windows_is_padding_invariant():
    # With M = 4 left padding of 4 slots moves a sequence by one whole group: its 2:4 groups, sink-free
    # recent windows and RoPE positions are those of the sequence alone, so its greedy generation is too.
    name = dfss.transformers.register("dfss-test-recent", pattern="2:4", recent_tokens=4)
    (model,) = _models("llama", [name])
    short, longer = _ids(1, 21), _ids(1, 25)
    ids = torch.cat([torch.cat([torch.zeros(1, 4, dtype=torch.long), short], 1), longer])
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    seq, logits = _generate(model, ids, mask)
    alone, alone_logits = _generate(model, short, torch.ones_like(short))
    assert torch.equal(seq[0, 4:], alone[0])
    torch.testing.assert_close(logits[0], alone_logits[0], rtol=1e-6, atol=1e-6)  # generate: fp32 logits


def test_recent_window_with_a_4d_mask_raises():
    name = dfss.transformers.register("dfss-test-recent-4d", pattern="2:4", recent_tokens=4)
    fn = _attention_function(name)
    q = torch.randn(1, 4, 5, 8)
    k = torch.randn(1, 2, 5, 8)
    full = torch.ones(5, 5, dtype=torch.bool).tril()[None, None]
    with pytest.raises(NotImplementedError, match="recent_tokens=4 with a mask that reaches dfss only as a 4-D"):
        fn(_Module(), q, k, k, full, scaling=0.3)
    out, _ = _attention_function(SPARSE)(_Module(), q, k, k, full, scaling=0.3)  # no window: the bias
    assert torch.isfinite(out).all()


def test_static_cache_generation_dense_matches_sdpa():
    # A static cache hands the attention its whole buffer (max length keys): the mask function turns
    # its empty slots into a key limit (a view of the first keys), not a mask.
    sdpa, dense = _models("llama", ["sdpa", DENSE])
    ids = _ids(2, 7)
    kw = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0,
              cache_implementation="static")
    want = sdpa.generate(ids, attention_mask=torch.ones_like(ids), **kw)
    got = dense.generate(ids, attention_mask=torch.ones_like(ids), **kw)
    assert torch.equal(got, want)


def test_training_backward_matches_sdpa():
    sdpa, dense = _models("qwen3", ["sdpa", DENSE])
    ids = _ids(2, 14)
    for m in (sdpa, dense):
        m.train()
        m(ids, labels=ids).loss.backward()
    for (name, a), b in zip(sdpa.named_parameters(), dense.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-8, atol=1e-10, msg=name)


def test_torch_compile():
    (model,) = _models("llama", [SPARSE], dtype=torch.float32)
    ids = _ids(2, 16)
    with torch.no_grad():
        want = model(ids).logits
    torch._dynamo.reset()
    # aot_eager: dynamo and AOTAutograd trace the operator with fake tensors (its Meta kernels) but
    # run it eagerly; inductor would also need a C++ toolchain and minutes of compilation here.
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    with torch.no_grad():
        got = compiled(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # Left padding while tracing: the causal flag and a key mask too (no branch on the mask's values).
    pad = torch.ones_like(ids)
    pad[0, :5] = 0
    with torch.no_grad():
        want = model(ids, attention_mask=pad).logits
        got = compiled(ids, attention_mask=pad).logits
    torch.testing.assert_close(got[pad.bool()], want[pad.bool()], rtol=1e-5, atol=1e-5)
    model.train()
    loss = compiled(ids, labels=ids).loss
    loss.backward()
    assert model.model.layers[0].self_attn.q_proj.weight.grad is not None


def _attention_function(name):
    return transformers.AttentionInterface()[name]


class _Module(torch.nn.Module):
    is_causal = True


@pytest.mark.parametrize("kwarg,value", [("sliding_window", 8), ("softcap", 30.0), ("s_aux", torch.zeros(4)),
                                         ("sinks", torch.zeros(4)), ("head_mask", torch.ones(4)),
                                         ("position_bias", torch.zeros(1, 4, 5, 5)),
                                         ("output_attentions", True), ("dropout", 0.1)])
def test_unsupported_options_raise(kwarg, value):
    fn = _attention_function(SPARSE)
    q = torch.randn(1, 4, 5, 8)
    k = torch.randn(1, 2, 5, 8)
    out, weights = fn(_Module(), q, k, k, None, scaling=0.3)
    assert out.shape == (1, 5, 4, 8) and weights is None
    with pytest.raises(NotImplementedError, match=f"dfss.transformers: .*{kwarg}"):
        fn(_Module(), q, k, k, None, scaling=0.3, **{kwarg: value})


def test_unsupported_model_options_raise():
    (model,) = _models("llama", [SPARSE], attention_dropout=0.1)
    ids = _ids(1, 8)
    with pytest.raises(NotImplementedError, match="dropout"):
        model.train()(ids)
    model.eval()
    with pytest.raises(NotImplementedError, match="output_attentions"):
        model(ids, output_attentions=True)
    (qwen,) = _models("qwen2", [SPARSE], use_sliding_window=True, sliding_window=4, max_window_layers=1)
    with pytest.raises(NotImplementedError, match="sliding-window"):
        qwen(ids)


def test_attention_function_matches_dfss_attention():
    # The layout contract: transformers passes [B, H, L, d] and wants [B, L, H, d] back.
    fn = _attention_function(SPARSE)
    q = torch.randn(2, 6, 9, 16, dtype=torch.float64)
    k = torch.randn(2, 3, 9, 16, dtype=torch.float64)
    v = torch.randn(2, 3, 9, 16, dtype=torch.float64)
    out, _ = fn(_Module(), q, k, v, None, scaling=0.2)
    want = dfss.attention(q, k, v, is_causal=True, scale=0.2, pattern="2:4")
    torch.testing.assert_close(out, want.transpose(1, 2), rtol=0, atol=0)


def test_register_arguments():
    assert dfss.transformers.register("dfss-test-1:2", pattern="1:2") == "dfss-test-1:2"
    assert "dfss-test-1:2" in transformers.AttentionInterface()
    assert "dfss-test-1:2" in masking_utils.AttentionMaskInterface()
    with pytest.raises(ValueError, match="recent_tokens"):
        dfss.transformers.register("x", recent_tokens=1.5)
    with pytest.raises(ValueError, match="sink_tokens"):
        dfss.transformers.register("x", sink_tokens=-1)
    with pytest.raises(ValueError, match="pattern"):
        dfss.transformers.register("x", pattern="5:4")
    with pytest.raises(ValueError, match="name"):
        dfss.transformers.register("sdpa")


def _spy(name):
    """Registers `name`-spy: the attention function of `name`, recording the masks it receives."""
    seen = []
    inner = transformers.AttentionInterface()[name]

    def spy(module, query, key, value, attention_mask, **kwargs):
        m = attention_mask
        seen.append("none" if m is None else
                    ("4-D" if m.mask is not None else "segments" if m.segments is not None else "keys")
                    if isinstance(m, dfss.transformers.DFSSMask) else type(m).__name__)
        return inner(module, query, key, value, attention_mask, **kwargs)

    transformers.AttentionInterface.register(name + "-spy", spy)
    masking_utils.AttentionMaskInterface.register(name + "-spy", masking_utils.AttentionMaskInterface()[name])
    return name + "-spy", seen


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("padding", ["none", "left"])
def test_generation_builds_no_4d_mask(cache, padding):
    # Prefill and decode reach dfss as flags, key lengths and (left padding) a key mask, never as a
    # 4-D mask.
    name, seen = _spy(SPARSE)
    (model,) = _models("llama", [name])
    ids = _ids(2, 9)
    mask = torch.ones_like(ids)
    if padding == "left":
        mask[1, :3] = 0
    model.generate(ids, attention_mask=mask, max_new_tokens=4, min_new_tokens=4, do_sample=False,
                   pad_token_id=0, cache_implementation=cache)
    assert seen and set(seen) == {"keys"}, seen


def test_torch_compile_static_cache_generation():
    # The usual compiled decode: a static cache and a compiled forward. The mask function runs before
    # the forward (generate), so the compiled step sees key lengths, and K/V keep the cache's shape.
    sdpa, dense = _models("llama", ["sdpa", DENSE], dtype=torch.float32)
    ids = _ids(2, 7)
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=6, min_new_tokens=6, do_sample=False,
              pad_token_id=0, cache_implementation="static")
    want = sdpa.generate(ids, **kw)
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    dense.forward = torch.compile(dense.forward, backend="aot_eager")
    got = dense.generate(ids, **kw)
    assert torch.equal(got, want)
    assert counters["stats"]["unique_graphs"] == 2  # prefill and decode: no re-trace per position


def test_sink_and_recent_windows():
    # Windows that cover every key make 2:4 dense attention; small ones change the result and keep
    # decode against the cache equal to one causal forward.
    everything = dfss.transformers.register("dfss-test-windows-all", pattern="2:4", sink_tokens=256,
                                            recent_tokens=256)
    small = dfss.transformers.register("dfss-test-windows", pattern="2:4", sink_tokens=4, recent_tokens=8)
    dense, full, windows, plain = _models("llama", [DENSE, everything, small, SPARSE])
    ids = _ids(2, 29)
    with torch.no_grad():
        torch.testing.assert_close(full(ids).logits, dense(ids).logits, rtol=1e-10, atol=1e-10)
        w, p = windows(ids).logits, plain(ids).logits
    assert not torch.allclose(w, p, atol=1e-6)
    seq, logits = _generate(windows, ids[:, :13], torch.ones(2, 13, dtype=torch.long))
    with torch.no_grad():
        want = windows(seq[:, :-1]).logits[:, 12:]
    torch.testing.assert_close(logits, want.to(logits.dtype), rtol=1e-6, atol=1e-6)


# Packed sequences (transformers' padding-free format: one row holds several sequences, position ids
# restart at each; no attention mask, no cache, as in training with DataCollatorWithFlattening).
PACKED = [5, 7, 3, 9, 1, 6]  # sequence starts 0, 5, 12, 15, 24, 25: most not multiples of M = 4


def _packed(lengths):
    ids = _ids(1, sum(lengths))
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    return ids, positions, starts


def test_packed_mask_is_spans():
    # transformers' packed-sequence mask function reaches dfss as spans, never as a 4-D mask; rows of
    # a batch may be packed differently, and an unpacked row is one span.
    cfg = _config("llama")
    cfg._attn_implementation = SPARSE
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3], [0, 1, 2, 3, 4, 5, 6, 7, 8]])
    m = masking_utils.create_causal_mask(config=cfg, inputs_embeds=torch.zeros(2, 9, 8), attention_mask=None,
                                         cache=None, position_ids=positions)
    assert isinstance(m, dfss.transformers.DFSSMask) and m.mask is None and m.causal, m
    assert m.segments == [[(0, 3), (3, 5), (5, 9)], [(0, 9)]], m.segments
    # Not packed (or with a padding mask, or a cache): the usual mapping, no spans.
    m = masking_utils.create_causal_mask(config=cfg, inputs_embeds=torch.zeros(2, 9, 8), attention_mask=None,
                                         cache=None, position_ids=torch.arange(9).expand(2, 9))
    assert isinstance(m, dfss.transformers.DFSSMask) and m.segments is None and m.mask is None


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
@pytest.mark.parametrize("pattern", ["dense", "2:4"])
def test_packed_sequences_attend_alone(kind, pattern):
    # Each packed sequence gives the logits it gives alone: its keys only, causal, and its N:M groups
    # from its own first token (a 4-D mask over the packed row would group keys across sequences).
    # Dense also equals SDPA on the same packed row.
    name = DENSE if pattern == "dense" else SPARSE
    sdpa, model = _models(kind, ["sdpa", name])
    ids, positions, starts = _packed(PACKED)
    with torch.no_grad():
        packed = model(ids, position_ids=positions, use_cache=False).logits
        alone = torch.cat([model(ids[:, s:s + n], use_cache=False).logits for s, n in zip(starts, PACKED)], 1)
        torch.testing.assert_close(packed, alone, rtol=1e-12, atol=1e-12)
        if pattern == "dense":
            want = sdpa(ids, position_ids=positions, use_cache=False).logits
            torch.testing.assert_close(packed, want, rtol=1e-10, atol=1e-10)


def test_packed_training_backward_matches_sdpa_and_reaches_dfss_as_spans():
    name, seen = _spy(DENSE)
    sdpa, dense = _models("qwen3", ["sdpa", name])
    ids, positions, _ = _packed(PACKED)
    for m in (sdpa, dense):
        m.train()
        m(ids, position_ids=positions, labels=ids, use_cache=False).loss.backward()
    assert seen and set(seen) == {"segments"}, seen
    for (pname, a), b in zip(sdpa.named_parameters(), dense.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-8, atol=1e-10, msg=pname)


def test_packed_sequences_with_windows_attend_alone():
    # Sink and recent windows count from each sequence's own first token; with a 4-D mask they could
    # not be placed (recent_tokens raised NotImplementedError there).
    name = dfss.transformers.register("dfss-test-packed-windows", pattern="2:4", sink_tokens=2, recent_tokens=3)
    (model,) = _models("llama", [name])
    lengths = [11, 6, 13]
    ids, positions, starts = _packed(lengths)
    with torch.no_grad():
        packed = model(ids, position_ids=positions, use_cache=False).logits
        alone = torch.cat([model(ids[:, s:s + n], use_cache=False).logits for s, n in zip(starts, lengths)], 1)
    torch.testing.assert_close(packed, alone, rtol=1e-12, atol=1e-12)


def test_torch_compile_packed_sequences():
    # While tracing the spans would depend on the position ids' values: the packed mask takes the 4-D
    # fallback there, and dense still equals SDPA.
    sdpa, dense = _models("llama", ["sdpa", DENSE], dtype=torch.float32)
    ids, positions, _ = _packed(PACKED)
    torch._dynamo.reset()
    compiled = torch.compile(dense, backend="aot_eager", fullgraph=True)
    with torch.no_grad():
        want = sdpa(ids, position_ids=positions, use_cache=False).logits
        got = compiled(ids, position_ids=positions, use_cache=False).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_packed_spans_of_another_shape_raise():
    fn = _attention_function(DENSE)
    q = torch.randn(1, 4, 5, 8)
    k = torch.randn(1, 2, 5, 8)
    spans = dfss.transformers.DFSSMask(True, None, None, None, 0, 0, 5, segments=[[(0, 3)]])
    with pytest.raises(ValueError, match=r"packed-sequence mask was made for 1 rows of \[3\] tokens, got query of "
                                         r"shape \[1, 4, 5, 8\]"):
        fn(_Module(), q, k, k, spans)
    out, _ = fn(_Module(), q, k, k, dfss.transformers.DFSSMask(True, None, None, None, 0, 0, 5,
                                                              segments=[[(0, 3), (3, 5)]]))
    want = torch.cat([fn(_Module(), q[:, :, s:e], k[:, :, s:e], k[:, :, s:e], None)[0] for s, e in ((0, 3), (3, 5))], 1)
    torch.testing.assert_close(out, want, rtol=0, atol=0)
