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

try:
    from triton.experimental.gluon import language as gl
except ImportError:  # a Triton without Gluon: no kernel passes GLUON=True then
    gl = None

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


FP8_E4M3_MAX: float = 448.0
FP8_E4M3_MIN_NORMAL: tl.constexpr = tl.constexpr(0.015625)  # 2**-6


@triton.jit
def round_to_fp8e4m3(x, INTERPRET: tl.constexpr):
    """Round an fp32 tensor to FP8 e4m3 (``float8_e4m3fn``), nearest-even, saturating at +-448.

    Clamping first makes the conversion saturating on every target (NaN aside).
    The CPU interpreter neither rounds to nearest nor saturates; there the value
    is first rounded onto the e4m3 grid in fp32 (3 mantissa bits for normals, a
    fixed step of 2**-9 for subnormals, sign kept for values that round to 0),
    so that the final cast is exact.
    """
    x = tl.minimum(tl.maximum(x, -448.0), 448.0)
    if INTERPRET:
        bits = x.to(tl.uint32, bitcast=True)
        normal = (bits + 0x7FFFF + ((bits >> 20) & 1)) & 0xFFF00000
        # Adding 1.5 * 2**14 puts every |x| < 2**-6 in a binade whose fp32 step is 2**-9.
        sub = ((x + 24576.0) - 24576.0).to(tl.uint32, bitcast=True) | (bits & 0x80000000)
        x = tl.where(tl.abs(x) >= FP8_E4M3_MIN_NORMAL, normal, sub).to(tl.float32, bitcast=True)
    return x.to(tl.float8e4nv)


@triton.jit
def reciprocal_rn(s):
    """``1 / s`` in fp32, rounded once (IEEE, nearest-even); a scalar or a tensor."""
    return tl.math.div_rn(tl.full(s.shape, 1.0, tl.float32), s)


@triton.jit
def inv_rms(sum_sq, eps, D: tl.constexpr):
    """``1/sqrt(sum_sq / D + eps)`` per row, with IEEE-rounded sqrt and division
    (not ``rsqrt.approx``) so that it matches ``torch.rsqrt`` in fp32; one value
    per row, so the cost is nil."""
    return tl.math.div_rn(1.0, tl.sqrt_rn(sum_sq / D + eps))


@triton.jit
def rms_normalize(x, eps, D: tl.constexpr):
    """``x * 1/sqrt(mean(x^2, -1) + eps)`` over the ``D`` columns of an fp32 tile."""
    return x * inv_rms(tl.sum(x * x, axis=1), eps, D)[:, None]


