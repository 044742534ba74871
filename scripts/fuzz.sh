#!/usr/bin/env bash
# The fuzz runs, part of the test command (scripts/test.sh calls this after the sanitizer runs): the libFuzzer
# targets of tests/fuzz, built with clang under AddressSanitizer + UndefinedBehaviorSanitizer in build-fuzz/
# (GPUCLEANUP_FUZZ=ON builds only them and the library sources they reach), each run for a fixed time on a copy
# of its seed corpus (tests/fuzz/corpus/<target>/, never written to here):
#   fuzz_status_request  a status request through the server's own check: frames, signature, JSON, fields, replay
#   fuzz_native_json     the JSON the extension hands in: server config, state, cell records, trace candidates
#   fuzz_signature       the HMAC-SHA256 check and the replay guard
# Per target it prints the executions, the coverage (libFuzzer's cov: edges, ft: features), the corpus size and
# the crashes. A crash, a broken invariant (the targets check them), a leak or a timeout fails the run; the input
# is kept in build-fuzz/crashes/ and the command that replays it is printed. native/README.md ("Fuzzing") has
# the figures of the long run.
# Usage: scripts/fuzz.sh [--seconds N | --long] [TARGET...]
#   --seconds N  run each target N seconds (default: $GPUCLEANUP_FUZZ_SECONDS, else 60)
#   --long       600 s per target (the long run)
#   TARGET       one or more of the targets above (default: all three, one after another)
# Environment: GPUCLEANUP_FUZZ_SECONDS (default 60), GPUCLEANUP_FUZZ_CXX (default clang++-14).
# Needs clang and its libFuzzer runtime (Debian: clang-14 libclang-rt-14-dev), which scripts/setup.sh installs;
# it runs `scripts/setup.sh --system-only` when they are missing.
set -euo pipefail
cd "$(dirname "$0")/.."
say() { echo "fuzz.sh: $*"; }

all_targets=(fuzz_status_request fuzz_native_json fuzz_signature)
seconds=${GPUCLEANUP_FUZZ_SECONDS:-60}
targets=()
while [ $# -gt 0 ]; do
  case "$1" in
    --seconds) [ $# -ge 2 ] || { echo "fuzz.sh: --seconds needs a number" >&2; exit 2; }; seconds=$2; shift 2 ;;
    --seconds=*) seconds=${1#--seconds=}; shift ;;
    --long) seconds=600; shift ;;
    -h | --help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    fuzz_*)
      [[ " ${all_targets[*]} " == *" $1 "* ]] || { echo "fuzz.sh: no target $1 (${all_targets[*]})" >&2; exit 2; }
      targets+=("$1"); shift ;;
    *) echo "fuzz.sh: unknown argument '$1' (usage: scripts/fuzz.sh [--seconds N | --long] [TARGET...])" >&2; exit 2 ;;
  esac
done
case "$seconds" in
  '' | *[!0-9]*) echo "fuzz.sh: --seconds needs a whole number of seconds, got '$seconds'" >&2; exit 2 ;;
