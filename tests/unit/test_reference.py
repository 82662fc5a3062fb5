"""The reference against a second, independently written float64 oracle.

The oracle rotates through complex multiplication and normalises per head in
float64; the reference works step by step in fp32 with real arithmetic.  They
must agree within bf16 rounding, and an element off by exactly one bf16 ulp is
counted (fp32 vs fp64 can land on either side of a rounding boundary).
"""

from __future__ import annotations

import zlib

import pytest
import torch

from cake_sp import reference

BF16_TOL = {"atol": 1e-2, "rtol": 1e-2}


def _oracle_rank(x, w, b, qn, kn, cos_sin_rows, hq, hkv, style, eps):
    """float64 projection, norm (with the contract's bf16 roundings) and complex RoPE."""
    d = w.shape[0] // (hq + 2 * hkv)
    p = torch.einsum("bsh,nh->bsn", x.double(), w.double())
    if b is not None:
        p = p + b.double()
    p = p.unflatten(-1, (hq + 2 * hkv, d))
    heads = []
    for h in range(hq + 2 * hkv):
        t = p[:, :, h]
        if h >= hq + hkv:
            heads.append(t.to(torch.bfloat16))
            continue
        weight = qn if h < hq else kn
        if weight is not None:
            scale = 1.0 / torch.sqrt((t * t).sum(-1, keepdim=True) / d + eps)
            t = (t * scale).to(torch.bfloat16).double() * weight.double()
            t = t.to(torch.bfloat16).double()
        cos, sin = cos_sin_rows[..., : d // 2].double(), cos_sin_rows[..., d // 2:].double()
        rot = torch.complex(cos, sin)
        if style == "interleaved":
            z = torch.view_as_complex(t.reshape(*t.shape[:-1], d // 2, 2).contiguous())
            t = torch.view_as_real(z * rot).flatten(-2)
        else:
            z = torch.complex(t[..., : d // 2], t[..., d // 2:])
            t = torch.cat(((z * rot).real, (z * rot).imag), dim=-1)
        heads.append(t.to(torch.bfloat16))
    stacked = torch.stack(heads, dim=2)
    return stacked[:, :, :hq], stacked[:, :, hq:hq + hkv], stacked[:, :, hq + hkv:]


def _assert_close_counting_ulps(actual, expected, what):
    torch.testing.assert_close(actual.float(), expected.float(), **BF16_TOL, msg=what)
    diff = actual.float() != expected.float()
    ulp_flips = diff.sum().item()
    # fp32 vs fp64 arithmetic may put a value on the other side of a bf16
    # rounding boundary; that is a one-ulp difference and must stay rare.
    assert ulp_flips <= max(1, actual.numel() // 200), f"{what}: {ulp_flips} elements differ"


@pytest.mark.parametrize("style", ["interleaved", "neox"])
@pytest.mark.parametrize("with_bias,with_norm,with_positions",
                         [(False, True, False), (True, True, True), (True, False, False),
                          (False, False, True)])
@pytest.mark.parametrize("hq,hkv,world", [(4, 4, 2), (8, 2, 4), (8, 2, 8)])
def test_reference_matches_float64_oracle(style, with_bias, with_norm, with_positions, hq,
                                          hkv, world):
    seed = zlib.crc32(repr((style, with_bias, with_norm, hq, world)).encode())
    g = torch.Generator().manual_seed(seed)
    d, hidden, batch, s_local = 128, 96, 2, 5
    n = (hq + 2 * hkv) * d
    w = (torch.randn(n, hidden, generator=g) / hidden**0.5).bfloat16()
    b = torch.randn(n, generator=g).bfloat16() if with_bias else None
    qn = (1 + 0.1 * torch.randn(d, generator=g)).bfloat16() if with_norm else None
    kn = (1 + 0.1 * torch.randn(d, generator=g)).bfloat16() if with_norm else None
    xs = [torch.randn(batch, s_local, hidden, generator=g).bfloat16() for _ in range(world)]
    if with_positions:
        table = reference.rope_cos_sin_table(64, d)
        positions = [torch.randint(0, 64, (batch, s_local), generator=g) for _ in range(world)]
        rows = [table[p] for p in positions]
        tables = table
    else:
        tables = [reference.rope_cos_sin_table(batch * s_local, d, base=100.0 + r)
                  for r in range(world)]
        positions = None
        rows = [t.reshape(batch, s_local, d) for t in tables]

    got = reference.qkv_norm_rope_exchange(
        xs, w, qn, kn, tables, positions, b, num_q_heads=hq, num_kv_heads=hkv,
        rope_style=style)
    oracle = [_oracle_rank(x, w, b, qn, kn, rows[r], hq, hkv, style, 1e-6)
              for r, x in enumerate(xs)]
    group = hq // hkv
    for r in range(world):
        q_heads = range(r * hq // world, (r + 1) * hq // world)
        kv_heads = sorted({h // group for h in q_heads})
        want = [torch.cat([o[i][:, :, list(heads)] for o in oracle], dim=1)
                for i, heads in ((0, q_heads), (1, kv_heads), (2, kv_heads))]
        for name, a, e in zip("qkv", got[r], want):
            assert a.dtype == torch.bfloat16 and a.shape == e.shape
            _assert_close_counting_ulps(a, e, f"rank {r} {name}")


def test_fused_layout_is_qkv_per_head():
    g = torch.Generator().manual_seed(7)
    d, hidden, h, world = 128, 64, 4, 2
    w = torch.randn(3 * h * d, hidden, generator=g).bfloat16()
    xs = [torch.randn(1, 3, hidden, generator=g).bfloat16() for _ in range(world)]
    table = reference.rope_cos_sin_table(3, d)
    kwargs = dict(num_q_heads=h, num_kv_heads=h)
    bshd = reference.qkv_norm_rope_exchange(xs, w, None, None, table, **kwargs)
    fused = reference.qkv_norm_rope_exchange(xs, w, None, None, table, layout="fused", **kwargs)
    for (q, k, v), f in zip(bshd, fused):
        assert f.shape == (1, 3 * world, h // world, 3 * d)
        assert torch.equal(f[..., :d], q) and torch.equal(f[..., d:2 * d], k)
        assert torch.equal(f[..., 2 * d:], v)


def test_unknown_rope_style_is_rejected():
    with pytest.raises(ValueError, match="rope_style"):
        reference.rope(torch.randn(1, 2, 1, 8), torch.randn(1, 2, 8), "gptj")


@pytest.mark.parametrize("rope_style,causal", [("neox", True), ("interleaved", False)])
def test_layer_reference_gradients_pass_gradcheck(rope_style, causal):
    """The float64 whole-layer reference the gradient tests use is itself differentiable
    correctly: finite differences agree with its autograd (GQA 4/2, biases, norms, two ranks)."""
    g = torch.Generator().manual_seed(0)
    hq, hkv, d, hidden, world, seq = 4, 2, 4, 8, 2, 3
    n = (hq + 2 * hkv) * d

    def rand(*shape):
        return torch.randn(shape, generator=g, dtype=torch.float64, requires_grad=True)

    xs = [rand(1, seq, hidden) for _ in range(world)]
    params = [rand(n, hidden), rand(hidden, hq * d), rand(n), rand(hidden), rand(d), rand(d)]
    table = reference.rope_cos_sin_table(world * seq, d).double()
    tables = [table[r * seq:(r + 1) * seq] for r in range(world)]

    def layer(x0, x1, w_qkv, w_o, b_qkv, b_o, qn, kn):
        return tuple(reference.ulysses_attention_layer(
            [x0, x1], w_qkv, w_o, tables, num_q_heads=hq, num_kv_heads=hkv, qkv_bias=b_qkv,
            o_bias=b_o, q_norm_weight=qn, k_norm_weight=kn, rope_style=rope_style,
            causal=causal))

    assert torch.autograd.gradcheck(layer, (*xs, *params))


@pytest.mark.parametrize("causal", [True, False])
def test_layer_reference_packed_sequences_are_independent(causal):
    """With ``cu_seqlens`` the reference is the layer run on each packed sequence alone: a
    sequence across the rank boundary, one inside a rank, one of a single token, two rows."""
    g = torch.Generator().manual_seed(1)
    hq, hkv, d, hidden, world, seq_local, batch = 4, 2, 8, 16, 2, 5, 2
    seq = world * seq_local
    w_qkv = torch.randn((hq + 2 * hkv) * d, hidden, generator=g, dtype=torch.float64)
    w_o = torch.randn(hidden, hq * d, generator=g, dtype=torch.float64)
    xs = [torch.randn(batch, seq_local, hidden, generator=g, dtype=torch.float64)
          for _ in range(world)]
    table = torch.randn(batch * seq, d, generator=g).view(batch, seq, d)
    tables = [table[:, r * seq_local:(r + 1) * seq_local].flatten(0, 1) for r in range(world)]
    options = dict(num_q_heads=hq, num_kv_heads=hkv, causal=causal)
    cu_seqlens = (0, 3, 8, 9, seq, 2 * seq)
    packed = torch.cat(reference.ulysses_attention_layer(
        xs, w_qkv, w_o, tables, cu_seqlens=cu_seqlens, **options), dim=1).flatten(0, 1)
    x, rope = torch.cat(xs, dim=1).flatten(0, 1), table.flatten(0, 1)
    for a, b in zip(cu_seqlens, cu_seqlens[1:]):
        alone = reference.ulysses_attention_layer([x[None, a:b]], w_qkv, w_o, [rope[a:b]],
                                                  **options)[0][0]
        torch.testing.assert_close(packed[a:b], alone, rtol=1e-12, atol=1e-12)
    whole = torch.cat(reference.ulysses_attention_layer(xs, w_qkv, w_o, tables, **options),
                      dim=1).flatten(0, 1)
    assert not torch.allclose(packed[3:8], whole[3:8])  # the mask changed something
