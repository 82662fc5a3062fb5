"""The attention core of the layer: each rank's head band over the whole sequence.

``q [B, S, Hq_local, D]``, ``k, v [B, S, Hkv_local, D]`` bf16 (views of the
front end's receive slot, tokens in global order: source rank, then position)
-> ``o [B, S, Hq_local, D]``.  GQA (``Hq_local`` a multiple of ``Hkv_local``) is
passed to the backend as is, never by materialising repeated K/V.  Backends:

* ``"sdpa"``: ``torch.nn.functional.scaled_dot_product_attention`` with
  ``enable_gqa`` (PyTorch picks flash, cuDNN, memory-efficient or math);
* ``"flash"``: ``flash_attn.flash_attn_func`` (the flash-attn package, CUDA only);
* ``"auto"``: flash-attn where it is installed and the device is a CUDA GPU of
  compute capability 8.0 or newer, else SDPA.

Both are differentiable through their own autograd.

Packed sequences.  ``cu_seqlens`` (flash-attn's name) lists where the sequences packed
along the tokens start: offsets into the ``B * S`` tokens taken row by row, from 0 to
``B * S``, every row's start ``b * S`` among them.  A token attends only within its own
sequence (causally if ``causal``).  flash-attn runs them in one varlen call; the SDPA
backend, on a GPU, in one call of PyTorch's ``flex_attention`` (compiled once per process
and shape) with a block mask of the sequences (built once per distinct ``cu_seqlens``), and on
the CPU in one SDPA call per sequence.  Rows of one sequence each take the unpacked path.

Key masks.  ``key_mask [B, S]`` (True: a key the row's queries may attend to; padding of a
text encoder's tokens, for instance).  Where every row keeps a key, the masked keys are
taken out and the rest attended with no mask, on the backend's fastest kernel; that is the
mask's meaning, not an approximation (the mask is read to the host once per mask tensor:
every layer of a forward given the same one shares the read).  Rows keeping the same run of
keys, or as many scattered keys, form one call (one call for the whole batch where the rows
are alike; the rows back in their order after).  Rows that keep one run of keys ``[a, b)``
(padding at the end, or at the start) attend to ``K[:, a:b]``, causally or not (a causal
call's queries after the run over all of it, those before it, which have no key, zeros); a
bidirectional call keeping scattered keys compacts K and V to them.  Under
``torch.compile`` or CUDA-graph capture (no host read there), for causal calls keeping
scattered keys, and where a row keeps no key, the mask goes to SDPA as a boolean mask
``[B, 1, 1, S]`` whatever the backend (flash-attn takes no mask; PyTorch picks its
memory-efficient kernel), except where SDPA would fall back to its math kernel or need the
``S x S`` mask: GQA or causal calls on a GPU take ``flex_attention`` with a block mask of
the keys (built once per mask tensor).  A query left with no key (every key masked, or every
earlier one if causal) gets what the kernel gives there (zeros from SDPA's math and
memory-efficient kernels and from flex attention).

Sliding windows.  ``window`` (causal calls only; transformers' ``sliding_window``): a query
at ``i`` attends the keys ``j`` with ``i - window < j <= i`` (flash-attn's ``window_size =
(window - 1, 0)``), within its sequence and its kept keys where ``cu_seqlens`` or
``key_mask`` is given too.  flash-attn runs it (varlen with ``cu_seqlens``; not with a key
mask); otherwise a GPU runs flex attention with one block mask of everything (built once
per mask tensor or ``cu_seqlens``: the blocks out of every window are skipped), and the CPU
one SDPA call with the dense mask.  A window of ``S`` or more keys is plain causal
attention.

Soft-capped logits.  ``softcap`` (Gemma 2's ``attn_logit_softcapping``): the scaled logits
``s`` become ``softcap * tanh(s / softcap)`` before the mask and the softmax.  flash-attn
applies it (``softcap=``; not with a key mask); otherwise a GPU runs flex attention with the
cap as its ``score_mod`` and one block mask of every mask above (none where nothing is
masked), and the CPU the logits written out (in fp32 at least) with the dense mask.
"""

