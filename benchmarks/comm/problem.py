"""One row's inputs on this rank, and what this rank must receive, from the reference alone.

Inputs come from seeded generators, one stream per source rank, so every rank
can rebuild any rank's ``x`` without communication.  The expected output of
rank ``r`` is then ``cake_sp.reference.qkv_norm_rope`` of every source's
tokens restricted to ``r``'s head band (per-head norm and RoPE do not mix
heads), concatenated in source order: no collective and nothing from the code
under test is involved, and the full-size check costs about one local GEMM in
fp32.

Two expectations are built from the same fp32 projection:

* ``"contract"``: DESIGN.md section 1 exactly (the projection is never rounded);
  the fused session is checked against it;
* ``"bf16_projection"``: the same steps after rounding the projection to bf16,
  which is what a cuBLAS GEMM with a bf16 output hands the next operator.
  The baselines are checked against it: one extra rounding before the norm
  moves many outputs by a few bf16 ulps (the norm and the rotation amplify
  it), more than the contract's tolerance allows, and that difference is the
  baselines' documented deviation, not an error.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from cake_sp import reference
from cake_sp.layouts import KIND_K, KIND_Q, KIND_V, HeadPlan
from cake_sp.testing import assert_close_counting_flips

from rows import Row

EPS = 1e-6
ROPE_STYLE = "interleaved"
BF16_TOL = {"atol": 1e-2, "rtol": 1e-2}  # DESIGN.md section 1
_CHUNK_TOKENS = 8192  # bounds the fp32 temporaries of the full-size reference


@dataclass
class Inputs:
    """This rank's call arguments: ``x [B, S_local, hidden]``, weights, per-token cos/sin."""

    x: Tensor
    qkv_weight: Tensor
    q_norm_weight: Tensor
    k_norm_weight: Tensor
    rope_cos_sin: Tensor  # fp32 [B * S_local, D]: rows of the tokens' global positions


def _generator(device: torch.device, seed: int) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def _source_x(row: Row, world: int, source: int, device: torch.device, seed: int) -> Tensor:
    g = _generator(device, seed * 1009 + 17 + source)
    shape = (row.batch, row.seq_local(world), row.hidden)
    return torch.randn(shape, generator=g, device=device).bfloat16()


def _global_positions(row: Row, world: int, source: int, device: torch.device) -> Tensor:
    """``[B, S_local]`` global positions of ``source``'s tokens (``source * S_local + s``)."""
    s_local = row.seq_local(world)
    pos = torch.arange(source * s_local, (source + 1) * s_local, device=device)
    return pos.expand(row.batch, s_local)


def make_inputs(row: Row, world: int, rank: int, device: torch.device, seed: int) -> Inputs:
    """Fresh random inputs of ``rank`` (never zeros); weights are the same on every rank."""
    g = _generator(device, seed)
    n = row.total_heads * row.head_dim
    weight = (torch.randn(n, row.hidden, generator=g, device=device)
              / row.hidden**0.5).bfloat16()
    q_norm = (1 + 0.2 * torch.randn(row.head_dim, generator=g, device=device)).bfloat16()
    k_norm = (1 + 0.2 * torch.randn(row.head_dim, generator=g, device=device)).bfloat16()
    table = reference.rope_cos_sin_table(row.seq_global, row.head_dim, device=device)
    cos_sin = table[_global_positions(row, world, rank, device).reshape(-1)].contiguous()
    return Inputs(_source_x(row, world, rank, device, seed), weight, q_norm, k_norm, cos_sin)


def band_heads(plan: HeadPlan, rank: int) -> tuple[list[int], list[int], list[int]]:
    """Projection-head indices of ``rank``'s Q, K and V bands (rows of ``qkv_weight`` / D)."""
    hq, hkv = plan.num_q_heads, plan.num_kv_heads
    return (list(plan.source_heads(rank, KIND_Q)),
            [hq + h for h in plan.source_heads(rank, KIND_K)],
            [hq + hkv + h for h in plan.source_heads(rank, KIND_V)])


