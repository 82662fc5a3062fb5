"""``decode_triton_v1``: split-KV flash-decoding over a paged KV cache.

One program per (request, KV head, split) packs the ``GROUP x q_len_per_req``
query rows that share a KV head into one tile, so each K/V page is read once
per KV head; it folds its split's keys into a partial ``(acc, m, l)`` in the
workspace.  A second kernel merges the splits of each (token, KV head), adds the
sink, scales by ``bmm2_scale`` and writes ``out`` (and the LSE).

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

from cake_sp.kernels._config import INTERPRET
from cake_sp.kernels.fmha import tuning
from cake_sp.kernels.fmha.manifest import ensure_sources_verified
from cake_sp.kernels.fmha.problem import PagedAttention
from cake_sp.kernels.fmha.tiles import (
    LOG2E,
    finalize_rows,
    fold_key_tiles,
    store_out,
)


@triton.jit
def _decode_partial_kernel(
    q_ptr, k_ptr, v_ptr, k_table_ptr, v_table_ptr, seq_lens_ptr, acc_ptr, ml_ptr,
    scale_log2, window_left, num_kv_heads, chunk_len,
    stride_qt, stride_qh,
    stride_kp, stride_kh, stride_ks,
    stride_vp, stride_vh, stride_vs,
    stride_ktb, stride_vtb,
    Q_LEN: tl.constexpr, GROUP: tl.constexpr, PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WINDOW: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """Partial attention of one split: rows ``(q token i, head g)`` of one (request, KV head).

    Writes ``acc [T, Hq, S, D]`` and ``ml [T, Hq, S, 2]`` (log2-unit max, sum) fp32.
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
    if INTERPRET:
        q = q.to(tl.float32)

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

    slot = ((tok * (num_kv_heads * GROUP) + head) * num_splits + split).to(tl.int64)
    tl.store(acc_ptr + slot[:, None] * HEAD_DIM + cols[None, :], acc, mask=row_ok[:, None])
    tl.store(ml_ptr + slot * 2, m_i, mask=row_ok)
    tl.store(ml_ptr + slot * 2 + 1, l_i, mask=row_ok)