from __future__ import annotations

import functools
import importlib.util
import operator
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from cake_sp._memo import LastInputs

ATTENTION_BACKENDS = ("auto", "sdpa", "flash")
_KEY_BLOCK_MASK = LastInputs()
# An integer mask's bool form, one per mask tensor, so that the layers of a forward pass the
# same bool tensor on and share its block mask.
_BOOL_KEY_MASK = LastInputs()
# The kept keys' indices of a mask tensor (a host read), likewise.
_KEPT_KEYS = LastInputs()
# The block mask of ``_keeps`` (a sliding window's, a soft-capped call's), likewise.
_BLOCK_MASK = LastInputs()


@functools.cache
def _flash_problem(device_type: str, capability: tuple[int, int] | None) -> str | None:
    """Why flash-attn cannot serve here, or None."""
    if device_type != "cuda":
        return "flash-attn runs on CUDA GPUs only"
    if capability is not None and capability < (8, 0):
        return f"flash-attn needs compute capability 8.0+, the GPU has {capability}"
    if importlib.util.find_spec("flash_attn") is None:
        return "the flash-attn package is not installed (pip install flash-attn)"
    return None


def resolve_attention_backend(requested: str, device: torch.device) -> tuple[str, str]:
    """``(backend, reason)`` for ``requested`` on ``device``; ``ValueError`` for an unknown name
    and ``ImportError`` for ``"flash"`` where it cannot run."""
    if requested not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, "
                         f"got {requested!r}")
    capability = (torch.cuda.get_device_capability(device)
                  if device.type == "cuda" else None)
    problem = _flash_problem(device.type, capability)
    if requested == "flash":
        if problem is not None:
            raise ImportError(f"attention_backend='flash': {problem}")
        return "flash", "requested"
    if requested == "sdpa":
        return "sdpa", "requested"
    if problem is None:
        return "flash", "auto: flash-attn is installed"
    return "sdpa", f"auto: {problem}"


def check_cu_seqlens(cu_seqlens: Sequence[int] | Tensor, *, batch: int,
                     seq: int) -> tuple[int, ...]:
    """``cu_seqlens`` as host ints, or ``ValueError`` naming what is wrong: ``[N + 1]`` strictly
    increasing offsets from 0 to ``batch * seq`` that include every row start ``b * seq`` (a
    sequence never spans two rows).  A tensor is read to the host (a sync if on a GPU)."""
    if isinstance(cu_seqlens, Tensor):
        if cu_seqlens.ndim != 1 or cu_seqlens.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"cu_seqlens must be a 1-D int32/int64 tensor or a sequence of "
                             f"ints, got {cu_seqlens.dtype} of shape {tuple(cu_seqlens.shape)}")
        cu_seqlens = cu_seqlens.tolist()
    try:
        bounds = tuple(operator.index(b) for b in cu_seqlens)
    except TypeError:
        raise ValueError(f"cu_seqlens must hold ints, got {cu_seqlens!r}") from None
    total = batch * seq
    if (len(bounds) < 2 or bounds[0] != 0 or bounds[-1] != total
            or any(a >= b for a, b in zip(bounds, bounds[1:]))):
        raise ValueError(f"cu_seqlens must be strictly increasing ints from 0 to B * S = "
                         f"{batch} * {seq} = {total} (S the whole sequence), got "
                         f"{_shorten(bounds)}")
    missing = sorted(set(range(seq, total, seq)) - set(bounds))
    if missing:
        raise ValueError(f"cu_seqlens must include every batch row's start b * S (S = {seq}): "
                         f"a packed sequence cannot span two rows; {missing[0]} is missing")
    return bounds


