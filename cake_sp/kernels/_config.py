"""Launch heuristics and compile-time switches shared by the Triton kernels.

Kept apart from the kernels so that tuning a block size never touches the math.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

# Triton's CPU interpreter (``TRITON_INTERPRET=1``) computes wrongly on bf16
# values and truncates on fp32 -> bf16 casts; kernels take this flag as a
# ``tl.constexpr`` and, when it is set, upcast right after loading and round
# to bf16 by hand (see ``norm_rope.round_to_bf16``).  On a GPU it is False and
# the kernels keep bf16 operands for the tensor cores.
INTERPRET: bool = os.environ.get("TRITON_INTERPRET", "0") == "1"


def plain_torch(device: torch.device) -> bool:
    """Whether code on ``device`` runs the plain-PyTorch path instead of Triton kernels: a
    CPU without Triton's interpreter."""
    return device.type == "cpu" and not INTERPRET


def require_triton_device(what: str, device: torch.device) -> None:
    """Raise ``RuntimeError`` unless Triton kernels can run on ``device``: a CUDA GPU, or the
    CPU with Triton's interpreter, which must be chosen before Triton is first imported."""
    if plain_torch(device):
        raise RuntimeError(
            f"{what} runs Triton kernels, which on the CPU need Triton's interpreter: set "
            "TRITON_INTERPRET=1 in the environment before cake_sp (or triton) is first "
            "imported, e.g. `TRITON_INTERPRET=1 torchrun ...`")


@functools.cache
def tma_supported(device_index: int) -> bool:
    """Whether GPU ``device_index`` has the tensor memory accelerator (sm_90+)."""
    return torch.cuda.get_device_capability(device_index)[0] >= 9


@functools.cache
def wgmma_supported(device_index: int) -> bool:
    """Whether GPU ``device_index`` runs Hopper's warpgroup MMA (sm_90 exactly)."""
    return torch.cuda.get_device_capability(device_index)[0] == 9


# -- signals.py ---------------------------------------------------------------
# Polls a spin makes in the interpreter before it reports a timeout: there the
# programs of every virtual rank run one after another, so a word that is not
# there at the first poll never comes.
SPIN_POLLS_INTERPRET: int = 4
# Readiness words one wait program polls at once, and its warps.
WAIT_BLOCK: int = 1024
WAIT_NUM_WARPS: int = 4

# -- band_push.py ------------------------------------------------------------
# Rows per tile of the band push (one head of D columns: 16 KiB of bf16 at D = 128) and
# its warps; the consumers' row-block readiness words count these rows.
BAND_PUSH_BLOCK_M: int = 64
BAND_PUSH_NUM_WARPS: int = 4
# A consumer of a band exchange on NVLink (the o_proj GEMM; the front end's backward kernel
# and dX GEMM) takes the rows in up to this many chunks, each behind a wait for its row
# blocks, so that the first chunk's work runs while later rows still arrive; calls below
# BAND_CHUNK_MIN_ROWS rows a chunk take one chunk.
BAND_CHUNKS: int = 4
BAND_CHUNK_MIN_ROWS: int = 1024

# -- front_end_backward.py ----------------------------------------------------
# Rows per program (one head of D columns): the six fp32 [BLOCK_M, D] tiles of the norm
# backward stay in registers at 4 warps.
FRONT_END_BACKWARD_BLOCK_M: int = 32
FRONT_END_BACKWARD_NUM_WARPS: int = 4

# -- producer.py --------------------------------------------------------------
# Rows per tile: see producer_block_m.  Readiness words are kept per row block,
# so the session builds its ReadinessLayout with the block_m it launches with.
# Reduction step of the GEMM mainloop (the largest of these dividing hidden).
PRODUCER_BLOCK_K_CHOICES: tuple[int, ...] = (64, 32, 16)
PRODUCER_NUM_WARPS: int = 8
# Four stages of a 256 x 64 + 128 x 64 bf16 tile pair (192 KiB) fit sm_90's shared
# memory; on an H200 they took 3-13 % less time than three on 5 of 6 sweep rows and
# 3 % more on the sixth (hidden 8192, 65536 rows; docs/results/producer_and_fmha_sweeps_h200.md).
PRODUCER_NUM_STAGES: int = 4
# Heads per tile group: tiles walk the row blocks of GROUP_HEADS heads before
# moving to the next group, so the weights of a group stay in L2 while the
# row blocks stream past; within a group consecutive tiles go to different heads.
PRODUCER_GROUP_HEADS: int = 16
# Grid of the persistent producer in the interpreter (no SMs to count there).
PRODUCER_INTERPRET_PROGRAMS: int = 2
# Mainloops in order of preference; the launcher takes the first the device and the
# head size allow (producer.MAINLOOPS says what each needs).
PRODUCER_MAINLOOPS: tuple[str, ...] = ("tma", "pointer")
# The session's producer engine per call shape (session/producer.py): rows of
# ``(most rows, engine)`` looked up in order by the call's rows (``B * S_local``); the last
# row takes every larger call.  On an H200 (docs/results.md, "Producer engines"; hidden
# 3072-8192, GQA 8 K/V heads, D = 128) the cuBLAS engine took 0.76-0.99x the fused
# kernel's time at 512 rows, and 1.01-1.14x at 2,048 rows and more.
PRODUCER_ENGINE_TABLE: tuple[tuple[int, str], ...] = ((512, "cublas"), (2**62, "fused"))


