"""Random inputs of the whole layer every rank can regenerate, and the fp64 reference's verdict.

Tolerances.  The layer computes in bf16 (unit roundoff u = 2^-9 ~ 2e-3): the
projection, the norm and RoPE outputs, the attention probabilities inside the
kernel, o and y are each rounded once, so the forward's relative error (Frobenius
norm, against the float64 reference without any rounding) is a few u; the
gradients pass through as many roundings again, plus the bf16 gradient GEMMs,
so a few u more.  ``FORWARD_RTOL = 1e-2`` (5u) and ``GRAD_RTOL = 2e-2`` (10u) bound
those with margin; the errors measured on CPU and GPU sit at 1.5-4e-3 and
2-8e-3 (docs/results.md), and a wrong head, token or sign gives O(1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from cake_sp import reference

FORWARD_RTOL = 1e-2
GRAD_RTOL = 2e-2
PARAM_NAMES = ("qkv_weight", "qkv_bias", "q_norm_weight", "k_norm_weight", "o_weight", "o_bias")


@dataclass
class LayerProblem:
    """Every rank's input of one layer call, its parameters and output gradients."""

    xs: list[Tensor]
    params: dict[str, Tensor | None]
    tables: list[Tensor]
    positions: list[Tensor] | None
    dys: list[Tensor]


def make_layer_problem(seed: int, world: int, *, hidden: int, num_q_heads: int,
                       num_kv_heads: int, head_dim: int, batch: int, seq_local: int,
                       qkv_bias: bool, o_bias: bool, qk_norm: bool, o_proj: bool = True,
                       positions: bool = False) -> LayerProblem:
    """Fresh random inputs (never zeros); per-token RoPE tables at the tokens' global
    positions, or one table and random positions."""
    g = torch.Generator().manual_seed(seed)
    n = (num_q_heads + 2 * num_kv_heads) * head_dim
    o_in = num_q_heads * head_dim

    def rand(*shape, scale=1.0, shift=0.0):
        return (shift + scale * torch.randn(shape, generator=g)).bfloat16()

    params = {
        "qkv_weight": rand(n, hidden, scale=hidden**-0.5),
        "qkv_bias": rand(n, scale=0.5) if qkv_bias else None,
        "q_norm_weight": rand(head_dim, scale=0.2, shift=1.0) if qk_norm else None,
        "k_norm_weight": rand(head_dim, scale=0.2, shift=1.0) if qk_norm else None,
        "o_weight": rand(hidden, o_in, scale=o_in**-0.5) if o_proj else None,
        "o_bias": rand(hidden, scale=0.5) if o_bias else None,
    }
    xs = [rand(batch, seq_local, hidden) for _ in range(world)]
    out_width = hidden if o_proj else o_in
    dys = [rand(batch, seq_local, out_width) for _ in range(world)]
    if positions:
        table = reference.rope_cos_sin_table(4 * world * seq_local, head_dim)
        pos = [torch.randint(0, table.shape[0], (batch, seq_local), generator=g)
               for _ in range(world)]
        return LayerProblem(xs, params, [table] * world, pos, dys)
    full = reference.rope_cos_sin_table(world * seq_local, head_dim, base=500.0)
    tables = [full[r * seq_local:(r + 1) * seq_local].repeat(batch, 1) for r in range(world)]
    return LayerProblem(xs, params, tables, None, dys)


def reference_layer(problem: LayerProblem, *, num_q_heads: int, num_kv_heads: int,
                    rope_style: str, causal: bool,
                    cu_seqlens: tuple[int, ...] | None = None,
                    key_mask: Tensor | None = None,
                    qk_norm_offset: float = 0.0,
                    softcap: float | None = None) -> tuple[list[Tensor], dict]:
    """The float64 reference's outputs and, after backward with ``problem.dys``, the
    gradients: ``{"x": [per rank], name: full-sequence parameter gradient}``.  The norms
    scale by ``qk_norm_offset + weight``."""
    xs = [x.double().requires_grad_(True) for x in problem.xs]
    params = {k: None if v is None else v.double().requires_grad_(True)
              for k, v in problem.params.items()}
    q_scale, k_scale = [None if w is None else qk_norm_offset + w
                        for w in (params["q_norm_weight"], params["k_norm_weight"])]
    ys = reference.ulysses_attention_layer(
        xs, params["qkv_weight"], params["o_weight"], problem.tables,
        num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, qkv_bias=params["qkv_bias"],
        o_bias=params["o_bias"], q_norm_weight=q_scale, k_norm_weight=k_scale,
        positions=problem.positions,
        rope_style=rope_style, causal=causal, cu_seqlens=cu_seqlens, key_mask=key_mask,
        softcap=softcap)
    torch.autograd.backward(ys, [dy.double() for dy in problem.dys])
    grads = {"x": [x.grad for x in xs]}
    grads.update({k: v.grad for k, v in params.items() if v is not None})
    return [y.detach() for y in ys], grads


def relative_error(got: Tensor, want: Tensor) -> float:
    """``||got - want|| / ||want||`` (Frobenius), in float64 on the CPU."""
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    assert got.shape == want.shape, f"shape {tuple(got.shape)} != {tuple(want.shape)}"
    return float((got - want).norm() / want.norm())
