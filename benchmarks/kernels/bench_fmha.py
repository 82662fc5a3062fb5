"""Paged FMHA (cake_sp) against torch SDPA's best backend on the same problem, contiguous KV.

Decode rows: B x KV length x Hq/Hkv, D = 128, bf16 or fp8 (e4m3) KV; reported
as achieved GB/s of KV read (the bytes the paged kernel must read), next to
SDPA reading the same KV in bf16 from a contiguous ``[B, Hkv, L, D]`` tensor,
and as a fraction of the measured HBM read bandwidth (``_bandwidth.py``).  Context rows: one
causal sequence of T tokens, GQA 32/8, D = 128, bf16 or fp8 KV (SDPA on the same keys in
bf16); reported in TFLOP/s (causal FLOPs ``2 * 2 * T^2 / 2 * Hq * D``).

Each arm's call is captured once in a CUDA graph; times are CUDA-event medians
over ``--reps`` replays after ``--warmup``, with a 256 MiB L2 flush between
replays.  Replaying a graph leaves the host's launch cost out for both arms, as
in a serving loop that replays its decode step; ``--eager`` times plain calls
instead (the host cost of the Python front end then shows at small rows).
SDPA's best backend is the fastest of cuDNN, FlashAttention and memory-efficient
that accepts the problem (GQA through ``enable_gqa``, so no backend reads
repeated K/V).

    python benchmarks/kernels/bench_fmha.py --json fmha.json [--quick]

The last thing printed is a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from _bandwidth import hbm_bandwidths
from _graphs import graphed

import cake_sp

DECODE_BATCHES = (1, 16, 64, 256)
DECODE_KV_LENS = (1024, 8192, 32768)
DECODE_HEADS = ((32, 8), (64, 8))
CONTEXT_TOKENS = (4096, 8192, 16384, 32768, 65536)
HEAD_DIM = 128


@dataclass(frozen=True)
class Timing:
    warmup: int
    reps: int
    eager: bool = False


def _time_ms(fn, timing: Timing) -> float:
    """Median ms of ``fn`` replayed from a CUDA graph (or called, with ``timing.eager``)."""
    warmup, reps = timing.warmup, timing.reps
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    if not timing.eager:
        fn = graphed(fn)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def sdpa_best_ms(q, k, v, causal: bool, timing: Timing) -> tuple[float, str]:
    """Fastest SDPA backend on ``q [B, Hq, S, D]``, ``k, v [B, Hkv, L, D]``: (ms, name).

    GQA goes through ``enable_gqa`` (no K/V copy); a backend that refuses the
    problem is skipped.
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel

    best = (math.inf, "none")
    for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION,
                    SDPBackend.EFFICIENT_ATTENTION):
        try:
            with sdpa_kernel(backend):
                fn = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                                            enable_gqa=True)
                fn()
                ms = _time_ms(fn, timing)
        except RuntimeError:
            continue
        best = min(best, (ms, backend.name))
    return best


