"""The main benchmark's run: ceilings, then per row check every arm, time the checked ones.

Per row: build this rank's inputs and its expected outputs from the reference;
prepare each arm, run it once and compare with the reference on every rank
(an arm that fails is reported and never timed); then time the checked arms
in counterbalanced rounds with an A/A control (the first fused arm run a
second time under another name) and report the medians against the floor.
Imported by the entry script after the Triton interpreter switch is set.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from _harness import (
    BenchContext,
    HostDelay,
    ProfilerTimer,
    WallTimer,
    check_same_on_all_ranks,
    counterbalanced_order,
    environment,
    init_distributed,
    launch_skew,
    make_timer,
    max_over_ranks,
    median,
    synchronize,
)
from _report import arms_table, plot_speedups, progress, summary_table, write_json
from arms import ARMS, FUSED_ARMS, ArmSkipped, build_arm, skip_reason
from bench_link import SIZES_CPU, SIZES_CUDA, link_tables, measure_link
from problem import ROPE_STYLE, Inputs, compare, expected_outputs, make_inputs
from rows import Row, select_rows

SCHEMA = "cake_sp.bench.qkv_norm_rope_exchange_overlap/1"
AA_LIMIT_PCT = 1.0
AA_SUFFIX = "~aa"
# Square GEMMs added to the row shapes when measuring the matmul rate.
SQUARE_GEMM = {"cuda": 8192, "cpu": 512}

Timer = WallTimer | ProfilerTimer


def measure_matmul_rate(ctx: BenchContext, timer: Timer, rows: list[Row],
                        samples: int) -> dict:
    """Best bf16 GEMM rate over the rows' projection shapes and one square GEMM.

    Each shape ``(M, K, N)`` is ``F.linear`` of ``[M, K]`` by ``[N, K]``, timed like
    the arms.  The fastest rate is the one the floors use (a lower floor).
    """
    square = SQUARE_GEMM[ctx.device.type]
    shapes = {(row.batch * row.seq_local(ctx.world_size), row.hidden,
               row.total_heads * row.head_dim) for row in rows}
    shapes.add((square, square, square))
    results = []
    for m, k, n in sorted(shapes):
        x = torch.randn(m, k, device=ctx.device).bfloat16()
        w = torch.randn(n, k, device=ctx.device).bfloat16()
        call = lambda x=x, w=w: F.linear(x, w)  # noqa: E731
        call()
        synchronize(ctx)
        per_sample, _ = max_over_ranks(ctx, timer.time_samples([call] * samples))
        t = median(per_sample) / 1e3
        results.append({"m": m, "k": k, "n": n, "samples_ms": per_sample,
                        "median_ms": t * 1e3, "tflops": 2 * m * k * n / t / 1e12})
        del x, w
    best = max(results, key=lambda r: r["tflops"])
    return {"shapes": results, "rate_flops_per_s": best["tflops"] * 1e12,
            "rate_source": f"F.linear bf16 [{best['m']}, {best['k']}] x [{best['n']}, "
                           f"{best['k']}]^T"}


def verify(ctx: BenchContext, arm, expected: dict) -> tuple[bool, list[dict]]:
    """Run ``arm`` once and compare q, k, v with its reference on every rank.

    Returns (every element of every rank within tolerance, per-rank reports).
    """
    arm.run()
    got = arm.outputs()
    synchronize(ctx)
    # Baselines that round the projection to bf16 (cuBLAS bf16 out) have one more
    # bf16 rounding before RoPE than the contract.
    roundings = 3 if arm.reference == "bf16_projection" else 2
    styles = (ROPE_STYLE, ROPE_STYLE, None)
    mine = {name: compare(g, w, style, roundings)
            for name, g, w, style in zip("qkv", got, expected[arm.reference], styles,
                                         strict=True)}
    reports: list = [None] * ctx.world_size
    dist.all_gather_object(reports, mine, group=ctx.control)
    ok = all(r[name]["mismatches"] == 0 for r in reports for name in "qkv")
    return ok, reports


def time_arms(ctx: BenchContext, timer: Timer, schedule: dict, args: argparse.Namespace) -> dict:
    """Warm up, then time every arm of ``schedule`` (name -> arm) in counterbalanced rounds."""
    names = list(schedule)
    for _ in range(args.warmup):
        for name in names:
            schedule[name].run()
    synchronize(ctx)
    rounds = max(1, -(-args.samples // 2))
    order = counterbalanced_order(names, rounds)
    # One timer batch for every round: a profiler session costs seconds to start and parse.
    per_sample, per_rank = max_over_ranks(ctx, timer.time_samples([schedule[name].run
                                                                     for _, name in order]))
    arrivals = [None] * ctx.world_size
    dist.all_gather_object(arrivals, timer.arrivals_ns, group=ctx.control)
    skew = launch_skew(arrivals)
    samples = {n: [t for t, (_, m) in zip(per_sample, order, strict=True) if m == n]
               for n in names}
    samples_per_rank = {n: [[t for t, (_, m) in zip(rank, order, strict=True) if m == n]
                            for rank in per_rank] for n in names}
    medians = {n: median(v) for n, v in samples.items()}
    control = next(n for n in names if n.endswith(AA_SUFFIX))
    base = control.removesuffix(AA_SUFFIX)
    a, b = medians[base], medians[control]
    spread = 100.0 * abs(a - b) / min(a, b) if min(a, b) > 0 else float("inf")
    return {"order": [[k, n] for k, n in order], "samples_ms": samples,
            "samples_ms_per_rank": samples_per_rank, "median_ms": medians,
            "skew_ms": skew, "median_skew_ms": median(skew),
            "aa": {"arm": base, "control": control, "spread_pct": spread,
                   "flagged": spread > AA_LIMIT_PCT}}


def _row_shape(row: Row, world: int) -> dict:
    return {"name": row.name, "world_size": world, "hidden": row.hidden,
            "num_q_heads": row.num_q_heads, "num_kv_heads": row.num_kv_heads,
            "head_dim": row.head_dim, "batch": row.batch, "seq_global": row.seq_global,
            "seq_local": row.seq_local(world)}


def _prepare_arms(ctx: BenchContext, row: Row, names: list[str], inputs: Inputs,
                  expected: dict) -> tuple[dict, dict]:
    """Build, prepare and check each arm; return (arm reports, checked arms by name)."""
    reports, live = {}, {}
    for name in names:
        report = {"description": ARMS[name], "status": "skipped", "reason": skip_reason(name, ctx),
                  "verified": None}
        reports[name] = report
        if report["reason"] is not None:
            continue
        arm = build_arm(name, ctx, row)
        try:
            arm.prepare(inputs)
        except ArmSkipped as exc:
            report["reason"] = str(exc)
            continue
        report.update(arm.info(), reference=arm.reference)
        report["verified"], report["verification"] = verify(ctx, arm, expected)
        if report["verified"]:
            report.update(status="timed", reason=None)
            live[name] = arm
        else:
            report.update(status="failed", reason="outputs differ from the reference "
                                                  "(see verification)")
            arm.close()
    return reports, live


def run_row(ctx: BenchContext, timer: Timer, row: Row, args: argparse.Namespace,
            ceilings: dict) -> dict:
    """Check and time every requested arm on ``row``; the row's JSON record."""
    world = ctx.world_size
    result: dict = {"row": _row_shape(row, world), "status": "skipped",
                    "reason": row.invalid_reason(world), "arms": {}}
    if result["reason"] is not None:
        return result
    inputs = make_inputs(row, world, ctx.rank, ctx.device, args.seed)
    expected = expected_outputs(row, world, ctx.rank, inputs, args.seed)
    result["arms"], live = _prepare_arms(ctx, row, args.arms, inputs, expected)
    del expected
    check_same_on_all_ranks(ctx, f"the arms to time on {row.name}", list(live))
    if not live:
        result["reason"] = "no arm could run (see arms)"
        return result
    control = next((n for n in FUSED_ARMS if n in live), next(iter(live)))
    schedule = {**live, control + AA_SUFFIX: live[control]}
    attempts = []
    for _ in range(args.attempts):
        attempts.append(time_arms(ctx, timer, schedule, args))
        if not attempts[-1]["aa"]["flagged"]:
            break
    for arm in live.values():
        arm.close()
    kept = attempts[-1]
    medians = kept["median_ms"]
    fused = next((n for n in FUSED_ARMS if n in live), None)
    baselines = {n: medians[n] for n in live if n not in FUSED_ARMS}
    best = min(baselines, key=baselines.get) if baselines else None
    compute_ms = row.gemm_flops(world) / ceilings["matmul"]["rate_flops_per_s"] * 1e3
    link_ms = row.bytes_out(world) / ceilings["link"]["rate_bytes_per_s"] * 1e3
    floor_ms = max(compute_ms, link_ms)
    fused_ms = medians[fused] if fused else None
    flags = ([f"A/A {kept['aa']['spread_pct']:.2f}% > {AA_LIMIT_PCT:g}%"]
             if kept["aa"]["flagged"] else [])
    result.update({
        "status": "measured", "reason": None,
        "gemm_flops": row.gemm_flops(world), "bytes_out_per_gpu": row.bytes_out(world),
        "attempts": attempts, "median_ms": medians, "median_skew_ms": kept["median_skew_ms"],
        "aa_spread_pct": kept["aa"]["spread_pct"], "flags": flags,
        "fused_arm": fused, "fused_ms": fused_ms,
        "best_baseline": best, "best_baseline_ms": baselines.get(best),
        "speedup": baselines[best] / fused_ms if fused and best else None,
        "floor": {"compute_ms": compute_ms, "link_ms": link_ms, "floor_ms": floor_ms,
                  "bound": "compute" if compute_ms >= link_ms else "link"},
        "fused_over_floor": fused_ms / floor_ms if fused else None,
    })
    return result


