"""Fused QK RMSNorm + RoPE + paged append, BF16 caches, against the float64 oracle.

CPU (Triton interpreter) cases stay small: each program of a grid runs in
turn there, so a case costs about (token blocks x (Hq + 2 Hkv) + B x clear shares)
programs.  ``gpu`` cases use serving shapes and CUDA graphs.
"""

from __future__ import annotations

import pytest
import torch
from _append_reference import (
    Case,
    check_call,
    force_programs,
    plan_targets,
    poisoned,
    reference_qk,
    rope_table,
)

from cake_sp import fused_qk_rmsnorm_rope_append_paged_kv_cache as append_bf16
from cake_sp.kernels import _config
from cake_sp.kernels.paged_append import ERR_METADATA, ERR_PAGE, ERR_POSITION

BF16 = torch.bfloat16
# Decode: one new token per request, prefixes that end mid-page and on a page edge.
DECODE = dict(new=[1, 1, 1], prefix=[20, 15, 0])
# Prefill: ragged, crossing pages, with an empty request.
PREFILL = dict(new=[5, 0, 19], prefix=[13, 7, 30])


def cache_shape(case: Case, kv_layout: str) -> tuple[int, int, int, int]:
    if kv_layout == "NHD":
        return (case.num_pages, case.page_size, case.num_kv_heads, case.head_dim)
    return (case.num_pages, case.num_kv_heads, case.page_size, case.head_dim)


def run_case(device, case: Case, *, policy=2, rope_style="neox", kv_layout="NHD",
             redirect=(False, False), clear=True, norm_dtype=torch.float32, record=None,
             targets=None):
    """Draw inputs, poison every output, run the op, and check every byte it owns."""
    d, t = case.head_dim, case.num_tokens
    qkv = (torch.randn(t, case.num_slots * d) * 3).to(BF16)
    cos_sin = rope_table(case.max_pos, d)
    weights = [(torch.rand(d) + 0.5).to(norm_dtype) for _ in range(2)]
    caches_before = [poisoned(cache_shape(case, kv_layout), BF16) for _ in range(2)]
    q_before = poisoned((t, case.num_q_heads, d), BF16)
    outs_before = [poisoned((t, case.num_kv_heads, d), BF16) if r else None for r in redirect]
    flags = torch.full((len(case.new),), -7, dtype=torch.int32, device=device)
    # Copies, also on the CPU (where .to(device) would alias): the poison is compared after.
    caches = [c.to(device, copy=True) for c in caches_before]
    outs = [None if o is None else o.to(device, copy=True) for o in outs_before]
    out_q = append_bf16(
        qkv.to(device), cos_sin.to(device), case.seq_lens.to(device), case.q_indptr.to(device),
        case.page_indices.to(device), caches[0], caches[1], num_q_heads=case.num_q_heads,
        num_kv_heads=case.num_kv_heads, qk_norm_policy=policy,
        q_norm_weight=weights[0].to(device), k_norm_weight=weights[1].to(device),
        rope_style=rope_style, kv_layout=kv_layout, out_q=q_before.to(device, copy=True),
        out_k=outs[0], out_v=outs[1], clear_unused_last_page_rows=clear, error_flags=flags)
    targets = targets or plan_targets(case, clear=clear)
    assert flags.cpu().tolist() == targets.status
    if any(targets.writable):
        q_ref, k_ref, v = reference_qk(qkv, cos_sin, case, targets, policy=policy,
                                       q_norm_weight=weights[0], k_norm_weight=weights[1],
                                       eps=1e-6, rope_style=rope_style)
    else:  # malformed table: nothing may be written, every row is checked as untouched
        q_ref = k_ref = v = None
    check_call(case, targets, kv_layout, "bf16", q_out=out_q, q_before=q_before, q_ref=q_ref,
               k_ref=k_ref, v_want=v, caches=caches, caches_before=caches_before, outs=outs,
               outs_before=outs_before, record=record)
    return targets


@pytest.mark.parametrize("rope_style", ["neox", "interleaved"])
@pytest.mark.parametrize("policy", [0, 1, 2])
def test_decode_policies_and_styles(device, policy, rope_style, record_property):
    case = Case(**DECODE, page_size=16, num_q_heads=8, num_kv_heads=1)
    run_case(device, case, policy=policy, rope_style=rope_style, record=record_property)