def _paged_problem(b, hkv, length, page_size, kv_dtype):
    """A random HND paged cache ``[pages, 2, Hkv, P, D]`` with a shuffled page table, and the
    same K and V as contiguous bf16 ``[B, Hkv, L, D]`` tensors for SDPA."""
    per = math.ceil(length / page_size)
    cache = torch.randn(b * per, 2, hkv, page_size, HEAD_DIM, device="cuda",
                        dtype=torch.bfloat16).to(kv_dtype)
    table = torch.randperm(b * per, device="cuda").view(b, per).int()

    def contiguous(which):
        # [per, Hkv, P, D] pages -> [Hkv, L, D], one request of K or V at a time: a gather of
        # the whole batch at once needs a second copy of it (B = 256 at 32k keys: 16 GiB more,
        # past an 80 GB card).
        out = torch.empty(b, hkv, length, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        for i in range(b):
            pages = cache[table[i].long(), which].permute(1, 0, 2, 3)
            out[i] = pages.reshape(hkv, per * page_size, HEAD_DIM)[:, :length]
        return out

    return cache, table, contiguous(0), contiguous(1)


def bench_decode(b, length, hq, hkv, fp8, page_size, hbm, timing) -> dict:
    q = torch.randn(b, hq, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    kv_dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
    cache, table, k, v = _paged_problem(b, hkv, length, page_size, kv_dtype)
    seq_lens = torch.full((b,), length, dtype=torch.int32, device="cuda")
    ws = torch.zeros(256 << 20, dtype=torch.uint8, device="cuda")
    out = torch.empty_like(q)
    ours = _time_ms(lambda: cake_sp.batch_decode_with_kv_cache(
        q, cache, ws, table, seq_lens, length, bmm1_scale=HEAD_DIM ** -0.5, out=out),
        timing)
    sdpa_ms, backend = sdpa_best_ms(q[:, :, None], k, v, False, timing)
    kv_bytes = 2 * b * hkv * length * HEAD_DIM * cache.element_size()
    sdpa_bytes = 2 * b * hkv * length * HEAD_DIM * 2
    ours_gbs, sdpa_gbs = kv_bytes / ours / 1e6, sdpa_bytes / sdpa_ms / 1e6
    return dict(op="decode", B=b, kv_len=length, heads=f"{hq}/{hkv}",
                kv="fp8" if fp8 else "bf16", ours_ms=ours, sdpa_ms=sdpa_ms, sdpa_backend=backend,
                ours_gbs=ours_gbs, sdpa_gbs=sdpa_gbs, ours_frac_hbm=ours_gbs / hbm,
                time_ratio=sdpa_ms / ours)


def bench_context(tokens, page_size, timing, fp8=False, hq=32, hkv=8) -> dict:
    q = torch.randn(tokens, hq, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    kv_dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
    cache, table, k, v = _paged_problem(1, hkv, tokens, page_size, kv_dtype)
    lens = torch.tensor([tokens], dtype=torch.int32, device="cuda")
    cu = torch.tensor([0, tokens], dtype=torch.int32, device="cuda")
    # FlashInfer's customary 128 MiB: an FP8 cache's bf16 copy (fp8_staging) takes 32 MiB a KV
    # head at 64k tokens, so there it goes in chunks of 4 heads.
    ws = torch.zeros(128 << 20, dtype=torch.uint8, device="cuda")
    out = torch.empty_like(q)
    ours = _time_ms(lambda: cake_sp.batch_context_with_kv_cache(
        q, cache, ws, table, lens, tokens, tokens, HEAD_DIM ** -0.5, 1.0, 1, cu, cu, out=out),
        timing)
    sdpa_ms, backend = sdpa_best_ms(q.transpose(0, 1)[None].contiguous(), k, v, True, timing)
    flops = 4 * tokens * tokens / 2 * hq * HEAD_DIM
    return dict(op="context", tokens=tokens, heads=f"{hq}/{hkv}", kv="fp8" if fp8 else "bf16",
                ours_ms=ours,
                sdpa_ms=sdpa_ms, sdpa_backend=backend, ours_tflops=flops / ours / 1e9,
                sdpa_tflops=flops / sdpa_ms / 1e9, time_ratio=sdpa_ms / ours)


def markdown(rows: list[dict], hbm: float) -> str:
    lines = [f"HBM read bandwidth: {hbm:.0f} GB/s", "",
             "| op | shape | KV | cake_sp | SDPA (backend) | cake_sp / SDPA |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        if r["op"] == "decode":
            shape = f"B={r['B']} L={r['kv_len']} H={r['heads']}"
            ours = f"{r['ours_gbs']:.0f} GB/s ({r['ours_frac_hbm']:.2f} HBM)"
            sdpa = f"{r['sdpa_gbs']:.0f} GB/s ({r['sdpa_backend']})"
            kv = r["kv"]
        else:
            shape = f"T={r['tokens']} causal H={r['heads']}"
            ours = f"{r['ours_tflops']:.0f} TFLOP/s"
            sdpa = f"{r['sdpa_tflops']:.0f} TFLOP/s ({r['sdpa_backend']})"
            kv = r["kv"]
        lines.append(f"| {r['op']} | {shape} | {kv} | {ours} | {sdpa} | {r['time_ratio']:.2f}x |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", metavar="PATH", help="write every row and setting here")
    parser.add_argument("--quick", action="store_true", help="a few rows only")
    parser.add_argument("--ops", default="decode,context", help="comma list: decode, context")
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--eager", action="store_true",
                        help="time plain calls instead of CUDA-graph replays")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_fmha needs a CUDA GPU")
    timing = Timing(args.warmup, args.reps, args.eager)
    hbm = hbm_bandwidths()["read"] / 1e9
    # One untimed row first: the first row of a run (B = 1, 1k keys) once took about
    # 6x what the same kernel took in another run, while every later row was in line.
    bench_decode(1, 1024, *DECODE_HEADS[0], False, args.page_size, hbm, timing)
    rows = []
    ops = args.ops.split(",")
    if "decode" in ops:
        batches = (16,) if args.quick else DECODE_BATCHES
        lens = (8192,) if args.quick else DECODE_KV_LENS
        for fp8 in (False, True):
            for hq, hkv in DECODE_HEADS:
                for b in batches:
                    for length in lens:
                        rows.append(bench_decode(b, length, hq, hkv, fp8, args.page_size, hbm,
                                                 timing))
                        print(rows[-1], flush=True)
    if "context" in ops:
        for fp8 in (False, True):
            for tokens in ((4096,) if args.quick else CONTEXT_TOKENS):
                rows.append(bench_context(tokens, args.page_size, timing, fp8))
                print(rows[-1], flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "hbm_read_gbs": hbm,
                       "settings": vars(args), "rows": rows}, f, indent=2)
    print(markdown(rows, hbm))


if __name__ == "__main__":
    main()
