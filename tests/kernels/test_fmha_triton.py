"""The Triton routes (split-KV decode, paged context) against the ``compat_v1`` route.

Runs through the Triton interpreter on the CPU (CI) or on the GPU.  The CPU
interpreter runs every program of a grid in turn, so CI takes a seeded sample
of the shape grid plus the edge cells (largest decode tile, many splits with
empty ones, several query blocks, zero-width window, fp16 output); the GPU
test module replays the whole grid.
"""

from __future__ import annotations

import random
import zlib

import pytest
import torch
from _fmha_cases import (
    FmhaCase,
    assert_matches,
    call,
    make_call,
    one_thread,
    oracle_fp64,
    poison_unowned_slots,
    shape_grid,
)

from cake_sp.kernels.fmha import tuning

SAMPLE = 10  # per op, from the seeded shuffle of the shape grid

EDGE_DECODE = [
    FmhaCase(num_kv_heads=1, group=16, kv_lens=(4, 23), q_lens=(4, 4), sinks=True, lse=True),
    FmhaCase(kv_lens=(1, 100, 64), window_left=0, lse=True, split_tables=True),
    FmhaCase(page_size=7, kv_lens=(30, 3), q_lens=(2, 2), window_left=9, kv_layout="NHD",
             fp8_kv=True, sinks=True),
]
EDGE_CONTEXT = [
    FmhaCase(op="context", kv_lens=(40, 45), q_lens=(40, 20), lse=True, sinks=True),
    FmhaCase(op="context", kv_lens=(33, 18), q_lens=(33, 1), causal=False, window_left=4,
             page_size=3, split_tables=True, lse=True),
    FmhaCase(op="context", num_kv_heads=1, group=16, kv_lens=(20,), q_lens=(20,),
             kv_layout="NHD", fp8_kv=True, window_left=6),
]


def _sample(op: str) -> list[FmhaCase]:
    grid = shape_grid(op)
    random.Random(zlib.crc32(op.encode())).shuffle(grid)
    return grid[:SAMPLE]


CASES = _sample("decode") + EDGE_DECODE + _sample("context") + EDGE_CONTEXT


@pytest.fixture(autouse=True)
def _one_thread():
    with one_thread():
        yield


def _run_route(case, device, route, monkeypatch, seed):
    monkeypatch.setenv("CAKE_SP_FMHA_ROUTE", route)
    kw = make_call(case, device, seed)
    return kw, call(case, kw)


@pytest.mark.parametrize("case", CASES, ids=FmhaCase.label)
def test_triton_route_matches_compat(case, device, monkeypatch):
    # Many splits: every split of a short request is empty, long ones span several; the
    # combine kernel takes 16 columns at a time, so a row is merged by several programs.
    monkeypatch.setattr(tuning, "decode_programs_per_sm", lambda kv_element_size: 64)
    monkeypatch.setattr(tuning, "decode_combine_block_d", lambda block_s, head_dim: 16)
    seed = zlib.crc32(case.label().encode())
    ref_kw, _ = _run_route(case, device, "compat_v1", monkeypatch, seed)
    kw, result = _run_route(case, device, "triton", monkeypatch, seed)
    assert_matches(case, kw, result, ref_kw["out"], ref_kw["lse"])


@pytest.mark.parametrize("case", [
    # Key tiles inside one page (TMA where the GPU has it; the interpreter emulates it).
    FmhaCase(op="context", kv_lens=(37, 16), q_lens=(37, 9), lse=True),
    FmhaCase(op="context", kv_lens=(37, 16), q_lens=(20, 9), causal=False, kv_layout="NHD"),
    # Key tiles spanning pages.
    FmhaCase(op="context", kv_lens=(37, 16), q_lens=(20, 9), page_size=5),
    # Requests without query tokens, with and without cached keys, between others.
    FmhaCase(op="context", kv_lens=(37, 0, 12, 16), q_lens=(20, 0, 0, 9)),
    FmhaCase(kv_lens=(37, 16, 1), q_lens=(1, 1, 1), lse=True),
], ids=FmhaCase.label)
def test_unowned_cache_slots_never_reach_the_output(case, device, monkeypatch):
    monkeypatch.setenv("CAKE_SP_FMHA_ROUTE", "triton")
    kw = make_call(case, device, seed=zlib.crc32(case.label().encode()))
    poison_unowned_slots(case, kw)
    ref_out, ref_lse = oracle_fp64(case, kw)
    assert_matches(case, kw, call(case, kw), ref_out, ref_lse)


