"""``apply_ulysses(model)``: Ulysses sequence parallelism for a transformers decoder model.

Every attention module of a Qwen3, Qwen3-MoE, Qwen2, Qwen2-MoE, Llama, Mistral, Mixtral,
Granite, Granite-MoE, Seed-OSS, Arcee, Apertus, EXAONE 4, Gemma, Gemma 3 (text), StarCoder2,
Helium, dots.llm1, Gemma 2 or Phi-3 model (``SUPPORTED``) is replaced
by ``TransformersUlyssesAttention``: a ``UlyssesAttention`` holding the same weights
(``q_proj``, ``k_proj``, ``v_proj`` fused into ``qkv_weight``, or Phi-3's ``qkv_proj`` as it
is; per-head QK-norm weights where
the model has them; its softmax scale) behind the module's own call contract
``forward(hidden_states, position_embeddings, attention_mask=None, **kwargs) ->
(attn_output, None)``, so the decoder layers need no change.  Each rank then runs
the model on its shard of the tokens with the matching global positions::

    model = apply_ulysses(AutoModelForCausalLM.from_config(config), group=sp_group)
    s = input_ids.shape[1] // world
    logits = model(input_ids[:, rank * s:(rank + 1) * s],
                   position_ids=torch.arange(rank * s, (rank + 1) * s)[None]).logits

Packed sequences (several documents in one row, as transformers'
``DataCollatorWithFlattening`` makes them) are read from ``position_ids`` the way
transformers reads them: a token whose position is not its predecessor's plus one starts
a new sequence.  Padding is read from the 2-D ``attention_mask`` (each rank passes its
shard, like ``input_ids``): a run of padding is a sequence of its own, so real tokens never
attend to it, left or right.  The layers learn where every rank's sequences start from one
small all-gather per model forward and attend within each sequence only
(``UlyssesAttention``'s ``cu_seqlens``); padded tokens' outputs are not meaningful, as in
transformers.  Bounds passed as ``cu_seq_lens_q`` (transformers' flash-attn keyword
arguments, over the whole rows) are used as given instead.  ``shard_batch`` turns a batch
of whole rows into a rank's part: its tokens, the whole rows' bounds, and its tokens'
targets shifted over the whole rows.

Causal attention, over each layer's sliding window where the model has one (Mistral's
``sliding_window``, the sliding layers of Qwen2's, Qwen3's and the Gemmas' ``layer_types``),
with Gemma 2's soft-capped logits: a 4-D mask or a KV cache raises ``ValueError`` naming what
is supported, and so do what the layer does not compute (the Gemmas' bidirectional
configurations, models whose masks flash-attn cannot express, as Gemma 3's image tokens).
``apply_ulysses`` turns ``use_cache`` off and has the model build its masks as for
flash-attn: the 2-D mask where there is padding, else None.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch import Tensor, nn

from cake_sp._memo import LastInputs
from cake_sp.attention import row_bounds
from cake_sp.integrations import check_adapters_merged, stacked_projections
from cake_sp.layer import UlyssesAttention

# The attention classes replaced, by transformers module: each has q/k/v/o projections,
# ``head_dim``, ``scaling`` and rotate-half RoPE from the model's position embeddings (Qwen3's
# also per-head q_norm/k_norm); their decoder layers call them alike.
SUPPORTED = {"Qwen3Attention": "qwen3", "Qwen3MoeAttention": "qwen3_moe",
             "Qwen2Attention": "qwen2", "Qwen2MoeAttention": "qwen2_moe",
             "LlamaAttention": "llama", "MistralAttention": "mistral",
             "MixtralAttention": "mixtral", "GraniteAttention": "granite",
             "GraniteMoeAttention": "granitemoe", "SeedOssAttention": "seed_oss",
             "ArceeAttention": "arcee", "ApertusAttention": "apertus",
             "Exaone4Attention": "exaone4", "GemmaAttention": "gemma",
             "Starcoder2Attention": "starcoder2", "HeliumAttention": "helium",
             "Dots1Attention": "dots1", "Gemma2Attention": "gemma2",
             "Gemma3Attention": "gemma3", "Phi3Attention": "phi3"}
# Those that rotate channel pairs (2i, 2i + 1) rather than (i, i + D/2).
INTERLEAVED_ROPE = {"HeliumAttention"}
# Those whose QK norms scale by 1 + weight (zero-centred weights): UlyssesAttention's
# qk_norm_offset.
NORM_OFFSETS = {"Gemma3Attention": 1.0}
# Models whose masks flash-attn cannot express (image tokens attending both ways).
BEYOND_FLASH_MASKS = {"Gemma3Model"}
# The name apply_ulysses gives the model's attention implementation (config._attn_implementation).
ATTENTION_IMPLEMENTATION = "cake_sp_ulysses"
# One table and one packing per model forward, shared by the layers (they get the same
# position embeddings, position ids and given bounds).  The packing's derivation is
# collective, so whether a layer derives it must be the same on every rank: it is keyed on
# the position ids alone (one tensor for every layer of a forward, on every rank), not on
# the masks (a model of sliding and global layers gives each kind its own mask tensor on
# the ranks with padding, and None on the others), and cleared as the model's decoder
# starts a forward (``_clear_packing``).
_ROPE_TABLE = LastInputs()
_PACKING = LastInputs()


def _attention_classes() -> tuple[type, ...]:
    """The ``SUPPORTED`` classes this transformers has."""
    import importlib

    classes = []
    for name, module in SUPPORTED.items():
        try:
            found = importlib.import_module(f"transformers.models.{module}.modeling_{module}")
        except ImportError:
            continue
        classes.append(getattr(found, name))
    return tuple(classes)


def _sliding_window(attn: nn.Module) -> int | None:
    """The layer's sliding window, read where its model class reads it: the module's own
    ``sliding_window`` (Qwen2, Qwen3, their MoE models, dots.llm1, EXAONE 4, whose hybrid
    configurations ``apply_ulysses`` refuses), else the config's, for the layers
    ``config.layer_types`` marks as sliding or for every layer (Mistral, Mixtral,
    StarCoder2, Phi-3)."""
    if hasattr(attn, "sliding_window"):
        return attn.sliding_window or None
    config = attn.config
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and layer_types[attn.layer_idx] != "sliding_attention":
        return None
    return getattr(config, "sliding_window", None) or None


class TransformersUlyssesAttention(nn.Module):
    """A transformers attention module's replacement on this rank's token shard.

    ``self.layer`` is the ``UlyssesAttention`` that owns the weights; ``layer_idx`` and
    ``config`` are kept for code that reads them.
    """

    def __init__(self, attn: nn.Module, *, group=None, world_size: int, **layer_options) -> None:
        super().__init__()
        config = attn.config
        self.config, self.layer_idx = config, attn.layer_idx
        d = attn.head_dim
        self.head_dim = d
        self.attention_dropout = float(getattr(attn, "attention_dropout", 0.0))
        self.train(attn.training)  # the replaced module's mode, as model.eval() left it
        q_norm = getattr(attn, "q_norm", None)
        weight = attn.o_proj.weight
        kind = type(attn).__name__
        qkv_weight, qkv_bias = _qkv_projection(attn)
        options = dict(
            group=group, max_tokens=math.ceil(config.max_position_embeddings / world_size),
            qkv_bias=qkv_bias is not None, o_bias=attn.o_proj.bias is not None,
            qk_norm=q_norm is not None, qk_norm_offset=NORM_OFFSETS.get(kind, 0.0),
            causal=True, sliding_window=_sliding_window(attn),
            softcap=getattr(attn, "attn_logit_softcapping", None),
            rope_style="interleaved" if kind in INTERLEAVED_ROPE else "neox",
            # Gemma 3's norms name it eps, the others variance_epsilon.
            eps=getattr(q_norm, "variance_epsilon", getattr(q_norm, "eps", 1e-6)),
            softmax_scale=attn.scaling, device=weight.device, dtype=weight.dtype)
        options.update(layer_options)
        self.layer = UlyssesAttention(config.hidden_size, config.num_attention_heads,
                                      config.num_key_value_heads, d, **options)
        with torch.no_grad():
            self.layer.qkv_weight.copy_(qkv_weight)
            if self.layer.qkv_bias is not None:
                self.layer.qkv_bias.copy_(qkv_bias)
            if q_norm is not None:
                self.layer.q_norm_weight.copy_(q_norm.weight)
                self.layer.k_norm_weight.copy_(attn.k_norm.weight)
            self.layer.o_weight.copy_(attn.o_proj.weight)
            if self.layer.o_bias is not None:
                self.layer.o_bias.copy_(attn.o_proj.bias)

    def forward(self, hidden_states: Tensor, position_embeddings: tuple[Tensor, Tensor],
                attention_mask: Tensor | None = None, **kwargs) -> tuple[Tensor, None]:
        cache = kwargs.get("past_key_values", kwargs.get("cache"))
        if cache is not None:
            raise ValueError(f"layer {self.layer_idx}: a KV cache ({type(cache).__name__}) is not "
                             "supported by cake_sp's Ulysses attention yet; call the model with "
                             "use_cache=False")
        batch, seq_local = hidden_states.shape[:2]
        cos, sin = position_embeddings
        if cos.shape[-1] != self.head_dim:  # the same on every rank: all raise, none waits
            raise ValueError(f"layer {self.layer_idx}: partial rotary embeddings (RoPE on "
                             f"{cos.shape[-1]} of head_dim={self.head_dim} channels) are not "
                             "supported by cake_sp's Ulysses attention")
        if attention_mask is not None and tuple(attention_mask.shape) != (batch, seq_local):
            raise ValueError(
                f"layer {self.layer_idx}: cake_sp's Ulysses attention takes a 2-D padding mask "
                f"[B, S_local] = [{batch}, {seq_local}] of this rank's tokens, got an "
                f"attention_mask of shape {tuple(attention_mask.shape)}")
        if self.training and self.attention_dropout:
            raise ValueError(f"layer {self.layer_idx}: attention_dropout="
                             f"{self.attention_dropout} is not supported by cake_sp's Ulysses "
                             "attention (it applies no dropout); set it to 0 for training")
        half = self.head_dim // 2
        given = kwargs.get("cu_seq_lens_q")
        if given is None:
            cu_seqlens = _packing(kwargs.get("position_ids"), attention_mask, batch, seq_local,
                                  self.layer.group)
        else:
            cu_seqlens = _given_bounds(given, kwargs.get("cu_seq_lens_k"), batch,
                                       seq_local * self.layer.session.world_size)

        def table():
            # transformers repeats each frequency in both halves (rotate_half): keep one of each.
            rope = torch.cat((cos[..., :half], sin[..., :half]), dim=-1).float()
            return rope.expand(batch, seq_local, -1).reshape(batch * seq_local, -1)

        rope = _ROPE_TABLE.get((cos, sin), (half, batch, seq_local), table)
        return self.layer(hidden_states, rope, cu_seqlens=cu_seqlens), None


def _qkv_projection(attn: nn.Module) -> tuple[Tensor, Tensor | None]:
    """The module's Q, K, V projections as the layer's ``qkv_weight`` and ``qkv_bias``:
    Phi-3's ``qkv_proj`` as it is (its rows already Q, then K, then V), else ``q_proj``,
    ``k_proj`` and ``v_proj`` stacked."""
    fused = getattr(attn, "qkv_proj", None)
    if fused is not None:
        return fused.weight, fused.bias
    return stacked_projections((attn.q_proj, attn.k_proj, attn.v_proj))


@torch.compiler.disable
def _packing(position_ids: Tensor | None, attention_mask: Tensor | None, batch: int,
             seq_local: int, group: dist.ProcessGroup) -> Tensor | None:
    """``sequence_bounds`` once per model forward, as an int64 CPU tensor.  Eager under
    ``torch.compile`` (a graph break: it is collective and reads the host), and a tensor so
    that the compiled code after it does not specialise on the bounds."""
    def bounds():
        found = sequence_bounds(position_ids, attention_mask, batch, seq_local, group)
        return None if found is None else torch.tensor(found)

    tensors = [] if position_ids is None else [position_ids]
    return _PACKING.get(tensors, (batch, seq_local, group), bounds)


def _clear_packing(module: nn.Module, args: tuple) -> None:
    """A forward pre-hook of the modules holding the replaced layers: a new forward derives
    its own packing (``_PACKING``)."""
    _PACKING.clear()


@torch.compiler.disable
def _given_bounds(cu_seq_lens_q: Tensor, cu_seq_lens_k: Tensor | None, batch: int,
                  seq: int) -> Tensor | None:
    """The caller's ``cu_seq_lens_q`` over the ``batch`` whole rows of ``seq`` tokens (the
    same on every rank), as an int64 CPU tensor read once per model forward, with the
    tokens after its end (padding up to a multiple of the world size) as one more sequence;
    None where each row is one sequence, so that the layer call stays in a compiled graph;
    the layer checks the rest.  It describes every sequence, padding included: the
    attention mask is not read (transformers gives one only to the ranks whose shard has
    padding, so refusing it would raise on some ranks only)."""
    def bounds():
        if cu_seq_lens_k is not None and cu_seq_lens_k is not cu_seq_lens_q and not torch.equal(
                cu_seq_lens_k.cpu(), cu_seq_lens_q.cpu()):
            raise ValueError("cake_sp's Ulysses attention is self-attention: cu_seq_lens_k must "
                             "equal cu_seq_lens_q")
        found = cu_seq_lens_q.to("cpu", torch.int64)
        if found.ndim == 1 and len(found) and 0 <= found[-1] < batch * seq:
            found = torch.cat((found, found.new_tensor([batch * seq])))
        return None if tuple(found.tolist()) == row_bounds(batch, seq) else found

    given = [t for t in (cu_seq_lens_q, cu_seq_lens_k) if t is not None]
    return _PACKING.get(given, ("given", batch, seq), bounds)


def _sequence_rules(position_ids: Tensor | None,
                    padding_mask: Tensor | None) -> list[tuple[Tensor, int]]:
    """Where sequences start, as ``(values, step)`` rules: token ``i`` starts one where
    ``values[i] != values[i - 1] + step``.  The padding mask with step 0 (it changes between
    padding and tokens), the positions with step 1 (transformers'
    ``find_packed_sequence_indices``)."""
    return ([] if padding_mask is None else [(padding_mask, 0)]) + (
        [] if position_ids is None else [(position_ids, 1)])


def _inner_starts(rules: list[tuple[Tensor, int]], batch: int, seq: int) -> Tensor:
    """bool ``[batch, seq - 1]``: whether token ``i + 1`` of each row starts a sequence by any
    of ``rules`` (each value tensor ``[batch, seq]`` or broadcastable to it)."""
    starts = torch.zeros(batch, seq - 1, dtype=torch.bool)
    for values, step in rules:
        starts = starts.to(values.device) | (values.expand(batch, seq).long().diff(dim=-1)
                                             != step)
    return starts


def sequence_bounds(position_ids: Tensor | None, padding_mask: Tensor | None, batch: int,
                    seq_local: int, group: dist.ProcessGroup) -> tuple[int, ...] | None:
    """The ``cu_seqlens`` of the sequences in the whole sequence, from every rank's shard of
    its position ids and padding mask (each ``[B, S_local]`` or broadcastable to it; rank
    ``r``'s tokens at ``[r * S_local, (r + 1) * S_local)``), or None when each row is one
    sequence.  A sequence starts where a position is not its predecessor's plus one
    (transformers' ``find_packed_sequence_indices``) or where the mask changes between
    padding and tokens.  No mask means no padding: transformers gives a rank whose shard has
    none no mask, while others have one.  Collective: each rank sends its shard's first and
    last position and mask value and where its sequences start (one ``all_gather_object``)."""
    if padding_mask is None:
        padding_mask = torch.ones(1, 1, dtype=torch.long)
    rules = _sequence_rules(position_ids, padding_mask)
    starts = _inner_starts(rules, batch, seq_local)
    # [B, 2] per rule: each row's first and last value.
    ends = [values.expand(batch, seq_local)[:, [0, -1]].long() for values, _ in rules]
    local = {"ends": [e.tolist() for e in ends], "starts": [[] for _ in range(batch)]}
    for b, i in starts.nonzero().tolist():
        local["starts"][b].append(i + 1)
    shards: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(shards, local, group=group)
    seq = seq_local * len(shards)
    bounds = [0]
    for b in range(batch):
        for r, shard in enumerate(shards):
            if r and any(now[b][0] != before[b][1] + step for now, before, (_, step) in zip(
                    shard["ends"], shards[r - 1]["ends"], rules)):
                bounds.append(b * seq + r * seq_local)
            bounds.extend(b * seq + r * seq_local + i for i in shard["starts"][b])
        bounds.append((b + 1) * seq)
    # Only the rows' own bounds (0, S, ..., B * S): one sequence per row.
    return tuple(bounds) if len(bounds) > batch + 1 else None


def apply_ulysses(model: nn.Module, group=None, **layer_options) -> nn.Module:
    """Replace the model's attention modules in place (every rank must call); returns it.

    ``layer_options`` go to ``UlyssesAttention`` (``max_tokens`` defaults to
    ``ceil(max_position_embeddings / W)``; ``backend``, ``attention_backend``, ...).
    Raises ``ValueError`` naming the supported classes if the model has none of them.
    """
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import flash_attention_mask

    from cake_sp.session.overlap import resolve_group

    classes = _attention_classes()
    group = resolve_group(group)
    world = dist.get_world_size(group)
    targets = [(name, m) for name, m in model.named_modules() if isinstance(m, classes)]
    if not targets:
        kinds = sorted({type(m).__name__ for m in model.modules() if "Attention" in
                        type(m).__name__})
        raise ValueError(f"apply_ulysses: {type(model).__name__} has no attention module it "
                         f"supports ({', '.join(SUPPORTED)}); found {kinds or 'none'}")
    check_adapters_merged(targets)  # before any layer allocates its buffers
    _check_masks_expressible(model)
    for name, attn in targets:
        _check_attention_supported(name, attn)
    for name, attn in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, TransformersUlyssesAttention(attn, group=group, world_size=world,
                                                            **layer_options))
    # The decoders (``model.layers`` of a ...ForCausalLM: what runs the layers of one forward).
    decoders = {name.partition(".layers.")[0] if ".layers." in name else "" for name, _ in targets}
    for name in decoders:
        (model.get_submodule(name) if name else model).register_forward_pre_hook(_clear_packing)
    config = getattr(model, "config", None)
    if config is not None:
        config.use_cache = False
        # flash-attn's mask rule: the 2-D padding mask where there is padding, else None
        # (SDPA's would build each rank's own 4-D mask, blind to the other ranks' tokens).
        AttentionMaskInterface.register(ATTENTION_IMPLEMENTATION, flash_attention_mask)
        AttentionInterface.register(ATTENTION_IMPLEMENTATION, _not_replaced)
        config._attn_implementation = ATTENTION_IMPLEMENTATION
    return model


def _check_masks_expressible(model: nn.Module) -> None:
    """Raise for a model with a part whose masks are more than padding, packing and windows
    (Gemma 3's bidirectional image tokens): the drop-in, which reads flash-attn's masks,
    would attend causally instead.  Such a part declares flash-attn unsupported (transformers
    5), or is one that ``BEYOND_FLASH_MASKS`` names (for transformers before that)."""
    for name, module in model.named_modules():
        if getattr(type(module), "_supports_flash_attn", True) is False or \
                type(module).__name__ in BEYOND_FLASH_MASKS:
            raise ValueError(f"apply_ulysses: {name or 'the model'} ({type(module).__name__}) "
                             "has attention masks flash-attn cannot express (it does not "
                             "support flash-attn), nor can cake_sp's Ulysses attention; apply "
                             "it to the text model alone where the inputs are text")


def _check_attention_supported(name: str, attn: nn.Module) -> None:
    """Raise for an attention module whose computation the layer does not reproduce."""
    kind = type(attn).__name__
    if kind == "Exaone4Attention" and attn.sliding_window is not None and not attn.is_sliding:
        raise ValueError(f"apply_ulysses: {name} is a global layer of EXAONE 4's hybrid "
                         "attention, which has no RoPE: not supported (the layer rotates "
                         "Q and K)")
    if not getattr(attn, "is_causal", True):
        raise ValueError(f"apply_ulysses: {name} attends bidirectionally "
                         "(use_bidirectional_attention=True): not supported (the drop-in is "
                         "for causal language models)")


def shard_batch(batch: Mapping[str, Tensor], group=None, *, pad_token_id: int = 0,
                ignore_index: int = -100) -> dict[str, Tensor | int]:
    """This rank's part of a causal-LM batch of whole rows, for ``model(**part)`` on a model
    under ``apply_ulysses``.  Every rank of ``group`` (as in ``apply_ulysses``) passes the
    same ``batch``; see :func:`shard_rows` for what it takes and gives."""
    from cake_sp.session.overlap import resolve_group

    group = resolve_group(group)
    return shard_rows(batch, dist.get_rank(group), dist.get_world_size(group),
                      pad_token_id=pad_token_id, ignore_index=ignore_index)


def shard_rows(batch: Mapping[str, Tensor], rank: int, world: int, *, pad_token_id: int = 0,
               ignore_index: int = -100) -> dict[str, Tensor | int]:
    """Rank ``rank`` of ``world``'s part of ``batch``, whole rows of a causal-LM batch:

    * ``input_ids [B, S]``; optionally ``position_ids [B, S]`` or ``[1, S]`` (default
      ``0, ..., S - 1``; packed sequences restart them, as ``DataCollatorWithFlattening``
      makes them), ``attention_mask [B, S]`` (2-D, 0 at padding), ``cu_seq_lens_q`` (the sequences'
      offsets into the ``B * S`` tokens, instead of deriving them from the positions and the
      mask) and ``labels [B, S]`` (transformers' convention: unshifted, ``ignore_index``
      where no loss).

    The rows are padded to a multiple of ``world`` (``pad_token_id``, positions running on,
    mask 0, no targets), and the result holds rank ``rank``'s tokens ``[rank * S_local,
    (rank + 1) * S_local)`` of ``input_ids``, ``position_ids`` and ``attention_mask``, and for
    the whole rows ``cu_seq_lens_q``/``cu_seq_lens_k`` (int32; padding a sequence of its own)
    and ``max_length_q``/``max_length_k``, so the model derives nothing in its forward.  With
    ``labels``: ``shift_labels``, each of this rank's tokens' target, shifted over the whole
    row before sharding (so no token loses its target at a shard boundary), with no target
    across a sequence's end or at padding; ``labels``, the same tensor (so that the model
    computes its loss); and ``num_items_in_batch``, the targets of the whole batch.  Then
    transformers' loss on each rank is its tokens' share of the batch's mean, and the sum
    of the ranks' losses and gradients is the batch's.
    """
    ids = batch["input_ids"]
    if ids.ndim != 2:
        raise ValueError(f"input_ids must be [B, S], got shape {tuple(ids.shape)}")
    rows, seq = ids.shape
    for name, shared in (("position_ids", True), ("attention_mask", False), ("labels", False)):
        given = batch.get(name)
        if given is not None and tuple(given.shape) not in {(rows, seq), (1, seq) if shared
                                                            else (rows, seq)}:
            raise ValueError(f"{name} must be [B, S] = [{rows}, {seq}] like input_ids"
                             f"{' (or [1, S])' if shared else ''}, got shape "
                             f"{tuple(given.shape)}")
    if not 0 <= rank < world:
        raise ValueError(f"rank must be in [0, world) = [0, {world}), got {rank}")
    local = -(-seq // world)
    pad = local * world - seq
    positions = batch.get("position_ids")
    if positions is None:
        positions = torch.arange(seq, device=ids.device).expand(rows, seq)
    mask = batch.get("attention_mask")
    starts = torch.zeros(rows, seq, dtype=torch.bool, device=ids.device)
    starts[:, 0] = True
    bounds = batch.get("cu_seq_lens_q")
    if bounds is not None:
        inner = bounds.to(ids.device, torch.long)
        starts.view(-1)[inner[(inner >= 0) & (inner < rows * seq)]] = True
    else:
        starts[:, 1:] = _inner_starts(_sequence_rules(positions, mask), rows, seq)

    def padded(t: Tensor, value) -> Tensor:
        return torch.nn.functional.pad(t, (0, pad), value=value)

    running = positions[:, -1:] + torch.arange(1, pad + 1, device=ids.device)
    whole = {"input_ids": padded(ids, pad_token_id),
             "position_ids": torch.cat((positions, running), dim=1)}
    if mask is not None:
        whole["attention_mask"] = padded(mask, 0)
    mine = slice(rank * local, (rank + 1) * local)
    part = {name: t[:, mine].contiguous() for name, t in whole.items()}
    starts = padded(starts, False)
    if pad:
        starts[:, seq] = True
    offsets = starts.flatten().nonzero().flatten()
    cu = torch.cat((offsets, offsets.new_tensor([rows * local * world]))).to(torch.int32)
    longest = int(cu.diff().max())
    part.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=longest, max_length_k=longest)
    labels = batch.get("labels")
    if labels is not None:
        # Token i's target is token i + 1's label, unless i + 1 starts a sequence or is padding.
        targets = padded(labels, ignore_index).roll(-1, dims=1)
        targets[:, -1] = ignore_index
        targets[starts.roll(-1, dims=1)] = ignore_index
        if mask is not None:
            real = padded(mask, 0) != 0
            targets[~real | ~real.roll(-1, dims=1)] = ignore_index
        shifted = targets[:, mine].contiguous()
        part.update(shift_labels=shifted, labels=shifted,
                    num_items_in_batch=(targets != ignore_index).sum())
    return part


def _not_replaced(module: nn.Module, *args, **kwargs):
    raise TypeError(f"{type(module).__name__} was not replaced by cake_sp's apply_ulysses "
                    f"(it replaces {', '.join(SUPPORTED)}); the model's attention "
                    f"implementation is {ATTENTION_IMPLEMENTATION!r}")
