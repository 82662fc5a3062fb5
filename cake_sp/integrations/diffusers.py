"""``apply_ulysses(model)``: Ulysses sequence parallelism for the attention of FLUX blocks.

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

Both take the call ``forward(hidden_states, encoder_hidden_states=None,
attention_mask=None, image_rotary_emb=None)`` on this rank's tokens.  How the tokens are
sharded:

* a whole FLUX transformer: the text tokens and the image tokens are each split evenly
  over the ranks; rank ``r`` passes its text tokens, its image tokens and their own
  ``txt_ids``/``img_ids``, so ``image_rotary_emb`` has a row per local token (its text
  rows first), which both modules take;
* a single-stream block alone may also take the whole ``[text; image]`` sequence sharded
  by tokens (rank ``r``'s rows ``[r * S_local, (r + 1) * S_local)``, either part maybe
  empty) with ``image_rotary_emb`` for the whole sequence, of which it takes its rows.

Attention is over all tokens at once, so the order of the gathered sequence does not
matter, only that each token keeps its own RoPE row.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import Tensor, nn

from cake_sp.integrations import LastInputs
from cake_sp.layer import UlyssesAttention
from cake_sp.session.overlap import resolve_group

# One table per transformer forward, shared by the blocks (they get the same embeddings).
_ROPE_TABLE = LastInputs()


def _rope_table(image_rotary_emb: tuple[Tensor, Tensor]) -> Tensor:
    """fp32 ``[rows, D]``: FLUX's ``(cos, sin)`` (each frequency repeated for both channels
    of its pair) as the layer's table, one of each pair: cos of the D/2 frequencies, then
    sin."""
    cos, sin = image_rotary_emb
    return _ROPE_TABLE.get((cos, sin), (), lambda: torch.cat((cos[:, 0::2], sin[:, 0::2]),
                                                              dim=-1).float())


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


def _stream_layer(attn: nn.Module, projections: tuple[nn.Linear, nn.Linear, nn.Linear],
                  norms: tuple[nn.Module, nn.Module], out: nn.Linear | None, *, group,
                  max_tokens: int, **layer_options) -> UlyssesAttention:
    """A ``UlyssesAttention`` with one stream's weights of ``attn`` (a ``FluxAttention``):
    its ``q, k, v`` projections, its ``q, k`` RMSNorms and its output projection (None: no
    o_proj), interleaved RoPE, attention over every token."""
    weight = projections[0].weight
    options = dict(group=group, max_tokens=max_tokens, qkv_bias=projections[0].bias is not None,
                   qk_norm=True, rope_style="interleaved", causal=False,
                   eps=norms[0].eps or torch.finfo(weight.dtype).eps, o_proj=out is not None,
                   o_bias=out is not None and out.bias is not None, device=weight.device,
                   dtype=weight.dtype)
    options.update(layer_options)
    layer = UlyssesAttention(projections[0].in_features, attn.heads, attn.heads, attn.head_dim,
                             **options)
    with torch.no_grad():
        layer.qkv_weight.copy_(torch.cat([p.weight for p in projections]))
        if layer.qkv_bias is not None:
            layer.qkv_bias.copy_(torch.cat([p.bias for p in projections]))
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
    """A single-stream block's attention on this rank's token shard (``self.layer`` owns the
    weights)."""

    def __init__(self, attn: nn.Module, *, group=None, max_tokens: int, **layer_options) -> None:
        super().__init__()
        resolved = resolve_group(group)
        self._world, self._rank = dist.get_world_size(resolved), dist.get_rank(resolved)
        self.head_dim, self.heads = attn.head_dim, attn.heads
        self.layer = _stream_layer(attn, (attn.to_q, attn.to_k, attn.to_v),
                                   (attn.norm_q, attn.norm_k), None, group=group,
                                   max_tokens=max_tokens, **layer_options)

    def forward(self, hidden_states: Tensor, encoder_hidden_states: Tensor | None = None,
                attention_mask: Tensor | None = None,
                image_rotary_emb: tuple[Tensor, Tensor] | None = None, **kwargs) -> Tensor:
        if encoder_hidden_states is not None or attention_mask is not None or kwargs:
            raise ValueError("FluxUlyssesAttention (single-stream block attention) takes "
                             "hidden_states and image_rotary_emb only; got "
                             f"encoder_hidden_states={encoder_hidden_states is not None}, "
                             f"attention_mask={attention_mask is not None}, {sorted(kwargs)}")
        if image_rotary_emb is None:
            raise ValueError("FluxUlyssesAttention needs image_rotary_emb (cos, sin)")
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


class FluxDualUlyssesAttention(nn.Module):
    """A dual-stream block's attention on this rank's text and image tokens (``self.text``
    and ``self.image`` own the weights), each stream split evenly over the ranks.

    ``forward`` returns ``(image out [B, I_local, dim], text out [B, T_local, dim])`` like
    diffusers' processor.  The joined bands are a copy of both streams' (``torch.cat``), and
    the attention output is split by copies too.
    """

    def __init__(self, attn: nn.Module, *, group=None, max_tokens: int, **layer_options) -> None:
        super().__init__()
        stream = dict(group=group, max_tokens=max_tokens, **layer_options)
        self.image = _stream_layer(attn, (attn.to_q, attn.to_k, attn.to_v),
                                   (attn.norm_q, attn.norm_k), attn.to_out[0], **stream)
        # Both output steps' backwards run before the joint attention's: the text layer's
        # d_o must not go through the slot the image layer's shares with other layers.
        self.text = _stream_layer(attn, (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj),
                                  (attn.norm_added_q, attn.norm_added_k), attn.to_add_out,
                                  share_backward_exchange=False, **stream)
        # diffusers' to_out[1] is a Dropout: applied to the image output as the processor does.
        self.dropout = attn.to_out[1]

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
        table = _rope_table(image_rotary_emb)
        batch, device = hidden_states.shape[0], hidden_states.device
        q_t, k_t, v_t = self.text.front_end(encoder_hidden_states, table,
                                            _positions(0, text_local, batch, device))
        q_i, k_i, v_i = self.image.front_end(hidden_states, table,
                                             _positions(text_local, image_local, batch, device))
        o = self.image.attend(torch.cat((q_t, q_i), 1), torch.cat((k_t, k_i), 1),
                              torch.cat((v_t, v_i), 1))
        o_t, o_i = o.split((q_t.shape[1], q_i.shape[1]), dim=1)
        image_out = self.dropout(self.image.back_end(o_i.contiguous()))
        return image_out, self.text.back_end(o_t.contiguous())


def apply_ulysses(model: nn.Module, group=None, *, max_tokens: int, **layer_options) -> nn.Module:
    """Replace the attention of every ``FluxSingleTransformerBlock`` and ``FluxTransformerBlock``
    in ``model`` (a FLUX transformer or one block) in place; every rank must call.  Returns
    ``model``.

    ``max_tokens``: most rows ``B * S_local`` one call may have on a rank (of each stream,
    in a dual-stream block).  Raises ``ValueError`` for a ``FluxAttention`` outside those
    blocks, or when there is none of them.
    """
    from diffusers.models.transformers.transformer_flux import (
        FluxAttention,
        FluxSingleTransformerBlock,
        FluxTransformerBlock,
    )

    kinds = {FluxSingleTransformerBlock: FluxUlyssesAttention,
             FluxTransformerBlock: FluxDualUlyssesAttention}
    blocks = [(n, m) for n, m in model.named_modules() if type(m) in kinds]
    inside = {f"{n}.attn" if n else "attn" for n, _ in blocks}
    others = [n for n, m in model.named_modules()
              if isinstance(m, FluxAttention) and n not in inside]
    if others:
        raise ValueError(f"apply_ulysses: the attention at {others[:3]} is not inside a "
                         "FluxSingleTransformerBlock or FluxTransformerBlock")
    if not blocks:
        raise ValueError(f"apply_ulysses: {type(model).__name__} has no "
                         "FluxSingleTransformerBlock or FluxTransformerBlock")
    for _, block in blocks:
        block.attn = kinds[type(block)](block.attn, group=group, max_tokens=max_tokens,
                                        **layer_options)
    return model
