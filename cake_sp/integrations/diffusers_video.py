"""Wan (``WanTransformer3DModel``: Wan 2.1 and 2.2), LTX-Video (``LTXVideoTransformer3DModel``),
HunyuanVideo (``HunyuanVideoTransformer3DModel``), CogVideoX (``CogVideoXTransformer3DModel``)
and Stable Diffusion 3 / 3.5 (``SD3Transformer2DModel``, whose joint attention is built as
HunyuanVideo's) under Ulysses sequence parallelism, for
``cake_sp.integrations.diffusers.apply_ulysses``.

Wan and LTX normalise Q and K over all heads at once (``qk_norm="rms_norm_across_heads"``),
which the layer's producer, a norm per head, does not compute; HunyuanVideo and CogVideoX
rotate their video tokens and not their text, and SD3 rotates nothing.  So the drop-in keeps
the model's own front end and runs the rest on ``UlyssesAttentionCore``:

* the ``processor`` of every block's self-attention (Wan's, LTX's and CogVideoX's ``attn1``,
  both HunyuanVideo blocks' ``attn``, SD3's ``attn`` and SD3.5's image-only ``attn2``) becomes
  a ``WanUlyssesAttnProcessor``, ``LTXUlyssesAttnProcessor``, ``JointTextAttnProcessor`` or
  ``PlainSelfAttnProcessor``: the model's
  projections, norms and RoPE on this rank's tokens, then the core's exchange and attention
  over the whole sequence, then the model's output projections.  The weights stay where they
  are (LoRA adapters on them keep working); the cross-attention (``attn2``: this rank's tokens
  over the whole text) needs no exchange and is unchanged;
* HunyuanVideo's and CogVideoX's joint attention passes the text as the core's joint tokens:
  each rank holds the whole text (its text stream runs on every rank alike, a small share
  beside the video), attends its own band of the text's heads beside the video's, and gets
  the text's whole output back with its video tokens', the text's padding masked.  A whole
  SD3 transformer splits its text over the ranks too (a hook on its context embedder pads
  it to a multiple of the world size; the padding masked as keys), so its text stream,
  hundreds of tokens beside a few thousand image tokens, is not run on every rank; one of
  its blocks alone takes the whole text as HunyuanVideo's;
* a whole transformer is called with the whole inputs on every rank, as its pipelines call
  it, and returns the whole output on every rank: hooks placed where diffusers' own
  context-parallel plans place them give each rank its share of the video tokens (Wan and
  HunyuanVideo and SD3: after the patch embedding; CogVideoX: where it splits them from the
  text; LTX: its input tokens), of their RoPE rows and of a per-token timestep, and all-gather
  ``proj_out``'s output.  The tokens must split evenly.

Training: every rank computes the same loss of the whole output and runs the backward; the
gather hands each rank its own tokens' gradient, so each parameter's gradient is this rank's
tokens' share, and a sum over the group (``dist.all_reduce``) gives the whole gradient
(the text stream's too: each rank's copy of the text carries its share).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from diffusers.models.embeddings import apply_rotary_emb
from diffusers.models.transformers.transformer_ltx import apply_rotary_emb as ltx_rotate
from diffusers.models.transformers.transformer_wan import _get_qkv_projections
from torch import Tensor, nn

from cake_sp._memo import LastInputs
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
    """The processor of a self-attention on this rank's tokens over ``UlyssesAttentionCore``
    (``self.core``).  A module, so that it is the attention's submodule ``processor`` and
    ``close(model)`` finds its core; it holds no parameters (the attention's stay where they
    were)."""

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


class SelfAttnProcessor(CoreAttnProcessor):
    """A self-attention of the video tokens alone (``attn1``); subclasses compute the model's
    ``q, k, v``."""

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


class WanUlyssesAttnProcessor(SelfAttnProcessor):
    """Wan's self-attention: projections (fused or not), norms over all heads, then RoPE on
    the heads."""

    def qkv(self, attn, hidden_states, rotary_emb):
        q, k, v = _get_qkv_projections(attn, hidden_states, None)
        q, k = attn.norm_q(q), attn.norm_k(k)
        q, k, v = (t.unflatten(2, (attn.heads, -1)) for t in (q, k, v))
        if rotary_emb is not None:
            q, k = _wan_rotate(q, *rotary_emb), _wan_rotate(k, *rotary_emb)
        return q, k, v


class LTXUlyssesAttnProcessor(SelfAttnProcessor):
    """LTX-Video's self-attention: projections, norms over all heads, RoPE over all heads'
    channels at once (``[B, S, H * D]``), then the split into heads."""

    def qkv(self, attn, hidden_states, rotary_emb):
        q, k, v = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)
        q, k = attn.norm_q(q), attn.norm_k(k)
        if rotary_emb is not None:
            q, k = ltx_rotate(q, rotary_emb), ltx_rotate(k, rotary_emb)
        return tuple(t.unflatten(2, (attn.heads, -1)) for t in (q, k, v))


class PlainSelfAttnProcessor(SelfAttnProcessor):
    """A self-attention of the image tokens alone with Q/K norms per head and no RoPE: SD3.5's
    ``attn2`` (``JointTransformerBlock`` with ``use_dual_attention``)."""

    def qkv(self, attn, hidden_states, rotary_emb):
        return project_heads(attn, hidden_states, (attn.to_q, attn.to_k, attn.to_v),
                             (attn.norm_q, attn.norm_k))


def project_heads(attn: nn.Module, tokens: Tensor, projections: tuple, norms: tuple
                  ) -> tuple[Tensor, Tensor, Tensor]:
    """``q, k, v [B, S, H, D]`` of ``tokens`` through ``attn``'s ``projections``, Q and K
    normalised per head by ``norms`` (either may be None)."""
    q, k, v = (p(tokens).unflatten(2, (attn.heads, -1)) for p in projections)
    return (q if norms[0] is None else norms[0](q),
            k if norms[1] is None else norms[1](k), v)


_TEXT_KEYS = LastInputs()


class JointTextAttnProcessor(CoreAttnProcessor):
    """A joint attention of this rank's video tokens and the whole text (every rank holds it),
    the video's Q and K rotated, over ``UlyssesAttentionCore`` with the text as its joint
    tokens (each rank attends its band of the text's heads, every rank gets the text's whole
    output): the attention of HunyuanVideo's blocks (``HunyuanVideoTransformerBlock.attn``,
    with text projections of its own, ``HunyuanVideoSingleTransformerBlock.attn``, one
    projection for both and no output projection), of CogVideoX's (``CogVideoXBlock.attn1``,
    one projection and one ``to_out`` for both) and of SD3's (``JointTransformerBlock.attn``,
    as HunyuanVideo's dual-stream one, without RoPE).  The text's output projection is
    ``to_add_out`` where the attention has one, else ``to_out`` as the video's, and none in
    an attention whose text output is not used (``context_pre_only``, SD3's last block).
    The attention is over all tokens at once, so the order of the video and the text does
    not change the result: the video goes first here whatever the model's order.

    ``text_shards``: where the model's hooks split the text over the ranks too (a whole
    ``SD3Transformer2DModel``: ``TextShards``), a forward given a share of the text attends
    it as this rank's own tokens, its padding masked, instead of as joint tokens."""

    def __init__(self, attn: nn.Module, *, text_shards: TextShards | None = None,
                 **options) -> None:
        super().__init__(attn, **options)
        self.text_shards = text_shards

    def __call__(self, attn: nn.Module, hidden_states: Tensor,
                 encoder_hidden_states: Tensor | None = None,
                 attention_mask: Tensor | None = None,
                 image_rotary_emb: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor]:
        # diffusers' ``Attention`` passes a processor only the keywords its ``__call__`` names
        # (``nn.Module.__call__`` names none), so this one names ``forward``'s.
        return super().__call__(attn, hidden_states, encoder_hidden_states, attention_mask,
                                image_rotary_emb)

    def forward(self, attn: nn.Module, hidden_states: Tensor,
                encoder_hidden_states: Tensor | None = None,
                attention_mask: Tensor | None = None,
                image_rotary_emb: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor]:
        """``(video out [B, I_local, dim], text out [B, T, dim])`` for this rank's video tokens
        ``hidden_states [B, I_local, dim]`` and the whole text ``encoder_hidden_states [B, T,
        dim]``; ``attention_mask``: the model's bool ``[B, 1, 1, I + T]``, its last ``T``
        entries the text's padding (HunyuanVideo's), or None; ``image_rotary_emb``: this
        rank's video rows."""
        if encoder_hidden_states is None:
            raise ValueError(f"{type(self).__name__}: needs encoder_hidden_states (the text)")
        video, text = hidden_states.shape[1], encoder_hidden_states.shape[1]
        own = (attn.to_q, attn.to_k, attn.to_v), (attn.norm_q, attn.norm_k)
        added = own if getattr(attn, "add_q_proj", None) is None else (  # one for both
            (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj),
            (attn.norm_added_q, attn.norm_added_k))
        q, k, v = project_heads(attn, hidden_states, *own)
        if image_rotary_emb is not None:
            q, k = (apply_rotary_emb(t, image_rotary_emb, sequence_dim=1) for t in (q, k))
        text_qkv = project_heads(attn, encoder_hidden_states, *added)
        split_text = self.text_shards is not None and self.text_shards.tokens is not None
        if not split_text:
            o = self.core(q, k, v, joint=text_qkv,
                          key_mask=self._key_mask(attention_mask, q.shape[0], video, text,
                                                  q.device))
        else:  # this rank's share of the text, as its own tokens
            if attention_mask is not None:
                raise ValueError(f"{type(self).__name__}: an attention_mask with the text "
                                 "split over the ranks is not supported")
            q, k, v = (torch.cat(pair, dim=1) for pair in zip((q, k, v), text_qkv))
            o = self.core(q, k, v, key_mask=self.text_shards.key_mask(
                q.shape[0], video, text, self.core.plan.world_size, q.device))
        o_video, o_text = o.flatten(2, 3).type_as(q).split((video, text), dim=1)
        to_out, to_add_out = getattr(attn, "to_out", None), getattr(attn, "to_add_out", None)
        if to_out is not None:
            o_video = to_out[1](to_out[0](o_video))
        if to_add_out is not None:
            o_text = to_add_out(o_text)
        elif to_out is not None and not getattr(attn, "context_pre_only", False):
            o_text = to_out[1](to_out[0](o_text))
        return o_video, o_text

    def _key_mask(self, attention_mask: Tensor | None, batch: int, video: int, text: int,
                  device: torch.device) -> Tensor | None:
        """bool ``[B, I + T]`` over the core's keys (the whole video, then the text): every
        video key, and the text keys the model's mask keeps; None without a mask.  Built once
        per transformer forward (every block gets the same mask tensor), with no host
        read."""
        if attention_mask is None:
            return None
        world = self.core.plan.world_size

        def build():
            keys = torch.ones(batch, world * video + text, dtype=torch.bool, device=device)
            keys[:, world * video:] = attention_mask.reshape(batch, -1)[:, -text:].bool()
            return keys
        return _TEXT_KEYS.get((attention_mask,), (batch, world, video, text, device), build)


