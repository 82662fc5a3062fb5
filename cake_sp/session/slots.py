"""Receive-slot rings (with leases for autograd) and one call's validated inputs (both backends)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.multiprocessing.reductions import StorageWeakRef

from cake_sp.layouts import DestLayout, HeadPlan


@dataclass(frozen=True)
class CallInputs:
    """One call's inputs after validation, flattened to what the producer kernel takes.

    x2d: bf16 ``[rows, hidden]`` (``rows = batch * seq_local``, a view of ``x``);
    positions: ``[rows]`` view of the caller's ``[B, S_local]`` positions, or None.
    """

    x2d: Tensor
    batch: int
    seq_local: int
    world_size: int
    qkv_weight: Tensor
    qkv_bias: Tensor | None
    q_norm_weight: Tensor | None
    k_norm_weight: Tensor | None
    rope_cos_sin: Tensor
    positions: Tensor | None

    @property
    def rows(self) -> int:
        return self.batch * self.seq_local

    @property
    def seq_global(self) -> int:
        return self.seq_local * self.world_size


class SlotInUseError(RuntimeError):
    """A call needs the next receive slot, but autograd still holds what that slot contains."""


class SlotRing:
    """``num_slots`` flat bf16 receive buffers used in turn, and the leases that pin them.

    A call takes the next slot; what it returns stays valid until the ring comes
    back to that slot ``num_slots`` calls later.  ``tables[s]`` holds, for every
    destination rank, the byte address of that rank's slot ``s`` (only this rank's
    own address when the slots are local memory).  Every rank of a group makes the
    same calls, so every rank takes the same slot: a writer addresses its peers'
    slot ``s`` through its own ``tables[s]``.

    A slot under a :class:`SlotLease` (a forward whose outputs autograd saved for
    its backward) is never handed out again while the lease lasts, nor a slot
    whose contents were lent (``lend``: a backward's result, whose reader autograd
    picks) while a view of them is alive: ``advance`` raises :class:`SlotInUseError`
    instead, before the call sends anything, on every rank alike.

    The ring owns ``buffers`` only when built by ``local``; otherwise the
    symmetric heap that allocated them does.
    """

    def __init__(self, buffers: Sequence[Tensor], tables: Tensor, *, what: str) -> None:
        self._buffers = list(buffers)
        self._tables = tables
        self._what = what
        self._leases = [0] * len(self._buffers)
        self._lent: list[tuple[StorageWeakRef, str] | None] = [None] * len(self._buffers)
        self._next = 0

    @classmethod
    def local(cls, elements: int, num_slots: int, device: torch.device, *, what: str) -> SlotRing:
        """A ring of ``num_slots`` buffers of ``elements`` bf16 values in ordinary device memory."""
        buffers = [torch.empty(elements, dtype=torch.bfloat16, device=device)
                   for _ in range(num_slots)]
        tables = torch.tensor([[b.data_ptr()] for b in buffers], dtype=torch.int64,
                              device=device)
        return cls(buffers, tables, what=what)

    @property
    def num_slots(self) -> int:
        return len(self._buffers)

    def advance(self) -> int:
        """The slot this call writes; moves the ring on.  Raises ``SlotInUseError`` if that
        slot is leased, or lent and a view of what was lent is alive."""
        slot = self._next
        if self._leases[slot]:
            held = sum(1 for n in self._leases if n)
            raise SlotInUseError(
                f"{self._what}: every receive slot this call could use holds tensors that a "
                f"pending backward still needs ({held} of num_slots={self.num_slots} are "
                "leased). Run the backward of earlier forwards first, or build the layer with "
                f"num_slots >= (forwards in flight) + 1; nothing was sent or overwritten.")
        lent = self._lent[slot]
        if lent is not None and not lent[0].expired():
            raise SlotInUseError(
                f"{self._what}: the receive slot this call writes still holds an earlier "
                "call's result, and a tensor viewing it is alive (not yet read by its "
                f"consumer); nothing was sent or overwritten. {lent[1]}")
        self._lent[slot] = None
        self._next = (slot + 1) % len(self._buffers)
        return slot

    def lend(self, slot: int, view: Tensor, *, remedy: str) -> Tensor:
        """``view`` (of ``slot``'s buffer) as a tensor of the same memory on a storage of its
        own: ``advance`` will not hand ``slot`` out again while any view of that storage is
        alive, and raises saying ``remedy`` instead.  For a result the caller hands to a
        reader it does not control (a backward's gradient, read by whichever node autograd
        runs next), where a lease would have no one to release it."""
        lent = torch.from_dlpack(view)  # a new storage over the same bytes
        self._lent[slot] = (StorageWeakRef(lent.untyped_storage()), remedy)
        return lent

    def lease(self, slot: int) -> SlotLease:
        """Pin ``slot`` until the returned lease is released (or garbage collected)."""
        return SlotLease(self, slot)

    def buffer(self, slot: int) -> Tensor:
        return self._buffers[slot]

    @property
    def nbytes(self) -> int:
        """Bytes of the ring's buffers."""
        return sum(b.nbytes for b in self._buffers)

    def table(self, slot: int) -> Tensor:
        return self._tables[slot]


class SlotLease:
    """Keeps one slot of a ring from reuse while autograd may still read it.

    Held by a ticket an autograd context saved (``session/tickets.py``); released by its
    backward or, if the graph is dropped without one, when the ticket is freed.
    ``release`` is idempotent.
    """

    def __init__(self, ring: SlotRing, slot: int) -> None:
        self._ring, self._slot = ring, slot
        ring._leases[slot] += 1

    def release(self) -> None:
        if self._ring is not None:
            self._ring._leases[self._slot] -= 1
            self._ring = None

    def __del__(self) -> None:
        self.release()


def front_end_layout(plan: HeadPlan, layout: str, max_tokens: int, seq_len: int) -> DestLayout:
    """Where the front end's q/k/v land in a slot of ``W * max_tokens`` tokens."""
    return DestLayout.for_layout(plan, layout, token_capacity=max_tokens * plan.world_size,
                                 seq_len=seq_len)


def deliver(views: list[Tensor], out: list[Tensor] | None) -> list[Tensor]:
    """``views`` themselves, or copied into the caller-owned ``out`` tensors."""
    if out is None:
        return views
    for dst, src in zip(out, views):
        dst.copy_(src)
    return out
