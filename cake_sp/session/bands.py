"""Band exchanges of already computed tensors, both directions (``layouts.BandTransfer``).

The layer moves data four times (DESIGN.md section 6): the front end's scatter
by heads is fused into the producer (``nvlink.py``); the other three are a
``BandExchange`` each: the output's gather by tokens, and in the backward the
scatter by heads of ``d_o`` and the gather by tokens of ``dq, dk, dv``.  Two
implementations with one contract:

* ``NvlinkBandExchange`` (here): an ``NvlinkChannel`` written by ``band_push``,
  which stores straight into the peers' slots behind readiness words;
* ``NcclBandExchange`` (``cake_sp.fallback.bands``): pack, one asynchronous
  ``all_to_all_single``, unpack into a local slot.

The forward's exchange is the layer's own (its slots hold what autograd saves); the
backward's two are shared by every layer of one shape (``shared_band_exchange``), as
are the exchanges of calls without grad: the gather of ``dq, dk, dv`` is copied out
within its call, and the scatter of ``d_o`` is lent to the attention's backward.

A call is ``pending = ex.send(parts, batch=, seq_local=)``, then ``ex.wait(pending)``
(or ``ex.wait(pending, first_row, rows)`` for each chunk of ``ex.row_chunks(rows)``: on
NVLink the consumer's first chunk starts while later rows still arrive; on NCCL there
is one chunk), then ``ex.output(pending)``: a view of the receive slot, valid until the
ring returns to it ``num_slots`` calls later, or for as long as ``ex.lease(pending)`` is
held.  ``ex.lend(pending, remedy=)`` gives the same view on a storage of its own, for a
reader the caller does not control (a backward's gradient, read by whichever node
autograd runs next): a later call to that slot raises ``SlotInUseError`` while a view of
it is alive.  Every rank of the group makes the same calls in the same order; a call
allocates nothing and runs no host collective.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from cake_sp.kernels import _config
from cake_sp.kernels.band_push import band_push, readable_in_place
from cake_sp.layouts import BandTransfer
from cake_sp.session.channel import NvlinkChannel
from cake_sp.session.shared import check_not_capturing, hold_shared
from cake_sp.session.slots import SlotLease


@dataclass
class PendingBands:
    """One exchange call in flight: its slot and shape (and, on the NCCL path, the collective)."""

    slot: int
    batch: int
    seq_local: int
    work: object = None
    unpacked: bool = False

    @property
    def rows(self) -> int:
        return self.batch * self.seq_local


def check_parts(transfer: BandTransfer, parts: Sequence[Tensor], batch: int, seq_local: int,
                max_tokens: int, device: torch.device, what: str) -> None:
    """Raise ``ValueError`` naming the part unless ``parts`` fit ``transfer`` and the capacity."""
    if len(parts) != len(transfer.part_heads):
        raise ValueError(f"{what}: expected {len(transfer.part_heads)} parts, got {len(parts)}")
    if not 1 <= batch * seq_local <= max_tokens:
        raise ValueError(f"{what}: B * S_local = {batch * seq_local} rows; the exchange takes 1 "
                         f"to max_tokens={max_tokens}")
    for i, part in enumerate(parts):
        shape = transfer.source_shape(i, batch, seq_local)
        if (not isinstance(part, Tensor) or tuple(part.shape) != shape
                or part.dtype != torch.bfloat16 or part.device != device):
            got = (f"{part.dtype} {tuple(part.shape)} on {part.device}"
                   if isinstance(part, Tensor) else type(part).__name__)
            raise ValueError(f"{what}: part {i} must be bf16 {shape} on {device}, got {got}")


class NvlinkBandExchange:
    """One band transfer over a symmetric heap, which it owns and closes (collective).

    The slots each hold ``transfer.slot_elements(max_tokens)`` bf16 values; the
    readiness words count ``_config.BAND_PUSH_BLOCK_M``-row blocks of the call's
    ``B * S_local`` rows.
    """

    graph_capturable = True

    def __init__(self, heap, transfer: BandTransfer, *, max_tokens: int, num_slots: int,
                 device: torch.device, wait_timeout_s: float, what: str) -> None:
        self.transfer, self.what = transfer, what
        self.max_tokens, self.device = max_tokens, device
        self._heap, self._rank = heap, heap.rank
        self.block_m = _config.BAND_PUSH_BLOCK_M
        self.channel = NvlinkChannel(
            heap, slot_elements=transfer.slot_elements(max_tokens), num_slots=num_slots,
            readiness=transfer.readiness(max_tokens, self.block_m), device=device,
            wait_timeout_s=wait_timeout_s, what=what)

    # start / push / wait are separate so that in-process virtual ranks, which share one
    # stream, can run every rank's arrive before any rank's push.

    def start(self, batch: int, seq_local: int) -> PendingBands:
        return PendingBands(self.channel.start(), batch, seq_local)

    def push(self, pending: PendingBands, parts: Sequence[Tensor]) -> None:
        """Push every part; one the kernel cannot read in place (``readable_in_place``) is
        copied first."""
        table = self.channel.ring.table(pending.slot)
        for i, part in enumerate(parts):
            if not readable_in_place(part):
                part = part.contiguous()
            band_push(self.transfer, i, part, table, batch=pending.batch,
                      seq_local=pending.seq_local, source_rank=self._rank,
                      signals=self.channel.signals, block_m=self.block_m)

    def send(self, parts: Sequence[Tensor], *, batch: int, seq_local: int) -> PendingBands:
        check_parts(self.transfer, parts, batch, seq_local, self.max_tokens, self.device,
                    self.what)
        pending = self.start(batch, seq_local)
        self.push(pending, parts)
        return pending

    def wait(self, pending: PendingBands, first_row: int = 0, rows: int | None = None) -> None:
        """Acquire rows ``[first_row, first_row + rows)`` (all by default) from every source;
        ``first_row`` must be a multiple of ``block_m``."""
        rows = pending.rows - first_row if rows is None else rows
        first = first_row // self.block_m
        self.channel.wait(-(-(first_row + rows) // self.block_m) - first, first)

    def row_chunks(self, rows: int) -> list[tuple[int, int]]:
        """``(first_row, rows)`` pieces in which a consumer may take a call of ``rows`` rows, each
        after ``wait(pending, first_row, rows)`` (multiples of ``block_m``; see
        ``_config.BAND_CHUNKS``)."""
        chunks = min(_config.BAND_CHUNKS, rows // _config.BAND_CHUNK_MIN_ROWS)
        if chunks <= 1:
            return [(0, rows)]
        step = -(-rows // chunks // self.block_m) * self.block_m
        return [(first, min(step, rows - first)) for first in range(0, rows, step)]

    def output(self, pending: PendingBands) -> Tensor:
        shape = self.transfer.output_shape(pending.batch, pending.seq_local)
        return self.channel.ring.buffer(pending.slot)[: math.prod(shape)].view(shape)

    def lease(self, pending: PendingBands) -> SlotLease:
        return self.channel.ring.lease(pending.slot)

    def lend(self, pending: PendingBands, *, remedy: str) -> Tensor:
        """``output(pending)``, its slot held until no view of it is alive (``SlotRing.lend``)."""
        return self.channel.ring.lend(pending.slot, self.output(pending), remedy=remedy)

    @property
    def nbytes(self) -> int:
        """Bytes of this rank's buffers."""
        return self.channel.nbytes

    def check(self) -> None:
        self.channel.check()

    def close(self) -> None:
        self._heap.close()


