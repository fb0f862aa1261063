"""torch.ops.dfss.attention on CUDA tensors (src/torch/cuda.cpp).

Without a GPU (CI): which CUDA kernel the build registered (cuda.cpp, or cuda_unavailable.cpp's clear
error), that it agrees with setup.py's recorded choice, that CI's build with nvcc and a CUDA torch
does compile the CUDA kernels (DFSS_EXPECT_CUDA_OPERATOR=1), and the CUDA kernels' host side run by
redispatching CPU tensors to them (the checks before the device, the backward's error).
With a GPU (sm_80 or newer, tools/gpu/device-run.sh): the forward against the fp64 reference
(reference.py) on awkward shapes, key lengths with empty rows, causal, grouped heads, d = 64 and
128, 1:2 and 2:4, f16 and bf16, both layouts of dfss.attention, no keys and no queries, the current
stream and a CUDA graph capture; and the clear errors (f32, unsupported options, the backward).
Every GPU test skips, with the reason, where there is no GPU or no CUDA kernels.
"""
import math
import os
import re

import pytest
import torch

import dfss
from dfss import _build_info
from reference import reference_attention

op = torch.ops.dfss.attention


def cuda_registration():
    """The source file of the operator's CUDA kernel, from the dispatcher's own table."""
    found = re.search(r"^CUDA: registered at (\S+?):\d+", torch._C._dispatch_dump("dfss::attention"), re.M)
    return os.path.basename(found.group(1)) if found else None


def test_cuda_registration_is_the_build_choice():
    assert cuda_registration() == ("cuda.cpp" if _build_info.cuda else "cuda_unavailable.cpp"), (
        f"dispatcher: {cuda_registration()}, setup.py: cuda={_build_info.cuda} ({_build_info.cuda_reason})")


def test_cuda_kernels_built_where_expected():
    # CTest sets it when the core has the CUDA backend and the torch of the test is a CUDA build, so
    # that a build which silently lost its CUDA kernels fails instead of skipping.
    if os.environ.get("DFSS_EXPECT_CUDA_OPERATOR") != "1":
        pytest.skip("DFSS_EXPECT_CUDA_OPERATOR is not 1: no expectation about this build's CUDA kernels")
    assert _build_info.cuda, f"the extension was built without its CUDA kernels: {_build_info.cuda_reason}"


needs_cuda_build = pytest.mark.skipif(not _build_info.cuda,
                                      reason=f"built without the CUDA kernels ({_build_info.cuda_reason})")


def redispatch_to_cuda(overload, *args):
    """Runs the CUDA kernel of @p overload on whatever tensors it is given: its host side up to the
    device, on a machine without a GPU."""
    return overload.redispatch(torch._C.DispatchKeySet(torch._C.DispatchKey.CUDA), *args)


@needs_cuda_build
def test_cuda_forward_kernel_checks_its_device_without_a_gpu():
    q, k, v = (torch.randn(1, 4, 2, 64, dtype=torch.float16) for _ in range(3))
    with pytest.raises(RuntimeError, match=r"dfss.attention: argument 'q': expected a CUDA tensor, got a tensor on cpu"):
        redispatch_to_cuda(op.default, q, k, v, "2:4", False, None, None, None, 0, None, 0, 0)


@needs_cuda_build
def test_cuda_backward_kernel_raises_without_a_gpu():
    t = torch.zeros(1, 4, 2, 64, dtype=torch.float16)
    lse = torch.zeros(1, 2, 4)
    with pytest.raises(NotImplementedError, match=r"dfss.attention_backward: no CUDA backward yet"):
        redispatch_to_cuda(torch.ops.dfss.attention_backward.default, t, t, t, t, t, lse, "2:4", False, None,
                           None, None, False, 0, None, 0, 0, None)


def gpu_reason():
    if not _build_info.cuda:
        return f"built without the CUDA kernels ({_build_info.cuda_reason})"
    if not torch.cuda.is_available():
        return "no CUDA device"
    if torch.cuda.get_device_capability() < (8, 0):
        return f"{torch.cuda.get_device_name()} is older than sm_80 (the sparse tensor cores)"
    return None


needs_gpu = pytest.mark.skipif(gpu_reason() is not None, reason=str(gpu_reason()))

UNIT_ROUNDOFF = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def make_inputs(b, lq, lk, h, hkv, d, dtype):
    """Small-integer q and k, so every score is exact in f32 and f64 and the kernel's selection must
    be the reference's; v real in [-1, 1]. On the CPU, moved to the GPU by the caller."""
    q = torch.randint(-2, 3, (b, lq, h, d)).to(dtype)
    k = torch.randint(-2, 3, (b, lk, hkv, d)).to(dtype)
    v = (torch.rand(b, lk, hkv, d) * 2 - 1).to(dtype)
    return q, k, v