def _caveats(ctx: BenchContext) -> list[str]:
    caveats = []
    if not ctx.is_cuda:
        caveats.append("CPU run (gloo, Triton interpreter, wall-clock time): checks the harness "
                       "end to end; the numbers say nothing about GPUs.")
    if ctx.shared_gpu:
        caveats.append(f"{ctx.world_size} ranks share one GPU: a harness check, NOT multi-GPU "
                       "numbers. Ranks time-slice the GPU, the 'link' rate is a device-local "
                       "copy, and arms that need an NCCL group are skipped.")
    return caveats


def _header(doc: dict) -> str:
    env, ceil = doc["environment"], doc["ceilings"]
    lines = [f"# qkv_norm_rope_exchange_overlap, W = {env['world_size']}", "",
             f"- device: {env.get('gpu', 'cpu')} x{env['world_size']} ranks "
             f"({env['dist_backend']}); torch {env['torch']}, NCCL {env.get('nccl', '-')}, "
             f"NVSHMEM4py {env['nvshmem4py'] or '-'}, commit {str(env['commit'])[:12]}"
             f"{' (dirty)' if env['commit_dirty'] else ''}",
             f"- timing: {doc['timer']}, medians of per-sample maxima over ranks, "
             f"counterbalanced rounds, A/A control flagged above {AA_LIMIT_PCT:g}%",
             f"- ranks start each sample together: host barrier, then device barrier "
             f"{doc['device_barrier'] or '(none on the CPU)'}; skew = median over samples of "
             f"the spread of the ranks' host arrivals at that barrier, not part of any GPU time"
             + (f"; rank {doc['config']['delay_rank']} delayed "
                f"{doc['config']['delay_ms']:g} ms on purpose" if doc['config']['delay_ms']
                else ""),
             f"- matmul rate: {ceil['matmul']['rate_flops_per_s'] / 1e12:.3g} TFLOP/s "
             f"({ceil['matmul']['rate_source']})",
             f"- link rate: {ceil['link']['rate_bytes_per_s'] / 1e9:.1f} GB/s "
             f"({ceil['link']['rate_source']})"]
    lines += [f"- **caveat**: {c}" for c in doc["caveats"]]
    if not doc["complete"]:
        lines.append("- **incomplete**: written while the run was going; later rows are missing")
    return "\n".join(lines)


