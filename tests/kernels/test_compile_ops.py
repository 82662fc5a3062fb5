"""``torch.compile(fullgraph=True)`` of functions that call the bundled kernels.

Each public op is one custom operator under compilation (``cake_sp::...``): no graph
break, and every output and cache byte equal to the eager call on the same inputs
(the same kernel runs either way).  On CPUs through Triton's interpreter (appends)
or the compatibility route (FMHA), on GPUs through the Triton kernels.
"""

from __future__ import annotations

import pytest
import torch
from _append_reference import Case, poisoned, rope_table
from _fmha_cases import FmhaCase, call, make_call

from cake_sp import (
    fused_qk_rmsnorm_rope_append_paged_kv_cache,
    fused_qk_rmsnorm_rope_quantize_fp8_append_paged_kv_cache,
)

BF16, FP8 = torch.bfloat16, torch.float8_e4m3fn


def _compiled_equals_eager(fn, inputs, backend="aot_eager"):
    """Run ``fn`` eagerly and compiled (fullgraph) on two copies of ``inputs``; return (graph
    breaks, whether every returned tensor and every input tensor agree bit for bit)."""
    def copy():
        return [t.clone() if isinstance(t, torch.Tensor) else t for t in inputs]

    eager_in, compiled_in = copy(), copy()
    want = fn(*eager_in)
    got = torch.compile(fn, backend=backend, fullgraph=True)(*compiled_in)
    breaks = torch._dynamo.explain(fn)(*copy()).graph_break_count
    pairs = list(zip(want, got, strict=True)) + list(zip(eager_in, compiled_in, strict=True))
    same = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
               for a, b in pairs if isinstance(a, torch.Tensor))
    return breaks, same


def _append_inputs(device, case: Case, fmt: str):
    gen = torch.Generator().manual_seed(3)
    d = case.head_dim
    qkv = (torch.randn(case.num_tokens, case.num_slots * d, generator=gen) * 3).to(BF16)
    caches = [poisoned((case.num_pages, case.page_size, case.num_kv_heads, d),
                       BF16 if fmt == "bf16" else FP8) for _ in range(2)]
    weights = [(torch.rand(d, generator=gen) + 0.5) for _ in range(2)]
    tensors = [qkv, rope_table(case.max_pos, d), case.seq_lens, case.q_indptr,
               case.page_indices, *caches, *weights]
    return [t.to(device) for t in tensors]


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_bf16_append_compiles_whole(device, backend):
    case = Case(new=[3, 0, 1], prefix=[2, 4, 6], page_size=4, num_q_heads=4, num_kv_heads=2,
                head_dim=64)

    def fn(qkv, cos_sin, seq_lens, q_indptr, pages, k_cache, v_cache, qw, kw):
        q = fused_qk_rmsnorm_rope_append_paged_kv_cache(
            qkv * 1, cos_sin, seq_lens, q_indptr, pages, k_cache, v_cache,
            num_q_heads=case.num_q_heads, num_kv_heads=case.num_kv_heads, qk_norm_policy=2,
            q_norm_weight=qw, k_norm_weight=kw)
        return (q.float() * 2,)

    breaks, same = _compiled_equals_eager(fn, _append_inputs(device, case, "bf16"), backend)
    assert breaks == 0 and same


def test_fp8_append_compiles_whole(device):
    case = Case(new=[2, 1], prefix=[3, 0], page_size=4, num_q_heads=2, num_kv_heads=1,
                head_dim=64)

    def fn(qkv, cos_sin, seq_lens, q_indptr, pages, k_cache, v_cache, qw, kw):
        one = torch.ones(1, device=qkv.device)
        out_q, q_scale, split = fused_qk_rmsnorm_rope_quantize_fp8_append_paged_kv_cache(
            qkv, cos_sin, seq_lens, q_indptr, pages, (k_cache, v_cache), False, one * 0.5,
            one * 0.75, 1, q_norm_weight=qw, k_norm_weight=kw, qk_norm_policy=1)
        return out_q, q_scale, split

    breaks, same = _compiled_equals_eager(fn, _append_inputs(device, case, "fp8"))
    assert breaks == 0 and same


@pytest.mark.parametrize("op", ["decode", "context"])
def test_fmha_compiles_whole(device, op):
    case = FmhaCase(op=op, q_lens=(1, 1, 1) if op == "decode" else (1, 5, 3), lse=True)
    names = list(make_call(case, device))

    def fn(*tensors_and_values):
        kwargs = dict(zip(names, tensors_and_values, strict=True))
        out, lse = call(case, {**kwargs, "return_lse": True})
        return out, lse

    breaks, same = _compiled_equals_eager(fn, list(make_call(case, device, seed=1).values()))
    assert breaks == 0 and same


def test_compiled_append_names_a_bad_argument(device):
    """The checks are traced: a bad argument raises the eager call's error while compiling
    (under ``fullgraph=True`` Dynamo reports it inside its own ``Unsupported`` error)."""
    case = Case(new=[2], prefix=[1], page_size=4, num_q_heads=2, num_kv_heads=1, head_dim=64)
    qkv, cos_sin, seq_lens, q_indptr, pages, k_cache, v_cache, _, _ = _append_inputs(
        device, case, "bf16")

    def fn(qkv):
        return fused_qk_rmsnorm_rope_append_paged_kv_cache(
            qkv, cos_sin, seq_lens, q_indptr, pages, k_cache, v_cache, num_q_heads=2,
            num_kv_heads=2)

    with pytest.raises(ValueError, match="num_kv_heads"):
        torch.compile(fn, backend="aot_eager")(qkv)
    with pytest.raises(Exception, match=r"num_kv_heads \(2\) must match"):
        torch.compile(fn, backend="aot_eager", fullgraph=True)(qkv)
