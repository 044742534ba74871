#!/usr/bin/env bash
# ipykernel's own test suite, with gpucleanup loaded into every kernel it starts, on the fake CUDA driver: the
# stage "ipykernel suite" of scripts/test.sh.
#
# The best proof that a kernel behaves as before: the suite passes without gpucleanup, so a failure here is
# something gpucleanup changed in what a kernel says or does. Every kernel the suite starts reads a private
# IPYTHONDIR whose profile loads the installed gpucleanup (what scripts/setup.sh built from the sources) and
# finds the fake driver with one device in use. A kernel is started first to prove the profile is read and the
# line arrives as gpucleanup's own display output, not inside the cell's stdout.
#
# Without --show (the standing check), two runs:
#   1. the whole suite with show = "always": every cell of every kernel gets a display output of gpucleanup's
#      own, the most it can add; the tests that assert a cell's exact list of display outputs are left out
#      of this run (the by-design list below), since that list holds one more output per cell by design;
#   2. those tests with the default show ("auto"), where they must pass as they are.
# With --show MODE: the whole suite once with that show, nothing left out by design.
#
# The suite is the sdist of a pinned ipykernel (its tests/ are not in the wheel), fetched once from PyPI with
# pip and checked against its SHA-256; that ipykernel (without its dependencies, which are the project's .venv's,
# checked against its requirements) and the suite's test plugins, pinned too, go into .venv/ipykernel-suite/deps,
# on PYTHONPATH for this script only: the project's .venv stays as scripts/setup.sh made it. Every test left out
# is printed with its reason before the run.
#
# Usage: scripts/ipykernel_suite.sh [--without-gpucleanup] [--show MODE] [pytest options: -k EXPR, -x, ...]
#        scripts/ipykernel_suite.sh --list-left-out
#   --without-gpucleanup   the same suite with nothing loaded: the suite's own result on this machine, to compare
#   --show MODE            one run with GPUCleanup.show = MODE (auto, always or never) in every kernel
#   --list-left-out        print the tests this script can leave out (condition, test, reason: one a line,
#                          tab-separated) and exit
# Environment: GPUCLEANUP_BUILD_DIR (default build): where the fake driver is (built there when missing).
set -euo pipefail
cd "$(dirname "$0")/.."

# The ipykernel whose suite is run, and the SHA-256 of its sdist on PyPI.
ipykernel_version=7.4.0
ipykernel_sdist_sha256=4330114d22b9b33575b2c7c68753fc8faabbbcfbc60b0cdff9f14dd4ce63742f
# The suite's test plugins (its pyproject's "test" group, less ipyparallel and pre-commit), and hatchling with
# what it imports, for pip to read the sdist's metadata without an isolated build environment.
suite_deps=(pytest-timeout==2.4.0 flaky==3.8.1 pytest-asyncio==1.5.0 pytest-cov==7.1.0 coverage==7.17.5
  hatchling==1.33.0 pathspec==1.1.1 trove-classifiers==2026.9.21.13)

with_gpucleanup=1
show=
list_only=0
while [ $# -gt 0 ]; do
  case "$1" in
    --without-gpucleanup) with_gpucleanup=0; shift ;;
    --show) show=${2:?--show takes auto, always or never}; shift 2 ;;
    --list-left-out) list_only=1; shift ;;
    *) break ;;
  esac
done
case "$show" in '' | auto | always | never) ;; *) echo "ipykernel_suite: --show takes auto, always or never, not $show" >&2; exit 2 ;; esac
root=$PWD
say() { printf 'ipykernel_suite: %s\n' "$*"; }
started=$SECONDS
py=$root/.venv/bin/python
build=$root/${GPUCLEANUP_BUILD_DIR:-build}
fake=$build/tests/fake_cuda/libcuda.so.1

# Tests left out, each with its reason; printed before the run. `deselect WHEN NODEID REASON`, WHEN one of:
#   always      in every run of this script
#   by-design   in the show = "always" run of the standing check (they run with the default show after it)
#   no-MODULE   where MODULE cannot be imported; no-display where DISPLAY is unset
deselections=()
deselect() { deselections+=("$1"$'\t'"$2"$'\t'"$3"); }
deselect always tests/test_embed_kernel.py::test_embed_kernel_func \
  "it starts a kernel inside pytest's own process and stops it from a thread after a fixed 1 s; when the kernel's set-up takes longer (a loaded machine, with or without gpucleanup) the thread fails, the test hangs until the 30 s timeout and leaves an IPKernelApp singleton behind, which then fails test_kernelspec.py::test_install_kernelspec and test_zmq_shell.py::test_zmq_interactive_shell"
