"""Random session inputs every rank can regenerate, and comparison against the reference."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from cake_sp import reference
from cake_sp.testing import assert_close_counting_flips

HEAD_DIM = 128


@dataclass
class Problem:
    """All ranks' inputs of one call (every rank holds all of them, built from one seed)."""

    xs: list[Tensor]
    qkv_weight: Tensor
    qkv_bias: Tensor | None
    q_norm_weight: Tensor | None
    k_norm_weight: Tensor | None
    tables: list[Tensor]
    positions: list[Tensor] | None

    def rank_args(self, rank: int, device: torch.device) -> tuple:
        """Rank ``rank``'s positional call arguments, on ``device``."""
        def on(t):
            return None if t is None else t.to(device)
        return (on(self.xs[rank]), on(self.qkv_weight), on(self.q_norm_weight),
                on(self.k_norm_weight), on(self.tables[rank]),
                None if self.positions is None else on(self.positions[rank]), on(self.qkv_bias))

    def expected(self, num_q_heads: int, num_kv_heads: int, rope_style: str,
                 layout: str) -> list:
        return reference.qkv_norm_rope_exchange(
            self.xs, self.qkv_weight, self.q_norm_weight, self.k_norm_weight, self.tables,
            self.positions, self.qkv_bias, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
            rope_style=rope_style, layout=layout)


def make_problem(seed: int, world: int, *, num_q_heads: int, num_kv_heads: int, hidden: int,
                 batch: int, seq_local: int, bias: bool = True, norms: bool = True,
                 positions: bool = False, max_pos: int = 4096,
                 head_dim: int = HEAD_DIM) -> Problem:
    """Fresh random inputs (never zeros) for every rank of a ``world``-rank call."""
    g = torch.Generator().manual_seed(seed)
    n = (num_q_heads + 2 * num_kv_heads) * head_dim
    weight = (torch.randn(n, hidden, generator=g) / hidden**0.5).bfloat16()
    xs = [torch.randn(batch, seq_local, hidden, generator=g).bfloat16() for _ in range(world)]
    norm = lambda: (1 + 0.2 * torch.randn(head_dim, generator=g)).bfloat16()  # noqa: E731
    if positions:
        table = reference.rope_cos_sin_table(max_pos, head_dim)
        tables = [table] * world
        pos = [torch.randint(0, max_pos, (batch, seq_local), generator=g, dtype=torch.int32)
               for _ in range(world)]
    else:
        # Per-token tables: each rank's tokens at their global positions.
        full = reference.rope_cos_sin_table(world * batch * seq_local, head_dim, base=500.0)
        rows = batch * seq_local
        tables = [full[r * rows:(r + 1) * rows].contiguous() for r in range(world)]
        pos = None
    return Problem(xs, weight, torch.randn(n, generator=g).bfloat16() if bias else None,
                   norm() if norms else None, norm() if norms else None, tables, pos)


def compare(got: Tensor, want: Tensor, what: str, rope_style: str | None = None,
            head_dim: int = HEAD_DIM) -> dict:
    """Assert ``got`` matches the reference (``bf16_checks``); count the differences.

    ``rope_style`` is the style the values were rotated with, None for V.
    """
    assert got.dtype == torch.bfloat16, f"{what}: dtype {got.dtype}"
    return assert_close_counting_flips(got, want, rope_style=rope_style, head_dim=head_dim,
                                       what=what)
