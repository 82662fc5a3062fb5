"""The ``compat_v1`` route against an independent float64 per-request loop.

The compat route is the oracle of the Triton route tests, so it is itself
held to ``_fmha_cases.oracle_fp64`` on the whole shape grid (host torch, fast).
"""

from __future__ import annotations

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
    shape_grid,
)

CASES = shape_grid("decode") + shape_grid("context")


@pytest.fixture(autouse=True)
def _force_compat(monkeypatch):
    monkeypatch.setenv("CAKE_SP_FMHA_ROUTE", "compat_v1")
    with one_thread():
        yield


@pytest.mark.parametrize("case", CASES, ids=FmhaCase.label)
def test_compat_matches_fp64_loop(case):
    kw = make_call(case, torch.device("cpu"), seed=zlib.crc32(case.label().encode()))
    result = call(case, kw)
    ref_out, ref_lse = oracle_fp64(case, kw)
    assert_matches(case, kw, result, ref_out, ref_lse)


@pytest.mark.parametrize("window_left", [0, 3])
def test_compat_context_window_non_causal(window_left):
    case = FmhaCase(op="context", kv_lens=(12, 30), q_lens=(4, 9), causal=False,
                    window_left=window_left, sinks=True, lse=True)
    kw = make_call(case, torch.device("cpu"), seed=7)
    assert_matches(case, kw, call(case, kw), *oracle_fp64(case, kw))
