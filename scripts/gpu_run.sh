#!/usr/bin/env bash
# One run on a GPU test machine (offline, hence the carried wheels): install the wheels
# carried in .whl/ (gpucleanup's manylinux wheel plus IPython, ipykernel,
# jupyter_client and their dependencies, made by scripts/build_wheels.sh),
# then the real-GPU tests, the benchmarks and the demo, in one go.
# Results land in $OUT (or ./gpu-out): machine.log, gpu-tests.log, facts.log, bench.json, bench.log, demo.log,
# for the stage trace: trace-tests.log, trace-bench.json, trace-bench.log; for dask: dask-tests.log, dask-bench.*;
# for server: server-tests.log and server/ (the page's data, /metrics, the plots);
# for lab: lab-tests.log and lab/ (the answers the JupyterLab item draws);
# for in-process: in-process.log, in-process.json; for idle-kernels: idle-kernels.log, idle-kernels.json;
# and for the stage kernels: kernels.json, kernels.log, kernel-calls.json, kernel-calls.log.
# Usage: scripts/gpu_run.sh [STAGE ...]   stages: tests facts bench demo kernels kernels-focus per-cell paired idle-kernels in-process paired-stages paired-ab stages trace dask server lab managed reliability memcheck park park-kernels park-loop park-hold park-bench-kernels
#        (default: tests facts bench demo)
# The stage stages (tests/bench/profile_cell.py --stages --primitives, in-process, about a minute) writes
# stages.log: where the per-cell time goes, step by step, with CUDA unused and PyTorch or CuPy idle; and
# driver-costs.log: each driver call of one after-cell pass timed alone (tests/bench/driver_costs.cpp).
# The stage kernels (tests/bench/kernel_calls.py, under a minute, then tests/bench/bench_kernels.py, about
# 7.5 minutes) runs only when named. For its ipyexperiments variant, .whl/ must also carry ipyexperiments,
# nvidia-ml-py (the pynvml module) and psutil (psutil comes with ipykernel's dependencies anyway); without
# them that variant is skipped with the reason, the rest runs.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-$PWD/gpu-out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1

