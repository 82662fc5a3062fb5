"""Autograd of the layer's two exchange steps (DESIGN.md section 6, the backward column).

* ``FrontEndFunction``: the session call (GEMM -> norm/RoPE -> scatter by heads).
  Backward: ``dq, dk, dv`` gathered back to token order (a ``BandExchange``), then
  one kernel (``kernels/front_end_backward.py``: the sum over the ranks that hold a
  replicated K/V head, RoPE transposed, RMSNorm backward in fp32) gives ``dP``, then
  ``dX = dP @ W_qkv`` -- both row chunk by row chunk as the chunks arrive (NVLink) --
  and ``dW_qkv = dP^T @ X``.
* ``OutputProjectionFunction``: gather by tokens -> o_proj GEMM.  Backward:
  ``d_o = dY @ W_o`` scattered by heads back to the band owners, ``dW_o = dY^T @ o``.
* ``HeadScatterFunction``: the front end of ``UlyssesAttentionCore``, whose caller computed
  ``q, k, v`` itself: scatter by heads.  Backward: ``dq, dk, dv`` gathered back to token
  order, as the front end's.

What each saves (per layer call on one rank, ``rows = B * S_local``):

* front end: ``x`` and the parameters are the caller's; the q/k/v outputs are
  views of a receive slot, leased until the backward so that no later call
  overwrites them (the lease rides in a saved ticket, ``session/tickets.py``: under
  activation checkpointing it ends with the forward, and the recomputed forward
  takes its own).  The projection of the Q/K heads, which only the norm backward
  reads, is by default recomputed in the backward (one bf16 GEMM of ``rows x (Hq +
  Hkv) * D x hidden``, only with a QK norm, written into the ``dP`` buffer); with the
  session's ``save_projection`` the forward's fp32 projection of every head is kept
  instead (``rows * (Hq + 2 * Hkv) * D * 4`` bytes until the backward; the cuBLAS engine
  writes it anyway).
* output: the token-order ``o`` (``rows * Hq * D`` bf16), a view of the gather's
  receive slot, saved and leased likewise.
* head scatter: nothing but the lease of its receive slot, whose q/k/v bands the
  attention saves.

The attention between them is the attention backend's own autograd (it saves
q, k, v, o and its LSE).  Parameter gradients are this rank's contribution from
its own tokens: a data-parallel reduction over the sequence-parallel group (as
with DeepSpeed-Ulysses) sums them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from cake_sp.fallback.torch_front_end import TorchFrontEndBackward
from cake_sp.kernels import _config
from cake_sp.kernels.front_end_backward import FrontEndBackward
from cake_sp.kernels.norm_rope import rope_style_code
from cake_sp.layouts import HeadPlan
from cake_sp.session import tickets
from cake_sp.session.slots import CallInputs, SlotLease


def _qk_projection(call: CallInputs, plan: HeadPlan, dp: Tensor) -> Tensor | None:
    """The projection of the Q/K heads without the bias, bf16 ``[rows, (Hq + Hkv) * D]``
    (recomputed rather than kept; only the norm backward reads it), or None without a norm
    weight.  Written into the first columns of ``dp``, the backward's ``dP`` buffer, which the
    norm backward overwrites tile by tile after reading them: no buffer of its own."""
    if call.q_norm_weight is None and call.k_norm_weight is None:
        return None
    qk_cols = (plan.num_q_heads + plan.num_kv_heads) * plan.head_dim
    return torch.matmul(call.x2d, call.qkv_weight[:qk_cols].T, out=dp[:, :qk_cols])


def _front_end_grads(exchange, pending, p: Tensor | None, dp: Tensor, call: CallInputs,
                     plan: HeadPlan, *, eps: float, rope_style: int
                     ) -> tuple[Tensor | None, ...]:
    """``(dx, dW_qkv, d_bias, d_q_norm, d_k_norm)`` from the gathered output gradients (the
    call ``pending`` of ``exchange``, ``[B, S_local, W, heads_per_rank, D]``) and the Q/K
    projection ``p`` (without the bias).

    The rows come in ``exchange.row_chunks``: each chunk's ``dP`` rows and ``dX`` rows are
    computed as soon as that chunk has arrived; ``dW_qkv = dP^T @ X`` needs every row.
    """
    # On a CPU without Triton's interpreter the same math in plain PyTorch.
    plain = _config.plain_torch(call.x2d.device)
    backward = (TorchFrontEndBackward if plain else FrontEndBackward)(
        exchange.output(pending), p, plan, rope_cos_sin=call.rope_cos_sin,
        positions=call.positions, q_norm_weight=call.q_norm_weight,
        k_norm_weight=call.k_norm_weight, qkv_bias=call.qkv_bias, eps=eps,
        rope_style=rope_style, dp=dp)
    dx = torch.empty_like(call.x2d)
    for first, n in exchange.row_chunks(call.rows):
        exchange.wait(pending, first, n)
        backward.rows(first, n)
        torch.matmul(dp[first:first + n], call.qkv_weight, out=dx[first:first + n])
    d_bias = dp.sum(dim=0, dtype=torch.float32).to(dp.dtype) if call.qkv_bias is not None \
        else None
    d_weight = dp.T @ call.x2d
    return dx, d_weight, d_bias, *(None if g is None else g.to(torch.bfloat16)
                                   for g in backward.norm_weight_grads())


def front_end_forward(session, call: CallInputs, *, for_backward: bool
                      ) -> tuple[list[Tensor], Tensor, SlotLease | None, Tensor | None]:
    """Run one session call: ``(views, slot_buffer, lease, projection)``.

    views: the outputs, views of the receive slot ``slot_buffer`` (the exchange's, flat);
    lease: that slot pinned until released, when ``for_backward``, else None.  projection:
    the fp32 ``[rows, (Hq + 2 * Hkv) * D]`` projection kept for the backward (allocated
    here, owned by the caller from now on) when ``for_backward`` and the session saves it,
    else None.
    """
    projection = None
    if for_backward and session.config.save_projection and (call.q_norm_weight is not None
                                                            or call.k_norm_weight is not None):
        projection = torch.empty(call.rows, call.qkv_weight.shape[0], dtype=torch.float32,
                                 device=call.x2d.device)
    exchange = session.exchange(for_backward)
    views, slot = exchange.run(call, None, projection)
    lease = exchange.slots.lease(slot) if for_backward else None
    return views, exchange.slots.buffer(slot), lease, projection


def front_end_backward(session, call: CallInputs, grads: Sequence[Tensor],
                       projection: Tensor | None, lease: SlotLease | None
                       ) -> tuple[Tensor | None, ...]:
    """``(dx [B, S_local, hidden], dW_qkv, d_bias, d_q_norm, d_k_norm)`` of one call from the
    gradients of its outputs (``(dq, dk, dv)``, or one fused tensor); releases ``lease`` (the
    forward's slot; None when it already ended with its ticket) once nothing reads it any
    more.  Collective, like the forward."""
    d = session.plan.head_dim
    if len(grads) == 1:  # one [B, S_global, H, 3D] tensor: q | k | v per head
        grads = tuple(grads[0][..., i * d:(i + 1) * d] for i in range(3))
    parts = [g.to(torch.bfloat16) for g in grads]
    exchange = session.grad_exchange()
    pending = exchange.send(parts, batch=call.batch, seq_local=call.seq_local)
    # While the gradients travel (the NCCL path's collective is asynchronous; on NVLink
    # the peers push into this rank's slot), recompute what the norm backward needs.
    plan = session.plan
    dp = torch.empty(call.rows, plan.total_heads * plan.head_dim, dtype=torch.bfloat16,
                     device=call.x2d.device)
    p = projection if projection is not None else _qk_projection(call, plan, dp)
    if lease is not None:
        lease.release()
    dx, dw, db, dqn, dkn = _front_end_grads(
        exchange, pending, p, dp, call, plan, eps=float(session.config.eps),
        rope_style=rope_style_code(session.config.rope_style))
    return dx.view(call.batch, call.seq_local, -1), dw, db, dqn, dkn


def output_projection_forward(gather, o_band: Tensor, o_weight: Tensor | None,
                              o_bias: Tensor | None) -> tuple[Tensor, Tensor, SlotLease]:
    """``(y [B, S_local, out], o_tokens [rows, Hq * D], lease)``: ``o_band`` gathered by tokens
    (``o_tokens``, a view of the gather's slot, pinned by ``lease`` until released), then
    ``y = o_tokens @ o_weight.T (+ o_bias)`` chunk by chunk as the rows arrive (``y`` is
    ``o_tokens`` itself without ``o_weight``)."""
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
        for first, n in gather.row_chunks(rows):
            gather.wait(pending, first, n)
            rows_in, rows_out = o_tokens[first:first + n], y[first:first + n]
            if o_bias is None:
                torch.matmul(rows_in, o_weight.T, out=rows_out)
            else:  # the bias in the GEMM's epilogue: one rounding, no extra pass
                torch.addmm(o_bias, rows_in, o_weight.T, out=rows_out)
    return y.view(batch, seq_local, -1), o_tokens, gather.lease(pending)


def output_projection_backward(scatter, dy: Tensor, o_weight: Tensor | None, o_tokens: Tensor,
                               lease: SlotLease | None, *, weight_grad: bool, bias_grad: bool,
                               remedy: str) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """``(d_o_band, dW_o, d_bias)`` from ``dy [B, S_local, out]``: ``d_o = dy @ W_o`` scattered
    by heads back to the band owners (``d_o_band``, the scatter's slot lent: ``lend``, with
    ``remedy``, the caller's advice for a second backward before ``d_o`` is read), ``dW_o =
    dy^T @ o_tokens``; releases ``lease`` (the forward's gather slot; None when it already
    ended with its ticket).  Collective."""
    batch, seq_local = dy.shape[:2]
    dy2d = dy.reshape(batch * seq_local, -1).to(torch.bfloat16)
    d_tokens = dy2d if o_weight is None else dy2d @ o_weight
    transfer = scatter.transfer
    pending = scatter.send([d_tokens.view(batch, seq_local,
                                          transfer.part_heads[0] * transfer.world_size, -1)],
                           batch=batch, seq_local=seq_local)
    dw = dy2d.T @ o_tokens if o_weight is not None and weight_grad else None
    db = dy2d.float().sum(dim=0).to(dy2d.dtype) if o_weight is not None and bias_grad else None
    if lease is not None:
        lease.release()
    scatter.wait(pending)
    # Autograd, not this function, decides when d_o is read: lent, so that a second output
    # step's backward before that read raises instead of overwriting it.
    return scatter.lend(pending, remedy=remedy), dw, db


def _lease_of(ticket: Tensor) -> SlotLease | None:
    """The slot lease a saved ticket holds, or None if it ended with the original ticket (a
    saved-tensor hook dropped or copied it; the backward then reads only saved tensors)."""
    found = tickets.state(ticket)
    return None if found is None else found.lease


class FrontEndFunction(torch.autograd.Function):
    """The session call with a backward (``QkvNormRopeExchangeOverlap.__call__`` uses it when
    an input requires grad).  Outputs are views of a receive slot, leased by a saved ticket
    (``session/tickets.py``) until the backward."""

    @staticmethod
    def forward(ctx, session, call: CallInputs, x, qkv_weight, qkv_bias, q_norm_weight,
                k_norm_weight):
        views, _, lease, projection = front_end_forward(session, call, for_backward=True)
        # Saved, not kept on ctx: activation checkpointing drops them (and the lease with the
        # ticket) after the forward, and its recomputed forward saves its own.
        ctx.save_for_backward(tickets.issue(lease=lease), projection)
        ctx.session, ctx.call = session, call
        return tuple(views)

    @staticmethod
    def backward(ctx, *grads):
        ticket, projection = ctx.saved_tensors
        dx, dw, db, dqn, dkn = front_end_backward(ctx.session, ctx.call, grads, projection,
                                                  _lease_of(ticket))
        needs = ctx.needs_input_grad
        return (None, None, dx if needs[2] else None, dw if needs[3] else None,
                db if needs[4] else None, dqn if needs[5] else None, dkn if needs[6] else None)


class OutputProjectionFunction(torch.autograd.Function):
    """``y = o_tokens @ o_weight.T (+ o_bias)``, ``o_tokens`` gathered by tokens from every
    rank's head band; without ``o_weight``, ``y = o_tokens`` (a view of the leased slot).

    ``gather``/``scatter``: the layer's ``BandExchange`` of Q bands, in each direction;
    ``remedy``: what the caller advises where ``scatter``'s slot is still lent
    (``output_projection_backward``).  The GEMM consumes the gathered rows in
    ``gather.row_chunks`` as they arrive.
    """

    @staticmethod
    def forward(ctx, gather, scatter, remedy, o_band, o_weight, o_bias):
        y, o_tokens, lease = output_projection_forward(gather, o_band, o_weight, o_bias)
        ctx.save_for_backward(o_weight, o_tokens, tickets.issue(lease=lease))
        ctx.scatter, ctx.remedy = scatter, remedy
        return y

    @staticmethod
    def backward(ctx, dy):
        o_weight, o_tokens, ticket = ctx.saved_tensors
        d_o, dw, db = output_projection_backward(
            ctx.scatter, dy, o_weight, o_tokens, _lease_of(ticket),
            weight_grad=ctx.needs_input_grad[4], bias_grad=ctx.needs_input_grad[5],
            remedy=ctx.remedy)
        return None, None, None, d_o, dw, db


def head_scatter_forward(scatter, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, SlotLease]:
    """``(bands [B, W * S_local, heads, D], lease)``: ``q, k, v`` bf16 ``[B, S_local, W * h_i,
    D]`` scattered by heads (``scatter``, a ``SCATTER_HEADS`` exchange of the three parts);
    ``bands`` is a view of its receive slot, pinned by ``lease`` until released.
    Collective."""
    batch, seq_local = q.shape[:2]
    pending = scatter.send([q, k, v], batch=batch, seq_local=seq_local)
    scatter.wait(pending)
    return scatter.output(pending), scatter.lease(pending)


def head_scatter_backward(gather, grads: Sequence[Tensor],
                          lease: SlotLease | None) -> tuple[Tensor, Tensor, Tensor]:
    """``dq, dk, dv`` in token order (fresh tensors ``[B, S_local, W * h_i, D]``) from the
    bands' gradients ``[B, W * S_local, h_i, D]``, gathered by tokens (``gather``); releases
    ``lease`` (the forward's slot, which the attention's backward has read; None when it
    already ended with its ticket).  Collective."""
    if lease is not None:
        lease.release()
    batch, seq = grads[0].shape[:2]
    seq_local = seq // gather.transfer.world_size
    pending = gather.send([g.to(torch.bfloat16) for g in grads], batch=batch,
                          seq_local=seq_local)
    gather.wait(pending)
    out = gather.output(pending)  # [B, S_local, W, heads, D], a shared slot: copied out
    t = gather.transfer
    return tuple(out[:, :, :, t.part_offset(i):t.part_offset(i) + h]
                 .clone(memory_format=torch.contiguous_format).flatten(2, 3)
                 for i, h in enumerate(t.part_heads))


class HeadScatterFunction(torch.autograd.Function):
    """``q, k, v`` bf16 ``[B, S_local, W * h_i, D]`` (this rank's tokens, every rank's band of
    heads side by side) -> this rank's bands over the whole sequence ``[B, W * S_local, h_i,
    D]``: views of ``scatter``'s receive slot, leased by a saved ticket until the backward.

    ``scatter``: a ``BandExchange`` of ``SCATTER_HEADS`` with the three parts; ``gather``: one
    of ``GATHER_TOKENS`` with the same parts, which takes ``dq, dk, dv`` back to token order
    in the backward.  Collective, forward and backward.
    """

    @staticmethod
    def forward(ctx, scatter, gather, q, k, v):
        bands, lease = head_scatter_forward(scatter, q, k, v)
        ctx.save_for_backward(tickets.issue(lease=lease))
        ctx.gather = gather
        return bands.split(scatter.transfer.part_heads, dim=2)

    @staticmethod
    def backward(ctx, *grads):
        (ticket,) = ctx.saved_tensors
        return (None, None, *head_scatter_backward(ctx.gather, grads, _lease_of(ticket)))