deselect by-design tests/test_kernel.py::test_print_to_correct_cell_from_thread \
  "it asserts each cell's exact list of display outputs, and with show = always every cell has one more, gpucleanup's own"
deselect no-ipyparallel tests/test_ipkernel_direct.py::test_do_apply "it needs ipyparallel, which is not installed"
deselect no-display "tests/test_matplotlib_eventloops.py::test_matplotlib_gui[tk]" "it needs a display for tk (DISPLAY is unset)"

# deselect_for RUN: the --deselect options (in deselect_args) for RUN: standing (the show = "always" run of the
# standing check), single (one run: --show or --without-gpucleanup) or by-design (the by-design tests, selected
# by name: nothing left out); each test left out is printed with its reason.
deselect_args=()
deselect_for() {
  local run=$1 entry when id reason
  deselect_args=()
  [ "$run" != by-design ] || return 0
  for entry in "${deselections[@]}"; do
    IFS=$'\t' read -r when id reason <<<"$entry"
    case "$when" in
      always) ;;
      by-design) [ "$run" = standing ] || continue ;;
      no-display) [ -z "${DISPLAY:-}" ] || continue ;;
      no-*) ! "$py" -c "import ${when#no-}" 2>/dev/null || continue ;;
      *) say "unknown condition $when for $id"; exit 2 ;;
    esac
    say "left out: $id: $reason"
    deselect_args+=(--deselect "$id")
  done
}

if [ "$list_only" = 1 ]; then
  printf '%s\n' "${deselections[@]}"
  exit 0
fi

# What it needs, made here when missing (as scripts/test.sh makes it): the set-up (quick when nothing changed;
# it rebuilds the installed gpucleanup when its sources changed), then the fake driver.
bash scripts/setup.sh
if [ ! -e "$fake" ]; then
  say "building the fake CUDA driver in $build/"
  cmake -S . -B "$build" -G Ninja -DGPUCLEANUP_BUILD_TESTS=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
  cmake --build "$build" -j"$(nproc)" --target fake_cuda >/dev/null
fi
[ -e "$fake" ] || { say "missing $fake after the build"; exit 1; }

suite_dir=$root/.venv/ipykernel-suite
deps=$suite_dir/deps
sdist=$suite_dir/ipykernel-$ipykernel_version.tar.gz
want="ipykernel==$ipykernel_version ${suite_deps[*]}"
if [ "$(cat "$deps/.complete" 2>/dev/null)" != "$want" ]; then
  say "installing ipykernel $ipykernel_version and the suite's test plugins into $deps"
  rm -rf "$deps"
  "$py" -m pip install -q --no-deps --target "$deps" "ipykernel==$ipykernel_version" "${suite_deps[@]}"
  echo "$want" >"$deps/.complete"
fi
export PYTHONPATH=$deps${PYTHONPATH:+:$PYTHONPATH}
# ipykernel's own requirements, met by what the project's .venv has (the deps folder holds ipykernel alone)
"$py" - "$ipykernel_version" <<'PY'
import importlib.metadata as md, sys

import ipykernel
from packaging.requirements import Requirement

want = sys.argv[1]
if ipykernel.__version__ != want:
    sys.exit(f"ipykernel_suite: imported ipykernel {ipykernel.__version__} from {ipykernel.__file__}, not {want}")
unmet = []
for line in md.requires("ipykernel") or []:
    req = Requirement(line)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    try:
        have = md.version(req.name)
    except md.PackageNotFoundError:
        have = None
    if have is None or not req.specifier.contains(have, prereleases=True):
        unmet.append(f"{req} (installed: {have or 'none'})")
if unmet:
    sys.exit(f"ipykernel_suite: ipykernel {want} needs " + "; ".join(unmet) + " in .venv: pip install them there")