# PyCUDA has no wheel on PyPI: built here from the carried source when no wheel of it is carried
# (about 90 s), and written to $OUT so that a later run can carry it in .whl/.
if ! ls .whl/pycuda-*.whl >/dev/null 2>&1 && ls .whl/src/pycuda-*.tar.gz >/dev/null 2>&1; then
  start=$SECONDS
  rm -rf /tmp/pycuda-build && mkdir -p /tmp/pycuda-build
  tar -xzf "$(ls .whl/src/pycuda-*.tar.gz | tail -1)" -C /tmp/pycuda-build
  (cd /tmp/pycuda-build/pycuda-* && python3 configure.py --cuda-root=/usr/local/cuda >/tmp/pycuda-build/log 2>&1 \
     && python3 setup.py build_ext -j 16 bdist_wheel >>/tmp/pycuda-build/log 2>&1 && cp dist/*.whl "$out"/) \
    && echo "gpu_run: built $(ls "$out"/pycuda-*.whl) in $((SECONDS - start)) s" \
    || { echo "gpu_run: building PyCUDA failed (its tests are skipped):"; tail -20 /tmp/pycuda-build/log; }
fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    $(ls "$out"/pycuda-*.whl 2>/dev/null) \
  || { echo "gpu_run: installing the carried wheels failed"; exit 1; }
export PYTHONPATH=/tmp/site
export PATH=/tmp/site/bin:$PATH

{
  echo "== machine"; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import sys, gpucleanup, IPython, ipykernel; print(sys.version.split()[0], 'gpucleanup', gpucleanup.__version__, 'IPython', IPython.__version__, 'ipykernel', ipykernel.__version__)"
  echo "== snapshot in a fresh process (nothing uses CUDA yet)"
  python3 -c "import gpucleanup, json; print(json.dumps(gpucleanup.snapshot()['driver']))"
} 2>&1 | tee "$out/machine.log"

stages=" ${*:-tests facts bench demo} "
if [[ $stages == *" tests "* ]]; then
  python3 -m pytest tests/gpu -v -s -p no:cacheprovider 2>&1 | tee "$out/gpu-tests.log"
fi
if [[ $stages == *" trace "* ]]; then
  # the allocation trace and PyCUDA: their GPU tests, then what the trace costs per call (bench_trace.py)
  python3 -m pytest tests/gpu/test_trace_gpu.py tests/gpu/test_pycuda_gpu.py -v -s -p no:cacheprovider 2>&1 \
    | tee "$out/trace-tests.log"
  python3 tests/bench/bench_trace.py --json "$out/trace-bench.json" 2>&1 | tee "$out/trace-bench.log"
fi
if [[ $stages == *" dask "* ]]; then
  # the Dask worker plugin on a LocalCUDACluster: its GPU test, then its cost per task and per cleanup
  python3 -m pytest tests/gpu/test_dask_gpu.py -v -s -p no:cacheprovider 2>&1 | tee "$out/dask-tests.log"
  python3 tests/bench/bench_dask.py --json "$out/dask-bench.json" 2>&1 | tee "$out/dask-bench.log"
fi
if [[ $stages == *" server "* ]]; then
  # the Jupyter Server page's data, /metrics and %gpumem --plot against a CuPy and a PyTorch notebook; what
  # they showed (server-kernels.json, server-metrics.txt, gpumem-*.json, gpumem-plot-*.png) comes back in
  # $OUT/server/
  # and the page's admin view (tests/gpu/test_page_totals_gpu.py): its per-GPU totals against nvidia-smi with three
  # CuPy kernels and a process without gpucleanup, then the bulk park's preview against what it gave back
  GPUCLEANUP_ARTIFACTS="$out/server" python3 -m pytest tests/gpu/test_server_gpu.py tests/gpu/test_page_totals_gpu.py \
    -v -s -p no:cacheprovider 2>&1 | tee "$out/server-tests.log"
fi
if [[ $stages == *" lab "* ]]; then
  # the JupyterLab status item's figures for a CuPy notebook against nvidia-smi, parked and resumed
  # (tests/gpu/test_lab_item_gpu.py); the server's answers come back in $OUT/lab/ for the browser here
  GPUCLEANUP_ARTIFACTS="$out/lab" timeout 300 python3 -m pytest tests/gpu/test_lab_item_gpu.py -v -s \
    -p no:cacheprovider 2>&1 | tee "$out/lab-tests.log"
fi
if [[ $stages == *" managed "* ]]; then
  # CUDA managed memory seen from outside a process (its mappings of the driver's device files) and the driver's
  # checkpoint of such a process (tests/gpu/probe_managed.py): one JSON line per framework in managed.jsonl;
  timeout 240 python3 tests/gpu/probe_managed.py 2>&1 | tee "$out/managed.jsonl"
  # then a CuPy kernel on a managed pool: the park refused and said, park --check after it, a cell that frees it
  timeout 300 python3 -m pytest tests/gpu/test_park_kernel_gpu.py -k managed -v -s -p no:cacheprovider 2>&1 \
    | tee "$out/managed-tests.log"
fi
if [[ $stages == *" park "* ]]; then
  # parking: CuPy, PyTorch and JAX (one visible GPU) processes parked to 0 MiB and resumed with every byte equal,
  # then park/resume time against the bytes parked (1, 8, 32 GiB of PyTorch tensors, JAX at its default
  # preallocation) next to restarting the process and re-running its set-up (park-bench.json); at most 8 minutes
  timeout 180 python3 -m pytest tests/gpu/test_park_gpu.py -v -s -p no:cacheprovider 2>&1 | tee "$out/park-tests.log"
  timeout 300 python3 tests/bench/bench_park.py --json "$out/park-bench.json" 2>&1 | tee "$out/park-bench.log"
fi
if [[ $stages == *" park "* || $stages == *" park-kernels "* ]]; then
  # kernels: a CuPy, a PyTorch and a JAX notebook parked by %gpumem --park or gpucleanup park, resumed by the
  # next cell with every byte equal; a parked kernel shut down (at most 5 minutes)
  timeout 300 python3 -m pytest tests/gpu/test_park_kernel_gpu.py -v -s -p no:cacheprovider 2>&1 | tee "$out/park-kernel-tests.log"
  # which state survives a park/resume (cuBLAS, cuDNN, CUDA graphs, Numba, PyCUDA autoinit, managed memory)
  timeout 240 python3 -m pytest tests/gpu/test_park_survival_gpu.py -v -s -p no:cacheprovider 2>&1 | tee "$out/park-survival-tests.log"
  # what a park must never start or try: a kernel that used two GPUs together (refused, it keeps working; needs
  # two GPUs), a resume on a GPU another process took (the cell refused at once, resumed once it is free)
  timeout 240 python3 -m pytest tests/gpu/test_park_safety_gpu.py -v -s -p no:cacheprovider 2>&1 | tee "$out/park-safety-tests.log"
  # the driver's own answers there (tests/bench/park_facts.py: share/FACTS.md §10.1), as JSON
  timeout 400 python3 tests/bench/park_facts.py --json "$out/park-facts.json" 2>&1 | tee "$out/park-facts.log"
fi
if [[ $stages == *" park-loop "* ]]; then
  # the JAX notebook parked from outside about a second after its cell (about when a release once idle comes due),
  # again and again: PARK_LOOP_RUNS runs (default 8), stopping at the first failure, within PARK_LOOP_S seconds
  # (default 420); each run's outcome and figures in park-loop.log, a failure's whole output after them.
  # The kernel runs with tests/gpu/native/crash_backtrace.c preloaded (built here, or carried built as
  # .whl/crash_backtrace.so): a thread that dies of a fatal signal writes its native stack to the kernel's stderr,
  # which the failure's output shows.
  if command -v cc >/dev/null && cc -shared -fPIC -O1 -o /tmp/crash_backtrace.so tests/gpu/native/crash_backtrace.c; then
    export GPUCLEANUP_TEST_CRASH_BACKTRACE=/tmp/crash_backtrace.so
  elif [[ -f .whl/crash_backtrace.so ]]; then
    export GPUCLEANUP_TEST_CRASH_BACKTRACE=$PWD/.whl/crash_backtrace.so
  fi
  echo "park-loop: native stacks on a fatal signal from ${GPUCLEANUP_TEST_CRASH_BACKTRACE:-nothing (no cc, none carried)}" | tee "$out/park-loop.log"
  # PARK_LOOP_TEST: another pytest selection to run again and again instead (e.g. the whole file, whose other
  # kernels park just before the JAX one, as in the suite where the losses came); PARK_LOOP_RUN_S: each run's limit
  jax_command="tests/gpu/test_park_kernel_gpu.py::test_a_notebook_is_parked_to_zero_and_resumed_with_every_byte[jax-command]"
  runs=${PARK_LOOP_RUNS:-8} passed=0 ran=0 loop_end=$((SECONDS + ${PARK_LOOP_S:-420}))
  for ((run = 1; run <= runs && SECONDS < loop_end; run++)); do
    ran=$run
    timeout "${PARK_LOOP_RUN_S:-150}" python3 -m pytest "${PARK_LOOP_TEST:-$jax_command}" \
      -x -q -s -p no:cacheprovider >"$out/park-loop-run.log" 2>&1
    rc=$?
    echo "park-loop run $run: rc $rc; $(grep -h FIGURE "$out/park-loop-run.log" | tr '\n' ' ')" | tee -a "$out/park-loop.log"
    if [[ $rc != 0 ]]; then cat "$out/park-loop-run.log" >>"$out/park-loop.log"; break; fi
    passed=$((passed + 1))
  done
  echo "park-loop: $passed of $ran runs passed" | tee -a "$out/park-loop.log"
  rm -f "$out/park-loop-run.log"
fi
if [[ $stages == *" park-hold "* ]]; then
  # one kernel (gpucleanup loaded by the kernel's config file) parked from outside and resumed again and again
  # (tests/bench/park_loop.py), arm after arm: PARK_HOLD_ARMS is a list of framework:runs:pause:resume:hold[:parked]
  # (pause: seconds idle before the park; resume: cell or outside; hold: on, or off for the control arm without
  # the hold; parked: seconds parked before the resume, default 0; park: outside (gpucleanup park PID, default)
  # or kernel (%gpumem --park, with the hold while parked)), each bounded by PARK_HOLD_ARM_S seconds
  # (default 300); each arm's runs in park-hold-<n>.json, every line in park-hold.log
  if command -v cc >/dev/null && cc -shared -fPIC -O1 -o /tmp/crash_backtrace.so tests/gpu/native/crash_backtrace.c; then
    export GPUCLEANUP_TEST_CRASH_BACKTRACE=/tmp/crash_backtrace.so
  fi
  echo "park-hold: Yama ptrace_scope $(cat /proc/sys/kernel/yama/ptrace_scope 2>/dev/null || echo absent), uid $(id -u)" \
    | tee "$out/park-hold.log"
  n=0
  for arm in ${PARK_HOLD_ARMS:-jax:50:0:cell:on jax:50:2:cell:on}; do
    n=$((n + 1))
    IFS=: read -r framework runs pause resume hold parked park_by <<<"$arm"
    timeout $(( ${PARK_HOLD_ARM_S:-300} + 60 )) python3 tests/bench/park_loop.py --framework "$framework" --runs "$runs" \
      --pause "$pause" --parked "${parked:-0}" --resume "$resume" --hold "$hold" --park "${park_by:-outside}" \
      --budget "${PARK_HOLD_ARM_S:-300}" \
      --json "$out/park-hold-$n.json" 2>&1 | tee -a "$out/park-hold.log"
  done
fi
if [[ $stages == *" park-bench-kernels "* ]]; then
  # a kernel parked and resumed against restarted and set up again: 1, 8, 32 GiB of PyTorch, JAX at its default
  # preallocation (park-kernels-bench.json); at most 9 minutes
  timeout 540 python3 tests/bench/bench_park_kernels.py --json "$out/park-kernels-bench.json" 2>&1 | tee "$out/park-kernels-bench.log"
fi
if [[ $stages == *" reliability "* ]]; then
  # a 500-cell soak with CuPy and PyTorch, and a kernel killed while a drain from outside waits on its GPU
  python3 -m pytest tests/gpu/test_reliability_gpu.py -v -s -p no:cacheprovider 2>&1 | tee "$out/reliability-tests.log"
fi
if [[ $stages == *" memcheck "* ]]; then
  # the GPU suite under compute-sanitizer's memcheck, every process it starts included (the allocation trace's
  # tests left out: CUPTI takes one subscriber, and the sanitizer is one); each process's report is gathered into
  # memcheck.log, and the line "ERROR SUMMARY" of each says how many errors it found. The suite runs at most
  # GPUCLEANUP_MEMCHECK_S seconds (default 480): under memcheck it is many times slower.
  # Then, each in one process of its own under memcheck (no subprocess to follow): 20 cells of CuPy, of CuPy
  # with its stream-ordered pool, and of PyTorch, with gpucleanup's cleanup after every cell
  # (tests/bench/profile_cell.py), each cell's gpucleanup line and the pool at the end printed: memcheck-cells.log.
  # GPUCLEANUP_MEMCHECK_SUITE=0 runs only these.
  sanitizer=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
  if [ "${GPUCLEANUP_MEMCHECK_SUITE:-1}" = 1 ]; then
    mkdir -p /tmp/memcheck && rm -f /tmp/memcheck/*.log
    # kernels are stopped with a shutdown request, the kill only after 120 s: a killed process writes no report
    GPUCLEANUP_SHUTDOWN_WAIT_S=120 timeout "${GPUCLEANUP_MEMCHECK_S:-480}" "$sanitizer" --tool memcheck --target-processes all \
      --log-file /tmp/memcheck/%p.log python3 -m pytest tests/gpu -k "not trace" -v -p no:cacheprovider 2>&1 \
      | tee "$out/memcheck-tests.log"
    for f in /tmp/memcheck/*.log; do echo "== $f"; cat "$f"; done > "$out/memcheck.log" 2>/dev/null
    echo "memcheck: $(ls /tmp/memcheck/*.log 2>/dev/null | wc -l) processes checked; error summaries:" \
      "$(grep -h "ERROR SUMMARY" /tmp/memcheck/*.log 2>/dev/null | sort | uniq -c | tr '\n' ';')" | tee -a "$out/memcheck-tests.log"
  fi
  for scenario in cupy_images cupy_async_pool torch_out; do
    echo "== $scenario under memcheck"
    "$sanitizer" --tool memcheck --leak-check full python3 tests/bench/profile_cell.py "$scenario" --stages --lines --cells 20
    echo "exit status $?"
  done 2>&1 | tee "$out/memcheck-cells.log"
fi
if [[ $stages == *" facts "* ]]; then
  python3 scripts/gpu_facts.py 2>&1 | tee "$out/facts.log"
fi
if [[ $stages == *" bench "* ]]; then
  python3 tests/bench/bench_after_cell.py --json "$out/bench.json" 2>&1 | tee "$out/bench.log"
fi
if [[ $stages == *" demo "* ]]; then
  python3 scripts/demo.py 2>&1 | tee "$out/demo.log"
fi
if [[ $stages == *" stages "* ]]; then
  # the driver's own cost per call (a C++ program: carried prebuilt in .bin/, else built here)
  [[ -x .bin/driver_costs ]] || bash tests/bench/build_driver_costs.sh .bin/driver_costs
  .bin/driver_costs 2000 1000 2>&1 | tee "$out/driver-costs.log"
  for scenario in unused cupy_idle torch_idle torch_out; do
    echo "== $scenario"
    python3 tests/bench/profile_cell.py "$scenario" --stages --primitives --cells 300
  done 2>&1 | tee "$out/stages.log"
fi
if [[ $stages == *" per-cell "* ]]; then
  # an idle cell's cost, three ways (about 4 min): the GPU test that idle cells are skipped; where the time
  # goes in-process (CuPy and PyTorch idle); real kernels side by side, with release "cell" (the default)
  # and "auto" for the pinned re-run
  python3 -m pytest tests/gpu/test_idle_cell_gpu.py -q -p no:cacheprovider 2>&1 | tee "$out/idle-cell-tests.log"
  for scenario in cupy_idle torch_idle; do
    echo "== $scenario"
    python3 tests/bench/profile_cell.py "$scenario" --stages --primitives --cells 300
  done 2>&1 | tee "$out/stages.log"
  python3 tests/bench/bench_kernels.py --scenario cupy-idle,torch-idle,rerun-cupy-pinned \
    --variants bare,gpucleanup,gpucleanup-auto --cells 600 --budget-s 300 --json "$out/per-cell.json" 2>&1 \
    | tee "$out/per-cell.log"
fi
if [[ $stages == *" paired "* ]]; then
  # the per-cell goals measured on and off inside each kernel (tests/bench/bench_paired.py, about 3 min): the
  # default release ("rerun") and "cell", 3 kernels each, so the noise between kernel processes drops out;
  # then the same scenarios side by side in separate kernels (bench_kernels.py, about 3 min)
  python3 tests/bench/bench_paired.py --json "$out/paired.json" 2>&1 | tee "$out/paired.log"
  python3 tests/bench/bench_paired.py --scenario rerun-cupy-pinned --config "GPUCleanup.release = 'cell'" \
    --json "$out/paired-cell.json" 2>&1 | tee "$out/paired-cell.log"
  python3 tests/bench/bench_kernels.py --scenario cupy-idle,torch-idle,rerun-cupy-pinned \
    --variants bare,gpucleanup,gpucleanup-cell --cells 400 --budget-s 240 --json "$out/per-cell.json" 2>&1 \
    | tee "$out/per-cell.log"
fi
if [[ $stages == *" in-process "* ]]; then
  # an idle cell in process on this machine's quiet CPUs (tests/bench/bench_run_cell.py, under a minute): the fake
  # driver, carried in .fake/ (strip -o .fake/tests/fake_cuda/libcuda.so.1 build/tests/fake_cuda/libcuda.so.1, after
  # a build with -DGPUCLEANUP_BUILD_TESTS=ON), under the wheel's package and library
  if [[ -f .fake/tests/fake_cuda/libcuda.so.1 ]]; then
    GPUCLEANUP_BUILD_DIR=$PWD/.fake python3 tests/bench/bench_run_cell.py never device unused --rounds 12 --block 300 \
      --json "$out/in-process.json" 2>&1 | tee "$out/in-process.log"
  else
    echo "in-process: no fake driver carried in .fake/tests/fake_cuda/libcuda.so.1; skipped" | tee "$out/in-process.log"
  fi
fi
if [[ $stages == *" idle-kernels "* ]]; then
  # an idle cell in real kernels, untimed steps (bench_paired.py, CuPy and PyTorch idle, 3 kernels each, about
  # 2 minutes): what the per-cell goal in real kernels is checked against
  python3 tests/bench/bench_paired.py --scenario cupy-idle,torch-idle --cells 400 --json "$out/idle-kernels.json" 2>&1 \
    | tee "$out/idle-kernels.log"
fi
if [[ $stages == *" paired-stages "* ]]; then
  # where an idle cell's added time goes inside each kernel (bench_paired.py --stages, about a minute): the hooks,
  # the rest of the cell, and what lies outside the cell, with the engine's steps timed in the kernel
  python3 tests/bench/bench_paired.py --stages --scenario cupy-idle,torch-idle --cells 300 \
    --json "$out/paired-stages.json" 2>&1 | tee "$out/paired-stages.log"
fi
if [[ $stages == *" paired-ab "* ]]; then
  # this build (the carried wheel's native library with this working tree's Python) against a baseline on the
  # same machine (about 4 min; PAIRED_ROUNDS rounds, default 2): .whl/baseline/ holds the baseline's
  # gpucleanup wheel and, optionally, gpucleanup-src-<commit>.tar (git archive <commit> ipython_ext/gpucleanup,
  # put over that wheel's Python). Each round runs bench_paired.py for CuPy and PyTorch idle with the
  # baseline, then with this build (added = on minus off within each kernel): paired-ab.log, paired-ab-json.tar;
  # before them, each build once with its steps timed in the kernels: paired-ab-stages-{baseline,this}.log
  base=/tmp/site-base
  cp -r ipython_ext/gpucleanup/. /tmp/site/gpucleanup/
  rm -rf "$base" && mkdir -p "$base"
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$base" .whl/baseline/gpucleanup-*.whl
  for tar in .whl/baseline/gpucleanup-src-*.tar; do
    [ -f "$tar" ] && tar -xf "$tar" --strip-components=1 -C "$base" && echo "baseline Python: $tar"
  done 2>&1 | tee "$out/paired-ab.log"
  # where each build's idle cell spends its time inside the kernels (the steps timed, about 40 s a build)
  for build in baseline this; do
    path=$PYTHONPATH
    [ "$build" = baseline ] && path=$base:$PYTHONPATH
    PYTHONPATH=$path python3 tests/bench/bench_paired.py --stages --scenario cupy-idle,torch-idle --cells 300 \
      --json "/tmp/paired-ab-stages-$build.json" >"$out/paired-ab-stages-$build.log" 2>&1
  done
  # PAIRED_ROUNDS rounds (default 2, about 70 s each); the figures of every round in one tar, paired-ab-json.tar
  # (a GPU run brings back at most 8 files)
  rm -rf /tmp/paired-ab-json && mkdir -p /tmp/paired-ab-json
  for round in $(seq 1 "${PAIRED_ROUNDS:-2}"); do
    for build in baseline this; do
      path=$PYTHONPATH
      [ "$build" = baseline ] && path=$base:$PYTHONPATH
      PYTHONPATH=$path python3 -c "import gpucleanup._native as n; print('$build:', n.library_path(), 'quiet check:', hasattr(n, 'quiet'))"
      echo "== round $round, $build"
      PYTHONPATH=$path python3 tests/bench/bench_paired.py --scenario cupy-idle,torch-idle --cells 300 \
        --json "/tmp/paired-ab-json/paired-ab-$build-$round.json"
    done
  done 2>&1 | tee -a "$out/paired-ab.log"
  tar -cf "$out/paired-ab-json.tar" -C /tmp/paired-ab-json .
  # the hooks of an idle cell in process, with and without the idle proof, each build (bench_idle_proof.py,
  # about 20 s a build): PyTorch and CuPy idle, and a device in use with no framework on the fake driver
  for build in baseline this; do
    path=$PYTHONPATH
    [ "$build" = baseline ] && path=$base:$PYTHONPATH
    echo "== idle proof, $build"
    PYTHONPATH=$path python3 tests/bench/bench_idle_proof.py torch_idle cupy_idle --rounds 10 --block 500 \
      --json "/tmp/idle-proof-$build.json"
  done 2>&1 | tee "$out/idle-proof-ab.log"
fi
if [[ $stages == *" kernels-focus "* ]]; then
  # the per-cell headline scenarios again with 600 timed cells per variant (about 4 min): the
  # kernel-level figures of an idle cell move by +-0.2 ms from one machine to the next
  python3 tests/bench/bench_kernels.py --scenario cuda-unused,torch-idle,cupy-idle,long-session --cells 600 \
    --budget-s 420 --json "$out/kernels-focus.json" 2>&1 | tee "$out/kernels-focus.log"
fi
if [[ $stages == *" kernels "* ]]; then
  # what the extension does per cell (calls, JSON, threads, walks), then the per-cell cost in real kernels,
  # every variant side by side (about 7.5 min; no scenario starts after 420 s, so the stage stays under 10 min)
  start=$SECONDS
  python3 tests/bench/kernel_calls.py --json "$out/kernel-calls.json" 2>&1 | tee "$out/kernel-calls.log"
  echo "gpu_run: kernel_calls took $((SECONDS - start)) s" | tee -a "$out/kernel-calls.log"
  start=$SECONDS
  python3 tests/bench/bench_kernels.py --budget-s 420 --json "$out/kernels.json" 2>&1 | tee "$out/kernels.log"
  echo "gpu_run: bench_kernels took $((SECONDS - start)) s" | tee -a "$out/kernels.log"
fi
