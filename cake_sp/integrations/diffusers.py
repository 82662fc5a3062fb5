"""``apply_ulysses(model)``: Ulysses sequence parallelism for the attention of FLUX, FLUX.2,
Qwen-Image, Wan, LTX-Video, HunyuanVideo and CogVideoX blocks (the last four in
``diffusers_video``: their self-attentions' processors over ``UlyssesAttentionCore``, their
tokens sharded inside the model).

* The ``FluxAttention`` of every ``FluxSingleTransformerBlock`` becomes
  ``FluxUlyssesAttention``: a ``UlyssesAttention`` without o_proj (the block's
  ``proj_out`` follows), with the same ``to_q/to_k/to_v`` weights and biases, the
  ``norm_q/norm_k`` RMSNorm weights and interleaved RoPE.  The block concatenates its
  ``[text; image]`` tokens, so the rank's rows are its text tokens, then its image tokens.
* The ``FluxAttention`` of every dual-stream ``FluxTransformerBlock`` becomes
  ``FluxDualUlyssesAttention``: two ``UlyssesAttention`` layers, one a stream (text:
  ``add_q/k/v_proj``, ``norm_added_q/k``, ``to_add_out``; image: ``to_q/k/v``,
  ``norm_q/k``, ``to_out[0]``), whose head bands of the whole text and the whole image
  sequence are joined for one attention, then split again for the two output exchanges.
* FLUX.2's blocks likewise: the ``Flux2Attention`` of every ``Flux2TransformerBlock`` becomes
  ``FluxDualUlyssesAttention`` (same weights, same names), and the
  ``Flux2ParallelSelfAttention`` of every ``Flux2SingleTransformerBlock`` (attention and MLP
  in parallel) ``Flux2ParallelUlyssesAttention``, its fused input projection split into the
  layer's ``q, k, v`` and an MLP ``Linear``.
* The attention of every ``QwenImageTransformerBlock`` becomes ``QwenImageUlyssesAttention``:
  the same two streams (Qwen-Image's blocks are all dual-stream), the text padding mask
  (``encoder_hidden_states_mask``) as a key mask of the joint attention, RoPE from
  Qwen-Image's complex frequencies.

FLUX's two take the call ``forward(hidden_states, encoder_hidden_states=None,
attention_mask=None, image_rotary_emb=None)`` on this rank's tokens.  How the tokens are
sharded:

* a whole FLUX transformer: the text tokens and the image tokens are each split evenly
  over the ranks; rank ``r`` passes its text tokens, its image tokens and their own
  ``txt_ids``/``img_ids``, so ``image_rotary_emb`` has a row per local token (its text
  rows first), which both modules take;
* a single-stream block alone may also take the whole ``[text; image]`` sequence sharded
  by tokens (rank ``r``'s rows ``[r * S_local, (r + 1) * S_local)``, either part maybe
  empty) with ``image_rotary_emb`` for the whole sequence, of which it takes its rows.

Qwen-Image shards as FLUX's whole transformer does: rank ``r`` passes its text tokens (with
their rows of ``encoder_hidden_states_mask``) and its image tokens, and the whole
``img_shapes``.  ``apply_ulysses`` of a whole ``QwenImageTransformer2DModel`` hooks its
``pos_embed`` so that the frequencies are those of the whole text and image, of which each
rank keeps its own rows.  Pad the text to a multiple of the world size with masked tokens.

Attention is over all tokens at once, so the order of the gathered sequence does not
matter, only that each token keeps its own RoPE row.

``shard_calls(model)`` does the sharding for a caller that passes every rank the whole
inputs (a pipeline): hooks split the inputs and all-gather the output.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from cake_sp._memo import LastInputs
from cake_sp.integrations import check_adapters_merged, gather_tokens, stacked_projections
from cake_sp.layer import UlyssesAttention
from cake_sp.session.overlap import resolve_group

# One table per transformer forward, shared by the blocks (they get the same embeddings).
_ROPE_TABLE = LastInputs()
# One joint key mask per transformer forward, likewise.
_KEY_MASK = LastInputs()


def _rope_table(image_rotary_emb: tuple[Tensor, Tensor]) -> Tensor:
    """fp32 ``[rows, D]``: FLUX's ``(cos, sin)`` (each frequency repeated for both channels
    of its pair) as the layer's table, one of each pair: cos of the D/2 frequencies, then
    sin."""
    cos, sin = image_rotary_emb
    return _ROPE_TABLE.get((cos, sin), (), lambda: torch.cat((cos[:, 0::2], sin[:, 0::2]),
                                                              dim=-1).float())


def _complex_rope_table(txt_freqs: Tensor, img_freqs: Tensor) -> Tensor:
    """fp32 ``[T + I, D]``: Qwen-Image's complex frequencies ``[T, D/2]`` and ``[I, D/2]``
    (``cos + i sin`` of each pair ``(2i, 2i+1)``), text rows first, as the layer's table."""
    def build():
        rows = torch.cat((txt_freqs, img_freqs))
        return torch.cat((rows.real, rows.imag), dim=-1).float()
    return _ROPE_TABLE.get((txt_freqs, img_freqs), (), build)


