"""Wan (``WanTransformer3DModel``: Wan 2.1 and 2.2) and LTX-Video
(``LTXVideoTransformer3DModel``) under Ulysses sequence parallelism, for
``cake_sp.integrations.diffusers.apply_ulysses``.

Both normalise Q and K over all heads at once (``qk_norm="rms_norm_across_heads"``), which
the layer's producer, a norm per head, does not compute.  So the drop-in keeps the model's
own front end and runs the rest on ``UlyssesAttentionCore``:

* the ``processor`` of every block's self-attention (``attn1``) becomes a
  ``WanUlyssesAttnProcessor`` or ``LTXUlyssesAttnProcessor``: the model's projections, norms
  and RoPE on this rank's tokens, then the core's exchange and attention over the whole
  sequence, then the model's ``to_out``.  The weights stay where they are (LoRA adapters on
  them keep working); the cross-attention (``attn2``: this rank's tokens over the whole text)
  needs no exchange and is unchanged;
* a whole transformer is called with the whole inputs on every rank, as its pipelines call
  it, and returns the whole output on every rank: hooks placed where diffusers' own
  context-parallel plans place them give each rank its share of the tokens (Wan: after the
  patch embedding; LTX: its input tokens), of their RoPE rows and of a per-token timestep,
  and all-gather ``proj_out``'s output.  The tokens must split evenly.

Training: every rank computes the same loss of the whole output and runs the backward; the
gather hands each rank its own tokens' gradient, so each parameter's gradient is this rank's
tokens' share, and a sum over the group (``dist.all_reduce``) gives the whole gradient.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from diffusers.models.transformers.transformer_ltx import apply_rotary_emb as ltx_rotate
from diffusers.models.transformers.transformer_wan import _get_qkv_projections
from torch import Tensor, nn

from cake_sp.core import UlyssesAttentionCore
from cake_sp.integrations import gather_tokens
from cake_sp.session.overlap import resolve_group


def _wan_rotate(x: Tensor, freqs_cos: Tensor, freqs_sin: Tensor) -> Tensor:
    """Wan's RoPE of ``x [B, S, H, D]``: channel pairs ``(2i, 2i+1)`` rotated by the angle
    whose cos and sin ``freqs_cos, freqs_sin [1, S, 1, D]`` hold (each twice, once a
    channel), computed in the frequencies' dtype and returned in ``x``'s."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = freqs_cos[..., 0::2], freqs_sin[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2).type_as(x)


class CoreAttnProcessor(nn.Module):
    """The processor of a self-attention (``attn1``) on this rank's tokens over
    ``UlyssesAttentionCore``; subclasses compute the model's ``q, k, v``.  A module, so that it
    is the attention's submodule ``processor`` and ``close(model)`` finds its core; it holds
    no parameters (the attention's stay where they were)."""

    def __init__(self, attn: nn.Module, *, group=None, max_tokens: int, **core_options) -> None:
        super().__init__()
        if getattr(attn, "is_cross_attention", False):
            raise ValueError(f"{type(self).__name__}: takes a self-attention (attn1), got a "
                             "cross-attention")
        head_dim = attn.inner_dim // attn.heads
        options = dict(group=group, max_tokens=max_tokens, device=attn.to_q.weight.device)
        options.update(core_options)
        self.core = UlyssesAttentionCore(attn.heads, attn.to_k.out_features // head_dim,
                                         head_dim, causal=False, **options)

    def forward(self, attn: nn.Module, hidden_states: Tensor,
                encoder_hidden_states: Tensor | None = None,
                attention_mask: Tensor | None = None,
                rotary_emb: tuple[Tensor, Tensor] | None = None) -> Tensor:
        """``attn``'s output ``[B, S_local, dim]`` for this rank's tokens ``hidden_states
        [B, S_local, dim]`` and their RoPE rows ``rotary_emb``."""
        if encoder_hidden_states is not None or attention_mask is not None:
            raise ValueError(f"{type(self).__name__}: a self-attention takes no "
                             "encoder_hidden_states or attention_mask")
        q, k, v = self.qkv(attn, hidden_states, rotary_emb)
        o = self.core(q, k, v).flatten(2, 3).type_as(q)
        return attn.to_out[1](attn.to_out[0](o))

    def qkv(self, attn: nn.Module, hidden_states: Tensor,
            rotary_emb: tuple[Tensor, Tensor] | None) -> tuple[Tensor, Tensor, Tensor]:
        """``q, k, v [B, S_local, H, D]``, projected, normalised and rotated as the model's
        own processor does."""
        raise NotImplementedError


