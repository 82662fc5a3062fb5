"""``UlyssesAttention``: the whole sequence-parallel attention layer (DESIGN.md section 6).

Per rank, for its token shard ``x [B, S_local, hidden]`` (global position of token
``s`` of rank ``r``: ``r * S_local + s``)::

    q, k, v = session(x, qkv_weight, q_norm_weight, k_norm_weight, rope, positions, qkv_bias)
                                       # front end: GEMM -> QK RMSNorm -> RoPE -> scatter by heads
    o = attention(q, k, v)             # this rank's head band over the whole sequence
    y = gather_by_tokens(o) @ o_weight.T (+ o_bias)   # back end: o_proj as rows arrive

The front end is a ``QkvNormRopeExchangeOverlap`` session; the back end a
``BandExchange`` of the same backend whose receive slot the o_proj GEMM reads
row chunk by row chunk as the readiness words say the chunk is there (NVLink),
or after one asynchronous all-to-all (NCCL).  Both steps are
``torch.autograd.Function``s (``session/autograd.py``); the backward mirrors them.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn

from cake_sp._validation import check_positive_number, check_sliding_window
from cake_sp.attention import (
    attention,
    check_cu_seqlens,
    check_key_mask,
    resolve_attention_backend,
)
from cake_sp.layouts import GATHER_TOKENS, SCATTER_HEADS, BandTransfer
from cake_sp.session import ops
from cake_sp.session.autograd import OutputProjectionFunction
from cake_sp.session.bands import make_band_exchange, shared_band_exchange
from cake_sp.session.overlap import (
    QkvNormRopeExchangeOverlap,
    _resolve_device,
    raise_unless_agreed,
    resolve_group,
)
from cake_sp.session.shared import release_shared

PARAM_DTYPES = (torch.bfloat16, torch.float32)


class UlyssesAttention(nn.Module):
    """Ulysses sequence-parallel attention: QKV projection, per-head Q/K RMSNorm, RoPE,
    attention over the whole sequence on each rank's head band, and the output projection.

    Parameters
    ----------
    hidden, num_q_heads, num_kv_heads, head_dim : int
        Model shape (``head_dim`` in 64, 128, 256; ``num_q_heads`` divisible by the group
        size; ``num_kv_heads`` dividing or divisible by it).
    group : ProcessGroup or 1-D DeviceMesh, optional
        The sequence-parallel group (None: the default group).
    max_tokens : int
        Most rows ``B * S_local`` one call may have; buffers are sized from it once.
    qkv_bias, o_bias : bool
        Whether the projections have biases.
    qk_norm : bool
        Per-head RMSNorm of Q and K before RoPE (Qwen3, FLUX); off for Llama/Qwen2.
    qk_norm_offset : float
        The norms scale by ``qk_norm_offset + q_norm_weight`` (and ``k_norm_weight``):
        0 (Qwen3, FLUX), or 1 for Gemma 3's zero-centred weights (``1 + w``).  The sum is
        taken in fp32 and rounded to bf16 once per forward (the front end takes bf16 norm
        weights; Gemma multiplies by it in fp32: within one bf16 rounding of the scale).
    rope_style : {"neox", "interleaved"}
        ``rotate_half`` pairs ``(i, i + D/2)`` (Llama, Qwen) or pairs ``(2i, 2i+1)`` (FLUX).
    causal : bool
        Causal attention over global token order (source rank, then position).
    sliding_window : int, optional
        Causal only: a query attends its last ``sliding_window`` keys (itself among them),
        as transformers' ``sliding_window`` (Mistral); within its packed sequence and its
        kept keys where ``cu_seqlens`` or ``key_mask`` is given too.
    eps : float
        RMSNorm epsilon.
    softmax_scale : float, optional
        Defaults to ``head_dim ** -0.5``.
    softcap : float, optional
        Soft-capped attention logits: the scaled logits ``s`` become ``softcap * tanh(s /
        softcap)`` (Gemma 2's ``attn_logit_softcapping``; ``cake_sp.attention``).
    attention_backend : {"auto", "sdpa", "flash"}
        See ``cake_sp.attention``; ``extra_repr`` shows the choice and why.
    backend : {"auto", "nvlink", "nccl"}
        The exchanges' backend (see ``QkvNormRopeExchangeOverlap``).
    o_proj : bool
        Without it (FLUX single-stream blocks), the layer returns the token-order
        attention output ``[B, S_local, Hq * D]`` and has no ``o_weight``.
    num_slots : int
        Receive slots of each forward exchange: how many forwards may await their
        backward at once (an activation-checkpointed forward holds none).  1 (the default)
        serves ``fwd, bwd, fwd, bwd`` schedules with or without checkpointing; a pipeline
        schedule with ``k`` forwards awaiting their backwards needs ``k``.
    slot_pool : str or None
        Without grad the front end stores its bands in one receive slot held in common by
        every layer of the same shape and ``slot_pool`` on the group (the attention reads
        them at once), and the layer's own slots are built by its first forward under
        grad: a model served without grad holds one, not one a layer.  ``front_end``'s
        outputs without grad are then valid until the next ``front_end`` of the pool, so
        a module that keeps one layer's while another layer's runs (the dual-stream
        blocks of ``integrations.diffusers``) puts the two layers in different pools.
        None: the layer's own ``num_slots`` slots for every call (``front_end``'s outputs
        without grad valid for ``num_slots - 1`` further calls), built with the layer.
    engine : {"auto", "fused", "cublas"}
        The front end's producer (see ``QkvNormRopeExchangeOverlap``).
    save_projection : bool
        Keep the forward's QKV projection for the backward instead of recomputing its Q/K
        part there (see ``QkvNormRopeExchangeOverlap``; docs/guide.md, Training).
    share_backward_exchange : bool
        The backward's scatter of ``d_o`` by heads goes through one slot shared by every
        layer of the same shape on the group (the default): its result is read by this
        layer's attention backward, next.  ``False`` gives the layer a slot of its own,
        for a module that runs several layers' ``back_end`` steps on one attention (FLUX's
        dual-stream blocks), whose backwards both finish before the attention's: sharing
        there, the second raises ``SlotInUseError`` on every rank (the slot still holds
        the first's ``d_o``, unread), and nothing is overwritten.
    device, dtype :
        Where the parameters live (the current CUDA device, or the CPU), and their dtype:
        bf16, or fp32 master weights (cast to bf16 in each forward, fp32 gradients).

    Parameters (``nn.Parameter``): ``qkv_weight [(Hq + 2*Hkv) * D, hidden]``,
    ``qkv_bias [(Hq + 2*Hkv) * D]``, ``q_norm_weight [D]``, ``k_norm_weight [D]``,
    ``o_weight [hidden, Hq * D]``, ``o_bias [hidden]`` (each where enabled).

    Construction is collective over ``group``: every rank builds the layer with the
    same arguments, or every rank raises the same error.  So is every call.
    """

    # What the backward's ``SlotInUseError`` advises when the shared slot of ``d_o`` is
    # still unread (the joint pattern of ``front_end``/``back_end``: see
    # ``share_backward_exchange``).
    BACKWARD_SLOT_REMEDY = (
        "A second output step's backward ran before the attention backward that reads the "
        "first one's d_o, as when a module attends over several layers' front ends at once "
        "and calls each layer's back_end: build those layers with "
        "share_backward_exchange=False (a slot each).")

    def __init__(self, hidden: int, num_q_heads: int, num_kv_heads: int, head_dim: int, *,
                 group: dist.ProcessGroup | None = None, max_tokens: int,
                 qkv_bias: bool = False, o_bias: bool = False, qk_norm: bool = True,
                 qk_norm_offset: float = 0.0, rope_style: str = "neox", causal: bool = True,
                 sliding_window: int | None = None, eps: float = 1e-6,
                 softmax_scale: float | None = None, softcap: float | None = None,
                 attention_backend: str = "auto", backend: str = "auto", o_proj: bool = True,
                 num_slots: int = 1, wait_timeout_s: float = 30.0, engine: str = "auto",
                 save_projection: bool = False, share_backward_exchange: bool = True,
                 slot_pool: str | None = "default", device: torch.device | str | None = None,
                 dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        group = resolve_group(group)
        device = _resolve_device(device)
        options = dict(qkv_bias=qkv_bias, o_bias=o_bias, qk_norm=qk_norm,
                       qk_norm_offset=qk_norm_offset, causal=causal,
                       sliding_window=sliding_window, softmax_scale=softmax_scale,
                       softcap=softcap,
                       attention_backend=attention_backend, o_proj=o_proj,
                       share_backward_exchange=share_backward_exchange, dtype=str(dtype))
        error = None
        try:
            self._check_options(options, dtype)
            self.attention_backend, self.attention_reason = resolve_attention_backend(
                attention_backend, device)
        except (ValueError, TypeError, ImportError) as exc:
            error = (type(exc).__name__, str(exc))
        gathered: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, (options, error), group=group)
        raise_unless_agreed(gathered, prefix="UlyssesAttention: ",
                            mismatch="built the layer with different options")
        self.hidden, self.num_q_heads, self.num_kv_heads = hidden, num_q_heads, num_kv_heads
        self.head_dim, self.causal, self.max_tokens = head_dim, causal, max_tokens
        self.softmax_scale, self.sliding_window = softmax_scale, sliding_window
        self.softcap = softcap
        self.qk_norm_offset = float(qk_norm_offset)
        self.session = QkvNormRopeExchangeOverlap(
            group, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
            hidden=hidden, max_tokens=max_tokens, num_slots=num_slots, rope_style=rope_style,
            eps=eps, backend=backend, device=device, wait_timeout_s=wait_timeout_s,
            engine=engine, save_projection=save_projection, slot_pool=slot_pool)
        plan = self.session.plan
        self._group, self._timeout = group, wait_timeout_s
        self._share_scatter, self._num_slots = share_backward_exchange, num_slots
        # The output step's gather by tokens: without grad one slot shared by every layer of
        # the same shape on the group (its rows are read at once, by o_proj or a copy), so a
        # model served without grad holds one, not one a layer; under grad this layer's own,
        # leased until the backward.  Each is built by the first forward that needs it.
        self._gather_transfer = BandTransfer(GATHER_TOKENS, plan.world_size,
                                             (plan.q_per_rank,), head_dim)
        self._shared_gather = self._gather = self._scatter = None
        self.op_handle = ops.register(self)  # how the compiled output step names this layer

        def param(*shape):
            return nn.Parameter(torch.empty(shape, device=device, dtype=dtype))

        n_qkv = (num_q_heads + 2 * num_kv_heads) * head_dim
        self.qkv_weight = param(n_qkv, hidden)
        self.qkv_bias = param(n_qkv) if qkv_bias else None
        self.q_norm_weight = param(head_dim) if qk_norm else None
        self.k_norm_weight = param(head_dim) if qk_norm else None
        self.o_weight = param(hidden, num_q_heads * head_dim) if o_proj else None
        self.o_bias = param(hidden) if o_proj and o_bias else None
        self.reset_parameters()

    @staticmethod
    def _check_options(options: dict, dtype: torch.dtype) -> None:
        if dtype not in PARAM_DTYPES:
            raise TypeError(f"dtype must be torch.bfloat16 or torch.float32 (fp32 master "
                            f"weights; the layer computes in bf16 either way), got {dtype}")
        for name in ("softmax_scale", "softcap"):
            check_positive_number(name, options[name])
        check_sliding_window(options["sliding_window"], options["causal"])
        offset = options["qk_norm_offset"]
        if isinstance(offset, bool) or not isinstance(offset, (int, float)) or \
                not math.isfinite(offset):
            raise ValueError(f"qk_norm_offset must be a finite float (0, or 1 for Gemma 3's "
                             f"1 + w), got {offset!r}")
        if options["o_bias"] and not options["o_proj"]:
            raise ValueError("o_bias=True needs o_proj=True")

    def reset_parameters(self) -> None:
        """``nn.Linear``'s initialisation for the projections; norm weights that scale by
        one (ones, or zeros with ``qk_norm_offset=1``)."""
        for weight, bias in ((self.qkv_weight, self.qkv_bias), (self.o_weight, self.o_bias)):
            if weight is None:
                continue
            nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
            if bias is not None:
                bound = 1 / math.sqrt(weight.shape[1])
                nn.init.uniform_(bias, -bound, bound)
        for norm in (self.q_norm_weight, self.k_norm_weight):
            if norm is not None:
                nn.init.constant_(norm, 1.0 - self.qk_norm_offset)

    @property
    def group(self) -> dist.ProcessGroup | None:
        """The sequence-parallel group (None once closed)."""
        return self._group

    @property
    def backend(self) -> str:
        return self.session.backend

    @property
    def backend_reason(self) -> str:
        return self.session.backend_reason

    def forward(self, x: Tensor, rope_cos_sin: Tensor, positions: Tensor | None = None,
                cu_seqlens: Sequence[int] | Tensor | None = None,
                key_mask: Tensor | None = None) -> Tensor:
        """``y [B, S_local, hidden]`` bf16 (``[B, S_local, Hq * D]`` without o_proj).

        x : bf16 ``[B, S_local, hidden]``, this rank's tokens (fp32 is cast to bf16).
        rope_cos_sin : fp32 ``[B * S_local, D]`` per token (cos of the D/2 frequencies,
            then sin), or ``[max_pos, D]`` indexed by ``positions [B, S_local]``.
        cu_seqlens : optional, the same on every rank: sequences packed along the whole
            sequence (``S = W * S_local`` tokens per row, rank ``r``'s at ``[r * S_local,
            (r + 1) * S_local)``), as ``[N + 1]`` offsets into the ``B * S`` tokens taken row
            by row (see ``cake_sp.attention``).  Each attends only within itself.  Checked on
            the host before any exchange (a GPU tensor is read back: one sync).
        key_mask : optional bool ``[B, S]`` over the whole sequence (``S = W * S_local``, in
            that order), the same on every rank, on ``x``'s device: False (or 0) for a key
            no query may attend to (padding).  Not with ``cu_seqlens`` (padding can be a
            sequence of its own there).  Where every row keeps a key (one run of keys each,
            padding at the end or the start, causal or not; any keys if bidirectional),
            attention runs on the kept keys alone, one call per group of alike rows (one
            host read per mask tensor); otherwise on SDPA with the mask, or on a GPU for
            causal or GQA calls on flex attention (``cake_sp.attention``).  A query with no
            key to attend gives zeros.

        Every rank of the group calls, in the same order.  Without grad (or with nothing
        requiring it, frozen weights) the result is a fresh tensor; with grad (the
        no-o_proj layer's result is then a view of a receive slot) every slot a call's
        autograd state reads stays leased until its backward.

        Under ``torch.compile`` the session call and the output step are custom operators
        (``session/ops.py``), so the layer compiles into the model's graph (and its
        backward into the compiled backward) with no graph break.  A call with
        ``cu_seqlens`` runs eagerly instead (one graph break); pass it as a tensor there, as
        the compiler specialises on a tuple's ints (one recompilation per packing).

        The same as ``back_end(attend(*front_end(x, rope_cos_sin, positions), cu_seqlens=...,
        key_mask=...))``:
        a module that attends over more than one layer's tokens (FLUX's dual-stream blocks)
        calls the three steps itself.
        """
        key_mask = self._checked_key_mask(key_mask, cu_seqlens, x.shape[0],
                                          self.session.world_size * x.shape[1], x.device)
        if cu_seqlens is not None:
            return self._packed_forward(x, rope_cos_sin, positions, cu_seqlens)
        return self.back_end(self._attend(*self.front_end(x, rope_cos_sin, positions), None,
                                          key_mask))

    @torch.compiler.disable
    def _packed_forward(self, x: Tensor, rope_cos_sin: Tensor, positions: Tensor | None,
                        cu_seqlens: Sequence[int] | Tensor) -> Tensor:
        """``forward`` with ``cu_seqlens``.  Under ``torch.compile`` it runs eagerly (a graph
        break): the bounds are host data, and traced they would be guarded on, one
        recompilation per packing."""
        # Before the front end's exchange, so that every rank raises.
        cu_seqlens = check_cu_seqlens(cu_seqlens, batch=x.shape[0],
                                      seq=self.session.world_size * x.shape[1])
        return self.back_end(self._attend(*self.front_end(x, rope_cos_sin, positions),
                                          cu_seqlens))

    def front_end(self, x: Tensor, rope_cos_sin: Tensor,
                  positions: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """``q [B, S, Hq / W, D]``, ``k, v [B, S, Hkv_local, D]`` bf16: this rank's head band
        over the whole sequence (``S = W * S_local``, rank ``r``'s tokens at rows
        ``[r * S_local, (r + 1) * S_local)``), projected, normalised and rotated from every
        rank's ``x`` (``forward``'s arguments).  Views of a receive slot: under grad the
        layer's own, leased until the backward; without, the pool's (``slot_pool``), valid
        until its next ``front_end``."""
        if x.dtype != torch.bfloat16 and (x.dtype == torch.float32 or
                                          torch.is_autocast_enabled(x.device.type)):
            x = x.to(torch.bfloat16)
        # Differentiable casts: fp32 master weights get fp32 gradients (no-ops for bf16).
        qkv_weight, qkv_bias = [None if p is None else p.to(torch.bfloat16)
                                for p in (self.qkv_weight, self.qkv_bias)]
        q_norm, k_norm = [None if p is None else self._norm_scale(p)
                          for p in (self.q_norm_weight, self.k_norm_weight)]
        with torch.autocast(x.device.type, enabled=False):
            return self.session(x, qkv_weight, q_norm, k_norm, rope_cos_sin, positions, qkv_bias)

    def _norm_scale(self, weight: Tensor) -> Tensor:
        """What a norm multiplies by, bf16 ``[D]``: ``qk_norm_offset + weight``."""
        if not self.qk_norm_offset:
            return weight.to(torch.bfloat16)
        return (weight.float() + self.qk_norm_offset).to(torch.bfloat16)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, *,
               cu_seqlens: Sequence[int] | Tensor | None = None,
               key_mask: Tensor | None = None) -> Tensor:
        """``o [B, S, Hq / W, D]``: the layer's attention (its mask, scale and backend) over
        ``front_end``'s bands, or over several layers' bands joined along the sequence;
        ``cu_seqlens`` and ``key_mask`` as in ``forward``, over this ``S``."""
        key_mask = self._checked_key_mask(key_mask, cu_seqlens, *q.shape[:2], q.device)
        if cu_seqlens is not None:
            return self._packed_attend(q, k, v, cu_seqlens)
        return self._attend(q, k, v, None, key_mask)

    @torch.compiler.disable
    def _packed_attend(self, q: Tensor, k: Tensor, v: Tensor,
                       cu_seqlens: Sequence[int] | Tensor) -> Tensor:
        """``attend`` with ``cu_seqlens``, eager under ``torch.compile`` (``_packed_forward``)."""
        cu_seqlens = check_cu_seqlens(cu_seqlens, batch=q.shape[0], seq=q.shape[1])
        return self._attend(q, k, v, cu_seqlens)

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, cu_seqlens: tuple[int, ...] | None,
                key_mask: Tensor | None = None) -> Tensor:
        """``attend`` with ``cu_seqlens`` and ``key_mask`` already checked."""
        with torch.autocast(q.device.type, enabled=False):
            return attention(q, k, v, causal=self.causal, softmax_scale=self.softmax_scale,
                             backend=self.attention_backend, cu_seqlens=cu_seqlens,
                             key_mask=key_mask, window=self.sliding_window,
                             softcap=self.softcap)

    @staticmethod
    def _checked_key_mask(key_mask: Tensor | None, cu_seqlens, batch: int, seq: int,
                          device: torch.device) -> Tensor | None:
        """``key_mask`` checked for a call over ``[batch, seq]`` tokens (host checks only, so
        every rank raises alike before any exchange)."""
        if key_mask is None:
            return None
        if cu_seqlens is not None:
            raise ValueError("pass cu_seqlens or key_mask, not both: with cu_seqlens, padding "
                             "can be a sequence of its own")
        return check_key_mask(key_mask, batch=batch, seq=seq, device=device)

    def back_end(self, o: Tensor) -> Tensor:
        """``forward``'s result from ``o [B, S, Hq / W, D]`` (``attend``'s layout, this layer's
        ``S``): gathered by tokens from every rank's head band, then o_proj."""
        o_weight, o_bias = (None if p is None else p.to(torch.bfloat16)
                            for p in (self.o_weight, self.o_bias))
        # As the compiled operator decides: the same gather (own or shared) either way.
        grad = ops.differentiable(o, o_weight, o_bias)
        with torch.autocast(o.device.type, enabled=False):
            if torch.compiler.is_compiling():
                y = ops.output_projection(self, o, o_weight, o_bias)
            else:
                y = OutputProjectionFunction.apply(*self.output_exchanges(grad),
                                                   self.BACKWARD_SLOT_REMEDY, o, o_weight,
                                                   o_bias)
        # Without o_proj and a backward, y is the shared slot itself: copied out.
        return y if grad or o_weight is not None else y.clone()

    @property
    def plan(self):
        """The head split over the group (``layouts.HeadPlan``)."""
        return self.session.plan

    def output_exchanges(self, for_backward: bool) -> tuple:
        """The output step's exchanges: the gather by tokens of ``o`` (this layer's own for a
        call whose backward will run; else the shared one), and for such a call the scatter
        by heads of ``d_o``, else None.  Each built by the first call that needs it
        (collective: every rank makes the same calls)."""
        if not for_backward:
            if self._shared_gather is None:
                self._shared_gather = shared_band_exchange(
                    self.session.backend, self._group, self._gather_transfer,
                    max_tokens=self.max_tokens, device=self.session.device,
                    wait_timeout_s=self._timeout, what="output exchange")
            return self._shared_gather, None
        if self._gather is None:
            self._gather = make_band_exchange(
                self.session.backend, self._group, self._gather_transfer,
                max_tokens=self.max_tokens, num_slots=self._num_slots,
                device=self.session.device, wait_timeout_s=self._timeout,
                what="output exchange")
        return self._gather, self._backward_exchange()

    def _backward_exchange(self):
        """The scatter by heads of ``d_o``, built by the first forward under grad (collective:
        every rank makes that forward).  One slot, read by the attention's backward at once,
        shared with every layer of the same shape on the group unless
        ``share_backward_exchange`` is off."""
        if self._scatter is None:
            plan = self.session.plan
            make = shared_band_exchange if self._share_scatter else functools.partial(
                make_band_exchange, num_slots=1)
            self._scatter = make(
                self.backend, self._group,
                BandTransfer(SCATTER_HEADS, plan.world_size, (plan.q_per_rank,), self.head_dim),
                max_tokens=self.max_tokens, device=self.session.device,
                wait_timeout_s=self._timeout, what="output exchange backward")
        return self._scatter

    @property
    def buffer_bytes(self) -> int:
        """Device memory this layer's exchanges hold on this rank (receive slots, staging
        buffers, readiness words), allocated at the first forward without grad and at the
        first under grad (with ``slot_pool=None``, the front end's at construction); the
        parameters not included.  What a layer holds in common with others (the exchanges
        without grad, the backward's two, the NCCL path's staging) is counted in each."""
        exchanges = (*self.session.held_exchanges, self._shared_gather, self._gather,
                     self._scatter)
        return sum(e.nbytes for e in exchanges if e is not None)

    def synchronize(self) -> None:
        """Wait for this rank's enqueued work; raise if an exchange timed out (see the session)."""
        self.session.synchronize()
        for exchange in (self._shared_gather, self._gather, self._scatter):
            if exchange is not None:
                exchange.check()

    def close(self) -> None:
        """Release the exchanges' buffers (collective on the NVLink path).  Idempotent."""
        self.session.close()
        if self._shared_gather is not None:
            release_shared(self._shared_gather)
        if self._gather is not None:
            self._gather.close()
        if self._scatter is not None:
            if self._share_scatter:
                release_shared(self._scatter)
            else:
                self._scatter.close()
        self._shared_gather = self._gather = self._scatter = self._group = None

    def __enter__(self) -> UlyssesAttention:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def extra_repr(self) -> str:
        plan = self.session.plan
        return (f"hidden={self.hidden}, heads={self.num_q_heads}/{self.num_kv_heads}, "
                f"head_dim={self.head_dim}, world_size={plan.world_size}, "
                f"causal={self.causal}, o_proj={self.o_weight is not None}, "
                + (f"sliding_window={self.sliding_window}, " if self.sliding_window else "")
                + (f"qk_norm_offset={self.qk_norm_offset}, " if self.qk_norm_offset else "")
                + (f"softcap={self.softcap}, " if self.softcap is not None else "")
                + f"backend={self.backend!r} ({self.backend_reason}), "
                f"attention_backend={self.attention_backend!r} ({self.attention_reason})")
