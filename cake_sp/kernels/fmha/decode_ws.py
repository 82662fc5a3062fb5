"""The warp-specialised split-KV decode kernel for sm_90a (Gluon): the partial kernel of
``decode_triton_v1`` for the calls it serves (:func:`serves`).

``decode.py``'s partial kernel issues its page lookups, its K/V loads and its dots from the
same warps, and Triton's pipeliner gives each load one shared-memory buffer, so a program has
one K and one V tile in flight and none while it computes; it needs several programs an SM,
hence many splits, to keep HBM busy.  Here a program (same grid and partials as
``decode.py``'s, so its combine kernel merges them) has two partitions:

* *loader* (one warp): for each 64-key tile of its split, the K and V rows by TMA into a
  ring of ``tuning.DECODE_WS_STAGES`` shared-memory slots, one copy per page the tile covers,
  through the request's page tables (``context_ws.load_kv_tiles``, page entries one tile
  ahead);
* *consumer* (four warps): the request's query rows of that KV head as one ``mma_v2`` tile,
  ``S = Q K^T``, the online softmax, ``O += P V``, releasing each slot as soon as its operand
  is in registers; then the partial ``(acc, m, l)`` or, for one split, ``out``.

Splits are few (``tuning.decode_ws_splits``): as many as keep each within 4,096 keys, or,
when the (request, KV head) programs are too few to fill the SMs, as many as give every SM
one.  Semantics are
``decode.py``'s, restricted to what :func:`serves` accepts.  Keys past the request's length
in its last tile are masked out of ``S`` and their V rows zeroed in shared memory before
``P V``, so whatever the cache holds there, even NaN, never reaches the output.  Never runs in
the CPU interpreter.
"""

from __future__ import annotations

import math

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

from cake_sp.kernels.fmha import tuning
from cake_sp.kernels.fmha.context_ws import (
    MIN_BOX,
    load_kv_tiles,
    rows_descriptor,
    softmax_step,
    zero_keys_past,
)
from cake_sp.kernels.fmha.problem import PagedAttention
from cake_sp.kernels.fmha.tiles import LN2

BLOCK_N = 64
HEAD_DIMS = (64, 128)
LOADER_REGS = 40
# Query rows x D of the consumer's accumulator that fit its 128 registers with the K^T and V
# operands beside them: 32 x 128 (ptxas for sm_90a); 64 rows at D = 128 spilled 1,104 bytes.
MAX_ACC_VALUES = 32 * 128


