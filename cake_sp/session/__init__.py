"""The prepared session: validation, backend choice, symmetric memory and the NVLink path.

* ``overlap`` -- ``QkvNormRopeExchangeOverlap``, the public session (configuration
  agreement across ranks, call validation, dispatch to a backend);
* ``mesh`` -- the topology probe and the backend decision;
* ``slots`` -- the receive-slot ring and one call's validated inputs (both backends);
* ``heap`` -- symmetric memory (nvshmem4py, or W virtual ranks in one process for tests);
* ``nvlink`` -- the NVLink path: epochs, barrier -> producer -> wait, timeouts;
* ``positions`` -- the GPU-side range check of ``positions``, reported without a sync.

The NCCL path lives in ``cake_sp.fallback``; the host-only layouts (head bands,
destination and readiness layouts) in ``cake_sp.layouts``, below both this package and
``cake_sp.kernels``.
"""
