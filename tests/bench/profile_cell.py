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
    run("%load_ext gpucleanup")
    from gpucleanup import extension

    ext = extension.get_extension(shell)
    hook_times = {"pre_run_cell": [], "post_run_cell": []}
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
        callbacks[callbacks.index(original)] = timed

    for _ in range(3):
        run(spec["cell"])
    for times in hook_times.values():
        times.clear()
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(args.cells):
        run(spec["cell"])
    profile.disable()
    for name, times in hook_times.items():
        print(f"{name}: median {statistics.median(times):.3f} ms, max {max(times):.3f} ms over {len(times)} cells")
    print("last summary line:", next((l for l in reversed(sink.getvalue().splitlines()) if l.startswith("gpucleanup")), None))
    stats = pstats.Stats(profile, stream=sys.stdout)
    stats.sort_stats("cumulative").print_stats(r"gpucleanup|cupy|torch|zmq|ctypes", args.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
