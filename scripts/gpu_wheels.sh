#!/usr/bin/env bash
# Download the wheels scripts/gpu_check.sh installs on the GPU machine (which reaches no package registry) into
# .whl/ (git-ignored; carry it: the device tool's `carry: [".whl"]`).  Run here, where pip reaches the registry.
# CPython 3.12 on x86-64 Linux, binary wheels only, no dependencies resolved: scripts/gpu_wheels.txt names each.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
mkdir -p .whl
grep -v '^\s*#' scripts/gpu_wheels.txt | grep -v '^\s*$' | while read -r wanted; do
  "$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
    -d .whl "$wanted"
done
echo "gpu_wheels: $(ls .whl | wc -l) wheels, $(du -sh .whl | cut -f1) in .whl/"
