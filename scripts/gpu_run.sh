#!/usr/bin/env bash
# One run on a GPU test machine (offline, hence the carried wheels): install the wheels
# carried in .whl/ (gpucleanup's manylinux wheel plus IPython, ipykernel,
# jupyter_client and their dependencies, made by scripts/build_wheels.sh),
# then the real-GPU tests, the benchmarks and the demo, in one go.
# Results land in $OUT (or ./gpu-out): machine.log, gpu-tests.log, facts.log, bench.json, bench.log, demo.log.
# Usage: scripts/gpu_run.sh [STAGE ...]   stages: tests facts bench demo (default: all of them)
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-$PWD/gpu-out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1

python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || { echo "gpu_run: installing the carried wheels failed"; exit 1; }
export PYTHONPATH=/tmp/site
export PATH=/tmp/site/bin:$PATH

{
  echo "== machine"; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import sys, gpucleanup, IPython, ipykernel; print(sys.version.split()[0], 'gpucleanup', gpucleanup.__version__, 'IPython', IPython.__version__, 'ipykernel', ipykernel.__version__)"
  echo "== snapshot in a fresh process (nothing uses CUDA yet)"
  python3 -c "import gpucleanup, json; print(json.dumps(gpucleanup.snapshot()['driver']))"
} 2>&1 | tee "$out/machine.log"

stages=" ${*:-tests facts bench demo} "
if [[ $stages == *" tests "* ]]; then
  python3 -m pytest tests/gpu -v -s -p no:cacheprovider 2>&1 | tee "$out/gpu-tests.log"
fi
if [[ $stages == *" facts "* ]]; then
  python3 scripts/gpu_facts.py 2>&1 | tee "$out/facts.log"
fi
if [[ $stages == *" bench "* ]]; then
  python3 tests/bench/bench_after_cell.py --json "$out/bench.json" 2>&1 | tee "$out/bench.log"
fi
if [[ $stages == *" demo "* ]]; then
  python3 scripts/demo.py 2>&1 | tee "$out/demo.log"
fi
