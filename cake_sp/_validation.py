"""Checks of tensor arguments shared by the public calls; errors name the argument."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch


def describe(t: torch.Tensor) -> str:
    """``shape (...), dtype ..., device ..., strides (...)``: how an error message quotes a
    tensor."""
    return (f"shape {tuple(t.shape)}, dtype {t.dtype}, device {t.device}, "
            f"strides {tuple(t.stride())}")


def check_tensor(name: str, value: object, *, dtypes: Sequence[torch.dtype] | None = None,
                 device: torch.device | None = None, ndim: int | None = None,
                 shape: Sequence[int] | None = None, contiguous: bool = False,
                 unit_last_stride: bool = False, optional: bool = False,
                 prefix: str = "") -> None:
    """Raise unless ``value`` is a tensor as described; a check given None is skipped.

    In this order: ``value`` must be a ``torch.Tensor`` (None passes if ``optional``)
    with a dtype in ``dtypes``, else TypeError; then it must be on ``device``, have
    ``ndim`` dims and exactly ``shape``, be contiguous if ``contiguous``, and have a
    unit stride in its last dim if ``unit_last_stride``, else ValueError.  The message
    starts ``f"{prefix}{name}"`` and states the expected value.
    """
    if value is None and optional:
        return
    arg = f"{prefix}{name}"
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{arg} must be a torch.Tensor, got {type(value).__name__}")
    if dtypes is not None and value.dtype not in dtypes:
        raise TypeError(f"{arg} must have dtype in {[str(d) for d in dtypes]}, "
                        f"got {describe(value)}")
    if device is not None and value.device != device:
        raise ValueError(f"{arg} must be on {device}, got {describe(value)}")
    if ndim is not None and value.dim() != ndim:
        raise ValueError(f"{arg} must be {ndim}-D, got {describe(value)}")
    if shape is not None and tuple(value.shape) != tuple(shape):
        raise ValueError(f"{arg} must have shape {tuple(shape)}, got {describe(value)}")
    if contiguous and not value.is_contiguous():
        raise ValueError(f"{arg} must be contiguous (call .contiguous()), got strides "
                         f"{value.stride()}")
    if unit_last_stride and value.numel() > 0 and value.shape[-1] > 1 and value.stride(-1) != 1:
        raise ValueError(f"{arg} must have a unit stride in its last dim, got {describe(value)}")


def check_positive_number(name: str, value: object) -> None:
    """Raise ``ValueError`` naming ``name`` unless ``value`` is None or a positive finite
    number (``softmax_scale``, ``softcap``)."""
    if value is not None and not (isinstance(value, (int, float))
                                  and not isinstance(value, bool) and math.isfinite(value)
                                  and value > 0):
        raise ValueError(f"{name} must be a positive finite number or None, got {value!r}")


def check_sliding_window(window: object, causal: object) -> None:
    """``sliding_window``: None, or a positive int with ``causal=True`` (a query's last
    ``window`` keys, itself among them)."""
    if window is None:
        return
    check_positive_int("sliding_window", window)
    if causal is not True:
        raise ValueError(f"sliding_window={window} needs causal=True (a query's last keys)")


def check_positive_int(name: str, value: object) -> None:
    """``TypeError`` unless ``value`` is an int (not a bool), ``ValueError`` unless it is
    >= 1; both name ``name``."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