@torch.compiler.disable
def _joint_key_mask(text_mask: Tensor | None, text_shape: tuple[int, int], image_tokens: int,
                    image_padding: int, group, device: torch.device) -> Tensor | None:
    """bool ``[B, T + I]``, the keys of the joint attention: every rank's text mask ``[B,
    T_local]`` in rank order (``text_shape`` is ``(B, T)``; all kept without one), then the
    ``I`` image tokens, of which the last ``image_padding`` are masked; None where no key is.
    With a text mask, a collective and one host read, once per transformer forward; eager
    under ``torch.compile``.  The masks are gathered as host objects (they are small), as any
    backend of the group can (the transformers drop-in's bounds likewise)."""
    def build():
        if text_mask is None:
            text = torch.ones(text_shape, dtype=torch.bool)
        else:
            parts = [None] * dist.get_world_size(group)
            dist.all_gather_object(parts, text_mask.bool().cpu(), group=group)
            text = torch.cat(parts, dim=1)
        if not image_padding and bool(text.all()):
            return None
        image = text.new_ones(text.shape[0], image_tokens)
        image[:, image_tokens - image_padding:] = False
        return torch.cat((text, image), dim=1).to(device)
    tensors = () if text_mask is None else (text_mask,)
    return _KEY_MASK.get(tensors, (text_shape, image_tokens, image_padding, group, device),
                         build)


class _ImagePadding:
    """Tokens of padding after the whole image sequence of the current Qwen-Image forward, up
    to a multiple of the world size: the hooked ``pos_embed``, which sees the image's real
    token count, sets it (and gives those tokens identity rotations); the attention masks
    them as keys.  One object shared by a transformer's hook and attention modules."""

    def __init__(self) -> None:
        self.tokens = 0


def _position_rows(first: int, count: int, batch: int, device: torch.device) -> Tensor:
    return torch.arange(first, first + count, device=device).repeat(batch, 1)


_cached_position_rows = functools.lru_cache(maxsize=8)(_position_rows)


def _positions(first: int, count: int, batch: int, device: torch.device) -> Tensor:
    """int64 ``[batch, count]``: rows ``first, ..., first + count - 1`` of the RoPE table for
    every sequence of the batch.  Kept across eager calls (read only): a FLUX forward asks
    for the same two or three ranges in every block.  Under ``torch.compile``, which does not
    honour the cache, traced into the graph."""
    build = _position_rows if torch.compiler.is_compiling() else _cached_position_rows
    return build(first, count, batch, device)


def _stream_layer(attn: nn.Module, qkv: tuple[Tensor, Tensor | None],
                  norms: tuple[nn.Module, nn.Module], out: nn.Linear | None, *, group,
                  max_tokens: int, **layer_options) -> UlyssesAttention:
    """A ``UlyssesAttention`` with one stream's weights of ``attn`` (a FLUX or Qwen-Image
    attention): ``qkv``, its ``q, k, v`` projections' weights ``[3 * inner, dim]`` and biases
    (or None) stacked, its ``q, k`` RMSNorms and its output projection (None: no o_proj),
    interleaved RoPE, attention over every token."""
    weight, bias = qkv
    heads = attn.heads
    options = dict(group=group, max_tokens=max_tokens, qkv_bias=bias is not None,
                   qk_norm=True, rope_style="interleaved", causal=False,
                   eps=norms[0].eps or torch.finfo(weight.dtype).eps, o_proj=out is not None,
                   o_bias=out is not None and out.bias is not None, device=weight.device,
                   dtype=weight.dtype)
    options.update(layer_options)
    layer = UlyssesAttention(weight.shape[1], heads, heads, weight.shape[0] // (3 * heads),
                             **options)
    with torch.no_grad():
        layer.qkv_weight.copy_(weight)
        if layer.qkv_bias is not None:
            layer.qkv_bias.copy_(bias)
        # A norm without a weight normalises all the same: the layer's weights stay ones.
        for mine, theirs in ((layer.q_norm_weight, norms[0]), (layer.k_norm_weight, norms[1])):
            if theirs.weight is not None:
                mine.copy_(theirs.weight)
        if out is not None:
            layer.o_weight.copy_(out.weight)
            if layer.o_bias is not None:
                layer.o_bias.copy_(out.bias)
    return layer


