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
# Rows per readiness word: the launchers' default ``block_m`` and the session's, whose
# consumers wait for row blocks of this many rows.  It is the warp-specialised kernel's
# epilogue chunk (PRODUCER_WS_CHUNK_M), so one readiness layout serves every mainloop and
# engine: a tile of more rows (producer_tile_m) raises one word per block it holds.
PRODUCER_BLOCK_M: int = 64
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
# Mainloops in order of preference; the launcher takes the first the device, the head
# size and the call allow (producer.MAINLOOPS says what each needs; producer_mainloop).
PRODUCER_MAINLOOPS: tuple[str, ...] = ("warp_specialized", "tma", "pointer")
# The warp-specialised mainloop by default only from this many rows.  On an H200 with its
# tiles chosen by wave fill (producer_ws_tile), at 1,024 rows it took 0.77-1.00x the TMA
# mainloop's time (hidden 3072-8192, both norms; the TMA kernel 1 % ahead on hidden 6144) and
# at 512 rows 0.81-1.23x (TMA faster on 3 of 4); from 2,048 rows it is faster on every row
# (docs/results.md, "Head pairs at the session's shapes").
PRODUCER_WS_MIN_ROWS: int = 1024
# The session's producer engine per call shape (session/producer.py, producer_engine).  Above
# PRODUCER_CUBLAS_MAX_ROWS rows the fused kernel; up to it, the fused kernel only when its
# persistent grid's (row block, head) tiles fill their last wave of SMs to PRODUCER_FUSED_MIN_FILL
# or more, else the cuBLAS engine.  On an H200 (docs/results.md, "Head pairs at the session's
# shapes"; hidden 3072-8192, 8 K/V heads, D = 128, 132 SMs) this rule's pick was within 2 % of
# the fastest engine on 18 of 20 rows of 512 to 2,048 rows: cuBLAS at fills of 0.61-0.81,
# the fused kernel at 0.91-0.97, which at 1,536 rows of hidden 8192 (fill 0.91) was 3-6 %
# slower than cuBLAS; at 1,536 rows of hidden 4096 (fill 0.73) cuBLAS was 11 % faster, and at
# 2,048 rows the fused kernel won every row, 0.81 fills included.
PRODUCER_CUBLAS_MAX_ROWS: int = 1536
PRODUCER_FUSED_MIN_FILL: float = 0.9
# The cuBLAS engine's epilogue kernel (producer_cublas.py): values of its fp32 projection tile
# per program (rows x D; at least a readiness word's rows) and its warps.  On an H200
# (docs/results.md, "Tiles by wave fill") 64 x 128 values at 8 warps took 0.88-0.95x the time
# of the fused kernel's 256 x 128 tile, the engine's tile until then, on all 15 rows (512 to
# 16,384 rows); 64 x 128 at 4 warps took 1.01-1.05x, 128 x 128 at 4 or 8 warps 1.02-1.12x.
PRODUCER_EPILOGUE_TILE_VALUES: int = 64 * 128
PRODUCER_EPILOGUE_NUM_WARPS: int = 8


# Overrides of the engine choice and of the default mainloop, for tests and tuning, read
# once from the environment (spawned ranks inherit them): CAKE_SP_PRODUCER_ENGINE ("fused"
# or "cublas") replaces producer_engine's choice for a session built with engine="auto";
# CAKE_SP_PRODUCER_MAINLOOP (a name in producer.MAINLOOPS) is the default mainloop wherever
# the device and the call allow it.
PRODUCER_ENGINE_OVERRIDE: str | None = os.environ.get("CAKE_SP_PRODUCER_ENGINE") or None
PRODUCER_MAINLOOP_OVERRIDE: str | None = os.environ.get("CAKE_SP_PRODUCER_MAINLOOP") or None


def producer_engine(rows: int, total_heads: int, head_dim: int, num_sms: int,
                    on_gpu: bool) -> str:
    """The engine (``"fused"`` or ``"cublas"``) for a session call of ``rows`` rows of
    ``total_heads = Hq + 2 * Hkv`` heads of ``head_dim`` on a GPU of ``num_sms`` SMs (the
    CPU interpreter: the fused one); see ``PRODUCER_CUBLAS_MAX_ROWS``."""
    if not on_gpu or rows > PRODUCER_CUBLAS_MAX_ROWS:
        return "fused"
    fill = wave_fill(rows, producer_tile_m(head_dim, PRODUCER_BLOCK_M), total_heads, num_sms)
    return "fused" if fill >= PRODUCER_FUSED_MIN_FILL else "cublas"


