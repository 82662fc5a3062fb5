"""The fused producer against cuBLAS alone and against the per-operator eager front end.

One command on one GPU; prints a Markdown table last and can write ``--json PATH``::

    python benchmarks/kernels/bench_producer.py --json producer.json

Rows: ``W in {2, 8}`` x ``hidden in {3072, 4096, 8192}`` (``hidden / 128`` Q
heads, 8 K/V heads, D = 128) x ``S_global in {4096, 32768, 131072}``, one
batch entry, so this rank has ``rows = S_local = S_global / W`` tokens.  Arms,
all on this rank's rows, every destination buffer local (an in-process
pointer table of W buffers, so the stores cost HBM bandwidth, not NVLink):

* ``cublas``: ``x @ qkv_weight.T`` alone (cuBLAS through ``torch.matmul``), bf16 out;
* ``producer``: ``qkv_norm_rope_produce`` without signals, its default launch
  (``--mainloops`` times named mainloops side by side instead, as
  ``producer_<mainloop>``): GEMM + bias + QK RMSNorm + RoPE + stores of every
  head band at its destination's offset;
* ``eager``: the per-operator front end: ``F.linear``, RMSNorm and RoPE as torch
  ops, then one copy per destination and kind into the same buffers;
* ``cublas_fp32``: the GEMM alone with an fp32 output (the cuBLAS engine's first step);
* ``cublas_engine``: the session's second engine
  (``producer_cublas.qkv_norm_rope_produce_cublas``): ``cublas_fp32``, then one Triton
  epilogue kernel.

The eager arm is a baseline: a check of it that fails is recorded in the row
(``eager_check``) and the arm still timed; every other arm must pass.

Each arm is checked against the fp32 reference (``cake_sp.reference``) on the
first ``--check-rows`` rows, atol = rtol = 1e-2, before it is timed; the eager
arm against the same steps from a bf16-rounded projection, which is its math.  Each
arm is captured once in a CUDA graph and timed as medians of
``triton.testing.do_bench`` over replays (L2 flushed before every replay), so the
host's launch cost is left out of every arm; inputs fresh random per row.
``TFLOP/s`` counts the projection's ``2 * rows * N * hidden``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F
from _graphs import graphed

HEAD_DIM = 128
NUM_KV_HEADS = 8
WORLDS = (2, 8)
HIDDENS = (3072, 4096, 8192)
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
    p.add_argument("--warmup-ms", type=int, default=25)
    p.add_argument("--rep-ms", type=int, default=200)
    p.add_argument("--mainloops", type=lambda t: [m.strip() or None for m in t.split(",")],
                   default=[None], help="comma list of producer mainloops to time side by side "
                   "(producer.MAINLOOPS; empty: the launch default); the first is the one "
                   "the eager and TFLOP/s columns use")
    p.add_argument("--json", metavar="PATH", help="also write rows and environment here")
    return p.parse_args(argv)


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


# ----------------------------------------------------------------------------- problem


def make_problem(world: int, hidden: int, seq_global: int, rope_style: str,
                 device: torch.device) -> dict:
    """Fresh random inputs for source rank 0, and W local destination buffers."""
    # The package is imported where it is used, so that --help works without it.
    from cake_sp.layouts import DestLayout, HeadPlan

    hq = hidden // HEAD_DIM
    plan = HeadPlan(world, hq, NUM_KV_HEADS, HEAD_DIM)
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


def producer_arm(p: dict, mainloop: str | None) -> Callable[[], None]:
    from cake_sp.kernels.producer import qkv_norm_rope_produce

    return _launch_arm(p, qkv_norm_rope_produce, mainloop=mainloop)


def _producer_arm_names(mainloops: list[str | None]) -> list[str]:
    return ["producer" if m is None else f"producer_{m}" for m in mainloops]


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

    hq, d = p["plan"].num_q_heads, HEAD_DIM
    proj = reference.project(p["x"][:rows], p["weight"], p["bias"]).view(rows, -1, d)
    if round_projection:
        proj = proj.bfloat16().float()
    cos_sin = p["cos_sin"][:rows]
    out = {name: reference.rope(reference.rms_norm(heads, weight, EPS), cos_sin,
                                p["rope_style"])
           for name, heads, weight in (("q", proj[:, :hq], p["q_norm"]),
                                       ("k", proj[:, hq: hq + NUM_KV_HEADS], p["k_norm"]))}
    out["v"] = proj[:, hq + NUM_KV_HEADS:]
    return out


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
                what=f"{arm}: destination {r} {name}",
                # The eager arm rounds the projection to bf16 too (cuBLAS bf16 out).
                intermediate_roundings=3 if arm == "eager" else 2,
                # ... and so flips about ten times as often (6 in 524288 at hidden 8192).
                max_flip_fraction=1e-4 if arm == "eager" else 1e-5)


def check_projection(p: dict, out: torch.Tensor, rows: int) -> None:
    expected = p["x"][:rows].float() @ p["weight"].float().T
    torch.testing.assert_close(out[:rows].float(), expected, **TOLERANCE)


# ----------------------------------------------------------------------------- driver


def checked_front_ends(p: dict, check_rows: int, mainloops: list[str | None]
                       ) -> tuple[dict[str, Callable[[], None]], str]:
    """The producer arm(s), the cuBLAS engine and the eager arm, each run once into
    NaN-poisoned buffers and checked against the reference; returns them and the eager
    arm's check (``"passed"`` or its failure)."""
    arms = {name: producer_arm(p, m) for name, m in zip(_producer_arm_names(mainloops),
                                                         mainloops, strict=True)}
    arms["cublas_engine"] = cublas_engine_arm(p)
    arms["eager"] = eager_arm(p)
    eager_check = "passed"
    for name, fn in arms.items():
        for b in p["buffers"]:
            b.fill_(float("nan"))
        fn()
        ref = reference_heads(p, check_rows, round_projection=name == "eager")
        try:
            check_buffers(p, ref, check_rows, name)
        except AssertionError as exc:
            if name != "eager":
                raise
            eager_check = str(exc)
    return arms, eager_check


