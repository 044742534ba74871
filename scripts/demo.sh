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
if [ -e build/timings-demo.tsv ]; then run_kind=again; else run_kind=fresh; fi
if [ -e .venv ]; then timing_note=(--note "set-up already done"); else timing_note=(); fi
mkdir -p build
export GPUCLEANUP_TIMINGS="$PWD/build/timings-demo.tsv"
: >"$GPUCLEANUP_TIMINGS"

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
if [ "${GPUCLEANUP_RECORD_TIMINGS:-0}" = 1 ] && [ $# = 0 ]; then
  python3 scripts/timings.py record --command demo --run "$run_kind" --stages "$GPUCLEANUP_TIMINGS" \
    --total "$((SECONDS - started))" ${timing_note[@]+"${timing_note[@]}"}
fi