def wave_fill(rows: int, tile_rows: int, total_heads: int, num_sms: int) -> float:
    """How full a persistent grid's waves of (``tile_rows`` row block, head) tiles are: the
    tiles over ``num_sms`` times the waves (1.0: every wave full; 0.55: the last one about
    a tenth full of two)."""
    tiles = -(-rows // tile_rows) * total_heads
    return tiles / (-(-tiles // num_sms) * num_sms)


# The warp-specialised kernel (producer_ws.py): two MMA warpgroups (a partition each, taking
# half of every tile's rows), a one-warp TMA loader, and an epilogue partition working in
# 64-row chunks, each one readiness word of PRODUCER_BLOCK_M rows or several.  Two tile shapes:
# * fp32 hand-off (any norm setting): 128-row tiles (64 rows a warpgroup); ring slots
#   of a 128 x 64 + D x 64 bf16 block pair (4 x 32 KiB at D = 128) beside the 64 KiB
#   fp32 tile; 104 MMA registers leave 132 to 8 epilogue warps, no spills (sm_90a,
#   ptxas).  8 heads per tile group (sweep 7 of docs/results/producer_and_fmha_sweeps_h200.md).
# * norm in the MMA warps (both norm weights given, PRODUCER_WS_NORM_IN_MMA): 256-row
#   tiles, a bf16 hand-off (64 KiB) beside 3 ring slots of 48 KiB; 168 MMA registers
#   leave 136 to 4 epilogue warps, no spills.
# On an H200 (docs/results.md, "The warp-specialised producer as the default") the
# 256-row kernel took 1.02-1.35x cuBLAS's time at 2,048 rows and more (geometric mean
# 1.13 over 30 rows), where the TMA mainloop took 1.10-1.39x (1.18).
PRODUCER_WS_CHUNK_M: int = 64
PRODUCER_WS_NORM_IN_MMA: bool = True


@dataclass(frozen=True)
class WsTile:
    """One tile shape of the warp-specialised producer (see above): rows per tile, ring
    slots, the register budget of each of its two MMA warpgroups, the epilogue
    partition's warps, whether the MMA warps normalise and hand over bf16, and the heads a
    tile holds (2: adjacent heads of one kind, one a warpgroup)."""

    tile_m: int
    stages: int
    mma_regs: int
    epilogue_warps: int
    norm_in_mma: bool
    heads: int = 1


PRODUCER_WS_TILE = WsTile(tile_m=128, stages=4, mma_regs=104, epilogue_warps=8,
                          norm_in_mma=False)
PRODUCER_WS_NORM_TILE = WsTile(tile_m=256, stages=3, mma_regs=168, epilogue_warps=4,
                               norm_in_mma=True)
# The same operand bytes, registers and shared memory as the 256-row tile, as 128 rows of two
# adjacent heads: the epilogue loads each row's RoPE table entries once for both heads (Q/K
# pairs), which halves the table reads, about 5 % of the mainloop's bytes at hidden 3072.
# D = 128, even Q and K/V head counts.  On an H200 (docs/results.md, "Head pairs" and "Head
# pairs at the session's shapes") it took 0.96-0.98x the 256-row tile's time in back-to-back
# calls and 0.97-0.99x under do_bench's flushed replays on 8 of 8 rows of a second A/B; its
# epilogue spills 8-380 bytes a thread (ptxas), which the halved table reads more than pay
# for: each head loading its own entries (no spills) took 1.00-1.03x the shared loads' time.
PRODUCER_WS_PAIR_TILE = WsTile(tile_m=128, stages=3, mma_regs=168, epilogue_warps=4,
                               norm_in_mma=True, heads=2)
PRODUCER_WS_HEAD_PAIRS: bool = True
# With both norm weights, the 256-row tile unless the 128-row one fills the persistent grid's
# waves (wave_fill) better by more than this.  On an H200 (docs/results.md, "Tiles by wave
# fill") the 128-row tile took 0.79-0.88x the 256-row one's time on the 5 rows where its fill
# was higher by 0.16-0.24 (512 to 2,048 rows), and 0.95-1.08x on the 10 where the fills were
# within 0.02.  Against the head-pair tile (docs/results.md, "Head pairs at the session's
# shapes") the 128-row tile took 0.78-0.95x its time on the 6 rows of 1,024-2,048 rows where
# the rule picks it.
PRODUCER_WS_FILL_MARGIN: float = 0.1
PRODUCER_WS_LOADER_REGS: int = 40
# Heads a tile group (4 pairs for the head-pair tile).  With pairs on an H200, groups of 4
# heads took 1.01-1.07x the time of 8, groups of 16 0.96-1.04x (within a round's noise on
# most rows, slower at hidden 8192): docs/results.md, "Head pairs at the session's shapes".
PRODUCER_WS_GROUP_HEADS: int = 8


def producer_ws_tile(rows: int, total_heads: int, num_sms: int, both_norms: bool,
                     head_pairs: bool = False) -> WsTile:
    """The warp-specialised kernel's tile for a call of ``rows`` rows of ``total_heads`` heads
    on ``num_sms`` SMs: the fp32 hand-off's 128 rows, or with ``both_norms`` (and
    ``PRODUCER_WS_NORM_IN_MMA``) the 256-row tile (the head-pair tile where ``head_pairs``
    says the shape allows it and ``PRODUCER_WS_HEAD_PAIRS``) unless 128-row tiles fill the
    waves better (``PRODUCER_WS_FILL_MARGIN``)."""
    if not (both_norms and PRODUCER_WS_NORM_IN_MMA):
        return PRODUCER_WS_TILE
    norm_tile = (PRODUCER_WS_PAIR_TILE if head_pairs and PRODUCER_WS_HEAD_PAIRS
                 else PRODUCER_WS_NORM_TILE)
    big, small = (wave_fill(rows, tile.tile_m, total_heads // tile.heads, num_sms)
                  for tile in (norm_tile, PRODUCER_WS_TILE))
    return PRODUCER_WS_TILE if small > big + PRODUCER_WS_FILL_MARGIN else norm_tile

# -- paged KV-cache append (qk_rope_append.py, qk_rope_fp8_append.py) --
# Every program scans q_indptr itself; a chunk of up to 128 int32 keeps that scan to
# a few vector loads for serving batch sizes.
APPEND_CHUNK_B: int = 128
# Page-table entries one request program checks per step.
APPEND_CHUNK_P: int = 64
# (row, kv head) pairs a request program zeroes per step when clearing a last page.
APPEND_BLOCK_R: int = 16
# Request programs below which small pages' clear shares shrink (append_clear_programs).
APPEND_MIN_REQUEST_PROGRAMS: int = 128
# Clear programs a request gets at most (append_clear_programs): what pages of 64 rows at
# Hkv = 8 get in chunks of APPEND_BLOCK_R.  Uncapped, pages of 256 rows took 128 a request,
# and 128 decode requests (64, 8) ran 1.6-2.3x their time at pages of 16 per byte moved.
# With the tail's chunks dealt out: 0.92-0.96x at this cap, 1.24x at 16 and 1.48x at 8
# (BF16; an H100, docs/results.md): fewer programs each run more masked steps.
APPEND_MAX_CLEAR_PROGRAMS: int = 32


# Launch shapes of the append kernels, chosen on an H200 from sweeps over the rows of
# the FlashInfer comparison (docs/results.md: block of 4/8/16 tokens x 1/2/4/8 warps;
# clear shares of 8-128 pairs x the order of the two kinds of programs); each choice
# below was within 1-4 % (geometric mean) of the best per row, where single samples
# vary by up to 5-10 %.
# A tile program holds 1024 channels of one head: 8 tokens at D = 128.
APPEND_TILE_CHANNELS: int = 1024
# Up to this many (token, head) rows in the batch, 4 warps (8 values a thread: more
# programs in flight for small decode batches); above it, 2 warps (16 a thread).
APPEND_SMALL_BATCH_ROWS: int = 4096
# A token program (decode batches) holds up to 2048 channels of one token: 16 heads at
# D = 128.  Its warps follow append_num_warps, as a tile program's do: on an H200, 2 warps
# took 0.94-0.98x the time of 4 on H3 (128 requests, (64, 8): 10,240 rows), and from 0.98x
# (D4, pages of 64) to 1.18x on the smaller decode batches (no QK norm).
APPEND_TOKEN_CHANNELS: int = 2048


def _power_of_two_block(count: int, cap: int) -> int:
    """The smallest power of two covering ``min(count, cap)`` (at least 1)."""
    block = 1
    while block < min(count, cap):
        block *= 2
    return block


def append_block_m(num_tokens: int, head_dim: int) -> int:
    """Tokens per tile program: ``APPEND_TILE_CHANNELS / head_dim``, and no more than
    the batch needs (a power of two)."""
    return _power_of_two_block(num_tokens, max(1, APPEND_TILE_CHANNELS // head_dim))


def append_num_warps(num_tokens: int, num_slots: int) -> int:
    """Warps of every program of one append launch (``num_slots = Hq + 2 Hkv``), tiles of
    tokens or token programs."""
    return 4 if num_tokens * num_slots <= APPEND_SMALL_BATCH_ROWS else 2


def append_token_programs(num_tokens: int, num_requests: int) -> bool:
    """Whether a BF16 append launch runs token programs (one token, ``append_slots_per_token``
    head slots) instead of tiles of ``append_block_m`` tokens of one slot: decode batches (no
    more tokens than requests, where a token's request is its own index), with and without QK
    norm.  Without norm, on an H200, token programs took 0.92-0.97x the tiles' time on 7 of the
    10 decode rows of the FlashInfer comparison (0.99-1.05x on the other three).  With RMSNorm
    they lost (0.98-1.11x) while the token program's rows crossed shared memory; with the rows
    kept in their load layout, on an H100 they took 0.95-1.01x the tiles' time on the 10 decode
    rows with norm (geometric mean over all 36 rows 0.898 against 0.907 ours / FlashInfer;
    docs/results.md).  The FP8 kernel runs tiles only (token programs took 1.05x there)."""
    return num_tokens <= num_requests


def append_slots_per_token(num_slots: int, head_dim: int) -> int:
    """Head slots of one token a token program holds: ``APPEND_TOKEN_CHANNELS`` channels,
    and no more than the token has (a power of two)."""
    return _power_of_two_block(num_slots, max(1, APPEND_TOKEN_CHANNELS // head_dim))


def append_clear_programs(page_size: int, num_kv_heads: int, num_requests: int) -> int:
    """Request programs a request gets: each validates, and clears its share of the unused
    rows of the request's last page, the chunks of ``APPEND_BLOCK_R`` ``(row, kv head)``
    pairs of that tail dealt out in turn (``paged_append.clear_rows``).

    Pages of 64 rows and more leave long tails on average: a program a chunk of a full
    page, so that enough stores are in flight, but no more than
    ``APPEND_MAX_CLEAR_PROGRAMS``.  Smaller pages leave short tails: a program for up to
    128 pairs of a page, more (shares of down to ``APPEND_BLOCK_R`` pairs) where the batch
    would otherwise have fewer than ``APPEND_MIN_REQUEST_PROGRAMS`` request programs (a few
    requests' tails are not left to a few programs).  A program whose share of a shorter
    tail is empty stops once it has read the tables.
    """
    page_pairs = page_size * num_kv_heads
    if page_size >= 64:
        return min(-(-page_pairs // APPEND_BLOCK_R), APPEND_MAX_CLEAR_PROGRAMS)
    pairs = 128
    while pairs > APPEND_BLOCK_R and (
            num_requests * -(-page_pairs // pairs) < APPEND_MIN_REQUEST_PROGRAMS):
        pairs //= 2
    return -(-page_pairs // pairs)


def append_tiles_first(tile_programs: int, request_programs: int) -> bool:
    """Whether an append grid puts its tile programs before its request programs: the
    smaller group goes first, so that its programs do not start behind the other's."""
    return tile_programs < request_programs


def producer_mainloop(allowed: tuple[str, ...] | list[str], rows: int) -> str:
    """The default mainloop for a call of ``rows`` rows, among the ``allowed`` ones (what the
    device and the call's shape permit): the first of ``PRODUCER_MAINLOOPS``, the
    warp-specialised one only from ``PRODUCER_WS_MIN_ROWS`` rows; ``PRODUCER_MAINLOOP_OVERRIDE``
    where it is allowed."""
    if PRODUCER_MAINLOOP_OVERRIDE in allowed:
        return PRODUCER_MAINLOOP_OVERRIDE
    for mainloop in PRODUCER_MAINLOOPS:
        if mainloop in allowed and (mainloop != "warp_specialized"
                                    or rows >= PRODUCER_WS_MIN_ROWS):
            return mainloop
    raise ValueError(f"producer_mainloop: none of {PRODUCER_MAINLOOPS} is in {list(allowed)}")


def producer_tile_m(head_dim: int, block_m: int) -> int:
    """Rows per tile (one head of ``head_dim`` columns) of the ``tl.dot`` producer kernel and
    of the cuBLAS engine's epilogue, at least the ``block_m`` rows of a readiness word.

    256 rows with ``D <= 128``: a 256 x 128 tile reads 25 % fewer operand bytes
    per FLOP than a 128 x 128 one; with four stages it took the producer on an
    H200 from 460-510 to 530-666 TFLOP/s (docs/results.md).  ``D = 256`` takes
    64 rows, the largest tile whose epilogue does not spill.  The CPU
    interpreter takes 128, so small tests stay one tile and fast.
    """
    if INTERPRET:
        return max(128, block_m)
    return max(64 if head_dim > 128 else 256, block_m)


def producer_epilogue_tile_m(head_dim: int, block_m: int) -> int:
    """Rows per program of the cuBLAS engine's epilogue: ``PRODUCER_EPILOGUE_TILE_VALUES``
    values of one head, and at least the ``block_m`` rows of a readiness word."""
    return max(PRODUCER_EPILOGUE_TILE_VALUES // head_dim, block_m)