@pytest.mark.parametrize("heads", [(8, 1), (64, 8), (32, 8), (4, 4)])
@pytest.mark.parametrize("page_size", [16, 64])
def test_decode_heads_and_pages(device, heads, page_size, record_property):
    if heads == (64, 8) and page_size == 64:
        pytest.skip("covered at GPU scale; the interpreter runs its 100+ programs one by one")
    case = Case(**DECODE, page_size=page_size, num_q_heads=heads[0], num_kv_heads=heads[1])
    run_case(device, case, policy=1, kv_layout="HND" if heads[1] == 4 else "NHD",
             record=record_property)


@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
def test_long_pages_clear_in_capped_shares(device, kv_layout, record_property):
    """Pages of 256 rows at Hkv = 4: 1,024 (row, head) pairs a page, cleared by
    ``APPEND_MAX_CLEAR_PROGRAMS`` programs a request in shares of several blocks."""
    case = Case(**DECODE, page_size=256, num_q_heads=8, num_kv_heads=4)
    assert case.page_size * case.num_kv_heads > (_config.APPEND_MAX_CLEAR_PROGRAMS
                                                 * _config.APPEND_BLOCK_R)
    run_case(device, case, policy=2, kv_layout=kv_layout, record=record_property)


@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
def test_short_tails_dealt_over_clear_programs(device, kv_layout, record_property):
    """Pages of 64 rows at Hkv = 6: 24 clear programs a request, chunks of 16 pairs that
    straddle rows. Tails of 3 rows (two chunks), 1 row, none (the page is full), 63 rows
    (every chunk) and 26 rows of a second page: most programs have no chunk and stop
    early, the others must still clear every row of the tail and nothing before it."""
    case = Case(new=[1, 1, 1, 1, 2], prefix=[60, 62, 63, 0, 100], page_size=64,
                num_q_heads=12, num_kv_heads=6)
    assert _config.append_clear_programs(64, 6, 5) == 24
    run_case(device, case, policy=2, kv_layout=kv_layout, record=record_property)


@pytest.mark.parametrize("heads,policy,rope_style,kv_layout", [
    ((8, 1), 2, "neox", "NHD"),
    ((64, 8), 1, "neox", "NHD"),
    ((32, 8), 0, "interleaved", "HND"),
    ((4, 4), 2, "interleaved", "HND"),
])
def test_prefill_ragged_cross_page(device, heads, policy, rope_style, kv_layout,
                                   record_property):
    case = Case(**PREFILL, page_size=16, num_q_heads=heads[0], num_kv_heads=heads[1])
    run_case(device, case, policy=policy, rope_style=rope_style, kv_layout=kv_layout,
             record=record_property)


@pytest.mark.parametrize("programs", ["token", "tile"])
@pytest.mark.parametrize("mode,heads,policy,rope_style,kv_layout,redirect", [
    ("decode", (8, 1), 0, "neox", "NHD", (False, False)),
    ("decode", (4, 2), 2, "interleaved", "HND", (True, False)),
    ("decode", (12, 3), 1, "neox", "NHD", (False, False)),
    ("prefill", (2, 2), 1, "neox", "NHD", (False, True)),
    ("prefill", (8, 1), 0, "interleaved", "HND", (False, False)),
])
def test_both_program_shapes(device, monkeypatch, programs, mode, heads, policy, rope_style,
                             kv_layout, redirect):
    """Token programs and tiles of tokens, each forced on decode and prefill batches, with
    and without QK norm (a token program's rows mix Q, K and V heads, each with its kind's
    weights; GQA 12/3 runs 16 and 2 slots a token), every head kind, both layouts and the
    caller's out_k / out_v: the same bytes."""
    force_programs(monkeypatch, programs)
    case = Case(**(DECODE if mode == "decode" else PREFILL), page_size=16,
                num_q_heads=heads[0], num_kv_heads=heads[1])
    run_case(device, case, policy=policy, rope_style=rope_style, kv_layout=kv_layout,
             redirect=redirect)


def test_decode_batches_take_token_programs(device, monkeypatch):
    """Decode batches run token programs with and without QK norm."""
    rule, seen = _config.append_token_programs, []

    def recorded_rule(num_tokens, num_requests):
        seen.append(rule(num_tokens, num_requests))
        return seen[-1]

    monkeypatch.setattr(_config, "append_token_programs", recorded_rule)
    case = Case(**DECODE, page_size=16, num_q_heads=8, num_kv_heads=1)
    for policy in (2, 0):
        run_case(device, case, policy=policy)
    assert seen == [True, True]


