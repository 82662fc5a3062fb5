"""Fused QK RMSNorm + RoPE (+ FP8 quantize) + paged KV append against a step-wise torch pipeline.

One command on one GPU; prints a Markdown table last and can write ``--json PATH``::

    python benchmarks/kernels/bench_qk_rope_append.py --json append.json

Rows: decode ``B in {1, 32, 128, 256}`` (one new token each) and prefill
``Q in {16, 128, 1024}`` new tokens for each of ``--prefill-requests`` requests,
x heads ``(8, 1), (64, 8)`` x quant (0 = BF16 op, 1 dynamic / 2 static FP8 op)
x qk_norm_policy ``0/1/2``.  Columns, all per call, in microseconds:

* ``fused graph``: one CUDA graph holding ``--calls-per-graph`` back-to-back
  calls, replayed; launch overhead amortised, so this is the kernel's time;
* ``fused eager``: the Python call (launcher + kernel), synchronising at the end;
* ``floor``: ``max(bytes moved / HBM read + write bandwidth, launch floor)``, the
  bandwidth measured by a kernel (``_bandwidth.py``), bytes
  counted from the actual metadata (``qkv`` and ``cos_sin`` rows read, Q/K/V
  written, last-page tails zeroed, ``q_scale``); the launch floor is one tiny
  kernel per graph node, measured the same way;
* ``step graph`` / ``step eager``: RMSNorm, RoPE, quantize and ``index_put``
  append (plus the tail clear) as separate torch ops, as a graph and eagerly.

L2 stays warm between calls (decode inputs fit in L2), so a ratio to the HBM
floor below 1 is possible for the smallest rows.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections.abc import Callable

import torch
from _bandwidth import hbm_bandwidths
from _graphs import graphed

HEADS = ((8, 1), (64, 8))
DECODE_B = (1, 32, 128, 256)
PREFILL_Q = (16, 128, 1024)
HEAD_DIM = 128
FP8 = torch.float8_e4m3fn


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=("all", "decode", "prefill"), default="all")
    p.add_argument("--quant", default="0,1,2", help="comma list: 0 BF16 op, 1/2 FP8 quant_policy")
    p.add_argument("--norm", default="0,1,2", help="comma list of qk_norm_policy values")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--prefix", type=int, default=1000, help="tokens already cached per request")
    p.add_argument("--prefill-requests", type=int, default=4)
    p.add_argument("--calls-per-graph", type=int, default=20)
    p.add_argument("--replays", type=int, default=20)
    p.add_argument("--eager-iters", type=int, default=50)
    p.add_argument("--json", metavar="PATH", help="also write rows and environment here")
    return p.parse_args(argv)


# ----------------------------------------------------------------------------- timing


def calls_graph(fn: Callable[[], None], calls: int) -> Callable[[], None]:
    """A replay of one CUDA graph holding ``calls`` back-to-back calls of ``fn``."""
    def calls_in_a_row():
        for _ in range(calls):
            fn()
    return graphed(calls_in_a_row)


def sample_us(replay: Callable[[], None], calls: int, replays: int = 1) -> float:
    """Microseconds per call of one sample: ``replays`` replays of a ``calls``-call graph."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / (calls * replays)


def time_graph(fn: Callable[[], None], calls: int, replays: int) -> float:
    """Microseconds per call of ``fn``: a graph of ``calls`` calls, replayed ``replays`` times
    after one warm replay, the median replay."""
    replay = calls_graph(fn, calls)
    replay()
    return statistics.median(sample_us(replay, calls) for _ in range(replays))