def check_against_reference(q, k, v, out, lse, pattern, causal, key_lengths=None):
    """out and lse of the GPU against the fp64 reference, with the tolerances of
    tests/cuda/test_attention_gpu.cu (out_tolerance, lse_tolerance; derived there from the kernels'
    rounding in src/cuda/warp/softmax_fold.hpp). The scores are exact, and so are the selection and
    every maximum; each kept weight is within a factor 1 + e of exact, e = 3u + 2^-20 (u the 16-bit
    type's unit roundoff), and both sums run in f32 over at most Lk keys:
      |out error| <= max|v| (2 e + 2 Lk 2^-24) + 2^-23 |out| + u |out|   (the output is q's dtype),
      |lse error| <= e + Lk 2^-24 + 2^-22 (|lse| + 1)."""
    ref_out, ref_lse = reference_attention(q, k, v, pattern=pattern, causal=causal, key_lengths=key_lengths)
    u = UNIT_ROUNDOFF[q.dtype]
    e = 3 * u + 2.0**-20
    f32_sum = k.shape[1] * 2.0**-24
    vmax = v.double().abs().max().item()
    out = out.cpu().double()
    assert torch.isfinite(out).all(), "non-finite output"
    tol = vmax * (2 * e + 2 * f32_sum) + (2.0**-23 + u) * ref_out.abs()
    err = (out - ref_out).abs()
    assert (err <= tol).all(), (f"out: {(err > tol).sum().item()} elements out of tolerance, max error "
                                f"{err.max().item():.3g}, max error / tolerance {(err / tol).max().item():.2f}")
    lse = lse.cpu().double()
    empty = torch.isinf(ref_lse)
    assert (lse[empty] == -math.inf).all(), "an empty row's LSE is not -inf"
    lse_tol = e + f32_sum + 2.0**-22 * (ref_lse.abs() + 1)
    lse_err = (lse - ref_lse).abs()
    assert (lse_err[~empty] <= lse_tol[~empty]).all(), (
        f"lse: max error {lse_err[~empty].max().item():.3g}, "
        f"max error / tolerance {(lse_err[~empty] / lse_tol[~empty]).max().item():.2f}")


FORWARD_CASES = [
    # b, lq, lk, h, hkv, d, dtype, pattern, causal, key_lengths
    (1, 1, 1, 1, 1, 64, torch.bfloat16, "2:4", False, None),
    (2, 37, 91, 4, 4, 64, torch.bfloat16, "2:4", False, None),
    (2, 37, 91, 4, 2, 128, torch.float16, "2:4", True, None),
    (3, 70, 45, 8, 2, 64, torch.float16, "1:2", True, [45, 0, 13]),
    (2, 129, 200, 2, 1, 128, torch.bfloat16, "1:2", False, [199, 3]),
    (1, 300, 300, 2, 2, 64, torch.bfloat16, "2:4", True, [257]),
]


@needs_gpu
@pytest.mark.parametrize("b, lq, lk, h, hkv, d, dtype, pattern, causal, lengths", FORWARD_CASES)
def test_forward_matches_the_reference(b, lq, lk, h, hkv, d, dtype, pattern, causal, lengths):
    q, k, v = make_inputs(b, lq, lk, h, hkv, d, dtype)
    kl = None if lengths is None else torch.tensor(lengths, dtype=torch.int32 if b % 2 else torch.int64)
    out, lse = op(q.cuda(), k.cuda(), v.cuda(), pattern=pattern, causal=causal,
                  key_lengths=None if kl is None else kl.cuda())
    assert out.device == q.cuda().device and out.dtype == dtype and out.shape == q.shape
    assert lse.dtype == torch.float32 and lse.shape == (b, h, lq)
    check_against_reference(q, k, v, out, lse, pattern, causal, kl)


@needs_gpu
def test_functional_layouts_and_no_grad():
    """dfss.attention's default [B, H, L, d] layout hands the operator strided views; the result is
    the [B, L, H, d] call's, and inference under no_grad needs no backward."""
    q, k, v = make_inputs(2, 50, 77, 4, 2, 64, torch.bfloat16)
    qc, kc, vc = q.cuda(), k.cuda(), v.cuda()
    want, _ = op(qc, kc, vc, causal=True)
    with torch.no_grad():
        got = dfss.attention(qc.transpose(1, 2).contiguous(), kc.transpose(1, 2).contiguous(),
                             vc.transpose(1, 2).contiguous(), is_causal=True)
        blhd = dfss.attention(qc, kc, vc, is_causal=True, layout="blhd")
    torch.testing.assert_close(got.transpose(1, 2), want, rtol=0, atol=0)
    torch.testing.assert_close(blhd, want, rtol=0, atol=0)


