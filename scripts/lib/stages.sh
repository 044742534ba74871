# Stage lines and timings for the scripts that set up, build and test gpucleanup (sourced, not run).
#
#   stage_begin NAME     prints "<script>: NAME: started"
#   stage_end NAME       prints "<script>: NAME: done in N s" and, when GPUCLEANUP_TIMINGS names a file,
#                        appends "NAME<TAB>seconds" to it
#
# scripts/test.sh and scripts/demo.sh point GPUCLEANUP_TIMINGS at a file of their build directory; the scripts
# they call (setup.sh, sanitizers.sh, fuzz.sh) inherit it, so one run's stages end up in one file, which
# scripts/timings.py turns into tests/timings.json and the README's table (GPUCLEANUP_RECORD_TIMINGS=1).
# Expects say() to be defined by the script that sources it.

declare -A _stage_started=()

stage_begin() {
  _stage_started[$1]=$SECONDS
  say "$1: started"
}

stage_end() {
  local name=$1 took=$((SECONDS - ${_stage_started[$1]:-$SECONDS}))
  say "$name: done in $(_stage_duration "$took")"
  if [ -n "${GPUCLEANUP_TIMINGS:-}" ]; then
    printf '%s\t%s\n' "$name" "$took" >>"$GPUCLEANUP_TIMINGS"
  fi
}

_stage_duration() {
  local s=$1
  if [ "$s" -ge 60 ]; then echo "$((s / 60)) min $((s % 60)) s"; else echo "$s s"; fi
}
