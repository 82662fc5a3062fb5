"""The packed-attention benchmark's host side: document lengths, the rows' masks, the table."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "layer"))

torch = pytest.importorskip("torch")
import bench_packed_attention as bench  # noqa: E402


@pytest.mark.parametrize("kind,n", [("equal", 8), ("random", 64), ("equal", 1)])
def test_document_lengths_cover_the_row(kind, n):
    lengths = bench._lengths(8192, kind, n, torch.Generator().manual_seed(0))
    assert len(lengths) == n and sum(lengths) == 8192 and min(lengths) >= 1


def test_markdown_has_one_line_per_row_and_every_column():
    row = {"seq": 8192, "documents": "equal 8"}
    for mode in ("fwd", "fwdbwd"):
        for i, arm in enumerate(("cake_sp", "dense_mask", "per_sequence", "unpacked")):
            row[f"{mode}_{arm}_ms"] = 1.0 + i
        row[f"{mode}_cake_sp_over_dense_mask"] = 0.5
        row[f"{mode}_cake_sp_over_per_sequence"] = 0.33
    lines = bench.markdown([row]).splitlines()
    assert len(lines) == 3
    assert lines[2].count("|") == lines[0].count("|") == 15
    assert "| 8192 | equal 8 | 1.000 | 2.000 | 3.000 | 4.000 | 0.50 | 0.33 |" in lines[2]


@pytest.mark.parametrize("causal", [True, False])
def test_a_padded_row_masks_its_last_keys(causal):
    cu_seqlens, key_mask, allowed, spans = bench._masks(8, "padded", 3, causal,
                                                        torch.Generator().manual_seed(0))
    assert cu_seqlens is None and spans == [(0, 0, 5)]
    assert key_mask.tolist() == [[True] * 5 + [False] * 3]
    assert not allowed[0, :, 5:].any() and allowed[0, 7, :5].all()
    assert bool(allowed[0, 0, 1]) is not causal  # a later key: seen only without causality


def test_ragged_rows_mask_different_numbers_of_last_keys():
    cu_seqlens, key_mask, allowed, spans = bench._masks(8, "ragged", 4, False,
                                                        torch.Generator().manual_seed(0))
    assert cu_seqlens is None and spans == [(0, 0, 4), (1, 0, 6)]
    assert key_mask.tolist() == [[True] * 4 + [False] * 4, [True] * 6 + [False] * 2]
    assert allowed.shape == (2, 8, 8) and allowed[1, 0, 5] and not allowed[0, 0, 5]


def test_a_documents_row_allows_each_document_causally():
    cu_seqlens, key_mask, allowed, spans = bench._masks(8, "equal", 2, True,
                                                        torch.Generator().manual_seed(0))
    assert key_mask is None and cu_seqlens == (0, 4, 8) and spans == [(0, 0, 4), (0, 4, 8)]
    assert allowed[0, 5, 4] and not allowed[0, 5, 3] and not allowed[0, 4, 5]
