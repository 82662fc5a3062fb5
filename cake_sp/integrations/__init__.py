"""Drop-in replacements of the attention modules of Hugging Face models (optional extras).

* ``cake_sp.integrations.transformers.apply_ulysses``: the attention of Qwen3, Qwen2, Llama,
  Mistral, Granite, Seed-OSS, Arcee, Apertus, EXAONE 4 and the Qwen3-MoE, Qwen2-MoE,
  Granite-MoE and Mixtral models;
* ``cake_sp.integrations.diffusers.apply_ulysses``: the attention of FLUX's and FLUX.2's
  single- and dual-stream blocks and of Qwen-Image's blocks, and the self-attention of Wan's
  and LTX-Video's (``diffusers_video``).

Each imports its library lazily, and refuses attentions with unmerged LoRA adapters
(``check_adapters_merged``).  ``close(model)`` releases every layer's buffers (collective,
like the layers' construction).
"""

from __future__ import annotations

from collections.abc import Container

import torch
import torch.distributed as dist
from torch import Tensor, nn

from cake_sp.core import UlyssesAttentionCore
from cake_sp.layer import UlyssesAttention


def stacked_projections(projections: tuple[nn.Linear, ...]) -> tuple[Tensor, Tensor | None]:
    """The ``q, k, v`` projections' weights stacked as the layer's ``qkv_weight``, and their
    biases as its ``qkv_bias`` (None where they have none)."""
    bias = None
    if projections[0].bias is not None:
        bias = torch.cat([p.bias for p in projections])
    return torch.cat([p.weight for p in projections]), bias


def check_adapters_merged(modules: list[tuple[str, nn.Module]],
                          kept: Container[str] = ()) -> None:
    """``ValueError`` naming the submodules of ``modules`` (``(name, module)`` pairs, the
    attentions about to be replaced) that carry active PEFT adapters (LoRA) not merged into
    their base weights.  The drop-ins copy the base weights, so such an adapter would be
    dropped without a word; merged, it is in them.  ``kept``: the full names of submodules
    the drop-in keeps and calls as they are (their adapters keep working)."""
    unmerged = []
    for prefix, module in modules:
        for name, m in module.named_modules():
            full = f"{prefix}.{name}" if prefix else name
            if (not hasattr(m, "merged_adapters") or getattr(m, "disable_adapters", False)
                    or full in kept):
                continue  # not a PEFT tuner layer, its adapters off, or kept as it is
            held = [getattr(m, layer, {}) for layer in getattr(m, "adapter_layer_names", ())]
            if any(a not in m.merged_adapters and any(a in h for h in held)
                   for a in m.active_adapters):
                unmerged.append(full)
    if unmerged:
        raise ValueError(f"apply_ulysses: {unmerged[:3]} carry adapters (LoRA) not merged into "
                         f"their weights, which the drop-in would lose; merge them first "
                         f"(diffusers: pipe.fuse_lora(); PEFT: model.merge_and_unload())")


class _GatherTokens(torch.autograd.Function):
    """Every rank's ``[B, S_local, ...]`` joined along the tokens in rank order; the backward
    hands each rank its own tokens' rows of the gradient."""

    @staticmethod
    def forward(ctx, local: Tensor, group) -> Tensor:
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        parts = [torch.empty_like(local) for _ in range(world)]
        dist.all_gather(parts, local.contiguous(), group=group)
        ctx.rows = (rank * local.shape[1], local.shape[1])
        return torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad.narrow(1, *ctx.rows), None


def gather_tokens(local: Tensor, group: dist.ProcessGroup) -> Tensor:
    """Every rank's tokens ``local [B, S_local, ...]`` joined along dim 1 in rank order (a
    collective).  Differentiable for a loss every rank computes alike from the whole result:
    each rank's gradient is its own tokens' rows, so the parameters' gradients are each rank's
    tokens' share, which a sum over the group (``dist.all_reduce``) makes whole."""
    return _GatherTokens.apply(local, group)


def close(model: nn.Module) -> None:
    """Close every ``UlyssesAttention`` and ``UlyssesAttentionCore`` inside ``model`` (every
    rank must call)."""
    for module in model.modules():
        if isinstance(module, (UlyssesAttention, UlyssesAttentionCore)):
            module.close()
