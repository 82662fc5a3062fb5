"""The front end in plain PyTorch, for CPUs without Triton's interpreter (forward and backward).

The same math as the producer (DESIGN.md section 1, ``cake_sp.reference.qkv_norm_rope``)
and as ``kernels/front_end_backward.py``, written with torch ops, so that a session
and the layer run on CPU tensors with no environment variable.  The NCCL path calls
``produce_torch`` in place of the producer kernel (the destinations are tensors here,
not a pointer table); autograd takes ``TorchFrontEndBackward`` in place of
``FrontEndBackward``.  Triton's interpreter (``TRITON_INTERPRET=1``) still runs the
kernels themselves on the CPU, which is how the tests exercise them.
"""

from __future__ import annotations

import torch
from torch import Tensor

from cake_sp import reference
from cake_sp.kernels.front_end_backward import dp_buffer
from cake_sp.kernels.norm_rope import ROPE_STYLES
from cake_sp.layouts import KIND_K, KIND_Q, KIND_V, DestLayout, HeadPlan
from cake_sp.session.positions import BadPositionsCounter
from cake_sp.session.slots import CallInputs


def _style_name(rope_style: int) -> str:
    """The RoPE style name of the kernels' code (``norm_rope.ROPE_STYLES``)."""
    return next(name for name, code in ROPE_STYLES.items() if code == rope_style)


def _cos_sin_rows(table: Tensor, positions: Tensor | None, rows: int) -> tuple[Tensor, int]:
    """fp32 ``[rows, D]``: each token's cos/sin row (``positions`` ``[rows]`` index the table,
    else row ``m`` is token ``m``), and how many positions lie outside the table: their
    rows are cos = sin = 0, as the producer kernel rotates them."""
    if positions is None:
        return table[:rows], 0
    pos = positions.long()
    bad = (pos < 0) | (pos >= table.shape[0])
    return torch.where(bad[:, None], 0.0, table[pos.clamp(0, table.shape[0] - 1)]), \
        int(bad.sum())


def produce_torch(call: CallInputs, plan: HeadPlan, dest: DestLayout, buffers: list[Tensor], *,
                  dest_seq_offset: int, eps: float, rope_style: int,
                  bad_positions: BadPositionsCounter, projection: Tensor | None) -> None:
    """The producer's job with torch ops: rank ``d``'s head bands of this rank's tokens into
    ``buffers[d]`` (a 1-D bf16 buffer laid out by ``dest``), at token ``dest_seq_offset``.

    ``projection``: an fp32 ``[rows, (Hq + 2*Hkv) * D]`` buffer to receive ``x @ W.T``
    (autograd keeps it), or None.
    """
    d = plan.head_dim
    hq, hkv = plan.num_q_heads, plan.num_kv_heads
    p = call.x2d.float() @ call.qkv_weight.float().T
    if projection is not None:
        projection.copy_(p)
    if call.qkv_bias is not None:
        p = p + call.qkv_bias.float()
    p = p.view(call.batch, call.seq_local, plan.total_heads, d)
    cos_sin, bad = _cos_sin_rows(call.rope_cos_sin, call.positions, call.rows)
    bad_positions.count += bad * (hq + hkv)  # per Q/K head row, as the kernel counts
    cos_sin = cos_sin.view(call.batch, call.seq_local, d)
    q, k, v = p.split((hq, hkv, hkv), dim=2)
    style = _style_name(rope_style)
    heads = {KIND_Q: reference.rope(reference.rms_norm(q, call.q_norm_weight, eps), cos_sin,
                                    style),
             KIND_K: reference.rope(reference.rms_norm(k, call.k_norm_weight, eps), cos_sin,
                                    style),
             KIND_V: v}
    for rank, buffer in enumerate(buffers):
        for kind, values in heads.items():
            band = plan.source_heads(rank, kind)
            dest.kind_view(buffer, kind, len(band), call.batch, call.seq_local,
                           dest_seq_offset).copy_(values[:, :, band.start:band.stop])


class TorchFrontEndBackward:
    """``kernels.front_end_backward.FrontEndBackward`` with torch ops (same arguments, same
    ``dp``, ``rows`` and ``norm_weight_grads``)."""

    def __init__(self, gathered: Tensor, p: Tensor | None, plan: HeadPlan, *,
                 rope_cos_sin: Tensor, positions: Tensor | None,
                 q_norm_weight: Tensor | None, k_norm_weight: Tensor | None,
                 qkv_bias: Tensor | None, eps: float, rope_style: int,
                 dp: Tensor | None = None) -> None:
        self.num_rows = gathered.shape[0] * gathered.shape[1]
        self._plan, self._eps = plan, eps
        self._style = _style_name(rope_style)
        self._gathered = gathered.view(self.num_rows, plan.world_size, plan.heads_per_rank, -1)
        self._p, self._bias = p, qkv_bias
        self._weights = {KIND_Q: q_norm_weight, KIND_K: k_norm_weight}
        self._cos_sin, _ = _cos_sin_rows(rope_cos_sin, positions, self.num_rows)
        # ``p`` may be a view of ``dp``: ``rows`` reads a chunk's p before it writes its dp.
        self.dp = dp_buffer(dp, self.num_rows, plan, gathered.device)
        self._dw = {kind: torch.zeros(plan.head_dim, dtype=torch.float32,
                                      device=gathered.device) for kind in (KIND_Q, KIND_K)}

    def _head_grads(self, rows: slice) -> Tensor:
        """fp32 ``[n, H, D]``: each projection head's output gradient, summed over every rank
        that received it (``HeadPlan.destinations``)."""
        plan = self._plan
        g = self._gathered[rows].float()
        out = g.new_empty(g.shape[0], plan.total_heads, plan.head_dim)
        for head in range(plan.total_heads):
            dests = plan.destinations(head)
            out[:, head] = sum(g[:, rank, plan.kind_offset(kind) + local]
                               for rank, kind, local in dests)
        return out

    def rows(self, first: int, n: int) -> None:
        plan, d = self._plan, self._plan.head_dim
        hq, hkv = plan.num_q_heads, plan.num_kv_heads
        rows = slice(first, first + n)
        grads = self._head_grads(rows)
        cos_sin = self._cos_sin[rows]
        # RoPE is a rotation: its transpose rotates by -theta.
        inverse = torch.cat((cos_sin[..., : d // 2], -cos_sin[..., d // 2:]), dim=-1)
        for kind, heads in ((KIND_Q, slice(0, hq)), (KIND_K, slice(hq, hq + hkv))):
            dy = reference.rope(grads[:, heads], inverse, self._style)
            w = self._weights[kind]
            if w is not None:
                p = self._p[rows, heads.start * d:heads.stop * d].float()
                if self._bias is not None:
                    p = p + self._bias[heads.start * d:heads.stop * d].float()
                p = p.view(n, -1, d)
                rstd = torch.rsqrt(p.pow(2).mean(-1, keepdim=True) + self._eps)
                normed = p * rstd
                self._dw[kind] += (dy * normed.bfloat16().float()).sum(dim=(0, 1))
                dn = dy * w.float()
                dy = rstd * (dn - normed * (dn * normed).mean(-1, keepdim=True))
            grads[:, heads] = dy
        self.dp[rows] = grads.flatten(1).bfloat16()

    def norm_weight_grads(self) -> tuple[Tensor | None, Tensor | None]:
        return tuple(self._dw[kind] if self._weights[kind] is not None else None
                     for kind in (KIND_Q, KIND_K))
