#!/usr/bin/env bash
# Builds tests/bench/driver_costs (the per-call driver costs on a real GPU) against the CUDA
# toolkit's headers; where it runs it opens the real libcuda.so.1 with dlopen.
# Usage: tests/bench/build_driver_costs.sh [OUT]   (default: build/driver_costs)
set -euo pipefail
cd "$(dirname "$0")/../.."
cuda=${CUDA_HOME:-/usr/local/cuda}
out=${1:-build/driver_costs}
mkdir -p "$(dirname "$out")"
"${CXX:-g++}" -O2 -std=c++20 -I"$cuda/include" tests/bench/driver_costs.cpp -o "$out" -ldl -lpthread
echo "built $out"
