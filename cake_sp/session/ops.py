"""The layer's exchange steps as ``torch.library`` custom operators, for ``torch.compile``.

Under ``torch.compile`` the session call and the layer's output projection are these
operators, so Dynamo traces a model using them whole (``fullgraph=True`` works) and
AOTAutograd puts their backwards in the compiled backward graph; eager calls use the
autograd Functions of ``session/autograd.py``.  Both run the same forward and
backward helpers, so the math and the exchanges exist once.

* ``cake_sp::front_end(handle, x, qkv_weight, ...) -> (slot, ticket)`` and
  ``cake_sp::front_end_backward``;
* ``cake_sp::output_projection(handle, o_band, ...) -> (y, ticket)`` and
  ``cake_sp::output_projection_backward`` (of a layer, or of an ``UlyssesAttentionCore``
  without a projection: both give ``output_exchanges``, ``BACKWARD_SLOT_REMEDY`` and
  ``plan``);
* ``cake_sp::head_scatter(handle, q, k, v, ...) -> (slot, ticket)`` and
  ``cake_sp::head_scatter_backward``: the core's scatter of the caller's q, k, v.

Two things an operator cannot take or return are passed around it:

* the session, layer or core: by ``handle``, an int from ``register`` (a constant of the
  graph);
* what a forward keeps for its backward beyond tensors the graph owns (the slot lease,
  the gathered ``o_tokens``, a saved projection): a ticket (``session/tickets.py``), a
  tensor autograd saves, as in the eager Functions.

The session call returns its whole receive slot as one tensor (an operator's outputs
may not alias each other); q, k, v are views of it taken outside the operator, and
their gradients reach the backward as one slot-shaped tensor.  The tensors the
backward reads are its inputs (saved by autograd), never references kept in a
ticket: the compiler may reuse the memory of any tensor it believes dead.
"""

from __future__ import annotations

import itertools
import weakref

import torch
from torch import Tensor

from cake_sp.layouts import DestLayout
from cake_sp.session.autograd import (
    front_end_backward,
    front_end_forward,
    head_scatter_backward,
    head_scatter_forward,
    output_projection_backward,
    output_projection_forward,
)
from cake_sp.session.slots import front_end_layout
from cake_sp.session.tickets import issue, redeem

_OBJECTS: weakref.WeakValueDictionary[int, object] = weakref.WeakValueDictionary()
_NEXT_ID = itertools.count(1)


def register(obj: object) -> int:
    """A handle for ``obj`` (a session or a layer), valid while ``obj`` lives."""
    handle = next(_NEXT_ID)
    _OBJECTS[handle] = obj
    return handle


def _lookup(handle: int):
    obj = _OBJECTS.get(handle)
    if obj is None:
        raise RuntimeError(f"cake_sp operator: handle {handle} names no live session or layer")
    return obj


