"""Device helpers shared by the paged FMHA Triton kernels.

Tile vocabulary: a *row* is one (query token, query head) pair, a *key* is one
KV position of a request.  Logits are kept in log2 units (``bmm1_scale *
log2(e)`` is folded into one scale) so the softmax uses ``exp2``; LSE leaves
the kernels in natural-log units.

When ``INTERPRET`` is set (the CPU interpreter, whose bf16 arithmetic is
wrong) every operand is upcast to fp32 right after its load; on a GPU K and V
are cast to the 16-bit type of the query tile (exact for fp8 e4m3; under FP8
KV a bf16 query becomes fp16, ``query_operand``) and the dots run on the tensor
cores with fp32 accumulation.
"""

from __future__ import annotations

import triton
import triton.language as tl

from cake_sp.kernels.norm_rope import round_to_bf16

LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)
LN2: tl.constexpr = tl.constexpr(0.6931471805599453)
# Q's scale before the dots take fp16 operands from a bf16 query (``query_operand``): a power
# of two, folded back into the logit scale, so exact; it keeps any bf16 query below 2**24 in
# fp16's range (one below 2**-9 rounds, by at most 2**-17).
Q_FP16_SCALE = 1.0 / 256.0


@triton.jit
def query_operand(q, scale_log2, q_scale, DOT_FP16: tl.constexpr, INTERPRET: tl.constexpr):
    """``(q, scale_log2)``: a loaded query tile as the dots take it, and the logit scale
    that goes with it.

    ``DOT_FP16`` (``tuning.fp16_dots``: FP8 KV under a bf16 query): fp16, scaled by
    ``q_scale`` (``Q_FP16_SCALE``) first, so K and V convert to fp16 too.  ``q_scale`` is an
    argument because as a constant the compiler moves the multiply past the conversion to
    fp16, where a large query overflows.  The interpreter keeps fp32 (scaled all the same).
    """
    if DOT_FP16:
        q = q.to(tl.float32) * q_scale
        scale_log2 = scale_log2 / q_scale
        if not INTERPRET:
            q = q.to(tl.float16)
    elif INTERPRET:
        q = q.to(tl.float32)
    return q, scale_log2


