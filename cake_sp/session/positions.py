"""Positions outside the RoPE table: counted on the GPU, reported by the host without waiting.

A range check on the host (``positions.min()``, ``positions.max()``) would make
every call wait for the GPU.  Instead the producer kernel counts the rows of its
Q and K tiles whose position indexes outside ``rope_cos_sin`` (such a row reads
nothing and is rotated by cos = sin = 0) into a counter in pinned host memory,
and the session reads the counter at the start of each later call and in
``synchronize``: a plain memory read, no synchronisation.
"""

from __future__ import annotations

import torch


class BadPositionsCounter:
    """The producer's out-of-table row count (int64 ``[1]``, pinned on CUDA) and what the host
    has reported of it.  Only kernels write ``count``; the host only reads it."""

    def __init__(self, device: torch.device) -> None:
        self.count = torch.zeros(1, dtype=torch.int64, pin_memory=device.type == "cuda")
        self._reported = 0

    def check(self) -> None:
        """Raise ``ValueError`` if calls since the last check had positions outside the table."""
        count = int(self.count[0])
        if count == self._reported:
            return
        new, self._reported = count - self._reported, count
        raise ValueError(
            f"positions of an earlier call lie outside [0, rows of rope_cos_sin): {new} Q/K head "
            "rows were rotated by cos = sin = 0, so that call's q and k are wrong. Every "
            "position must index a row of rope_cos_sin; the session itself is unaffected.")
