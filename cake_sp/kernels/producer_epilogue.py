"""The producer's tile order and tile epilogue, shared by its two kernels.

``producer.py`` (``tl.dot`` mainloops: pointer loads or TMA; any target and the
CPU interpreter) and ``producer_ws.py`` (a warp-specialised Gluon mainloop,
sm_90a) compute the same fp32 ``[BLOCK_M, D]`` accumulator of one (row block,
head) tile; everything after it (bias, RMSNorm, RoPE, bf16 rounding, the stores
at every destination and the readiness words) is :func:`deliver_tile`.

The helpers build no index vector of their own: the caller passes ``offs_m``
(``[BLOCK_M]`` source rows), ``cols`` (``[D]``) and ``half_cols`` (``[D/2]``),
so a Gluon caller chooses their layouts (slices of its accumulator's layout)
and a ``tl`` caller passes ``tl.arange``.  ``GLUON`` tells the RoPE helper to
match its operands' layouts, which Gluon requires and ``tl`` infers.
"""

from __future__ import annotations

import triton
import triton.language as tl

from cake_sp.kernels.norm_rope import load_cos_sin, rms_normalize, rope_rotate, round_to_bf16
from cake_sp.kernels.signals import (
    _ENTER_TIMEOUT,
    publish_run,
    record_timeout,
    spin_until_at_least,
)


