"""Step-by-step reference of the session's math (DESIGN.md section 1), in plain torch.

Slow and obvious on purpose: every step of the contract is one line, in fp32,
and the Ulysses exchange is plain tensor indexing over per-rank results.  The
kernels, the NCCL path and the benchmarks are all checked against it; it
imports nothing from ``cake_sp.kernels``, ``cake_sp.fallback`` or ``cake_sp.session``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

Tensor = torch.Tensor


def project(x: Tensor, qkv_weight: Tensor, qkv_bias: Tensor | None = None) -> Tensor:
    """``x @ qkv_weight.T (+ bias)`` in fp32 with no intermediate rounding.

    x: ``[..., hidden]``; qkv_weight: ``[N, hidden]``; qkv_bias: ``[N]`` or None.
    Returns fp32 ``[..., N]``.
    """
    p = x.float() @ qkv_weight.float().T
    if qkv_bias is not None:
        p = p + qkv_bias.float()
    return p


def rms_norm(p: Tensor, weight: Tensor | None, eps: float) -> Tensor:
    """Per-head RMSNorm: fp32 normalise, round to bf16, times the bf16 weight (a bf16 product).

    p: fp32 ``[..., D]``.  ``weight`` None skips the norm and returns ``p`` unchanged.
    Returns fp32 holding bf16-representable values (or ``p`` itself).
    """
    if weight is None:
        return p
    n = p * torch.rsqrt(p.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (n.to(torch.bfloat16) * weight.to(torch.bfloat16)).float()


def rope(x: Tensor, cos_sin: Tensor, style: str) -> Tensor:
    """Rotate the channel pairs of fp32 ``x [..., H, D]`` by per-token ``cos_sin [..., D]``.

    ``cos_sin`` rows hold cos of the D/2 frequencies then their sin.
    ``"interleaved"`` pairs channels ``(2i, 2i+1)``; ``"neox"`` pairs ``(i, i + D/2)``.
    """
    half = x.shape[-1] // 2
    cos = cos_sin[..., None, :half].float()
    sin = cos_sin[..., None, half:].float()
    if style == "interleaved":
        a, b = x[..., 0::2], x[..., 1::2]
        return torch.stack((a * cos - b * sin, b * cos + a * sin), dim=-1).flatten(-2)
    if style == "neox":
        a, b = x[..., :half], x[..., half:]
        return torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1)
    raise ValueError(f"rope_style must be 'interleaved' or 'neox', got {style!r}")


def token_cos_sin(rope_cos_sin: Tensor, positions: Tensor | None, batch: int,
                  seq_local: int) -> Tensor:
    """Each token's cos/sin row, ``[B, S_local, D]``: row ``b * S_local + s`` of a per-token
    table, or row ``positions[b, s]`` of a ``[max_pos, D]`` table."""
    if positions is None:
        return rope_cos_sin[: batch * seq_local].reshape(batch, seq_local, -1)
    return rope_cos_sin[positions.long()]


def qkv_norm_rope(
    x: Tensor,
    qkv_weight: Tensor,
    q_norm_weight: Tensor | None,
    k_norm_weight: Tensor | None,
    rope_cos_sin: Tensor,
    positions: Tensor | None = None,
    qkv_bias: Tensor | None = None,
    *,
    num_q_heads: int,
    num_kv_heads: int,
    rope_style: str = "interleaved",
    eps: float = 1e-6,
) -> tuple[Tensor, Tensor, Tensor]:
    """One rank's projection, QK norm and RoPE, before any exchange.

    x: bf16 ``[B, S_local, hidden]``.  Returns bf16 ``q [B, S_local, Hq, D]``,
    ``k``, ``v [B, S_local, Hkv, D]``.
    """
    batch, seq_local, _ = x.shape
    head_dim = qkv_weight.shape[0] // (num_q_heads + 2 * num_kv_heads)
    p = project(x, qkv_weight, qkv_bias).reshape(batch, seq_local, -1, head_dim)
    q, k, v = p.split((num_q_heads, num_kv_heads, num_kv_heads), dim=2)
    cos_sin = token_cos_sin(rope_cos_sin, positions, batch, seq_local)
    q = rope(rms_norm(q, q_norm_weight, eps), cos_sin, rope_style)
    k = rope(rms_norm(k, k_norm_weight, eps), cos_sin, rope_style)
    return q.to(torch.bfloat16), k.to(torch.bfloat16), v.to(torch.bfloat16)


def ulysses_redistribute(
    per_rank: Sequence[tuple[Tensor, Tensor, Tensor]], *, layout: str = "bshd"
) -> list[tuple[Tensor, Tensor, Tensor] | Tensor]:
    """The Ulysses all-to-all by indexing: rank r gets its head band for the whole sequence.

    per_rank[src] = ``(q [B, S_local, Hq, D], k, v [B, S_local, Hkv, D])``.
    Rank r receives Q heads ``[r*Hq/W, (r+1)*Hq/W)`` and the K/V heads those Q
    heads attend with (GQA group ``Hq / Hkv``), tokens ordered by source rank.
    Returns per rank ``(q, k, v)`` ``[B, S_global, H_local, D]`` for ``"bshd"``,
    or one ``[B, S_global, H_local, 3*D]`` q|k|v-per-head tensor for ``"fused"``.
    """
    world = len(per_rank)
    hq, hkv = per_rank[0][0].shape[2], per_rank[0][1].shape[2]
    group = hq // hkv
    out = []
    for r in range(world):
        q_heads = list(range(r * hq // world, (r + 1) * hq // world))
        kv_heads = sorted({h // group for h in q_heads})
        q = torch.cat([p[0][:, :, q_heads] for p in per_rank], dim=1)
        k = torch.cat([p[1][:, :, kv_heads] for p in per_rank], dim=1)
        v = torch.cat([p[2][:, :, kv_heads] for p in per_rank], dim=1)
        if layout == "bshd":
            out.append((q, k, v))
        elif layout == "fused":
            out.append(torch.cat((q, k, v), dim=-1))
        else:
            raise ValueError(f"layout must be 'bshd' or 'fused', got {layout!r}")
    return out


def qkv_norm_rope_exchange(
    xs: Sequence[Tensor],
    qkv_weight: Tensor,
    q_norm_weight: Tensor | None,
    k_norm_weight: Tensor | None,
    rope_cos_sin: Tensor | Sequence[Tensor],
    positions: Sequence[Tensor] | None = None,
    qkv_bias: Tensor | None = None,
    *,
    num_q_heads: int,
    num_kv_heads: int,
    rope_style: str = "interleaved",
    eps: float = 1e-6,
    layout: str = "bshd",
) -> list[tuple[Tensor, Tensor, Tensor] | Tensor]:
    """What every rank of a session should return, from every rank's input.

    xs[r]: rank r's bf16 ``[B, S_local, hidden]``.  ``rope_cos_sin`` is one shared
    ``[max_pos, D]`` table (with ``positions[r]`` ``[B, S_local]``) or one per-token
    table per rank; per-token tables may also be given as one tensor shared by all ranks.
    """
    tables = (rope_cos_sin if isinstance(rope_cos_sin, (list, tuple))
              else [rope_cos_sin] * len(xs))
    per_rank = [
        qkv_norm_rope(x, qkv_weight, q_norm_weight, k_norm_weight, tables[r],
                      None if positions is None else positions[r], qkv_bias,
                      num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                      rope_style=rope_style, eps=eps)
        for r, x in enumerate(xs)
    ]
    return ulysses_redistribute(per_rank, layout=layout)


def rope_cos_sin_table(positions: int, head_dim: int, base: float = 10000.0,
                       device: torch.device | str = "cpu") -> Tensor:
    """A standard RoPE table: fp32 ``[positions, D]``, cos of the D/2 frequencies then sin."""
    inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64, device=device)
                        / head_dim)
    angles = torch.arange(positions, dtype=torch.float64, device=device)[:, None] * inv_freq
    return torch.cat((angles.cos(), angles.sin()), dim=-1).float()


def full_sequence_qkv(
    xs: Sequence[Tensor],
    qkv_weight: Tensor,
    rope_cos_sin: Sequence[Tensor],
    *,
    num_q_heads: int,
    num_kv_heads: int,
    qkv_bias: Tensor | None = None,
    q_norm_weight: Tensor | None = None,
    k_norm_weight: Tensor | None = None,
    positions: Sequence[Tensor] | None = None,
    rope_style: str = "neox",
    eps: float = 1e-6,
    dtype: torch.dtype = torch.float64,
) -> tuple[Tensor, Tensor, Tensor]:
    """The layer's front end on the full sequence, in ``dtype`` with no intermediate rounding:
    ``q [B, S, Hq, D]``, ``k, v [B, S, Hkv, D]`` (``S = W * S_local``, rank order), from
    ``ulysses_attention_layer``'s arguments of the same names.  Differentiable."""
    def cast(t):
        return None if t is None else t.to(dtype)

    batch, seq_local, _ = xs[0].shape
    d = qkv_weight.shape[0] // (num_q_heads + 2 * num_kv_heads)
    x = torch.cat([cast(t) for t in xs], dim=1)
    p = x @ cast(qkv_weight).T
    if qkv_bias is not None:
        p = p + cast(qkv_bias)
    p = p.unflatten(-1, (-1, d))
    q, k, v = p.split((num_q_heads, num_kv_heads, num_kv_heads), dim=2)

    def norm(t, w):
        if w is None:
            return t
        return t * torch.rsqrt(t.pow(2).mean(dim=-1, keepdim=True) + eps) * cast(w)

    cos_sin = torch.cat([cast(token_cos_sin(rope_cos_sin[r], None if positions is None
                                             else positions[r], batch, seq_local))
                         for r in range(len(xs))], dim=1)
    q, k = (rope(norm(t, w), cos_sin, rope_style) for t, w in ((q, q_norm_weight),
                                                                (k, k_norm_weight)))
    return q, k, v


