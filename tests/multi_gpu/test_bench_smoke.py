"""Smoke run of the main comm benchmark on 2 ranks: it finishes, checks every arm, writes its files.

Launches ``benchmarks/comm/bench_qkv_norm_rope_exchange_overlap.py`` under
torchrun at the tiny rows.  Where it runs follows ``CAKE_SP_TEST_DEVICE`` (see
``_ranks.py``): gloo on the CPU by default, one GPU per rank with ``cuda``, both
ranks on GPU 0 with ``cuda-shared``.  It checks the JSON's shape and that every
arm that ran was verified against the reference; the numbers are not looked at.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from _ranks import TEST_DEVICE

pytestmark = pytest.mark.multi_gpu

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "benchmarks" / "comm" / "bench_qkv_norm_rope_exchange_overlap.py"
WORLD = 2
ROW_KEYS = {"row", "status", "reason", "arms", "gemm_flops", "bytes_out_per_gpu", "attempts",
            "median_ms", "aa_spread_pct", "flags", "fused_arm", "fused_ms", "best_baseline",
            "best_baseline_ms", "speedup", "floor", "fused_over_floor", "median_skew_ms"}
ATTEMPT_KEYS = {"order", "samples_ms", "samples_ms_per_rank", "median_ms", "aa", "skew_ms",
                "median_skew_ms"}
DELAY_MS = 20.0


def _run_bench(out: Path, *extra: str, env_extra: dict | None = None) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p), **(env_extra or {}))
    args = ["--rows", "tiny", "--samples", "2", "--warmup", "0", "--ceiling-samples", "1",
            "--json", str(out / "r.json"), "--markdown", str(out / "r.md"),
            "--plot", str(out / "r.png"), *extra]
    if TEST_DEVICE == "cpu":
        args += ["--device", "cpu", "--link-sizes", "4096,65536"]
    else:
        args += ["--device", "cuda", "--link-sizes", "1048576"]
    if TEST_DEVICE == "cuda-shared":
        env.update(CUDA_VISIBLE_DEVICES="0", CAKE_SP_ALLOW_SHARED_GPU="1")
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone",
         f"--nproc-per-node={WORLD}", str(BENCH), *args],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=580)
    assert proc.returncode == 0, f"benchmark failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return {"doc": json.loads((out / "r.json").read_text()), "out": out, "stdout": proc.stdout}


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    return _run_bench(tmp_path_factory.mktemp("bench"))


def test_files_and_environment(run):
    doc, out = run["doc"], run["out"]
    assert doc["schema"] == "cake_sp.bench.qkv_norm_rope_exchange_overlap/1"
    assert (out / "r.png").stat().st_size > 0
    assert "fastest baseline" in (out / "r.md").read_text()
    env = doc["environment"]
    for key in ("torch", "commit", "world_size", "dist_backend", "hostname"):
        assert key in env, key
    assert env["world_size"] == WORLD
    assert doc["ceilings"]["matmul"]["rate_flops_per_s"] > 0
    assert doc["ceilings"]["link"]["rate_bytes_per_s"] > 0
    if TEST_DEVICE != "cuda":
        assert doc["caveats"], "a CPU or shared-GPU run must say its numbers are not GPU numbers"


def test_every_arm_ran_was_verified(run):
    rows = run["doc"]["rows"]
    assert [r["row"]["name"] for r in rows] == ["tiny", "tiny_gqa"]
    for r in rows:
        assert r["status"] == "measured", r["reason"]
        assert ROW_KEYS <= set(r), ROW_KEYS - set(r)
        for name, arm in r["arms"].items():
            assert arm["status"] in ("timed", "skipped"), (r["row"]["name"], name, arm)
            if arm["status"] == "skipped":
                assert arm["reason"], f"{name} skipped without a reason"
            else:
                assert arm["verified"] is True, (name, arm.get("verification"))
                assert len(arm["verification"]) == WORLD
        timed = {n for n, a in r["arms"].items() if a["status"] == "timed"}
        assert r["fused_arm"] in timed
        if TEST_DEVICE == "cpu":
            assert timed == {"fused_nccl", "b1_three_a2a", "b2_packed_a2a", "b3_band_overlap",
                             "b4_yunchang"}
            assert r["arms"]["fused_nvlink"]["status"] == "skipped"


def test_samples_order_and_aa_control(run):
    for r in run["doc"]["rows"]:
        timed = [n for n, a in r["arms"].items() if a["status"] == "timed"]
        for attempt in r["attempts"]:
            assert ATTEMPT_KEYS <= set(attempt)
            control = attempt["aa"]["control"]
            assert control == attempt["aa"]["arm"] + "~aa"
            names = set(timed) | {control}
            assert set(attempt["samples_ms"]) == names
            # Counterbalanced: every arm appears equally often in the executed order.
            counts = {n: sum(1 for _, m in attempt["order"] if m == n) for n in names}
            assert len(set(counts.values())) == 1, counts
            for name, samples in attempt["samples_ms"].items():
                assert len(samples) == counts[name] and all(s > 0 for s in samples)
                per_rank = attempt["samples_ms_per_rank"][name]
                assert len(per_rank) == WORLD
                assert samples == [max(v) for v in zip(*per_rank, strict=True)]


@pytest.mark.skipif(TEST_DEVICE == "cpu", reason="the device barrier exists on GPUs only")
def test_device_barrier_keeps_a_delayed_rank_out_of_the_times(run, tmp_path):
    """Rank 1 sleeps 20 ms on the host before every sample: it shows as skew, and the device
    barrier keeps it out of every arm's time (a tiny row takes well under 1 ms; without the
    barrier, rank 0's waits for rank 1 would count the 20 ms)."""
    delayed = _run_bench(tmp_path, "--delay-rank", "1", "--delay-ms", str(DELAY_MS))["doc"]
    assert delayed["device_barrier"] in ("nccl all_reduce", "nvshmem sync_all")
    for plain, late in zip(run["doc"]["rows"], delayed["rows"], strict=True):
        assert late["median_skew_ms"] > DELAY_MS / 2, late["median_skew_ms"]
        assert plain["median_skew_ms"] < DELAY_MS / 4, plain["median_skew_ms"]
        for name, ms in late["median_ms"].items():
            assert ms < plain["median_ms"][name] + DELAY_MS / 10, (late["row"]["name"], name)


