"""The host side of the GPU positions check: each new count raises once, with the rows it adds."""

import pytest
import torch

from cake_sp.session.positions import BadPositionsCounter


def test_each_increase_raises_once_with_the_new_rows():
    counter = BadPositionsCounter(torch.device("cpu"))
    counter.check()  # nothing counted yet
    counter.count += 6  # what the producer's atomics do
    with pytest.raises(ValueError, match=r"outside \[0, rows of rope_cos_sin\): 6 Q/K head rows"):
        counter.check()
    counter.check()  # reported already: the session goes on
    counter.count += 2
    with pytest.raises(ValueError, match=": 2 Q/K head rows"):
        counter.check()
    assert counter.count.item() == 8  # the host never writes the counter
