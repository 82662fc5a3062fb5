"""Launch heuristics of the paged FMHA Triton routes.

Kept apart from the kernels (and from the manifest's kernel sources) so that
tuning a block size never touches the math.  Values are for Hopper (H200);
the CPU interpreter uses the smallest legal tiles because it runs every
program of a grid one after the other.
"""

from __future__ import annotations

import functools

import torch

from cake_sp.kernels._config import INTERPRET, tma_supported, wave_fill

# Decode packs the GQA group x q_len_per_req query rows of one KV head into one
# tile; tl.dot needs at least 16 rows, and past 64 rows a tile no longer fits
# the register budget at D = 256, so wider problems take the compat route.
DECODE_MIN_ROWS = 16
DECODE_MAX_ROWS = 64
# 8 warps ran 35-40 % slower with FP8 KV and up to 33 % with bf16 (sweep 3).
DECODE_NUM_WARPS = 4
# Pipeline stages of the partial kernel's K/V loads (decode_num_stages).
DECODE_NUM_STAGES = 3
DECODE_WIDE_NUM_STAGES = 2
DECODE_WIDE_MIN_BATCH = 16
DECODE_WIDE_FP8_MIN_KEYS = 4096
# The warp-specialised Gluon kernel (decode_ws.py) for every bf16 call it serves: its ring of
# K/V slots and its register bound, which lets 3 programs of 5 warps share an SM (2 stages:
# 66 KiB of shared memory each).  On an H200 (bf16, GQA 32/8 and 64/8, pages of 64, equal
# lengths) it took B = 16-256 with 8k-32k keys from 0.94-0.99x cuDNN's speed (the split Triton
# kernels) to 0.97-1.01x, B = 16 with 1k keys from 0.82-0.85x to 1.00x, and B = 1 from
# 0.94-0.98x to 0.95-1.02x; 2 ring stages beat 3 and 4 by 1-4 % (docs/results.md).
DECODE_WARP_SPECIALIZED = True
DECODE_WS_STAGES = 2
DECODE_WS_MAX_REGISTERS = 128
# Grids of too few (request, KV head) programs split until they fill this many programs an SM
# (decode_ws_splits): one.  Its loader keeps an SM's share of HBM busy alone; on an H200 (GQA
# 32/8 and 64/8, B = 1 and 4, 1k-32k keys) filling 1 took 0.90-1.01x the time of filling 3 and
# 0.97-1.01x that of filling 2 (docs/results.md).
DECODE_WS_FILL_PROGRAMS_PER_SM = 1
# Most keys one program of decode_ws folds (decode_ws_splits).  A persistent grid giving every
# SM an equal share of all (request, KV head)'s tiles, which needs no such bound, ran 1.25-1.28x
# faster with one long request among short ones but at 0.79-1.01x the split grid's speed on
# equal lengths (docs/results.md, "A persistent stream-K decode grid"): not used.
DECODE_WS_SPLIT_KEYS = 4096
# Split-KV (decode_num_splits).
DECODE_MAX_SPLITS = 64
# Partial values one combine program loads at once (decode_combine_block_d).
DECODE_COMBINE_VALUES = 4096
# A split count is good enough when its last wave is at least this fraction as full as the
# best count's: the fewest splits within 5 % of the best fill.  (FlashAttention-2 takes 85 %,
# which here chose 7 splits of 32 programs over 8 and took 1.12-1.14x the time.)
DECODE_WAVE_FILL_MARGIN = 0.95
# A grid this full of (request, KV head) programs already runs unsplit.
DECODE_FULL_GRID = 0.8
# Short splits fill waves of this many programs an SM (latency: many short loops in flight):
# 3 rather than 2 took B = 1 from 0.95 to 0.96x cuDNN's speed (geometric mean, bf16, 1k-32k
# keys, GQA 32/8 and 64/8 on an H200) and FP8 from 1.12 to 1.15x (docs/results.md).
DECODE_SHORT_SPLIT_PROGRAMS_PER_SM = 3


def decode_programs_per_sm(kv_element_size: int) -> int:
    """Partial-kernel programs one SM holds at once at D = 128 (4 warps; ptxas for sm_90a):
    bf16 KV 112-124 registers a thread, 4 programs; FP8 KV 168 (``decode_max_registers``), 3."""
    return 3 if kv_element_size == 1 else 4


def decode_long_split_tiles(kv_element_size: int) -> int:
    """Fewest key tiles of a split that fills every program slot of an SM: bf16 4 tiles (256
    keys), FP8 16 (2,048 keys).  The FP8 kernel is bound by its arithmetic (each key
    converted), not its bytes: while it converted to bf16, FP8 splits of 4 tiles filling 3
    programs an SM took 1.08-1.16x the time of these at B = 1 and 4 with 8k-32k keys on an
    H200; with fp16 dots (``fp16_dots``) splits of 4 or 8 tiles were within 1 % of 16
    (docs/results.md)."""
    return 16 if kv_element_size == 1 else 4


