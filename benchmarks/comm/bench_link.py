"""Link ceilings: peer-copy bandwidth per GPU pair, and all_to_all_single bandwidth by size.

Run under torchrun, one rank per GPU::

    torchrun --standalone --nproc-per-node=8 benchmarks/comm/bench_link.py --json link.json

* ``peer_copy``: rank 0 copies a large buffer from GPU ``i`` to GPU ``j`` for
  every ordered pair it can see (CUDA events on the source device's stream,
  where the copy runs), the other ranks idle.  GB/s per pair.
* ``all_to_all``: every rank calls ``all_to_all_single`` with a per-rank buffer
  of each size; kernel time from the profiler, per-sample maximum over ranks,
  median.  ``busbw`` = bytes leaving one GPU / time = ``size * (W-1)/W / t``
  (nccl-tests' definition for all-to-all).
* ``local_copy``: a device-local copy, reported where there is no link to
  measure (ranks sharing one GPU, or the CPU); it is not a link rate.

``measure_link`` is what the main benchmark calls to get its link rate for
the floors, in the same run.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

from _harness import (
    BenchContext,
    ProfilerTimer,
    WallTimer,
    all_to_all_bytes,
    environment,
    init_distributed,
    make_timer,
    max_over_ranks,
    median,
    set_safe_env,
    synchronize,
)
from _report import write_json

# Before any process group exists: NCCL and NVSHMEM read these at initialisation.
set_safe_env()

SCHEMA = "cake_sp.bench.link/1"
SIZES_CUDA = tuple(1 << s for s in range(20, 31, 2))  # 1 MiB .. 1 GiB per rank
SIZES_CPU = tuple(1 << s for s in range(10, 21, 2))   # 1 KiB .. 1 MiB per rank
PEER_COPY_BYTES = 256 << 20


def a2a_sweep(ctx: BenchContext, timer: WallTimer | ProfilerTimer, sizes: tuple[int, ...],
              samples: int) -> list[dict]:
    """``all_to_all_single`` of ``size`` bytes per rank, for each size (rounded to W)."""
    results = []
    for size in sizes:
        size -= size % ctx.world_size
        send = torch.randint(0, 255, (size,), dtype=torch.uint8, device=ctx.device)
        recv = torch.empty_like(send)
        call = lambda r=recv, s=send: all_to_all_bytes(r, s, ctx.group)  # noqa: E731
        call()
        synchronize(ctx)
        per_sample, per_rank = max_over_ranks(ctx, timer.time_samples([call] * samples))
        t = median(per_sample) / 1e3
        out_bytes = size * (ctx.world_size - 1) / ctx.world_size
        results.append({"bytes_per_rank": size, "samples_ms": per_sample,
                        "samples_ms_per_rank": per_rank, "median_ms": t * 1e3,
                        "algbw_GBps": size / t / 1e9, "busbw_GBps": out_bytes / t / 1e9})
    return results


def _events_ms(device: torch.device, fn, samples: int) -> list[float]:
    """Times of ``fn`` by CUDA events on ``device``'s current stream."""
    stream = torch.cuda.current_stream(device)
    times = []
    for _ in range(samples):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        fn()
        end.record(stream)
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def peer_copy_sweep(ctx: BenchContext, nbytes: int, samples: int) -> list[dict]:
    """Rank 0: GB/s of a ``nbytes`` copy for every ordered pair of visible GPUs.

    A cross-device ``copy_`` runs on the source device's current stream, so the
    events are recorded there.  Other ranks return an empty list.
    """
    results = []
    if ctx.rank == 0:
        count = torch.cuda.device_count()
        for i in range(count):
            src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=f"cuda:{i}")
            for j in range(count):
                if i == j:
                    continue
                dst = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{j}")
                with torch.cuda.device(i):
                    dst.copy_(src)
                    torch.cuda.synchronize()
                    copy = lambda d=dst, s=src: d.copy_(s, non_blocking=True)  # noqa: E731
                    times = _events_ms(src.device, copy, samples)
                t = median(times) / 1e3
                results.append({"src": i, "dst": j, "bytes": nbytes, "samples_ms": times,
                                "median_ms": t * 1e3, "GBps": nbytes / t / 1e9})
                del dst
            del src
        torch.cuda.synchronize()
    dist.barrier(group=ctx.control)
    return results


