"""``LastInputs``: a one-entry cache keyed by tensors' identities, for what every layer of a
model's forward would otherwise build again from the same inputs."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor


class LastInputs:
    """``build()``'s result for the last tensors and arguments it was asked about, kept while
    they are the same objects, unmodified: every layer of a model's forward receives the same
    position embeddings (or mask), so what is built from them (a RoPE table, a block mask)
    is built once per forward, not once per layer.
    Under ``torch.compile`` it builds every time: the build is traced into the graph, and the
    tensors' ids, which the compiler cannot trace, are not read."""

    def __init__(self) -> None:
        self._key: tuple = ()
        self._inputs: tuple[Tensor, ...] = ()
        self._value = None

    def clear(self) -> None:
        """Forget the last result (the next ``get`` builds)."""
        self._key, self._inputs, self._value = (), (), None

    def get(self, tensors: Sequence[Tensor], args: tuple, build: Callable):
        if torch.compiler.is_compiling():
            return build()
        key = (tuple(id(t) for t in tensors), tuple(t._version for t in tensors), args)
        if key != self._key:
            # Holding the tensors keeps their ids from naming other tensors later.
            self._key, self._inputs, self._value = key, tuple(tensors), build()
        return self._value
