"""Fused QK RMSNorm + RoPE + FP8 quantize + paged KV-cache append, FP8 e4m3 caches.

The FP8 twin of ``qk_rope_append``: same grid, metadata and status flags
(``paged_append``), but Q leaves as FP8 with a per-token-per-head (dynamic) or
static scale, K and V are stored as FP8 ``x * (1 / k_scale)`` and ``x * (1 / v_scale)``,
and the first request program of each request also writes its ``split_k_flag``
entries: 0, or -1 when the metadata is malformed and nothing was written.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from cake_sp.kernels import _config
from cake_sp.kernels.norm_rope import FP8_E4M3_MAX, reciprocal_rn, rope_style_code, round_to_fp8e4m3
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
    program_role,
    request_program,
    require_tensor,
    store_kv_rows,
    store_token_rows,
    tile_program,
)

_OP = "fused_qk_rmsnorm_rope_quantize_fp8_append_paged_kv_cache"
_NO_LIMIT = 2**31 - 1
QUANT_POLICIES = {1: "dynamic per-token-per-head Q scale", 2: "static q_scale_inv"}
_QUANT_DYNAMIC: tl.constexpr = tl.constexpr(1)
# Floor of a dynamic Q scale's numerator, so an all-zero head gets a finite scale.
_AMAX_FLOOR: tl.constexpr = tl.constexpr(1e-6)
# q_scale of dynamic prefill pads each request's token axis to a multiple of this.
Q_SCALE_PAD = 128


@triton.jit
def _store_row_values(ptrs, values, mask, INTERPRET: tl.constexpr):
    """Store one fp32 value a tile row (``[BLOCK_M]`` pointers, values and mask, as a row
    reduction of the tile leaves them) where ``mask``.

    ``tl.store`` gives a ``[BLOCK_M]`` store a layout of its own, one row a lane, and moving
    the rows there crosses warps: Triton then rebuilt the request scan of ``tile_program``
    in that layout, 5-13 shared-memory barriers a program (ptxas for sm_90a, 2 and 4 warps)
    where the static-scale kernel has 0-3.  The store as elementwise PTX keeps the rows where
    the reduction left them: the lanes that share a row store the same value to the same
    address, one transaction.  That took 4-11 % off the dynamic-scale calls on an H200
    (docs/results.md).  The interpreter runs no PTX."""
    if INTERPRET:
        tl.store(ptrs, values, mask=mask)
    else:
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.b32 p, $3, 0; @p st.global.f32 [$1], $2; mov.b32 $0, 0; }",
            "=r,l,f,r", [ptrs.to(tl.int64, bitcast=True), values, mask.to(tl.int32)],
            dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _qk_rope_fp8_append_kernel(
    qkv_ptr, cos_sin_ptr, seq_lens_ptr, q_indptr_ptr, page_indices_ptr,
    k_cache_ptr, v_cache_ptr, out_q_ptr, out_k_ptr, out_v_ptr,
    q_norm_ptr, k_norm_ptr, error_flags_ptr, split_k_flag_ptr, q_scale_ptr,
    k_scale_ptr, v_scale_ptr, q_scale_inv_ptr,
    num_tokens, num_req, max_req_len, max_pos, max_pages, num_pages,
    stride_qkv, stride_cs, stride_pi, stride_cp, stride_cr, stride_ch,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_sb, stride_st, stride_sh,
    eps, upper_max,
    HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, PAGE_SIZE: tl.constexpr,
    TOKEN_PROGRAMS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_S: tl.constexpr,
    CHUNK_B: tl.constexpr, NUM_B_CHUNKS: tl.constexpr,
    CHUNK_P: tl.constexpr, NUM_P_CHUNKS: tl.constexpr, BLOCK_R: tl.constexpr,
    CLEAR_PROGRAMS: tl.constexpr, TILES_FIRST: tl.constexpr,
    POLICY: tl.constexpr, STYLE: tl.constexpr, QUANT: tl.constexpr,
    SCALE_BY_REQUEST: tl.constexpr, K_TO_CACHE: tl.constexpr, V_TO_CACHE: tl.constexpr,
    CLEAR: tl.constexpr, HAS_ERROR_FLAGS: tl.constexpr, INTERPRET: tl.constexpr,
):
    """Request and tile programs (``paged_append``), in the order ``TILES_FIRST`` says.
    Q: ``fp8(y * (1 / s))`` with ``s = max(|y|, 1e-6) / upper_max`` per token and head
    (``QUANT`` 1) or ``fp8(y * q_scale_inv)`` (2), where ``y = qk_norm_rope(fp32(x))``;
    K: ``fp8(y * (1 / k_scale))``; V: ``fp8(fp32(v) * (1 / v_scale))``.  ``s`` and each
    reciprocal are rounded once (IEEE), then each product, then the FP8 conversion
    (nearest-even, saturating), as FlashInfer's kernel does."""
    # Tiles of tokens only: token programs (``paged_append``) took 1.05x the tiles' time
    # over the FP8 decode rows on an H200 (docs/results.md), so this kernel has none.
    tl.static_assert(not TOKEN_PROGRAMS)
    is_request, index = program_role(tl.program_id(0), num_tokens, num_req, HQ + 2 * HKV,
                                     BLOCK_M, BLOCK_S, CLEAR_PROGRAMS, TILES_FIRST)
    if is_request:
        b, c, valid = request_program(
            index, q_indptr_ptr, seq_lens_ptr, page_indices_ptr, k_cache_ptr, v_cache_ptr,
            error_flags_ptr, num_tokens, num_req, max_req_len, max_pos, max_pages, num_pages,
            stride_pi, stride_cp, stride_cr, stride_ch, HKV, D, PAGE_SIZE, CHUNK_B,
            NUM_B_CHUNKS, CHUNK_P, NUM_P_CHUNKS, BLOCK_R, CLEAR_PROGRAMS, CLEAR,
            HAS_ERROR_FLAGS)
        for h in tl.static_range(HKV):  # one split_k_flag entry per (b, kv head)
            tl.store(split_k_flag_ptr + b * HKV + h, tl.where(valid, 0, -1), mask=c == 0)
    else:
        # The per-tensor scales before the tile's loads (``paged_append.guess_request``):
        # loaded beside their use, after the head's arithmetic, K's and Q's would wait for
        # the RoPE rows, one round trip more.
        k_scale = tl.load(k_scale_ptr)
        v_scale = tl.load(v_scale_ptr)
        if QUANT != _QUANT_DYNAMIC:
            q_scale_inv = tl.load(q_scale_inv_ptr)
        slot, tok, req, r, tok_ok, pos, page, row, page_ok, x_lo, x_hi = tile_program(
            index, qkv_ptr, q_indptr_ptr, seq_lens_ptr, page_indices_ptr,
            num_tokens, num_req, max_req_len, max_pos, max_pages, num_pages, stride_qkv,
            stride_pi, HQ + 2 * HKV, D, PAGE_SIZE, BLOCK_M, CHUNK_B, NUM_B_CHUNKS)
        if slot < HQ + HKV:
            y_lo, y_hi = normalized_rotated_head(x_lo, x_hi, slot, pos, tok_ok, cos_sin_ptr,
                                                 stride_cs, q_norm_ptr, k_norm_ptr, eps, HQ,
                                                 POLICY, BLOCK_M, D, STYLE)
            if slot < HQ:
                if QUANT == _QUANT_DYNAMIC:
                    amax = tl.maximum(tl.maximum(tl.max(tl.abs(y_lo), axis=1),
                                                 tl.max(tl.abs(y_hi), axis=1)), _AMAX_FLOOR)
                    scale = tl.math.div_rn(amax, tl.full([BLOCK_M], upper_max, tl.float32))
                    inv_scale = reciprocal_rn(scale)[:, None]
                    q_lo = round_to_fp8e4m3(y_lo * inv_scale, INTERPRET)
                    q_hi = round_to_fp8e4m3(y_hi * inv_scale, INTERPRET)
                    if SCALE_BY_REQUEST:
                        s_off = req.to(tl.int64) * stride_sb + r * stride_st
                    else:
                        s_off = tok.to(tl.int64) * stride_st
                    _store_row_values(q_scale_ptr + s_off + slot * stride_sh, scale, tok_ok,
                                      INTERPRET)
                else:
                    q_lo = round_to_fp8e4m3(y_lo * q_scale_inv, INTERPRET)
                    q_hi = round_to_fp8e4m3(y_hi * q_scale_inv, INTERPRET)
                store_token_rows(out_q_ptr, q_lo, q_hi, tok, slot, tok_ok, stride_qt, stride_qh, D)
            else:
                inv_k_scale = reciprocal_rn(k_scale)
                store_kv_rows(k_cache_ptr, out_k_ptr,
                              round_to_fp8e4m3(y_lo * inv_k_scale, INTERPRET),
                              round_to_fp8e4m3(y_hi * inv_k_scale, INTERPRET),
                              tok, slot - HQ, page, row, tok_ok, page_ok, stride_cp, stride_cr,
                              stride_ch, stride_kt, stride_kh, D, K_TO_CACHE)
        else:
            inv_v_scale = reciprocal_rn(v_scale)
            store_kv_rows(v_cache_ptr, out_v_ptr,
                          round_to_fp8e4m3(x_lo.to(tl.float32) * inv_v_scale, INTERPRET),
                          round_to_fp8e4m3(x_hi.to(tl.float32) * inv_v_scale, INTERPRET),
                          tok, slot - HQ - HKV, page, row, tok_ok, page_ok, stride_cp,
                          stride_cr, stride_ch, stride_vt, stride_vh, D, V_TO_CACHE)


