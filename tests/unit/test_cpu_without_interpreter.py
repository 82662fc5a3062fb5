"""On the CPU without Triton's interpreter, the calls that need it say what to set (and that it
must be set before the import) instead of failing inside Triton."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

SCRIPT = """
import torch, torch.distributed as dist
import cake_sp
from cake_sp import QkvNormRopeExchangeOverlap
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{port}", rank=0, world_size=1)
for name, make in (
        ("session", lambda: QkvNormRopeExchangeOverlap(num_q_heads=1, num_kv_heads=1,
                                                       head_dim=64, hidden=64, max_tokens=4,
                                                       device="cpu")),
        ("layer", lambda: cake_sp.UlyssesAttention(64, 1, 1, 64, max_tokens=4, device="cpu")),
        ("append", lambda: cake_sp.fused_qk_rmsnorm_rope_append_paged_kv_cache(
            torch.zeros(1, 192, dtype=torch.bfloat16), torch.zeros(4, 64),
            torch.ones(1, dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32),
            torch.zeros(1, 1, dtype=torch.int32), torch.zeros(1, 4, 1, 64, dtype=torch.bfloat16),
            torch.zeros(1, 4, 1, 64, dtype=torch.bfloat16), num_q_heads=1, num_kv_heads=1))):
    try:
        make()
        print(name, "no error")
    except RuntimeError as exc:
        print(name, "RuntimeError:", exc)
dist.destroy_process_group()
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path only")
def test_cpu_calls_name_the_interpreter_switch():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    port = 29000 + os.getpid() % 1000
    result = subprocess.run([sys.executable, "-c", SCRIPT.format(port=port)], env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in result.stdout.splitlines())
    for name in ("session", "layer", "append"):
        assert "TRITON_INTERPRET=1" in lines[name] and "before cake_sp" in lines[name], (
            name, lines[name])
