"""The producer kernel with a warp-specialised mainloop, in Gluon (sm_90a only).

Same contract, tile order and epilogue as ``producer.py`` (the module docstring
there); only the GEMM mainloop and where the epilogue runs differ.  Triton 3.6
gives ``tl.dot`` code no warp specialisation on sm_90a, so this kernel spells
it out in three partitions over ``[TILE_M, D]`` tiles:

* *loader* (one warp): walks this program's tiles and streams the ``x`` and
  ``qkv_weight`` blocks by TMA into a ring of ``STAGES`` shared-memory slots
  (``ready`` / ``empty`` mbarriers), running ahead across tile boundaries;
* *MMA* (two partitions of one warpgroup each, taking the upper and lower half
  of every tile's rows): async ``wgmma`` over the ring with one group in flight,
  then writes its half of the accumulator to a shared-memory tile (``acc_full`` /
  ``acc_empty`` mbarriers) and starts the next tile's MMAs.  Each warpgroup
  releases ring slots and hands over its rows on its own (those barriers count two
  arrivals): as one partition of eight warps, a CTA barrier tied the warpgroups
  together at every K step, which cost up to 5 % on an H200 (docs/results.md);
* *epilogue* (the launch's warps, the default partition): reads the tile back
  in ``CHUNK_M``-row chunks in a blocked layout and runs
  :func:`producer_epilogue.deliver_tile` on each (norm weight, RoPE, 16-byte
  stores at every destination, the readiness words of ``READY_M`` rows)
  while the MMA warps compute the next tile.

The hand-off comes in two shapes (``_config.WsTile``).  In general the fp32
accumulator goes through shared memory, because the contract normalises the
unrounded projection: 128-row tiles.  When both norm weights are given
(``NORM_IN_MMA``), the MMA warps add the bias and take each Q/K row's RMS in the
wgmma layout themselves, and hand over the bf16 tile the contract rounds to at
that point anyway (V rows: their bf16 output): half the bytes, so 256-row tiles
fit, which read 25 % fewer operand bytes per FLOP.  The same bytes laid out as 128
rows of two adjacent heads of one kind (``HEADS = 2``, D = 128, even head counts:
each warpgroup computes one head over every row, from the same ``x`` block) let the
epilogue load each row's RoPE table entries once for both heads.  One buffer is
enough: an epilogue takes a small fraction of a tile's MMAs.  The launcher takes this kernel
for ``mainloop="warp_specialized"``, its default on sm_90 (``_config.producer_mainloop``);
it never runs in the CPU interpreter.
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

from cake_sp.kernels.norm_rope import rms_normalize
from cake_sp.kernels.producer_epilogue import deliver_tile, tile_coords, tile_cos_sin


@gluon.constexpr_function
def _mma_layout(d, warps):
    """wgmma accumulator layout of a ``[TILE_M, d]`` tile over ``warps`` (16 rows each)."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[warps, 1],
                                     instr_shape=[16, d, 16])


@gluon.constexpr_function
def _epilogue_layout(d, num_warps):
    """Blocked layout of the epilogue's ``[CHUNK_M, d]`` chunks: each thread holds two runs of 8
    columns, ``d/2`` apart, so the stores are 16 bytes wide and both RoPE pairings (adjacent
    columns, columns ``d/2`` apart) stay inside a thread; a row spans ``d/16`` lanes."""
    lanes = d // 16
    return gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[32 // lanes, lanes],
                            warps_per_cta=[num_warps, 1], order=[1, 0])


@gluon.constexpr_function
def _pair_band(per_rank):
    """Head pairs a destination band holds in ``tile_coords``' round-robin over pairs: half
    the band's heads, or 1 (pairs in projection order) where a band's heads are odd."""
    return per_rank // 2 if per_rank % 2 == 0 else 1


