"""The warp-specialised paged prefill kernel for sm_90a (Gluon): the fast path of
``context_triton_v1`` where it applies (:func:`serves`).

Triton 3.6 gives ``tl.dot`` code no warp specialisation on sm_90a, so ``context.py``'s
kernel issues its loads, its two GEMMs and its softmax from the same warps.  This kernel
spells out FlashAttention-3's structure in three partitions over one program's 128 query
rows of one request and head:

* *loader* (one warp): Q once by TMA, then for each 128-key tile its K and V rows by TMA
  into a ring of ``STAGES`` shared-memory slots (``*_ready`` / ``*_empty`` mbarriers), one
  copy per page the tile covers (``BOX = min(page_size, 128)`` rows each, through the
  request's K and V page tables);
* *consumers* (two partitions of one ``wgmma`` warpgroup each, taking the upper and lower
  64 query rows): ``S = Q K^T`` from shared memory, the online softmax in registers,
  ``O += P V`` with ``P`` as the register operand; tile ``i``'s ``Q K^T`` is issued together
  with tile ``i - 1``'s ``P V`` so the tensor cores work while the softmax of tile ``i``
  waits for its scores (FA3's intra-warpgroup overlap).  Each warpgroup releases ring slots
  on its own (those barriers count two arrivals), so the two drift apart and one's softmax
  runs under the other's GEMMs.  As one partition of eight warps, tied together by a
  barrier at every slot release, the kernel took 1.15-1.33x this one's time on an H200;
  FA3's explicit ping-pong (each warpgroup waits for the other's GEMMs before issuing its
  own) took 1.00-1.07x (docs/results.md, "Two consumer partitions").

Semantics are ``context.py``'s (its docstring), restricted to what :func:`serves` accepts.
Keys past a request's length in its last tile are masked out of ``S``, and their V rows are
zeroed in shared memory before ``P V``: whatever the cache holds there, even NaN, never
reaches the output.  Never runs in the CPU interpreter.
"""

from __future__ import annotations

import math

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from cake_sp.kernels.fmha import tuning
from cake_sp.kernels.fmha.problem import PagedAttention, cache_rows

BLOCK_M = 128
BLOCK_N = 128
# Each consumer warpgroup is a partition of its own, taking half of the block's query rows;
# the launch's warps are the first one's, the second (a worker) gets CONSUMER_REGS registers
# a thread, the loader warp 40.
WARPGROUP = 4
CONSUMER_REGS = 232
STAGES = 2
HEAD_DIMS = (64, 128)
# Pages of fewer keys than this would need more than 8 copies per tile.
MIN_BOX = 16
# Programs a grid's second dimension may hold.
MAX_GRID_Y = 65535