@gluon.jit
def _consumer(q_ptr, k_bufs, v_bufs, k_ready, k_empty, v_ready, v_empty, acc_ptr, ml_ptr,
              out_ptr, lse_ptr, b, hkv, split, num_splits, num_kv_heads, start, n_tiles, seq_len,
              scale_log2, bmm2_scale, stride_qt, stride_qh, stride_ot, stride_oh,
              Q_LEN: gl.constexpr, GROUP: gl.constexpr, D: gl.constexpr, BLOCK_M: gl.constexpr,
              BLOCK_N: gl.constexpr, STAGES: gl.constexpr, FINALIZE: gl.constexpr,
              HAS_LSE: gl.constexpr):
    """Consumer partition: rows ``(q token i, head g)`` of one (request, KV head) over the
    split's ``n_tiles`` tiles from key ``start`` (keys below ``seq_len``); the split's partial,
    or with ``FINALIZE`` ``out`` and (``HAS_LSE``) the LSE."""
    warps: gl.constexpr = gl.num_warps()
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, warps],
                                                  instr_shape=[16, 8])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    b_layout: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    blocked: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [warps, 1], [1, 0])
    q_rows = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, blocked))
    q_cols = gl.arange(0, D, layout=gl.SliceLayout(0, blocked))
    q_tok = (b * Q_LEN + q_rows // GROUP).to(gl.int64)
    q_head = hkv * GROUP + q_rows % GROUP
    q = gl.load(q_ptr + q_tok[:, None] * stride_qt + q_head[:, None] * stride_qh + q_cols[None, :],
                mask=(q_rows < Q_LEN * GROUP)[:, None], other=0.0)
    q = gl.convert_layout(q, a_layout)

    rows = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, mma))
    keys = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, mma))
    q_pos = seq_len - Q_LEN + rows // GROUP
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, gl.SliceLayout(1, mma))
    l_i = gl.zeros([BLOCK_M], gl.float32, gl.SliceLayout(1, mma))
    acc = gl.zeros([BLOCK_M, D], gl.float32, mma)
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, mma)
    # Tiles from this key hold keys that some row may not see (past seq_len, or after a query's
    # own position when a request brings several); softmax_step masks those.
    first_masked = seq_len - Q_LEN + 1
    for i in range(n_tiles):
        s = i % STAGES
        phase = (i // STAGES) & 1
        j0 = start + i * BLOCK_N
        mbarrier.wait(k_ready.index(s), phase)
        k_t = k_bufs.index(s).permute((1, 0)).load(b_layout)
        gl.thread_barrier()
        mbarrier.arrive(k_empty.index(s))
        qk = mma_v2(q, k_t, s_zero)
        p, alpha, m_i, l_i = softmax_step(qk, m_i, l_i, j0, keys, q_pos, seq_len, first_masked,
                                          scale_log2, True, BLOCK_N)
        mbarrier.wait(v_ready.index(s), phase)
        zero_keys_past(v_bufs.index(s), j0, seq_len, BLOCK_N, D, warps)
        v = v_bufs.index(s).load(b_layout)
        gl.thread_barrier()
        mbarrier.arrive(v_empty.index(s))
        acc = mma_v2(gl.convert_layout(p.to(gl.bfloat16), a_layout), v, acc * alpha[:, None])

    cols = gl.arange(0, D, layout=gl.SliceLayout(0, mma))
    row_ok = rows < Q_LEN * GROUP
    tok = (b * Q_LEN + rows // GROUP).to(gl.int64)
    head = hkv * GROUP + rows % GROUP
    row = tok * (num_kv_heads * GROUP) + head
    if FINALIZE:
        has_mass = l_i > 0
        inv = gl.where(has_mass, bmm2_scale / gl.where(has_mass, l_i, 1.0), 0.0)
        ptrs = out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + cols[None, :]
        gl.store(ptrs, (acc * inv[:, None]).to(gl.bfloat16), mask=row_ok[:, None])
        if HAS_LSE:
            lse = gl.where(has_mass, (m_i + gl.log2(gl.where(has_mass, l_i, 1.0))) * LN2,
                           float("-inf"))
            gl.store(lse_ptr + row, lse, mask=row_ok)
    else:
        # decode.py's partials, merged by its combine kernel.
        slot = row * num_splits + split
        gl.store(acc_ptr + slot[:, None] * D + cols[None, :], acc, mask=row_ok[:, None])
        gl.store(ml_ptr + slot * 2, m_i, mask=row_ok)
        gl.store(ml_ptr + slot * 2 + 1, l_i, mask=row_ok)


@gluon.jit
def decode_ws_kernel(q_ptr, k_desc, v_desc, k_tables_ptr, v_tables_ptr, seq_lens_ptr, acc_ptr,
                     ml_ptr, out_ptr, lse_ptr, scale_log2, bmm2_scale, num_kv_heads, chunk_len,
                     k_head_rows, k_page_rows, v_head_rows, v_page_rows, stride_qt, stride_qh,
                     stride_ktb, stride_vtb, stride_ot, stride_oh,
                     Q_LEN: gl.constexpr, GROUP: gl.constexpr, PAGE: gl.constexpr,
                     BOX: gl.constexpr, D: gl.constexpr, BLOCK_M: gl.constexpr,
                     BLOCK_N: gl.constexpr, STAGES: gl.constexpr, FINALIZE: gl.constexpr,
                     HAS_LSE: gl.constexpr, LOADER_REGS: gl.constexpr):
    """Program ``(request x KV head, split)``: keys ``[split * chunk_len, ...)`` of the
    request, into the partials ``acc [T, Hq, S, D]``, ``ml [T, Hq, S, 2]`` fp32 (log2-unit
    max, sum) at ``(row, split)`` as ``decode.py``'s partial kernel writes them, or with
    ``FINALIZE`` (one split) ``out`` and the LSE.  ``k_desc`` / ``v_desc``: 2-D descriptors
    over the caches' rows of ``D`` values (as in ``context_ws``)."""
    pid = gl.program_id(0)
    split = gl.program_id(1)
    b = pid // num_kv_heads
    hkv = pid % num_kv_heads
    seq_len = gl.load(seq_lens_ptr + b).to(gl.int32)
    start = split * chunk_len
    end = gl.minimum(start + chunk_len, seq_len)
    n_tiles = gl.cdiv(gl.maximum(end - start, 0), BLOCK_N)
    k_bufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, D], k_desc.layout)
    v_bufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, D], v_desc.layout)
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(v_empty.index(i), count=1)
    k_table = k_tables_ptr + b.to(gl.int64) * stride_ktb
    v_table = v_tables_ptr + b.to(gl.int64) * stride_vtb
    gl.warp_specialize([
        (_consumer, (q_ptr, k_bufs, v_bufs, k_ready, k_empty, v_ready, v_empty, acc_ptr, ml_ptr,
                     out_ptr, lse_ptr, b, hkv, split, gl.num_programs(1), num_kv_heads, start,
                     n_tiles, seq_len, scale_log2, bmm2_scale, stride_qt, stride_qh, stride_ot,
                     stride_oh, Q_LEN, GROUP, D, BLOCK_M, BLOCK_N, STAGES, FINALIZE, HAS_LSE)),
        # The loader partition: every tile of the split.
        (load_kv_tiles, (k_desc, v_desc, k_bufs, v_bufs, k_ready, k_empty, v_ready, v_empty,
                         k_table, v_table, start, n_tiles, seq_len, hkv * k_head_rows,
                         hkv * v_head_rows, k_page_rows, v_page_rows, PAGE, BOX, BLOCK_N,
                         STAGES)),
    ], [1], [LOADER_REGS])


