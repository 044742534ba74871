#!/usr/bin/env bash
# Two builds of the Python package side by side over the same library and fake driver (this tree's build/):
# bench_run_cell.py and profile_idle_hooks.py, alternated, each run in a process of its own.
# Usage: tests/bench/ab_packages.sh OLD_TREE NEW_TREE [ROUNDS]   (trees: checkouts with ipython_ext/)
# Needs the venv and build of scripts/setup.sh and the CMake build with -DGPUCLEANUP_BUILD_TESTS=ON.
set -euo pipefail
old=$1 new=$2 rounds=${3:-3}
here=$(cd "$(dirname "$0")/../.." && pwd)
py=$here/.venv/bin/python
for tree in "$old" "$new"; do
  [ -d "$tree/ipython_ext/gpucleanup" ] || { echo "ab_packages: no package in $tree/ipython_ext" >&2; exit 2; }
done
echo "ab_packages: $(date -u +%FT%TZ), $(nproc) CPUs, old $(git -C "$old" rev-parse --short HEAD), new $(git -C "$new" rev-parse --short HEAD)"
for i in $(seq "$rounds"); do
  for tree in "$old" "$new"; do
    echo "== $(git -C "$tree" rev-parse --short HEAD) run $i, load $(cut -d' ' -f1 /proc/loadavg)"
    PYTHONPATH=$tree/ipython_ext "$py" "$here/tests/bench/bench_run_cell.py" never device --rounds 12 --block 300
    for scenario in never device; do
      PYTHONPATH=$tree/ipython_ext "$py" "$here/tests/bench/profile_idle_hooks.py" "$scenario" 3000 | sed -n 1p
    done
  done
done
