"""Capability matrix of the paged FMHA routes and the per-call route choice (host only).

Vocabulary: a *cell* is the abstraction of one call that routing depends on
(operation, dtypes, layout, head dim, GQA group, page-size class, q-length
class, features); a *route* is one implementation.  The *corpus* is every cell
of the matrix's axes, valid or not; ``manifest.py`` records how the selector
routes each of them, and a replay test checks that record.

Routes:

* ``decode_triton_v1``: split-KV flash-decoding (``decode.py``);
* ``context_triton_v1``: paged FlashAttention-2-style prefill (``context.py``);
* ``compat_v1``: page gather + fp32 softmax, the complete domain (``compat.py``);
* ``reject``: the cell is outside the domain; the API raises before choosing.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator
from typing import NamedTuple

from cake_sp.kernels.fmha.tuning import DECODE_MAX_ROWS

COMPAT = "compat_v1"
DECODE_TRITON = "decode_triton_v1"
CONTEXT_TRITON = "context_triton_v1"
REJECT = "reject"
ROUTES = (COMPAT, DECODE_TRITON, CONTEXT_TRITON, REJECT)

# Axis values of the corpus.  Entries past the domain are there on purpose so
# that the replay proves they are rejected.
OPS = ("decode", "context")
Q_DTYPES = ("bf16", "fp16", "fp32")
KV_DTYPES = ("same", "fp8_e4m3", "fp8_e5m2", "other_half")
KV_LAYOUTS = ("HND", "NHD")
HEAD_DIMS = (64, 128, 256, 96)
GROUPS = tuple(range(1, 18))
PAGE_CLASSES = ("1", "pow2", "other")
DECODE_Q_LEN_CLASSES = ("1", "2-4", "5-8", "9+")
CONTEXT_Q_LEN_CLASS = "ragged"
FLAGS = (False, True)

VALID_Q_DTYPES = ("bf16", "fp16")
VALID_KV_DTYPES = ("same", "fp8_e4m3")
VALID_HEAD_DIMS = (64, 128, 256)
MAX_GROUP = 16

# Upper bound of each decode q-length class: a decode cell is served by the
# Triton route only when every call it stands for fits the row budget.
_Q_LEN_UPPER = {"1": 1, "2-4": 4, "5-8": 8}

ROUTE_ENV = "CAKE_SP_FMHA_ROUTE"
ROUTE_OVERRIDES = ("auto", "compat_v1", "triton")


class Cell(NamedTuple):
    """What routing knows about one call; every field is hashable and printable."""

    op: str
    q_dtype: str
    kv_dtype: str
    kv_layout: str
    head_dim: int
    group: int
    page_class: str
    q_len_class: str
    causal: bool
    window: bool
    sinks: bool
    lse: bool
    split_tables: bool

    def key(self) -> str:
        """Canonical text of the cell, the unit hashed by the manifest."""
        return "|".join(str(int(v) if isinstance(v, bool) else v) for v in self)


def page_class(page_size: int) -> str:
    """Page-size class of ``page_size`` (>= 1): ``"1"``, ``"pow2"`` or ``"other"``."""
    if page_size == 1:
        return "1"
    return "pow2" if page_size & (page_size - 1) == 0 else "other"


def decode_q_len_class(q_len_per_req: int) -> str:
    """q-length class of a decode call with ``q_len_per_req`` (>= 1) new tokens per request."""
    for name, upper in _Q_LEN_UPPER.items():
        if q_len_per_req <= upper:
            return name
    return "9+"


def is_valid(cell: Cell) -> bool:
    """True when ``cell`` is inside the domain of the public functions."""
    return (
        cell.q_dtype in VALID_Q_DTYPES
        and cell.kv_dtype in VALID_KV_DTYPES
        and cell.head_dim in VALID_HEAD_DIMS
        and 1 <= cell.group <= MAX_GROUP
    )


def select_route(cell: Cell) -> str:
    """The route the capability matrix assigns to ``cell`` (pure, no runtime state).

    Decode goes to Triton when the group x q-length rows of one KV head fit
    ``DECODE_MAX_ROWS``; context goes to Triton for every valid cell.  Every
    other valid cell falls closed to ``compat_v1``.
    """
    if not is_valid(cell):
        return REJECT
    if cell.op == "context":
        return CONTEXT_TRITON
    upper = _Q_LEN_UPPER.get(cell.q_len_class)
    if upper is not None and cell.group * upper <= DECODE_MAX_ROWS:
        return DECODE_TRITON
    return COMPAT


def route_override() -> str:
    """The forced route from ``CAKE_SP_FMHA_ROUTE`` (``auto`` when unset); the only env read."""
    value = os.environ.get(ROUTE_ENV, "auto")
    if value not in ROUTE_OVERRIDES:
        raise ValueError(f"{ROUTE_ENV} must be one of {list(ROUTE_OVERRIDES)}, got {value!r}")
    return value


# choose_route's reason when the workspace alone keeps a call off its Triton route.
SHORT_WORKSPACE = "workspace_buffer is too small for the split-KV partials"


def choose_route(cell: Cell, *, workspace_ok: bool, triton_runs: bool) -> tuple[str, str]:
    """Pick the route of one valid call; returns ``(route, reason)``.

    Parameters
    ----------
    cell : Cell
        The call's cell; must be valid (the API validates first).
    workspace_ok : bool
        Whether ``workspace_buffer`` holds the Triton route's scratch.
    triton_runs : bool
        Whether Triton can launch on the tensors' device (a GPU, or the
        interpreter for CPU tensors).

    A matrix miss, a short workspace or a device Triton cannot reach falls
    closed to ``compat_v1``; ``CAKE_SP_FMHA_ROUTE=triton`` turns those into a
    ``RuntimeError`` instead, ``=compat_v1`` always takes the compat route.
    """
    override = route_override()
    planned = select_route(cell)
    if override == COMPAT:
        return COMPAT, f"{ROUTE_ENV}={COMPAT}"
    if planned == COMPAT:
        reason = "outside the Triton capability matrix"
    elif not triton_runs:
        reason = "tensors are on a device Triton cannot launch on"
    elif not workspace_ok:
        reason = SHORT_WORKSPACE
    else:
        return planned, "capability matrix"
    if override == "triton":
        raise RuntimeError(f"{ROUTE_ENV}=triton but the call has no Triton route: {reason}")
    return COMPAT, reason


def corpus() -> Iterator[Cell]:
    """Every cell of the matrix's axes, valid and invalid, in a fixed order."""
    shared = (Q_DTYPES, KV_DTYPES, KV_LAYOUTS, HEAD_DIMS, GROUPS, PAGE_CLASSES)
    for op in OPS:
        if op == "decode":
            lens = itertools.product(DECODE_Q_LEN_CLASSES, (True,))
        else:
            lens = itertools.product((CONTEXT_Q_LEN_CLASS,), FLAGS)
        lens = tuple(lens)
        for axes in itertools.product(*shared, lens, FLAGS, FLAGS, FLAGS, FLAGS):
            *head, (q_len_class, causal), window, sinks, lse, split = axes
            yield Cell(op, *head, q_len_class, causal, window, sinks, lse, split)


def capability_matrix() -> dict:
    """The matrix as data: axes, the valid domain and the routing rule's constants."""
    return {
        "axes": {
            "op": list(OPS),
            "q_dtype": list(Q_DTYPES),
            "kv_dtype": list(KV_DTYPES),
            "kv_layout": list(KV_LAYOUTS),
            "head_dim": list(HEAD_DIMS),
            "group": list(GROUPS),
            "page_class": list(PAGE_CLASSES),
            "decode_q_len_class": list(DECODE_Q_LEN_CLASSES),
            "features": ["causal", "window", "sinks", "lse", "split_tables"],
        },
        "valid": {
            "q_dtype": list(VALID_Q_DTYPES),
            "kv_dtype": list(VALID_KV_DTYPES),
            "head_dim": list(VALID_HEAD_DIMS),
            "group": [1, MAX_GROUP],
        },
        "routes": {
            DECODE_TRITON: f"decode cells with group * max(q_len_class) <= {DECODE_MAX_ROWS}",
            CONTEXT_TRITON: "every valid context cell",
            COMPAT: "every other valid cell, and any call the Triton route cannot serve",
            REJECT: "invalid cells",
        },
    }
