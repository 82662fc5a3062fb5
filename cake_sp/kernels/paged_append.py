"""Paged KV-cache append: what the BF16 and FP8 append kernels share.

Both kernels (``qk_rope_append.py``, ``qk_rope_fp8_append.py``) run one 1-D
grid of two kinds of programs:

* a *request* program per ``(request b, kv head h)``: validates the metadata,
  writes the request's status, and zeroes the unused rows of its last page;
* a *tile* program per ``(BLOCK_M tokens, head slot)``: slot ``s`` is column
  block ``s`` of the packed ``qkv`` row, so slots ``[0, Hq)`` are Q heads,
  ``[Hq, Hq + Hkv)`` K heads and ``[Hq + Hkv, Hq + 2 Hkv)`` V heads.

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

This module also holds the host-side checks common to both launchers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cake_sp._validation import check_tensor, describe
from cake_sp.kernels import _config
from cake_sp.kernels.norm_rope import QK_NORM_POLICIES

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
def scan_q_indptr(q_indptr_ptr, num_req, num_tokens, max_req_len, tok, BLOCK_M: tl.constexpr,
                  CHUNK_B: tl.constexpr, NUM_B_CHUNKS: tl.constexpr):
    """Validate ``q_indptr`` and find the request of each token in ``tok``.

    Returns ``(valid, req)``: ``valid`` is a scalar, true iff ``q_indptr[0] == 0``,
    ``q_indptr[B] == T``, the table is non-decreasing and no request has more
    than ``max_req_len`` tokens; ``req`` (int32 ``[BLOCK_M]``) is
    ``#{j < B : q_indptr[j + 1] <= tok}``, the request holding each token when
    the table is valid, clamped into ``[0, B)`` otherwise.
    """
    first = tl.load(q_indptr_ptr)
    last = tl.load(q_indptr_ptr + num_req)
    bad = (first != 0).to(tl.int32) + (last != num_tokens).to(tl.int32)
    req = tl.zeros([BLOCK_M], dtype=tl.int32)
    for c in range(NUM_B_CHUNKS):
        j = c * CHUNK_B + tl.arange(0, CHUNK_B)
        m = j < num_req
        lo = tl.load(q_indptr_ptr + j, mask=m, other=0)
        hi = tl.load(q_indptr_ptr + j + 1, mask=m, other=0)
        n = hi - lo
        bad += tl.sum((m & ((n < 0) | (n > max_req_len))).to(tl.int32), axis=0)
        ends_before = m[None, :] & (hi[None, :] <= tok[:, None])
        req += tl.sum(ends_before.to(tl.int32), axis=1)
    return bad == 0, tl.minimum(req, num_req - 1)


@triton.jit
def request_span(q_indptr_ptr, seq_lens_ptr, req, max_pos, max_pages, PAGE_SIZE: tl.constexpr):
    """Token range and position check of requests ``req`` (scalar or vector).

    Returns ``(start, n, seq_len, pos_ok)``: the request's first token, its token
    count, its length after the append, and whether all of its positions
    ``[seq_len - n, seq_len)`` index the ``cos_sin`` table (``< max_pos``) and
    the page table (``< max_pages * PAGE_SIZE``).
    """
    start = tl.load(q_indptr_ptr + req)
    n = tl.load(q_indptr_ptr + req + 1) - start
    seq_len = tl.load(seq_lens_ptr + req)
    # seq_len >= n >= 0 first, so that the division below never sees a negative value.
    pos_ok = (seq_len >= n) & (seq_len <= max_pos) & (
        tl.maximum(seq_len - 1, 0) // PAGE_SIZE < max_pages)
    return start, n, seq_len, pos_ok


@triton.jit
def token_targets(q_indptr_ptr, seq_lens_ptr, page_indices_ptr, stride_pi, tok, req, live,
                  max_pos, max_pages, num_pages, PAGE_SIZE: tl.constexpr):
    """Where each token of a tile goes.

    ``live`` masks the tokens that exist in a valid table.  Returns
    ``(tok_ok, r, pos, page, row, page_ok)``: whether the token may be written
    at all (its request's positions are in range), its index in its request,
    its position (int64), its page and row, and whether that page is in
    ``[0, num_pages)``.
    """
    start, n, seq_len, pos_ok = request_span(q_indptr_ptr, seq_lens_ptr, req, max_pos,
                                             max_pages, PAGE_SIZE)
    tok_ok = live & pos_ok
    r = tok - start
    pos = tl.where(tok_ok, r + seq_len - n, 0).to(tl.int64)
    page = tl.load(page_indices_ptr + req.to(tl.int64) * stride_pi + pos // PAGE_SIZE,
                   mask=tok_ok, other=-1)
    page_ok = tok_ok & (page >= 0) & (page < num_pages)
    return tok_ok, r, pos, page.to(tl.int64), pos % PAGE_SIZE, page_ok


@triton.jit
def store_kv_rows(cache_ptr, out_ptr, vals, tok, head, page, row, tok_ok, page_ok,
                  stride_cp, stride_cr, stride_ch, stride_ot, stride_oh,
                  D: tl.constexpr, TO_CACHE: tl.constexpr):
    """Store a ``[BLOCK_M, D]`` K or V tile of kv head ``head``.

    ``TO_CACHE``: into the paged cache at ``(page, row)`` of each token, skipping
    tokens whose page is out of range; otherwise into the caller's ``out``
    ``[T, Hkv, D]`` (no page involved, so only ``tok_ok`` gates the row).
    """
    cols = tl.arange(0, D)[None, :]
    if TO_CACHE:
        offs = page * stride_cp + row * stride_cr + head * stride_ch
        tl.store(cache_ptr + offs[:, None] + cols, vals, mask=page_ok[:, None])
    else:
        offs = tok.to(tl.int64) * stride_ot + head * stride_oh
        tl.store(out_ptr + offs[:, None] + cols, vals, mask=tok_ok[:, None])


@triton.jit
def request_status(q_indptr_ptr, seq_lens_ptr, page_indices_ptr, stride_pi, b, valid,
                   check_pages, max_pos, max_pages, num_pages, PAGE_SIZE: tl.constexpr,
                   CHUNK_P: tl.constexpr, NUM_P_CHUNKS: tl.constexpr):
    """Status of request ``b`` and where its last page's unused rows start.

    Returns ``(status, last_page, tail_start)``: ``status`` is a sum of
    ``ERR_*`` bits (``ERR_PAGE`` only looked for when ``check_pages``: it walks
    the request's page-table row); ``last_page`` is the page holding the
    request's last row when that page may be cleared, else -1; rows
    ``[tail_start, PAGE_SIZE)`` of it follow the request's last row.  As in
    FlashInfer's kernel, every request of length ``seq_len >= 1`` clears, also one
    that appends no token in this call; here only when the table is valid, the
    last row lies inside the page table, the request's appended positions (if any)
    are in range, and the page index is in ``[0, num_pages)``.
    """
    start, n, seq_len, pos_ok = request_span(q_indptr_ptr, seq_lens_ptr, b, max_pos,
                                             max_pages, PAGE_SIZE)
    status = tl.where(valid, 0, _ERR_METADATA)
    status += tl.where(valid & (n > 0) & (~pos_ok), _ERR_POSITION, 0)
    writes = valid & (n > 0) & pos_ok
    # The page slots the request writes: [first_slot, last_slot].
    first_slot = tl.where(writes, (seq_len - n) // PAGE_SIZE, 0)
    last_slot = tl.where(writes, (seq_len - 1) // PAGE_SIZE, -1)
    row_base = page_indices_ptr + b.to(tl.int64) * stride_pi
    if check_pages:
        num_bad = tl.sum(tl.zeros([CHUNK_P], dtype=tl.int32), axis=0)
        for c in range(NUM_P_CHUNKS):
            s = c * CHUNK_P + tl.arange(0, CHUNK_P)
            m = (s >= first_slot) & (s <= last_slot)
            p = tl.load(row_base + s, mask=m, other=0)
            num_bad += tl.sum((m & ((p < 0) | (p >= num_pages))).to(tl.int32), axis=0)
        status += tl.where(num_bad > 0, _ERR_PAGE, 0)
    # The page holding the last row: for a request that appends nothing only the page table
    # bound matters (its positions index no cos/sin row).
    in_table = (seq_len > 0) & (tl.maximum(seq_len - 1, 0) // PAGE_SIZE < max_pages)
    clears = valid & in_table & ((n == 0) | pos_ok)
    tail_slot = tl.where(clears, (seq_len - 1) // PAGE_SIZE, 0)
    last_page = tl.load(row_base + tail_slot, mask=clears, other=-1)
    last_page = tl.where((last_page >= 0) & (last_page < num_pages), last_page, -1)
    return status, last_page.to(tl.int64), seq_len - tail_slot * PAGE_SIZE


@triton.jit
def clear_rows(cache_ptr, page, head, row_start, stride_cp, stride_cr, stride_ch,
               D: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_R: tl.constexpr):
    """Zero rows ``[row_start, PAGE_SIZE)`` of kv head ``head`` in page ``page`` (none if -1).

    Zero is the all-zero bit pattern in both bf16 and FP8 e4m3, so one helper
    serves both cache dtypes.
    """
    cols = tl.arange(0, D)[None, :]
    zeros = tl.zeros([BLOCK_R, D], dtype=cache_ptr.dtype.element_ty)
    base = cache_ptr + page * stride_cp + head * stride_ch
    for c in range((PAGE_SIZE + BLOCK_R - 1) // BLOCK_R):
        rows = c * BLOCK_R + tl.arange(0, BLOCK_R)
        m = (page >= 0) & (rows >= row_start) & (rows < PAGE_SIZE)
        tl.store(base + rows.to(tl.int64)[:, None] * stride_cr + cols, zeros, mask=m[:, None])


@triton.jit
def request_program(pid, q_indptr_ptr, seq_lens_ptr, page_indices_ptr, k_cache_ptr,
                    v_cache_ptr, error_flags_ptr, num_tokens, num_req, max_req_len, max_pos,
                    max_pages, num_pages, stride_pi, stride_cp, stride_cr, stride_ch,
                    HKV: tl.constexpr, D: tl.constexpr, PAGE_SIZE: tl.constexpr,
                    BLOCK_M: tl.constexpr, CHUNK_B: tl.constexpr, NUM_B_CHUNKS: tl.constexpr,
                    CHUNK_P: tl.constexpr, NUM_P_CHUNKS: tl.constexpr, BLOCK_R: tl.constexpr,
                    CLEAR: tl.constexpr, HAS_ERROR_FLAGS: tl.constexpr):
    """Request program ``pid`` = ``b * Hkv + h``: status of request ``b`` (written by
    ``h == 0``), then zero the unused last-page rows of kv head ``h`` in both caches.

    Returns ``(b, h, valid)`` so that a kernel can add its own per-request outputs.
    """
    b = pid // HKV
    h = pid % HKV
    valid, _ = scan_q_indptr(q_indptr_ptr, num_req, num_tokens, max_req_len,
                             tl.zeros([BLOCK_M], dtype=tl.int32), BLOCK_M, CHUNK_B, NUM_B_CHUNKS)
    status, last_page, tail_start = request_status(
        q_indptr_ptr, seq_lens_ptr, page_indices_ptr, stride_pi, b, valid,
        h == 0, max_pos, max_pages, num_pages, PAGE_SIZE, CHUNK_P,
        NUM_P_CHUNKS)
    if HAS_ERROR_FLAGS:
        tl.store(error_flags_ptr + b, status, mask=h == 0)
    if CLEAR:
        clear_rows(k_cache_ptr, last_page, h, tail_start, stride_cp, stride_cr, stride_ch, D,
                   PAGE_SIZE, BLOCK_R)
        clear_rows(v_cache_ptr, last_page, h, tail_start, stride_cp, stride_cr, stride_ch, D,
                   PAGE_SIZE, BLOCK_R)
    return b, h, valid


@triton.jit
def tile_program(pid, qkv_ptr, q_indptr_ptr, seq_lens_ptr, page_indices_ptr, num_tokens,
                 num_req, max_req_len, max_pos, max_pages, num_pages, stride_qkv, stride_pi,
                 NUM_SLOTS: tl.constexpr, D: tl.constexpr, PAGE_SIZE: tl.constexpr,
                 BLOCK_M: tl.constexpr, CHUNK_B: tl.constexpr, NUM_B_CHUNKS: tl.constexpr):
    """Tile program ``pid`` = ``block * NUM_SLOTS + slot``: tokens
    ``[block * BLOCK_M, (block + 1) * BLOCK_M)`` of head slot ``slot``.

    Returns ``(slot, tok, req, r, pos, page, row, tok_ok, page_ok, src)``: see
    ``token_targets``; ``src`` points at the tile's ``[BLOCK_M, D]`` bf16 input.
    """
    slot = pid % NUM_SLOTS
    tok = (pid // NUM_SLOTS) * BLOCK_M + tl.arange(0, BLOCK_M)
    valid, req = scan_q_indptr(q_indptr_ptr, num_req, num_tokens, max_req_len, tok, BLOCK_M,
                               CHUNK_B, NUM_B_CHUNKS)
    live = valid & (tok < num_tokens)
    tok_ok, r, pos, page, row, page_ok = token_targets(
        q_indptr_ptr, seq_lens_ptr, page_indices_ptr, stride_pi, tok, req, live, max_pos,
        max_pages, num_pages, PAGE_SIZE)
    src = (qkv_ptr + tok.to(tl.int64)[:, None] * stride_qkv + slot * D
           + tl.arange(0, D)[None, :])
    return slot, tok, req, r, pos, page, row, tok_ok, page_ok, src


def launch_constants(num_req: int, max_pages: int) -> dict[str, int]:
    """The compile-time loop shapes of the shared helpers for a batch of ``num_req``
    requests and a page table ``max_pages`` wide."""
    return dict(CHUNK_B=_config.APPEND_CHUNK_B,
                NUM_B_CHUNKS=triton.cdiv(num_req, _config.APPEND_CHUNK_B),
                CHUNK_P=_config.APPEND_CHUNK_P,
                NUM_P_CHUNKS=triton.cdiv(max_pages, _config.APPEND_CHUNK_P),
                BLOCK_R=_config.APPEND_BLOCK_R)


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
