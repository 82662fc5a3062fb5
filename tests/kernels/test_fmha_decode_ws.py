"""The warp-specialised decode kernel (``decode_ws``): which calls it serves and takes (host,
any machine), and on an sm_90 GPU its output against the fp64 oracle with NaN in every cache
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

from cake_sp.kernels.fmha import api, decode_ws, tuning

SERVED = FmhaCase(op="decode", head_dim=128, num_kv_heads=2, group=4, page_size=64,
                  kv_lens=(700, 65, 1), q_lens=(1, 1, 1))


@pytest.fixture
def problem_of(monkeypatch):
    """``problem_of(case)``: the validated ``PagedAttention`` the public call builds from
    ``case``'s arguments on the CPU (the route is not run)."""
    monkeypatch.setattr(api, "_run", lambda problem, cell, return_lse: problem)
    return lambda case: call(case, make_call(case, torch.device("cpu")))


@pytest.mark.parametrize(("change", "served"), [
    ({}, True),
    ({"head_dim": 64}, True),
    ({"page_size": 16}, True),            # 4 TMA copies a tile
    ({"page_size": 256}, True),           # 4 tiles a page
    ({"kv_layout": "NHD"}, True),
    ({"lse": True}, True),
    ({"q_lens": (2, 2, 2)}, True),        # several query tokens a request
    ({"q_lens": (8, 8, 8)}, True),        # 32 query rows at D = 128
    ({"q_lens": (9, 9, 9)}, False),       # 36: more than the accumulator's registers hold
    ({"q_lens": (16, 16, 16), "head_dim": 64}, True),  # 64 rows at D = 64
    ({"head_dim": 256}, False),
    ({"q_dtype": torch.float16}, False),
    ({"fp8_kv": True}, False),
    ({"window_left": 8}, False),
    ({"sinks": True}, False),
    ({"page_size": 8}, False),            # 8 copies of 8 rows a tile
    ({"page_size": 48}, False),           # neither divides the other
])
def test_serves(change, served, problem_of):
    case = dataclasses.replace(SERVED, **change)
    assert decode_ws.serves(problem_of(case)) is served


def test_serves_needs_a_positive_scale(problem_of):
    problem = dataclasses.replace(problem_of(SERVED), bmm1_scale=-0.1)
    assert not decode_ws.serves(problem)


GPU_CASES = [
    # One tile a page, ragged lengths (a request of one key, one of a tile and one more).
    FmhaCase(op="decode", head_dim=128, num_kv_heads=8, group=4, page_size=64,
             kv_lens=(700, 65, 64, 1), q_lens=(1, 1, 1, 1), lse=True),
    # Pages of 16 (4 copies a tile), D = 64, eight heads a group, separate K/V tables.
    FmhaCase(op="decode", head_dim=64, num_kv_heads=2, group=8, page_size=16,
             kv_lens=(333, 17, 5), q_lens=(1, 1, 1), split_tables=True),
    # Four tiles a page; two query tokens a request (causal among them).
    FmhaCase(op="decode", head_dim=128, num_kv_heads=2, group=4, page_size=256,
             kv_lens=(600, 2, 257), q_lens=(2, 2, 2), lse=True),
    # The most query rows served at D = 128: 8 tokens x 4 heads.
    FmhaCase(op="decode", head_dim=128, num_kv_heads=2, group=4, page_size=64,
             kv_lens=(8, 300), q_lens=(8, 8)),
    # NHD pages of 32 as a (K, V) tuple (one KV head: TMA reads NHD rows only then,
    # context.tma_fits).
    FmhaCase(op="decode", head_dim=128, num_kv_heads=1, group=8, page_size=32,
             kv_lens=(129, 1000), q_lens=(1, 1), kv_layout="NHD", tuple_kv=True),
]


@pytest.mark.gpu
@pytest.mark.parametrize("split_keys", [1 << 30, 128], ids=["one-split", "splits-of-128"])
@pytest.mark.parametrize("case", GPU_CASES, ids=FmhaCase.label)
def test_matches_the_oracle_and_never_reads_unowned_slots(case, split_keys, monkeypatch):
    """One split (the kernel finalises) and splits of two tiles (the combine kernel merges its
    partials), with NaN in every partial slot no split writes."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the warp-specialised kernel is sm_90 only")
    ran = []
    real = decode_ws.decode_ws
    monkeypatch.setattr(decode_ws, "decode_ws", lambda p, splits, *a: (ran.append(splits),
                                                                        real(p, splits, *a)))
    monkeypatch.setattr(tuning, "DECODE_WARP_SPECIALIZED", True)
    monkeypatch.setattr(tuning, "DECODE_WS_SPLIT_KEYS", split_keys)
    monkeypatch.setattr(tuning, "sm_count", lambda device: 1)  # any grid fills one SM
    monkeypatch.setenv("CAKE_SP_FMHA_ROUTE", "triton")
    kw = make_call(case, torch.device("cuda"), seed=zlib.crc32(case.label().encode()))
    poison_unowned_slots(case, kw)
    kw["workspace_buffer"].fill_(255)
    ref_out, ref_lse = oracle_fp64(case, kw)
    assert_matches(case, kw, call(case, kw), ref_out, ref_lse)
    assert len(ran) == 1, "the call did not take the warp-specialised kernel"
    assert ran[0] == (1 if split_keys > max(case.kv_lens) else -(-max(case.kv_lens) // 128))


@pytest.mark.parametrize(("max_kv_len", "split_keys", "splits"), [
    (8192, 8192, 1), (8193, 8192, 2), (32768, 8192, 4), (1, 8192, 1), (300, 128, 3)])
def test_a_full_grid_splits_only_to_bound_the_keys_of_a_program(max_kv_len, split_keys, splits,
                                                                 monkeypatch):
    monkeypatch.setattr(tuning, "DECODE_WS_SPLIT_KEYS", split_keys)
    tiles = -(-max_kv_len // 64)
    assert tuning.decode_ws_splits(128, tiles, max_kv_len, 132) == splits  # B = 16, 8 KV heads


@pytest.mark.parametrize(("split_keys", "splits"), [(4096, 6), (32, 12)])
def test_a_small_grid_splits_to_fill_the_program_slots(split_keys, splits, monkeypatch):
    """2 programs on 4 SMs of 3 program slots each, 6 key tiles: 6 splits fill all 12 slots
    (2, 3 and 4 splits fill at most half); a tighter key bound still asks for more."""
    monkeypatch.setattr(tuning, "DECODE_WS_SPLIT_KEYS", split_keys)
    monkeypatch.setattr(tuning, "DECODE_WS_FILL_PROGRAMS_PER_SM", 3)
    assert tuning.decode_ws_splits(2, 6, 384, 4) == splits


@pytest.mark.parametrize(("programs", "max_kv_len", "splits"), [
    (8, 1024, 16), (8, 8192, 16), (8, 32768, 16), (32, 8192, 4), (32, 32768, 8)])
def test_few_requests_split_to_give_each_sm_one_program(programs, max_kv_len, splits):
    """B = 1 and 4 with 8 KV heads on 132 SMs: 16 and 4 splits fill 128 of 132 program slots
    (4 splits of B = 4 at 32k keys would pass 4,096 keys each: 8)."""
    assert tuning.decode_ws_splits(programs, -(-max_kv_len // 64), max_kv_len, 132) == splits
