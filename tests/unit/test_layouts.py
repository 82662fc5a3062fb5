"""Host-only checks of the head plan, destination layouts and readiness-word layout."""

from __future__ import annotations

import itertools

import pytest

from cake_sp.layouts import (
    KIND_K,
    KIND_Q,
    KIND_V,
    DestLayout,
    HeadPlan,
    ReadinessLayout,
)


@pytest.mark.parametrize("world,hq,hkv", [(2, 4, 4), (4, 32, 8), (8, 32, 8), (8, 16, 2),
                                          (8, 8, 1), (4, 8, 2), (2, 2, 1)])
def test_every_destination_receives_exactly_its_band(world, hq, hkv):
    plan = HeadPlan(world, hq, hkv, 128)
    received = {(r, kind): [] for r in range(world) for kind in (KIND_Q, KIND_K, KIND_V)}
    for head in range(plan.total_heads):
        for rank, kind, local in plan.destinations(head):
            within_kind = head - (0, hq, hq + hkv)[kind]
            received[(rank, kind)].append((local, within_kind))
    group = hq // hkv
    for rank in range(world):
        q_band = list(range(rank * hq // world, (rank + 1) * hq // world))
        kv_band = sorted({h // group for h in q_band})  # what the rank's Q heads attend with
        assert sorted(received[(rank, KIND_Q)]) == list(enumerate(q_band))
        for kind in (KIND_K, KIND_V):
            assert sorted(received[(rank, kind)]) == list(enumerate(kv_band))
            assert list(plan.source_heads(rank, kind)) == kv_band
        assert plan.heads_per_rank == len(q_band) + 2 * len(kv_band)


@pytest.mark.parametrize("world,hq,hkv,message", [
    (4, 6, 6, "divisible by the world size"),
    (4, 8, 3, "multiple of num_kv_heads"),
    (4, 12, 3, "split or replicate"),
    (8, 24, 12, "split or replicate"),
    (0, 8, 8, "world_size must be a positive int"),
])
def test_impossible_head_splits_are_rejected(world, hq, hkv, message):
    with pytest.raises(ValueError, match=message):
        HeadPlan(world, hq, hkv, 128)


def test_fused_layout_needs_equal_head_counts_and_unknown_layouts_fail():
    with pytest.raises(ValueError, match="num_q_heads == num_kv_heads"):
        DestLayout.for_layout(HeadPlan(2, 4, 2, 128), "fused", token_capacity=4, seq_len=4)
    with pytest.raises(ValueError, match="layout must be one of"):
        DestLayout.for_layout(HeadPlan(2, 4, 4, 128), "sbhd", token_capacity=4, seq_len=4)


def test_readiness_words_are_distinct_and_in_range():
    plan = HeadPlan(4, 8, 2, 128)
    layout = ReadinessLayout.for_plan(plan, max_tokens=300, block_m=128)
    assert layout.max_row_blocks == 3
    indices = [layout.index(s, b, h) for s, b, h in itertools.product(
        range(4), range(layout.max_row_blocks), range(plan.heads_per_rank))]
    assert sorted(indices) == list(range(layout.words))
