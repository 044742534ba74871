#!/usr/bin/env bash
# The main job: set-up, then the demo notebooks in a real Jupyter kernel with
# `%load_ext gpucleanup` and no cleanup code in any cell. Without a GPU, the
# tour runs against the test suite's fake CUDA driver (built here).
# After the tour, the same scripted device by hand (scripts/demo.py says more):
#   --shell            an IPython shell with gpucleanup loaded
#   --server (--lab)   Jupyter Server with gpucleanup's page and one kernel, until Ctrl-C
# Every stage prints a line as it starts and its duration as it ends; GPUCLEANUP_RECORD_TIMINGS=1 stores them in
# tests/timings.json and the README's table (scripts/timings.py).
set -euo pipefail
cd "$(dirname "$0")/.."
started=$SECONDS
say() { echo "demo.sh: $*"; }
usage="usage: bash scripts/demo.sh [--shell | --server | --lab | NOTEBOOK.ipynb ...]"

# Arguments are checked before the set-up, which takes minutes on a fresh clone.
mode=tour
for arg in "$@"; do
  case "$arg" in
    --shell | --server | --lab)
      [ $# = 1 ] || { echo "demo.sh: $arg goes alone ($usage)" >&2; exit 2; }
      mode=interactive ;;
    -h | --help) echo "$usage"; exit 0 ;;
    *.ipynb) [ -f "$arg" ] || { echo "demo.sh: no such notebook: $arg" >&2; exit 2; } ;;
    *) echo "demo.sh: unknown argument '$arg' ($usage)" >&2; exit 2 ;;
  esac
done

source scripts/lib/stages.sh
timings_start demo build

stage_begin "set-up"
bash scripts/setup.sh
stage_end "set-up"
stage_begin "fake CUDA driver build"
cmake -S . -B build -G Ninja -DGPUCLEANUP_BUILD_TESTS=ON >/dev/null
cmake --build build -j"$(nproc)" --target fake_cuda >/dev/null
stage_end "fake CUDA driver build"
if [ "$mode" = interactive ]; then
  # no stage line: how long someone explores is not the demo's duration
  exec .venv/bin/python scripts/demo.py "$@"
fi
stage_begin "demo"
.venv/bin/python scripts/demo.py "$@"
stage_end "demo"
[ $# != 0 ] || timings_record demo "$started"  # only the default tour is the measured run
