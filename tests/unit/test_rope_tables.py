"""The RoPE-table recipes of docs/guide.md ("Using it in a model") against the conventions
they convert from, written out independently here: transformers' ``rotate_half`` with
halves-duplicated cos/sin (neox), and FLUX.1's complex rotation of adjacent channel pairs
with diffusers' ``repeat_interleave`` cos/sin (interleaved)."""

from __future__ import annotations

import torch

from cake_sp import reference

D, POSITIONS = 64, 37


def _frequencies(g: torch.Generator) -> torch.Tensor:
    """Angles ``[POSITIONS, D/2]`` from a random base, in float64."""
    base = 1000.0 + 9000.0 * torch.rand((), generator=g, dtype=torch.float64)
    inv_freq = base ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
    return torch.arange(POSITIONS, dtype=torch.float64)[:, None] * inv_freq


def test_transformers_neox_table():
    g = torch.Generator().manual_seed(1)
    angles = _frequencies(g)
    emb = torch.cat([angles, angles], dim=-1)            # transformers: cat(freqs, freqs)
    cos, sin = emb.cos(), emb.sin()
    x = torch.randn(POSITIONS, 2, D, generator=g, dtype=torch.float64)
    rotate_half = torch.cat([-x[..., D // 2:], x[..., : D // 2]], dim=-1)
    want = x * cos[:, None] + rotate_half * sin[:, None]

    half = D // 2
    table = torch.cat([cos[..., :half], sin[..., :half]], dim=-1).float()
    got = reference.rope(x.float(), table, "neox")
    torch.testing.assert_close(got, want.float(), rtol=1e-5, atol=1e-5)


def test_flux_interleaved_table():
    g = torch.Generator().manual_seed(2)
    angles = _frequencies(g)
    cos = angles.cos().repeat_interleave(2, dim=-1)      # diffusers: repeat_interleave_real
    sin = angles.sin().repeat_interleave(2, dim=-1)
    x = torch.randn(POSITIONS, 2, D, generator=g, dtype=torch.float64)
    # FLUX.1: each adjacent pair (x[2i], x[2i+1]) is a complex number times e^(i * angle).
    pairs = torch.view_as_complex(x.reshape(POSITIONS, 2, D // 2, 2).contiguous())
    want = torch.view_as_real(pairs * torch.polar(torch.ones_like(angles), angles)[:, None])
    want = want.reshape(POSITIONS, 2, D)

    table = torch.cat([cos[..., 0::2], sin[..., 0::2]], dim=-1).float()
    got = reference.rope(x.float(), table, "interleaved")
    torch.testing.assert_close(got, want.float(), rtol=1e-5, atol=1e-5)
