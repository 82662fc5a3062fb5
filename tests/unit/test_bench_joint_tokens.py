"""The joint-tokens benchmark's host side: the copies arm's key mask, the rows, the table."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "layer"))

torch = pytest.importorskip("torch")
import bench_joint_tokens as bench  # noqa: E402


def test_copies_key_mask_keeps_every_image_key_and_the_first_text_copy():
    mask = bench.copies_key_mask(image=8, text=3, world=4)  # 2 image tokens a rank
    assert mask.shape == (1, 8 + 4 * 3)
    assert mask[0].tolist() == [True] * 5 + ([True] * 2 + [False] * 3) * 3


@pytest.mark.parametrize("rows", sorted(bench.ROWS))
def test_rows_split_evenly(rows):
    for _, image, _, heads, _, world in bench.ROWS[rows]:
        assert image % world == 0 and heads % world == 0


def test_markdown_has_one_line_per_row_and_every_column():
    row = {"model": "SD3", "image": 4096, "text": 333, "heads": 24, "head_dim": 64,
           "world": 4, "queries": 1.2255}
    for mode in ("fwd", "fwdbwd"):
        row |= {f"{mode}_joint_ms": 1.0, f"{mode}_copies_ms": 1.5,
                f"{mode}_copies_over_joint": 1.5}
    lines = bench.markdown([row]).splitlines()
    assert len(lines) == 3 and lines[2].count("|") == lines[0].count("|") == 13
    assert "| SD3 | 4 | 4096 | 333 | 6 x 64 | 1.226 | 1.000 | 1.500 | 1.500 |" in lines[2]
