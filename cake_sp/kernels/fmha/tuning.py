"""Launch heuristics of the paged FMHA Triton routes.

Kept apart from the kernels (and from the manifest's kernel sources) so that
tuning a block size never touches the math.  Values are for Hopper (H200);
the CPU interpreter uses the smallest legal tiles because it runs every
program of a grid one after the other.
"""

from __future__ import annotations

import functools

import torch

from cake_sp.kernels._config import INTERPRET, tma_supported

# Decode packs the GQA group x q_len_per_req query rows of one KV head into one
# tile; tl.dot needs at least 16 rows, and past 64 rows a tile no longer fits
# the register budget at D = 256, so wider problems take the compat route.
DECODE_MIN_ROWS = 16
DECODE_MAX_ROWS = 64
# 8 warps ran 35-40 % slower with FP8 KV and up to 33 % with bf16 (sweep 3).
DECODE_NUM_WARPS = 4
DECODE_NUM_STAGES = 3
# Split-KV: aim for this many programs per SM so that small batches still fill
# the GPU, but never split finer than one key tile per split.  On an H200, 4, 8
# and 16 were at best 1 % faster than 2 for bf16 KV and up to 70 % slower (B = 1).
DECODE_PROGRAMS_PER_SM = 2
DECODE_MAX_SPLITS = 64


def decode_max_split_keys(kv_element_size: int) -> int | None:
    """Most keys one split may fold, or None for no bound beyond the programs-per-SM rule.

    FP8 KV: 4096.  At B = 64 with 8 KV heads the rule above leaves one split of
    8k-32k keys per program; two to eight splits there took 8-11 % less time on
    an H200, 2048 keys lost 5 % at B = 16, and bf16 KV gained nothing
    (docs/results/producer_and_fmha_sweeps_h200.md, sweep 4).
    """
    return 4096 if kv_element_size == 1 else None



def decode_block_n(kv_element_size: int, head_dim: int) -> int:
    """Keys per decode tile.  FP8 KV at D <= 128 reads 128 keys a step: as many
    bytes as 64 bf16 keys, and took 16-38 % less time than 64 on an H200
    (docs/results/producer_and_fmha_sweeps_h200.md)."""
    if INTERPRET:
        return 16
    return 128 if kv_element_size == 1 and head_dim <= 128 else 64


# K/V tiles by TMA wherever the cache layout allows (context.py); the CPU
# interpreter emulates the descriptors, so CI runs that path too.
CONTEXT_USE_TMA = True


# The warp-specialised Gluon kernel (context_ws.py) for the calls it serves on sm_90.  Causal,
# GQA 32/8, D = 128 on an H200, T = 4k-64k: 423-492 TFLOP/s against 414-470 for the tl.dot
# kernel in one run, before its two consumer partitions took it to 530-609 (docs/results.md,
# "Two consumer partitions").  Tests switch it off to reach the tl.dot kernel on those calls.
CONTEXT_WARP_SPECIALIZED = True
# context_ws's grid goes query block first from requests of this many query tokens, so the
# programs in flight share one K/V head's keys in L2.  On an H200 (same section; one causal
# sequence, GQA 32/8) that took 0.92-0.97x the time of request x head first at 16k-64k tokens
# and 1.08x at 4k (8k not measured).
CONTEXT_QBLOCK_MAJOR_MIN_Q_LEN = 16384


def context_tma_available(device: torch.device) -> bool:
    """Whether the context kernel may read K/V tiles by TMA on ``device``."""
    if INTERPRET:
        return CONTEXT_USE_TMA
    return CONTEXT_USE_TMA and device.type == "cuda" and tma_supported(device.index)


def context_block_n(head_dim: int, page_size: int) -> int:
    """Keys per tile of the context kernel.

    64, or 32 on 32-key pages so that a tile stays inside one page (one page
    lookup, TMA): 386 against 314 TFLOP/s for 64-key tiles gathered key by key,
    causal T = 16384 on an H200.  D = 256 takes 32 to stay inside shared memory.
    """
    if INTERPRET:
        return 16
    if head_dim == 256 or (page_size % 64 and page_size % 32 == 0):
        return 32
    return 64


def context_launch(head_dim: int, block_n: int, tma: bool) -> tuple[int, int, int]:
    """``(BLOCK_M, num_warps, num_stages)`` of the context kernel.

    With TMA at D <= 128: 128 query rows on one warpgroup (4 warps) for 64-key
    tiles, 472 TFLOP/s against 358 on two warpgroups (causal T = 16384, page 64,
    an H200); 64 rows for 32-key tiles.  Pointer loads and D = 256 keep 128
    rows on 8 warps, which spill least there (D = 256 is not measured).
    Sweeps: docs/results/producer_and_fmha_sweeps_h200.md.
    """
    if INTERPRET:
        return 16, 4, 3
    if head_dim == 256 or not tma:
        return 128, 8, 3
    return (128 if block_n == 64 else 64), 4, 3


@functools.cache
def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (a nominal 4 for the CPU interpreter)."""
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count
