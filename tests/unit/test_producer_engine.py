"""The producer engine choice: the per-shape table and the dispatch that follows it."""

from __future__ import annotations

import pytest
import torch

from cake_sp.kernels import _config
from cake_sp.layouts import HeadPlan
from cake_sp.session import producer
from cake_sp.session.slots import CallInputs


# (rows, Hq + 2 Hkv, engine) on 132 SMs, the H200 rows the rule was fitted on (D = 128):
# 256-row tiles filling their last wave to 0.61-0.81 take cuBLAS, to 0.91-0.97 the fused
# kernel; above 1,536 rows the fused kernel whatever the fill.
@pytest.mark.parametrize("rows, heads, engine", [
    (512, 40, "cublas"), (512, 48, "cublas"), (512, 64, "fused"), (512, 80, "cublas"),
    (1024, 40, "cublas"), (1024, 48, "cublas"), (1024, 64, "fused"), (1024, 80, "cublas"),
    (1536, 40, "fused"), (1536, 48, "cublas"), (1536, 64, "fused"), (1536, 80, "fused"),
    (1537, 48, "fused"), (2048, 40, "fused"), (10**7, 48, "fused"),
])
def test_engine_by_wave_fill_on_a_gpu(monkeypatch, rows, heads, engine):
    monkeypatch.setattr(_config, "INTERPRET", False)  # a GPU's tiles, not the interpreter's
    assert _config.producer_engine(rows, heads, 128, 132, on_gpu=True) == engine


def test_wave_fill_counts_the_head_size_tiles(monkeypatch):
    monkeypatch.setattr(_config, "INTERPRET", False)
    # D = 256: 64-row tiles, so 512 rows of 16 heads are 128 tiles, 0.97 of 132 SMs.
    assert _config.producer_engine(512, 16, 256, 132, on_gpu=True) == "fused"
    assert _config.producer_engine(512, 16, 128, 132, on_gpu=True) == "cublas"


def test_cpu_interpreter_runs_the_fused_kernel():
    assert _config.producer_engine(1, 40, 128, 0, on_gpu=False) == "fused"


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


@pytest.mark.parametrize("engine, max_tokens, rows", [
    ("fused", 4096, 0), ("cublas", 4096, 4096), ("cublas", 100, 100),
    ("auto", 4096, 1536),   # the most rows "auto" may give the cuBLAS engine
    ("auto", 100, 100),     # max_tokens below that
])
def test_workspace_holds_the_most_rows_the_engine_may_get(engine, max_tokens, rows):
    assert _config.PRODUCER_CUBLAS_MAX_ROWS == 1536
    assert producer._cublas_rows(engine, max_tokens=max_tokens, on_gpu=True) == rows


def test_a_call_beyond_the_workspace_raises(monkeypatch):
    _record(monkeypatch)
    produce = producer.Producer("cublas", PLAN, max_tokens=4, device=torch.device("cpu"))
    with pytest.raises(RuntimeError, match="workspace holds 4 rows, the call has 6"):
        _run(produce, _call(6))


def test_engine_override_replaces_auto_only(monkeypatch):
    calls = _record(monkeypatch)
    monkeypatch.setattr(_config, "PRODUCER_ENGINE_OVERRIDE", "cublas")
    overridden = producer.Producer("auto", PLAN, max_tokens=8, device=torch.device("cpu"))
    named = producer.Producer("fused", PLAN, max_tokens=8, device=torch.device("cpu"))
    _run(overridden, _call())
    _run(named, _call())
    assert [name for name, _ in calls] == ["cublas", "fused"]
    assert overridden.workspace.shape == (8, 64)


def test_bad_engine_override_is_named(monkeypatch):
    monkeypatch.setattr(_config, "PRODUCER_ENGINE_OVERRIDE", "cutlass")
    with pytest.raises(ValueError, match="CAKE_SP_PRODUCER_ENGINE"):
        producer.Producer("auto", PLAN, max_tokens=8, device=torch.device("cpu"))


EVERY_MAINLOOP = ("warp_specialized", "tma", "pointer")


@pytest.mark.parametrize("allowed, rows, mainloop", [
    (EVERY_MAINLOOP, 1024, "warp_specialized"), (EVERY_MAINLOOP, 10**6, "warp_specialized"),
    (EVERY_MAINLOOP, 1023, "tma"),                  # below PRODUCER_WS_MIN_ROWS
    (("tma", "pointer"), 4096, "tma"), (("pointer",), 4096, "pointer"),
])
def test_default_mainloop(allowed, rows, mainloop):
    assert _config.PRODUCER_WS_MIN_ROWS == 1024
    assert _config.producer_mainloop(allowed, rows) == mainloop


