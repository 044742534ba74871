#!/usr/bin/env bash
# The test command: set-up, then the C++ suites (ctest, against the fake CUDA
# driver) and the Python suites (pytest: native binding, extension in an
# InteractiveShell, real kernels through jupyter_client, status server, CLI).
# tests/gpu runs only where a GPU is present; it skips elsewhere.
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/setup.sh

build=${GPUCLEANUP_BUILD_DIR:-build}
cmake -S . -B "$build" -G Ninja -DGPUCLEANUP_BUILD_TESTS=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build "$build" -j"$(nproc)"
ctest --test-dir "$build" --output-on-failure -j"$(nproc)"

# The installed package (with its own libgpucleanup.so) is what is tested; the
# build tree provides only the fake driver.
# Two runs: each suite has a conftest of its own that its modules import.
GPUCLEANUP_BUILD_DIR="$build" .venv/bin/python -m pytest tests/python -q -p no:cacheprovider "$@"
.venv/bin/python -m pytest tests/gpu -q -p no:cacheprovider -rs "$@"
