#!/usr/bin/env bash
# Download, on a machine with access to the package index, the wheels a CUDA machine without
# network access needs to run ipcpool's GPU suite (scripts/gpu_suite.sh installs them from there).
set -euo pipefail
usage() {
  cat <<'USAGE'
usage: scripts/fetch_wheels.sh [--dest DIR] [--python X.Y] [--platform TAG] [SPEC...]

Downloads binary wheels, without their dependencies, for the GPU machine's Python into DIR.
The default set is what ipcpool needs beyond a CUDA image that already has Python, numpy, pytest,
msgpack, sortedcontainers, cuda-core, cuda-bindings, torch and CuPy:
  pyzmq, rich (with markdown-it-py, mdurl, pygments), prometheus-client, pytest-timeout, and
  nixl-cu13 (the fleet pull's tests and bench/pull.py; 56 MiB).
A wheel already in DIR (same project name) is not downloaded again.

  --dest DIR       where the wheels go (default: .whl, beside this repository's files)
  --python X.Y     the GPU machine's Python version (default: 3.12)
  --platform TAG   its platform, manylinux x86-64 by default; repeat for several tags
  SPEC...          more requirements to fetch, such as safetensors==0.8.0
  -h, --help       this help
USAGE
}
cd "$(dirname "$0")/.."
DEST=.whl PY=3.12 PLATFORMS=()
while [ $# -gt 0 ]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --dest) DEST=$2; shift 2 ;;
    --python) PY=$2; shift 2 ;;
    --platform) PLATFORMS+=("$2"); shift 2 ;;
    -*) echo "fetch_wheels.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
    *) break ;;
  esac
done
[ ${#PLATFORMS[@]} -gt 0 ] || PLATFORMS=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_26_x86_64
                                         manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64)
WHEELS=("pyzmq==27.1.0" "rich==15.0.0" "markdown-it-py==4.3.0" "mdurl==0.1.2" "pygments==2.21.0"
        "prometheus-client==0.26.0" "pytest-timeout==2.4.0" "nixl-cu13==1.5.1" "$@")
mkdir -p "$DEST"
platform_args=()
for p in "${PLATFORMS[@]}"; do platform_args+=(--platform "$p"); done
for spec in "${WHEELS[@]}"; do
  name=${spec%%[=<>!~ ]*}
  pattern=$(echo "$name" | tr 'A-Z-' 'a-z_')
  if ls "$DEST" 2>/dev/null | tr 'A-Z-' 'a-z_' | grep -q "^${pattern}-"; then echo "have $name"; continue; fi
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PY" --implementation cp \
    "${platform_args[@]}" -d "$DEST" "$spec"
done
ls -la "$DEST"
