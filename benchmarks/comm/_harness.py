"""Shared machinery of the comm benchmarks: process set-up, timers, run order, statistics.

Vocabulary: an *arm* is one implementation being timed; a *sample* is one
timed call of one arm; a *round* runs every arm twice, in counterbalanced
order (``A B C C B A``), so drift over a round hits every arm alike.

Timing on a GPU is kernel time from the profiler (CUPTI through
``torch.profiler``): the union of the intervals of the GPU activities (kernels,
copies, memsets) a sample enqueued, on every stream, so work overlapped on two
streams counts once and host gaps never count.  Each sample starts with a
cold L2 (a buffer several times the L2 size is rewritten first) and the ranks
start it together: a host barrier, then a device barrier (an NCCL all-reduce on
NCCL groups, NVSHMEM's ``sync_all`` on the stream otherwise), so launch skew
between ranks is spent in the barrier, which is outside the sample.  Each
rank's host arrival time at the device barrier is kept as well: per sample,
their spread over ranks is the launch skew, reported apart from the time.  On
the CPU it is wall-clock time.  Either way a sample's time is the maximum over ranks:
a collective is only done when its slowest rank is.
"""

from __future__ import annotations

import datetime
import os
import platform
import socket
import statistics
import subprocess
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import torch
import torch.distributed as dist

# Multicast (NVLS) objects are never created by these benchmarks; these switches keep
# NCCL, torch symmetric memory and NVSHMEM from creating them behind our back.
SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
            "NVSHMEM_DISABLE_NVLS": "1"}
DIST_BACKENDS = ("auto", "nccl", "gloo")
# The two marker ops that bracket every profiled sample, as fragments of their kernel names
# once lower-cased without underscores: torch names the kernels after
# ``bitwise_not_kernel_cuda`` and ``BitwiseAndFunctor``.  No arm runs either op.
_BEGIN_MARK, _END_MARK = "bitwisenot", "bitwiseand"
_MIN_FLUSH_BYTES = 256 << 20


def set_safe_env() -> None:
    """Apply ``SAFE_ENV`` (without overriding what the caller exported)."""
    for key, value in SAFE_ENV.items():
        os.environ.setdefault(key, value)


def use_interpreter_if_cpu(device: str) -> None:
    """Route Triton kernels through the CPU interpreter when the run has no GPU.

    Must run before anything imports ``triton`` (the interpreter is chosen at import).
    """
    if device == "cpu" or not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


@dataclass
class BenchContext:
    """Where this process runs.

    ``group`` is the benchmark's process group (NCCL with one GPU per rank, gloo
    otherwise); ``control`` is a gloo group over the same ranks for host-side
    barriers and result gathering, so they never enqueue GPU work.
    ``shared_gpu`` is True when several ranks share one GPU (numbers then are
    harness checks, not multi-GPU numbers).
    """

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    dist_backend: str
    shared_gpu: bool
    group: dist.ProcessGroup
    control: dist.ProcessGroup

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"


def init_distributed(device: str, dist_backend: str = "auto") -> BenchContext:
    """Join the torchrun job: pick this rank's device and the group backend.

    Parameters
    ----------
    device : {"cuda", "cpu"}
        ``"cuda"``: GPU ``LOCAL_RANK % device_count``; when there are fewer GPUs
        than local ranks, the ranks share GPUs and the group must be gloo.
    dist_backend : {"auto", "nccl", "gloo"}
        ``"auto"``: NCCL with one GPU per rank, gloo otherwise.

    Raises ``ValueError`` on an impossible combination (NCCL on the CPU or on a
    shared GPU: NCCL refuses two ranks on one device).
    """
    if dist_backend not in DIST_BACKENDS:
        raise ValueError(f"dist_backend must be one of {DIST_BACKENDS}, got {dist_backend!r}")
    if device not in ("cuda", "cpu"):
        raise ValueError(f"device must be 'cuda' or 'cpu', got {device!r}")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    shared = False
    if device == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("--device cuda needs a CUDA GPU; use --device cpu")
        shared = torch.cuda.device_count() < local_world
        dev = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(dev)
    else:
        dev = torch.device("cpu")
    if dist_backend == "auto":
        dist_backend = "nccl" if device == "cuda" and not shared else "gloo"
    if dist_backend == "nccl" and (device == "cpu" or shared):
        raise ValueError("the nccl backend needs one GPU per rank; with ranks sharing a GPU "
                         "or on the CPU use --dist-backend gloo")
    dist.init_process_group(dist_backend, timeout=datetime.timedelta(minutes=10),
                            device_id=dev if dist_backend == "nccl" else None)
    control = dist.new_group(backend="gloo")
    return BenchContext(dist.get_rank(), dist.get_world_size(), local_rank, dev, dist_backend,
                        shared, dist.group.WORLD, control)


