#!/usr/bin/env bash
# Build the wheel, install it into a fresh virtual environment (not editable, CPU torch) and
# run launch/wheel_smoke.py from outside the tree.
set -euo pipefail
cd "$(dirname "$0")/.."
work=$(mktemp -d)
python3 -m venv "$work/venv"
"$work/venv/bin/pip" install -q --disable-pip-version-check build "torch==2.13.0"
"$work/venv/bin/python" -m build -q --wheel --outdir "$work/dist" .
"$work/venv/bin/pip" install -q --disable-pip-version-check "$work"/dist/cake_sp-*.whl
cp launch/wheel_smoke.py "$work/"
(cd "$work" && "$work/venv/bin/python" wheel_smoke.py)
rm -rf "$work"
