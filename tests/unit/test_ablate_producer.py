"""The producer ablation's variants still apply to the kernel, and its host pieces."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "kernels"))

import ablate_producer as ab  # noqa: E402


@pytest.mark.parametrize("name", list(ab.VARIANTS))
def test_every_variant_applies_to_the_landed_kernel(name):
    """An edit that no longer matches (the kernel changed) fails here, on the CPU, rather
    than on a GPU after a machine was paid for."""
    landed = ab.landed_sources()
    edited = ab.variant_sources(name, landed)
    for edit in ab.VARIANTS[name]:
        assert edit.new in edited[edit.file]
    changed = {key for key in landed if edited[key] != landed[key]}
    assert changed == {edit.file for edit in ab.VARIANTS[name]}


def test_candidates_carry_no_ablation_edit():
    """A candidate is checked against the reference, so it must not switch a part off: none
    of its edits may be one an ablation (a variant outside ``CANDIDATES``) makes."""
    assert "landed" in ab.CANDIDATES and set(ab.CANDIDATES) <= set(ab.VARIANTS)
    ablations = {edit for name, edits in ab.VARIANTS.items() if name not in ab.CANDIDATES
                 for edit in edits}
    assert ablations
    for name in ab.CANDIDATES:
        assert not ablations & set(ab.VARIANTS[name]), name


def test_a_missing_edit_names_the_variant_and_the_file():
    sources = ab.landed_sources()
    sources["epilogue"] = sources["epilogue"].replace(ab.NO_STORE.old, "")
    with pytest.raises(ValueError, match=r"'nostore': producer_epilogue.py holds 0 copies"):
        ab.variant_sources("nostore", sources)
    with pytest.raises(ValueError, match="variant must be one of"):
        ab.variant_sources("fast", sources)


@pytest.mark.parametrize("name", ["nodeliver", "nomath"])
def test_a_loaded_variant_runs_its_own_epilogue_copy(name, tmp_path):
    pytest.importorskip("triton.experimental.gluon")
    kernel = ab.load_variant(name, tmp_path)
    ws = (tmp_path / f"ablate_{name}_ws.py").read_text()
    assert ab.EPILOGUE_IMPORT not in ws
    assert f"from ablate_{name}_epilogue import" in ws
    assert kernel.__module__ == f"ablate_{name}_ws"


def test_parse_rows():
    assert ab.parse_rows("2x3072x32768,8x4096x4096") == [(2, 3072, 32768), (8, 4096, 4096)]
    with pytest.raises(ValueError, match="WxHIDDENxS_GLOBAL"):
        ab.parse_rows("2x3072")


def test_ncu_table_one_row_per_kernel_result(tmp_path):
    header = ('"ID","Process ID","Kernel Name","Section Name","Metric Name","Metric Unit",'
              '"Metric Value"\n')
    (tmp_path / "landed.csv").write_text(
        "==PROF== Connected to process 1\n" + header
        + '"0","1","qkv_produce_ws_kernel","Command line profiler metrics",'
          '"dram__bytes_read.sum","Mbyte","171.20"\n'
        + '"0","1","qkv_produce_ws_kernel","Command line profiler metrics",'
          '"gpu__time_duration.sum","us","402.1"\n')
    (tmp_path / "cublas.csv").write_text(
        header + '"0","1","nvjet_tst_320x128","Command line profiler metrics",'
                 '"dram__bytes_read.sum","Mbyte","150.00"\n')
    lines = ab.ncu_table([tmp_path / "landed.csv", tmp_path / "cublas.csv"]).splitlines()
    assert lines[0] == ("| arm | kernel | dram__bytes_read.sum (Mbyte) | "
                        "gpu__time_duration.sum (us) |")
    assert lines[2] == "| landed | 0 qkv_produce_ws_kernel | 171.20 | 402.1 |"
    assert lines[3] == "| cublas | 0 nvjet_tst_320x128 | 150.00 |  |"