def _check_scalar_tensor(name: str, t, device: torch.device) -> None:
    """A one-element fp32 device tensor (a per-tensor scale)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{_OP}: {name} must be a one-element fp32 torch.Tensor, "
                        f"got {type(t).__name__}")
    if t.dtype != torch.float32 or t.numel() != 1 or t.device != device:
        raise ValueError(f"{_OP}: {name} must be a one-element fp32 tensor on {device}, "
                         f"got {describe(t)}")


def q_scale_shape(quant_policy: int, is_prefill: bool, num_tokens: int, num_req: int,
                  num_q_heads: int, max_seqlen: int) -> tuple[int, ...]:
    """Shape of ``q_scale``: ``[T, Hq]`` (dynamic decode), ``[B, Hq, round_up(max_seqlen,
    128)]`` (dynamic prefill) or ``[0]`` (static)."""
    if quant_policy != 1:
        return (0,)
    if is_prefill:
        return (num_req, num_q_heads, triton.cdiv(max_seqlen, Q_SCALE_PAD) * Q_SCALE_PAD)
    return (num_tokens, num_q_heads)


def _check_qk_rope_fp8_append_inputs(qkv, cos_sin, seq_lens, q_indptr, page_indices,
                                     paged_kv_cache, is_prefill, k_scale, v_scale, quant_policy,
                                     max_seqlen, upper_max, q_scale_inv, q_norm_weight,
                                     k_norm_weight, qk_norm_policy, out_q, out_k, out_v, q_scale,
                                     split_k_flag, rope_style, kv_layout, error_flags):
    """Every check of the FP8 op, before anything is allocated.

    Returns ``(T, B, Hq, Hkv, D, page_size)``.
    """
    if not isinstance(paged_kv_cache, (tuple, list)) or len(paged_kv_cache) != 2:
        raise TypeError(f"{_OP}: paged_kv_cache must be a (key_cache, value_cache) tuple, "
                        f"got {type(paged_kv_cache).__name__}")
    key_cache, value_cache = paged_kv_cache
    num_tokens, num_req, hkv, head_dim, page_size = check_paged_append_common(
        _OP, qkv, cos_sin, seq_lens, q_indptr, page_indices, key_cache, value_cache, kv_layout,
        torch.float8_e4m3fn)
    width = qkv.shape[1]
    if width % head_dim or width // head_dim <= 2 * hkv:
        raise ValueError(f"{_OP}: qkv must be [T, (Hq + 2 Hkv) * D] with Hq >= 1, D = "
                         f"{head_dim} and Hkv = {hkv} (from the caches), got {describe(qkv)}")
    hq = width // head_dim - 2 * hkv
    check_num_q_heads(_OP, qkv, hq, hkv, head_dim)
    check_norm_weights(_OP, qk_norm_policy, q_norm_weight, k_norm_weight, head_dim, qkv.device)
    rope_style_code(rope_style)
    if not isinstance(is_prefill, bool):
        raise TypeError(f"{_OP}: is_prefill must be a bool, got {is_prefill!r}")
    if quant_policy not in QUANT_POLICIES:
        raise ValueError(f"{_OP}: quant_policy must be one of {QUANT_POLICIES}, "
                         f"got {quant_policy!r}")
    if not isinstance(upper_max, (int, float)) or not math.isfinite(upper_max) or not (
            0.0 < upper_max <= FP8_E4M3_MAX):
        raise ValueError(f"{_OP}: upper_max must be a finite float in (0, {FP8_E4M3_MAX}], "
                         f"got {upper_max!r}")
    if not isinstance(max_seqlen, int) or max_seqlen < 0:
        raise ValueError(f"{_OP}: max_seqlen must be a non-negative int, got {max_seqlen!r}")
    if quant_policy == 1 and is_prefill and max_seqlen == 0:
        raise ValueError(f"{_OP}: dynamic prefill (quant_policy=1, is_prefill=True) needs "
                         "max_seqlen > 0 to lay out q_scale")
    _check_scalar_tensor("k_scale", k_scale, qkv.device)
    _check_scalar_tensor("v_scale", v_scale, qkv.device)
    if quant_policy == 2:
        _check_scalar_tensor("q_scale_inv", q_scale_inv, qkv.device)
    for name, out, heads in (("out_q", out_q, hq), ("out_k", out_k, hkv), ("out_v", out_v, hkv)):
        if out is not None:
            check_token_out(_OP, name, out, (num_tokens, heads, head_dim), torch.float8_e4m3fn,
                            qkv.device)
    if q_scale is not None:
        want = q_scale_shape(quant_policy, is_prefill, num_tokens, num_req, hq, max_seqlen)
        if not isinstance(q_scale, torch.Tensor):
            raise TypeError(f"{_OP}: q_scale must be a torch.Tensor, got {type(q_scale).__name__}")
        if (q_scale.dtype != torch.float32 or q_scale.device != qkv.device
                or (quant_policy == 1 and tuple(q_scale.shape) != want)
                or (quant_policy == 2 and q_scale.numel() != 0)
                or (q_scale.numel() > 1 and q_scale.stride(-1) != 1)):
            raise ValueError(f"{_OP}: q_scale must be fp32 {list(want)} on {qkv.device} with a "
                             f"unit stride in its last dim, got {describe(q_scale)}")
    if split_k_flag is not None:
        require_tensor(_OP, "split_k_flag", split_k_flag, dtypes=(torch.int32,), ndim=2,
                       device=qkv.device)
        if tuple(split_k_flag.shape) != (num_req, hkv) or not split_k_flag.is_contiguous():
            raise ValueError(f"{_OP}: split_k_flag must be contiguous [B, Hkv] = "
                             f"[{num_req}, {hkv}], got {describe(split_k_flag)}")
    check_error_flags(_OP, error_flags, num_req, qkv.device)
    _config.require_triton_device(_OP, qkv.device)  # last: a bad argument is named first
    return num_tokens, num_req, hq, hkv, head_dim, page_size


def fused_qk_rmsnorm_rope_quantize_fp8_append_paged_kv_cache(
    qkv: torch.Tensor,
    cos_sin: torch.Tensor,
    seq_lens: torch.Tensor,
    q_indptr: torch.Tensor,
    page_indices: torch.Tensor,
    paged_kv_cache: tuple[torch.Tensor, torch.Tensor],
    is_prefill: bool,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    quant_policy: int,
    max_seqlen: int = 0,
    upper_max: float = FP8_E4M3_MAX,
    q_scale_inv: torch.Tensor | None = None,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    qk_norm_policy: int = 0,
    out_q: torch.Tensor | None = None,
    out_k: torch.Tensor | None = None,
    out_v: torch.Tensor | None = None,
    q_scale: torch.Tensor | None = None,
    split_k_flag: torch.Tensor | None = None,
    *,
    eps: float = 1e-6,
    rope_style: str = "neox",
    kv_layout: str = "NHD",
    clear_unused_last_page_rows: bool = True,
    error_flags: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Normalise, rotate and quantize Q and K to FP8, append K and V to FP8 paged caches.

    Same addressing and norm/RoPE math as
    ``fused_qk_rmsnorm_rope_append_paged_kv_cache`` (``y`` below is its fp32,
    unrounded Q or K head; it is quantized directly, never rounded to bf16)::

        quant_policy 1: q_scale[., h] = max(max|y_q|, 1e-6) / upper_max
                        out_q = fp8(y_q * (1 / q_scale))
        quant_policy 2: out_q = fp8(y_q * q_scale_inv);  q_scale is empty
        K[page, row] = fp8(y_k * (1 / k_scale));   V[page, row] = fp8(fp32(v) * (1 / v_scale))

    ``fp8`` rounds to nearest-even and saturates at +-448; the division and the
    reciprocals are IEEE fp32, each product is rounded once: FlashInfer's kernel
    quantizes the same way (a multiplication by the reciprocal, which can differ
    from the quotient by one fp32 ulp, so by one FP8 step at a rounding tie, and
    costs one instruction where a correctly rounded quotient costs six).

    The kernel validates ``q_indptr`` on the device: if ``q_indptr[0] != 0``, it
    decreases anywhere, ``q_indptr[B] != T``, or (dynamic prefill) a request has
    more than ``max_seqlen`` tokens, every
    ``split_k_flag[b, h]`` is -1 and no byte of Q, K, V, the caches or
    ``q_scale`` is written; otherwise all are 0.  No host sync, no extra launch,
    CUDA-graph capturable; runs on the current stream.

    Parameters
    ----------
    qkv, cos_sin, seq_lens, q_indptr, page_indices
        As in the BF16 op: bf16 ``[T, (Hq + 2 Hkv) * D]``, fp32 ``[max_pos, D]``,
        int32 ``[B]`` (lengths after the append), int32 ``[B + 1]``, int32
        ``[B, max_pages]``.  ``Hkv`` and ``D`` come from the caches and
        ``Hq = width / D - 2 Hkv`` (any positive multiple of ``Hkv``).
    paged_kv_cache : (key_cache, value_cache), float8_e4m3fn ``[num_pages, page_size, Hkv, D]``
        (``"NHD"``) or ``[num_pages, Hkv, page_size, D]`` (``"HND"``), updated in place.
    is_prefill : bool
        Picks the dynamic ``q_scale`` layout.
    k_scale, v_scale : fp32, one element, on the device
        Per-tensor dequantization scales of the caches.
    quant_policy : int
        1 dynamic per-token-per-head Q scale, 2 static ``q_scale_inv``.
    max_seqlen : int
        Dynamic prefill only (must be > 0 there): the longest request allowed;
        ``q_scale`` is ``[B, Hq, round_up(max_seqlen, 128)]``.
    upper_max : float
        Finite, in ``(0, 448]``: what the largest ``|y_q|`` of a head maps to.
    q_scale_inv : fp32, one element, optional
        Static Q multiplier, required by ``quant_policy=2``.
    q_norm_weight, k_norm_weight, qk_norm_policy
        As in the BF16 op (0 none, 1 RoPE then RMSNorm, 2 RMSNorm then RoPE).
    out_q : float8_e4m3fn ``[T, Hq, D]``, optional
        Allocated when None.
    out_k, out_v : float8_e4m3fn ``[T, Hkv, D]``, optional
        When given, K (resp. V) goes there, row ``t``, instead of into the cache.
    q_scale : fp32, optional
        ``[T, Hq]`` (dynamic decode: entry of token ``t``), ``[B, Hq,
        round_up(max_seqlen, 128)]`` (dynamic prefill: entry ``[b, h, r]`` of
        token ``r`` of request ``b``; padding entries are never written), or
        empty (static).  Allocated when None.
    split_k_flag : int32 ``[B, Hkv]``, optional
        Allocated when None; written by every call.
    eps, rope_style, kv_layout, clear_unused_last_page_rows, error_flags
        As in the BF16 op (keyword-only extensions of FlashInfer's signature).
        ``error_flags`` also reports ``ERR_POSITION`` / ``ERR_PAGE``, which do
        not touch ``split_k_flag``.

    Returns
    -------
    (out_q, q_scale, split_k_flag)

    Raises
    ------
    TypeError, ValueError
        On a wrong dtype, shape, device, layout or option, before any allocation.

    Under ``torch.compile`` the checks and the allocations are traced and the launch is the
    custom operator ``cake_sp::qk_rmsnorm_rope_quantize_fp8_append_paged_kv_cache``
    (below), which mutates the caches and the outputs.
    """
    num_tokens, num_req, hq, hkv, head_dim, page_size = _check_qk_rope_fp8_append_inputs(
        qkv, cos_sin, seq_lens, q_indptr, page_indices, paged_kv_cache, is_prefill, k_scale,
        v_scale, quant_policy, max_seqlen, upper_max, q_scale_inv, q_norm_weight, k_norm_weight,
        qk_norm_policy, out_q, out_k, out_v, q_scale, split_k_flag, rope_style, kv_layout,
        error_flags)
    dev = qkv.device
    if out_q is None:
        out_q = torch.empty((num_tokens, hq, head_dim), dtype=torch.float8_e4m3fn, device=dev)
    if q_scale is None:
        q_scale = torch.empty(q_scale_shape(quant_policy, is_prefill, num_tokens, num_req, hq,
                                            max_seqlen), dtype=torch.float32, device=dev)
    if split_k_flag is None:
        split_k_flag = torch.empty((num_req, hkv), dtype=torch.int32, device=dev)
    key_cache, value_cache = paged_kv_cache
    if torch.compiler.is_compiling():  # the launch as one custom operator (below)
        torch.ops.cake_sp.qk_rmsnorm_rope_quantize_fp8_append_paged_kv_cache(
            qkv, cos_sin, seq_lens, q_indptr, page_indices, key_cache, value_cache, is_prefill,
            k_scale, v_scale, quant_policy, max_seqlen, upper_max, q_scale_inv, q_norm_weight,
            k_norm_weight, qk_norm_policy, out_q, out_k, out_v, q_scale, split_k_flag, eps,
            rope_style, kv_layout, clear_unused_last_page_rows, error_flags)
        return out_q, q_scale, split_k_flag
    plan = launch_plan(num_tokens, num_req, hq + 2 * hkv, hkv, head_dim, page_size,
                       page_indices.shape[1], clear_unused_last_page_rows, token_programs=False)
    stride_cp, stride_cr, stride_ch = cache_strides(key_cache, kv_layout)
    # Absent optional tensors are never dereferenced (constexpr switches); any
    # valid pointer stands in for them.
    k_out = out_k if out_k is not None else out_q
    v_out = out_v if out_v is not None else out_q
    scale_by_request = quant_policy == 1 and is_prefill
    if scale_by_request:
        stride_sb, stride_st, stride_sh = q_scale.stride(0), q_scale.stride(2), q_scale.stride(1)
    elif quant_policy == 1:
        stride_sb, stride_st, stride_sh = 0, q_scale.stride(0), q_scale.stride(1)
    else:
        stride_sb = stride_st = stride_sh = 0
    _qk_rope_fp8_append_kernel[(plan.pop("grid"),)](
        qkv, cos_sin, seq_lens, q_indptr, page_indices, key_cache, value_cache,
        out_q, k_out, v_out,
        q_norm_weight if qk_norm_policy else qkv, k_norm_weight if qk_norm_policy else qkv,
        error_flags if error_flags is not None else seq_lens, split_k_flag,
        q_scale if quant_policy == 1 else k_scale, k_scale, v_scale,
        q_scale_inv if quant_policy == 2 else k_scale,
        num_tokens, num_req, max_seqlen if scale_by_request else _NO_LIMIT, cos_sin.shape[0],
        page_indices.shape[1], key_cache.shape[0],
        qkv.stride(0), cos_sin.stride(0), page_indices.stride(0),
        stride_cp, stride_cr, stride_ch,
        out_q.stride(0), out_q.stride(1), k_out.stride(0), k_out.stride(1),
        v_out.stride(0), v_out.stride(1), stride_sb, stride_st, stride_sh,
        eps, float(upper_max),
        HQ=hq, HKV=hkv, D=head_dim, PAGE_SIZE=page_size, **plan, POLICY=qk_norm_policy,
        STYLE=rope_style_code(rope_style), QUANT=quant_policy, SCALE_BY_REQUEST=scale_by_request,
        K_TO_CACHE=out_k is None, V_TO_CACHE=out_v is None,
        CLEAR=bool(clear_unused_last_page_rows), HAS_ERROR_FLAGS=error_flags is not None,
        INTERPRET=_config.INTERPRET,
    )
    return out_q, q_scale, split_k_flag