# --------------------------------------------------------------------------- host

def box_rows(page_size: int) -> int:
    """Rows of one TMA copy: a page, or the part of one a tile holds."""
    return min(page_size, BLOCK_N)


def serves(p: PagedAttention) -> bool:
    """Whether this kernel takes ``p`` (a decode call): bf16 query, KV and output, D 64 or 128,
    at most ``MAX_ACC_VALUES`` query rows (``group x q_len_per_req``) x D, no window or sinks,
    a positive ``bmm1_scale`` (the softmax's fused multiply-add), and pages that hold whole
    64-key tiles or split one evenly into copies of at least ``MIN_BOX`` rows.  The caller also
    checks the device and that TMA can read the caches."""
    page, head_dim = p.page_size, p.query.shape[2]
    return (p.query.dtype == torch.bfloat16 and p.k_cache.dtype == torch.bfloat16
            and p.out.dtype == torch.bfloat16 and head_dim in HEAD_DIMS
            and p.group * p.q_len_per_req * head_dim <= MAX_ACC_VALUES
            and p.window_left < 0 and p.sinks is None and p.bmm1_scale > 0
            and (page % BLOCK_N == 0 or (BLOCK_N % page == 0 and page >= MIN_BOX)))


def decode_ws(p: PagedAttention, splits: int, chunk: int, block_m: int, acc: torch.Tensor,
              ml: torch.Tensor) -> None:
    """Run ``p`` (a decode call :func:`serves` accepts, TMA-readable caches) over ``splits``
    splits of ``chunk`` keys (``decode.split_plan``, a multiple of ``BLOCK_N``) into the fp32
    partials ``acc`` and ``ml`` (``decode.py``'s layout), or for one split into ``p.out``
    (and ``p.lse``); the query rows of a KV head in tiles of ``block_m`` rows
    (``decode.block_rows``)."""
    box = box_rows(p.page_size)
    k_desc, k_head_rows, k_page_rows = rows_descriptor(p.k_cache, box)
    v_desc, v_head_rows, v_page_rows = rows_descriptor(p.v_cache, box)
    lse = p.lse if p.lse is not None else p.out
    decode_ws_kernel[(p.batch * p.num_kv_heads, splits)](
        p.query, k_desc, v_desc, p.k_tables, p.v_tables, p.seq_lens, acc, ml, p.out, lse,
        p.bmm1_scale * math.log2(math.e), p.bmm2_scale, p.num_kv_heads, chunk,
        k_head_rows, k_page_rows, v_head_rows, v_page_rows, p.query.stride(0), p.query.stride(1),
        p.k_tables.stride(0), p.v_tables.stride(0), p.out.stride(0), p.out.stride(1),
        Q_LEN=p.q_len_per_req, GROUP=p.group, PAGE=p.page_size, BOX=box, D=p.query.shape[2],
        BLOCK_M=block_m, BLOCK_N=BLOCK_N, STAGES=tuning.DECODE_WS_STAGES, FINALIZE=splits == 1,
        HAS_LSE=p.lse is not None, LOADER_REGS=LOADER_REGS, num_warps=tuning.DECODE_NUM_WARPS,
        maxnreg=tuning.DECODE_WS_MAX_REGISTERS)
