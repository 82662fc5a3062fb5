"""Launch heuristics and compile-time switches shared by the Triton kernels.

Kept apart from the kernels so that tuning a block size never touches the math.
"""

from __future__ import annotations

import os

# Triton's CPU interpreter (``TRITON_INTERPRET=1``) computes wrongly on bf16
# values and truncates on fp32 -> bf16 casts; kernels take this flag as a
# ``tl.constexpr`` and, when it is set, upcast right after loading and round
# to bf16 by hand (see ``norm_rope.round_to_bf16``).  On a GPU it is False and
# the kernels keep bf16 operands for the tensor cores.
INTERPRET: bool = os.environ.get("TRITON_INTERPRET", "0") == "1"

# -- paged KV-cache append (qk_rope_append.py, qk_rope_fp8_append.py) --
# Every program scans q_indptr itself; a chunk of 128 int32 keeps that scan to
# a few vector loads for serving batch sizes.
APPEND_CHUNK_B: int = 128
# Page-table entries one request program checks per step.
APPEND_CHUNK_P: int = 64
# Cache rows a request program zeroes per step when clearing a last page.
APPEND_BLOCK_R: int = 16
APPEND_NUM_WARPS: int = 4


def append_block_m(num_tokens: int, head_dim: int) -> int:
    """Tokens per tile program: enough rows to amortise the metadata scan, but a
    ``[BLOCK_M, D]`` fp32 tile of at most 4096 values (32 registers a thread at
    4 warps), and no wider than the batch needs."""
    cap = 4096 // head_dim
    block = 1
    while block < min(num_tokens, cap):
        block *= 2
    return block
