"""The producer engine choice: the per-shape table and the dispatch that follows it."""

from __future__ import annotations

import pytest
import torch

from cake_sp.kernels import _config
from cake_sp.layouts import HeadPlan
from cake_sp.session import producer
from cake_sp.session.slots import CallInputs


@pytest.mark.parametrize("rows, engine", [(1, "cublas"), (512, "cublas"), (513, "fused"),
                                          (2048, "fused"), (10**7, "fused")])
def test_table_picks_by_rows_on_a_gpu(rows, engine):
    assert _config.producer_engine(rows, on_gpu=True) == engine


def test_cpu_interpreter_runs_the_fused_kernel():
    assert _config.producer_engine(1, on_gpu=False) == "fused"


def test_last_table_row_takes_larger_calls(monkeypatch):
    monkeypatch.setattr(_config, "PRODUCER_ENGINE_TABLE", ((64, "fused"), (128, "cublas")))
    assert [_config.producer_engine(r, on_gpu=True) for r in (64, 65, 128, 129)] == \
        ["fused", "cublas", "cublas", "cublas"]


PLAN = HeadPlan(2, 2, 1, 16)  # 4 projection heads of 16: N = 64


def _call(rows: int = 6) -> CallInputs:
    x = torch.randn(rows, 16).bfloat16()
    return CallInputs(x, 1, rows, 2, torch.randn(64, 16).bfloat16(), None, None, None,
                      torch.randn(rows, 16), None)


def _record(monkeypatch) -> list:
    calls = []
    monkeypatch.setattr(producer, "qkv_norm_rope_produce",
                        lambda *a, **k: calls.append(("fused", k)))
    monkeypatch.setattr(producer, "qkv_norm_rope_produce_cublas",
                        lambda *a, **k: calls.append(("cublas", k)))
    return calls


def _run(produce, call, projection=None) -> None:
    produce(call, dest=None, dest_table=None, dest_seq_offset=0, eps=1e-6, rope_style=0,
            signals=None, bad_positions=None, block_m=128, projection=projection)


@pytest.mark.parametrize("engine, projection, launched", [
    ("fused", False, "fused"), ("cublas", False, "cublas"), ("auto", False, "fused"),
    ("fused", True, "cublas"),  # a kept projection exists only on the cuBLAS engine
])
def test_dispatch(monkeypatch, engine, projection, launched):
    calls = _record(monkeypatch)
    produce = producer.Producer(engine, PLAN, max_tokens=8, device=torch.device("cpu"))
    kept = torch.empty(6, 64) if projection else None
    _run(produce, _call(), kept)
    assert [name for name, _ in calls] == [launched]
    if launched == "cublas":
        workspace = calls[0][1]["workspace"]
        if kept is not None:
            assert workspace is kept
        else:  # the session's own workspace, allocated once, a row slice of it per call
            assert workspace.data_ptr() == produce.workspace.data_ptr()
            assert tuple(workspace.shape) == (6, 64)


@pytest.mark.parametrize("engine, table, rows", [
    ("fused", ((2**62, "cublas"),), 0), ("cublas", ((2**62, "fused"),), 100),
    ("auto", ((512, "cublas"), (2**62, "fused")), 100),   # max_tokens below the row limit
    ("auto", ((64, "cublas"), (2**62, "fused")), 64),
    ("auto", ((64, "fused"), (2**62, "cublas")), 100),    # the last row takes larger calls
])
def test_workspace_holds_the_most_rows_the_engine_may_get(monkeypatch, engine, table, rows):
    monkeypatch.setattr(_config, "PRODUCER_ENGINE_TABLE", table)
    got = producer._cublas_rows(engine, max_tokens=100, on_gpu=True)
    assert got == rows


def test_a_call_beyond_the_workspace_raises(monkeypatch):
    _record(monkeypatch)
    produce = producer.Producer("cublas", PLAN, max_tokens=4, device=torch.device("cpu"))
    with pytest.raises(RuntimeError, match="workspace holds 4 rows, the call has 6"):
        _run(produce, _call(6))
