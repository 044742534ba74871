#!/usr/bin/env bash
# IPython's own test suite, with gpucleanup loaded into every InteractiveShell it makes, on the fake CUDA
# driver: the stage "IPython suite" of scripts/test.sh, beside ipykernel's (scripts/ipykernel_suite.sh).
#
# The suite passes without gpucleanup, so a failure here is something gpucleanup changed in what a shell says
# or does. The suite makes its shells itself (tests/conftest.py builds one TerminalInteractiveShell from its own
# config, no profile is read), so a pytest plugin of this script's loads gpucleanup into each: the last step of
# every InteractiveShell's construction (subclasses too) is `%load_ext gpucleanup` through the shell's own
# extension manager, with GPUCleanup.show set in the shell's config. gpucleanup is the sources' (ipython_ext on
# PYTHONPATH) with the build's library (GPUCLEANUP_LIBRARY), and finds the fake driver with one device in use.
# The plugin counts the shells it loaded gpucleanup into and the cleanups they ran; a run where either is 0
# fails: the count is the proof that the suite ran with gpucleanup.
# Shells the suite starts as separate processes (`ipython --quick file.py`, pexpect) read no configuration by
# design and run without it.
#
# Without --show (the standing check), two runs:
#   1. the whole suite with show = "always": every cell gets gpucleanup's line, the most it can add; the tests
#      that compare a cell's whole output are left out of this run (the by-design list below), since that
#      output holds one more line per cell by design;
#   2. those tests with the default show ("auto"), where they must pass as they are.
# With --show MODE: the whole suite once with that show.
#
# The suite is the sdist of the installed IPython (its tests are not in the wheel), fetched once from PyPI with
# pip into .venv/ipython-suite; its IPython/ must be the installed one file for file (its doctests are part of
# the suite). The suite's test plugins, pinned, go into .venv/ipython-suite/deps, on PYTHONPATH for this script
# only. Every test left out is printed with its reason before the run.
#
# Usage: scripts/ipython_suite.sh [--without-gpucleanup] [--show MODE] [pytest options: -k EXPR, -x, ...]
#        scripts/ipython_suite.sh --list-left-out
#   --without-gpucleanup   the same suite with nothing loaded: the suite's own result on this machine, to compare
#   --show MODE            one run with GPUCleanup.show = MODE (auto, always or never) in every shell
#   --list-left-out        print the tests this script can leave out (condition, test, reason: one a line,
#                          tab-separated) and exit
# Environment: GPUCLEANUP_BUILD_DIR (default build): where the fake driver and libgpucleanup.so are (built
#   there when missing).
set -euo pipefail
cd "$(dirname "$0")/.."

# The suite's test plugins (IPython's "test" extra less what .venv has: pytest, packaging, setuptools).
suite_deps=(pytest-asyncio==1.5.0 testpath==0.6.0)

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
case "$show" in '' | auto | always | never) ;; *) echo "ipython_suite: --show takes auto, always or never, not $show" >&2; exit 2 ;; esac
root=$PWD
say() { printf 'ipython_suite: %s\n' "$*"; }
started=$SECONDS
py=$root/.venv/bin/python
build=$root/${GPUCLEANUP_BUILD_DIR:-build}
fake=$build/tests/fake_cuda/libcuda.so.1
library=$build/native/libgpucleanup.so

# Tests left out, each with its reason; printed before the run. `deselect WHEN NODEID REASON`, WHEN one of:
#   loaded      in every run with gpucleanup loaded
#   by-design   in the show = "always" run of the standing check (they run with the default show after it)
#   suite-order as by-design, for a test that fails in that run's order without gpucleanup too
deselections=()
deselect() { deselections+=("$1"$'\t'"$2"$'\t'"$3"); }
deselect loaded IPython/core/magics/config.py::IPython.core.magics.config.ConfigMagics.config \
  "its doctest lists every configurable class of the shell, and with gpucleanup loaded GPUCleanup is one of them"
line="with show = always every cell prints gpucleanup's line after its output"
deselect by-design tests/test_displayhook.py::test_output_quiet \
  "it asserts that no digit 2 is printed after a cell ending in a semicolon, and $line, whose figures (0.2 ms) may hold one"
