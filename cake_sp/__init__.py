"""cake_sp: the attention front end of a sequence-parallel (Ulysses) transformer layer.

Public names only; see ``docs/guide.md``.
"""

from __future__ import annotations

__version__ = "0.1.0"

# -- session (QkvNormRopeExchangeOverlap, UlyssesBackendError) --
from cake_sp.session.mesh import UlyssesBackendError
from cake_sp.session.overlap import QkvNormRopeExchangeOverlap
# -- paged KV-cache append kernels --
from cake_sp.kernels.qk_rope_append import (
    fused_qk_rmsnorm_rope_append_paged_kv_cache as fused_qk_rmsnorm_rope_append_paged_kv_cache,
)
from cake_sp.kernels.qk_rope_fp8_append import (
    fused_qk_rmsnorm_rope_quantize_fp8_append_paged_kv_cache as fused_qk_rmsnorm_rope_quantize_fp8_append_paged_kv_cache,  # noqa: E501
)
# -- paged FMHA --
from cake_sp.kernels.fmha import batch_context_with_kv_cache as batch_context_with_kv_cache
from cake_sp.kernels.fmha import batch_decode_with_kv_cache as batch_decode_with_kv_cache
from cake_sp.kernels.fmha import fmha_manifest as fmha_manifest
