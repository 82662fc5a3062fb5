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