class WanUlyssesAttnProcessor(CoreAttnProcessor):
    """Wan's self-attention: projections (fused or not), norms over all heads, then RoPE on
    the heads."""

    def qkv(self, attn, hidden_states, rotary_emb):
        q, k, v = _get_qkv_projections(attn, hidden_states, None)
        q, k = attn.norm_q(q), attn.norm_k(k)
        q, k, v = (t.unflatten(2, (attn.heads, -1)) for t in (q, k, v))
        if rotary_emb is not None:
            q, k = _wan_rotate(q, *rotary_emb), _wan_rotate(k, *rotary_emb)
        return q, k, v


class LTXUlyssesAttnProcessor(CoreAttnProcessor):
    """LTX-Video's self-attention: projections, norms over all heads, RoPE over all heads'
    channels at once (``[B, S, H * D]``), then the split into heads."""

    def qkv(self, attn, hidden_states, rotary_emb):
        q, k, v = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)
        q, k = attn.norm_q(q), attn.norm_k(k)
        if rotary_emb is not None:
            q, k = ltx_rotate(q, rotary_emb), ltx_rotate(k, rotary_emb)
        return tuple(t.unflatten(2, (attn.heads, -1)) for t in (q, k, v))


def _input_hook(split: dict[str, tuple[int, Callable[[Tensor], bool]]],
                own_rows: Callable[[Tensor, str], Tensor]):
    """A forward pre-hook (``with_kwargs``) that replaces each input ``split`` names (by
    keyword, or at its position) by this rank's rows where its condition holds."""
    def hook(module: nn.Module, args: tuple, kwargs: dict[str, Any]):
        args, kwargs = list(args), dict(kwargs)
        for name, (position, wanted) in split.items():
            if name in kwargs and kwargs[name] is not None and wanted(kwargs[name]):
                kwargs[name] = own_rows(kwargs[name], name)
            elif position < len(args) and wanted(args[position]):
                args[position] = own_rows(args[position], name)
        return tuple(args), kwargs
    return hook


def shard_tokens(model: nn.Module, group=None) -> None:
    """Hook a ``WanTransformer3DModel`` or ``LTXVideoTransformer3DModel`` so that its blocks
    run on this rank's tokens and its output is the whole sequence's (the module docstring);
    ``ValueError`` from the forward where the tokens do not split evenly."""
    resolved = resolve_group(group)
    rank, world = dist.get_rank(resolved), dist.get_world_size(resolved)

    def own_rows(t: Tensor, what: str) -> Tensor:
        if t.shape[1] % world:
            raise ValueError(f"apply_ulysses: {what} has {t.shape[1]} tokens, not a multiple "
                             f"of the world size {world}")
        rows = t.shape[1] // world
        return t.narrow(1, rank * rows, rows)

    def per_token(t: Tensor) -> bool:  # a timestep [B, S] (Wan 2.2 TI2V, LTX's conditioning)
        return t.ndim == 2 and t.shape[1] != 1

    if type(model).__name__ == "WanTransformer3DModel":  # tokens made inside: split at block 0
        model.register_forward_pre_hook(_input_hook({"timestep": (1, per_token)}, own_rows),
                                        with_kwargs=True)
        model.blocks[0].register_forward_pre_hook(
            _input_hook({"hidden_states": (0, lambda t: True)}, own_rows), with_kwargs=True)
    else:  # LTX-Video: the tokens are its input
        model.register_forward_pre_hook(
            _input_hook({"hidden_states": (0, lambda t: True), "timestep": (2, per_token)},
                        own_rows), with_kwargs=True)
    model.rope.register_forward_hook(
        lambda module, args, output: tuple(own_rows(t, "the RoPE table") for t in output))
    model.proj_out.register_forward_hook(
        lambda module, args, output: gather_tokens(output, resolved))
