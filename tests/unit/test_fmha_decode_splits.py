"""Decode launch choices, pure functions of the shape, dtypes and SM count (host only): the
split count, pipeline stages, register bound, fp16 dots and the combine kernel's columns."""

from __future__ import annotations

import pytest
import torch

from cake_sp.kernels.fmha import tuning

SMS = 132  # an H200: short splits fill 3 x 132 = 396 slots, long bf16 ones 4 x 132 = 528


@pytest.mark.parametrize("programs,tiles,want", [
    (8, 16, 16),      # B = 1, 8 KV heads, 1k keys: one tile a split, never more splits than tiles
    (8, 128, 43),     # 8k keys: 344 programs of 3 tiles fill the 396 slots of 3 an SM
    (8, 512, 64),     # 32k keys: 512 programs of 8 tiles fill the 528 slots of 4 an SM
    (32, 16, 8),      # B = 4, 1k keys: 256 programs of 2 tiles (16 would be 512 of 1)
    (32, 128, 16),    # B = 4, 8k keys: 512 programs of 8 tiles, 4 an SM
    (128, 128, 4),    # B = 16: 512 programs of 32 tiles, not 256 in a half-full wave
    (422, 512, 5),    # under 80 % of the long splits' wave
    (423, 512, 1),    # from 80 % of it (and of the short one's): unsplit
    (1, 4096, 61),    # capped at DECODE_MAX_SPLITS = 64: the fewest within 5 % of 64
])
def test_larger_of_the_short_and_long_wave_fills(programs, tiles, want):
    assert tuning.decode_num_splits(programs, tiles, tiles * 64, 2, SMS) == want


@pytest.mark.parametrize("programs,tiles,want", [
    (8, 256, 43),     # B = 1, 32k keys: FP8 splits shorter than 16 tiles stay at 3 an SM
    (32, 64, 11),     # B = 4, 8k keys: 352 programs of 6 tiles in the 396 short slots
    (128, 64, 3),     # B = 16, 8k keys: 384 programs of 22 tiles, 3 an SM
])
def test_fp8_long_splits_are_16_tiles(programs, tiles, want):
    assert tuning.decode_num_splits(programs, tiles, tiles * 128, 1, SMS) == want


@pytest.mark.parametrize("programs,tiles", [(8, 100), (8, 37), (128, 7), (3, 1000), (40, 65)])
def test_split_count_is_one_that_rounding_leaves(programs, tiles):
    """Every split but the last folds ceil(tiles / splits) tiles, so the count returned is
    the count the kernel launches: no split is left empty by rounding."""
    for kv_element_size in (1, 2):
        splits = tuning.decode_num_splits(programs, tiles, tiles * 64, kv_element_size, SMS)
        per = -(-tiles // splits)
        assert -(-tiles // per) == splits


def test_fp8_splits_are_at_most_4096_keys():
    # B = 64, 8 KV heads, 32k FP8 keys in 128-key tiles: the grid is full, yet 8 splits.
    assert tuning.decode_num_splits(512, 256, 32768, 1, SMS) == 8
    assert tuning.decode_num_splits(512, 256, 32768, 2, SMS) == 1
    # The bound never asks for more splits than tiles.
    assert tuning.decode_num_splits(512, 3, 40000, 1, SMS) == 3


def test_fp8_register_bound_keeps_three_programs_an_sm():
    regs = tuning.decode_max_registers(1, 128)
    per_sm = tuning.decode_programs_per_sm(1)
    assert regs % 8 == 0 and per_sm * regs * 128 <= 65536 < per_sm * (regs + 8) * 128
    assert tuning.decode_max_registers(2, 128) is None
    assert tuning.decode_max_registers(1, 256) is None


@pytest.mark.parametrize("batch,keys,element_size,want", [
    (16, 1024, 2, 2),     # bf16 from 16 requests, any length
    (256, 8192, 2, 2),
    (8, 32768, 2, 3),     # fewer requests keep 3
    (1, 1024, 1, 3),
    (16, 1024, 1, 3),     # FP8 batches of few keys keep 3
    (16, 4096, 1, 2),     # FP8 from 4k keys
    (64, 32768, 1, 2),
])
def test_decode_stages_by_batch_and_keys(batch, keys, element_size, want):
    assert tuning.decode_num_stages(batch, keys, element_size) == want


@pytest.mark.parametrize("query_dtype,element_size,want", [
    (torch.bfloat16, 1, True),    # FP8 KV under a bf16 query: fp16 dots
    (torch.float16, 1, False),    # an fp16 query's dots are fp16 already
    (torch.bfloat16, 2, False),   # 16-bit KV: the query's own dtype
    (torch.float16, 2, False),
])
def test_fp16_dots_only_for_fp8_kv_under_bf16_queries(query_dtype, element_size, want):
    assert tuning.fp16_dots(query_dtype, element_size) is want


@pytest.mark.parametrize("block_s,head_dim,want", [
    (2, 128, 128),    # few splits: a whole row in one program
    (32, 128, 128),   # 4096 values
    (64, 128, 64),    # the most splits: two programs a row
    (64, 256, 64),
    (16, 64, 64),
])
def test_combine_columns_bound_the_values_a_program_loads(block_s, head_dim, want):
    block_d = tuning.decode_combine_block_d(block_s, head_dim)
    assert block_d == want and head_dim % block_d == 0
    assert block_s * block_d <= tuning.DECODE_COMBINE_VALUES
