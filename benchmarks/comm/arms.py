"""The implementations the benchmark times: the fused session and the per-operator baselines.

Every arm has the same life: ``prepare(inputs)`` (allocate, build, once per
row, untimed), ``run()`` (one call, enqueued on the current stream, the thing
timed), ``outputs()`` (``(q, k, v)`` ``[B, S_global, H_local, D]`` of the last
call, for the check against the reference), ``close()``; ``reference`` names
the expectation it is checked against (``problem.expected_outputs``).

Baselines share one compute step, ``project_norm_rope``: a cuBLAS bf16 GEMM,
then one fused Triton QK-norm + RoPE launch in place (``_norm_rope_op``).
They differ only in how heads are exchanged:

* B1 ``b1_three_a2a``: three all-to-alls, one each for Q, K, V;
* B2 ``b2_packed_a2a``: one all-to-all of the Q|K|V bands packed per destination;
* B3 ``b3_band_overlap``: the head bands split into chunks; chunk ``i`` is
  exchanged (on NCCL's stream) while chunk ``i + 1`` is projected (on the
  caller's stream);
* B4 ``b4_yunchang``: the DeepSpeed-Ulysses / yunchang ``all_to_all_4D``
  layout, ``all_to_all_single`` on the ``[B, S/P, P, H/P, D]`` transpose, per
  tensor.

B1-B3 pack with one ``index_select`` over the head dim (destination-major) and
unpack with one strided copy per run of same-kind heads; B4 packs and unpacks
the way yunchang does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

import torch
import torch.nn.functional as F
from torch import Tensor

from cake_sp import QkvNormRopeExchangeOverlap, UlyssesBackendError
from cake_sp.layouts import KIND_K, KIND_Q, KIND_V, HeadPlan

from _harness import BenchContext, all_to_all_bytes
from _norm_rope_op import qk_norm_rope_
from problem import EPS, ROPE_STYLE, Inputs, band_heads
from rows import Row

ARMS: dict[str, str] = {
    "fused_nvlink": "the session, backend='nvlink': GEMM epilogue stores into peers' slots",
    "fused_nccl": "the session, backend='nccl': fused producer, one all_to_all_single",
    "b1_three_a2a": "B1: GEMM -> QK norm+RoPE -> three all-to-alls (q, k, v)",
    "b2_packed_a2a": "B2: GEMM -> QK norm+RoPE -> one packed QKV all-to-all",
    "b3_band_overlap": "B3: head bands; projection of band i+1 overlaps exchange of band i",
    "b4_yunchang": "B4: GEMM -> QK norm+RoPE -> yunchang all_to_all_4D per tensor",
}
FUSED_ARMS = ("fused_nvlink", "fused_nccl")
B3_BANDS = 4


class ArmSkipped(Exception):
    """This arm cannot run here; the message says why (recorded, never silently dropped)."""


def skip_reason(name: str, ctx: BenchContext) -> str | None:
    """Why arm ``name`` cannot run in this process set-up, decided alike on every rank."""
    if name != "fused_nvlink" and ctx.is_cuda and ctx.dist_backend != "nccl":
        return ("needs all_to_all of CUDA tensors, which a gloo group cannot do (NCCL refuses "
                "several ranks on one GPU, so a shared-GPU run has no NCCL group)")
    return None


def project_norm_rope(x: Tensor, weight: Tensor, inputs: Inputs, num_q: int,
                      num_k: int) -> Tensor:
    """The baselines' compute: ``x @ weight.T`` (bf16 out), then QK norm + RoPE in place.

    ``weight`` holds ``num_q`` Q heads, then ``num_k`` K heads, then V heads.
    Returns bf16 ``[B, S_local, heads, D]``.
    """
    batch, seq, _ = x.shape
    d = inputs.q_norm_weight.shape[0]
    p = F.linear(x, weight).view(batch, seq, -1, d)
    return qk_norm_rope_(p, inputs.q_norm_weight, inputs.k_norm_weight, inputs.rope_cos_sin,
                         num_q=num_q, num_k=num_k, rope_style=ROPE_STYLE, eps=EPS)


def _poisoned_outputs(row: Row, plan: HeadPlan, device: torch.device) -> tuple[Tensor, ...]:
    """NaN-filled ``q, k, v`` so that anything a baseline fails to write fails the check."""
    return tuple(torch.full((row.batch, row.seq_global, plan.kind_heads(kind), row.head_dim),
                            float("nan"), dtype=torch.bfloat16, device=device)
                 for kind in (KIND_Q, KIND_K, KIND_V))


class SessionArm:
    """The fused session (``cake_sp.QkvNormRopeExchangeOverlap``) on one backend."""

    reference = "contract"

    def __init__(self, ctx: BenchContext, row: Row, backend: str) -> None:
        self._ctx, self._row, self._backend = ctx, row, backend
        self._session: QkvNormRopeExchangeOverlap | None = None
        self._out: tuple[Tensor, Tensor, Tensor] | None = None

    def prepare(self, inputs: Inputs) -> None:
        row, ctx = self._row, self._ctx
        try:
            self._session = QkvNormRopeExchangeOverlap(
                ctx.group, num_q_heads=row.num_q_heads, num_kv_heads=row.num_kv_heads,
                head_dim=row.head_dim, hidden=row.hidden,
                max_tokens=row.batch * row.seq_local(ctx.world_size), rope_style=ROPE_STYLE,
                eps=EPS, backend=self._backend, device=ctx.device)
        except UlyssesBackendError as exc:  # raised alike on every rank
            raise ArmSkipped(str(exc)) from exc
        self._args = (inputs.x, inputs.qkv_weight, inputs.q_norm_weight, inputs.k_norm_weight,
                      inputs.rope_cos_sin)

    def run(self) -> None:
        self._out = self._session(*self._args)

    def outputs(self) -> tuple[Tensor, Tensor, Tensor]:
        # Raises if a peer's data never arrived (NVLink path) instead of comparing garbage.
        self._session.synchronize()
        return self._out

    def info(self) -> dict:
        s = self._session
        return {"backend": s.backend, "backend_reason": s.backend_reason,
                "graph_capturable": s.graph_capturable}

    def close(self) -> None:
        if self._session is not None:
            self._session.close()


@dataclass
class _Exchange:
    """One all-to-all: local head positions ``[lo, hi)`` of every destination's band."""

    send_index: Tensor  # [W * (hi - lo)] rows of the band's computed heads, destination-major
    send: Tensor        # [W * (hi - lo), B, S_local, D]
    recv: Tensor        # same shape; rows [src * (hi - lo), ...] come from rank src
    runs: list[tuple[int, int, int, int]]  # (kind, first recv head, first out head, count)


