#!/usr/bin/env python3
"""What an idle cell costs while a Python thread of the kernel's is busy (a data loader, a training loop started from
a cell, a progress monitor), gpucleanup loaded and not, on the fake CUDA driver.

Python hands its interpreter lock to a waiting thread when the running one gives it up (a blocking call such as
``os.stat``) or after the switch interval (5 ms); a busy thread is always waiting. A hook that gives the lock up
lets the busy thread run up to a whole interval before the cell goes on. Method: an ``InteractiveShell`` in this
process, the scenario of ``bench_run_cell.py`` (``device``: a context on the device; ``never``: nothing initialised
the driver), 100 untimed cells ``x = 1``, then a thread that counts in a loop, 5 more untimed cells and N timed ones,
each timed alone; ``off`` and ``on`` each in a process of its own, ``--runs`` times, alternated. The mean is what
the waits cost; the median is a cell that did not wait.

Usage: python tests/bench/bench_busy_thread.py [device|never] [--cells N] [--runs N]
(PYTHONPATH selects the package; GPUCLEANUP_BUILD_DIR the build tree whose fake driver and library are used)
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import subprocess
import sys
import threading
import time


def timed(scenario: str, loaded: bool, cells: int) -> dict:
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
    import fake_driver  # tests/bench/fake_driver.py
    from bench_run_cell import SCENARIOS

    fake_driver.use(SCENARIOS[scenario])
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    if loaded:
        shell.run_line_magic("load_ext", "gpucleanup")
    for _ in range(100):
        shell.run_cell("x = 1", store_history=True)
    stop = threading.Event()

    def busy() -> None:
        n = 0
        while not stop.is_set():
            n += 1

    thread = threading.Thread(target=busy, daemon=True)
    thread.start()
    times = []
    try:
        for _ in range(5):
            shell.run_cell("x = 1", store_history=True)
        for _ in range(cells):
            start = time.perf_counter()
            shell.run_cell("x = 1", store_history=True)
            times.append(time.perf_counter() - start)
    finally:
        stop.set()
        thread.join(10)
    return {"mean_ms": statistics.mean(times) * 1e3, "median_ms": statistics.median(times) * 1e3}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("scenario", nargs="?", default="device", choices=["device", "never"])
    parser.add_argument("--cells", type=int, default=400)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--one", choices=["on", "off"], help=argparse.SUPPRESS)  # a child process's own run
    args = parser.parse_args()
    if args.one:
        print(json.dumps(timed(args.scenario, args.one == "on", args.cells)))
        return 0
    found: dict = {"off": [], "on": []}
    for _ in range(args.runs):
        for mode in ("off", "on"):
            done = subprocess.run([sys.executable, __file__, args.scenario, "--cells", str(args.cells), "--one", mode],
                                  capture_output=True, text=True)
            if done.returncode != 0:
                sys.stderr.write(done.stdout[-4000:] + done.stderr[-4000:])
                print(f"bench_busy_thread: {mode} failed (exit {done.returncode})")
                return 1
            found[mode].append(json.loads(done.stdout.strip().splitlines()[-1]))
    for mode in ("off", "on"):
        print(f"{args.scenario} {mode:3s} per cell with a busy thread, {args.runs} runs of {args.cells}: mean "
              + ", ".join(f"{r['mean_ms']:.2f}" for r in found[mode]) + " ms; median "
              + ", ".join(f"{r['median_ms']:.3f}" for r in found[mode]) + " ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
