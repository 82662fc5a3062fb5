"""What a benchmark run leaves behind: JSON, a Markdown table, a PNG, and progress while it runs."""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

HIDDEN_COLORS = {3072: 0, 4096: 1, 6144: 2, 8192: 3}  # matplotlib cycle index per hidden size


def write_json(path: str | Path, doc: dict) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1, allow_nan=True) + "\n")


def _ms(value: float | None) -> str:
    return "-" if value is None or math.isnan(value) else f"{value:.3f}"


def _ratio(value: float | None, suffix: str = "x") -> str:
    return "-" if value is None or math.isnan(value) else f"{value:.2f}{suffix}"


def summary_table(rows: Sequence[dict]) -> str:
    """One line per row: fused vs. the fastest baseline, the floor, the A/A control.

    ``rows`` are the per-row results of the main benchmark's JSON.
    """
    lines = ["| row | W | hidden | Hq/Hkv | S_global | fused (arm) ms | fastest baseline ms "
             "| speedup | floor ms (bound) | fused / floor | A/A % | skew ms | flags |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        shape = r["row"]
        head = (f"| {shape['name']} | {shape['world_size']} | {shape['hidden']} | "
                f"{shape['num_q_heads']}/{shape['num_kv_heads']} | {shape['seq_global']} |")
        if r["status"] != "measured":
            lines.append(f"{head} - | - | - | - | - | - | - | skipped: {r['reason']} |")
            continue
        fused = (f"{_ms(r['fused_ms'])} ({r['fused_arm']})" if r["fused_arm"] else "-")
        base = (f"{_ms(r['best_baseline_ms'])} ({r['best_baseline']})"
                if r["best_baseline"] else "-")
        floor = r["floor"]
        flags = "; ".join(r["flags"]) or "ok"
        lines.append(f"{head} {fused} | {base} | {_ratio(r['speedup'])} | "
                     f"{_ms(floor['floor_ms'])} ({floor['bound']}) | "
                     f"{_ratio(r['fused_over_floor'])} | {_ratio(r['aa_spread_pct'], '')} | "
                     f"{_ms(r['median_skew_ms'])} | {flags} |")
    return "\n".join(lines)


def arms_table(rows: Sequence[dict]) -> str:
    """Median ms of every arm of every measured row, skipped and failed arms named."""
    names = list(dict.fromkeys(a for r in rows for a in r.get("arms", {})))
    lines = ["| row | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for r in rows:
        if r["status"] != "measured":
            continue
        cells = []
        for name in names:
            arm = r["arms"].get(name, {})
            status = arm.get("status", "-")
            cells.append(_ms(r["median_ms"].get(name)) if status == "timed" else status)
        lines.append(f"| {r['row']['name']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_speedups(rows: Sequence[dict], path: str | Path, title: str) -> None:
    """Bar chart of speedup (fastest baseline / fused) per row, grouped by W then hidden.

    One panel per world size; inside it, one group of bars per hidden size with one
    bar per (S_global, head counts).  Rows whose A/A control failed are hatched.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    measured = [r for r in rows if r["status"] == "measured"]
    worlds = sorted({r["row"]["world_size"] for r in measured}) or [0]
    fig, axes = plt.subplots(1, len(worlds), figsize=(max(6, 5 * len(worlds)), 4.5),
                             squeeze=False)
    for ax, world in zip(axes[0], worlds, strict=True):
        subset = sorted((r for r in measured
                         if r["row"]["world_size"] == world and r["speedup"] is not None),
                        key=lambda r: (r["row"]["hidden"], r["row"]["num_kv_heads"],
                                       r["row"]["seq_global"]))
        if not subset:
            ax.text(0.5, 0.5, "no speedup: no baseline ran (see the run's caveats)",
                    ha="center", va="center", transform=ax.transAxes)
        x, labels, pos = [], [], 0.0
        last_hidden = None
        for r in subset:
            if last_hidden is not None and r["row"]["hidden"] != last_hidden:
                pos += 1.0  # a gap between hidden-size groups
            last_hidden = r["row"]["hidden"]
            x.append(pos)
            labels.append(r["row"]["name"])
            pos += 1.0
        bars = ax.bar(x, [r["speedup"] for r in subset],
                      color=[f"C{HIDDEN_COLORS.get(r['row']['hidden'], 4)}" for r in subset])
        for bar, r in zip(bars, subset, strict=True):
            if r["flags"]:
                bar.set_hatch("//")
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(x, labels, rotation=70, fontsize=7)
        ax.set_ylabel("speedup vs fastest baseline")
        ax.set_title(f"W = {world}")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


@contextmanager
def progress(enabled: bool, total: int, description: str) -> Iterator:
    """A progress bar on an interactive terminal (rank 0 only); returns ``advance(n, note)``.

    Off a terminal (logs, CI) it prints one line per note instead, so long runs
    still show where they are.
    """
    console = Console(file=sys.stderr)
    if not enabled:
        yield lambda n=1, note=None: None
        return
    if not console.is_terminal:
        def advance(n: int = 1, note: str | None = None) -> None:
            if note:
                console.print(note, highlight=False)
        yield advance
        return
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn())
    with Progress(*columns, console=console) as bar:
        task = bar.add_task(description, total=total)

        def advance(n: int = 1, note: str | None = None) -> None:
            bar.update(task, advance=n, description=note or description)
        yield advance
