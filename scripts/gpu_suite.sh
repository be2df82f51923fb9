#!/usr/bin/env bash
# ipcpool's GPU suite for any CUDA machine: the GPU tests and the benchmarks, then a summary. `scripts/gpu_suite.sh --help` lists the modes and options.
set -uo pipefail
usage() {
  cat <<'USAGE'
usage: scripts/gpu_suite.sh [options] [MODE]

Runs ipcpool's GPU work on this CUDA machine and ends with a summary table.
MODE (default: full):
  tests   the GPU tests (pytest -m gpu tests/gpu)
  vmm     the VMM tests and the VMM grow benchmark (ipcpool with the default chunk stock, with
          none and with 8G), the grow floor (bench/grow_floor.py), then the same growth under
          cProfile (bench/profiles.py grow)
  check   tests + the VMM grow benchmarks of vmm
  bench   the other benchmarks (round trip, hand-off on GPU and host, hot attach, host round
          trip), the hand-off's timeline across its three processes
          (bench/handoff_timeline.py) and its client steps against the same work by hand
          (bench/handoff_steps.py); no tests
  full    check + bench
  mps     the GPU tests under CUDA MPS, without the tests that kill CUDA processes (marker
          kills_clients): starts a private MPS control daemon (nvidia-cuda-mps-control -d, its
          CUDA_MPS_PIPE_DIRECTORY and CUDA_MPS_LOG_DIRECTORY fresh temporary directories, exported
          to the tests), checks with `ipcpool doctor --json` that MPS serves the device, runs
          pytest -m "gpu and not kills_clients" tests/gpu, then stops the daemon (echo quit |
          nvidia-cuda-mps-control), also when a test fails or the run is interrupted; its logs
          go to DIR/mps/. Exits non-zero where nvidia-cuda-mps-control is missing, where MPS does
          not serve the device, or where a test fails. Under MPS a client killed with GPU work in
          flight can fail the MPS server for every process on the GPU: hence no kill tests.
  attach  hot attach at two sizes, five fresh processes a layout: 8 GiB as 1, 64 and 1024
          objects, 64 GiB as 1 and 4096 (bench/hot_attach.py --ipcpool-only), then the 4096-object
          attach under cProfile (bench/profiles.py attach); no tests
  peer    on a machine with two or more GPUs: the two-GPU tests (pytest -m "gpu and two_gpus"),
          then the hand-off benchmark with the producer on GPU 0 and the reader on GPU 1
          (bench/handoff.py --devices 0,1, torch.multiprocessing across the same two beside it);
          exits non-zero where fewer than two GPUs are visible
Each mode but full takes under ten minutes on an H100 or H200.

Options:
  --out DIR        logs and results go here (default: $OUT, else ./gpu-out)
  --wheels DIR     first install the wheels in DIR, offline and without resolving dependencies
                   (pip install --no-index --no-deps --target SITE); default: .whl where it holds
                   wheels (scripts/fetch_wheels.sh fills it on a machine with network access)
  --site DIR       where those wheels are installed, put first on PYTHONPATH (default: /tmp/site)
  -k EXPR          run only the GPU tests matching EXPR (pytest -k; default: $PYTEST_K)
  --before DIR     also compare the CUDA hand-off of the checkout in DIR (an earlier commit:
                   `git archive REV | tar -x -C DIR`) with this checkout's, interleaved over five
                   rounds on this machine (bench/handoff_ab.py; any MODE)
  --timeout S      fail a GPU test that runs longer than S seconds (pytest-timeout; default: 300)
  --keep-files     leave the results as loose files; by default they are packed into one archive,
                   DIR/results.tgz, to copy off the machine
  -h, --help       this help
USAGE
}
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out} WHEELS=.whl SITE=/tmp/site PYTEST_K=${PYTEST_K:-} TEST_TIMEOUT=300 ARCHIVE=1 MODE=full BEFORE=
while [ $# -gt 0 ]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --out) OUT=$2; shift 2 ;;
    --wheels) WHEELS=$2; shift 2 ;;
    --site) SITE=$2; shift 2 ;;
    -k) PYTEST_K=$2; shift 2 ;;
    --before) BEFORE=$(cd "$2" && pwd) || exit 2; shift 2 ;;
    --timeout) TEST_TIMEOUT=$2; shift 2 ;;
    --keep-files) ARCHIVE=0; shift ;;
    tests|vmm|check|bench|full|mps|attach|peer) MODE=$1; shift ;;
    *) echo "gpu_suite.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
