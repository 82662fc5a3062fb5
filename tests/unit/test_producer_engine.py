"""The producer engine choice: the per-shape table and the dispatch that follows it."""

from __future__ import annotations

import pytest
import torch

from cake_sp.kernels import _config
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


def _call() -> CallInputs:
    x = torch.randn(6, 16).bfloat16()
    return CallInputs(x, 1, 6, 2, torch.randn(48, 16).bfloat16(), None, None, None,
                      torch.randn(6, 16), None)


@pytest.mark.parametrize("engine, projection, launched", [
    ("fused", False, "fused"), ("cublas", False, "cublas"), ("auto", False, "fused"),
    ("fused", True, "cublas"),  # a kept projection exists only on the cuBLAS engine
])
def test_dispatch(monkeypatch, engine, projection, launched):
    calls = []
    monkeypatch.setattr(producer, "qkv_norm_rope_produce",
                        lambda *a, **k: calls.append(("fused", k)))
    monkeypatch.setattr(producer, "qkv_norm_rope_produce_cublas",
                        lambda *a, **k: calls.append(("cublas", k)))
    workspace = torch.empty(6, 48) if projection else None
    producer.produce(_call(), engine=engine, plan=None, dest=None, dest_table=None,
                     dest_seq_offset=0, eps=1e-6, rope_style=0, signals=None,
                     bad_positions=None, block_m=128, projection=workspace)
    assert [name for name, _ in calls] == [launched]
    if launched == "cublas":
        assert calls[0][1]["workspace"] is workspace