def test_token_programs_scan_on_a_miss(device):
    """A decode-sized batch (no more tokens than requests) with an empty request and a
    two-token one: tokens 1-3 are not at their own request's index, so their token
    programs scan the table.  GQA 12/3 has 18 head slots: runs of 16 and 2 a token."""
    case = Case(new=[1, 0, 2, 1, 0], prefix=[6, 3, 9, 0, 2], page_size=4, num_q_heads=12,
                num_kv_heads=3)
    assert case.num_tokens <= len(case.new)
    run_case(device, case, policy=0)


@pytest.mark.parametrize("rope_style", ["neox", "interleaved"])
def test_direct_lookup_and_scan_in_one_batch(device, rope_style):
    """32 one-token requests, then two of two tokens and an empty one: the tiles of the
    first 32 tokens find each token's request at its own index, the last tile misses
    that guess and scans the table (tiles of 8 tokens at D = 128, or up to 32)."""
    case = Case(new=[1] * 32 + [2, 0, 2], prefix=[3 * i % 11 for i in range(32)] + [5, 4, 9],
                page_size=4, num_q_heads=2, num_kv_heads=1)
    run_case(device, case, rope_style=rope_style)


@pytest.mark.parametrize("head_dim,page_size,norm_dtype", [
    (64, 1, torch.bfloat16), (256, 5, torch.float32), (128, 3, torch.bfloat16)])
def test_head_dims_and_odd_pages(device, head_dim, page_size, norm_dtype, record_property):
    case = Case(new=[3, 4], prefix=[4, 0], page_size=page_size, num_q_heads=2, num_kv_heads=1,
                head_dim=head_dim)
    run_case(device, case, policy=2, norm_dtype=norm_dtype, record=record_property)


@pytest.mark.parametrize("redirect", [(True, True), (False, True)])
def test_caller_owned_out_k_out_v(device, redirect, record_property):
    """K/V go to the caller's rows; the caches only get their tails cleared."""
    case = Case(**PREFILL, page_size=16, num_q_heads=4, num_kv_heads=2)
    run_case(device, case, redirect=redirect, record=record_property)


@pytest.mark.parametrize("redirect", [(False, False), (True, True)])
def test_requests_appending_nothing_clear_their_tail(device, redirect):
    """FlashInfer's rule: every request of length >= 1 zeroes the unused rows of its last
    page, also one that appends no token in this call; a request of length 0, or one ending
    on a page edge, clears nothing."""
    case = Case(new=[0, 3, 0, 0, 2, 0], prefix=[5, 4, 0, 8, 6, 2], page_size=4,
                num_q_heads=2, num_kv_heads=1)
    table = case.page_indices.tolist()
    want = {(table[0][1], 1), (table[1][1], 3), (table[4][1], 0), (table[5][0], 2)}
    want = {(page, start) for page, start in want if start}  # request 4 ends on an edge
    targets = run_case(device, case, redirect=redirect)
    assert set(targets.tails) == want, targets.tails


@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
def test_no_clear_leaves_tail(device, kv_layout):
    case = Case(**PREFILL, page_size=16, num_q_heads=4, num_kv_heads=2)
    targets = run_case(device, case, kv_layout=kv_layout, clear=False)
    assert targets.tails == []


def test_out_of_range_page_writes_nothing(device):
    """A bad page index: its rows are skipped and reported; other pages and requests land."""
    case = Case(new=[6, 2], prefix=[14, 3], page_size=4, num_q_heads=4, num_kv_heads=2)
    case.page_indices[0, 4] = case.num_pages  # rows of positions 16..19 of request 0
    case.page_indices[1, 1] = -3  # request 1's last page: no rows, no tail clear
    targets = run_case(device, case)
    assert targets.status == [ERR_PAGE, ERR_PAGE]
    assert not all(targets.page_ok) and any(targets.page_ok)


@pytest.mark.parametrize("bad_slot", [100, 229])
def test_bad_page_in_a_long_table_is_found(device, bad_slot):
    """Pages of one row: request 0 writes slots 100..229 of a 300-slot table, checked in
    chunks of APPEND_CHUNK_P from its first written slot; a bad page at either end is found.
    Request 1 writes two slots; the junk past them (unused slots hold out-of-range indices)
    is never read."""
    case = Case(new=[130, 2], prefix=[100, 290], page_size=1, num_q_heads=2, num_kv_heads=1)
    assert 130 > 2 * _config.APPEND_CHUNK_P
    case.page_indices[0, bad_slot] = -1
    targets = run_case(device, case, policy=0)
    assert targets.status == [ERR_PAGE, 0]
    assert not all(targets.page_ok) and any(targets.page_ok)