@dataclass
class _Band:
    """Heads projected together (ascending, so Q, then K, then V) and their exchanges."""

    weight: Tensor
    num_q: int
    num_k: int
    exchanges: list[_Exchange]


def _position_kind(plan: HeadPlan, pos: int) -> tuple[int, int]:
    """``(kind, head within kind)`` of local position ``pos`` of a destination's band."""
    for kind in (KIND_V, KIND_K, KIND_Q):
        if pos >= plan.kind_offset(kind):
            return kind, pos - plan.kind_offset(kind)
    raise ValueError(f"negative band position {pos}")


class ExchangeArm:
    """B1-B3: project head bands, pack destination-major, ``all_to_all_single``, unpack.

    ``bands`` lists, per band, the position ranges of its exchanges: local head
    positions ``[lo, hi)`` (0 .. ``heads_per_rank``) taken from every
    destination's band.  B1 = one band, three exchanges (Q, K, V ranges);
    B2 = one band, one exchange; B3 = several bands, one exchange each.
    """

    reference = "bf16_projection"

    def __init__(self, ctx: BenchContext, row: Row, bands: Sequence[Sequence[range]]) -> None:
        self._ctx, self._row, self._layout = ctx, row, bands

    def prepare(self, inputs: Inputs) -> None:
        ctx, row = self._ctx, self._row
        plan = HeadPlan(ctx.world_size, row.num_q_heads, row.num_kv_heads, row.head_dim)
        self._inputs = inputs
        self._out = _poisoned_outputs(row, plan, ctx.device)
        dest_heads = [sum(band_heads(plan, r), []) for r in range(ctx.world_size)]
        shape = (row.batch, row.seq_local(ctx.world_size), row.head_dim)
        weight = inputs.qkv_weight.view(row.total_heads, row.head_dim, row.hidden)
        self._bands = []
        for ranges in self._layout:
            heads = sorted({dest_heads[r][p] for r in range(ctx.world_size)
                            for span in ranges for p in span})
            exchanges = []
            for span in ranges:
                index = [heads.index(dest_heads[r][p]) for r in range(ctx.world_size)
                         for p in span]
                send = torch.empty((len(index), *shape), dtype=torch.bfloat16, device=ctx.device)
                exchanges.append(_Exchange(torch.tensor(index, device=ctx.device), send,
                                           torch.empty_like(send), self._runs(plan, span)))
            hq = row.num_q_heads
            self._bands.append(_Band(
                weight[heads].reshape(-1, row.hidden),
                num_q=sum(h < hq for h in heads),
                num_k=sum(hq <= h < hq + row.num_kv_heads for h in heads),
                exchanges=exchanges))

    @staticmethod
    def _runs(plan: HeadPlan, span: range) -> list[tuple[int, int, int, int]]:
        """Split ``span`` into runs of one kind: ``(kind, recv head, out head, count)``."""
        runs: list[list[int]] = []
        for i, pos in enumerate(span):
            kind, head = _position_kind(plan, pos)
            if runs and runs[-1][0] == kind:
                runs[-1][3] += 1
            else:
                runs.append([kind, i, head, 1])
        return [tuple(r) for r in runs]

    def run(self) -> None:
        ctx, x = self._ctx, self._inputs.x
        pending = []
        for band in self._bands:
            p = project_norm_rope(x, band.weight, self._inputs, band.num_q, band.num_k)
            by_head = p.permute(2, 0, 1, 3)  # [heads, B, S_local, D], a view
            for ex in band.exchanges:
                torch.index_select(by_head, 0, ex.send_index, out=ex.send)
                # Async: the next band's GEMM is enqueued while this exchange runs.
                pending.append((ex, all_to_all_bytes(ex.recv, ex.send, ctx.group,
                                                     async_op=True)))
        world, (batch, s_global) = ctx.world_size, self._out[0].shape[:2]
        for ex, work in pending:
            work.wait()
            recv = ex.recv.view(world, -1, batch, s_global // world, ex.recv.shape[-1])
            for kind, first, head, count in ex.runs:
                out = self._out[kind]
                out.view(batch, world, s_global // world, out.shape[2], -1)[
                    :, :, :, head:head + count].copy_(
                    recv[:, first:first + count].permute(2, 0, 3, 1, 4))

    def outputs(self) -> tuple[Tensor, Tensor, Tensor]:
        return self._out

    def info(self) -> dict:
        return {"exchanges_per_call": sum(len(b.exchanges) for b in self._bands),
                "bands": len(self._bands)}

    def close(self) -> None:
        self._bands = []


class YunchangArm:
    """B4: the DeepSpeed-Ulysses / yunchang ``all_to_all_4D`` (scatter heads, gather sequence).

    Per tensor ``t [B, S_local, H, D]``: ``t.reshape(B, S_local, P, H/P, D).transpose(0, 2)``
    made contiguous, ``all_to_all_single``, then ``reshape(S_global, B, H/P, D).transpose(0, 1)``.
    Where K/V heads replicate (``W % Hkv == 0``) each is repeated to one per rank first.
    """

    reference = "bf16_projection"

    def __init__(self, ctx: BenchContext, row: Row) -> None:
        self._ctx, self._row = ctx, row

    def prepare(self, inputs: Inputs) -> None:
        ctx, row = self._ctx, self._row
        plan = HeadPlan(ctx.world_size, row.num_q_heads, row.num_kv_heads, row.head_dim)
        self._inputs = inputs
        self._out = _poisoned_outputs(row, plan, ctx.device)
        kv_heads = torch.arange(row.num_kv_heads, device=ctx.device)
        self._kv_index = (kv_heads.repeat_interleave(plan.kv_replicas)
                          if plan.kv_replicas > 1 else None)

    def _all_to_all_4d(self, t: Tensor, out: Tensor) -> None:
        world = self._ctx.world_size
        batch, shard_seq, heads, d = t.shape
        send = t.reshape(batch, shard_seq, world, heads // world, d).transpose(0, 2).contiguous()
        recv = torch.empty_like(send)
        all_to_all_bytes(recv, send, self._ctx.group)
        out.copy_(recv.reshape(shard_seq * world, batch, heads // world, d).transpose(0, 1))

    def run(self) -> None:
        row = self._row
        hq, hkv = row.num_q_heads, row.num_kv_heads
        p = project_norm_rope(self._inputs.x, self._inputs.qkv_weight, self._inputs, hq, hkv)
        q, k, v = p[:, :, :hq], p[:, :, hq:hq + hkv], p[:, :, hq + hkv:]
        if self._kv_index is not None:
            k, v = k[:, :, self._kv_index], v[:, :, self._kv_index]
        for t, out in zip((q, k, v), self._out, strict=True):
            self._all_to_all_4d(t, out)

    def outputs(self) -> tuple[Tensor, Tensor, Tensor]:
        return self._out

    def info(self) -> dict:
        return {"exchanges_per_call": 3}

    def close(self) -> None:
        self._out = ()


def _split(span: range, parts: int) -> list[range]:
    """``span`` cut into at most ``parts`` contiguous, nearly equal, non-empty ranges."""
    parts = max(1, min(parts, len(span)))
    edges = [span.start + len(span) * i // parts for i in range(parts + 1)]
    return [range(a, b) for a, b in pairwise(edges)]


def build_arm(name: str, ctx: BenchContext, row: Row):
    """A new, unprepared arm ``name`` (one of ``ARMS``) for ``row``."""
    if name in FUSED_ARMS:
        return SessionArm(ctx, row, name.removeprefix("fused_"))
    if name == "b4_yunchang":
        return YunchangArm(ctx, row)
    plan = HeadPlan(ctx.world_size, row.num_q_heads, row.num_kv_heads, row.head_dim)
    q_end, k_end = plan.kind_offset(KIND_K), plan.kind_offset(KIND_V)
    everything = range(plan.heads_per_rank)
    layouts = {
        "b1_three_a2a": [[range(0, q_end), range(q_end, k_end), range(k_end, len(everything))]],
        "b2_packed_a2a": [[everything]],
        "b3_band_overlap": [[part] for part in _split(everything, B3_BANDS)],
    }
    if name not in layouts:
        raise ValueError(f"unknown arm {name!r}; valid: {list(ARMS)}")
    return ExchangeArm(ctx, row, layouts[name])