def all_to_all_bytes(out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup,
                     async_op: bool = False):
    """``all_to_all_single`` of equal splits along dim 0, moving raw bytes.

    gloo has no bf16 all-to-all and NCCL has no int16, so both buffers travel as
    uint8 views (same bytes, same split points).
    """
    return dist.all_to_all_single(out.view(torch.uint8), inp.view(torch.uint8), group=group,
                                  async_op=async_op)


# -- order ------------------------------------------------------------------------------------

def counterbalanced_order(arms: Sequence[str], rounds: int) -> list[tuple[int, str]]:
    """The executed order: ``rounds`` rounds of ``rot + reversed(rot)``, ``(round, arm)`` pairs.

    Round ``k`` rotates the arm list by ``k`` so that every arm takes every
    position in turn; inside a round the mirror (``A B C C B A``) cancels any
    linear drift.  Each round gives every arm two samples.
    """
    if not arms:
        raise ValueError("counterbalanced_order needs at least one arm")
    order = []
    for k in range(rounds):
        rot = list(arms[k % len(arms):]) + list(arms[: k % len(arms)])
        order.extend((k, arm) for arm in rot + rot[::-1])
    return order


# -- statistics --------------------------------------------------------------------------------

def union_length(intervals: Iterable[tuple[float, float]]) -> float:
    """Total length covered by ``(start, end)`` intervals (overlaps counted once)."""
    total, cur_start, cur_end = 0.0, None, None
    for start, end in sorted(intervals):
        if cur_end is None or start > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    if cur_end is not None:
        total += cur_end - cur_start
    return total


def split_samples(events: Sequence[tuple[str, float, float]]) -> list[float]:
    """Busy time of every bracketed sample in a GPU activity trace.

    ``events`` are ``(name, start_us, end_us)``; each sample is bracketed by a
    begin-marker activity and an end-marker activity (kernels whose names hold
    ``_BEGIN_MARK`` and ``_END_MARK``, compared lower-case without underscores).
    A sample's time is the union of the intervals of the activities that start
    between its markers.  Returns one value per sample, in microseconds.
    Raises ``RuntimeError`` if the markers do not pair up (a sample would be
    mis-attributed).
    """
    events = sorted(events, key=lambda e: e[1])
    samples: list[float] = []
    current: list[tuple[float, float]] | None = None
    for name, start, end in events:
        name = name.lower().replace("_", "")
        if _BEGIN_MARK in name:
            if current is not None:
                raise RuntimeError("profiler trace: two begin markers without an end marker")
            current = []
        elif _END_MARK in name:
            if current is None:
                raise RuntimeError("profiler trace: an end marker without a begin marker")
            samples.append(union_length(current))
            current = None
        elif current is not None:
            current.append((start, end))
    if current is not None:
        raise RuntimeError("profiler trace: the last sample has no end marker")
    return samples


def launch_skew(arrivals_ns_per_rank: Sequence[Sequence[int]]) -> list[float]:
    """Per sample, the spread over ranks of the host's arrival at the device barrier
    (max - min of ``time.time_ns()``, one clock on one host), in ms: the launch skew the
    barrier absorbed."""
    return [(max(t) - min(t)) / 1e6 for t in zip(*arrivals_ns_per_rank, strict=True)]


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def max_over_ranks(ctx: BenchContext, values: Sequence[float]) -> tuple[list[float],
                                                                        list[list[float]]]:
    """Gather every rank's per-sample values; return (element-wise max, per-rank lists)."""
    mine = torch.tensor(list(values), dtype=torch.float64)
    gathered = [torch.empty_like(mine) for _ in range(ctx.world_size)]
    dist.all_gather(gathered, mine, group=ctx.control)
    per_rank = [g.tolist() for g in gathered]
    return torch.stack(gathered).amax(dim=0).tolist(), per_rank


