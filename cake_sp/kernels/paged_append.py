"""Paged KV-cache append: what the BF16 and FP8 append kernels share.

Both kernels (``qk_rope_append.py``, ``qk_rope_fp8_append.py``) run one 1-D
grid of two kinds of programs (``launch_plan`` sizes it from ``_config``'s table,
``program_role`` says which is which):

* *request* programs, ``CLEAR_PROGRAMS`` per request ``b``: each validates the
  metadata and zeroes its share of the unused rows of ``b``'s last page (the
  tail's chunks of ``(row, kv head)`` pairs dealt out in turn; a program whose
  share is empty stops early); share 0 also writes the request's status;
* *tile* programs, one per ``(BLOCK_M tokens, BLOCK_S head slots)``: slot ``s`` is
  column block ``s`` of the packed ``qkv`` row, so slots ``[0, Hq)`` are Q heads,
  ``[Hq, Hq + Hkv)`` K heads and ``[Hq + Hkv, Hq + 2 Hkv)`` V heads.  A launch takes
  one of two shapes: ``BLOCK_M`` tokens of one slot (``tile_program``: the tokens are
  the rows of the tile), or one token and ``BLOCK_S`` consecutive slots
  (``token_program``: the slots are the rows, and the token's metadata are scalars),
  which the BF16 kernel runs for decode batches
  (``_config.append_token_programs``).

The smaller of the two groups comes first in the grid (``_config.append_tiles_first``),
so that it is not dispatched behind the other.

Metadata, as in FlashInfer's cake contract: ``q_indptr[B + 1]`` splits the ``T``
packed tokens into requests, ``seq_lens[B]`` is each request's length *after*
the append, so token ``r`` of request ``b`` has position
``r + seq_lens[b] - (q_indptr[b + 1] - q_indptr[b])`` and lands in page
``page_indices[b, pos // page_size]``, row ``pos % page_size``.

Every program re-validates ``q_indptr`` itself (one pass over ``B + 1``
int32 values, served from L2), so a malformed table writes nothing without a
host sync or a second launch.  Statuses (bit flags, ``ERR_*``) are computed
from the metadata alone by the request programs, so no atomics are needed and
a CUDA-graph replay rewrites them from scratch.

The kernels are latency-bound at serving sizes, so a program keeps its chain of
dependent loads to two, and issues every load of a level before the first
instruction that waits on one: a warp issues in order, so a load written after
such an instruction (or after a cross-warp reduction's barrier) starts only once
the earlier load has landed.  First level: the token's request guessed
(``guess_request``: request ``tok`` itself, always right for decode batches),
its input rows (they need no metadata), the ``q_indptr`` pass; then the scan
for a missed guess (``find_requests``, ``find_request``); second level: the page
table and the RoPE rows.  Heads are held as two
column halves, so NeoX RoPE needs no exchange between threads.  Why token programs
for decode: a tile of tokens holds each token's metadata as a vector in a layout of
its own, and every use beside the ``[rows, D/2]`` data (RoPE rows, store addresses,
masks) converts it through shared memory behind a CTA barrier; a scalar needs none.

This module also holds the host-side checks common to both launchers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cake_sp._validation import check_tensor, describe
from cake_sp.kernels import _config
from cake_sp.kernels.norm_rope import (
    QK_NORM_NONE,
    QK_NORM_POLICIES,
    load_cos_sin_halves,
    qk_norm_rope_halves,
)

KV_LAYOUTS = ("NHD", "HND")
HEAD_DIMS = (64, 128, 256)

# Status bits written to ``error_flags[b]`` (0 = the request was appended in full).
ERR_METADATA = 1  # q_indptr malformed (or a request too long for q_scale): nothing written
ERR_POSITION = 2  # positions outside cos_sin or the page table: the request wrote nothing
ERR_PAGE = 4  # a page index outside [0, num_pages): K/V rows for that page not stored
_ERR_METADATA: tl.constexpr = tl.constexpr(ERR_METADATA)
_ERR_POSITION: tl.constexpr = tl.constexpr(ERR_POSITION)
_ERR_PAGE: tl.constexpr = tl.constexpr(ERR_PAGE)


# ----------------------------------------------------------------------------- device
# Loop trip counts are compile-time (``NUM_*_CHUNKS``, ``PAGE_SIZE``): loops run
# over masked chunks instead of runtime bounds, which Triton's CPU interpreter
# cannot iterate (its scalars are 1-element arrays, which NumPy 2 refuses to
# turn into an index).


@triton.jit
def program_role(pid, num_tokens, num_req, NUM_SLOTS: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_S: tl.constexpr, CLEAR_PROGRAMS: tl.constexpr,
                 TILES_FIRST: tl.constexpr):
    """``(is_request, index)``: whether program ``pid`` of the grid is a request program,
    and its index among the programs of its kind.

    ``TILES_FIRST``: the ``cdiv(T, BLOCK_M) * cdiv(NUM_SLOTS, BLOCK_S)`` tile programs
    come first, then the ``B * CLEAR_PROGRAMS`` request programs; otherwise the other way
    round.
    """
    if TILES_FIRST:
        tiles = tl.cdiv(num_tokens, BLOCK_M) * ((NUM_SLOTS + BLOCK_S - 1) // BLOCK_S)
        is_request = pid >= tiles
        index = tl.where(is_request, pid - tiles, pid)
    else:
        requests = num_req * CLEAR_PROGRAMS
        is_request = pid < requests
        index = tl.where(is_request, pid, pid - requests)
    return is_request, index


@triton.jit
def q_indptr_valid(q_indptr_ptr, num_req, num_tokens, max_req_len, CHUNK_B: tl.constexpr,
                   NUM_B_CHUNKS: tl.constexpr):
    """True iff ``q_indptr[0] == 0``, ``q_indptr[B] == T``, the table is
    non-decreasing and no request has more than ``max_req_len`` tokens (a scalar)."""
    first = tl.load(q_indptr_ptr)
    last = tl.load(q_indptr_ptr + num_req)
    bad = (first != 0).to(tl.int32) + (last != num_tokens).to(tl.int32)
    # One reduction at the end: across warps it is a shared-memory round trip and a barrier.
    bad_requests = tl.zeros([CHUNK_B], dtype=tl.int32)
    for c in range(NUM_B_CHUNKS):
        j = c * CHUNK_B + tl.arange(0, CHUNK_B)
        m = j < num_req
        lo = tl.load(q_indptr_ptr + j, mask=m, other=0)
        n = tl.load(q_indptr_ptr + j + 1, mask=m, other=0) - lo
        bad_requests += (m & ((n < 0) | (n > max_req_len))).to(tl.int32)
    return bad + tl.sum(bad_requests, axis=0) == 0


@triton.jit
def guess_request(q_indptr_ptr, seq_lens_ptr, num_req, tok):
    """The first guess at the request holding token ``tok`` (a scalar or a vector): request
    ``tok`` itself, which decode batches (one token per request) always match, clamped into
    ``[0, B)``.  Returns ``(req, start, end, seq_len)``: the index, ``q_indptr[req]``,
    ``q_indptr[req + 1]`` and ``seq_lens[req]``, three loads that wait on none.

    A program issues these before its other loads' first consumer: a warp issues in order,
    so a load written after an instruction that waits on an earlier one starts only when
    that one has landed.
    """
    req = tl.minimum(tok, num_req - 1)
    return (req, tl.load(q_indptr_ptr + req), tl.load(q_indptr_ptr + req + 1),
            tl.load(seq_lens_ptr + req))


@triton.jit
def find_requests(q_indptr_ptr, seq_lens_ptr, num_req, tok, live, req, start, end, seq_len,
                  BLOCK_M: tl.constexpr, CHUNK_B: tl.constexpr, NUM_B_CHUNKS: tl.constexpr):
    """The request holding each token of ``tok`` (int32 ``[BLOCK_M]``; ``live``
    masks the tokens that exist), from ``guess_request``'s ``(req, start, end, seq_len)``.

    Returns int32 ``[BLOCK_M]`` vectors ``(req, start, end, seq_len)`` as
    ``guess_request`` does; exact for a valid table (``q_indptr_valid``), unspecified
    otherwise but for ``req``, which is always in ``[0, B)``.

    Only when a live token of the tile falls outside its guess does the program scan
    the table, taking the four values as masked sums over the one request whose range
    holds the token.
    """
    missed = tl.sum((live & ((tok < start) | (tok >= end))).to(tl.int32), axis=0)
    if missed > 0:
        req = tl.zeros([BLOCK_M], dtype=tl.int32)
        start = tl.zeros([BLOCK_M], dtype=tl.int32)
        end = tl.zeros([BLOCK_M], dtype=tl.int32)
        seq_len = tl.zeros([BLOCK_M], dtype=tl.int32)
        for c in range(NUM_B_CHUNKS):
            j = c * CHUNK_B + tl.arange(0, CHUNK_B)
            m = j < num_req
            lo = tl.load(q_indptr_ptr + j, mask=m, other=0)
            hi = tl.load(q_indptr_ptr + j + 1, mask=m, other=0)
            sl = tl.load(seq_lens_ptr + j, mask=m, other=0)
            hit = m[None, :] & (lo[None, :] <= tok[:, None]) & (tok[:, None] < hi[None, :])
            req += tl.sum(tl.where(hit, j[None, :], 0), axis=1)
            start += tl.sum(tl.where(hit, lo[None, :], 0), axis=1)
            end += tl.sum(tl.where(hit, hi[None, :], 0), axis=1)
            seq_len += tl.sum(tl.where(hit, sl[None, :], 0), axis=1)
        # Overlapping ranges of a malformed table sum to any index.
        req = tl.minimum(req, num_req - 1)
    return req, start, end, seq_len


@triton.jit
def find_request(q_indptr_ptr, seq_lens_ptr, num_req, tok, req, start, end, seq_len,
                 CHUNK_B: tl.constexpr, NUM_B_CHUNKS: tl.constexpr):
    """``find_requests`` for one token ``tok`` (a scalar): scalars ``(req, start, end,
    seq_len)`` from ``guess_request``'s.  On a miss one scan of the table finds the
    request, then its three values are loaded again, from an index kept in ``[0, B)``: the
    ranges of a malformed table may overlap, and their indices sum past the table."""
    if (tok < start) | (tok >= end):
        req = req * 0
        for c in range(NUM_B_CHUNKS):
            j = c * CHUNK_B + tl.arange(0, CHUNK_B)
            m = j < num_req
            lo = tl.load(q_indptr_ptr + j, mask=m, other=0)
            hi = tl.load(q_indptr_ptr + j + 1, mask=m, other=0)
            req += tl.sum(tl.where(m & (lo <= tok) & (tok < hi), j, 0), axis=0)
        req = tl.minimum(req, num_req - 1)
        start = tl.load(q_indptr_ptr + req)
        end = tl.load(q_indptr_ptr + req + 1)
        seq_len = tl.load(seq_lens_ptr + req)
    return req, start, end, seq_len


@triton.jit
def positions_in_range(n, seq_len, max_pos, max_pages, PAGE_SIZE: tl.constexpr):
    """Whether the positions ``[seq_len - n, seq_len)`` of a request appending ``n``
    tokens all index the ``cos_sin`` table (``< max_pos``) and the page table
    (``< max_pages * PAGE_SIZE``); scalars or vectors."""
    # seq_len >= n >= 0 first, so that the division below never sees a negative value.
    return (seq_len >= n) & (seq_len <= max_pos) & (
        tl.maximum(seq_len - 1, 0) // PAGE_SIZE < max_pages)


@triton.jit
def tile_program(pid, qkv_ptr, q_indptr_ptr, seq_lens_ptr, page_indices_ptr, num_tokens,
                 num_req, max_req_len, max_pos, max_pages, num_pages, stride_qkv, stride_pi,
                 NUM_SLOTS: tl.constexpr, D: tl.constexpr, PAGE_SIZE: tl.constexpr,
                 BLOCK_M: tl.constexpr, CHUNK_B: tl.constexpr, NUM_B_CHUNKS: tl.constexpr):
    """Tile program ``pid`` = ``block * NUM_SLOTS + slot``: tokens
    ``[block * BLOCK_M, (block + 1) * BLOCK_M)`` of head slot ``slot``.

    Loads the tile's input first, as its two column halves ``x_lo``, ``x_hi``
    (bf16 ``[BLOCK_M, D/2]``, channels ``[0, D/2)`` and ``[D/2, D)``: NeoX pairs
    meet in one thread, no layout change), so that the loads overlap the
    metadata reads; rows past ``T`` read 0.  Returns ``(slot, tok, req, r,
    tok_ok, pos, page, row, page_ok, x_lo, x_hi)``: the token's request, its index
    in it, whether it may be written at all (a valid table, its request's
    positions in range), its position (int64), its page and row, and whether
    that page is in ``[0, num_pages)``.
    """
    slot = pid % NUM_SLOTS
    tok = (pid // NUM_SLOTS) * BLOCK_M + tl.arange(0, BLOCK_M)
    in_batch = tok < num_tokens
    req, start, end, seq_len = guess_request(q_indptr_ptr, seq_lens_ptr, num_req, tok)
    src = (qkv_ptr + tok.to(tl.int64)[:, None] * stride_qkv + slot * D
           + tl.arange(0, D // 2)[None, :])
    x_lo = tl.load(src, mask=in_batch[:, None], other=0.0)
    x_hi = tl.load(src + D // 2, mask=in_batch[:, None], other=0.0)
    valid = q_indptr_valid(q_indptr_ptr, num_req, num_tokens, max_req_len, CHUNK_B,
                           NUM_B_CHUNKS)
    req, start, end, seq_len = find_requests(q_indptr_ptr, seq_lens_ptr, num_req, tok,
                                             in_batch, req, start, end, seq_len, BLOCK_M,
                                             CHUNK_B, NUM_B_CHUNKS)
    tok_ok = valid & in_batch & positions_in_range(end - start, seq_len, max_pos, max_pages,
                                                   PAGE_SIZE)
    # pos = r + seq_len - n with r = tok - start and n = end - start.
    pos = tl.where(tok_ok, tok + seq_len - end, 0).to(tl.int64)
    page = tl.load(page_indices_ptr + req.to(tl.int64) * stride_pi + pos // PAGE_SIZE,
                   mask=tok_ok, other=-1)
    page_ok = tok_ok & (page >= 0) & (page < num_pages)
    return (slot, tok, req, tok - start, tok_ok, pos, page.to(tl.int64), pos % PAGE_SIZE,
            page_ok, x_lo, x_hi)


@triton.jit
def token_program(pid, qkv_ptr, q_indptr_ptr, seq_lens_ptr, page_indices_ptr, num_tokens,
                  num_req, max_req_len, max_pos, max_pages, num_pages, stride_qkv, stride_pi,
                  NUM_SLOTS: tl.constexpr, D: tl.constexpr, PAGE_SIZE: tl.constexpr,
                  BLOCK_S: tl.constexpr, CHUNK_B: tl.constexpr, NUM_B_CHUNKS: tl.constexpr):
    """Token program ``pid`` = ``tok * cdiv(NUM_SLOTS, BLOCK_S) + group``: head slots
    ``[group * BLOCK_S, (group + 1) * BLOCK_S)`` of token ``tok``, the rows of its tile.

    Loads the slots' input first, as ``tile_program`` does (bf16 ``[BLOCK_S, D/2]``
    halves; slots past ``NUM_SLOTS`` read 0).  Returns ``(slot, slot_ok, tok, tok_ok, pos,
    page, row, page_ok, x_lo, x_hi)``: ``slot`` and ``slot_ok`` (the slot exists) are
    int32 / bool ``[BLOCK_S]``; the rest, as ``tile_program``'s, are scalars.
    """
    groups = (NUM_SLOTS + BLOCK_S - 1) // BLOCK_S
    tok = pid // groups
    slot = (pid % groups) * BLOCK_S + tl.arange(0, BLOCK_S)
    slot_ok = slot < NUM_SLOTS
    req, start, end, seq_len = guess_request(q_indptr_ptr, seq_lens_ptr, num_req, tok)
    src = (qkv_ptr + tok.to(tl.int64) * stride_qkv + slot[:, None] * D
           + tl.arange(0, D // 2)[None, :])
    x_lo = tl.load(src, mask=slot_ok[:, None], other=0.0)
    x_hi = tl.load(src + D // 2, mask=slot_ok[:, None], other=0.0)
    valid = q_indptr_valid(q_indptr_ptr, num_req, num_tokens, max_req_len, CHUNK_B,
                           NUM_B_CHUNKS)
    req, start, end, seq_len = find_request(q_indptr_ptr, seq_lens_ptr, num_req, tok, req,
                                            start, end, seq_len, CHUNK_B, NUM_B_CHUNKS)
    tok_ok = valid & positions_in_range(end - start, seq_len, max_pos, max_pages, PAGE_SIZE)
    pos = tl.where(tok_ok, tok + seq_len - end, 0).to(tl.int64)
    page = tl.load(page_indices_ptr + req.to(tl.int64) * stride_pi + pos // PAGE_SIZE,
                   mask=tok_ok, other=-1)
    page_ok = tok_ok & (page >= 0) & (page < num_pages)
    return slot, slot_ok, tok, tok_ok, pos, page.to(tl.int64), pos % PAGE_SIZE, page_ok, x_lo, x_hi


@triton.jit
def normalized_rotated_slots(x_lo, x_hi, slot, pos, tok_ok, cos_sin_ptr, stride_cs, q_norm_ptr,
                             k_norm_ptr, eps, HQ: tl.constexpr, POLICY: tl.constexpr,
                             BLOCK_S: tl.constexpr, D: tl.constexpr, STYLE: tl.constexpr):
    """``qk_norm_rope`` of every row of a token program (``token_program``) with RoPE row
    ``pos`` and each row's kind's norm weights (Q rows ``q_norm``, the others ``k_norm``):
    fp32 column halves, unrounded.  V rows come out normalised and rotated too; callers
    store their input instead."""
    # The RoPE row once per slot row, a [BLOCK_S, D/2] tile in the rows' own layout (the
    # copies come from L1).  Loaded once, as [1, D/2], it took a layout of its own that
    # Triton then computed in, moving every input and output half through shared memory
    # behind CTA barriers, which also held the second row load behind the first (with the
    # load order of ``guess_request``, 2-6 % of an H100 decode call; docs/results.md).
    rows = tl.full([BLOCK_S], 0, tl.int64) + pos
    cos_lo, sin_lo, cos_hi, sin_hi = load_cos_sin_halves(
        cos_sin_ptr, rows, stride_cs, tl.full([BLOCK_S], 0, tl.int1) | tok_ok, D, STYLE)
    w_lo = 1.0  # policy 0 reads no weights
    w_hi = 1.0
    if POLICY != QK_NORM_NONE:  # each row its kind's weights, a tile as the RoPE row's
        w_ptr = tl.where(slot < HQ, q_norm_ptr, k_norm_ptr)[:, None] + tl.arange(0, D // 2)
        w_lo = tl.load(w_ptr).to(tl.float32)
        w_hi = tl.load(w_ptr + D // 2).to(tl.float32)
    return qk_norm_rope_halves(x_lo.to(tl.float32), x_hi.to(tl.float32), w_lo, w_hi, cos_lo,
                               sin_lo, cos_hi, sin_hi, eps, POLICY, BLOCK_S, D, STYLE)


@triton.jit
def store_slot_rows(out_q_ptr, k_ptr, v_ptr, lo, hi, slot, slot_ok, tok, page, row, tok_ok,
                    page_ok, stride_qt, stride_qh, stride_cp, stride_cr, stride_ch,
                    stride_kt, stride_kh, stride_vt, stride_vh, HQ: tl.constexpr,
                    HKV: tl.constexpr, D: tl.constexpr, K_TO_CACHE: tl.constexpr,
                    V_TO_CACHE: tl.constexpr):
    """Store a token program's rows (column halves ``[BLOCK_S, D/2]``, already in the
    destination dtype) where each slot's kind sends it: Q rows into ``out_q`` row ``tok``,
    K / V rows into their cache at ``(page, row)`` (``k_ptr`` / ``v_ptr`` the caches) or,
    without ``*_TO_CACHE``, into the caller's ``out_k`` / ``out_v`` row ``tok`` (then
    ``k_ptr`` / ``v_ptr`` point there).  One store per half: each row's address and
    mask are chosen by its kind."""
    is_q = slot < HQ
    is_v = slot >= HQ + HKV
    tok64 = tok.to(tl.int64)
    q_dst = out_q_ptr + tok64 * stride_qt + slot * stride_qh
    if K_TO_CACHE:
        k_dst = k_ptr + page * stride_cp + row * stride_cr + (slot - HQ) * stride_ch
        k_ok = page_ok
    else:
        k_dst = k_ptr + tok64 * stride_kt + (slot - HQ) * stride_kh
        k_ok = tok_ok
    if V_TO_CACHE:
        v_dst = v_ptr + page * stride_cp + row * stride_cr + (slot - HQ - HKV) * stride_ch
        v_ok = page_ok
    else:
        v_dst = v_ptr + tok64 * stride_vt + (slot - HQ - HKV) * stride_vh
        v_ok = tok_ok
    dst = (tl.where(is_q, q_dst, tl.where(is_v, v_dst, k_dst))[:, None]
           + tl.arange(0, D // 2)[None, :])
    ok = (slot_ok & tl.where(is_q, tok_ok, tl.where(is_v, v_ok, k_ok)))[:, None]
    tl.store(dst, lo, mask=ok)
    tl.store(dst + D // 2, hi, mask=ok)


@triton.jit
def normalized_rotated_head(x_lo, x_hi, slot, pos, tok_ok, cos_sin_ptr, stride_cs, q_norm_ptr,
                            k_norm_ptr, eps, HQ: tl.constexpr, POLICY: tl.constexpr,
                            BLOCK_M: tl.constexpr, D: tl.constexpr, STYLE: tl.constexpr):
    """``qk_norm_rope`` of a Q (``slot < Hq``) or K tile from ``tile_program``: its
    fp32 column halves, unrounded, with RoPE row ``pos`` and that head kind's norm
    weights."""
    cos_lo, sin_lo, cos_hi, sin_hi = load_cos_sin_halves(cos_sin_ptr, pos, stride_cs, tok_ok,
                                                         D, STYLE)
    w_lo = 1.0  # policy 0 reads no weights
    w_hi = 1.0
    if POLICY != QK_NORM_NONE:
        if slot < HQ:
            w_ptr = q_norm_ptr
        else:
            w_ptr = k_norm_ptr
        # Loaded as vectors ([D/2]), not [1, D/2] tiles: a tile took a layout of its own and
        # the FP8 kernel's head through shared memory (116 registers from 69, sm_90a).
        half = tl.arange(0, D // 2)
        w_lo = tl.load(w_ptr + half).to(tl.float32)[None, :]
        w_hi = tl.load(w_ptr + D // 2 + half).to(tl.float32)[None, :]
    return qk_norm_rope_halves(x_lo.to(tl.float32), x_hi.to(tl.float32), w_lo, w_hi, cos_lo,
                               sin_lo, cos_hi, sin_hi, eps, POLICY, BLOCK_M, D, STYLE)


@triton.jit
def store_token_rows(out_ptr, lo, hi, tok, head, tok_ok, stride_ot, stride_oh,
                     D: tl.constexpr):
    """Store a head tile, given as its column halves ``lo``, ``hi`` (``[BLOCK_M, D/2]``
    each, ``tile_program``), into rows ``tok`` of a ``[T, H, D]`` output (``out_q``,
    or the caller's ``out_k`` / ``out_v``); ``tok_ok`` gates the rows."""
    dst = (out_ptr + (tok.to(tl.int64) * stride_ot + head * stride_oh)[:, None]
           + tl.arange(0, D // 2)[None, :])
    tl.store(dst, lo, mask=tok_ok[:, None])
    tl.store(dst + D // 2, hi, mask=tok_ok[:, None])


@triton.jit
def store_kv_rows(cache_ptr, out_ptr, lo, hi, tok, head, page, row, tok_ok, page_ok,
                  stride_cp, stride_cr, stride_ch, stride_ot, stride_oh,
                  D: tl.constexpr, TO_CACHE: tl.constexpr):
    """Store a K or V tile of kv head ``head`` (column halves, as ``store_token_rows``).

    ``TO_CACHE``: into the paged cache at ``(page, row)`` of each token, skipping
    tokens whose page is out of range; otherwise into the caller's ``out``
    ``[T, Hkv, D]`` (no page involved, so only ``tok_ok`` gates the row).
    """
    if TO_CACHE:
        dst = (cache_ptr + (page * stride_cp + row * stride_cr + head * stride_ch)[:, None]
               + tl.arange(0, D // 2)[None, :])
        tl.store(dst, lo, mask=page_ok[:, None])
        tl.store(dst + D // 2, hi, mask=page_ok[:, None])
    else:
        store_token_rows(out_ptr, lo, hi, tok, head, tok_ok, stride_ot, stride_oh, D)


@triton.jit
def request_status(n, seq_len, page_indices_ptr, stride_pi, b, valid, check_pages, max_pos,
                   max_pages, num_pages, PAGE_SIZE: tl.constexpr, CHUNK_P: tl.constexpr,
                   NUM_P_CHUNKS: tl.constexpr):
    """Status of request ``b`` (``n`` tokens appended, length ``seq_len`` after) and the
    last page whose unused rows it may clear.

    Returns ``(status, last_page)``: ``status`` is a sum of ``ERR_*`` bits
    (``ERR_PAGE`` only looked for when ``check_pages``: it walks the page-table slots
    the request writes, ``NUM_P_CHUNKS`` chunks from the first); ``last_page`` is the
    page holding the request's last row when that page may be cleared, else -1
    (``last_page_tail`` says which of its rows follow the last row).  As in
    FlashInfer's kernel, every request of length ``seq_len >= 1`` clears, also one that
    appends no token in this call; here only when the table is valid, the last row
    lies inside the page table, the request's appended positions (if any) are in
    range, and the page index is in ``[0, num_pages)``.
    """
    pos_ok = positions_in_range(n, seq_len, max_pos, max_pages, PAGE_SIZE)
    status = tl.where(valid, 0, _ERR_METADATA)
    status += tl.where(valid & (n > 0) & (~pos_ok), _ERR_POSITION, 0)
    writes = valid & (n > 0) & pos_ok
    # The page slots the request writes: [first_slot, last_slot].
    first_slot = tl.where(writes, (seq_len - n) // PAGE_SIZE, 0)
    last_slot = tl.where(writes, (seq_len - 1) // PAGE_SIZE, -1)
    row_base = page_indices_ptr + b.to(tl.int64) * stride_pi
    if check_pages:
        bad_slots = tl.zeros([CHUNK_P], dtype=tl.int32)
        for c in range(NUM_P_CHUNKS):  # from the first written slot (launch_plan's bound)
            s = first_slot + c * CHUNK_P + tl.arange(0, CHUNK_P)
            m = s <= last_slot
            p = tl.load(row_base + s, mask=m, other=0)
            bad_slots += (m & ((p < 0) | (p >= num_pages))).to(tl.int32)
        # One reduction after the loop, not one a chunk: each is a shared-memory round trip
        # and a barrier.
        status += tl.where(tl.sum(bad_slots, axis=0) > 0, _ERR_PAGE, 0)
    # The page holding the last row: for a request that appends nothing only the page table
    # bound matters (its positions index no cos/sin row).
    in_table = (seq_len > 0) & (tl.maximum(seq_len - 1, 0) // PAGE_SIZE < max_pages)
    clears = valid & in_table & ((n == 0) | pos_ok)
    tail_slot = tl.where(clears, (seq_len - 1) // PAGE_SIZE, 0)
    last_page = tl.load(row_base + tail_slot, mask=clears, other=-1)
    last_page = tl.where((last_page >= 0) & (last_page < num_pages), last_page, -1)
    return status, last_page.to(tl.int64)


@triton.constexpr_function
def page_chunks(page_size, num_kv_heads, block_r):
    """Chunks of ``block_r`` ``(row, kv head)`` pairs that cover one page."""
    return (page_size * num_kv_heads + block_r - 1) // block_r


@triton.jit
def last_page_tail(seq_len, HKV: tl.constexpr, PAGE_SIZE: tl.constexpr,
                   BLOCK_R: tl.constexpr):
    """Where the unused rows of a request's last page lie, from its length alone.

    Returns ``(tail_start, first_chunk, num_chunks)``: rows ``[tail_start, PAGE_SIZE)``
    follow the request's last row; they lie in the ``num_chunks`` chunks of ``BLOCK_R``
    ``(row, kv head)`` pairs (NHD order) from chunk ``first_chunk`` on.  No chunk for a
    request of length below 1 (``request_status`` gives it no page to clear).
    """
    tail_start = seq_len - (tl.maximum(seq_len, 1) - 1) // PAGE_SIZE * PAGE_SIZE
    first_chunk = tail_start * HKV // BLOCK_R
    num_chunks = page_chunks(PAGE_SIZE, HKV, BLOCK_R) - first_chunk
    return tail_start, first_chunk, tl.where(seq_len > 0, num_chunks, 0)


@triton.jit
def clear_rows(cache_ptr, page, row_start, first_chunk, share, stride_cp, stride_cr,
               stride_ch, HKV: tl.constexpr, D: tl.constexpr, PAGE_SIZE: tl.constexpr,
               BLOCK_R: tl.constexpr, SHARES: tl.constexpr):
    """Zero share ``share`` of ``SHARES`` of a last page's tail: chunk ``first_chunk +
    share + i * SHARES`` for every ``i``, each ``BLOCK_R`` ``(row, kv head)`` pairs (pair
    ``p`` is row ``p // Hkv``, head ``p % Hkv``: the NHD order) of page ``page``, only
    their rows in ``[row_start, PAGE_SIZE)``; none if ``page`` is -1.

    The chunks are dealt out from the tail's first, so that a short tail of a long page
    still spreads over the shares.  The loop runs as many steps as a whole page would
    take (a static count: the interpreter cannot run a loop bound by a loaded value);
    the masks drop the chunks past the page.  Zero is the all-zero bit pattern in both
    bf16 and FP8 e4m3, so one helper serves both cache dtypes.
    """
    cols = tl.arange(0, D)[None, :]
    zeros = tl.zeros([BLOCK_R, D], dtype=cache_ptr.dtype.element_ty)
    base = cache_ptr + page * stride_cp
    for i in range((page_chunks(PAGE_SIZE, HKV, BLOCK_R) + SHARES - 1) // SHARES):
        # A scalar start and a static vector: dividing the loaded start's pair vector by
        # Hkv took the FP8 kernel from 72 to 118 registers (sm_90a), 17-23 % slower.
        first_pair = (first_chunk + share + i * SHARES) * BLOCK_R
        k = first_pair % HKV + tl.arange(0, BLOCK_R)
        row = first_pair // HKV + k // HKV
        m = (page >= 0) & (row >= row_start) & (row < PAGE_SIZE)
        offs = row.to(tl.int64) * stride_cr + (k % HKV) * stride_ch
        # Nothing reads the zeros soon: on an H200 the hint took the 33 MB clear of 128
        # requests' pages of 64 rows (Hkv 8) 5 % faster.
        tl.store(base + offs[:, None] + cols, zeros, mask=m[:, None],
                 eviction_policy="evict_first")


@triton.jit
def request_program(pid, q_indptr_ptr, seq_lens_ptr, page_indices_ptr, k_cache_ptr,
                    v_cache_ptr, error_flags_ptr, num_tokens, num_req, max_req_len, max_pos,
                    max_pages, num_pages, stride_pi, stride_cp, stride_cr, stride_ch,
                    HKV: tl.constexpr, D: tl.constexpr, PAGE_SIZE: tl.constexpr,
                    CHUNK_B: tl.constexpr, NUM_B_CHUNKS: tl.constexpr, CHUNK_P: tl.constexpr,
                    NUM_P_CHUNKS: tl.constexpr, BLOCK_R: tl.constexpr,
                    CLEAR_PROGRAMS: tl.constexpr, CLEAR: tl.constexpr,
                    HAS_ERROR_FLAGS: tl.constexpr):
    """Request program ``pid`` = ``b * CLEAR_PROGRAMS + c``: status of request ``b``
    (written by ``c == 0``), then zero share ``c`` of the unused rows of its last page
    in both caches.  A program ``c > 0`` whose share is empty stops once it has read the
    tables, before the page-table lookup and the stores.

    Returns ``(b, c, valid)`` so that a kernel can add its own per-request outputs.
    """
    b = pid // CLEAR_PROGRAMS
    c = pid % CLEAR_PROGRAMS
    # Every load the status needs first, together: a program that stops early has waited
    # for one round trip, and one that works for no more than before.
    start = tl.load(q_indptr_ptr + b)
    end = tl.load(q_indptr_ptr + b + 1)
    seq_len = tl.load(seq_lens_ptr + b)
    valid = q_indptr_valid(q_indptr_ptr, num_req, num_tokens, max_req_len, CHUNK_B,
                           NUM_B_CHUNKS)
    n = end - start
    tail_start, first_chunk, num_chunks = last_page_tail(seq_len, HKV, PAGE_SIZE, BLOCK_R)
    works = c == 0
    if CLEAR:
        works |= c < num_chunks
    if works:
        status, last_page = request_status(
            n, seq_len, page_indices_ptr, stride_pi, b, valid, c == 0, max_pos, max_pages,
            num_pages, PAGE_SIZE, CHUNK_P, NUM_P_CHUNKS)
        if HAS_ERROR_FLAGS:
            tl.store(error_flags_ptr + b, status, mask=c == 0)
        if CLEAR:
            clear_rows(k_cache_ptr, last_page, tail_start, first_chunk, c, stride_cp,
                       stride_cr, stride_ch, HKV, D, PAGE_SIZE, BLOCK_R, CLEAR_PROGRAMS)
            clear_rows(v_cache_ptr, last_page, tail_start, first_chunk, c, stride_cp,
                       stride_cr, stride_ch, HKV, D, PAGE_SIZE, BLOCK_R, CLEAR_PROGRAMS)
    return b, c, valid


def launch_plan(num_tokens: int, num_req: int, num_slots: int, num_kv_heads: int,
                head_dim: int, page_size: int, max_pages: int, clear: bool, *,
                token_programs: bool) -> dict[str, int]:
    """Grid and compile-time shapes of one append launch: ``grid``, ``num_warps`` and
    the kernels' constexprs (``TOKEN_PROGRAMS``: token programs instead of tiles of
    tokens, as the launcher asks; ``BLOCK_M`` x ``BLOCK_S`` tokens x slots a tile program;
    ``TILES_FIRST``: the order of the two kinds of programs).

    Tile and clear sizes come from ``_config``'s per-shape table; the loop chunks
    are no wider than the tables they scan (8 requests are not padded to 128).
    """
    if token_programs:
        block_m, block_s = 1, _config.append_slots_per_token(num_slots, head_dim)
    else:
        block_m, block_s = _config.append_block_m(num_tokens, head_dim), 1
    clear_programs = (_config.append_clear_programs(page_size, num_kv_heads, num_req)
                      if clear else 1)
    chunk_b = min(_config.APPEND_CHUNK_B, triton.next_power_of_2(num_req))
    # The page check walks the slots a request writes, from its first: n <= T tokens span
    # at most T // page_size + 2 slots, however long the context before them.
    walk = min(max_pages, num_tokens // page_size + 2)
    chunk_p = min(_config.APPEND_CHUNK_P, triton.next_power_of_2(walk))
    tile_programs = triton.cdiv(num_tokens, block_m) * triton.cdiv(num_slots, block_s)
    request_programs = num_req * clear_programs
    return dict(
        grid=request_programs + tile_programs,
        num_warps=_config.append_num_warps(num_tokens, num_slots),
        TOKEN_PROGRAMS=token_programs, BLOCK_M=block_m, BLOCK_S=block_s,
        CHUNK_B=chunk_b, NUM_B_CHUNKS=triton.cdiv(num_req, chunk_b), CHUNK_P=chunk_p,
        NUM_P_CHUNKS=triton.cdiv(walk, chunk_p), BLOCK_R=_config.APPEND_BLOCK_R,
        CLEAR_PROGRAMS=clear_programs,
        TILES_FIRST=_config.append_tiles_first(tile_programs, request_programs))


# ----------------------------------------------------------------------------- host


def require_tensor(op: str, name: str, t, *, dtypes: tuple, ndim: int,
                   device: torch.device | None) -> None:
    """Raise ``TypeError``/``ValueError`` (``check_tensor``) unless ``t`` is a tensor of one
    of ``dtypes``, ``ndim`` dims, on ``device``, with a unit stride in its last dim."""
    check_tensor(name, t, dtypes=dtypes, ndim=ndim, device=device, unit_last_stride=True,
                 prefix=f"{op}: ")


def check_paged_append_common(op: str, qkv, cos_sin, seq_lens, q_indptr, page_indices,
                              key_cache, value_cache, kv_layout: str, cache_dtype: torch.dtype,
                              ) -> tuple[int, int, int, int, int]:
    """Checks both append ops share; returns ``(T, B, Hkv, D, page_size)``.

    The head configuration comes from the caches (``kv_layout`` says which dim
    holds the heads); ``num_q_heads`` is then checked by the caller.
    """
    if kv_layout not in KV_LAYOUTS:
        raise ValueError(f"{op}: kv_layout must be one of {KV_LAYOUTS}, got {kv_layout!r}")
    require_tensor(op, "qkv", qkv, dtypes=(torch.bfloat16,), ndim=2, device=None)
    if qkv.device.type not in ("cuda", "cpu"):
        raise ValueError(f"{op}: qkv must be on a CUDA device, got {describe(qkv)}")
    dev = qkv.device
    require_tensor(op, "cos_sin", cos_sin, dtypes=(torch.float32,), ndim=2, device=dev)
    require_tensor(op, "seq_lens", seq_lens, dtypes=(torch.int32,), ndim=1, device=dev)
    require_tensor(op, "q_indptr", q_indptr, dtypes=(torch.int32,), ndim=1, device=dev)
    require_tensor(op, "page_indices", page_indices, dtypes=(torch.int32,), ndim=2, device=dev)
    for name, cache in (("key_cache", key_cache), ("value_cache", value_cache)):
        require_tensor(op, name, cache, dtypes=(cache_dtype,), ndim=4, device=dev)
    if value_cache.shape != key_cache.shape or value_cache.stride() != key_cache.stride():
        raise ValueError(f"{op}: key_cache and value_cache must have the same shape and strides, "
                         f"got key_cache {describe(key_cache)} and value_cache "
                         f"{describe(value_cache)}")
    if kv_layout == "NHD":
        num_pages, page_size, num_kv_heads, head_dim = key_cache.shape
    else:
        num_pages, num_kv_heads, page_size, head_dim = key_cache.shape
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"{op}: head dim (last dim of key_cache) must be one of {HEAD_DIMS}, "
                         f"got key_cache {describe(key_cache)}")
    if num_pages < 1 or page_size < 1 or num_kv_heads < 1:
        raise ValueError(f"{op}: key_cache ({kv_layout}) needs at least one page, row and head, "
                         f"got {describe(key_cache)}")
    num_req = seq_lens.shape[0]
    if num_req < 1:
        raise ValueError(f"{op}: seq_lens must hold at least one request, got {describe(seq_lens)}")
    if q_indptr.shape[0] != num_req + 1 or not q_indptr.is_contiguous():
        raise ValueError(f"{op}: q_indptr must be contiguous [B + 1] = [{num_req + 1}] for "
                         f"B = seq_lens.shape[0] = {num_req}, got {describe(q_indptr)}")
    if not seq_lens.is_contiguous():
        raise ValueError(f"{op}: seq_lens must be contiguous, got {describe(seq_lens)}")
    if page_indices.shape[0] != num_req or page_indices.shape[1] < 1:
        raise ValueError(f"{op}: page_indices must be [B, max_pages] with B = {num_req} and "
                         f"max_pages >= 1, got {describe(page_indices)}")
    if cos_sin.shape[1] != head_dim or cos_sin.shape[0] < 1:
        raise ValueError(f"{op}: cos_sin must be [max_pos, D] with D = {head_dim}, "
                         f"got {describe(cos_sin)}")
    return qkv.shape[0], num_req, num_kv_heads, head_dim, page_size


def check_token_out(op: str, name: str, out, shape: tuple[int, ...], dtype: torch.dtype,
                    device: torch.device) -> None:
    """Check a caller-owned ``[T, H, D]`` output (``out_q``, ``out_k``, ``out_v``)."""
    require_tensor(op, name, out, dtypes=(dtype,), ndim=3, device=device)
    if tuple(out.shape) != shape:
        raise ValueError(f"{op}: {name} must have shape {shape}, got {describe(out)}")


def check_error_flags(op: str, error_flags, num_req: int, device: torch.device) -> None:
    """Check the optional int32 ``[B]`` status output."""
    if error_flags is None:
        return
    require_tensor(op, "error_flags", error_flags, dtypes=(torch.int32,), ndim=1, device=device)
    if error_flags.shape[0] != num_req or not error_flags.is_contiguous():
        raise ValueError(f"{op}: error_flags must be contiguous [B] = [{num_req}], "
                         f"got {describe(error_flags)}")


def cache_strides(cache: torch.Tensor, kv_layout: str) -> tuple[int, int, int]:
    """``(page, row, head)`` element strides of a cache in either layout."""
    if kv_layout == "NHD":
        return cache.stride(0), cache.stride(1), cache.stride(2)
    return cache.stride(0), cache.stride(2), cache.stride(1)


def check_norm_weights(op: str, qk_norm_policy: int, q_norm_weight, k_norm_weight,
                       head_dim: int, device: torch.device) -> None:
    """Check ``qk_norm_policy`` and, when it normalises, both ``[D]`` weights."""
    if not isinstance(qk_norm_policy, int) or qk_norm_policy not in QK_NORM_POLICIES:
        raise ValueError(f"{op}: qk_norm_policy must be one of {QK_NORM_POLICIES}, "
                         f"got {qk_norm_policy!r}")
    if qk_norm_policy == 0:
        return
    for name, w in (("q_norm_weight", q_norm_weight), ("k_norm_weight", k_norm_weight)):
        if w is None:
            raise ValueError(f"{op}: qk_norm_policy={qk_norm_policy} needs {name}, got None")
        require_tensor(op, name, w, dtypes=(torch.float32, torch.bfloat16), ndim=1,
                       device=device)
        if w.shape[0] != head_dim or not w.is_contiguous():
            raise ValueError(f"{op}: {name} must be contiguous [D] = [{head_dim}], "
                             f"got {describe(w)}")
    if q_norm_weight.dtype != k_norm_weight.dtype:
        raise TypeError(f"{op}: q_norm_weight and k_norm_weight must share a dtype, got "
                        f"{q_norm_weight.dtype} and {k_norm_weight.dtype}")


def check_num_q_heads(op: str, qkv: torch.Tensor, num_q_heads: int, num_kv_heads: int,
                      head_dim: int) -> None:
    """Check ``Hq`` against the ``qkv`` width and GQA (``Hq`` a multiple of ``Hkv``)."""
    if not isinstance(num_q_heads, int) or num_q_heads < 1 or num_q_heads % num_kv_heads:
        raise ValueError(f"{op}: num_q_heads must be a positive multiple of num_kv_heads "
                         f"({num_kv_heads}), got {num_q_heads!r}")
    width = (num_q_heads + 2 * num_kv_heads) * head_dim
    if qkv.shape[1] != width:
        raise ValueError(f"{op}: qkv must be [T, (Hq + 2 Hkv) * D] = [T, {width}] for "
                         f"Hq = {num_q_heads}, Hkv = {num_kv_heads}, D = {head_dim}, "
                         f"got {describe(qkv)}")