class FluxUlyssesAttention(nn.Module):
    """A FLUX single-stream block's attention on this rank's token shard (``self.layer`` owns
    the weights)."""

    # Submodules of the replaced attention this module keeps and calls as they are (so their
    # LoRA adapters, merged or not, keep working); it copies the others' weights.
    KEPT_SUBMODULES: tuple[str, ...] = ()

    def __init__(self, attn: nn.Module, *, group=None, max_tokens: int, **layer_options) -> None:
        super().__init__()
        resolved = resolve_group(group)
        self._world, self._rank = dist.get_world_size(resolved), dist.get_rank(resolved)
        self.head_dim, self.heads = attn.head_dim, attn.heads
        self.layer = _stream_layer(attn, self._qkv(attn), (attn.norm_q, attn.norm_k), None,
                                   group=group, max_tokens=max_tokens, **layer_options)

    @staticmethod
    def _qkv(attn: nn.Module) -> tuple[Tensor, Tensor | None]:
        """``attn``'s ``q, k, v`` projection weights and biases, stacked."""
        return stacked_projections((attn.to_q, attn.to_k, attn.to_v))

    def forward(self, hidden_states: Tensor, encoder_hidden_states: Tensor | None = None,
                attention_mask: Tensor | None = None,
                image_rotary_emb: tuple[Tensor, Tensor] | None = None, **kwargs) -> Tensor:
        if encoder_hidden_states is not None or attention_mask is not None or kwargs:
            raise ValueError(f"{type(self).__name__} (single-stream block attention) takes "
                             "hidden_states and image_rotary_emb only; got "
                             f"encoder_hidden_states={encoder_hidden_states is not None}, "
                             f"attention_mask={attention_mask is not None}, {sorted(kwargs)}")
        return self._attend(hidden_states, image_rotary_emb)

    def _attend(self, hidden_states: Tensor,
                image_rotary_emb: tuple[Tensor, Tensor] | None) -> Tensor:
        """The attention output ``[B, S_local, heads * D]`` of this rank's tokens, with RoPE
        rows of this shard or of the whole sequence."""
        if image_rotary_emb is None:
            raise ValueError(f"{type(self).__name__} needs image_rotary_emb (cos, sin)")
        batch, seq_local = hidden_states.shape[:2]
        rows = image_rotary_emb[0].shape[0]
        if rows == self._world * seq_local:  # the whole sequence's: this rank's rows
            first = self._rank * seq_local
        elif rows == seq_local:
            first = 0
        else:
            raise ValueError(f"image_rotary_emb has {rows} rows; expected the whole "
                             f"sequence's ({self._world * seq_local}) or this shard's "
                             f"({seq_local})")
        return self.layer(hidden_states, _rope_table(image_rotary_emb),
                          _positions(first, seq_local, batch, hidden_states.device))


class Flux2ParallelUlyssesAttention(FluxUlyssesAttention):
    """A FLUX.2 single-stream block's ``Flux2ParallelSelfAttention`` on this rank's token
    shard: attention and MLP side by side.  Its fused ``to_qkv_mlp_proj`` is split: the
    ``q, k, v`` rows become ``self.layer``'s projection, the MLP rows ``self.mlp_in``; the
    attention output and the MLP's SwiGLU are joined for ``to_out`` as diffusers' processor
    does.  ``to_out`` is the block's own module (its adapters, merged or not, keep working)."""

    KEPT_SUBMODULES = ("to_out",)

    def __init__(self, attn: nn.Module, *, group=None, max_tokens: int, **layer_options) -> None:
        super().__init__(attn, group=group, max_tokens=max_tokens, **layer_options)
        fused = attn.to_qkv_mlp_proj
        qkv_rows = self.layer.qkv_weight.shape[0]  # the rest are the MLP's
        self.mlp_in = nn.Linear(fused.in_features, fused.out_features - qkv_rows,
                                bias=fused.bias is not None, device=fused.weight.device,
                                dtype=fused.weight.dtype)
        with torch.no_grad():
            self.mlp_in.weight.copy_(fused.weight[qkv_rows:])
            if fused.bias is not None:
                self.mlp_in.bias.copy_(fused.bias[qkv_rows:])
        self.mlp_act_fn, self.to_out = attn.mlp_act_fn, attn.to_out

    @staticmethod
    def _qkv(attn: nn.Module) -> tuple[Tensor, Tensor | None]:
        """The ``q, k, v`` rows of ``attn.to_qkv_mlp_proj`` (weight and bias)."""
        fused, qkv_rows = attn.to_qkv_mlp_proj, 3 * attn.inner_dim
        return fused.weight[:qkv_rows], None if fused.bias is None else fused.bias[:qkv_rows]

    def forward(self, hidden_states: Tensor, attention_mask: Tensor | None = None,
                image_rotary_emb: tuple[Tensor, Tensor] | None = None, **kwargs) -> Tensor:
        if attention_mask is not None or kwargs:
            raise ValueError("Flux2ParallelUlyssesAttention (single-stream block attention) "
                             "takes hidden_states and image_rotary_emb only; got "
                             f"attention_mask={attention_mask is not None}, {sorted(kwargs)}")
        o = self._attend(hidden_states, image_rotary_emb)
        mlp = self.mlp_act_fn(self.mlp_in(hidden_states))
        return self.to_out(torch.cat([o.to(mlp.dtype), mlp], dim=-1))


