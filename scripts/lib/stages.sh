# Stage lines and timings for the scripts that set up, build and test gpucleanup (sourced, not run).
#
#   stage_begin NAME     prints "<script>: NAME: started"
#   stage_end NAME       prints "<script>: NAME: done in N s" and, when GPUCLEANUP_TIMINGS names a file,
#                        appends "NAME<TAB>seconds" to it
#   stages_begun, stage_current: the stages begun in order, and the one under way (for a failed run's report)
#
# scripts/test.sh and scripts/demo.sh point GPUCLEANUP_TIMINGS at a file of their build directory; the scripts
# they call (setup.sh, sanitizers.sh, fuzz.sh) inherit it, so one run's stages end up in one file, which
# scripts/timings.py turns into tests/timings.json and the README's table (GPUCLEANUP_RECORD_TIMINGS=1).
# Expects say() to be defined by the script that sources it.

declare -A _stage_started=()

# timings_start COMMAND DIR: one run's stage file, DIR/timings-COMMAND.tsv, emptied; sets run_kind (fresh: the
# first run of COMMAND in this clone, else again) and timing_note (set-up already done, when .venv exists).
timings_start() {
  local file="$PWD/$2/timings-$1.tsv"
  if [ -e "$file" ]; then run_kind=again; else run_kind=fresh; fi
  if [ -e .venv ]; then timing_note=(--note "set-up already done"); else timing_note=(); fi
  mkdir -p "$2"
  export GPUCLEANUP_TIMINGS="$file"
  : >"$GPUCLEANUP_TIMINGS"
}

# timings_record COMMAND STARTED: with GPUCLEANUP_RECORD_TIMINGS=1, store this run in tests/timings.json and the
# README's table (scripts/timings.py); STARTED is the run's $SECONDS at its start.
timings_record() {
  [ "${GPUCLEANUP_RECORD_TIMINGS:-0}" = 1 ] || return 0
  python3 scripts/timings.py record --command "$1" --run "$run_kind" --stages "$GPUCLEANUP_TIMINGS" \
    --total "$((SECONDS - $2))" ${timing_note[@]+"${timing_note[@]}"}
}

stages_begun=()   # every stage begun so far, in order (a failed run says which of its planned stages never began)
stage_current=""  # the stage begun and not yet ended (a failed run says it is where it failed)

stage_begin() {
  _stage_started[$1]=$SECONDS
  stages_begun+=("$1")
  stage_current=$1
  say "$1: started"
}

stage_end() {
  local name=$1 took=$((SECONDS - ${_stage_started[$1]:-$SECONDS}))
  say "$name: done in $(_stage_duration "$took")"
  [ "$stage_current" != "$name" ] || stage_current=""
  if [ -n "${GPUCLEANUP_TIMINGS:-}" ]; then
    printf '%s\t%s\n' "$name" "$took" >>"$GPUCLEANUP_TIMINGS"
  fi
}

_stage_duration() {
  local s=$1
  if [ "$s" -ge 60 ]; then echo "$((s / 60)) min $((s % 60)) s"; else echo "$s s"; fi
}
