"""The fused producer against cuBLAS alone and against the per-operator eager front end.

One command on one GPU; prints a Markdown table last and can write ``--json PATH``::

    python benchmarks/kernels/bench_producer.py --json producer.json

Rows: ``W in {2, 4, 8}`` x ``hidden in {3072, 4096, 6144, 8192}`` (``hidden / 128`` Q
heads, 8 K/V heads or ``--kv-heads mha``, D = 128) x ``S_global in {4096, 32768,
131072}``, one batch entry, so this rank has ``rows = S_local = S_global / W`` tokens.  Arms,
all on this rank's rows, every destination buffer local (an in-process
pointer table of W buffers, so the stores cost HBM bandwidth, not NVLink):

* ``cublas``: ``x @ qkv_weight.T`` alone (cuBLAS through ``torch.matmul``), bf16 out;
* ``producer_<mainloop>``: ``qkv_norm_rope_produce`` without signals on each of
  ``--mainloops`` (default: ``warp_specialized`` and ``tma``, both Hopper's), side by
  side: GEMM + bias + QK RMSNorm + RoPE + stores of every head band at its
  destination's offset;
* ``eager``: the per-operator front end: ``F.linear``, RMSNorm and RoPE as torch
  ops, then one copy per destination and kind into the same buffers;
* ``cublas_fp32``: the GEMM alone with an fp32 output (the cuBLAS engine's first step);
* ``cublas_engine``: the session's second engine
  (``producer_cublas.qkv_norm_rope_produce_cublas``): ``cublas_fp32``, then one Triton
  epilogue kernel;
* ``unfused``: what the per-operator baselines compute before their exchange, a cuBLAS
  GEMM with the bias (bf16 out) and then their one QK-norm + RoPE launch in place
  (``benchmarks/comm/_norm_rope_op.py``), writing no destination: the pairing the fused
  producer must beat.

Per row the table prints every engine arm's time over ``cublas``, the arm the
session's choice takes (``_config.producer_engine``, then the launcher's default
mainloop) and its time over the fastest engine arm of the row.

The eager and unfused arms are baselines: a check of one that fails is recorded in the
row (``baseline_checks``) and the arm still timed; every other arm must pass.

Each arm is checked against the fp32 reference (``cake_sp.reference``) on the
first ``--check-rows`` rows, atol = rtol = 1e-2, before it is timed; the eager and
unfused arms against the same steps from a bf16-rounded projection, which is their math.  Each
arm is captured once in a CUDA graph and timed in ``--rounds`` rounds, each the median of
``triton.testing.do_bench`` over replays (L2 flushed before every replay), the arms in
rotated order from round to round; an arm's time is the median of its rounds (the JSON
keeps every round).  The host's launch cost is left out of every arm; inputs fresh
random per row.
``TFLOP/s`` counts the projection's ``2 * rows * N * hidden``.

``--sustained-ms T`` (0: off) also runs every arm, in every round right after its
timing, for about ``T`` ms of back-to-back replays with no flush between them, and
reads the board's power and SM clock over them (``_power.BoardMeter``, NVML): the GPU
sits at its power limit on these shapes, and whether it idles between calls (as under
``do_bench``'s flush) moves the arms' ratios by up to 10 %, in both directions.  The
second table prints, per arm, its sustained time over cuBLAS's sustained time, its
median power and SM clock.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from _graphs import graphed

HEAD_DIM = 128
WORLDS = (2, 4, 8)
HIDDENS = (3072, 4096, 6144, 8192)
SEQS = (4096, 32768, 131072)
TOLERANCE = dict(atol=1e-2, rtol=1e-2)  # DESIGN.md section 1
EPS = 1e-6


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worlds", default=",".join(map(str, WORLDS)), help="comma list of W")
    p.add_argument("--hiddens", default=",".join(map(str, HIDDENS)), help="comma list")
    p.add_argument("--seqs", default=",".join(map(str, SEQS)), help="comma list of S_global")
    p.add_argument("--rope-style", choices=("interleaved", "neox"), default="neox")
    p.add_argument("--check-rows", type=int, default=1024,
                   help="rows checked against the fp32 reference before timing")
    p.add_argument("--warmup-ms", type=int, default=10)
    p.add_argument("--rep-ms", type=int, default=40, help="time of one do_bench round")
    p.add_argument("--rounds", type=int, default=5, help="rounds per arm (the median is kept)")
    p.add_argument("--kv-heads", default="8",
                   help="K/V heads: a number, or 'mha' for as many as Q heads")
    p.add_argument("--mainloops", type=lambda t: [m.strip() for m in t.split(",") if m.strip()],
                   default=["warp_specialized", "tma"], help="comma list of producer "
                   "mainloops to time side by side (producer.MAINLOOPS); the pick's is added "
                   "when missing")
    p.add_argument("--sustained-ms", type=int, default=0,
                   help="per arm and round, ms of back-to-back replays timed, with NVML's "
                   "power and SM clock read over them (0: not measured)")
    p.add_argument("--json", metavar="PATH", help="also write rows and environment here")
    return p.parse_args(argv)


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


# ----------------------------------------------------------------------------- problem


def make_problem(world: int, hidden: int, seq_global: int, rope_style: str,
                 device: torch.device, kv_heads: str = "8") -> dict:
    """Fresh random inputs for source rank 0, and W local destination buffers
    (``kv_heads``: a number, or ``"mha"``)."""
    # The package is imported where it is used, so that --help works without it.
    from cake_sp.layouts import DestLayout, HeadPlan

    hq = hidden // HEAD_DIM
    plan = HeadPlan(world, hq, hq if kv_heads == "mha" else int(kv_heads), HEAD_DIM)
    rows = seq_global // world
    n = plan.total_heads * HEAD_DIM
    dev = device
    angles = (torch.rand(rows, HEAD_DIM // 2, device=dev) * 2 - 1) * torch.pi
    buffers = [torch.empty(DestLayout.buffer_elements(plan, seq_global), dtype=torch.bfloat16,
                           device=dev) for _ in range(world)]
    return dict(
        plan=plan, rows=rows, hidden=hidden, seq_global=seq_global, rope_style=rope_style,
        x=torch.randn(rows, hidden, device=dev).bfloat16(),
        weight=(torch.randn(n, hidden, device=dev) * hidden ** -0.5).bfloat16(),
        bias=(torch.randn(n, device=dev) * 0.5).bfloat16(),
        q_norm=(1 + 0.3 * torch.randn(HEAD_DIM, device=dev)).bfloat16(),
        k_norm=(1 + 0.3 * torch.randn(HEAD_DIM, device=dev)).bfloat16(),
        cos_sin=torch.cat((angles.cos(), angles.sin()), dim=1),
        dest=DestLayout.for_layout(plan, "bshd", seq_global, seq_len=seq_global),
        buffers=buffers,
        table=torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64, device=dev))


def dest_views(p: dict, rank: int, rows: int) -> dict[str, torch.Tensor]:
    """Source rank 0's first ``rows`` tokens in destination ``rank``'s bshd buffer."""
    plan, s, buf = p["plan"], p["seq_global"], p["buffers"][rank]
    hq, hkv, d = plan.q_per_rank, plan.kv_per_rank, HEAD_DIM
    k0, v0 = s * hq * d, s * (hq + hkv) * d
    return {"q": buf[: s * hq * d].view(s, hq, d)[:rows],
            "k": buf[k0: k0 + s * hkv * d].view(s, hkv, d)[:rows],
            "v": buf[v0: v0 + s * hkv * d].view(s, hkv, d)[:rows]}


# ----------------------------------------------------------------------------- arms


def _launch_arm(p: dict, launch: Callable, **options) -> Callable[[], None]:
    """One call of a producer launcher (either engine) on problem ``p``."""
    def run():
        launch(p["x"], p["weight"], p["bias"], p["q_norm"], p["k_norm"], p["cos_sin"], None,
               plan=p["plan"], dest=p["dest"], dest_table=p["table"], seq_local=p["rows"],
               dest_seq_offset=0, eps=EPS, rope_style=p["rope_style"], **options)
    return run


def producer_arm(p: dict, mainloop: str) -> Callable[[], None]:
    from cake_sp.kernels.producer import qkv_norm_rope_produce

    return _launch_arm(p, qkv_norm_rope_produce, mainloop=mainloop)


def cublas_engine_arm(p: dict) -> Callable[[], None]:
    from cake_sp.kernels.producer_cublas import qkv_norm_rope_produce_cublas

    workspace = torch.empty(p["rows"], p["weight"].shape[0], dtype=torch.float32,
                            device=p["x"].device)
    return _launch_arm(p, qkv_norm_rope_produce_cublas, workspace=workspace)


def cublas_fp32_arm(p: dict) -> Callable[[], None]:
    from cake_sp.kernels.producer_cublas import project_fp32

    out = torch.empty(p["rows"], p["weight"].shape[0], dtype=torch.float32,
                      device=p["x"].device)
    return lambda: project_fp32(p["x"], p["weight"], out)


def _slice(heads: range) -> slice:
    return slice(heads.start, heads.stop)


def cublas_arm(p: dict) -> tuple[Callable[[], None], torch.Tensor]:
    out = torch.empty(p["rows"], p["weight"].shape[0], dtype=torch.bfloat16,
                      device=p["x"].device)

    def run():
        torch.matmul(p["x"], p["weight"].T, out=out)
    return run, out


def unfused_arm(p: dict) -> tuple[Callable[[], None], torch.Tensor]:
    """The baselines' compute (``benchmarks/comm/arms.project_norm_rope``, with the bias):
    cuBLAS bf16 out, then their one QK-norm + RoPE launch in place; returns the run and
    its ``[rows, heads, D]`` output."""
    comm = str(Path(__file__).resolve().parents[1] / "comm")
    if comm not in sys.path:
        sys.path.insert(0, comm)
    from _norm_rope_op import qk_norm_rope_

    plan, rows = p["plan"], p["rows"]
    out = torch.empty(rows, plan.total_heads, HEAD_DIM, dtype=torch.bfloat16,
                      device=p["x"].device)

    def run():
        torch.addmm(p["bias"], p["x"], p["weight"].T, out=out.view(rows, -1))
        qk_norm_rope_(out.view(1, rows, -1, HEAD_DIM), p["q_norm"], p["k_norm"], p["cos_sin"],
                      num_q=plan.num_q_heads, num_k=plan.num_kv_heads,
                      rope_style=p["rope_style"], eps=EPS)
    return run, out


def eager_arm(p: dict) -> Callable[[], None]:
    from cake_sp.layouts import KIND_K, KIND_Q

    plan, d = p["plan"], HEAD_DIM
    hq, hkv = plan.num_q_heads, plan.num_kv_heads
    half = d // 2
    cos, sin = p["cos_sin"][:, None, :half], p["cos_sin"][:, None, half:]

    def norm(t, w):
        tf = t.float()
        return (tf * torch.rsqrt(tf.pow(2).mean(-1, keepdim=True) + EPS)).bfloat16() * w

    def rope(t):
        tf = t.float()
        if p["rope_style"] == "interleaved":
            a, b = tf[..., 0::2], tf[..., 1::2]
            return torch.stack((a * cos - b * sin, b * cos + a * sin), -1).flatten(-2).bfloat16()
        a, b = tf[..., :half], tf[..., half:]
        return torch.cat((a * cos - b * sin, b * cos + a * sin), -1).bfloat16()

    views = [dest_views(p, r, p["rows"]) for r in range(plan.world_size)]
    q_heads = [_slice(plan.source_heads(r, KIND_Q)) for r in range(plan.world_size)]
    kv_heads = [_slice(plan.source_heads(r, KIND_K)) for r in range(plan.world_size)]

    def run():
        qkv = F.linear(p["x"], p["weight"], p["bias"]).view(p["rows"], -1, d)
        q = rope(norm(qkv[:, :hq], p["q_norm"]))
        k = rope(norm(qkv[:, hq: hq + hkv], p["k_norm"]))
        v = qkv[:, hq + hkv:]
        for view, qh, kvh in zip(views, q_heads, kv_heads, strict=True):
            view["q"].copy_(q[:, qh])
            view["k"].copy_(k[:, kvh])
            view["v"].copy_(v[:, kvh])
    return run


# ----------------------------------------------------------------------------- checks


def reference_heads(p: dict, rows: int, round_projection: bool) -> dict[str, torch.Tensor]:
    """``cake_sp.reference`` step by step on the first ``rows`` rows, fp32 ``[rows, H, D]``.

    ``round_projection`` rounds the projection to bf16 before the norm, which is
    the eager arm's math (its GEMM writes bf16); the producer follows the
    contract, where the projection stays fp32.
    """
    from cake_sp import reference

    hq, hkv, d = p["plan"].num_q_heads, p["plan"].num_kv_heads, HEAD_DIM
    proj = reference.project(p["x"][:rows], p["weight"], p["bias"]).view(rows, -1, d)
    if round_projection:
        proj = proj.bfloat16().float()
    cos_sin = p["cos_sin"][:rows]
    out = {name: reference.rope(reference.rms_norm(heads, weight, EPS), cos_sin,
                                p["rope_style"])
           for name, heads, weight in (("q", proj[:, :hq], p["q_norm"]),
                                       ("k", proj[:, hq: hq + hkv], p["k_norm"]))}
    out["v"] = proj[:, hq + hkv:]
    return out


# The arms that round the projection to bf16 (cuBLAS bf16 out): checked against the reference
# fed that rounding, timed even when the check fails.
BASELINES = ("eager", "unfused")


def _flip_tolerance(arm: str) -> dict:
    """``assert_close_counting_flips``' rounding model for ``arm``: a baseline rounds the
    projection once more, and so flips about ten times as often (6 in 524288 at hidden
    8192)."""
    if arm in BASELINES:
        return dict(intermediate_roundings=3, max_flip_fraction=1e-4)
    return dict(intermediate_roundings=2, max_flip_fraction=1e-5)


def check_buffers(p: dict, ref: dict[str, torch.Tensor], rows: int, arm: str) -> None:
    from cake_sp.layouts import KIND_K, KIND_Q, KIND_V
    from cake_sp.testing import assert_close_counting_flips

    plan = p["plan"]
    for r in range(plan.world_size):
        got = dest_views(p, r, rows)
        for kind, name in zip((KIND_Q, KIND_K, KIND_V), "qkv", strict=True):
            assert_close_counting_flips(
                got[name], ref[name][:, _slice(plan.source_heads(r, kind))],
                rope_style=None if name == "v" else p["rope_style"],
                what=f"{arm}: destination {r} {name}", **_flip_tolerance(arm))


def check_heads(p: dict, out: torch.Tensor, ref: dict[str, torch.Tensor], rows: int,
                arm: str) -> None:
    """``out [rows, heads, D]`` (Q, K, V heads in projection order) against ``ref``."""
    from cake_sp.testing import assert_close_counting_flips

    hq, hkv = p["plan"].num_q_heads, p["plan"].num_kv_heads
    for name, heads in (("q", out[:rows, :hq]), ("k", out[:rows, hq: hq + hkv]),
                        ("v", out[:rows, hq + hkv:])):
        assert_close_counting_flips(heads, ref[name], what=f"{arm}: {name}",
                                    rope_style=None if name == "v" else p["rope_style"],
                                    **_flip_tolerance(arm))


def check_projection(p: dict, out: torch.Tensor, rows: int) -> None:
    expected = p["x"][:rows].float() @ p["weight"].float().T
    torch.testing.assert_close(out[:rows].float(), expected, **TOLERANCE)


# ----------------------------------------------------------------------------- driver


def checked_front_ends(p: dict, check_rows: int, mainloops: list[str]
                       ) -> tuple[dict[str, Callable[[], None]], dict[str, str]]:
    """The producer arms, the cuBLAS engine and the two baselines, each run once into
    NaN-poisoned buffers and checked against the reference; returns them and the
    baselines' checks (``"passed"`` or the failure)."""
    arms = {f"producer_{m}": producer_arm(p, m) for m in mainloops}
    arms["cublas_engine"] = cublas_engine_arm(p)
    arms["eager"] = eager_arm(p)
    arms["unfused"], unfused_out = unfused_arm(p)
    checks = {}
    for name, fn in arms.items():
        for b in (*p["buffers"], unfused_out):
            b.fill_(float("nan"))
        fn()
        baseline = name in BASELINES
        ref = reference_heads(p, check_rows, round_projection=baseline)
        try:
            if name == "unfused":
                check_heads(p, unfused_out, ref, check_rows, name)
            else:
                check_buffers(p, ref, check_rows, name)
        except AssertionError as exc:
            if not baseline:
                raise
            checks[name] = str(exc)
        else:
            if baseline:
                checks[name] = "passed"
    return arms, checks