class DualStreamUlyssesAttention(nn.Module):
    """A dual-stream block's attention on this rank's text and image tokens (``self.text``
    and ``self.image`` own the weights), each stream split evenly over the ranks: the
    modules of FLUX's and Qwen-Image's dual-stream blocks, which differ in their calls only.

    The joined bands are a copy of both streams' (``torch.cat``), and the attention output
    is split by copies too.
    """

    KEPT_SUBMODULES: tuple[str, ...] = ()  # as FluxUlyssesAttention's

    def __init__(self, attn: nn.Module, *, group=None, max_tokens: int, **layer_options) -> None:
        super().__init__()
        self._group = resolve_group(group)
        stream = dict(group=group, max_tokens=max_tokens, **layer_options)
        pool = stream.pop("slot_pool", "default")
        self.image = _stream_layer(attn, stacked_projections((attn.to_q, attn.to_k, attn.to_v)),
                                   (attn.norm_q, attn.norm_k), attn.to_out[0], slot_pool=pool,
                                   **stream)
        # Both output steps' backwards run before the joint attention's: the text layer's
        # d_o must not go through the slot the image layer's shares with other layers.  Its
        # front end's bands are kept while the image's front end runs: another pool.
        text_qkv = stacked_projections((attn.add_q_proj, attn.add_k_proj, attn.add_v_proj))
        self.text = _stream_layer(attn, text_qkv,
                                  (attn.norm_added_q, attn.norm_added_k), attn.to_add_out,
                                  share_backward_exchange=False,
                                  slot_pool=None if pool is None else f"{pool} text", **stream)
        # diffusers' to_out[1] is a Dropout: applied to the image output as the processor does.
        self.dropout = attn.to_out[1]

    def _attend_streams(self, hidden_states: Tensor, encoder_hidden_states: Tensor,
                        table: Tensor, key_mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """``(image out [B, I_local, dim], text out [B, T_local, dim])`` from this rank's
        image and text tokens; ``table``: fp32 ``[T_local + I_local, D]``, the text rows
        first; ``key_mask``: bool over the joint sequence (every rank's text, then every
        rank's image tokens) or None."""
        text_local, image_local = encoder_hidden_states.shape[1], hidden_states.shape[1]
        batch, device = hidden_states.shape[0], hidden_states.device
        q_t, k_t, v_t = self.text.front_end(encoder_hidden_states, table,
                                            _positions(0, text_local, batch, device))
        q_i, k_i, v_i = self.image.front_end(hidden_states, table,
                                             _positions(text_local, image_local, batch, device))
        o = self.image.attend(torch.cat((q_t, q_i), 1), torch.cat((k_t, k_i), 1),
                              torch.cat((v_t, v_i), 1), key_mask=key_mask)
        o_t, o_i = o.split((q_t.shape[1], q_i.shape[1]), dim=1)
        image_out = self.dropout(self.image.back_end(o_i.contiguous()))
        return image_out, self.text.back_end(o_t.contiguous())


class FluxDualUlyssesAttention(DualStreamUlyssesAttention):
    """A FLUX dual-stream block's attention (``forward`` returns ``(image out, text out)``
    like diffusers' processor)."""

    def forward(self, hidden_states: Tensor, encoder_hidden_states: Tensor | None = None,
                attention_mask: Tensor | None = None,
                image_rotary_emb: tuple[Tensor, Tensor] | None = None,
                **kwargs) -> tuple[Tensor, Tensor]:
        if encoder_hidden_states is None or attention_mask is not None or kwargs:
            raise ValueError("FluxDualUlyssesAttention (dual-stream block attention) takes "
                             "hidden_states, encoder_hidden_states and image_rotary_emb; got "
                             f"encoder_hidden_states={encoder_hidden_states is not None}, "
                             f"attention_mask={attention_mask is not None}, {sorted(kwargs)}")
        text_local, image_local = encoder_hidden_states.shape[1], hidden_states.shape[1]
        rows = None if image_rotary_emb is None else image_rotary_emb[0].shape[0]
        if rows != text_local + image_local:
            raise ValueError(f"FluxDualUlyssesAttention needs image_rotary_emb with a row per "
                             f"local token, text first ({text_local} + {image_local}); got "
                             f"{rows}: pass each rank's own txt_ids and img_ids")
        return self._attend_streams(hidden_states, encoder_hidden_states,
                                    _rope_table(image_rotary_emb))


class QwenImageUlyssesAttention(DualStreamUlyssesAttention):
    """A ``QwenImageTransformerBlock``'s attention: ``forward(hidden_states,
    encoder_hidden_states, encoder_hidden_states_mask=None, attention_mask=None,
    image_rotary_emb=(img_freqs, txt_freqs))`` -> ``(image out, text out)`` like diffusers'
    ``QwenDoubleStreamAttnProcessor2_0``.

    ``encoder_hidden_states_mask`` ``[B, T_local]`` (nonzero: a real text token) masks the
    text padding out of every query's keys: the ranks' masks are gathered once per
    transformer forward (``_joint_key_mask``).  ``image_rotary_emb``: this rank's rows,
    ``[I_local, D/2]`` and ``[T_local, D/2]`` complex, as the hooked ``pos_embed`` of a
    whole transformer under ``apply_ulysses`` gives them.  ``image_padding``: the tokens
    after the image's end, up to a multiple of the world size (masked as keys).
    """

    def __init__(self, attn: nn.Module, **options) -> None:
        super().__init__(attn, **options)
        self.image_padding = _ImagePadding()

    def forward(self, hidden_states: Tensor, encoder_hidden_states: Tensor | None = None,
                encoder_hidden_states_mask: Tensor | None = None,
                attention_mask: Tensor | None = None,
                image_rotary_emb: tuple[Tensor, Tensor] | None = None,
                **kwargs) -> tuple[Tensor, Tensor]:
        if encoder_hidden_states is None or attention_mask is not None or kwargs:
            raise ValueError("QwenImageUlyssesAttention takes hidden_states, "
                             "encoder_hidden_states, encoder_hidden_states_mask and "
                             "image_rotary_emb; got encoder_hidden_states="
                             f"{encoder_hidden_states is not None}, attention_mask="
                             f"{attention_mask is not None}, {sorted(kwargs)}")
        batch, text_local = encoder_hidden_states.shape[:2]
        image_local = hidden_states.shape[1]
        rows = None if image_rotary_emb is None else tuple(f.shape[0] for f in image_rotary_emb)
        if rows != (image_local, text_local):
            raise ValueError(f"QwenImageUlyssesAttention needs image_rotary_emb with this "
                             f"rank's rows (image, text) = ({image_local}, {text_local}); got "
                             f"{rows}: apply_ulysses to the whole QwenImageTransformer2DModel "
                             f"(its pos_embed then gives each rank its rows, the image padded "
                             f"at its end to a multiple of the world size), or pass them")
        if encoder_hidden_states_mask is not None and (
                tuple(encoder_hidden_states_mask.shape) != (batch, text_local)):
            raise ValueError(f"encoder_hidden_states_mask must have shape [B, T_local] = "
                             f"[{batch}, {text_local}], got "
                             f"{list(encoder_hidden_states_mask.shape)}")
        key_mask = None
        if encoder_hidden_states_mask is not None or self.image_padding.tokens:
            world = self.image.session.world_size
            key_mask = _joint_key_mask(encoder_hidden_states_mask, (batch, world * text_local),
                                       world * image_local, self.image_padding.tokens,
                                       self._group, hidden_states.device)
        img_freqs, txt_freqs = image_rotary_emb
        return self._attend_streams(hidden_states, encoder_hidden_states,
                                    _complex_rope_table(txt_freqs, img_freqs), key_mask)


def _shard_rope_rows(pos_embed: nn.Module, rank: int, world: int,
                     padding: _ImagePadding) -> None:
    """Hook Qwen-Image's ``pos_embed(img_shapes, max_txt_seq_len=T_local)``: it computes the
    frequencies of the whole text (``W * T_local`` tokens) and image, the image's padded to a
    multiple of ``W`` with identity rotations (``padding.tokens`` of them, set here each
    forward), and returns this rank's rows of each, ``(img_freqs [I_local],
    txt_freqs [T_local])``."""
    def whole_text(module: nn.Module, args: tuple, kwargs: dict[str, Any]):
        if "max_txt_seq_len" in kwargs:  # as the transformer calls it
            kwargs["max_txt_seq_len"] = int(kwargs["max_txt_seq_len"]) * world
        else:  # forward(video_fhw, device, max_txt_seq_len)
            args = (*args[:2], int(args[2]) * world, *args[3:])
        return args, kwargs

    def own_rows(module: nn.Module, args: tuple, kwargs: dict[str, Any], output):
        img_freqs, txt_freqs = output
        padding.tokens = -img_freqs.shape[0] % world
        if padding.tokens:
            img_freqs = torch.cat((img_freqs, img_freqs.new_ones(padding.tokens,
                                                                 img_freqs.shape[1])))
        i, t = img_freqs.shape[0] // world, txt_freqs.shape[0] // world
        return img_freqs[rank * i:(rank + 1) * i], txt_freqs[rank * t:(rank + 1) * t]

    pos_embed.register_forward_pre_hook(whole_text, with_kwargs=True)
    pos_embed.register_forward_hook(own_rows, with_kwargs=True)


def _replacements() -> tuple[dict[type, type], tuple[type, ...]]:
    """``({block class: its attention's replacement}, the attention classes replaced)`` of
    this diffusers: FLUX's and Qwen-Image's, and FLUX.2's where diffusers has it (0.36 on)."""
    from diffusers.models.transformers.transformer_flux import (
        FluxAttention,
        FluxSingleTransformerBlock,
        FluxTransformerBlock,
    )
    from diffusers.models.transformers.transformer_qwenimage import QwenImageTransformerBlock

    kinds = {FluxSingleTransformerBlock: FluxUlyssesAttention,
             FluxTransformerBlock: FluxDualUlyssesAttention,
             QwenImageTransformerBlock: QwenImageUlyssesAttention}
    attentions: tuple[type, ...] = (FluxAttention,)
    try:
        from diffusers.models.transformers.transformer_flux2 import (
            Flux2Attention,
            Flux2ParallelSelfAttention,
            Flux2SingleTransformerBlock,
            Flux2TransformerBlock,
        )
    except ImportError:
        return kinds, attentions
    kinds.update({Flux2SingleTransformerBlock: Flux2ParallelUlyssesAttention,
                  Flux2TransformerBlock: FluxDualUlyssesAttention})
    return kinds, (*attentions, Flux2Attention, Flux2ParallelSelfAttention)


def _apply_video(model: nn.Module, group, max_tokens: int, core_options: dict) -> bool:
    """``apply_ulysses`` of a Wan, LTX-Video, HunyuanVideo, CogVideoX or SD3 transformer or
    block (``diffusers_video``); False for any other model."""
    from diffusers.models.attention import JointTransformerBlock
    from diffusers.models.transformers.cogvideox_transformer_3d import (
        CogVideoXBlock,
        CogVideoXTransformer3DModel,
    )
    from diffusers.models.transformers.transformer_hunyuan_video import (
        HunyuanVideoSingleTransformerBlock,
        HunyuanVideoTransformer3DModel,
        HunyuanVideoTransformerBlock,
    )
    from diffusers.models.transformers.transformer_ltx import (
        LTXVideoTransformer3DModel,
        LTXVideoTransformerBlock,
    )
    from diffusers.models.transformers.transformer_sd3 import SD3Transformer2DModel
    from diffusers.models.transformers.transformer_wan import (
        WanTransformer3DModel,
        WanTransformerBlock,
    )

    from cake_sp.integrations.diffusers_video import (
        JointTextAttnProcessor,
        LTXUlyssesAttnProcessor,
        PlainSelfAttnProcessor,
        TextShards,
        WanUlyssesAttnProcessor,
        shard_tokens,
    )

    # SD3's text is split over the ranks with its image (a few hundred tokens beside a few
    # thousand: its text stream's share of a rank's work would be large); the video models'
    # text, a small share, stays whole on every rank, the joint attention's joint tokens.
    text_shards = TextShards()

    # transformer class: (its blocks' classes, {an attention's name in them: its processor})
    kinds = {WanTransformer3DModel: ((WanTransformerBlock,), {"attn1": WanUlyssesAttnProcessor}),
             LTXVideoTransformer3DModel: ((LTXVideoTransformerBlock,),
                                          {"attn1": LTXUlyssesAttnProcessor}),
             HunyuanVideoTransformer3DModel: ((HunyuanVideoTransformerBlock,
                                               HunyuanVideoSingleTransformerBlock),
                                              {"attn": JointTextAttnProcessor}),
             CogVideoXTransformer3DModel: ((CogVideoXBlock,), {"attn1": JointTextAttnProcessor}),
             # attn2: SD3.5's, or None; its core has a d_o slot of its own, as a compiled
             # block may run both cores' output backwards before either attention backward.
             SD3Transformer2DModel: ((JointTransformerBlock,),
                                     {"attn": functools.partial(JointTextAttnProcessor,
                                                                text_shards=text_shards),
                                      "attn2": functools.partial(PlainSelfAttnProcessor,
                                                                 share_backward_exchange=False)})}
    for model_class, (block_classes, processors) in kinds.items():
        if isinstance(model, (model_class, *block_classes)):
            if getattr(getattr(model, "config", None), "image_condition_type", None) == \
                    "token_replace":
                raise ValueError("apply_ulysses: a HunyuanVideoTransformer3DModel with "
                                 "image_condition_type='token_replace' is not supported (its "
                                 "first frame's tokens are conditioned apart)")
            for block in [m for m in model.modules() if isinstance(m, block_classes)]:
                for name, processor in processors.items():
                    attn = getattr(block, name)
                    if attn is not None:
                        attn.set_processor(processor(attn, group=group, max_tokens=max_tokens,
                                                     **core_options))
            if isinstance(model, model_class):
                shard_tokens(model, group, text_shards)
            return True
        if any(isinstance(m, block_classes) for m in model.modules()):
            raise ValueError(f"apply_ulysses: {type(model).__name__} is not supported; of its "
                             f"family, a {model_class.__name__} or one of its blocks is")
    return False


def apply_ulysses(model: nn.Module, group=None, *, max_tokens: int, **layer_options) -> nn.Module:
    """Replace the attention of every FLUX, FLUX.2 and Qwen-Image transformer block
    (``FluxSingleTransformerBlock``, ``FluxTransformerBlock``, ``Flux2SingleTransformerBlock``,
    ``Flux2TransformerBlock``, ``QwenImageTransformerBlock``) in ``model`` (such a
    transformer, or one block) in place; every rank must call.  Returns ``model``.  A whole
    ``QwenImageTransformer2DModel`` also gets its ``pos_embed`` hooked, so that each rank's
    blocks receive its rows of the whole sequence's frequencies.

    A ``WanTransformer3DModel``, ``LTXVideoTransformer3DModel``,
    ``HunyuanVideoTransformer3DModel``, ``CogVideoXTransformer3DModel`` or
    ``SD3Transformer2DModel``, or one of their blocks: the processor of every block's
    self-attention becomes a ``WanUlyssesAttnProcessor``, ``LTXUlyssesAttnProcessor``,
    ``JointTextAttnProcessor`` or ``PlainSelfAttnProcessor``
    (``diffusers_video``; its ``UlyssesAttentionCore``
    takes ``layer_options`` of the core's), and a whole transformer gets hooks that shard its
    video tokens inside, so that every rank calls it with the whole inputs and gets the whole
    output.

    ``max_tokens``: most rows ``B * S_local`` one call may have on a rank (of each stream,
    in a dual-stream block; for HunyuanVideo, CogVideoX and SD3 the rank's video (image)
    tokens and the whole text).
    Raises ``ValueError``, before replacing anything, for a FLUX attention outside those
    blocks, when there is none of them, for an attention with unmerged LoRA adapters
    (``check_adapters_merged``), for a Qwen-Image transformer with ``zero_cond_t`` (its
    per-token modulation covers the whole image) and for a HunyuanVideo transformer with
    ``image_condition_type="token_replace"``; an SD3 transformer called with a ControlNet's
    residuals or IP-Adapter embeddings raises ``ValueError`` from its forward.
    """
    from diffusers.models.transformers.transformer_qwenimage import QwenImageTransformer2DModel

    if _apply_video(model, group, max_tokens, layer_options):
        return model
    kinds, attentions = _replacements()
    supported = ", ".join(k.__name__ for k in kinds)
    blocks = [(n, m) for n, m in model.named_modules() if type(m) in kinds]
    inside = {f"{n}.attn" if n else "attn" for n, _ in blocks}
    others = [n for n, m in model.named_modules()
              if isinstance(m, attentions) and n not in inside]
    if others:
        raise ValueError(f"apply_ulysses: the attention at {others[:3]} is not inside a "
                         f"{supported}")
    if not blocks:
        raise ValueError(f"apply_ulysses: {type(model).__name__} has none of {supported}")
    names = [(f"{n}.attn" if n else "attn", b) for n, b in blocks]
    check_adapters_merged([(name, b.attn) for name, b in names],
                          kept={f"{name}.{sub}" for name, b in names
                                for sub in kinds[type(b)].KEPT_SUBMODULES})
    qwen_image = isinstance(model, QwenImageTransformer2DModel)
    if qwen_image and model.config.zero_cond_t:
        raise ValueError("apply_ulysses: a QwenImageTransformer2DModel with zero_cond_t=True "
                         "is not supported (its modulation index covers the whole image)")
    rope_arguments = inspect.signature(model.pos_embed.forward).parameters if qwen_image else {}
    if qwen_image and "max_txt_seq_len" not in rope_arguments:
        raise ValueError("apply_ulysses: this diffusers' Qwen-Image pos_embed takes no "
                         "max_txt_seq_len; install a diffusers whose does (0.42 does)")
    for _, block in blocks:
        block.attn = kinds[type(block)](block.attn, group=group, max_tokens=max_tokens,
                                        **layer_options)
    if qwen_image:  # one padding for the hook and every block of the transformer
        padding = _ImagePadding()
        for _, block in blocks:
            block.attn.image_padding = padding
        resolved = resolve_group(group)
        _shard_rope_rows(model.pos_embed, dist.get_rank(resolved),
                         dist.get_world_size(resolved), padding)
    return model


# shard_calls: per transformer class, its inputs split by image tokens and by text tokens
# (name, token dimension), and whether they may be padded with masked tokens (Qwen-Image).
_SHARDED_INPUTS = {
    "FluxTransformer2DModel": ((("hidden_states", 1), ("img_ids", -2)),
                               (("encoder_hidden_states", 1), ("txt_ids", -2)), False),
    "Flux2Transformer2DModel": ((("hidden_states", 1), ("img_ids", -2)),
                                (("encoder_hidden_states", 1), ("txt_ids", -2)), False),
    "QwenImageTransformer2DModel": ((("hidden_states", 1),),
                                    (("encoder_hidden_states", 1),
                                     ("encoder_hidden_states_mask", 1)), True),
}


def shard_calls(model: nn.Module, group=None) -> nn.Module:
    """Let every rank call ``model``, a FLUX or Qwen-Image transformer under
    ``apply_ulysses``, with the whole inputs, as diffusers' pipelines do: a forward pre-hook
    hands the model this rank's shard (the text and the image tokens each split evenly over
    the ranks), and a forward hook gathers every rank's image tokens, so that each rank
    returns the whole output.  Qwen-Image's text and image tokens are first padded to a
    multiple of the world size with tokens masked as keys (the image's dropped from the
    output); FLUX's must split evenly.  Inputs by keyword, as the pipelines pass them.  The
    gather is differentiable (``integrations.gather_tokens``): for training, every rank
    computes the same loss of the whole output, and a sum of the gradients over the group
    makes them whole.  Returns ``model``.
    """
    name = type(model).__name__
    if name not in _SHARDED_INPUTS:
        raise ValueError(f"shard_calls: {name} is not one of {sorted(_SHARDED_INPUTS)}")
    image_inputs, text_inputs, pads = _SHARDED_INPUTS[name]
    resolved = resolve_group(group)
    rank, world = dist.get_rank(resolved), dist.get_world_size(resolved)
    if not any(isinstance(m, (FluxUlyssesAttention, DualStreamUlyssesAttention))
               for m in model.modules()):
        raise ValueError(f"shard_calls: {name} has no replaced attention: apply_ulysses first")
    image_tokens = []  # the current call's, before padding

    def own_rows(t: Tensor, dim: int) -> Tensor:
        size = t.shape[dim] // world
        return t.narrow(dim, rank * size, size)

    def shard(module: nn.Module, args: tuple, kwargs: dict[str, Any]):
        if args:
            raise TypeError(f"shard_calls: pass {name}'s inputs by keyword")
        kwargs = dict(kwargs)
        image, text = kwargs["hidden_states"], kwargs["encoder_hidden_states"]
        image_tokens[:] = [image.shape[1]]
        if pads:
            pad = -text.shape[1] % world
            if pad:
                mask = kwargs.get("encoder_hidden_states_mask")
                if mask is None:
                    mask = torch.ones(text.shape[:2], dtype=torch.int64, device=text.device)
                kwargs["encoder_hidden_states"] = F.pad(text, (0, 0, 0, pad))
                kwargs["encoder_hidden_states_mask"] = F.pad(mask, (0, pad))
            kwargs["hidden_states"] = F.pad(image, (0, 0, 0, -image.shape[1] % world))
        for key, dim in (*image_inputs, *text_inputs):
            value = kwargs.get(key)
            if value is None:
                continue
            if value.shape[dim] % world:
                raise ValueError(f"shard_calls: {key} has {value.shape[dim]} tokens, not a "
                                 f"multiple of the world size {world}")
            kwargs[key] = own_rows(value, dim)
        return (), kwargs

    def gather(module: nn.Module, args: tuple, kwargs: dict[str, Any], output):
        local = output[0] if isinstance(output, tuple) else output.sample
        whole = gather_tokens(local, resolved)[:, :image_tokens[0]]
        return (whole, *output[1:]) if isinstance(output, tuple) else type(output)(sample=whole)

    model.register_forward_pre_hook(shard, with_kwargs=True)
    model.register_forward_hook(gather, with_kwargs=True)
    return model
