"""The append-shapes benchmark's host pieces: each shape changes one thing of its base, and
the ratio is per byte only where the shape moves more."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "kernels"))

pytest.importorskip("torch")
import bench_append_shapes as bas  # noqa: E402


@pytest.mark.parametrize("base", bas.BASES, ids=lambda b: b.name)
def test_every_shape_changes_one_thing_of_its_base(base):
    anchor = bas.Shape(base.heads)
    shapes = bas.shapes_of(base)
    assert len(set(shapes)) == len(shapes)
    for shape in shapes:
        changed = [f.name for f in dataclasses.fields(bas.Shape)
                   if getattr(shape, f.name) != getattr(anchor, f.name)]
        assert len(changed) == 1, (shape, changed)
        assert shape.label(base) != "base"
    assert anchor.label(base) == "base"


def test_per_byte_ratio_scales_only_when_the_shape_moves_more():
    # Fewer bytes than the base: compared with the base's time as it is.
    assert bas.per_byte_ratio(3.0, 50, 2.0, 100) == pytest.approx(1.5)
    # Twice the bytes: the base's time doubled is the bar.
    assert bas.per_byte_ratio(3.0, 200, 2.0, 100) == pytest.approx(0.75)
    assert bas.per_byte_ratio(5.0, 200, 2.0, 100) == pytest.approx(1.25)


def test_markdown_lists_the_rows_over_the_limit():
    row = dict(base="M1", op="bf16", norm=2, shape="D 64", base_us=2.0, shape_us=2.2,
               bytes_ratio=0.5, ratio=1.1)
    text = bas.markdown([row, {**row, "shape": "HND", "ratio": 0.9}], 1.0)
    assert "1 of 2 shapes above 1.0: M1 bf16 norm 2 D 64 1.100" in text
    assert "| M1 | bf16 | 2 | HND | 2.00 | 2.20 | 0.50 | 0.900 |" in text


def test_markdown_separates_the_rows_beyond_their_bases_noise():
    row = dict(base="H3", op="bf16", norm=0, shape="HND", base_us=3.5, shape_us=3.6,
               bytes_ratio=1.0, ratio=1.03)
    rows = [row, {**row, "shape": "page 256", "base_us": 3.7, "ratio": 1.7},
            {**row, "op": "fp8 q2", "shape": "D 64", "base_us": 3.0, "ratio": 1.01}]
    assert bas.base_spread(rows) == {("H3", "bf16", 0): pytest.approx(3.7 / 3.5),
                                     ("H3", "fp8 q2", 0): 1.0}
    text = bas.markdown(rows, 1.0)
    assert "3 of 3 shapes above 1.0" in text
    assert "spread by 1.000-1.057x" in text
    # HND is within its base's 5.7 % spread; page 256 is not, nor D 64 (a base timed once).
    assert text.endswith("above its base's spread: H3 bf16 norm 0 page 256 1.700 (spread 1.057); "
                         "H3 fp8 q2 norm 0 D 64 1.010 (spread 1.000)")


def test_time_pair_takes_the_instances_in_turn(monkeypatch):
    """Round i times instance i of each arm (A/B/B/A); the medians are over every instance's
    samples, and the spread is of the first arm's instances' own medians."""
    monkeypatch.setattr(bas, "sample_us", lambda replay, calls, replays: replay())
    seen = []

    def instance(us):
        return lambda: seen.append(us) or us

    a, b = [instance(t) for t in (1.0, 1.2, 1.1)], [instance(t) for t in (2.0, 2.0, 2.3)]
    args = bas.parse_args(["--rounds", "6"])
    a_us, b_us, spread = bas.time_pair(a, b, args)
    assert seen[:8] == [1.0, 2.0, 2.0, 1.0, 1.2, 2.0, 2.0, 1.2]
    assert a_us == pytest.approx(1.1) and b_us == pytest.approx(2.0)
    assert spread == pytest.approx(1.2)


def test_markdown_reports_the_instances_spread():
    row = dict(base="M1", op="bf16", norm=2, shape="D 64", base_us=2.0, shape_us=2.2,
               bytes_ratio=0.5, ratio=1.1, base_instance_spread=1.02)
    text = bas.markdown([row, {**row, "base_instance_spread": 1.005}], 1.0)
    assert text.endswith("instances (graphs over inputs of their own) spread by "
                         "1.005-1.020x beside one shape.")