def producer_engine(rows: int, on_gpu: bool) -> str:
    """The engine for a session call of ``rows`` rows (the CPU interpreter: the fused one)."""
    if not on_gpu:
        return "fused"
    for most_rows, engine in PRODUCER_ENGINE_TABLE:
        if rows <= most_rows:
            return engine
    return PRODUCER_ENGINE_TABLE[-1][1]


# The warp-specialised kernel (producer_ws.py).  Its epilogue works in 64-row chunks,
# each a readiness row block (the launcher's block_m).  Two tile shapes:
# * fp32 hand-off (any norm setting): 128-row tiles, one wgmma warpgroup; ring slots
#   of a 128 x 64 + D x 64 bf16 block pair (4 x 32 KiB at D = 128) beside the 64 KiB
#   fp32 tile; 168 MMA registers leave 152 to 8 epilogue warps, no spills (sm_90a,
#   ptxas).  On an H200 (sweep 7) 8 heads per tile group took 1-11 % less time than
#   16; 5 stages, 3 stages and two MMA warpgroups of 64 rows took more.
# * norm in the MMA warps (both norm weights given, PRODUCER_WS_NORM_IN_MMA): 256-row
#   tiles, two warpgroups, a bf16 hand-off (64 KiB) beside 3 ring slots of 48 KiB;
#   168 MMA registers leave 136 to 4 epilogue warps, no spills.  On an H200 (sweep 8 of
#   docs/results/producer_and_fmha_sweeps_h200.md) 0.88-1.01x the TMA mainloop's time at
#   2,048 rows and more, 1.05-1.20x at 512: not yet the default.
PRODUCER_WS_CHUNK_M: int = 64
PRODUCER_WS_NORM_IN_MMA: bool = True


@dataclass(frozen=True)
class WsTile:
    """One tile shape of the warp-specialised producer (see above): rows per tile, ring
    slots, MMA warps and their register budget, and the epilogue partition's warps."""

    tile_m: int
    stages: int
    mma_warps: int
    mma_regs: int
    epilogue_warps: int


PRODUCER_WS_TILE = WsTile(tile_m=128, stages=4, mma_warps=4, mma_regs=168, epilogue_warps=8)
PRODUCER_WS_NORM_TILE = WsTile(tile_m=256, stages=3, mma_warps=8, mma_regs=168,
                               epilogue_warps=4)
PRODUCER_WS_LOADER_REGS: int = 40
PRODUCER_WS_GROUP_HEADS: int = 8

# -- paged KV-cache append (qk_rope_append.py, qk_rope_fp8_append.py) --
# Every program scans q_indptr itself; a chunk of up to 128 int32 keeps that scan to
# a few vector loads for serving batch sizes.
APPEND_CHUNK_B: int = 128
# Page-table entries one request program checks per step.
APPEND_CHUNK_P: int = 64
# (row, kv head) pairs a request program zeroes per step when clearing a last page.
APPEND_BLOCK_R: int = 16


# Launch shapes of the append kernels, chosen on an H200 from a sweep over the rows of
# the FlashInfer comparison (docs/results.md: block of 4/8/16 tokens x 1/2/4/8 warps,
# clear shares of 16-256 pairs); each choice below was within 1-4 % (geometric mean) of
# the best per row, where single samples vary by up to 10 %.
# A tile program holds 1024 channels of one head: 8 tokens at D = 128.
APPEND_TILE_CHANNELS: int = 1024
# Up to this many (token, head) rows in the batch, 4 warps (8 values a thread: more
# programs in flight for small decode batches); above it, 2 warps (16 a thread).
APPEND_SMALL_BATCH_ROWS: int = 4096


def append_block_m(num_tokens: int, head_dim: int) -> int:
    """Tokens per tile program: ``APPEND_TILE_CHANNELS / head_dim``, and no more than
    the batch needs (a power of two)."""
    cap = max(1, APPEND_TILE_CHANNELS // head_dim)
    block = 1
    while block < min(num_tokens, cap):
        block *= 2
    return block


def append_num_warps(num_tokens: int, num_slots: int) -> int:
    """Warps of every program of one append launch (``num_slots = Hq + 2 Hkv``)."""
    return 4 if num_tokens * num_slots <= APPEND_SMALL_BATCH_ROWS else 2


def append_clear_pairs(page_size: int, num_kv_heads: int) -> int:
    """``(row, kv head)`` pairs of a last page one request program clears (a multiple of
    ``APPEND_BLOCK_R``): a page's tail is split over ``ceil(page_size * Hkv / this)``
    programs.  Pages under 64 rows leave short tails, and a share that finds no row
    to clear still costs a program: one program takes up to 128 pairs.  Larger pages
    leave long tails on average, spread in shares of 32 pairs (several kv heads) or
    64 (one)."""
    if page_size < 64:
        return 128
    return 32 if num_kv_heads > 1 else 64


def producer_block_m(head_dim: int, mainloop: str | None = None) -> int:
    """Rows per producer tile (one head of ``head_dim`` columns) for ``mainloop``.

    The warp-specialised mainloop takes ``PRODUCER_WS_CHUNK_M``.  The others:

    256 rows with ``D <= 128``: a 256 x 128 tile reads 25 % fewer operand bytes
    per FLOP than a 128 x 128 one; with four stages it took the producer on an
    H200 from 460-510 to 530-666 TFLOP/s (docs/results.md).  ``D = 256`` takes
    64 rows, the largest tile whose epilogue does not spill.  The CPU
    interpreter takes 128, so small tests stay one tile and fast.
    """
    if mainloop == "warp_specialized":
        return PRODUCER_WS_CHUNK_M
    if INTERPRET:
        return 128
    return 64 if head_dim > 128 else 256