def check_key_mask(key_mask: Tensor, *, batch: int, seq: int,
                   device: torch.device) -> Tensor:
    """``key_mask`` as a bool ``[batch, seq]`` tensor on ``device``, or ``ValueError`` naming
    what is wrong: a bool or integer tensor (nonzero: attend), ``S`` the whole sequence.  Host
    checks of its shape, dtype and device only (no sync).  An integer mask's bool form is
    made once while the same unmodified tensor comes back."""
    if not isinstance(key_mask, Tensor) or (key_mask.dtype != torch.bool
                                            and key_mask.dtype.is_floating_point):
        raise ValueError(f"key_mask must be a bool or integer tensor (True or nonzero: a key "
                         f"to attend), got {getattr(key_mask, 'dtype', type(key_mask))}")
    if tuple(key_mask.shape) != (batch, seq):
        raise ValueError(f"key_mask must have shape [B, S] = [{batch}, {seq}] (S the whole "
                         f"sequence), got {list(key_mask.shape)}")
    if key_mask.device != device:
        raise ValueError(f"key_mask must be on {device}, got {key_mask.device}")
    if key_mask.dtype == torch.bool:
        return key_mask
    return _BOOL_KEY_MASK.get((key_mask,), (), lambda: key_mask != 0)


def row_bounds(batch: int, seq: int) -> tuple[int, ...]:
    """``cu_seqlens`` of ``batch`` rows of one sequence each: ``0, S, ..., B * S``."""
    return tuple(range(0, batch * seq + 1, seq))


def _shorten(bounds: tuple) -> str:
    return str(list(bounds)) if len(bounds) <= 8 else f"[{bounds[0]}, ..., {bounds[-1]}] " \
        f"({len(bounds)} entries)"


def attention(q: Tensor, k: Tensor, v: Tensor, *, causal: bool, softmax_scale: float | None,
              backend: str, cu_seqlens: tuple[int, ...] | None = None,
              key_mask: Tensor | None = None, window: int | None = None,
              softcap: float | None = None) -> Tensor:
    """``o [B, S, Hq, D]`` from ``q [B, S, Hq, D]``, ``k, v [B, S, Hkv, D]`` (a resolved
    ``backend``); with ``cu_seqlens`` (checked by ``check_cu_seqlens``) each packed sequence
    attends only to itself; with ``key_mask`` (bool ``[B, S]``, checked by
    ``check_key_mask``; not with ``cu_seqlens``) no query attends to a masked key; with
    ``window`` (causal only) a query attends its last ``window`` keys alone; with ``softcap``
    the logits are soft-capped."""
    batch, seq = q.shape[:2]
    if softcap is not None:
        return _softcapped_attention(q, k, v, causal, softmax_scale, backend, softcap,
                                     cu_seqlens, key_mask, window)
    if window is not None and window < seq:
        return _windowed_attention(q, k, v, softmax_scale, backend, window, cu_seqlens,
                                   key_mask)
    if key_mask is not None:
        kept = None if _no_host_reads(q) else _kept_keys(key_mask)
        if kept is not None and (not causal or kept.spans_only):
            return _attention_on_kept_keys(q, k, v, kept, causal, softmax_scale, backend)
        if q.device.type == "cuda" and (causal or q.shape[2] != k.shape[2]):
            return _flex_attention(q, k, v, softmax_scale,
                                   _key_block_mask(key_mask, causal))
        return _sdpa(q, k, v, causal, softmax_scale, key_mask)
    if cu_seqlens is not None and cu_seqlens != row_bounds(batch, seq):
        return _packed_attention(q, k, v, causal, softmax_scale, backend, cu_seqlens)
    if backend == "flash":
        return _flash(q, k, v, causal, softmax_scale, None)
    return _sdpa(q, k, v, causal, softmax_scale)


def _windowed_attention(q: Tensor, k: Tensor, v: Tensor, softmax_scale: float | None,
                        backend: str, window: int, cu_seqlens: tuple[int, ...] | None,
                        key_mask: Tensor | None) -> Tensor:
    """Causal attention over each query's last ``window`` keys (``window < S``), within its
    sequence and its kept keys (``attention``'s notes)."""
    batch, seq = q.shape[:2]
    if backend == "flash" and key_mask is None:
        return _flash(q, k, v, True, softmax_scale, cu_seqlens, (window - 1, 0))
    if q.device.type == "cuda":
        return _flex_attention(q, k, v, softmax_scale,
                               _block_mask(True, window, cu_seqlens, key_mask, batch, seq,
                                           q.device))
    # The CPU (tests): one SDPA call with the dense mask.
    o = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
        attn_mask=_dense_mask(True, window, cu_seqlens, key_mask, batch, seq, q.device),
        scale=softmax_scale, enable_gqa=q.shape[2] != k.shape[2])
    return o.transpose(1, 2)


