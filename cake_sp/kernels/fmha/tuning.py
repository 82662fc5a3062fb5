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
    8k-32k keys per program; two to eight splits there took 8-9 % less time on an
    H200, while bf16 KV gained nothing (docs/results/producer_and_fmha_sweeps_h200.md).
    """
    return 4096 if kv_element_size == 1 else None



def decode_block_n(kv_element_size: int, head_dim: int) -> int:
    """Keys per decode tile.  FP8 KV at D <= 128 reads 128 keys a step: as many
    bytes as 64 bf16 keys, and took 16-38 % less time than 64 on an H200
    (docs/results/producer_and_fmha_sweeps_h200.md)."""
    if INTERPRET:
        return 16
    return 128 if kv_element_size == 1 and head_dim <= 128 else 64


CONTEXT_BLOCK_M = 16 if INTERPRET else 128
CONTEXT_NUM_WARPS = 4 if INTERPRET else 8
CONTEXT_NUM_STAGES = 3
# K/V tiles by TMA wherever the cache layout allows (context.py); the CPU
# interpreter emulates the descriptors, so CI runs that path too.
CONTEXT_USE_TMA = True


def context_tma_available(device: torch.device) -> bool:
    """Whether the context kernel may read K/V tiles by TMA on ``device``."""
    if INTERPRET:
        return CONTEXT_USE_TMA
    return CONTEXT_USE_TMA and device.type == "cuda" and tma_supported(device.index)


def context_block_n(head_dim: int) -> int:
    """Keys per tile of the context kernel; D = 256 halves it to stay inside shared memory."""
    if INTERPRET:
        return 16
    return 32 if head_dim == 256 else 64


@functools.cache
def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (a nominal 4 for the CPU interpreter)."""
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count
