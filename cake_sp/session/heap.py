"""Symmetric memory: buffers every rank allocates alike and every rank can address.

Two heaps with one interface (``rank``, ``world_size``, ``alloc``, ``barrier``,
``close``):

* ``NvshmemHeap``: nvshmem4py's symmetric heap, one process per rank (several
  processes may share one GPU).  Bootstrap: rank 0's unique id is broadcast over
  the session's ``torch.distributed`` group.  Allocation and ``close`` are
  collective; buffers are freed explicitly by ``close``, never by garbage collection.
* ``InProcessHeap``: ``W`` virtual ranks inside one process (one GPU, or the CPU
  under the Triton interpreter), so kernels and protocol can be tested without
  several processes.  ``InProcessHeap(W, device).rank(r)`` is rank r's view; the
  k-th ``alloc`` on every view returns rank r's part of the same k-th allocation.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor


@dataclass(frozen=True)
class SymmetricTensor:
    """One symmetric allocation as seen by one rank.

    local: this rank's 1-D buffer (owned by the heap, not by this object).
    table: int64 ``[W]`` on the device: byte address of every rank's buffer, as
    this rank's kernels must address it.
    """

    local: Tensor
    table: Tensor


class NvshmemHeap:
    """nvshmem4py symmetric heap over a ``torch.distributed`` group (one PE per rank).

    NVSHMEM is initialised once per process, over the first group a heap is made
    for; a later heap must use a group of the same size and rank.
    """

    _initialised_for: tuple[int, int] | None = None

    def __init__(self, group: dist.ProcessGroup, device: torch.device) -> None:
        import nvshmem.core as nvshmem

        self._nvshmem = nvshmem
        self._group, self._device = group, device
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self._owned: list[Tensor] = []
        self._bootstrap()

    def _bootstrap(self) -> None:
        key = (self.rank, self.world_size)
        if NvshmemHeap._initialised_for is not None:
            if NvshmemHeap._initialised_for != key:
                raise RuntimeError(f"NVSHMEM is already initialised for (rank, world) = "
                                   f"{NvshmemHeap._initialised_for}, not {key}")
            return
        from cuda.core import Device

        nvshmem = self._nvshmem
        cuda_device = Device(self._device.index)
        cuda_device.set_current()
        uid = nvshmem.get_unique_id(empty=self.rank != 0)
        payload = [uid._data.view(np.int8).tobytes() if self.rank == 0 else None]
        dist.broadcast_object_list(payload, group_src=0, group=self._group)
        if self.rank != 0:
            uid._data.view(np.int8)[:] = np.frombuffer(payload[0], dtype=np.int8)
        nvshmem.init(device=cuda_device, uid=uid, rank=self.rank, nranks=self.world_size,
                     initializer_method="uid")
        NvshmemHeap._initialised_for = key

    def alloc(self, numel: int, dtype: torch.dtype) -> SymmetricTensor:
        """Collective: a 1-D symmetric buffer of ``numel`` elements per rank, uninitialised."""
        local = self._nvshmem.tensor((numel,), dtype=dtype)
        self._owned.append(local)
        addresses = [self._nvshmem.get_peer_tensor(local, pe).data_ptr()
                     for pe in range(self.world_size)]
        table = torch.tensor(addresses, dtype=torch.int64, device=self._device)
        return SymmetricTensor(local, table)

    def barrier(self) -> None:
        """Host barrier after this rank's device work so far (used at set-up only)."""
        torch.cuda.synchronize(self._device)
        dist.barrier(group=self._group)

    def close(self) -> None:
        """Collective: wait for the device, then free every buffer this heap allocated, and drop
        the reference to the process group."""
        if self._owned:
            self.barrier()
            for tensor in reversed(self._owned):
                self._nvshmem.free_tensor(tensor)
            self._owned.clear()
        self._group = None


class InProcessHeap:
    """``world_size`` virtual ranks in one process; ``rank(r)`` gives rank r's heap view."""

    def __init__(self, world_size: int, device: torch.device | str) -> None:
        self.world_size = world_size
        self.device = torch.device(device)
        self._allocations: list[list[Tensor]] = []
        self._tables: list[Tensor] = []

    def rank(self, rank: int) -> _InProcessRank:
        return _InProcessRank(self, rank)

    def _allocation(self, index: int, numel: int, dtype: torch.dtype) -> tuple[list[Tensor],
                                                                                Tensor]:
        if index == len(self._allocations):
            buffers = [torch.empty(numel, dtype=dtype, device=self.device)
                       for _ in range(self.world_size)]
            self._allocations.append(buffers)
            self._tables.append(torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64,
                                             device=self.device))
        buffers = self._allocations[index]
        if buffers[0].numel() != numel or buffers[0].dtype != dtype:
            raise RuntimeError(f"virtual ranks disagree on allocation {index}: "
                               f"{numel} x {dtype} vs {buffers[0].numel()} x {buffers[0].dtype}")
        return buffers, self._tables[index]


class _InProcessRank:
    """One virtual rank's view of an ``InProcessHeap`` (same interface as ``NvshmemHeap``)."""

    def __init__(self, heap: InProcessHeap, rank: int) -> None:
        self._heap, self.rank, self.world_size = heap, rank, heap.world_size
        self._count = 0

    def alloc(self, numel: int, dtype: torch.dtype) -> SymmetricTensor:
        buffers, table = self._heap._allocation(self._count, numel, dtype)
        self._count += 1
        return SymmetricTensor(buffers[self.rank], table)

    def barrier(self) -> None:
        """Virtual ranks share one stream: ordering is already total."""

    def close(self) -> None:
        """The in-process heap's buffers are ordinary tensors owned by the heap object."""
