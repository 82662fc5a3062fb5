"""``UlyssesAttentionCore``: Ulysses attention over ``q, k, v`` the caller computed itself.

For a model whose front end the layer's producer does not compute (a Q/K norm over all
heads, as Wan's; its own RoPE; LoRA on the projections), the core keeps the model's
projections and runs only the sequence-parallel part, per rank::

    q, k, v = scatter_by_heads(q, k, v)   # [B, S_local, H, D] -> [B, S, H / W, D], S = W * S_local
    o = attention(q, k, v)                # this rank's band of heads, the whole sequence
    o = gather_by_tokens(o)               # -> [B, S_local, Hq, D]

Both exchanges are the layer's ``BandExchange``s (``session/bands.py``: NVLink stores into
the peers' receive slots, or one NCCL all-to-all), and so are their mirrors in the
backward (``session/autograd.py``: ``HeadScatterFunction``, ``OutputProjectionFunction``
without a projection).  What the layer fuses into its producer (the QKV GEMM, norm and
RoPE) stays the caller's: one more pass over q, k, v than the layer, and any math.

*Joint tokens* (``joint=(q, k, v)``): tokens every rank holds whole, the text of a diffusion
model's joint attention, attended with the sequence both as queries and as keys.  No rank
sends them: each takes its own head band of them locally, joins it to the bands it received,
attends over ``S + T`` tokens, and sends its band of their output to every rank with the
sequence's (the gather by tokens, each destination receiving the same band), so every rank
gets their whole output.  Their keys count once and their queries are attended once, where
passing them as every rank's own tokens would attend ``W`` copies of them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn

from cake_sp._validation import (
    check_positive_int,
    check_positive_number,
    check_sliding_window,
    check_tensor,
)
from cake_sp.attention import attention, check_key_mask, resolve_attention_backend
from cake_sp.kernels.producer import HEAD_DIMS
from cake_sp.layouts import GATHER_TOKENS, SCATTER_HEADS, BandTransfer, HeadPlan
from cake_sp.session import ops
from cake_sp.session.autograd import HeadScatterFunction, OutputProjectionFunction
from cake_sp.session.bands import make_band_exchange, shared_band_exchange
from cake_sp.session.mesh import Backend, EnvOverrides, probe_mesh
from cake_sp.session.overlap import _resolve_device, agree_on_backend, resolve_group
from cake_sp.session.shared import release_shared

# What q, k and v may come in: bf16 as they are, fp32 cast to bf16 (the exchange and the
# attention run in bf16, as the layer's).
INPUT_DTYPES = (torch.bfloat16, torch.float32)


class UlyssesAttentionCore(nn.Module):
    """Ulysses sequence-parallel attention of ``q, k, v`` given per rank for its own tokens.

    Parameters
    ----------
    num_q_heads, num_kv_heads, head_dim : int
        ``num_q_heads`` divisible by the group size; ``num_kv_heads`` dividing it and
        dividing or divisible by the group size; ``head_dim`` in 64, 128, 256.
    causal : bool
        Causal attention over global token order (rank ``r``'s tokens at ``[r * S_local,
        (r + 1) * S_local)``), or bidirectional (diffusion transformers).
    sliding_window : int, optional
        Causal only: a query attends its last ``sliding_window`` keys (as the layer's).
    group : ProcessGroup or 1-D DeviceMesh, optional
        The sequence-parallel group (None: the default group).
    max_tokens : int
        Most rows ``B * S_local`` one call may have; the exchanges' buffers are sized from it.
    softmax_scale : float, optional
        Defaults to ``head_dim ** -0.5``.
    softcap : float, optional
        Soft-capped attention logits (as the layer's).
    attention_backend : {"auto", "sdpa", "flash"}
        See ``cake_sp.attention``.
    backend : {"auto", "nvlink", "nccl"}
        The exchanges' backend, decided as the layer's (``QkvNormRopeExchangeOverlap``).
    num_slots : int
        Calls under autograd that may await their backward at once (as the layer's).
    share_backward_exchange : bool
        The backward's scatter of ``d_o`` by heads goes through one slot shared by every
        core of the same shape on the group (the default), read by this core's attention
        backward, next.  ``False`` gives the core a slot of its own: for a module holding
        two cores of one shape that is compiled whole (SD3.5's dual-attention blocks), as
        Inductor may run both cores' output backwards before either attention backward
        (the second then raises ``SlotInUseError`` on every rank; nothing is overwritten).
    wait_timeout_s : float
        How long a GPU wait for a peer's data may take before the call is marked timed out.
    device : optional
        The ranks' device (the current CUDA device, or the CPU).

    Buffers, all allocated on first use (collective: every rank makes the same calls):

    * calls under autograd use exchanges of this module's own (``num_slots`` slots of
      ``(Hq + 2 * Hkv_local * W) * D`` and ``Hq * D`` bf16 values a row, ``max_tokens``
      rows): the attention saves views of them for its backward, in place of copies;
    * calls without autograd, and every backward, use exchanges shared by every module of
      the same shape on the group (one slot each), so a model's cores hold one set.

    Construction is collective over ``group``: every rank builds the module with the same
    arguments, or every rank raises the same error.  So is every call.
    """

    # A call holds its own attention, so eagerly its output step's backward is followed by
    # that attention's backward before any other core's: the shared slot of ``d_o`` is read
    # at once.  A compiled graph holding two cores may order their backwards otherwise.
    BACKWARD_SLOT_REMEDY = (
        "A second core's output backward ran before the attention backward that reads the "
        "first one's d_o (the cores of one shape share that slot), as Inductor may order the "
        "backward of a compiled module holding two cores: build one of them with "
        "share_backward_exchange=False (a slot of its own).")

    def __init__(self, num_q_heads: int, num_kv_heads: int, head_dim: int, *, causal: bool,
                 sliding_window: int | None = None,
                 group: dist.ProcessGroup | None = None, max_tokens: int,
                 softmax_scale: float | None = None, softcap: float | None = None,
                 attention_backend: str = "auto", backend: str = "auto", num_slots: int = 1,
                 share_backward_exchange: bool = True, wait_timeout_s: float = 30.0,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        group = resolve_group(group)
        device = _resolve_device(device)
        env = EnvOverrides.read()
        if backend == Backend.AUTO.value and env.backend:
            backend = env.backend
        world = dist.get_world_size(group)
        options = dict(num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                       causal=causal, sliding_window=sliding_window, max_tokens=max_tokens,
                       softmax_scale=softmax_scale, softcap=softcap,
                       attention_backend=attention_backend,
                       backend=backend,
                       num_slots=num_slots, share_backward_exchange=share_backward_exchange,
                       wait_timeout_s=wait_timeout_s, device_type=device.type)
        error = None
        try:
            self.plan = _check_options(options, world)
            self.attention_backend, self.attention_reason = resolve_attention_backend(
                attention_backend, device)
        except (ValueError, TypeError, ImportError) as exc:
            error = (type(exc).__name__, str(exc))
        probe = probe_mesh(device) if error is None else None
        gathered: list = [None] * world
        dist.all_gather_object(gathered, (options, error, probe), group=group)
        decision = agree_on_backend(gathered, env, prefix="UlyssesAttentionCore: ",
                                    mismatch="built the core with different options")
        self.backend, self.backend_reason = decision.backend.value, decision.reason
        self.causal, self.softmax_scale, self.max_tokens = causal, softmax_scale, max_tokens
        self.sliding_window, self.softcap = sliding_window, softcap
        self.num_slots, self.device = num_slots, device
        self._share_scatter = share_backward_exchange
        self._group, self._timeout = group, float(wait_timeout_s)
        self.rank = dist.get_rank(group)
        plan = self.plan
        q, kv = plan.q_per_rank, plan.kv_per_rank
        self._transfers = {
            "scatter_qkv": BandTransfer(SCATTER_HEADS, world, (q, kv, kv), head_dim),
            "gather_o": BandTransfer(GATHER_TOKENS, world, (q,), head_dim),
            "gather_dqkv": BandTransfer(GATHER_TOKENS, world, (q, kv, kv), head_dim),
            "scatter_do": BandTransfer(SCATTER_HEADS, world, (q,), head_dim),
        }
        self._own: dict = {}     # this module's exchanges, by transfer name
        self._shared: dict = {}  # exchanges shared with every core of this shape
        self.op_handle = ops.register(self)  # how the compiled steps name this core

    def _exchange(self, name: str, *, own: bool):
        """The exchange of transfer ``name``: this module's own, or the shared one (built on
        first use; collective)."""
        held = self._own if own else self._shared
        if name not in held:
            common = dict(max_tokens=self.max_tokens, device=self.device,
                          wait_timeout_s=self._timeout, what=f"core {name}")
            if own:
                held[name] = make_band_exchange(self.backend, self._group,
                                                self._transfers[name],
                                                num_slots=self.num_slots, **common)
            else:
                held[name] = shared_band_exchange(self.backend, self._group,
                                                  self._transfers[name], **common)
        return held[name]

    @property
    def band_heads(self) -> tuple[int, int, int]:
        """Heads of q, k and v each rank receives (its bands)."""
        return self._transfers["scatter_qkv"].part_heads

    def scatter_exchanges(self, for_backward: bool) -> tuple:
        """The scatter by heads of ``q, k, v`` (this module's own for a call whose backward will
        run, else the shared one) and, for such a call, the gather by tokens of their
        gradients (else None)."""
        return (self._exchange("scatter_qkv", own=for_backward),
                self._exchange("gather_dqkv", own=False) if for_backward else None)

    def output_exchanges(self, for_backward: bool) -> tuple:
        """The gather by tokens of the attention's output and, for a call whose backward will
        run, the scatter by heads of its gradient (else None); as ``scatter_exchanges``."""
        return (self._exchange("gather_o", own=for_backward),
                self._exchange("scatter_do", own=not self._share_scatter) if for_backward
                else None)

    @property
    def group(self) -> dist.ProcessGroup | None:
        """The sequence-parallel group (None once closed)."""
        return self._group

    def forward(self, q: Tensor, k: Tensor, v: Tensor, *, key_mask: Tensor | None = None,
                joint: tuple[Tensor, Tensor, Tensor] | None = None) -> Tensor:
        """``o [B, S_local (+ T), Hq, D]`` bf16: attention of this rank's queries (and the
        joint tokens') over the whole sequence (and the joint tokens), for this rank's tokens
        (then the joint tokens).

        q : ``[B, S_local, Hq, D]``; k, v : ``[B, S_local, Hkv, D]``: this rank's tokens, every
            head, bf16 (fp32 is cast to bf16), on the module's device; any strides.
        key_mask : optional bool ``[B, S]`` over the whole sequence (``S = W * S_local``; with
            ``joint``, ``[B, S + T]``: the sequence's keys, then the joint tokens'), the same
            on every rank: False (or 0) for a key no query may attend to.
        joint : optional ``(q [B, T, Hq, D], k [B, T, Hkv, D], v [B, T, Hkv, D])``, tokens every
            rank passes whole and alike (the text of a joint attention; ``causal=False``
            only).  Their output ``[B, T, Hq, D]``, the same on every rank, follows this
            rank's tokens' in ``o``; ``B * (S_local + T)`` rows count against ``max_tokens``.
            Their gradient on each rank covers its own band of heads (the part of the loss
            reached through that band), so the sum over the group is the whole gradient.

        Every rank of the group calls, in the same order.  Under autograd (an input that
        requires grad) the result is a view of this module's receive slot, leased until
        its backward, and ``dq, dk, dv`` are fresh tensors; without, a fresh tensor.  Under
        ``torch.compile`` the two exchanges are custom operators (``session/ops.py``), so the
        core compiles into the model's graph with no break (``fullgraph=True``).
        """
        q, k, v = self._checked(q, k, v)
        batch, seq_local = q.shape[:2]
        joint = self._checked_joint(joint, batch, seq_local)
        joint_tokens = 0 if joint is None else joint[0].shape[1]
        if key_mask is not None:
            key_mask = check_key_mask(
                key_mask, batch=batch, seq=self.plan.world_size * seq_local + joint_tokens,
                device=q.device)
        if self.plan.kv_replicas > 1:  # each rank's K/V head, once per rank that uses it
            k, v = (t.repeat_interleave(self.plan.kv_replicas, dim=2) for t in (k, v))
        grad = ops.differentiable(q, k, v, *(joint or ()))
        compiling = torch.compiler.is_compiling()
        if compiling:
            q, k, v = ops.head_scatter(self, q, k, v)
        else:
            q, k, v = HeadScatterFunction.apply(*self.scatter_exchanges(grad), q, k, v)
        if joint is not None:
            q, k, v = (torch.cat((band, own), dim=1)
                       for band, own in zip((q, k, v), self._joint_bands(joint)))
        with torch.autocast(q.device.type, enabled=False):
            o = attention(q, k, v, causal=self.causal, softmax_scale=self.softmax_scale,
                          backend=self.attention_backend, key_mask=key_mask,
                          window=self.sliding_window, softcap=self.softcap)
        if joint is not None:
            o = self._with_joint_rows(o, joint_tokens)
        if compiling:
            y = ops.output_projection(self, o, None, None)
        else:
            y = OutputProjectionFunction.apply(*self.output_exchanges(grad),
                                               self.BACKWARD_SLOT_REMEDY, o, None, None)
        y = y.view(batch, seq_local + joint_tokens, self.plan.num_q_heads, self.plan.head_dim)
        return y if grad else y.clone()  # without autograd the slot is shared: copied out

    def _joint_bands(self, joint: tuple[Tensor, Tensor, Tensor]) -> tuple[Tensor, ...]:
        """This rank's band of the joint tokens' heads: Q heads ``[r * q, (r + 1) * q)``, and
        the K/V heads that band uses (one K/V head shared by ``kv_replicas`` ranks)."""
        plan, r = self.plan, self.rank
        kv_first = r * plan.kv_per_rank // plan.kv_replicas
        jq, jk, jv = joint
        return (jq.narrow(2, r * plan.q_per_rank, plan.q_per_rank),
                jk.narrow(2, kv_first, plan.kv_per_rank), jv.narrow(2, kv_first, plan.kv_per_rank))

    def _with_joint_rows(self, o: Tensor, joint_tokens: int) -> Tensor:
        """``o [B, S + T, h, D]`` (the sequence's rows, then the joint tokens') laid out for
        the gather by tokens: ``[B, W * (S_local + T), h, D]``, destination ``d``'s block its
        own rows then the joint tokens' (every block the same ones; so in the backward the
        joint rows' gradient is the sum of every rank's)."""
        world = self.plan.world_size
        batch, rows, heads, dim = o.shape
        sequence, joint_rows = o.split((rows - joint_tokens, joint_tokens), dim=1)
        blocks = sequence.unflatten(1, (world, -1))
        copies = joint_rows.unsqueeze(1).expand(batch, world, joint_tokens, heads, dim)
        return torch.cat((blocks, copies), dim=2).flatten(1, 2)

    def _checked(self, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``q, k, v`` checked (host checks only: every rank raises alike before any exchange)
        and cast to bf16."""
        plan = self.plan
        check_tensor("q", q, dtypes=INPUT_DTYPES, device=self.device, ndim=4)
        batch, seq_local = q.shape[:2]
        if not 1 <= batch * seq_local <= self.max_tokens:
            raise ValueError(f"q: B * S_local = {batch * seq_local} rows; the core takes 1 to "
                             f"max_tokens={self.max_tokens}")
        check_tensor("q", q, shape=(batch, seq_local, plan.num_q_heads, plan.head_dim))
        kv_shape = (batch, seq_local, plan.num_kv_heads, plan.head_dim)
        for name, t in (("k", k), ("v", v)):
            check_tensor(name, t, dtypes=INPUT_DTYPES, device=self.device, shape=kv_shape)
        return tuple(t.to(torch.bfloat16) for t in (q, k, v))

    def _checked_joint(self, joint, batch: int, seq_local: int) -> tuple[Tensor, ...] | None:
        """``joint`` checked as ``_checked`` checks ``q, k, v``, cast to bf16; None stays."""
        if joint is None:
            return None
        if self.causal:
            raise ValueError("joint: joint tokens need a core with causal=False (they have no "
                             "place in the sequence's order)")
        if not isinstance(joint, (tuple, list)) or len(joint) != 3:
            raise TypeError(f"joint must be a tuple (q, k, v) of tensors, got {type(joint)}")
        plan = self.plan
        check_tensor("joint q", joint[0], dtypes=INPUT_DTYPES, device=self.device, ndim=4)
        tokens = joint[0].shape[1]
        if tokens < 1 or batch * (seq_local + tokens) > self.max_tokens:
            raise ValueError(f"joint q: T = {tokens} joint tokens, B * (S_local + T) = "
                             f"{batch * (seq_local + tokens)} rows; the core takes T >= 1 and "
                             f"at most max_tokens={self.max_tokens} rows")
        check_tensor("joint q", joint[0], shape=(batch, tokens, plan.num_q_heads, plan.head_dim))
        kv_shape = (batch, tokens, plan.num_kv_heads, plan.head_dim)
        for name, t in (("joint k", joint[1]), ("joint v", joint[2])):
            check_tensor(name, t, dtypes=INPUT_DTYPES, device=self.device, shape=kv_shape)
        return tuple(t.to(torch.bfloat16) for t in joint)

    @property
    def buffer_bytes(self) -> int:
        """Device memory of the exchanges this module holds (shared ones counted in each)."""
        return sum(e.nbytes for e in (*self._own.values(), *self._shared.values()))

    def synchronize(self) -> None:
        """Wait for this rank's enqueued work; raise if an exchange timed out
        (``PeerTimeoutError``)."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        for exchange in (*self._own.values(), *self._shared.values()):
            exchange.check()

    def close(self) -> None:
        """Release the exchanges (collective on the NVLink path).  Idempotent."""
        for exchange in self._own.values():
            exchange.close()
        for exchange in self._shared.values():
            release_shared(exchange)
        self._own, self._shared, self._group = {}, {}, None

    def __enter__(self) -> UlyssesAttentionCore:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def extra_repr(self) -> str:
        plan = self.plan
        return (f"heads={plan.num_q_heads}/{plan.num_kv_heads}, head_dim={plan.head_dim}, "
                f"world_size={plan.world_size}, causal={self.causal}, "
                f"backend={self.backend!r} ({self.backend_reason}), "
                f"attention_backend={self.attention_backend!r} ({self.attention_reason})")


def _check_options(options: dict, world: int) -> HeadPlan:
    """The head split of ``options`` over ``world`` ranks, or the error naming the argument."""
    plan = HeadPlan(world, options["num_q_heads"], options["num_kv_heads"], options["head_dim"])
    if options["head_dim"] not in HEAD_DIMS:
        raise ValueError(f"head_dim must be one of {HEAD_DIMS}, got {options['head_dim']}")
    for name in ("max_tokens", "num_slots"):
        check_positive_int(name, options[name])
    if not isinstance(options["causal"], bool):
        raise TypeError(f"causal must be a bool, got {options['causal']!r}")
    check_sliding_window(options["sliding_window"], options["causal"])
    for name in ("softmax_scale", "softcap"):
        check_positive_number(name, options[name])
    backends = [b.value for b in Backend]
    if options["backend"] not in backends:
        raise ValueError(f"backend must be one of {backends}, got {options['backend']!r}")
    return plan