def ulysses_attention_layer(
    xs: Sequence[Tensor],
    qkv_weight: Tensor,
    o_weight: Tensor | None,
    rope_cos_sin: Sequence[Tensor],
    *,
    num_q_heads: int,
    num_kv_heads: int,
    qkv_bias: Tensor | None = None,
    o_bias: Tensor | None = None,
    q_norm_weight: Tensor | None = None,
    k_norm_weight: Tensor | None = None,
    positions: Sequence[Tensor] | None = None,
    rope_style: str = "neox",
    causal: bool = True,
    eps: float = 1e-6,
    softmax_scale: float | None = None,
    cu_seqlens: Sequence[int] | None = None,
    key_mask: Tensor | None = None,
    softcap: float | None = None,
    dtype: torch.dtype = torch.float64,
) -> list[Tensor]:
    """The whole layer on the full sequence, in ``dtype`` with no intermediate rounding:
    what ``UlyssesAttention`` should return on every rank (the mathematical layer, not
    the bf16 contract of section 1; tests compare with it by relative error).

    xs[r]: rank r's ``[B, S_local, hidden]``; the full sequence is their concatenation
    along tokens.  ``rope_cos_sin[r]``: rank r's per-token table ``[B * S_local, D]``, or
    a ``[max_pos, D]`` table indexed by ``positions[r] [B, S_local]``.  ``cu_seqlens``:
    sequences packed along the ``B * S`` tokens (row by row); a token then attends only to
    tokens of its own sequence.  ``key_mask [B, S]``: no token attends to a key where it is
    False (or 0).  ``softcap``: as ``attention``'s.  Differentiable:
    with inputs that require grad, autograd of this function is the gradient reference.
    Returns per rank ``y [B, S_local, hidden]`` (``[B, S_local, Hq * D]`` without ``o_weight``).
    """
    q, k, v = full_sequence_qkv(
        xs, qkv_weight, rope_cos_sin, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
        qkv_bias=qkv_bias, q_norm_weight=q_norm_weight, k_norm_weight=k_norm_weight,
        positions=positions, rope_style=rope_style, eps=eps, dtype=dtype)
    o = attention(q, k, v, causal=causal, softmax_scale=softmax_scale, cu_seqlens=cu_seqlens,
                  key_mask=key_mask, softcap=softcap).flatten(2)
    return output_projection(o, o_weight, o_bias, seq_local=xs[0].shape[1])


