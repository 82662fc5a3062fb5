"""``python -m cake_sp.kernels.fmha [--write]``: check or regenerate the FMHA manifest."""

import sys

from cake_sp.kernels.fmha.manifest import main

sys.exit(main())
