"""The front end's producer launch on the engine chosen for the call (both backends).

Two engines compute the same contract (``kernels/producer.py``):

* ``"fused"``: one persistent Triton kernel, GEMM mainloop and epilogue in one pass;
* ``"cublas"``: the projection on cuBLAS into an fp32 workspace, then one Triton
  epilogue kernel (``kernels/producer_cublas.py``).

``"auto"`` takes ``_config.producer_engine``'s choice for the call's shape.  A call
whose projection autograd keeps (``projection=``) always runs the cuBLAS engine:
only it materialises the projection.
"""

from __future__ import annotations

import torch

from cake_sp.kernels import _config
from cake_sp.kernels.producer import qkv_norm_rope_produce
from cake_sp.kernels.producer_cublas import qkv_norm_rope_produce_cublas
from cake_sp.kernels.signals import ProducerSignals
from cake_sp.layouts import DestLayout, HeadPlan
from cake_sp.session.slots import CallInputs

ENGINES = ("auto", "fused", "cublas")


def produce(call: CallInputs, *, engine: str, plan: HeadPlan, dest: DestLayout,
            dest_table: torch.Tensor, dest_seq_offset: int, eps: float, rope_style: int,
            signals: ProducerSignals | None, bad_positions: torch.Tensor, block_m: int,
            projection: torch.Tensor | None = None) -> None:
    """Project, normalise and rotate ``call``'s rows and store every head at its destinations.

    ``engine``: one of ``ENGINES``.  ``projection``: an fp32 ``[rows, (Hq + 2*Hkv) * D]``
    workspace the cuBLAS engine fills with ``x @ qkv_weight.T`` for the caller to keep.
    Arguments otherwise as ``qkv_norm_rope_produce`` takes them, already validated.
    """
    x = call.x2d
    if engine == "auto":
        engine = _config.producer_engine(call.rows, x.device.type == "cuda"
                                         and not _config.INTERPRET)
    args = (x, call.qkv_weight, call.qkv_bias, call.q_norm_weight, call.k_norm_weight,
            call.rope_cos_sin, call.positions)
    common = dict(plan=plan, dest=dest, dest_table=dest_table, seq_local=call.seq_local,
                  dest_seq_offset=dest_seq_offset, eps=eps, rope_style=rope_style,
                  signals=signals, bad_positions=bad_positions, block_m=block_m,
                  validate=False)
    if engine == "cublas" or projection is not None:
        qkv_norm_rope_produce_cublas(*args, **common, workspace=projection)
    else:
        qkv_norm_rope_produce(*args, **common)
