#!/usr/bin/env bash
# The full soak and churn run (tests/soak/soak.py) against the fake CUDA driver:
#   2,000 cells in one real kernel while the fake driver's state changes under them (a second device in use
#     and not, pools filling, live bytes, a synchronize stalling past settle_timeout, a failing entry point,
#     a sticky error near the end), %gpumem --json and a status request from outside every 10 cells;
#   200 cycles of %load_ext / %reload_ext / %unload_ext gpucleanup in one kernel;
#   50 kernels started and stopped (two at a time, every other one killed) while gpucleanup ps --json runs
#     in a loop;
#   and, to read the cells' memory figures against, the same 2,000 cells in a kernel without gpucleanup.
# It fails (exit 1) when a kernel's resident memory grows by more than 5 MiB after the warm-up, when threads,
# descriptors or sockets do not end where the warm-up left them, when something stays in the runtime
# directory, or when a reply is missing. About 3 minutes on 2 cores; BENCHMARKS.md ("Soak and churn") has
# the figures of one run. The short version runs in the test suite (tests/python/test_soak.py).
# It runs on copies of the package and of the built libraries, taken at its start.
# Usage: scripts/soak.sh [soak.py options...]   (e.g. --cells 500; later options win)
# Environment: GPUCLEANUP_BUILD_DIR (default build), GPUCLEANUP_SOAK_JSON (where the figures go, default
#   <build>/soak/soak-<UTC time>.json).
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/setup.sh

build=${GPUCLEANUP_BUILD_DIR:-build}
if [ ! -e "$build/tests/fake_cuda/libcuda.so.1" ] || [ ! -e "$build/native/libgpucleanup.so" ]; then
  echo "soak.sh: building the library and the fake CUDA driver in $build/"
  cmake -S . -B "$build" -G Ninja -DGPUCLEANUP_BUILD_TESTS=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
  cmake --build "$build" -j"$(nproc)"
fi

json=${GPUCLEANUP_SOAK_JSON:-$build/soak/soak-$(date -u +%Y%m%dT%H%M%SZ).json}
status=0
GPUCLEANUP_BUILD_DIR=$build .venv/bin/python tests/soak/soak.py --cells 2000 --reloads 200 --kernels 50 \
  --baseline --json "$json" "$@" || status=$?
if [ -e "$json" ]; then
  echo "soak.sh: figures in $json"
fi
exit "$status"
