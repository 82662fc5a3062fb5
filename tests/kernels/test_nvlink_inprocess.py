"""The NVLink path's protocol with W virtual ranks in one process (in-process heap).

Every rank runs ``barrier_arrive`` before any rank's producer, and every
producer before any wait, since the virtual ranks share one stream (and, in
Triton's interpreter, run one program at a time).  Checks: every rank's slot
against the reference, bytes outside what a call may write untouched, words
reused without memset across calls of different sizes, and the timeout that
names a rank that never called.
"""

from __future__ import annotations

import pytest
import torch

from cake_sp import reference
from cake_sp.kernels.norm_rope import rope_style_code
from cake_sp.layouts import DestLayout, HeadPlan
from cake_sp.session.heap import InProcessHeap
from cake_sp.session.nvlink import NvlinkExchange, PeerTimeoutError
from cake_sp.session.slots import CallInputs

POISON = -12288.0  # exactly representable in bf16


def _exchanges(world, hq, hkv, *, layout, max_tokens, device, rope_style="interleaved",
               num_slots=2, timeout_s=30.0, head_dim=128, engine="fused"):
    heap = InProcessHeap(world, device)
    plan = HeadPlan(world, hq, hkv, head_dim)
    ranks = [NvlinkExchange(heap.rank(r), plan, layout=layout, max_tokens=max_tokens,
                            num_slots=num_slots, device=torch.device(device), eps=1e-6,
                            rope_style=rope_style_code(rope_style), engine=engine,
                            wait_timeout_s=timeout_s)
             for r in range(world)]
    return plan, ranks


def _inputs(g, world, plan, hidden, batch, seq_local, device, *, positions):
    d = plan.head_dim
    n = plan.total_heads * d
    weight = (torch.randn(n, hidden, generator=g) / hidden**0.5).bfloat16()
    bias = torch.randn(n, generator=g).bfloat16()
    qn, kn = [(1 + 0.2 * torch.randn(d, generator=g)).bfloat16() for _ in range(2)]
    xs = [torch.randn(batch, seq_local, hidden, generator=g).bfloat16() for _ in range(world)]
    if positions:
        table = reference.rope_cos_sin_table(512, d)
        tables = [table] * world
        pos = [torch.randint(0, 512, (batch, seq_local), generator=g) for _ in range(world)]
    else:
        tables = [reference.rope_cos_sin_table(batch * seq_local, d, base=100.0 + r)
                  for r in range(world)]
        pos = None
    calls = [CallInputs(xs[r].to(device).view(batch * seq_local, hidden), batch, seq_local,
                        world, weight.to(device), bias.to(device), qn.to(device), kn.to(device),
                        tables[r].to(device),
                        None if pos is None else pos[r].to(device).view(-1))
             for r in range(world)]
    return calls, (xs, weight, qn, kn, tables, pos, bias)


def _run_call(ranks, calls):
    slots = [ex.start() for ex in ranks]
    for ex, call, slot in zip(ranks, calls, slots):
        ex.produce(call, slot)
    return [ex.finish(call, slot, None) for ex, call, slot in zip(ranks, calls, slots)], slots


@pytest.mark.parametrize("world,hq,hkv,layout,rope_style,positions,head_dim", [
    (2, 2, 2, "bshd", "interleaved", False, 128),
    (2, 4, 4, "fused", "neox", True, 128),
    (4, 8, 4, "bshd", "neox", False, 128),        # GQA, K/V heads split
    (4, 4, 1, "bshd", "interleaved", True, 128),  # GQA, K/V heads replicated to every rank
    (2, 4, 2, "bshd", "neox", True, 64),
    (2, 2, 2, "fused", "interleaved", False, 256),
])
@pytest.mark.parametrize("engine", ["fused", "cublas"])
def test_slots_match_reference_and_nothing_else_is_written(device, world, hq, hkv, layout,
                                                           rope_style, positions, head_dim,
                                                           engine):
    g = torch.Generator().manual_seed(world * 100 + hq * 10 + hkv + head_dim)
    hidden, max_tokens = 64, 160
    plan, ranks = _exchanges(world, hq, hkv, layout=layout, max_tokens=max_tokens,
                             device=device, rope_style=rope_style, head_dim=head_dim,
                             engine=engine)
    for ex in ranks:
        for buffer in ex.slots._buffers:
            buffer.fill_(POISON)
    # Call 1: a tail row block (150 rows = one full block of 128 and a partial one).
    # Call 2 (same slot ring, next slot): fewer rows, words reused without memset.
    for call_index, (batch, seq_local) in enumerate([(2, 75), (1, 37)]):
        calls, host = _inputs(g, world, plan, hidden, batch, seq_local, device,
                              positions=positions)
        outputs, slots = _run_call(ranks, calls)
        want = reference.qkv_norm_rope_exchange(
            host[0], host[1], host[2], host[3], host[4], host[5], host[6], num_q_heads=hq,
            num_kv_heads=hkv, rope_style=rope_style, layout=layout)
        for r, ex in enumerate(ranks):
            ex.check()
            expected = [want[r]] if layout == "fused" else list(want[r])
            for got, exp in zip(outputs[r], expected):
                torch.testing.assert_close(got.float().cpu(), exp.float(), atol=1e-2, rtol=1e-2)
            # Every element past this call's outputs in the slot is still poison.
            buffer = ex.slots._buffers[slots[r]].float().cpu()
            written = torch.zeros_like(buffer, dtype=torch.bool)
            layout_ = ex.layout(seq_local * world)
            for view in layout_.region_views(torch.arange(buffer.numel()), batch):
                written[view.flatten()] = True
            assert (buffer[~written] == POISON).all(), f"call {call_index} rank {r} wrote outside"
            assert not (buffer[written] == POISON).any(), "an output element was not written"
            assert int(ex.channel.epoch.item()) == call_index + 1


def test_timeout_names_the_rank_that_never_called(device):
    g = torch.Generator().manual_seed(5)
    world = 4
    plan, ranks = _exchanges(world, 4, 4, layout="bshd", max_tokens=32, device=device,
                             timeout_s=0.05)
    calls, _ = _inputs(g, world, plan, 64, 1, 16, device, positions=False)
    present = [0, 1, 3]  # rank 2 never enters the call
    slots = {r: ranks[r].start() for r in present}
    for r in present:
        ranks[r].produce(calls[r], slots[r])
    for r in present:
        ranks[r].finish(calls[r], slots[r], None)
    if device.type == "cuda":
        torch.cuda.synchronize()
    for r in present:
        with pytest.raises(PeerTimeoutError, match=r"rank\(s\) \[2\]"):
            ranks[r].check()


def test_destination_layout_covers_the_buffer_exactly():
    """Host-only: the regions of both layouts tile a full slot with no gap or overlap."""
    for hq, hkv, layout in [(8, 2, "bshd"), (4, 4, "fused"), (8, 8, "bshd")]:
        plan = HeadPlan(4, hq, hkv, 128)
        cap = 12
        dest = DestLayout.for_layout(plan, layout, token_capacity=cap, seq_len=cap)
        marks = torch.zeros(DestLayout.buffer_elements(plan, cap), dtype=torch.int32)
        for view in dest.region_views(torch.arange(marks.numel()), 1):
            marks[view.flatten()] += 1
        assert (marks == 1).all()
