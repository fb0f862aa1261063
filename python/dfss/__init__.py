"""dfss: dynamic N:M fine-grained structured sparse attention (DFSS, Chen et al., PPoPP 2023).

    import dfss
    out = dfss.attention(q, k, v, pattern="2:4")   # like F.scaled_dot_product_attention
    out.sum().backward()

* ``dfss.attention``: mirrors ``torch.nn.functional.scaled_dot_product_attention``.
* ``torch.ops.dfss.attention``: the registered operator, [B, L, H, d] layout, returns (out, lse).
  CPU tensors: every float dtype, forward and backward. CUDA tensors: the forward only, float16 and
  bfloat16 (README.md, "PyTorch"), in builds with the CUDA kernels (``dfss._build_info.cuda``;
  ``dfss._build_info.cuda_reason`` says why or why not).
* ``dfss.nn.DFSSAttention``: a multi-head attention module.
* ``dfss.patch_attention(model)``: swaps the self-attention of BERT-style encoders for DFSS.
* ``dfss.merge_attention_states``: the exact merge of results over key shards (split-K, context
  parallelism).
* ``dfss.distributed.context_parallel_attention``: DFSS over key/value shards held by the ranks of a
  torch.distributed group, merged exactly (imported on use).
* ``dfss.transformers.register()``: DFSS as a transformers ``attn_implementation`` (decoder LMs,
  KV-cache generation); imports transformers only when called.
"""
import importlib.machinery
import os

import torch


def _load_operator_library():
    here = os.path.dirname(os.path.abspath(__file__))
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = os.path.join(here, "_ops" + suffix)
        if os.path.exists(path):
            break
    else:
        raise ImportError(
            f"dfss: the operator library (_ops*.so) is missing from {here}; install the package with "
            "'pip install --no-build-isolation <dfss repository>' instead of importing the source tree")
    try:
        torch.ops.load_library(path)
    except OSError as exc:
        from . import _build_info
        raise ImportError(
            f"dfss: cannot load {path} ({exc}); it was built against torch {_build_info.torch_version} "
            f"and this is torch {torch.__version__}: reinstall dfss with this torch") from exc


_load_operator_library()

from .functional import attention  # noqa: E402
from . import nn  # noqa: E402
from .patch import patch_attention, PatchHandle  # noqa: E402
from .merge import merge_attention_states  # noqa: E402
from . import transformers  # noqa: E402  (does not import the transformers package)

__version__ = "0.1.0"
__all__ = ["attention", "nn", "patch_attention", "PatchHandle", "merge_attention_states", "transformers"]
