#!/usr/bin/env bash
# Installs everything gpucleanup needs on a fresh Debian/Ubuntu machine:
#   Debian packages (as root, or through sudo), a virtual environment in .venv,
#   and gpucleanup itself with its test and demo extras.
# Safe to run again: it installs only what is missing and rebuilds the package.
set -euo pipefail
cd "$(dirname "$0")/.."

deb_packages=(g++ pkg-config nlohmann-json3-dev libgtest-dev libgmock-dev libzmq3-dev cppzmq-dev libssl-dev patchelf)
command -v cmake >/dev/null || deb_packages+=(cmake)
command -v ninja >/dev/null || deb_packages+=(ninja-build)
command -v python3 >/dev/null || deb_packages+=(python3 python3-venv)

missing=()
for p in "${deb_packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ]; then sudo=(); elif command -v sudo >/dev/null; then sudo=(sudo); else
    echo "setup: need root to install Debian packages: ${missing[*]}" >&2; exit 1; fi
  echo "setup: installing ${missing[*]}"
  "${sudo[@]}" apt-get update -qq
  DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

cuda_home=${CUDA_HOME:-/usr/local/cuda}
if [ ! -f "$cuda_home/include/cudaTypedefs.h" ]; then
  echo "setup: the CUDA Toolkit headers (cuda.h, cudaTypedefs.h) were not found under $cuda_home:" >&2
  echo "       install the CUDA Toolkit or set CUDA_HOME to its root" >&2
  exit 1
fi

[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade "pip>=23" >/dev/null
echo "setup: building and installing gpucleanup into .venv"
.venv/bin/python -m pip install -q ".[test]"

# PyTorch's CPU build proves the torch adapter never initialises CUDA. It is
# large; take it only where a local wheel makes it cheap (this is what CI has).
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  if compgen -G "/opt/wheels/torch-2.13.0+cpu-*.whl" >/dev/null; then
    .venv/bin/python -m pip install -q "torch==2.13.0" || echo "setup: torch CPU build not installed; its tests will be skipped"
  else
    echo "setup: no local PyTorch CPU wheel; the PyTorch tests will be skipped"
  fi
fi
