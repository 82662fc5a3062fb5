"""Launch-shape sweep of the append kernels, the measurement behind ``_config``'s append table.

On one GPU, over the rows of the FlashInfer comparison tool (its rows and inputs are
imported from a copy of it, ``--anchor-dir``), each variant's time per call from a CUDA
graph of 20 calls (median of 30 replays)::

    python benchmarks/kernels/sweep_append_launch.py --part tile --json tile.json
    python benchmarks/kernels/sweep_append_launch.py --part clear --json clear.json
    python benchmarks/kernels/sweep_append_launch.py --part order --json order.json

``tile``: tokens a tile program holds (512, 1024, 2048 channels of one head) x warps
(1, 2, 4, 8), BF16 and FP8 (dynamic Q scale), page 16.  ``clear``: the ``(row, kv head)``
pairs of a last page one request program clears (16-256), BF16, pages of 16 and 64.
``order``: every BF16 row (with norm) and the FP8 rows ``--fp8-rows`` names, each on
its own tool's inputs: the table's launch and, request programs first or tile programs
first, clear shares of ``--pairs`` (8-128 pairs), timed A/B/B/A.  ``token``: the BF16 rows
with no more tokens than requests (decode) and no QK norm, the table's launch, tiles of
tokens and token programs of 8, 16 or 32 head slots x 2 or 4 warps, timed A/B/B/A.
A variant patches ``_config`` for its calls; the table itself is edited by hand from the
results (docs/results.md).

    python benchmarks/kernels/sweep_append_launch.py --part token --json token.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import triton

import cake_sp
from cake_sp.kernels import _config

CALLS, REPLAYS = 20, 30


def programs_for(pairs: int):
    """``_config.append_clear_programs`` with shares of ``pairs`` pairs of a page."""
    return lambda page_size, num_kv_heads, num_requests: -(-page_size * num_kv_heads // pairs)


def block_m_for(channels: int):
    """``_config.append_block_m`` with another channel budget."""
    def block_m(num_tokens: int, head_dim: int) -> int:
        cap, block = max(1, channels // head_dim), 1
        while block < min(num_tokens, cap):
            block *= 2
        return block
    return block_m


def fp8_call(h, p: dict, outs):
    """The FP8 op (dynamic Q scale) on the harness problem ``p``."""
    kc = outs[0]
    kc8 = torch.zeros(kc.shape, dtype=torch.float8_e4m3fn, device=kc.device)
    one = torch.ones(1, device=kc.device)
    kw = h.call_kwargs(p)
    return lambda: cake_sp.fused_qk_rmsnorm_rope_quantize_fp8_append_paged_kv_cache(
        qkv=p["qkv"], cos_sin=p["cos_sin"], seq_lens=p["seq_lens"], q_indptr=p["q_indptr"],
        page_indices=p["page_indices"], paged_kv_cache=(kc8, torch.zeros_like(kc8)),
        is_prefill=p["t"] != p["row"].batch, k_scale=one, v_scale=one, quant_policy=1,
        max_seqlen=p["row"].q_len, q_norm_weight=kw["q_norm_weight"],
        k_norm_weight=kw["k_norm_weight"], qk_norm_policy=kw["qk_norm_policy"])


def time_variant(h, p: dict, op: str, channels: int, warps: int, pairs: int) -> float | str:
    _config.append_block_m = block_m_for(channels)
    _config.append_num_warps = lambda num_tokens, num_slots: warps
    _config.append_clear_programs = programs_for(pairs)
    outs = h.fresh_outputs(p)
    fn = h.project_arm(cake_sp, p, outs) if op == "bf16" else fp8_call(h, p, outs)
    try:
        graph = h.capture(fn, CALLS)
        return round(statistics.median(h.replay_us(graph, CALLS) for _ in range(REPLAYS)), 3)
    except Exception as e:  # noqa: BLE001 - a variant that does not compile is reported
        return repr(e)[:80]


def graph_of(h, fn, tiles_first: bool | None = None, pairs: int | None = None):
    """A CUDA graph (the BF16 tool ``h``'s capture) of ``CALLS`` calls of ``fn`` launched with
    the table's shapes but for the given order and clear share, where given (pairs under
    ``APPEND_BLOCK_R`` shrink that block too)."""
    saved = (_config.append_tiles_first, _config.append_clear_programs, _config.APPEND_BLOCK_R)
    if tiles_first is not None:
        _config.append_tiles_first = lambda tile_programs, request_programs: tiles_first
    if pairs is not None:
        _config.append_clear_programs = programs_for(pairs)
        _config.APPEND_BLOCK_R = min(pairs, _config.APPEND_BLOCK_R)
    try:
        return h.capture(fn, CALLS)
    finally:
        _config.append_tiles_first, _config.append_clear_programs, _config.APPEND_BLOCK_R = saved


def interleaved_us(h, graphs: dict, rounds: int, reps: int = 5) -> dict[str, float]:
    """Median us per call of each graph, replayed in turn and back (A/B/B/A) ``rounds`` times."""
    names = list(graphs)
    samples: dict[str, list[float]] = {n: [] for n in names}
    for _ in range(rounds):
        for name in names + names[::-1]:
            samples[name] += [h.replay_us(graphs[name], CALLS) for _ in range(reps)]
    return {n: round(statistics.median(v), 3) for n, v in samples.items()}


def order_part(h, h8, fp8_rows: set[str], pairs: list[int]) -> list[dict]:
    """The ``order`` sweep: each row's arm from its own tool, on that tool's inputs."""
    start, results = time.time(), []
    cases = [("bf16", geometry, row, h.problem_for(row, 2, geometry, torch.device("cuda"), 1))
             for geometry in ("brief", "pr") for row in h.ROWS]
    cases += [("fp8", geometry, row, h8.problem_for(row, geometry, torch.device("cuda"), 1))
              for geometry in ("brief", "pr") for row in h8.ROWS
              if f"{geometry} {row.name}" in fp8_rows]
    for op, geometry, row, p in cases:
        tool = h if op == "bf16" else h8
        fn = tool.project_arm(cake_sp, p, tool.fresh_outputs(p))
        graphs = {"table": graph_of(h, fn)}
        graphs |= {f"p{n} {o}": graph_of(h, fn, o == "T", n) for n in pairs for o in "RT"}
        times = interleaved_us(h, graphs, rounds=3)
        results.append(dict(op=op, geometry=geometry, row=row.name, times=times))
        best = sorted(times, key=times.get)[:3]
        print(f"{op} {geometry:5s} {row.name:24s} table={times['table']:.2f} "
              + " ".join(f"{b}={times[b]:.2f}" for b in best)
              + f"  [{time.time() - start:.0f} s]", flush=True)
    return results


def token_variants() -> dict[str, tuple[bool, int, int]]:
    """The ``token`` part's variants beside the table's own launch: name -> (token programs,
    slots, warps); "tile" is the table's tiles of tokens."""
    variants = {"tile": (False, 0, 0)}
    variants |= {f"s{s} w{w}": (True, s, w) for s, w in ((8, 2), (8, 4), (16, 2), (16, 4),
                                                         (32, 4))}
    return variants