def time_eager(fn: Callable[[], None], iters: int) -> float:
    """Microseconds per call, host launch overhead included."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / iters


def launch_floor_us() -> float:
    """Per-node time of a graph of one-element kernels."""
    x = torch.zeros(1, device="cuda")
    return time_graph(lambda: x.add_(1.0), calls=100, replays=10)


# ----------------------------------------------------------------------------- problem


def make_problem(num_req: int, new: int, heads: tuple[int, int], quant: int, norm: int, *,
                 page_size: int, prefix: int, head_dim: int = HEAD_DIM,
                 kv_layout: str = "NHD") -> dict:
    """Inputs of one call: ``num_req`` requests of ``prefix`` cached tokens appending ``new``
    each, ``heads = (Hq, Hkv)``, caches of ``kv_layout`` (NHD ``[pages, page, Hkv, D]`` or
    HND ``[pages, Hkv, page, D]``) in a shuffled page table."""
    hq, hkv = heads
    dev, d, ps = "cuda", head_dim, page_size
    seq = prefix + new
    pages_per_req = -(-seq // ps)
    num_pages = num_req * pages_per_req + 8
    t = num_req * new
    cache_dtype = torch.bfloat16 if quant == 0 else FP8
    cache_shape = (num_pages, ps, hkv, d) if kv_layout == "NHD" else (num_pages, hkv, ps, d)
    max_pos = seq + 1
    inv_freq = 1.0 / 10000 ** (torch.arange(0, d, 2, device=dev, dtype=torch.float64) / d)
    ang = torch.arange(max_pos, device=dev, dtype=torch.float64)[:, None] * inv_freq
    return dict(
        qkv=(torch.randn(t, (hq + 2 * hkv) * d, device=dev) * 3).to(torch.bfloat16),
        cos_sin=torch.cat([ang.cos(), ang.sin()], 1).float(),
        seq_lens=torch.full((num_req,), seq, dtype=torch.int32, device=dev),
        q_indptr=torch.arange(0, t + 1, new, dtype=torch.int32, device=dev),
        page_indices=torch.randperm(num_pages, device=dev)[:num_req * pages_per_req]
        .view(num_req, pages_per_req).to(torch.int32),
        caches=[torch.zeros(cache_shape, device=dev, dtype=cache_dtype) for _ in range(2)],
        weights=[torch.rand(d, device=dev) + 0.5 for _ in range(2)],
        scales=[torch.tensor([s], device=dev) for s in (0.01, 0.02, 150.0)],
        hq=hq, hkv=hkv, d=d, page_size=ps, kv_layout=kv_layout, quant=quant, norm=norm,
        num_req=num_req, new=new, seq=seq, t=t, max_seqlen=new, prefill=new > 1)


def bytes_moved(p: dict) -> int:
    """Bytes the op must move at least, from the metadata."""
    t, hq, hkv, d, page_size = p["t"], p["hq"], p["hkv"], p["d"], p["page_size"]
    out_elt = 2 if p["quant"] == 0 else 1
    read = t * (hq + 2 * hkv) * d * 2 + t * d * 4
    write = t * (hq + 2 * hkv) * d * out_elt
    tail_rows = (-p["seq"]) % page_size
    write += p["num_req"] * tail_rows * hkv * d * out_elt * 2
    if p["quant"] == 1:
        write += t * hq * 4
    return read + write


def fused_call(p: dict) -> Callable[[], None]:
    import cake_sp

    kw = dict(qk_norm_policy=p["norm"], q_norm_weight=p["weights"][0],
              k_norm_weight=p["weights"][1], kv_layout=p["kv_layout"])
    args = (p["qkv"], p["cos_sin"], p["seq_lens"], p["q_indptr"], p["page_indices"])
    if p["quant"] == 0:
        out_q = torch.empty(p["t"], p["hq"], p["d"], dtype=torch.bfloat16, device="cuda")
        return lambda: cake_sp.fused_qk_rmsnorm_rope_append_paged_kv_cache(
            *args, *p["caches"], num_q_heads=p["hq"], num_kv_heads=p["hkv"], out_q=out_q, **kw)
    out = cake_sp.fused_qk_rmsnorm_rope_quantize_fp8_append_paged_kv_cache(
        *args, tuple(p["caches"]), p["prefill"], p["scales"][0], p["scales"][1], p["quant"],
        max_seqlen=p["max_seqlen"], q_scale_inv=p["scales"][2], **kw)
    return lambda: cake_sp.fused_qk_rmsnorm_rope_quantize_fp8_append_paged_kv_cache(
        *args, tuple(p["caches"]), p["prefill"], p["scales"][0], p["scales"][1], p["quant"],
        max_seqlen=p["max_seqlen"], q_scale_inv=p["scales"][2], out_q=out[0], q_scale=out[1],
        split_k_flag=out[2], **kw)


def stepwise_call(p: dict) -> Callable[[], None]:
    """The same step as separate torch ops (NHD caches); no host sync, so it can be captured."""
    hq, hkv, d, t, page_size = p["hq"], p["hkv"], p["d"], p["t"], p["page_size"]
    tok = torch.arange(t, device="cuda")

    def rmsnorm(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w

    def rope(x, cs):
        a, b = x[..., : d // 2], x[..., d // 2:]
        cos, sin = cs[:, None, : d // 2], cs[:, None, d // 2:]
        return torch.cat([a * cos - b * sin, b * cos + a * sin], -1)

    def quant(x, scale):
        return (x / scale).clamp(-448, 448).to(FP8)

    def run():
        indptr, seq_lens = p["q_indptr"], p["seq_lens"]
        req = torch.searchsorted(indptr[1:], tok, right=True)
        n = indptr[req + 1] - indptr[req]
        pos = tok - indptr[req] + seq_lens[req] - n
        page = p["page_indices"][req, pos // page_size]
        row = pos % page_size
        x = p["qkv"].float().view(t, hq + 2 * hkv, d)
        cs = p["cos_sin"][pos]
        qk = x[:, : hq + hkv]
        if p["norm"] == 2:
            qk = torch.cat([rmsnorm(qk[:, :hq], p["weights"][0]),
                            rmsnorm(qk[:, hq:], p["weights"][1])], 1)
        qk = rope(qk, cs)
        if p["norm"] == 1:
            qk = torch.cat([rmsnorm(qk[:, :hq], p["weights"][0]),
                            rmsnorm(qk[:, hq:], p["weights"][1])], 1)
        q, k, v = qk[:, :hq], qk[:, hq:], x[:, hq + hkv:]
        if p["quant"] == 0:
            q, k, v = q.bfloat16(), k.bfloat16(), v.bfloat16()
        else:
            if p["quant"] == 1:
                q_scale = q.abs().amax(-1, keepdim=True).clamp_min(1e-6) / 448.0
                q = quant(q, q_scale)
            else:
                q = quant(q, 1.0 / p["scales"][2])
            k, v = quant(k, p["scales"][0]), quant(v, p["scales"][1])
        for cache, val in zip(p["caches"], (k, v), strict=True):
            cache.index_put_((page, row), val)
            last = p["page_indices"].gather(1, ((seq_lens - 1) // page_size).long()[:, None])[:, 0]
            rows = torch.arange(page_size, device="cuda")
            tail = rows[None, :] >= (seq_lens % page_size)[:, None]
            tail &= (seq_lens % page_size != 0)[:, None]
            raw = cache.view(torch.uint8)  # zero bits in any dtype; FP8 has no masked_fill
            raw[last] = raw[last].masked_fill(tail[:, :, None, None], 0)

    return run


# ----------------------------------------------------------------------------- main


def rows_for(args) -> list[tuple[str, int, int]]:
    out = []
    if args.mode in ("all", "decode"):
        out += [("decode", b, 1) for b in DECODE_B]
    if args.mode in ("all", "prefill"):
        out += [("prefill", args.prefill_requests, q) for q in PREFILL_Q]
    return out


def markdown(rows: list[dict]) -> str:
    head = ("| mode | B | Q | (Hq,Hkv) | quant | norm | fused graph us | fused eager us | floor us "
            "| fused/floor | step graph us | step eager us | step graph / fused graph |")
    lines = [head, "|" + "---|" * 13]
    for r in rows:
        lines.append(
            f"| {r['mode']} | {r['B']} | {r['Q']} | {tuple(r['heads'])} | {r['quant']} | "
            f"{r['norm']} | {r['fused_graph_us']:.2f} | {r['fused_eager_us']:.1f} | "
            f"{r['floor_us']:.2f} | {r['fused_over_floor']:.2f} | {r['step_graph_us']:.1f} | "
            f"{r['step_eager_us']:.1f} | {r['speedup_vs_step_graph']:.1f}x |")
    ratios = [r["fused_over_floor"] for r in rows]
    speed = [r["speedup_vs_step_graph"] for r in rows]
    geo = math.exp(sum(math.log(x) for x in ratios) / len(ratios))
    lines.append("")
    lines.append(f"geometric mean fused/floor = {geo:.2f} (target <= 1.3); "
                 f"min speedup vs step-wise graph = {min(speed):.1f}x (target >= 10x)")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_qk_rope_append: needs a CUDA GPU", file=sys.stderr)
        return 2
    quants = [int(x) for x in args.quant.split(",")]
    norms = [int(x) for x in args.norm.split(",")]
    bandwidth, launch = hbm_bandwidths()["read_write"], launch_floor_us()
    rows = []
    for mode, num_req, new in rows_for(args):
        for heads in HEADS:
            for quant in quants:
                for norm in norms:
                    p = make_problem(num_req, new, heads, quant, norm,
                                     page_size=args.page_size, prefix=args.prefix)
                    fused, step = fused_call(p), stepwise_call(p)
                    moved = bytes_moved(p)
                    floor = max(moved / bandwidth * 1e6, launch)
                    r = dict(mode=mode, B=num_req, Q=new, heads=heads, quant=quant, norm=norm,
                             bytes=moved,
                             fused_graph_us=time_graph(fused, args.calls_per_graph, args.replays),
                             fused_eager_us=time_eager(fused, args.eager_iters),
                             step_graph_us=time_graph(step, args.calls_per_graph, args.replays),
                             step_eager_us=time_eager(step, args.eager_iters), floor_us=floor)
                    r["fused_over_floor"] = r["fused_graph_us"] / floor
                    r["speedup_vs_step_graph"] = r["step_graph_us"] / r["fused_graph_us"]
                    rows.append(r)
                    print(json.dumps(r), file=sys.stderr)
    if args.json:
        env = dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                   hbm_bytes_per_s=bandwidth, launch_floor_us=launch, args=vars(args))
        with open(args.json, "w") as f:
            json.dump(dict(environment=env, rows=rows), f, indent=1)
    print(f"HBM {bandwidth / 1e12:.2f} TB/s, launch floor {launch:.2f} us, "
          f"page size {args.page_size}, prefix {args.prefix}")
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
