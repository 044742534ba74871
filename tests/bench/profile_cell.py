"""Where the per-cell time of gpucleanup goes: cProfile of the after-cell path for one scenario.

Runs a scenario of bench_after_cell.py (same setup and cell) in this process with
%load_ext gpucleanup, warms up, then profiles N cells and prints the functions with
the largest cumulative time, plus the wall time of the hooks alone (pre_run_cell and
post_run_cell, timed by wrapping them).

With ``--stages`` it times, instead of profiling, each step of the after-cell path
(the engine's steps, the adapters' verbs, the native calls, the record's conversion,
the status endpoint) by wrapping them, and prints the median microseconds each adds
per cell: inclusive times, so a step's figure contains the steps it calls. With
``--primitives`` it times single calls the steps are made of (a framework's memory
statistics, ``gc.collect``, a native pass) in the cell's namespace after the setup.

With ``--lines`` it prints each timed cell's gpucleanup lines and, at the end, what the
framework's pool still holds (scripts/gpu_run.sh memcheck: what the cleanup did under the sanitizer).

Usage: python tests/bench/profile_cell.py SCENARIO [--cells N] [--top K] [--stages] [--primitives] [--lines] [--bare]
       [--config LINE ...]
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import functools
import io
import pathlib
import pstats
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_after_cell import SCENARIOS as _BENCH_SCENARIOS  # noqa: E402

# In-process counterparts of bench_kernels.py's "nothing to free" scenarios.
SCENARIOS = dict(_BENCH_SCENARIOS)
SCENARIOS.update({
    "unused": dict(needs=None, setup="x = 0", cell="x += 1"),
    "torch_idle": dict(needs="torch", setup=(
        "import torch\nw = torch.ones(1 << 20, device='cuda')\nloss = float((w * 2).sum())\ntorch.cuda.synchronize()"),
        cell="x = 1"),
    "cupy_idle": dict(needs="cupy", setup=(
        "import cupy as cp\nw = cp.ones(1 << 20)\ncp.cuda.Device(0).synchronize()"), cell="x = 1"),
    # PyTorch idle on two GPUs (the per-cell cost with two devices in use, against torch_idle's one)
    "torch_idle_2gpu": dict(needs="torch", setup=(
        "import torch\nw0 = torch.ones(1 << 20, device='cuda:0')\nw1 = torch.ones(1 << 20, device='cuda:1')\n"
        "torch.cuda.synchronize(0)\ntorch.cuda.synchronize(1)"), cell="x = 1"),
    # bench_kernels.py's rerun-cupy-pinned: 64 MiB staged through pinned memory, freed, re-run back to back
    "cupy_pinned_rerun": dict(needs="cupy", setup="import cupy as cp, cupyx, numpy as np", cell=(
        "_h = cupyx.empty_pinned((16 << 20,), dtype=np.float32)\n_h[:] = 1.0\n_d = cp.asarray(_h)\n"
        "s = float(_d.sum())\ndel _h, _d")),
    # each cell's last expression is a CUDA tensor: it stays in Out[N], and the holder check reads it
    "torch_out": dict(needs="torch", setup=(
        "import torch\nw = torch.ones(1 << 20, device='cuda')\ntorch.cuda.synchronize()"), cell="w"),
})

# (module, attribute path) of what --stages times, outermost first.
STAGES = [
    ("gpucleanup.in_kernel.extension", "GPUCleanup.pre_run_cell"),
    ("gpucleanup.in_kernel.extension", "GPUCleanup.post_run_cell"),
    ("gpucleanup.in_kernel.endpoint_link", "EndpointLink.say"),
    ("gpucleanup.in_kernel.endpoint_link", "EndpointLink.cell_state"),
    ("gpucleanup.in_kernel.extension", "GPUCleanup.settings"),
    ("gpucleanup.engine.after_cell", "AfterCell.run"),
    ("gpucleanup.engine.cell_pass", "CellPass.__init__"),
    ("gpucleanup.engine.cell_pass", "CellPass.nothing_initialised"),
    ("gpucleanup.engine.cell_pass", "CellPass.proven_idle"),
    ("gpucleanup.engine.quiet_check", "QuietCheck.look"),
    ("gpucleanup.engine.quiet_check", "IdleProof.stands"),
    ("gpucleanup.engine.cell_pass", "CellPass.collect"),
    ("gpucleanup.engine.cell_pass", "CellPass._early_figures"),
    ("gpucleanup.engine.cell_pass", "CellPass.unchanged"),
    ("gpucleanup.engine.cell_pass", "CellPass.nothing_new"),
    ("gpucleanup.engine.cell_pass", "CellPass.unchanged_outcome"),
    ("gpucleanup.engine.releases", "Releases.cell_starts"),
    ("gpucleanup.engine.releases", "Releases.cell_ends"),
    ("gpucleanup.engine.cell_pass", "CellPass.probe"),
    ("gpucleanup.engine.cell_pass", "CellPass.clean"),
    ("gpucleanup.engine.cell_pass", "CellPass.drain"),
    ("gpucleanup.engine.cell_pass", "CellPass.trim"),
    ("gpucleanup.engine.cell_pass", "CellPass.snapshot"),
    ("gpucleanup.engine.cell_pass", "CellPass.release_pinned"),
    ("gpucleanup.engine.cell_pass", "CellPass.record"),
    ("gpucleanup.engine.cell_pass", "CellPass.remember"),
    ("gpucleanup.engine.releases", "Releases.start_pinned"),
    ("gpucleanup.engine.releases", "Releases.defer"),
    ("gpucleanup.in_kernel.extension", "GPUCleanup._say"),
    ("gpucleanup.in_kernel.extension", "GPUCleanup.cleanup"),
    ("gpucleanup.engine.cell_pass", "CellPass.native_pass"),
    ("gpucleanup.engine.cell_pass", "CellPass.settle"),
    ("gpucleanup.engine.figures", "FrameworkReader.adapters"),
    ("gpucleanup.engine.quiet_check", "QuietCheck.adapters_in_use"),
    ("gpucleanup.engine.figures", "FrameworkReader.stats"),
    ("gpucleanup.engine.cell_pass", "CellPass.collect_garbage"),
    ("gpucleanup.engine.cell_pass", "CellPass.drain_frameworks"),
    ("gpucleanup.engine.cell_pass", "CellPass.pinned_candidates"),
    ("gpucleanup.engine.cell_pass", "CellPass.trim_pools"),
    ("gpucleanup.engine.cell_pass", "CellPass.outcome"),
    ("gpucleanup.engine.since_last_pass", "GpuHolders.update"),
    ("gpucleanup.in_kernel.holders", "held_after_cell"),
    ("gpucleanup.records.record", "CellRecord.to_dict"),
    ("gpucleanup.records.report", "summary_lines"),
    ("gpucleanup.records.report", "CellVoice.summary"),
    ("gpucleanup.records.history", "History.append"),
    ("gpucleanup.in_kernel.status_endpoint", "StatusEndpoint.set_state"),
    ("gpucleanup.in_kernel.status_endpoint", "StatusEndpoint.cell_state"),
    ("gpucleanup.in_kernel.status_endpoint", "StatusEndpoint.publish"),
    ("gpucleanup._native", "after_cell"),
    ("gpucleanup._native", "quiet"),
    ("gpucleanup._native", "cuda_initialized"),
    ("gpucleanup._native", "server_state"),
    ("gpucleanup._native", "server_parked"),
    ("gpucleanup._native", "server_cell"),
    ("gpucleanup.park.kernel_side", "InKernel.resume_before_cell"),
    ("gpucleanup.park.kernel_side", "InKernel.arm"),
    ("gpucleanup.in_kernel.extension", "GPUCleanup._say_idle"),
    ("gpucleanup.in_kernel.extension", "GPUCleanup._wait_for_outside_drain"),
    ("gpucleanup._native", "trim"),
    ("gpucleanup._native", "snapshot"),
    ("gpucleanup._native", "server_set_state"),
    ("gpucleanup._native", "server_publish"),
    ("gpucleanup.frameworks.base", "Adapter.stats"),
    ("gpucleanup.frameworks.base", "Adapter.drain"),
    ("gpucleanup.frameworks.base", "Adapter.drain_pinned"),
    ("gpucleanup.frameworks.base", "Adapter.in_use"),
    ("gpucleanup.frameworks.base", "Adapter.quiet_token"),
    ("gpucleanup.frameworks", "active"),
    ("gpucleanup.frameworks.cupy", "CupyAdapter._stats"),
    ("gpucleanup.frameworks.cupy", "CupyAdapter._pinned_stats"),
    ("gpucleanup.frameworks.cupy", "CupyAdapter._quiet_token"),
    ("gpucleanup.frameworks.torch", "TorchAdapter._stats"),
    ("gpucleanup.frameworks.torch", "TorchAdapter._pinned_stats"),
    ("gpucleanup.engine.figures", "FrameworkFigures.read"),
    ("gpucleanup.park.kernel_side", "InKernel.parked"),
    ("gc", "collect"),
]

# Single calls timed by --primitives, per framework the scenario needs (None: always).
PRIMITIVES = {
    None: [
        "gc.collect(0)", "gc.collect(1)",
        "gpucleanup._native.probe()",
        "gpucleanup._native.after_cell(timeout=1.0)",
        "gpucleanup.frameworks.active()",
    ],
    "torch": [
        "torch.cuda.is_initialized()",
        "torch.cuda.memory_allocated(0)",
        "torch.cuda.memory_reserved(0)",
        "torch.cuda.memory_stats_as_nested_dict(0)",
        "torch.cuda.memory.host_memory_stats()",
        "torch.cuda.get_allocator_backend()",
        "torch.cuda.empty_cache()",
        "torch.cuda.ipc_collect()",
    ],
    "cupy": [
        "cp.get_default_memory_pool().used_bytes()",
        "cp.get_default_memory_pool().total_bytes()",
        "cp.get_default_pinned_memory_pool().n_free_blocks()",
        "cp.get_default_memory_pool().free_all_blocks()",
    ],
}


# what the framework's pool holds (bytes), for --lines
POOLS = {
    "cupy": "cp.get_default_memory_pool().total_bytes()",
    "torch": "torch.cuda.memory_reserved()",
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("scenario", choices=sorted(SCENARIOS))
    parser.add_argument("--cells", type=int, default=20)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--filter", default=r"gpucleanup|cupy|torch|zmq|ctypes",
                        help="regular expression on the profile's file/function names ('.' for everything)")
    parser.add_argument("--bare", action="store_true", help="do not load gpucleanup (the baseline)")
    parser.add_argument("--config", action="append", default=[], metavar="LINE",
                        help="a %%config line run before loading gpucleanup (e.g. \"GPUCleanup.release = 'idle'\")")
    parser.add_argument("--stages", action="store_true", help="median microseconds per cell of each step, no profiler")
    parser.add_argument("--primitives", action="store_true", help="time single calls the steps are made of")
    parser.add_argument("--lines", action="store_true",
                        help="print each timed cell's gpucleanup lines, and the framework's pool at the end")
    args = parser.parse_args()

    from IPython.core.interactiveshell import InteractiveShell

    spec = SCENARIOS[args.scenario]
    shell = InteractiveShell.instance()
    sink = io.StringIO()

    def run(code: str) -> None:
        with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
            result = shell.run_cell(code, store_history=True)
        if result.error_before_exec or result.error_in_exec:
            raise SystemExit(f"cell failed: {result.error_before_exec or result.error_in_exec!r}\n{sink.getvalue()}")

    run(spec["setup"])
    hook_times: dict = {"pre_run_cell": [], "post_run_cell": []}
    # wrapped before loading, so that what the extension looks up once is the timed one
    stage_times = _time_stages(args.cells) if args.stages and not args.bare else None
    if not args.bare:
        for line in args.config:
            run(f"%config {line}")
        run("%load_ext gpucleanup")
        _time_hooks(shell, hook_times)
    cell_times = []
    for _ in range(3):
        run(spec["cell"])
    for times in hook_times.values():
        times.clear()
    for _ in range(args.cells):  # timed without the profiler (with --stages: with the timers)
        if stage_times is not None:
            stage_times["_counter"]["cell"] += 1
        seen = len(sink.getvalue())
        t0 = time.perf_counter()
        run(spec["cell"])
        cell_times.append((time.perf_counter() - t0) * 1e3)
        if args.lines:
            for line in sink.getvalue()[seen:].splitlines():
                if line.startswith("gpucleanup"):
                    print(f"cell {len(cell_times)}: {line}")
    if args.lines and spec.get("needs") in POOLS:
        print(f"pool at the end: {POOLS[spec['needs']]} = {shell.ev(POOLS[spec['needs']])}")
    print(f"run_cell: median {statistics.median(cell_times):.3f} ms over {len(cell_times)} cells")
    for name, times in hook_times.items():
        if times:
            print(f"{name}: median {statistics.median(times):.3f} ms, max {max(times):.3f} ms over {len(times)} cells")
    if stage_times is not None:
        _print_stages(stage_times, args.cells)
    if args.primitives:
        _time_primitives(shell, spec.get("needs"))
    if args.stages or args.primitives:
        return 0
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(args.cells):
        run(spec["cell"])
    profile.disable()
    print("last summary line:", next((l for l in reversed(sink.getvalue().splitlines()) if l.startswith("gpucleanup")), None))
    stats = pstats.Stats(profile, stream=sys.stdout)
    stats.sort_stats("cumulative").print_stats(args.filter, args.top)
    return 0


def _time_stages(cells: int) -> dict:
    """Wraps every step of STAGES that exists with a timer; returns {name: [(cell, µs)]}, filled as cells run."""
    import importlib

    times: dict = {}
    counter = {"cell": 0}
    for module_name, path in STAGES:
        try:
            owner = importlib.import_module(module_name)
        except ImportError:
            continue
        *parents, attr = path.split(".")
        for parent in parents:
            owner = getattr(owner, parent, None)
        original = getattr(owner, attr, None) if owner is not None else None
        if original is None or not callable(original):
            continue
        label = f"{module_name.rsplit('.', 1)[-1]}.{path}"
        times[label] = []

        @functools.wraps(original)  # keeps __module__: bench_paired tells gpucleanup's hooks by it
        def timed(*a, _original=original, _label=label, **k):
            t0 = time.perf_counter_ns()
            try:
                return _original(*a, **k)
            finally:
                times[_label].append((counter["cell"], (time.perf_counter_ns() - t0) / 1e3))

        setattr(owner, attr, timed)
    times["_counter"] = counter
    return times


def stage_rows(times: dict, cells) -> list:
    """(median, max, calls per cell, label) of each step over ``cells`` (cell numbers), largest first: the
    step's summed time in each cell, 0 in a cell where it did not run; a step that ran in none is left out.
    Also what tests/bench/kernel_probe.py reports from inside a kernel."""
    cells = list(cells)
    wanted = set(cells)
    rows = []
    for label, samples in times.items():
        if label == "_counter":
            continue
        per_cell: dict = {}
        calls = 0
        for cell, us in samples:
            if cell in wanted:
                per_cell[cell] = per_cell.get(cell, 0.0) + us
                calls += 1
        if per_cell:
            values = [per_cell.get(c, 0.0) for c in cells]
            rows.append((statistics.median(values), max(values), calls / len(cells), label))
    return sorted(rows, reverse=True)


def _print_stages(times: dict, cells: int) -> None:
    """Median over cells of each step's summed time in a cell (0 for a cell where it did not run)."""
    counter = times["_counter"]
    print(f"per-stage: median µs per cell (inclusive) and calls per cell, over {cells} cells")
    for median, worst, n, label in stage_rows(times, range(1, counter["cell"] + 1)):
        print(f"  {median:9.1f} µs  (max {worst:9.1f})  {n:5.2f} calls  {label}")


