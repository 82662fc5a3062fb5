"""CUDA-graph capture shared by the kernel benchmarks (run as scripts from this folder)."""

from __future__ import annotations

from collections.abc import Callable

import torch


class GraphReplay:
    """A captured CUDA graph, replayed by calling this, and the ``fn`` it was captured from.

    The graph reads and writes the memory of the tensors ``fn`` used at capture, and holds
    no reference to them: holding ``fn`` keeps those tensors (a buffer only ``fn``'s closure
    knows, say) from being freed and their memory handed to other tensors while replays
    still write it.
    """

    def __init__(self, graph: torch.cuda.CUDAGraph, fn: Callable[[], None]) -> None:
        self.graph, self.fn = graph, fn

    def __call__(self) -> None:
        self.graph.replay()


def graphed(fn: Callable[[], None]) -> GraphReplay:
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
    return GraphReplay(graph, fn)