def check_same_on_all_ranks(ctx: BenchContext, what: str, value) -> None:
    """Raise on every rank if ranks disagree on ``value`` (e.g. which arms to run).

    The run order must be identical everywhere or the collectives would pair up
    wrongly and hang; this turns that into an error instead.
    """
    gathered: list = [None] * ctx.world_size
    dist.all_gather_object(gathered, value, group=ctx.control)
    if any(g != gathered[0] for g in gathered):
        raise RuntimeError(f"ranks disagree on {what}: {gathered}")


# -- timers -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class HostDelay:
    """A delay of ``ms`` milliseconds on rank ``rank``'s host before every sample, after the
    host barrier: launch skew made on purpose, to check that the device barrier absorbs it."""

    rank: int
    ms: float

    def apply(self, rank: int) -> None:
        if rank == self.rank and self.ms > 0:
            time.sleep(self.ms / 1e3)


class WallTimer:
    """Wall-clock samples (CPU runs): host barrier, then time the call (no device barrier, so
    launch skew counts here).  After ``time_samples``, ``arrivals_ns`` holds this rank's start
    of every sample (``time.time_ns()``)."""

    kind = "wall_clock"

    def __init__(self, ctx: BenchContext, delay: HostDelay | None = None) -> None:
        self._ctx, self._delay = ctx, delay
        self.arrivals_ns: list[int] = []

    def time_samples(self, calls: Sequence[Callable[[], None]]) -> list[float]:
        """Run ``calls`` in order, one sample each; return this rank's times in ms."""
        times, self.arrivals_ns = [], []
        for call in calls:
            dist.barrier(group=self._ctx.control)
            if self._delay is not None:
                self._delay.apply(self._ctx.rank)
            self.arrivals_ns.append(time.time_ns())
            start = time.perf_counter()
            call()
            times.append((time.perf_counter() - start) * 1e3)
        return times


def _device_barrier(ctx: BenchContext) -> tuple[Callable[[], None] | None, str]:
    """A barrier of every rank's GPU, enqueued on the current stream, and its name.

    NCCL groups: an all-reduce of one float.  gloo groups on GPUs (ranks sharing a GPU):
    NVSHMEM's ``sync_all`` on the stream (NVSHMEM bootstrapped over the group, as the
    session's heap does; it supports several processes per GPU).  None without nvshmem4py.
    """
    if ctx.dist_backend == "nccl":
        token = torch.zeros(1, dtype=torch.float32, device=ctx.device)
        return (lambda: dist.all_reduce(token, group=ctx.group)), "nccl all_reduce"
    try:
        import nvshmem.core as nvshmem
    except ImportError:
        return None, "none (no nvshmem4py: host barrier only, skew is counted)"
    from cake_sp.session.heap import NvshmemHeap

    NvshmemHeap(ctx.group, ctx.device)  # bootstraps NVSHMEM once per process
    return (lambda: nvshmem.sync_all(stream=torch.cuda.current_stream())), "nvshmem sync_all"


