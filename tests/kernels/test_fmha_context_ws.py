"""The warp-specialised context kernel (``context_ws``): which calls it serves (host, any
machine), and on an sm_90 GPU its output against the fp64 oracle with NaN in every cache
slot no request owns."""

from __future__ import annotations

import dataclasses
import zlib

import pytest
import torch
from _fmha_cases import (
    FmhaCase,
    assert_matches,
    call,
    make_call,
    oracle_fp64,
    poison_unowned_slots,
)

from cake_sp.kernels.fmha import api, context_ws, tuning

SERVED = FmhaCase(op="context", head_dim=128, page_size=128, kv_lens=(300, 5), q_lens=(300, 5))


@pytest.fixture
def problem_of(monkeypatch):
    """``problem_of(case, **overrides)``: the validated ``PagedAttention`` that the public
    call builds from ``case``'s arguments on the CPU (the route is not run)."""
    monkeypatch.setattr(api, "_run", lambda problem, cell, return_lse: problem)

    def build(case: FmhaCase, **overrides):
        kw = make_call(case, torch.device("cpu"))
        kw.update(overrides)
        return call(case, kw)
    return build


@pytest.mark.parametrize(("change", "served"), [
    ({}, True),
    ({"head_dim": 64}, True),
    ({"page_size": 16}, True),            # 8 TMA copies a tile
    ({"page_size": 384}, True),           # 3 tiles a page
    ({"split_tables": True}, True),
    ({"causal": False}, True),
    ({"head_dim": 256}, False),
    ({"q_dtype": torch.float16}, False),
    ({"fp8_kv": True}, False),
    ({"window_left": 8}, False),
    ({"sinks": True}, False),
    ({"lse": True}, False),
    ({"page_size": 8}, False),            # 16 copies a tile
    ({"page_size": 48}, False),           # neither divides the other
])
def test_serves(change, served, problem_of):
    case = dataclasses.replace(SERVED, **change)
    assert context_ws.serves(problem_of(case)) is served


def test_serves_needs_query_tokens(problem_of):
    empty = dataclasses.replace(SERVED, kv_lens=(3, 0), q_lens=(0, 0))
    # The API takes a bound max_q_len >= 1 even when no request has query tokens.
    assert not context_ws.serves(problem_of(empty, max_q_len=1))


@pytest.mark.parametrize("scale", [0.0, -0.1])
def test_serves_needs_a_positive_scale(scale, problem_of):
    """The kernel takes the row maximum of the unscaled logits (``_softmax_step``)."""
    assert not context_ws.serves(problem_of(SERVED, bmm1_scale=scale))


def test_serves_needs_a_contiguous_query(problem_of):
    base = make_call(SERVED, torch.device("cpu"))
    strided = torch.empty(*base["query"].shape[:2], 256, dtype=torch.bfloat16)[..., :128]
    strided.copy_(base["query"])
    assert not context_ws.serves(problem_of(SERVED, query=strided,
                                            out=torch.empty_like(strided)))


@pytest.mark.parametrize(("programs", "max_q_len", "threshold", "grid", "qblock_major"), [
    (64, 300, 256, (3, 64), True),
    (64, 300, 301, (64, 3), False),
    (65535, 1000, 0, (8, 65535), True),
    (65536, 1000, 0, (65536, 8), False),     # would not fit the grid's second dimension
    (4, 0, 0, (1, 4), True),                 # one block at least
])
def test_launch_grid(programs, max_q_len, threshold, grid, qblock_major, monkeypatch):
    monkeypatch.setattr(tuning, "CONTEXT_QBLOCK_MAJOR_MIN_Q_LEN", threshold)
    assert context_ws.launch_grid(programs, max_q_len) == (grid, qblock_major)


def test_long_requests_go_query_block_first():
    assert tuning.CONTEXT_QBLOCK_MAJOR_MIN_Q_LEN == 16384
    assert context_ws.launch_grid(32, 16384)[1] and not context_ws.launch_grid(32, 8192)[1]


GPU_CASES = [
    # One tile a page; several tiles a page; several pages a tile (one TMA copy each).
    FmhaCase(op="context", num_kv_heads=8, group=4, head_dim=128, page_size=128,
             kv_lens=(700, 129, 1), q_lens=(700, 1, 1)),
    FmhaCase(op="context", num_kv_heads=2, group=8, head_dim=128, page_size=256,
             kv_lens=(600, 300), q_lens=(450, 300), causal=False),
    FmhaCase(op="context", num_kv_heads=4, group=2, head_dim=64, page_size=16,
             kv_lens=(777, 40, 17), q_lens=(500, 40, 3), split_tables=True),
    FmhaCase(op="context", num_kv_heads=1, group=16, head_dim=128, page_size=32,
             kv_lens=(300, 64), q_lens=(129, 64), tuple_kv=True),
    FmhaCase(op="context", num_kv_heads=2, group=1, head_dim=64, page_size=64,
             kv_lens=(1000, 0), q_lens=(200, 0), causal=False),
    # Fewer query tokens than one 128-row Q box (TMA fills the rest with zeros).
    FmhaCase(op="context", num_kv_heads=2, group=2, head_dim=128, page_size=16,
             kv_lens=(40, 17), q_lens=(20, 3)),
]


@pytest.mark.gpu
@pytest.mark.parametrize("qblock_major", [True, False])
@pytest.mark.parametrize("case", GPU_CASES, ids=FmhaCase.label)
def test_matches_the_oracle_and_never_reads_unowned_slots(case, qblock_major, monkeypatch):
    """Both grid orders (``tuning.CONTEXT_QBLOCK_MAJOR_MIN_Q_LEN``)."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the warp-specialised kernel is sm_90 only")
    ran = []
    real = context_ws.context_ws
    monkeypatch.setattr(context_ws, "context_ws", lambda p: (ran.append(p), real(p)))
    monkeypatch.setattr(tuning, "CONTEXT_WARP_SPECIALIZED", True)
    monkeypatch.setattr(tuning, "CONTEXT_QBLOCK_MAJOR_MIN_Q_LEN", 0 if qblock_major else 2**31)
    monkeypatch.setenv("CAKE_SP_FMHA_ROUTE", "triton")
    kw = make_call(case, torch.device("cuda"), seed=zlib.crc32(case.label().encode()))
    poison_unowned_slots(case, kw)
    ref_out, ref_lse = oracle_fp64(case, kw)
    assert_matches(case, kw, call(case, kw), ref_out, ref_lse)
    assert len(ran) == 1, "the call did not take the warp-specialised kernel"
