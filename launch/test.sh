#!/usr/bin/env bash
# Set up .venv and run the linter and the whole test suite (extra pytest arguments pass through).
source "$(dirname "$0")/setup_env.sh"
.venv/bin/ruff check .
.venv/bin/python -m pytest "$@"
