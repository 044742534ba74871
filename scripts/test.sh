#!/usr/bin/env bash
# The test command: set-up, then the C++ suites (ctest, against the fake CUDA
# driver) and the Python suites (pytest: native binding, extension in an
# InteractiveShell, real kernels through jupyter_client, status server, CLI).
# tests/gpu runs only where a GPU is present; it skips elsewhere.
# Then ipykernel's own test suite with gpucleanup in every kernel (scripts/ipykernel_suite.sh), IPython's own
# with gpucleanup in every shell (scripts/ipython_suite.sh), and the
# IPython-facing suites again in .venv-ipython-low, with the lowest
# IPython (and jupyter_core) that pyproject.toml claims, on the same wheel.
#
# Usage: scripts/test.sh [--repeat N] [pytest arguments...]
#   --repeat N   run the pytest suites N times in a row (one set-up and build),
#                stopping at the first round that fails
# Then the sanitizer runs (scripts/sanitizers.sh) and the fuzz runs (scripts/fuzz.sh: each libFuzzer target 60 s).
# Every stage prints a line as it starts and its duration as it ends (scripts/lib/stages.sh); how long each took
# on a measured run is in tests/timings.json and the README's table, and nowhere else.
# Environment: GPUCLEANUP_BUILD_DIR (default build), GPUCLEANUP_SKIP_LOW_IPYTHON=1 skips the
#   lowest-IPython run, GPUCLEANUP_SKIP_IPYKERNEL_SUITE=1 ipykernel's suite, GPUCLEANUP_SKIP_IPYTHON_SUITE=1
#   IPython's suite, GPUCLEANUP_SKIP_SANITIZERS=1 the
#   sanitizer runs, GPUCLEANUP_SKIP_FUZZ=1 the fuzz runs, GPUCLEANUP_FUZZ_SECONDS (default 60) sets how long
#   each fuzz target runs,
#   GPUCLEANUP_RECORD_TIMINGS=1 stores a whole run's stage times in tests/timings.json and the README's table
#   (scripts/timings.py) once it passed.
set -euo pipefail
cd "$(dirname "$0")/.."

repeat=1
pytest_args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --repeat) [ $# -ge 2 ] || { echo "test.sh: --repeat needs a number" >&2; exit 2; }; repeat=$2; shift 2 ;;
    --repeat=*) repeat=${1#--repeat=}; shift ;;
    *) pytest_args+=("$1"); shift ;;
  esac
