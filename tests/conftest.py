"""Shared test set-up.

Without a GPU, Triton kernels run on the CPU through Triton's interpreter; the
switch must be set before any kernel module is imported, hence here.
"""

from __future__ import annotations

import os

import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")

import pytest  # noqa: E402

# Under pytest-xdist each worker gets an equal share of the host's cores for torch's CPU
# threads.  Left at torch's default (every core, in every worker) the fp64 oracles of 8
# workers on a 16-core host ran 128 threads, and a reference that takes 5 s alone had not
# finished after 110 s, which looked like a GPU kernel that never returns.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // _WORKERS))


@pytest.fixture
def device() -> torch.device:
    """The device kernel tests run on: the GPU when there is one, else the CPU interpreter."""
    return torch.device("cuda" if HAS_CUDA else "cpu")


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)
