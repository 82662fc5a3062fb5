"""Where the warp-specialised producer's time goes: the landed kernel beside copies of it
with one part switched off, every arm timed over cuBLAS ``x @ W.T`` alone.

A diagnostic, not a benchmark of the product: every ablation variant computes wrong bytes
on purpose and is never checked.  A variant is a list of text edits to copies of
``cake_sp/kernels/producer_ws.py`` and ``producer_epilogue.py`` written to a temporary
folder (the package's files are never touched); each edit must match its file exactly once,
so a variant that no longer applies to the kernel fails before anything is timed rather
than timing the landed kernel under another name (``tests/unit/test_ablate_producer.py``
checks that on the CPU).

Variants (``VARIANTS``):

* ``landed``: the package's kernel, checked against the reference before it is timed;
* ``nonorm``: no bias + RMSNorm in the MMA warps (``NORM_IN_MMA`` off in the body);
* ``nodeliver``: the epilogue waits for each tile and hands it back, delivering nothing;
* ``gemm``: ``nonorm`` and ``nodeliver``, and no hand-off barriers: the mainloop alone;
* ``nostore``: every destination store predicated off;
* ``notable``: every RoPE table load predicated off (cos = sin = 0);
* ``neither``: ``nostore`` and ``notable``;
* ``nomath``: ``notable``, and the epilogue stores its hand-off tile as it is (no norm
  weight, no RoPE).

Candidates (``CANDIDATES``) are edits that keep the output: each is checked against the
reference like ``landed`` before it is timed, so a faster candidate is a change to try in
the kernel itself:

* ``streamstore``: the epilogue's stores with the streaming cache hint (``st.global.cs``);
* ``evictstore``: the epilogue's stores with an L2 evict-first policy
  (``st.global.L2::cache_hint``), so the output lines leave L2 before the operands the
  mainloop still reads;
* ``group2x``: head-pair tiles walk the row blocks of twice as many heads a group, so each
  ``x`` row block is read from DRAM half as often (the weights of a group double in L2).

Timing is ``bench_producer``'s: CUDA-graph replays under ``triton.testing.do_bench`` (L2
flushed) and ``--sustained-ms`` bursts, the arms in rotated order round after round::

    python benchmarks/kernels/ablate_producer.py --rows 2x3072x32768,8x4096x32768 \
        --variants landed,nodeliver,nomath --json ablate.json

``--profile ARM`` runs one problem's arm once under ``cudaProfilerStart/Stop`` (after a
warm-up that compiles it), for a profiler started with ``--profile-from-start off``;
``--ncu-table CSV...`` prints Nsight Compute's CSV exports (``--csv``, details page) as one
table, an arm a row (``launch/h200_check.sh``'s ``ncu-producer`` stage does both).
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import json
import statistics
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

KERNELS = Path(__file__).resolve().parents[2] / "cake_sp" / "kernels"
FILES = {"ws": "producer_ws.py", "epilogue": "producer_epilogue.py"}
EPILOGUE_IMPORT = "from cake_sp.kernels.producer_epilogue import"


@dataclass(frozen=True)
class Edit:
    """Replace ``old`` (which must occur exactly once) by ``new`` in ``FILES[file]``."""

    file: str
    old: str
    new: str


NO_NORM = Edit("ws", "        if NORM_IN_MMA:\n            # In place",
               "        if False:\n            # In place")
NO_DELIVERY = Edit("ws", "            if chunk * CHUNK_M < rows:",
                   "            if chunk * CHUNK_M < rows * 0:")
NO_HANDOFF = (
    Edit("ws", "        mbarrier.wait(acc_empty, (t & 1) ^ 1)\n", ""),
    Edit("ws", "        gl.thread_barrier()\n        mbarrier.arrive(acc_full)\n", ""),
    Edit("ws", "        mbarrier.wait(acc_full, t & 1)\n", ""),
    Edit("ws", "        gl.thread_barrier()\n        mbarrier.arrive(acc_empty)\n", ""),
)
STORE = "                tl.store(ptrs, out, mask=row_ok[:, None])"  # the epilogue's one store
NO_STORE = Edit("epilogue", STORE, STORE.replace("row_ok[:, None]", "row_ok[:, None] & (rows < 0)"))
NO_TABLE = Edit(
    "epilogue",
    "    return load_cos_sin(cos_sin_ptr, table_rows, cos_sin_stride, table_ok, half_cols, D)",
    "    return load_cos_sin(cos_sin_ptr, table_rows, cos_sin_stride, table_ok & (offs_m < 0),"
    " half_cols, D)")
NO_MATH = Edit("epilogue", "    p = acc\n", "    p = acc\n    return round_to_bf16(p, INTERPRET)\n")
STREAM_STORE = Edit("epilogue", STORE, STORE[:-1] + ", cache_modifier='.cs')")
EVICT_STORE = Edit("epilogue", STORE, STORE[:-1] + ", eviction_policy='evict_first')")
PAIR_GROUP = "_pair_band(KV_PER_RANK),\n                                      GROUP_HEADS)"
GROUP_2X = Edit("ws", PAIR_GROUP, PAIR_GROUP[:-1] + " * 2)")

VARIANTS: dict[str, tuple[Edit, ...]] = {
    "landed": (),
    "nonorm": (NO_NORM,),
    "nodeliver": (NO_DELIVERY,),
    "gemm": (NO_NORM, NO_DELIVERY, *NO_HANDOFF),
    "nostore": (NO_STORE,),
    "notable": (NO_TABLE,),
    "neither": (NO_STORE, NO_TABLE),
    "nomath": (NO_MATH, NO_TABLE),
    "streamstore": (STREAM_STORE,),
    "evictstore": (EVICT_STORE,),
    "group2x": (GROUP_2X,),
}
# The variants whose bytes must equal the landed kernel's (checked before timing).
CANDIDATES: tuple[str, ...] = ("landed", "streamstore", "evictstore", "group2x")


def landed_sources() -> dict[str, str]:
    return {key: (KERNELS / name).read_text() for key, name in FILES.items()}


def variant_sources(name: str, sources: dict[str, str]) -> dict[str, str]:
    """``sources`` (``FILES``' keys to text) with variant ``name``'s edits applied; raises
    ``ValueError`` naming the variant and the edit when an edit does not match exactly once."""
    if name not in VARIANTS:
        raise ValueError(f"variant must be one of {sorted(VARIANTS)}, got {name!r}")
    out = dict(sources)
    for edit in VARIANTS[name]:
        found = out[edit.file].count(edit.old)
        if found != 1:
            raise ValueError(f"variant {name!r}: {FILES[edit.file]} holds {found} copies of "
                             f"{edit.old!r}, expected exactly 1 (update the edit to the kernel)")
        out[edit.file] = out[edit.file].replace(edit.old, edit.new)
    return out


def load_variant(name: str, folder: Path) -> Callable:
    """Variant ``name``'s ``qkv_produce_ws_kernel``, from copies written under ``folder``
    (the copy of ``producer_ws.py`` imports the variant's copy of the epilogue)."""
    sources = variant_sources(name, landed_sources())
    epilogue = f"ablate_{name}_epilogue"
    if sources["ws"].count(EPILOGUE_IMPORT) != 1:
        raise ValueError(f"{FILES['ws']} must import the epilogue once as {EPILOGUE_IMPORT!r}")
    (folder / f"{epilogue}.py").write_text(sources["epilogue"])
    ws_path = folder / f"ablate_{name}_ws.py"
    ws_path.write_text(sources["ws"].replace(EPILOGUE_IMPORT, f"from {epilogue} import"))
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
    spec = importlib.util.spec_from_file_location(ws_path.stem, ws_path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.qkv_produce_ws_kernel


def variant_arm(p: dict, kernel: Callable | None) -> Callable[[], None]:
    """``bench_producer``'s warp-specialised arm, launching ``kernel`` in place of the
    package's (None: the package's own)."""
    import bench_producer

    from cake_sp.kernels import producer

    run = bench_producer.producer_arm(p, "warp_specialized")
    if kernel is None:
        return run

    def swapped():
        landed, producer.qkv_produce_ws_kernel = producer.qkv_produce_ws_kernel, kernel
        try:
            run()
        finally:
            producer.qkv_produce_ws_kernel = landed
    return swapped


def parse_rows(text: str) -> list[tuple[int, int, int]]:
    """``"WxHIDDENxS_GLOBAL,..."`` to ``(world, hidden, seq_global)`` triples."""
    rows = []
    for item in text.split(","):
        parts = item.split("x")
        if len(parts) != 3 or not all(v.isdigit() for v in parts):
            raise ValueError(f"--rows: expected WxHIDDENxS_GLOBAL items, got {item!r}")
        rows.append(tuple(int(v) for v in parts))
    return rows


def ncu_table(paths: list[Path]) -> str:
    """One Markdown row per kernel result of Nsight Compute's CSV exports (details page:
    columns ``Kernel Name``, ``Metric Name``, ``Metric Unit``, ``Metric Value``), the file's
    stem naming the arm."""
    table, metrics = [], []
    for path in paths:
        results: dict[str, dict[str, str]] = {}
        with open(path, newline="") as f:
            lines = [line for line in f if line.startswith('"')]  # drop ncu's own log lines
        for rec in csv.DictReader(lines):
            key = f"{rec['ID']} {rec['Kernel Name'][:40]}"
            name = f"{rec['Metric Name']} ({rec['Metric Unit']})"
            results.setdefault(key, {})[name] = rec["Metric Value"]
            if name not in metrics:
                metrics.append(name)
        table += [(path.stem, kernel, values) for kernel, values in results.items()]
    lines = ["| arm | kernel | " + " | ".join(metrics) + " |", "|" + "---|" * (len(metrics) + 2)]
    for arm, kernel, values in table:
        lines.append(f"| {arm} | {kernel} | " + " | ".join(values.get(m, "") for m in metrics)
                     + " |")
    return "\n".join(lines)


def build_arms(p: dict, names: list[str], folder: Path) -> dict[str, Callable[[], None]]:
    """``cublas`` and each variant of ``names``, those of ``CANDIDATES`` checked against the
    reference into NaN-poisoned buffers first."""
    import bench_producer
    import torch

    arms = {"cublas": bench_producer.cublas_arm(p)[0]}
    for name in names:
        arms[name] = variant_arm(p, None if name == "landed" else load_variant(name, folder))
    checked = [n for n in names if n in CANDIDATES]
    check_rows = min(512, p["rows"])
    if checked:
        ref = bench_producer.reference_heads(p, check_rows, round_projection=False)
    for name in checked:
        for b in p["buffers"]:
            b.fill_(float("nan"))
        arms[name]()
        torch.cuda.synchronize()
        bench_producer.check_buffers(p, ref, check_rows, name)
    return arms


def ablate_row(world: int, hidden: int, seq_global: int, args, folder: Path) -> dict:
    import bench_producer
    import torch

    p = bench_producer.make_problem(world, hidden, seq_global, "neox", torch.device("cuda"))
    samples, board = bench_producer.timed(build_arms(p, args.variants, folder), args)
    ms = {k: statistics.median(v) for k, v in samples.items()}
    row = dict(world=world, hidden=hidden, seq_global=seq_global, rows=p["rows"], ms=ms,
               samples=samples, over_cublas={k: v / ms["cublas"] for k, v in ms.items()},
               cublas_tflops=2 * p["rows"] * p["weight"].shape[0] * hidden / ms["cublas"] / 1e9)
    if board["cublas"]:
        sus = {k: statistics.median(b["ms_per_call"] for b in v) for k, v in board.items()}
        row.update(sustained_ms=sus, sustained_over_cublas={k: v / sus["cublas"]
                                                            for k, v in sus.items()})
    return row


def markdown(rows: list[dict]) -> str:
    arms = [a for a in rows[0]["over_cublas"] if a != "cublas"]
    head = ["W", "hidden", "rows", "cublas ms", "cublas TFLOP/s"] + [
        f"{a} / cublas" + (" (do_bench, sustained)" if "sustained_ms" in rows[0] else "")
        for a in arms]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["world"], r["hidden"], r["rows"], f"{r['ms']['cublas']:.3f}",
                 f"{r['cublas_tflops']:.0f}"]
        for a in arms:
            cell = f"{r['over_cublas'][a]:.3f}"
            if "sustained_ms" in r:
                cell += f", {r['sustained_over_cublas'][a]:.3f}"
            cells.append(cell)
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=parse_rows,
                    default=parse_rows("2x3072x32768,2x4096x32768,4x3072x32768,"
                                       "8x3072x32768,8x4096x32768"),
                    help="WxHIDDENxS_GLOBAL items (default: the rows where the delivery costs)")
    ap.add_argument("--variants", type=lambda s: s.split(","), default=list(VARIANTS),
                    help=f"comma-separated, of {', '.join(VARIANTS)} (default: all)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--warmup-ms", type=float, default=10)
    ap.add_argument("--rep-ms", type=float, default=40)
    ap.add_argument("--sustained-ms", type=float, default=100, help="0: do_bench only")
    ap.add_argument("--profile", metavar="ARM",
                    help="run ARM (cublas or a variant) once on the first row, for a profiler")
    ap.add_argument("--ncu-table", nargs="+", type=Path, metavar="CSV",
                    help="print these Nsight Compute CSV exports as one table and exit")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    for name in args.variants + ([args.profile] if args.profile else []):
        if name != "cublas" and name not in VARIANTS:
            ap.error(f"variant must be cublas or one of {', '.join(VARIANTS)}, got {name!r}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.ncu_table:
        print(ncu_table(args.ncu_table))
        return 0
    import torch
    if not torch.cuda.is_available():
        print("ablate_producer: needs a CUDA GPU", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="ablate_producer_") as tmp:
        if args.profile:
            import bench_producer
            p = bench_producer.make_problem(*args.rows[0], "neox", torch.device("cuda"))
            variants = [] if args.profile == "cublas" else [args.profile]
            run = build_arms(p, variants, Path(tmp))[args.profile]
            run()  # compiles outside the profiled window
            torch.cuda.synchronize()
            torch.cuda.profiler.start()
            run()
            torch.cuda.synchronize()
            torch.cuda.profiler.stop()
            return 0
        rows = []
        for world, hidden, seq_global in args.rows:
            rows.append(ablate_row(world, hidden, seq_global, args, Path(tmp)))
            print(json.dumps({k: rows[-1][k] for k in ("world", "hidden", "rows",
                                                         "over_cublas")}), file=sys.stderr)
            torch.cuda.empty_cache()
    print(markdown(rows))
    if args.json:
        env = dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                   triton=__import__("triton").__version__, argv=sys.argv[1:])
        args.json.write_text(json.dumps(dict(environment=env, rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