esac
seconds=$((10#$seconds))
[ "$seconds" -ge 1 ] || { echo "fuzz.sh: --seconds needs at least 1" >&2; exit 2; }
[ ${#targets[@]} -gt 0 ] || targets=("${all_targets[@]}")

# The longest input each target takes: a request up to the server's 64 KiB limit and some over it; the JSON
# arguments and the signature pieces need less to reach everything.
max_len() {
  case "$1" in
    fuzz_status_request) echo 70000 ;;
    fuzz_native_json) echo 8192 ;;
    *) echo 4096 ;;
  esac
}

cxx=${GPUCLEANUP_FUZZ_CXX:-clang++-14}
have_fuzzer() {
  command -v "$cxx" >/dev/null || return 1
  local runtime
  runtime=$("$cxx" -print-runtime-dir 2>/dev/null) || return 1
  [ -f "$runtime/libclang_rt.fuzzer-$(uname -m).a" ]
}
if ! have_fuzzer; then
  say "$cxx or its libFuzzer runtime is missing: installing the system packages (scripts/setup.sh --system-only)"
  bash scripts/setup.sh --system-only
  have_fuzzer || { say "still no $cxx with libclang_rt.fuzzer (Debian: apt-get install clang-14 libclang-rt-14-dev)"; exit 1; }
fi

started=$SECONDS
# A build-fuzz/ configured with another compiler is configured afresh (CMake would otherwise drop the options).
if [ -f build-fuzz/CMakeCache.txt ]; then
  cached=$(sed -n 's/^CMAKE_CXX_COMPILER:[A-Z]*=//p' build-fuzz/CMakeCache.txt)
  if [ "$(readlink -f "$(command -v "$cached" || echo "$cached")")" != "$(readlink -f "$(command -v "$cxx")")" ]; then
    rm -rf build-fuzz/CMakeCache.txt build-fuzz/CMakeFiles
  fi
fi
say "building the fuzz targets with $cxx in build-fuzz/"
cmake -S . -B build-fuzz -G Ninja -DGPUCLEANUP_FUZZ=ON -DCMAKE_CXX_COMPILER="$cxx" -DCMAKE_BUILD_TYPE= >/dev/null
cmake --build build-fuzz -j"$(nproc)" -- "${targets[@]}"
say "built in $((SECONDS - started)) s; ${#targets[@]} target(s), $seconds s each"

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p build-fuzz/crashes build-fuzz/logs
# Leaks count (detect_leaks=1): the targets free what they make. Every UB report is fatal (built with
# -fno-sanitize-recover=undefined).
export ASAN_OPTIONS=detect_leaks=1:halt_on_error=1
export UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1

failed=()
rows=()
for target in "${targets[@]}"; do
  corpus=$work/$target
  cp -r "tests/fuzz/corpus/$target" "$corpus"
  seeds=$(find "$corpus" -type f | wc -l)
  log=build-fuzz/logs/$target.log
  stamp=$work/$target.stamp
  touch "$stamp"
  dict=()
  [ -f "tests/fuzz/$target.dict" ] && dict=(-dict="tests/fuzz/$target.dict")
  say "$target: $seeds seeds, $seconds s, -max_len=$(max_len "$target") (log: $log)"
  rc=0
  "build-fuzz/$target" "$corpus" -max_total_time="$seconds" -print_final_stats=1 -max_len="$(max_len "$target")" \
    -timeout=10 -rss_limit_mb=2048 -artifact_prefix="build-fuzz/crashes/$target-" ${dict[@]+"${dict[@]}"} \
    >"$log" 2>&1 || rc=$?
  executions=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
  speed=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log" | tail -1)
  # The last status line (#N DONE, or the last before a crash): cov, ft, corp.
  status_line=$(grep -E '^#[0-9]+[[:space:]]' "$log" | tail -1 || true)
  cov=$(sed -n 's/.* cov: \([0-9]*\).*/\1/p' <<<"$status_line")
  ft=$(sed -n 's/.* ft: \([0-9]*\).*/\1/p' <<<"$status_line")
  units=$(sed -n 's/.* corp: \([0-9]*\/[0-9]*[a-zA-Z]*\).*/\1/p' <<<"$status_line")
  found=$(find build-fuzz/crashes -type f -name "$target-*" -newer "$stamp" | sort)
  crashes=$(grep -c . <<<"$found" || true)
  rows+=("$(printf '%-20s %7s %11s %7s %6s %7s %14s %8s' "$target" "$seconds" "${executions:-?}" "${speed:-?}" \
    "${cov:-?}" "${ft:-?}" "${units:-?}" "$crashes")")
  if [ "$rc" != 0 ] || [ "$crashes" != 0 ]; then
    failed+=("$target")
    say "$target FAILED (libFuzzer exit $rc); its report:"
    # From the first report line (a broken invariant, a sanitizer, libFuzzer's own), 60 lines.
    awk '/^invariant broken|runtime error:|==[0-9]+==ERROR|^==[0-9]+== ERROR|ALARM:|out-of-memory/ { on = 1 }
         on && n++ < 60' "$log"
    if [ -n "$found" ]; then
      while read -r input; do
        say "kept $input; replay it with: build-fuzz/$target $input"
      done <<<"$found"
      say "once fixed, add it to tests/fuzz/corpus/$target/ as finding-<what> (and a GoogleTest in tests/native/)"
    fi
  fi
done

say "$(printf '%-20s %7s %11s %7s %6s %7s %14s %8s' target seconds executions exec/s cov ft corpus crashes)"
for row in "${rows[@]}"; do say "$row"; done
if [ ${#failed[@]} -gt 0 ]; then
  say "FAILED: ${failed[*]} (inputs in build-fuzz/crashes/, logs in build-fuzz/logs/)"
  exit 1
fi
say "no crash, leak or timeout in $((SECONDS - started)) s"