deselect by-design tests/test_displayhook.py::test_interactivehooks_ast_modes_semi_suppress \
  "it asserts that no digit 2 is printed after a cell ending in a semicolon, and $line, whose figures (0.2 ms) may hold one"
deselect by-design tests/test_magic.py::test_tb_syntaxerror \
  "it asserts that the last line a cell printed is its SyntaxError, and $line"
deselect by-design tests/test_magic_terminal.py::test_paste_echo \
  "it compares everything %paste printed, and $line"
deselect by-design tests/test_magic.py::test_notebook_export_json_with_output \
  "it compares each cell's outputs in what %notebook exports, and with show = always each cell has one more, gpucleanup's line as a display output"
# The suite's own order: once the pure-Python doctest IPython/testing/plugin/test_example.txt has run, pytest's
# doctest plugin leaves builtins._ set ('HELLO WORLD'), and these tests' cells no longer get _ from the output
# cache; test_underscore_no_overwrite_builtins deletes builtins._ at its end, so failing, it leaves it for the
# others. With IPython 9.19.1 (what scripts/setup.sh installs since 2026-12; the stage was written against 9.18.1)
# the order puts the doctest first in the show = "always" run, and they fail without gpucleanup too (issue 53).
# gpucleanup's own proof that _ is the last result with its line shown is tests/python/test_extension.py
# (test_underscore_is_the_last_result_after_a_cell_whose_line_was_shown).
underscore="the suite's own order: after pytest's doctest plugin ran test_example.txt, builtins._ stays set and this fails without gpucleanup too (gpucleanup's _ proof: test_underscore_is_the_last_result_after_a_cell_whose_line_was_shown)"
deselect suite-order tests/test_displayhook.py::test_underscore_no_overwrite_user "$underscore"
deselect suite-order tests/test_displayhook.py::test_underscore_no_overwrite_builtins "$underscore"
deselect suite-order tests/test_interactiveshell.py::test_naked_string_cells "$underscore"
deselect suite-order tests/test_interactiveshell.py::test_run_cell_await "$underscore"
deselect suite-order tests/test_interactiveshell.py::test_run_cell_asyncio_run "$underscore"

# deselect_for RUN: the --deselect options (in deselect_args) for RUN: standing (the show = "always" run of the
# standing check), single (one run with gpucleanup: --show), without (--without-gpucleanup) or by-design (the
# by-design tests, selected by name: nothing left out); each test left out is printed with its reason.
deselect_args=()
deselect_for() {
  local run=$1 entry when id reason
  deselect_args=()
  [ "$run" != by-design ] && [ "$run" != without ] || return 0
  for entry in "${deselections[@]}"; do
    IFS=$'\t' read -r when id reason <<<"$entry"
    case "$when" in
      loaded) ;;
      by-design | suite-order) [ "$run" = standing ] || continue ;;
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

[ -x "$py" ] || { say "no .venv: run scripts/setup.sh first"; exit 1; }
if [ ! -e "$fake" ] || [ ! -e "$library" ]; then
  say "building the fake CUDA driver and libgpucleanup.so in $build/"
  cmake -S . -B "$build" -G Ninja -DGPUCLEANUP_BUILD_TESTS=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
  cmake --build "$build" -j"$(nproc)" --target fake_cuda gpucleanup >/dev/null
fi
for built in "$fake" "$library"; do [ -e "$built" ] || { say "missing $built after the build"; exit 1; }; done

ipython_version=$("$py" -c 'import IPython; print(IPython.__version__)')
suite_dir=$root/.venv/ipython-suite
deps=$suite_dir/deps
sdist=$suite_dir/ipython-$ipython_version.tar.gz
want="${suite_deps[*]}"
if [ "$(cat "$deps/.complete" 2>/dev/null)" != "$want" ]; then
  say "installing the suite's test plugins into $deps"
  rm -rf "$deps"
  "$py" -m pip install -q --no-deps --target "$deps" "${suite_deps[@]}"
  echo "$want" >"$deps/.complete"
fi
if [ ! -f "$sdist" ]; then
  say "downloading IPython $ipython_version's sdist (its test suite) with pip"
  "$py" -m pip download -q --no-deps --no-binary :all: --no-build-isolation -d "$suite_dir" \
    "ipython==$ipython_version"
  [ -f "$sdist" ] || { say "pip left no $sdist"; exit 1; }
fi