def decode_max_registers(kv_element_size: int, head_dim: int) -> int | None:
    """``maxnreg`` of the partial kernel, or None for ptxas's own count.

    FP8 KV at D = 128: 168, the most with which 3 programs of 4 warps share an SM's 65,536
    registers.  Every variant takes 168 by itself but the one that finalises a group of 8
    heads (176, so 2 programs an SM); bounded (at 160 in that sweep), that variant took
    0.89x its time at B = 256, 1k keys, GQA 64/8 on an H200 (docs/results.md)."""
    return 168 if kv_element_size == 1 and head_dim == 128 else None


def decode_max_split_keys(kv_element_size: int) -> int | None:
    """Most keys one split may fold, or None for no bound beyond the wave rule.

    FP8 KV: 4096.  At B = 64 with 8 KV heads the wave rule leaves one split of
    8k-32k keys per program; two to eight splits there took 8-11 % less time on
    an H200, 2048 keys lost 5 % at B = 16, and bf16 KV gained nothing
    (docs/results/producer_and_fmha_sweeps_h200.md, sweep 4).
    """
    return 4096 if kv_element_size == 1 else None


@functools.lru_cache(maxsize=4096)
def _fewest_filling_splits(programs: int, key_tiles: int, slots: int, min_tiles: int,
                           max_splits: int, full_grid: float, margin: float) -> int:
    """The fewest splits, of at least ``min_tiles`` key tiles each and at most
    ``max_splits``, whose grid of ``programs * splits`` fills waves of ``slots`` programs
    within ``margin`` of the fullest candidate; one split when the programs alone fill
    ``full_grid`` of a wave.

    Every split but the last folds ``ceil(key_tiles / splits)`` tiles, so only the counts
    that rounding leaves distinct are candidates, and the count returned is the one
    launched.  Cached: a decode call's host work stays about a microsecond (the scan
    over up to 64 counts takes about 60)."""
    def rounded(splits: int) -> int:
        return -(-key_tiles // -(-key_tiles // splits))

    if programs >= full_grid * slots:
        return 1
    counts = {rounded(s) for s in range(1, max(1, min(key_tiles // min_tiles, max_splits)) + 1)}
    fills = {n: wave_fill(programs * n, 1, 1, slots) for n in counts}
    best = max(fills.values())
    return min(n for n, fill in fills.items() if fill >= margin * best)


def decode_num_splits(programs: int, key_tiles: int, max_kv_len: int, kv_element_size: int,
                      num_sms: int) -> int:
    """Splits of each (request, KV head) program's keys in a decode call.

    ``programs`` = B x Hkv, ``key_tiles`` the key tiles of the longest request.  The
    larger of two wave fills (``_fewest_filling_splits``): splits of any length filling
    ``DECODE_SHORT_SPLIT_PROGRAMS_PER_SM`` programs an SM, and splits of at least
    ``decode_long_split_tiles`` tiles filling all ``decode_programs_per_sm`` of them: few
    keys want many short loops in flight, many keys every slot busy (B in {1, 4, 16} x
    {1k, 8k, 32k} keys on an H200, docs/results.md).  At least what
    ``decode_max_split_keys`` asks for, at most ``DECODE_MAX_SPLITS``.
    """
    knobs = (DECODE_MAX_SPLITS, DECODE_FULL_GRID, DECODE_WAVE_FILL_MARGIN)
    short = _fewest_filling_splits(programs, key_tiles,
                                   DECODE_SHORT_SPLIT_PROGRAMS_PER_SM * num_sms, 1, *knobs)
    long = _fewest_filling_splits(programs, key_tiles,
                                  decode_programs_per_sm(kv_element_size) * num_sms,
                                  decode_long_split_tiles(kv_element_size), *knobs)
    splits = max(short, long)
    max_keys = decode_max_split_keys(kv_element_size)
    if max_keys is not None:
        bound = min(key_tiles, DECODE_MAX_SPLITS, -(-max_kv_len // max_keys))
        splits = max(splits, -(-key_tiles // -(-key_tiles // bound)))
    return splits


def decode_ws_splits(programs: int, key_tiles: int, max_kv_len: int, num_sms: int) -> int:
    """Splits of each (request, KV head) in a ``decode_ws`` call of ``programs`` = B x Hkv
    programs over ``key_tiles`` tiles of the longest request: the more of two counts.

    * As few as keep every split within ``DECODE_WS_SPLIT_KEYS`` keys.  The plan sees only
      the longest request, and an unsplit long request among short ones is one SM's work
      while the others idle.  On an H200 (bf16, GQA 32/8, B = 16-64, up to 32k keys) splits of
      at most 4,096 keys took 0.16-0.87x the split Triton kernels' time on batches of random
      lengths or one long request among short ones, where one split took 0.46-1.26x and
      splits of 8,192 keys 0.20-1.07x; on batches of equal lengths they took 1.02-1.03x one
      split's time (docs/results.md).
    * One when the programs alone fill ``DECODE_FULL_GRID`` of the SMs (a program keeps its
      SM's share of HBM busy: more splits there took 1-4 % longer), else the fewest that fill
      ``DECODE_WS_FILL_PROGRAMS_PER_SM`` programs an SM (B = 1 with 8 KV heads: 16 splits).
    """
    bounded = -(-max_kv_len // DECODE_WS_SPLIT_KEYS)
    filling = 1
    if programs < DECODE_FULL_GRID * num_sms:
        filling = _fewest_filling_splits(programs, key_tiles,
                                         DECODE_WS_FILL_PROGRAMS_PER_SM * num_sms, 1,
                                         DECODE_MAX_SPLITS, 1.0, DECODE_WAVE_FILL_MARGIN)
    return max(1, bounded, filling)


def decode_num_stages(batch: int, max_kv_len: int, kv_element_size: int) -> int:
    """Pipeline stages of the decode partial kernel: ``DECODE_WIDE_NUM_STAGES`` (2) for batches
    of at least ``DECODE_WIDE_MIN_BATCH`` requests (FP8 KV: of at least
    ``DECODE_WIDE_FP8_MIN_KEYS`` keys too), else ``DECODE_NUM_STAGES`` (3).

    On an H200 (GQA 32/8 and 64/8, D = 128, pages of 64), 2 stages took 0.98-1.00x the time
    of 3 on every bf16 row from B = 16 (1k-32k keys) and 0.95-1.00x on the FP8 rows from
    B = 16 with 8k-32k keys, in two runs; below 16 requests, and on FP8 batches of 1k keys,
    neither count won every row (0.95-1.04x), so those keep 3 (docs/results.md)."""
    wide = batch >= DECODE_WIDE_MIN_BATCH and (kv_element_size == 2
                                               or max_kv_len >= DECODE_WIDE_FP8_MIN_KEYS)
    return DECODE_WIDE_NUM_STAGES if wide else DECODE_NUM_STAGES


def fp16_dots(query_dtype: torch.dtype, kv_element_size: int) -> bool:
    """Whether the decode and context dots take fp16 operands: FP8 KV under a bf16 query.  An e4m3
    value converts to fp16 (exactly) in one instruction for two, to bf16 only through fp16
    again per value; on an H200 those conversions ran at a quarter of the integer rate and
    held the FP8 kernel to about half the bf16 one's bandwidth.  Q is scaled into fp16's
    range first (``tiles.query_operand``), and P rounds to fp16, 3 bits finer than bf16."""
    return kv_element_size == 1 and query_dtype == torch.bfloat16


def decode_combine_block_d(block_s: int, head_dim: int) -> int:
    """Columns of one combine program (a power of two dividing ``head_dim``): its
    ``block_s`` partials of them at once are at most ``DECODE_COMBINE_VALUES`` fp32 values,
    32 a thread of 4 warps (``DECODE_MAX_SPLITS`` <= 64 leaves at least 64 columns)."""
    return max(1, min(head_dim, DECODE_COMBINE_VALUES // block_s))


def decode_block_n(kv_element_size: int, head_dim: int) -> int:
    """Keys per decode tile.  FP8 KV at D <= 128 reads 128 keys a step: as many
    bytes as 64 bf16 keys, and took 16-38 % less time than 64 on an H200
    (docs/results/producer_and_fmha_sweeps_h200.md); with fp16 dots 64 keys still took
    1.04-1.24x the time on 11 of 12 rows (docs/results.md)."""
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


# FP8 caches reach the warp-specialised kernel through a bf16 copy in the workspace
# (fp8_staging.py) from this many query tokens a request (max_q_len): the copy moves every
# key the requests own, whatever their query count.  On an H200 (GQA 32/8, page 64) the
# staged call took 0.33-0.78x the tl.dot kernel's time at 64-1024 query tokens (B = 1 with
# 4k and 32k keys, B = 8 with 4k); fewer were not measured.
CONTEXT_FP8_STAGE_MIN_Q_LEN = 64


def context_fp8_staged(max_q_len: int, batch: int, chunk_q_heads: int, chunks: int,
                       num_sms: int) -> bool:
    """Whether a context call over an FP8 cache takes the staged route: at least
    ``CONTEXT_FP8_STAGE_MIN_Q_LEN`` query tokens, and when the KV heads go in ``chunks``
    (one after another, ``chunk_q_heads`` query heads each), a chunk's programs (``batch``
    requests of up to ``max_q_len`` tokens in 128-row blocks) fill every SM once.  At 4k
    tokens on an H200 (GQA 32/8), chunks of one KV head (128 programs) took 1.13x the tl.dot
    kernel's time, chunks of two (256) 0.64x; every chunk size took 0.57x at 16k and 64k."""
    programs = batch * chunk_q_heads * -(-max_q_len // 128)
    return max_q_len >= CONTEXT_FP8_STAGE_MIN_Q_LEN and (chunks == 1 or programs >= num_sms)


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
