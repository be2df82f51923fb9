#!/usr/bin/env bash
# Download (here, where pip reaches the index) the wheels the GPU machine lacks, into .whl/.
# The device image already has msgpack, numpy, pytest, cuda-core, cuda-bindings, cupy, torch and
# sortedcontainers (/work/.library/device/KINDS.md); it lacks pyzmq. Python 3.12, x86-64 manylinux.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
mkdir -p .whl
WHEELS=("pyzmq==27.1.0")
for spec in "${WHEELS[@]}"; do
  name=${spec%%==*}
  if ls .whl/ 2>/dev/null | grep -qi "^${name}-"; then echo "have $name"; continue; fi
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
    -d .whl "$spec"
done
ls -la .whl
