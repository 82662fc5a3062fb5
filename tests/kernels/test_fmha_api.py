"""Argument validation and return values of the public paged FMHA calls (compat route, host)."""

from __future__ import annotations

import warnings

import pytest
import torch
from _fmha_cases import FmhaCase, call, make_call, one_thread

from cake_sp.kernels.fmha import api

DECODE = FmhaCase(kv_lens=(3, 20), q_lens=(1, 1))
CONTEXT = FmhaCase(op="context", kv_lens=(6, 9), q_lens=(2, 9))


@pytest.fixture(autouse=True)
def _compat(monkeypatch):
    monkeypatch.setenv("CAKE_SP_FMHA_ROUTE", "compat_v1")
    with one_thread():
        yield


def _kw(case=DECODE, **changes):
    kw = make_call(case, torch.device("cpu"), seed=11)
    kw.update(changes)
    return kw


def _bad(case, exc, match, **changes):
    kw = _kw(case, **changes)
    out_before = kw["out"].clone() if isinstance(kw.get("out"), torch.Tensor) else None
    with pytest.raises(exc, match=match):
        call(case, kw)
    if out_before is not None and kw["out"].shape == out_before.shape:
        assert torch.equal(kw["out"].isnan(), out_before.isnan()), "rejected call wrote out"


@pytest.mark.parametrize(("changes", "exc", "match"), [
    (dict(query=torch.zeros(2, 4, 64)), TypeError, r"query must have dtype.*float32"),
    (dict(query=torch.zeros(2, 4, 96, dtype=torch.bfloat16)), ValueError, "head_dim must be one"),
    (dict(query=torch.zeros(3, 4, 64, dtype=torch.bfloat16)), ValueError,
     r"B \* q_len_per_req = 2 \* 1"),
    (dict(kv_layout="BHSD"), ValueError, "kv_layout must be one of"),
    (dict(kv_cache=torch.zeros(4, 3, 2, 16, 64, dtype=torch.bfloat16)), ValueError,
     r"\[pages, 2, \.\.\.\]"),
    (dict(kv_cache=torch.zeros(4, 2, 2, 16, 64, dtype=torch.float16)), TypeError,
     "kv_cache dtype must be"),
    (dict(kv_cache=torch.zeros(4, 2, 3, 16, 64, dtype=torch.bfloat16)), ValueError,
     r"multiple of kv heads \(3\)"),
    (dict(block_tables=torch.zeros(2, 4)), TypeError, "block_tables must have dtype"),
    (dict(uses_shared_paged_kv_idx=False), ValueError, r"\[B, 2, max_pages\]"),
    (dict(seq_lens=torch.tensor([3], dtype=torch.int32)), ValueError, r"seq_lens must be \[B=2\]"),
    (dict(max_seq_len=10**6), ValueError, "exceeds the page table's capacity"),
    (dict(max_seq_len=0), ValueError, "max_seq_len must be an int >= 1"),
    (dict(window_left=-2), ValueError, "window_left must be an int >= -1"),
    (dict(sinks=torch.zeros(3)), ValueError, r"sinks must be \[Hq=4\]"),
    (dict(sinks=torch.zeros(4, dtype=torch.float64)), TypeError, "sinks must have dtype"),
    (dict(out=torch.zeros(2, 4, 32, dtype=torch.bfloat16)), ValueError, "out must be"),
    (dict(out_dtype=torch.float32), TypeError, "out_dtype must be"),
    (dict(lse=torch.zeros(2, 5)), ValueError, "lse must be contiguous"),
    (dict(q_len_per_req=0), ValueError, "q_len_per_req must be an int >= 1"),
    (dict(bmm1_scale="x"), TypeError, "bmm1_scale must be a float"),
    (dict(bmm1_scale=torch.ones(1)), NotImplementedError, "bmm1_scale as a device tensor"),
    (dict(out_dtype="nvfp4", out=None), NotImplementedError, "nvfp4"),
    (dict(o_sf_scale=1.0), NotImplementedError, r"o_sf_scale=1\.0 \(NVFP4 output"),
    (dict(sparse_mla_top_k=64), NotImplementedError, "block-sparse"),
    (dict(cp_world=2), NotImplementedError, r"\(DCP\)"),
    (dict(cum_seq_lens_q=torch.zeros(3, dtype=torch.int32)), NotImplementedError,
     "variable-length decode"),
    (dict(not_an_argument=1), TypeError, "unexpected keyword argument 'not_an_argument'"),
])
def test_decode_rejects(changes, exc, match):
    _bad(DECODE, exc, match, **changes)


@pytest.mark.parametrize(("changes", "exc", "match"), [
    (dict(batch_size=3), ValueError, r"cum_seq_lens_kv must be \[batch_size \+ 1 = 4\]"),
    (dict(cum_seq_lens_q=torch.zeros(4, dtype=torch.int32)), ValueError,
     r"cum_seq_lens_q must be \[B \+ 1 = 3\]"),
    (dict(cum_seq_lens_kv=torch.zeros(3)), TypeError, "cum_seq_lens_kv must have dtype"),
    (dict(causal=1), TypeError, "causal must be a bool"),
    (dict(max_kv_len=10**6), ValueError, "max_kv_len .* exceeds"),
    (dict(enable_dcp=True), NotImplementedError, "DCP"),
])
def test_context_rejects(changes, exc, match):
    _bad(CONTEXT, exc, match, **changes)


@pytest.mark.parametrize("case", [DECODE, CONTEXT], ids=lambda c: c.op)
def test_returns_and_defaults(case):
    kw = _kw(case, out=None, lse=None, enable_pdl=True, backend="auto", o_sf_scale=None)
    out = call(case, kw)
    assert isinstance(out, torch.Tensor) and out.shape == kw["query"].shape
    assert out.dtype == kw["query"].dtype and not out.isnan().any()
    out2, lse = call(case, dict(kw, return_lse=True))
    assert torch.equal(out, out2)
    assert lse.shape == kw["query"].shape[:2] and lse.dtype == torch.float32
    given = torch.full_like(lse, float("nan"))
    out3 = call(case, dict(kw, lse=given))
    assert torch.equal(out3, out) and torch.equal(given, lse)


@pytest.mark.parametrize("fits", [True, False])
def test_a_workspace_too_small_for_the_triton_route_warns_as_it_falls_back(fits, monkeypatch):
    """Only the workspace decides here: the route is what the capability matrix plans, or the
    compat one with a RuntimeWarning naming both sizes; no kernel runs (the runners record)."""
    monkeypatch.delenv("CAKE_SP_FMHA_ROUTE")
    monkeypatch.setattr(api, "INTERPRET", True)  # Triton "runs" on these CPU tensors
    need = 1 << 20
    monkeypatch.setattr(api, "decode_workspace_bytes", lambda problem: need)
    ran = []
    for route in list(api._RUNNERS):
        monkeypatch.setitem(api._RUNNERS, route, lambda problem, route=route: ran.append(route))
    kw = _kw(workspace_buffer=torch.empty(need if fits else need - 1, dtype=torch.uint8))
    if fits:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            call(DECODE, kw)
        assert ran == [api.DECODE_TRITON]
    else:
        with pytest.warns(RuntimeWarning, match=rf"holds {need - 1} bytes.*needs {need}"):
            call(DECODE, kw)
        assert ran == [api.COMPAT]
