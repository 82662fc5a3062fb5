"""The FMHA manifest: corpus replay, source authentication, selector decisions (host only)."""

from __future__ import annotations

import json
import shutil

import pytest

import cake_sp
from cake_sp.kernels.fmha import manifest, selector
from cake_sp.kernels.fmha.selector import Cell


def test_replay_matches_manifest():
    record = cake_sp.fmha_manifest()
    digest, counts, size = manifest.replay_corpus()
    assert digest == record["corpus_digest"]
    assert counts == record["route_counts"]
    assert size == record["corpus_size"] == sum(counts.values())
    assert set(counts) <= set(selector.ROUTES)


def test_committed_record_is_current():
    """A kernel or selector edit without `python -m cake_sp.kernels.fmha --write` fails here."""
    assert manifest.build_record() == manifest.load_record()


def test_record_digest_and_defensive_copy():
    record = cake_sp.fmha_manifest()
    assert record["digest"] == manifest.record_digest(record)
    record["sources"].clear()
    record["route_counts"]["compat_v1"] = -1
    fresh = cake_sp.fmha_manifest()
    assert fresh["sources"] and fresh["route_counts"]["compat_v1"] >= 0


def test_modified_kernel_source_refuses_to_load(tmp_path):
    for rel in manifest.KERNEL_SOURCES:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(manifest.PACKAGE_PARENT / rel, tmp_path / rel)
    record = manifest.load_record()
    manifest.check_sources(record, tmp_path)
    target = tmp_path / "cake_sp/kernels/fmha/decode.py"
    target.write_text(target.read_text() + "\n# edited\n")
    with pytest.raises(manifest.FmhaManifestError, match=r"decode\.py.*--write"):
        manifest.check_sources(record, tmp_path)


def test_tampered_manifest_is_rejected(tmp_path, monkeypatch):
    record = manifest.load_record()
    forged = dict(record, route_counts={**record["route_counts"], "compat_v1": 0})
    path = tmp_path / "manifest.json"
    path.write_text(json.dumps(forged))
    monkeypatch.setattr(manifest, "MANIFEST_PATH", path)
    manifest.load_record.cache_clear()
    try:
        with pytest.raises(manifest.FmhaManifestError, match="digest mismatch"):
            manifest.load_record()
    finally:
        manifest.load_record.cache_clear()


def _cell(**kw) -> Cell:
    base = dict(op="decode", q_dtype="bf16", kv_dtype="same", kv_layout="HND", head_dim=128,
                group=4, page_class="pow2", q_len_class="1", causal=True, window=False,
                sinks=False, lse=False, split_tables=False)
    return Cell(**{**base, **kw})


@pytest.mark.parametrize(("kw", "route"), [
    (dict(), "decode_triton_v1"),
    (dict(group=16, q_len_class="2-4"), "decode_triton_v1"),
    (dict(group=9, q_len_class="5-8"), "compat_v1"),
    (dict(q_len_class="9+"), "compat_v1"),
    (dict(op="context", q_len_class="ragged", causal=False, kv_dtype="fp8_e4m3"),
     "context_triton_v1"),
    (dict(q_dtype="fp32"), "reject"),
    (dict(kv_dtype="fp8_e5m2"), "reject"),
    (dict(head_dim=96), "reject"),
    (dict(group=17), "reject"),
])
def test_select_route(kw, route):
    assert selector.select_route(_cell(**kw)) == route


def test_choose_route_falls_closed(monkeypatch):
    monkeypatch.delenv(selector.ROUTE_ENV, raising=False)
    cell = _cell()
    assert selector.choose_route(cell, workspace_ok=True, triton_runs=True)[0] == \
        "decode_triton_v1"
    assert selector.choose_route(cell, workspace_ok=False, triton_runs=True)[0] == "compat_v1"
    assert selector.choose_route(cell, workspace_ok=True, triton_runs=False)[0] == "compat_v1"
    monkeypatch.setenv(selector.ROUTE_ENV, "bogus")
    with pytest.raises(ValueError, match="CAKE_SP_FMHA_ROUTE"):
        selector.choose_route(cell, workspace_ok=True, triton_runs=True)


def test_classifiers():
    assert [selector.page_class(p) for p in (1, 2, 16, 5, 48)] == \
        ["1", "pow2", "pow2", "other", "other"]
    assert [selector.decode_q_len_class(q) for q in (1, 2, 4, 5, 8, 9)] == \
        ["1", "2-4", "2-4", "5-8", "5-8", "9+"]