def picked_arm(p: dict) -> str:
    """The arm the session's ``engine="auto"`` runs for ``p``: ``_config.producer_engine``'s
    choice, and on the fused engine the launcher's default mainloop."""
    from cake_sp.kernels import _config
    from cake_sp.kernels.producer import choose_mainloop

    sms = torch.cuda.get_device_properties(p["x"].device).multi_processor_count
    if _config.producer_engine(p["rows"], p["plan"].total_heads, HEAD_DIM, sms,
                               on_gpu=True) == "cublas":
        return "cublas_engine"
    return "producer_" + choose_mainloop(None, p["x"], p["weight"], HEAD_DIM,
                                         _config.PRODUCER_BLOCK_M, on_gpu=True)


def timed(arms: dict[str, Callable[[], None]], args
          ) -> tuple[dict[str, list[float]], dict[str, list[dict]]]:
    """Per arm, ``args.rounds`` medians of ``triton.testing.do_bench`` over graph replays, and
    with ``--sustained-ms`` as many bursts (``_power.BoardMeter.burst``); the rounds
    visit the arms in rotated order, every other one reversed, so drift in the GPU's clock
    spreads over all arms."""
    import triton.testing

    meter = None
    if args.sustained_ms > 0:
        from _power import BoardMeter
        meter = BoardMeter()
    graphs = {name: graphed(fn) for name, fn in arms.items()}
    names = list(graphs)
    samples = {name: [] for name in names}
    board = {name: [] for name in names}
    for r in range(args.rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order[::-1] if r % 2 else order:
            ms = triton.testing.do_bench(graphs[name], warmup=args.warmup_ms, rep=args.rep_ms,
                                         return_mode="median")
            samples[name].append(ms)
            if meter is not None:
                board[name].append(meter.burst(graphs[name],
                                               max(1, round(args.sustained_ms / ms))))
    return samples, board


def bench_row(world: int, hidden: int, seq_global: int, args) -> dict:
    p = make_problem(world, hidden, seq_global, args.rope_style, torch.device("cuda"),
                     args.kv_heads)
    rows, check_rows = p["rows"], min(args.check_rows, p["rows"])
    cublas, cublas_out = cublas_arm(p)
    cublas()
    check_projection(p, cublas_out, check_rows)
    picked = picked_arm(p)
    mainloops = list(args.mainloops)
    if picked.startswith("producer_") and picked[len("producer_"):] not in mainloops:
        mainloops.append(picked[len("producer_"):])
    front_ends, baseline_checks = checked_front_ends(p, check_rows, mainloops)
    samples, board = timed(dict(cublas=cublas, cublas_fp32=cublas_fp32_arm(p), **front_ends),
                           args)
    ms = {name: statistics.median(v) for name, v in samples.items()}
    sustained = {}
    if args.sustained_ms > 0:
        burst_ms = {name: statistics.median(b["ms_per_call"] for b in v)
                    for name, v in board.items()}
        sustained = {name: dict(ms=burst_ms[name], over_cublas=burst_ms[name] / burst_ms["cublas"],
                                watts=statistics.median(b["watts"] for b in v),
                                sm_mhz=statistics.median(b["sm_mhz"] for b in v))
                     for name, v in board.items()}
    engines = [*(f"producer_{m}" for m in mainloops), "cublas_engine"]
    flop = 2 * rows * p["weight"].shape[0] * hidden
    return dict(world=world, hidden=hidden, seq_global=seq_global, rows=rows,
                q_heads=p["plan"].num_q_heads, kv_heads=p["plan"].num_kv_heads, ms=ms,
                samples=samples, over_cublas={a: ms[a] / ms["cublas"] for a in engines},
                unfused_over_cublas=ms["unfused"] / ms["cublas"],
                baseline_checks=baseline_checks, picked=picked,
                picked_over_cublas=ms[picked] / ms["cublas"],
                picked_over_best=ms[picked] / min(ms[a] for a in engines),
                eager_over_picked=ms["eager"] / ms[picked],
                unfused_over_picked=ms["unfused"] / ms[picked], sustained=sustained, board=board,
                picked_tflops=flop / ms[picked] / 1e9, cublas_tflops=flop / ms["cublas"] / 1e9)


def markdown(rows: list[dict]) -> str:
    engines = list(rows[0]["over_cublas"]) if rows else []
    head = (["W", "hidden", "Hq/Hkv", "S_global", "rows", "cublas ms"]
            + [f"{a} / cublas" for a in engines]
            + ["picked", "picked / cublas", "picked / best", "unfused / cublas",
               "unfused / picked", "eager / picked", "picked TFLOP/s", "cublas TFLOP/s"])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = ([r["world"], r["hidden"], f"{r['q_heads']}/{r['kv_heads']}", r["seq_global"],
                  r["rows"], f"{r['ms']['cublas']:.3f}"]
                 + [f"{r['over_cublas'].get(a, float('nan')):.3f}" for a in engines]
                 + [r["picked"], f"{r['picked_over_cublas']:.3f}",
                    f"{r['picked_over_best']:.3f}", f"{r['unfused_over_cublas']:.3f}",
                    f"{r['unfused_over_picked']:.3f}", f"{r['eager_over_picked']:.2f}",
                    f"{r['picked_tflops']:.0f}", f"{r['cublas_tflops']:.0f}"])
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    if rows and rows[0]["sustained"]:
        arms = list(rows[0]["sustained"])
        head = ["W", "hidden", "rows", "cublas sustained ms"] + [
            f"{a}: sustained / cublas, W, MHz" for a in arms]
        lines += ["", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for r in rows:
            e = r["sustained"]
            cells = ([r["world"], r["hidden"], r["rows"], f"{e['cublas']['ms']:.3f}"]
                     + [f"{e[a]['over_cublas']:.3f}, {e[a]['watts']:.0f}, {e[a]['sm_mhz']:.0f}"
                        for a in arms])
            lines.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_producer: needs a CUDA GPU", file=sys.stderr)
        return 2
    rows = []
    for world in _ints(args.worlds):
        for hidden in _ints(args.hiddens):
            for seq_global in _ints(args.seqs):
                row = bench_row(world, hidden, seq_global, args)
                print(json.dumps(row), file=sys.stderr)
                rows.append(row)
                torch.cuda.empty_cache()
    print(markdown(rows))
    if args.json:
        env = dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                   triton=__import__("triton").__version__, argv=sys.argv[1:])
        with open(args.json, "w") as f:
            json.dump(dict(environment=env, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