@gluon.constexpr_function
def _mma_layout(n, warps):
    """wgmma accumulator layout of a ``[BLOCK_M, n]`` tile over ``warps`` (16 rows each)."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[warps, 1],
                                     instr_shape=[16, n, 16])


@gluon.jit
def _tile_rows(table_ptr, j0, kv_len, head_row, page_rows, PAGE: gl.constexpr,
               BOX: gl.constexpr, BLOCK_N: gl.constexpr):
    """Descriptor rows of the ``BLOCK_N // BOX`` copies of keys ``[j0, j0 + BLOCK_N)`` of one
    KV head, one per page (int32 ``[copies]``).  A copy wholly past ``kv_len`` reads the box of
    the request's last key again (a later page's table entry may not exist); those keys are
    masked."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
    c = gl.arange(0, BLOCK_N // BOX, layout=layout)
    key = gl.minimum(j0 + c * BOX, (kv_len - 1) // BOX * BOX)
    page = gl.load(table_ptr + key // PAGE).to(gl.int32)
    return page * page_rows + head_row + key % PAGE


@gluon.jit
def _load_tile(desc, bufs, ready, empty, rows, i, BOX: gl.constexpr, BLOCK_N: gl.constexpr,
               STAGES: gl.constexpr):
    """One tile's copies (descriptor ``rows``, ``_tile_rows``) into ring slot ``i % STAGES``."""
    s = i % STAGES
    mbarrier.wait(empty.index(s), ((i // STAGES) & 1) ^ 1)  # a fresh barrier: phase "-1" done
    mbarrier.expect(ready.index(s), (BLOCK_N // BOX) * desc.block_type.nbytes)
    copies = gl.arange(0, BLOCK_N // BOX, layout=rows.type.layout)
    for c in gl.static_range(BLOCK_N // BOX):
        row = gl.sum(gl.where(copies == c, rows, 0), axis=0)
        tma.async_copy_global_to_shared(desc, [row, 0], ready.index(s),
                                        bufs.index(s).slice(c * BOX, BOX))


@gluon.jit
def load_kv_tiles(k_desc, v_desc, k_bufs, v_bufs, k_ready, k_empty, v_ready, v_empty, k_table,
                  v_table, start, n_tiles, kv_len, k_head_row, v_head_row, k_page_rows,
                  v_page_rows, PAGE: gl.constexpr, BOX: gl.constexpr, BLOCK_N: gl.constexpr,
                  STAGES: gl.constexpr):
    """The K and V of ``n_tiles`` tiles from key ``start`` of one KV head into the ring, tile
    ``i`` in slot ``i % STAGES`` (``_load_tile``).  The page table entries of tile ``i + 1``
    are loaded before tile ``i``'s slots are waited for, so their latency hides under the
    wait.  Also ``decode_ws``'s loader."""
    if n_tiles > 0:
        k_rows = _tile_rows(k_table, start, kv_len, k_head_row, k_page_rows, PAGE, BOX, BLOCK_N)
        v_rows = _tile_rows(v_table, start, kv_len, v_head_row, v_page_rows, PAGE, BOX, BLOCK_N)
        for i in range(n_tiles):
            j1 = start + (i + 1) * BLOCK_N
            k_next = _tile_rows(k_table, j1, kv_len, k_head_row, k_page_rows, PAGE, BOX,
                                BLOCK_N)
            v_next = _tile_rows(v_table, j1, kv_len, v_head_row, v_page_rows, PAGE, BOX,
                                BLOCK_N)
            _load_tile(k_desc, k_bufs, k_ready, k_empty, k_rows, i, BOX, BLOCK_N, STAGES)
            _load_tile(v_desc, v_bufs, v_ready, v_empty, v_rows, i, BOX, BLOCK_N, STAGES)
            k_rows = k_next
            v_rows = v_next


@gluon.jit
def _loader(q_desc, k_desc, v_desc, q_smem, k_bufs, v_bufs, q_bar, k_ready, k_empty, v_ready,
            v_empty, k_table, v_table, q_row, q_col, kv_len, k_head_row, v_head_row,
            k_page_rows, v_page_rows, n_tiles, PAGE: gl.constexpr, BOX: gl.constexpr,
            BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """Loader partition: Q once, then every tile's K and V (``load_kv_tiles``)."""
    mbarrier.expect(q_bar, q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [q_row, q_col], q_bar, q_smem)
    load_kv_tiles(k_desc, v_desc, k_bufs, v_bufs, k_ready, k_empty, v_ready, v_empty, k_table,
                  v_table, 0, n_tiles, kv_len, k_head_row, v_head_row, k_page_rows, v_page_rows,
                  PAGE, BOX, BLOCK_N, STAGES)


@gluon.jit
def softmax_step(qk, m_i, l_i, j0, keys, q_pos, kv_len, first_masked, scale_log2,
                  CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr):
    """Mask one S tile (unscaled logits) and return ``(p, alpha, m_new, l_new)`` of the online
    softmax, whose maxima ``m`` are in scaled (log2) units.  ``scale_log2 > 0`` (``serves``),
    so the scaled row maximum is the scaled maximum of the raw scores, and each probability
    takes one fused multiply-add instead of a multiply before the maximum and a subtraction
    after it.  Also ``decode_ws``'s step (``CAUSAL``, ``q_pos`` per row)."""
    if j0 + BLOCK_N > first_masked:
        key = j0 + keys
        ok = key[None, :] < kv_len
        if CAUSAL:
            ok = ok & (key[None, :] <= q_pos[:, None])
        qk = gl.where(ok, qk, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(qk, axis=1) * scale_log2)
    # Rows with no key yet (all -inf) keep m = -inf; shift by 0 there, not by -inf.
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2(m_i - m_safe)
    p = gl.exp2(gl.fma(qk, scale_log2, -m_safe[:, None]))
    return p, alpha, m_new, l_i * alpha + gl.sum(p, axis=1)


@gluon.jit
def zero_keys_past(v_buf, j0, kv_len, BLOCK_N: gl.constexpr, D: gl.constexpr,
                    num_warps: gl.constexpr):
    """Zero the V rows of keys ``>= kv_len`` in ``v_buf`` (the request's last tile only)."""
    if j0 + BLOCK_N > kv_len:
        layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
        keys = j0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, layout))
        v = v_buf.load(layout)
        v_buf.store(gl.where((keys < kv_len)[:, None], v, gl.zeros_like(v)))
        fence_async_shared()  # generic-proxy stores before the wgmma's async-proxy reads
        gl.thread_barrier()


@gluon.jit
def _store_rows(acc, l_i, out_ptr, stride_ot, stride_oh, tok0, h, q_len, m0, bmm2_scale,
                o_layout: gl.constexpr, BLOCK_M: gl.constexpr, D: gl.constexpr):
    """``bmm2_scale * O / l`` as bf16 into the rows of ``out`` this program owns (0 where a
    row had no key)."""
    l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))
    out = acc * (bmm2_scale / gl.where(l_o == 0.0, 1.0, l_o))[:, None]
    rows = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, o_layout))
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, o_layout))
    ptrs = (out_ptr + (tok0 + rows).to(gl.int64)[:, None] * stride_ot + h * stride_oh
            + cols[None, :])
    gl.store(ptrs, out.to(gl.bfloat16), mask=(rows < q_len)[:, None])


@gluon.jit
def _softmax_partition(q_smem, k_bufs, v_bufs, q_bar, k_ready, k_empty, v_ready, v_empty,
                       v_masked, out_ptr, stride_ot, stride_oh, tok0, h, q_len, m0, kv_len,
                       n_tiles, scale_log2, bmm2_scale, WG: gl.constexpr, CAUSAL: gl.constexpr,
                       BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr,
                       STAGES: gl.constexpr):
    """Consumer warpgroup ``WG`` (0 or 1), the query rows ``[m0 + WG * BLOCK_M / 2, ...)`` of
    the block: the overlapped Q K^T / softmax / P V loop over every K/V tile, then ``O / l``
    to ``out``.  Each warpgroup releases ring slots on its own (those barriers count two)."""
    ROWS: gl.constexpr = BLOCK_M // 2
    warps: gl.constexpr = gl.num_warps()
    s_layout: gl.constexpr = _mma_layout(BLOCK_N, warps)
    o_layout: gl.constexpr = _mma_layout(D, warps)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row0 = m0 + WG * ROWS
    q_rows = q_smem.slice(WG * ROWS, ROWS)
    rows = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, s_layout))
    keys = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    q_pos = kv_len - q_len + rows
    m_i = gl.full([ROWS], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([ROWS], gl.float32, gl.SliceLayout(1, s_layout))
    acc = gl.zeros([ROWS, D], gl.float32, o_layout)
    s_zero = gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout)
    # Tiles below this key need no mask: every key is < kv_len and <= the first row's position.
    first_masked = kv_len - q_len + row0 + 1 if CAUSAL else kv_len
    first_masked = gl.minimum(first_masked, kv_len)
    mbarrier.wait(q_bar, 0)
    # Tile 0: S alone (the accumulator is still zero).
    mbarrier.wait(k_ready.index(0), 0)
    qk = warpgroup_mma(q_rows, k_bufs.index(0).permute((1, 0)), s_zero, use_acc=False)
    gl.thread_barrier()
    mbarrier.arrive(k_empty.index(0))
    p, alpha, m_i, l_i = softmax_step(qk, m_i, l_i, 0, keys, q_pos, kv_len, first_masked,
                                       scale_log2, CAUSAL, BLOCK_N)
    p_op = gl.convert_layout(p.to(gl.bfloat16), p_layout)
    for i in range(1, n_tiles):
        s = i % STAGES
        prev = (i - 1) % STAGES
        mbarrier.wait(k_ready.index(s), (i // STAGES) & 1)
        qk = warpgroup_mma(q_rows, k_bufs.index(s).permute((1, 0)), s_zero, use_acc=False,
                           is_async=True)
        # Only the request's last tile can hold keys past kv_len, so tile i - 1 never does.
        mbarrier.wait(v_ready.index(prev), ((i - 1) // STAGES) & 1)
        acc = warpgroup_mma(p_op, v_bufs.index(prev), acc, is_async=True)
        # wgmma groups retire in order: one left outstanding means S has landed.
        qk = warpgroup_mma_wait(num_outstanding=1, deps=(qk,))
        gl.thread_barrier()
        mbarrier.arrive(k_empty.index(s))
        p, alpha, m_i, l_i = softmax_step(qk, m_i, l_i, i * BLOCK_N, keys, q_pos, kv_len,
                                           first_masked, scale_log2, CAUSAL, BLOCK_N)
        acc, _ = warpgroup_mma_wait(num_outstanding=0, deps=(acc, p_op))
        gl.thread_barrier()
        mbarrier.arrive(v_empty.index(prev))
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
        p_op = gl.convert_layout(p.to(gl.bfloat16), p_layout)
    last = (n_tiles - 1) % STAGES
    last_j0 = (n_tiles - 1) * BLOCK_N
    mbarrier.wait(v_ready.index(last), ((n_tiles - 1) // STAGES) & 1)
    if last_j0 + BLOCK_N > kv_len:
        # Each warpgroup zeroes half of the tile's V rows; both P V products read all of them.
        HALF: gl.constexpr = BLOCK_N // 2
        zero_keys_past(v_bufs.index(last).slice(WG * HALF, HALF), last_j0 + WG * HALF, kv_len,
                        HALF, D, warps)
        mbarrier.arrive(v_masked)
        mbarrier.wait(v_masked, 0)
    acc = warpgroup_mma(p_op, v_bufs.index(last), acc)
    gl.thread_barrier()
    mbarrier.arrive(v_empty.index(last))
    _store_rows(acc, l_i, out_ptr, stride_ot, stride_oh, tok0, h, q_len, row0, bmm2_scale,
                o_layout, ROWS, D)


@gluon.jit
def _store_zero_rows(out_ptr, stride_ot, stride_oh, tok0, h, q_len, m0,
                     BLOCK_M: gl.constexpr, D: gl.constexpr, num_warps: gl.constexpr):
    """Rows of a block that no key is allowed for: ``out = 0`` (as ``context.py``)."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
    rows = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, layout))
    ptrs = (out_ptr + (tok0 + rows).to(gl.int64)[:, None] * stride_ot + h * stride_oh
            + cols[None, :])
    gl.store(ptrs, gl.zeros([BLOCK_M, D], gl.bfloat16, layout), mask=(rows < q_len)[:, None])


@gluon.jit
def context_ws_kernel(q_desc, k_desc, v_desc, k_tables_ptr, v_tables_ptr, seq_lens_ptr,
                      cu_q_ptr, out_ptr, stride_ktb, stride_vtb, stride_ot, stride_oh,
                      num_heads, k_head_rows, k_page_rows, v_head_rows, v_page_rows,
                      scale_log2, bmm2_scale,
                      GROUP: gl.constexpr, PAGE: gl.constexpr, BOX: gl.constexpr,
                      D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                      STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                      CONSUMER_REGS: gl.constexpr, QBLOCK_MAJOR: gl.constexpr):
    """Query rows ``[m0, m0 + BLOCK_M)`` of one request and head.  ``k_desc`` / ``v_desc``: 2-D
    descriptors over the caches' rows of ``D`` values, ``BOX``-row boxes; KV head ``hkv`` of
    page ``p`` starts at row ``p * k_page_rows + hkv * k_head_rows`` (V alike)."""
    # QBLOCK_MAJOR: the grid is (query blocks, requests x heads), so the programs in flight
    # share one K/V head's keys in L2 (faster on long requests, launch_grid); else transposed.
    if QBLOCK_MAJOR:
        pid = gl.program_id(1)
        block = gl.program_id(0)
        blocks = gl.num_programs(0)
    else:
        pid = gl.program_id(0)
        block = gl.program_id(1)
        blocks = gl.num_programs(1)
    # The last query blocks of a causal request see the most keys: launch them first.
    m0 = (blocks - 1 - block) * BLOCK_M
    b = pid // num_heads
    h = pid % num_heads
    q_start = gl.load(cu_q_ptr + b).to(gl.int32)
    q_len = gl.load(cu_q_ptr + b + 1).to(gl.int32) - q_start
    kv_len = gl.load(seq_lens_ptr + b).to(gl.int32)
    hi = kv_len
    if CAUSAL:
        hi = gl.minimum(kv_len, kv_len - q_len + m0 + BLOCK_M)
    n_tiles = gl.cdiv(gl.maximum(hi, 0), BLOCK_N)
    if m0 < q_len:
        if n_tiles == 0:
            _store_zero_rows(out_ptr, stride_ot, stride_oh, q_start, h, q_len, m0, BLOCK_M, D,
                             gl.num_warps())
        else:
            q_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_M, D], q_desc.layout)
            k_bufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, D],
                                               k_desc.layout)
            v_bufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, D],
                                               v_desc.layout)
            q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
            k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
            k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
            v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
            v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
            v_masked = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
            mbarrier.init(q_bar, count=1)
            for i in gl.static_range(STAGES):
                mbarrier.init(k_ready.index(i), count=1)
                mbarrier.init(k_empty.index(i), count=2)
                mbarrier.init(v_ready.index(i), count=1)
                mbarrier.init(v_empty.index(i), count=2)
            mbarrier.init(v_masked, count=2)
            hkv = h // GROUP
            k_table = k_tables_ptr + b.to(gl.int64) * stride_ktb
            v_table = v_tables_ptr + b.to(gl.int64) * stride_vtb
            gl.warp_specialize([
                (_softmax_partition, (q_smem, k_bufs, v_bufs, q_bar, k_ready, k_empty, v_ready,
                                      v_empty, v_masked, out_ptr, stride_ot, stride_oh,
                                      q_start, h, q_len, m0, kv_len, n_tiles, scale_log2,
                                      bmm2_scale, 0, CAUSAL, BLOCK_M, BLOCK_N, D, STAGES)),
                (_softmax_partition, (q_smem, k_bufs, v_bufs, q_bar, k_ready, k_empty, v_ready,
                                      v_empty, v_masked, out_ptr, stride_ot, stride_oh,
                                      q_start, h, q_len, m0, kv_len, n_tiles, scale_log2,
                                      bmm2_scale, 1, CAUSAL, BLOCK_M, BLOCK_N, D, STAGES)),
                (_loader, (q_desc, k_desc, v_desc, q_smem, k_bufs, v_bufs, q_bar, k_ready,
                           k_empty, v_ready, v_empty, k_table, v_table, q_start + m0, h * D,
                           kv_len, hkv * k_head_rows, hkv * v_head_rows, k_page_rows,
                           v_page_rows, n_tiles, PAGE, BOX, BLOCK_N, STAGES)),
            ], [gl.num_warps(), 1], [CONSUMER_REGS, 40])


# --------------------------------------------------------------------------- host

def _shared_layout(rows: int, cols: int):
    return gl.NVMMASharedLayout.get_default_for([rows, cols], gl.bfloat16)


def rows_descriptor(cache: torch.Tensor, box: int) -> tuple[TensorDescriptor, int, int]:
    """``(descriptor, head_rows, page_rows)``: a 2-D descriptor over ``cache``'s
    (``[pages, Hkv, page_size, D]``) rows of ``D`` values, ``box``-row boxes, and where a
    page and a KV head start in it (``context.tma_fits`` has checked the strides)."""
    rows, head_rows, page_rows = cache_rows(cache)
    d = cache.shape[3]
    desc = TensorDescriptor(cache, [rows, d], [cache.stride(2), 1], [box, d],
                            _shared_layout(box, d))
    return desc, head_rows, page_rows


def box_rows(page_size: int) -> int:
    """Rows of one TMA copy: a page, or the part of one a tile holds."""
    return min(page_size, BLOCK_N)


def _tma_rows(x: torch.Tensor) -> bool:
    """Whether ``x`` ``[T, H, D]`` bf16 is a 2-D ``[T, H * D]`` array TMA reads: heads and
    values packed, 16-byte aligned rows and base (a slice of heads qualifies)."""
    return (x.stride(2) == 1 and x.stride(1) == x.shape[2] and x.stride(0) % 8 == 0
            and x.data_ptr() % 16 == 0)


def serves(p: PagedAttention) -> bool:
    """Whether this kernel takes ``p`` (a context call): bf16 query, KV and output, D 64 or
    128, a non-empty query whose token rows TMA reads (``_tma_rows``), no window, sinks or
    LSE, a positive ``bmm1_scale`` (``softmax_step``), and pages that hold whole tiles or
    split one evenly into copies of at least ``MIN_BOX`` rows.  The caller also checks the
    device and that TMA can read the caches."""
    page = p.page_size
    return (p.query.dtype == torch.bfloat16 and p.k_cache.dtype == torch.bfloat16
            and p.out.dtype == torch.bfloat16 and p.query.shape[2] in HEAD_DIMS
            and p.query.shape[0] > 0 and _tma_rows(p.query)
            and p.window_left < 0 and p.sinks is None and p.lse is None and p.bmm1_scale > 0
            and (page % BLOCK_N == 0 or (BLOCK_N % page == 0 and page >= MIN_BOX)))


def launch_grid(programs_per_block: int, max_q_len: int) -> tuple[tuple[int, int], bool]:
    """``(grid, qblock_major)`` of a call with ``programs_per_block`` (requests x heads)
    programs per query block and at most ``max_q_len`` query tokens a request: query block
    first from ``tuning.CONTEXT_QBLOCK_MAJOR_MIN_Q_LEN`` tokens, unless the requests x heads
    would not fit a grid's second dimension."""
    blocks = max(1, triton.cdiv(max_q_len, BLOCK_M))
    if max_q_len >= tuning.CONTEXT_QBLOCK_MAJOR_MIN_Q_LEN and programs_per_block <= MAX_GRID_Y:
        return (blocks, programs_per_block), True
    return (programs_per_block, blocks), False


def context_ws(p: PagedAttention) -> None:
    """Run ``p`` (a context call that :func:`serves` accepts, TMA-readable caches)."""
    t, num_heads, d = p.query.shape
    box = box_rows(p.page_size)
    q_desc = TensorDescriptor(p.query.flatten(1), [t, num_heads * d], [p.query.stride(0), 1],
                              [BLOCK_M, d], _shared_layout(BLOCK_M, d))
    k_desc, k_head_rows, k_page_rows = rows_descriptor(p.k_cache, box)
    v_desc, v_head_rows, v_page_rows = rows_descriptor(p.v_cache, box)
    grid, qblock_major = launch_grid(p.batch * num_heads, p.max_q_len)
    context_ws_kernel[grid](
        q_desc, k_desc, v_desc, p.k_tables, p.v_tables, p.seq_lens, p.cu_q, p.out,
        p.k_tables.stride(0), p.v_tables.stride(0), p.out.stride(0), p.out.stride(1),
        num_heads, k_head_rows, k_page_rows, v_head_rows, v_page_rows,
        p.bmm1_scale * math.log2(math.e), p.bmm2_scale,
        GROUP=p.group, PAGE=p.page_size, BOX=box, D=d, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
        STAGES=STAGES, CAUSAL=p.causal, CONSUMER_REGS=CONSUMER_REGS,
        QBLOCK_MAJOR=qblock_major, num_warps=WARPGROUP)
