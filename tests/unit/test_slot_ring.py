"""``SlotRing``: a slot is handed out again only when neither a lease nor a live view of
what it lent pins it, and a refused call leaves the ring where it was."""

import pytest
import torch

from cake_sp.session.slots import SlotInUseError, SlotRing

REMEDY = "give the caller a slot of its own"


def _ring(num_slots: int) -> SlotRing:
    return SlotRing.local(24, num_slots, torch.device("cpu"), what="test ring")


def test_lent_slot_held_while_any_view_lives():
    ring = _ring(1)
    slot = ring.advance()
    buffer = ring.buffer(slot)
    buffer.copy_(torch.randn(24))
    lent = ring.lend(slot, buffer[4:16].view(3, 4), remedy=REMEDY)
    # The same bytes: what the lent tensor reads and writes is the slot.
    assert lent.data_ptr() == buffer[4:].data_ptr() and torch.equal(lent.flatten(), buffer[4:16])
    lent.fill_(7.0)
    assert torch.equal(buffer[4:16], torch.full((12,), 7.0, dtype=torch.bfloat16))
    derived = lent.t()[1:]  # a view of the lent tensor outlives it
    del lent
    with pytest.raises(SlotInUseError, match=REMEDY):
        ring.advance()
    del derived
    assert ring.advance() == slot


def test_refused_call_leaves_the_ring_in_place():
    ring = _ring(2)
    first = ring.advance()
    lent = ring.lend(first, ring.buffer(first)[:8], remedy=REMEDY)
    second = ring.advance()  # the other slot is free
    assert second != first
    with pytest.raises(SlotInUseError, match="nothing was sent or overwritten"):
        ring.advance()
    with pytest.raises(SlotInUseError):  # still the same slot, still refused
        ring.advance()
    del lent
    assert ring.advance() == first and ring.advance() == second


def test_lease_and_lend_hold_independently():
    ring = _ring(1)
    slot = ring.advance()
    lease = ring.lease(slot)
    lent = ring.lend(slot, ring.buffer(slot), remedy=REMEDY)
    del lent
    with pytest.raises(SlotInUseError, match="num_slots"):  # the lease still pins it
        ring.advance()
    lease.release()
    assert ring.advance() == slot
