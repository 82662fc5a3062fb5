"""Paged FMHA on a GPU: the whole shape grid, real shapes, and CUDA-graph capture/replay."""

from __future__ import annotations

import math
import zlib

import pytest
import torch
from _fmha_cases import (
    TOLERANCES,
    FmhaCase,
    assert_matches,
    call,
    make_call,
    oracle_fp64,
    shape_grid,
)

from cake_sp.kernels.fmha import tuning

pytestmark = pytest.mark.gpu


def _triton_vs_compat(case, monkeypatch, seed):
    monkeypatch.setenv("CAKE_SP_FMHA_ROUTE", "compat_v1")
    ref = make_call(case, torch.device("cuda"), seed)
    call(case, ref)
    monkeypatch.setenv("CAKE_SP_FMHA_ROUTE", "triton")
    kw = make_call(case, torch.device("cuda"), seed)
    assert_matches(case, kw, call(case, kw), ref["out"], ref["lse"])


@pytest.mark.parametrize("case", shape_grid("decode") + shape_grid("context"),
                         ids=FmhaCase.label)
def test_grid_on_gpu(case, monkeypatch):
    _triton_vs_compat(case, monkeypatch, zlib.crc32(case.label().encode()))


REAL = [
    FmhaCase(num_kv_heads=8, group=4, head_dim=128, page_size=64,
             kv_lens=(8192, 1, 8191, 4097) * 4, q_lens=(1,) * 16, lse=True),
    FmhaCase(num_kv_heads=8, group=8, head_dim=128, page_size=16, fp8_kv=True,
             kv_lens=(32768, 1000), q_lens=(1, 1), sinks=True),
    FmhaCase(num_kv_heads=8, group=4, head_dim=128, page_size=32, kv_lens=(8192, 300) * 4,
             q_lens=(4,) * 8, window_left=1024, split_tables=True),
    FmhaCase(op="context", num_kv_heads=8, group=4, head_dim=128, page_size=64,
             kv_lens=(4096, 1500, 2600), q_lens=(4096, 700, 2600), lse=True),
    FmhaCase(op="context", num_kv_heads=8, group=8, head_dim=128, page_size=16, fp8_kv=True,
             kv_lens=(3000,), q_lens=(3000,), causal=False, window_left=512, sinks=True),
    FmhaCase(op="context", num_kv_heads=4, group=2, head_dim=256, page_size=64,
             kv_lens=(2048, 64), q_lens=(1024, 64), kv_layout="NHD"),
    # Served by the warp-specialised kernel on sm_90 (context_ws.serves).
    FmhaCase(op="context", num_kv_heads=8, group=4, head_dim=128, page_size=64,
             kv_lens=(4096, 1500, 2600), q_lens=(4096, 700, 2600)),
]


@pytest.mark.parametrize("warp_specialized", [True, False])
@pytest.mark.parametrize("case", REAL, ids=FmhaCase.label)
def test_real_shapes(case, warp_specialized, monkeypatch):
    """Also with the warp-specialised kernels off, so the tl.dot kernels stay tested on the
    calls the others serve."""
    monkeypatch.setattr(tuning, "CONTEXT_WARP_SPECIALIZED", warp_specialized)
    monkeypatch.setattr(tuning, "DECODE_WARP_SPECIALIZED", warp_specialized)
    _triton_vs_compat(case, monkeypatch, 1)


@pytest.mark.parametrize("case", [
    FmhaCase(num_kv_heads=8, group=4, head_dim=128, page_size=64, fp8_kv=True,
             kv_lens=(4096, 77, 1), q_lens=(1, 1, 1), lse=True),
    FmhaCase(op="context", num_kv_heads=8, group=4, head_dim=128, page_size=64, fp8_kv=True,
             kv_lens=(700, 300), q_lens=(700, 20), lse=True),
], ids=FmhaCase.label)
def test_fp8_query_beyond_fp16_range(case, monkeypatch):
    """A bf16 query past fp16's largest value (65504) under FP8 KV, whose dots take fp16
    operands (``tuning.fp16_dots``): Q is scaled into range first, so the result still
    matches the fp64 oracle."""
    assert tuning.fp16_dots(case.q_dtype, 1)
    monkeypatch.setenv("CAKE_SP_FMHA_ROUTE", "triton")
    kw = make_call(case, torch.device("cuda"), seed=3)
    kw["query"].mul_(2.0 ** 17)  # powers of two: exact, and the logits unchanged
    kw["bmm1_scale"] *= 2.0 ** -17
    assert kw["query"].abs().max().item() > 65504
    assert_matches(case, kw, call(case, kw), *oracle_fp64(case, kw))


@pytest.mark.parametrize("route", ["triton", "compat_v1"])
@pytest.mark.parametrize("op", ["decode", "context"])
def test_cuda_graph_capture_and_replay(op, route, monkeypatch):
    """Captured once, replayed on new query values and new (shorter) lengths."""
    monkeypatch.setenv("CAKE_SP_FMHA_ROUTE", route)
    if op == "decode":
        case = FmhaCase(num_kv_heads=8, group=4, head_dim=128, page_size=16,
                        kv_lens=(700, 33, 2048), q_lens=(1, 1, 1), sinks=True, lse=True)
    else:
        case = FmhaCase(op="context", num_kv_heads=8, group=4, head_dim=128, page_size=16,
                        kv_lens=(700, 33, 300), q_lens=(100, 33, 20), lse=True)
    kw = make_call(case, torch.device("cuda"), seed=2)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call(case, kw)  # warm-up: JIT and allocator outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call(case, kw)
    kw["query"].copy_(torch.randn_like(kw["query"]))
    kw["seq_lens"].copy_(kw["seq_lens"] - torch.tensor([5, 0, 7], device="cuda").int())
    kw["out"].fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    eager = dict(kw, out=torch.empty_like(kw["out"]), lse=torch.empty_like(kw["lse"]))
    call(case, eager)
    atol, rtol = TOLERANCES[case.q_dtype]
    torch.testing.assert_close(kw["out"], eager["out"], atol=atol, rtol=rtol)
    torch.testing.assert_close(kw["lse"], eager["lse"], atol=1e-5, rtol=0)
    assert not math.isnan(kw["out"].float().sum().item())
