"""``apply_ulysses(model)``: Ulysses sequence parallelism for the FLUX single-stream blocks.

The ``FluxAttention`` of every ``FluxSingleTransformerBlock`` is replaced by
``FluxUlyssesAttention``: a ``UlyssesAttention`` without o_proj (the block's
``proj_out`` follows), with the same ``to_q/to_k/to_v`` weights and biases, the
``norm_q/norm_k`` RMSNorm weights and interleaved RoPE, behind the module's call
``forward(hidden_states, encoder_hidden_states=None, attention_mask=None,
image_rotary_emb=None)``.  The whole ``[text; image]`` sequence is sharded by
tokens: rank ``r`` passes the block the text tokens and the image tokens that fall
in its shard ``[r * S_local, (r + 1) * S_local)`` (``encoder_hidden_states`` may have
no tokens), and ``image_rotary_emb`` for the whole sequence or for its shard.

Dual-stream ``FluxTransformerBlock`` attention is not supported yet: a model that
has it raises ``ValueError`` naming the module, rather than attending over one
shard only.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn

from cake_sp.integrations import LastInputs
from cake_sp.layer import UlyssesAttention
from cake_sp.session.overlap import resolve_group

# One table per transformer forward, shared by the blocks (they get the same embeddings).
_ROPE_TABLE = LastInputs()


class FluxUlyssesAttention(nn.Module):
    """A single-stream block's attention on this rank's token shard (``self.layer`` owns the
    weights)."""

    def __init__(self, attn: nn.Module, *, group=None, max_tokens: int, **layer_options) -> None:
        super().__init__()
        resolved = resolve_group(group)
        self._world, self._rank = dist.get_world_size(resolved), dist.get_rank(resolved)
        self.head_dim, self.heads = attn.head_dim, attn.heads
        weight = attn.to_q.weight
        affine = attn.norm_q.weight is not None
        options = dict(group=group, max_tokens=max_tokens, qkv_bias=attn.to_q.bias is not None,
                       qk_norm=affine, rope_style="interleaved", causal=False,
                       eps=attn.norm_q.eps or torch.finfo(weight.dtype).eps, o_proj=False,
                       device=weight.device, dtype=weight.dtype)
        options.update(layer_options)
        self.layer = UlyssesAttention(attn.query_dim, attn.heads, attn.heads, attn.head_dim,
                                      **options)
        with torch.no_grad():
            projections = (attn.to_q, attn.to_k, attn.to_v)
            self.layer.qkv_weight.copy_(torch.cat([p.weight for p in projections]))
            if self.layer.qkv_bias is not None:
                self.layer.qkv_bias.copy_(torch.cat([p.bias for p in projections]))
            if affine:
                self.layer.q_norm_weight.copy_(attn.norm_q.weight)
                self.layer.k_norm_weight.copy_(attn.norm_k.weight)

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
        cos, sin = image_rotary_emb
        world, rank = self._world, self._rank
        if cos.shape[0] == world * seq_local:  # the whole sequence's: this rank's rows
            first = rank * seq_local
        elif cos.shape[0] == seq_local:
            first = 0
        else:
            raise ValueError(f"image_rotary_emb has {cos.shape[0]} rows; expected the whole "
                             f"sequence's ({world * seq_local}) or this shard's ({seq_local})")

        def table_and_positions():
            # FLUX repeats each frequency for both channels of its pair: keep one of each.
            table = torch.cat((cos[:, 0::2], sin[:, 0::2]), dim=-1).float()
            positions = torch.arange(first, first + seq_local, device=hidden_states.device)
            return table, positions.repeat(batch, 1)

        table, positions = _ROPE_TABLE.get((cos, sin), (first, batch, seq_local),
                                           table_and_positions)
        return self.layer(hidden_states, table, positions)


def apply_ulysses(model: nn.Module, group=None, *, max_tokens: int, **layer_options) -> nn.Module:
    """Replace the attention of every ``FluxSingleTransformerBlock`` in ``model`` (a FLUX
    transformer or one block) in place; every rank must call.  Returns ``model``.

    ``max_tokens``: most rows ``B * S_local`` one call may have on a rank.
    Raises ``ValueError`` for a ``FluxAttention`` outside a single-stream block, or
    when there is no single-stream block.
    """
    from diffusers.models.transformers.transformer_flux import (
        FluxAttention,
        FluxSingleTransformerBlock,
    )

    blocks = [(n, m) for n, m in model.named_modules() if isinstance(m, FluxSingleTransformerBlock)]
    inside = {f"{n}.attn" if n else "attn" for n, _ in blocks}
    others = [n for n, m in model.named_modules()
              if isinstance(m, FluxAttention) and n not in inside]
    if others:
        raise ValueError(f"apply_ulysses: the attention at {others[:3]} is not inside a "
                         "FluxSingleTransformerBlock; only single-stream blocks are supported")
    if not blocks:
        raise ValueError(f"apply_ulysses: {type(model).__name__} has no "
                         "FluxSingleTransformerBlock (the supported module)")
    for _, block in blocks:
        block.attn = FluxUlyssesAttention(block.attn, group=group, max_tokens=max_tokens,
                                          **layer_options)
    return model