def differentiable(*tensors: Tensor | None) -> bool:
    """Whether a call on ``tensors`` records a backward: what decides, eagerly and compiled,
    between an exchange of the caller's own (leased until the backward) and a shared one."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _slot_layout(session, seq_local: int) -> DestLayout:
    cfg = session.config
    return front_end_layout(session.plan, cfg.layout, cfg.max_tokens,
                            seq_local * session.world_size)


# -- the session call ---------------------------------------------------------------------------

@torch.library.custom_op("cake_sp::front_end", mutates_args=())
def _front_end(handle: int, x: Tensor, qkv_weight: Tensor, qkv_bias: Tensor | None,
               q_norm_weight: Tensor | None, k_norm_weight: Tensor | None,
               rope_cos_sin: Tensor, positions: Tensor | None,
               for_backward: bool) -> tuple[Tensor, Tensor]:
    session = _lookup(handle)
    call = session._check_call_inputs(x, qkv_weight, q_norm_weight, k_norm_weight,
                                      rope_cos_sin, positions, qkv_bias)
    if for_backward:
        session.grad_exchange()  # built here, in a forward every rank makes alike
    _, slot_buffer, lease, projection = front_end_forward(session, call,
                                                          for_backward=for_backward)
    state = dict(lease=lease, projection=projection) if for_backward else {}
    return slot_buffer, issue(**state)


@_front_end.register_fake
def _(handle, x, qkv_weight, qkv_bias, q_norm_weight, k_norm_weight, rope_cos_sin, positions,
      for_backward):
    session = _lookup(handle)
    elements = DestLayout.buffer_elements(session.plan,
                                          session.config.max_tokens * session.world_size)
    return x.new_empty(elements), torch.empty(1, dtype=torch.int64)


@torch.library.custom_op("cake_sp::front_end_backward", mutates_args=())
def _front_end_backward(handle: int, ticket: Tensor, grad_slot: Tensor, x: Tensor,
                        qkv_weight: Tensor, qkv_bias: Tensor | None,
                        q_norm_weight: Tensor | None, k_norm_weight: Tensor | None,
                        rope_cos_sin: Tensor, positions: Tensor | None) -> list[Tensor]:
    session = _lookup(handle)
    state = redeem(ticket, "cake_sp::front_end_backward")
    call = session._check_call_inputs(x, qkv_weight, q_norm_weight, k_norm_weight,
                                      rope_cos_sin, positions, qkv_bias)
    grads = _slot_layout(session, call.seq_local).region_views(grad_slot.contiguous(),
                                                               call.batch)
    dx, dw, *rest = front_end_backward(session, call, grads, state.projection, state.lease)
    return [dx, dw, *(g for g in rest if g is not None)]


@_front_end_backward.register_fake
def _(handle, ticket, grad_slot, x, qkv_weight, qkv_bias, q_norm_weight, k_norm_weight,
      rope_cos_sin, positions):
    return [torch.empty_like(t) for t in (x, qkv_weight, qkv_bias, q_norm_weight,
                                          k_norm_weight) if t is not None]


def _front_end_setup(ctx, inputs, output) -> None:
    handle, x, qkv_weight, qkv_bias, q_norm_weight, k_norm_weight, rope, positions, _ = inputs
    ctx.handle = handle
    ctx.save_for_backward(output[1], x, qkv_weight, qkv_bias, q_norm_weight, k_norm_weight,
                          rope, positions)


def _front_end_grad(ctx, grad_slot, _grad_ticket):
    ticket, x, qkv_weight, qkv_bias, q_norm_weight, k_norm_weight, rope, positions = \
        ctx.saved_tensors
    grads = iter(torch.ops.cake_sp.front_end_backward(
        ctx.handle, ticket, grad_slot, x, qkv_weight, qkv_bias, q_norm_weight, k_norm_weight,
        rope, positions))
    present = [next(grads) if t is not None else None
               for t in (x, qkv_weight, qkv_bias, q_norm_weight, k_norm_weight)]
    return None, *present, None, None, None


torch.library.register_autograd("cake_sp::front_end", _front_end_grad,
                                setup_context=_front_end_setup)


def front_end(session, x: Tensor, qkv_weight: Tensor, q_norm_weight: Tensor | None,
              k_norm_weight: Tensor | None, rope_cos_sin: Tensor, positions: Tensor | None,
              qkv_bias: Tensor | None) -> tuple[Tensor, Tensor, Tensor] | Tensor:
    """The session call as the operator (what ``session(...)`` runs under torch.compile)."""
    for_backward = differentiable(x, qkv_weight, qkv_bias, q_norm_weight, k_norm_weight)
    slot, _ = torch.ops.cake_sp.front_end(session.op_handle, x, qkv_weight, qkv_bias,
                                          q_norm_weight, k_norm_weight, rope_cos_sin, positions,
                                          for_backward)
    views = _slot_layout(session, x.shape[1]).region_views(slot, x.shape[0])
    return views[0] if session.config.layout == "fused" else tuple(views)


# -- the output projection ----------------------------------------------------------------------

@torch.library.custom_op("cake_sp::output_projection", mutates_args=())
def _output_projection(handle: int, o_band: Tensor, o_weight: Tensor | None,
                       o_bias: Tensor | None, for_backward: bool) -> tuple[Tensor, Tensor]:
    # Both exchanges built here, in a forward every rank makes alike.
    gather, _ = _lookup(handle).output_exchanges(for_backward)
    y, o_tokens, lease = output_projection_forward(gather, o_band, o_weight, o_bias)
    if not for_backward:
        lease.release()
    return y, issue(**(dict(lease=lease, o_tokens=o_tokens) if for_backward else {}))


@_output_projection.register_fake
def _(handle, o_band, o_weight, o_bias, for_backward):
    batch, seq_global, heads, d = o_band.shape
    world = _lookup(handle).plan.world_size
    width = o_weight.shape[0] if o_weight is not None else heads * d * world
    return o_band.new_empty(batch, seq_global // world, width), torch.empty(1, dtype=torch.int64)


@torch.library.custom_op("cake_sp::output_projection_backward", mutates_args=())
def _output_projection_backward(handle: int, ticket: Tensor, dy: Tensor,
                                o_weight: Tensor | None, bias_grad: bool) -> list[Tensor]:
    owner = _lookup(handle)
    _, scatter = owner.output_exchanges(True)
    state = redeem(ticket, "cake_sp::output_projection_backward")
    d_o, dw, db = output_projection_backward(scatter, dy, o_weight, state.o_tokens, state.lease,
                                             weight_grad=o_weight is not None,
                                             bias_grad=bias_grad,
                                             remedy=owner.BACKWARD_SLOT_REMEDY)
    return [d_o, *(g for g in (dw, db) if g is not None)]


@_output_projection_backward.register_fake
def _(handle, ticket, dy, o_weight, bias_grad):
    plan = _lookup(handle).plan
    batch, seq_local = dy.shape[:2]
    d_o = dy.new_empty(batch, seq_local * plan.world_size, plan.q_per_rank, plan.head_dim)
    if o_weight is None:
        return [d_o]
    dw = torch.empty_like(o_weight)
    return [d_o, dw, dy.new_empty(o_weight.shape[0])] if bias_grad else [d_o, dw]


def _output_projection_setup(ctx, inputs, output) -> None:
    handle, _, o_weight, o_bias, _ = inputs
    ctx.handle, ctx.has_bias = handle, o_bias is not None
    ctx.save_for_backward(output[1], o_weight)


def _output_projection_grad(ctx, dy, _grad_ticket):
    ticket, o_weight = ctx.saved_tensors
    grads = torch.ops.cake_sp.output_projection_backward(ctx.handle, ticket, dy, o_weight,
                                                         ctx.has_bias)
    d_o, *rest = grads
    dw = rest[0] if o_weight is not None else None
    db = rest[1] if ctx.has_bias else None
    return None, d_o, dw, db, None


torch.library.register_autograd("cake_sp::output_projection", _output_projection_grad,
                                setup_context=_output_projection_setup)


def output_projection(layer, o_band: Tensor, o_weight: Tensor | None,
                      o_bias: Tensor | None) -> Tensor:
    """The layer's output step as the operator (what the layer runs under torch.compile)."""
    y, _ = torch.ops.cake_sp.output_projection(
        layer.op_handle, o_band, o_weight, o_bias, differentiable(o_band, o_weight, o_bias))
    return y


