"""The prepared session: validation, backend choice, symmetric memory and the NVLink path.

* ``overlap`` -- ``QkvNormRopeExchangeOverlap``, the public session (configuration
  agreement across ranks, call validation, dispatch to a backend);
* ``mesh`` -- the topology probe and the backend decision;
* ``slots`` -- receive-slot rings with their autograd leases, one call's validated inputs;
* ``heap`` -- symmetric memory (nvshmem4py, or W virtual ranks in one process for tests);
* ``channel`` -- one NVLink exchange's slots, epoch, entry and readiness words, timeouts;
* ``nvlink`` -- the front end's NVLink path: the fused producer writing a channel;
* ``bands`` -- band exchanges of computed tensors (the layer's other three exchanges);
* ``autograd`` -- the backward of the session call and of the output projection;
* ``positions`` -- the GPU-side range check of ``positions``, reported without a sync.

The NCCL path lives in ``cake_sp.fallback``; the host-only layouts (head bands,
destination and readiness layouts) in ``cake_sp.layouts``, below both this package and
``cake_sp.kernels``.
"""
