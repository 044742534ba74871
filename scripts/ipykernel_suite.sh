#!/usr/bin/env bash
# ipykernel's own test suite, with gpucleanup loaded into every kernel it starts, on the fake CUDA driver.
#
# The best proof that a kernel behaves as before: the suite passes without gpucleanup, so a failure here is
# something gpucleanup changed in what a kernel says or does (the summary line inside a cell's stdout, say).
# Every kernel the suite starts reads a private IPYTHONDIR whose profile loads gpucleanup with
# show = "always" (a line after every cell: the most output it can add) and finds the fake driver with one
# device in use. A kernel is started first to prove the profile is read and the line arrives as
# gpucleanup's own display output.
#
# The suite is the sdist of the installed ipykernel (its tests/ are not in the wheel), downloaded once with
# pip into .venv/ipykernel-sdist/; its test dependencies (pytest-timeout, flaky, pytest-asyncio, pytest-cov, and
# hatchling for pip to read the sdist) into .venv/ipykernel-sdist/deps/, on PYTHONPATH for this run only. Tests
# that need ipyparallel, or a display for tk, are left out where those are missing. It runs scripts/setup.sh and
# builds the fake driver and libgpucleanup first where they are missing.
#
# Usage: scripts/ipykernel_suite.sh [--without-gpucleanup] [--show MODE] [pytest options: -k EXPR, -x, ...]
#   --without-gpucleanup   the same run with nothing loaded: the suite's own result on this machine, to compare
#   --show MODE            GPUCleanup.show in every kernel (default always). With "always" every cell gets a
#                          display output of gpucleanup's own, so a test that asserts a cell's exact list of
#                          display outputs (test_kernel.py::test_print_to_correct_cell_from_thread) sees one more;
#                          "auto" on the fake driver's idle device says nothing after the first cells
# Environment: GPUCLEANUP_BUILD_DIR (default build): where the fake driver and libgpucleanup were built.
set -euo pipefail
cd "$(dirname "$0")/.."
with_gpucleanup=1
show=always
while [ $# -gt 0 ]; do
  case "$1" in
    --without-gpucleanup) with_gpucleanup=0; shift ;;
    --show) show=${2:?--show takes auto, always or never}; shift 2 ;;
    *) break ;;
  esac
done
case "$show" in auto | always | never) ;; *) echo "ipykernel_suite: --show takes auto, always or never, not $show" >&2; exit 2 ;; esac
root=$PWD
say() { printf 'ipykernel_suite: %s\n' "$*"; }
started=$SECONDS
py=$root/.venv/bin/python
build=$root/${GPUCLEANUP_BUILD_DIR:-build}
fake=$build/tests/fake_cuda/libcuda.so.1
library=$build/native/libgpucleanup.so
# What it needs, made here when missing (as scripts/test.sh makes it): the set-up, then the fake driver and the
# library in the build directory.
[ -x "$py" ] || bash scripts/setup.sh
if [ ! -e "$fake" ] || [ ! -e "$library" ]; then
  say "building the fake CUDA driver and libgpucleanup in $build/"
  cmake -S . -B "$build" -G Ninja -DGPUCLEANUP_BUILD_TESTS=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
  cmake --build "$build" -j"$(nproc)" --target fake_cuda gpucleanup >/dev/null
fi
for needed in "$py" "$fake" "$library"; do
  [ -e "$needed" ] || { say "missing $needed after the set-up and build"; exit 1; }
done

version=$("$py" -c 'import ipykernel; print(ipykernel.__version__)')
sdists=$root/.venv/ipykernel-sdist
sdist=$sdists/ipykernel-$version.tar.gz
# The suite's own test dependencies go into a folder of their own, on PYTHONPATH for this run only: the
# project's .venv (and its pytest) stays as scripts/setup.sh made it. hatchling: pip reads the sdist's
# metadata with it (no isolated build environment, which may be slow or offline).
deps=$sdists/deps
if [ ! -f "$deps/.complete" ]; then
  say "installing ipykernel's test dependencies into $deps"
  rm -rf "$deps"
  "$py" -m pip install -q --no-deps --target "$deps" pytest-timeout flaky "pytest-asyncio>=0.23.5" pytest-cov coverage \
    hatchling pathspec trove-classifiers
  touch "$deps/.complete"
