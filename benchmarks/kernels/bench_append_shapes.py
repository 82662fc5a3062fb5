"""The append kernels beyond the anchor's shapes: each shape beside the anchor shape it is
nearest to, timed in the same process.

FlashInfer's Cake append kernels (``../shared/anchors/flashinfer_append``) cover D = 128,
NHD caches and the heads ``(8, 1)`` and ``(64, 8)``, after 1,000-2,048 cached tokens.  Ours
take any GQA, D 64/128/256, both layouts, any page size and any context, and must be no
slower there than on the nearest shape the anchor covers.  Each row here changes one thing
of an anchor row (its *base*: the anchor's batch, new tokens and heads, D = 128, NHD, pages
of 16 after 1,000 cached tokens) and compares per byte where the new shape moves more::

    ratio = time(shape) / (time(base) * max(1, bytes(shape) / bytes(base)))

so 1.0 or less is no slower than the base (and no slower per byte than it where the shape
moves more).  Bytes are ``bench_qk_rope_append.bytes_moved``'s.  Every shape and its
base run as CUDA graphs of ``--calls-per-graph`` calls (L2 warm, as the anchor times),
the two replayed alternately (A/B/B/A) for ``--rounds`` rounds, medians.  Each arm has
``--instances`` graphs, each over inputs of its own (fresh random values and page table,
other addresses), taken in turn round by round: two graphs of one problem differ by up to
about 3 % on one GPU, which a single graph an arm would count as the shape's::

    python benchmarks/kernels/bench_append_shapes.py --json append_shapes.json

Prints one Markdown table last, a row per shape, the rows over ``--limit``, and of those
the ones beyond their base's own spread: the same base problem, timed beside each of its
shapes, gives one median each, and their largest over smallest is the run's noise there.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from bench_qk_rope_append import (
    HEAD_DIM,
    bytes_moved,
    calls_graph,
    fused_call,
    make_problem,
    sample_us,
)


@dataclass(frozen=True)
class Base:
    """An anchor row: ``batch`` requests appending ``new`` tokens each, ``heads = (Hq, Hkv)``."""

    name: str
    batch: int
    new: int
    heads: tuple[int, int]


# Anchor rows (the harness's names): decode at both head counts, a short and a long prefill.
BASES = (Base("M1", 32, 1, (8, 1)), Base("H3", 128, 1, (64, 8)),
         Base("H4", 1, 128, (64, 8)), Base("L1", 1, 1024, (8, 1)))
# What a shape changes of its base (one thing each): heads, head dim, layout, page size.
HEADS = {(8, 1): ((16, 2), (6, 1), (8, 8)), (64, 8): ((32, 8), (40, 8), (32, 4))}
HEAD_DIMS = (64, 256)
PAGE_SIZES = (1, 32, 256)
PREFIX = 1000
# A long context with the base's last-page tail at every page size up to 256 (32,000 is
# 125 x 256): the page table a request program could walk is 33 times the base's.
LONG_PREFIX = PREFIX + 32_000
BASE_PAGE = 16


@dataclass(frozen=True)
class Shape:
    """One call shape: a base's batch and new tokens with these heads, D, layout, pages,
    after ``prefix`` cached tokens."""

    heads: tuple[int, int]
    head_dim: int = HEAD_DIM
    kv_layout: str = "NHD"
    page_size: int = BASE_PAGE
    prefix: int = PREFIX

    def label(self, base: Base) -> str:
        changed = [f"heads {self.heads}" if self.heads != base.heads else "",
                   f"D {self.head_dim}" if self.head_dim != HEAD_DIM else "",
                   self.kv_layout if self.kv_layout != "NHD" else "",
                   f"page {self.page_size}" if self.page_size != BASE_PAGE else "",
                   f"prefix {self.prefix}" if self.prefix != PREFIX else ""]
        return ", ".join(c for c in changed if c) or "base"


def shapes_of(base: Base) -> list[Shape]:
    """The shapes compared with ``base``: each changes one thing of it."""
    return ([Shape(h) for h in HEADS[base.heads]]
            + [Shape(base.heads, head_dim=d) for d in HEAD_DIMS]
            + [Shape(base.heads, kv_layout="HND")]
            + [Shape(base.heads, page_size=ps) for ps in PAGE_SIZES]
            + [Shape(base.heads, prefix=LONG_PREFIX)])


def problem_of(base: Base, shape: Shape, quant: int, norm: int) -> dict:
    """``bench_qk_rope_append``'s inputs for ``shape`` at ``base``'s batch and new tokens."""
    return make_problem(base.batch, base.new, shape.heads, quant, norm, page_size=shape.page_size,
                        prefix=shape.prefix, head_dim=shape.head_dim,
                        kv_layout=shape.kv_layout)


def per_byte_ratio(time_us: float, moved: int, base_us: float, base_moved: int) -> float:
    """``time / (base time * max(1, bytes / base bytes))``: above 1, slower than the base
    (per byte where the shape moves more)."""
    return time_us / (base_us * max(1.0, moved / base_moved))


def instances(base: Base, shape: Shape, quant: int, norm: int, args) -> list[Callable[[], None]]:
    """``--instances`` graphs of ``shape``'s call, each over inputs of its own."""
    return [calls_graph(fused_call(problem_of(base, shape, quant, norm)), args.calls_per_graph)
            for _ in range(args.instances)]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quant", default="0,2", help="comma list: 0 BF16 op, 1/2 FP8 quant_policy")
    p.add_argument("--norm", default="2,0", help="comma list of qk_norm_policy values")
    p.add_argument("--bases", default=",".join(b.name for b in BASES))
    p.add_argument("--calls-per-graph", type=int, default=20)
    p.add_argument("--replays", type=int, default=5, help="replays a sample")
    p.add_argument("--rounds", type=int, default=12, help="A/B/B/A rounds")
    p.add_argument("--instances", type=int, default=3,
                   help="graphs an arm, each over inputs of its own, taken in turn")
    p.add_argument("--limit", type=float, default=1.0, help="ratios above this are listed")
    p.add_argument("--json", metavar="PATH", help="also write rows and environment here")
    return p.parse_args(argv)