def bench_row(world: int, hidden: int, seq_global: int, args) -> dict:
    import triton.testing

    p = make_problem(world, hidden, seq_global, args.rope_style, torch.device("cuda"))
    rows, check_rows = p["rows"], min(args.check_rows, p["rows"])
    cublas, cublas_out = cublas_arm(p)
    cublas()
    check_projection(p, cublas_out, check_rows)
    front_ends, eager_check = checked_front_ends(p, check_rows, args.mainloops)
    arms = dict(cublas=cublas, cublas_fp32=cublas_fp32_arm(p), **front_ends)
    ms = {name: triton.testing.do_bench(graphed(fn), warmup=args.warmup_ms, rep=args.rep_ms,
                                        return_mode="median") for name, fn in arms.items()}
    from cake_sp.kernels import _config

    flop = 2 * rows * p["weight"].shape[0] * hidden
    first = _producer_arm_names(args.mainloops)[0]
    picked = _config.producer_engine(rows, on_gpu=True)  # what the session's "auto" runs
    return dict(world=world, hidden=hidden, seq_global=seq_global, rows=rows,
                q_heads=p["plan"].num_q_heads, kv_heads=NUM_KV_HEADS, ms=ms,
                over_cublas={a: ms[a] / ms["cublas"]
                             for a in [*_producer_arm_names(args.mainloops), "cublas_engine"]},
                eager_check=eager_check, picked=picked,
                picked_over_cublas=ms["cublas_engine" if picked == "cublas" else first]
                / ms["cublas"],
                eager_over_producer=ms["eager"] / ms[first],
                producer_tflops=flop / ms[first] / 1e9,
                cublas_tflops=flop / ms["cublas"] / 1e9)


def markdown(rows: list[dict]) -> str:
    arms = list(rows[0]["ms"]) if rows else []
    producers = list(rows[0]["over_cublas"]) if rows else []
    head = (["W", "hidden", "S_global", "rows"] + [f"{a} ms" for a in arms]
            + [f"{a} / cublas" for a in producers]
            + ["table picks", "picked / cublas", "eager / producer", "producer TFLOP/s",
               "cublas TFLOP/s"])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = ([r["world"], r["hidden"], r["seq_global"], r["rows"]]
                 + [f"{r['ms'][a]:.3f}" for a in arms]
                 + [f"{r['over_cublas'][a]:.3f}" for a in producers]
                 + [r["picked"], f"{r['picked_over_cublas']:.3f}",
                    f"{r['eager_over_producer']:.2f}",
                    f"{r['producer_tflops']:.0f}", f"{r['cublas_tflops']:.0f}"])
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