class ProfilerTimer:
    """GPU kernel-time samples from the profiler, each with a cold L2, the ranks' GPUs
    aligned by a device barrier right before it.

    One profiler session covers a batch of samples; marker kernels bracket each
    sample so its activities can be told apart afterwards (``split_samples``).
    After ``time_samples``, ``arrivals_ns`` holds this rank's host arrival at the device
    barrier of every sample (``time.time_ns()``).  (The barrier's own GPU time does not show
    the skew: NVSHMEM's ``sync_all`` with several processes on one GPU waits on the host.)
    """

    kind = "profiler_kernel_time_cold_l2"

    def __init__(self, ctx: BenchContext, delay: HostDelay | None = None) -> None:
        self._ctx, self._delay = ctx, delay
        l2 = torch.cuda.get_device_properties(ctx.device).L2_cache_size
        self._flush = torch.empty(max(_MIN_FLUSH_BYTES, 4 * l2), dtype=torch.uint8,
                                  device=ctx.device)
        self._mark = torch.zeros(1, dtype=torch.int32, device=ctx.device)
        self._barrier, self.barrier_kind = _device_barrier(ctx)
        self.arrivals_ns: list[int] = []
        # The first profiler session pays CUPTI's set-up; keep that out of real samples.
        self.time_samples([lambda: None])

    def _start_together(self) -> None:
        dist.barrier(group=self._ctx.control)
        if self._delay is not None:
            self._delay.apply(self._ctx.rank)
        self._flush.bitwise_xor_(1)  # rewrite the whole buffer: L2 holds none of the call's data
        self.arrivals_ns.append(time.time_ns())
        if self._barrier is not None:
            self._barrier()  # align the GPUs (not just the hosts) right before the begin marker
        self._mark.bitwise_not_()

    def time_samples(self, calls: Sequence[Callable[[], None]]) -> list[float]:
        """Run ``calls`` in order, one sample each; return this rank's kernel times in ms."""
        from torch.autograd import DeviceType
        from torch.profiler import ProfilerActivity, profile

        torch.cuda.synchronize()
        self.arrivals_ns = []
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for call in calls:
                self._start_together()
                call()
                self._mark.bitwise_and_(self._mark)
                torch.cuda.synchronize()
        events = [(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
                  if e.device_type == DeviceType.CUDA and not e.is_user_annotation]
        samples = split_samples(events)
        if len(samples) != len(calls):
            raise RuntimeError(f"profiler trace has {len(samples)} samples for {len(calls)} calls")
        return [s / 1e3 for s in samples]


def make_timer(ctx: BenchContext, delay: HostDelay | None = None) -> WallTimer | ProfilerTimer:
    return ProfilerTimer(ctx, delay) if ctx.is_cuda else WallTimer(ctx, delay)


def synchronize(ctx: BenchContext) -> None:
    if ctx.is_cuda:
        torch.cuda.synchronize()


# -- environment ------------------------------------------------------------------------------

def _run(cmd: list[str]) -> str | None:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=30,
                              check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def _package_version(*names: str) -> str | None:
    for name in names:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def environment(ctx: BenchContext) -> dict:
    """What a reader needs to reproduce the numbers: hardware, driver, library versions, commit."""
    repo = Path(__file__).resolve().parents[2]
    env = {
        "hostname": socket.gethostname(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda_runtime": torch.version.cuda,
        "triton": _package_version("triton"),
        "nvshmem4py": _package_version("nvshmem4py-cu13", "nvshmem4py-cu12", "nvshmem4py"),
        "commit": _run(["git", "-C", str(repo), "rev-parse", "HEAD"]),
        "commit_dirty": bool(_run(["git", "-C", str(repo), "status", "--porcelain",
                                   "--untracked-files=no"])),
        "world_size": ctx.world_size,
        "dist_backend": ctx.dist_backend,
        "device": str(ctx.device),
        "shared_gpu": ctx.shared_gpu,
        "env": {k: os.environ.get(k) for k in (*SAFE_ENV, "CAKE_SP_ALLOW_SHARED_GPU",
                                                 "CAKE_SP_BACKEND", "TRITON_INTERPRET",
                                                 "CUDA_VISIBLE_DEVICES")},
        "cpu_count": os.cpu_count(),
    }
    if ctx.is_cuda:
        props = torch.cuda.get_device_properties(ctx.device)
        env.update({
            "gpu": props.name,
            "gpu_count": torch.cuda.device_count(),
            "capability": f"{props.major}.{props.minor}",
            "gpu_memory_gib": round(props.total_memory / 2**30, 1),
            "driver": _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader",
                            "-i", str(ctx.device.index)]),
            "nccl": ".".join(map(str, torch.cuda.nccl.version())),
        })
    return env