def _softcapped_attention(q: Tensor, k: Tensor, v: Tensor, causal: bool,
                          softmax_scale: float | None, backend: str, softcap: float,
                          cu_seqlens: tuple[int, ...] | None, key_mask: Tensor | None,
                          window: int | None) -> Tensor:
    """``attention`` with soft-capped logits (``attention``'s notes)."""
    batch, seq = q.shape[:2]
    if window is not None and window >= seq:
        window = None
    if cu_seqlens is not None and cu_seqlens == row_bounds(batch, seq):
        cu_seqlens = None
    if backend == "flash" and key_mask is None:
        return _flash(q, k, v, causal, softmax_scale, cu_seqlens,
                      (-1, -1) if window is None else (window - 1, 0), softcap)
    masked = causal or any(m is not None for m in (window, cu_seqlens, key_mask))
    if q.device.type == "cuda":
        block_mask = _block_mask(causal, window, cu_seqlens, key_mask, batch, seq,
                                 q.device) if masked else None
        return _flex_attention(q, k, v, softmax_scale, block_mask, _capped_scores(softcap))
    # The CPU (tests): the logits written out, in fp32 at least.
    group = q.shape[2] // k.shape[2]
    work = torch.promote_types(q.dtype, torch.float32)
    qh, kh, vh = (t.transpose(1, 2).to(work) for t in (q, k, v))
    kh, vh = (t.repeat_interleave(group, dim=1) for t in (kh, vh))
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    scores = _capped_scores(softcap)(qh @ kh.transpose(-1, -2) * scale, None, None, None, None)
    if masked:
        allowed = _dense_mask(causal, window, cu_seqlens, key_mask, batch, seq, q.device)
        scores = scores.masked_fill(~allowed, float("-inf"))
        # A query with no key to attend: zeros, as flex attention gives (its row is NaN).
        probs = scores.softmax(dim=-1).masked_fill(~allowed.any(dim=-1, keepdim=True), 0.0)
    else:
        probs = scores.softmax(dim=-1)
    return (probs @ vh).to(q.dtype).transpose(1, 2)


@functools.cache
def _capped_scores(softcap: float):
    """flex attention's ``score_mod`` capping the scaled logits at ``softcap`` (one function a
    value, so that the compiled flex attention is reused)."""
    def capped(score, b, h, q_idx, kv_idx):
        return softcap * torch.tanh(score / softcap)
    return capped


def _keeps(causal: bool, window: int | None, cu_seqlens: tuple[int, ...] | None,
           key_mask: Tensor | None, batch: int, seq: int, device: torch.device):
    """The mask function ``(b, h, q_idx, kv_idx) -> keep`` of causality, a window (causal
    only), packed sequences and a key mask, each where given, at least one (flex
    attention's ``mask_mod``; broadcasting index tensors give the dense mask)."""
    sequence = None if cu_seqlens is None else _sequence_ids(cu_seqlens, batch, seq, device)

    def keep(b, h, q_idx, kv_idx):
        rules = []
        if causal:
            rules.append(q_idx >= kv_idx)
        if window is not None:
            rules.append(q_idx - kv_idx < window)
        if sequence is not None:
            rules.append(sequence[b, q_idx] == sequence[b, kv_idx])
        if key_mask is not None:
            rules.append(key_mask[b, kv_idx])
        return functools.reduce(operator.and_, rules)
    return keep


def _dense_mask(causal: bool, window: int | None, cu_seqlens: tuple[int, ...] | None,
                key_mask: Tensor | None, batch: int, seq: int, device: torch.device) -> Tensor:
    """bool ``[B, 1, S, S]``: ``_keeps`` over every query and key."""
    positions = torch.arange(seq, device=device)
    allowed = _keeps(causal, window, cu_seqlens, key_mask, batch, seq, device)(
        torch.arange(batch, device=device)[:, None, None, None], None, positions[:, None],
        positions)
    return allowed.expand(batch, 1, seq, seq)


