"""Buffers held in common: one object per key, built by its first holder, closed by its last.

The layers of a model share what each uses only within one call (the backward's exchanges,
the exchanges of calls without grad, the NCCL path's staging buffers): every rank builds,
holds and releases them in the same order (the same model code), so a build or a close that
is collective (symmetric memory on the NVLink path) happens on every rank alike.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import TypeVar

import torch

T = TypeVar("T")

# key -> [object, number of holders]
_HELD: dict[Hashable, list] = {}


def hold_shared(key: Hashable, build: Callable[[], T]) -> T:
    """The object held under ``key``, built by ``build()`` (collective where it allocates
    symmetric memory) if nobody holds one yet; each call is one hold."""
    entry = _HELD.get(key)
    if entry is None:
        entry = _HELD[key] = [build(), 0]
    entry[1] += 1
    return entry[0]


def release_shared(obj: object) -> None:
    """Drop one hold on ``obj``; the last one forgets it and calls its ``close()``, if it has
    one (collective on the NVLink path, as every rank releases in the same order)."""
    for key, entry in _HELD.items():
        if entry[0] is obj:
            entry[1] -= 1
            if entry[1] == 0:
                del _HELD[key]
                close = getattr(obj, "close", None)
                if close is not None:
                    close()
            return
    raise ValueError(f"release_shared: {obj!r} is not held in common")


def check_not_capturing(device: torch.device, what: str) -> None:
    """Raise ``RuntimeError`` instead of building ``what`` (allocation, and on the NVLink path a
    collective) inside a CUDA graph capture.  Exchanges are built by the first call that needs
    them, so a captured call needs one eager call of its kind (with or without grad) first;
    every rank captures alike, so every rank raises."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(f"cake_sp: the {what} is built by the first call that needs it, "
                           "and this call is being captured in a CUDA graph: make one call of "
                           "the same kind (with or without grad) before capturing")
