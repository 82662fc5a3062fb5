"""Tickets: what a forward keeps for its backward, held by a tensor autograd saves.

A ticket is a CPU int64 ``[1]`` tensor whose memory is a ``_Ticket`` object carrying
that state as attributes (the slot lease, the gathered tokens, a saved projection);
``torch.frombuffer`` keeps the object alive exactly as long as the tensor's memory.
Saved with ``ctx.save_for_backward``, the state lives as long as a backward may need
it and no longer:

* dropped with the autograd graph, or at once by a forward without grad;
* dropped right after the forward under non-reentrant activation checkpointing,
  whose pack hook keeps no saved tensor (the recomputed forward issues its own), so a
  checkpointed layer holds no slot between its forward and its backward;
* dropped likewise under saved-tensor hooks that copy what they save (offloading, such
  as ``torch.autograd.graph.save_on_cpu``): the copy keeps the key, not the state, and
  the backward reads its own copies of the slot's views, not the slot (``state`` is then
  None).  A hook that copied the ticket but kept views of the slot itself would let a
  later call overwrite them: hooks that treat every saved tensor alike are safe;
* carried through ``torch.compile`` like any saved tensor (``session/ops.py``), where
  an autograd context's Python attributes would be frozen at trace time.
"""

from __future__ import annotations

import itertools
import weakref

import torch
from torch import Tensor

_LIVE: weakref.WeakValueDictionary[int, _Ticket] = weakref.WeakValueDictionary()
_NEXT_KEY = itertools.count(1)


class _Ticket(bytearray):
    """Eight bytes (the ticket's key) and, as attributes, the state a backward needs."""


def issue(**state) -> Tensor:
    """A new ticket holding ``state`` (keyword attributes of the object behind it)."""
    ticket = _Ticket(8)
    ticket.__dict__.update(state)
    key = next(_NEXT_KEY)
    _LIVE[key] = ticket
    tensor = torch.frombuffer(ticket, dtype=torch.int64)  # keeps ``ticket`` alive
    tensor[0] = key
    return tensor


def state(ticket: Tensor) -> _Ticket | None:
    """The state behind ``ticket``, or None once the original ticket is gone (a copy keeps
    only the key)."""
    return _LIVE.get(int(ticket[0]))


def redeem(ticket: Tensor, what: str) -> _Ticket:
    """The state behind ``ticket``; ``RuntimeError`` naming ``what`` if it is gone or empty."""
    found = state(ticket)
    if found is None or not found.__dict__:
        raise RuntimeError(f"{what}: the forward's state for this backward is gone (was the "
                           "forward run without grad?)")
    return found
