"""The benchmark's rows: model shapes x sequence lengths, by name, and the presets that pick them.

A row fixes ``hidden``, the head counts, ``S_global`` and ``B``; the world size
``W`` comes from the launch.  Names read ``h4096_s32k`` (``Hq = Hkv = hidden / 128``)
or ``h4096_q32kv8_s32k`` (GQA).  ``tiny`` and ``tiny_gqa`` are small rows whose
head counts follow ``W`` so that they are valid at any world size; they are
what the CPU smoke runs.
"""

from __future__ import annotations

from dataclasses import dataclass

from cake_sp.layouts import HeadPlan

HEAD_DIM = 128
HIDDENS = (3072, 4096, 6144, 8192)
SEQS_GLOBAL = (4096, 8192, 16384, 32768, 65536, 131072)
GQA_SHAPES = ((4096, 32, 8),)  # (hidden, Hq, Hkv): Llama-3-8B-like
REPRESENTATIVE = ("h3072_s4k", "h4096_s8k", "h4096_s32k", "h8192_s32k", "h8192_s128k",
                  "h4096_q32kv8_s32k")
TINY = ("tiny", "tiny_gqa")
PRESETS = ("representative", "full", "tiny")


@dataclass(frozen=True)
class Row:
    """One benchmark shape.  ``seq_global`` tokens per batch entry, split over ``W`` ranks."""

    name: str
    hidden: int
    num_q_heads: int
    num_kv_heads: int
    seq_global: int
    batch: int = 1
    head_dim: int = HEAD_DIM

    @property
    def total_heads(self) -> int:
        return self.num_q_heads + 2 * self.num_kv_heads

    def seq_local(self, world: int) -> int:
        return self.seq_global // world

    def invalid_reason(self, world: int) -> str | None:
        """Why this row cannot run at ``world`` ranks, or None."""
        if self.seq_global % world:
            return f"S_global={self.seq_global} is not divisible by W={world}"
        try:
            HeadPlan(world, self.num_q_heads, self.num_kv_heads, self.head_dim)
        except ValueError as exc:
            return str(exc)
        return None

    def gemm_flops(self, world: int) -> int:
        """Projection FLOPs on one rank: ``2 * B * S_local * hidden * (Hq + 2 Hkv) * D``."""
        return (2 * self.batch * self.seq_local(world) * self.hidden * self.total_heads
                * self.head_dim)

    def bytes_out(self, world: int) -> int:
        """bf16 bytes one rank sends to the other ``W - 1`` ranks in one exchange.

        Every destination receives its whole head band (``heads_per_rank`` heads,
        replicated K/V heads included) for this rank's ``B * S_local`` tokens.
        """
        plan = HeadPlan(world, self.num_q_heads, self.num_kv_heads, self.head_dim)
        per_destination = self.batch * self.seq_local(world) * plan.heads_per_rank * self.head_dim
        return 2 * per_destination * (world - 1)


def _seq_name(seq: int) -> str:
    return f"{seq // 1024}k" if seq % 1024 == 0 else str(seq)


def catalogue(world: int) -> dict[str, Row]:
    """Every named row at world size ``world``: the full grid, the GQA set, the tiny rows."""
    rows: dict[str, Row] = {}
    for hidden in HIDDENS:
        heads = hidden // HEAD_DIM
        for seq in SEQS_GLOBAL:
            name = f"h{hidden}_s{_seq_name(seq)}"
            rows[name] = Row(name, hidden, heads, heads, seq)
    for hidden, hq, hkv in GQA_SHAPES:
        for seq in SEQS_GLOBAL:
            name = f"h{hidden}_q{hq}kv{hkv}_s{_seq_name(seq)}"
            rows[name] = Row(name, hidden, hq, hkv, seq)
    # Tiny rows: two heads per rank, and a GQA row whose K/V heads replicate (W % Hkv == 0).
    rows["tiny"] = Row("tiny", 256, 2 * world, 2 * world, 32 * world)
    rows["tiny_gqa"] = Row("tiny_gqa", 256, 2 * world, max(1, world // 2), 32 * world)
    return rows


def select_rows(spec: str, world: int) -> list[Row]:
    """Rows for ``--rows``: presets (``representative``, ``full``, ``tiny``) or row names.

    ``spec`` is comma-separated; entries may mix presets and names.

    Raises ``ValueError`` naming the unknown entries and listing every valid one.
    """
    rows = catalogue(world)
    presets = {
        "representative": list(REPRESENTATIVE),
        "full": [n for n in rows if n not in TINY],
        "tiny": list(TINY),
    }
    names: list[str] = []
    for item in (s.strip() for s in spec.split(",") if s.strip()):
        names.extend(presets.get(item, [item]))
    unknown = [n for n in names if n not in rows]
    if unknown or not names:
        raise ValueError(f"unknown row(s) {unknown or [spec]}; valid: presets {list(PRESETS)} "
                         f"or names {list(rows)}")
    return [rows[n] for n in dict.fromkeys(names)]
