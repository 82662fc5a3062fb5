"""``QkvNormRopeExchangeOverlap``: the prepared per-layer session (DESIGN.md section 2).

Construction is collective and does all the work that can be done once:
validate the configuration on every rank jointly (one all-gather), agree on the
backend from every rank's mesh probe, allocate buffers.  A call then validates
its tensors locally (before any collective, so a bad call raises on every rank
that makes it) and runs the chosen backend's sequence with no allocation and no
host collective.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from functools import partial

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from cake_sp._validation import check_positive_int, check_tensor
from cake_sp.fallback.exchange import NcclExchange, nccl_graph_capturable
from cake_sp.kernels.norm_rope import rope_style_code
from cake_sp.kernels.producer import HEAD_DIMS as SUPPORTED_HEAD_DIMS
from cake_sp.layouts import GATHER_TOKENS, BandTransfer, DestLayout, HeadPlan
from cake_sp.session import ops
from cake_sp.session.autograd import FrontEndFunction
from cake_sp.session.bands import shared_band_exchange
from cake_sp.session.mesh import (
    Backend,
    BackendDecision,
    EnvOverrides,
    decide_backend,
    probe_mesh,
)
from cake_sp.session.producer import ENGINES
from cake_sp.session.shared import check_not_capturing, hold_shared, release_shared
from cake_sp.session.slots import CallInputs

# What local validation may raise; re-raised on every rank after the all-gather.
_ERRORS = {"ValueError": ValueError, "TypeError": TypeError, "RuntimeError": RuntimeError,
           "ImportError": ImportError}
# The producer's GEMM steps over hidden in blocks of at least 16 (and its TMA
# mainloop reads 16-byte aligned rows), so both are checked before any launch.
HIDDEN_MULTIPLE = 16
ALIGNMENT_BYTES = 16


@dataclass(frozen=True)
class SessionConfig:
    """Everything every rank must agree on; compared field by field across ranks."""

    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    hidden: int
    max_tokens: int
    num_slots: int
    layout: str
    rope_style: str
    eps: float
    backend: str
    device_type: str
    wait_timeout_s: float
    engine: str
    save_projection: bool
    slot_pool: str | None

    def validate(self, world_size: int) -> HeadPlan:
        """Check every field; return the head plan.  ValueError/TypeError names the field."""
        for name in ("num_q_heads", "num_kv_heads", "head_dim", "hidden", "max_tokens",
                     "num_slots"):
            check_positive_int(name, getattr(self, name))
        if self.head_dim not in SUPPORTED_HEAD_DIMS:
            raise ValueError(f"head_dim must be one of {SUPPORTED_HEAD_DIMS}, got {self.head_dim}")
        if self.hidden % HIDDEN_MULTIPLE:
            raise ValueError(f"hidden must be a multiple of {HIDDEN_MULTIPLE}, got {self.hidden}")
        rope_style_code(self.rope_style)
        if self.backend not in tuple(b.value for b in Backend):
            raise ValueError(f"backend must be one of {[b.value for b in Backend]}, "
                             f"got {self.backend!r}")
        if self.engine not in ENGINES:
            raise ValueError(f"engine must be one of {ENGINES}, got {self.engine!r}")
        if not isinstance(self.save_projection, bool):
            raise TypeError(f"save_projection must be a bool, got "
                            f"{type(self.save_projection).__name__}")
        if self.slot_pool is not None and not (isinstance(self.slot_pool, str)
                                               and self.slot_pool):
            raise TypeError(f"slot_pool must be None or a non-empty str, got {self.slot_pool!r}")
        for name in ("eps", "wait_timeout_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a positive finite number, got {value!r}")
        plan = HeadPlan(world_size, self.num_q_heads, self.num_kv_heads, self.head_dim)
        # Rejects an unknown layout, and "fused" with GQA, with the layout's own message.
        DestLayout.for_layout(plan, self.layout, token_capacity=1, seq_len=1)
        return plan


class QkvNormRopeExchangeOverlap:
    """Fused QKV projection + per-head Q/K RMSNorm + RoPE + Ulysses head exchange.

    Per call, rank ``r`` of ``W`` gives its token shard ``x`` ``[B, S_local, hidden]``
    and receives its head band for the whole sequence ``S_global = W * S_local``:
    ``q [B, S_global, Hq/W, D]``, ``k, v [B, S_global, Hkv_local, D]`` (layout
    ``"bshd"``) or one ``[B, S_global, H/W, 3*D]`` q|k|v-per-head tensor (``"fused"``).
    It equals ``cake_sp.reference.qkv_norm_rope_exchange`` of every rank's input.

    Parameters
    ----------
    group : torch.distributed group or 1-D DeviceMesh, optional
        The sequence-parallel group; None means the default (world) group.
    num_q_heads, num_kv_heads, head_dim, hidden : int
        Model shape; ``qkv_weight`` is ``[(Hq + 2*Hkv) * head_dim, hidden]``.
    max_tokens : int
        Most rows ``B * S_local`` one call may have; buffers are sized from it once.
    num_slots : int
        Receive slots in the ring; a call's outputs stay valid for ``num_slots - 1``
        further calls (calls without grad: see ``slot_pool``).
    layout : {"bshd", "fused"}
    rope_style : {"interleaved", "neox"}
    eps : float
        RMSNorm epsilon.
    backend : {"auto", "nvlink", "nccl"}
        ``"auto"`` probes the mesh and falls back to ``"nccl"`` with the reason in
        ``backend_reason``; ``"nvlink"`` raises ``UlyssesBackendError`` if it cannot serve.
    device : torch.device, optional
        Defaults to the current CUDA device, or the CPU when there is no GPU.  On the
        CPU the front end runs in plain PyTorch (``fallback/torch_front_end.py``), or
        in Triton's interpreter when ``TRITON_INTERPRET=1`` was set before the import.
    wait_timeout_s : float
        NVLink path: how long a rank waits for a peer's data before giving up and
        reporting which ranks never arrived (the next call raises).
    engine : {"auto", "fused", "cublas"}
        How the producer computes (``session.producer``): one fused Triton kernel, or
        cuBLAS then a Triton epilogue; ``"auto"`` picks per call shape
        (``_config.producer_engine``).
    save_projection : bool
        Under autograd, keep the projection ``x @ qkv_weight.T`` (fp32, ``rows * (Hq +
        2*Hkv) * D * 4`` bytes a call, until its backward) instead of recomputing its
        Q/K part in the backward (one GEMM).  Such calls run the cuBLAS engine.
    slot_pool : str, optional
        None (the default): every call goes through the session's own ring, built here.
        A name: calls without grad go through one receive slot (and, on the NCCL path,
        staging) held in common by every session of the same configuration and
        ``slot_pool`` on the group, so their outputs stay valid only until the next such
        call of any of them; the own ring is built by the first call under grad
        (collective, like construction).  For a caller that reads each call's outputs
        before the next (``UlyssesAttention``): a model served without grad then holds
        one slot, not one a layer.

    Construction is collective: every rank of ``group`` must construct, with the
    same configuration, or every rank raises the same error.

    A call is differentiable when an input requires grad (``session.autograd``
    says what the backward does and saves); its outputs then keep their receive
    slot from reuse until the backward has run, and a call that would need a
    leased slot raises ``SlotInUseError`` on every rank before sending anything.
    """

    def __init__(self, group: dist.ProcessGroup | DeviceMesh | None = None, *, num_q_heads: int,
                 num_kv_heads: int, head_dim: int, hidden: int, max_tokens: int,
                 num_slots: int = 2, layout: str = "bshd", rope_style: str = "interleaved",
                 eps: float = 1e-6, backend: str = "auto", device: torch.device | None = None,
                 wait_timeout_s: float = 30.0, engine: str = "auto",
                 save_projection: bool = False, slot_pool: str | None = None) -> None:
        self._group = resolve_group(group)
        self._closed = True
        self._own = self._shared = self._grad_exchange = None
        self.world_size = dist.get_world_size(self._group)
        self.rank = dist.get_rank(self._group)
        self.device = _resolve_device(device)
        env = EnvOverrides.read()
        if backend == Backend.AUTO.value and env.backend:
            backend = env.backend
        self.config = SessionConfig(num_q_heads, num_kv_heads, head_dim, hidden, max_tokens,
                                    num_slots, layout, rope_style, eps, backend,
                                    self.device.type, wait_timeout_s, engine, save_projection,
                                    slot_pool)
        plan, error = None, None
        try:
            plan = self.config.validate(self.world_size)
        except (ValueError, TypeError, RuntimeError) as exc:
            error = (type(exc).__name__, str(exc))
        probe = probe_mesh(self.device) if error is None else None
        gathered: list = [None] * self.world_size
        dist.all_gather_object(gathered, (asdict(self.config), error, probe), group=self._group)
        decision = agree_on_backend(gathered, env)
        self.plan: HeadPlan = plan
        self.backend: str = decision.backend.value
        self.backend_reason: str = decision.reason
        # Whether a call can be captured in a CUDA graph (docs/guide.md).
        self.graph_capturable: bool = (decision.backend is Backend.NVLINK
                                       or nccl_graph_capturable(self._group, self.device))
        if slot_pool is None:
            self._own = self._build(self.config.num_slots)
        self.op_handle = ops.register(self)  # how the compiled call names this session
        self._closed = False

    def _build(self, num_slots: int):
        """The backend's exchange with a ring of ``num_slots`` (collective)."""
        check_not_capturing(self.device, "front end's exchange")
        cfg = self.config
        common = dict(layout=cfg.layout, max_tokens=cfg.max_tokens, num_slots=num_slots,
                      device=self.device, eps=float(cfg.eps),
                      rope_style=rope_style_code(cfg.rope_style), engine=cfg.engine)
        if self.backend == Backend.NVLINK.value:
            from cake_sp.session.heap import NvshmemHeap
            from cake_sp.session.nvlink import NvlinkExchange
            return NvlinkExchange(NvshmemHeap(self._group, self.device), self.plan,
                                  wait_timeout_s=float(cfg.wait_timeout_s), **common)
        return NcclExchange(self._group, self.plan, **common)

    def exchange(self, for_backward: bool):
        """The backend's exchange a call runs on (``NvlinkExchange`` or ``NcclExchange``): the
        session's own ring for a call whose backward will run or without ``slot_pool``, else
        the one held in common by the pool.  Built on first use (collective: every rank makes
        the same calls)."""
        if for_backward or self.config.slot_pool is None:
            if self._own is None:
                self._own = self._build(self.config.num_slots)
            return self._own
        if self._shared is None:
            key = ("front end", self.backend, id(self._group), str(self.device),
                   replace(self.config, num_slots=1))
            self._shared = hold_shared(key, lambda: self._build(1))
        return self._shared

    @property
    def held_exchanges(self) -> tuple:
        """The exchanges this session holds now (its own ring, the pool's, the backward's)."""
        return tuple(e for e in (self._own, self._shared, self._grad_exchange) if e is not None)

    def __call__(self, x: Tensor, qkv_weight: Tensor, q_norm_weight: Tensor | None,
                 k_norm_weight: Tensor | None, rope_cos_sin: Tensor,
                 positions: Tensor | None = None, qkv_bias: Tensor | None = None,
                 out: Sequence[Tensor] | Tensor | None = None
                 ) -> tuple[Tensor, Tensor, Tensor] | Tensor:
        """Run one layer's front end; every rank of the group must call, in the same order.

        Parameters
        ----------
        x : bf16 ``[B, S_local, hidden]``, contiguous, on the session's device.
        qkv_weight : bf16 ``[(Hq + 2*Hkv) * D, hidden]``, contiguous (``nn.Linear`` layout).
        q_norm_weight, k_norm_weight : bf16 ``[D]`` or None (None skips that norm).
        rope_cos_sin : fp32 ``[B * S_local, D]`` per token, or ``[max_pos, D]`` with ``positions``.
        positions : int32/int64 ``[B, S_local]``, optional; rows of ``rope_cos_sin``.  Checked
            on the GPU: one outside the table makes the next call or ``synchronize`` raise
            ``ValueError`` (docs/guide.md, Errors).
        qkv_bias : bf16 ``[(Hq + 2*Hkv) * D]``, optional.
        out : caller-owned outputs to copy into (``(q, k, v)`` or one fused tensor).

        Returns
        -------
        ``(q, k, v)`` for ``"bshd"`` or one tensor for ``"fused"``: views of the
        session's current receive slot (or ``out``).  Enqueued on the current
        stream; the host does not wait for the GPU.

        Under ``torch.compile`` the call is the custom operator ``cake_sp::front_end``
        (``session/ops.py``); ``out=`` is not available there.
        """
        if torch.compiler.is_compiling():
            if out is not None:
                raise ValueError("out= is not supported under torch.compile (the outputs are "
                                 "views of the receive slot; copy them in the model instead)")
            return ops.front_end(self, x, qkv_weight, q_norm_weight, k_norm_weight,
                                 rope_cos_sin, positions, qkv_bias)
        if self._closed:
            raise RuntimeError("QkvNormRopeExchangeOverlap is closed")
        call = self._check_call_inputs(x, qkv_weight, q_norm_weight, k_norm_weight,
                                       rope_cos_sin, positions, qkv_bias)
        out_list = self._check_out(out, call)
        differentiable = (x, qkv_weight, qkv_bias, q_norm_weight, k_norm_weight)
        if ops.differentiable(*differentiable):
            if out_list is not None:
                raise ValueError("out= cannot be combined with inputs that require grad "
                                 "(the outputs would not be part of the autograd graph)")
            self.grad_exchange()  # built here, in a forward every rank makes alike
            views = FrontEndFunction.apply(self, call, *differentiable)
        else:
            views, _ = self.exchange(False).run(call, out_list)
        return views[0] if self.config.layout == "fused" else tuple(views)

    def grad_exchange(self):
        """The backward's exchange (``dq, dk, dv`` gathered back to token order), built on the
        first call that needs gradients (collective, like construction).  One slot, shared
        with every session of the same shape on the group: a backward reads it at once, and
        the next call's entry barrier orders its reuse."""
        if self._grad_exchange is None:
            plan = self.plan
            transfer = BandTransfer(GATHER_TOKENS, self.world_size,
                                    (plan.q_per_rank, plan.kv_per_rank, plan.kv_per_rank),
                                    plan.head_dim)
            self._grad_exchange = shared_band_exchange(
                self.backend, self._group, transfer, max_tokens=self.config.max_tokens,
                device=self.device, wait_timeout_s=float(self.config.wait_timeout_s),
                what="front end backward")
        return self._grad_exchange

    def synchronize(self) -> None:
        """Wait for this rank's enqueued calls; raise if a peer's data never arrived
        (``PeerTimeoutError``) or if a call's positions lay outside its RoPE table
        (``ValueError``)."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        for exchange in self.held_exchanges:
            exchange.check()

    def close(self) -> None:
        """Release the session's buffers (collective on the NVLink path).  Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._own is not None:
            self._own.close()
        for held in (self._shared, self._grad_exchange):
            if held is not None:
                release_shared(held)
        self._own = self._shared = self._grad_exchange = None
        # No reference to the process group outlives close(): a group kept alive past
        # destroy_process_group() is torn down at interpreter exit, which can abort it.
        self._group = None

    def __enter__(self) -> QkvNormRopeExchangeOverlap:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __repr__(self) -> str:
        cfg = self.config
        return (f"QkvNormRopeExchangeOverlap(world_size={self.world_size}, Hq={cfg.num_q_heads}, "
                f"Hkv={cfg.num_kv_heads}, D={cfg.head_dim}, layout={cfg.layout!r}, "
                f"backend={self.backend!r})")

    # -- validation -------------------------------------------------------------------------

    def _check_call_inputs(self, x, qkv_weight, q_norm_weight, k_norm_weight, rope_cos_sin,
                           positions, qkv_bias) -> CallInputs:
        cfg, plan = self.config, self.plan
        d = cfg.head_dim
        n = plan.total_heads * d
        bf16 = (torch.bfloat16,)
        check = partial(check_tensor, device=self.device, contiguous=True)
        check("x", x, dtypes=bf16, ndim=3)
        batch, seq_local, hidden = x.shape
        if hidden != cfg.hidden:
            raise ValueError(f"x must be [B, S_local, hidden={cfg.hidden}], got {tuple(x.shape)}")
        rows = batch * seq_local
        if rows < 1 or rows > cfg.max_tokens:
            raise ValueError(f"x has B * S_local = {rows} rows; the session takes 1 to "
                             f"max_tokens={cfg.max_tokens}")
        check("qkv_weight", qkv_weight, dtypes=bf16, shape=(n, cfg.hidden))
        for name, tensor in (("x", x), ("qkv_weight", qkv_weight)):
            if tensor.data_ptr() % ALIGNMENT_BYTES:
                raise ValueError(f"{name} must start at a {ALIGNMENT_BYTES}-byte aligned address "
                                 f"(a fresh tensor does), got {tensor.data_ptr():#x}")
        check("qkv_bias", qkv_bias, dtypes=bf16, shape=(n,), optional=True)
        check("q_norm_weight", q_norm_weight, dtypes=bf16, shape=(d,), optional=True)
        check("k_norm_weight", k_norm_weight, dtypes=bf16, shape=(d,), optional=True)
        check("rope_cos_sin", rope_cos_sin, dtypes=(torch.float32,), ndim=2)
        if rope_cos_sin.shape[1] != d:
            raise ValueError(f"rope_cos_sin must have head_dim={d} columns (cos then sin), got "
                             f"{tuple(rope_cos_sin.shape)}")
        table_rows = rope_cos_sin.shape[0]
        if positions is None:
            if table_rows < rows:
                raise ValueError(f"rope_cos_sin without positions needs one row per token "
                                 f"(B * S_local = {rows}), got {table_rows} rows")
            flat_positions = None
        else:
            check("positions", positions, dtypes=(torch.int32, torch.int64),
                  shape=(batch, seq_local))
            # Their range is checked by the producer on the GPU (session/positions.py).
            flat_positions = positions.view(rows)
        return CallInputs(x.view(rows, hidden), batch, seq_local, self.world_size, qkv_weight,
                          qkv_bias, q_norm_weight, k_norm_weight, rope_cos_sin, flat_positions)

    def _check_out(self, out, call: CallInputs) -> list[Tensor] | None:
        if out is None:
            return None
        plan, d = self.plan, self.config.head_dim
        s_global = call.seq_global
        if self.config.layout == "fused":
            expected = {"out": (call.batch, s_global, plan.q_per_rank, 3 * d)}
            tensors = [out]
        else:
            if not isinstance(out, (tuple, list)) or len(out) != 3:
                raise TypeError("out must be a (q, k, v) tuple for layout='bshd'")
            expected = {"out[0] (q)": (call.batch, s_global, plan.q_per_rank, d),
                        "out[1] (k)": (call.batch, s_global, plan.kv_per_rank, d),
                        "out[2] (v)": (call.batch, s_global, plan.kv_per_rank, d)}
            tensors = list(out)
        for (name, shape), tensor in zip(expected.items(), tensors):
            check_tensor(name, tensor, dtypes=(torch.bfloat16,), device=self.device, shape=shape,
                         contiguous=True)
        return tensors