fi
export PYTHONPATH=$deps${PYTHONPATH:+:$PYTHONPATH}
if [ ! -f "$sdist" ]; then
  say "downloading ipykernel $version's sdist (its test suite) with pip"
  "$py" -m pip download -q --no-deps --no-binary :all: --no-build-isolation -d "$sdists" "ipykernel==$version"
fi

work=$(mktemp -d "${TMPDIR:-/tmp}/gpucleanup-ipykernel.XXXXXX")
trap 'rm -rf "$work"' EXIT
tar -xzf "$sdist" -C "$work"
# only the tests and their pytest settings: `import ipykernel` must find the installed package, not the sdist's
mkdir "$work/suite"
mv "$work/ipykernel-$version/tests" "$work/ipykernel-$version/pyproject.toml" "$work/suite/"

mkdir -p "$work/ipython/profile_default"
if [ "$with_gpucleanup" = 1 ]; then
  cat >"$work/ipython/profile_default/ipython_kernel_config.py" <<CONFIG
c.InteractiveShellApp.extensions = ["gpucleanup"]
c.GPUCleanup.show = "$show"
CONFIG
fi
export IPYTHONDIR=$work/ipython
export JUPYTER_RUNTIME_DIR=$work/runtime
export PYTHONPATH=$root/ipython_ext:$PYTHONPATH
export GPUCLEANUP_LIBRARY=$library
export GPUCLEANUP_LIBCUDA=$fake
# one device in use, nothing to free: with show = "auto" a cell says nothing, with "always" every cell has a line
export GPUCLEANUP_FAKE_CUDA_SCENARIO='{"devices": [{"name": "Fake H100", "primary_active": true}]}'

if [ "$with_gpucleanup" = 1 ]; then
say "checking that a kernel started with this profile loads gpucleanup"
SUITE_SHOW=$show "$py" - <<'PY'
import json, os

from jupyter_client.manager import start_new_kernel

# 1 GiB in the driver's pool: the first cell frees it, so it has a line whatever the show policy (but never)
pool = {"devices": [{"name": "Fake H100", "primary_active": True,
                     "default_pool": {"reserved_bytes": 1 << 30, "used_bytes": 0}}]}
env = dict(os.environ, GPUCLEANUP_FAKE_CUDA_SCENARIO=json.dumps(pool))
km, kc = start_new_kernel(kernel_name="python3", env=env)
try:
    msg_id = kc.execute("print('hi')")
    stdout, ours = "", []
    while True:
        msg = kc.get_iopub_msg(timeout=60)
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        if msg["msg_type"] == "stream":
            stdout += msg["content"]["text"]
        elif msg["msg_type"] == "display_data" and "gpucleanup" in msg["content"]["metadata"]:
            ours.append(msg["content"]["data"]["text/plain"])
        elif msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            break
    assert stdout == "hi\n", f"the cell's stdout holds more than the cell printed: {stdout!r}"
    if os.environ["SUITE_SHOW"] != "never":
        assert ours and ours[0].startswith("gpucleanup · GPU0"), f"no gpucleanup line after the cell: {ours!r}"
        print(f"ipykernel_suite: a kernel said: {ours[0]}")
finally:
    kc.stop_channels()
    km.shutdown_kernel(now=True)
PY
fi

# tests that need what this machine may lack (not gpucleanup's business): left out when it is missing
skip=()
"$py" -c 'import ipyparallel' 2>/dev/null || skip+=(--deselect tests/test_ipkernel_direct.py::test_do_apply)
[ -n "${DISPLAY:-}" ] || skip+=(--deselect "tests/test_matplotlib_eventloops.py::test_matplotlib_gui[tk]")
if [ "$with_gpucleanup" = 1 ]; then
  say "running ipykernel $version's test suite with gpucleanup in every kernel"
else
  say "running ipykernel $version's test suite with nothing loaded (--without-gpucleanup)"
fi
cd "$work/suite"
rc=0
# pytest-asyncio 0.24+ warns (an error under the suite's filterwarnings) when this option is unset
"$py" -m pytest tests -q -p no:cacheprovider -o asyncio_default_fixture_loop_scope=function ${skip[@]+"${skip[@]}"} "$@" || rc=$?
say "done in $((SECONDS - started)) s (rc $rc)"
exit "$rc"