work=$(mktemp -d "${TMPDIR:-/tmp}/gpucleanup-ipython.XXXXXX")
trap 'rm -rf "$work"' EXIT
tar -xzf "$sdist" -C "$work"
suite=$work/ipython-$ipython_version
# The doctests are collected from the sdist's IPython/, which pytest's rootdir puts first on sys.path: it must
# be the installed IPython, file for file, for the suite to test what is installed.
"$py" - "$suite/IPython" <<'PY'
import filecmp, pathlib, sys

import IPython

sdist, installed = pathlib.Path(sys.argv[1]), pathlib.Path(IPython.__file__).parent
names = lambda top: {p.relative_to(top) for p in top.rglob("*.py")}
ours, theirs = names(sdist), names(installed)
differ = sorted(str(p) for p in ours & theirs if not filecmp.cmp(sdist / p, installed / p, shallow=False))
# the sdist has tests inside the package too (IPython/extensions/tests/): the wheel leaves them out
missing = sorted(str(p) for p in ours ^ theirs if not (p in ours and "tests" in p.parts))
if differ or missing:
    sys.exit(f"ipython_suite: the sdist's IPython/ is not the installed {installed}: "
             f"{len(differ)} files differ ({', '.join(differ[:5])}), {len(missing)} in one only ({', '.join(missing[:5])})")
print(f"ipython_suite: the sdist's IPython/ is the installed one ({len(ours & theirs)} files alike)")
PY

# The plugin: gpucleanup into every InteractiveShell as the last step of its construction, and the counts.
mkdir "$work/plugin"
cat >"$work/plugin/gpucleanup_in_every_shell.py" <<'PY'
"""Loads gpucleanup into every InteractiveShell made in this pytest process and counts them."""

import functools
import json
import os
import threading

from IPython.core.interactiveshell import InteractiveShell

SHOW = os.environ["IPYTHON_SUITE_SHOW"]
_building = threading.local()  # constructors under way in this thread: a subclass's __init__ calls its base's
_extensions = []  # (shell class, its GPUCleanup object)


def _load(shell):
    from gpucleanup.in_kernel.extension import get_extension

    shell.config.GPUCleanup.show = SHOW
    shell.extension_manager.load_extension("gpucleanup")
    ext = get_extension(shell)
    if ext is None:
        raise RuntimeError(f"gpucleanup did not load into {type(shell).__name__}")
    _extensions.append((type(shell).__name__, ext))


def _wrap(cls):
    init = cls.__dict__.get("__init__")
    if init is None or getattr(init, "_gpucleanup_wrapped", False):
        return

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        depth = getattr(_building, "depth", 0)
        _building.depth = depth + 1
        try:
            init(self, *args, **kwargs)
        finally:
            _building.depth = depth
        if depth == 0:  # the outermost constructor: the shell is whole, as an app's extensions find it
            _load(self)

    __init__._gpucleanup_wrapped = True
    cls.__init__ = __init__


def _wrap_all(cls):
    _wrap(cls)
    for sub in cls.__subclasses__():
        _wrap_all(sub)


_wrap_all(InteractiveShell)
_own_init_subclass = InteractiveShell.__dict__.get("__init_subclass__")


@classmethod
def _init_subclass(cls, **kwargs):
    if _own_init_subclass is not None:
        _own_init_subclass.__func__(cls, **kwargs)
    else:
        super(InteractiveShell, cls).__init_subclass__(**kwargs)
    _wrap(cls)


InteractiveShell.__init_subclass__ = _init_subclass


# The suite's Ctrl-C tests (test_magic.py's *_raise_on_interrupt) raise SIGINT and expect KeyboardInterrupt, as in a
# terminal. A run started in the background by a shell without job control inherits SIGINT ignored, and Python then
# installs no handler: those three tests fail, with or without gpucleanup. So Python's handler is put in place as the
# session starts; and every change of the handler after a test is said (one of gpucleanup's would show here).
import signal as _signal

if _signal.getsignal(_signal.SIGINT) is _signal.SIG_IGN:
    _signal.signal(_signal.SIGINT, _signal.default_int_handler)
_sigint = {"last": None, "changes": []}


def pytest_runtest_teardown(item, nextitem):
    handler = _signal.getsignal(_signal.SIGINT)
    seen = None if handler is _signal.default_int_handler else repr(handler)[:160]
    if seen != _sigint["last"] and len(_sigint["changes"]) < 20:
        _sigint["changes"].append([item.nodeid, seen])
    _sigint["last"] = seen


