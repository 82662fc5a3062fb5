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