def _block_mask(causal: bool, window: int | None, cu_seqlens: tuple[int, ...] | None,
                key_mask: Tensor | None, batch: int, seq: int, device: torch.device):
    """flex attention's ``BlockMask`` of ``_keeps``, built once while the same mask tensor (or
    none) and arguments come back (every layer of a model's forward)."""
    tensors = () if key_mask is None else (key_mask,)
    return _BLOCK_MASK.get(
        tensors, (causal, window, cu_seqlens, batch, seq, device),
        lambda: _compiled("create_block_mask")(
            _keeps(causal, window, cu_seqlens, key_mask, batch, seq, device), batch, None,
            seq, seq, device=device))


def _no_host_reads(q: Tensor) -> bool:
    """Whether this call is being traced by ``torch.compile`` or captured into a CUDA graph."""
    return torch.compiler.is_compiling() or (q.device.type == "cuda"
                                             and torch.cuda.is_current_stream_capturing())


@dataclass(frozen=True)
class _RowGroup:
    """Rows of a key mask ``[B, S]`` that keep the same keys' run, or as many scattered keys:
    ``rows``, a slice where they are consecutive (a view, no copy) or else int64 ``[G]`` on the
    mask's device, and either ``span`` ``(start, stop)`` where each keeps exactly the keys
    ``[start, stop)`` (padding before and after them) or ``index`` (int64 ``[G, n]``) the ``n``
    keys each keeps."""

    rows: slice | Tensor
    span: tuple[int, int] | None = None
    index: Tensor | None = None


@dataclass(frozen=True)
class _KeptKeys:
    """What a key mask ``[B, S]`` whose every row keeps a key keeps: its rows grouped (in the
    order of their first rows), and ``order`` (int64 ``[B]``; None where the groups' outputs
    concatenated are the rows in order) placing row ``b`` there."""

    groups: tuple[_RowGroup, ...]
    order: Tensor | None

    @property
    def spans_only(self) -> bool:
        """Whether every row keeps one run of keys (the unmasked causal kernels serve)."""
        return all(group.span is not None for group in self.groups)


def _kept_keys(key_mask: Tensor) -> _KeptKeys | None:
    """``key_mask``'s ``_KeptKeys`` (None where a row keeps no key), read to the host once per
    mask tensor (every layer of a forward shares it): rows keeping one run of keys grouped by
    the run, the others by how many they keep."""
    def build():
        host = key_mask.cpu()
        counts = host.sum(dim=1)
        if not bool((counts > 0).all()):
            return None
        first = host.int().argmax(dim=1)  # each row's first kept key
        spans = [(a, a + n) if bool(row[a:a + n].all()) else None
                 for row, a, n in zip(host, first.tolist(), counts.tolist())]
        keys = [span or n for span, n in zip(spans, counts.tolist())]
        device = key_mask.device
        groups, members = [], []
        for key in dict.fromkeys(keys):  # in the order of their first rows
            rows = torch.tensor([b for b, other in enumerate(keys) if other == key])
            members.append(rows)
            a, b = int(rows[0]), int(rows[-1]) + 1
            taken = slice(a, b) if b - a == len(rows) else rows.to(device)
            if isinstance(key, tuple):
                groups.append(_RowGroup(taken, span=key))
            else:
                index = host[rows].nonzero()[:, 1].view(-1, key)
                groups.append(_RowGroup(taken, index=index.to(device)))
        members = torch.cat(members)
        order = None if bool((members == torch.arange(len(host))).all()) \
            else members.argsort().to(device)
        return _KeptKeys(tuple(groups), order)
    return _KEPT_KEYS.get((key_mask,), (), build)