if [ "$MODE" = mps ] && ! command -v nvidia-cuda-mps-control >/dev/null 2>&1; then
  echo "gpu_suite.sh: mode mps needs nvidia-cuda-mps-control (the CUDA MPS control daemon, shipped with the driver), and it is not on PATH" >&2
  exit 1
fi
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
if ls "$WHEELS"/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$WHEELS"/*.whl || exit 1
  export PYTHONPATH=$SITE:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
# The directory reader's lookup in C (ipcpool/shm/_native.c), built in place as `pip install`
# builds it; where it does not build, the package reads the directory in Python.
if [ ipcpool/shm/_native.c -nt ipcpool/shm/_native.abi3.so ] && command -v cc >/dev/null 2>&1; then
  cc -O2 -shared -fPIC -I"$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["include"])')" \
    ipcpool/shm/_native.c -o ipcpool/shm/_native.abi3.so \
    || echo "gpu_suite.sh: ipcpool/shm/_native.c did not build: the directory is read in Python" >&2
fi

# mps: a private MPS control daemon whose pipe and log directories are ours alone; every CUDA
# process started below (doctor, brokers, test clients) finds it through the exported variables.
MPS_RC=skipped MPS_UP=0 MPS_PID=
stop_mps() {
  [ "$MPS_UP" = 1 ] || return 0
  MPS_UP=0
  echo quit | nvidia-cuda-mps-control
  local state="stopped"
  if [ -n "$MPS_PID" ]; then   # the daemon (and its server) exit once their clients are gone
    for _ in $(seq 300); do kill -0 "$MPS_PID" 2>/dev/null || break; sleep 0.1; done
    kill -0 "$MPS_PID" 2>/dev/null && state="asked to quit, still running after 30 s (pid $MPS_PID)"
  fi
  mkdir -p "$OUT/mps" && cp -r "$CUDA_MPS_LOG_DIRECTORY"/. "$OUT/mps/" 2>/dev/null
  echo "MPS control daemon $state (pipe $CUDA_MPS_PIPE_DIRECTORY)" | tee -a "$OUT/mps.txt"
  rm -rf "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
}
if [ "$MODE" = mps ]; then
  CUDA_MPS_PIPE_DIRECTORY=$(mktemp -d /tmp/ipcpool-mps-pipe.XXXXXX)
  CUDA_MPS_LOG_DIRECTORY=$(mktemp -d /tmp/ipcpool-mps-log.XXXXXX)
  export CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
  trap stop_mps EXIT
  trap 'exit 130' INT TERM
  : > "$OUT/mps.txt"
  if ! nvidia-cuda-mps-control -d; then
    echo "gpu_suite.sh: nvidia-cuda-mps-control -d failed" >&2
    exit 1
  fi
  MPS_UP=1
  for _ in $(seq 50); do [ -s "$CUDA_MPS_PIPE_DIRECTORY/nvidia-cuda-mps-control.pid" ] && break; sleep 0.2; done
  MPS_PID=$(cat "$CUDA_MPS_PIPE_DIRECTORY/nvidia-cuda-mps-control.pid" 2>/dev/null)
  serves=$(python3 -m ipcpool doctor --json | python3 -c "import json, sys; print(json.load(sys.stdin)['mps']['serves_device'])")
  echo "MPS control daemon started: pipe $CUDA_MPS_PIPE_DIRECTORY, logs $CUDA_MPS_LOG_DIRECTORY; ipcpool doctor: serves_device=$serves" | tee -a "$OUT/mps.txt"
  if [ "$serves" != True ]; then
    echo "gpu_suite.sh: MPS does not serve the device (ipcpool doctor --json); not running the tests" >&2
    cat "$CUDA_MPS_LOG_DIRECTORY"/control.log >&2 2>/dev/null
    exit 1
  fi
