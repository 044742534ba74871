#!/usr/bin/env bash
# The main job: set-up, then the demo notebooks in a real Jupyter kernel with
# `%load_ext gpucleanup` and no cleanup code in any cell. Without a GPU, the
# tour runs against the test suite's fake CUDA driver (built here).
# Every stage prints a line as it starts and its duration as it ends; GPUCLEANUP_RECORD_TIMINGS=1 stores them in
# tests/timings.json and the README's table (scripts/timings.py).
set -euo pipefail
cd "$(dirname "$0")/.."
started=$SECONDS
say() { echo "demo.sh: $*"; }
source scripts/lib/stages.sh
timings_start demo build

stage_begin "set-up"
bash scripts/setup.sh
stage_end "set-up"
stage_begin "fake CUDA driver build"
cmake -S . -B build -G Ninja -DGPUCLEANUP_BUILD_TESTS=ON >/dev/null
cmake --build build -j"$(nproc)" --target fake_cuda >/dev/null
stage_end "fake CUDA driver build"
stage_begin "demo"
.venv/bin/python scripts/demo.py "$@"
stage_end "demo"
[ $# != 0 ] || timings_record demo "$started"  # only the default tour is the measured run
