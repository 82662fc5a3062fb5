"""CUDA-graph capture shared by the kernel benchmarks (run as scripts from this folder)."""

from __future__ import annotations

from collections.abc import Callable

import torch


def graphed(fn: Callable[[], None]) -> Callable[[], None]:
    """Capture one call of ``fn`` in a CUDA graph and return the graph's replay.

    ``fn`` runs once on a side stream first (lazy initialisation and compilation
    must not happen during capture).  Replays skip the host's launch cost, so a
    timing of them is the GPU's time alone.
    """
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay
