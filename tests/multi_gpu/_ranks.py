"""Spawn W ranks once and run a list of cases inside them; every rank reports every case.

Importing torch in 8 processes on a small CPU costs seconds, so a test module
spawns its ranks once per world size (``run_cases``) and its tests then read
the per-case, per-rank reports.  A case is a module-level function
``case(ctx) -> dict`` run on every rank; an exception becomes that rank's
report (``{"error": "...", "type": "ValueError"}``), so one failing case never
hangs the others.  As each case ends, rank 0 prints its time and, given a
``verdict`` function, that case's verdict: a run cut by a time limit before the
tests read the reports still shows the verdict of every case it finished.

Where the ranks run is read from the environment:

* ``CAKE_SP_TEST_DEVICE=cpu`` (default): gloo, CPU tensors, Triton interpreter.
* ``CAKE_SP_TEST_DEVICE=cuda``: NCCL, one GPU per rank.
* ``CAKE_SP_TEST_DEVICE=cuda-shared``: gloo, every rank on GPU 0, the NVLink
  path allowed on one shared GPU (``CAKE_SP_ALLOW_SHARED_GPU=1``); NCCL for one rank.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TEST_DEVICE = os.environ.get("CAKE_SP_TEST_DEVICE", "cpu")


@dataclass
class RankContext:
    rank: int
    world_size: int
    device: torch.device
    dist_backend: str


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, cases: list, verdict, out_dir: str) -> None:
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")
    if TEST_DEVICE == "cuda":
        device, backend = torch.device("cuda", rank), "nccl"
        torch.cuda.set_device(device)
    elif TEST_DEVICE == "cuda-shared":  # NCCL refuses two ranks on one GPU, but takes one
        device, backend = torch.device("cuda", 0), "gloo" if world > 1 else "nccl"
        os.environ["CAKE_SP_ALLOW_SHARED_GPU"] = "1"
        torch.cuda.set_device(device)
    else:
        device, backend = torch.device("cpu"), "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, device_id=device if backend == "nccl" else None)
    ctx = RankContext(rank, world, device, backend)
    reports = {}
    for case in cases:
        start = time.perf_counter()
        try:
            reports[case.__name__] = case(ctx) or {}
        except Exception as exc:
            reports[case.__name__] = {"error": str(exc), "type": type(exc).__name__,
                                      "traceback": traceback.format_exc()}
        # Every rank's report of this case, which also keeps the ranks in step, so an error
        # on one rank shows as that case's report.
        per_rank = [None] * world
        dist.all_gather_object(per_rank, reports[case.__name__])
        if rank == 0:  # progress, for runs that a time limit may cut
            line = f"W={world} {case.__name__}: {time.perf_counter() - start:.1f} s"
            if verdict is not None:
                line += f", {verdict(world, case.__name__, per_rank)}"
            print(line, file=sys.stderr, flush=True)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(reports, f)
    # Every rank past its last collective before any tears down: a gloo rank that closes
    # its pairs while a peer still reads from them aborts that peer (SIGABRT at exit).
    dist.barrier()
    dist.destroy_process_group()
    # The report is written; leave without the interpreter's teardown.  Under load (the
    # whole suite on two cores) a rank has aborted there ("terminate called without an
    # active exception") after every case passed, most likely gloo work torn down during
    # interpreter finalization (docs/results.md, "Clean exits"), and a test must fail on
    # its checks, not on that.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_cases(world: int, cases: list,
              verdict: Callable[[int, str, list[dict]], str] | None = None,
              ) -> dict[str, list[dict]]:
    """Run ``cases`` on ``world`` spawned ranks; return ``{case name: [report of each rank]}``.

    ``verdict(world, case name, every rank's report)`` (a module-level function, so the
    spawned ranks can import it) runs on rank 0 as each case ends; its line is printed.
    """
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(_rank_main, args=(world, _free_port(), cases, verdict, out_dir),
                           nprocs=world, join=True, start_method="spawn")
        per_rank = []
        for rank in range(world):
            with open(os.path.join(out_dir, f"rank{rank}.json")) as f:
                per_rank.append(json.load(f))
    return {name: [r[name] for r in per_rank] for name in per_rank[0]}
