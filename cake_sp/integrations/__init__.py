"""Drop-in replacements of the attention modules of Hugging Face models (optional extras).

* ``cake_sp.integrations.transformers.apply_ulysses``: Qwen3, Qwen2 and Llama attention;
* ``cake_sp.integrations.diffusers.apply_ulysses``: the attention of FLUX single-stream blocks.

Each imports its library lazily.  ``close(model)`` releases every layer's buffers
(collective, like the layers' construction).
"""

from __future__ import annotations

from torch import nn

from cake_sp.layer import UlyssesAttention


def close(model: nn.Module) -> None:
    """Close every ``UlyssesAttention`` inside ``model`` (every rank must call)."""
    for module in model.modules():
        if isinstance(module, UlyssesAttention):
            module.close()