def time_pair(a: Sequence[Callable[[], None]], b: Sequence[Callable[[], None]],
              args) -> tuple[float, float, float]:
    """Medians of the graphs ``a`` and of ``b`` (instances of one problem each) over A/B/B/A
    rounds, round ``i`` taking instance ``i`` of each in turn, and the largest over the
    smallest of ``a``'s instances' own medians (how far where the buffers fall moves it)."""
    times: tuple[dict, dict] = ({}, {})
    for i in range(args.rounds):
        for which in (0, 1, 1, 0):
            replays = (a, b)[which]
            times[which].setdefault(i % len(replays), []).append(
                sample_us(replays[i % len(replays)], args.calls_per_graph, args.replays))
    medians = [statistics.median(sum(t.values(), [])) for t in times]
    per_instance = [statistics.median(t) for t in times[0].values()]
    return medians[0], medians[1], max(per_instance) / min(per_instance)


def markdown(rows: list[dict], limit: float) -> str:
    lines = ["| base | op | norm | shape | base us | shape us | bytes / base's | ratio |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['base']} | {r['op']} | {r['norm']} | {r['shape']} | "
                     f"{r['base_us']:.2f} | {r['shape_us']:.2f} | {r['bytes_ratio']:.2f} | "
                     f"{r['ratio']:.3f} |")
    over = [r for r in rows if r["ratio"] > limit]
    spread = base_spread(rows)
    beyond = [r for r in over if r["ratio"] > spread[group_of(r)]]
    lines += ["", f"{len(over)} of {len(rows)} shapes above {limit}: "
              + ("; ".join(f"{r['base']} {r['op']} norm {r['norm']} {r['shape']} "
                           f"{r['ratio']:.3f}" for r in over) or "none"),
              f"Each base's own medians, one a shape, spread by {min(spread.values()):.3f}-"
              f"{max(spread.values()):.3f}x (largest over smallest) within the run; above "
              f"its base's spread: " + ("; ".join(
                  f"{r['base']} {r['op']} norm {r['norm']} {r['shape']} {r['ratio']:.3f} "
                  f"(spread {spread[group_of(r)]:.3f})" for r in beyond) or "none")]
    instance = [r["base_instance_spread"] for r in rows if "base_instance_spread" in r]
    if instance:
        lines.append(f"A base's instances (graphs over inputs of their own) spread by "
                     f"{min(instance):.3f}-{max(instance):.3f}x beside one shape.")
    return "\n".join(lines)


def group_of(row: dict) -> tuple:
    """The rows timed beside the same base problem: base, op and norm policy."""
    return row["base"], row["op"], row["norm"]


def base_spread(rows: list[dict]) -> dict[tuple, float]:
    """Per group, the largest over the smallest of its base's medians (one beside each
    shape): how far the same problem's time moves within the run, the ratios' noise."""
    times: dict[tuple, list[float]] = {}
    for r in rows:
        times.setdefault(group_of(r), []).append(r["base_us"])
    return {g: max(t) / min(t) for g, t in times.items()}


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_append_shapes: needs a CUDA GPU", file=sys.stderr)
        return 2
    by_name = {b.name: b for b in BASES}
    unknown = set(args.bases.split(",")) - set(by_name)
    if unknown:
        print(f"bench_append_shapes: --bases must name rows of {sorted(by_name)}, got "
              f"{sorted(unknown)}", file=sys.stderr)
        return 2
    rows = []
    for base in (by_name[n] for n in args.bases.split(",")):
        for quant in (int(x) for x in args.quant.split(",")):
            for norm in (int(x) for x in args.norm.split(",")):
                base_p = problem_of(base, Shape(base.heads), quant, norm)
                base_replays = instances(base, Shape(base.heads), quant, norm, args)
                base_moved = bytes_moved(base_p)
                for shape in shapes_of(base):
                    p = problem_of(base, shape, quant, norm)
                    base_us, shape_us, spread = time_pair(
                        base_replays, instances(base, shape, quant, norm, args), args)
                    r = dict(base=base.name, op="bf16" if quant == 0 else f"fp8 q{quant}",
                             norm=norm, shape=shape.label(base), base_us=base_us,
                             shape_us=shape_us, bytes_ratio=bytes_moved(p) / base_moved,
                             ratio=per_byte_ratio(shape_us, bytes_moved(p), base_us, base_moved),
                             base_instance_spread=spread)
                    rows.append(r)
                    print(json.dumps(r), file=sys.stderr)
    if args.json:
        env = dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                   args=vars(args))
        with open(args.json, "w") as f:
            json.dump(dict(environment=env, rows=rows), f, indent=1)
    print(markdown(rows, args.limit))
    return 0


if __name__ == "__main__":
    sys.exit(main())
