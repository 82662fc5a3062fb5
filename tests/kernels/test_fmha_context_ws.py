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

from cake_sp.kernels.fmha import api, context_ws, fp8_staging, tuning

SERVED = FmhaCase(op="context", head_dim=128, page_size=128, kv_lens=(300, 5), q_lens=(300, 5))


@pytest.fixture
def problem_of(monkeypatch):
    """``problem_of(case, device=cpu, **overrides)``: the validated ``PagedAttention`` that the
    public call builds from ``case``'s arguments (the route is not run)."""
    monkeypatch.setattr(api, "_run", lambda problem, cell, return_lse: problem)

    def build(case: FmhaCase, device: torch.device | None = None, **overrides):
        kw = make_call(case, device or torch.device("cpu"))
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
    ({"fp8_kv": True}, False),            # served through its bf16 copy (fp8_staging)
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
    assert not context_ws.serves(problem_of(SERVED, bmm1_scale=scale))


def test_serves_a_slice_of_heads(problem_of):
    p = problem_of(SERVED)
    half = dataclasses.replace(p, query=p.query[:, 2:], out=p.out[:, 2:],
                               k_cache=p.k_cache[:, 1:], v_cache=p.v_cache[:, 1:])
    assert context_ws.serves(half)


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


def _staged_bytes(case: FmhaCase, kv_heads: int) -> int:
    """Workspace bytes of ``kv_heads`` staged KV heads of ``case`` (fp8_staging's layout,
    computed here from its docstring): the page table, 128-byte aligned, then K and V."""
    batch, pages = len(case.kv_lens), -(-max(case.kv_lens) // fp8_staging.STAGE_PAGE)
    table = -(-batch * pages * 4 // 128) * 128
    return table + 2 * kv_heads * batch * pages * fp8_staging.STAGE_PAGE * case.head_dim * 2


FP8_STAGED = dataclasses.replace(SERVED, fp8_kv=True, page_size=16, split_tables=True,
                                 num_kv_heads=3, kv_lens=(300, 5, 0), q_lens=(300, 5, 0))


@pytest.mark.parametrize(("room_heads", "chunk_heads"), [(3, (3,)), (2, (2, 1)), (1, (1, 1, 1)),
                                                         (0.5, ())])
def test_fp8_pages_staged_as_bf16(room_heads, chunk_heads, problem_of, device):
    """Every key a request owns, copied from the FP8 cache to its staged bf16 slot exactly, in
    chunks of as many KV heads as the workspace holds; the page table; every other workspace
    byte left as it was; no staging where the workspace holds no KV head."""
    case = FP8_STAGED
    room = _staged_bytes(case, 0) + int(room_heads * (_staged_bytes(case, 1)
                                                      - _staged_bytes(case, 0)))
    p = problem_of(case, device)
    p = dataclasses.replace(p, workspace=p.workspace[:room])
    chunks = fp8_staging.staged_problems(p)
    assert [c.num_kv_heads for _, c in chunks] == list(chunk_heads)
    src_k, src_v = p.k_cache.cpu(), p.v_cache.cpu()
    k_table, v_table = p.k_tables.cpu(), p.v_tables.cpu()
    for head0, chunk in chunks:
        p.workspace.fill_(255)  # bf16 NaN in every slot nothing is staged into
        fp8_staging.stage(p, head0, chunk)
        heads = slice(head0, head0 + chunk.num_kv_heads)
        assert chunk.query.data_ptr() == p.query[:, heads.start * case.group].data_ptr()
        assert chunk.query.shape[1] == chunk.num_kv_heads * case.group
        pages = chunk.k_tables.shape[1]
        assert torch.equal(chunk.k_tables.cpu().flatten(),
                           torch.arange(p.batch * pages, dtype=torch.int32))
        for src, table, dst in ((src_k, k_table, chunk.k_cache), (src_v, v_table, chunk.v_cache)):
            want = torch.full(dst.shape, -1, dtype=torch.int16).view(torch.bfloat16)  # 0xFFFF
            for b, kv_len in enumerate(p.seq_lens.tolist()):
                keys = torch.arange(kv_len)
                rows = src[table[b, keys // p.page_size].long(), heads, keys % p.page_size]
                want[b * pages + keys // fp8_staging.STAGE_PAGE, :,
                     keys % fp8_staging.STAGE_PAGE] = rows.to(torch.bfloat16)
            assert torch.equal(dst.cpu().view(torch.int16), want.view(torch.int16))
        end = _staged_bytes(case, chunk.num_kv_heads)
        assert bool((p.workspace[p.batch * pages * 4:_staged_bytes(case, 0)] == 255).all())
        assert bool((p.workspace[end:] == 255).all())


@pytest.mark.parametrize(("max_q_len", "batch", "chunk_q_heads", "chunks", "staged"), [
    (64, 1, 32, 1, True),
    (63, 8, 32, 1, False),       # fewer query tokens than measured
    (300, 1, 4, 1, True),        # one chunk: staged whatever its grid
    (4096, 1, 4, 8, False),      # 4 x 32 = 128 programs a chunk, fewer than 132 SMs
    (4096, 1, 8, 4, True),       # 256 programs a chunk
    (257, 33, 2, 4, True),       # 33 requests x 2 heads x 3 blocks = 198 programs
])
def test_context_fp8_staged(max_q_len, batch, chunk_q_heads, chunks, staged):
    assert tuning.CONTEXT_FP8_STAGE_MIN_Q_LEN == 64
    assert tuning.context_fp8_staged(max_q_len, batch, chunk_q_heads, chunks, 132) is staged


def test_staged_pages_are_one_key_tile():
    assert fp8_staging.STAGE_PAGE == context_ws.BLOCK_N


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
# The same calls over FP8 caches, staged as bf16 in the workspace (fp8_staging).
GPU_CASES += [dataclasses.replace(case, fp8_kv=True) for case in GPU_CASES]


def _check_against_the_oracle(case: FmhaCase, monkeypatch, workspace_bytes: int | None = None
                              ) -> list:
    """Run ``case`` on the GPU through the Triton route with NaN in every cache slot no request
    owns and in a workspace of ``workspace_bytes`` (the default's, if None), compare with the
    fp64 oracle, and return the problems ``context_ws`` ran."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the warp-specialised kernel is sm_90 only")
    ran = []
    real = context_ws.context_ws
    monkeypatch.setattr(context_ws, "context_ws", lambda p: (ran.append(p), real(p)))
    monkeypatch.setattr(tuning, "CONTEXT_WARP_SPECIALIZED", True)
    monkeypatch.setattr(tuning, "CONTEXT_FP8_STAGE_MIN_Q_LEN", 1)
    monkeypatch.setattr(tuning, "sm_count", lambda device: 1)  # chunks of any size staged
    monkeypatch.setenv("CAKE_SP_FMHA_ROUTE", "triton")
    kw = make_call(case, torch.device("cuda"), seed=zlib.crc32(case.label().encode()))
    poison_unowned_slots(case, kw)
    if workspace_bytes is not None:
        kw["workspace_buffer"] = torch.empty(workspace_bytes, dtype=torch.uint8, device="cuda")
    kw["workspace_buffer"].fill_(255)  # bf16 NaN in every staged slot no request owns
    ref_out, ref_lse = oracle_fp64(case, kw)
    assert_matches(case, kw, call(case, kw), ref_out, ref_lse)
    return ran


@pytest.mark.gpu
@pytest.mark.parametrize("qblock_major", [True, False])
@pytest.mark.parametrize("case", GPU_CASES, ids=FmhaCase.label)
def test_matches_the_oracle_and_never_reads_unowned_slots(case, qblock_major, monkeypatch):
    """Both grid orders (``tuning.CONTEXT_QBLOCK_MAJOR_MIN_Q_LEN``); FP8 caches through their
    bf16 staging, all KV heads at once."""
    monkeypatch.setattr(tuning, "CONTEXT_QBLOCK_MAJOR_MIN_Q_LEN", 0 if qblock_major else 2**31)
    ran = _check_against_the_oracle(case, monkeypatch)
    assert len(ran) == 1, "the call did not take the warp-specialised kernel"


@pytest.mark.gpu
@pytest.mark.parametrize("case", [c for c in GPU_CASES if c.fp8_kv and c.num_kv_heads > 1],
                         ids=FmhaCase.label)
def test_fp8_in_head_chunks_matches_the_oracle(case, monkeypatch):
    """A workspace that holds one staged KV head: one chunk a head, each against the oracle."""
    ran = _check_against_the_oracle(case, monkeypatch, _staged_bytes(case, 1))
    assert [p.num_kv_heads for p in ran] == [1] * case.num_kv_heads
