"""``decode_triton_v1``: split-KV flash-decoding over a paged KV cache.

One program per (request, KV head, split) packs the ``GROUP x q_len_per_req``
query rows that share a KV head into one tile, so each K/V page is read once
per KV head; it folds its split's keys into a partial ``(acc, m, l)`` in the
workspace.  A second kernel merges the splits of each (token, head), adds the
sink, scales by ``bmm2_scale`` and writes ``out`` (and the LSE).  A call of one
split finalises in the first kernel and launches no second one.  On sm_90 the calls
``decode_ws.serves`` accepts take the Gluon partial kernel of ``decode_ws.py`` instead (same
partials, same combine), in its own splits.

Pseudo-code it equals (per token ``t`` of request ``b``, head ``h``)::

    out[t, h] = bmm2_scale * softmax_with_sink(bmm1_scale * q[t, h] . K_b^T) @ V_b

with keys after ``q_pos`` (causal inside the request's new tokens) or before
``q_pos - window_left`` masked.  Nothing here reads a device value on the
host, so a call can be captured in a CUDA graph.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from cake_sp.kernels._config import INTERPRET, wgmma_supported
from cake_sp.kernels.fmha import tuning
from cake_sp.kernels.fmha.context import tma_fits
from cake_sp.kernels.fmha.manifest import ensure_sources_verified
from cake_sp.kernels.fmha.problem import PagedAttention
from cake_sp.kernels.fmha.tiles import (
    LOG2E,
    Q_FP16_SCALE,
    finalize_rows,
    fold_key_tiles,
    query_operand,
    store_out,
)

try:  # Gluon's Hopper API as of Triton 3.6; without it every call takes the Triton kernel
    from cake_sp.kernels.fmha import decode_ws
except ImportError:
    decode_ws = None


@triton.jit
def _decode_partial_kernel(
    q_ptr, k_ptr, v_ptr, k_table_ptr, v_table_ptr, seq_lens_ptr, acc_ptr, ml_ptr,
    sinks_ptr, out_ptr, lse_ptr,
    scale_log2, bmm2_scale, q_scale, window_left, num_kv_heads, chunk_len,
    stride_qt, stride_qh,
    stride_kp, stride_kh, stride_ks,
    stride_vp, stride_vh, stride_vs,
    stride_ktb, stride_vtb, stride_ot, stride_oh,
    Q_LEN: tl.constexpr, GROUP: tl.constexpr, PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WINDOW: tl.constexpr,
    FINALIZE: tl.constexpr, HAS_SINKS: tl.constexpr, HAS_LSE: tl.constexpr,
    OUT_BF16: tl.constexpr, DOT_FP16: tl.constexpr, INTERPRET: tl.constexpr,
):
    """Attention of one split: rows ``(q token i, head g)`` of one (request, KV head).

    Writes the partial ``acc [T, Hq, S, D]`` and ``ml [T, Hq, S, 2]`` (log2-unit
    max, sum) fp32, or with ``FINALIZE`` (one split) ``out`` and the LSE themselves.
    ``DOT_FP16``, ``q_scale``: as in ``tiles.query_operand``.
    """
    pid = tl.program_id(0)
    split = tl.program_id(1)
    num_splits = tl.num_programs(1)
    b = pid // num_kv_heads
    hkv = pid % num_kv_heads
    rows = tl.arange(0, BLOCK_M)
    qi = rows // GROUP
    row_ok = rows < Q_LEN * GROUP
    tok = (b * Q_LEN + qi).to(tl.int64)
    head = hkv * GROUP + rows % GROUP
    cols = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + cols[None, :],
                mask=row_ok[:, None], other=0.0)
    q, scale_log2 = query_operand(q, scale_log2, q_scale, DOT_FP16, INTERPRET)

    seq_len = tl.load(seq_lens_ptr + b).to(tl.int32)
    q_pos = seq_len - Q_LEN + qi
    start = split * chunk_len
    end = tl.minimum(start + chunk_len, seq_len)
    if WINDOW:
        # Skip whole tiles left of the first query's window.
        first = tl.maximum(seq_len - Q_LEN - window_left, 0)
        start = tl.maximum(start, first // BLOCK_N * BLOCK_N)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    k_table = k_table_ptr + b.to(tl.int64) * stride_ktb
    v_table = v_table_ptr + b.to(tl.int64) * stride_vtb
    # Every tile masked and every key looking up its page: unmasked interior tiles
    # with one page lookup per tile (as in context.py) ran 8-25 % slower on an H200.
    acc, m_i, l_i = fold_key_tiles(
        start, end, end, q, acc, m_i, l_i, q_pos, k_ptr, v_ptr, k_table, v_table,
        hkv * stride_kh, hkv * stride_vh, stride_kp, stride_ks, stride_vp, stride_vs, 0, 0,
        scale_log2, window_left, PAGE_SIZE, HEAD_DIM, BLOCK_N, True, True, WINDOW, False, False,
        INTERPRET)

    row = tok * (num_kv_heads * GROUP) + head
    if FINALIZE:
        _finalize_and_store(acc, m_i, l_i, row_ok, row_ok, tok, head, row, cols, sinks_ptr,
                            out_ptr, lse_ptr, bmm2_scale, stride_ot, stride_oh, HAS_SINKS,
                            HAS_LSE, OUT_BF16, INTERPRET)
    else:
        slot = (row * num_splits + split).to(tl.int64)
        tl.store(acc_ptr + slot[:, None] * HEAD_DIM + cols[None, :], acc, mask=row_ok[:, None])
        tl.store(ml_ptr + slot * 2, m_i, mask=row_ok)
        tl.store(ml_ptr + slot * 2 + 1, l_i, mask=row_ok)


@triton.jit
def _finalize_and_store(acc, m_i, l_i, row_ok, lse_ok, tok, head, row, cols, sinks_ptr, out_ptr,
                        lse_ptr, bmm2_scale, stride_ot, stride_oh, HAS_SINKS: tl.constexpr,
                        HAS_LSE: tl.constexpr, OUT_BF16: tl.constexpr, INTERPRET: tl.constexpr):
    """Add the sink, normalise and scale rows ``acc [R, C]`` (token ``tok``, head ``head``,
    LSE index ``row``: int ``[R]``), columns ``cols`` (int ``[C]``) of ``out``; store those
    where ``row_ok`` and (``HAS_LSE``) the LSE where ``lse_ok`` (bool ``[R]``)."""
    sink_log2 = 0.0
    if HAS_SINKS:
        sink_log2 = tl.load(sinks_ptr + head, mask=row_ok, other=0.0).to(tl.float32) * LOG2E
    out, lse = finalize_rows(acc, m_i, l_i, sink_log2, bmm2_scale, HAS_SINKS)
    ptrs = out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + cols[None, :]
    store_out(ptrs, out, row_ok[:, None], OUT_BF16, INTERPRET)
    if HAS_LSE:
        tl.store(lse_ptr + row, lse, mask=lse_ok)


@triton.jit
def _decode_combine_kernel(
    acc_ptr, ml_ptr, sinks_ptr, out_ptr, lse_ptr,
    bmm2_scale, num_heads, stride_ot, stride_oh,
    NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
    HEAD_DIM: tl.constexpr, HAS_SINKS: tl.constexpr, HAS_LSE: tl.constexpr,
    OUT_BF16: tl.constexpr, INTERPRET: tl.constexpr,
):
    """Program ``(row, c)``: merge columns ``[c * BLOCK_D, (c + 1) * BLOCK_D)`` of the
    ``NUM_SPLITS`` partials of one (token, head) row; add the sink, scale, store (and, for
    ``c == 0``, the LSE).

    Every load is issued at once, the splits' maxima and sums beside their partial
    columns, so a merge costs one round trip to memory: loading the partials only once
    the maximum was known took two (and a split-by-split online merge a chain of dependent
    loads as long as the split count).
    """
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    tok = row // num_heads
    head = row % num_heads
    s = tl.arange(0, BLOCK_S)
    s_ok = s < NUM_SPLITS
    slot = row * NUM_SPLITS + s
    cols = c * BLOCK_D + tl.arange(0, BLOCK_D)
    m_s = tl.load(ml_ptr + slot * 2, mask=s_ok, other=float("-inf"))
    l_s = tl.load(ml_ptr + slot * 2 + 1, mask=s_ok, other=0.0)
    part = tl.load(acc_ptr + slot[:, None] * HEAD_DIM + cols[None, :], mask=s_ok[:, None],
                   other=0.0)
    m = tl.max(m_s, axis=0)
    w = tl.math.exp2(m_s - tl.where(m == float("-inf"), 0.0, m))
    # As a one-row tile, the shape _finalize_and_store takes; the first column program
    # stores the LSE.
    one = tl.arange(0, 1)
    zero = tl.zeros([1], tl.float32)
    _finalize_and_store(tl.sum(part * w[:, None], axis=0)[None, :], zero + m,
                        zero + tl.sum(l_s * w, axis=0), one == 0, (one == 0) & (c == 0),
                        tok + one, head + one, row + one, cols, sinks_ptr, out_ptr, lse_ptr,
                        bmm2_scale, stride_ot, stride_oh, HAS_SINKS, HAS_LSE, OUT_BF16,
                        INTERPRET)


def block_rows(group: int, q_len_per_req: int) -> int:
    """Rows of the decode query tile: ``group * q_len_per_req`` padded to a power of two >= 16."""
    return max(tuning.DECODE_MIN_ROWS, triton.next_power_of_2(group * q_len_per_req))


def split_plan(p: PagedAttention) -> tuple[int, int, int]:
    """``(num_splits, chunk_len, block_n)`` of decode call ``p``: keys per split a multiple
    of the key tile ``block_n`` (``tuning.decode_num_splits``).

    Host values only, so the plan of a captured call never changes on replay.  A call that
    takes ``decode_ws`` splits as ``tuning.decode_ws_splits`` says.
    """
    return _plan(p, _warp_specialized_fits(p))


def _plan(p: PagedAttention, warp_specialized: bool) -> tuple[int, int, int]:
    """``split_plan`` for ``p`` taking (``warp_specialized``) or not taking ``decode_ws``."""
    block_n = tuning.decode_block_n(p.k_cache.element_size(), p.query.shape[2])
    tiles = max(1, math.ceil(p.max_kv_len / block_n))
    if warp_specialized:
        splits = tuning.decode_ws_splits(p.batch * p.num_kv_heads, tiles, p.max_kv_len,
                                         tuning.sm_count(p.query.device))
    else:
        splits = tuning.decode_num_splits(p.batch * p.num_kv_heads, tiles, p.max_kv_len,
                                          p.k_cache.element_size(),
                                          tuning.sm_count(p.query.device))
    chunk = math.ceil(tiles / splits) * block_n
    return max(1, math.ceil(p.max_kv_len / chunk)), chunk, block_n


def _partials_bytes(p: PagedAttention, splits: int) -> int:
    """fp32 ``acc [T, Hq, S, D]`` then ``ml [T, Hq, S, 2]``; none for one split."""
    num_tokens, num_heads, head_dim = p.query.shape
    return 0 if splits == 1 else num_tokens * num_heads * splits * (head_dim + 2) * 4


def decode_workspace_bytes(p: PagedAttention) -> int:
    """Bytes of ``workspace_buffer`` the split-KV partials of ``p`` need (none for one split)."""
    return _partials_bytes(p, split_plan(p)[0])


def decode_triton(p: PagedAttention) -> None:
    """Run ``p`` (a decode call, ``p.cu_q is None``) on the split-KV kernels: the partials by
    ``decode_ws`` or ``_decode_partial_kernel``, then (more than one split) the combine."""
    ensure_sources_verified()
    num_tokens, num_heads, head_dim = p.query.shape
    warp_specialized = _warp_specialized_fits(p)
    splits, chunk, block_n = _plan(p, warp_specialized)
    n_acc = num_tokens * num_heads * splits * head_dim
    scratch = p.workspace[: _partials_bytes(p, splits)].view(torch.float32)
    acc, ml = scratch[:n_acc], scratch[n_acc:]
    # Unused pointers (no partials, no sinks, no LSE) point at a tensor that is there.
    spare = p.out
    sinks = p.sinks if p.sinks is not None else spare
    lse = p.lse if p.lse is not None else spare
    finalize = splits == 1
    if warp_specialized:
        decode_ws.decode_ws(p, splits, chunk, block_rows(p.group, p.q_len_per_req),
                            spare if finalize else acc, spare if finalize else ml)
    else:
        _decode_partial(p, splits, chunk, block_n, acc, ml, spare, sinks, lse)
    if finalize:
        return
    flags = dict(HAS_SINKS=p.sinks is not None, HAS_LSE=p.lse is not None,
                 OUT_BF16=p.out.dtype == torch.bfloat16, INTERPRET=INTERPRET)
    block_s = triton.next_power_of_2(splits)
    block_d = tuning.decode_combine_block_d(block_s, head_dim)
    _decode_combine_kernel[(num_tokens * num_heads, head_dim // block_d)](
        acc, ml, sinks, p.out, lse, p.bmm2_scale, num_heads, p.out.stride(0), p.out.stride(1),
        NUM_SPLITS=splits, BLOCK_S=block_s, BLOCK_D=block_d, HEAD_DIM=head_dim, **flags,
    )


def _warp_specialized_fits(p: PagedAttention) -> bool:
    """Whether ``p`` takes ``decode_ws`` (``tuning.DECODE_WARP_SPECIALIZED``): an sm_90 GPU,
    a call it serves, TMA-readable caches."""
    return (decode_ws is not None and tuning.DECODE_WARP_SPECIALIZED and not INTERPRET
            and p.query.device.type == "cuda" and wgmma_supported(p.query.device.index)
            and decode_ws.serves(p) and tma_fits(p, decode_ws.box_rows(p.page_size)))


def _decode_partial(p: PagedAttention, splits: int, chunk: int, block_n: int, acc: torch.Tensor,
                    ml: torch.Tensor, spare: torch.Tensor, sinks: torch.Tensor,
                    lse: torch.Tensor) -> None:
    """Launch ``_decode_partial_kernel`` for ``p`` (``decode_triton``'s split plan and
    buffers)."""
    hkv, group, q_len = p.num_kv_heads, p.group, p.q_len_per_req
    head_dim = p.query.shape[2]
    finalize = splits == 1
    flags = dict(HAS_SINKS=p.sinks is not None, HAS_LSE=p.lse is not None,
                 OUT_BF16=p.out.dtype == torch.bfloat16, INTERPRET=INTERPRET)
    _decode_partial_kernel[(p.batch * hkv, splits)](
        p.query, p.k_cache, p.v_cache, p.k_tables, p.v_tables, p.seq_lens,
        spare if finalize else acc, spare if finalize else ml, sinks, p.out, lse,
        p.bmm1_scale * math.log2(math.e), p.bmm2_scale, Q_FP16_SCALE, p.window_left, hkv, chunk,
        p.query.stride(0), p.query.stride(1),
        p.k_cache.stride(0), p.k_cache.stride(1), p.k_cache.stride(2),
        p.v_cache.stride(0), p.v_cache.stride(1), p.v_cache.stride(2),
        p.k_tables.stride(0), p.v_tables.stride(0), p.out.stride(0), p.out.stride(1),
        Q_LEN=q_len, GROUP=group, PAGE_SIZE=p.page_size, HEAD_DIM=head_dim,
        BLOCK_M=block_rows(group, q_len), BLOCK_N=block_n,
        WINDOW=p.window_left >= 0, FINALIZE=finalize,
        DOT_FP16=tuning.fp16_dots(p.query.dtype, p.k_cache.element_size()), **flags,
        num_warps=tuning.DECODE_NUM_WARPS,
        num_stages=tuning.decode_num_stages(p.batch, p.max_kv_len, p.k_cache.element_size()),
        maxnreg=tuning.decode_max_registers(p.k_cache.element_size(), head_dim),
    )
