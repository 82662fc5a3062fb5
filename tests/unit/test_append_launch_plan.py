"""The append kernels' launch plan: a pure function of the shape (host only)."""

from __future__ import annotations

import pytest

from cake_sp.kernels import _config
from cake_sp.kernels.paged_append import launch_plan


@pytest.mark.parametrize("num_tokens,head_dim,want", [
    (1, 128, 1), (3, 128, 4), (32, 128, 8), (1024, 64, 16), (1024, 256, 4), (5, 64, 8)])
def test_tile_is_the_channel_budget_or_the_batch(num_tokens, head_dim, want):
    assert _config.append_block_m(num_tokens, head_dim) == want


def test_small_batches_take_more_warps():
    assert _config.append_num_warps(32, 10) == 4  # decode, (8, 1)
    assert _config.append_num_warps(128, 80) == 2  # decode B = 128, (64, 8)


@pytest.mark.parametrize("page_size,num_kv_heads,num_req,clear,programs", [
    (16, 1, 32, True, 1),      # the whole page (16 pairs) in one share
    (16, 8, 128, True, 1),     # small pages, many requests: one program for 128 pairs
    (16, 8, 32, True, 4),      # fewer requests: shares shrink to give 128 programs
    (16, 8, 2, True, 8),       # ... but never below APPEND_BLOCK_R pairs
    (16, 6, 32, True, 6),      # 96 pairs: shares of 16 give 32 requests 192 programs
    (64, 8, 32, True, 32),     # large pages: a program a chunk of APPEND_BLOCK_R pairs
    (128, 1, 32, True, 8),
    (256, 8, 128, True, 32),   # ... up to APPEND_MAX_CLEAR_PROGRAMS a request
    (256, 6, 4, True, 32),
    (5, 1, 32, True, 1),       # a share never below APPEND_BLOCK_R pairs
    (64, 8, 32, False, 1),     # no clear: one status program a request
])
@pytest.mark.parametrize("token_programs", [False, True])
def test_clear_programs(page_size, num_kv_heads, num_req, clear, programs, token_programs):
    plan = launch_plan(num_tokens=32, num_req=num_req, num_slots=10, num_kv_heads=num_kv_heads,
                       head_dim=128, page_size=page_size, max_pages=70, clear=clear,
                       token_programs=token_programs)
    assert plan["CLEAR_PROGRAMS"] == programs
    tiles = -(-32 // plan["BLOCK_M"]) * -(-10 // plan["BLOCK_S"])
    assert plan["grid"] == num_req * programs + tiles


@pytest.mark.parametrize("num_tokens,num_req,page_size,tiles_first", [
    (32, 32, 64, True),      # decode (8, 1), page 64: 1024 request programs, 32 token programs
    (32, 32, 16, False),     # page 16: 32 request programs (one 16-pair share each), 32 token
    (1024, 1, 64, False),    # one long prefill: 4 request programs, 1280 tile programs
])
def test_the_smaller_group_of_programs_goes_first(num_tokens, num_req, page_size, tiles_first):
    plan = launch_plan(num_tokens=num_tokens, num_req=num_req, num_slots=10, num_kv_heads=1,
                       head_dim=128, page_size=page_size, max_pages=70, clear=True,
                       token_programs=_config.append_token_programs(num_tokens, num_req))
    assert plan["TILES_FIRST"] is tiles_first


def test_scan_chunks_fit_the_tables():
    plan = launch_plan(num_tokens=64, num_req=5, num_slots=4, num_kv_heads=1, head_dim=128,
                       page_size=16, max_pages=3, clear=True, token_programs=False)
    assert (plan["CHUNK_B"], plan["NUM_B_CHUNKS"]) == (8, 1)
    assert (plan["CHUNK_P"], plan["NUM_P_CHUNKS"]) == (4, 1)
    plan = launch_plan(num_tokens=300, num_req=300, num_slots=4, num_kv_heads=1, head_dim=128,
                       page_size=16, max_pages=200, clear=True, token_programs=False)
    assert (plan["CHUNK_B"], plan["NUM_B_CHUNKS"]) == (128, 3)
    # The page check walks the slots 300 tokens can span (300 // 16 + 2), not the table.
    assert (plan["CHUNK_P"], plan["NUM_P_CHUNKS"]) == (32, 1)
    plan = launch_plan(num_tokens=300, num_req=3, num_slots=4, num_kv_heads=1, head_dim=128,
                       page_size=1, max_pages=32768, clear=True, token_programs=False)
    assert (plan["CHUNK_P"], plan["NUM_P_CHUNKS"]) == (64, 5)


@pytest.mark.parametrize("num_tokens,num_req,token_programs", [
    (32, 32, True),      # decode: one token a request, with or without QK norm
    (30, 32, True),      # no more tokens than requests (some append nothing)
    (33, 32, False),     # one request appends two
    (1024, 1, False),    # prefill
])
def test_token_programs_for_decode_batches(num_tokens, num_req, token_programs):
    assert _config.append_token_programs(num_tokens, num_req) is token_programs
    plan = launch_plan(num_tokens=num_tokens, num_req=num_req, num_slots=10, num_kv_heads=1,
                       head_dim=128, page_size=16, max_pages=70, clear=True,
                       token_programs=token_programs)
    assert plan["TOKEN_PROGRAMS"] is token_programs
    if token_programs:  # one token, a run of up to 16 slots (2048 channels) a program
        assert (plan["BLOCK_M"], plan["BLOCK_S"]) == (1, 16)
    else:
        assert (plan["BLOCK_M"], plan["BLOCK_S"]) == (
            _config.append_block_m(num_tokens, 128), 1)


@pytest.mark.parametrize("num_slots,head_dim,slots", [
    (10, 128, 16),   # (8, 1): one run of 16 slots
    (80, 128, 16),   # (64, 8): five runs
    (3, 128, 4),     # a small head count
    (48, 64, 32),    # D = 64 takes 32 slots
    (48, 256, 8),
])
def test_token_program_slots(num_slots, head_dim, slots):
    assert _config.append_slots_per_token(num_slots, head_dim) == slots


@pytest.mark.parametrize("num_tokens,num_slots,warps", [
    (256, 10, 4),    # D4: 2,560 rows
    (128, 80, 2),    # H3: 10,240 rows
])
def test_token_programs_take_the_tiles_warps(num_tokens, num_slots, warps):
    plan = launch_plan(num_tokens=num_tokens, num_req=num_tokens, num_slots=num_slots,
                       num_kv_heads=num_slots // 10, head_dim=128, page_size=64, max_pages=40,
                       clear=True, token_programs=True)
    assert plan["num_warps"] == warps == _config.append_num_warps(num_tokens, num_slots)
