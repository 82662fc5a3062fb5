"""The benchmarks' graph capture keeps alive what the captured graph writes."""

from __future__ import annotations

import contextlib
import gc
import sys
import weakref
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "kernels"))

torch = pytest.importorskip("torch")
import _graphs  # noqa: E402


class _FakeGraph:
    def __init__(self) -> None:
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1


class _FakeStream:
    def wait_stream(self, other) -> None:
        pass


def test_the_replay_holds_the_captured_callable(monkeypatch):
    """A buffer only the captured closure knows must outlive the capture: the graph writes
    its memory on every replay (freed, that memory would go to other tensors)."""
    monkeypatch.setattr(torch.cuda, "Stream", _FakeStream)
    monkeypatch.setattr(torch.cuda, "current_stream", _FakeStream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", lambda g: contextlib.nullcontext())

    calls = []

    def make_call():
        out = torch.empty(4)

        def call():
            out.fill_(1.0)
            calls.append(1)
        return call, weakref.ref(out)

    call, out_ref = make_call()
    replay = _graphs.graphed(call)
    del call
    gc.collect()
    assert out_ref() is not None
    assert len(calls) == 2  # the warm-up call and the captured one
    replay()
    assert replay.graph.replays == 1
    del replay
    gc.collect()
    assert out_ref() is None
