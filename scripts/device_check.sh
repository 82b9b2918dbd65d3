#!/usr/bin/env bash
# ftbridge's device check: on a machine with one GPU, no network and Python 3.12 with torch installed,
# install ftbridge and its wheels from ./device_wheels (scripts/fetch_device_wheels.sh made them), then run
# python -m ftbridge.harness.bench.device_check: equivalence against plain DeepSpeed (ZeRO 1/2/3, fp32/bf16,
# overlap_comm off/on), failover and heal, step-time overhead. Prints a table and writes it to
# runs/device_check/table.txt (and results.json). Under 8 minutes on one GPU.
#
#   scripts/device_check.sh                 # on the GPU machine
#   PYTHON=.venv/bin/python scripts/device_check.sh --dry-run   # anywhere: the same on the CPU, gloo, small sizes
#   scripts/device_check.sh --only equivalence --stages 2 --dtypes fp32 --overlap off
#
# Environment: PYTHON (default python3), WHEELS (default ./device_wheels), VENV (default ./.device_venv).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
PYTHON="${PYTHON:-python3}"
WHEELS="${WHEELS:-$ROOT/device_wheels}"
VENV="${VENV:-$ROOT/.device_venv}"
dry=0
for a in "$@"; do [ "$a" = "--dry-run" ] && dry=1; done

if [ "$dry" = 0 ]; then
  if [ ! -d "$WHEELS" ]; then
    echo "no wheel folder $WHEELS: run scripts/fetch_device_wheels.sh on a machine with network first" >&2
    exit 2
  fi
  if [ ! -x "$VENV/bin/python" ]; then
    # --system-site-packages: the machine's own torch (with its CUDA) is used, never downloaded.
    "$PYTHON" -m venv --system-site-packages "$VENV"
  fi
  "$VENV/bin/python" -m pip install --quiet --no-index --no-deps "$WHEELS"/*.whl
  PY="$VENV/bin/python"
else
  PY="$PYTHON"  # the dry run uses the given environment as it is, e.g. PYTHON=.venv/bin/python
fi
# ftbridge itself from this checkout (no build step needed).
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
"$PY" -c "import torch, deepspeed, torchft, ftbridge; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'deepspeed', deepspeed.__version__)"
if [ "$dry" = 0 ]; then
  # The tests marked cuda (they skip on CPU machines); their outcome is part of the check's output.
  timeout 120 "$PY" -m pytest -m cuda tests/test_cuda.py -q -p no:cacheprovider -rs || echo "CUDA TESTS FAILED"
fi
# A bound on the whole check: 10 minutes on a GPU (planned under 8); the CPU dry run is slower.
limit=600
[ "$dry" = 1 ] && limit=3600
exec timeout --signal=TERM "$limit" "$PY" -m ftbridge.harness.bench.device_check "$@"
