"""Bad arguments raise ValueError (shape, dtype, value) or RuntimeError (device) naming the argument,
the expected and the received value."""
import pytest
import torch

import dfss


def qkv(dtype=torch.float32):
    return (torch.randn(2, 5, 4, 8, dtype=dtype), torch.randn(2, 7, 2, 8, dtype=dtype),
            torch.randn(2, 7, 2, 8, dtype=dtype))


def op(q, k, v, **kw):
    return torch.ops.dfss.attention(q, k, v, **kw)


@pytest.mark.parametrize("make, error, pattern", [
    (lambda q, k, v: op(q, k.double(), v), ValueError, r"argument 'k': expected dtype float32 \(the dtype of q\), got float64"),
    (lambda q, k, v: op(q.int(), k.int(), v.int()), ValueError, r"argument 'q': expected dtype float64, float32, float16 or bfloat16, got int32"),
    (lambda q, k, v: op(q[0], k, v), ValueError, r"argument 'q': expected 4 dimensions \[B, Lq, H, d\], got 3 dimensions with shape \[5, 4, 8\]"),
    (lambda q, k, v: op(q, k[:, :, :, :4], v), ValueError, r"argument 'k': expected shape\[3\] \(head_dim\) == 8, got 4"),
    (lambda q, k, v: op(q, torch.randn(2, 7, 3, 8), v), ValueError, r"argument 'k': expected shape\[2\] \(heads_kv\) to divide the 4 query heads, got 3"),
    (lambda q, k, v: op(q, k, v[:, :6]), ValueError, r"argument 'v': expected the shape of 'k' \[2, 7, 2, 8\], got \[2, 6, 2, 8\]"),
    (lambda q, k, v: op(q, k, v, pattern="2-4"), ValueError, r"argument 'pattern'"),
    (lambda q, k, v: op(q, k, v, pattern="5:4"), ValueError, r"argument 'pattern': expected 1 <= N <= M <= 16, got 5:4"),
    (lambda q, k, v: op(q, k, v, scale=-1.0), ValueError, r"argument 'scale': expected a finite value > 0"),
    (lambda q, k, v: op(q, k, v, key_lengths=torch.tensor([7.0, 1.0])), ValueError, r"argument 'key_lengths': expected dtype int32 or int64, got float32"),
    (lambda q, k, v: op(q, k, v, key_lengths=torch.tensor([7])), ValueError, r"argument 'key_lengths': expected shape\[0\] \(batch\) == 2, got 1"),
    (lambda q, k, v: op(q, k, v, key_lengths=torch.tensor([-8, 1])), ValueError, r"argument 'key_lengths': expected values in \[0, 4611686018427387904\].*got -8 at index 0"),
    (lambda q, k, v: op(q, k, v, attn_bias=torch.randn(2, 3, 5, 7)), ValueError, r"argument 'attn_bias': expected shape\[1\] \(heads or 1\) == 4, got 3"),
    (lambda q, k, v: op(q, k, v, attn_bias=torch.randn(5, 7)), ValueError, r"argument 'attn_bias': expected 4 dimensions"),
    (lambda q, k, v: dfss.attention(q, k, v, dropout_p=0.1), ValueError, r"argument 'dropout_p': expected 0.0"),
    (lambda q, k, v: dfss.attention(q[0], k, v), ValueError, r"argument 'query': expected 4 dimensions \[B, H, L, d\]"),
    (lambda q, k, v: dfss.attention(q, k, v, layout="bshd"), ValueError, r"argument 'layout'"),
    (lambda q, k, v: dfss.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=torch.ones(3, 7, dtype=torch.bool)), ValueError, r"argument 'attn_mask': expected a shape broadcastable to \[2, 4, 5, 7\]"),
])
def test_bad_arguments(make, error, pattern):
    q, k, v = qkv()
    with pytest.raises(error, match=pattern):
        make(q, k, v)


def test_cuda_tensors_raise_a_clear_error():
    """A build without CUDA kernels (cuda_unavailable.cpp); test_cuda.py covers the CUDA kernels."""
    from dfss import _build_info
    if _build_info.cuda:
        pytest.skip("this build has the CUDA kernels (tests/python/test_cuda.py tests them)")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: the CUDA error path needs one")
    q, k, v = qkv()
    with pytest.raises(RuntimeError, match=r"argument 'q': expected a CPU tensor, got a tensor on cuda:0 "
                                           r"\(this dfss build has no CUDA kernels; move the inputs to the CPU"):
        torch.ops.dfss.attention(q.cuda(), k.cuda(), v.cuda())
    with pytest.raises(RuntimeError, match=r"argument 'k': expected a CPU tensor"):
        torch.ops.dfss.attention(q, k.cuda(), v)


def test_module_and_patch_errors():
    with pytest.raises(ValueError, match="argument 'num_kv_heads'"):
        dfss.nn.DFSSAttention(32, 4, num_kv_heads=3)
    with pytest.raises(ValueError, match="found none"):
        dfss.patch_attention(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="argument 'pattern'"):
        dfss.patch_attention(torch.nn.MultiheadAttention(8, 2), pattern="2:5:1")