# -- the core's scatter of q, k, v -------------------------------------------------------------

@torch.library.custom_op("cake_sp::head_scatter", mutates_args=())
def _head_scatter(handle: int, q: Tensor, k: Tensor, v: Tensor,
                  for_backward: bool) -> tuple[Tensor, Tensor]:
    scatter, _ = _lookup(handle).scatter_exchanges(for_backward)
    bands, lease = head_scatter_forward(scatter, q, k, v)
    if not for_backward:
        lease.release()
    return bands, issue(**(dict(lease=lease) if for_backward else {}))


@_head_scatter.register_fake
def _(handle, q, k, v, for_backward):
    core = _lookup(handle)
    batch, seq_local = q.shape[:2]
    return (q.new_empty(batch, seq_local * core.plan.world_size, sum(core.band_heads),
                        core.plan.head_dim), torch.empty(1, dtype=torch.int64))


@torch.library.custom_op("cake_sp::head_scatter_backward", mutates_args=())
def _head_scatter_backward(handle: int, ticket: Tensor, grad_bands: Tensor) -> list[Tensor]:
    core = _lookup(handle)
    _, gather = core.scatter_exchanges(True)
    state = redeem(ticket, "cake_sp::head_scatter_backward")
    parts = grad_bands.split(core.band_heads, dim=2)
    return list(head_scatter_backward(gather, parts, state.lease))


@_head_scatter_backward.register_fake
def _(handle, ticket, grad_bands):
    core = _lookup(handle)
    world, d = core.plan.world_size, core.plan.head_dim
    batch, seq = grad_bands.shape[:2]
    return [grad_bands.new_empty(batch, seq // world, world * h, d) for h in core.band_heads]


def _head_scatter_setup(ctx, inputs, output) -> None:
    ctx.handle = inputs[0]
    ctx.save_for_backward(output[1])


def _head_scatter_grad(ctx, grad_bands, _grad_ticket):
    (ticket,) = ctx.saved_tensors
    dq, dk, dv = torch.ops.cake_sp.head_scatter_backward(ctx.handle, ticket, grad_bands)
    return None, dq, dk, dv, None


torch.library.register_autograd("cake_sp::head_scatter", _head_scatter_grad,
                                setup_context=_head_scatter_setup)


def head_scatter(core, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The core's scatter as the operator (what the core runs under torch.compile): the
    q, k, v bands, views of one slot-shaped output."""
    bands, _ = torch.ops.cake_sp.head_scatter(core.op_handle, q, k, v,
                                              differentiable(q, k, v))
    return bands.split(core.band_heads, dim=2)