def resolve_group(group) -> dist.ProcessGroup:
    """A process group from ``group``: None (the default group), a ``ProcessGroup``, or a
    1-D ``DeviceMesh`` (its group)."""
    if group is None:
        return dist.group.WORLD
    if isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise ValueError(f"group: a DeviceMesh must be 1-D (pass mesh['sp'] for the "
                             f"sequence-parallel dimension), got {group.ndim}-D {group}")
        return group.get_group()
    return group


def _resolve_device(device: torch.device | str | None) -> torch.device:
    if device is None:
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def raise_unless_agreed(gathered: list[tuple[dict, tuple[str, str] | None]], *, prefix: str,
                        mismatch: str) -> None:
    """Every rank's ``(options, local error)`` -> the same exception on every rank, or nothing.

    The first rank's error is raised again with its rank; otherwise options that differ
    between rank 0 and another rank raise ``ValueError`` (``prefix`` + "ranks " +
    ``mismatch``, then the differing fields).
    """
    for rank, (_, error) in enumerate(gathered):
        if error is not None:
            kind, message = error
            raise _ERRORS[kind](f"{prefix}{message} (rank {rank})")
    first = gathered[0][0]
    for rank, (options, _) in enumerate(gathered[1:], start=1):
        differing = sorted(k for k in options if options[k] != first[k])
        if differing:
            detail = ", ".join(f"{k}: {first[k]!r} vs {options[k]!r}" for k in differing)
            raise ValueError(f"{prefix}ranks {mismatch} (rank 0 vs rank {rank}: {detail})")


def agree_on_backend(gathered: list, env: EnvOverrides, *, prefix: str = "",
                     mismatch: str = "constructed the session with different configurations"
                     ) -> BackendDecision:
    """Every rank's (config, error, probe) -> one decision, or the same exception on every rank
    (``raise_unless_agreed``'s ``prefix`` and ``mismatch``).  ``config["backend"]`` is the
    requested backend."""
    raise_unless_agreed([(config, error) for config, error, _ in gathered], prefix=prefix,
                        mismatch=mismatch)
    probes = [probe for _, _, probe in gathered]
    return decide_backend(gathered[0][0]["backend"], probes,
                          allow_shared_gpu=env.allow_shared_gpu)

