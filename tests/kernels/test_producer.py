"""The fused producer (``kernels/producer.py``) on W virtual ranks in one process.

Every rank's slot is a poisoned bf16 buffer inside guard bands; the pointer
table holds their addresses, so one process plays the whole exchange: every
rank's ``barrier_arrive``, then every rank's producer, then every rank's
``wait_ready`` (the order one stream imposes, and the only one the CPU
interpreter can run, since it executes programs one after another).

The oracle is written here, independently of the package: DESIGN.md section 1
in fp32, step by step, and the Ulysses redistribution by plain indexing into
views of the slot laid out by hand from the contract.  bf16 outputs must be
within atol = rtol = 1e-2 of it; elements one bf16 ulp away from the rounded
oracle (fp32 summation order put them across a rounding boundary) are counted
and recorded as the ``one_ulp`` property (``--junitxml`` shows it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import pytest
import torch
import triton
import triton.language as tl

from cake_sp.kernels import _config
from cake_sp.kernels.producer import MAINLOOPS, WS_HEAD_DIMS, qkv_norm_rope_produce
from cake_sp.kernels.producer_cublas import qkv_norm_rope_produce_cublas
from cake_sp.kernels.producer_epilogue import tile_coords
from cake_sp.kernels.signals import (
    STATUS_ENTER_TIMEOUT,
    STATUS_READY_TIMEOUT,
    ProducerSignals,
    barrier_arrive,
    wait_ready,
)
from cake_sp.layouts import DestLayout, HeadPlan, ReadinessLayout
from cake_sp.testing import assert_close_counting_flips

# DESIGN.md section 1: bf16 outputs against the fp32 reference.
TOLERANCES = {torch.bfloat16: dict(atol=1e-2, rtol=1e-2)}
POISON = 0x7FA5  # a bf16 NaN whose payload no kernel produces
GUARD = 64  # bf16 elements of poison on each side of every slot (128 bytes keeps alignment)
EPS = 1e-6
TIMEOUT_NS = 10**9


@dataclass(frozen=True)
class Case:
    world: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int = 128
    hidden: int = 128
    batch: int = 1
    seq_local: int = 37
    layout: str = "bshd"
    rope_style: str = "interleaved"
    bias: bool = False
    q_norm: bool = True
    k_norm: bool = True
    positions: torch.dtype | None = None
    block_m: int | None = None  # rows per readiness word; None: _config.PRODUCER_BLOCK_M
    num_sms: int | None = None
    mainloop: str | None = None  # None: the launch default
    engine: str = "fused"  # or "cublas" (producer_cublas.py)

    @property
    def rows(self) -> int:
        return self.batch * self.seq_local

    @property
    def plan(self) -> HeadPlan:
        return HeadPlan(self.world, self.num_q_heads, self.num_kv_heads, self.head_dim)

    @property
    def ready_rows(self) -> int:
        return self.block_m or _config.PRODUCER_BLOCK_M


CASES = {
    # W = 2, MHA; one tail row block.
    "w2-mha-37": Case(2, 2, 2),
    # W = 2, GQA split, B = 2 (two row blocks, the second a tail), every option on.
    "w2-gqa-split-200": Case(2, 4, 2, hidden=192, batch=2, seq_local=100, rope_style="neox",
                             bias=True, positions=torch.int64),
    # W = 4, GQA replication (each K/V head to two ranks), D = 64, one norm only.
    "w4-gqa-repl-d64": Case(4, 4, 2, head_dim=64, hidden=256, batch=2, seq_local=100,
                            bias=True, q_norm=False, positions=torch.int32, block_m=64),
    # W = 4, fused layout, no norms (RoPE on the fp32 projection), one program.
    "w4-fused-nonorm": Case(4, 4, 4, hidden=64, layout="fused", rope_style="neox",
                            q_norm=False, k_norm=False, num_sms=1),
    # W = 2, fused layout, B = 2, bias and positions, an odd grid.
    "w2-fused-200": Case(2, 2, 2, head_dim=64, batch=2, seq_local=100, bias=True,
                         positions=torch.int32, num_sms=3),
    # W = 4, GQA split with two K/V heads per rank, Q heads > W.
    "w4-gqa-split-wide": Case(4, 8, 4, head_dim=64, hidden=64, rope_style="neox",
                              block_m=32),
    # W = 2, D = 256 (64-row tiles on a GPU), interleaved RoPE, a tail row block.
    "w2-mha-d256": Case(2, 2, 2, head_dim=256, hidden=64, seq_local=37, bias=True),
    # The tensor-descriptor mainloop (TMA on a GPU; emulated by the interpreter).
    "w2-tma": Case(2, 4, 2, batch=2, seq_local=100, bias=True, positions=torch.int64,
                   mainloop="tma"),
    # The same at D = 256 (64-row tiles on a GPU; a 256 x 64 weight block per K step).
    "w2-tma-d256": Case(2, 2, 2, head_dim=256, hidden=128, seq_local=70, rope_style="neox",
                        mainloop="tma"),
    # The cuBLAS engine: GQA split, B = 2, every option on, 32-row blocks with a tail.
    "w2-cublas-split": Case(2, 4, 2, hidden=192, batch=2, seq_local=50, rope_style="neox",
                            bias=True, positions=torch.int64, block_m=32, engine="cublas"),
    # ... with GQA replication at D = 64, one norm.
    "w4-cublas-repl-d64": Case(4, 4, 2, head_dim=64, hidden=256, batch=2, seq_local=40,
                               bias=True, q_norm=False, positions=torch.int32, block_m=64,
                               engine="cublas"),
    # ... with the fused layout, no norms, D = 256.
    "w2-cublas-fused-d256": Case(2, 2, 2, head_dim=256, hidden=64, layout="fused",
                                 q_norm=False, k_norm=False, block_m=16, engine="cublas"),
}


# ----------------------------------------------------------------------------- inputs and oracle


def _make_inputs(case: Case, device: torch.device, seed: int) -> dict:
    """Fresh random inputs: shared weights, and per-rank x, cos/sin table and positions."""
    gen = torch.Generator().manual_seed(seed)
    plan, d, rows = case.plan, case.head_dim, case.rows

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(device)

    def cos_sin_table(n):
        angles = (torch.rand(n, d // 2, generator=gen) * 2 - 1) * math.pi
        return torch.cat((angles.cos(), angles.sin()), dim=1).to(device)

    max_pos = 3 * rows
    ranks = []
    for _ in range(case.world):
        positions = (torch.randint(0, max_pos, (case.batch, case.seq_local), generator=gen)
                     .to(device, case.positions) if case.positions else None)
        ranks.append(dict(
            x=randn(rows, case.hidden).bfloat16(),
            cos_sin=cos_sin_table(max_pos if case.positions else rows),
            positions=positions))
    return dict(
        weight=randn(plan.total_heads * d, case.hidden, scale=case.hidden ** -0.5).bfloat16(),
        bias=randn(plan.total_heads * d, scale=0.5).bfloat16() if case.bias else None,
        q_norm=(1 + randn(d, scale=0.3)).bfloat16() if case.q_norm else None,
        k_norm=(1 + randn(d, scale=0.3)).bfloat16() if case.k_norm else None,
        ranks=ranks)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, style: str) -> torch.Tensor:
    if style == "interleaved":
        a, b = x[..., 0::2], x[..., 1::2]
        return torch.stack((a * cos - b * sin, b * cos + a * sin), dim=-1).flatten(-2)
    a, b = x.chunk(2, dim=-1)
    return torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1)


def _oracle_source(case: Case, inputs: dict, rank: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s q, k, v, fp32 ``[B, S_local, H, D]`` before the final bf16 rounding.

    Computed with torch ops on the inputs' device (fp32 matmuls there are IEEE fp32:
    torch leaves TF32 off by default), so the real-shape cases do not wait on a CPU GEMM.
    """
    d, hq, hkv = case.head_dim, case.num_q_heads, case.num_kv_heads
    src = inputs["ranks"][rank]
    p = src["x"].float() @ inputs["weight"].float().T
    if inputs["bias"] is not None:
        p = p + inputs["bias"].float()
    p = p.view(case.batch, case.seq_local, hq + 2 * hkv, d)
    table = src["cos_sin"]
    rows = (src["positions"].long() if src["positions"] is not None
            else torch.arange(case.rows, device=table.device).view(case.batch, case.seq_local))
    cos, sin = table[rows][:, :, None, : d // 2], table[rows][:, :, None, d // 2:]
    out = {}
    for name, heads, weight in (("q", p[:, :, :hq], inputs["q_norm"]),
                                ("k", p[:, :, hq:hq + hkv], inputs["k_norm"])):
        if weight is not None:
            n = heads * torch.rsqrt(heads.pow(2).mean(dim=-1, keepdim=True) + EPS)
            heads = (n.bfloat16() * weight).float()
        out[name] = _rope(heads, cos, sin, case.rope_style)
    out["v"] = p[:, :, hq + hkv:]
    return out


def _oracle_destinations(case: Case, inputs: dict) -> list[dict[str, torch.Tensor]]:
    """What rank r must receive: its Q band and the K/V heads that band uses, all tokens
    ordered by source rank, fp32 ``[B, W * S_local, H_local, D]``."""
    world, hq, hkv = case.world, case.num_q_heads, case.num_kv_heads
    sources = [_oracle_source(case, inputs, r) for r in range(world)]
    out = []
    for r in range(world):
        q_heads = list(range(r * hq // world, (r + 1) * hq // world))
        kv_heads = sorted({h // (hq // hkv) for h in q_heads})
        out.append({
            "q": torch.cat([s["q"][:, :, q_heads] for s in sources], dim=1),
            "k": torch.cat([s["k"][:, :, kv_heads] for s in sources], dim=1),
            "v": torch.cat([s["v"][:, :, kv_heads] for s in sources], dim=1)})
    return out


def _slot_views(flat: torch.Tensor, case: Case, capacity: int) -> dict[str, torch.Tensor]:
    """The session's output views of a slot, from DESIGN.md's layouts (not from DestLayout)."""
    plan, d = case.plan, case.head_dim
    b, s_global = case.batch, case.world * case.seq_local
    hq, hkv = plan.q_per_rank, plan.kv_per_rank
    if case.layout == "fused":
        fused = flat[: b * s_global * hq * 3 * d].view(b, s_global, hq, 3, d)
        return {"q": fused[..., 0, :], "k": fused[..., 1, :], "v": fused[..., 2, :]}
    k0, v0 = capacity * hq * d, capacity * (hq + hkv) * d
    return {"q": flat[: b * s_global * hq * d].view(b, s_global, hq, d),
            "k": flat[k0: k0 + b * s_global * hkv * d].view(b, s_global, hkv, d),
            "v": flat[v0: v0 + b * s_global * hkv * d].view(b, s_global, hkv, d)}


# ----------------------------------------------------------------------------- virtual ranks


class VirtualRanks:
    """W ranks in one process: poisoned slots in guard bands, entry and readiness words,
    epochs and status flags, and the pointer tables a rank's kernels use to reach them."""

    def __init__(self, case: Case, max_tokens: int, device: torch.device) -> None:
        self.case, self.device = case, device
        world = case.world
        self.capacity = world * max_tokens
        self.elements = DestLayout.buffer_elements(case.plan, self.capacity)
        self.storage = [torch.full((self.elements + 2 * GUARD,), POISON, dtype=torch.int16,
                                   device=device) for _ in range(world)]
        self.slots = [s[GUARD: GUARD + self.elements].view(torch.bfloat16)
                      for s in self.storage]
        self.readiness = ReadinessLayout.for_plan(case.plan, max_tokens, case.ready_rows)
        self.words = [torch.zeros(self.readiness.words, dtype=torch.int64, device=device)
                      for _ in range(world)]
        self.enter = [torch.zeros(world, dtype=torch.int64, device=device)
                      for _ in range(world)]
        self.epoch = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
        self.status = [torch.zeros(1 + world, dtype=torch.int64, device=device)
                       for _ in range(world)]
        self.bad_positions = [torch.zeros(1, dtype=torch.int64, device=device)
                              for _ in range(world)]
        self.slot_table = self._table(self.slots)
        self.word_table = self._table(self.words)
        self.enter_table = self._table(self.enter)

    def _table(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64,
                            device=self.device)

    def poison(self) -> None:
        for s in self.storage:
            s.fill_(POISON)

    def dest(self) -> DestLayout:
        c = self.case
        return DestLayout.for_layout(c.plan, c.layout, self.capacity,
                                     seq_len=c.world * c.seq_local)

    def produce(self, rank: int, inputs: dict, signal: bool) -> None:
        c, src = self.case, inputs["ranks"][rank]
        signals = ProducerSignals(
            epoch=self.epoch[rank], enter=self.enter[rank], word_table=self.word_table,
            source_rank=rank, readiness=self.readiness, status=self.status[rank],
            timeout_ns=TIMEOUT_NS) if signal else None
        common = dict(plan=c.plan, dest=self.dest(), dest_table=self.slot_table,
                      seq_local=c.seq_local, dest_seq_offset=rank * c.seq_local, eps=EPS,
                      rope_style=c.rope_style, signals=signals,
                      bad_positions=self.bad_positions[rank], block_m=c.ready_rows)
        args = (src["x"], inputs["weight"], inputs["bias"], inputs["q_norm"], inputs["k_norm"],
                src["cos_sin"], src["positions"])
        if c.engine == "cublas":
            qkv_norm_rope_produce_cublas(*args, **common)
        else:
            qkv_norm_rope_produce(*args, **common, num_sms=c.num_sms, mainloop=c.mainloop)

    def row_blocks(self) -> int:
        return -(-self.case.rows // self.case.ready_rows)

    def call(self, inputs: dict, ranks: range | list[int] | None = None) -> None:
        """One NVLink call of ``ranks`` (default all): arrive, produce, wait."""
        ranks = range(self.case.world) if ranks is None else ranks
        for r in ranks:
            barrier_arrive(self.epoch[r], self.enter_table, source_rank=r)
        for r in ranks:
            self.produce(r, inputs, signal=True)
        for r in ranks:
            wait_ready(self.epoch[r], self.words[r], self.status[r], readiness=self.readiness,
                       row_blocks=self.row_blocks(), timeout_ns=TIMEOUT_NS)


def _check_slots(vr: VirtualRanks, expected: list[dict[str, torch.Tensor]],
                 record_property) -> None:
    """Every rank's slot equals the oracle where the call writes, and the poison elsewhere."""
    one_ulp = flips = 0
    for r in range(vr.case.world):
        storage = vr.storage[r].cpu()
        written = torch.zeros(vr.elements, dtype=torch.bool)
        got = _slot_views(storage[GUARD: GUARD + vr.elements].view(torch.bfloat16), vr.case,
                          vr.capacity)
        for name, view in _slot_views(written, vr.case, vr.capacity).items():
            view.fill_(True)
            ref = expected[r][name]
            style = None if name == "v" else vr.case.rope_style
            counts = assert_close_counting_flips(got[name], ref, rope_style=style,
                                                 head_dim=vr.case.head_dim,
                                                 what=f"rank {r} {name}")
            one_ulp += counts["one_ulp"]
            flips += counts["intermediate_flips"]
        untouched = torch.cat((storage[:GUARD], storage[GUARD: GUARD + vr.elements][~written],
                               storage[GUARD + vr.elements:]))
        assert bool((untouched == POISON).all()), \
            f"rank {r}: {(untouched != POISON).sum()} elements outside the call were written"
    record_property("one_ulp", one_ulp)
    record_property("intermediate_flips", flips)


# ----------------------------------------------------------------------------- tests


def _exchange_and_check(case: Case, device, record_property, seed: int) -> None:
    """barrier -> producer -> wait on W ranks: slots, readiness words, status, epochs."""
    vr = VirtualRanks(case, max_tokens=case.rows + 24, device=device)
    inputs = _make_inputs(case, device, seed=seed)
    vr.call(inputs)
    _check_slots(vr, _oracle_destinations(case, inputs), record_property)
    per_source = vr.readiness.max_row_blocks * case.plan.heads_per_rank
    used = vr.row_blocks() * case.plan.heads_per_rank
    for r in range(case.world):
        assert vr.epoch[r].item() == 1
        assert vr.status[r].cpu().tolist() == [0] * (1 + case.world)
        assert vr.bad_positions[r].item() == 0
        words = vr.words[r].cpu().view(case.world, per_source)
        assert bool((words[:, :used] == 1).all()), f"rank {r}: readiness words not raised"
        assert bool((words[:, used:] == 0).all()), f"rank {r}: words past the call raised"


@pytest.mark.parametrize("name", list(CASES))
def test_exchange_matches_oracle(name, device, record_property):
    _exchange_and_check(CASES[name], device, record_property, seed=len(name))


# The cases whose head size the warp-specialised kernel takes, at its smallest tile.
WS_CASES = [n for n, c in CASES.items()
            if c.head_dim in WS_HEAD_DIMS and c.mainloop is None and c.engine == "fused"]


@pytest.mark.gpu
@pytest.mark.parametrize("norm_in_mma", [True, False])
@pytest.mark.parametrize("name", WS_CASES)
def test_warp_specialized_mainloop_matches_oracle(name, norm_in_mma, device, record_property,
                                                  monkeypatch):
    """The Gluon kernel on the small cases: tail row blocks, one K step, GQA replication; the
    cases with both norms in both one-head tile shapes (``_config.PRODUCER_WS_NORM_IN_MMA``; an
    infinite ``PRODUCER_WS_FILL_MARGIN`` keeps the 256-row tile at any wave fill)."""
    case = replace(CASES[name], mainloop="warp_specialized", block_m=None)
    if not (case.q_norm and case.k_norm) and not norm_in_mma:
        pytest.skip("without both norm weights the kernel always hands over fp32")
    monkeypatch.setattr(_config, "PRODUCER_WS_NORM_IN_MMA", norm_in_mma)
    monkeypatch.setattr(_config, "PRODUCER_WS_FILL_MARGIN", float("inf"))
    # One head a tile here; the head-pair tile has its own test below.
    monkeypatch.setattr(_config, "PRODUCER_WS_HEAD_PAIRS", False)
    _exchange_and_check(case, device, record_property, seed=len(name) + 1)


# The warp-specialised kernel's head-pair tile (_config.PRODUCER_WS_PAIR_TILE): D = 128, both
# norms, even Q and K/V head counts; bands of an even and an odd number of heads, K/V
# replication, positions, both RoPE styles, several row blocks and a tail.
PAIR_CASES = {
    "w2-pairs-mha-37": CASES["w2-mha-37"],
    "w2-pairs-gqa-200": CASES["w2-gqa-split-200"],
    "w2-pairs-even-bands": Case(2, 8, 4, hidden=256, batch=1, seq_local=300, rope_style="neox",
                                bias=True, positions=torch.int32),
    "w4-pairs-repl": Case(4, 8, 2, hidden=128, batch=2, seq_local=150, bias=True),
    "w2-pairs-odd-bands": Case(2, 6, 2, hidden=192, seq_local=260, rope_style="neox"),
}


@triton.jit
def _tile_order_kernel(out_ptr, row_blocks, NUM_Q_HEADS: tl.constexpr,
                       NUM_KV_HEADS: tl.constexpr, Q_PER_RANK: tl.constexpr,
                       KV_PER_RANK: tl.constexpr, GROUP_HEADS: tl.constexpr):
    """``tile_coords`` of persistent tile ``t``, a program each: ``out[t] = (row_block,
    position)``."""
    t = tl.program_id(0)
    row_block, position = tile_coords(t, row_blocks, NUM_Q_HEADS, NUM_KV_HEADS, Q_PER_RANK,
                                      KV_PER_RANK, GROUP_HEADS)
    tl.store(out_ptr + 2 * t, row_block)
    tl.store(out_ptr + 2 * t + 1, position)


@pytest.mark.parametrize("heads", [1, 2])
@pytest.mark.parametrize("world, hq, hkv", [
    (2, 24, 8), (4, 24, 8), (8, 24, 8), (8, 32, 8), (8, 64, 4), (4, 36, 4), (8, 40, 8),
    (2, 2, 2), (4, 8, 2),
])
def test_tile_order_covers_every_head_of_every_row_block_once(world, hq, hkv, heads, device):
    """The persistent tiles' ``(row block, head)`` (``producer_epilogue.tile_coords``; with two
    heads a tile, over pairs as ``producer_ws._tile_heads`` takes it, bands of an odd number of
    heads included) name every row block of every head once, a pair's heads of one kind."""
    _pair_band = pytest.importorskip("cake_sp.kernels.producer_ws")._pair_band

    plan = HeadPlan(world, hq, hkv, 128)
    row_blocks, total = 3, plan.total_heads
    q_band, kv_band = plan.q_per_rank, plan.kv_per_rank
    if heads == 2:
        q_band, kv_band = _pair_band(q_band), _pair_band(kv_band)
    positions = total // heads
    group = min(_config.PRODUCER_WS_GROUP_HEADS // heads, positions)
    out = torch.full((row_blocks * positions, 2), -1, dtype=torch.int32, device=device)
    _tile_order_kernel[(out.shape[0],)](out, row_blocks, hq // heads, hkv // heads, q_band,
                                        kv_band, group)
    got = sorted((int(rb), int(p) * heads) for rb, p in out.tolist())
    assert got == [(rb, h) for rb in range(row_blocks) for h in range(0, total, heads)]
    kinds = [0] * hq + [1] * hkv + [2] * hkv
    assert all(kinds[h] == kinds[h + heads - 1] for _, h in got)


def _head_pairs(monkeypatch, case: Case) -> None:
    """Make the launcher take the head-pair tile for ``case``, and check it will."""
    monkeypatch.setattr(_config, "PRODUCER_WS_HEAD_PAIRS", True)
    monkeypatch.setattr(_config, "PRODUCER_WS_FILL_MARGIN", float("inf"))
    tile = _config.producer_ws_tile(case.rows, case.plan.total_heads, 132, True, True)
    assert tile == _config.PRODUCER_WS_PAIR_TILE


@pytest.mark.gpu
@pytest.mark.parametrize("name", PAIR_CASES)
def test_warp_specialized_head_pairs_match_oracle(name, device, record_property, monkeypatch):
    """Two adjacent heads a tile, one a warpgroup, each row's RoPE table entries loaded once
    for both: the same destinations, bytes and readiness words as one head a tile."""
    case = replace(PAIR_CASES[name], mainloop="warp_specialized", block_m=None)
    _head_pairs(monkeypatch, case)
    _exchange_and_check(case, device, record_property, seed=len(name) + 3)


@pytest.mark.parametrize("pairs", [False, True], ids=["", "pairs"])
@pytest.mark.parametrize("name", ["w2-gqa-split-200", "w4-gqa-repl-d64", "w2-tma",
                                  "w2-cublas-split"])
def test_positions_outside_the_table_are_counted_and_read_nothing(name, pairs, device,
                                                                  record_property, monkeypatch):
    """Positions < 0 or >= the table's rows: those Q/K rows rotate by cos = sin = 0 (the
    oracle gets a zero table row for them), every Q/K tile row counts once, nothing else
    changes.  ``pairs``: on the warp-specialised kernel's head-pair tile, which counts a row
    once for both heads of a pair."""
    case = CASES[name]
    if pairs:
        if name != "w2-gqa-split-200" or device.type != "cuda":
            pytest.skip("the head-pair tile: D = 128 with both norms, on a Hopper GPU")
        case = replace(case, mainloop="warp_specialized")
        _head_pairs(monkeypatch, case)
    inputs = _make_inputs(case, device, seed=13)
    oracle_ranks, bad_rows = [], []
    for src in inputs["ranks"]:
        table, positions = src["cos_sin"], src["positions"].view(-1)
        bad = torch.zeros_like(positions, dtype=torch.bool)
        bad[::7] = True
        positions[::14] = -1
        positions[7::14] = table.shape[0] + 5
        bad_rows.append(int(bad.sum()))
        oracle_ranks.append(dict(
            src, cos_sin=torch.cat((table, table.new_zeros(1, table.shape[1]))),
            positions=torch.where(bad, table.shape[0], positions).view_as(src["positions"])))
    vr = VirtualRanks(case, max_tokens=case.rows, device=device)
    vr.call(inputs)
    _check_slots(vr, _oracle_destinations(case, dict(inputs, ranks=oracle_ranks)),
                 record_property)
    qk_heads = case.num_q_heads + case.num_kv_heads
    for r in range(case.world):
        assert vr.bad_positions[r].item() == bad_rows[r] * qk_heads
        assert not vr.status[r].any()


@pytest.mark.parametrize("name", ["w2-gqa-split-200", "w4-fused-nonorm", "w2-fused-200"])
def test_pack_without_signals(name, device, record_property):
    """``signals=None`` (the NCCL path packing its send buffer): stores only, no words."""
    case = CASES[name]
    vr = VirtualRanks(case, max_tokens=case.rows, device=device)
    inputs = _make_inputs(case, device, seed=7)
    for r in range(case.world):
        vr.produce(r, inputs, signal=False)
    _check_slots(vr, _oracle_destinations(case, inputs), record_property)
    for r in range(case.world):
        assert not vr.words[r].any() and not vr.status[r].any() and not vr.epoch[r].any()


def test_second_call_reuses_words_without_memset(device, record_property):
    """A second, shorter call: fresh epoch in its words, the first call's left alone."""
    first = Case(2, 4, 2, head_dim=64, hidden=64, batch=2, seq_local=100, block_m=64,
                 bias=True)
    second = replace(first, batch=1, seq_local=37, positions=torch.int64)
    vr = VirtualRanks(first, max_tokens=first.rows, device=device)
    vr.call(_make_inputs(first, device, seed=1))
    vr.poison()
    vr.case = second
    inputs = _make_inputs(second, device, seed=2)
    vr.call(inputs)
    _check_slots(vr, _oracle_destinations(second, inputs), record_property)
    heads = first.plan.heads_per_rank
    for r in range(2):
        assert vr.epoch[r].item() == 2 and not vr.status[r].any()
        words = vr.words[r].cpu().view(2, vr.readiness.max_row_blocks, heads)
        assert bool((words[:, :1] == 2).all())  # the second call's one row block
        assert bool((words[:, 1:4] == 1).all())  # left over from the first call


def test_absent_rank_times_out_and_is_named(device):
    """Rank 1 never enters: rank 0 skips its stores to rank 1, and both of rank 0's
    waits give up and name rank 1, instead of hanging."""
    case = CASES["w2-gqa-split-200"]
    vr = VirtualRanks(case, max_tokens=case.rows, device=device)
    inputs = _make_inputs(case, device, seed=3)
    vr.call(inputs, ranks=[0])
    status = vr.status[0].cpu().tolist()
    assert status == [STATUS_READY_TIMEOUT | STATUS_ENTER_TIMEOUT, 0,
                      STATUS_READY_TIMEOUT | STATUS_ENTER_TIMEOUT]
    assert bool((vr.storage[1] == POISON).all()), "stores reached a rank that never entered"
    assert not vr.words[1].any()
    assert vr.epoch[0].item() == 1 and vr.epoch[1].item() == 0
    # Rank 0 still received its own band from itself.
    own = _slot_views(vr.slots[0], case, vr.capacity)["q"][:, : case.seq_local]
    ref = _oracle_destinations(case, inputs)[0]["q"][:, : case.seq_local]
    torch.testing.assert_close(own.float().cpu(), ref.cpu(), **TOLERANCES[torch.bfloat16])


def test_matches_package_reference(device):
    """The kernel agrees with ``cake_sp.reference`` too, where that module exists."""
    reference = pytest.importorskip("cake_sp.reference")
    case = CASES["w2-gqa-split-200"]
    vr = VirtualRanks(case, max_tokens=case.rows, device=device)
    inputs = _make_inputs(case, device, seed=11)
    vr.call(inputs)
    ranks = inputs["ranks"]
    expected = reference.qkv_norm_rope_exchange(
        [r["x"].cpu().view(case.batch, case.seq_local, -1) for r in ranks],
        inputs["weight"].cpu(), inputs["q_norm"].cpu(), inputs["k_norm"].cpu(),
        [r["cos_sin"].cpu() for r in ranks], positions=[r["positions"].cpu() for r in ranks],
        qkv_bias=inputs["bias"].cpu(), num_q_heads=case.num_q_heads,
        num_kv_heads=case.num_kv_heads, rope_style=case.rope_style, eps=EPS)
    for r in range(case.world):
        got = _slot_views(vr.slots[r].cpu(), case, vr.capacity)
        for name, ref in zip("qkv", expected[r], strict=True):
            torch.testing.assert_close(got[name].float(), ref.float(),
                                       **TOLERANCES[torch.bfloat16])


# ----------------------------------------------------------------------------- validation


def _misaligned(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of ``t`` that starts 2 bytes past an aligned address."""
    flat = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
    out = flat[1:].view(t.shape)
    out.copy_(t)
    return out


def _valid_args(device: torch.device) -> tuple[list, dict]:
    case = Case(2, 2, 2, hidden=64, seq_local=8)
    inputs = _make_inputs(case, device, seed=0)
    vr = VirtualRanks(case, max_tokens=8, device=device)
    src = inputs["ranks"][0]
    args = [src["x"], inputs["weight"], None, inputs["q_norm"], inputs["k_norm"],
            src["cos_sin"], None]
    kwargs = dict(plan=case.plan, dest=vr.dest(), dest_table=vr.slot_table, seq_local=8,
                  dest_seq_offset=0, eps=EPS, rope_style="neox")
    return args, kwargs


@pytest.mark.parametrize("change, error, match", [
    (lambda a, k: a.__setitem__(0, a[0].float()), TypeError, "x must have dtype"),
    (lambda a, k: a.__setitem__(0, a[0][:, :48]), ValueError, "contiguous"),
    (lambda a, k: a.__setitem__(1, a[1][:-1]), ValueError, "qkv_weight"),
    (lambda a, k: a.__setitem__(2, torch.zeros(5, dtype=torch.bfloat16, device=a[0].device)),
     ValueError, "qkv_bias"),
    (lambda a, k: a.__setitem__(3, a[3].float()), TypeError, "q_norm_weight"),
    (lambda a, k: a.__setitem__(5, a[5][:4]), ValueError, "per-token cos_sin"),
    (lambda a, k: a.__setitem__(5, a[5].double()), ValueError, "cos_sin must be fp32"),
    (lambda a, k: a.__setitem__(6, torch.zeros(3, dtype=torch.int64, device=a[0].device)),
     ValueError, "positions"),
    (lambda a, k: k.update(seq_local=3), ValueError, "multiple of seq_local"),
    (lambda a, k: k.update(dest_seq_offset=9), ValueError, "dest_seq_offset"),
    (lambda a, k: k.update(block_m=48), ValueError, "block_m"),
    (lambda a, k: k.update(eps=0.0), ValueError, "eps"),
    (lambda a, k: k.update(rope_style="gptj"), ValueError, "rope_style"),
    (lambda a, k: k.update(dest_table=k["dest_table"][:1]), ValueError, "dest_table"),
    (lambda a, k: k.update(dest=replace(k["dest"], head_stride=(128, 128, 4))), ValueError,
     "multiples of 8"),
    (lambda a, k: k.update(plan=HeadPlan(2, 2, 2, 32)), ValueError, "head_dim"),
    (lambda a, k: k.update(signals="on"), TypeError, "ProducerSignals"),
    (lambda a, k: (a.__setitem__(0, _misaligned(a[0])), k.update(mainloop="tma")), ValueError,
     "16-byte aligned"),
    (lambda a, k: k.update(mainloop="wgmma"), ValueError, "mainloop must be one of"),
])
def test_rejects_bad_inputs(device, change, error, match):
    args, kwargs = _valid_args(device)
    change(args, kwargs)
    with pytest.raises(error, match=match):
        qkv_norm_rope_produce(*args, **kwargs)


def test_rejects_readiness_of_another_block_m(device):
    args, kwargs = _valid_args(device)
    plan, w = kwargs["plan"], 2
    words = torch.zeros(1, dtype=torch.int64, device=device)
    signals = ProducerSignals(
        epoch=words, enter=torch.zeros(w, dtype=torch.int64, device=device),
        word_table=torch.zeros(w, dtype=torch.int64, device=device), source_rank=0,
        readiness=ReadinessLayout(w, 0, plan.heads_per_rank),
        status=torch.zeros(1 + w, dtype=torch.int64, device=device), timeout_ns=1)
    with pytest.raises(ValueError, match="same block_m"):
        qkv_norm_rope_produce(*args, **kwargs, signals=signals)


# ----------------------------------------------------------------------------- real shapes


@pytest.mark.gpu
@pytest.mark.parametrize("world, hq, hkv", [(2, 32, 8), (4, 32, 8), (8, 32, 8), (8, 64, 4)])
@pytest.mark.parametrize("batch, seq_local", [(1, 8192), (2, 1000)])
@pytest.mark.parametrize("engine", [*MAINLOOPS, "cublas"])
def test_real_shapes(world, hq, hkv, batch, seq_local, engine, device, record_property):
    kind = dict(engine="cublas") if engine == "cublas" else dict(mainloop=engine)
    case = Case(world, hq, hkv, hidden=4096, batch=batch, seq_local=seq_local, bias=True,
                positions=torch.int32, rope_style="neox", **kind)
    vr = VirtualRanks(case, max_tokens=case.rows, device=device)
    inputs = _make_inputs(case, device, seed=world)
    vr.call(inputs)
    _check_slots(vr, _oracle_destinations(case, inputs), record_property)
    for r in range(world):
        assert not vr.status[r].any()
