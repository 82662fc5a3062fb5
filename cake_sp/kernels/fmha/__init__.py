"""Paged FMHA (decode and context) with FlashInfer's TensorRT-LLM calling convention.

Modules: ``api`` (the public calls and their validation), ``selector``
(capability matrix and route choice), ``compat`` (complete-domain route),
``decode`` / ``context`` (Triton routes), ``tiles`` (their shared device code),
``manifest`` (the content-addressed record), ``problem`` and ``tuning``.
"""

from cake_sp.kernels.fmha.api import batch_context_with_kv_cache, batch_decode_with_kv_cache
from cake_sp.kernels.fmha.manifest import FmhaManifestError, fmha_manifest

__all__ = [
    "FmhaManifestError",
    "batch_context_with_kv_cache",
    "batch_decode_with_kv_cache",
    "fmha_manifest",
]