def local_copy(ctx: BenchContext, timer: WallTimer | ProfilerTimer, nbytes: int,
               samples: int) -> dict:
    """Device-local copy bandwidth (read + write counted once: ``nbytes / t``)."""
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=ctx.device)
    dst = torch.empty_like(src)
    per_sample, per_rank = max_over_ranks(
        ctx, timer.time_samples([lambda: dst.copy_(src)] * samples))
    t = median(per_sample) / 1e3
    return {"bytes": nbytes, "samples_ms": per_sample, "samples_ms_per_rank": per_rank,
            "median_ms": t * 1e3, "GBps": nbytes / t / 1e9}


def measure_link(ctx: BenchContext, timer: WallTimer | ProfilerTimer, sizes: tuple[int, ...],
                 samples: int) -> dict:
    """Every ceiling this set-up can measure, and the one rate the floors use.

    ``rate_bytes_per_s`` is the highest per-GPU outgoing rate measured
    (all-to-all busbw or one peer copy), i.e. the most favourable link, so the
    floor is never too high.  Where no link can be measured (shared GPU) it is
    the local copy rate and ``rate_source`` says so.
    """
    result: dict = {"a2a": [], "peer_copy": [], "local_copy": None}
    multi_gpu = ctx.is_cuda and not ctx.shared_gpu
    if not ctx.is_cuda or ctx.dist_backend == "nccl":
        result["a2a"] = a2a_sweep(ctx, timer, sizes, samples)
    if multi_gpu and torch.cuda.device_count() > 1:
        result["peer_copy"] = peer_copy_sweep(ctx, PEER_COPY_BYTES, samples)
    if not multi_gpu:
        result["local_copy"] = local_copy(ctx, timer, max(sizes), samples)
    candidates = [(a["busbw_GBps"], "all_to_all_single busbw") for a in result["a2a"]]
    gathered: list = [None] * ctx.world_size
    dist.all_gather_object(gathered, [p["GBps"] for p in result["peer_copy"]], group=ctx.control)
    candidates += [(g, "peer copy") for g in sum(gathered, [])]
    if not candidates:
        candidates = [(result["local_copy"]["GBps"],
                       "device-local copy (ranks share one GPU: not a link rate)")]
    best, source = max(candidates)
    result.update(rate_bytes_per_s=best * 1e9, rate_source=source)
    return result


def link_tables(link: dict) -> str:
    """Markdown tables of a ``measure_link`` result."""
    out = [f"link rate used for floors: {link['rate_bytes_per_s'] / 1e9:.1f} GB/s "
           f"({link['rate_source']})", ""]
    if link["a2a"]:
        out += ["| bytes per rank | median ms | algbw GB/s | busbw GB/s |", "|---|---|---|---|"]
        out += [f"| {a['bytes_per_rank']} | {a['median_ms']:.4f} | {a['algbw_GBps']:.1f} | "
                f"{a['busbw_GBps']:.1f} |" for a in link["a2a"]]
        out.append("")
    if link["peer_copy"]:
        out += ["| src -> dst | GB/s |", "|---|---|"]
        out += [f"| {p['src']} -> {p['dst']} | {p['GBps']:.1f} |" for p in link["peer_copy"]]
        out.append("")
    if link["local_copy"]:
        out.append(f"local copy: {link['local_copy']['GBps']:.1f} GB/s")
    return "\n".join(out)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"),
                        default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dist-backend", choices=("auto", "nccl", "gloo"), default="auto")
    parser.add_argument("--sizes", type=lambda s: tuple(int(v) for v in s.split(",")),
                        help="comma-separated bytes per rank (default: 1 MiB..1 GiB on GPUs)")
    parser.add_argument("--samples", type=int, default=10)
    parser.add_argument("--json", help="write every sample and the environment here")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    ctx = init_distributed(args.device, args.dist_backend)
    sizes = args.sizes or (SIZES_CUDA if ctx.is_cuda else SIZES_CPU)
    link = measure_link(ctx, make_timer(ctx), sizes, args.samples)
    if ctx.rank == 0:
        print(link_tables(link))
        if args.json:
            write_json(args.json, {"schema": SCHEMA, "environment": environment(ctx),
                                   "config": vars(args), "link": link})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