def _write_files(doc: dict, args: argparse.Namespace, ctx: BenchContext, final: bool) -> None:
    """Rank 0: the JSON, Markdown and PNG of the rows so far; the final call also prints."""
    results = doc["rows"]
    text = "\n\n".join([_header(doc), summary_table(results), "Median ms of every arm:",
                        arms_table(results), "Link ceilings:",
                        link_tables(doc["ceilings"]["link"])])
    if final:
        print(text)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text + "\n")
    if args.json:
        write_json(args.json, doc)
    if args.plot:
        title = (f"{doc['environment'].get('gpu', 'CPU')}, W={ctx.world_size}, {doc['timer']}"
                 + (" - harness check only, not multi-GPU numbers" if doc["caveats"] else ""))
        plot_speedups(results, args.plot, title)


def run(args: argparse.Namespace) -> int:
    """The whole benchmark on this rank; returns the process exit code."""
    try:
        rows = select_rows(args.rows, int(os.environ.get("WORLD_SIZE", "1")))
        args.arms = args.arms or list(ARMS)
        unknown = [a for a in args.arms if a not in ARMS]
        if unknown:
            raise ValueError(f"unknown arm(s) {unknown}; valid: {list(ARMS)}")
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    ctx = init_distributed(args.device, args.dist_backend)
    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 reference must be fp32
    timer = make_timer(ctx, HostDelay(args.delay_rank, args.delay_ms))
    runnable = [r for r in rows if r.invalid_reason(ctx.world_size) is None]
    sizes = args.link_sizes or (SIZES_CUDA if ctx.is_cuda else SIZES_CPU)
    ceilings = {"matmul": measure_matmul_rate(ctx, timer, runnable, args.ceiling_samples),
                "link": measure_link(ctx, timer, sizes, args.ceiling_samples)}
    doc = {"schema": SCHEMA, "command": sys.argv, "config": vars(args),
           "environment": environment(ctx), "timer": timer.kind,
           "device_barrier": getattr(timer, "barrier_kind", None), "caveats": _caveats(ctx),
           "aa_limit_pct": AA_LIMIT_PCT, "arms_catalogue": ARMS, "ceilings": ceilings,
           "complete": False, "rows": []}
    with progress(ctx.rank == 0, len(rows), "rows") as advance:
        for row in rows:
            start = time.perf_counter()
            doc["rows"].append(run_row(ctx, timer, row, args, ceilings))
            last = doc["rows"][-1]
            advance(1, f"{row.name}: {last['status']}"
                       + (f", speedup {last['speedup']:.2f}x" if last.get("speedup") else "")
                       + f" ({time.perf_counter() - start:.0f} s)")
            if ctx.rank == 0:
                # Rewritten after every row, so a run cut short keeps the rows it finished.
                _write_files(doc, args, ctx, final=False)
            if ctx.is_cuda:
                torch.cuda.empty_cache()
    doc["complete"] = True
    failed = [f"{r['row']['name']}/{n}" for r in doc["rows"] for n, a in r["arms"].items()
              if a["status"] == "failed"]
    if ctx.rank == 0:
        _write_files(doc, args, ctx, final=True)
        if failed:
            print(f"error: arms failed the reference check: {failed}", file=sys.stderr)
    # Nobody exits before rank 0 has written its files (torchrun stops the rest on an exit).
    dist.barrier(group=ctx.control)
    dist.destroy_process_group()
    return 1 if failed else 0
