#!/usr/bin/env bash
# The main job: set-up, then the demo notebooks in a real Jupyter kernel with
# `%load_ext gpucleanup` and no cleanup code in any cell. Without a GPU, the
# tour runs against the test suite's fake CUDA driver (built here).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
echo "demo.sh: building the fake CUDA driver in build/"
cmake -S . -B build -G Ninja -DGPUCLEANUP_BUILD_TESTS=ON >/dev/null
cmake --build build -j"$(nproc)" --target fake_cuda >/dev/null
echo "demo.sh: running the demo"
exec .venv/bin/python scripts/demo.py "$@"
