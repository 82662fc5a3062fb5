"""One NVLink exchange's state on one rank: symmetric receive slots and the readiness protocol.

Every exchange of the layer (the front end's scatter by heads, the output's gather
by tokens, and the backward's two mirror images) is one ``NvlinkChannel`` plus
the kernel that writes into it (the fused producer, or ``band_push``).  A call::

    slot = channel.start()   # raise an earlier failure; next slot; barrier_arrive
    <writer>(..., channel.ring.table(slot), channel.signals)
    channel.wait(row_blocks)  # acquire the words addressed to this rank (or a chunk)

The protocol and its memory-ordering argument are in :mod:`cake_sp.kernels.signals`.
Timeouts do not hang the job: the kernels record which peers never arrived in a
pinned status word that ``check`` reads at the next call or ``synchronize``.
"""

from __future__ import annotations

import torch

from cake_sp.kernels.signals import (
    STATUS_ENTER_TIMEOUT,
    STATUS_READY_TIMEOUT,
    ProducerSignals,
    barrier_arrive,
    wait_ready,
)
from cake_sp.layouts import ReadinessLayout
from cake_sp.session.slots import SlotRing


class PeerTimeoutError(RuntimeError):
    """A peer's data (or its entry into a call) did not arrive within the wait timeout."""


class NvlinkChannel:
    """Per-rank state of one exchange over a symmetric heap (``NvshmemHeap`` or an
    ``InProcessHeap`` rank view).

    Symmetric buffers (owned by ``heap``, freed by its ``close``): the slot ring
    (``num_slots`` x ``slot_elements`` bf16), the readiness words (int64,
    ``readiness``) and the entry words (int64 ``[W]``).  Local: the epoch (int64
    ``[1]`` on the device, bumped by every call's first kernel, so CUDA-graph
    replays and eager calls interleave) and the status flags (int64 ``[1 + W]``,
    pinned host memory on a GPU so the host reads them without a sync).

    Construction is collective (allocations and one barrier).
    """

    def __init__(self, heap, *, slot_elements: int, num_slots: int, readiness: ReadinessLayout,
                 device: torch.device, wait_timeout_s: float, what: str) -> None:
        world, rank = heap.world_size, heap.rank
        self.rank, self.what = rank, what
        self._timeout_ns = int(wait_timeout_s * 1e9)
        slots = heap.alloc(num_slots * slot_elements, torch.bfloat16)
        slot_bytes = slot_elements * slots.local.element_size()
        tables = torch.stack([slots.table + s * slot_bytes for s in range(num_slots)])
        buffers = [slots.local[s * slot_elements:(s + 1) * slot_elements]
                   for s in range(num_slots)]
        self.ring = SlotRing(buffers, tables, what=what)
        self.readiness = readiness
        self._words = heap.alloc(readiness.words, torch.int64)
        self._enter = heap.alloc(world, torch.int64)
        # Words only grow from 0; every rank zeroes its own before any peer may write.
        self._words.local.zero_()
        self._enter.local.zero_()
        heap.barrier()
        self.epoch = torch.zeros(1, dtype=torch.int64, device=device)
        self._status = torch.zeros(1 + world, dtype=torch.int64,
                                   pin_memory=device.type == "cuda")
        self.signals = ProducerSignals(
            epoch=self.epoch, enter=self._enter.local, word_table=self._words.table,
            source_rank=rank, readiness=readiness, status=self._status,
            timeout_ns=self._timeout_ns)

    @property
    def nbytes(self) -> int:
        """Bytes of this rank's symmetric buffers (slots, readiness and entry words)."""
        return self.ring.nbytes + self._words.local.nbytes + self._enter.local.nbytes

    def start(self) -> int:
        """Raise if an earlier call failed; take the next slot; announce the call to peers."""
        self.check()
        slot = self.ring.advance()
        barrier_arrive(self.epoch, self._enter.table, source_rank=self.rank)
        return slot

    def wait(self, row_blocks: int, first_row_block: int = 0) -> None:
        """Acquire every source's words for row blocks ``[first, first + row_blocks)``."""
        wait_ready(self.epoch, self._words.local, self._status, readiness=self.readiness,
                   row_blocks=row_blocks, first_row_block=first_row_block,
                   timeout_ns=self._timeout_ns)

    def check(self) -> None:
        """Raise ``PeerTimeoutError`` naming the peers a wait gave up on (reads pinned memory;
        does not wait)."""
        flags = self._status.tolist()
        if not flags[0]:
            return
        late = [p for p, f in enumerate(flags[1:]) if f & STATUS_READY_TIMEOUT]
        absent = [p for p, f in enumerate(flags[1:]) if f & STATUS_ENTER_TIMEOUT]
        parts = []
        if late:
            parts.append(f"data from rank(s) {late} never arrived")
        if absent:
            parts.append(f"rank(s) {absent} never entered the call, so nothing was sent to them")
        raise PeerTimeoutError(
            f"rank {self.rank} ({self.what}): {'; '.join(parts)} within "
            f"{self._timeout_ns / 1e9:g} s. The outputs of that call are invalid; every rank "
            "must make the same calls in the same order. The session cannot continue; close it.")
