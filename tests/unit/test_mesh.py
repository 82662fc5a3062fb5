"""The backend decision on synthetic topologies, and the probe on this machine."""

from __future__ import annotations

import pytest
import torch

from cake_sp.session.mesh import (
    Backend,
    MeshProbe,
    PeerLink,
    UlyssesBackendError,
    decide_backend,
    probe_mesh,
)

NVLINK = PeerLink(access=True, native_atomics=True, nvlink=True)


def _mesh(world, link=NVLINK, hosts=None, capability=(9, 0), uuids=None, **overrides):
    uuids = uuids or [f"GPU-{i}" for i in range(world)]
    probes = []
    for rank in range(world):
        peers = {u: link for u in set(uuids) if u != uuids[rank]}
        probes.append(MeshProbe(hostname=(hosts or ["node0"] * world)[rank], device_type="cuda",
                                device_uuid=uuids[rank], capability=capability, peers=peers,
                                **overrides))
    return probes


@pytest.mark.parametrize("world", [2, 4, 8])
def test_full_nvlink_mesh_picks_nvlink(world):
    decision = decide_backend("auto", _mesh(world))
    assert decision.backend is Backend.NVLINK
    assert decide_backend("nvlink", _mesh(world)).backend is Backend.NVLINK


@pytest.mark.parametrize("probes,why", [
    (_mesh(3), "world size 3"),
    (_mesh(1), "world size 1"),
    (_mesh(2, link=PeerLink(True, True, False)), "lacks NVLink"),
    (_mesh(4, link=PeerLink(True, False, True)), "lacks native atomics"),
    (_mesh(2, link=PeerLink(False, False, False)), "lacks peer access, native atomics, NVLink"),
    (_mesh(2, hosts=["a", "b"]), "several hosts"),
    (_mesh(2, capability=(8, 0)), "compute capability (8, 0)"),
    (_mesh(2, symmetric_memory="nvshmem4py is not importable"), "nvshmem4py"),
    (_mesh(2, uuids=["GPU-0", "GPU-0"]), "share one GPU"),
    (_mesh(2, problem="probing the GPU failed"), "probing the GPU failed"),
    ([MeshProbe(hostname="a", device_type="cpu")] * 2, "not a CUDA GPU"),
])
def test_auto_falls_back_with_reason_and_forced_nvlink_raises(probes, why):
    decision = decide_backend("auto", probes)
    assert decision.backend is Backend.NCCL
    assert why in decision.reason
    with pytest.raises(UlyssesBackendError, match="not possible"):
        decide_backend("nvlink", probes)


def test_one_missing_pair_is_enough_to_refuse():
    probes = _mesh(4)
    broken = dict(probes[2].peers)
    broken["GPU-1"] = PeerLink(True, True, False)
    probes[2] = MeshProbe(**{**probes[2].__dict__, "peers": broken})
    decision = decide_backend("auto", probes)
    assert decision.backend is Backend.NCCL
    assert "rank 2 -> rank 1" in decision.reason


def test_shared_gpu_needs_the_test_switch():
    probes = _mesh(4, uuids=["GPU-0"] * 4)
    assert decide_backend("auto", probes).backend is Backend.NCCL
    assert decide_backend("auto", probes, allow_shared_gpu=True).backend is Backend.NVLINK


def test_nccl_is_always_possible_and_unknown_names_are_rejected():
    assert decide_backend("nccl", _mesh(3)).backend is Backend.NCCL
    with pytest.raises(ValueError, match="'gloo'"):
        decide_backend("gloo", _mesh(2))


def test_probe_never_raises_and_reports_cpu():
    probe = probe_mesh(torch.device("cpu"))
    assert probe.device_type == "cpu" and probe.problem is None
