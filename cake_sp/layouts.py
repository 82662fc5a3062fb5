"""Host-only layouts: which heads each rank receives, where a tile lands, where readiness lives.

Below both ``cake_sp.kernels`` (which take these numbers as launch arguments) and
``cake_sp.session``; it imports neither.

Vocabulary: a *kind* is one of Q, K, V; a *band* is the run of heads of one
kind that one destination rank receives; a *tile* is ``BLOCK_M`` token rows of
one head.  Nothing here touches a device; the kernels take these numbers as
arguments, and the unit tests check them on synthetic shapes.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

KIND_Q, KIND_K, KIND_V = 0, 1, 2
LAYOUTS = ("bshd", "fused")


@dataclass(frozen=True)
class HeadPlan:
    """The Ulysses head split of ``num_q_heads`` / ``num_kv_heads`` heads over ``world_size`` ranks.

    Rank ``r`` receives Q heads ``[r * q_per_rank, (r + 1) * q_per_rank)`` and
    the K/V heads its Q band uses: ``kv_per_rank`` of them when the K/V heads
    split (``Hkv % W == 0``), or the single head its band shares with
    ``kv_replicas`` ranks when they replicate (``W % Hkv == 0``).

    Raises ``ValueError`` on any other shape, naming the argument.
    """

    world_size: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int

    def __post_init__(self) -> None:
        w, hq, hkv = self.world_size, self.num_q_heads, self.num_kv_heads
        for name, value in (("world_size", w), ("num_q_heads", hq), ("num_kv_heads", hkv),
                            ("head_dim", self.head_dim)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if hq % hkv != 0:
            raise ValueError(
                f"num_q_heads ({hq}) must be a multiple of num_kv_heads ({hkv})")
        if hq % w != 0:
            raise ValueError(
                f"num_q_heads ({hq}) must be divisible by the world size ({w})")
        if hkv % w != 0 and w % hkv != 0:
            raise ValueError(
                f"num_kv_heads ({hkv}) must divide, or be divisible by, the world size ({w}) "
                "so that K/V heads either split or replicate across ranks")

    @property
    def q_per_rank(self) -> int:
        return self.num_q_heads // self.world_size

    @property
    def kv_per_rank(self) -> int:
        return max(1, self.num_kv_heads // self.world_size)

    @property
    def kv_replicas(self) -> int:
        """How many ranks receive each K/V head (1 when the K/V heads split)."""
        return max(1, self.world_size // self.num_kv_heads)

    @property
    def heads_per_rank(self) -> int:
        """Head bands one rank receives from each source: Q, then K, then V."""
        return self.q_per_rank + 2 * self.kv_per_rank

    @property
    def total_heads(self) -> int:
        """Heads in the projection: ``Hq + 2 * Hkv`` (rows of ``qkv_weight`` / ``head_dim``)."""
        return self.num_q_heads + 2 * self.num_kv_heads

    def kind_heads(self, kind: int) -> int:
        """Local heads of ``kind`` at one destination."""
        return self.q_per_rank if kind == KIND_Q else self.kv_per_rank

    def kind_offset(self, kind: int) -> int:
        """Index of the first head of ``kind`` among the ``heads_per_rank`` local heads."""
        return (0, self.q_per_rank, self.q_per_rank + self.kv_per_rank)[kind]

    def destinations(self, head: int) -> list[tuple[int, int, int]]:
        """``(rank, kind, local_head)`` for every rank that receives projection head ``head``."""
        hq, hkv = self.num_q_heads, self.num_kv_heads
        if head < hq:
            return [(head // self.q_per_rank, KIND_Q, head % self.q_per_rank)]
        kind, j = (KIND_K, head - hq) if head < hq + hkv else (KIND_V, head - hq - hkv)
        first = (j // self.kv_per_rank) * self.kv_replicas
        return [(first + t, kind, j % self.kv_per_rank) for t in range(self.kv_replicas)]

    def source_heads(self, rank: int, kind: int) -> range:
        """Global head indices within ``kind`` that ``rank`` receives, in local order."""
        if kind == KIND_Q:
            return range(rank * self.q_per_rank, (rank + 1) * self.q_per_rank)
        first = (rank // self.kv_replicas) * self.kv_per_rank
        return range(first, first + self.kv_per_rank)


@dataclass(frozen=True)
class DestLayout:
    """Where a destination buffer keeps each kind: element offsets into one bf16 buffer.

    Token ``t`` (``t = b * seq_len + seq_offset + s`` for source row ``b * S_local + s``)
    of local head ``h`` of ``kind`` starts at element
    ``region_offset[kind] + t * token_stride[kind] + h * head_stride[kind]`` and
    spans ``head_dim`` contiguous elements.
    """

    region_offset: tuple[int, int, int]
    token_stride: tuple[int, int, int]
    head_stride: tuple[int, int, int]
    seq_len: int
    layout: str = "bshd"

    @classmethod
    def for_layout(cls, plan: HeadPlan, layout: str, token_capacity: int,
                   seq_len: int) -> DestLayout:
        """Layout of a ``token_capacity``-token buffer whose batch entries hold ``seq_len`` tokens.

        ``"bshd"``: three contiguous regions ``[B, seq_len, H_kind, D]`` (Q, K, V) at
        fixed offsets, so each is a contiguous prefix whatever the call's batch.
        ``"fused"`` (Hq == Hkv only): one ``[B, seq_len, H_local, 3 * D]`` region, q|k|v per head.
        """
        d = plan.head_dim
        hq, hkv = plan.q_per_rank, plan.kv_per_rank
        if layout == "bshd":
            return cls(
                region_offset=(0, token_capacity * hq * d, token_capacity * (hq + hkv) * d),
                token_stride=(hq * d, hkv * d, hkv * d),
                head_stride=(d, d, d),
                seq_len=seq_len,
            )
        if layout == "fused":
            if plan.num_q_heads != plan.num_kv_heads:
                raise ValueError(
                    f"layout='fused' needs num_q_heads == num_kv_heads, got "
                    f"{plan.num_q_heads} and {plan.num_kv_heads}")
            return cls(region_offset=(0, d, 2 * d), token_stride=(3 * hq * d,) * 3,
                       head_stride=(3 * d,) * 3, seq_len=seq_len, layout="fused")
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")

    @property
    def regions(self) -> tuple[int, ...]:
        """The kinds that start a region: Q, K, V for ``"bshd"``; only Q (q|k|v) for ``"fused"``."""
        return (KIND_Q,) if self.layout == "fused" else (KIND_Q, KIND_K, KIND_V)

    def region_views(self, buffer: Tensor, batch: int) -> list[Tensor]:
        """Views of a 1-D bf16 ``buffer`` in this layout for ``batch`` entries.

        ``"bshd"``: ``[q, k, v]``, each ``[B, seq_len, H_kind, D]``;
        ``"fused"``: ``[qkv]``, one ``[B, seq_len, H_local, 3 * D]``.
        """
        views = []
        for kind in self.regions:
            start, width, head = (self.region_offset[kind], self.token_stride[kind],
                                  self.head_stride[kind])
            region = buffer[start: start + batch * self.seq_len * width]
            views.append(region.view(batch, self.seq_len, width // head, head))
        return views

    def kind_view(self, buffer: Tensor, kind: int, heads: int, batch: int, seq_local: int,
                  seq_offset: int) -> Tensor:
        """The elements of ``kind``'s ``heads`` local heads that source rows ``[B, S_local]``
        land on, as a ``[B, S_local, heads, D]`` strided view of the 1-D bf16 ``buffer``
        (tokens ``seq_offset + s`` of every batch entry; either layout)."""
        token, head = self.token_stride[kind], self.head_stride[kind]
        d = head if self.layout == "bshd" else head // 3
        return buffer.as_strided(
            (batch, seq_local, heads, d), (self.seq_len * token, token, head, 1),
            buffer.storage_offset() + self.region_offset[kind] + seq_offset * token)

    @staticmethod
    def buffer_elements(plan: HeadPlan, token_capacity: int) -> int:
        """bf16 elements a buffer of ``token_capacity`` tokens needs (either layout)."""
        return token_capacity * plan.heads_per_rank * plan.head_dim


@dataclass(frozen=True)
class ReadinessLayout:
    """The int64 readiness words one destination keeps: one per (source, row block, local head).

    Word ``source * max_row_blocks * heads_per_rank + row_block * heads_per_rank + local``
    (``local = plan.kind_offset(kind) + head``) holds the epoch of the last call
    whose tile was stored.  Words only grow, so no memset is needed between calls.
    """

    world_size: int
    max_row_blocks: int
    heads_per_rank: int

    @classmethod
    def for_plan(cls, plan: HeadPlan, max_tokens: int, block_m: int) -> ReadinessLayout:
        return cls(plan.world_size, -(-max_tokens // block_m), plan.heads_per_rank)

    @property
    def words(self) -> int:
        return self.world_size * self.max_row_blocks * self.heads_per_rank

    def index(self, source: int, row_block: int, local_head: int) -> int:
        return (source * self.max_row_blocks + row_block) * self.heads_per_rank + local_head


GATHER_TOKENS = "gather_tokens"
SCATTER_HEADS = "scatter_heads"
DIRECTIONS = (GATHER_TOKENS, SCATTER_HEADS)


@dataclass(frozen=True)
class BandTransfer:
    """One direction of the Ulysses exchange of already computed tensors (DESIGN.md section 6).

    Every source rank ``r`` sends every destination rank ``d`` one block of
    ``batch x seq_local`` token rows and ``part_heads[i]`` heads of ``head_dim``
    channels per *part* ``i`` (say q, k and v gradients: three parts).

    * ``"gather_tokens"`` (head band -> token order; the forward's output exchange and
      the front end's backward): part ``i`` of source ``r`` is ``[B, W * S_local, h_i, D]``,
      its band of heads for the whole sequence; ``d`` receives its own tokens
      ``[d * S_local, (d + 1) * S_local)``.  Output ``[B, S_local, W, heads, D]``:
      source ``r``'s parts side by side at ``[:, :, r]`` (``heads = sum(part_heads)``),
      so a single part of Q heads reads as ``[B, S_local, W * h, D]`` in head order.
    * ``"scatter_heads"`` (token order -> head band; o_proj's backward, and the q, k, v of
      ``UlyssesAttentionCore``): part ``i`` of source ``r`` is ``[B, S_local, W * h_i, D]``;
      ``d`` receives its heads ``[d * h_i, (d + 1) * h_i)``.  Output
      ``[B, W * S_local, heads, D]``, tokens ordered by source rank, the parts side by side
      along the heads.

    In either direction the element ``(b, s, j, c)`` of source ``r``'s block for ``d``
    sits in part ``i``'s tensor at ``[b, s + d * src_s_step, j + d * src_h_step, c]`` and
    lands in ``d``'s output at ``[b, s + r * dst_s_step, j + r * dst_h_step + offset_i, c]``
    of a ``[B, tokens, heads, D]`` view (``steps``); the push kernel takes those numbers.
    """

    direction: str
    world_size: int
    part_heads: tuple[int, ...]
    head_dim: int

    def __post_init__(self) -> None:
        if self.direction not in DIRECTIONS:
            raise ValueError(f"direction must be one of {DIRECTIONS}, got {self.direction!r}")
        if not self.part_heads or any(h < 1 for h in self.part_heads):
            raise ValueError(f"part_heads must be positive head counts, got {self.part_heads}")

    @property
    def heads(self) -> int:
        """Heads one source sends one destination (all parts), i.e. words per row block."""
        return sum(self.part_heads)

    def part_offset(self, part: int) -> int:
        return sum(self.part_heads[:part])

    def slot_elements(self, max_tokens: int) -> int:
        """bf16 elements of one receive slot for calls of up to ``max_tokens`` rows a rank."""
        return self.world_size * max_tokens * self.heads * self.head_dim

    def readiness(self, max_tokens: int, block_m: int) -> ReadinessLayout:
        return ReadinessLayout(self.world_size, -(-max_tokens // block_m), self.heads)

    def source_shape(self, part: int, batch: int, seq_local: int) -> tuple[int, int, int, int]:
        w, h = self.world_size, self.part_heads[part]
        if self.direction == GATHER_TOKENS:
            return (batch, w * seq_local, h, self.head_dim)
        return (batch, seq_local, w * h, self.head_dim)

    def output_shape(self, batch: int, seq_local: int) -> tuple[int, ...]:
        w, d = self.world_size, self.head_dim
        if self.direction == GATHER_TOKENS:
            return (batch, seq_local, w, self.heads, d)
        return (batch, w * seq_local, self.heads, d)

    def output_view_shape(self, batch: int, seq_local: int) -> tuple[int, int, int, int]:
        """The output as ``[B, tokens, heads, D]`` (the push kernel's destination geometry)."""
        w, d = self.world_size, self.head_dim
        if self.direction == GATHER_TOKENS:
            return (batch, seq_local, w * self.heads, d)
        return (batch, w * seq_local, self.heads, d)

    def steps(self, part: int, seq_local: int) -> tuple[int, int, int, int, int]:
        """``(src_s_step, src_h_step, dst_s_step, dst_h_step, offset)`` of part ``part``."""
        if self.direction == GATHER_TOKENS:
            return (seq_local, 0, 0, self.heads, self.part_offset(part))
        return (0, self.part_heads[part], seq_local, 0, self.part_offset(part))
