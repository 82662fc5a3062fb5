"""The producer's cuBLAS engine: the projection on cuBLAS, then one Triton epilogue kernel.

Same contract as :func:`producer.qkv_norm_rope_produce` (its docstring has the math and
the arguments), computed in two launches::

    P = x @ qkv_weight.T          # cuBLAS, fp32 out: the projection is not rounded
    deliver(P)                    # bias, QK RMSNorm, RoPE, stores at every destination, words

``P`` is an fp32 ``[rows, (Hq + 2 * Hkv) * D]`` workspace; it stays fp32 so that the
projection is not rounded before the norm (DESIGN.md section 1, step 1).  The
epilogue kernel loads one (row block, head) tile of ``P`` and finishes it with the
fused kernel's own ``producer_epilogue.deliver_tile``: the same norm, rotation,
rounding, stores, entry waits and readiness words, so a consumer cannot tell the
engines apart.  Autograd can keep ``P`` for the backward instead of recomputing it.

Measured on an H200 (docs/results.md) this engine is slower than the fused kernel from
2,048 rows on, and faster only at small calls whose fused tiles leave the last wave of SMs
part empty (``_config.producer_engine``): cuBLAS's fp32-output GEMM alone took 1.01-1.20x
its bf16-output GEMM, and the epilogue reads 4 bytes per projection element.  Row chunks of the GEMM
with the epilogues on a side stream (with or without cuBLAS's SM carve-out) measured
slower still, so the engine runs one GEMM and one epilogue.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cake_sp.kernels import _config
from cake_sp.kernels.producer import check_producer_inputs, epilogue_constants, signal_args
from cake_sp.kernels.producer_epilogue import deliver_tile, tile_coords
from cake_sp.kernels.signals import ProducerSignals
from cake_sp.layouts import DestLayout, HeadPlan


@triton.jit
def _deliver_projection_kernel(p_ptr, bias_ptr, q_norm_ptr, k_norm_ptr, cos_sin_ptr, pos_ptr,
                               bad_pos_ptr, dest_table_ptr, epoch_ptr, enter_ptr,
                               word_table_ptr, status_ptr, rows, row_blocks,
                               cos_sin_stride, cos_sin_rows, eps, seq_local, dest_seq_len,
                               dest_seq_offset, region_q, region_k, region_v,
                               token_stride_q, token_stride_k, token_stride_v,
                               head_stride_q, head_stride_k, head_stride_v,
                               source_rank, max_row_blocks, timeout_ns,
                               NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
                               Q_PER_RANK: tl.constexpr, KV_PER_RANK: tl.constexpr,
                               KV_REPLICAS: tl.constexpr, D: tl.constexpr,
                               BLOCK_M: tl.constexpr, HAS_BIAS: tl.constexpr,
                               HAS_Q_NORM: tl.constexpr, HAS_K_NORM: tl.constexpr,
                               HAS_POSITIONS: tl.constexpr, ROPE_STYLE: tl.constexpr,
                               SIGNAL: tl.constexpr, READY_M: tl.constexpr,
                               INTERPRET: tl.constexpr):
    """One program per (row block, head) tile; within a row block consecutive programs take
    heads bound for different ranks (``tile_coords`` with one group of every head)."""
    TOTAL_HEADS: tl.constexpr = NUM_Q_HEADS + 2 * NUM_KV_HEADS
    row_block, head = tile_coords(tl.program_id(0), row_blocks, NUM_Q_HEADS, NUM_KV_HEADS,
                                  Q_PER_RANK, KV_PER_RANK, TOTAL_HEADS)
    offs_m = row_block.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, D)
    # The epilogue loads the RoPE rows after the norm has waited for this tile.  Loading them
    # here, beside the tile, saves that round trip but took 106 registers instead of 80 (two
    # programs an SM instead of three): on an H100 it was 2-3 % slower at hidden 3072 and
    # within 2 % elsewhere (docs/results.md, 2026-12-06).
    acc = tl.load(p_ptr + offs_m[:, None] * (TOTAL_HEADS * D) + head * D + cols[None, :],
                  mask=(offs_m < rows)[:, None], other=0.0)
    if SIGNAL:
        epoch = tl.load(epoch_ptr)
    else:
        epoch = tl.full((), 0, tl.int64)
    nothing = tl.full((), 0, tl.int64)
    deliver_tile(
        acc, row_block, head, offs_m, cols, tl.arange(0, D // 2), nothing, nothing, rows,
        (bias_ptr, q_norm_ptr, k_norm_ptr, cos_sin_ptr, cos_sin_stride, cos_sin_rows, pos_ptr,
         bad_pos_ptr, eps),
        (dest_table_ptr, seq_local, dest_seq_len, dest_seq_offset, region_q, region_k, region_v,
         token_stride_q, token_stride_k, token_stride_v, head_stride_q, head_stride_k,
         head_stride_v),
        (epoch, enter_ptr, word_table_ptr, status_ptr, source_rank, max_row_blocks, timeout_ns),
        NUM_Q_HEADS, NUM_KV_HEADS, Q_PER_RANK, KV_PER_RANK, KV_REPLICAS, D, BLOCK_M, HAS_BIAS,
        HAS_Q_NORM, HAS_K_NORM, HAS_POSITIONS, ROPE_STYLE, SIGNAL, READY_M, False, INTERPRET)


def project_fp32(x: torch.Tensor, qkv_weight: torch.Tensor, out: torch.Tensor) -> None:
    """``out = x @ qkv_weight.T`` in fp32, unrounded: cuBLAS's bf16 GEMM with an fp32 output
    on a GPU; an fp32 GEMM on the CPU (where only correctness is at stake)."""
    if x.device.type == "cuda":
        torch.mm(x, qkv_weight.T, out_dtype=torch.float32, out=out)
    else:
        torch.mm(x.float(), qkv_weight.float().T, out=out)


def qkv_norm_rope_produce_cublas(
    x: torch.Tensor,
    qkv_weight: torch.Tensor,
    qkv_bias: torch.Tensor | None,
    q_norm_weight: torch.Tensor | None,
    k_norm_weight: torch.Tensor | None,
    cos_sin: torch.Tensor,
    positions: torch.Tensor | None,
    *,
    plan: HeadPlan,
    dest: DestLayout,
    dest_table: torch.Tensor,
    seq_local: int,
    dest_seq_offset: int,
    eps: float,
    rope_style: str | int,
    signals: ProducerSignals | None = None,
    bad_positions: torch.Tensor | None = None,
    block_m: int | None = None,
    workspace: torch.Tensor | None = None,
    validate: bool = True,
) -> torch.Tensor:
    """:func:`producer.qkv_norm_rope_produce` on the cuBLAS engine; returns the projection.

    Arguments as there, and:

    workspace : Tensor or None
        fp32 ``[rows, (Hq + 2 * Hkv) * D]``, contiguous, for ``x @ qkv_weight.T`` (the bias
        is not in it); None allocates one from PyTorch's caching allocator.  The
        caller owns it; autograd keeps it to skip recomputing the projection.

    Returns the workspace.  Runs on the current stream; the host does not block.
    """
    if isinstance(positions, torch.Tensor) and positions.is_contiguous():
        positions = positions.view(-1)
    if block_m is None:
        block_m = _config.PRODUCER_BLOCK_M
    rows, _ = x.shape
    n = plan.total_heads * plan.head_dim
    if validate:
        check_producer_inputs(x, qkv_weight, qkv_bias, q_norm_weight, k_norm_weight, cos_sin,
                              positions, plan, dest, dest_table, seq_local, dest_seq_offset,
                              eps, signals, bad_positions, block_m)
        if workspace is not None and (workspace.dtype != torch.float32
                                      or tuple(workspace.shape) != (rows, n)
                                      or not workspace.is_contiguous()
                                      or workspace.device != x.device):
            raise ValueError(f"qkv_norm_rope_produce_cublas: workspace must be contiguous "
                             f"fp32 [{rows}, {n}] on {x.device}, got {workspace.dtype} "
                             f"{tuple(workspace.shape)} on {workspace.device}")
    if workspace is None:
        workspace = torch.empty(rows, n, dtype=torch.float32, device=x.device)
    epoch, enter, word_table, status, source_rank, max_row_blocks, timeout_ns = \
        signal_args(signals)
    constants = epilogue_constants(plan, qkv_bias, q_norm_weight, k_norm_weight, positions,
                                   rope_style, signals, block_m)
    project_fp32(x, qkv_weight, workspace)
    tile_m = _config.producer_epilogue_tile_m(plan.head_dim, block_m)
    row_blocks = triton.cdiv(rows, tile_m)
    _deliver_projection_kernel[(row_blocks * plan.total_heads,)](
        workspace, qkv_bias, q_norm_weight, k_norm_weight, cos_sin, positions, bad_positions,
        dest_table, epoch, enter, word_table, status, rows, row_blocks, cos_sin.stride(0),
        cos_sin.shape[0], eps, seq_local, dest.seq_len, dest_seq_offset, *dest.region_offset,
        *dest.token_stride, *dest.head_stride, source_rank, max_row_blocks, timeout_ns,
        BLOCK_M=tile_m, INTERPRET=_config.INTERPRET,
        **{**constants, "num_warps": _config.PRODUCER_EPILOGUE_NUM_WARPS})
    return workspace
