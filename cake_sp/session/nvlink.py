"""The NVLink path of the front end: the producer writing into an ``NvlinkChannel``.

One call on rank ``r`` (all on the caller's stream, no host collective, no allocation)::

    barrier_arrive(epoch, enter_table)   # epoch += 1 on the device; tell every peer
    produce(x, W, ..., slot tables)      # GEMM + norm + RoPE; epilogue waits for the
                                         # destination's entry word, stores the head band
                                         # into its slot, release-stores a readiness word
    wait_ready(epoch, words)             # acquire every word addressed to r this call
    return views of slot s               # s = the ring's host-side slot counter

The slot index is chosen on the host, so a captured call always reuses the slot
it was captured with (docs/guide.md says what that means for outputs).
Positions outside the RoPE table are reported like timeouts, without a sync
(``positions.py``).
"""

from __future__ import annotations

import torch

from cake_sp.kernels import _config
from cake_sp.layouts import DestLayout, HeadPlan, ReadinessLayout
from cake_sp.session.channel import NvlinkChannel, PeerTimeoutError
from cake_sp.session.positions import BadPositionsCounter
from cake_sp.session.producer import Producer
from cake_sp.session.slots import CallInputs, deliver, front_end_layout

__all__ = ["NvlinkExchange", "PeerTimeoutError"]


class NvlinkExchange:
    """Per-rank state of the front end's NVLink path over a symmetric heap (``NvshmemHeap``
    or an ``InProcessHeap`` rank view), which it owns and closes.

    Its channel's slots each hold ``W * max_tokens`` tokens of this rank's head
    bands (``DestLayout``); readiness words count the producer's row blocks.
    """

    graph_capturable = True

    def __init__(self, heap, plan: HeadPlan, *, layout: str, max_tokens: int, num_slots: int,
                 device: torch.device, eps: float, rope_style: int, engine: str,
                 wait_timeout_s: float) -> None:
        self._heap, self._plan, self._rank = heap, plan, heap.rank
        self._layout, self._max_tokens = layout, max_tokens
        self._eps, self._rope_style = eps, rope_style
        self._producer = Producer(engine, plan, max_tokens=max_tokens, device=device)
        self._block_m = _config.PRODUCER_BLOCK_M
        self.channel = NvlinkChannel(
            heap, slot_elements=DestLayout.buffer_elements(plan, max_tokens * plan.world_size),
            num_slots=num_slots, readiness=ReadinessLayout.for_plan(plan, max_tokens,
                                                                    self._block_m),
            device=device, wait_timeout_s=wait_timeout_s, what="front end")
        self.slots = self.channel.ring
        self._bad_positions = BadPositionsCounter(device)

    # The three phases are separate so that in-process virtual ranks, which share
    # one stream, can run every rank's arrive before any rank's producer.

    def start(self) -> int:
        """Raise if an earlier call failed; take the next slot; announce the call to peers."""
        self.check()
        return self.channel.start()

    def produce(self, call: CallInputs, slot: int, projection: torch.Tensor | None = None
                ) -> None:
        """Project, normalise and rotate; store every head band into its destination's slot
        (``projection``: see ``session.producer.Producer``)."""
        self._producer(call, dest=self.layout(call.seq_global),
                       dest_table=self.slots.table(slot),
                       dest_seq_offset=self._rank * call.seq_local, eps=self._eps,
                       rope_style=self._rope_style, signals=self.channel.signals,
                       bad_positions=self._bad_positions.count, block_m=self._block_m,
                       projection=projection)

    def finish(self, call: CallInputs, slot: int, out: list[torch.Tensor] | None
               ) -> list[torch.Tensor]:
        """Acquire this call's readiness words; return the slot's views (or copy into ``out``)."""
        self.channel.wait(-(-call.rows // self._block_m))
        views = self.layout(call.seq_global).region_views(self.slots.buffer(slot), call.batch)
        return deliver(views, out)

    def run(self, call: CallInputs, out: list[torch.Tensor] | None,
            projection: torch.Tensor | None = None) -> tuple[list[torch.Tensor], int | None]:
        """One call: the outputs, and the slot they are views of (None when copied to ``out``)."""
        slot = self.start()
        self.produce(call, slot, projection)
        return self.finish(call, slot, out), None if out is not None else slot

    @property
    def nbytes(self) -> int:
        return self.channel.nbytes + self._producer.nbytes

    def layout(self, seq_global: int) -> DestLayout:
        return front_end_layout(self._plan, self._layout, self._max_tokens, seq_global)

    def check(self) -> None:
        """Raise ``PeerTimeoutError`` naming the peers a wait gave up on, or ``ValueError`` for
        positions outside the RoPE table (reads pinned memory; does not wait)."""
        self.channel.check()
        self._bad_positions.check()

    def close(self) -> None:
        """Collective: free the symmetric buffers (and drop the producer's workspace)."""
        self._producer.close()
        self._heap.close()
