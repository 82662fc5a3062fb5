"""Fused QK RMSNorm + RoPE + paged KV-cache append, BF16 caches.

One launch: read the packed ``qkv`` rows, normalise (optional) and rotate the
Q and K heads in fp32, write Q to ``out_q`` and append K and V into the paged
caches (or the caller's ``out_k`` / ``out_v``), zeroing the unused rows of each
request's last page.  Grid layout, metadata and status flags: ``paged_append``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cake_sp.kernels import _config
from cake_sp.kernels.norm_rope import rope_style_code, round_to_bf16
from cake_sp.kernels.paged_append import (
    cache_strides,
    check_error_flags,
    check_norm_weights,
    check_num_q_heads,
    check_paged_append_common,
    check_token_out,
    describe,
    launch_plan,
    normalized_rotated_head,
    normalized_rotated_slots,
    program_role,
    request_program,
    store_kv_rows,
    store_slot_rows,
    store_token_rows,
    tile_program,
    token_program,
)

_OP = "fused_qk_rmsnorm_rope_append_paged_kv_cache"
# No per-request length limit: only the FP8 dynamic-prefill q_scale has one.
_NO_LIMIT: tl.constexpr = tl.constexpr(2**31 - 1)


@triton.jit
def _qk_rope_append_kernel(
    qkv_ptr, cos_sin_ptr, seq_lens_ptr, q_indptr_ptr, page_indices_ptr,
    k_cache_ptr, v_cache_ptr, out_q_ptr, out_k_ptr, out_v_ptr,
    q_norm_ptr, k_norm_ptr, error_flags_ptr,
    num_tokens, num_req, max_pos, max_pages, num_pages,
    stride_qkv, stride_cs, stride_pi, stride_cp, stride_cr, stride_ch,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    eps,
    HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, PAGE_SIZE: tl.constexpr,
    TOKEN_PROGRAMS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_S: tl.constexpr,
    CHUNK_B: tl.constexpr, NUM_B_CHUNKS: tl.constexpr,
    CHUNK_P: tl.constexpr, NUM_P_CHUNKS: tl.constexpr, BLOCK_R: tl.constexpr,
    CLEAR_PROGRAMS: tl.constexpr, TILES_FIRST: tl.constexpr,
    POLICY: tl.constexpr, STYLE: tl.constexpr, K_TO_CACHE: tl.constexpr,
    V_TO_CACHE: tl.constexpr, CLEAR: tl.constexpr, HAS_ERROR_FLAGS: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """Request and tile programs (``paged_append``), in the order ``TILES_FIRST`` says.
    Q/K: ``bf16(qk_norm_rope(fp32(x)))``, rounded once; V: the input bits, copied."""
    is_request, index = program_role(tl.program_id(0), num_tokens, num_req, HQ + 2 * HKV,
                                     BLOCK_M, BLOCK_S, CLEAR_PROGRAMS, TILES_FIRST)
    if is_request:
        request_program(index, q_indptr_ptr, seq_lens_ptr, page_indices_ptr, k_cache_ptr,
                        v_cache_ptr, error_flags_ptr, num_tokens, num_req, _NO_LIMIT, max_pos,
                        max_pages, num_pages, stride_pi, stride_cp, stride_cr, stride_ch, HKV,
                        D, PAGE_SIZE, CHUNK_B, NUM_B_CHUNKS, CHUNK_P, NUM_P_CHUNKS, BLOCK_R,
                        CLEAR_PROGRAMS, CLEAR, HAS_ERROR_FLAGS)
    elif TOKEN_PROGRAMS:
        slot, slot_ok, tok, tok_ok, pos, page, row, page_ok, x_lo, x_hi = token_program(
            index, qkv_ptr, q_indptr_ptr, seq_lens_ptr, page_indices_ptr, num_tokens, num_req,
            _NO_LIMIT, max_pos, max_pages, num_pages, stride_qkv, stride_pi, HQ + 2 * HKV, D,
            PAGE_SIZE, BLOCK_S, CHUNK_B, NUM_B_CHUNKS)
        y_lo, y_hi = normalized_rotated_slots(x_lo, x_hi, slot, pos, tok_ok, cos_sin_ptr,
                                              stride_cs, q_norm_ptr, k_norm_ptr, eps, HQ,
                                              POLICY, BLOCK_S, D, STYLE)
        is_v = (slot >= HQ + HKV)[:, None]  # V rows keep their input bits
        store_slot_rows(out_q_ptr, k_cache_ptr if K_TO_CACHE else out_k_ptr,
                        v_cache_ptr if V_TO_CACHE else out_v_ptr,
                        tl.where(is_v, x_lo, round_to_bf16(y_lo, INTERPRET)),
                        tl.where(is_v, x_hi, round_to_bf16(y_hi, INTERPRET)), slot, slot_ok,
                        tok, page, row, tok_ok, page_ok, stride_qt, stride_qh, stride_cp,
                        stride_cr, stride_ch, stride_kt, stride_kh, stride_vt, stride_vh, HQ,
                        HKV, D, K_TO_CACHE, V_TO_CACHE)
    else:
        slot, tok, req, r, tok_ok, pos, page, row, page_ok, x_lo, x_hi = tile_program(
            index, qkv_ptr, q_indptr_ptr, seq_lens_ptr, page_indices_ptr,
            num_tokens, num_req, _NO_LIMIT, max_pos, max_pages, num_pages, stride_qkv,
            stride_pi, HQ + 2 * HKV, D, PAGE_SIZE, BLOCK_M, CHUNK_B, NUM_B_CHUNKS)
        if slot < HQ + HKV:
            y_lo, y_hi = normalized_rotated_head(x_lo, x_hi, slot, pos, tok_ok, cos_sin_ptr,
                                                 stride_cs, q_norm_ptr, k_norm_ptr, eps, HQ,
                                                 POLICY, BLOCK_M, D, STYLE)
            y_lo = round_to_bf16(y_lo, INTERPRET)
            y_hi = round_to_bf16(y_hi, INTERPRET)
            if slot < HQ:
                store_token_rows(out_q_ptr, y_lo, y_hi, tok, slot, tok_ok, stride_qt, stride_qh, D)
            else:
                store_kv_rows(k_cache_ptr, out_k_ptr, y_lo, y_hi, tok, slot - HQ, page, row,
                              tok_ok, page_ok, stride_cp, stride_cr, stride_ch, stride_kt,
                              stride_kh, D, K_TO_CACHE)
        else:
            # V is a pure copy: no arithmetic, so the bf16 bits pass through unchanged.
            store_kv_rows(v_cache_ptr, out_v_ptr, x_lo, x_hi, tok, slot - HQ - HKV, page, row,
                          tok_ok, page_ok, stride_cp, stride_cr, stride_ch, stride_vt,
                          stride_vh, D, V_TO_CACHE)


def _check_qk_rope_append_inputs(qkv, cos_sin, seq_lens, q_indptr, page_indices, key_cache,
                                 value_cache, num_q_heads, num_kv_heads, qk_norm_policy,
                                 q_norm_weight, k_norm_weight, rope_style, kv_layout, out_q,
                                 out_k, out_v, error_flags) -> tuple[int, int, int, int]:
    """Every check of the BF16 op, before anything is allocated; returns ``(T, B, D, ps)``."""
    num_tokens, num_req, hkv, head_dim, page_size = check_paged_append_common(
        _OP, qkv, cos_sin, seq_lens, q_indptr, page_indices, key_cache, value_cache, kv_layout,
        torch.bfloat16)
    if num_kv_heads != hkv:
        raise ValueError(f"{_OP}: num_kv_heads ({num_kv_heads!r}) must match the caches' kv-head "
                         f"dim ({kv_layout}), got key_cache {describe(key_cache)}")
    check_num_q_heads(_OP, qkv, num_q_heads, num_kv_heads, head_dim)
    check_norm_weights(_OP, qk_norm_policy, q_norm_weight, k_norm_weight, head_dim, qkv.device)
    rope_style_code(rope_style)
    for name, out, heads in (("out_q", out_q, num_q_heads), ("out_k", out_k, num_kv_heads),
                             ("out_v", out_v, num_kv_heads)):
        if out is not None:
            check_token_out(_OP, name, out, (num_tokens, heads, head_dim), torch.bfloat16,
                            qkv.device)
    check_error_flags(_OP, error_flags, num_req, qkv.device)
    _config.require_triton_device(_OP, qkv.device)  # last: a bad argument is named first
    return num_tokens, num_req, head_dim, page_size


def fused_qk_rmsnorm_rope_append_paged_kv_cache(
    qkv: torch.Tensor,
    cos_sin: torch.Tensor,
    seq_lens: torch.Tensor,
    q_indptr: torch.Tensor,
    page_indices: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    *,
    num_q_heads: int,
    num_kv_heads: int,
    qk_norm_policy: int = 0,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    rope_style: str = "neox",
    kv_layout: str = "NHD",
    out_q: torch.Tensor | None = None,
    out_k: torch.Tensor | None = None,
    out_v: torch.Tensor | None = None,
    clear_unused_last_page_rows: bool = True,
    error_flags: torch.Tensor | None = None,
) -> torch.Tensor:
    """Normalise and rotate Q and K, write Q, append K and V to a paged BF16 cache: one launch.

    Equals, per request ``b`` with ``n_b = q_indptr[b+1] - q_indptr[b]`` new
    tokens and token ``r`` of it at position ``pos = r + seq_lens[b] - n_b``::

        x = fp32(qkv[t]).view(Hq + 2 Hkv, D)            # t = q_indptr[b] + r
        f = {0: rope, 1: w * rmsnorm(rope(.)), 2: rope(w * rmsnorm(.))}[qk_norm_policy]
        out_q[t] = bf16(f(x[:Hq], q_norm_weight))        # rounded once, nearest-even
        K[page_indices[b, pos // ps], pos % ps] = bf16(f(x[Hq:Hq+Hkv], k_norm_weight))
        V[page_indices[b, pos // ps], pos % ps] = qkv[t, V part]   # bits copied

    with ``rmsnorm(y) = y / sqrt(mean(y^2) + eps)`` and RoPE from row ``pos`` of
    ``cos_sin``; all math in fp32.  Runs on the current stream, allocates only
    ``out_q`` when it is None, never syncs the host, and is CUDA-graph capturable.

    Parameters
    ----------
    qkv : bf16 ``[T, (Hq + 2 Hkv) * D]``
        Packed Q|K|V rows (heads in order inside each part); rows may be strided.
    cos_sin : fp32 ``[max_pos, D]``
        Row ``p``: cos of the ``D/2`` frequencies at position ``p``, then their sin.
    seq_lens : int32 ``[B]``
        Each request's length *after* this append.
    q_indptr : int32 ``[B + 1]``
        Token offsets of the requests in ``qkv``; ``q_indptr[0] == 0``,
        non-decreasing, ``q_indptr[B] == T``.  Empty requests are allowed.
    page_indices : int32 ``[B, max_pages]``
        Dense per-request page table.
    key_cache, value_cache : bf16 ``[num_pages, page_size, Hkv, D]`` (``"NHD"``) or
        ``[num_pages, Hkv, page_size, D]`` (``"HND"``)
        Updated in place; the same shape and strides, unit stride in ``D``
        (views of one combined KV buffer are fine).
    num_q_heads, num_kv_heads : int
        ``Hq`` (any positive multiple of ``Hkv``) and ``Hkv`` (must match the caches).
        ``D`` (the caches' last dim) is 64, 128 or 256; ``page_size >= 1``.
    qk_norm_policy : int
        0 no RMSNorm, 1 RoPE then RMSNorm, 2 RMSNorm then RoPE.
    q_norm_weight, k_norm_weight : fp32 or bf16 ``[D]``, one dtype
        Required when ``qk_norm_policy != 0``, ignored otherwise.
    eps : float
        RMSNorm epsilon.
    rope_style : ``"neox"`` or ``"interleaved"``
        Channel pairs ``(i, i + D/2)`` or ``(2i, 2i + 1)``.
    kv_layout : ``"NHD"`` or ``"HND"``
        Layout of both caches.
    out_q : bf16 ``[T, Hq, D]``, optional
        Where Q goes; allocated when None.
    out_k, out_v : bf16 ``[T, Hkv, D]``, optional
        When given, K (resp. V) goes there, row ``t``, instead of into the cache.
    clear_unused_last_page_rows : bool
        Zero, in both caches, rows ``[(seq_lens[b] - 1) % page_size + 1, page_size)``
        of every request's last page, as FlashInfer does: every request with
        ``seq_lens[b] >= 1``, also one that appends no token in this call, and also
        when ``out_k``/``out_v`` redirect the writes (skipped for a request whose
        metadata, positions or last page index are out of range).  This writes rows
        no token of this call owns, so the caller must own those pages exclusively
        (no other request or in-flight reader may use those rows).
    error_flags : int32 ``[B]``, optional
        Status per request, rewritten by every call: 0, or a sum of
        ``ERR_METADATA`` (1: ``q_indptr`` malformed; nothing at all was written),
        ``ERR_POSITION`` (2: a position is negative, ``>= max_pos`` or beyond the
        page table; the request wrote nothing) and ``ERR_PAGE`` (4: a page index
        the request writes is outside ``[0, num_pages)``; those K/V rows, and the
        tail clear of such a last page, were skipped).  The same rules apply
        when it is None; they are just not reported.

    Returns
    -------
    out_q : bf16 ``[T, Hq, D]``

    Raises
    ------
    TypeError, ValueError
        On a wrong dtype, shape, device, layout or option, before any allocation.

    Under ``torch.compile`` the checks and ``out_q``'s allocation are traced and the launch
    is the custom operator ``cake_sp::qk_rmsnorm_rope_append_paged_kv_cache`` (below), which
    mutates the caches and the outputs.
    """
    num_tokens, num_req, head_dim, page_size = _check_qk_rope_append_inputs(
        qkv, cos_sin, seq_lens, q_indptr, page_indices, key_cache, value_cache, num_q_heads,
        num_kv_heads, qk_norm_policy, q_norm_weight, k_norm_weight, rope_style, kv_layout,
        out_q, out_k, out_v, error_flags)
    if out_q is None:
        out_q = torch.empty((num_tokens, num_q_heads, head_dim), dtype=torch.bfloat16,
                            device=qkv.device)
    if torch.compiler.is_compiling():  # the launch as one custom operator (below)
        torch.ops.cake_sp.qk_rmsnorm_rope_append_paged_kv_cache(
            qkv, cos_sin, seq_lens, q_indptr, page_indices, key_cache, value_cache, out_q,
            out_k, out_v, q_norm_weight, k_norm_weight, error_flags, num_q_heads,
            num_kv_heads, qk_norm_policy, eps, rope_style, kv_layout,
            clear_unused_last_page_rows)
        return out_q
    qk_rope_append_fwd(qkv, cos_sin, seq_lens, q_indptr, page_indices, key_cache, value_cache,
                       out_q, out_k, out_v, q_norm_weight, k_norm_weight, error_flags,
                       num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                       qk_norm_policy=qk_norm_policy, eps=eps, rope_style=rope_style,
                       kv_layout=kv_layout, clear=clear_unused_last_page_rows,
                       page_size=page_size)
    return out_q


@torch.library.custom_op("cake_sp::qk_rmsnorm_rope_append_paged_kv_cache",
                        mutates_args=("key_cache", "value_cache", "out_q", "out_k", "out_v",
                                      "error_flags"))
def _append_op(qkv: torch.Tensor, cos_sin: torch.Tensor, seq_lens: torch.Tensor,
               q_indptr: torch.Tensor, page_indices: torch.Tensor, key_cache: torch.Tensor,
               value_cache: torch.Tensor, out_q: torch.Tensor, out_k: torch.Tensor | None,
               out_v: torch.Tensor | None, q_norm_weight: torch.Tensor | None,
               k_norm_weight: torch.Tensor | None, error_flags: torch.Tensor | None,
               num_q_heads: int, num_kv_heads: int, qk_norm_policy: int, eps: float,
               rope_style: str, kv_layout: str, clear_unused_last_page_rows: bool) -> None:
    """The op as one custom operator (for ``torch.compile``): writes only what it mutates."""
    fused_qk_rmsnorm_rope_append_paged_kv_cache(
        qkv, cos_sin, seq_lens, q_indptr, page_indices, key_cache, value_cache,
        num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, qk_norm_policy=qk_norm_policy,
        q_norm_weight=q_norm_weight, k_norm_weight=k_norm_weight, eps=eps,
        rope_style=rope_style, kv_layout=kv_layout, out_q=out_q, out_k=out_k, out_v=out_v,
        clear_unused_last_page_rows=clear_unused_last_page_rows, error_flags=error_flags)


@_append_op.register_fake
def _(*args) -> None:
    return None


def qk_rope_append_fwd(qkv, cos_sin, seq_lens, q_indptr, page_indices, key_cache, value_cache,
                       out_q, out_k, out_v, q_norm_weight, k_norm_weight, error_flags, *,
                       num_q_heads: int, num_kv_heads: int, qk_norm_policy: int, eps: float,
                       rope_style: str, kv_layout: str, clear: bool, page_size: int) -> None:
    """Launch the kernel on checked inputs (see the public function)."""
    num_tokens, num_req = qkv.shape[0], seq_lens.shape[0]
    head_dim = key_cache.shape[-1]
    plan = launch_plan(num_tokens, num_req, num_q_heads + 2 * num_kv_heads, num_kv_heads,
                       head_dim, page_size, page_indices.shape[1], clear,
                       token_programs=_config.append_token_programs(num_tokens, num_req))
    stride_cp, stride_cr, stride_ch = cache_strides(key_cache, kv_layout)
    # Absent optional tensors are never dereferenced (constexpr switches); any
    # valid pointer stands in for them.
    q_w = q_norm_weight if qk_norm_policy else qkv
    k_w = k_norm_weight if qk_norm_policy else qkv
    k_out = out_k if out_k is not None else out_q
    v_out = out_v if out_v is not None else out_q
    _qk_rope_append_kernel[(plan.pop("grid"),)](
        qkv, cos_sin, seq_lens, q_indptr, page_indices, key_cache, value_cache,
        out_q, k_out, v_out, q_w, k_w, error_flags if error_flags is not None else seq_lens,
        num_tokens, num_req, cos_sin.shape[0], page_indices.shape[1], key_cache.shape[0],
        qkv.stride(0), cos_sin.stride(0), page_indices.stride(0),
        stride_cp, stride_cr, stride_ch,
        out_q.stride(0), out_q.stride(1), k_out.stride(0), k_out.stride(1),
        v_out.stride(0), v_out.stride(1), eps,
        HQ=num_q_heads, HKV=num_kv_heads, D=head_dim, PAGE_SIZE=page_size, **plan,
        POLICY=qk_norm_policy,
        STYLE=rope_style_code(rope_style), K_TO_CACHE=out_k is None, V_TO_CACHE=out_v is None,
        CLEAR=bool(clear), HAS_ERROR_FLAGS=error_flags is not None,
        INTERPRET=_config.INTERPRET,
    )
