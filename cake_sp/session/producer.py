"""The front end's producer launch on the engine chosen for the call (both backends).

Two engines compute the same contract (``kernels/producer.py``):

* ``"fused"``: one persistent Triton kernel, GEMM mainloop and epilogue in one pass;
* ``"cublas"``: the projection on cuBLAS into an fp32 workspace, then one Triton
  epilogue kernel (``kernels/producer_cublas.py``).

``"auto"`` takes ``_config.producer_engine``'s choice for the call's shape, or the engine
named by ``_config.PRODUCER_ENGINE_OVERRIDE`` (``CAKE_SP_PRODUCER_ENGINE``).  A call
whose projection autograd keeps (``projection=``) always runs the cuBLAS engine:
only it materialises the projection.  Otherwise the cuBLAS engine writes the
``Producer``'s workspace, allocated with the session's exchange and held in common by every
producer of its size on the device (``session.shared``): a call uses it between its GEMM and
its epilogue only, and a device's calls run one after another on one stream.
"""

from __future__ import annotations

import torch

from cake_sp.kernels import _config
from cake_sp.kernels.producer import qkv_norm_rope_produce
from cake_sp.kernels.producer_cublas import qkv_norm_rope_produce_cublas
from cake_sp.kernels.signals import ProducerSignals
from cake_sp.layouts import DestLayout, HeadPlan
from cake_sp.session.shared import hold_shared, release_shared
from cake_sp.session.slots import CallInputs

ENGINES = ("auto", "fused", "cublas")


def _cublas_rows(engine: str, max_tokens: int, on_gpu: bool) -> int:
    """The most rows a call may run on the cuBLAS engine (its workspace's rows)."""
    if engine == "cublas":
        return max_tokens
    if engine == "fused" or not on_gpu:
        return 0
    return min(_config.PRODUCER_CUBLAS_MAX_ROWS, max_tokens)


class Producer:
    """One session's producer: the engine (``ENGINES``) chosen per call, and the cuBLAS
    engine's fp32 projection workspace ``[rows, (Hq + 2*Hkv) * D]`` for the most rows a call
    may run on that engine, held here (in common, see the module docstring) so that a call
    allocates nothing; ``close`` drops it."""

    def __init__(self, engine: str, plan: HeadPlan, *, max_tokens: int,
                 device: torch.device) -> None:
        if engine == "auto" and _config.PRODUCER_ENGINE_OVERRIDE is not None:
            engine = _config.PRODUCER_ENGINE_OVERRIDE
        if engine not in ENGINES:
            raise ValueError(f"Producer: engine must be one of {ENGINES}, got {engine!r} "
                             "(CAKE_SP_PRODUCER_ENGINE?)")
        self.engine, self._plan = engine, plan
        self._on_gpu = device.type == "cuda" and not _config.INTERPRET
        self._num_sms = (torch.cuda.get_device_properties(device).multi_processor_count
                         if self._on_gpu else 0)
        rows = _cublas_rows(engine, max_tokens, self._on_gpu)
        shape = (rows, plan.total_heads * plan.head_dim)
        self.workspace = None if rows == 0 else hold_shared(
            ("cublas workspace", str(device), shape),
            lambda: torch.empty(shape, dtype=torch.float32, device=device))

    @property
    def nbytes(self) -> int:
        """Bytes of the workspace (counted in each holder)."""
        return 0 if self.workspace is None else self.workspace.nbytes

    def close(self) -> None:
        """Drop the hold on the workspace."""
        if self.workspace is not None:
            release_shared(self.workspace)
        self.workspace = None

    def __call__(self, call: CallInputs, *, dest: DestLayout, dest_table: torch.Tensor,
                 dest_seq_offset: int, eps: float, rope_style: int,
                 signals: ProducerSignals | None, bad_positions: torch.Tensor, block_m: int,
                 projection: torch.Tensor | None = None) -> None:
        """Project, normalise and rotate ``call``'s rows and store every head at its
        destinations.

        ``projection``: an fp32 ``[rows, (Hq + 2*Hkv) * D]`` tensor the cuBLAS engine fills
        with ``x @ qkv_weight.T`` for the caller to keep (autograd), which forces that
        engine.  Arguments otherwise as ``qkv_norm_rope_produce`` takes them, already
        validated.
        """
        x = call.x2d
        engine = self.engine
        if engine == "auto":
            engine = _config.producer_engine(call.rows, self._plan.total_heads,
                                             self._plan.head_dim, self._num_sms, self._on_gpu)
        args = (x, call.qkv_weight, call.qkv_bias, call.q_norm_weight, call.k_norm_weight,
                call.rope_cos_sin, call.positions)
        common = dict(plan=self._plan, dest=dest, dest_table=dest_table,
                      seq_local=call.seq_local, dest_seq_offset=dest_seq_offset, eps=eps,
                      rope_style=rope_style, signals=signals, bad_positions=bad_positions,
                      block_m=block_m, validate=False)
        if engine == "cublas" and projection is None:
            if self.workspace is None or self.workspace.shape[0] < call.rows:
                raise RuntimeError(f"Producer: the cuBLAS engine's workspace holds "
                                   f"{0 if self.workspace is None else self.workspace.shape[0]}"
                                   f" rows, the call has {call.rows} (was the engine table "
                                   "changed after the session was built?)")
            projection = self.workspace[:call.rows]
        if projection is not None:
            qkv_norm_rope_produce_cublas(*args, **common, workspace=projection)
        else:
            qkv_norm_rope_produce(*args, **common)
