"""The baselines' QK RMSNorm + RoPE: one fused, in-place Triton launch over a bf16 projection.

The per-operator baselines run the projection as a cuBLAS GEMM with a bf16
output and then this kernel, the way a serving stack pairs a GEMM with a fused
QK-norm + RoPE kernel (FlashInfer, Liger).  It is written with the package's
own device helpers (``cake_sp.kernels.norm_rope``), so its math is the math of
the fused producer minus the GEMM: per Q/K head of ``D`` channels::

    y = bf16(bf16(p * rsqrt(mean(p^2) + eps)) * w)       # w: q or k norm weight
    p = bf16(rope(y, cos_sin[token]))                    # fp32 rotation

V heads are left as they are.  The only difference from DESIGN.md section 1
is upstream: ``p`` was rounded to bf16 by the GEMM.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cake_sp.kernels import _config
from cake_sp.kernels.norm_rope import (
    load_cos_sin,
    rms_normalize,
    rope_rotate,
    rope_style_code,
    round_to_bf16,
)

BLOCK_M = 32


@triton.jit
def _norm_rope_kernel(p_ptr, q_norm_ptr, k_norm_ptr, cos_sin_ptr, cos_sin_stride, rows, eps,
                      HEAD_STRIDE: tl.constexpr, NUM_Q: tl.constexpr, D: tl.constexpr,
                      BLOCK_M: tl.constexpr, STYLE: tl.constexpr, INTERPRET: tl.constexpr):
    """One ``[BLOCK_M, D]`` tile of one Q or K head of ``p [rows, heads, D]``, in place."""
    head = tl.program_id(1)
    offs_m = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    row_ok = offs_m < rows
    cols = tl.arange(0, D)
    ptrs = p_ptr + offs_m[:, None] * HEAD_STRIDE + head * D + cols[None, :]
    x = tl.load(ptrs, mask=row_ok[:, None], other=0.0).to(tl.float32)
    if head < NUM_Q:
        w = tl.load(q_norm_ptr + cols).to(tl.float32)
    else:
        w = tl.load(k_norm_ptr + cols).to(tl.float32)
    n = round_to_bf16(rms_normalize(x, eps, D), INTERPRET).to(tl.float32)
    # Both factors are bf16 values: the fp32 product is exact, one rounding makes it bf16.
    y = round_to_bf16(n * w[None, :], INTERPRET).to(tl.float32)
    cos, sin = load_cos_sin(cos_sin_ptr, offs_m, cos_sin_stride, row_ok, tl.arange(0, D // 2), D)
    out = round_to_bf16(rope_rotate(y, cos, sin, BLOCK_M, D, STYLE), INTERPRET)
    tl.store(ptrs, out, mask=row_ok[:, None])


def qk_norm_rope_(p: torch.Tensor, q_norm_weight: torch.Tensor, k_norm_weight: torch.Tensor,
                  cos_sin: torch.Tensor, *, num_q: int, num_k: int, rope_style: str,
                  eps: float) -> torch.Tensor:
    """Normalise and rotate the first ``num_q + num_k`` heads of ``p`` in place; return ``p``.

    Parameters
    ----------
    p : bf16 ``[B, S, H, D]``, contiguous; heads ``[0, num_q)`` are Q heads,
        ``[num_q, num_q + num_k)`` K heads, the rest are left alone.
    q_norm_weight, k_norm_weight : bf16 ``[D]``.
    cos_sin : fp32 ``[B * S, D]``, one row per token (cos of the D/2 frequencies, then sin).
    """
    batch, seq, heads, d = p.shape
    rows = batch * seq
    if p.dtype != torch.bfloat16 or not p.is_contiguous():
        raise ValueError(f"qk_norm_rope_: p must be contiguous bf16, got {p.dtype} with "
                         f"strides {p.stride()}")
    if num_q + num_k > heads:
        raise ValueError(f"qk_norm_rope_: {num_q} Q + {num_k} K heads > {heads} heads of p")
    if cos_sin.shape[0] < rows or cos_sin.shape[1] != d or cos_sin.stride(1) != 1:
        raise ValueError(f"qk_norm_rope_: cos_sin must be fp32 [>= {rows}, {d}] with unit "
                         f"column stride, got {tuple(cos_sin.shape)}")
    if num_q + num_k == 0:
        return p
    grid = (triton.cdiv(rows, BLOCK_M), num_q + num_k)
    _norm_rope_kernel[grid](p, q_norm_weight, k_norm_weight, cos_sin, cos_sin.stride(0), rows,
                            eps, HEAD_STRIDE=heads * d, NUM_Q=num_q, D=d, BLOCK_M=BLOCK_M,
                            STYLE=rope_style_code(rope_style), INTERPRET=_config.INTERPRET)
    return p
