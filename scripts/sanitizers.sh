#!/usr/bin/env bash
# The sanitizer runs, part of the test command (scripts/test.sh calls this after the main suites):
#   1. build-asan/: the library, the fake CUDA driver, the fake libcupti and the C++ tests built with
#      AddressSanitizer + UndefinedBehaviorSanitizer (GPUCLEANUP_SANITIZE=ON, every UB report fatal); ctest;
#      then the Python suite (tests/python: the extension in a shell, real kernels, the status server, the CLI,
#      Dask workers) against that library, with the ASan runtime preloaded into Python (and libstdc++ with it,
#      so that ASan's __cxa_throw interceptor finds the real one in a Python that was not built with ASan).
#   2. build-tsan/: the same C++ tests built with ThreadSanitizer (GPUCLEANUP_TSAN=ON): the watchdog threads,
#      the status server's thread, the interpreter-lock hooks and the trace's callbacks run concurrently there.
# Any report fails the run. Leak checking is off (detect_leaks=0): the library keeps a few objects for the
# life of the process on purpose (the interpreter-lock hooks, the trace's state, the fake driver's retired
# contexts), which LeakSanitizer reports at exit. The one suppression file, tests/sanitizers/tsan.supp, names
# third-party code only (libzmq), with its reason.
# The first build of each takes longest (the GoogleTest suites dominate); later runs rebuild only what changed.
# How long a measured run took: tests/timings.json (the sanitizers stage of scripts/test.sh).
# Usage: scripts/sanitizers.sh [asan] [tsan]   (default: both)
# Needs what scripts/setup.sh installs (it runs it when .venv is missing).
set -euo pipefail
cd "$(dirname "$0")/.."
say() { echo "sanitizers.sh: $*"; }
[ -x .venv/bin/python ] || bash scripts/setup.sh
which=" ${*:-asan tsan} "
started=$SECONDS

if [[ $which == *" asan "* ]]; then
  step=$SECONDS
  say "building with AddressSanitizer + UndefinedBehaviorSanitizer in build-asan/"
  cmake -S . -B build-asan -G Ninja -DGPUCLEANUP_BUILD_TESTS=ON -DGPUCLEANUP_SANITIZE=ON \
    -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
  cmake --build build-asan -j"$(nproc)"
  say "built in $((SECONDS - step)) s"
  export ASAN_OPTIONS=detect_leaks=0:halt_on_error=1:abort_on_error=0
  export UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1
  ctest --test-dir build-asan --output-on-failure -j"$(nproc)"
  say "the Python suite against build-asan/native/libgpucleanup.so"
  asan=$(gcc -print-file-name=libasan.so)
  stdcxx=$(readlink -f "$(gcc -print-file-name=libstdc++.so)")
  [ -f "$asan" ] && [ -f "$stdcxx" ] || { say "no ASan runtime or libstdc++ found ($asan, $stdcxx)"; exit 1; }
  # ASan writes its reports to stderr, which pytest captures per test: a report that ends a kernel or a
  # worker would be lost with it. Each process writes its own file here instead, and any file fails the run.
  reports=$(mktemp -d)
  rc=0
  LD_PRELOAD="$asan $stdcxx" ASAN_OPTIONS="$ASAN_OPTIONS:log_path=$reports/asan" \
    UBSAN_OPTIONS="$UBSAN_OPTIONS:log_path=$reports/ubsan" \
    GPUCLEANUP_LIBRARY="$PWD/build-asan/native/libgpucleanup.so" GPUCLEANUP_BUILD_DIR=build-asan \
    .venv/bin/python -m pytest tests/python -q -p no:cacheprovider || rc=$?
  if compgen -G "$reports/*" >/dev/null; then
    say "sanitizer reports:"
    cat "$reports"/*
    rc=1
  fi
  rm -rf "$reports"
  [ "$rc" = 0 ] || { say "the Python suite under ASan + UBSan failed"; exit "$rc"; }
  say "ASan + UBSan: no report (C++ and Python suites) in $((SECONDS - step)) s"
fi

if [[ $which == *" tsan "* ]]; then
  step=$SECONDS
  say "building with ThreadSanitizer in build-tsan/"
  cmake -S . -B build-tsan -G Ninja -DGPUCLEANUP_BUILD_TESTS=ON -DGPUCLEANUP_TSAN=ON \
    -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
  cmake --build build-tsan -j"$(nproc)"
  say "built in $((SECONDS - step)) s"
  # tests/sanitizers/tsan.supp: libzmq only (uninstrumented, it orders its messages with atomics TSan cannot see)
  TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1:suppressions=$PWD/tests/sanitizers/tsan.supp" \
    ctest --test-dir build-tsan --output-on-failure -j"$(nproc)"
  say "TSan: no report (C++ suites) in $((SECONDS - step)) s"
fi
say "done in $((SECONDS - started)) s"