def shared_band_exchange(backend: str, group: dist.ProcessGroup, transfer: BandTransfer, *,
                         max_tokens: int, device: torch.device, wait_timeout_s: float,
                         what: str):
    """A one-slot ``transfer`` exchange held in common (``session.shared``) by every caller
    with the same arguments: the layers of one shape share it for what each uses within one
    call (a backward's exchanges, a call without grad), one after another, in the same order
    on every rank.  Release it with ``release_shared``."""
    key = ("band exchange", backend, id(group), transfer, max_tokens, str(device),
           wait_timeout_s)
    return hold_shared(key, lambda: make_band_exchange(
        backend, group, transfer, max_tokens=max_tokens, num_slots=1, device=device,
        wait_timeout_s=wait_timeout_s, what=what))


def make_band_exchange(backend: str, group: dist.ProcessGroup, transfer: BandTransfer, *,
                       max_tokens: int, num_slots: int, device: torch.device,
                       wait_timeout_s: float, what: str):
    """The ``backend`` ("nvlink" or "nccl") implementation of ``transfer`` (collective)."""
    check_not_capturing(device, what)
    if backend == "nvlink":
        from cake_sp.session.heap import NvshmemHeap
        return NvlinkBandExchange(NvshmemHeap(group, device), transfer, max_tokens=max_tokens,
                                  num_slots=num_slots, device=device,
                                  wait_timeout_s=wait_timeout_s, what=what)
    from cake_sp.fallback.bands import NcclBandExchange
    return NcclBandExchange(group, transfer, max_tokens=max_tokens, num_slots=num_slots,
                            device=device, what=what)
