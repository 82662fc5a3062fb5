#!/usr/bin/env bash
# Set up .venv and run the main job: the session on NPROC ranks (default 4) under torchrun.
source "$(dirname "$0")/setup_env.sh"
.venv/bin/torchrun --standalone --nproc-per-node="${NPROC:-4}" launch/demo.py "$@"
