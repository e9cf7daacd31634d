#!/usr/bin/env bash
# Fill eval/gpu_wheels/ (here, with PyPI access) with the wheels listed in eval/gpu_wheels.txt, for the GPU machine's
# Python 3.12 on x86_64 Linux: binary wheels are downloaded; a package published only as an sdist (hqq) is built into
# a wheel here. Then `bash eval/gpu_check.sh --dry-run` checks them.
#   bash eval/fetch_gpu_wheels.sh [PIP]        (PIP defaults to .venv/bin/pip, else pip3)
set -euo pipefail
cd "$(dirname "$0")/.."
PIP=${1:-$( [ -x .venv/bin/pip ] && echo .venv/bin/pip || echo pip3 )}
DEST=eval/gpu_wheels
mkdir -p "$DEST"
grep -v '^\s*#' eval/gpu_wheels.txt | sed 's/#.*//' | while read -r pin; do
  [ -z "$pin" ] && continue
  if ! "$PIP" download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux2014_x86_64 -d "$DEST" "$pin"; then
    echo "no wheel for $pin on the index: building one from its sdist"
    "$PIP" wheel --no-deps -w "$DEST" "$pin"
  fi
done
ls -la "$DEST"