def _attention_on_kept_keys(q: Tensor, k: Tensor, v: Tensor, kept: _KeptKeys, causal: bool,
                            softmax_scale: float | None, backend: str) -> Tensor:
    """Each group of rows attending to its kept keys alone, with no mask (``_span_attention``,
    or K and V compacted to them: bidirectional only); the rows then back in their order."""
    outputs = []
    for group in kept.groups:
        rows = [t[group.rows] for t in (q, k, v)]
        if group.span is not None:
            outputs.append(_span_attention(*rows, group.span, causal, softmax_scale, backend))
        else:
            q_rows, k_rows, v_rows = rows
            outputs.append(attention(q_rows, _compacted(k_rows, group.index),
                                     _compacted(v_rows, group.index), causal=False,
                                     softmax_scale=softmax_scale, backend=backend))
    o = outputs[0] if len(outputs) == 1 else torch.cat(outputs)
    return o if kept.order is None else o.index_select(0, kept.order)


def _span_attention(q: Tensor, k: Tensor, v: Tensor, span: tuple[int, int], causal: bool,
                    softmax_scale: float | None, backend: str) -> Tensor:
    """Attention over the keys ``[start, stop)`` of every row alone.  Causal: the queries in
    the span causally, the queries after it (padding) over the whole span, which is every kept
    key before them, and the queries before it (padding, no key to attend) zeros, as SDPA and
    flex attention give a query whose every key is masked."""
    start, stop = span
    k, v = k[:, start:stop], v[:, start:stop]
    options = dict(softmax_scale=softmax_scale, backend=backend)
    if not causal:
        return attention(q, k, v, causal=False, **options)
    parts = [q.new_zeros(q.shape[0], start, *q.shape[2:])] if start else []
    parts.append(attention(q[:, start:stop], k, v, causal=True, **options))
    if stop < q.shape[1]:
        parts.append(attention(q[:, stop:], k, v, causal=False, **options))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


def _compacted(t: Tensor, kept: Tensor) -> Tensor:
    """``t [B, S, H, D]``'s rows ``kept [B, n]`` of each batch row: ``[B, n, H, D]``."""
    return t.gather(1, kept[:, :, None, None].expand(-1, -1, *t.shape[2:]))


def _sdpa(q: Tensor, k: Tensor, v: Tensor, causal: bool, softmax_scale: float | None,
          key_mask: Tensor | None = None) -> Tensor:
    mask = None
    if key_mask is not None:  # [B, 1, 1, S], and causal folded in: SDPA takes one or the other
        seq = q.shape[1]
        mask = key_mask[:, None, None, :]
        if causal:
            mask = mask & torch.ones(seq, seq, dtype=torch.bool, device=q.device).tril()
    o = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
        is_causal=causal and mask is None, scale=softmax_scale,
        enable_gqa=q.shape[2] != k.shape[2])
    return o.transpose(1, 2)


def _packed_attention(q: Tensor, k: Tensor, v: Tensor, causal: bool,
                      softmax_scale: float | None, backend: str,
                      cu_seqlens: tuple[int, ...]) -> Tensor:
    batch, seq = q.shape[:2]
    if backend == "flash":
        return _flash(q, k, v, causal, softmax_scale, cu_seqlens)
    if q.device.type == "cuda":
        return _flex_attention(q, k, v, softmax_scale,
                               _document_mask(cu_seqlens, batch, seq, causal, q.device))
    # The CPU (tests): one SDPA call per sequence.
    tokens = [t.reshape(batch * seq, *t.shape[2:]) for t in (q, k, v)]
    o = torch.cat([_sdpa(*(t[None, a:b] for t in tokens), causal, softmax_scale)[0]
                   for a, b in zip(cu_seqlens, cu_seqlens[1:])])
    return o.view(batch, seq, *o.shape[1:])