def _norm_rope_band(p: Tensor, inputs: Inputs, cos_sin: Tensor,
                    plan: HeadPlan) -> tuple[Tensor, Tensor, Tensor]:
    """Steps 2-4 of the contract on a fp32 band projection ``p [B, S, heads, D]``.

    The same steps, in the same order, as ``reference.qkv_norm_rope`` after its
    projection (which offers no way to round the projection first).
    """
    q, k, v = p.split((plan.q_per_rank, plan.kv_per_rank, plan.kv_per_rank), dim=2)
    q = reference.rope(reference.rms_norm(q, inputs.q_norm_weight, EPS), cos_sin, ROPE_STYLE)
    k = reference.rope(reference.rms_norm(k, inputs.k_norm_weight, EPS), cos_sin, ROPE_STYLE)
    return q.bfloat16(), k.bfloat16(), v.bfloat16()


def expected_outputs(row: Row, world: int, rank: int, inputs: Inputs,
                     seed: int) -> dict[str, tuple[Tensor, Tensor, Tensor]]:
    """What ``rank`` must receive, ``{"contract": (q, k, v), "bf16_projection": (q, k, v)}``.

    Each is bf16 ``q [B, S_global, Hq/W, D]``, ``k``, ``v [B, S_global, Hkv_local, D]``.
    """
    plan = HeadPlan(world, row.num_q_heads, row.num_kv_heads, row.head_dim)
    device, d = inputs.x.device, row.head_dim
    heads = [h for band in band_heads(plan, rank) for h in band]
    w_band = inputs.qkv_weight.view(row.total_heads, d, row.hidden)[heads].reshape(-1, row.hidden)
    table = reference.rope_cos_sin_table(row.seq_global, d, device=device)
    pieces: dict[str, list[list[Tensor]]] = {"contract": [[], [], []],
                                             "bf16_projection": [[], [], []]}
    s_local = row.seq_local(world)
    for source in range(world):
        x = _source_x(row, world, source, device, seed)
        positions = _global_positions(row, world, source, device)
        for start in range(0, s_local, _CHUNK_TOKENS):
            stop = min(start + _CHUNK_TOKENS, s_local)
            p = reference.project(x[:, start:stop], w_band)
            p = p.reshape(row.batch, stop - start, len(heads), d)
            cos_sin = reference.token_cos_sin(table, positions[:, start:stop], row.batch,
                                              stop - start)
            for name, proj in (("contract", p), ("bf16_projection", p.bfloat16().float())):
                for kind, t in enumerate(_norm_rope_band(proj, inputs, cos_sin, plan)):
                    pieces[name][kind].append(t)
    return {name: tuple(torch.cat(p, dim=1) for p in kinds) for name, kinds in pieces.items()}


def compare(got: Tensor, want: Tensor, rope_style: str | None,
            intermediate_roundings: int = 2) -> dict:
    """Element counts of ``got`` against the reference ``want`` (bf16, same shape).

    ``mismatches``: outside ``BF16_TOL`` and not explained by one intermediate
    bf16 flip (``cake_sp.testing``; the arm fails); ``flips``: beyond the tolerance
    but so explained, counted, never hidden; ``differ``: not bit-equal;
    ``one_ulp``: at most one bf16 ulp apart.
    """
    if got.shape != want.shape or got.dtype != want.dtype:
        return {"elements": want.numel(), "mismatches": want.numel(), "differ": want.numel(),
                "one_ulp": 0, "flips": 0, "max_abs_err": float("inf"),
                "error": f"got {got.dtype} {tuple(got.shape)}, want {want.dtype} "
                         f"{tuple(want.shape)}"}
    diff = (got.float() - want.float()).abs()
    report = {"max_abs_err": float(diff.nan_to_num(float("inf")).max()) if diff.numel() else 0.0}
    try:
        # A bf16-rounded projection flips about ten times as often (see bench_producer).
        counts = assert_close_counting_flips(
            got, want, rope_style=rope_style, intermediate_roundings=intermediate_roundings,
            max_flip_fraction=1e-5 if intermediate_roundings == 2 else 1e-4)
    except AssertionError as exc:
        close = torch.isclose(got.float(), want.float(), **BF16_TOL)
        return {**report, "elements": want.numel(), "mismatches": max(1, int((~close).sum())),
                "differ": int((got != want).sum()), "one_ulp": 0, "flips": 0,
                "error": str(exc)}
    return {**report, "elements": counts["elements"], "mismatches": 0,
            "differ": counts["differ"], "one_ulp": counts["one_ulp"],
            "flips": counts["intermediate_flips"]}