@pytest.mark.parametrize("case", [
    FmhaCase(kv_lens=(1, 100, 64), window_left=5, sinks=True, lse=True),
    FmhaCase(kv_lens=(30, 3), q_lens=(2, 2), page_size=7, kv_layout="NHD", fp8_kv=True,
             lse=True),
], ids=FmhaCase.label)
def test_one_split_finalizes_without_the_workspace(case, device, monkeypatch):
    """One split a (request, KV head): the first kernel writes ``out`` and the LSE itself,
    and the workspace, which it then needs none of, keeps every byte."""
    monkeypatch.setattr(tuning, "DECODE_MAX_SPLITS", 1)
    monkeypatch.setenv("CAKE_SP_FMHA_ROUTE", "triton")
    kw = make_call(case, device, seed=zlib.crc32(case.label().encode()))
    kw["workspace_buffer"].random_(0, 256)
    before = kw["workspace_buffer"].clone()
    ref_out, ref_lse = oracle_fp64(case, kw)
    assert_matches(case, kw, call(case, kw), ref_out, ref_lse)
    assert torch.equal(kw["workspace_buffer"], before)


def test_fp16_output_from_bf16_query(device, monkeypatch):
    case = FmhaCase(kv_lens=(5, 17), q_lens=(1, 1))
    monkeypatch.setenv("CAKE_SP_FMHA_ROUTE", "triton")
    kw = make_call(case, device, seed=3)
    kw["out"] = torch.full(kw["query"].shape, float("nan"), dtype=torch.float16, device=device)
    out = call(case, kw)
    monkeypatch.setenv("CAKE_SP_FMHA_ROUTE", "compat_v1")
    ref = call(case, dict(kw, out=None))
    assert out.dtype == torch.float16 and ref.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref.float(), atol=1e-2, rtol=1e-2)


def test_short_workspace_falls_back_to_compat(device, monkeypatch):
    # Long enough for several splits on any GPU (one split needs no workspace).
    case = FmhaCase(kv_lens=(3, 700), q_lens=(1, 1), lse=True)
    kw = make_call(case, device, seed=4)
    kw["workspace_buffer"] = torch.zeros(16, dtype=torch.uint8, device=device)
    monkeypatch.setenv("CAKE_SP_FMHA_ROUTE", "triton")
    with pytest.raises(RuntimeError, match="workspace_buffer is too small"):
        call(case, kw)
    monkeypatch.setenv("CAKE_SP_FMHA_ROUTE", "auto")
    with pytest.warns(RuntimeWarning, match="takes the compat route"):
        out, lse = call(case, dict(kw, return_lse=True))
    ref_kw, _ = _run_route(case, device, "compat_v1", monkeypatch, 4)
    assert torch.equal(out, ref_kw["out"]) and torch.equal(lse, ref_kw["lse"])


def test_wide_decode_tile_takes_compat(device, monkeypatch):
    case = FmhaCase(num_kv_heads=1, group=16, kv_lens=(6, 9), q_lens=(5, 5))
    kw = make_call(case, device, seed=5)
    monkeypatch.setenv("CAKE_SP_FMHA_ROUTE", "triton")
    with pytest.raises(RuntimeError, match="outside the Triton capability matrix"):
        call(case, kw)
    monkeypatch.setenv("CAKE_SP_FMHA_ROUTE", "auto")
    out = call(case, kw)
    ref_kw, _ = _run_route(case, device, "compat_v1", monkeypatch, 5)
    assert torch.equal(out, ref_kw["out"])
