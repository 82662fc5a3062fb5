"""The comparison helper accepts one intermediate bf16 flip and nothing more."""

from __future__ import annotations

import pytest
import torch

from cake_sp import reference
from cake_sp.testing import assert_close_counting_flips, bf16_ulp


def _rotated(pre_rope: torch.Tensor, style: str) -> torch.Tensor:
    cos_sin = reference.rope_cos_sin_table(pre_rope.shape[0], pre_rope.shape[-1])
    return reference.rope(pre_rope[:, None, :], cos_sin, style)[:, 0].bfloat16()


@pytest.mark.parametrize("style", ["interleaved", "neox"])
def test_one_intermediate_flip_is_counted_and_a_real_error_is_not(style):
    g = torch.Generator().manual_seed(3)
    pre = (4 * torch.randn(4096, 128, generator=g)).bfloat16().float()
    want = _rotated(pre, style)
    # Flip one intermediate value by one ulp where its partner nearly cancels it.
    flipped = pre.clone()
    flipped[100, 6] += bf16_ulp(flipped[100, 6])
    got = _rotated(flipped, style)
    counts = assert_close_counting_flips(got, want, rope_style=style)
    assert counts["differ"] >= 1
    wrong = want.clone()
    wrong[7, 3] += 40 * bf16_ulp(wrong[7, 3].float()) + 0.5
    with pytest.raises(AssertionError, match="does not explain"):
        assert_close_counting_flips(wrong, want, rope_style=style)
    with pytest.raises(AssertionError):
        assert_close_counting_flips(wrong, want, rope_style=None)
