"""cake_sp: the attention front end of a sequence-parallel (Ulysses) transformer layer.

Public names only; see ``docs/guide.md``.
"""

from __future__ import annotations

__version__ = "0.1.0"

# -- session (QkvNormRopeExchangeOverlap, UlyssesBackendError) --
from cake_sp.session.mesh import UlyssesBackendError
from cake_sp.session.overlap import QkvNormRopeExchangeOverlap
# -- paged KV-cache append kernels --
# -- paged FMHA --
from cake_sp.kernels.fmha import batch_context_with_kv_cache as batch_context_with_kv_cache
from cake_sp.kernels.fmha import batch_decode_with_kv_cache as batch_decode_with_kv_cache
from cake_sp.kernels.fmha import fmha_manifest as fmha_manifest
