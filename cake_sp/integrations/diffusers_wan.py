"""Wan (``WanTransformer3DModel``: Wan 2.1 and 2.2) under Ulysses sequence parallelism, for
``cake_sp.integrations.diffusers.apply_ulysses``.

Wan's self-attention normalises Q and K over all heads at once
(``qk_norm="rms_norm_across_heads"``), which the layer's producer, a norm per head, does
not compute.  So the drop-in keeps Wan's own front end and runs the rest on
``UlyssesAttentionCore``:

* the ``processor`` of every ``WanTransformerBlock``'s self-attention (``attn1``) becomes a
  ``WanUlyssesAttnProcessor``: Wan's projections, norms and RoPE on this rank's tokens, then
  the core's exchange and attention over the whole sequence, then Wan's ``to_out``.  The
  weights stay where they are (LoRA adapters on them keep working); the cross-attention
  (``attn2``: this rank's tokens over the whole text) needs no exchange and is unchanged;
* a whole ``WanTransformer3DModel`` is called with the whole inputs on every rank, as its
  pipelines call it, and returns the whole output on every rank: hooks placed where
  diffusers' own context-parallel plan places them split the tokens after the patch
  embedding (with their RoPE rows, and a per-token timestep: Wan 2.2 TI2V) and all-gather
  ``proj_out``'s output.  The tokens (frames x height x width patches) must split evenly.

Training: every rank computes the same loss of the whole output and runs the backward; the
gather hands each rank its own tokens' gradient, so each parameter's gradient is this rank's
tokens' share, and a sum over the group (``dist.all_reduce``) gives the whole gradient.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from cake_sp.core import UlyssesAttentionCore
from cake_sp.session.overlap import resolve_group


def _rotate(x: Tensor, freqs_cos: Tensor, freqs_sin: Tensor) -> Tensor:
    """Wan's RoPE of ``x [B, S, H, D]``: channel pairs ``(2i, 2i+1)`` rotated by the angle
    whose cos and sin ``freqs_cos, freqs_sin [1, S, 1, D]`` hold (each twice, once a
    channel), computed in the frequencies' dtype and returned in ``x``'s."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = freqs_cos[..., 0::2], freqs_sin[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2).type_as(x)


class WanUlyssesAttnProcessor(nn.Module):
    """The processor of a Wan self-attention (``attn1``) on this rank's tokens.  A module, so
    that it is the attention's submodule ``processor`` and ``close(model)`` finds its core; it
    holds no parameters (the attention's stay where they were)."""

    def __init__(self, attn: nn.Module, *, group=None, max_tokens: int, **core_options) -> None:
        super().__init__()
        if attn.is_cross_attention or attn.add_k_proj is not None:
            raise ValueError("WanUlyssesAttnProcessor: takes a self-attention (attn1), got a "
                             "cross-attention")
        heads = attn.heads
        options = dict(group=group, max_tokens=max_tokens, device=attn.to_q.weight.device)
        options.update(core_options)
        self.core = UlyssesAttentionCore(heads, heads, attn.inner_dim // heads, causal=False,
                                         **options)

    def forward(self, attn: nn.Module, hidden_states: Tensor,
                encoder_hidden_states: Tensor | None = None,
                attention_mask: Tensor | None = None,
                rotary_emb: tuple[Tensor, Tensor] | None = None) -> Tensor:
        """``attn``'s output ``[B, S_local, dim]`` for this rank's tokens ``hidden_states
        [B, S_local, dim]`` and their RoPE rows ``rotary_emb`` (``[1, S_local, 1, D]`` each)."""
        from diffusers.models.transformers.transformer_wan import _get_qkv_projections

        if encoder_hidden_states is not None or attention_mask is not None:
            raise ValueError("WanUlyssesAttnProcessor: a self-attention takes no "
                             "encoder_hidden_states or attention_mask")
        q, k, v = _get_qkv_projections(attn, hidden_states, None)
        q, k = attn.norm_q(q), attn.norm_k(k)
        q, k, v = (t.unflatten(2, (attn.heads, -1)) for t in (q, k, v))
        if rotary_emb is not None:
            q, k = _rotate(q, *rotary_emb), _rotate(k, *rotary_emb)
        o = self.core(q, k, v).flatten(2, 3).type_as(q)
        return attn.to_out[1](attn.to_out[0](o))


class _GatherTokens(torch.autograd.Function):
    """Every rank's ``[B, S_local, C]`` joined along the tokens in rank order; the backward
    hands each rank its own tokens' rows of the gradient (every rank computes the same loss
    of the whole output)."""

    @staticmethod
    def forward(ctx, local: Tensor, group, rank: int) -> Tensor:
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, local.contiguous(), group=group)
        ctx.rows = (rank * local.shape[1], local.shape[1])
        return torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad.narrow(1, *ctx.rows), None, None


def shard_wan_tokens(model: nn.Module, group=None) -> None:
    """Hook a ``WanTransformer3DModel`` so that its blocks run on this rank's tokens and its
    output is the whole sequence's (the module docstring); ``ValueError`` from the forward
    where the tokens do not split evenly."""
    resolved = resolve_group(group)
    rank, world = dist.get_rank(resolved), dist.get_world_size(resolved)

    def own_rows(t: Tensor, what: str) -> Tensor:
        if t.shape[1] % world:
            raise ValueError(f"apply_ulysses: {what} has {t.shape[1]} tokens, not a multiple "
                             f"of the world size {world} (frames x height x width patches)")
        rows = t.shape[1] // world
        return t.narrow(1, rank * rows, rows)

    def timestep_rows(module: nn.Module, args: tuple, kwargs: dict[str, Any]):
        # Wan 2.2 TI2V's timestep is [B, S], one per token: each rank keeps its own.
        if "timestep" in kwargs and kwargs["timestep"].ndim == 2:
            kwargs = {**kwargs, "timestep": own_rows(kwargs["timestep"], "timestep")}
        elif len(args) > 1 and args[1].ndim == 2:
            args = (args[0], own_rows(args[1], "timestep"), *args[2:])
        return args, kwargs

    def block_rows(module: nn.Module, args: tuple, kwargs: dict[str, Any]):
        if args:
            return (own_rows(args[0], "hidden_states"), *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": own_rows(kwargs["hidden_states"],
                                                           "hidden_states")}

    model.register_forward_pre_hook(timestep_rows, with_kwargs=True)
    model.rope.register_forward_hook(
        lambda module, args, output: tuple(own_rows(t, "the RoPE table") for t in output))
    model.blocks[0].register_forward_pre_hook(block_rows, with_kwargs=True)
    model.proj_out.register_forward_hook(
        lambda module, args, output: _GatherTokens.apply(output, resolved, rank))