def test_mainloop_override_applies_where_allowed(monkeypatch):
    monkeypatch.setattr(_config, "PRODUCER_MAINLOOP_OVERRIDE", "warp_specialized")
    assert _config.producer_mainloop(EVERY_MAINLOOP, 16) == "warp_specialized"
    assert _config.producer_mainloop(("tma", "pointer"), 16) == "tma"


def test_no_allowed_mainloop_raises():
    with pytest.raises(ValueError, match="none of"):
        _config.producer_mainloop((), 16)


@pytest.mark.parametrize("interpret, head_dim, block_m, tile_m", [
    (False, 128, 64, 256), (False, 64, 16, 256), (False, 256, 64, 64), (False, 256, 128, 128),
    (True, 128, 64, 128), (True, 128, 256, 256),
])
def test_tile_rows_hold_whole_readiness_blocks(monkeypatch, interpret, head_dim, block_m,
                                               tile_m):
    monkeypatch.setattr(_config, "INTERPRET", interpret)
    got = _config.producer_tile_m(head_dim, block_m)
    assert got == tile_m and got % block_m == 0


@pytest.mark.parametrize("rows, tile_rows, heads, sms, fill", [
    (256, 256, 132, 132, 1.0), (2048, 256, 40, 132, 320 / 396), (1, 256, 1, 132, 1 / 132),
    (257, 256, 132, 132, 1.0), (2049, 128, 40, 132, 680 / 792),   # a tail row block
])
def test_wave_fill(rows, tile_rows, heads, sms, fill):
    assert _config.wave_fill(rows, tile_rows, heads, sms) == pytest.approx(fill)


@pytest.mark.parametrize("rows, heads, tile_m", [
    (2048, 40, 128),     # 256-row tiles fill 0.81 of their last waves, 128-row ones 0.97
    (1024, 48, 128),     # 0.73 against 0.97
    (2048, 48, 256),     # both 0.97
    (16384, 40, 256),    # 0.97 against 0.99: within the margin
    (512, 40, 256),      # both 0.61
])
def test_ws_tile_by_wave_fill(rows, heads, tile_m):
    assert _config.PRODUCER_WS_FILL_MARGIN == 0.1
    tile = _config.producer_ws_tile(rows, heads, 132, both_norms=True)
    assert tile.tile_m == tile_m
    assert tile in (_config.PRODUCER_WS_TILE, _config.PRODUCER_WS_NORM_TILE)


@pytest.mark.parametrize("switch, head_pairs, expected", [
    (True, True, "PRODUCER_WS_PAIR_TILE"), (True, False, "PRODUCER_WS_NORM_TILE"),
    (False, True, "PRODUCER_WS_NORM_TILE"),
])
def test_ws_head_pair_tile_where_the_shape_allows_and_the_switch_is_on(
        monkeypatch, switch, head_pairs, expected):
    monkeypatch.setattr(_config, "PRODUCER_WS_HEAD_PAIRS", switch)
    assert _config.producer_ws_tile(16384, 40, 132, True, head_pairs) \
        == getattr(_config, expected)
    # Its fill is counted over pairs: 128-row tiles of 20 pairs, as many tiles as 256 x 1.
    assert _config.producer_ws_tile(2048, 40, 132, True, head_pairs) == _config.PRODUCER_WS_TILE
    assert _config.producer_ws_tile(16384, 40, 132, False, head_pairs) \
        == _config.PRODUCER_WS_TILE


def test_ws_tile_without_both_norms_is_the_fp32_hand_off(monkeypatch):
    for rows in (512, 2048, 16384):
        assert _config.producer_ws_tile(rows, 40, 132, both_norms=False) \
            == _config.PRODUCER_WS_TILE
    monkeypatch.setattr(_config, "PRODUCER_WS_NORM_IN_MMA", False)
    assert _config.producer_ws_tile(16384, 40, 132, both_norms=True) == _config.PRODUCER_WS_TILE


@pytest.mark.parametrize("head_dim, block_m, tile_m", [
    (128, 64, 64), (64, 64, 128), (256, 64, 64), (128, 128, 128), (128, 16, 64),
])
def test_epilogue_tile_rows_hold_whole_readiness_blocks(head_dim, block_m, tile_m):
    assert _config.PRODUCER_EPILOGUE_TILE_VALUES == 64 * 128
    got = _config.producer_epilogue_tile_m(head_dim, block_m)
    assert got == tile_m and got % block_m == 0