PY
if [ ! -f "$sdist" ] || [ "$(sha256sum "$sdist" | cut -d' ' -f1)" != "$ipykernel_sdist_sha256" ]; then
  say "downloading ipykernel $ipykernel_version's sdist (its test suite) with pip"
  rm -f "$sdist"
  "$py" -m pip download -q --no-deps --no-binary :all: --no-build-isolation -d "$suite_dir" \
    "ipykernel==$ipykernel_version"
  got=$(sha256sum "$sdist" | cut -d' ' -f1)
  if [ "$got" != "$ipykernel_sdist_sha256" ]; then
    rm -f "$sdist"
    say "ipykernel-$ipykernel_version.tar.gz has SHA-256 $got, not $ipykernel_sdist_sha256: not running it"
    exit 1
  fi
fi

work=$(mktemp -d "${TMPDIR:-/tmp}/gpucleanup-ipykernel.XXXXXX")
trap 'rm -rf "$work"' EXIT
tar -xzf "$sdist" -C "$work"
# only the tests and their pytest settings: `import ipykernel` must find the pinned package, not the sdist's
mkdir "$work/suite"
mv "$work/ipykernel-$ipykernel_version/tests" "$work/ipykernel-$ipykernel_version/pyproject.toml" "$work/suite/"

mkdir -p "$work/ipython/profile_default"
profile=$work/ipython/profile_default/ipython_kernel_config.py
use_show() {
  printf 'c.InteractiveShellApp.extensions = ["gpucleanup"]\nc.GPUCleanup.show = "%s"\n' "$1" >"$profile"
}
export IPYTHONDIR=$work/ipython
export JUPYTER_RUNTIME_DIR=$work/runtime
export GPUCLEANUP_LIBCUDA=$fake
# one device in use, nothing to free: with show = "auto" a cell says nothing, with "always" every cell has a line
export GPUCLEANUP_FAKE_CUDA_SCENARIO='{"devices": [{"name": "Fake H100", "primary_active": true}]}'

# check_kernel: a kernel started with this profile loads gpucleanup, and its line is its own display output
check_kernel() {
  say "checking that a kernel started with this profile loads gpucleanup (show = $1)"
  SUITE_SHOW=$1 "$py" - <<'PY'
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
}

# run_suite RUN PATHS... [pytest arguments]: the suite's PATHS with the profile as it is; a selection given on
# the command line (-k ...) that leaves a run without a test (pytest's exit 5) is no failure.
given=$#
rc=0
run_suite() {
  local run=$1 r=0
  shift
  deselect_for "$run"
  # Each test gets a second run if its first fails (flaky's --force-flaky; tests with a flaky marker of their own
  # keep it): ipykernel's embed and start_kernel tests race their own kernel_info replies on a loaded machine, with
  # or without gpucleanup (see the left-out list). A failure that comes back every time still fails the stage, and
  # flaky's report names every test that needed its second run; its line for each test that passed at once
  # (--no-success-flaky-report) is left out, so pytest's summary ends the log. No colour codes in the log.
  (cd "$work/suite" && "$py" -m pytest -q -p no:cacheprovider --color=no \
    -o asyncio_default_fixture_loop_scope=function \
    --force-flaky --max-runs=2 --min-passes=1 --no-success-flaky-report \
    ${deselect_args[@]+"${deselect_args[@]}"} "$@") || r=$?
  if [ "$r" = 5 ] && [ "$given" -gt 0 ]; then
    say "no test selected in this run by the arguments given"
    r=0
  fi
  [ "$r" = 0 ] || rc=$r
}
if [ "$with_gpucleanup" = 0 ]; then
  rm -f "$profile"
  say "running ipykernel $ipykernel_version's test suite with nothing loaded (--without-gpucleanup)"
  run_suite single tests "$@"
elif [ -n "$show" ]; then
  use_show "$show"
  check_kernel "$show"
  say "running ipykernel $ipykernel_version's test suite with gpucleanup (show = $show) in every kernel"
  run_suite single tests "$@"
else
  use_show always
  check_kernel always
  say "running ipykernel $ipykernel_version's test suite with gpucleanup (show = always) in every kernel"
  run_suite standing tests "$@"
  by_design=()
  for entry in "${deselections[@]}"; do
    IFS=$'\t' read -r when id _ <<<"$entry"
    [ "$when" = by-design ] && by_design+=("$id")
  done
  use_show auto
  say "running the tests left out by design with the default show (auto): ${by_design[*]}"
  run_suite by-design "${by_design[@]}" "$@"
fi
say "done in $((SECONDS - started)) s (rc $rc)"
exit "$rc"
