"""cake_sp: sequence-parallel (Ulysses) attention for NVIDIA GPUs: the whole layer, its front end.

Public names only; see ``docs/guide.md`` and ``docs/kernels.md``.
"""

from __future__ import annotations

from cake_sp.core import UlyssesAttentionCore
from cake_sp.kernels.fmha import (
    batch_context_with_kv_cache,
    batch_decode_with_kv_cache,
    fmha_manifest,
)
from cake_sp.kernels.qk_rope_append import fused_qk_rmsnorm_rope_append_paged_kv_cache
from cake_sp.kernels.qk_rope_fp8_append import (
    fused_qk_rmsnorm_rope_quantize_fp8_append_paged_kv_cache,
)
from cake_sp.layer import UlyssesAttention
from cake_sp.session.channel import PeerTimeoutError
from cake_sp.session.mesh import UlyssesBackendError
from cake_sp.session.overlap import QkvNormRopeExchangeOverlap
from cake_sp.session.slots import SlotInUseError

__version__ = "0.1.0"

__all__ = [
    "PeerTimeoutError",
    "QkvNormRopeExchangeOverlap",
    "SlotInUseError",
    "UlyssesAttention",
    "UlyssesAttentionCore",
    "UlyssesBackendError",
    "batch_context_with_kv_cache",
    "batch_decode_with_kv_cache",
    "fmha_manifest",
    "fused_qk_rmsnorm_rope_append_paged_kv_cache",
    "fused_qk_rmsnorm_rope_quantize_fp8_append_paged_kv_cache",
]
