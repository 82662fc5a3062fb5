"""Backward of the front end's norm and RoPE, from the gathered output gradients to ``dP``.

Per token row and projection head ``h`` (``HeadPlan`` order: Q, K, V heads)::

    g_h  = sum over the ranks that received h of gathered[row, rank, local(h)]   # fp32
    Q, K:  dy = rope(g_h, cos, -sin)            # RoPE is a rotation: transpose = rotate by -theta
           with a norm weight w (forward: y = bf16(bf16(n) * w), n = p * rstd):
           dn = dy * w;   dp = rstd * (dn - n * mean(dn * n));   dw += sum_rows(dy * bf16(n))
           without:        dp = dy
    V:     dp = g_h
    dP[row, h] = bf16(dp)

``gathered`` is the front end backward's ``BandExchange`` output ``[rows, W, heads,
D]`` (each source rank's Q band, then its K and V bands); ``p`` the projection
``x @ W.T`` of the Q and K heads without the bias (recomputed by the caller in bf16,
or the forward's fp32 workspace kept), read with the bias added only where a norm
weight is given.  The
roundings of the forward are passed straight through, as autograd treats a cast.
One program per (row block, head); the norm-weight gradients are written as
per-row-block partial sums that the launcher adds up (deterministic).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cake_sp.kernels import _config
from cake_sp.kernels.norm_rope import load_cos_sin, rope_rotate, round_to_bf16
from cake_sp.layouts import HeadPlan


@triton.jit
def _norm_backward(dy, p_ptr, bias_ptr, head, offs_m, row_ok, cols, w_ptr, eps, p_stride,
                   HAS_NORM: tl.constexpr, HAS_BIAS: tl.constexpr, D: tl.constexpr,
                   INTERPRET: tl.constexpr):
    """``(dp, dw)`` of one head tile: ``dw`` is this tile's ``[D]`` share of the weight's grad."""
    if HAS_NORM:
        p = tl.load(p_ptr + offs_m[:, None] * p_stride + head * D + cols[None, :],
                    mask=row_ok[:, None], other=0.0).to(tl.float32)
        if HAS_BIAS:
            p += tl.load(bias_ptr + head * D + cols).to(tl.float32)[None, :]
        rstd = 1.0 / tl.sqrt_rn(tl.sum(p * p, axis=1) / D + eps)
        n = p * rstd[:, None]
        w = tl.load(w_ptr + cols).to(tl.float32)
        dw = tl.sum(dy * round_to_bf16(n, INTERPRET).to(tl.float32), axis=0)
        dn = dy * w[None, :]
        dp = rstd[:, None] * (dn - n * (tl.sum(dn * n, axis=1) / D)[:, None])
    else:
        dp = dy
        dw = tl.zeros((D,), dtype=tl.float32)
    return dp, dw


@triton.jit
def _front_end_backward_kernel(g_ptr, p_ptr, bias_ptr, cos_sin_ptr, pos_ptr, q_norm_ptr,
                               k_norm_ptr, dp_ptr, dw_ptr, rows, first_block, cos_sin_stride,
                               cos_sin_rows, eps, p_stride,
                               NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
                               Q_PER_RANK: tl.constexpr, KV_PER_RANK: tl.constexpr,
                               KV_REPLICAS: tl.constexpr, WORLD: tl.constexpr, D: tl.constexpr,
                               BLOCK_M: tl.constexpr, HAS_Q_NORM: tl.constexpr,
                               HAS_K_NORM: tl.constexpr, HAS_BIAS: tl.constexpr,
                               HAS_POSITIONS: tl.constexpr, ROPE_STYLE: tl.constexpr,
                               INTERPRET: tl.constexpr):
    row_block = first_block + tl.program_id(0)
    head = tl.program_id(1)
    HEADS_PER_RANK: tl.constexpr = Q_PER_RANK + 2 * KV_PER_RANK
    QK_HEADS: tl.constexpr = NUM_Q_HEADS + NUM_KV_HEADS
    offs_m = row_block.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = offs_m < rows
    cols = tl.arange(0, D)

    # Which ranks received head ``head`` (HeadPlan.destinations), as which local head.
    is_q = head < NUM_Q_HEADS
    is_v = head >= QK_HEADS
    j = head - tl.where(is_q, 0, tl.where(is_v, QK_HEADS, NUM_Q_HEADS))
    per_band = tl.where(is_q, Q_PER_RANK, KV_PER_RANK)
    replicas = tl.where(is_q, 1, KV_REPLICAS)
    first_rank = (j // per_band) * replicas
    local = j % per_band + tl.where(is_q, 0, tl.where(is_v, Q_PER_RANK + KV_PER_RANK,
                                                      Q_PER_RANK))
    grad = tl.zeros((BLOCK_M, D), dtype=tl.float32)
    for t in range(KV_REPLICAS):
        if t < replicas:
            src = g_ptr + ((offs_m * WORLD + first_rank + t) * HEADS_PER_RANK + local) * D
            grad += tl.load(src[:, None] + cols[None, :], mask=row_ok[:, None],
                            other=0.0).to(tl.float32)

    if head < QK_HEADS:
        if HAS_POSITIONS:
            table_rows = tl.load(pos_ptr + offs_m, mask=row_ok, other=0).to(tl.int64)
            # A position outside the table rotated its row by cos = sin = 0 in the forward
            # (which reported it); its transpose is the same zero, and nothing is read.
            table_ok = row_ok & (table_rows >= 0) & (table_rows < cos_sin_rows)
        else:
            table_rows = offs_m
            table_ok = row_ok
        cos, sin = load_cos_sin(cos_sin_ptr, table_rows, cos_sin_stride, table_ok,
                                tl.arange(0, D // 2), D)
        dy = rope_rotate(grad, cos, -sin, BLOCK_M, D, ROPE_STYLE)
        if head < NUM_Q_HEADS:
            out, dw = _norm_backward(dy, p_ptr, bias_ptr, head, offs_m, row_ok, cols,
                                     q_norm_ptr, eps, p_stride, HAS_Q_NORM, HAS_BIAS, D,
                                     INTERPRET)
        else:
            out, dw = _norm_backward(dy, p_ptr, bias_ptr, head, offs_m, row_ok, cols,
                                     k_norm_ptr, eps, p_stride, HAS_K_NORM, HAS_BIAS, D,
                                     INTERPRET)
        tl.store(dw_ptr + (row_block * QK_HEADS + head) * D + cols, dw)
    else:
        out = grad
    dst = dp_ptr + offs_m[:, None] * ((QK_HEADS + NUM_KV_HEADS) * D) + head * D + cols[None, :]
    tl.store(dst, round_to_bf16(out, INTERPRET), mask=row_ok[:, None])


def dp_buffer(dp: torch.Tensor | None, rows: int, plan: HeadPlan,
              device: torch.device) -> torch.Tensor:
    """``dp`` checked (bf16 ``[rows, (Hq + 2*Hkv) * D]``, contiguous), or a new one."""
    shape = (rows, plan.total_heads * plan.head_dim)
    if dp is None:
        return torch.empty(shape, dtype=torch.bfloat16, device=device)
    if tuple(dp.shape) != shape or dp.dtype != torch.bfloat16 or not dp.is_contiguous():
        raise ValueError(f"front_end_backward: dp must be contiguous bf16 {list(shape)}, got "
                         f"{dp.dtype} {tuple(dp.shape)}")
    return dp


class FrontEndBackward:
    """``dP`` and the norm-weight gradients of one backward call, filled row chunk by row chunk
    (each chunk as soon as its gathered rows have arrived).

    Arguments (checked here): ``gathered`` bf16 ``[B, S_local, W, heads_per_rank, D]``,
    contiguous (module docstring); ``p`` bf16 or fp32 ``[rows, >= (Hq + Hkv) * D]`` with unit
    column stride, the Q/K columns (first) of ``x @ W.T`` without the bias, or None when
    neither norm weight is given; ``rope_cos_sin`` and ``positions`` (``[rows]`` or None) as
    the forward took them; ``qkv_bias`` bf16 ``[(Hq + 2*Hkv) * D]`` or None, added to
    ``p``.  ``gathered`` may still be arriving: a chunk's rows are read only by its
    ``rows`` call.  Owns ``dp``
    (bf16 ``[rows, (Hq + 2*Hkv) * D]``) and the per-row-block partial sums of the norm-weight
    gradients; ``rows(first, n)`` computes rows ``[first, first + n)`` (``first`` a multiple
    of ``_config.FRONT_END_BACKWARD_BLOCK_M``) on the current stream.
    """

    def __init__(self, gathered: torch.Tensor, p: torch.Tensor | None, plan: HeadPlan, *,
                 rope_cos_sin: torch.Tensor, positions: torch.Tensor | None,
                 q_norm_weight: torch.Tensor | None, k_norm_weight: torch.Tensor | None,
                 qkv_bias: torch.Tensor | None, eps: float, rope_style: int,
                 dp: torch.Tensor | None = None) -> None:
        self.num_rows = gathered.shape[0] * gathered.shape[1]
        d = plan.head_dim
        qk_heads = plan.num_q_heads + plan.num_kv_heads
        if gathered.shape[2:] != (plan.world_size, plan.heads_per_rank, d) \
                or not gathered.is_contiguous():
            raise ValueError(f"front_end_backward: gathered must be contiguous [B, S_local, "
                             f"{plan.world_size}, {plan.heads_per_rank}, {d}], got "
                             f"{tuple(gathered.shape)}")
        has_norm = q_norm_weight is not None or k_norm_weight is not None
        if has_norm and (p is None or p.dim() != 2 or p.shape[0] != self.num_rows
                         or p.shape[1] < qk_heads * d or p.stride(1) != 1
                         or p.dtype not in (torch.bfloat16, torch.float32)):
            raise ValueError(f"front_end_backward: p must be bf16 or fp32 [{self.num_rows}, >= "
                             f"{qk_heads * d}] with unit column stride, got "
                             f"{None if p is None else (p.dtype, tuple(p.shape), p.stride())}")
        self._plan, self._q_norm, self._k_norm = plan, q_norm_weight, k_norm_weight
        self._block_m = _config.FRONT_END_BACKWARD_BLOCK_M
        device = gathered.device
        self.dp = dp_buffer(dp, self.num_rows, plan, device)
        self._dw = torch.empty(triton.cdiv(self.num_rows, self._block_m), qk_heads, d,
                               dtype=torch.float32, device=device)
        self._args = (gathered, p, qkv_bias, rope_cos_sin, positions, q_norm_weight,
                      k_norm_weight, self.dp, self._dw, self.num_rows)
        self._tail = (rope_cos_sin.stride(0), rope_cos_sin.shape[0], eps,
                      0 if p is None else p.stride(0))
        self._constants = dict(
            NUM_Q_HEADS=plan.num_q_heads, NUM_KV_HEADS=plan.num_kv_heads,
            Q_PER_RANK=plan.q_per_rank, KV_PER_RANK=plan.kv_per_rank,
            KV_REPLICAS=plan.kv_replicas, WORLD=plan.world_size, D=d, BLOCK_M=self._block_m,
            HAS_Q_NORM=q_norm_weight is not None, HAS_K_NORM=k_norm_weight is not None,
            HAS_BIAS=qkv_bias is not None, HAS_POSITIONS=positions is not None,
            ROPE_STYLE=rope_style, INTERPRET=_config.INTERPRET,
            num_warps=_config.FRONT_END_BACKWARD_NUM_WARPS)

    def rows(self, first: int, n: int) -> None:
        if first % self._block_m or not 0 < n <= self.num_rows - first:
            raise ValueError(f"front_end_backward: rows [{first}, {first + n}) must start at a "
                             f"multiple of {self._block_m} and lie in [0, {self.num_rows})")
        first_block = first // self._block_m
        grid = (triton.cdiv(first + n, self._block_m) - first_block, self._plan.total_heads)
        _front_end_backward_kernel[grid](*self._args, first_block, *self._tail,
                                         **self._constants)

    def norm_weight_grads(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """fp32 ``[D]`` gradients of the Q and K norm weights (None without that weight), once
        every row has been computed."""
        hq = self._plan.num_q_heads
        d_q = self._dw[:, :hq].sum(dim=(0, 1)) if self._q_norm is not None else None
        d_k = self._dw[:, hq:].sum(dim=(0, 1)) if self._k_norm is not None else None
        return d_q, d_k