def _flash(q: Tensor, k: Tensor, v: Tensor, causal: bool, softmax_scale: float | None,
           cu_seqlens: tuple[int, ...] | None, window_size: tuple[int, int] = (-1, -1),
           softcap: float = 0.0) -> Tensor:
    """flash-attn over ``q, k, v [B, S, H, D]``: each row one sequence (``cu_seqlens`` None or
    the rows' own bounds), else one varlen call over the packed sequences."""
    batch, seq = q.shape[:2]
    options = dict(softmax_scale=softmax_scale, causal=causal, window_size=window_size)
    if softcap:  # only then: flash-attn before 2.6 takes no softcap
        options["softcap"] = softcap
    if cu_seqlens is None or cu_seqlens == row_bounds(batch, seq):
        from flash_attn import flash_attn_func
        return flash_attn_func(q, k, v, **options)
    from flash_attn import flash_attn_varlen_func
    tokens = [t.reshape(batch * seq, *t.shape[2:]) for t in (q, k, v)]
    bounds, longest = _varlen_bounds(cu_seqlens, q.device)
    o = flash_attn_varlen_func(*tokens, bounds, bounds, longest, longest, **options)
    return o.view(batch, seq, *o.shape[1:])


def _flex_attention(q: Tensor, k: Tensor, v: Tensor, softmax_scale: float | None,
                    block_mask, score_mod=None) -> Tensor:
    # Always the main flex kernel: below 128 queries Inductor takes its decoding kernel, which
    # packs a K/V head's query heads into one block of next_pow2(S x group) rows and has no
    # configuration once that exceeds the block mask's 128 rows (NoValidChoicesError at S = 88
    # with two query heads a K/V head, PyTorch 2.11).
    o = _compiled("flex_attention")(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), score_mod=score_mod,
        block_mask=block_mask, scale=softmax_scale, enable_gqa=q.shape[2] != k.shape[2],
        kernel_options={"FORCE_USE_FLEX_ATTENTION": True})
    return o.transpose(1, 2)


@functools.lru_cache(maxsize=4)
def _varlen_bounds(cu_seqlens: tuple[int, ...], device: torch.device) -> tuple[Tensor, int]:
    """flash-attn's varlen arguments: ``cu_seqlens`` as int32 on ``device`` and the longest
    sequence, copied once per distinct ``cu_seqlens`` (every layer of a forward shares it)."""
    longest = max(b - a for a, b in zip(cu_seqlens, cu_seqlens[1:]))
    return torch.tensor(cu_seqlens, dtype=torch.int32, device=device), longest


@functools.cache
def _compiled(name: str):
    """``flex_attention`` or ``create_block_mask``, compiled once per process (PyTorch's advice:
    eager flex attention materialises the scores, eager block masks the whole ``S x S`` mask)."""
    from torch.nn.attention import flex_attention
    return torch.compile(getattr(flex_attention, name), dynamic=False)


def _key_block_mask(key_mask: Tensor, causal: bool):
    """flex attention's ``BlockMask`` of the keys ``key_mask [B, S]`` lets through (and
    earlier ones only, if ``causal``), built once while the same unmodified mask tensor comes
    back (every layer of a model's forward)."""
    batch, seq = key_mask.shape

    def key_kept(b, h, q_idx, kv_idx):
        keep = key_mask[b, kv_idx]
        return keep & (q_idx >= kv_idx) if causal else keep

    return _KEY_BLOCK_MASK.get((key_mask,), (causal,), lambda: _compiled("create_block_mask")(
        key_kept, batch, None, seq, seq, device=key_mask.device))


def _sequence_ids(cu_seqlens: tuple[int, ...], batch: int, seq: int,
                  device: torch.device) -> Tensor:
    """int64 ``[B, S]``: the index of the packed sequence each token belongs to."""
    lengths = torch.tensor(cu_seqlens).diff()
    sequence = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    return sequence.view(batch, seq).to(device)


@functools.lru_cache(maxsize=4)
def _document_mask(cu_seqlens: tuple[int, ...], batch: int, seq: int, causal: bool,
                   device: torch.device):
    """flex attention's ``BlockMask`` of packed sequences (causal within each if ``causal``),
    built once per distinct ``cu_seqlens``: every layer of a model forward shares it."""
    sequence = _sequence_ids(cu_seqlens, batch, seq, device)

    def same_sequence(b, h, q_idx, kv_idx):
        keep = sequence[b, q_idx] == sequence[b, kv_idx]
        return keep & (q_idx >= kv_idx) if causal else keep

    return _compiled("create_block_mask")(same_sequence, batch, None, seq, seq, device=device)
