"""The content-addressed FMHA manifest: kernel sources, capability matrix, route counts.

``manifest.json`` (next to this file) is one record::

    {"schema", "sources": {path: sha256}, "capability_matrix", "corpus_size",
     "route_counts": {route: cells}, "corpus_digest", "digest"}

``corpus_digest`` is the SHA-256 of the lines ``"<cell key>=<route>\\n"`` of the
whole corpus in ``selector.corpus()`` order; ``digest`` is the SHA-256 of the
record's canonical JSON without ``digest``.  The Triton launchers call
:func:`ensure_sources_verified` before their first launch (so before any JIT
compilation): a kernel source whose hash differs from the record refuses to
load.  Regenerate after an intended change with::

    python -m cake_sp.kernels.fmha --write
"""

from __future__ import annotations

import argparse
import collections
import copy
import functools
import hashlib
import json
from pathlib import Path

from cake_sp.kernels.fmha.selector import capability_matrix, corpus, select_route

SCHEMA = "cake_sp.fmha.manifest/1"
MANIFEST_PATH = Path(__file__).with_name("manifest.json")
# Directory that holds the ``cake_sp`` package; source paths are relative to it.
PACKAGE_PARENT = Path(__file__).resolve().parents[3]
# Every file whose code is JIT-compiled into an FMHA kernel.
KERNEL_SOURCES = (
    "cake_sp/kernels/fmha/tiles.py",
    "cake_sp/kernels/fmha/decode.py",
    "cake_sp/kernels/fmha/context.py",
    "cake_sp/kernels/fmha/context_ws.py",
    "cake_sp/kernels/fmha/decode_ws.py",
    "cake_sp/kernels/fmha/fp8_staging.py",
    "cake_sp/kernels/norm_rope.py",
)
REGENERATE = "python -m cake_sp.kernels.fmha --write"


class FmhaManifestError(RuntimeError):
    """A kernel source or the manifest itself does not match its recorded digest."""


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def record_digest(record: dict) -> str:
    """SHA-256 of ``record``'s canonical JSON (sorted keys, no spaces), ``digest`` left out."""
    body = {k: v for k, v in record.items() if k != "digest"}
    return _sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())


def source_hashes(root: Path = PACKAGE_PARENT) -> dict[str, str]:
    """SHA-256 of each of ``KERNEL_SOURCES`` under ``root``."""
    return {rel: _sha256((root / rel).read_bytes()) for rel in KERNEL_SOURCES}


def replay_corpus() -> tuple[str, dict[str, int], int]:
    """Route every corpus cell with the real selector: ``(digest, counts, size)``."""
    h = hashlib.sha256()
    counts: collections.Counter[str] = collections.Counter()
    for cell in corpus():
        route = select_route(cell)
        h.update(f"{cell.key()}={route}\n".encode())
        counts[route] += 1
    return h.hexdigest(), dict(sorted(counts.items())), sum(counts.values())


def build_record(root: Path = PACKAGE_PARENT) -> dict:
    """A fresh record from the sources under ``root`` and the current selector."""
    digest, counts, size = replay_corpus()
    record = {
        "schema": SCHEMA,
        "sources": source_hashes(root),
        "capability_matrix": capability_matrix(),
        "corpus_size": size,
        "route_counts": counts,
        "corpus_digest": digest,
    }
    record["digest"] = record_digest(record)
    return record


@functools.cache
def load_record() -> dict:
    """The committed record, its own digest checked; cached for the process."""
    try:
        record = json.loads(MANIFEST_PATH.read_text())
    except (OSError, ValueError) as exc:
        raise FmhaManifestError(f"cannot read {MANIFEST_PATH}: {exc}; run `{REGENERATE}`") from exc
    if record.get("schema") != SCHEMA or record.get("digest") != record_digest(record):
        raise FmhaManifestError(
            f"{MANIFEST_PATH} is not a valid {SCHEMA} record (digest mismatch); run `{REGENERATE}`")
    return record


def check_sources(record: dict, root: Path = PACKAGE_PARENT) -> None:
    """Raise :class:`FmhaManifestError` naming every kernel source under ``root`` that differs."""
    expected = record["sources"]
    actual = source_hashes(root)
    bad = [f"{rel} (recorded {expected.get(rel, 'nothing')[:12]}, found {actual[rel][:12]})"
           for rel in KERNEL_SOURCES if expected.get(rel) != actual[rel]]
    if bad:
        raise FmhaManifestError(
            "paged FMHA kernel sources differ from the manifest, refusing to compile them: "
            + "; ".join(bad) + f". If the change is intended, run `{REGENERATE}`.")


@functools.cache
def ensure_sources_verified() -> None:
    """Check the kernel sources against the committed record once per process."""
    check_sources(load_record())


def fmha_manifest() -> dict:
    """A defensive copy of the committed FMHA manifest record (see the module docstring).

    Returns
    -------
    dict
        ``schema``, ``sources`` (path -> SHA-256), ``capability_matrix``,
        ``corpus_size``, ``route_counts``, ``corpus_digest`` and ``digest``.
    """
    return copy.deepcopy(load_record())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Write or check the paged FMHA manifest.")
    parser.add_argument("--write", action="store_true", help=f"rewrite {MANIFEST_PATH.name}")
    args = parser.parse_args(argv)
    fresh = build_record()
    if args.write:
        MANIFEST_PATH.write_text(json.dumps(fresh, indent=2, sort_keys=True) + "\n")
        print(f"wrote {MANIFEST_PATH} digest {fresh['digest']}")
        return 0
    stale = fresh != json.loads(MANIFEST_PATH.read_text())
    print(f"{MANIFEST_PATH}: {'stale' if stale else 'up to date'}")
    return int(stale)

