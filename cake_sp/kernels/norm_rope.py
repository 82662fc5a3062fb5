"""Device helpers for per-head RMSNorm and rotary embedding (RoPE) on register tiles.

One module, shared by every kernel that normalises or rotates heads: the fused
producer of the NVLink path (``producer.py``) and the paged KV-cache append
kernels.  Each helper works on a ``[BLOCK_M, D]`` fp32 tile whose rows are
tokens and whose columns are the ``D`` channels of one head.

RoPE table convention (FlashInfer's ``cos_sin_cache``): a row of ``D`` fp32
values holds ``cos`` of the ``D/2`` frequencies, then their ``sin``.  Styles:

* ``"interleaved"`` (FLUX.1): channel pairs ``(2i, 2i+1)`` rotate by frequency ``i``;
* ``"neox"`` (Llama/Qwen ``rotate_half``): pairs ``(i, i + D/2)`` rotate by frequency ``i``.
"""

from __future__ import annotations

import triton
import triton.language as tl

ROPE_STYLES: dict[str, int] = {"interleaved": 0, "neox": 1}
ROPE_INTERLEAVED: tl.constexpr = tl.constexpr(0)
ROPE_NEOX: tl.constexpr = tl.constexpr(1)


def rope_style_code(rope_style: str) -> int:
    """Map a RoPE style name to the kernels' constexpr code, rejecting unknown names."""
    try:
        return ROPE_STYLES[rope_style]
    except KeyError:
        raise ValueError(
            f"rope_style must be one of {sorted(ROPE_STYLES)}, got {rope_style!r}"
        ) from None


@triton.jit
def round_to_bf16(x, INTERPRET: tl.constexpr):
    """Round an fp32 tensor to bf16, nearest-even, returning a bf16 tensor.

    The CPU interpreter truncates on ``.to(tl.bfloat16)``; there the rounding is
    done on the bit pattern first so that the final cast is exact.
    """
    if INTERPRET:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        x = bits.to(tl.float32, bitcast=True)
    return x.to(tl.bfloat16)


@triton.jit
def rms_normalize(x, eps, D: tl.constexpr):
    """``x * 1/sqrt(mean(x^2, -1) + eps)`` over the ``D`` columns of an fp32 tile.

    Uses IEEE-rounded sqrt and division (not ``rsqrt.approx``) so the result
    matches ``torch.rsqrt`` in fp32; it is one value per row, so the cost is nil.
    """
    mean_sq = tl.sum(x * x, axis=1) / D
    inv_rms = tl.math.div_rn(1.0, tl.sqrt_rn(mean_sq + eps))
    return x * inv_rms[:, None]


@triton.jit
def load_cos_sin(cos_sin_ptr, rows, row_stride, mask, D: tl.constexpr):
    """Load the ``cos`` and ``sin`` halves of table rows ``rows`` as two fp32 ``[BLOCK_M, D/2]`` tiles.

    ``rows`` is an int64 ``[BLOCK_M]`` vector of table row indices; masked rows read 0.
    """
    cols = tl.arange(0, D // 2)[None, :]
    ptrs = cos_sin_ptr + rows[:, None] * row_stride + cols
    cos = tl.load(ptrs, mask=mask[:, None], other=0.0)
    sin = tl.load(ptrs + D // 2, mask=mask[:, None], other=0.0)
    return cos, sin


@triton.jit
def rope_rotate(x, cos, sin, BLOCK_M: tl.constexpr, D: tl.constexpr, STYLE: tl.constexpr):
    """Rotate the channel pairs of an fp32 ``[BLOCK_M, D]`` tile by ``cos``/``sin`` ``[BLOCK_M, D/2]``.

    For each pair ``(a, b)`` with frequency ``i``: ``a' = a cos_i - b sin_i``,
    ``b' = b cos_i + a sin_i``.  ``STYLE`` picks the pairing (``ROPE_STYLES``).
    """
    if STYLE == ROPE_INTERLEAVED:
        a, b = tl.split(tl.reshape(x, (BLOCK_M, D // 2, 2)))
    else:
        a, b = tl.split(tl.permute(tl.reshape(x, (BLOCK_M, 2, D // 2)), (0, 2, 1)))
    ra = a * cos - b * sin
    rb = b * cos + a * sin
    if STYLE == ROPE_INTERLEAVED:
        out = tl.reshape(tl.join(ra, rb), (BLOCK_M, D))
    else:
        out = tl.reshape(tl.permute(tl.join(ra, rb), (0, 2, 1)), (BLOCK_M, D))
    return out
