"""Fused QKV projection + QK RMSNorm + RoPE; the epilogue stores each head tile at its destinations.

Per call, on rank ``source_rank`` with ``rows = B * S_local`` tokens ``x [rows, hidden]``::

    p = x @ qkv_weight.T (+ qkv_bias)                          # fp32 accumulation
    for every head h of kind Q or K (norm weight w given or None):
        y = bf16(bf16(p_h * rsqrt(mean(p_h^2) + eps)) * w)      # or y = p_h when w is None
        out_h = bf16(rope(y, cos_sin[positions or row]))        # fp32 rotation, one rounding
    for every V head h:  out_h = bf16(p_h)
    for every destination (rank d, local head l) of h (HeadPlan.destinations):
        slot_d[region[kind] + t * token_stride[kind] + l * head_stride[kind] + c] = out_h[m, c]
        with t = b * dest.seq_len + dest_seq_offset + s for source row m = b * S_local + s

This is DESIGN.md section 1 followed by the Ulysses exchange, for one source
rank.  A *tile* is ``BLOCK_M`` rows of one head (``BLOCK_N = head_dim``), so the
whole epilogue (norm, rotation, rounding, stores, readiness word) is local to
the tile.  ``slot_d`` is reached through ``dest_table`` (byte addresses of bf16
buffers, one per rank): peer pointers on the NVLink path, or addresses in this
rank's own send buffer on the NCCL path.

With ``signals`` the kernel also runs its half of the NVLink protocol (see
:mod:`cake_sp.kernels.signals`): before its first store to rank ``d`` a program
waits for ``d`` to have entered the call, and after each tile stored at ``d``
it raises ``d``'s readiness words for (source, row block, local head), a row
block being the launcher's ``block_m`` rows (a tile holds one or several).

The grid is persistent: ``min(tiles, SMs)`` programs walk the tiles in groups
of ``GROUP_HEADS`` heads (the weights of a group stay in L2 while the row blocks
stream past); inside a group consecutive tiles are different heads, ordered so
that consecutive heads go to different ranks and every link is busy from the
first wave (``producer_epilogue.tile_coords``).  Three mainloops compute a
tile's fp32 accumulator (``mainloop=``, ``MAINLOOPS``): ``tl.dot`` over pointer
loads (any target, the CPU interpreter) or over host-built tensor descriptors
(TMA, sm_90+), both in this module's kernel, and a warp-specialised Gluon kernel
(``producer_ws.py``, sm_90).  All three finish the tile with
``producer_epilogue.deliver_tile``.  On an H200 the warp-specialised kernel is faster
than the TMA mainloop from 1,024 rows and slower on most shapes at 512 (docs/results.md),
so it is the default on sm_90 from ``_config.PRODUCER_WS_MIN_ROWS`` rows
(``_config.producer_mainloop``).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from cake_sp._validation import check_tensor
from cake_sp.kernels import _config
from cake_sp.kernels.norm_rope import ROPE_STYLES, rope_style_code
from cake_sp.kernels.producer_epilogue import deliver_tile, tile_coords
from cake_sp.kernels.signals import ProducerSignals, check_int64_vector
from cake_sp.layouts import DestLayout, HeadPlan

try:  # Gluon's Hopper API as of Triton 3.6; without it the warp-specialised mainloop is off
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonTensorDescriptor

    from cake_sp.kernels.producer_ws import qkv_produce_ws_kernel
except ImportError:
    qkv_produce_ws_kernel = None

HEAD_DIMS = (64, 128, 256)
MAINLOOPS = ("pointer", "tma", "warp_specialized")
# The warp-specialised kernel is not built for D = 256: its fp32 hand-off tile alone would
# take 128 KiB of shared memory.
WS_HEAD_DIMS = (64, 128)

# ----------------------------------------------------------------------------- device code


@triton.jit
def _qkv_mainloop(x_src, w_src, row0, w_row0, rows, HIDDEN: tl.constexpr, D: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, USE_TMA: tl.constexpr,
                  INTERPRET: tl.constexpr):
    """fp32 ``x[row0:row0+BLOCK_M] @ w[w_row0:w_row0+D].T``, a ``[BLOCK_M, D]`` accumulator.

    ``x_src``/``w_src`` are pointers, or tensor descriptors when ``USE_TMA``.  Rows
    past ``rows`` hold garbage (the pointer variant re-reads the last row, TMA
    reads zeros); the epilogue masks them.
    """
    acc = tl.zeros((BLOCK_M, D), dtype=tl.float32)
    if USE_TMA:
        for k in range(0, HIDDEN, BLOCK_K):
            a = x_src.load([row0, k])
            b = w_src.load([w_row0, k])
            if INTERPRET:
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc = tl.dot(a, b.T, acc)
    else:
        # Clamping instead of masking keeps the loads unpredicated.
        offs_m = tl.minimum(row0 + tl.arange(0, BLOCK_M), rows - 1).to(tl.int64)
        offs_n = (w_row0 + tl.arange(0, D)).to(tl.int64)
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = x_src + offs_m[:, None] * HIDDEN + offs_k[None, :]
        # w tile loaded as [BLOCK_K, D] (w.T) rather than transposed after the load.
        b_ptrs = w_src + offs_n[None, :] * HIDDEN + offs_k[:, None]
        for k in range(0, HIDDEN, BLOCK_K):
            a = tl.load(a_ptrs + k)
            b = tl.load(b_ptrs + k)
            if INTERPRET:
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def _produce_tile(tile, entered, failed, row_blocks, x_src, w_src, rows, inputs, dest, signals,
                  HIDDEN: tl.constexpr, NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
                  Q_PER_RANK: tl.constexpr, KV_PER_RANK: tl.constexpr,
                  KV_REPLICAS: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_K: tl.constexpr, GROUP_HEADS: tl.constexpr, HAS_BIAS: tl.constexpr,
                  HAS_Q_NORM: tl.constexpr, HAS_K_NORM: tl.constexpr,
                  HAS_POSITIONS: tl.constexpr, ROPE_STYLE: tl.constexpr, SIGNAL: tl.constexpr,
                  READY_M: tl.constexpr, USE_TMA: tl.constexpr, INTERPRET: tl.constexpr):
    """Compute one tile and store it at every destination; returns the updated
    bit sets of ranks seen entered / given up on by this program."""
    row_block, head = tile_coords(tile, row_blocks, NUM_Q_HEADS, NUM_KV_HEADS, Q_PER_RANK,
                                  KV_PER_RANK, GROUP_HEADS)
    row0 = row_block * BLOCK_M
    acc = _qkv_mainloop(x_src, w_src, row0, head * D, rows, HIDDEN, D, BLOCK_M, BLOCK_K,
                        USE_TMA, INTERPRET)
    return deliver_tile(
        acc, row_block, head, row0 + tl.arange(0, BLOCK_M).to(tl.int64), tl.arange(0, D),
        tl.arange(0, D // 2), entered, failed, rows, inputs, dest, signals, NUM_Q_HEADS,
        NUM_KV_HEADS, Q_PER_RANK, KV_PER_RANK, KV_REPLICAS, D, BLOCK_M, HAS_BIAS, HAS_Q_NORM,
        HAS_K_NORM, HAS_POSITIONS, ROPE_STYLE, SIGNAL, READY_M, False, INTERPRET)


@triton.jit
def _qkv_produce_kernel(x_src, w_src, bias_ptr, q_norm_ptr, k_norm_ptr, cos_sin_ptr, pos_ptr,
                        bad_pos_ptr, dest_table_ptr, epoch_ptr, enter_ptr, word_table_ptr,
                        status_ptr, rows, cos_sin_stride, cos_sin_rows, eps, seq_local,
                        dest_seq_len, dest_seq_offset, region_q, region_k, region_v,
                        token_stride_q, token_stride_k, token_stride_v,
                        head_stride_q, head_stride_k, head_stride_v,
                        source_rank, max_row_blocks, timeout_ns,
                        HIDDEN: tl.constexpr, NUM_Q_HEADS: tl.constexpr,
                        NUM_KV_HEADS: tl.constexpr, Q_PER_RANK: tl.constexpr,
                        KV_PER_RANK: tl.constexpr, KV_REPLICAS: tl.constexpr, D: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                        GROUP_HEADS: tl.constexpr, HAS_BIAS: tl.constexpr,
                        HAS_Q_NORM: tl.constexpr, HAS_K_NORM: tl.constexpr,
                        HAS_POSITIONS: tl.constexpr, ROPE_STYLE: tl.constexpr,
                        SIGNAL: tl.constexpr, READY_M: tl.constexpr, USE_TMA: tl.constexpr,
                        INTERPRET: tl.constexpr):
    row_blocks = tl.cdiv(rows, BLOCK_M)
    num_tiles = row_blocks * (NUM_Q_HEADS + 2 * NUM_KV_HEADS)
    if SIGNAL:
        epoch = tl.load(epoch_ptr)
    else:
        epoch = tl.full((), 0, tl.int64)
    entered = tl.full((), 0, tl.int64)
    failed = tl.full((), 0, tl.int64)
    inputs = (bias_ptr, q_norm_ptr, k_norm_ptr, cos_sin_ptr, cos_sin_stride, cos_sin_rows,
              pos_ptr, bad_pos_ptr, eps)
    dest = (dest_table_ptr, seq_local, dest_seq_len, dest_seq_offset, region_q, region_k,
            region_v, token_stride_q, token_stride_k, token_stride_v, head_stride_q,
            head_stride_k, head_stride_v)
    signals = (epoch, enter_ptr, word_table_ptr, status_ptr, source_rank, max_row_blocks,
               timeout_ns)
    if INTERPRET:
        # The interpreter cannot range over a runtime program id.
        tile = tl.program_id(0)
        while tile < num_tiles:
            entered, failed = _produce_tile(
                tile, entered, failed, row_blocks, x_src, w_src, rows, inputs, dest, signals,
                HIDDEN, NUM_Q_HEADS, NUM_KV_HEADS, Q_PER_RANK, KV_PER_RANK, KV_REPLICAS, D,
                BLOCK_M, BLOCK_K, GROUP_HEADS, HAS_BIAS, HAS_Q_NORM, HAS_K_NORM, HAS_POSITIONS,
                ROPE_STYLE, SIGNAL, READY_M, USE_TMA, INTERPRET)
            tile += tl.num_programs(0)
    else:
        # tl.range, not the while loop: it compiles differently, it measured 3-4 %
        # faster at 128-row tiles (two runs on an H200, not side by side), and every
        # measurement of the current tiles used it.  One stage: only the GEMM
        # mainloop is software-pipelined; when hidden == BLOCK_K that loop folds away
        # and Triton 3.6 would otherwise pipeline this loop instead (with TMA the
        # pipeliner then fails to compile the kernel).
        for tile in tl.range(tl.program_id(0), num_tiles, tl.num_programs(0), num_stages=1):
            entered, failed = _produce_tile(
                tile, entered, failed, row_blocks, x_src, w_src, rows, inputs, dest, signals,
                HIDDEN, NUM_Q_HEADS, NUM_KV_HEADS, Q_PER_RANK, KV_PER_RANK, KV_REPLICAS, D,
                BLOCK_M, BLOCK_K, GROUP_HEADS, HAS_BIAS, HAS_Q_NORM, HAS_K_NORM, HAS_POSITIONS,
                ROPE_STYLE, SIGNAL, READY_M, USE_TMA, INTERPRET)


# ----------------------------------------------------------------------------- launcher


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _block_k(hidden: int) -> int:
    for block_k in _config.PRODUCER_BLOCK_K_CHOICES:
        if hidden % block_k == 0:
            return block_k
    raise ValueError(f"qkv_norm_rope_produce: hidden ({hidden}) must be a multiple of "
                     f"{min(_config.PRODUCER_BLOCK_K_CHOICES)}")


def _rope_code(rope_style: str | int) -> int:
    if isinstance(rope_style, int) and rope_style in ROPE_STYLES.values():
        return rope_style
    return rope_style_code(rope_style)


def signal_args(signals: ProducerSignals | None) -> tuple:
    """The kernels' seven protocol arguments (epoch, entry words, word table, status, source
    rank, row blocks per source, timeout), or placeholders without signals."""
    if signals is None:
        return (None, None, None, None, 0, 0, 0)
    return (signals.epoch, signals.enter, signals.word_table, signals.status,
            signals.source_rank, signals.readiness.max_row_blocks, signals.timeout_ns)


def epilogue_constants(plan: HeadPlan, qkv_bias, q_norm_weight, k_norm_weight, positions,
                       rope_style: str | int, signals: ProducerSignals | None,
                       block_m: int) -> dict:
    """The compile-time switches of ``producer_epilogue.deliver_tile`` for one launch
    (``block_m``: rows per readiness word)."""
    return dict(
        NUM_Q_HEADS=plan.num_q_heads, NUM_KV_HEADS=plan.num_kv_heads,
        Q_PER_RANK=plan.q_per_rank, KV_PER_RANK=plan.kv_per_rank,
        KV_REPLICAS=plan.kv_replicas, D=plan.head_dim,
        HAS_BIAS=qkv_bias is not None, HAS_Q_NORM=q_norm_weight is not None,
        HAS_K_NORM=k_norm_weight is not None, HAS_POSITIONS=positions is not None,
        ROPE_STYLE=_rope_code(rope_style), SIGNAL=signals is not None, READY_M=block_m,
        num_warps=_config.PRODUCER_NUM_WARPS)


def _nvmma_layout(rows: int, block_k: int):
    return gl.NVMMASharedLayout.get_default_for([rows, block_k], gl.bfloat16)


def choose_mainloop(mainloop: str | None, x: torch.Tensor, qkv_weight: torch.Tensor, d: int,
                    block_m: int, on_gpu: bool) -> str:
    """The mainloop to launch: ``mainloop`` checked, or the default (see the launcher)."""
    allowed = ["pointer"]
    if _config.INTERPRET or (on_gpu and _config.tma_supported(x.device.index)):
        allowed.append("tma")  # the interpreter emulates tensor descriptors
    if (qkv_produce_ws_kernel is not None and on_gpu and _config.wgmma_supported(x.device.index)
            and d in WS_HEAD_DIMS and block_m <= _config.PRODUCER_WS_CHUNK_M):
        allowed.append("warp_specialized")
    if mainloop is None:
        mainloop = _config.producer_mainloop(allowed, x.shape[0])
    elif mainloop not in allowed:
        raise ValueError(f"qkv_norm_rope_produce: mainloop must be one of {allowed} here "
                         f"(device {x.device}, head_dim {d}, block_m {block_m}), "
                         f"got {mainloop!r}")
    if mainloop != "pointer" and (x.data_ptr() % 16 or qkv_weight.data_ptr() % 16):
        raise ValueError(f"qkv_norm_rope_produce: the {mainloop!r} mainloop needs 16-byte "
                         "aligned x and qkv_weight (pass mainloop='pointer' for views at odd "
                         "offsets)")
    return mainloop


def _persistent_grid(rows: int, tile_rows: int, plan: HeadPlan, num_sms: int,
                     tile_heads: int = 1) -> tuple[int]:
    """One program per SM at most, and none without a tile (of ``tile_heads`` heads)."""
    return (min(triton.cdiv(rows, tile_rows) * (plan.total_heads // tile_heads), num_sms),)


def check_producer_inputs(x, qkv_weight, qkv_bias, q_norm_weight, k_norm_weight, cos_sin,
                          positions, plan, dest, dest_table, seq_local, dest_seq_offset, eps,
                          signals, bad_positions, block_m) -> None:
    """Raise ``TypeError``/``ValueError`` naming the argument unless the producer's inputs fit
    (both engines check with this)."""
    if not isinstance(plan, HeadPlan) or not isinstance(dest, DestLayout):
        raise TypeError("qkv_norm_rope_produce: plan must be a HeadPlan and dest a DestLayout, "
                        f"got {type(plan).__name__} and {type(dest).__name__}")
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError("qkv_norm_rope_produce: x must be a [rows, hidden] tensor, got "
                         f"{getattr(x, 'shape', type(x).__name__)}")
    rows, hidden = x.shape
    d, device = plan.head_dim, x.device
    if d not in HEAD_DIMS:
        raise ValueError(f"qkv_norm_rope_produce: head_dim must be one of {HEAD_DIMS}, got {d}")
    check = functools.partial(check_tensor, device=device, contiguous=True,
                              prefix="qkv_norm_rope_produce: ")
    bf16 = (torch.bfloat16,)
    check("x", x, dtypes=bf16, shape=(rows, hidden))
    check("qkv_weight", qkv_weight, dtypes=bf16, shape=(plan.total_heads * d, hidden))
    check("qkv_bias", qkv_bias, dtypes=bf16, shape=(plan.total_heads * d,), optional=True)
    check("q_norm_weight", q_norm_weight, dtypes=bf16, shape=(d,), optional=True)
    check("k_norm_weight", k_norm_weight, dtypes=bf16, shape=(d,), optional=True)
    check("positions", positions, dtypes=(torch.int32, torch.int64), shape=(rows,),
          optional=True)
    check("dest_table", dest_table, dtypes=(torch.int64,), shape=(plan.world_size,))
    if not isinstance(cos_sin, torch.Tensor) or cos_sin.dtype != torch.float32 \
            or cos_sin.dim() != 2 or cos_sin.shape[1] != d or cos_sin.stride(1) != 1:
        raise ValueError(f"qkv_norm_rope_produce: cos_sin must be fp32 [rows or max_pos, {d}] "
                         "with unit column stride, got "
                         f"{getattr(cos_sin, 'dtype', None)} {getattr(cos_sin, 'shape', None)}")
    if cos_sin.device != device:
        raise ValueError(f"qkv_norm_rope_produce: cos_sin is on {cos_sin.device}, "
                         f"expected {device}")
    if positions is None and cos_sin.shape[0] < rows:
        raise ValueError(f"qkv_norm_rope_produce: a per-token cos_sin needs >= {rows} rows, "
                         f"got {cos_sin.shape[0]}")
    if rows < 1 or seq_local < 1 or rows % seq_local != 0:
        raise ValueError(f"qkv_norm_rope_produce: rows ({rows}) must be a positive multiple of "
                         f"seq_local ({seq_local})")
    if not 0 <= dest_seq_offset <= dest.seq_len - seq_local:
        raise ValueError(f"qkv_norm_rope_produce: dest_seq_offset ({dest_seq_offset}) + "
                         f"seq_local ({seq_local}) must fit in dest.seq_len ({dest.seq_len})")
    if any(v % 8 for v in (*dest.region_offset, *dest.token_stride, *dest.head_stride)):
        raise ValueError("qkv_norm_rope_produce: dest offsets and strides must be multiples of "
                         f"8 elements (16-byte stores), got {dest}")
    if block_m not in (16, 32, 64, 128, 256):
        raise ValueError(f"qkv_norm_rope_produce: block_m must be a power of two in [16, 256], "
                         f"got {block_m}")
    if not eps > 0:
        raise ValueError(f"qkv_norm_rope_produce: eps must be > 0, got {eps}")
    if bad_positions is not None:
        check_int64_vector("qkv_norm_rope_produce: bad_positions", bad_positions, 1, device)
    if signals is not None:
        if not isinstance(signals, ProducerSignals):
            raise TypeError("qkv_norm_rope_produce: signals must be a ProducerSignals or None, "
                            f"got {type(signals).__name__}")
        signals.validate(plan, row_blocks=triton.cdiv(rows, block_m), device=device)


def qkv_norm_rope_produce(
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
    num_sms: int | None = None,
    mainloop: str | None = None,
    validate: bool = True,
) -> None:
    """Project, normalise and rotate this rank's tokens and store every head at its destinations.

    Parameters
    ----------
    x : Tensor
        bf16 ``[rows, hidden]``, contiguous; ``rows = B * S_local``, ``hidden`` a multiple of 16.
    qkv_weight : Tensor
        bf16 ``[(Hq + 2 * Hkv) * D, hidden]``, contiguous (``nn.Linear`` layout: Q, K, V heads).
    qkv_bias : Tensor or None
        bf16 ``[(Hq + 2 * Hkv) * D]``, added in fp32 before the norm.
    q_norm_weight, k_norm_weight : Tensor or None
        bf16 ``[D]``; None skips that kind's RMSNorm (RoPE then rotates the fp32 projection).
    cos_sin : Tensor
        fp32 ``[rows, D]`` (row ``m`` for source row ``m``) or ``[max_pos, D]`` with
        ``positions``; each row is ``cos`` of the ``D/2`` frequencies, then their ``sin``.
    positions : Tensor or None
        int32/int64 ``[B, S_local]`` (or ``[rows]``), contiguous; indices into ``cos_sin``.
    plan : HeadPlan
        Head split; ``plan.head_dim`` in ``HEAD_DIMS``.
    dest : DestLayout
        Layout of every destination buffer for this call (``seq_len`` = tokens per
        batch entry at the destination, ``W * S_local`` for the exchange).
    dest_table : Tensor
        int64 ``[W]``: byte address, as seen from this device, of each destination
        rank's bf16 buffer, 16-byte aligned.  Each buffer must hold every element
        ``dest`` addresses for this call; the kernel writes nothing else.
    seq_local : int
        ``S_local``: source row ``m`` is token ``m % S_local`` of batch entry ``m // S_local``.
    dest_seq_offset : int
        Where this rank's tokens start in a destination's batch entry (``source_rank * S_local``).
    eps : float
        RMSNorm epsilon.
    rope_style : str or int
        ``"interleaved"`` or ``"neox"``, or its code in ``norm_rope.ROPE_STYLES``.
    signals : ProducerSignals or None
        NVLink protocol state; None stores only (no wait, no readiness words).
    bad_positions : Tensor or None
        int64 ``[>= 1]``, device or pinned host memory: with ``positions``, each row of a
        Q or K tile whose position lies outside ``cos_sin``'s rows adds 1 to
        ``bad_positions[0]`` (the session reads it later without waiting for the GPU).
        Such a row reads nothing outside ``cos_sin`` and rotates by cos = sin = 0.
    block_m : int or None
        Rows per readiness word (a power of two in [16, 256]), default
        ``_config.PRODUCER_BLOCK_M``; the readiness layout and :func:`signals.wait_ready` must
        use the same.  The ``tl.dot`` mainloops take tiles of
        ``_config.producer_tile_m(D, block_m)`` rows, the warp-specialised one needs
        ``block_m <= 64``.
    num_sms : int or None
        Programs of the persistent grid; default the device's SM count.
    mainloop : str or None
        The GEMM mainloop (``MAINLOOPS``): ``"pointer"`` (pointer loads; any target and
        the CPU interpreter), ``"tma"`` (``tl.dot`` over tensor descriptors, sm_90+),
        ``"warp_specialized"`` (``producer_ws``: a TMA loader warp, two ``wgmma`` warpgroups
        and epilogue warps, sm_90 only, ``D`` of 64 or 128, ``block_m`` at most 64).  Default:
        ``_config.producer_mainloop`` of those the device and shape allow.  Both TMA
        mainloops need 16-byte aligned ``x`` and ``qkv_weight``.
    validate : bool
        Check every argument before launching (default).  The session passes False:
        it has checked the same tensors and built ``plan``, ``dest``, ``dest_table``
        and ``signals`` itself, and the checks cost about 20 us of host time a call.

    Runs on the current stream and allocates nothing; the host does not block.
    With ``signals``, a destination that has not entered the call within
    ``signals.timeout_ns`` gets no stores and is flagged in ``signals.status``.
    """
    if isinstance(positions, torch.Tensor) and positions.is_contiguous():
        positions = positions.view(-1)
    if block_m is None:
        block_m = _config.PRODUCER_BLOCK_M
    if validate:
        check_producer_inputs(x, qkv_weight, qkv_bias, q_norm_weight, k_norm_weight, cos_sin,
                              positions, plan, dest, dest_table, seq_local, dest_seq_offset,
                              eps, signals, bad_positions, block_m)
    rows, hidden = x.shape
    d = plan.head_dim
    block_k = _block_k(hidden)
    on_gpu = x.device.type == "cuda" and not _config.INTERPRET
    mainloop = choose_mainloop(mainloop, x, qkv_weight, d, block_m, on_gpu)
    if num_sms is None:
        num_sms = _sm_count(x.device.index) if on_gpu else _config.PRODUCER_INTERPRET_PROGRAMS
    epoch, enter, word_table, status, source_rank, max_row_blocks, timeout_ns = \
        signal_args(signals)
    args = (qkv_bias, q_norm_weight, k_norm_weight, cos_sin, positions, bad_positions,
            dest_table, epoch, enter, word_table, status,
            rows, cos_sin.stride(0), cos_sin.shape[0], eps, seq_local, dest.seq_len,
            dest_seq_offset,
            *dest.region_offset, *dest.token_stride, *dest.head_stride,
            source_rank, max_row_blocks, timeout_ns)
    constants = dict(HIDDEN=hidden, BLOCK_K=block_k,
                     **epilogue_constants(plan, qkv_bias, q_norm_weight, k_norm_weight,
                                          positions, rope_style, signals, block_m))
    if mainloop == "warp_specialized":
        head_pairs = d == 128 and plan.num_q_heads % 2 == 0 and plan.num_kv_heads % 2 == 0
        tile = _config.producer_ws_tile(rows, plan.total_heads, num_sms,
                                        q_norm_weight is not None and k_norm_weight is not None,
                                        head_pairs)
        w_rows = tile.heads * d
        x_desc = GluonTensorDescriptor.from_tensor(x, [tile.tile_m, block_k],
                                                   _nvmma_layout(tile.tile_m, block_k))
        w_desc = GluonTensorDescriptor.from_tensor(qkv_weight, [w_rows, block_k],
                                                   _nvmma_layout(w_rows, block_k))
        positions_a_group = _config.PRODUCER_WS_GROUP_HEADS // tile.heads
        qkv_produce_ws_kernel[_persistent_grid(rows, tile.tile_m, plan, num_sms, tile.heads)](
            x_desc, w_desc, *args, **{**constants, "num_warps": tile.epilogue_warps},
            GROUP_HEADS=min(positions_a_group, plan.total_heads // tile.heads),
            TILE_M=tile.tile_m, CHUNK_M=_config.PRODUCER_WS_CHUNK_M, NORM_IN_MMA=tile.norm_in_mma,
            STAGES=tile.stages, MMA_REGS=tile.mma_regs,
            LOADER_REGS=_config.PRODUCER_WS_LOADER_REGS, HEADS=tile.heads)
        return
    use_tma = mainloop == "tma"
    tile_m = _config.producer_tile_m(d, block_m)
    if use_tma:
        x_src = TensorDescriptor(x, list(x.shape), list(x.stride()), [tile_m, block_k])
        w_src = TensorDescriptor(qkv_weight, list(qkv_weight.shape), list(qkv_weight.stride()),
                                 [d, block_k])
    else:
        x_src, w_src = x, qkv_weight
    _qkv_produce_kernel[_persistent_grid(rows, tile_m, plan, num_sms)](
        x_src, w_src, *args, **constants, BLOCK_M=tile_m,
        GROUP_HEADS=min(_config.PRODUCER_GROUP_HEADS, plan.total_heads), USE_TMA=use_tma,
        INTERPRET=_config.INTERPRET, num_stages=_config.PRODUCER_NUM_STAGES)
