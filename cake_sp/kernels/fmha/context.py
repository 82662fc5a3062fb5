"""``context_triton_v1``: paged FlashAttention-2-style prefill (ragged queries, paged KV).

One program per (request, query head, query block) loads its ``[BLOCK_M, D]``
query tile once and streams the request's keys page by page with an online
softmax; causal blocks stop at their last query's position and windowed
blocks start at their first query's window, so masked tiles are never read.
Only the key tiles on the causal diagonal (or at the ends of a window or of
the request) apply masks.  When a key tile lies inside one page and the cache
strides allow, K and V tiles arrive by TMA (a 2-D descriptor over the
cache's rows); otherwise by pointer loads.  On sm_90 the calls that
``context_ws.serves`` (bf16, D 64/128, no window, sinks or LSE) take the
warp-specialised Gluon kernel of ``context_ws.py`` instead, same semantics, and so
do those calls over an FP8 cache through a bf16 copy of it in the workspace
(``fp8_staging.py``).

Pseudo-code it equals (query token ``i`` of request ``b``, head ``h``,
``q_pos = kv_len_b - q_len_b + i``: the last query aligns with the last key)::

    out[cu_q[b] + i, h] = bmm2_scale * softmax_with_sink(bmm1_scale * q . K_b^T) @ V_b
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from cake_sp.kernels._config import INTERPRET, wgmma_supported
from cake_sp.kernels.fmha import fp8_staging, tuning
from cake_sp.kernels.fmha.manifest import ensure_sources_verified
from cake_sp.kernels.fmha.problem import PagedAttention, cache_rows
from cake_sp.kernels.fmha.tiles import (
    LOG2E,
    Q_FP16_SCALE,
    attend_key_range,
    finalize_rows,
    query_operand,
    store_out,
    unmasked_end,
)

try:  # Gluon's Hopper API as of Triton 3.6; without it every call takes the tl.dot kernel
    from cake_sp.kernels.fmha import context_ws
except ImportError:
    context_ws = None


@triton.jit
def _context_kernel(
    q_ptr, k_src, v_src, k_table_ptr, v_table_ptr, seq_lens_ptr, cu_q_ptr, sinks_ptr,
    out_ptr, lse_ptr,
    scale_log2, bmm2_scale, q_scale, window_left, num_heads,
    stride_qt, stride_qh,
    k_head_offset, stride_kp, stride_ks, k_page_rows,
    v_head_offset, stride_vp, stride_vs, v_page_rows,
    stride_ktb, stride_vtb, stride_ot, stride_oh,
    GROUP: tl.constexpr, PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr,
    HAS_SINKS: tl.constexpr, HAS_LSE: tl.constexpr, OUT_BF16: tl.constexpr,
    USE_TMA: tl.constexpr, DOT_FP16: tl.constexpr, INTERPRET: tl.constexpr,
):
    """Attention of query rows ``[m0, m0 + BLOCK_M)`` of one request and head.

    ``k_head_offset``/``v_head_offset`` locate KV head 0 .. of a page: an element
    offset per KV head, or with ``USE_TMA`` a row offset per KV head in the
    descriptor's rows (see ``tiles.load_key_tile``).  ``DOT_FP16``, ``q_scale``: as in
    ``tiles.query_operand``.
    """
    pid = tl.program_id(0)
    # The last query blocks of a causal request see the most keys: launch them first.
    m0 = (tl.num_programs(1) - 1 - tl.program_id(1)) * BLOCK_M
    b = pid // num_heads
    h = pid % num_heads
    hkv = h // GROUP
    q_start = tl.load(cu_q_ptr + b).to(tl.int32)
    q_len = tl.load(cu_q_ptr + b + 1).to(tl.int32) - q_start
    if m0 < q_len:
        rows = m0 + tl.arange(0, BLOCK_M)
        row_ok = rows < q_len
        tok = (q_start + rows).to(tl.int64)
        cols = tl.arange(0, HEAD_DIM)
        q = tl.load(q_ptr + tok[:, None] * stride_qt + h * stride_qh + cols[None, :],
                    mask=row_ok[:, None], other=0.0)
        q, scale_log2 = query_operand(q, scale_log2, q_scale, DOT_FP16, INTERPRET)
        kv_len = tl.load(seq_lens_ptr + b).to(tl.int32)
        q_pos = kv_len - q_len + rows
        lo = 0
        hi = kv_len
        if CAUSAL:
            hi = tl.minimum(kv_len, kv_len - q_len + m0 + BLOCK_M)
        if WINDOW:
            lo = tl.maximum(kv_len - q_len + m0 - window_left, 0) // BLOCK_N * BLOCK_N
        full_end = unmasked_end(lo, hi, kv_len - q_len + m0, BLOCK_N, CAUSAL, WINDOW)

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        k_table = k_table_ptr + b.to(tl.int64) * stride_ktb
        v_table = v_table_ptr + b.to(tl.int64) * stride_vtb
        acc, m_i, l_i = attend_key_range(
            lo, full_end, hi, q, acc, m_i, l_i, q_pos, k_src, v_src, k_table, v_table,
            hkv * k_head_offset, hkv * v_head_offset, stride_kp, stride_ks, stride_vp,
            stride_vs, k_page_rows, v_page_rows, scale_log2, window_left, PAGE_SIZE, HEAD_DIM,
            BLOCK_N, CAUSAL, WINDOW, PAGE_SIZE % BLOCK_N == 0, USE_TMA, INTERPRET)

        sink_log2 = 0.0
        if HAS_SINKS:
            sink_log2 = tl.load(sinks_ptr + h).to(tl.float32) * LOG2E
        out, lse = finalize_rows(acc, m_i, l_i, sink_log2, bmm2_scale, HAS_SINKS)
        store_out(out_ptr + tok[:, None] * stride_ot + h * stride_oh + cols[None, :], out,
                  row_ok[:, None], OUT_BF16, INTERPRET)
        if HAS_LSE:
            tl.store(lse_ptr + tok * num_heads + h, lse, mask=row_ok)


def _kv_source(cache: torch.Tensor, block_n: int, use_tma: bool) -> tuple:
    """``(source, head_offset, page_rows)`` of ``cache`` ``[pages, Hkv, page_size, D]``.

    Pointer loads take the tensor and its element strides.  The TMA variant
    takes a 2-D descriptor over rows of ``D`` values spaced by the slot stride,
    so pages and KV heads become row offsets (see ``tiles.load_key_tile``).
    """
    if not use_tma:
        return cache, cache.stride(1), 0
    rows, head_rows, page_rows = cache_rows(cache)
    desc = TensorDescriptor(cache, [rows, cache.shape[3]], [cache.stride(2), 1],
                            [block_n, cache.shape[3]])
    return desc, head_rows, page_rows


def tma_fits(p: PagedAttention, block_n: int) -> bool:
    """Whether both caches can be read by TMA in ``block_n``-key tiles: tiles inside one
    page, pages and heads whole numbers of slot rows, 16-byte aligned rows and bases,
    and row indices that fit the descriptor's int32 coordinates."""
    if p.page_size % block_n or not tuning.context_tma_available(p.query.device):
        return False
    for cache in (p.k_cache, p.v_cache):
        stride_page, stride_head, stride_slot, last = cache.stride()
        size = cache.element_size()
        if (last != 1 or stride_page % stride_slot or stride_head % stride_slot
                or (stride_slot * size) % 16 or cache.data_ptr() % 16
                or cache_rows(cache)[0] >= 2**31):
            return False
    return True


