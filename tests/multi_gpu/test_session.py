"""The session on 2, 4 and 8 spawned ranks: results against the reference, bad input, lifecycle.

Every rank checks its own output against the reference computed from every
rank's input.  On CPUs the ranks use gloo and the NCCL path; with
``CAKE_SP_TEST_DEVICE`` set (see ``_ranks.py``) the same cases run on GPUs.
``CAKE_SP_TEST_WORLDS``, ``CAKE_SP_TEST_CALLS`` and ``CAKE_SP_TEST_CASES`` pick the
world sizes, the back-to-back call count and a subset of the cases.
"""

from __future__ import annotations

import os
import zlib

import pytest
import torch
from _checks import assert_no_rank_failed, expect_error
from _inputs import compare, make_problem
from _ranks import TEST_DEVICE, run_cases

from cake_sp import QkvNormRopeExchangeOverlap, UlyssesBackendError

pytestmark = pytest.mark.multi_gpu

WORLDS = [int(w) for w in os.environ.get("CAKE_SP_TEST_WORLDS", "2,4,8").split(",")]
# What the result cases ask for, and which backend they must then report.
REQUESTED_BACKEND = os.environ.get("CAKE_SP_TEST_REQUEST", "auto")
EXPECTED_BACKEND = os.environ.get("CAKE_SP_TEST_BACKEND", "nccl")
HIDDEN = 64 if TEST_DEVICE == "cpu" else 1024
# Several processes time-slicing one GPU make each call slow; lanes may lower this there.
BACK_TO_BACK_CALLS = int(os.environ.get("CAKE_SP_TEST_CALLS", "1000"))
# Comma-separated case names (without "case_") to run only those; a lane whose time limit
# cannot hold every case at a large W uses it to finish the ones that were cut.
ONLY_CASES = {f"case_{c}" for c in os.environ.get("CAKE_SP_TEST_CASES", "").split(",") if c}