@pytest.mark.parametrize("programs", ["tile", "token"])
@pytest.mark.parametrize("breakage", ["first", "decreasing", "last", "overlapping"])
def test_malformed_q_indptr_writes_nothing(device, monkeypatch, programs, breakage):
    """A malformed table writes nothing and flags every request, in both program shapes.
    "overlapping": two requests' ranges both hold tokens 2 and 3, so a scan for their request
    sums to B (clamped into the table before its loads)."""
    force_programs(monkeypatch, programs)
    if breakage == "overlapping":
        case = Case(new=[1, 1, 1, 1], prefix=[5, 0, 9, 2], page_size=4, num_q_heads=2,
                    num_kv_heads=1)
        case.q_indptr[:] = torch.tensor([0, 1, 4, 2, 4], dtype=torch.int32)
    else:
        case = Case(new=[2, 3, 1], prefix=[5, 0, 9], page_size=4, num_q_heads=2,
                    num_kv_heads=1)
    if breakage == "first":
        case.q_indptr[0] = 1
    elif breakage == "decreasing":
        case.q_indptr[1], case.q_indptr[2] = 4, 3
    elif breakage == "last":
        case.q_indptr[-1] = case.num_tokens - 1
    targets = run_case(device, case, policy=0)
    assert targets.status == [ERR_METADATA] * len(case.new) and not any(targets.writable)


def test_bad_positions_skip_the_request(device):
    """seq_lens below the new-token count, or past cos_sin: that request writes nothing."""
    case = Case(new=[3, 2, 2], prefix=[4, 0, 6], page_size=4, num_q_heads=2, num_kv_heads=1)
    case.seq_lens[1] = 1
    case.seq_lens[2] = case.max_pos + 1
    targets = run_case(device, case)
    assert targets.status == [0, ERR_POSITION, ERR_POSITION]


# ----------------------------------------------------------------------------- validation

def _args(device, **over):
    case = Case(new=[2], prefix=[3], page_size=4, num_q_heads=2, num_kv_heads=1, head_dim=64)
    kw = dict(qkv=torch.randn(2, 4 * 64).to(BF16), cos_sin=rope_table(case.max_pos, 64),
              seq_lens=case.seq_lens, q_indptr=case.q_indptr, page_indices=case.page_indices,
              key_cache=poisoned(cache_shape(case, "NHD"), BF16),
              value_cache=poisoned(cache_shape(case, "NHD"), BF16), num_q_heads=2,
              num_kv_heads=1)
    kw = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
    kw.update(over)
    return kw


@pytest.mark.parametrize("over,exc,match", [
    (dict(qkv="x"), TypeError, "qkv must be a torch.Tensor"),
    (dict(num_q_heads=0), ValueError, "num_q_heads must be a positive multiple"),
    (dict(num_q_heads=4), ValueError, r"qkv must be \[T, \(Hq \+ 2 Hkv\) \* D\]"),
    (dict(num_kv_heads=2), ValueError, "num_kv_heads"),
    (dict(qk_norm_policy=3), ValueError, "qk_norm_policy"),
    (dict(qk_norm_policy=1), ValueError, "needs q_norm_weight"),
    (dict(rope_style="gptj"), ValueError, "rope_style"),
    (dict(kv_layout="NDH"), ValueError, "kv_layout"),
    (dict(seq_lens=torch.tensor([5], dtype=torch.int64)), TypeError, r"seq_lens.*int32"),
    (dict(q_indptr=torch.tensor([0, 2, 2], dtype=torch.int32)), ValueError,
     r"q_indptr.*\[B \+ 1\]"),
    (dict(out_q=torch.empty(2, 2, 32, dtype=BF16)), ValueError,
     r"out_q must have shape \(2, 2, 64\)"),
    (dict(error_flags=torch.empty(2, dtype=torch.int32)), ValueError, "error_flags"),
])
def test_argument_validation(over, exc, match):
    """Errors name the argument and quote what it got; CPU tensors suffice (no launch)."""
    with pytest.raises(exc, match=match):
        append_bf16(**_args(torch.device("cpu"), **over))


