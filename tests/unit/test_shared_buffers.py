"""``cake_sp.session.shared``: one object per key, built by the first holder, closed by the
last; and the producer's cuBLAS workspace held that way."""

from __future__ import annotations

import pytest
import torch

from cake_sp.layouts import HeadPlan
from cake_sp.session import producer
from cake_sp.session.shared import hold_shared, release_shared


class _Closable:
    closed = 0

    def close(self) -> None:
        self.closed += 1


def test_one_object_per_key_closed_by_its_last_holder():
    first = hold_shared(("test", 1), _Closable)
    second = hold_shared(("test", 1), _Closable)
    other = hold_shared(("test", 2), _Closable)
    assert first is second and other is not first
    release_shared(first)
    assert first.closed == 0
    release_shared(second)
    assert first.closed == 1 and other.closed == 0
    again = hold_shared(("test", 1), _Closable)  # built anew once nobody held it
    assert again is not first
    for held in (again, other):
        release_shared(held)
    assert again.closed == other.closed == 1


def test_releasing_what_is_not_held_raises():
    with pytest.raises(ValueError, match="not held in common"):
        release_shared(_Closable())


def test_producers_of_one_size_hold_one_workspace():
    plan, cpu = HeadPlan(1, 2, 1, 16), torch.device("cpu")
    first, second = (producer.Producer("cublas", plan, max_tokens=5, device=cpu)
                     for _ in range(2))
    smaller = producer.Producer("cublas", plan, max_tokens=3, device=cpu)
    assert first.workspace is second.workspace
    assert tuple(first.workspace.shape) == (5, 64) and tuple(smaller.workspace.shape) == (3, 64)
    held = first.workspace
    for p in (first, second, smaller):
        p.close()
    assert first.workspace is None
    fresh = producer.Producer("cublas", plan, max_tokens=5, device=cpu)
    assert fresh.workspace is not held  # the last close let it go
    fresh.close()
