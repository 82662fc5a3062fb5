"""HBM bandwidth references of the kernel benchmarks, measured with kernels on the SMs."""

from __future__ import annotations

import statistics

import torch
from _graphs import graphed


def hbm_bandwidths(nbytes: int = 1 << 30, replays: int = 20) -> dict[str, float]:
    """Bytes per second of two streams over ``nbytes`` of fp32 (far past L2), each
    captured in a CUDA graph and timed as the median of ``replays`` replays:

    * ``"read_write"``: ``torch.neg(src, out=dst)``, counting ``2 * nbytes``;
    * ``"read"``: ``torch.sum(src, dim=0)``, counting ``nbytes``.

    Kernels rather than ``copy_``: a captured device-to-device ``copy_`` is a memcpy
    node, which measured 2.7 TB/s (read + write) on an H200 against about 4.3 TB/s
    seen for an eager copy on the same model, so kernels that stream memory showed
    above 100 % of it.
    """
    src = torch.randn(nbytes // 4, device="cuda")
    dst = torch.empty_like(src)
    total = torch.empty((), device="cuda")

    def rate(fn, moved: int) -> float:
        replay = graphed(fn)
        samples = []
        for _ in range(replays):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            replay()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) * 1e-3)
        return moved / statistics.median(samples)

    return {"read_write": rate(lambda: torch.neg(src, out=dst), 2 * src.nbytes),
            "read": rate(lambda: torch.sum(src, dim=0, out=total), src.nbytes)}