def _warp_specialized_fits(p: PagedAttention) -> bool:
    """Whether ``p`` takes ``context_ws``: an sm_90 GPU, a call it serves, TMA-readable caches."""
    return (context_ws is not None and tuning.CONTEXT_WARP_SPECIALIZED and not INTERPRET
            and p.query.device.type == "cuda" and wgmma_supported(p.query.device.index)
            and context_ws.serves(p) and tma_fits(p, context_ws.box_rows(p.page_size)))


def context_triton(p: PagedAttention) -> None:
    """Run ``p`` (a context call, ``p.cu_q`` set) on the paged prefill kernel."""
    ensure_sources_verified()
    if _warp_specialized_fits(p):
        context_ws.context_ws(p)
        return
    # An FP8 cache whose KV heads the workspace holds as bf16, all at once or in chunks: the
    # warp-specialised kernel on each chunk's copy.
    chunks = fp8_staging.staged_problems(p)
    if chunks and _warp_specialized_fits(chunks[0][1]) and tuning.context_fp8_staged(
            p.max_q_len, p.batch, chunks[0][1].query.shape[1], len(chunks),
            tuning.sm_count(p.query.device)):
        for head0, chunk in chunks:
            fp8_staging.stage(p, head0, chunk)
            context_ws.context_ws(chunk)
        return
    _, num_heads, head_dim = p.query.shape
    block_n = tuning.context_block_n(head_dim, p.page_size)
    use_tma = tma_fits(p, block_n)
    block_m, num_warps, num_stages = tuning.context_launch(head_dim, block_n, use_tma)
    k_src, k_head_offset, k_page_rows = _kv_source(p.k_cache, block_n, use_tma)
    v_src, v_head_offset, v_page_rows = _kv_source(p.v_cache, block_n, use_tma)
    grid = (p.batch * num_heads, max(1, triton.cdiv(p.max_q_len, block_m)))
    _context_kernel[grid](
        p.query, k_src, v_src, p.k_tables, p.v_tables, p.seq_lens, p.cu_q,
        p.sinks if p.sinks is not None else p.seq_lens,
        p.out, p.lse if p.lse is not None else p.out,
        p.bmm1_scale * math.log2(math.e), p.bmm2_scale, Q_FP16_SCALE, p.window_left, num_heads,
        p.query.stride(0), p.query.stride(1),
        k_head_offset, p.k_cache.stride(0), p.k_cache.stride(2), k_page_rows,
        v_head_offset, p.v_cache.stride(0), p.v_cache.stride(2), v_page_rows,
        p.k_tables.stride(0), p.v_tables.stride(0), p.out.stride(0), p.out.stride(1),
        GROUP=p.group, PAGE_SIZE=p.page_size, HEAD_DIM=head_dim,
        BLOCK_M=block_m, BLOCK_N=block_n,
        CAUSAL=p.causal, WINDOW=p.window_left >= 0,
        HAS_SINKS=p.sinks is not None, HAS_LSE=p.lse is not None,
        OUT_BF16=p.out.dtype == torch.bfloat16, USE_TMA=use_tma,
        DOT_FP16=tuning.fp16_dots(p.query.dtype, p.k_cache.element_size()), INTERPRET=INTERPRET,
        num_warps=num_warps, num_stages=num_stages,
    )