@triton.jit
def _decode_combine_kernel(
    acc_ptr, ml_ptr, sinks_ptr, out_ptr, lse_ptr,
    bmm2_scale, num_kv_heads, stride_ot, stride_oh,
    NUM_SPLITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr,
    HAS_SINKS: tl.constexpr, HAS_LSE: tl.constexpr, OUT_BF16: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """Merge the splits of the ``GROUP`` heads of one (token, KV head); add sink, scale, store."""
    pid = tl.program_id(0)
    tok = pid // num_kv_heads
    g = tl.arange(0, BLOCK_G)
    g_ok = g < GROUP
    head = (pid % num_kv_heads) * GROUP + g
    row = (tok * (num_kv_heads * GROUP) + head).to(tl.int64)
    cols = tl.arange(0, HEAD_DIM)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
    for s in range(NUM_SPLITS):
        slot = row * NUM_SPLITS + s
        m_s = tl.load(ml_ptr + slot * 2, mask=g_ok, other=float("-inf"))
        l_s = tl.load(ml_ptr + slot * 2 + 1, mask=g_ok, other=0.0)
        acc_s = tl.load(acc_ptr + slot[:, None] * HEAD_DIM + cols[None, :], mask=g_ok[:, None],
                        other=0.0)
        m_new = tl.maximum(m_i, m_s)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        a = tl.math.exp2(m_i - m_safe)
        w = tl.math.exp2(m_s - m_safe)
        acc = acc * a[:, None] + acc_s * w[:, None]
        l_i = l_i * a + l_s * w
        m_i = m_new
    sink_log2 = 0.0
    if HAS_SINKS:
        sink_log2 = tl.load(sinks_ptr + head, mask=g_ok, other=0.0).to(tl.float32) * LOG2E
    out, lse = finalize_rows(acc, m_i, l_i, sink_log2, bmm2_scale, HAS_SINKS)
    ptrs = out_ptr + tok.to(tl.int64) * stride_ot + head[:, None] * stride_oh + cols[None, :]
    store_out(ptrs, out, g_ok[:, None], OUT_BF16, INTERPRET)
    if HAS_LSE:
        tl.store(lse_ptr + row, lse, mask=g_ok)


def block_rows(group: int, q_len_per_req: int) -> int:
    """Rows of the decode query tile: ``group * q_len_per_req`` padded to a power of two >= 16."""
    return max(tuning.DECODE_MIN_ROWS, triton.next_power_of_2(group * q_len_per_req))


def split_plan(p: PagedAttention) -> tuple[int, int, int]:
    """``(num_splits, chunk_len, block_n)`` of decode call ``p``: keys per split a multiple
    of the key tile ``block_n``.

    Host values only, so the plan of a captured call never changes on replay.
    """
    block_n = tuning.decode_block_n(p.k_cache.element_size(), p.query.shape[2])
    tiles = max(1, math.ceil(p.max_kv_len / block_n))
    programs = p.batch * p.num_kv_heads
    want = math.ceil(tuning.DECODE_PROGRAMS_PER_SM * tuning.sm_count(p.query.device)
                     / max(programs, 1))
    max_keys = tuning.decode_max_split_keys(p.k_cache.element_size())
    if max_keys is not None:
        want = max(want, math.ceil(p.max_kv_len / max_keys))
    splits = max(1, min(want, tiles, tuning.DECODE_MAX_SPLITS))
    chunk = math.ceil(tiles / splits) * block_n
    return max(1, math.ceil(p.max_kv_len / chunk)), chunk, block_n


def decode_workspace_bytes(p: PagedAttention) -> int:
    """Bytes of ``workspace_buffer`` the split-KV partials of ``p`` need."""
    num_tokens, num_heads, head_dim = p.query.shape
    splits, _, _ = split_plan(p)
    return num_tokens * num_heads * splits * (head_dim + 2) * 4


def decode_triton(p: PagedAttention) -> None:
    """Run ``p`` (a decode call, ``p.cu_q is None``) on the split-KV Triton kernels."""
    ensure_sources_verified()
    num_tokens, num_heads, head_dim = p.query.shape
    hkv, group, q_len = p.num_kv_heads, p.group, p.q_len_per_req
    splits, chunk, block_n = split_plan(p)
    n_acc = num_tokens * num_heads * splits * head_dim
    scratch = p.workspace[: (n_acc + num_tokens * num_heads * splits * 2) * 4]
    scratch = scratch.view(torch.float32)
    acc, ml = scratch[:n_acc], scratch[n_acc:]
    _decode_partial_kernel[(p.batch * hkv, splits)](
        p.query, p.k_cache, p.v_cache, p.k_tables, p.v_tables, p.seq_lens, acc, ml,
        p.bmm1_scale * math.log2(math.e), p.window_left, hkv, chunk,
        p.query.stride(0), p.query.stride(1),
        p.k_cache.stride(0), p.k_cache.stride(1), p.k_cache.stride(2),
        p.v_cache.stride(0), p.v_cache.stride(1), p.v_cache.stride(2),
        p.k_tables.stride(0), p.v_tables.stride(0),
        Q_LEN=q_len, GROUP=group, PAGE_SIZE=p.page_size, HEAD_DIM=head_dim,
        BLOCK_M=block_rows(group, q_len), BLOCK_N=block_n,
        WINDOW=p.window_left >= 0, INTERPRET=INTERPRET,
        num_warps=tuning.DECODE_NUM_WARPS, num_stages=tuning.DECODE_NUM_STAGES,
    )
    _decode_combine_kernel[(num_tokens * hkv,)](
        acc, ml, p.sinks if p.sinks is not None else ml,
        p.out, p.lse if p.lse is not None else ml,
        p.bmm2_scale, hkv, p.out.stride(0), p.out.stride(1),
        NUM_SPLITS=splits, GROUP=group, BLOCK_G=triton.next_power_of_2(group), HEAD_DIM=head_dim,
        HAS_SINKS=p.sinks is not None, HAS_LSE=p.lse is not None,
        OUT_BF16=p.out.dtype == torch.bfloat16, INTERPRET=INTERPRET,
    )