def output_projection(o: Tensor, o_weight: Tensor | None, o_bias: Tensor | None, *,
                      seq_local: int) -> list[Tensor]:
    """The layer's back end on the full sequence: per rank ``y [B, S_local, hidden]`` from
    ``o [B, S, Hq * D]`` (``o`` itself without ``o_weight``), in ``o``'s dtype."""
    y = o if o_weight is None else o @ o_weight.to(o.dtype).T
    if o_bias is not None:
        y = y + o_bias.to(o.dtype)
    return list(y.split(seq_local, dim=1))


def attention(q: Tensor, k: Tensor, v: Tensor, *, causal: bool,
              softmax_scale: float | None = None, cu_seqlens: Sequence[int] | None = None,
              key_mask: Tensor | None = None, window: int | None = None,
              softcap: float | None = None) -> Tensor:
    """Softmax attention written out in ``q``'s dtype: ``o [B, S, Hq, D]`` from ``q [B, S, Hq,
    D]`` and ``k, v [B, S, Hkv, D]`` (query head ``h`` attends with K/V head ``h // (Hq /
    Hkv)``), causal over ``S`` if ``causal``; ``cu_seqlens`` and ``key_mask`` as in
    ``ulysses_attention_layer``; ``window``: a query at ``i`` sees no key at ``i - window`` or
    before; ``softcap``: the scaled logits ``s`` become ``softcap * tanh(s / softcap)``
    (Gemma 2's ``attn_logit_softcapping``).  What ``UlyssesAttentionCore`` computes on the
    whole sequence."""
    batch, s, num_q_heads, d = q.shape
    group = num_q_heads // k.shape[2]
    k, v = (t.repeat_interleave(group, dim=2) for t in (k, v))
    scale = d**-0.5 if softmax_scale is None else softmax_scale
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    hidden = torch.zeros(batch, 1, s, s, dtype=torch.bool, device=scores.device)
    if causal:
        hidden |= torch.ones(s, s, dtype=torch.bool, device=scores.device).triu(1)
    if window is not None:
        hidden |= torch.ones(s, s, dtype=torch.bool, device=scores.device).tril(-window)
    if cu_seqlens is not None:
        lengths = torch.tensor(cu_seqlens).diff()
        sequence = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
        sequence = sequence.view(batch, 1, s).to(scores.device)
        hidden |= sequence[..., :, None] != sequence[..., None, :]
    if key_mask is not None:
        hidden |= ~key_mask.bool().view(batch, 1, 1, s).to(scores.device)
    scores = scores.masked_fill(hidden, float("-inf"))
    # A query with no key to attend (left padding under a causal mask): zeros, as SDPA and
    # flex attention give; its softmax row is NaN, and so is its gradient until masked_fill's.
    probs = scores.softmax(dim=-1).masked_fill(hidden.all(dim=-1, keepdim=True), 0.0)
    return torch.einsum("bhqk,bkhd->bqhd", probs, v)