@gluon.jit
def _tile_heads(tile, row_blocks, NUM_Q_HEADS: gl.constexpr, NUM_KV_HEADS: gl.constexpr,
                Q_PER_RANK: gl.constexpr, KV_PER_RANK: gl.constexpr, GROUP_HEADS: gl.constexpr,
                HEADS: gl.constexpr):
    """``(row_block, head)`` of tile ``tile``: its first head of ``HEADS`` (1, or 2 adjacent
    heads of one kind, ``tile_coords`` over pairs)."""
    if HEADS == 1:
        row_block, head = tile_coords(tile, row_blocks, NUM_Q_HEADS, NUM_KV_HEADS, Q_PER_RANK,
                                      KV_PER_RANK, GROUP_HEADS)
    else:
        row_block, pair = tile_coords(tile, row_blocks, NUM_Q_HEADS // 2, NUM_KV_HEADS // 2,
                                      _pair_band(Q_PER_RANK), _pair_band(KV_PER_RANK),
                                      GROUP_HEADS)
        head = pair * 2
    return row_block, head


@gluon.jit
def _load_tiles(x_desc, w_desc, a_bufs, b_bufs, ready, empty, num_tiles, row_blocks,
                NUM_Q_HEADS: gl.constexpr, NUM_KV_HEADS: gl.constexpr, Q_PER_RANK: gl.constexpr,
                KV_PER_RANK: gl.constexpr, GROUP_HEADS: gl.constexpr, K_STEPS: gl.constexpr,
                D: gl.constexpr, TILE_M: gl.constexpr, BLOCK_K: gl.constexpr,
                STAGES: gl.constexpr, HEADS: gl.constexpr):
    """Loader partition: every (tile, K step) of this program, in order, into the ring (the
    ``x`` rows and the ``HEADS`` heads' weight rows)."""
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    count = 0
    for t in range(gl.cdiv(num_tiles - pid, nprog)):
        row_block, head = _tile_heads(pid + t * nprog, row_blocks, NUM_Q_HEADS, NUM_KV_HEADS,
                                      Q_PER_RANK, KV_PER_RANK, GROUP_HEADS, HEADS)
        for kk in range(K_STEPS):
            slot = count % STAGES
            # A fresh barrier has completed phase "-1": the first pass does not wait.
            mbarrier.wait(empty.index(slot), ((count // STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(slot),
                            x_desc.block_type.nbytes + w_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(x_desc, [row_block * TILE_M, kk * BLOCK_K],
                                            ready.index(slot), a_bufs.index(slot))
            tma.async_copy_global_to_shared(w_desc, [head * D, kk * BLOCK_K],
                                            ready.index(slot), b_bufs.index(slot))
            count += 1


@gluon.jit
def _mma_tiles(a_bufs, b_bufs, ready, empty, acc_smem, acc_full, acc_empty, num_tiles, row_blocks,
               bias_ptr, eps, NUM_Q_HEADS: gl.constexpr, NUM_KV_HEADS: gl.constexpr,
               Q_PER_RANK: gl.constexpr, KV_PER_RANK: gl.constexpr, GROUP_HEADS: gl.constexpr,
               K_STEPS: gl.constexpr, D: gl.constexpr, TILE_M: gl.constexpr,
               STAGES: gl.constexpr, HAS_BIAS: gl.constexpr, NORM_IN_MMA: gl.constexpr,
               CONSUMER: gl.constexpr, HEADS: gl.constexpr):
    """MMA partition ``CONSUMER`` (0 or 1), one warpgroup: wgmma of its share of every tile
    over the ring (one head: half the tile's rows; two heads: every row of head
    ``CONSUMER``); each finished accumulator into its rows of ``acc_smem`` (fp32, or with
    ``NORM_IN_MMA`` the bias added, Q/K rows normalised, rounded to bf16).

    Each warpgroup releases a ring slot and hands over its rows on its own (those barriers
    count two arrivals), so the two never wait for each other."""
    ROWS: gl.constexpr = TILE_M * HEADS // 2
    layout: gl.constexpr = _mma_layout(D, gl.num_warps())
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, layout))
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    acc = gl.zeros((ROWS, D), gl.float32, layout)
    my_acc = acc_smem.slice(CONSUMER * ROWS, ROWS)
    count = 0
    for t in range(gl.cdiv(num_tiles - pid, nprog)):
        for kk in range(K_STEPS):
            slot = count % STAGES
            mbarrier.wait(ready.index(slot), (count // STAGES) & 1)
            if HEADS == 1:
                a = a_bufs.index(slot).slice(CONSUMER * ROWS, ROWS)
                b = b_bufs.index(slot)
            else:
                a = a_bufs.index(slot)
                b = b_bufs.index(slot).slice(CONSUMER * D, D)
            acc = warpgroup_mma(a, b.permute((1, 0)), acc, use_acc=kk > 0, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
            # The previous step's wgmma has retired in every warp of the group (the
            # arrive is one thread's): its slot can be refilled.
            gl.thread_barrier()
            mbarrier.arrive(empty.index((count + STAGES - 1) % STAGES), pred=kk > 0)
            count += 1
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        gl.thread_barrier()
        mbarrier.arrive(empty.index((count + STAGES - 1) % STAGES))
        if NORM_IN_MMA:
            # In place on the accumulator: a second tile of registers would spill.
            _, head = _tile_heads(pid + t * nprog, row_blocks, NUM_Q_HEADS, NUM_KV_HEADS,
                                  Q_PER_RANK, KV_PER_RANK, GROUP_HEADS, HEADS)
            if HEADS == 2:
                head += CONSUMER
            if HAS_BIAS:
                acc = acc + gl.load(bias_ptr + head * D + cols).to(gl.float32)[None, :]
            if head < NUM_Q_HEADS + NUM_KV_HEADS:
                acc = rms_normalize(acc, eps, D)
        # The epilogue has read the previous tile out of the buffer.
        mbarrier.wait(acc_empty, (t & 1) ^ 1)
        my_acc.store(acc.to(acc_smem.dtype))
        gl.thread_barrier()
        mbarrier.arrive(acc_full)


@gluon.jit
def _epilogue_tiles(acc_smem, acc_full, acc_empty, num_tiles, row_blocks,
                    bias_ptr, q_norm_ptr, k_norm_ptr, cos_sin_ptr, pos_ptr, bad_pos_ptr,
                    dest_table_ptr, epoch_ptr, enter_ptr, word_table_ptr, status_ptr,
                    rows, cos_sin_stride, cos_sin_rows, eps, seq_local, dest_seq_len,
                    dest_seq_offset, region_q, region_k, region_v, token_stride_q,
                    token_stride_k, token_stride_v, head_stride_q, head_stride_k, head_stride_v,
                    source_rank, max_row_blocks, timeout_ns,
                    NUM_Q_HEADS: gl.constexpr, NUM_KV_HEADS: gl.constexpr,
                    Q_PER_RANK: gl.constexpr, KV_PER_RANK: gl.constexpr,
                    KV_REPLICAS: gl.constexpr, GROUP_HEADS: gl.constexpr, D: gl.constexpr,
                    TILE_M: gl.constexpr, CHUNK_M: gl.constexpr, READY_M: gl.constexpr,
                    HAS_BIAS: gl.constexpr, HAS_Q_NORM: gl.constexpr, HAS_K_NORM: gl.constexpr,
                    HAS_POSITIONS: gl.constexpr, ROPE_STYLE: gl.constexpr,
                    SIGNAL: gl.constexpr, NORM_IN_MMA: gl.constexpr, HEADS: gl.constexpr):
    """Epilogue partition: each tile out of ``acc_smem`` in ``CHUNK_M``-row chunks through the
    shared epilogue, which raises the readiness words of ``READY_M`` rows.  With two heads
    a tile, a chunk's RoPE table rows are loaded once for both (a V pair's loads are
    predicated off)."""
    layout: gl.constexpr = _epilogue_layout(D, gl.num_warps())
    chunk_rows = gl.arange(0, CHUNK_M, layout=gl.SliceLayout(1, layout)).to(gl.int64)
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, layout))
    half_cols = gl.arange(0, D // 2, layout=gl.SliceLayout(0, layout))
    CHUNKS: gl.constexpr = TILE_M // CHUNK_M
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    none = pid.to(gl.int64) * 0
    if SIGNAL:
        epoch = gl.load(epoch_ptr)
    else:
        epoch = none
    entered = none
    failed = none
    inputs = (bias_ptr, q_norm_ptr, k_norm_ptr, cos_sin_ptr, cos_sin_stride, cos_sin_rows,
              pos_ptr, bad_pos_ptr, eps)
    dest = (dest_table_ptr, seq_local, dest_seq_len, dest_seq_offset, region_q, region_k,
            region_v, token_stride_q, token_stride_k, token_stride_v, head_stride_q,
            head_stride_k, head_stride_v)
    signals = (epoch, enter_ptr, word_table_ptr, status_ptr, source_rank, max_row_blocks,
               timeout_ns)
    for t in range(gl.cdiv(num_tiles - pid, nprog)):
        row_block, head = _tile_heads(pid + t * nprog, row_blocks, NUM_Q_HEADS, NUM_KV_HEADS,
                                      Q_PER_RANK, KV_PER_RANK, GROUP_HEADS, HEADS)
        mbarrier.wait(acc_full, t & 1)
        for c in gl.static_range(CHUNKS):
            chunk = row_block * CHUNKS + c
            # Chunks past the call's rows have no readiness word to raise.
            if chunk * CHUNK_M < rows:
                offs_m = chunk * CHUNK_M + chunk_rows
                if HEADS == 1:
                    cos_sin = None
                else:
                    rotated = (offs_m < rows) & (head < NUM_Q_HEADS + NUM_KV_HEADS)
                    cos_sin = tile_cos_sin(offs_m, rotated, half_cols, inputs, D,
                                           HAS_POSITIONS, HEADS)
                for h in gl.static_range(HEADS):
                    acc = acc_smem.slice(h * TILE_M + c * CHUNK_M, CHUNK_M).load(layout)
                    entered, failed = deliver_tile(
                        acc.to(gl.float32), chunk, head + h, offs_m, cols, half_cols, entered,
                        failed, rows, inputs, dest, signals, NUM_Q_HEADS, NUM_KV_HEADS,
                        Q_PER_RANK, KV_PER_RANK, KV_REPLICAS, D, CHUNK_M, HAS_BIAS, HAS_Q_NORM,
                        HAS_K_NORM, HAS_POSITIONS, ROPE_STYLE, SIGNAL, READY_M, True, False,
                        NORM_IN_MMA, cos_sin)
        gl.thread_barrier()
        mbarrier.arrive(acc_empty)


@gluon.jit
def qkv_produce_ws_kernel(x_desc, w_desc, bias_ptr, q_norm_ptr, k_norm_ptr, cos_sin_ptr, pos_ptr,
                          bad_pos_ptr, dest_table_ptr, epoch_ptr, enter_ptr, word_table_ptr,
                          status_ptr, rows, cos_sin_stride, cos_sin_rows, eps, seq_local,
                          dest_seq_len, dest_seq_offset,
                          region_q, region_k, region_v,
                          token_stride_q, token_stride_k, token_stride_v,
                          head_stride_q, head_stride_k, head_stride_v,
                          source_rank, max_row_blocks, timeout_ns,
                          HIDDEN: gl.constexpr, NUM_Q_HEADS: gl.constexpr,
                          NUM_KV_HEADS: gl.constexpr, Q_PER_RANK: gl.constexpr,
                          KV_PER_RANK: gl.constexpr, KV_REPLICAS: gl.constexpr,
                          D: gl.constexpr, BLOCK_K: gl.constexpr,
                          GROUP_HEADS: gl.constexpr, HAS_BIAS: gl.constexpr,
                          HAS_Q_NORM: gl.constexpr, HAS_K_NORM: gl.constexpr,
                          HAS_POSITIONS: gl.constexpr, ROPE_STYLE: gl.constexpr,
                          SIGNAL: gl.constexpr, TILE_M: gl.constexpr, CHUNK_M: gl.constexpr,
                          READY_M: gl.constexpr, NORM_IN_MMA: gl.constexpr,
                          STAGES: gl.constexpr, MMA_REGS: gl.constexpr,
                          LOADER_REGS: gl.constexpr, HEADS: gl.constexpr = 1):
    """``producer._qkv_produce_kernel`` with ``x_desc``/``w_desc`` Gluon tensor descriptors of
    ``[TILE_M, BLOCK_K]`` / ``[HEADS * D, BLOCK_K]`` blocks (NVMMA shared layouts).  ``CHUNK_M``:
    rows the epilogue takes at once; ``READY_M``: rows of a readiness word (the launcher's
    ``block_m``, at most ``CHUNK_M``); ``NORM_IN_MMA`` (both norm weights given): the MMA
    warps add the bias and normalise, and hand over a bf16 tile; ``HEADS``: heads a tile
    (2: adjacent heads of one kind, one a warpgroup, ``NORM_IN_MMA`` only)."""
    a_bufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, TILE_M, BLOCK_K], x_desc.layout)
    b_bufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, HEADS * D, BLOCK_K],
                                       w_desc.layout)
    # Rows of 16-byte chunks XOR-swizzled by row: the wgmma layout writes 8 rows at once.
    if NORM_IN_MMA:
        acc_smem = gl.allocate_shared_memory(gl.bfloat16, [HEADS * TILE_M, D],
                                             gl.SwizzledSharedLayout(8, 1, 8, order=[1, 0]))
    else:
        gl.static_assert(HEADS == 1, "two heads a tile hand over bf16 (NORM_IN_MMA)")
        acc_smem = gl.allocate_shared_memory(gl.float32, [TILE_M, D],
                                             gl.SwizzledSharedLayout(4, 1, 8, order=[1, 0]))
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    acc_full = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    acc_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)
    mbarrier.init(acc_full, count=2)
    mbarrier.init(acc_empty, count=1)
    row_blocks = gl.cdiv(rows, TILE_M)
    num_tiles = row_blocks * ((NUM_Q_HEADS + 2 * NUM_KV_HEADS) // HEADS)
    K_STEPS: gl.constexpr = HIDDEN // BLOCK_K
    # Two MMA partitions: one per warpgroup, each its half of a tile's rows.
    gl.warp_specialize([
        (_epilogue_tiles, (acc_smem, acc_full, acc_empty, num_tiles, row_blocks,
                           bias_ptr, q_norm_ptr, k_norm_ptr, cos_sin_ptr, pos_ptr, bad_pos_ptr,
                           dest_table_ptr, epoch_ptr, enter_ptr, word_table_ptr, status_ptr,
                           rows, cos_sin_stride, cos_sin_rows, eps, seq_local, dest_seq_len,
                           dest_seq_offset, region_q, region_k, region_v,
                           token_stride_q, token_stride_k, token_stride_v,
                           head_stride_q, head_stride_k, head_stride_v,
                           source_rank, max_row_blocks, timeout_ns,
                           NUM_Q_HEADS, NUM_KV_HEADS, Q_PER_RANK, KV_PER_RANK, KV_REPLICAS,
                           GROUP_HEADS, D, TILE_M, CHUNK_M, READY_M, HAS_BIAS, HAS_Q_NORM,
                           HAS_K_NORM, HAS_POSITIONS, ROPE_STYLE, SIGNAL, NORM_IN_MMA,
                           HEADS)),
        (_mma_tiles, (a_bufs, b_bufs, ready, empty, acc_smem, acc_full, acc_empty, num_tiles,
                      row_blocks, bias_ptr, eps, NUM_Q_HEADS, NUM_KV_HEADS, Q_PER_RANK,
                      KV_PER_RANK, GROUP_HEADS, K_STEPS, D, TILE_M, STAGES, HAS_BIAS,
                      NORM_IN_MMA, 0, HEADS)),
        (_mma_tiles, (a_bufs, b_bufs, ready, empty, acc_smem, acc_full, acc_empty, num_tiles,
                      row_blocks, bias_ptr, eps, NUM_Q_HEADS, NUM_KV_HEADS, Q_PER_RANK,
                      KV_PER_RANK, GROUP_HEADS, K_STEPS, D, TILE_M, STAGES, HAS_BIAS,
                      NORM_IN_MMA, 1, HEADS)),
        (_load_tiles, (x_desc, w_desc, a_bufs, b_bufs, ready, empty, num_tiles, row_blocks,
                       NUM_Q_HEADS, NUM_KV_HEADS, Q_PER_RANK, KV_PER_RANK, GROUP_HEADS, K_STEPS,
                       D, TILE_M, BLOCK_K, STAGES, HEADS)),
    ], [4, 4, 1], [MMA_REGS, MMA_REGS, LOADER_REGS])
