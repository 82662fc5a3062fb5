"""The band exchange's NVLink path (``band_push`` into an ``NvlinkChannel``) with W virtual ranks.

Every rank starts (``barrier_arrive``) before any rank pushes, and every push
runs before any wait, since the virtual ranks share one stream (and, in Triton's
interpreter, run one program at a time).  Checks: each rank's output equals the
exchange written as plain indexing (bit for bit: it is data movement), nothing
past the call's output in the slot is written, readiness words reused across
calls of different sizes, chunked waits, non-contiguous sources, and the
timeout that names a rank that never called.
"""

from __future__ import annotations

import pytest
import torch

from cake_sp.layouts import GATHER_TOKENS, SCATTER_HEADS, BandTransfer
from cake_sp.session.bands import NvlinkBandExchange
from cake_sp.session.channel import PeerTimeoutError
from cake_sp.session.heap import InProcessHeap

POISON = -12288.0  # exactly representable in bf16


def expected_outputs(transfer: BandTransfer, parts: list[list[torch.Tensor]], batch: int,
                     seq_local: int) -> list[torch.Tensor]:
    """Every destination's output, by indexing: ``parts[r][i]`` is source r's part i."""
    w = transfer.world_size
    outs = []
    for d in range(w):
        out = torch.empty(transfer.output_shape(batch, seq_local), dtype=torch.bfloat16)
        for r in range(w):
            for i, part in enumerate(parts[r]):
                h, off = transfer.part_heads[i], transfer.part_offset(i)
                if transfer.direction == GATHER_TOKENS:
                    out[:, :, r, off:off + h] = part[:, d * seq_local:(d + 1) * seq_local].cpu()
                else:
                    out[:, r * seq_local:(r + 1) * seq_local, off:off + h] = \
                        part[:, :, d * h:(d + 1) * h].cpu()
        outs.append(out)
    return outs


def _exchanges(transfer, max_tokens, device, timeout_s=30.0):
    heap = InProcessHeap(transfer.world_size, device)
    return [NvlinkBandExchange(heap.rank(r), transfer, max_tokens=max_tokens, num_slots=2,
                               device=torch.device(device), wait_timeout_s=timeout_s,
                               what="test") for r in range(transfer.world_size)]


def _parts(g, transfer, batch, seq_local, device, transposed):
    """Random parts; ``transposed`` makes them strided views like an attention output."""
    parts = []
    for i in range(len(transfer.part_heads)):
        shape = transfer.source_shape(i, batch, seq_local)
        t = torch.randn(shape, generator=g).bfloat16()
        if transposed:
            t = t.transpose(1, 2).contiguous().transpose(1, 2)
        parts.append(t.to(device))
    return parts


@pytest.mark.parametrize("direction,world,part_heads,head_dim,transposed", [
    (GATHER_TOKENS, 2, (1,), 128, True),        # the output exchange (Q bands)
    (GATHER_TOKENS, 4, (2, 1, 1), 64, False),   # the front end's backward (q, k, v parts)
    (GATHER_TOKENS, 2, (1, 1, 1), 256, True),
    (SCATTER_HEADS, 2, (2,), 128, False),       # o_proj's backward
    (SCATTER_HEADS, 4, (1,), 64, True),
    (SCATTER_HEADS, 2, (2, 1, 1), 128, True),   # the core's q, k, v
    (SCATTER_HEADS, 4, (1, 1, 1), 64, False),
])
def test_outputs_match_indexing_and_nothing_else_is_written(device, direction, world,
                                                            part_heads, head_dim, transposed):
    g = torch.Generator().manual_seed(world * 10 + head_dim + len(part_heads))
    transfer = BandTransfer(direction, world, part_heads, head_dim)
    max_tokens = 160
    ranks = _exchanges(transfer, max_tokens, device)
    for ex in ranks:
        for s in range(2):
            ex.channel.ring.buffer(s).fill_(POISON)
    # Call 1: 2 x 75 = 150 rows, a tail row block; call 2 (next slot): fewer rows, the
    # readiness words reused without a memset.  Call 3 reuses call 1's slot.
    for call, (batch, seq_local) in enumerate([(2, 75), (1, 37), (1, 80)]):
        parts = [_parts(g, transfer, batch, seq_local, device, transposed) for _ in range(world)]
        pending = [ex.start(batch, seq_local) for ex in ranks]
        for ex, p, rank_parts in zip(ranks, pending, parts):
            ex.push(p, rank_parts)
        for ex, p in zip(ranks, pending):
            if call == 0:  # in two chunks of rows, the first a multiple of the row block
                ex.wait(p, 0, ex.block_m)
                ex.wait(p, ex.block_m, p.rows - ex.block_m)
            else:
                ex.wait(p)
        want = expected_outputs(transfer, parts, batch, seq_local)
        for r, (ex, p) in enumerate(zip(ranks, pending)):
            ex.check()
            assert torch.equal(ex.output(p).cpu(), want[r]), f"call {call} rank {r}"
            if call < 2:  # the tail of the slot past this call's output is still poison
                tail = ex.channel.ring.buffer(p.slot)[want[r].numel():]
                assert (tail == POISON).all(), f"call {call} rank {r} wrote past its output"


def test_bad_parts_raise_before_anything_runs(device):
    transfer = BandTransfer(GATHER_TOKENS, 2, (1,), 64)
    (ex, _) = _exchanges(transfer, 16, device)
    good = torch.zeros(1, 16, 1, 64, dtype=torch.bfloat16, device=device)
    with pytest.raises(ValueError, match=r"part 0 must be bf16 \(1, 16, 1, 64\)"):
        ex.send([good.float()], batch=1, seq_local=8)
    with pytest.raises(ValueError, match="max_tokens=16"):
        ex.send([torch.zeros(1, 34, 1, 64, dtype=torch.bfloat16, device=device)], batch=1,
                seq_local=17)
    with pytest.raises(ValueError, match="expected 1 parts"):
        ex.send([good, good], batch=1, seq_local=8)
    assert int(ex.channel.epoch.item()) == 0, "a rejected call must not have started"


def test_timeout_names_the_rank_that_never_called(device):
    g = torch.Generator().manual_seed(3)
    transfer = BandTransfer(SCATTER_HEADS, 4, (1,), 64)
    ranks = _exchanges(transfer, 32, device, timeout_s=0.05)
    present = [0, 1, 3]  # rank 2 never enters the call
    pending = {r: ranks[r].start(1, 16) for r in present}
    for r in present:
        ranks[r].push(pending[r], _parts(g, transfer, 1, 16, device, False))
    for r in present:
        ranks[r].wait(pending[r])
    if device.type == "cuda":
        torch.cuda.synchronize()
    for r in present:
        with pytest.raises(PeerTimeoutError, match=r"rank\(s\) \[2\]"):
            ranks[r].check()
