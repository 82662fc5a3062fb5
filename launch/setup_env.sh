# Sourced by the entry scripts: create .venv and install cake_sp with its test extras.
# Without a GPU, torch==2.13.0 resolves to the CPU wheel where one is on offer.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
python3 -m venv .venv
.venv/bin/pip install -q --disable-pip-version-check "torch==2.13.0" -e ".[test]"
