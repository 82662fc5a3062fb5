"""Drop-in replacements of the attention modules of Hugging Face models (optional extras).

* ``cake_sp.integrations.transformers.apply_ulysses``: the attention of Qwen3, Qwen2, Llama,
  Mistral and the Qwen3-MoE, Qwen2-MoE and Mixtral models;
* ``cake_sp.integrations.diffusers.apply_ulysses``: the attention of FLUX's single- and
  dual-stream blocks and of Qwen-Image's blocks.

Each imports its library lazily.  ``close(model)`` releases every layer's buffers
(collective, like the layers' construction).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

from cake_sp.layer import UlyssesAttention


class LastInputs:
    """``build()``'s result for the last tensors and arguments it was asked about, kept while
    they are the same objects, unmodified: every layer of a model's forward receives the same
    position embeddings, so the RoPE table is built once per forward, not once per layer.
    Under ``torch.compile`` it builds every time: the build is traced into the graph, and the
    tensors' ids, which the compiler cannot trace, are not read."""

    def __init__(self) -> None:
        self._key: tuple = ()
        self._inputs: tuple[Tensor, ...] = ()
        self._value = None

    def get(self, tensors: Sequence[Tensor], args: tuple, build: Callable):
        if torch.compiler.is_compiling():
            return build()
        key = (tuple(id(t) for t in tensors), tuple(t._version for t in tensors), args)
        if key != self._key:
            # Holding the tensors keeps their ids from naming other tensors later.
            self._key, self._inputs, self._value = key, tuple(tensors), build()
        return self._value


def close(model: nn.Module) -> None:
    """Close every ``UlyssesAttention`` inside ``model`` (every rank must call)."""
    for module in model.modules():
        if isinstance(module, UlyssesAttention):
            module.close()
