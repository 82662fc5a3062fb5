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
from cake_sp.session.slots import SlotLease, SlotRing


class NcclBandExchange:
    """Send and receive buffers of ``transfer.slot_elements(max_tokens)`` bf16 values and a
    slot ring of as many; all ordinary device memory owned here."""

    graph_capturable = False

    def __init__(self, group: dist.ProcessGroup, transfer: BandTransfer, *, max_tokens: int,
                 num_slots: int, device: torch.device, what: str) -> None:
        self.transfer, self.what = transfer, what
        self.max_tokens, self.device = max_tokens, device
        self._group = group
        elements = transfer.slot_elements(max_tokens)
        self.ring = SlotRing.local(elements, num_slots, device, what=what)
        if transfer.world_size > 1:
            self._send = torch.empty(elements, dtype=torch.bfloat16, device=device)
            self._recv = torch.empty_like(self._send)

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

    @property
    def nbytes(self) -> int:
        """Bytes of the ring and of the send and receive buffers."""
        staging = 2 * self._send.nbytes if self.transfer.world_size > 1 else 0
        return self.ring.nbytes + staging

    def check(self) -> None:
        """Nothing is reported asynchronously on this path."""

    def close(self) -> None:
        """Nothing collective to release (the buffers are ordinary device memory); drops the
        reference to the process group."""
        self._group = None
