"""The comm benchmarks' host-side pieces: run order, profiler-trace splitting, rows."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "comm"))

from _harness import (  # noqa: E402
    counterbalanced_order,
    launch_skew,
    split_samples,
    union_length,
)
from rows import catalogue, select_rows  # noqa: E402


def test_counterbalanced_order_mirrors_and_rotates():
    order = counterbalanced_order(["A", "B", "C"], rounds=3)
    names = [n for _, n in order]
    assert names[:6] == ["A", "B", "C", "C", "B", "A"]
    assert names[6:12] == ["B", "C", "A", "A", "C", "B"]
    assert [k for k, _ in order] == [0] * 6 + [1] * 6 + [2] * 6
    assert {n: names.count(n) for n in "ABC"} == {"A": 6, "B": 6, "C": 6}
    # Every arm opens one round.
    assert {names[6 * k] for k in range(3)} == {"A", "B", "C"}


def test_union_length_counts_overlap_once():
    assert union_length([]) == 0
    assert union_length([(0, 2), (1, 3), (5, 6)]) == 4
    assert union_length([(0, 10), (2, 3)]) == 10


def test_split_samples_uses_markers_and_ignores_what_lies_outside():
    begin = ("void at::native::vectorized_elementwise_kernel<4, at::native::"
             "bitwise_not_kernel_cuda(at::TensorIteratorBase&)::{lambda(int)#1}>")
    end = ("void at::native::vectorized_elementwise_kernel<4, at::native::BinaryFunctor<int, "
           "int, int, at::native::BitwiseAndFunctor<int>>>")
    events = [
        ("flush", 0, 5), ("nccl_allreduce_sync", 5, 6), (begin, 6, 7),
        ("gemm", 8, 18), ("nccl_all_to_all", 12, 20),  # overlapped on two streams
        (end, 21, 22), ("flush", 23, 28),
        (begin, 29, 30), ("kernel", 31, 33), ("kernel", 35, 36), (end, 37, 38),
    ]
    assert split_samples(list(reversed(events))) == [12, 3]


def test_launch_skew_is_the_spread_of_arrivals_per_sample():
    ms = 1_000_000
    assert launch_skew([[5 * ms, 100, 7 * ms], [1 * ms, 100, 9 * ms]]) == pytest.approx(
        [4.0, 0.0, 2.0])
    with pytest.raises(ValueError):
        launch_skew([[5, 1], [1]])


@pytest.mark.parametrize("events", [
    [("bitwise_not_kernel_cuda", 0, 1), ("k", 2, 3)],
    [("BitwiseAndFunctor<int>", 0, 1)],
    [("bitwise_not_kernel_cuda", 0, 1), ("bitwise_not_kernel_cuda", 2, 3)],
])
def test_split_samples_refuses_unpaired_markers(events):
    with pytest.raises(RuntimeError, match="marker"):
        split_samples(events)


def test_rows_catalogue_and_selection():
    rows = catalogue(8)
    assert len([n for n in rows if not n.startswith("tiny")]) == 4 * 6 + 6
    row = rows["h4096_q32kv8_s32k"]
    assert (row.hidden, row.num_q_heads, row.num_kv_heads, row.seq_global) == (4096, 32, 8,
                                                                               32768)
    assert row.invalid_reason(8) is None
    # Per rank: 2 * S_local * hidden * (Hq + 2 Hkv) * D FLOPs; bf16 band bytes to W - 1 peers.
    assert row.gemm_flops(8) == 2 * 4096 * 4096 * 48 * 128
    assert row.bytes_out(8) == 2 * 4096 * (4 + 2 * 1) * 128 * 7
    assert [r.name for r in select_rows("tiny,h3072_s4k,tiny", 2)] == ["tiny", "tiny_gqa",
                                                                       "h3072_s4k"]
    assert len(select_rows("full", 4)) == 30
    with pytest.raises(ValueError, match="valid: presets"):
        select_rows("h4096_s3k", 2)


@pytest.mark.parametrize("world", [2, 4, 8])
def test_tiny_rows_are_valid_at_every_world_size(world):
    for row in select_rows("tiny", world):
        assert row.invalid_reason(world) is None
