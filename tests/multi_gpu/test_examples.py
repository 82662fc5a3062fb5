"""The documentation's examples: shown in the docs exactly as they are in ``examples/``, and
they run to a clean exit under torchrun with two CPU ranks."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.multi_gpu

ROOT = Path(__file__).resolve().parents[2]
# Each example and the page that shows it whole.
EXAMPLES = {"examples/layer.py": "README.md",
            "examples/qwen3_sequence_parallel.py": "docs/integrations.md",
            "examples/qwen_image_sequence_parallel.py": "docs/integrations.md",
            "examples/wan_sequence_parallel.py": "docs/integrations.md"}


def _python_blocks(page: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S)


@pytest.mark.parametrize("example", sorted(EXAMPLES))
def test_the_docs_show_the_example_as_it_is(example):
    text = (ROOT / example).read_text()
    assert text in _python_blocks(ROOT / EXAMPLES[example]), (
        f"{EXAMPLES[example]} must show {example} verbatim in a ```python block")


@pytest.mark.slow
@pytest.mark.parametrize("example", sorted(EXAMPLES))
def test_the_example_runs_and_exits_cleanly(example):
    if example.startswith("examples/qwen3"):
        pytest.importorskip("transformers")
    if example.startswith(("examples/qwen_image", "examples/wan")):
        pytest.importorskip("diffusers")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
         example], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert "terminate called" not in result.stderr, result.stderr[-4000:]
