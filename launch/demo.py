"""The main job: build a session under torchrun, run it, check it, time it.

    torchrun --standalone --nproc-per-node=4 launch/demo.py

Every rank checks its own output of every call against ``cake_sp.reference``;
rank 0 prints the backend, why it was chosen, and a short timing table.  With
no GPU the ranks run on the CPU over gloo (kernels through Triton's
interpreter, so keep the shapes small); with GPUs, one GPU per rank over NCCL.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

if not torch.cuda.is_available():
    # Must precede the first import of triton (through cake_sp).
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Never NVLink multicast: it is not needed, and it can take shared GPUs out of service.
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")

import torch.distributed as dist  # noqa: E402

from cake_sp import QkvNormRopeExchangeOverlap, reference  # noqa: E402
from cake_sp.testing import assert_close_counting_flips  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    gpu = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--heads-per-rank", type=int, default=4 if gpu else 1,
                   help="Q heads each rank receives (Hq = W * this)")
    p.add_argument("--kv-heads", type=int, default=0, help="Hkv; 0 means Hkv = Hq (no GQA)")
    p.add_argument("--hidden", type=int, default=4096 if gpu else 128)
    p.add_argument("--seq-local", type=int, default=4096 if gpu else 24)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--calls", type=int, default=20 if gpu else 3)
    p.add_argument("--layout", default="bshd", choices=["bshd", "fused"])
    p.add_argument("--rope-style", default="interleaved", choices=["interleaved", "neox"])
    p.add_argument("--backend", default="auto", choices=["auto", "nvlink", "nccl"])
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    gpu = torch.cuda.is_available()
    if gpu:
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if gpu else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    hq = world * args.heads_per_rank
    hkv = args.kv_heads or hq
    d = 128
    rows = args.batch * args.seq_local
    g = torch.Generator().manual_seed(1234)
    weight = (torch.randn((hq + 2 * hkv) * d, args.hidden, generator=g)
              / args.hidden**0.5).bfloat16()
    q_norm = (1 + 0.1 * torch.randn(d, generator=g)).bfloat16()
    k_norm = (1 + 0.1 * torch.randn(d, generator=g)).bfloat16()
    table = reference.rope_cos_sin_table(world * rows, d)
    tables = [table[r * rows:(r + 1) * rows].contiguous() for r in range(world)]
    times, worst, flips = [], 0.0, 0
    with QkvNormRopeExchangeOverlap(num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
                                    hidden=args.hidden, max_tokens=rows, layout=args.layout,
                                    rope_style=args.rope_style, backend=args.backend,
                                    device=device) as session:
        if rank == 0:
            print(f"{session!r}\nbackend: {session.backend} ({session.backend_reason})",
                  flush=True)
        w_dev, qn_dev, kn_dev = weight.to(device), q_norm.to(device), k_norm.to(device)
        for call in range(args.calls):
            xs = [torch.randn(args.batch, args.seq_local, args.hidden, generator=g).bfloat16()
                  for _ in range(world)]
            x_dev, table_dev = xs[rank].to(device), tables[rank].to(device)
            if gpu:
                torch.cuda.synchronize()
            start = time.perf_counter()
            got = session(x_dev, w_dev, qn_dev, kn_dev, table_dev)
            if gpu:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
            if call in (0, args.calls - 1):  # the reference is slow at real shapes
                want = reference.qkv_norm_rope_exchange(
                    xs, weight, q_norm, k_norm, tables, num_q_heads=hq, num_kv_heads=hkv,
                    rope_style=args.rope_style, layout=args.layout)[rank]
                if args.layout == "fused":
                    checks = [(got, want, args.rope_style)]
                else:
                    checks = zip(got, want, (args.rope_style, args.rope_style, None))
                for a, b, style in checks:
                    counts = assert_close_counting_flips(a, b, rope_style=style)
                    flips += counts["intermediate_flips"]
                    worst = max(worst, (a.float().cpu() - b.float()).abs().max().item())
    per_rank = [None] * world
    dist.all_gather_object(per_rank, times)
    if rank == 0:
        slowest = [max(r[i] for r in per_rank) for i in range(args.calls)]
        steady = slowest[1:] or slowest
        print(f"\nW={world} Hq={hq} Hkv={hkv} hidden={args.hidden} B={args.batch} "
              f"S_local={args.seq_local} layout={args.layout} rope={args.rope_style}")
        print("| calls | first call ms | median ms | min ms | max |out - reference| |")
        print("|---|---|---|---|---|")
        print(f"| {args.calls} | {slowest[0] * 1e3:.2f} | {statistics.median(steady) * 1e3:.2f} "
              f"| {min(steady) * 1e3:.2f} | {worst:.3g} |")
        print(f"every rank matched the reference (rank 0: {flips} elements off by an "
              "intermediate bf16 flip, see cake_sp.testing)", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