def _heads(world: int, kind: str) -> tuple[int, int]:
    """(Hq, Hkv) for a head configuration at this world size."""
    return {"mha": (world, world),
            "gqa_split": (2 * world, world),               # Hkv % W == 0
            "gqa_replicate": (world, max(1, world // 4)),  # W % Hkv == 0, Hkv < W
            }[kind]


def _check_call(ctx, *, kind, layout="bshd", rope_style="interleaved", batch=1, seq_local=37,
                bias=True, norms=True, positions=False, use_out=False, calls=2, seed=0,
                head_dim=128, engine="auto"):
    hq, hkv = _heads(ctx.world_size, kind)
    report = {"compare": []}
    with QkvNormRopeExchangeOverlap(num_q_heads=hq, num_kv_heads=hkv, head_dim=head_dim,
                                    hidden=HIDDEN, max_tokens=256, layout=layout,
                                    rope_style=rope_style, device=ctx.device,
                                    backend=REQUESTED_BACKEND, engine=engine) as session:
        report["backend"], report["reason"] = session.backend, session.backend_reason
        for call in range(calls):
            # Fresh inputs every call, and a different row count on the second call.
            rows = seq_local if call % 2 == 0 else max(1, seq_local // 3)
            seed_call = zlib.crc32(repr((seed, kind, layout, call)).encode())
            problem = make_problem(seed_call, ctx.world_size,
                                   num_q_heads=hq, num_kv_heads=hkv, hidden=HIDDEN, batch=batch,
                                   seq_local=rows, bias=bias, norms=norms, positions=positions,
                                   head_dim=head_dim)
            want = problem.expected(hq, hkv, rope_style, layout)[ctx.rank]
            args = problem.rank_args(ctx.rank, ctx.device)
            out = None
            if use_out:
                shapes = [w.shape for w in ([want] if layout == "fused" else want)]
                out = [torch.full(s, float("nan"), dtype=torch.bfloat16, device=ctx.device)
                       for s in shapes]
                out = out[0] if layout == "fused" else tuple(out)
            got = session(*args, out=out)
            if use_out:
                assert got is out or all(g is o for g, o in zip(got, out))
            if layout == "fused":
                checks = [("qkv", got, want, rope_style)]
            else:
                checks = zip("qkv", got, want, (rope_style, rope_style, None))
            for name, g, w, style in checks:
                report["compare"].append(compare(g, w, f"call {call} {name}", style, head_dim))
    return report


def _compare_qkv(got, want, what, rope_style="interleaved"):
    """Compare a bshd (q, k, v) triple: q and k were rotated, v was not."""
    return [compare(g, w, f"{what} {n}", style)
            for n, g, w, style in zip("qkv", got, want, (rope_style, rope_style, None))]


def case_mha_bshd_interleaved(ctx):
    return _check_call(ctx, kind="mha")


def case_mha_fused_neox_positions_no_norm_no_bias(ctx):
    return _check_call(ctx, kind="mha", layout="fused", rope_style="neox", seq_local=200,
                       bias=False, norms=False, positions=True)


def case_head_dims_64_and_256(ctx):
    """The head sizes besides 128: GQA split with D = 64 (neox, positions), MHA fused with
    D = 256 (tail rows: 37 is no multiple of a 64-row tile)."""
    small = _check_call(ctx, kind="gqa_split", rope_style="neox", positions=True, head_dim=64)
    large = _check_call(ctx, kind="mha", layout="fused", head_dim=256)
    return {**small, "compare": small["compare"] + large["compare"]}


def case_gqa_split_neox_out(ctx):
    return _check_call(ctx, kind="gqa_split", rope_style="neox", batch=2, use_out=True)


def case_gqa_replicate_interleaved_positions(ctx):
    return _check_call(ctx, kind="gqa_replicate", batch=2, seq_local=37, positions=True)


def case_each_engine_named(ctx):
    """Both producer engines by name (``"auto"`` takes one of them per shape): the cuBLAS
    engine with GQA replication, positions and B = 2; the fused one with GQA split."""
    cublas = _check_call(ctx, kind="gqa_replicate", batch=2, seq_local=37, positions=True,
                         rope_style="neox", engine="cublas", seed=5)
    fused = _check_call(ctx, kind="gqa_split", seq_local=29, engine="fused", seed=6)
    return {**cublas, "compare": cublas["compare"] + fused["compare"]}


def case_slot_ring_keeps_earlier_outputs(ctx):
    """With two slots, call i's views survive call i+1 and are reused by call i+2."""
    hq, hkv = _heads(ctx.world_size, "mha")
    problems = [make_problem(100 + i, ctx.world_size, num_q_heads=hq, num_kv_heads=hkv,
                             hidden=HIDDEN, batch=1, seq_local=5) for i in range(3)]
    with QkvNormRopeExchangeOverlap(num_q_heads=hq, num_kv_heads=hkv, head_dim=128,
                                    hidden=HIDDEN, max_tokens=8, num_slots=2,
                                    device=ctx.device) as session:
        first = session(*problems[0].rank_args(ctx.rank, ctx.device))
        session(*problems[1].rank_args(ctx.rank, ctx.device))
        want0 = problems[0].expected(hq, hkv, "interleaved", "bshd")[ctx.rank]
        kept = _compare_qkv(first, want0, "call 0 after call 1")
        third = session(*problems[2].rank_args(ctx.rank, ctx.device))
        same_storage = first[0].data_ptr() == third[0].data_ptr()
    return {"compare": kept, "reused_after_two_calls": same_storage}




def case_bad_configuration_raises_everywhere(ctx):
    w = ctx.world_size
    base = dict(num_q_heads=w, num_kv_heads=w, head_dim=128, hidden=HIDDEN, max_tokens=64,
                device=ctx.device)
    checks = {
        "hq_not_divisible": ({**base, "num_q_heads": w + 1, "num_kv_heads": 1}, ValueError,
                             "divisible by the world size"),
        "gqa_neither": ({**base, "num_q_heads": 3 * w, "num_kv_heads": 3}, ValueError,
                        "split or replicate"),
        "layout": ({**base, "layout": "sbhd"}, ValueError, "layout must be one of"),
        "rope_style": ({**base, "rope_style": "gptj"}, ValueError, "rope_style must be one of"),
        "backend": ({**base, "backend": "mpi"}, ValueError, "backend must be one of"),
        "engine": ({**base, "engine": "cutlass"}, ValueError, "engine must be one of"),
        "save_projection": ({**base, "save_projection": 1}, TypeError,
                            "save_projection must be a bool"),
        "fused_gqa": ({**base, "num_q_heads": 2 * w, "layout": "fused"}, ValueError,
                      "num_q_heads == num_kv_heads"),
        "head_dim": ({**base, "head_dim": 96}, ValueError, "head_dim must be one of"),
        "max_tokens": ({**base, "max_tokens": 0}, ValueError, "max_tokens must be >= 1"),
        "hidden": ({**base, "hidden": HIDDEN + 8}, ValueError, "hidden must be a multiple of 16"),
        # Only rank 0 differs: every rank must still raise, none may hang.
        "mismatch": ({**base, "max_tokens": 64 + (ctx.rank == 0)}, ValueError,
                     "different configurations"),
    }
    report = {}
    for name, (kwargs, exc_type, fragment) in checks.items():
        report[name] = expect_error(lambda k=kwargs: QkvNormRopeExchangeOverlap(**k), exc_type,
                                     fragment)
    if ctx.device.type == "cpu":
        report["forced_nvlink"] = expect_error(
            lambda: QkvNormRopeExchangeOverlap(**{**base, "backend": "nvlink"}),
            UlyssesBackendError, "not a CUDA GPU")
    return report


def case_bad_call_inputs_raise_before_any_collective(ctx):
    w = ctx.world_size
    problem = make_problem(7, w, num_q_heads=w, num_kv_heads=w, hidden=HIDDEN, batch=1,
                           seq_local=6, positions=True, max_pos=16)
    x, weight, qn, kn, table, pos, bias = problem.rank_args(ctx.rank, ctx.device)
    report = {}
    with QkvNormRopeExchangeOverlap(num_q_heads=w, num_kv_heads=w, head_dim=128, hidden=HIDDEN,
                                    max_tokens=8, device=ctx.device) as session:
        bad = {
            "x_dtype": ((x.float(), weight, qn, kn, table, pos), TypeError, "x must have dtype"),
            "x_shape": ((x[..., :-1].contiguous(), weight, qn, kn, table, pos), ValueError,
                        "hidden="),
            "rows": ((torch.cat([x, x], 1), weight, qn, kn, table, torch.cat([pos, pos], 1)),
                     ValueError, "max_tokens=8"),
            "weight": ((x, weight[:-128].contiguous(), qn, kn, table, pos), ValueError,
                       "qkv_weight must have shape"),
            "norm": ((x, weight, qn[:64].contiguous(), kn, table, pos), ValueError,
                     "q_norm_weight"),
            "table_dtype": ((x, weight, qn, kn, table.double(), pos), TypeError, "rope_cos_sin"),
            "no_positions_short_table": ((x, weight, qn, kn, table[:2].contiguous(), None),
                                         ValueError, "one row per token"),
            "noncontiguous": ((torch.cat([x, x], -1)[..., :HIDDEN], weight, qn, kn, table, pos),
                              ValueError, "contiguous"),
            # Contiguous, but one element into its storage: not 16-byte aligned.
            "misaligned": ((torch.cat([x.flatten(), x.flatten()])[1: 1 + x.numel()].view_as(x),
                            weight, qn, kn, table, pos), ValueError, "16-byte aligned"),
        }
        for name, (args, exc_type, fragment) in bad.items():
            report[name] = expect_error(lambda a=args: session(*a, qkv_bias=bias), exc_type,
                                         fragment)
        # Positions past the table's rows are found on the GPU, so the call runs (every rank
        # makes it) and the error comes from synchronize (or the next call).
        session(x, weight, qn, kn, table, torch.full_like(pos, table.shape[0]), bias)
        report["positions_range"] = expect_error(session.synchronize, ValueError,
                                                  "outside [0, rows of rope_cos_sin)")
        # The group is still in step: a good call after all the bad ones works.
        want = problem.expected(w, w, "interleaved", "bshd")[ctx.rank]
        got = session(x, weight, qn, kn, table, pos, bias)
        report["compare"] = _compare_qkv(got, want, "good call")
    return report


def case_lifecycle(ctx):
    w = ctx.world_size
    session = QkvNormRopeExchangeOverlap(num_q_heads=w, num_kv_heads=w, head_dim=128,
                                         hidden=HIDDEN, max_tokens=8, device=ctx.device)
    capturable = session.graph_capturable
    session.close()
    session.close()  # idempotent
    problem = make_problem(3, w, num_q_heads=w, num_kv_heads=w, hidden=HIDDEN, batch=1,
                           seq_local=2)
    closed = expect_error(lambda: session(*problem.rank_args(ctx.rank, ctx.device)),
                           RuntimeError, "closed")
    return {"closed": closed, "graph_capturable": capturable, "repr": repr(session)}


def _gpu_call_plan(seed, rows_choices, calls):
    """Per-call (rows, problem seed) from a seed every rank shares, so the ranks agree on sizes."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(calls):
        rows = rows_choices[int(torch.randint(len(rows_choices), (1,), generator=g))]
        yield rows, int(torch.randint(2**31, (1,), generator=g))


def _gpu_problem(ctx, hq, hkv, rows, seed):
    return make_problem(seed, ctx.world_size, num_q_heads=hq, num_kv_heads=hkv, hidden=HIDDEN,
                        batch=1, seq_local=rows, positions=False)


def _gpu_problem_stream(ctx, seed, hq, hkv, rows_choices, calls):
    """Per-call problems from a seed every rank shares: fresh inputs, varying sizes."""
    for rows, problem_seed in _gpu_call_plan(seed, rows_choices, calls):
        yield _gpu_problem(ctx, hq, hkv, rows, problem_seed)


def _back_to_back_inputs(ctx, seed, hq, hkv, rows_choices, calls, check_every):
    """Per-call (device args, reference output or None), all built before the first call.

    Row counts and seeds come from ``_gpu_call_plan`` as in ``_gpu_problem_stream``,
    so every rank makes the same sequence of calls.  Every ``check_every``-th call
    gets fresh inputs and its reference.  The other calls only stress the protocol
    (epochs, slot ring, readiness words), not the math, so they reuse one device
    input per row count: building every rank's random problem on the host for
    every call, in every process (10-25 ms at W=2-8), and copying it to the GPU
    (a pageable copy, which may wait for the GPU) kept the case running for
    minutes with W processes on one GPU.
    """
    pool = {rows: _gpu_problem(ctx, hq, hkv, rows, seed=rows).rank_args(ctx.rank, ctx.device)
            for rows in rows_choices}
    inputs = []
    for i, (rows, problem_seed) in enumerate(_gpu_call_plan(seed, rows_choices, calls)):
        if i % check_every:
            inputs.append((pool[rows], None))
        else:
            problem = _gpu_problem(ctx, hq, hkv, rows, problem_seed)
            inputs.append((problem.rank_args(ctx.rank, ctx.device),
                           problem.expected(hq, hkv, "interleaved", "bshd")[ctx.rank]))
    return inputs


def case_gpu_back_to_back_calls(ctx):
    """Many calls (1,000 by default) with varying row counts, no host sync between them;
    every 97th is checked."""
    if ctx.device.type != "cuda":
        return {"skipped": "GPU only"}
    hq, hkv = _heads(ctx.world_size, "gqa_replicate")
    inputs = _back_to_back_inputs(ctx, 11, hq, hkv, [1, 37, 128, 200, 256], BACK_TO_BACK_CALLS,
                                  check_every=97)
    checked = []
    with QkvNormRopeExchangeOverlap(num_q_heads=hq, num_kv_heads=hkv, head_dim=128,
                                    hidden=HIDDEN, max_tokens=256, device=ctx.device,
                                    backend=REQUESTED_BACKEND) as session:
        pending = []
        for i, (args, want) in enumerate(inputs):
            if want is None:
                session(*args)
            else:
                out = tuple(torch.full(w.shape, float("nan"), dtype=torch.bfloat16,
                                       device=ctx.device) for w in want)
                pending.append((i, session(*args, out=out), want))
        session.synchronize()
        for i, got, want in pending:
            checked += _compare_qkv(got, want, f"call {i}")
    return {"compare": checked}


def case_gpu_two_sessions_in_flight(ctx):
    """Two sessions on one group, calls interleaved without syncs, outputs kept in their rings."""
    if ctx.device.type != "cuda":
        return {"skipped": "GPU only"}
    hq, hkv = _heads(ctx.world_size, "mha")
    kwargs = dict(num_q_heads=hq, num_kv_heads=hkv, head_dim=128, hidden=HIDDEN,
                  max_tokens=64, num_slots=3, device=ctx.device, backend=REQUESTED_BACKEND)
    report = {"compare": []}
    with QkvNormRopeExchangeOverlap(**kwargs) as a, QkvNormRopeExchangeOverlap(**kwargs) as b:
        problems = list(_gpu_problem_stream(ctx, 23, hq, hkv, [17, 64], 6))
        results = [(a if i % 2 == 0 else b)(*p.rank_args(ctx.rank, ctx.device))
                   for i, p in enumerate(problems)]
        torch.cuda.synchronize()
        for i, (p, got) in enumerate(zip(problems, results)):
            want = p.expected(hq, hkv, "interleaved", "bshd")[ctx.rank]
            report["compare"] += _compare_qkv(got, want, f"call {i}")
    return report


def case_gpu_graph_capture_and_replay(ctx):
    """Capture a call, replay it with fresh inputs, interleave replays with eager calls; on
    each producer engine."""
    return _capture_and_replay(ctx, REQUESTED_BACKEND)


def case_gpu_nccl_graph_capture(ctx):
    """The same on the NCCL path of an NCCL group (capturable: no host sync, no allocation)."""
    if ctx.dist_backend != "nccl":
        return {"skipped": "needs an NCCL group"}
    return _capture_and_replay(ctx, "nccl")


def _capture_and_replay(ctx, backend: str) -> dict:
    if ctx.device.type != "cuda":
        return {"skipped": "GPU only"}
    hq, hkv = _heads(ctx.world_size, "gqa_split")
    report = {"compare": []}
    for engine in ("fused", "cublas"):
        with QkvNormRopeExchangeOverlap(num_q_heads=hq, num_kv_heads=hkv, head_dim=128,
                                        hidden=HIDDEN, max_tokens=64, num_slots=2,
                                        device=ctx.device, backend=backend,
                                        engine=engine) as session:
            report["graph_capturable"] = session.graph_capturable
            if not session.graph_capturable:
                return report
            problems = list(_gpu_problem_stream(ctx, 31, hq, hkv, [48], 7))
            static = [t.clone() if t is not None else None
                      for t in problems[0].rank_args(ctx.rank, ctx.device)]
            session(*static)  # eager warm-up: compiles the kernels
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                captured = session(*static)
            for i, p in enumerate(problems[1:], start=1):
                want = p.expected(hq, hkv, "interleaved", "bshd")[ctx.rank]
                args = p.rank_args(ctx.rank, ctx.device)
                if i % 2:
                    for dst, src in zip(static, args):
                        if dst is not None:
                            dst.copy_(src)
                    graph.replay()
                    got = captured
                else:
                    got = session(*args)
                torch.cuda.synchronize()
                kind = "replay" if i % 2 else "eager"
                report["compare"] += _compare_qkv(got, want, f"{engine} call {i} ({kind})")
            session.synchronize()
    return report


def case_gpu_wait_timeout_names_the_absent_rank(ctx):
    """The last rank never calls; the others must raise naming it instead of hanging."""
    if ctx.device.type != "cuda" or REQUESTED_BACKEND == "nccl":
        return {"skipped": "NVLink path only"}
    from cake_sp.session.nvlink import PeerTimeoutError

    w = ctx.world_size
    absent = w - 1
    with QkvNormRopeExchangeOverlap(num_q_heads=w, num_kv_heads=w, head_dim=128, hidden=HIDDEN,
                                    max_tokens=16, device=ctx.device, backend="nvlink",
                                    wait_timeout_s=1.0) as session:
        if ctx.rank == absent:
            return {"absent": True}
        problem = make_problem(5, w, num_q_heads=w, num_kv_heads=w, hidden=HIDDEN, batch=1,
                               seq_local=16)
        session(*problem.rank_args(ctx.rank, ctx.device))
        return expect_error(session.synchronize, PeerTimeoutError, f"[{absent}]")


CASES = [case_mha_bshd_interleaved, case_mha_fused_neox_positions_no_norm_no_bias,
         case_head_dims_64_and_256, case_gqa_split_neox_out,
         case_gqa_replicate_interleaved_positions, case_each_engine_named,
         case_slot_ring_keeps_earlier_outputs, case_bad_configuration_raises_everywhere,
         case_bad_call_inputs_raise_before_any_collective, case_lifecycle,
         case_gpu_back_to_back_calls, case_gpu_two_sessions_in_flight,
         case_gpu_graph_capture_and_replay, case_gpu_nccl_graph_capture,
         case_gpu_wait_timeout_names_the_absent_rank]
RESULT_CASES = CASES[:6] + [case_bad_call_inputs_raise_before_any_collective,
                            case_gpu_back_to_back_calls, case_gpu_two_sessions_in_flight]
GRAPH_CASES = [case_gpu_graph_capture_and_replay, case_gpu_nccl_graph_capture]
GPU_CASES = {c.__name__ for c in CASES if c.__name__.startswith("case_gpu_")}
# On CPUs every rank runs the kernels through Triton's interpreter, so the larger
# worlds run the cases that depend on W (head split, replication, agreement) and
# leave layout and RoPE-style variations, which do not, to W=2.
WIDE_WORLD_SKIPS = {case_mha_fused_neox_positions_no_norm_no_bias.__name__,
                    case_head_dims_64_and_256.__name__}


def _cases_for(world: int) -> list:
    unknown = ONLY_CASES - {c.__name__ for c in CASES}
    if unknown:
        raise ValueError(f"CAKE_SP_TEST_CASES names unknown cases {sorted(unknown)}")
    skips = set()
    if TEST_DEVICE == "cpu":
        skips = GPU_CASES | (WIDE_WORLD_SKIPS if world > 2 else set())
    return [c for c in CASES if c.__name__ not in skips
            and (not ONLY_CASES or c.__name__ in ONLY_CASES)]




# What each case's reports must show, one function per test below; a case may have several.
def _check_matches_reference(world, name, per_rank) -> str:
    assert_no_rank_failed(world, per_rank, name)
    differ = sum(c["differ"] for r in per_rank for c in r["compare"])
    one_ulp = sum(c["one_ulp"] for r in per_rank for c in r["compare"])
    elements = sum(c["elements"] for r in per_rank for c in r["compare"])
    flips = sum(c["intermediate_flips"] for r in per_rank for c in r["compare"])
    # Elements may only differ where fp32 summation order crossed a bf16 rounding boundary.
    assert differ <= elements // 100, f"{differ} of {elements} elements differ"
    for report in per_rank:
        if "backend" in report:
            assert report["backend"] == EXPECTED_BACKEND, report["reason"]
    return (f"{differ} of {elements} elements differ from the reference, {one_ulp} of them by "
            f"one bf16 ulp, {flips} by an intermediate flip")


def _check_timeout(world, name, per_rank) -> str:
    assert_no_rank_failed(world, per_rank, name)
    if REQUESTED_BACKEND != "nccl":
        assert all("raised" in r for r in per_rank[:-1]) and per_rank[-1].get("absent")
    return "every other rank named the absent one"


def _check_slot_ring(world, name, per_rank) -> str:
    assert_no_rank_failed(world, per_rank, name)
    assert all(r["reused_after_two_calls"] for r in per_rank)
    return "slots reused after two calls"


def _check_bad_configuration(world, name, per_rank) -> str:
    assert_no_rank_failed(world, per_rank, name)
    # Every rank raised the same error for each bad configuration.
    for bad in per_rank[0]:
        assert len({r[bad]["message"] for r in per_rank}) == 1, bad
    return "every rank raised the same errors"


def _check_graph_capture(world, name, per_rank) -> str:
    if all("skipped" in r for r in per_rank):
        return f"skipped: {per_rank[0]['skipped']}"
    assert_no_rank_failed(world, per_rank, name)
    for report in per_rank:
        assert report["graph_capturable"], report
        assert len(report["compare"]) == 2 * 6 * 3, "q, k, v of 6 calls on each engine"
    return "captured; " + _check_matches_reference(world, name, per_rank)


def _check_lifecycle(world, name, per_rank) -> str:
    assert_no_rank_failed(world, per_rank, name)
    return "closed twice, then a call raised"


CHECKS = {
    **{case.__name__: [_check_matches_reference] for case in RESULT_CASES},
    case_slot_ring_keeps_earlier_outputs.__name__: [_check_matches_reference, _check_slot_ring],
    case_gpu_wait_timeout_names_the_absent_rank.__name__: [_check_timeout],
    case_bad_configuration_raises_everywhere.__name__: [_check_bad_configuration],
    case_lifecycle.__name__: [_check_lifecycle],
    **{case.__name__: [_check_graph_capture] for case in GRAPH_CASES},
}
assert set(CHECKS) == {case.__name__ for case in CASES}, "every case needs its checks"


def case_verdict(world: int, name: str, per_rank: list[dict]) -> str:
    """One case's verdict from every rank's report, by the same checks as its tests, for the
    line ``run_cases`` prints as the case ends."""
    if all("skipped" in r for r in per_rank):
        return f"skipped: {per_rank[0]['skipped']}"
    try:
        details = [check(world, name, per_rank) for check in CHECKS[name]]
    except Exception as exc:  # a verdict never stops the run; the tests report in full
        return f"FAILED: {type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}"
    return "passed: " + "; ".join(details)


@pytest.fixture(scope="module", params=WORLDS, ids=lambda w: f"W{w}")
def reports(request):
    return request.param, run_cases(request.param, _cases_for(request.param), case_verdict)


def _reports_of(by_case: dict, name: str) -> list[dict]:
    """Every rank's report of one case; skips a case this lane did not run."""
    if name not in by_case:
        pytest.skip(f"{name} not run here: CAKE_SP_TEST_CASES selects others, or on CPUs it "
                    "runs at W=2 only (its result does not depend on W)")
    return by_case[name]


@pytest.mark.parametrize("case", RESULT_CASES, ids=lambda c: c.__name__[5:])
def test_every_rank_matches_the_reference(reports, case):
    world, by_case = reports
    if case.__name__ in GPU_CASES and TEST_DEVICE == "cpu":
        pytest.skip("needs GPUs (CAKE_SP_TEST_DEVICE=cuda or cuda-shared)")
    summary = _check_matches_reference(world, case.__name__, _reports_of(by_case, case.__name__))
    print(f"W={world} {case.__name__}: {summary}")


@pytest.mark.parametrize("case", GRAPH_CASES, ids=lambda c: c.__name__[5:])
def test_graph_capture_and_replay(reports, case):
    world, by_case = reports
    if TEST_DEVICE == "cpu":
        pytest.skip("needs GPUs (CAKE_SP_TEST_DEVICE=cuda or cuda-shared)")
    print(f"W={world} {case.__name__}: "
          f"{_check_graph_capture(world, case.__name__, _reports_of(by_case, case.__name__))}")


@pytest.mark.skipif(TEST_DEVICE == "cpu", reason="needs a GPU")
def test_nccl_path_captures_at_world_one():
    """One rank on an NCCL group (allowed where ranks otherwise share the GPU): the NCCL
    path says it is capturable, and its replays match the reference."""
    name = case_gpu_nccl_graph_capture.__name__
    per_rank = run_cases(1, [case_gpu_nccl_graph_capture])[name]
    assert "skipped" not in per_rank[0], per_rank[0]
    print(f"W=1 {name}: {_check_graph_capture(1, name, per_rank)}")


def test_wait_timeout_names_the_absent_rank(reports):
    world, by_case = reports
    if TEST_DEVICE == "cpu":
        pytest.skip("needs GPUs (CAKE_SP_TEST_DEVICE=cuda or cuda-shared)")
    name = case_gpu_wait_timeout_names_the_absent_rank.__name__
    _check_timeout(world, name, _reports_of(by_case, name))


def test_slot_ring_reuse(reports):
    world, by_case = reports
    name = case_slot_ring_keeps_earlier_outputs.__name__
    _check_slot_ring(world, name, _reports_of(by_case, name))


def test_bad_configuration_raises_on_every_rank(reports):
    world, by_case = reports
    name = case_bad_configuration_raises_everywhere.__name__
    _check_bad_configuration(world, name, _reports_of(by_case, name))


def test_lifecycle_and_backend_reason(reports):
    world, by_case = reports
    _check_lifecycle(world, case_lifecycle.__name__, _reports_of(by_case, case_lifecycle.__name__))
    reason = _reports_of(by_case, "case_mha_bshd_interleaved")[0]["reason"]
    print(f"W={world} backend reason: {reason}")
    if TEST_DEVICE == "cpu" and REQUESTED_BACKEND == "auto":
        assert "not a CUDA GPU" in reason


def test_case_verdict_names_failures():
    """The progress line's verdict fails where the tests would: an error on one rank, too many
    differing elements, a rank that disagrees about a bad configuration."""
    good = {"compare": [{"differ": 1, "one_ulp": 1, "elements": 1000, "intermediate_flips": 0}]}
    name = case_mha_bshd_interleaved.__name__
    assert case_verdict(2, name, [good, good]).startswith("passed: 2 of 2000")
    error = {"error": "boom", "type": "RuntimeError"}
    assert case_verdict(2, name, [good, error]).startswith("FAILED: AssertionError: W=2 rank 1")
    many = {"compare": [{"differ": 30, "one_ulp": 0, "elements": 1000, "intermediate_flips": 0}]}
    assert case_verdict(2, name, [many, good]) == ("FAILED: AssertionError: 31 of 2000 "
                                                   "elements differ")
    bad = case_bad_configuration_raises_everywhere.__name__
    assert case_verdict(2, bad, [{"x": {"message": "a"}}, {"x": {"message": "b"}}]).startswith(
        "FAILED")
    assert case_verdict(2, bad, [{"x": {"message": "a"}}] * 2).startswith("passed")
    assert case_verdict(2, name, [{"skipped": "GPU only"}] * 2) == "skipped: GPU only"