def pytest_sessionfinish(session):
    kinds = {}
    for kind, _ in _extensions:
        kinds[kind] = kinds.get(kind, 0) + 1
    cleanups = sum(ext.totals.as_dict().get("cleanups", 0) for _, ext in _extensions)
    with open(os.environ["IPYTHON_SUITE_COUNTS"], "w") as f:
        json.dump({"shells": kinds, "cleanups": cleanups, "sigint": _sigint["changes"]}, f)
PY

export IPYTHON_SUITE_COUNTS=$work/counts.json
export GPUCLEANUP_LIBCUDA=$fake
export GPUCLEANUP_LIBRARY=$library
# one device in use, nothing to free: with show = "auto" a cell says nothing, with "always" every cell has a line
export GPUCLEANUP_FAKE_CUDA_SCENARIO='{"devices": [{"name": "Fake H100", "primary_active": true}]}'
export PYTHONPATH=$deps${PYTHONPATH:+:$PYTHONPATH}

# run_suite RUN SHOW [PATHS and pytest arguments]: the suite with gpucleanup at SHOW in every shell (SHOW "":
# nothing loaded); a selection given on the command line (-k ...) that leaves a run without a test (pytest's
# exit 5) is no failure. With gpucleanup, the plugin's counts are checked and printed.
given=$#
rc=0
run_suite() {
  local run=$1 show=$2 r=0
  shift 2
  deselect_for "$run"
  local path=$PYTHONPATH plugin=()
  if [ -n "$show" ]; then
    path=$work/plugin:$root/ipython_ext:$path
    plugin=(-p gpucleanup_in_every_shell)
  fi
  rm -f "$IPYTHON_SUITE_COUNTS"
  (cd "$suite" && IPYTHON_SUITE_SHOW=$show PYTHONPATH=$path "$py" -m pytest -q -p no:cacheprovider --color=no \
    ${plugin[@]+"${plugin[@]}"} ${deselect_args[@]+"${deselect_args[@]}"} "$@") || r=$?
  if [ "$r" = 5 ] && [ "$given" -gt 0 ]; then
    say "no test selected in this run by the arguments given"
    r=0
  elif [ -n "$show" ]; then
    if ! "$py" - "$IPYTHON_SUITE_COUNTS" "$show" <<'PY'
import json, sys

try:
    with open(sys.argv[1]) as f:
        counts = json.load(f)
except OSError:
    sys.exit("ipython_suite: the run left no counts: the plugin that loads gpucleanup did not run")
shells = sum(counts["shells"].values())
kinds = ", ".join(f"{n} {kind}" for kind, n in sorted(counts["shells"].items()))
print(f"ipython_suite: gpucleanup (show = {sys.argv[2]}) was loaded into {shells} shells ({kinds or 'none'}) "
      f"and cleaned up after {counts['cleanups']} cells")
for test, handler in counts.get("sigint") or ():
    print(f"ipython_suite: after {test}, SIGINT's handler is "
          + (handler if handler is not None else "Python's default again"))
if not shells or not counts["cleanups"]:
    sys.exit("ipython_suite: that is no proof the suite ran with gpucleanup: failing")
PY
    then r=1; fi
  fi
  [ "$r" = 0 ] || rc=$r
}
if [ "$with_gpucleanup" = 0 ]; then
  say "running IPython $ipython_version's test suite with nothing loaded (--without-gpucleanup)"
  run_suite without "" "$@"
elif [ -n "$show" ]; then
  say "running IPython $ipython_version's test suite with gpucleanup (show = $show) in every shell"
  run_suite single "$show" "$@"
else
  say "running IPython $ipython_version's test suite with gpucleanup (show = always) in every shell"
  run_suite standing always "$@"
  by_design=()
  for entry in "${deselections[@]}"; do
    IFS=$'\t' read -r when id _ <<<"$entry"
    [ "$when" = by-design ] || [ "$when" = suite-order ] && by_design+=("$id")
  done
  say "running the tests left out of that run with the default show (auto): ${by_design[*]}"
  run_suite by-design auto "${by_design[@]}" "$@"
fi
say "done in $((SECONDS - started)) s (rc $rc)"
exit "$rc"
