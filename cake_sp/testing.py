"""Comparing bf16 outputs of the session math with ``cake_sp.reference`` (tests, demo, benches).

The contract (DESIGN.md section 1) rounds to bf16 twice before RoPE: the
normalised value, then its product with the norm weight.  A kernel whose fp32
GEMM sums in another order than the reference can land such an intermediate on
the other side of a rounding boundary: one intermediate ulp.  RoPE then mixes
the pair ``(a, b)``; where ``a cos - b sin`` nearly cancels, that one ulp of
``a`` is a large relative error of the output, beyond atol = rtol = 1e-2,
although nothing is wrong.

``assert_close_counting_flips`` keeps the 1e-2 tolerance for every element and
accepts an element beyond it only when one intermediate flip explains it:
``|got - want| <= n ulp(|pair|) + ulp(want)`` (n = 2 roundings), with ``|pair| = hypot(a', b')``
the pair's length, which the rotation preserves, so it bounds ``|a|`` and
``|b|``.  Those elements must stay rare and are counted, never hidden.
"""

from __future__ import annotations

import torch
from torch import Tensor

BF16_TOL = {"atol": 1e-2, "rtol": 1e-2}
MAX_FLIP_FRACTION = 1e-5


def bf16_ulp(x: Tensor) -> Tensor:
    """The spacing of bf16 values at ``|x|`` (fp32 tensor)."""
    exponent = torch.floor(torch.log2(x.abs().clamp_min(2.0**-126)))
    return torch.exp2(exponent - 7)


def rope_pair_length(x: Tensor, head_dim: int, rope_style: str) -> Tensor:
    """``hypot`` of each element's RoPE partner and itself; ``x`` is ``[..., k * head_dim]``."""
    heads = x.unflatten(-1, (-1, head_dim))
    if rope_style == "interleaved":
        pairs = heads.unflatten(-1, (head_dim // 2, 2))
        length = torch.hypot(pairs[..., 0], pairs[..., 1]).repeat_interleave(2, dim=-1)
    else:
        a, b = heads[..., : head_dim // 2], heads[..., head_dim // 2:]
        length = torch.hypot(a, b).repeat(*([1] * (heads.dim() - 1)), 2)
    return length.flatten(-2)


def assert_close_counting_flips(got: Tensor, want: Tensor, *, rope_style: str | None,
                                head_dim: int = 128, what: str = "",
                                intermediate_roundings: int = 2,
                                max_flip_fraction: float = MAX_FLIP_FRACTION) -> dict:
    """Assert ``got`` (bf16) matches ``want`` as the module docstring says; return the counts.

    ``rope_style`` None means the values were not rotated (V): plain tolerance.
    ``intermediate_roundings``: bf16 roundings before RoPE (2 in the contract; a
    front end that also rounds the projection to bf16 has 3 and more error);
    ``max_flip_fraction``: how rare the explained flips must be.
    """
    # On the tensors' own device: a full-size benchmark check is ~10^9 elements, minutes on a CPU.
    got, want = got.detach().float(), want.detach().float().to(got.device)
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    err = (got - want).abs()
    beyond = err > BF16_TOL["atol"] + BF16_TOL["rtol"] * want.abs()
    beyond |= got.isnan() != want.isnan()
    flips = 0
    if beyond.any():
        if rope_style is None:
            torch.testing.assert_close(got, want, **BF16_TOL, msg=lambda m: f"{what}: {m}")
        bound = (intermediate_roundings * bf16_ulp(rope_pair_length(want, head_dim, rope_style))
                 + bf16_ulp(want))
        unexplained = beyond & ~(err <= bound)
        flips = int(beyond.sum())
        assert not unexplained.any(), (
            f"{what}: {int(unexplained.sum())} elements beyond tolerance that one intermediate "
            f"bf16 flip does not explain; worst |err| {err[unexplained].max():.4g}")
        assert flips <= max(1, int(max_flip_fraction * got.numel())), (
            f"{what}: {flips} of {got.numel()} elements differ by an intermediate flip")
    differ = got != want
    return {"elements": got.numel(), "differ": int(differ.sum()),
            "one_ulp": int((differ & (err <= bf16_ulp(want))).sum()), "intermediate_flips": flips}