class TextShards:
    """The text of the current forward split over the ranks (``SD3Transformer2DModel``): its
    context embedder's output padded to a multiple of the world size, each rank taking its
    share, as the image's tokens.  The hook sets ``tokens`` (the whole text's, padding not
    counted), the model's forward pre-hook clears it, and the joint attentions read it.  One
    object shared by a transformer's hooks and processors."""

    def __init__(self) -> None:
        self.tokens: int | None = None
        self._masks = LastInputs()

    def own_rows(self, text: Tensor, rank: int, world: int) -> Tensor:
        """This rank's rows of ``text [B, T, dim]`` padded with zeros to ``W * ceil(T / W)``
        rows (the padding masked as keys, its outputs dropped with the text stream's)."""
        self.tokens = text.shape[1]
        rows = -(-self.tokens // world)
        padded = F.pad(text, (0, 0, 0, world * rows - self.tokens))
        return padded[:, rank * rows:(rank + 1) * rows]

    def key_mask(self, batch: int, video: int, text: int, world: int,
                 device: torch.device) -> Tensor | None:
        """bool ``[B, W * (I_local + T_local)]`` over the core's sequence (each rank's video
        tokens, then its share of the text): the padding rows masked; None without padding."""
        if world * text == self.tokens:
            return None

        def build():
            keys = torch.ones(world, video + text, dtype=torch.bool, device=device)
            keys[:, video:] = torch.arange(world * text, device=device).view(world, text) \
                < self.tokens
            return keys.flatten().expand(batch, -1)
        return self._masks.get((), (batch, video, text, world, self.tokens, device), build)


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


def _refuse_sd3_extras(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
    """A forward pre-hook of ``SD3Transformer2DModel``: ``ValueError`` for a ControlNet's
    residuals (whole-image tokens, added inside the blocks) or IP-Adapter embeddings (read by
    a processor of their own, which the drop-in replaced)."""
    names = ("hidden_states", "encoder_hidden_states", "pooled_projections", "timestep",
             "block_controlnet_hidden_states", "joint_attention_kwargs")
    given = dict(zip(names, args)) | kwargs
    if given.get("block_controlnet_hidden_states") is not None:
        raise ValueError("apply_ulysses: SD3Transformer2DModel with "
                         "block_controlnet_hidden_states is not supported (a ControlNet's "
                         "residuals cover the whole image)")
    if "ip_adapter_image_embeds" in (given.get("joint_attention_kwargs") or {}):
        raise ValueError("apply_ulysses: SD3Transformer2DModel with an IP-Adapter is not "
                         "supported (its processors were replaced)")


# The patch embedding whose output tokens each rank takes its share of; the text stays whole.
_PATCH_EMBEDDING = {"HunyuanVideoTransformer3DModel": "x_embedder",
                    "SD3Transformer2DModel": "pos_embed"}


def shard_tokens(model: nn.Module, group=None, text_shards: TextShards | None = None) -> None:
    """Hook a ``WanTransformer3DModel``, ``LTXVideoTransformer3DModel``,
    ``HunyuanVideoTransformer3DModel``, ``CogVideoXTransformer3DModel`` or
    ``SD3Transformer2DModel`` so that its blocks run on this rank's video (image) tokens and
    its output is the whole sequence's (the module docstring); ``ValueError`` from the
    forward where the tokens do not split evenly.  ``text_shards`` (SD3 only): the text is
    split too, padded, into the object its joint attentions read."""
    resolved = resolve_group(group)
    rank, world = dist.get_rank(resolved), dist.get_world_size(resolved)

    def own_rows(t: Tensor, what: str, dim: int = 1) -> Tensor:
        if t.shape[dim] % world:
            raise ValueError(f"apply_ulysses: {what} has {t.shape[dim]} tokens, not a multiple "
                             f"of the world size {world}")
        rows = t.shape[dim] // world
        return t.narrow(dim, rank * rows, rows)

    def per_token(t: Tensor) -> bool:  # a timestep [B, S] (Wan 2.2 TI2V, LTX's conditioning)
        return t.ndim == 2 and t.shape[1] != 1

    name = type(model).__name__
    if name == "WanTransformer3DModel":  # tokens made inside: split at block 0
        model.register_forward_pre_hook(_input_hook({"timestep": (1, per_token)}, own_rows),
                                        with_kwargs=True)
        model.blocks[0].register_forward_pre_hook(
            _input_hook({"hidden_states": (0, lambda t: True)}, own_rows), with_kwargs=True)
    elif name in _PATCH_EMBEDDING:
        getattr(model, _PATCH_EMBEDDING[name]).register_forward_hook(
            lambda module, args, output: own_rows(output, "the patch tokens"))
        if name == "SD3Transformer2DModel":
            model.register_forward_pre_hook(_refuse_sd3_extras, with_kwargs=True)
            if text_shards is not None:  # cleared first, so a block called alone sees none
                model.register_forward_pre_hook(
                    lambda module, args: setattr(text_shards, "tokens", None))
                model.context_embedder.register_forward_hook(
                    lambda module, args, output: text_shards.own_rows(output, rank, world))
    elif name == "CogVideoXTransformer3DModel":
        # The video tokens once the model has split them from the text (block 0's input),
        # and the rows of the RoPE table the caller passes.
        model.transformer_blocks[0].register_forward_pre_hook(
            _input_hook({"hidden_states": (0, lambda t: True)}, own_rows), with_kwargs=True)
        model.register_forward_pre_hook(_input_hook(
            {"image_rotary_emb": (5, lambda t: t is not None)},
            lambda table, what: tuple(own_rows(t, what, 0) for t in table)), with_kwargs=True)
    else:  # LTX-Video: the tokens are its input
        model.register_forward_pre_hook(
            _input_hook({"hidden_states": (0, lambda t: True), "timestep": (2, per_token)},
                        own_rows), with_kwargs=True)
    if hasattr(model, "rope"):  # HunyuanVideo's table is [I, D], the others' [B, I, ...]
        token_dim = 0 if name == "HunyuanVideoTransformer3DModel" else 1
        model.rope.register_forward_hook(lambda module, args, output: tuple(
            own_rows(t, "the RoPE table", token_dim) for t in output))
    model.proj_out.register_forward_hook(
        lambda module, args, output: gather_tokens(output, resolved))
