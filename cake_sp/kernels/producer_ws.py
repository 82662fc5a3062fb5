"""The producer kernel with a warp-specialised mainloop, in Gluon (sm_90a only).

Same contract, tile order and epilogue as ``producer.py`` (the module docstring
there); only the GEMM mainloop differs.  Triton 3.6 gives ``tl.dot`` code no
warp specialisation on sm_90a, so this kernel spells it out:

* a one-warp *loader* partition walks this program's tiles and streams the
  ``x`` and ``qkv_weight`` blocks by TMA into a ring of ``STAGES`` shared-memory
  slots (``ready`` / ``empty`` mbarriers); it runs ahead across tile
  boundaries, so the next tile's blocks arrive while this tile's epilogue runs;
* the default partition (the launch's warps, two warpgroups at 8) issues async
  ``wgmma`` on each slot with one group in flight, hands slots back, and runs
  :func:`producer_epilogue.deliver_tile` on the accumulator in its wgmma layout
  (norm reductions and the RoPE pair split stay in registers).

A plain persistent GEMM of this shape ran at 0.91-1.10 x cuBLAS on an H200 at
S_local >= 2048, against 1.06-1.19 x for the ``tl.dot`` mainloop
(docs/results/producer_and_fmha_sweeps_h200.md, sweep 5).  The launcher picks it
(``mainloop="warp_specialized"``); it never runs in the CPU interpreter.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from cake_sp.kernels.producer_epilogue import deliver_tile, tile_coords


@gluon.constexpr_function
def _accumulator_layout(block_m, d, num_warps):
    """wgmma accumulator layout of a ``[block_m, d]`` tile: warps stacked along the rows
    (16 rows each), then across the columns once the rows run out."""
    warps = [4, 1]
    while warps[0] * warps[1] != num_warps:
        if block_m > 16 * warps[0]:
            warps[0] *= 2
        else:
            warps[1] *= 2
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=warps,
                                     instr_shape=[16, min(256, d // warps[1]), 16])


@gluon.jit
def _load_tiles(x_desc, w_desc, a_bufs, b_bufs, ready, empty, num_tiles, row_blocks,
                NUM_Q_HEADS: gl.constexpr, NUM_KV_HEADS: gl.constexpr, Q_PER_RANK: gl.constexpr,
                KV_PER_RANK: gl.constexpr, GROUP_HEADS: gl.constexpr, K_STEPS: gl.constexpr,
                D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_K: gl.constexpr,
                STAGES: gl.constexpr):
    """Loader partition: every (tile, K step) of this program, in order, into the ring."""
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    count = 0
    for t in range(gl.cdiv(num_tiles - pid, nprog)):
        row_block, head = tile_coords(pid + t * nprog, row_blocks, NUM_Q_HEADS, NUM_KV_HEADS,
                                      Q_PER_RANK, KV_PER_RANK, GROUP_HEADS)
        for kk in range(K_STEPS):
            slot = count % STAGES
            # A fresh barrier has completed phase "-1": the first pass does not wait.
            mbarrier.wait(empty.index(slot), ((count // STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(slot),
                            x_desc.block_type.nbytes + w_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(x_desc, [row_block * BLOCK_M, kk * BLOCK_K],
                                            ready.index(slot), a_bufs.index(slot))
            tma.async_copy_global_to_shared(w_desc, [head * D, kk * BLOCK_K],
                                            ready.index(slot), b_bufs.index(slot))
            count += 1


@gluon.jit
def _compute_tiles(a_bufs, b_bufs, ready, empty, num_tiles, row_blocks,
                   bias_ptr, q_norm_ptr, k_norm_ptr, cos_sin_ptr, pos_ptr,
                   dest_table_ptr, epoch_ptr, enter_ptr, word_table_ptr, status_ptr,
                   rows, cos_sin_stride, eps, seq_local, dest_seq_len, dest_seq_offset,
                   region_q, region_k, region_v, token_stride_q, token_stride_k, token_stride_v,
                   head_stride_q, head_stride_k, head_stride_v,
                   source_rank, max_row_blocks, timeout_ns,
                   NUM_Q_HEADS: gl.constexpr, NUM_KV_HEADS: gl.constexpr,
                   Q_PER_RANK: gl.constexpr, KV_PER_RANK: gl.constexpr,
                   KV_REPLICAS: gl.constexpr, GROUP_HEADS: gl.constexpr, K_STEPS: gl.constexpr,
                   D: gl.constexpr, BLOCK_M: gl.constexpr, HAS_BIAS: gl.constexpr,
                   HAS_Q_NORM: gl.constexpr, HAS_K_NORM: gl.constexpr,
                   HAS_POSITIONS: gl.constexpr, ROPE_STYLE: gl.constexpr, SIGNAL: gl.constexpr,
                   STAGES: gl.constexpr):
    """Default partition: wgmma over the ring, then the shared epilogue, tile by tile."""
    layout: gl.constexpr = _accumulator_layout(BLOCK_M, D, gl.num_warps())
    tile_rows = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, layout)).to(gl.int64)
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, layout))
    half_cols = gl.arange(0, D // 2, layout=gl.SliceLayout(0, layout))
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    none = pid.to(gl.int64) * 0
    if SIGNAL:
        epoch = gl.load(epoch_ptr)
    else:
        epoch = none
    entered = none
    failed = none
    acc = gl.zeros((BLOCK_M, D), gl.float32, layout)
    count = 0
    for t in range(gl.cdiv(num_tiles - pid, nprog)):
        row_block, head = tile_coords(pid + t * nprog, row_blocks, NUM_Q_HEADS, NUM_KV_HEADS,
                                      Q_PER_RANK, KV_PER_RANK, GROUP_HEADS)
        for kk in range(K_STEPS):
            slot = count % STAGES
            mbarrier.wait(ready.index(slot), (count // STAGES) & 1)
            acc = warpgroup_mma(a_bufs.index(slot), b_bufs.index(slot).permute((1, 0)), acc,
                                use_acc=kk > 0, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
            # The previous step's wgmma has retired in this warpgroup; the arrive is
            # one thread's, so both warpgroups must be past it before the slot is freed.
            gl.thread_barrier()
            mbarrier.arrive(empty.index((count + STAGES - 1) % STAGES), pred=kk > 0)
            count += 1
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        gl.thread_barrier()
        mbarrier.arrive(empty.index((count + STAGES - 1) % STAGES))
        entered, failed = deliver_tile(
            acc, row_block, head, row_block * BLOCK_M + tile_rows, cols, half_cols, entered,
            failed, epoch, bias_ptr, q_norm_ptr, k_norm_ptr, cos_sin_ptr, pos_ptr,
            dest_table_ptr, enter_ptr, word_table_ptr, status_ptr, rows, cos_sin_stride, eps,
            seq_local, dest_seq_len, dest_seq_offset, region_q, region_k, region_v,
            token_stride_q, token_stride_k, token_stride_v, head_stride_q, head_stride_k,
            head_stride_v, source_rank, max_row_blocks, timeout_ns, NUM_Q_HEADS, NUM_KV_HEADS,
            Q_PER_RANK, KV_PER_RANK, KV_REPLICAS, D, BLOCK_M, HAS_BIAS, HAS_Q_NORM, HAS_K_NORM,
            HAS_POSITIONS, ROPE_STYLE, SIGNAL, True, False)


@gluon.jit
def qkv_produce_ws_kernel(x_desc, w_desc, bias_ptr, q_norm_ptr, k_norm_ptr, cos_sin_ptr, pos_ptr,
                          dest_table_ptr, epoch_ptr, enter_ptr, word_table_ptr, status_ptr,
                          rows, cos_sin_stride, eps, seq_local, dest_seq_len, dest_seq_offset,
                          region_q, region_k, region_v,
                          token_stride_q, token_stride_k, token_stride_v,
                          head_stride_q, head_stride_k, head_stride_v,
                          source_rank, max_row_blocks, timeout_ns,
                          HIDDEN: gl.constexpr, NUM_Q_HEADS: gl.constexpr,
                          NUM_KV_HEADS: gl.constexpr, Q_PER_RANK: gl.constexpr,
                          KV_PER_RANK: gl.constexpr, KV_REPLICAS: gl.constexpr,
                          D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_K: gl.constexpr,
                          GROUP_HEADS: gl.constexpr, HAS_BIAS: gl.constexpr,
                          HAS_Q_NORM: gl.constexpr, HAS_K_NORM: gl.constexpr,
                          HAS_POSITIONS: gl.constexpr, ROPE_STYLE: gl.constexpr,
                          SIGNAL: gl.constexpr, STAGES: gl.constexpr, LOADER_REGS: gl.constexpr):
    """``producer._qkv_produce_kernel`` with ``x_desc``/``w_desc`` Gluon tensor descriptors of
    ``[BLOCK_M, BLOCK_K]`` / ``[D, BLOCK_K]`` blocks (NVMMA shared layouts)."""
    a_bufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_M, BLOCK_K], x_desc.layout)
    b_bufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, D, BLOCK_K], w_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    row_blocks = gl.cdiv(rows, BLOCK_M)
    num_tiles = row_blocks * (NUM_Q_HEADS + 2 * NUM_KV_HEADS)
    K_STEPS: gl.constexpr = HIDDEN // BLOCK_K
    gl.warp_specialize([
        (_compute_tiles, (a_bufs, b_bufs, ready, empty, num_tiles, row_blocks,
                          bias_ptr, q_norm_ptr, k_norm_ptr, cos_sin_ptr, pos_ptr,
                          dest_table_ptr, epoch_ptr, enter_ptr, word_table_ptr, status_ptr,
                          rows, cos_sin_stride, eps, seq_local, dest_seq_len, dest_seq_offset,
                          region_q, region_k, region_v,
                          token_stride_q, token_stride_k, token_stride_v,
                          head_stride_q, head_stride_k, head_stride_v,
                          source_rank, max_row_blocks, timeout_ns,
                          NUM_Q_HEADS, NUM_KV_HEADS, Q_PER_RANK, KV_PER_RANK, KV_REPLICAS,
                          GROUP_HEADS, K_STEPS, D, BLOCK_M, HAS_BIAS, HAS_Q_NORM, HAS_K_NORM,
                          HAS_POSITIONS, ROPE_STYLE, SIGNAL, STAGES)),
        (_load_tiles, (x_desc, w_desc, a_bufs, b_bufs, ready, empty, num_tiles, row_blocks,
                       NUM_Q_HEADS, NUM_KV_HEADS, Q_PER_RANK, KV_PER_RANK, GROUP_HEADS, K_STEPS,
                       D, BLOCK_M, BLOCK_K, STAGES)),
    ], [1], [LOADER_REGS])
