"""Autograd of the layer's two exchange steps (DESIGN.md section 6, the backward column).

* ``FrontEndFunction``: the session call (GEMM -> norm/RoPE -> scatter by heads).
  Backward: ``dq, dk, dv`` gathered back to token order (a ``BandExchange``, summed
  over the ranks that hold a replicated K/V head), RoPE transposed, RMSNorm
  backward in fp32, then ``dX = dP @ W_qkv`` and ``dW_qkv = dP^T @ X``.
* ``OutputProjectionFunction``: gather by tokens -> o_proj GEMM.  Backward:
  ``d_o = dY @ W_o`` scattered by heads back to the band owners, ``dW_o = dY^T @ o``.

What each saves (per layer call on one rank, ``rows = B * S_local``):

* front end: nothing new -- ``x`` and the parameters are the caller's; the
  pre-norm projection of the Q/K heads is recomputed in the backward (one GEMM
  of ``rows x (Hq + Hkv) * D x hidden``) instead of being kept
  (``rows * (Hq + Hkv) * D * 4`` bytes); the q/k/v outputs are views of a receive
  slot, leased until the backward so that no later call overwrites them.
* output: the token-order ``o`` (``rows * Hq * D`` bf16), a view of the gather's
  receive slot, leased likewise.

The attention between them is the attention backend's own autograd (it saves
q, k, v, o and its LSE).  Parameter gradients are this rank's contribution from
its own tokens: a data-parallel reduction over the sequence-parallel group (as
with DeepSpeed-Ulysses) sums them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from cake_sp.layouts import KIND_K, HeadPlan
from cake_sp.session.slots import CallInputs


def _rotate(x: Tensor, cos: Tensor, sin: Tensor, style: str) -> Tensor:
    """``x [..., H, D]`` rotated by the per-token ``cos, sin [..., 1, D/2]`` (fp32)."""
    half = x.shape[-1] // 2
    if style == "interleaved":
        a, b = x[..., 0::2], x[..., 1::2]
        return torch.stack((a * cos - b * sin, b * cos + a * sin), dim=-1).flatten(-2)
    a, b = x[..., :half], x[..., half:]
    return torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1)


def _norm_backward(dy: Tensor, p: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """Gradients of ``y = bf16(bf16(p * rstd) * w)`` (DESIGN.md section 1, step 2) through the
    roundings (straight through, as autograd treats a cast): ``(dp, dw)``, fp32.

    dy, p: fp32 ``[rows, H, D]``; weight: bf16 ``[D]``.
    """
    rstd = torch.rsqrt(p.square().mean(dim=-1, keepdim=True) + eps)
    n = p * rstd
    dw = (dy * n.to(torch.bfloat16).float()).sum(dim=(0, 1))
    dn = dy * weight.float()
    dp = rstd * (dn - n * (dn * n).mean(dim=-1, keepdim=True))
    return dp, dw


def token_cos_sin(call: CallInputs) -> tuple[Tensor, Tensor]:
    """Each of the call's rows' ``(cos, sin)``, fp32 ``[rows, 1, D/2]``."""
    table = call.rope_cos_sin
    rows = table[call.positions.long()] if call.positions is not None else table[: call.rows]
    half = table.shape[1] // 2
    return rows[:, None, :half].float(), rows[:, None, half:].float()


def front_end_backward(dq: Tensor, dk: Tensor, dv: Tensor, call: CallInputs, plan: HeadPlan, *,
                       eps: float, rope_style: str) -> tuple[Tensor | None, ...]:
    """``(dx, dW_qkv, d_bias, d_q_norm, d_k_norm)`` from the token-order output gradients
    ``dq [rows, Hq, D]``, ``dk, dv [rows, Hkv, D]`` (fp32)."""
    hq, hkv, d = plan.num_q_heads, plan.num_kv_heads, plan.head_dim
    x2d, weight, bias = call.x2d, call.qkv_weight, call.qkv_bias
    cos, sin = token_cos_sin(call)
    # RoPE is a rotation: its transpose rotates by -theta.
    dy = _rotate(torch.cat((dq, dk), dim=1), cos, -sin, rope_style)
    norms = (call.q_norm_weight, call.k_norm_weight)
    d_norms = [None, None]
    if any(w is not None for w in norms):
        qk_rows = (hq + hkv) * d
        p = F.linear(x2d, weight[:qk_rows], None if bias is None else bias[:qk_rows])
        p = p.float().view(-1, hq + hkv, d)
        for i, (w, heads) in enumerate(zip(norms, (slice(0, hq), slice(hq, hq + hkv)))):
            if w is not None:
                dy[:, heads], d_norms[i] = _norm_backward(dy[:, heads], p[:, heads], w, eps)
    dp = torch.cat((dy, dv), dim=1).view(x2d.shape[0], -1)
    d_bias = dp.sum(dim=0).to(torch.bfloat16) if bias is not None else None
    dp = dp.to(torch.bfloat16)
    dx = dp @ weight
    d_weight = dp.T @ x2d
    return dx, d_weight, d_bias, *(None if g is None else g.to(torch.bfloat16) for g in d_norms)


def assemble_token_grads(gathered: Tensor, plan: HeadPlan) -> tuple[Tensor, Tensor, Tensor]:
    """Token-order ``(dq, dk, dv)`` fp32 from the gathered bands ``[B, S_local, W, heads, D]``.

    Source ``r``'s slice holds its Q band, then its K and V bands; a K/V head that
    ``kv_replicas`` ranks received collects the sum of their gradients.
    """
    batch, seq_local, world, _, d = gathered.shape
    rows = batch * seq_local
    q_local, kv_local, replicas = plan.q_per_rank, plan.kv_per_rank, plan.kv_replicas
    g = gathered.view(rows, world, -1, d)
    dq = g[:, :, :q_local].float().reshape(rows, plan.num_q_heads, d)
    kv = []
    for kind in (KIND_K, KIND_K + 1):
        start = plan.kind_offset(kind)
        band = g[:, :, start:start + kv_local].float()
        # Ranks r = group * replicas + t hold the K/V heads of group ``group``.
        band = band.view(rows, world // replicas, replicas, kv_local, d).sum(dim=2)
        kv.append(band.reshape(rows, plan.num_kv_heads, d))
    return dq, kv[0], kv[1]


class FrontEndFunction(torch.autograd.Function):
    """The session call with a backward (``QkvNormRopeExchangeOverlap.__call__`` uses it when
    an input requires grad).  Outputs are views of a leased receive slot."""

    @staticmethod
    def forward(ctx, session, call: CallInputs, x, qkv_weight, qkv_bias, q_norm_weight,
                k_norm_weight):
        views, slot = session._impl.run(call, None)
        ctx.lease = session._impl.slots.lease(slot)
        ctx.session, ctx.call = session, call
        ctx.fused = len(views) == 1
        return tuple(views)

    @staticmethod
    def backward(ctx, *grads):
        session, call = ctx.session, ctx.call
        d = session.plan.head_dim
        if ctx.fused:  # one [B, S_global, H, 3D] tensor: q | k | v per head
            grads = tuple(grads[0][..., i * d:(i + 1) * d] for i in range(3))
        parts = [g.to(torch.bfloat16) for g in grads]
        exchange = session.grad_exchange()
        pending = exchange.send(parts, batch=call.batch, seq_local=call.seq_local)
        exchange.wait(pending)
        dq, dk, dv = assemble_token_grads(exchange.output(pending), session.plan)
        ctx.lease.release()
        dx, dw, db, dqn, dkn = front_end_backward(
            dq, dk, dv, call, session.plan, eps=float(session.config.eps),
            rope_style=session.config.rope_style)
        needs = ctx.needs_input_grad
        return (None, None, dx.view(call.batch, call.seq_local, -1) if needs[2] else None,
                dw if needs[3] else None, db if needs[4] else None,
                dqn if needs[5] else None, dkn if needs[6] else None)


class OutputProjectionFunction(torch.autograd.Function):
    """``y = o_tokens @ o_weight.T (+ o_bias)``, ``o_tokens`` gathered by tokens from every
    rank's head band; without ``o_weight``, ``y = o_tokens`` (a view of the leased slot).

    ``gather``/``scatter``: the layer's ``BandExchange`` of Q bands, in each direction;
    ``row_chunks``: ``(first_row, rows)`` pieces in which the GEMM consumes the
    rows as they arrive (multiples of the gather's row blocks).
    """

    @staticmethod
    def forward(ctx, gather, scatter, row_chunks, o_band, o_weight, o_bias):
        batch, seq_global = o_band.shape[:2]
        seq_local = seq_global // gather.transfer.world_size
        rows = batch * seq_local
        pending = gather.send([o_band], batch=batch, seq_local=seq_local)
        o_tokens = gather.output(pending).view(rows, -1)
        if o_weight is None:
            gather.wait(pending)
            y = o_tokens
        else:
            y = torch.empty(rows, o_weight.shape[0], dtype=o_band.dtype, device=o_band.device)
            for first, n in row_chunks:
                gather.wait(pending, first, n)
                torch.matmul(o_tokens[first:first + n], o_weight.T, out=y[first:first + n])
            if o_bias is not None:
                y += o_bias
        ctx.lease = gather.lease(pending)
        ctx.save_for_backward(o_weight)
        ctx.o_tokens, ctx.scatter = o_tokens, scatter
        ctx.shape = (batch, seq_local)
        return y.view(batch, seq_local, -1)

    @staticmethod
    def backward(ctx, dy):
        (o_weight,) = ctx.saved_tensors
        batch, seq_local = ctx.shape
        dy2d = dy.reshape(batch * seq_local, -1).to(torch.bfloat16)
        d_tokens = dy2d if o_weight is None else dy2d @ o_weight
        scatter = ctx.scatter
        pending = scatter.send([d_tokens.view(batch, seq_local, scatter.transfer.part_heads[0]
                                              * scatter.transfer.world_size, -1)],
                               batch=batch, seq_local=seq_local)
        dw = db = None
        if o_weight is not None:
            if ctx.needs_input_grad[4]:
                dw = dy2d.T @ ctx.o_tokens
            if ctx.needs_input_grad[5]:
                db = dy2d.float().sum(dim=0).to(dy2d.dtype)
        ctx.lease.release()
        scatter.wait(pending)
        return None, None, None, scatter.output(pending), dw, db
