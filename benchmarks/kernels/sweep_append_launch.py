"""Launch-shape sweep of the append kernels, the measurement behind ``_config``'s append table.

On one GPU, over the rows of the FlashInfer comparison tool (its rows and inputs are
imported from a copy of it, ``--anchor-dir``), each variant's time per call from a CUDA
graph of 20 calls (median of 30 replays)::

    python benchmarks/kernels/sweep_append_launch.py --part tile --json tile.json
    python benchmarks/kernels/sweep_append_launch.py --part clear --json clear.json

``tile``: tokens a tile program holds (512, 1024, 2048 channels of one head) x warps
(1, 2, 4, 8), BF16 and FP8 (dynamic Q scale), page 16.  ``clear``: the ``(row, kv head)``
pairs of a last page one request program clears (16-256), BF16, pages of 16 and 64.  A
variant patches ``_config`` for its calls; the table itself is edited by hand from the
results (docs/results.md).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

import cake_sp
from cake_sp.kernels import _config

CALLS, REPLAYS = 20, 30


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
    _config.append_clear_pairs = lambda page_size, num_kv_heads: pairs
    outs = h.fresh_outputs(p)
    fn = h.project_arm(cake_sp, p, outs) if op == "bf16" else fp8_call(h, p, outs)
    try:
        graph = h.capture(fn, CALLS)
        return round(statistics.median(h.replay_us(graph, CALLS) for _ in range(REPLAYS)), 3)
    except Exception as e:  # noqa: BLE001 - a variant that does not compile is reported
        return repr(e)[:80]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--part", choices=("tile", "clear"), required=True)
    ap.add_argument("--anchor-dir", default=".anchors/flashinfer_append",
                    help="a copy of the FlashInfer comparison tool (its rows and inputs)")
    ap.add_argument("--json", type=Path, required=True)
    args = ap.parse_args()
    sys.path.insert(0, str(Path(args.anchor_dir).resolve()))
    import bench_append_vs_flashinfer as h

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
