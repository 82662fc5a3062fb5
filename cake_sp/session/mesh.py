"""Topology probe (never raises) and the pure backend decision over every rank's probe.

Each rank probes what it can see from its own process: its host, its GPU, the
CUDA peer attributes and NVML link type from its GPU to every other visible
GPU, and whether the symmetric-memory library imports.  The probes are
all-gathered once at session construction; ``decide_backend`` then turns them
into the same answer on every rank, so the choice is unit-testable on synthetic
topologies with no GPU.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from enum import Enum

import torch

NVLINK_WORLD_SIZES = (2, 4, 8)
MIN_CAPABILITY = (9, 0)


class Backend(str, Enum):
    """Exchange backends.  ``AUTO`` is only ever requested, never resolved."""

    AUTO = "auto"
    NVLINK = "nvlink"
    NCCL = "nccl"


class UlyssesBackendError(RuntimeError):
    """``backend="nvlink"`` was requested and the mesh cannot serve it (the message says why)."""


@dataclass(frozen=True)
class PeerLink:
    """What this rank's GPU sees towards another visible GPU (by UUID)."""

    access: bool
    native_atomics: bool
    nvlink: bool


@dataclass(frozen=True)
class MeshProbe:
    """One rank's view of the machine.  Every field is plain data (picklable, comparable).

    ``problem`` is set when probing itself failed; the rank then cannot serve NVLink.
    """

    hostname: str
    device_type: str
    device_uuid: str | None = None
    capability: tuple[int, int] | None = None
    peers: dict[str, PeerLink] = field(default_factory=dict)
    symmetric_memory: str | None = None  # None if importable, else why not
    problem: str | None = None


@dataclass(frozen=True)
class EnvOverrides:
    """The environment switches the session honours, read in one place.

    ``CAKE_SP_BACKEND``: replaces ``backend="auto"`` (never a forced backend).
    ``CAKE_SP_ALLOW_SHARED_GPU=1``: lets several ranks share one GPU on the
    NVLink path (nvshmem4py supports it); meant for testing the real
    multi-process protocol on a single device, never for performance.
    """

    backend: str | None
    allow_shared_gpu: bool

    @classmethod
    def read(cls) -> EnvOverrides:
        return cls(backend=os.environ.get("CAKE_SP_BACKEND") or None,
                   allow_shared_gpu=os.environ.get("CAKE_SP_ALLOW_SHARED_GPU", "0") == "1")


def probe_mesh(device: torch.device) -> MeshProbe:
    """Probe this rank's view of the mesh.  Never raises: failures land in ``problem``."""
    hostname = socket.gethostname()
    if device.type != "cuda":
        return MeshProbe(hostname=hostname, device_type=device.type)
    try:
        index = device.index if device.index is not None else torch.cuda.current_device()
        props = torch.cuda.get_device_properties(index)
        uuids = [str(torch.cuda.get_device_properties(i).uuid)
                 for i in range(torch.cuda.device_count())]
        peers = _probe_peers(index, uuids)
    except Exception as exc:  # the probe reports, the decision refuses
        return MeshProbe(hostname=hostname, device_type="cuda",
                         problem=f"probing the GPU failed: {exc!r}")
    return MeshProbe(hostname=hostname, device_type="cuda", device_uuid=uuids[index],
                     capability=(props.major, props.minor), peers=peers,
                     symmetric_memory=_symmetric_memory_problem())


def _probe_peers(index: int, uuids: list[str]) -> dict[str, PeerLink]:
    """CUDA peer access and native atomics (cuda-python), NVLink or not (NVML)."""
    from cuda.bindings import driver

    def check(result):
        err, *values = result
        if err != driver.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"CUDA driver call failed: {err}")
        return values[0] if values else None

    check(driver.cuInit(0))
    attr = driver.CUdevice_P2PAttribute
    if len(uuids) == 1:
        return {}
    bus_ids = [check(driver.cuDeviceGetPCIBusId(32, ordinal)).split(b"\0")[0].decode()
               for ordinal in range(len(uuids))]
    nvlinked = _nvml_nvlink_peers(index, bus_ids)
    peers = {}
    for other, uuid in enumerate(uuids):
        if other == index:
            continue
        access = check(driver.cuDeviceGetP2PAttribute(
            attr.CU_DEVICE_P2P_ATTRIBUTE_ACCESS_SUPPORTED, index, other))
        atomics = check(driver.cuDeviceGetP2PAttribute(
            attr.CU_DEVICE_P2P_ATTRIBUTE_NATIVE_ATOMIC_SUPPORTED, index, other))
        peers[uuid] = PeerLink(bool(access), bool(atomics), other in nvlinked)
    return peers


