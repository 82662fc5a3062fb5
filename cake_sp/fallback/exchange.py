"""The NCCL path: the same contract as the NVLink path, built on ``torch.distributed``.

Equivalent unfused pseudo-code, per rank::

    p = x @ qkv_weight.T (+ bias)                      # fp32
    q, k = rope(rms_norm(q)), rope(rms_norm(k))        # DESIGN.md section 1
    send[d] = (q, k, v)[heads of rank d]               # pack, rank-major
    recv = all_to_all_single(send)                     # ONE collective
    out[:, src * S_local:(src + 1) * S_local] = recv[src]

The projection, norm, RoPE and pack are the producer (either engine,
``session/producer.py``) with a destination table pointing at this rank's own send
buffer, so the NCCL path shares every line of math with the NVLink path.  The group's backend
moves the bytes (NCCL on GPUs, gloo on CPUs); the bytes travel as uint8 since
gloo has no bf16 all-to-all.  With one rank the producer writes the output
directly and no collective runs.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from cake_sp.fallback.bands import hold_staging
from cake_sp.fallback.torch_front_end import produce_torch
from cake_sp.kernels import _config
from cake_sp.layouts import DestLayout, HeadPlan
from cake_sp.session.positions import BadPositionsCounter
from cake_sp.session.producer import Producer
from cake_sp.session.shared import release_shared
from cake_sp.session.slots import CallInputs, SlotRing, deliver, front_end_layout


def nccl_graph_capturable(group: dist.ProcessGroup, device: torch.device) -> bool:
    """Whether the NCCL path's calls can be captured in a CUDA graph: a call allocates
    nothing, never waits on the host and takes its slot on the host, so wherever its
    collective can be (NCCL's is; gloo's all-to-all runs on the host), or with one rank."""
    return device.type == "cuda" and (dist.get_world_size(group) == 1
                                      or dist.get_backend(group) == dist.Backend.NCCL)


class NcclExchange:
    """Buffers and call sequence of the NCCL path for one session.

    Owns the session's receive-slot ring, and holds a send and a receive buffer of ``W *
    max_tokens`` token rows of every head band (``fallback.bands.hold_staging``).
    """

    def __init__(self, group: dist.ProcessGroup, plan: HeadPlan, *, layout: str,
                 max_tokens: int, num_slots: int, device: torch.device, eps: float,
                 rope_style: int, engine: str) -> None:
        self._group, self._plan, self._layout = group, plan, layout
        self._max_tokens = max_tokens
        self._eps, self._rope_style = eps, rope_style
        self._plain_torch = _config.plain_torch(device)
        self._producer = Producer(engine, plan, max_tokens=max_tokens, device=device)
        world = plan.world_size
        self.slots = SlotRing.local(DestLayout.buffer_elements(plan, max_tokens * world),
                                    num_slots, device, what="front end")
        self._bad_positions = BadPositionsCounter(device)
        self._staging = None
        if world > 1:
            elements = world * DestLayout.buffer_elements(plan, max_tokens)
            self._staging = hold_staging(group, device, elements)
            self._send, self._recv = self._staging
            self._send_table = torch.empty(world, dtype=torch.int64, device=device)
            self._rank_index = torch.arange(world, dtype=torch.int64, device=device)
        self.graph_capturable = nccl_graph_capturable(group, device)

    def run(self, call: CallInputs, out: list[torch.Tensor] | None,
            projection: torch.Tensor | None = None) -> tuple[list[torch.Tensor], int | None]:
        """Project, normalise, rotate and exchange: the outputs, and the slot they are views of
        (None when copied to ``out``)."""
        self.check()
        plan, world = self._plan, self._plan.world_size
        # The slot is taken before any collective, so a leased ring raises on every rank.
        slot = self.slots.advance() if out is None or world == 1 else None
        layout = front_end_layout(plan, self._layout, self._max_tokens, call.seq_global)
        if world == 1:
            self._produce(call, layout, self.slots.table(slot), self.slots.buffer(slot),
                          projection)
            views = layout.region_views(self.slots.buffer(slot), call.batch)
            return deliver(views, out), None if out is not None else slot
        chunk = call.rows * plan.heads_per_rank * plan.head_dim
        send_layout = DestLayout.for_layout(plan, self._layout, token_capacity=call.rows,
                                            seq_len=call.seq_local)
        # Destination d's chunk starts d * chunk elements into the send buffer.
        torch.mul(self._rank_index, chunk * self._send.element_size(), out=self._send_table)
        self._send_table.add_(self._send.data_ptr())
        self._produce(call, send_layout, self._send_table, self._send[: world * chunk],
                      projection)
        dist.all_to_all_single(self._recv[: world * chunk].view(torch.uint8),
                               self._send[: world * chunk].view(torch.uint8), group=self._group)
        views = out if out is not None else layout.region_views(self.slots.buffer(slot),
                                                                call.batch)
        received = self._recv[: world * chunk].view(world, chunk)
        for kind, dest in zip(send_layout.regions, views):
            # Source src's region sits at the same offset of its chunk: [B, S_local, H, X].
            batch, _, heads, width = dest.shape
            start = send_layout.region_offset[kind]
            source = received[:, start: start + call.rows * heads * width]
            dest.view(batch, world, call.seq_local, heads, width).copy_(
                source.view(world, batch, call.seq_local, heads, width).transpose(0, 1))
        return views, slot

    @property
    def nbytes(self) -> int:
        """Bytes of the ring, the send and receive buffers (counted in each holder) and the
        producer's workspace."""
        staging = 2 * self._send.nbytes if self._staging is not None else 0
        return self.slots.nbytes + staging + self._producer.nbytes

    def _produce(self, call: CallInputs, dest: DestLayout, table: torch.Tensor,
                 buffer: torch.Tensor, projection: torch.Tensor | None) -> None:
        """The producer, without signals, into ``buffer``: one equal chunk per destination
        (``table`` holds their addresses); this rank's tokens start each destination row."""
        if self._plain_torch:
            chunks = list(buffer.view(len(table), -1))
            produce_torch(call, self._plan, dest, chunks, dest_seq_offset=0, eps=self._eps,
                          rope_style=self._rope_style, bad_positions=self._bad_positions,
                          projection=projection)
            return
        self._producer(call, dest=dest, dest_table=table, dest_seq_offset=0, eps=self._eps,
                       rope_style=self._rope_style, signals=None,
                       bad_positions=self._bad_positions.count,
                       block_m=_config.PRODUCER_BLOCK_M,
                       projection=projection)

    def check(self) -> None:
        """Raise ``ValueError`` if an earlier call had positions outside the RoPE table."""
        self._bad_positions.check()

    def close(self) -> None:
        """Drop the hold on the staging buffers and the reference to the process group
        (nothing collective: the buffers are ordinary device memory)."""
        self._producer.close()
        if self._staging is not None:
            release_shared(self._staging)
        self._staging = self._group = None