@torch.library.custom_op("cake_sp::qk_rmsnorm_rope_quantize_fp8_append_paged_kv_cache",
                        mutates_args=("key_cache", "value_cache", "out_q", "out_k", "out_v",
                                      "q_scale", "split_k_flag", "error_flags"))
def _append_fp8_op(qkv: torch.Tensor, cos_sin: torch.Tensor, seq_lens: torch.Tensor,
                   q_indptr: torch.Tensor, page_indices: torch.Tensor, key_cache: torch.Tensor,
                   value_cache: torch.Tensor, is_prefill: bool, k_scale: torch.Tensor,
                   v_scale: torch.Tensor, quant_policy: int, max_seqlen: int, upper_max: float,
                   q_scale_inv: torch.Tensor | None, q_norm_weight: torch.Tensor | None,
                   k_norm_weight: torch.Tensor | None, qk_norm_policy: int,
                   out_q: torch.Tensor, out_k: torch.Tensor | None, out_v: torch.Tensor | None,
                   q_scale: torch.Tensor, split_k_flag: torch.Tensor, eps: float,
                   rope_style: str, kv_layout: str, clear_unused_last_page_rows: bool,
                   error_flags: torch.Tensor | None) -> None:
    """The op as one custom operator (for ``torch.compile``): writes only what it mutates."""
    fused_qk_rmsnorm_rope_quantize_fp8_append_paged_kv_cache(
        qkv, cos_sin, seq_lens, q_indptr, page_indices, (key_cache, value_cache), is_prefill,
        k_scale, v_scale, quant_policy, max_seqlen, upper_max, q_scale_inv, q_norm_weight,
        k_norm_weight, qk_norm_policy, out_q, out_k, out_v, q_scale, split_k_flag, eps=eps,
        rope_style=rope_style, kv_layout=kv_layout,
        clear_unused_last_page_rows=clear_unused_last_page_rows, error_flags=error_flags)


@_append_fp8_op.register_fake
def _(*args) -> None:
    return None