def _nvml_nvlink_peers(index: int, bus_ids: list[str]) -> set[int]:
    """Visible device ordinals whose link from ``index`` NVML reports as NVLink.

    Devices are matched by PCI bus id, since NVML ignores CUDA_VISIBLE_DEVICES.
    """
    import pynvml

    pynvml.nvmlInit()
    try:
        handles = [pynvml.nvmlDeviceGetHandleByPciBusId(b) for b in bus_ids]
        nvlink = pynvml.NVML_P2P_CAPS_INDEX_NVLINK
        return {other for other in range(len(bus_ids)) if other != index and
                pynvml.nvmlDeviceGetP2PStatus(handles[index], handles[other], nvlink)
                == pynvml.NVML_P2P_STATUS_OK}
    finally:
        pynvml.nvmlShutdown()


def _symmetric_memory_problem() -> str | None:
    try:
        import nvshmem.core  # noqa: F401
    except Exception as exc:
        return f"nvshmem4py is not importable ({exc.__class__.__name__}: {exc})"
    return None


@dataclass(frozen=True)
class BackendDecision:
    backend: Backend
    reason: str


def decide_backend(requested: str, probes: list[MeshProbe], *,
                   allow_shared_gpu: bool = False) -> BackendDecision:
    """The backend every rank will use, from every rank's probe (rank order).

    Pure: the same probes give the same answer on every rank.  ``"nccl"`` is
    always possible; ``"nvlink"`` needs one host, W in {2, 4, 8}, one GPU per rank
    (unless ``allow_shared_gpu``), compute capability >= 9.0, nvshmem4py, and every
    ordered pair of the ranks' GPUs peer-accessible over NVLink with native atomics.
    A forced ``"nvlink"`` that cannot be served raises ``UlyssesBackendError``;
    ``"auto"`` falls back to ``"nccl"`` with the reason.
    """
    requested = Backend(requested)
    if requested is Backend.NCCL:
        return BackendDecision(Backend.NCCL, "requested backend='nccl'")
    refusal = _nvlink_refusal(probes, allow_shared_gpu)
    if refusal is None:
        return BackendDecision(Backend.NVLINK, "every GPU pair is peer-accessible over NVLink "
                                               "with native atomics")
    if requested is Backend.NVLINK:
        raise UlyssesBackendError(f"backend='nvlink' is not possible: {refusal}")
    return BackendDecision(Backend.NCCL, f"NVLink path unavailable: {refusal}")


def _nvlink_refusal(probes: list[MeshProbe], allow_shared_gpu: bool) -> str | None:
    """Why the NVLink path cannot serve these ranks, or None if it can."""
    world = len(probes)
    if world not in NVLINK_WORLD_SIZES:
        return f"world size {world} is not one of {NVLINK_WORLD_SIZES}"
    for rank, p in enumerate(probes):
        if p.problem:
            return f"rank {rank}: {p.problem}"
        if p.device_type != "cuda":
            return f"rank {rank} runs on {p.device_type}, not a CUDA GPU"
        if p.capability is None or p.capability < MIN_CAPABILITY:
            return f"rank {rank}'s GPU has compute capability {p.capability}, needs >= 9.0"
        if p.symmetric_memory:
            return f"rank {rank}: {p.symmetric_memory}"
    hosts = {p.hostname for p in probes}
    if len(hosts) > 1:
        return f"ranks span several hosts ({sorted(hosts)})"
    uuids = [p.device_uuid for p in probes]
    for rank, p in enumerate(probes):
        for other, uuid in enumerate(uuids):
            if other == rank:
                continue
            if uuid == p.device_uuid:
                if allow_shared_gpu:
                    continue
                return (f"ranks {rank} and {other} share one GPU "
                        "(CAKE_SP_ALLOW_SHARED_GPU=1 allows it, for testing)")
            link = p.peers.get(uuid)
            if link is None:
                return f"rank {rank} cannot see rank {other}'s GPU"
            if not (link.access and link.native_atomics and link.nvlink):
                missing = [name for name, ok in (("peer access", link.access),
                                                 ("native atomics", link.native_atomics),
                                                 ("NVLink", link.nvlink)) if not ok]
                return f"GPU pair rank {rank} -> rank {other} lacks {', '.join(missing)}"
    return None
