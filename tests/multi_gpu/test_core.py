"""``UlyssesAttentionCore`` on 2, 4 and 8 spawned ranks: the output and ``dq, dk, dv`` against
float64 attention over the whole sequence (and joint tokens every rank holds), calls without
grad, two cores and activation checkpointing under one backward, slot leases, and bad input
raising on every rank.

On CPUs the ranks use gloo and the NCCL path; ``CAKE_SP_TEST_DEVICE`` (see ``_ranks.py``)
runs the same cases on GPUs, ``CAKE_SP_TEST_WORLDS`` picks W and ``CAKE_SP_TEST_BACKEND`` the
backend the cores must have chosen.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from _checks import assert_no_rank_failed, expect_error, worst_errors_within
from _layer_inputs import FORWARD_RTOL, GRAD_RTOL, relative_error
from _ranks import run_cases
from torch.utils.checkpoint import checkpoint

from cake_sp import SlotInUseError, UlyssesAttentionCore, reference

pytestmark = pytest.mark.multi_gpu

WORLDS = [int(w) for w in os.environ.get("CAKE_SP_TEST_WORLDS", "2,4,8").split(",")]
EXPECTED_BACKEND = os.environ.get("CAKE_SP_TEST_BACKEND", "nccl")
HEAD_DIM = 64
MAX_TOKENS = 64


def _problem(seed: int, world: int, *, hq: int, hkv: int, batch: int, seq_local: int,
             dtype=torch.bfloat16) -> dict:
    """Every rank's ``q, k, v`` and ``dy`` (bf16 values, ``dtype``), the same on every rank."""
    g = torch.Generator().manual_seed(seed)

    def rand(heads):
        return [torch.randn(batch, seq_local, heads, HEAD_DIM, generator=g).bfloat16().to(dtype)
                for _ in range(world)]

    return {"q": rand(hq), "k": rand(hkv), "v": rand(hkv), "dy": rand(hq)}


def _reference(problem: dict, *, causal: bool, key_mask=None, window=None,
               softcap=None) -> tuple[list, dict]:
    """Per rank: float64 ``o`` of the whole sequence's attention, and ``dq, dk, dv`` after the
    backward of every rank's ``dy``."""
    full = {n: torch.cat(problem[n], dim=1).double().requires_grad_(True) for n in "qkv"}
    o = reference.attention(full["q"], full["k"], full["v"], causal=causal, key_mask=key_mask,
                            window=window, softcap=softcap)
    o.backward(torch.cat(problem["dy"], dim=1).double())
    seq_local = problem["q"][0].shape[1]
    return (list(o.detach().split(seq_local, dim=1)),
            {n: list(full[n].grad.split(seq_local, dim=1)) for n in "qkv"})


def _inputs(ctx, problem: dict) -> list:
    return [problem[n][ctx.rank].to(ctx.device).requires_grad_(True) for n in "qkv"]


def _check_core(ctx, *, hq: int, hkv: int, causal: bool, seed: int, batch: int = 2,
                seq_local: int = 13, key_mask=None, dtype=torch.bfloat16,
                compiled: bool = False, window: int | None = None,
                softcap: float | None = None) -> dict:
    """The core's output and ``dq, dk, dv`` against float64 attention over the whole sequence
    (``compiled``: under ``torch.compile(fullgraph=True)``, aot_eager), then its output
    without grad through the same call."""
    problem = _problem(seed, ctx.world_size, hq=hq, hkv=hkv, batch=batch, seq_local=seq_local,
                       dtype=dtype)
    want_o, want_grads = _reference(problem, causal=causal, key_mask=key_mask, window=window,
                                    softcap=softcap)
    r = ctx.rank
    mask = None if key_mask is None else key_mask.to(ctx.device)
    with UlyssesAttentionCore(hq, hkv, HEAD_DIM, causal=causal, max_tokens=MAX_TOKENS,
                              sliding_window=window, softcap=softcap,
                              device=ctx.device) as module:
        core = torch.compile(module, backend="aot_eager", fullgraph=True) if compiled \
            else module
        q, k, v = _inputs(ctx, problem)
        o = core(q, k, v, key_mask=mask)
        o.backward(problem["dy"][r].to(ctx.device))
        errors = {"o": relative_error(o, want_o[r])}
        errors.update({f"d{n}": relative_error(t.grad, want_grads[n][r])
                       for n, t in zip("qkv", (q, k, v))})
        grad_dtypes = {str(t.grad.dtype) for t in (q, k, v)}
        # Without grad: the same o, as a tensor of its own (a second call leaves it alone).
        with torch.no_grad():
            o_eval = core(q, k, v, key_mask=mask)
            kept = o_eval.clone()
            core(*(torch.randn_like(t) for t in (q, k, v)), key_mask=mask)
        module.synchronize()
        return {"errors": errors, "grad_dtypes": sorted(grad_dtypes),
                "no_grad_equal": bool(torch.equal(o_eval, o.detach())),
                "no_grad_kept": bool(torch.equal(o_eval, kept)),
                "no_grad_graph": o_eval.grad_fn is not None, "backend": module.backend}


