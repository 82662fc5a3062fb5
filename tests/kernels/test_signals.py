"""Entry barrier and readiness wait (``kernels/signals.py``) on W in-process virtual ranks.

Readiness words are written by hand here (``tests/kernels/test_producer.py``
covers them as the producer raises them), so each test pins down one rule of
the protocol: epochs grow on the device, a word counts only when it has
reached the current epoch, words past the call's row blocks are ignored, and
a wait that cannot complete stops and names the missing sources.
"""

from __future__ import annotations

import time

import pytest
import torch

from cake_sp.kernels.signals import (
    STATUS_READY_TIMEOUT,
    barrier_arrive,
    wait_ready,
)
from cake_sp.layouts import ReadinessLayout

HEADS_PER_RANK = 6
MAX_ROW_BLOCKS = 5


def _ranks(world: int, device: torch.device) -> dict:
    def zeros(n):
        return [torch.zeros(n, dtype=torch.int64, device=device) for _ in range(world)]

    enter = zeros(world)
    return dict(epoch=zeros(1), enter=enter, status=zeros(1 + world),
                enter_table=torch.tensor([t.data_ptr() for t in enter], dtype=torch.int64,
                                         device=device))


@pytest.mark.parametrize("world", [2, 4, 8])
def test_barrier_arrive_bumps_epoch_and_tells_every_rank(world, device):
    ranks = _ranks(world, device)
    for call in (1, 2, 3):
        for r in range(world):
            barrier_arrive(ranks["epoch"][r], ranks["enter_table"], source_rank=r)
        for r in range(world):
            assert ranks["epoch"][r].item() == call
            assert ranks["enter"][r].cpu().tolist() == [call] * world


def test_barrier_arrive_of_one_rank_reaches_only_its_word(device):
    ranks = _ranks(4, device)
    barrier_arrive(ranks["epoch"][2], ranks["enter_table"], source_rank=2)
    for r in range(4):
        assert ranks["enter"][r].cpu().tolist() == [0, 0, 1, 0]
    assert [e.item() for e in ranks["epoch"]] == [0, 0, 1, 0]


def _words(world: int, row_blocks: int, epoch: int, device: torch.device
           ) -> tuple[ReadinessLayout, torch.Tensor]:
    """A rank's words after every source raised ``row_blocks`` row blocks at ``epoch``,
    with older epochs in the row blocks past the call."""
    readiness = ReadinessLayout(world, MAX_ROW_BLOCKS, HEADS_PER_RANK)
    words = torch.full((world, MAX_ROW_BLOCKS, HEADS_PER_RANK), epoch - 1, dtype=torch.int64)
    words[:, :row_blocks] = epoch
    return readiness, words.view(-1).to(device)


@pytest.mark.parametrize("world, row_blocks", [(2, 1), (4, 3), (8, 5)])
def test_wait_ready_passes_when_every_word_arrived(world, row_blocks, device):
    readiness, words = _words(world, row_blocks, epoch=3, device=device)
    epoch = torch.full((1,), 3, dtype=torch.int64, device=device)
    status = torch.zeros(1 + world, dtype=torch.int64, device=device)
    wait_ready(epoch, words, status, readiness=readiness, row_blocks=row_blocks,
               timeout_ns=10**9)
    assert not status.any()


@pytest.mark.parametrize("stale", [(1, 0, 0), (2, 2, 5), (3, 1, 3)])
def test_wait_ready_names_each_source_whose_words_are_stale(stale, device):
    """One word of source ``s`` (row block ``b``, head ``h``) still holds the previous epoch."""
    world, row_blocks = 4, 3
    readiness, words = _words(world, row_blocks, epoch=7, device=device)
    source, block, head = stale
    words[readiness.index(source, block, head)] = 6
    words[readiness.index(0, 0, 0)] = 9  # a word ahead of the epoch counts as arrived
    epoch = torch.full((1,), 7, dtype=torch.int64, device=device)
    status = torch.zeros(1 + world, dtype=torch.int64, device=device)
    start = time.monotonic()
    wait_ready(epoch, words, status, readiness=readiness, row_blocks=row_blocks,
               timeout_ns=10**7)
    flags = status.cpu().tolist()
    assert time.monotonic() - start < 60
    expected = [0] * (1 + world)
    expected[0] = expected[1 + source] = STATUS_READY_TIMEOUT
    assert flags == expected


def test_status_flags_accumulate(device):
    readiness, words = _words(2, 1, epoch=1, device=device)
    words.zero_()
    epoch = torch.ones(1, dtype=torch.int64, device=device)
    status = torch.zeros(3, dtype=torch.int64, device=device)
    for _ in range(2):
        wait_ready(epoch, words, status, readiness=readiness, row_blocks=1, timeout_ns=10**6)
    assert status.cpu().tolist() == [STATUS_READY_TIMEOUT] * 3


@pytest.mark.parametrize("call, error, match", [
    (lambda r, d: barrier_arrive(r["epoch"][0].int(), r["enter_table"], source_rank=0),
     ValueError, "epoch"),
    (lambda r, d: barrier_arrive(r["epoch"][0], r["enter_table"], source_rank=2),
     ValueError, "source_rank"),
    (lambda r, d: barrier_arrive(r["epoch"][0], r["enter_table"].tolist(), source_rank=0),
     TypeError, "enter_table"),
    (lambda r, d: wait_ready(r["epoch"][0], torch.zeros(3, dtype=torch.int64, device=d),
                             r["status"][0], readiness=ReadinessLayout(2, 2, 2),
                             row_blocks=1, timeout_ns=1), ValueError, "words"),
    (lambda r, d: wait_ready(r["epoch"][0], torch.zeros(8, dtype=torch.int64, device=d),
                             r["status"][0], readiness=ReadinessLayout(2, 2, 2),
                             row_blocks=3, timeout_ns=1), ValueError, "row_blocks"),
    (lambda r, d: wait_ready(r["epoch"][0], torch.zeros(8, dtype=torch.int64, device=d),
                             r["status"][0][:2], readiness=ReadinessLayout(2, 2, 2),
                             row_blocks=1, timeout_ns=1), ValueError, "status"),
    (lambda r, d: wait_ready(r["epoch"][0], torch.zeros(8, dtype=torch.int64, device=d),
                             r["status"][0], readiness=ReadinessLayout(2, 2, 2),
                             row_blocks=1, timeout_ns=-1), ValueError, "timeout_ns"),
])
def test_rejects_bad_arguments(call, error, match, device):
    with pytest.raises(error, match=match):
        call(_ranks(2, device), device)


@pytest.mark.gpu
def test_wait_timeout_is_bounded_in_wall_time(device):
    """On a GPU a missing word costs about ``timeout_ns``, not a hang."""
    readiness, words = _words(8, 5, epoch=2, device=device)
    words[readiness.index(5, 4, 5)] = 1
    epoch = torch.full((1,), 2, dtype=torch.int64, device=device)
    status = torch.zeros(9, dtype=torch.int64, device=device)
    wait_ready(epoch, words, status, readiness=readiness, row_blocks=5, timeout_ns=10**6)
    torch.cuda.synchronize()
    start = time.monotonic()
    wait_ready(epoch, words, status, readiness=readiness, row_blocks=5, timeout_ns=2 * 10**8)
    torch.cuda.synchronize()
    elapsed = time.monotonic() - start
    assert 0.15 < elapsed < 5, elapsed
    assert status.cpu().tolist() == [1, 0, 0, 0, 0, 0, 1, 0, 0]
