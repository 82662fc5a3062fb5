"""The fused QKV + QK norm + RoPE + Ulysses exchange session against per-operator baselines.

Run under torchrun, one rank per GPU (docs/benchmarks.md has the details)::

    torchrun --standalone --nproc-per-node=8 \\
        benchmarks/comm/bench_qkv_norm_rope_exchange_overlap.py \\
        --rows representative --json out/w8.json --plot out/w8.png

Rows are ``W`` (the launch) x ``hidden`` x ``S_global`` (``--rows``); arms are
the session on ``nvlink`` and ``nccl`` and baselines B1-B4 (``arms.py``).
Every arm is checked against ``cake_sp.reference`` before it is timed.
``--device cpu`` runs the same harness on gloo with the Triton interpreter
(tiny rows, wall-clock time), which is how CI smoke-tests it.
"""

from __future__ import annotations

import argparse
import sys

import torch

from _harness import DIST_BACKENDS, set_safe_env, use_interpreter_if_cpu

# Before any process group exists: NCCL and NVSHMEM read these at initialisation.
set_safe_env()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0],
        epilog="Rows: presets representative|full|tiny, or names like h4096_s32k, "
               "h4096_q32kv8_s32k (an unknown name lists every valid one).")
    parser.add_argument("--rows", default="representative" if cuda else "tiny",
                        help="comma-separated presets and/or row names")
    parser.add_argument("--arms", type=lambda s: [a.strip() for a in s.split(",")],
                        help="comma-separated arms (default: all): fused_nvlink, fused_nccl, "
                             "b1_three_a2a, b2_packed_a2a, b3_band_overlap, b4_yunchang")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if cuda else "cpu")
    parser.add_argument("--dist-backend", choices=DIST_BACKENDS, default="auto",
                        help="auto: nccl with one GPU per rank, gloo otherwise (shared GPU, CPU)")
    parser.add_argument("--samples", type=int, default=30 if cuda else 4,
                        help="timed samples per arm (two per counterbalanced round)")
    parser.add_argument("--warmup", type=int, default=3 if cuda else 1,
                        help="untimed calls per arm before the rounds")
    parser.add_argument("--attempts", type=int, default=2 if cuda else 1,
                        help="re-time a row whose A/A spread exceeds 1%% up to this many times "
                             "(every attempt is kept in the JSON)")
    parser.add_argument("--ceiling-samples", type=int, default=10 if cuda else 3,
                        help="samples per matmul shape and per link size")
    parser.add_argument("--link-sizes", type=lambda s: tuple(int(v) for v in s.split(",")),
                        help="all_to_all_single bytes per rank for the link sweep")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--delay-rank", type=int, default=0,
                        help="rank whose host sleeps --delay-ms before every sample")
    parser.add_argument("--delay-ms", type=float, default=0.0,
                        help="launch skew made on purpose (a check that the device barrier "
                             "keeps it out of the times; it shows in the skew column)")
    parser.add_argument("--json", help="write every raw sample, the order and the environment")
    parser.add_argument("--markdown", help="also write the printed tables to this file")
    parser.add_argument("--plot", help="write a PNG of the speedups here")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    use_interpreter_if_cpu(args.device)
    # Imported only now: cake_sp compiles its Triton kernels for the interpreter or the
    # GPU at import, so the switch above must come first.
    from driver import run

    return run(args)


if __name__ == "__main__":
    sys.exit(main())
