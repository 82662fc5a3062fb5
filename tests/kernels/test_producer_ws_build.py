"""The warp-specialised producer builds for sm_90a, with no spills, on any machine.

The kernel never runs in Triton's interpreter, so without this a change to it meets a
compiler only on a GPU.  ``_sm90_compile.py`` compiles it through the real launcher in a
subprocess (a stub driver naming an sm_90 target; nothing runs) and reports ptxas's
registers and spills.  A spill would mean a register budget in ``_config.WsTile`` no longer
fits the code.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton.experimental.gluon")
pytest.importorskip("triton.backends.nvidia.compiler")

HELPER = Path(__file__).with_name("_sm90_compile.py")
REPO = Path(__file__).resolve().parents[2]
SM90_SHARED_BYTES = 227 * 1024  # the most shared memory one sm_90 CTA may take

CONFIGS = {
    # Both norm weights: the 256-row tile, bf16 hand-off; bias, signals, NeoX.
    "norm-in-mma": {},
    # No norms: the 128-row fp32 hand-off, interleaved RoPE, positions.
    "fp32-hand-off": {"norms": False, "rope_style": "interleaved", "positions": True},
    # GQA replication at W = 4, D = 64, a tail row block.
    "d64-replicated": {"world": 4, "q_heads": 16, "kv_heads": 2, "head_dim": 64,
                       "hidden": 1024, "rows": 1000},
    # No signals, no bias (the NCCL path's packing).
    "no-signals": {"signals": False, "bias": False},
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_builds_for_sm90_without_spills(name):
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=os.pathsep.join(
        p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.run([sys.executable, str(HELPER), json.dumps(CONFIGS[name])], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout.splitlines()[-1])
    assert report["spill_bytes"] == 0, report
    assert 0 < report["shared_bytes"] <= SM90_SHARED_BYTES, report
