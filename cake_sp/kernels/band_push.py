"""Push one part of a band transfer (``layouts.BandTransfer``) into every destination's slot.

For source rank ``r`` and part ``i`` (``h`` heads a destination) of a transfer::

    for every destination d, row m = b * S_local + s, head j < h:
        slot_d[b, s + r * dst_s_step, j + r * dst_h_step + offset, :] =
            src[b, s + d * src_s_step, j + d * src_h_step, :]
    and, per (d, row block, j), a readiness word at d for (r, row block, offset + j)

This is the data movement of both exchange directions of the layer (DESIGN.md
section 6); the numbers come from ``BandTransfer.steps``.  A tile is
``BLOCK_M`` rows of one head.  Tiles are ordered row block first, so every
destination receives its first rows first and a consumer that waits for row
blocks in order (``signals.wait_ready`` with ``first_row_block``) can start on
them while later ones are still in flight; within a row block the destinations
start at ``r + 1``, so the ranks do not all write to the same peer at once.

With signals the kernel runs the producer's half of the NVLink protocol
(:mod:`cake_sp.kernels.signals`): before its stores to ``d`` a program waits for
``d`` to have entered the call, and after them it publishes the tile's word.
Without, it is a plain strided copy (the destination table pointing at local
buffers).  Values travel as 16-bit integers: the copy is exact whatever the
dtype, and the CPU interpreter never computes on bf16.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cake_sp.kernels import _config
from cake_sp.kernels.signals import (
    _ENTER_TIMEOUT,
    ProducerSignals,
    publish,
    record_timeout,
    spin_until_at_least,
)
from cake_sp.layouts import BandTransfer


@triton.jit
def _band_push_kernel(src_ptr, dest_table_ptr, epoch_ptr, enter_ptr, word_table_ptr, status_ptr,
                      rows, seq_local, src_sb, src_ss, src_sh, src_s_step, src_h_step,
                      dst_sb, dst_ss, dst_sh, dst_s_step, dst_h_step, offset, source_rank,
                      max_row_blocks, timeout_ns, HEADS: tl.constexpr, WORD_HEADS: tl.constexpr,
                      WORLD: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr,
                      SIGNAL: tl.constexpr, INTERPRET: tl.constexpr):
    tile = tl.program_id(0)
    row_block = tile // (WORLD * HEADS)
    within = tile % (WORLD * HEADS)
    dest = (source_rank + 1 + within // HEADS) % WORLD
    head = within % HEADS

    offs_m = row_block.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = offs_m < rows
    b = offs_m // seq_local
    s = offs_m - b * seq_local
    cols = tl.arange(0, D)
    src_rows = b * src_sb + (s + dest * src_s_step) * src_ss + (head + dest * src_h_step) * src_sh
    src = tl.max_contiguous(tl.multiple_of(src_ptr + src_rows[:, None] + cols[None, :], [1, 16]),
                            [1, D])
    values = tl.load(src, mask=row_ok[:, None])

    go = True
    if SIGNAL:
        epoch = tl.load(epoch_ptr)
        go = spin_until_at_least(enter_ptr + dest, epoch, timeout_ns, INTERPRET)
        if ~go:
            record_timeout(status_ptr, dest, _ENTER_TIMEOUT)
    if go:
        base = tl.load(dest_table_ptr + dest).to(tl.pointer_type(tl.int16))
        dst_rows = (b * dst_sb + (s + source_rank * dst_s_step) * dst_ss
                    + (head + source_rank * dst_h_step + offset) * dst_sh)
        # A pointer made from an integer has no known alignment; the launcher checks that
        # every stride is a multiple of 8 elements and the buffers are 16-byte aligned.
        dst = tl.max_contiguous(tl.multiple_of(base + dst_rows[:, None] + cols[None, :], [1, 16]),
                                [1, D])
        tl.store(dst, values, mask=row_ok[:, None])
        if SIGNAL:
            words = tl.load(word_table_ptr + dest).to(tl.pointer_type(tl.int64))
            publish(words + (source_rank * max_row_blocks + row_block) * WORD_HEADS + offset + head,
                    epoch)


def readable_in_place(src: torch.Tensor) -> bool:
    """Whether ``band_push`` can read ``src`` as it is: a unit last stride, the other strides
    multiples of 8 elements, 16-byte aligned data (else pass a contiguous copy)."""
    return (src.stride(-1) == 1 and all(st % 8 == 0 for st in src.stride()[:-1])
            and src.data_ptr() % 16 == 0)


def _check_push(transfer: BandTransfer, part: int, src: torch.Tensor, dest_table: torch.Tensor,
                batch: int, seq_local: int, signals: ProducerSignals | None) -> None:
    if not isinstance(transfer, BandTransfer):
        raise TypeError("band_push: transfer must be a BandTransfer, got "
                        f"{type(transfer).__name__}")
    if not 0 <= part < len(transfer.part_heads):
        raise ValueError(f"band_push: part must be in [0, {len(transfer.part_heads)}), got {part}")
    shape = transfer.source_shape(part, batch, seq_local)
    if not isinstance(src, torch.Tensor) or tuple(src.shape) != shape:
        raise ValueError(f"band_push: src must have shape {shape}, got "
                         f"{getattr(src, 'shape', type(src).__name__)}")
    if src.element_size() != 2:
        raise ValueError(f"band_push: src must hold 16-bit values, got {src.dtype}")
    if not readable_in_place(src):
        raise ValueError(f"band_push: src must have a unit last stride, other strides multiples "
                         f"of 8 elements and 16-byte aligned data, got strides {src.stride()}")
    if (dest_table.dtype != torch.int64 or tuple(dest_table.shape) != (transfer.world_size,)
            or dest_table.device != src.device):
        raise ValueError(f"band_push: dest_table must be int64 [{transfer.world_size}] on "
                         f"{src.device}, got {dest_table.dtype} {tuple(dest_table.shape)} on "
                         f"{dest_table.device}")
    if signals is not None and signals.readiness.heads_per_rank != transfer.heads:
        raise ValueError(f"band_push: signals.readiness has {signals.readiness.heads_per_rank} "
                         f"words a row block, the transfer {transfer.heads}")


def band_push(transfer: BandTransfer, part: int, src: torch.Tensor, dest_table: torch.Tensor,
              *, batch: int, seq_local: int, source_rank: int,
              signals: ProducerSignals | None = None, block_m: int | None = None) -> None:
    """Store part ``part`` of this rank's side of ``transfer`` into every destination.

    Parameters
    ----------
    transfer : BandTransfer
        The direction and the heads of each part.
    src : Tensor
        16-bit (bf16) ``transfer.source_shape(part, batch, seq_local)``, any strides that
        are multiples of 8 elements with a unit last stride (a transposed attention
        output is fine); owned by the caller, only read.
    dest_table : Tensor
        int64 ``[W]``: byte address of every destination's output buffer
        (``transfer.output_shape``, contiguous), peer pointers on the NVLink path.
    batch, seq_local : int
        The call's batch and tokens per rank per batch entry.
    source_rank : int
        This rank's index in ``[0, W)``.
    signals : ProducerSignals, optional
        The NVLink protocol (entry words, readiness words of ``transfer.readiness``
        with ``block_m``-row blocks, status flags, timeout).
    block_m : int, optional
        Rows per tile, ``_config.BAND_PUSH_BLOCK_M`` by default.

    Runs one program per tile on the current stream; the host does not block.
    """
    _check_push(transfer, part, src, dest_table, batch, seq_local, signals)
    block_m = block_m or _config.BAND_PUSH_BLOCK_M
    rows = batch * seq_local
    heads = transfer.part_heads[part]
    world = transfer.world_size
    _, tokens, out_heads, d = transfer.output_view_shape(batch, seq_local)
    src_s_step, src_h_step, dst_s_step, dst_h_step, offset = transfer.steps(part, seq_local)
    if signals is None:
        sig = (None, None, None, None, 0, 0)
    else:
        sig = (signals.epoch, signals.enter, signals.word_table, signals.status,
               signals.readiness.max_row_blocks, signals.timeout_ns)
    epoch, enter, word_table, status, max_row_blocks, timeout_ns = sig
    grid = (triton.cdiv(rows, block_m) * world * heads,)
    _band_push_kernel[grid](
        src.view(torch.int16), dest_table, epoch, enter, word_table, status, rows, seq_local,
        *src.stride()[:3], src_s_step, src_h_step, tokens * out_heads * d, out_heads * d, d,
        dst_s_step, dst_h_step, offset, source_rank, max_row_blocks, timeout_ns,
        HEADS=heads, WORD_HEADS=transfer.heads, WORLD=world, D=d, BLOCK_M=block_m,
        SIGNAL=signals is not None, INTERPRET=_config.INTERPRET,
        num_warps=_config.BAND_PUSH_NUM_WARPS)
