"""Device helpers shared by the paged FMHA Triton kernels.

Tile vocabulary: a *row* is one (query token, query head) pair, a *key* is one
KV position of a request.  Logits are kept in log2 units (``bmm1_scale *
log2(e)`` is folded into one scale) so the softmax uses ``exp2``; LSE leaves
the kernels in natural-log units.

When ``INTERPRET`` is set (the CPU interpreter, whose bf16 arithmetic is
wrong) every operand is upcast to fp32 right after its load; on a GPU K and V
are cast to the query's 16-bit type (exact for fp8 e4m3) and the dots run on
the tensor cores with fp32 accumulation.
"""

from __future__ import annotations

import triton
import triton.language as tl

from cake_sp.kernels.norm_rope import round_to_bf16

LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)
LN2: tl.constexpr = tl.constexpr(0.6931471805599453)


@triton.jit
def load_paged_rows(cache_ptr, table_ptr, keys, key_mask, head_offset, stride_page, stride_slot,
                    PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Load keys ``keys`` (int32 ``[BLOCK_N]``) of one request and KV head as ``[BLOCK_N, D]``.

    ``table_ptr`` points at the request's row of the page table; key ``n``
    lives in slot ``n % PAGE_SIZE`` of page ``table[n // PAGE_SIZE]``.  The
    cache's last dim must be contiguous.  Masked keys read 0.
    """
    page = tl.load(table_ptr + keys // PAGE_SIZE, mask=key_mask, other=0).to(tl.int64)
    slot = (keys % PAGE_SIZE).to(tl.int64)
    cols = tl.arange(0, HEAD_DIM)
    ptrs = cache_ptr + head_offset + page[:, None] * stride_page + slot[:, None] * stride_slot
    return tl.load(ptrs + cols[None, :], mask=key_mask[:, None], other=0.0)


@triton.jit
def online_softmax_step(q, k, v, acc, m_i, l_i, q_pos, keys, key_mask, scale_log2, window_left,
                        CAUSAL: tl.constexpr, WINDOW: tl.constexpr, INTERPRET: tl.constexpr):
    """Fold one key tile into the running ``(acc, m_i, l_i)`` of a ``[BLOCK_M, D]`` query tile.

    ``q`` is already in compute type; ``k``/``v`` are raw loads ``[BLOCK_N, D]``.
    A key is allowed when ``key_mask``, and (``CAUSAL``) ``key <= q_pos``, and
    (``WINDOW``) ``key >= q_pos - window_left``.  ``m_i`` is the running max in
    log2 units (-inf while nothing was allowed), ``l_i`` the running sum.
    """
    if INTERPRET:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    else:
        k = k.to(q.dtype)
        v = v.to(q.dtype)
    s = tl.dot(q, tl.trans(k)) * scale_log2
    allowed = key_mask[None, :]
    if CAUSAL:
        allowed = allowed & (keys[None, :] <= q_pos[:, None])
    if WINDOW:
        allowed = allowed & (keys[None, :] >= q_pos[:, None] - window_left)
    s = tl.where(allowed, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A row with nothing allowed yet keeps m = -inf; shift by 0 so exp2 gives 0, not NaN.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(s - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return acc, m_new, l_i


@triton.jit
def _fold_key_tile(n0, end, q, acc, m_i, l_i, q_pos, k_ptr, v_ptr, k_table, v_table,
                   k_head_offset, v_head_offset, stride_kp, stride_ks, stride_vp, stride_vs,
                   scale_log2, window_left, PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
                   BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr,
                   INTERPRET: tl.constexpr):
    keys = n0 + tl.arange(0, BLOCK_N)
    key_mask = keys < end
    k = load_paged_rows(k_ptr, k_table, keys, key_mask, k_head_offset, stride_kp, stride_ks,
                        PAGE_SIZE, HEAD_DIM)
    v = load_paged_rows(v_ptr, v_table, keys, key_mask, v_head_offset, stride_vp, stride_vs,
                        PAGE_SIZE, HEAD_DIM)
    return online_softmax_step(q, k, v, acc, m_i, l_i, q_pos, keys, key_mask, scale_log2,
                               window_left, CAUSAL, WINDOW, INTERPRET)


@triton.jit
def attend_key_range(start, end, q, acc, m_i, l_i, q_pos, k_ptr, v_ptr, k_table, v_table,
                     k_head_offset, v_head_offset, stride_kp, stride_ks, stride_vp, stride_vs,
                     scale_log2, window_left, PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
                     BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr,
                     INTERPRET: tl.constexpr):
    """Fold keys ``[start, end)`` of one request and KV head, ``BLOCK_N`` at a time.

    ``start`` is a multiple of ``BLOCK_N``; ``k_table``/``v_table`` point at the
    request's page-table rows.  Returns the updated ``(acc, m_i, l_i)``.
    """
    if INTERPRET:
        # The interpreter's scalars are 1-element arrays, which ``range`` cannot
        # take as bounds; a while loop gives the same iterations.
        n0 = start
        while n0 < end:
            acc, m_i, l_i = _fold_key_tile(
                n0, end, q, acc, m_i, l_i, q_pos, k_ptr, v_ptr, k_table, v_table,
                k_head_offset, v_head_offset, stride_kp, stride_ks, stride_vp, stride_vs,
                scale_log2, window_left, PAGE_SIZE, HEAD_DIM, BLOCK_N, CAUSAL, WINDOW, INTERPRET)
            n0 += BLOCK_N
    else:
        # A for loop, so that the compiler software-pipelines the page loads.
        for n0 in range(start, end, BLOCK_N):
            acc, m_i, l_i = _fold_key_tile(
                n0, end, q, acc, m_i, l_i, q_pos, k_ptr, v_ptr, k_table, v_table,
                k_head_offset, v_head_offset, stride_kp, stride_ks, stride_vp, stride_vs,
                scale_log2, window_left, PAGE_SIZE, HEAD_DIM, BLOCK_N, CAUSAL, WINDOW, INTERPRET)
    return acc, m_i, l_i


@triton.jit
def finalize_rows(acc, m_i, l_i, sink_log2, bmm2_scale, HAS_SINKS: tl.constexpr):
    """Normalise ``acc [R, D]`` by ``l_i`` (plus the sink), scale by ``bmm2_scale``; also the LSE.

    Returns ``(out [R, D] fp32, lse [R] fp32 natural log)``; a row with nothing
    allowed and no sink gets ``out = 0`` and ``lse = -inf``.
    """
    if HAS_SINKS:
        m_new = tl.maximum(m_i, sink_log2)
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.math.exp2(sink_log2 - m_new)
        acc = acc * alpha[:, None]
        m_i = m_new
    has_mass = l_i > 0
    inv = tl.where(has_mass, bmm2_scale / tl.where(has_mass, l_i, 1.0), 0.0)
    lse = tl.where(has_mass, (m_i + tl.math.log2(tl.where(has_mass, l_i, 1.0))) * LN2,
                   float("-inf"))
    return acc * inv[:, None], lse


@triton.jit
def store_out(ptrs, x, mask, OUT_BF16: tl.constexpr, INTERPRET: tl.constexpr):
    """Store fp32 ``x`` as bf16 (rounded to nearest-even, also in the interpreter) or fp16."""
    if OUT_BF16:
        y = round_to_bf16(x, INTERPRET)
    else:
        y = x.to(tl.float16)
    tl.store(ptrs, y, mask=mask)
