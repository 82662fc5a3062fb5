"""The front end's backward kernel against a float64 autograd reference, whole and in row chunks.

The reference differentiates the forward's math without its bf16 roundings (which the
kernel passes straight through, as autograd treats a cast): per head, Q and K
``rope(rmsnorm(p + b) * w)``, V ``p + b``, each copied to every rank that receives the
head (``HeadPlan.destinations``), dotted with the gathered output gradients.
"""

from __future__ import annotations

import pytest
import torch

from cake_sp import reference
from cake_sp.fallback.torch_front_end import TorchFrontEndBackward
from cake_sp.kernels import _config
from cake_sp.kernels.front_end_backward import FrontEndBackward
from cake_sp.kernels.norm_rope import rope_style_code
from cake_sp.layouts import KIND_K, KIND_Q, HeadPlan

EPS = 1e-6


def _local_index(plan: HeadPlan, kind: int, local: int) -> int:
    return local + (0 if kind == KIND_Q else plan.q_per_rank if kind == KIND_K
                    else plan.q_per_rank + plan.kv_per_rank)


def _reference(plan, gathered, p, bias, qn, kn, cos_sin, style):
    """fp64 ``(dP [rows, H * D], d_q_norm, d_k_norm)``."""
    d, hq, hkv = plan.head_dim, plan.num_q_heads, plan.num_kv_heads
    rows = p.shape[0]
    full = (p.double() + bias.double()).requires_grad_(True)
    weights = [w.double().requires_grad_(True) for w in (qn, kn)]
    heads = full.view(rows, plan.total_heads, d)

    def norm(t, w):
        return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + EPS) * w

    q = reference.rope(norm(heads[:, :hq], weights[0]), cos_sin.double(), style)
    k = reference.rope(norm(heads[:, hq:hq + hkv], weights[1]), cos_sin.double(), style)
    outs = torch.cat((q, k, heads[:, hq + hkv:]), dim=1)
    g = gathered.double().view(rows, plan.world_size, plan.heads_per_rank, d)
    loss = 0
    for head in range(plan.total_heads):
        for rank, kind, local in plan.destinations(head):
            loss = loss + (outs[:, head] * g[:, rank, _local_index(plan, kind, local)]).sum()
    loss.backward()
    return full.grad, weights[0].grad, weights[1].grad


@pytest.mark.parametrize("world, hq, hkv, style", [(2, 4, 2, "neox"), (4, 4, 1, "interleaved")])
def test_chunks_equal_one_pass_and_match_float64(world, hq, hkv, style, device):
    g = torch.Generator().manual_seed(world + hq)
    d, rows = 64, 100
    plan = HeadPlan(world, hq, hkv, d)
    gathered = torch.randn(1, rows, world, plan.heads_per_rank, d, generator=g).bfloat16()
    projection = torch.randn(rows, plan.total_heads * d, generator=g)  # fp32, as saved
    bias = (0.5 * torch.randn(plan.total_heads * d, generator=g)).bfloat16()
    qn, kn = [(1 + 0.3 * torch.randn(d, generator=g)).bfloat16() for _ in range(2)]
    angles = torch.rand(rows, d // 2, generator=g) * 6.0
    cos_sin = torch.cat((angles.cos(), angles.sin()), dim=1)
    want_dp, want_dq, want_dk = _reference(plan, gathered, projection, bias, qn, kn, cos_sin,
                                           style)

    def run(chunks):
        # The whole fp32 projection: the kernel reads its Q/K columns at its row stride.
        backward = FrontEndBackward(
            gathered.to(device), projection.to(device), plan,
            rope_cos_sin=cos_sin.to(device), positions=None,
            q_norm_weight=qn.to(device), k_norm_weight=kn.to(device), qkv_bias=bias.to(device),
            eps=EPS, rope_style=rope_style_code(style))
        backward.dp.fill_(float("nan"))
        for first, n in chunks:
            backward.rows(first, n)
        return backward.dp.cpu(), *[t.cpu() for t in backward.norm_weight_grads()]

    block = _config.FRONT_END_BACKWARD_BLOCK_M
    whole = run([(0, rows)])
    chunked = run([(0, 2 * block), (2 * block, rows - 2 * block)])
    for a, b in zip(whole, chunked):
        assert torch.equal(a, b), "row chunks must give the same bits as one pass"
    dp, dq, dk = whole
    assert not dp.isnan().any(), "a row of dP was not written"
    for got, want, what in ((dp, want_dp, "dP"), (dq, want_dq, "d_q_norm"),
                            (dk, want_dk, "d_k_norm")):
        err = float((got.double() - want).norm() / want.norm())
        # dP is rounded to bf16 once (u = 2^-9); the weight gradients are fp32 sums.
        assert err < 1e-2, f"{what}: relative error {err:.3g}"


def test_rows_must_start_on_a_row_block(device):
    plan = HeadPlan(2, 2, 2, 64)
    gathered = torch.zeros(1, 40, 2, plan.heads_per_rank, 64, dtype=torch.bfloat16,
                           device=device)
    backward = FrontEndBackward(gathered, None, plan, rope_cos_sin=torch.zeros(40, 64,
                                                                               device=device),
                                positions=None, q_norm_weight=None, k_norm_weight=None,
                                qkv_bias=None, eps=EPS, rope_style=rope_style_code("neox"))
    with pytest.raises(ValueError, match="must start at a multiple"):
        backward.rows(1, 10)
    with pytest.raises(ValueError, match="lie in"):
        backward.rows(0, 41)


@pytest.mark.parametrize("impl", [FrontEndBackward, TorchFrontEndBackward])
def test_projection_read_in_place_from_the_dp_buffer(impl, device):
    """``p`` written into the first columns of ``dp`` (how the layer recomputes it, to spare a
    buffer) gives the same bits as a separate ``p``: every tile is read before it is
    overwritten."""
    g = torch.Generator().manual_seed(11)
    world, hq, hkv, d, rows = 2, 4, 2, 64, 70
    plan = HeadPlan(world, hq, hkv, d)
    qk_cols = (hq + hkv) * d
    gathered = torch.randn(1, rows, world, plan.heads_per_rank, d, generator=g).bfloat16()
    p = torch.randn(rows, qk_cols, generator=g).bfloat16()
    qn, kn = [(1 + 0.3 * torch.randn(d, generator=g)).bfloat16() for _ in range(2)]
    angles = torch.rand(rows, d // 2, generator=g) * 6.0
    cos_sin = torch.cat((angles.cos(), angles.sin()), dim=1)

    def run(in_place):
        dp = torch.full((rows, plan.total_heads * d), float("nan"), dtype=torch.bfloat16,
                        device=device)
        proj = p.to(device)
        if in_place:
            dp[:, :qk_cols] = proj
            proj = dp[:, :qk_cols]
        backward = impl(gathered.to(device), proj, plan, rope_cos_sin=cos_sin.to(device),
                        positions=None, q_norm_weight=qn.to(device), k_norm_weight=kn.to(device),
                        qkv_bias=None, eps=EPS, rope_style=rope_style_code("neox"), dp=dp)
        assert backward.dp is dp
        block = _config.FRONT_END_BACKWARD_BLOCK_M
        backward.rows(0, block)
        backward.rows(block, rows - block)
        return dp.cpu(), *[t.cpu() for t in backward.norm_weight_grads()]

    for a, b in zip(run(False), run(True), strict=True):
        assert torch.equal(a, b)