@triton.jit
def load_key_tile(cache, table_ptr, n0, end, head_offset, stride_page, stride_slot, page_rows,
                  PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
                  MASKED: tl.constexpr, ONE_PAGE: tl.constexpr, USE_TMA: tl.constexpr):
    """Keys ``[n0, n0 + BLOCK_N)`` of one request and KV head as ``[BLOCK_N, D]``.

    ``table_ptr`` points at the request's row of the page table; key ``n``
    lives in slot ``n % PAGE_SIZE`` of page ``table[n // PAGE_SIZE]``.  The
    cache's last dim must be contiguous.  ``MASKED``: keys ``>= end`` read 0
    (otherwise every key of the tile must be ``< end``).

    ``ONE_PAGE`` (``PAGE_SIZE`` a multiple of ``BLOCK_N``): the tile lies inside
    one page, so one page-table entry serves it; otherwise every key looks up
    its page.  ``USE_TMA`` (with ``ONE_PAGE`` only):
    ``cache`` is a 2-D tensor descriptor over rows of ``D`` values, page ``p``
    of this head starting at row ``p * page_rows + head_offset``; the TMA unit
    then fetches the tile without per-element addresses.
    """
    keys = n0 + tl.arange(0, BLOCK_N)
    key_mask = keys < end
    cols = tl.arange(0, HEAD_DIM)
    if ONE_PAGE:
        page = tl.load(table_ptr + n0 // PAGE_SIZE).to(tl.int64)
        slot0 = n0 % PAGE_SIZE
        if USE_TMA:
            tile = cache.load([(page * page_rows + head_offset + slot0).to(tl.int32), 0])
            if MASKED:
                # Rows past ``end`` are the page's unused slots: whatever is there,
                # even NaN, must not reach P @ V.
                tile = tl.where(key_mask[:, None], tile, tl.zeros_like(tile))
        else:
            slots = (slot0 + tl.arange(0, BLOCK_N)).to(tl.int64)
            ptrs = (cache + head_offset + page * stride_page + slots[:, None] * stride_slot
                    + cols[None, :])
            if MASKED:
                tile = tl.load(ptrs, mask=key_mask[:, None], other=0.0)
            else:
                tile = tl.load(ptrs)
    else:
        page = tl.load(table_ptr + keys // PAGE_SIZE, mask=key_mask, other=0).to(tl.int64)
        slot = (keys % PAGE_SIZE).to(tl.int64)
        ptrs = (cache + head_offset + page[:, None] * stride_page + slot[:, None] * stride_slot
                + cols[None, :])
        tile = tl.load(ptrs, mask=key_mask[:, None], other=0.0)
    return tile


@triton.jit
def online_softmax_step(q, k, v, acc, m_i, l_i, q_pos, keys, key_mask, scale_log2, window_left,
                        MASKED: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr,
                        INTERPRET: tl.constexpr):
    """Fold one key tile into the running ``(acc, m_i, l_i)`` of a ``[BLOCK_M, D]`` query tile.

    ``q`` is already in compute type; ``k``/``v`` are raw loads ``[BLOCK_N, D]``.
    With ``MASKED`` a key is allowed when ``key_mask``, and (``CAUSAL``) ``key
    <= q_pos``, and (``WINDOW``) ``key >= q_pos - window_left``; without it the
    caller guarantees every key is allowed for every row.  ``m_i`` is the
    running max in log2 units (-inf while nothing was allowed), ``l_i`` the
    running sum.
    """
    if INTERPRET:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    else:
        k = k.to(q.dtype)
        v = v.to(q.dtype)
    s = tl.dot(q, tl.trans(k)) * scale_log2
    if MASKED:
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
def _fold_key_tile(n0, end, q, acc, m_i, l_i, q_pos, k_src, v_src, k_table, v_table,
                   k_head_offset, v_head_offset, stride_kp, stride_ks, stride_vp, stride_vs,
                   k_page_rows, v_page_rows, scale_log2, window_left, PAGE_SIZE: tl.constexpr,
                   HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
                   CAUSAL: tl.constexpr, WINDOW: tl.constexpr, ONE_PAGE: tl.constexpr,
                   USE_TMA: tl.constexpr, INTERPRET: tl.constexpr):
    k = load_key_tile(k_src, k_table, n0, end, k_head_offset, stride_kp, stride_ks, k_page_rows,
                      PAGE_SIZE, HEAD_DIM, BLOCK_N, MASKED, ONE_PAGE, USE_TMA)
    v = load_key_tile(v_src, v_table, n0, end, v_head_offset, stride_vp, stride_vs, v_page_rows,
                      PAGE_SIZE, HEAD_DIM, BLOCK_N, MASKED, ONE_PAGE, USE_TMA)
    keys = n0 + tl.arange(0, BLOCK_N)
    return online_softmax_step(q, k, v, acc, m_i, l_i, q_pos, keys, keys < end, scale_log2,
                               window_left, MASKED, CAUSAL, WINDOW, INTERPRET)


@triton.jit
def fold_key_tiles(lo, hi, end, q, acc, m_i, l_i, q_pos, k_src, v_src, k_table, v_table,
                   k_head_offset, v_head_offset, stride_kp, stride_ks, stride_vp, stride_vs,
                   k_page_rows, v_page_rows, scale_log2, window_left, PAGE_SIZE: tl.constexpr,
                   HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
                   CAUSAL: tl.constexpr, WINDOW: tl.constexpr, ONE_PAGE: tl.constexpr,
                   USE_TMA: tl.constexpr, INTERPRET: tl.constexpr):
    """Fold the key tiles starting in ``[lo, hi)``, ``BLOCK_N`` apart, of one request
    and KV head into ``(acc, m_i, l_i)``; keys ``>= end`` are excluded.

    ``lo`` is a multiple of ``BLOCK_N``.  ``MASKED``, ``ONE_PAGE`` and ``USE_TMA``
    as in :func:`load_key_tile` and :func:`online_softmax_step`;
    ``k_table``/``v_table`` point at the request's page-table rows.
    """
    if INTERPRET:
        # The interpreter's scalars are 1-element arrays, which ``range`` cannot
        # take as bounds; a while loop gives the same iterations.
        n0 = lo
        while n0 < hi:
            acc, m_i, l_i = _fold_key_tile(
                n0, end, q, acc, m_i, l_i, q_pos, k_src, v_src, k_table, v_table,
                k_head_offset, v_head_offset, stride_kp, stride_ks, stride_vp, stride_vs,
                k_page_rows, v_page_rows, scale_log2, window_left, PAGE_SIZE, HEAD_DIM,
                BLOCK_N, MASKED, CAUSAL, WINDOW, ONE_PAGE, USE_TMA, INTERPRET)
            n0 += BLOCK_N
    else:
        # A for loop, so that the compiler software-pipelines the page loads.
        for n0 in range(lo, hi, BLOCK_N):
            acc, m_i, l_i = _fold_key_tile(
                n0, end, q, acc, m_i, l_i, q_pos, k_src, v_src, k_table, v_table,
                k_head_offset, v_head_offset, stride_kp, stride_ks, stride_vp, stride_vs,
                k_page_rows, v_page_rows, scale_log2, window_left, PAGE_SIZE, HEAD_DIM,
                BLOCK_N, MASKED, CAUSAL, WINDOW, ONE_PAGE, USE_TMA, INTERPRET)
    return acc, m_i, l_i


@triton.jit
def attend_key_range(start, full_end, end, q, acc, m_i, l_i, q_pos, k_src, v_src, k_table,
                     v_table, k_head_offset, v_head_offset, stride_kp, stride_ks, stride_vp,
                     stride_vs, k_page_rows, v_page_rows, scale_log2, window_left,
                     PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
                     CAUSAL: tl.constexpr, WINDOW: tl.constexpr, ONE_PAGE: tl.constexpr,
                     USE_TMA: tl.constexpr, INTERPRET: tl.constexpr):
    """Fold keys ``[start, end)``: the tiles before ``full_end`` without masks, the rest
    with them (:func:`fold_key_tiles`).

    ``full_end - start`` is a multiple of ``BLOCK_N``, and the tiles before it
    hold only keys ``< end`` that every row may see (see :func:`unmasked_end`).
    Returns the updated ``(acc, m_i, l_i)``.
    """
    acc, m_i, l_i = fold_key_tiles(
        start, full_end, end, q, acc, m_i, l_i, q_pos, k_src, v_src, k_table, v_table,
        k_head_offset, v_head_offset, stride_kp, stride_ks, stride_vp, stride_vs,
        k_page_rows, v_page_rows, scale_log2, window_left, PAGE_SIZE, HEAD_DIM, BLOCK_N,
        False, CAUSAL, WINDOW, ONE_PAGE, USE_TMA, INTERPRET)
    return fold_key_tiles(
        full_end, end, end, q, acc, m_i, l_i, q_pos, k_src, v_src, k_table, v_table,
        k_head_offset, v_head_offset, stride_kp, stride_ks, stride_vp, stride_vs,
        k_page_rows, v_page_rows, scale_log2, window_left, PAGE_SIZE, HEAD_DIM, BLOCK_N,
        True, CAUSAL, WINDOW, ONE_PAGE, USE_TMA, INTERPRET)


@triton.jit
def unmasked_end(start, end, first_q_pos, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
                 WINDOW: tl.constexpr):
    """End of the tiles from ``start`` that need no mask: all keys ``< end`` and, when
    ``CAUSAL``, ``<= first_q_pos`` (the smallest query position of the tile).  With a
    window every tile is masked."""
    full = end
    if CAUSAL:
        full = tl.minimum(full, first_q_pos + 1)
    if WINDOW:
        full = start
    return start + tl.maximum(full - start, 0) // BLOCK_N * BLOCK_N


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