def token_graph(h, fn, variant: tuple[bool, int, int] | None):
    """A CUDA graph of ``CALLS`` calls of ``fn`` with the program shape of ``variant``
    (None: the table's)."""
    saved = (_config.append_token_programs, _config.append_slots_per_token,
             _config.append_num_warps)
    if variant is not None:
        token, slots, warps = variant
        _config.append_token_programs = lambda num_tokens, num_requests: token
        _config.append_slots_per_token = lambda num_slots, head_dim: min(
            slots, triton.next_power_of_2(num_slots))
        if token:
            _config.append_num_warps = lambda num_tokens, num_slots: warps
    try:
        return h.capture(fn, CALLS)
    finally:
        (_config.append_token_programs, _config.append_slots_per_token,
         _config.append_num_warps) = saved


def token_part(h) -> list[dict]:
    """The ``token`` sweep over the BF16 tool's decode rows without QK norm."""
    start, results = time.time(), []
    for geometry in ("brief", "pr"):
        for row in (r for r in h.ROWS if r.q_len == 1):
            results.append(token_row(h, geometry, row, 0))
            print(f"  [{time.time() - start:.0f} s]", flush=True)
    return results


def token_row(h, geometry: str, row, policy: int) -> dict:
    """One row of the ``token`` sweep: every variant's time, A/B/B/A."""
    p = h.problem_for(row, policy, geometry, torch.device("cuda"), 1)
    fn = h.project_arm(cake_sp, p, h.fresh_outputs(p))
    graphs = {"table": token_graph(h, fn, None)}
    graphs |= {n: token_graph(h, fn, v) for n, v in token_variants().items()}
    times = interleaved_us(h, graphs, rounds=3)
    best = sorted(times, key=times.get)[:3]
    print(f"bf16 {geometry:5s} {row.name} n{policy} table={times['table']:.2f} "
          f"tile={times['tile']:.2f} " + " ".join(f"{b}={times[b]:.2f}" for b in best), end="")
    return dict(op="bf16", geometry=geometry, row=f"{row.name} n{policy}", times=times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--part", choices=("tile", "clear", "order", "token"), required=True)
    ap.add_argument("--anchor-dir", default=".anchors/flashinfer_append",
                    help="a copy of the FlashInfer comparison tool (its rows and inputs)")
    ap.add_argument("--json", type=Path, required=True)
    ap.add_argument("--fp8-rows", default="pr P_decode_64x8_q1_n2,pr P_prefill_64x8_q1_n2,"
                    "pr P_prefill_64x8_q2_n2,pr E_prefill_64x8_q128,pr P_decode_8x1_q1_n2,"
                    "brief P_decode_64x8_q1_n2,brief P_prefill_64x8_q2_n2",
                    help="order part: the FP8 rows (geometry name) it covers")
    ap.add_argument("--pairs", default="8,16,32,64,128",
                    help="order part: the clear shares (pairs) it tries in both orders")
    args = ap.parse_args()
    sys.path.insert(0, str(Path(args.anchor_dir).resolve()))
    import bench_append_vs_flashinfer as h
    if args.part == "token":
        args.json.write_text(json.dumps(token_part(h), indent=1))
        return
    if args.part == "order":
        import bench_fp8_append_vs_flashinfer as h8
        results = order_part(h, h8, set(args.fp8_rows.split(",")),
                             [int(n) for n in args.pairs.split(",")])
        args.json.write_text(json.dumps(results, indent=1))
        return

    start, results = time.time(), []
    for geometry in ("brief",) if args.part == "tile" else ("brief", "pr"):
        g = h.GEOMETRIES[geometry]
        for row in h.ROWS:
            p = h.make_problem(row, 2, row.page_size or g["page_size"], g["ctx"],
                               torch.device("cuda"), seed=1)
            if args.part == "tile":
                times = {f"{op} c{c} w{w}": time_variant(h, p, op, c, w, 64)
                         for op in ("bf16", "fp8") for c in (512, 1024, 2048) for w in (1, 2, 4, 8)}
            else:
                times = {f"bf16 p{n}": time_variant(h, p, "bf16", 2048, 4, n)
                         for n in (16, 32, 64, 128, 256)}
            results.append(dict(geometry=geometry, row=row.name, times=times))
            best = sorted((v, k) for k, v in times.items() if isinstance(v, float))[:4]
            print(f"{geometry:5s} {row.name:3s} " + " ".join(f"{k}={v:.2f}" for v, k in best)
                  + f"  [{time.time() - start:.0f} s]", flush=True)
    args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
