"""Fused QK RMSNorm + RoPE + FP8 quantize + paged append, against the float64 oracle.

FP8 payloads are held to the FP8 rounding of the unrounded value (scaled);
``q_scale`` to rel 1e-5; V bit-exact to ``fp8(fp32(v) * fp32(1 / v_scale))``, the
op's arithmetic.  CPU cases
stay small (the interpreter runs programs one by one); ``gpu`` cases use
serving shapes and CUDA graphs.
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from _append_reference import Case, check_call, plan_targets, poisoned, reference_qk, rope_table

from cake_sp import fused_qk_rmsnorm_rope_quantize_fp8_append_paged_kv_cache as append_fp8
from cake_sp.kernels.norm_rope import reciprocal_rn
from cake_sp.kernels.paged_append import ERR_METADATA, ERR_PAGE

BF16, FP8 = torch.bfloat16, torch.float8_e4m3fn
DECODE = dict(new=[1, 1, 1], prefix=[20, 15, 0])
PREFILL = dict(new=[5, 0, 19], prefix=[13, 7, 30])
# Scales chosen so that K and V fill the FP8 range, some values saturating.
K_SCALE, V_SCALE, Q_SCALE_INV = 0.01, 0.02, 150.0
Q_SCALE_RTOL = 1e-5


def cache_shape(case: Case, kv_layout: str) -> tuple[int, int, int, int]:
    if kv_layout == "NHD":
        return (case.num_pages, case.page_size, case.num_kv_heads, case.head_dim)
    return (case.num_pages, case.num_kv_heads, case.page_size, case.head_dim)


def q_scale_shape(case: Case, quant: int, prefill: bool, max_seqlen: int):
    if quant == 2:
        return (0,)
    if prefill:
        return (len(case.new), case.num_q_heads, -(-max_seqlen // 128) * 128)
    return (case.num_tokens, case.num_q_heads)


def run_case(device, case: Case, *, quant=1, prefill=False, max_seqlen=0, policy=2,
             rope_style="neox", kv_layout="NHD", redirect=(False, False), clear=True,
             upper_max=448.0, record=None):
    """Draw inputs, poison every output, run the op, and check every byte it owns."""
    d, t = case.head_dim, case.num_tokens
    qkv = (torch.randn(t, case.num_slots * d) * 3).to(BF16)
    cos_sin = rope_table(case.max_pos, d)
    weights = [(torch.rand(d) + 0.5) for _ in range(2)]
    scales = [torch.tensor([s]) for s in (K_SCALE, V_SCALE, Q_SCALE_INV)]
    caches_before = [poisoned(cache_shape(case, kv_layout), FP8) for _ in range(2)]
    q_before = poisoned((t, case.num_q_heads, d), FP8)
    outs_before = [poisoned((t, case.num_kv_heads, d), FP8) if r else None for r in redirect]
    qs_before = poisoned(q_scale_shape(case, quant, prefill, max_seqlen), torch.float32)
    split_before = poisoned((len(case.new), case.num_kv_heads), torch.int32)
    flags = torch.full((len(case.new),), -7, dtype=torch.int32, device=device)
    # Copies, also on the CPU (where .to(device) would alias): the poison is compared after.
    caches = [c.to(device, copy=True) for c in caches_before]
    outs = [None if o is None else o.to(device, copy=True) for o in outs_before]
    dev = [x.to(device) for x in (qkv, cos_sin, case.seq_lens, case.q_indptr, case.page_indices)]
    out_q, q_scale, split = append_fp8(
        *dev, tuple(caches), prefill, scales[0].to(device), scales[1].to(device), quant,
        max_seqlen=max_seqlen, upper_max=upper_max, q_scale_inv=scales[2].to(device),
        q_norm_weight=weights[0].to(device), k_norm_weight=weights[1].to(device),
        qk_norm_policy=policy, out_q=q_before.to(device, copy=True), out_k=outs[0], out_v=outs[1],
        q_scale=qs_before.to(device, copy=True),
        split_k_flag=split_before.to(device, copy=True),
        rope_style=rope_style, kv_layout=kv_layout, clear_unused_last_page_rows=clear,
        error_flags=flags)
    max_req_len = max_seqlen if (quant == 1 and prefill) else None
    targets = plan_targets(case, max_req_len=max_req_len, clear=clear)
    assert flags.cpu().tolist() == targets.status
    malformed = targets.status[0] & ERR_METADATA
    assert split.cpu().eq(-1 if malformed else 0).all()

    q_ref = k_ref = v_want = None
    q_scale = q_scale.cpu()
    ok = torch.tensor(targets.writable, dtype=torch.bool)
    if ok.any():
        q64, k64, v = reference_qk(qkv, cos_sin, case, targets, policy=policy,
                                   q_norm_weight=weights[0], k_norm_weight=weights[1],
                                   eps=1e-6, rope_style=rope_style)
        k_ref = k64 / K_SCALE
        # torch's fp32 reciprocal and product are IEEE, each rounded once.
        inv_v_scale = torch.tensor(V_SCALE, dtype=torch.float32).reciprocal()
        v_want = (v.float() * inv_v_scale).clamp(-448, 448).to(FP8)
        if quant == 1:
            s_ref = q64.abs().amax(-1).clamp_min(1e-6) / upper_max
            q_ref = q64 / s_ref[..., None]
            s_got = q_scale if not prefill else q_scale[targets.req, :, targets.r]
            torch.testing.assert_close(s_got[ok].double(), s_ref[ok], rtol=Q_SCALE_RTOL, atol=0)
        else:
            q_ref = q64 * Q_SCALE_INV
    # q_scale entries no valid token owns stay poisoned (padding, empty and skipped requests).
    if quant == 1:
        owned = torch.zeros(q_scale.shape, dtype=torch.bool)
        for t_i in ok.nonzero().flatten().tolist():
            owned[(targets.req[t_i], slice(None), targets.r[t_i]) if prefill else t_i] = True
        assert torch.equal(q_scale[~owned].view(torch.int32), qs_before[~owned].view(torch.int32))
    check_call(case, targets, kv_layout, "fp8", q_out=out_q, q_before=q_before, q_ref=q_ref,
               k_ref=k_ref, v_want=v_want, caches=caches, caches_before=caches_before, outs=outs,
               outs_before=outs_before, record=record)
    return targets


@pytest.mark.parametrize("policy", [0, 1, 2])
@pytest.mark.parametrize("quant", [1, 2])
def test_decode_policies_and_quant(device, quant, policy, record_property):
    case = Case(**DECODE, page_size=16, num_q_heads=8, num_kv_heads=1)
    run_case(device, case, quant=quant, policy=policy, record=record_property)


@pytest.mark.parametrize("heads,page_size,rope_style,kv_layout", [
    ((8, 1), 64, "interleaved", "HND"),
    ((32, 8), 16, "neox", "NHD"),
    ((4, 4), 64, "neox", "HND"),
])
def test_decode_heads_pages_styles(device, heads, page_size, rope_style, kv_layout,
                                   record_property):
    case = Case(**DECODE, page_size=page_size, num_q_heads=heads[0], num_kv_heads=heads[1])
    run_case(device, case, quant=1, policy=1, rope_style=rope_style, kv_layout=kv_layout,
             record=record_property)


@pytest.mark.parametrize("heads,quant,policy", [
    ((8, 1), 1, 2), ((64, 8), 1, 1), ((4, 4), 2, 0), ((8, 1), 2, 1)])
def test_prefill_ragged_cross_page(device, heads, quant, policy, record_property):
    case = Case(**PREFILL, page_size=16, num_q_heads=heads[0], num_kv_heads=heads[1])
    run_case(device, case, quant=quant, prefill=True, max_seqlen=24, policy=policy,
             record=record_property)


@pytest.mark.parametrize("q_len", [127, 128, 129])
def test_dynamic_scale_padding_boundary(device, q_len, record_property):
    """q_scale is [B, Hq, round_up(max_seqlen, 128)]; entries past each request stay untouched."""
    case = Case(new=[q_len, 2], prefix=[3, 0], page_size=64, num_q_heads=2, num_kv_heads=1,
                head_dim=64)
    run_case(device, case, quant=1, prefill=True, max_seqlen=q_len, upper_max=240.0,
             record=record_property)


@pytest.mark.parametrize("redirect", [(True, True), (True, False)])
def test_caller_owned_out_k_out_v(device, redirect, record_property):
    case = Case(**PREFILL, page_size=16, num_q_heads=4, num_kv_heads=2)
    run_case(device, case, quant=2, prefill=True, redirect=redirect, record=record_property)


def test_no_clear_leaves_tail(device):
    case = Case(**DECODE, page_size=16, num_q_heads=4, num_kv_heads=2)
    assert run_case(device, case, clear=False).tails == []


@pytest.mark.parametrize("breakage", ["first", "decreasing", "last", "too_long"])
def test_malformed_metadata_flags_and_writes_nothing(device, breakage):
    """-1 in every split_k_flag entry, and not a byte of Q, K, V, caches or q_scale written."""
    case = Case(new=[2, 3, 1], prefix=[5, 0, 9], page_size=4, num_q_heads=2, num_kv_heads=2,
                head_dim=64)
    max_seqlen = 3
    if breakage == "first":
        case.q_indptr[0] = 1
    elif breakage == "decreasing":
        case.q_indptr[1], case.q_indptr[2] = 4, 3
    elif breakage == "last":
        case.q_indptr[-1] = case.num_tokens + 1
    else:
        max_seqlen = 2
    targets = run_case(device, case, quant=1, prefill=True, max_seqlen=max_seqlen,
                       redirect=(False, True))
    assert targets.status == [ERR_METADATA] * 3


def test_out_of_range_page_writes_nothing(device):
    case = Case(new=[6, 2], prefix=[14, 3], page_size=4, num_q_heads=2, num_kv_heads=1)
    case.page_indices[0, 4] = case.num_pages
    case.page_indices[1, 0] = -1
    targets = run_case(device, case, quant=1)
    assert targets.status == [ERR_PAGE, ERR_PAGE]


# ----------------------------------------------------------------------------- validation

def _args(**over):
    case = Case(new=[2], prefix=[3], page_size=4, num_q_heads=2, num_kv_heads=1, head_dim=64)
    caches = tuple(poisoned(cache_shape(case, "NHD"), FP8) for _ in range(2))
    kw = dict(qkv=torch.randn(2, 4 * 64).to(BF16), cos_sin=rope_table(case.max_pos, 64),
              seq_lens=case.seq_lens, q_indptr=case.q_indptr, page_indices=case.page_indices,
              paged_kv_cache=caches, is_prefill=False, k_scale=torch.tensor([0.1]),
              v_scale=torch.tensor([0.1]), quant_policy=1)
    kw.update(over)
    return kw


@pytest.mark.parametrize("over,exc,match", [
    (dict(paged_kv_cache=torch.empty(1)), TypeError, "paged_kv_cache must be a"),
    (dict(quant_policy=3), ValueError, "quant_policy"),
    (dict(upper_max=float("inf")), ValueError, r"upper_max must be a finite float in \(0, 448"),
    (dict(upper_max=500.0), ValueError, "upper_max"),
    (dict(upper_max=0.0), ValueError, "upper_max"),
    (dict(is_prefill=True), ValueError, "needs max_seqlen > 0"),
    (dict(quant_policy=2), TypeError, "q_scale_inv must be a one-element fp32"),
    (dict(k_scale=torch.tensor([0.1, 0.2])), ValueError, r"k_scale.*shape \(2,\)"),
    (dict(q_scale=torch.empty(2, 3)), ValueError, r"q_scale must be fp32 \[2, 2\]"),
    (dict(split_k_flag=torch.empty(1, 2, dtype=torch.int32)), ValueError, "split_k_flag"),
    (dict(out_q=torch.empty(2, 2, 64, dtype=BF16)), TypeError, r"out_q.*float8_e4m3fn"),
    (dict(qkv=torch.randn(2, 2 * 64).to(BF16)), ValueError, "Hq >= 1"),
])
def test_argument_validation(over, exc, match):
    """Errors name the argument and quote what it got; CPU tensors suffice (no launch)."""
    with pytest.raises(exc, match=match):
        append_fp8(**_args(**over))


def test_bf16_caches_rejected():
    caches = tuple(c.view(torch.uint8).to(BF16) for c in _args()["paged_kv_cache"])
    with pytest.raises(TypeError, match=r"key_cache must have dtype.*float8_e4m3fn"):
        append_fp8(**_args(paged_kv_cache=caches))


# ----------------------------------------------------------------------------- GPU scale

@pytest.mark.gpu
@pytest.mark.parametrize("heads", [(8, 1), (64, 8), (32, 8), (4, 4)])
@pytest.mark.parametrize("mode", ["decode", "prefill"])
@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("quant", [1, 2])
@pytest.mark.parametrize("policy", [0, 1, 2])
def test_gpu_real_shapes(device, heads, mode, page_size, quant, policy, record_property):
    b = 32 if mode == "decode" else 4
    new = [1] * b if mode == "decode" else [300, 0, 129, 1]
    prefix = [(97 * i) % 700 for i in range(b)]
    case = Case(new=new, prefix=prefix, page_size=page_size, num_q_heads=heads[0],
                num_kv_heads=heads[1])
    run_case(device, case, quant=quant, prefill=mode == "prefill", max_seqlen=300,
             policy=policy, kv_layout="HND" if page_size == 64 else "NHD",
             rope_style="interleaved" if policy == 1 else "neox", record=record_property)


@pytest.mark.gpu
@pytest.mark.parametrize("quant,prefill", [(1, False), (1, True), (2, False)])
def test_gpu_cuda_graph_replays_match_eager(device, quant, prefill):
    """Capture once; three replays on fresh copies are bitwise equal to an eager call,
    including the device-side flags of a table that turns malformed between replays."""
    case = Case(new=[1] * 32 if not prefill else [40] * 4, prefix=list(range(5, 37))[:32 if not
                prefill else 4], page_size=16, num_q_heads=64, num_kv_heads=8)
    d = case.head_dim
    qkv = (torch.randn(case.num_tokens, case.num_slots * d, device=device) * 3).to(BF16)
    cos_sin = rope_table(case.max_pos, d).to(device)
    seq_lens, q_indptr, table = (x.to(device) for x in (case.seq_lens, case.q_indptr,
                                                         case.page_indices))
    start = [poisoned(cache_shape(case, "NHD"), FP8).to(device) for _ in range(2)]
    scales = [torch.tensor([s], device=device) for s in (K_SCALE, V_SCALE, Q_SCALE_INV)]
    kw = dict(max_seqlen=64, q_scale_inv=scales[2], qk_norm_policy=0)

    def call(caches, **extra):
        return append_fp8(qkv, cos_sin, seq_lens, q_indptr, table, tuple(caches), prefill,
                          scales[0], scales[1], quant, **kw, **extra)

    # Dynamic prefill leaves q_scale's padding entries alone: both q_scale buffers start
    # as the same non-scale value, so the comparison covers them too.
    scale_start = torch.full(q_scale_shape(case, quant, prefill, kw["max_seqlen"]), -7.0,
                             device=device)
    eager_caches = [c.clone() for c in start]
    q_e, s_e, f_e = call(eager_caches, q_scale=scale_start.clone())
    caches = [c.clone() for c in start]
    out = (torch.empty_like(q_e), scale_start.clone(), torch.empty_like(f_e))
    call(caches, out_q=out[0], q_scale=out[1], split_k_flag=out[2])  # warm-up: compile
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call(caches, out_q=out[0], q_scale=out[1], split_k_flag=out[2])
    for _ in range(3):
        for c, s in zip(caches, start, strict=True):
            c.copy_(s)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out[0].view(torch.uint8), q_e.view(torch.uint8))
        assert torch.equal(out[1], s_e) and torch.equal(out[2], f_e)
        for c, e in zip(caches, eager_caches, strict=True):
            assert torch.equal(c.view(torch.uint8), e.view(torch.uint8))
    # The same graph with a malformed table: flags -1, caches untouched.
    q_indptr[0] = 1
    for c, s in zip(caches, start, strict=True):
        c.copy_(s)
    graph.replay()
    torch.cuda.synchronize()
    assert out[2].eq(-1).all()
    for c, s in zip(caches, start, strict=True):
        assert torch.equal(c.view(torch.uint8), s.view(torch.uint8))


# ----------------------------------------------------------------------------- reciprocal_rn


@triton.jit
def _reciprocal_kernel(s_ptr, out_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(out_ptr + offs, reciprocal_rn(tl.load(s_ptr + offs)))


def test_reciprocal_rn_is_the_ieee_reciprocal(device):
    """Bit for bit ``1 / s`` (torch's fp32 reciprocal is IEEE) over scales of both signs in
    [2^-100, 2^100], and zeros, infinities and NaN: the one rounding the op's FP8 scales take
    before each product."""
    g = torch.Generator().manual_seed(5)
    s = torch.exp2(torch.empty(256).uniform_(-100, 100, generator=g)) * torch.randn(
        256, generator=g).sign()
    s[:5] = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan")])
    out = torch.full_like(s, 7.0).to(device)
    _reciprocal_kernel[(1,)](s.to(device), out, N=s.numel())
    want, got = s.reciprocal(), out.cpu()
    same = (got.view(torch.int32) == want.view(torch.int32)) | (got.isnan() & want.isnan())
    assert bool(same.all()), f"{int((~same).sum())} reciprocals differ, first at " \
                             f"{(~same).nonzero()[:4].flatten().tolist()}"