# The session's producer engines, and on the fused one each mainloop, forced in turn
# (_config's overrides): the session arms must run and check on every one.
ENGINES = [("cublas", None), ("fused", "tma"), ("fused", "warp_specialized")]
# The session arms each device runs: the CPU has no NVLink path, and ranks sharing one GPU
# have a gloo group, with no all-to-all of CUDA tensors for the NCCL path.
SESSION_ARMS_TIMED = {"cpu": {"fused_nccl"}, "cuda-shared": {"fused_nvlink"},
                      "cuda": {"fused_nvlink", "fused_nccl"}}


@pytest.mark.parametrize("engine, mainloop", ENGINES)
def test_every_engine_runs_the_session_arms(tmp_path, engine, mainloop):
    if mainloop == "warp_specialized" and TEST_DEVICE == "cpu":
        pytest.skip("the warp-specialised mainloop runs on Hopper GPUs only")
    env = {"CAKE_SP_PRODUCER_ENGINE": engine, "CAKE_SP_PRODUCER_MAINLOOP": mainloop or ""}
    doc = _run_bench(tmp_path, "--arms", "fused_nvlink,fused_nccl", env_extra=env)["doc"]
    for r in doc["rows"]:
        assert r["status"] == "measured", r["reason"]
        timed = {n for n, a in r["arms"].items() if a["status"] == "timed"}
        assert timed == SESSION_ARMS_TIMED[TEST_DEVICE], (timed, TEST_DEVICE)
        for name in timed:
            assert r["arms"][name]["verified"] is True, (name, r["arms"][name])
