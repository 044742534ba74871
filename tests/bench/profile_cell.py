"""Where the per-cell time of gpucleanup goes: cProfile of the after-cell path for one scenario.

Runs a scenario of bench_after_cell.py (same setup and cell) in this process with
%load_ext gpucleanup, warms up, then profiles N cells and prints the functions with
the largest cumulative time, plus the wall time of the hooks alone (pre_run_cell and
post_run_cell, timed by wrapping them).

Usage: python tests/bench/profile_cell.py SCENARIO [--cells N] [--top K]
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import pathlib
import pstats
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_after_cell import SCENARIOS  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("scenario", choices=sorted(SCENARIOS))
    parser.add_argument("--cells", type=int, default=20)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--filter", default=r"gpucleanup|cupy|torch|zmq|ctypes",
                        help="regular expression on the profile's file/function names ('.' for everything)")
    parser.add_argument("--bare", action="store_true", help="do not load gpucleanup (the baseline)")
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
    if not args.bare:
        run("%load_ext gpucleanup")
        _time_hooks(shell, hook_times)
    cell_times = []
    for _ in range(3):
        run(spec["cell"])
    for times in hook_times.values():
        times.clear()
    for _ in range(args.cells):  # timed without the profiler
        t0 = time.perf_counter()
        run(spec["cell"])
        cell_times.append((time.perf_counter() - t0) * 1e3)
    print(f"run_cell: median {statistics.median(cell_times):.3f} ms over {len(cell_times)} cells")
    for name, times in hook_times.items():
        if times:
            print(f"{name}: median {statistics.median(times):.3f} ms, max {max(times):.3f} ms over {len(times)} cells")
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(args.cells):
        run(spec["cell"])
    profile.disable()
    print("last summary line:", next((l for l in reversed(sink.getvalue().splitlines()) if l.startswith("gpucleanup")), None))
    stats = pstats.Stats(profile, stream=sys.stdout)
    stats.sort_stats("cumulative").print_stats(args.filter, args.top)
    return 0


def _time_hooks(shell, hook_times: dict) -> None:
    """Wraps the extension's registered hooks to time them."""
    from gpucleanup import extension

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
