"""The receive-slot ring and the validated inputs of one call, shared by both backends."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from cake_sp.session.plan import DestLayout, HeadPlan


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


class SlotRing:
    """``num_slots`` receive buffers, each ``W * max_tokens`` tokens of this rank's head bands.

    A call takes the next slot; the views it returns stay valid until the ring
    comes back to that slot ``num_slots`` calls later.  ``tables[s]`` holds, for
    every destination rank, the byte address of that rank's slot ``s`` (only this
    rank's own address when the slots are local memory).

    The ring owns ``buffers`` only when built by ``local``; otherwise the
    symmetric heap that allocated them does.
    """

    def __init__(self, plan: HeadPlan, *, layout: str, max_tokens: int,
                 buffers: Sequence[Tensor], tables: Tensor) -> None:
        self._plan, self._layout = plan, layout
        self._capacity = max_tokens * plan.world_size
        self._buffers = list(buffers)
        self._tables = tables
        self._next = 0

    @classmethod
    def local(cls, plan: HeadPlan, *, layout: str, max_tokens: int, num_slots: int,
              device: torch.device) -> SlotRing:
        """A ring in ordinary device memory (the NCCL path)."""
        elements = DestLayout.buffer_elements(plan, max_tokens * plan.world_size)
        buffers = [torch.empty(elements, dtype=torch.bfloat16, device=device)
                   for _ in range(num_slots)]
        tables = torch.tensor([[b.data_ptr()] for b in buffers], dtype=torch.int64,
                              device=device)
        return cls(plan, layout=layout, max_tokens=max_tokens, buffers=buffers, tables=tables)

    @property
    def num_slots(self) -> int:
        return len(self._buffers)

    def advance(self) -> int:
        """The slot this call writes; moves the ring on."""
        slot = self._next
        self._next = (slot + 1) % len(self._buffers)
        return slot

    def layout(self, seq_len: int) -> DestLayout:
        return DestLayout.for_layout(self._plan, self._layout, token_capacity=self._capacity,
                                     seq_len=seq_len)

    def table(self, slot: int) -> Tensor:
        return self._tables[slot]

    def views(self, slot: int, batch: int, seq_len: int) -> list[Tensor]:
        return self.layout(seq_len).region_views(self._buffers[slot], batch)


def deliver(views: list[Tensor], out: list[Tensor] | None) -> list[Tensor]:
    """``views`` themselves, or copied into the caller-owned ``out`` tensors."""
    if out is None:
        return views
    for dst, src in zip(out, views):
        dst.copy_(src)
    return out