@triton.jit
def tile_coords(tile, row_blocks, NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
                Q_PER_RANK: tl.constexpr, KV_PER_RANK: tl.constexpr,
                GROUP_HEADS: tl.constexpr):
    """``(row_block, head)`` of persistent tile ``tile``.

    Tiles come in groups of ``GROUP_HEADS`` head positions: row blocks in order
    within a group, head positions fastest.  Positions list the kinds in Q, K, V
    order and, within a kind, take the destination bands round-robin (band 0
    head 0, band 1 head 0, ...) so that consecutive tiles go to different ranks.
    """
    TOTAL_HEADS: tl.constexpr = NUM_Q_HEADS + 2 * NUM_KV_HEADS
    group_tiles = row_blocks * GROUP_HEADS
    group = tile // group_tiles
    first_pos = group * GROUP_HEADS
    group_size = tl.minimum(TOTAL_HEADS - first_pos, GROUP_HEADS)
    within = tile - group * group_tiles
    pos = first_pos + within % group_size
    is_q = pos < NUM_Q_HEADS
    first = tl.where(is_q, 0, tl.where(pos < NUM_Q_HEADS + NUM_KV_HEADS, NUM_Q_HEADS,
                                       NUM_Q_HEADS + NUM_KV_HEADS))
    per_band = tl.where(is_q, Q_PER_RANK, KV_PER_RANK)
    bands = tl.where(is_q, NUM_Q_HEADS // Q_PER_RANK, NUM_KV_HEADS // KV_PER_RANK)
    j = pos - first
    return within // group_size, first + (j % bands) * per_band + j // bands


@triton.jit
def _head_destinations(head, NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
                       Q_PER_RANK: tl.constexpr, KV_PER_RANK: tl.constexpr,
                       KV_REPLICAS: tl.constexpr):
    """Where projection head ``head`` goes (``HeadPlan.destinations``).

    Returns ``(kind, first_rank, replicas, local)``: ranks ``[first_rank,
    first_rank + replicas)`` each receive it as their local head ``local`` of ``kind``.
    """
    kind = (head >= NUM_Q_HEADS).to(tl.int32) + (head >= NUM_Q_HEADS + NUM_KV_HEADS).to(tl.int32)
    is_q = kind == 0
    j = head - tl.where(is_q, 0, tl.where(kind == 1, NUM_Q_HEADS, NUM_Q_HEADS + NUM_KV_HEADS))
    per_band = tl.where(is_q, Q_PER_RANK, KV_PER_RANK)
    replicas = tl.where(is_q, 1, KV_REPLICAS)
    return kind, (j // per_band) * replicas, replicas, j % per_band


@triton.jit
def _maybe_rms_norm(p, weight_ptr, cols, eps, HAS_WEIGHT: tl.constexpr, D: tl.constexpr,
                    NORMALIZED: tl.constexpr, INTERPRET: tl.constexpr):
    """``bf16(bf16(rmsnorm(p)) * w)`` as fp32 when the norm weight is given, else ``p``.
    ``NORMALIZED``: ``p`` already holds ``bf16(rmsnorm(p))``."""
    if HAS_WEIGHT:
        w = tl.load(weight_ptr + cols).to(tl.float32)
        if NORMALIZED:
            n = p
        else:
            n = round_to_bf16(rms_normalize(p, eps, D), INTERPRET).to(tl.float32)
        # Both factors are bf16 values, so the fp32 product is exact: rounding it
        # once gives the bf16 product.
        p = round_to_bf16(n * w[None, :], INTERPRET).to(tl.float32)
    return p


@triton.jit
def tile_cos_sin(offs_m, row_ok, half_cols, inputs, D: tl.constexpr,
                 HAS_POSITIONS: tl.constexpr, HEADS: tl.constexpr):
    """RoPE ``cos`` and ``sin`` (fp32 ``[BLOCK_M, D/2]`` each) of source rows ``offs_m`` where
    ``row_ok``, for ``HEADS`` Q or K heads of those rows; ``inputs`` as in :func:`deliver_tile`.

    With positions, a row whose table row lies outside the table reads nothing (cos = sin =
    0) and adds ``HEADS`` to the bad-positions counter (one per Q or K head it has)."""
    (_, _, _, cos_sin_ptr, cos_sin_stride, cos_sin_rows, pos_ptr, bad_pos_ptr, _) = inputs
    if HAS_POSITIONS:
        table_rows = tl.load(pos_ptr + offs_m, mask=row_ok, other=0).to(tl.int64)
        in_table = (table_rows >= 0) & (table_rows < cos_sin_rows)
        # Checked here rather than on the host, which would have to wait for the GPU.
        if bad_pos_ptr is not None:
            # One predicated atomic per row, issued only for rows out of the table (the
            # operands are vectors in offs_m's layout: Gluon does not broadcast scalars).
            zero = offs_m * 0
            tl.atomic_add(bad_pos_ptr + zero, zero + HEADS, mask=row_ok & ~in_table,
                          sem="relaxed", scope="sys")
        table_ok = row_ok & in_table
    else:
        table_rows = offs_m
        table_ok = row_ok
    return load_cos_sin(cos_sin_ptr, table_rows, cos_sin_stride, table_ok, half_cols, D)


@triton.jit
def _qkv_epilogue(acc, head, offs_m, row_ok, cols, half_cols, inputs,
                  NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, D: tl.constexpr,
                  BLOCK_M: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_Q_NORM: tl.constexpr,
                  HAS_K_NORM: tl.constexpr, HAS_POSITIONS: tl.constexpr,
                  ROPE_STYLE: tl.constexpr, GLUON: tl.constexpr, NORMALIZED: tl.constexpr,
                  INTERPRET: tl.constexpr, cos_sin):
    """The bf16 ``[BLOCK_M, D]`` output tile of projection head ``head`` (``producer.py``);
    ``inputs`` as in :func:`deliver_tile`.  ``NORMALIZED``: ``acc`` already has the bias
    and, for Q and K heads (both with norm weights), ``bf16(rmsnorm)`` applied; V heads are
    then already their bf16 output.  ``cos_sin``: the rows' ``(cos, sin)`` from
    :func:`tile_cos_sin`, or None to load them here."""
    (bias_ptr, q_norm_ptr, k_norm_ptr, _, _, _, _, _, eps) = inputs
    p = acc
    if HAS_BIAS:
        if not NORMALIZED:
            p += tl.load(bias_ptr + head * D + cols).to(tl.float32)[None, :]
    if head < NUM_Q_HEADS + NUM_KV_HEADS:
        if head < NUM_Q_HEADS:
            y = _maybe_rms_norm(p, q_norm_ptr, cols, eps, HAS_Q_NORM, D, NORMALIZED, INTERPRET)
        else:
            y = _maybe_rms_norm(p, k_norm_ptr, cols, eps, HAS_K_NORM, D, NORMALIZED, INTERPRET)
        if cos_sin is None:
            cos, sin = tile_cos_sin(offs_m, row_ok, half_cols, inputs, D, HAS_POSITIONS, 1)
        else:
            cos, sin = cos_sin
        out = round_to_bf16(rope_rotate(y, cos, sin, BLOCK_M, D, ROPE_STYLE, GLUON), INTERPRET)
    else:
        out = round_to_bf16(p, INTERPRET)
    return out


@triton.jit
def deliver_tile(acc, row_block, head, offs_m, cols, half_cols, entered, failed, rows, inputs,
                 dest, signals,
                 NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
                 Q_PER_RANK: tl.constexpr, KV_PER_RANK: tl.constexpr,
                 KV_REPLICAS: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr,
                 HAS_BIAS: tl.constexpr, HAS_Q_NORM: tl.constexpr, HAS_K_NORM: tl.constexpr,
                 HAS_POSITIONS: tl.constexpr, ROPE_STYLE: tl.constexpr, SIGNAL: tl.constexpr,
                 READY_M: tl.constexpr, GLUON: tl.constexpr, INTERPRET: tl.constexpr,
                 NORMALIZED: tl.constexpr = False, cos_sin=None):
    """Finish tile (``row_block``, ``head``) from its fp32 accumulator and store it at every
    destination; returns the updated bit sets of ranks seen entered / given up on by
    this program (``offs_m`` int64 source rows of the tile, ``cols``/``half_cols``
    ``arange(D)``/``arange(D/2)`` in layouts matching ``acc``).

    Readiness words count ``READY_M`` rows (the launcher's ``block_m``, dividing
    ``BLOCK_M``): the tile raises the word of every such block it has rows in, at every
    destination, after its stores there.  The kernel's arguments
    arrive in three tuples, unpacked below in their order: ``inputs`` what the epilogue
    reads (bias, norm weights, RoPE table, positions, eps), ``dest`` where it writes,
    ``signals`` the readiness protocol.  ``cos_sin``: the rows' RoPE ``(cos, sin)`` when
    the caller loaded them once for several heads (:func:`tile_cos_sin`), else None."""
    row_ok = offs_m < rows
    out = _qkv_epilogue(acc, head, offs_m, row_ok, cols, half_cols, inputs, NUM_Q_HEADS,
                        NUM_KV_HEADS, D, BLOCK_M, HAS_BIAS, HAS_Q_NORM, HAS_K_NORM,
                        HAS_POSITIONS, ROPE_STYLE, GLUON, NORMALIZED, INTERPRET, cos_sin)
    (dest_table_ptr, seq_local, dest_seq_len, dest_seq_offset, region_q, region_k, region_v,
     token_stride_q, token_stride_k, token_stride_v, head_stride_q, head_stride_k,
     head_stride_v) = dest
    epoch, enter_ptr, word_table_ptr, status_ptr, source_rank, max_row_blocks, timeout_ns = signals

    kind, first_rank, replicas, local = _head_destinations(
        head, NUM_Q_HEADS, NUM_KV_HEADS, Q_PER_RANK, KV_PER_RANK, KV_REPLICAS)
    is_q = kind == 0
    is_k = kind == 1
    # Element offsets at the destination (DestLayout): the same on every rank.
    b = offs_m // seq_local
    t = b * dest_seq_len + dest_seq_offset + (offs_m - b * seq_local)
    row_off = (tl.where(is_q, region_q, tl.where(is_k, region_k, region_v))
               + t * tl.where(is_q, token_stride_q, tl.where(is_k, token_stride_k,
                                                             token_stride_v))
               + local * tl.where(is_q, head_stride_q, tl.where(is_k, head_stride_k,
                                                                head_stride_v)))
    offs = row_off[:, None] + cols[None, :]
    HEADS_PER_RANK: tl.constexpr = Q_PER_RANK + 2 * KV_PER_RANK
    head_word = local + tl.where(is_q, 0, tl.where(is_k, Q_PER_RANK, Q_PER_RANK + KV_PER_RANK))
    # The tile's readiness blocks: WORDS of them, the ones past the call's rows without a word.
    tl.static_assert(BLOCK_M % READY_M == 0, "a tile holds whole readiness blocks")
    WORDS: tl.constexpr = BLOCK_M // READY_M
    row0 = row_block * BLOCK_M
    first_word = (source_rank * max_row_blocks + row0 // READY_M) * HEADS_PER_RANK + head_word
    words_raised = tl.minimum(WORDS, tl.cdiv(rows - row0, READY_M))

    for rep in range(KV_REPLICAS):
        if rep < replicas:
            rank = first_rank + rep
            if SIGNAL:
                # An int64 scalar 1 built from ``entered``: ``tl.full`` needs a layout in Gluon.
                bit = (entered * 0 + 1) << rank
                if ((entered | failed) & bit) == 0:
                    if spin_until_at_least(enter_ptr + rank, epoch, timeout_ns, INTERPRET):
                        entered |= bit
                    else:
                        failed |= bit
                        record_timeout(status_ptr, rank, _ENTER_TIMEOUT)
                go = (entered & bit) != 0
            else:
                go = True
            if go:
                base = tl.load(dest_table_ptr + rank).to(tl.pointer_type(tl.bfloat16))
                # A pointer made from an integer has no known alignment; the launcher
                # checks offsets and strides are multiples of 8 elements and the
                # addresses are 16-byte aligned, so every row is: 16-byte stores.
                ptrs = tl.max_contiguous(tl.multiple_of(base + offs, [1, 16]), [1, D])
                tl.store(ptrs, out, mask=row_ok[:, None])
                if SIGNAL:
                    words = tl.load(word_table_ptr + rank).to(tl.pointer_type(tl.int64))
                    publish_run(words + first_word, HEADS_PER_RANK, words_raised, epoch, WORDS)
    return entered, failed
