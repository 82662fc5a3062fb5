"""The attention core of the layer: each rank's head band over the whole sequence.

``q [B, S, Hq_local, D]``, ``k, v [B, S, Hkv_local, D]`` bf16 (views of the
front end's receive slot, tokens in global order: source rank, then position)
-> ``o [B, S, Hq_local, D]``.  GQA (``Hq_local`` a multiple of ``Hkv_local``) is
passed to the backend as is, never by materialising repeated K/V.  Backends:

* ``"sdpa"``: ``torch.nn.functional.scaled_dot_product_attention`` with
  ``enable_gqa`` (PyTorch picks flash, cuDNN, memory-efficient or math);
* ``"flash"``: ``flash_attn.flash_attn_func`` (the flash-attn package, CUDA only);
* ``"auto"``: flash-attn where it is installed and the device is a CUDA GPU of
  compute capability 8.0 or newer, else SDPA.

Both are differentiable through their own autograd.
"""

from __future__ import annotations

import functools
import importlib.util

import torch
import torch.nn.functional as F
from torch import Tensor

ATTENTION_BACKENDS = ("auto", "sdpa", "flash")


@functools.cache
def _flash_problem(device_type: str, capability: tuple[int, int] | None) -> str | None:
    """Why flash-attn cannot serve here, or None."""
    if device_type != "cuda":
        return "flash-attn runs on CUDA GPUs only"
    if capability is not None and capability < (8, 0):
        return f"flash-attn needs compute capability 8.0+, the GPU has {capability}"
    if importlib.util.find_spec("flash_attn") is None:
        return "the flash-attn package is not installed (pip install flash-attn)"
    return None


def resolve_attention_backend(requested: str, device: torch.device) -> tuple[str, str]:
    """``(backend, reason)`` for ``requested`` on ``device``; ``ValueError`` for an unknown name
    and ``ImportError`` for ``"flash"`` where it cannot run."""
    if requested not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, "
                         f"got {requested!r}")
    capability = (torch.cuda.get_device_capability(device)
                  if device.type == "cuda" else None)
    problem = _flash_problem(device.type, capability)
    if requested == "flash":
        if problem is not None:
            raise ImportError(f"attention_backend='flash': {problem}")
        return "flash", "requested"
    if requested == "sdpa":
        return "sdpa", "requested"
    if problem is None:
        return "flash", "auto: flash-attn is installed"
    return "sdpa", f"auto: {problem}"


def attention(q: Tensor, k: Tensor, v: Tensor, *, causal: bool, softmax_scale: float | None,
              backend: str) -> Tensor:
    """``o [B, S, Hq, D]`` from ``q [B, S, Hq, D]``, ``k, v [B, S, Hkv, D]`` (a resolved
    ``backend``)."""
    if backend == "flash":
        from flash_attn import flash_attn_func
        return flash_attn_func(q, k, v, softmax_scale=softmax_scale, causal=causal)
    o = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal,
        scale=softmax_scale, enable_gqa=q.shape[2] != k.shape[2])
    return o.transpose(1, 2)