def test_validation_quotes_shape_dtype_device():
    bad = torch.empty(2, 4 * 64, dtype=torch.float16)
    with pytest.raises(TypeError, match=r"shape \(2, 256\), dtype torch.float16, device cpu"):
        append_bf16(**_args(torch.device("cpu"), qkv=bad))


def test_mismatched_caches_rejected():
    kw = _args(torch.device("cpu"))
    kw["value_cache"] = kw["value_cache"][:, :2]
    with pytest.raises(ValueError, match="same shape and strides"):
        append_bf16(**kw)


# ----------------------------------------------------------------------------- GPU scale

@pytest.mark.gpu
@pytest.mark.parametrize("heads", [(8, 1), (64, 8), (32, 8), (4, 4)])
@pytest.mark.parametrize("mode", ["decode", "prefill"])
@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("policy", [0, 1, 2])
@pytest.mark.parametrize("rope_style", ["neox", "interleaved"])
def test_gpu_real_shapes(device, heads, mode, page_size, policy, rope_style, record_property):
    b = 32 if mode == "decode" else 4
    new = [1] * b if mode == "decode" else [300, 0, 129, 1]
    prefix = [(97 * i) % 700 for i in range(b)]
    case = Case(new=new, prefix=prefix, page_size=page_size, num_q_heads=heads[0],
                num_kv_heads=heads[1])
    run_case(device, case, policy=policy, rope_style=rope_style,
             kv_layout="HND" if page_size == 64 else "NHD", record=record_property)


@pytest.mark.gpu
@pytest.mark.parametrize("programs", ["token", "tile"])
@pytest.mark.parametrize("heads", [(8, 1), (64, 8), (32, 8), (4, 4)])
@pytest.mark.parametrize("mode", ["decode", "prefill"])
@pytest.mark.parametrize("policy", [0, 2])
def test_gpu_both_program_shapes(device, monkeypatch, programs, heads, mode, policy,
                                 record_property):
    """The real shapes of ``test_gpu_real_shapes`` (page 64) with each program shape forced
    on both kinds of batch: token programs on prefill too, tiles of tokens on decode too."""
    force_programs(monkeypatch, programs)
    b = 32 if mode == "decode" else 4
    new = [1] * b if mode == "decode" else [300, 0, 129, 1]
    case = Case(new=new, prefix=[(97 * i) % 700 for i in range(b)], page_size=64,
                num_q_heads=heads[0], num_kv_heads=heads[1])
    run_case(device, case, policy=policy, kv_layout="HND", record=record_property)


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [(8, 1), (64, 8)])
def test_gpu_cuda_graph_replays_match_eager(device, heads):
    """Capture once; three replays on fresh copies are bitwise equal to an eager call."""
    case = Case(new=[1] * 32, prefix=list(range(5, 37)), page_size=16, num_q_heads=heads[0],
                num_kv_heads=heads[1])
    d = case.head_dim
    qkv = (torch.randn(case.num_tokens, case.num_slots * d, device=device) * 3).to(BF16)
    cos_sin = rope_table(case.max_pos, d).to(device)
    meta = [x.to(device) for x in (case.seq_lens, case.q_indptr, case.page_indices)]
    w = [(torch.rand(d, device=device) + 0.5) for _ in range(2)]
    start = [poisoned(cache_shape(case, "NHD"), BF16).to(device) for _ in range(2)]
    flags = torch.empty(len(case.new), dtype=torch.int32, device=device)
    kw = dict(num_q_heads=heads[0], num_kv_heads=heads[1], qk_norm_policy=2, q_norm_weight=w[0],
              k_norm_weight=w[1], error_flags=flags)

    eager = [c.clone() for c in start]
    q_eager = append_bf16(qkv, cos_sin, *meta, *eager, **kw)
    caches = [c.clone() for c in start]
    out_q = torch.empty_like(q_eager)
    append_bf16(qkv, cos_sin, *meta, *caches, out_q=out_q, **kw)  # warm-up: compile
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        append_bf16(qkv, cos_sin, *meta, *caches, out_q=out_q, **kw)
    for _ in range(3):
        for c, s in zip(caches, start, strict=True):
            c.copy_(s)
        out_q.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out_q.view(torch.int16), q_eager.view(torch.int16))
        for c, e in zip(caches, eager, strict=True):
            assert torch.equal(c.view(torch.int16), e.view(torch.int16))
