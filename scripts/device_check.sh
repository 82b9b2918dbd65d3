#!/usr/bin/env bash
# ftbridge's device check: on a machine with one GPU, no network and Python 3.12 with torch installed,
# install ftbridge and its wheels from ./device_wheels (scripts/fetch_device_wheels.sh made them), then run
# python -m ftbridge.harness.bench.device_check: equivalence against plain DeepSpeed (ZeRO 1/2/3, fp32/bf16,
# overlap_comm off/on), failover and heal, step-time overhead. Prints a table and writes it to
# runs/device_check/table.txt (and results.json). About 4 minutes on an H200.
#
#   scripts/device_check.sh                 # on the GPU machine
#   PYTHON=.venv/bin/python scripts/device_check.sh --dry-run   # anywhere: the same on the CPU, gloo, small sizes
#   scripts/device_check.sh --only equivalence --stages 2 --dtypes fp32 --overlap off
#
# Environment: PYTHON (default python3), WHEELS (default ./device_wheels), SITE (default ./.device_site: the
# wheels the machine's Python lacks are installed there and put on PYTHONPATH).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
PYTHON="${PYTHON:-python3}"
WHEELS="${WHEELS:-$ROOT/device_wheels}"
SITE="${SITE:-$ROOT/.device_site}"
dry=0
for a in "$@"; do [ "$a" = "--dry-run" ] && dry=1; done

if [ "$dry" = 0 ]; then
  if [ ! -d "$WHEELS" ]; then
    echo "no wheel folder $WHEELS: run scripts/fetch_device_wheels.sh on a machine with network first" >&2
    exit 2
  fi
  # Only the wheels whose distribution the machine's Python lacks go into $SITE, so the machine's own
  # torch (with its CUDA), numpy and the rest are used and never shadowed. (A venv with
  # --system-site-packages does not do this when that Python is itself a venv's: the new venv sees the
  # base interpreter's packages, not torch.)
  missing=$("$PYTHON" - "$WHEELS" <<'PY'
import glob, importlib.metadata as md, os, sys
for w in sorted(glob.glob(os.path.join(sys.argv[1], "*.whl"))):
    name = os.path.basename(w).split("-")[0]
    try:
        md.version(name)
    except md.PackageNotFoundError:
        print(w)
PY
)
  if [ -n "$missing" ]; then
    # shellcheck disable=SC2086 - one wheel path per word
    "$PYTHON" -m pip install --quiet --no-index --no-deps --no-compile --upgrade --target "$SITE" $missing
  fi
  echo "installed into $SITE: $(echo "$missing" | grep -c . || true) wheels the machine lacked"
  export PYTHONPATH="$SITE"
fi
PY="$PYTHON"  # the dry run uses the given environment as it is, e.g. PYTHON=.venv/bin/python
# ftbridge itself from this checkout (no build step needed).
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
"$PY" -c "import torch, deepspeed, torchft, ftbridge; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'deepspeed', deepspeed.__version__)"
if [ "$dry" = 0 ]; then
  # The tests marked cuda (they skip on CPU machines); their outcome is part of the check's output.
  timeout 120 "$PY" -m pytest -m cuda tests/test_cuda.py -q -p no:cacheprovider -rs || echo "CUDA TESTS FAILED"
fi
# A bound on the whole check: 10 minutes on a GPU (4 on an H200); the CPU dry run is slower.
limit=600
[ "$dry" = 1 ] && limit=3600
exec timeout --signal=TERM "$limit" "$PY" -m ftbridge.harness.bench.device_check "$@"
