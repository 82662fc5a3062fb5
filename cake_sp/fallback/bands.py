"""The NCCL path of a band exchange (``cake_sp.session.bands``): the same contract.

Equivalent pseudo-code, per rank, for every part of a ``BandTransfer``::

    send[d] = part[block for destination d]        # pack: one strided copy per part
    recv = all_to_all_single(send)                 # ONE collective, asynchronous
    out[..., from source r] = recv[r]              # unpack into the receive slot (at wait)

The collective runs on the group backend's own stream (NCCL) or thread (gloo),
so the caller's work between ``send`` and ``wait`` overlaps it.  Bytes travel as
uint8, since gloo has no bf16 all-to-all.  With one rank, ``send`` packs straight
into the slot and no collective runs.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from cake_sp.layouts import GATHER_TOKENS, BandTransfer
from cake_sp.session.bands import PendingBands, check_parts
from cake_sp.session.shared import hold_shared, release_shared
from cake_sp.session.slots import SlotLease, SlotRing


def hold_staging(group: dist.ProcessGroup, device: torch.device, elements: int
                 ) -> tuple[Tensor, Tensor]:
    """A send and a receive buffer of ``elements`` bf16 values, held in common by every NCCL
    exchange of that size on ``group`` (release with ``release_shared``): an exchange uses
    them between a call's pack and its unpack only, and a rank has one exchange in flight
    at a time (each exchange step sends and waits within one call)."""
    return hold_shared(("nccl staging", id(group), str(device), elements),
                       lambda: tuple(torch.empty(elements, dtype=torch.bfloat16, device=device)
                                     for _ in ("send", "recv")))


class NcclBandExchange:
    """A slot ring of ``transfer.slot_elements(max_tokens)`` bf16 values, owned here, and send
    and receive buffers of as many (``hold_staging``); all ordinary device memory."""

    graph_capturable = False

    def __init__(self, group: dist.ProcessGroup, transfer: BandTransfer, *, max_tokens: int,
                 num_slots: int, device: torch.device, what: str) -> None:
        self.transfer, self.what = transfer, what
        self.max_tokens, self.device = max_tokens, device
        self._group = group
        elements = transfer.slot_elements(max_tokens)
        self.ring = SlotRing.local(elements, num_slots, device, what=what)
        self._staging = None
        if transfer.world_size > 1:
            self._staging = hold_staging(group, device, elements)
            self._send, self._recv = self._staging

    def _blocks(self, buffer: Tensor, batch: int, seq_local: int) -> Tensor:
        """``buffer`` as ``[W, B, S_local, heads, D]``: the block for (or from) each rank."""
        t = self.transfer
        shape = (t.world_size, batch, seq_local, t.heads, t.head_dim)
        return buffer[: t.slot_elements(batch * seq_local)].view(shape)

    def send(self, parts: Sequence[Tensor], *, batch: int, seq_local: int) -> PendingBands:
        t = self.transfer
        check_parts(t, parts, batch, seq_local, self.max_tokens, self.device, self.what)
        slot = self.ring.advance()
        world = t.world_size
        send = self.ring.buffer(slot) if world == 1 else self._send
        blocks = self._blocks(send, batch, seq_local)
        for i, part in enumerate(parts):
            h, offset = t.part_heads[i], t.part_offset(i)
            if t.direction == GATHER_TOKENS:  # [B, W * S_local, h, D]: tokens of rank d
                source = part.unflatten(1, (world, seq_local)).permute(1, 0, 2, 3, 4)
            else:                             # [B, S_local, W * h, D]: heads of rank d
                source = part.unflatten(2, (world, h)).permute(2, 0, 1, 3, 4)
            blocks[..., offset:offset + h, :].copy_(source)
        pending = PendingBands(slot, batch, seq_local, unpacked=world == 1)
        if world > 1:
            n = t.slot_elements(batch * seq_local)
            pending.work = dist.all_to_all_single(self._recv[:n].view(torch.uint8),
                                                  send[:n].view(torch.uint8), group=self._group,
                                                  async_op=True)
        return pending

    def wait(self, pending: PendingBands, first_row: int = 0, rows: int | None = None) -> None:
        """Wait for the collective and unpack (all rows at once, whatever chunk is asked for)."""
        if pending.unpacked:
            return
        pending.work.wait()
        # Drop the collective's handle now rather than whenever ``pending`` goes: gloo work
        # objects (and the tensors they hold) torn down during interpreter exit can abort
        # the process (the cause described in pytorch/pytorch pull request 179291).
        pending.work = None
        received = self._blocks(self._recv, pending.batch, pending.seq_local)
        out = self.output(pending)
        if self.transfer.direction == GATHER_TOKENS:  # out [B, S_local, W, heads, D]
            out.copy_(received.permute(1, 2, 0, 3, 4))
        else:                                         # out [B, W * S_local, h, D]
            out.unflatten(1, (self.transfer.world_size, pending.seq_local)).copy_(
                received.permute(1, 0, 2, 3, 4))
        pending.unpacked = True

    def row_chunks(self, rows: int) -> list[tuple[int, int]]:
        """One chunk: the collective delivers every row at once."""
        return [(0, rows)]

    def output(self, pending: PendingBands) -> Tensor:
        shape = self.transfer.output_shape(pending.batch, pending.seq_local)
        n = self.transfer.slot_elements(pending.rows)
        return self.ring.buffer(pending.slot)[:n].view(shape)

    def lease(self, pending: PendingBands) -> SlotLease:
        return self.ring.lease(pending.slot)

    def lend(self, pending: PendingBands, *, remedy: str) -> Tensor:
        """``output(pending)``, its slot held until no view of it is alive (``SlotRing.lend``)."""
        return self.ring.lend(pending.slot, self.output(pending), remedy=remedy)

    @property
    def nbytes(self) -> int:
        """Bytes of the ring and of the send and receive buffers (counted in each holder)."""
        staging = 2 * self._send.nbytes if self._staging is not None else 0
        return self.ring.nbytes + staging

    def check(self) -> None:
        """Nothing is reported asynchronously on this path."""

    def close(self) -> None:
        """Drop the hold on the staging buffers and the reference to the process group
        (nothing collective: the buffers are ordinary device memory)."""
        if self._staging is not None:
            release_shared(self._staging)
        self._staging = self._group = None
