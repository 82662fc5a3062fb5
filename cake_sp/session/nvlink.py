"""The NVLink path: symmetric receive slots, epochs, and the barrier -> producer -> wait sequence.

One call on rank ``r`` (all on the caller's stream, no host collective, no allocation)::

    barrier_arrive(epoch, enter_table)   # epoch += 1 on the device; tell every peer
    producer(x, W, ..., slot tables)     # GEMM + norm + RoPE; epilogue waits for the
                                         # destination's entry word, stores the head band
                                         # into its slot, release-stores a readiness word
    wait_ready(epoch, words)             # acquire every word addressed to r this call
    return views of slot s               # s = the ring's host-side slot counter

The epoch lives on the device so CUDA-graph replays and eager calls interleave;
the slot index is chosen on the host, so a captured call always reuses the slot
it was captured with (docs/guide.md says what that means for outputs).
Timeouts do not hang the job: the kernels record which peers never arrived in a
pinned status word that ``check`` reads on the next call or ``synchronize``
(positions outside the RoPE table are reported the same way, ``positions.py``).
"""

from __future__ import annotations

import torch

from cake_sp.kernels import _config
from cake_sp.kernels.producer import qkv_norm_rope_produce
from cake_sp.kernels.signals import (
    STATUS_ENTER_TIMEOUT,
    STATUS_READY_TIMEOUT,
    ProducerSignals,
    barrier_arrive,
    wait_ready,
)
from cake_sp.session.plan import DestLayout, HeadPlan, ReadinessLayout
from cake_sp.session.positions import BadPositionsCounter
from cake_sp.session.slots import CallInputs, SlotRing, deliver


class PeerTimeoutError(RuntimeError):
    """A peer's data (or its entry into a call) did not arrive within the wait timeout."""


class NvlinkExchange:
    """Per-rank state of the NVLink path over a symmetric heap (``NvshmemHeap`` or an
    ``InProcessHeap`` rank view).

    Symmetric buffers (owned by ``heap``): the slot ring (``num_slots`` x
    ``W * max_tokens`` tokens of this rank's head bands, bf16), the readiness
    words (int64, ``ReadinessLayout``) and the entry words (int64 ``[W]``).
    Local: the epoch (int64 ``[1]`` on the device) and the status flags (int64
    ``[1 + W]``, pinned host memory on a GPU so the host reads them without a sync).
    """

    graph_capturable = True

    def __init__(self, heap, plan: HeadPlan, *, layout: str, max_tokens: int, num_slots: int,
                 device: torch.device, eps: float, rope_style: int,
                 wait_timeout_s: float) -> None:
        world, rank = heap.world_size, heap.rank
        self._heap, self._plan, self._rank = heap, plan, rank
        self._eps, self._rope_style = eps, rope_style
        self._block_m = _config.producer_block_m(plan.head_dim)
        self._timeout_ns = int(wait_timeout_s * 1e9)
        slot_elements = DestLayout.buffer_elements(plan, max_tokens * world)
        slots = heap.alloc(num_slots * slot_elements, torch.bfloat16)
        slot_bytes = slot_elements * slots.local.element_size()
        tables = torch.stack([slots.table + s * slot_bytes for s in range(num_slots)])
        buffers = [slots.local[s * slot_elements:(s + 1) * slot_elements]
                   for s in range(num_slots)]
        self.slots = SlotRing(plan, layout=layout, max_tokens=max_tokens, buffers=buffers,
                              tables=tables)
        self._readiness = ReadinessLayout.for_plan(plan, max_tokens, self._block_m)
        self._words = heap.alloc(self._readiness.words, torch.int64)
        self._enter = heap.alloc(world, torch.int64)
        # Words only grow from 0; every rank zeroes its own before any peer may write.
        self._words.local.zero_()
        self._enter.local.zero_()
        heap.barrier()
        self._epoch = torch.zeros(1, dtype=torch.int64, device=device)
        self._status = torch.zeros(1 + world, dtype=torch.int64,
                                   pin_memory=device.type == "cuda")
        self._bad_positions = BadPositionsCounter(device)
        self._signals = ProducerSignals(
            epoch=self._epoch, enter=self._enter.local, word_table=self._words.table,
            source_rank=rank, readiness=self._readiness, status=self._status,
            timeout_ns=self._timeout_ns)

    # The three phases are separate so that in-process virtual ranks, which share
    # one stream, can run every rank's arrive before any rank's producer.

    def start(self) -> int:
        """Raise if an earlier call failed; take the next slot; announce the call to peers."""
        self.check()
        slot = self.slots.advance()
        barrier_arrive(self._epoch, self._enter.table, source_rank=self._rank)
        return slot

    def produce(self, call: CallInputs, slot: int) -> None:
        """Project, normalise and rotate; store every head band into its destination's slot."""
        qkv_norm_rope_produce(
            call.x2d, call.qkv_weight, call.qkv_bias, call.q_norm_weight, call.k_norm_weight,
            call.rope_cos_sin, call.positions, plan=self._plan,
            dest=self.slots.layout(call.seq_global), dest_table=self.slots.table(slot),
            seq_local=call.seq_local, dest_seq_offset=self._rank * call.seq_local,
            eps=self._eps, rope_style=self._rope_style, signals=self._signals,
            bad_positions=self._bad_positions.count, block_m=self._block_m, validate=False)

    def finish(self, call: CallInputs, slot: int, out: list[torch.Tensor] | None
               ) -> list[torch.Tensor]:
        """Acquire this call's readiness words; return the slot's views (or copy into ``out``)."""
        wait_ready(self._epoch, self._words.local, self._status, readiness=self._readiness,
                   row_blocks=-(-call.rows // self._block_m), timeout_ns=self._timeout_ns)
        return deliver(self.slots.views(slot, call.batch, call.seq_global), out)

    def run(self, call: CallInputs, out: list[torch.Tensor] | None) -> list[torch.Tensor]:
        slot = self.start()
        self.produce(call, slot)
        return self.finish(call, slot, out)

    def check(self) -> None:
        """Raise ``PeerTimeoutError`` naming the peers a wait gave up on, or ``ValueError`` for
        positions outside the RoPE table (reads pinned memory; does not wait)."""
        flags = self._status.tolist()
        if not flags[0]:
            self._bad_positions.check()
            return
        late = [p for p, f in enumerate(flags[1:]) if f & STATUS_READY_TIMEOUT]
        absent = [p for p, f in enumerate(flags[1:]) if f & STATUS_ENTER_TIMEOUT]
        parts = []
        if late:
            parts.append(f"data from rank(s) {late} never arrived")
        if absent:
            parts.append(f"rank(s) {absent} never entered the call, so nothing was sent to them")
        raise PeerTimeoutError(
            f"rank {self._rank}: {'; '.join(parts)} within {self._timeout_ns / 1e9:g} s. "
            "The outputs of that call are invalid; every rank must make the same calls in "
            "the same order. The session cannot continue; close it.")

    def close(self) -> None:
        """Collective: free the symmetric buffers."""
        self._heap.close()