def _time_primitives(shell, needs) -> None:
    import timeit

    print("primitives: median µs per call over 5 rounds of 200 calls")
    namespace = dict(shell.user_ns)
    exec("import gc, gpucleanup, gpucleanup._native, gpucleanup.frameworks", namespace)
    for expression in PRIMITIVES[None] + (PRIMITIVES.get(needs, []) if needs else []):
        try:
            runs = timeit.repeat(expression, globals=namespace, number=200, repeat=5)
        except Exception as exc:
            print(f"  {'-':>9}      {expression}: {type(exc).__name__}: {exc}")
            continue
        print(f"  {statistics.median(runs) / 200 * 1e6:9.1f} µs  {expression}")


def _time_hooks(shell, hook_times: dict) -> None:
    """Wraps the extension's registered hooks to time them."""
    from gpucleanup.in_kernel import extension

    ext = extension.get_extension(shell)
    for name in hook_times:
        original = getattr(ext, name)

        def timed(*a, _original=original, _name=name, **k):
            t0 = time.perf_counter()
            try:
                return _original(*a, **k)
            finally:
                hook_times[_name].append((time.perf_counter() - t0) * 1e3)

        # the registered callbacks are bound methods of ext: swap them in the event registry
        callbacks = shell.events.callbacks[name]
        if original not in callbacks:  # no driver here: gpucleanup registered no hooks
            print(f"profile_cell: gpucleanup registered no {name} hook (no CUDA driver?): not timed")
            continue
        callbacks[callbacks.index(original)] = timed


if __name__ == "__main__":
    sys.exit(main())