fi
{
  python3 --version
  python3 -c "import cuda.core, cuda.bindings, zmq; print('cuda.core', cuda.core.__version__, '| cuda.bindings', cuda.bindings.__version__, '| pyzmq', zmq.__version__)"
  python3 -c "import torch, cupy; print('torch', torch.__version__, '| cupy', cupy.__version__)" 2>&1 | tail -1
  nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv
  python3 -m ipcpool doctor
} 2>&1 | tee "$OUT/env.txt"
TIMEOUT_ARGS=()
python3 -c "import pytest_timeout" 2>/dev/null && TIMEOUT_ARGS=(--timeout "$TEST_TIMEOUT")

has() { case " $2 " in *" $MODE "*) return 0;; *) return 1;; esac; }   # has STEP "modes"
TESTS=tests/gpu MARKS=gpu
[ "$MODE" = vmm ] && TESTS=tests/gpu/test_cuda_vmm.py
[ "$MODE" = mps ] && MARKS="gpu and not kills_clients"
[ "$MODE" = peer ] && MARKS="gpu and two_gpus"
TESTS_RC=skipped
if [ "$MODE" = peer ] && [ "$(nvidia-smi -L | grep -c '^GPU')" -lt 2 ]; then
  echo "gpu_suite.sh: mode peer needs two GPUs; nvidia-smi lists $(nvidia-smi -L | grep -c '^GPU')" >&2
  exit 1
fi
if has tests "tests vmm check full mps peer"; then
  python3 -m pytest -m "$MARKS" "$TESTS" -v -s -p no:cacheprovider "${TIMEOUT_ARGS[@]}" ${PYTEST_K:+-k "$PYTEST_K"} 2>&1 | tee "$OUT/gpu-tests.log"
  TESTS_RC=${PIPESTATUS[0]}
fi
if [ "$MODE" = mps ]; then   # proof that the tests ran under MPS: the daemon's server and its clients
  servers=$(echo get_server_list | nvidia-cuda-mps-control 2>&1 | tr '\n' ' ' | sed 's/ *$//')
  clients=$(grep -c "NEW CLIENT" "$CUDA_MPS_LOG_DIRECTORY/control.log" 2>/dev/null)
  echo "MPS after the tests: server(s) ${servers:-none}; ${clients:-0} client connection(s) in its log" | tee -a "$OUT/mps.txt"
  MPS_RC=0
  [ "${clients:-0}" -gt 0 ] || MPS_RC=1
  stop_mps
fi

if has vmm "vmm check full"; then
  timeout 420 python3 bench/vmm_grow.py --out-dir "$OUT" --stocks 0,8G 2>&1 | tee "$OUT/vmm_grow.log"
  timeout 300 python3 bench/grow_floor.py --out-dir "$OUT" 2>&1 | tee "$OUT/grow_floor.log"
  timeout 150 python3 bench/profiles.py grow --out "$OUT/profile_grow" --top 25 > "$OUT/profile_grow.log" 2>&1
fi

if [ -n "$BEFORE" ]; then   # before and after in turn, five rounds: drift falls on both alike
  timeout 400 python3 bench/handoff_ab.py --tree before="$BEFORE" --rounds 5 --handoffs 500 --out-dir "$OUT" \
    2>&1 | tee "$OUT/handoff_ab.log"
fi

BENCH_RC=skipped
if [ "$MODE" = attach ]; then
  timeout 240 python3 bench/hot_attach.py --gib 8 --counts 64 1024 --repeat 5 --ipcpool-only --out-dir "$OUT" \
    2>&1 | tee "$OUT/hot_attach_8gib.log"
  BENCH_RC=${PIPESTATUS[0]}
  timeout 240 python3 bench/hot_attach.py --gib 64 --counts 4096 --repeat 5 --ipcpool-only --out-dir "$OUT" \
    2>&1 | tee "$OUT/hot_attach_64gib.log"
  [ "${PIPESTATUS[0]}" = 0 ] || BENCH_RC=1
  timeout 150 python3 bench/profiles.py attach --gib 64 --count 4096 --out "$OUT/profile" --top 30 \
    > "$OUT/profile_attach.log" 2>&1
  # The driver's own floor for the same 64 GiB: 1 GiB slabs as ipcpool uses, and 4 GiB ones.
  timeout 200 python3 bench/attach_floor.py --gib 64 --slab-gib 1 --threads 1,8 --out-dir "$OUT" \
    2>&1 | tee "$OUT/attach_floor.log"
  timeout 100 python3 bench/attach_floor.py --gib 64 --slab-gib 4 --threads 1 --out-dir "$OUT/slab4" \
    2>&1 | tee -a "$OUT/attach_floor.log"