done
case "$repeat" in
  '' | *[!0-9]*) repeat=0 ;;
  *) repeat=$((10#$repeat)) ;;
esac
[ "$repeat" -ge 1 ] || { echo "test.sh: --repeat needs a whole number of at least 1" >&2; exit 2; }

started=$SECONDS
say() { echo "test.sh: $*"; }
source scripts/lib/stages.sh

# A run that fails says, last: where it failed, after how long, the tests that failed (pytest's JUnit reports of
# this run, in $build/pytest-reports/), and the stages it never began.
planned_stages=("set-up" "C++ build" "C++ tests" "Python suites" "ipykernel suite" "IPython suite"
                "lowest-IPython suites" "sanitizers" "fuzzing")
report_failure() {
  local rc=$? stage not_run=()
  [ "$rc" != 0 ] || return 0
  say "FAILED with exit status $rc after $(_stage_duration $((SECONDS - started)))${stage_current:+, in the stage: $stage_current}"
  if [ -d "$build/pytest-reports" ]; then
    python3 scripts/lib/junit_failures.py "$build"/pytest-reports/*.xml | sed 's/^/test.sh:   /' || true
  fi
  for stage in "${planned_stages[@]}"; do
    [[ " ${stages_begun[*]-} " == *" $stage "* ]] || not_run+=("$stage")
  done
  if [ ${#not_run[@]} -gt 0 ]; then
    say "stages that did not run: $(IFS=,; echo "${not_run[*]}" | sed 's/,/, /g')"
  fi
}
build=${GPUCLEANUP_BUILD_DIR:-build}
rm -rf "$build/pytest-reports"
trap report_failure EXIT

# The first test run of this clone, or a run again over kept builds (what the timings are recorded as); the
# set-up may have been done already by scripts/demo.sh, which the recorded timings then say.
timings_start test "$build"

stage_begin "set-up"
bash scripts/setup.sh
stage_end "set-up"

stage_begin "C++ build"
cmake -S . -B "$build" -G Ninja -DGPUCLEANUP_BUILD_TESTS=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build "$build" -j"$(nproc)"
stage_end "C++ build"
stage_begin "C++ tests"
ctest --test-dir "$build" --output-on-failure -j"$(nproc)"
stage_end "C++ tests"

# pytest "$@" with the arguments given to test.sh, its JUnit report in $build/pytest-reports/N.xml; a selection of those (-k ...) that leaves one suite without
# a test (pytest's exit 5) is no failure.
reports=0
pytest_run() {
  local rc=0
  reports=$((reports + 1))
  GPUCLEANUP_BUILD_DIR="$build" "$@" -q -p no:cacheprovider --junitxml="$build/pytest-reports/$reports.xml" \
    ${pytest_args[@]+"${pytest_args[@]}"} || rc=$?
  if [ "$rc" = 5 ] && [ ${#pytest_args[@]} -gt 0 ]; then
    say "no test selected there by: ${pytest_args[*]}"
    rc=0
  fi
  return "$rc"
}
# The installed package (with its own libgpucleanup.so) is what is tested; the
# build tree provides only the fake driver.
# Two runs: each suite has a conftest of its own that its modules import. -rfEs: every failure, error and skip
# is named in the summary at the end (a skip says why).
run_suites() {
  pytest_run .venv/bin/python -m pytest tests/python -rfEs && pytest_run .venv/bin/python -m pytest tests/gpu -rfEs
}
for ((round = 1; round <= repeat; round++)); do
  [ "$repeat" = 1 ] || say "round $round of $repeat"
  step=$SECONDS
  rc=0
  stage_begin "Python suites"
  run_suites || rc=$?
  if [ "$rc" != 0 ]; then
    if [ "$repeat" = 1 ]; then say "the pytest suites failed"; else say "round $round of $repeat failed"; fi
    exit "$rc"
  fi
  stage_end "Python suites"
  [ "$repeat" = 1 ] || say "round $round of $repeat passed in $((SECONDS - step)) s"
done
[ "$repeat" = 1 ] || say "all $repeat rounds passed"

# ipykernel's own test suite with gpucleanup loaded into every kernel it starts, on the fake driver
# (scripts/ipykernel_suite.sh): the proof that a kernel behaves as before. Skipped, as the sanitizer runs are,
# when pytest arguments or --repeat select a partial run.
if [ "${GPUCLEANUP_SKIP_IPYKERNEL_SUITE:-0}" = 1 ]; then
  say "ipykernel suite skipped (GPUCLEANUP_SKIP_IPYKERNEL_SUITE=1)"
elif [ ${#pytest_args[@]} -gt 0 ] || [ "$repeat" != 1 ]; then
  say "ipykernel suite skipped (a partial or repeated run: bash scripts/ipykernel_suite.sh runs it)"
else
  stage_begin "ipykernel suite"
  GPUCLEANUP_BUILD_DIR="$build" bash scripts/ipykernel_suite.sh
  stage_end "ipykernel suite"
fi

# IPython's own test suite with gpucleanup loaded into every shell it makes, on the fake driver
# (scripts/ipython_suite.sh): the proof that a shell behaves as before. Skipped as ipykernel's suite is.
if [ "${GPUCLEANUP_SKIP_IPYTHON_SUITE:-0}" = 1 ]; then
  say "IPython suite skipped (GPUCLEANUP_SKIP_IPYTHON_SUITE=1)"
elif [ ${#pytest_args[@]} -gt 0 ] || [ "$repeat" != 1 ]; then
  say "IPython suite skipped (a partial or repeated run: bash scripts/ipython_suite.sh runs it)"
else
  stage_begin "IPython suite"
  GPUCLEANUP_BUILD_DIR="$build" bash scripts/ipython_suite.sh
  stage_end "IPython suite"
fi

# The sanitizer runs (scripts/sanitizers.sh): the C++ suites under ASan + UBSan and under TSan, the Python
# suite against the ASan + UBSan library. Skipped when pytest arguments or --repeat select a partial run.
run_sanitizers() {
  if [ "${GPUCLEANUP_SKIP_SANITIZERS:-0}" = 1 ]; then
    say "sanitizer runs skipped (GPUCLEANUP_SKIP_SANITIZERS=1)"
  elif [ ${#pytest_args[@]} -gt 0 ] || [ "$repeat" != 1 ]; then
    say "sanitizer runs skipped (a partial or repeated run: bash scripts/sanitizers.sh runs them)"
  else
    stage_begin "sanitizers"
    bash scripts/sanitizers.sh
    stage_end "sanitizers"
  fi
}

# The fuzz runs (scripts/fuzz.sh): each libFuzzer target of tests/fuzz for GPUCLEANUP_FUZZ_SECONDS (60 s) on a
# copy of its seed corpus. Skipped, as the sanitizer runs are, when pytest arguments or --repeat select a
# partial run.
run_fuzzers() {
  if [ "${GPUCLEANUP_SKIP_FUZZ:-0}" = 1 ]; then
    say "fuzz runs skipped (GPUCLEANUP_SKIP_FUZZ=1)"
  elif [ ${#pytest_args[@]} -gt 0 ] || [ "$repeat" != 1 ]; then
    say "fuzz runs skipped (a partial or repeated run: bash scripts/fuzz.sh runs them)"
  else
    stage_begin "fuzzing"
    bash scripts/fuzz.sh
    stage_end "fuzzing"
  fi
}

# GPUCLEANUP_RECORD_TIMINGS=1: a whole run that passed stores its stages (scripts/timings.py).
record_timings() {
  if [ "${GPUCLEANUP_RECORD_TIMINGS:-0}" != 1 ]; then return 0; fi
  if [ ${#pytest_args[@]} -gt 0 ] || [ "$repeat" != 1 ] || [ "${GPUCLEANUP_SKIP_SANITIZERS:-0}" = 1 ] \
    || [ "${GPUCLEANUP_SKIP_FUZZ:-0}" = 1 ] || [ "${GPUCLEANUP_SKIP_LOW_IPYTHON:-0}" = 1 ] \
    || [ "${GPUCLEANUP_SKIP_IPYKERNEL_SUITE:-0}" = 1 ] || [ "${GPUCLEANUP_SKIP_IPYTHON_SUITE:-0}" = 1 ]; then
    say "timings not recorded: only a whole run is (no pytest arguments, --repeat or GPUCLEANUP_SKIP_*)"
    return 0
  fi
  timings_record test "$started"
}

main_ipython=$(.venv/bin/python -c 'import IPython; print(IPython.__version__)')
if [ "${GPUCLEANUP_SKIP_LOW_IPYTHON:-0}" = 1 ]; then
  say "tested with IPython $main_ipython only (GPUCLEANUP_SKIP_LOW_IPYTHON=1)"
  run_sanitizers
  run_fuzzers
  say "done in $((SECONDS - started)) s"
  exit 0
fi

# The lowest IPython that pyproject.toml allows (ipython>=8.12), with the lowest jupyter_core it allows
# (jupyter_core>=4.12), in a venv of its own, kept between runs. It gets the wheel setup.sh built and
# installed into .venv, so nothing is compiled again.
low_ipython=8.12
low_jupyter_core=4.12
low=.venv-ipython-low
wheel=$(ls .venv/gpucleanup-build/gpucleanup-*.whl)
stamp=$low/gpucleanup-build.sha256
want=$(sha256sum "$wheel" | cut -d' ' -f1)
if "$low/bin/python" - "$low_ipython" "$low_jupyter_core" 2>/dev/null <<'EOF'
import sys, IPython, jupyter_core
ok = IPython.__version__.startswith(sys.argv[1] + ".") and jupyter_core.__version__.startswith(sys.argv[2] + ".")
sys.exit(0 if ok else 1)
EOF
then
  say "using $low (IPython $low_ipython, jupyter_core $low_jupyter_core)"
else
  stage_begin "lowest-IPython venv"
  say "creating $low with IPython $low_ipython.* and jupyter_core $low_jupyter_core.*"
  rm -rf "$low"
  python3 -m venv "$low"
  printf '*\n' >"$low/.gitignore"  # keeps git (and `git add -A`) away from it
  "$low/bin/python" -m pip install -q --upgrade "pip>=23" >/dev/null
  "$low/bin/python" -m pip install -q "$wheel[test]" "ipython==$low_ipython.*" "jupyter_core==$low_jupyter_core.*"
  echo "$want" >"$stamp"
  stage_end "lowest-IPython venv"
fi
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  say "installing the new gpucleanup wheel into $low"
  "$low/bin/python" -m pip install -q --force-reinstall --no-deps "$wheel"
  "$low/bin/python" -m pip install -q "$wheel[test]" "ipython==$low_ipython.*" "jupyter_core==$low_jupyter_core.*"
  echo "$want" >"$stamp"
fi
low_versions=$("$low/bin/python" -c 'import IPython, jupyter_core; print(IPython.__version__, jupyter_core.__version__)')
low_ipython_version=${low_versions% *}
say "the IPython suites with IPython $low_ipython_version and jupyter_core ${low_versions#* }"
stage_begin "lowest-IPython suites"
rc=0
pytest_run "$low/bin/python" -m pytest -rfEs \
  tests/python/test_extension.py tests/python/test_magics.py tests/python/test_config.py tests/python/test_kernel.py || rc=$?
if [ "$rc" != 0 ]; then
  say "the IPython suites failed with IPython $low_ipython_version ($low); they passed with IPython $main_ipython (.venv)"
  exit "$rc"
fi
stage_end "lowest-IPython suites"
run_sanitizers
run_fuzzers
record_timings
say "tested with IPython $main_ipython (.venv) and IPython $low_ipython_version ($low); done in $((SECONDS - started)) s"
