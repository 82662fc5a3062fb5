"""Drop-in replacements of the attention modules of Hugging Face models (optional extras).

* ``cake_sp.integrations.transformers.apply_ulysses``: the attention of Qwen3, Qwen2, Llama,
  Mistral and the Qwen3-MoE, Qwen2-MoE and Mixtral models;
* ``cake_sp.integrations.diffusers.apply_ulysses``: the attention of FLUX's single- and
  dual-stream blocks and of Qwen-Image's blocks.

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