fi
if [ "$MODE" = peer ]; then
  timeout 300 python3 bench/handoff.py --backend cuda --handoffs 1000 --devices 0,1 --out-dir "$OUT/handoff_peer" \
    2>&1 | tee "$OUT/handoff_peer.log"
  BENCH_RC=${PIPESTATUS[0]}
fi
if has bench "bench full"; then
  timeout 240 python3 bench/gpu_roundtrip.py --out-dir "$OUT" 2>&1 | tee "$OUT/bench.log"
  BENCH_RC=${PIPESTATUS[0]}
  timeout 240 python3 bench/handoff.py --backend cuda --handoffs 1000 2>&1 | tee "$OUT/handoff_cuda.log"
  timeout 150 python3 bench/handoff_timeline.py --handoffs 300 --out-dir "$OUT" 2>&1 | tee "$OUT/handoff_timeline.log"
  timeout 120 python3 bench/handoff_steps.py --backend cuda --handoffs 1000 2>&1 | tee "$OUT/handoff_steps.log"
  timeout 300 python3 bench/hot_attach.py --gib 8 2>&1 | tee "$OUT/hot_attach.log"
  timeout 120 python3 bench/handoff.py --backend host --handoffs 1000 2>&1 | tee "$OUT/handoff_host.log"
  timeout 180 python3 bench/host_roundtrip.py --iterations 5000 2>&1 | tee "$OUT/host_roundtrip.log"
  cp bench/results/handoff_*.json bench/results/handoff_*.png bench/results/host_roundtrip.* bench/results/hot_attach.* "$OUT/" 2>/dev/null
fi

echo
echo "================ summary ================"
grep -sE "^=+ .*(passed|failed|skipped|error)" "$OUT/gpu-tests.log" | tail -1
printf '%-22s %s\n' "gpu tests rc" "$TESTS_RC" "benchmark rc" "$BENCH_RC"
if [ "$MODE" = mps ]; then
  printf '%-22s %s\n' "mps rc" "$MPS_RC"
  sed 's/^/  /' "$OUT/mps.txt"
fi
sed -n '/^what /,$p' "$OUT/bench.log" 2>/dev/null
sed -n '/p50 median/,$p' "$OUT/handoff_ab.log" 2>/dev/null
for f in handoff_peer handoff_cuda handoff_host host_roundtrip; do
  [ -s "$OUT/$f.log" ] && echo "-- $f"
  sed -n '/p50 µs/,$p' "$OUT/$f.log" 2>/dev/null
done
for f in hot_attach hot_attach_8gib hot_attach_64gib; do
  sed -n '/^method/,$p' "$OUT/$f.log" 2>/dev/null
done
grep -s "attach" "$OUT/profile_attach.log" | head -3
grep -s "grow steps" "$OUT/profile_grow.log"
sed -n '/^segment/,/^broker handlers/p' "$OUT/handoff_timeline.log" 2>/dev/null
if [ "$ARCHIVE" = 1 ]; then   # one file to copy off the machine
  archive=$(mktemp /tmp/gpu-results.XXXXXX.tgz)
  tar -czf "$archive" -C "$OUT" . && find "$OUT" -mindepth 1 -delete && mv "$archive" "$OUT/results.tgz"
  echo "results: $OUT/results.tgz"
fi
if [ "$MODE" = mps ]; then   # the mode passes only when MPS served and every test it runs passed
  [ "$TESTS_RC" = 0 ] && [ "$MPS_RC" = 0 ] || exit 1
fi