def case_gqa_causal(ctx):
    w = ctx.world_size
    return _check_core(ctx, hq=2 * w, hkv=w, causal=True, seed=1)


def case_gqa_sliding_window_key_mask(ctx):
    """A sliding window of 6 keys (windows across every rank boundary) with a key mask."""
    w = ctx.world_size
    g = torch.Generator().manual_seed(9)
    key_mask = torch.rand(2, 13 * w, generator=g) < 0.8
    key_mask[:, 0] = True
    return _check_core(ctx, hq=2 * w, hkv=w, causal=True, seed=4, key_mask=key_mask, window=6)


def case_softcap_sliding_window_key_mask(ctx):
    """Gemma 2's attention: logits soft-capped at 1 (most of them reach it), a sliding window
    of 6 keys across every rank boundary, a key mask."""
    w = ctx.world_size
    g = torch.Generator().manual_seed(12)
    key_mask = torch.rand(2, 13 * w, generator=g) < 0.8
    key_mask[:, 0] = True
    return _check_core(ctx, hq=2 * w, hkv=w, causal=True, seed=5, key_mask=key_mask, window=6,
                       softcap=1.0)


def case_replicated_kv_bidirectional_key_mask_fp32(ctx):
    """Hkv < W (each K/V head goes to several ranks; its gradient is their sum), a key mask,
    fp32 inputs (cast to bf16; fp32 gradients)."""
    w = ctx.world_size
    g = torch.Generator().manual_seed(7)
    key_mask = torch.rand(2, 11 * w, generator=g) < 0.7
    key_mask[:, 0] = True  # every query keeps a key
    return _check_core(ctx, hq=2 * w, hkv=max(1, w // 2), causal=False, seed=2, seq_local=11,
                       key_mask=key_mask, dtype=torch.float32)


def case_gqa_causal_key_mask_compiled(ctx):
    """Under ``torch.compile(fullgraph=True)``: the exchanges as custom operators, no graph
    break; a key mask (the masked path: no host read while compiling)."""
    w = ctx.world_size
    g = torch.Generator().manual_seed(8)
    key_mask = torch.rand(2, 12 * w, generator=g) < 0.7
    key_mask[:, 0] = True
    return _check_core(ctx, hq=2 * w, hkv=w, causal=True, seed=3, seq_local=12,
                       key_mask=key_mask, compiled=True)


def case_two_cores_checkpoint_and_leases(ctx):
    """Two cores of one shape awaiting one backward (one of them under activation
    checkpointing, with a d_o slot of its own) get their own correct gradients; a second
    forward of a one-slot core before its backward raises on every rank before sending
    anything."""
    w, r, dev = ctx.world_size, ctx.rank, ctx.device
    problems = [_problem(10 + i, w, hq=w, hkv=w, batch=1, seq_local=9) for i in range(2)]
    wants = [_reference(p, causal=True) for p in problems]
    report = {"errors": {}}
    with UlyssesAttentionCore(w, w, HEAD_DIM, causal=True, max_tokens=MAX_TOKENS,
                              device=dev) as first, \
            UlyssesAttentionCore(w, w, HEAD_DIM, causal=True, max_tokens=MAX_TOKENS,
                                 share_backward_exchange=False, device=dev) as second:
        report["own_d_o_slot"] = second.output_exchanges(True)[1] is not \
            first.output_exchanges(True)[1]
        ins = [_inputs(ctx, p) for p in problems]
        o1 = first(*ins[0])
        o2 = checkpoint(second, *ins[1], use_reentrant=False)
        report["second_forward"] = expect_error(lambda: first(*ins[0]), SlotInUseError,
                                                "num_slots=1")
        torch.autograd.backward([o1, o2], [p["dy"][r].to(dev) for p in problems])
        for i, (o, inputs, (want_o, want_grads)) in enumerate(zip((o1, o2), ins, wants)):
            report["errors"][f"o{i}"] = relative_error(o, want_o[r])
            for n, t in zip("qkv", inputs):
                report["errors"][f"d{n}{i}"] = relative_error(t.grad, want_grads[n][r])
        o1 = first(*ins[0])  # the backward released the slot
        report["errors"]["o0_again"] = relative_error(o1, wants[0][0][r])
    return report


def case_joint_tokens_key_mask(ctx):
    """Joint tokens (a text every rank passes whole): the sequence's and their output on every
    rank, and the sum over the group of their ``dq, dk, dv`` against float64 attention over
    the sequence and them once, each rank's ``dy`` of their rows its own (so the reference's
    is their sum); a key mask over both; Hkv < W from W = 4 (K/V heads replicated); then
    their output without grad."""
    w, r, dev = ctx.world_size, ctx.rank, ctx.device
    hq, hkv, text = 2 * w, max(1, w // 2), 7
    problem = _problem(21, w, hq=hq, hkv=hkv, batch=2, seq_local=5)
    g = torch.Generator().manual_seed(22)
    joint = {n: torch.randn(2, text, heads, HEAD_DIM, generator=g).bfloat16()
             for n, heads in (("q", hq), ("k", hkv), ("v", hkv))}
    joint_dy = [torch.randn(2, text, hq, HEAD_DIM, generator=g).bfloat16() for _ in range(w)]
    key_mask = torch.rand(2, 5 * w + text, generator=g) < 0.7
    key_mask[:, 0] = True
    full = {n: torch.cat((*problem[n], joint[n]), dim=1).double().requires_grad_(True)
            for n in "qkv"}
    want = reference.attention(full["q"], full["k"], full["v"], causal=False,
                               key_mask=key_mask)
    want.backward(torch.cat((*problem["dy"], sum(d.double() for d in joint_dy)), dim=1))
    with UlyssesAttentionCore(hq, hkv, HEAD_DIM, causal=False, max_tokens=MAX_TOKENS,
                              device=dev) as core:
        q, k, v = _inputs(ctx, problem)
        jq, jk, jv = (joint[n].to(dev).requires_grad_(True) for n in "qkv")
        o = core(q, k, v, joint=(jq, jk, jv), key_mask=key_mask.to(dev))
        o.backward(torch.cat((problem["dy"][r], joint_dy[r]), dim=1).to(dev))
        errors = {"o": relative_error(o[:, :5], want[:, 5 * r:5 * (r + 1)].detach()),
                  "o_joint": relative_error(o[:, 5:], want[:, 5 * w:].detach())}
        errors.update({f"d{n}": relative_error(t.grad, full[n].grad[:, 5 * r:5 * (r + 1)])
                       for n, t in zip("qkv", (q, k, v))})
        for n, t in zip("qkv", (jq, jk, jv)):
            total = t.grad.float()
            dist.all_reduce(total)  # each rank's band of heads
            errors[f"d{n}_joint"] = relative_error(total, full[n].grad[:, 5 * w:])
        with torch.no_grad():
            o_eval = core(q, k, v, joint=(jq, jk, jv), key_mask=key_mask.to(dev))
            kept = o_eval.clone()
            core(*(torch.randn_like(t) for t in (q, k, v)),
                 joint=tuple(torch.randn_like(t) for t in (jq, jk, jv)))
        core.synchronize()
        return {"errors": errors, "no_grad_equal": bool(torch.equal(o_eval, o.detach())),
                "no_grad_kept": bool(torch.equal(o_eval, kept)),
                "no_grad_graph": o_eval.grad_fn is not None}


def case_bad_arguments_raise_everywhere(ctx):
    w, dev = ctx.world_size, ctx.device
    out = {}

    def build(**kw):
        args = dict(num_q_heads=w, num_kv_heads=w, head_dim=HEAD_DIM, causal=False,
                    max_tokens=MAX_TOKENS, device=dev) | kw
        return UlyssesAttentionCore(**args)

    out["head_dim"] = expect_error(lambda: build(head_dim=96), ValueError, "head_dim")
    out["heads"] = expect_error(lambda: build(num_q_heads=w + 1, num_kv_heads=1), ValueError,
                                "num_q_heads")
    out["causal_differs"] = expect_error(lambda: build(causal=ctx.rank == 0), ValueError,
                                         "different options")
    out["backend"] = expect_error(lambda: build(backend="mpi"), ValueError, "backend")
    out["sliding_window"] = expect_error(lambda: build(sliding_window=4), ValueError,
                                         "sliding_window=4 needs causal=True")
    out["sliding_window_0"] = expect_error(lambda: build(causal=True, sliding_window=0),
                                           ValueError, "sliding_window must be >= 1")
    q = torch.randn(1, 8, w, HEAD_DIM, device=dev, dtype=torch.bfloat16)
    text = q[:, :3]
    with build(causal=True) as core:
        out["joint_causal"] = expect_error(lambda: core(q, q, q, joint=(text, text, text)),
                                           ValueError, "causal=False")
    with build() as core:
        out["k_shape"] = expect_error(lambda: core(q, q[:, :7], q), ValueError, "k must have")
        out["fp16"] = expect_error(lambda: core(q.half(), q, q), TypeError, "q must have dtype")
        long = torch.randn(1, MAX_TOKENS + 1, w, HEAD_DIM, device=dev, dtype=torch.bfloat16)
        out["rows"] = expect_error(lambda: core(long, long, long), ValueError, "max_tokens")
        bad_mask = torch.ones(1, 8, dtype=torch.bool, device=dev)
        out["key_mask"] = expect_error(lambda: core(q, q, q, key_mask=bad_mask), ValueError,
                                       "key_mask must have shape")
        out["joint_k"] = expect_error(lambda: core(q, q, q, joint=(text, text[:, :2], text)),
                                      ValueError, "joint k must have")
        out["joint_rows"] = expect_error(lambda: core(q, q, q, joint=(long, long, long)),
                                         ValueError, "max_tokens")
        mask = torch.ones(1, 8 * w, dtype=torch.bool, device=dev)  # the sequence's keys only
        out["joint_key_mask"] = expect_error(
            lambda: core(q, q, q, key_mask=mask, joint=(text, text, text)), ValueError,
            "key_mask must have shape")
        # Nothing was sent: a good call still runs on every rank.
        out["after"] = {"shape": list(core(q, q, q, joint=(text, text, text)).shape)}
    return out


CASES = [case_gqa_causal, case_gqa_sliding_window_key_mask,
         case_softcap_sliding_window_key_mask, case_replicated_kv_bidirectional_key_mask_fp32,
         case_gqa_causal_key_mask_compiled, case_two_cores_checkpoint_and_leases,
         case_joint_tokens_key_mask, case_bad_arguments_raise_everywhere]


def _check_errors(world, name, per_rank) -> str:
    summary = worst_errors_within(world, name, per_rank, forward="o",
                                  forward_rtol=FORWARD_RTOL, grad_rtol=GRAD_RTOL)
    for report in per_rank:
        assert report.get("backend", EXPECTED_BACKEND) == EXPECTED_BACKEND, report["backend"]
        if "no_grad_equal" in report:
            assert report["no_grad_equal"] and report["no_grad_kept"], report
            assert not report["no_grad_graph"], report
        assert report.get("own_d_o_slot", True), "share_backward_exchange=False shared d_o"
    return summary


def _check_fp32(world, name, per_rank) -> str:
    assert_no_rank_failed(world, per_rank, name)
    for report in per_rank:
        assert report["grad_dtypes"] == ["torch.float32"], report["grad_dtypes"]
    return _check_errors(world, name, per_rank)


def _check_bad_arguments(world, name, per_rank) -> str:
    assert_no_rank_failed(world, per_rank, name)
    for bad in per_rank[0]:
        if bad != "after":
            assert len({r[bad]["message"] for r in per_rank}) == 1, bad
    return "every rank raised the same errors; a good call ran after them"


CHECKS = {case_gqa_causal.__name__: _check_errors,
          case_gqa_sliding_window_key_mask.__name__: _check_errors,
          case_softcap_sliding_window_key_mask.__name__: _check_errors,
          case_gqa_causal_key_mask_compiled.__name__: _check_errors,
          case_replicated_kv_bidirectional_key_mask_fp32.__name__: _check_fp32,
          case_two_cores_checkpoint_and_leases.__name__: _check_errors,
          case_joint_tokens_key_mask.__name__: _check_errors,
          case_bad_arguments_raise_everywhere.__name__: _check_bad_arguments}
assert set(CHECKS) == {case.__name__ for case in CASES}, "every case needs its check"


def core_verdict(world: int, name: str, per_rank: list[dict]) -> str:
    try:
        return "passed: " + CHECKS[name](world, name, per_rank)
    except Exception as exc:  # a verdict never stops the run; the tests report in full
        return f"FAILED: {type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}"


@pytest.fixture(scope="module", params=WORLDS, ids=lambda w: f"W{w}")
def reports(request):
    return request.param, run_cases(request.param, CASES, core_verdict)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__[5:])
def test_core(reports, case):
    world, by_case = reports
    name = case.__name__
    print(f"W={world} {name}: {CHECKS[name](world, name, by_case[name])}")
