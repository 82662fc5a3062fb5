"""What the one-GPU attention benchmarks of this folder share: a sample's timing and the run
over a table's rows (run as scripts from the repository root or this folder)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable

import torch


def time_ms(fn: Callable[[], object]) -> float:
    """Milliseconds of one call of ``fn``, by CUDA events around it."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def run_rows(name: str, rows: Iterable[tuple], bench_row: Callable[..., dict],
             markdown: Callable[[list[dict]], str], json_path: str | None) -> None:
    """``bench_row(*row)`` for every row (each result printed as it comes), then the device,
    the Markdown table and, where asked, the rows as JSON."""
    if not torch.cuda.is_available():
        raise SystemExit(f"{name} needs a CUDA GPU")
    results = []
    for row in rows:
        results.append(bench_row(*row))
        print(results[-1], flush=True)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(markdown(results))
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": results}, f, indent=1)