@triton.jit
def load_cos_sin(cos_sin_ptr, rows, row_stride, mask, half_cols, D: tl.constexpr):
    """Load the ``cos`` and ``sin`` halves of table ``rows`` as two fp32 ``[BLOCK_M, D/2]`` tiles.

    ``rows`` is an int64 ``[BLOCK_M]`` vector of table row indices, ``half_cols``
    ``arange(D/2)`` (the caller's layout); masked rows read 0.
    """
    ptrs = cos_sin_ptr + rows[:, None] * row_stride + half_cols[None, :]
    cos = tl.load(ptrs, mask=mask[:, None], other=0.0)
    sin = tl.load(ptrs + D // 2, mask=mask[:, None], other=0.0)
    return cos, sin


@triton.jit
def rotate_pairs(a, b, cos, sin):
    """Rotate channel pairs ``(a, b)`` by their angle: ``(a cos - b sin, b cos + a sin)``."""
    return a * cos - b * sin, b * cos + a * sin


@triton.jit
def rope_rotate(x, cos, sin, BLOCK_M: tl.constexpr, D: tl.constexpr, STYLE: tl.constexpr,
                GLUON: tl.constexpr = False):
    """Rotate the channel pairs of an fp32 ``[BLOCK_M, D]`` tile by ``[BLOCK_M, D/2]`` cos, sin.

    For each pair ``(a, b)`` with frequency ``i``: ``a' = a cos_i - b sin_i``,
    ``b' = b cos_i + a sin_i``.  ``STYLE`` picks the pairing (``ROPE_STYLES``).
    ``GLUON``: called from a Gluon kernel, where operands must share a layout:
    ``cos``/``sin`` take the split halves' layout and the result ``x``'s (register
    moves only when ``cos``/``sin`` are slices of ``x``'s layout).
    """
    if STYLE == ROPE_INTERLEAVED:
        a, b = tl.split(tl.reshape(x, (BLOCK_M, D // 2, 2)))
    else:
        a, b = tl.split(tl.permute(tl.reshape(x, (BLOCK_M, 2, D // 2)), (0, 2, 1)))
    if GLUON:
        cos = gl.convert_layout(cos, a.type.layout)
        sin = gl.convert_layout(sin, a.type.layout)
    ra, rb = rotate_pairs(a, b, cos, sin)
    if STYLE == ROPE_INTERLEAVED:
        out = tl.reshape(tl.join(ra, rb), (BLOCK_M, D))
    else:
        out = tl.reshape(tl.permute(tl.join(ra, rb), (0, 2, 1)), (BLOCK_M, D))
    if GLUON:
        out = gl.convert_layout(out, x.type.layout)
    return out


QK_NORM_POLICIES: dict[int, str] = {0: "none", 1: "RoPE then RMSNorm", 2: "RMSNorm then RoPE"}
QK_NORM_NONE: tl.constexpr = tl.constexpr(0)
QK_NORM_AFTER_ROPE: tl.constexpr = tl.constexpr(1)
QK_NORM_BEFORE_ROPE: tl.constexpr = tl.constexpr(2)


@triton.jit
def qk_norm_rope(x, w_ptr, cos, sin, eps, POLICY: tl.constexpr, BLOCK_M: tl.constexpr,
                 D: tl.constexpr, STYLE: tl.constexpr):
    """Apply ``qk_norm_policy`` to an fp32 ``[BLOCK_M, D]`` head tile, all in fp32, no rounding.

    ``POLICY`` 0: ``rope(x)``; 1: ``rms_normalize(rope(x)) * w``; 2:
    ``rope(rms_normalize(x) * w)``.  ``w_ptr`` points at ``D`` norm weights
    (fp32 or bf16, upcast on load); it is not read under policy 0.
    """
    if POLICY == QK_NORM_BEFORE_ROPE:
        w = tl.load(w_ptr + tl.arange(0, D)).to(tl.float32)
        x = rms_normalize(x, eps, D) * w[None, :]
    x = rope_rotate(x, cos, sin, BLOCK_M, D, STYLE)
    if POLICY == QK_NORM_AFTER_ROPE:
        w = tl.load(w_ptr + tl.arange(0, D)).to(tl.float32)
        x = rms_normalize(x, eps, D) * w[None, :]
    return x


# -- the same math on a head split into its column halves --
# A head loaded as two [BLOCK_M, D/2] tiles, channels [0, D/2) and [D/2, D), keeps
# every NeoX pair (i, i + D/2) in one thread: RoPE is elementwise, with no layout
# change through shared memory (the paged-append kernels, whose tiles come from
# loads, not from an MMA accumulator).


@triton.jit
def load_cos_sin_halves(cos_sin_ptr, rows, row_stride, mask, D: tl.constexpr,
                        STYLE: tl.constexpr):
    """``(cos_lo, sin_lo, cos_hi, sin_hi)`` of table ``rows`` (int64 ``[BLOCK_M]``) for
    the two column halves of a head; masked rows read 0.

    NeoX: both halves rotate by the ``D/2`` frequencies, ``[BLOCK_M, D/2]`` each
    (the same tensors).  Interleaved: the low half's pairs take frequencies
    ``[0, D/4)`` and the high half's ``[D/4, D/2)``, ``[BLOCK_M, D/4]`` each.
    """
    base = cos_sin_ptr + rows[:, None] * row_stride
    if STYLE == ROPE_NEOX:
        i = tl.arange(0, D // 2)[None, :]
        cos_lo = tl.load(base + i, mask=mask[:, None], other=0.0)
        sin_lo = tl.load(base + D // 2 + i, mask=mask[:, None], other=0.0)
        cos_hi = cos_lo
        sin_hi = sin_lo
    else:
        i = tl.arange(0, D // 4)[None, :]
        cos_lo = tl.load(base + i, mask=mask[:, None], other=0.0)
        cos_hi = tl.load(base + D // 4 + i, mask=mask[:, None], other=0.0)
        sin_lo = tl.load(base + D // 2 + i, mask=mask[:, None], other=0.0)
        sin_hi = tl.load(base + D // 2 + D // 4 + i, mask=mask[:, None], other=0.0)
    return cos_lo, sin_lo, cos_hi, sin_hi


@triton.jit
def rms_normalize_halves(lo, hi, w_lo, w_hi, eps, D: tl.constexpr):
    """``rms_normalize(x) * w`` of heads given as their fp32 column halves ``[rows, D/2]``;
    ``w_lo``, ``w_hi``: the fp32 weights of the two halves, broadcastable to them."""
    inv = inv_rms(tl.sum(lo * lo, axis=1) + tl.sum(hi * hi, axis=1), eps, D)[:, None]
    return lo * inv * w_lo, hi * inv * w_hi


@triton.jit
def qk_norm_rope_halves(lo, hi, w_lo, w_hi, cos_lo, sin_lo, cos_hi, sin_hi, eps,
                        POLICY: tl.constexpr, BLOCK_M: tl.constexpr, D: tl.constexpr,
                        STYLE: tl.constexpr):
    """``qk_norm_rope`` on a head given as its fp32 column halves ``lo``, ``hi``
    (``[BLOCK_M, D/2]`` each) with ``load_cos_sin_halves``' tables and the norm weights'
    halves ``w_lo``, ``w_hi`` (not read under policy 0); returns the two halves of the
    result."""
    if POLICY == QK_NORM_BEFORE_ROPE:
        lo, hi = rms_normalize_halves(lo, hi, w_lo, w_hi, eps, D)
    if STYLE == ROPE_NEOX:
        lo, hi = rotate_pairs(lo, hi, cos_lo, sin_lo)
    else:
        lo = rope_rotate(lo, cos_lo, sin_lo, BLOCK_M, D // 2, STYLE)
        hi = rope_rotate(hi, cos_hi, sin_hi, BLOCK_M, D // 2, STYLE)
    if POLICY == QK_NORM_AFTER_ROPE:
        lo, hi = rms_normalize_halves(lo, hi, w_lo, w_hi, eps, D)
    return lo, hi