@needs_gpu
def test_problems_without_work():
    q, k, v = make_inputs(2, 5, 8, 2, 2, 64, torch.float16)
    out, lse = op(q.cuda(), k[:, :0].cuda(), v[:, :0].cuda())
    assert (out == 0).all() and (lse == -math.inf).all()
    out, lse = op(q[:, :0].cuda(), k.cuda(), v.cuda())
    assert out.shape == (2, 0, 2, 64) and lse.shape == (2, 2, 0)


@needs_gpu
def test_runs_on_the_current_stream_and_in_a_cuda_graph():
    q, k, v = (t.cuda() for t in make_inputs(2, 64, 96, 4, 2, 64, torch.bfloat16))
    want, want_lse = op(q, k, v)
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        out, lse = op(q, k, v)
    torch.cuda.current_stream().wait_stream(side)
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    # A capture fails if anything of the call runs outside the capturing (current) stream.
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_out, g_lse = op(q, k, v)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(g_out, want, rtol=0, atol=0)
    torch.testing.assert_close(g_lse, want_lse, rtol=0, atol=0)


@needs_gpu
def test_backward_raises_a_clear_error():
    q, k, v = (t.cuda() for t in make_inputs(1, 16, 16, 2, 2, 64, torch.bfloat16))
    q.requires_grad_()
    out = dfss.attention(q, k, v, layout="blhd")
    with pytest.raises(NotImplementedError, match=r"dfss.attention_backward: no CUDA backward yet"):
        out.float().sum().backward()


@needs_gpu
@pytest.mark.parametrize("change, error, pattern", [
    (lambda q, k, v: (q.float(), k.float(), v.float(), {}), NotImplementedError,
     r"argument 'q': expected dtype float16 or bfloat16 for CUDA tensors, got float32"),
    (lambda q, k, v: (q.double(), k.double(), v.double(), {}), NotImplementedError,
     r"argument 'q': expected dtype float16 or bfloat16 for CUDA tensors, got float64"),
    (lambda q, k, v: (q[..., :32], k[..., :32], v[..., :32], {}), RuntimeError, r"head_dim 64 and 128, got 32"),
    (lambda q, k, v: (q, k, v, {"pattern": "2:8"}), RuntimeError, r"patterns 1:2 and 2:4, got 2:8"),
    (lambda q, k, v: (q, k, v, {"attn_bias": torch.zeros(1, 2, 8, 8, dtype=q.dtype, device=q.device)}),
     RuntimeError, r"additive bias"),
    (lambda q, k, v: (q, k, v, {"sink_tokens": 4}), RuntimeError, r"sink_tokens or recent_tokens"),
    (lambda q, k, v: (q, k, v, {"key_offset": 4}), RuntimeError, r"key_offset or query_offset"),
    (lambda q, k, v: (q, k.cpu(), v, {}), RuntimeError, r"argument 'k': expected a CUDA tensor, got a tensor on cpu"),
    (lambda q, k, v: (q, k, v, {"key_lengths": torch.tensor([8])}), RuntimeError,
     r"argument 'key_lengths': expected a CUDA tensor, got a tensor on cpu"),
])
def test_unsupported_calls_raise_clear_errors(change, error, pattern):
    q, k, v = (t.cuda() for t in make_inputs(1, 8, 8, 2, 2, 64, torch.bfloat16))
    q, k, v, kw = change(q, k, v)
    with pytest.raises(error, match=r"dfss.attention: .*" + pattern):
        op(q, k, v, **kw)


@pytest.mark.skipif(gpu_reason() is not None or torch.cuda.device_count() < 2,
                    reason=gpu_reason() or "fewer than two CUDA devices")
def test_every_tensor_on_the_device_of_q():
    q, k, v = make_inputs(1, 8, 8, 2, 2, 64, torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"argument 'k': expected a tensor on cuda:0 \(the device of 'q'\), "
                                           r"got a tensor on cuda:1"):
        op(q.cuda(0), k.cuda(1), v.cuda(0))
    out, _ = op(q.cuda(1), k.cuda(1), v.cuda(1))
    assert out.device == torch.device("cuda:1")
