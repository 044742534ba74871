#!/usr/bin/env python3
"""What gpucleanup adds to a whole idle cell in process, on the fake CUDA driver: ``shell.run_cell`` on and off.

Method: an IPython shell in this process (no kernel, no messages), the fake driver (tests/fake_cuda) scripted with
one 80 GiB device, and no framework. Scenarios: ``device`` (the process has a context on it: every cell takes the
quiet check), ``unused`` (the driver initialised, no context: the library's quiet check of an unused driver) and
``never`` (nothing initialised the driver: the one-call path of a kernel that never used CUDA). Rounds: a block of
``--block`` cells ``x = 1`` with gpucleanup loaded and one with it unloaded, in alternating order (on first in even
rounds), each after 20 untimed cells. Per state the median over the rounds of each block's mean; added = median(on)
- median(off). The cell's own work is in both, so the difference is what the hooks and IPython's calls of them
cost. In ``unused`` a third state, ``whole``, interleaved with the two: gpucleanup loaded with the library's quiet
check of an unused driver turned off (``CellPass.still_unused``), so that each cell runs the whole native pass as
before that check existed.

Each block is also timed in process CPU time (``time.process_time``): under load the wall-clock figures grow with
the share of the CPU the process gets, the CPU figures much less. With gpucleanup loaded, its two hooks are timed where
they run, inside ``run_cell`` (a wrapper around each, about 0.1 us a call of its own): ``hooks_us``. What the cell
adds beyond them (``added - hooks``) is time IPython's own steps take longer when the hooks ran between them.

Usage: python tests/bench/bench_run_cell.py [device|unused|never ...] [--rounds N] [--block N] [--json PATH]
(GPUCLEANUP_BUILD_DIR selects the build tree whose fake driver and library are used, default build/)
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import subprocess
import sys
import time

GIB = 1 << 30
SCENARIOS = {
    "device": {"devices": [{"total_bytes": 80 * GIB, "free_bytes": 78 * GIB, "primary_active": True}]},
    "unused": {"devices": [{"total_bytes": 80 * GIB, "free_bytes": 80 * GIB, "primary_active": False}]},
    "never": {"initialized": False,
              "devices": [{"total_bytes": 80 * GIB, "free_bytes": 80 * GIB, "primary_active": False}]},
}


def run(scenario: str, rounds: int, block: int) -> dict:
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
    import fake_driver  # tests/bench/fake_driver.py

    fake_driver.use(SCENARIOS[scenario])
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()

    try:
        from gpucleanup.engine.cell_pass import CellPass
    except ImportError:  # a build before the package's folders (an A/B against an older commit)
        from gpucleanup.cell_pass import CellPass

    quiet_unused = getattr(CellPass, "still_unused", None)  # None: a build before the unused driver's quiet check

    in_hooks = [0.0]
    wrapped_hooks: dict = {}  # wrapper -> the callback it times

    def time_hooks(on: bool) -> None:
        """Wraps gpucleanup's own pre_run_cell and post_run_cell callbacks (load_ext registers them again), or
        puts them back (on False), so that unload_ext finds what it unregisters."""
        for event in ("pre_run_cell", "post_run_cell"):
            callbacks = shell.events.callbacks[event]
            for i, callback in enumerate(callbacks):
                if not on:
                    callbacks[i] = wrapped_hooks.pop(callback, callback)
                elif type(getattr(callback, "__self__", None)).__name__ == "GPUCleanup":
                    def wrapped(*args, _callback=callback):
                        start = time.perf_counter()
                        try:
                            _callback(*args)
                        finally:
                            in_hooks[0] += time.perf_counter() - start
                    callbacks[i] = wrapped
                    wrapped_hooks[wrapped] = callback

    def timed(on: bool, whole: bool = False) -> tuple:
        if quiet_unused is not None:
            CellPass.still_unused = (lambda self: False) if whole else quiet_unused
        time_hooks(False)
        shell.run_line_magic("load_ext" if on else "unload_ext", "gpucleanup")
        if on:
            time_hooks(True)
        for _ in range(20):
            shell.run_cell("x = 1", store_history=True)
        in_hooks[0] = 0.0
        start, start_cpu = time.perf_counter(), time.process_time()
        for _ in range(block):
            result = shell.run_cell("x = 1", store_history=True)
            if not result.success:
                raise SystemExit(f"bench_run_cell: a cell failed: {result.error_in_exec!r}")
        return ((time.perf_counter() - start) / block * 1e3, (time.process_time() - start_cpu) / block * 1e3,
                in_hooks[0] / block * 1e6)

    states = ["on", "off"] + (["whole"] if scenario == "unused" else [])
    times: dict = {state: [] for state in states}
    cpu: dict = {state: [] for state in states}
    hooks: list = []
    for r in range(rounds):
        for state in states[r % len(states):] + states[:r % len(states)]:
            wall, cpu_ms, hooks_us = timed(state != "off", state == "whole")
            times[state].append(wall)
            cpu[state].append(cpu_ms)
            if state == "on":
                hooks.append(hooks_us)
    if quiet_unused is not None:
        CellPass.still_unused = quiet_unused
    on_med, off_med = statistics.median(times["on"]), statistics.median(times["off"])
    on_cpu, off_cpu = statistics.median(cpu["on"]), statistics.median(cpu["off"])
    out = {"scenario": scenario, "rounds": rounds, "block": block, "on_ms": times["on"], "off_ms": times["off"],
           "on_median_ms": on_med, "off_median_ms": off_med, "added_ms": on_med - off_med, "ratio": on_med / off_med,
           "on_cpu_ms": cpu["on"], "off_cpu_ms": cpu["off"], "added_cpu_ms": on_cpu - off_cpu,
           "hooks_us": hooks, "hooks_median_us": statistics.median(hooks)}
    if "whole" in times:
        whole_med = statistics.median(times["whole"])
        out.update(whole_ms=times["whole"], whole_median_ms=whole_med, whole_added_ms=whole_med - off_med)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("scenario", nargs="*", help=f"of {sorted(SCENARIOS)} (default: all)")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--block", type=int, default=300)
    parser.add_argument("--json", type=pathlib.Path)
    args = parser.parse_args()
    args.scenario = args.scenario or list(SCENARIOS)
    unknown = [s for s in args.scenario if s not in SCENARIOS]
    if unknown:
        parser.error(f"unknown scenario {unknown[0]!r}: choose from {', '.join(SCENARIOS)}")
    if len(args.scenario) != 1:  # one shell per process: each scenario in a process of its own
        out = []
        for scenario in args.scenario:
            cmd = [sys.executable, __file__, scenario, "--rounds", str(args.rounds), "--block", str(args.block),
                   "--json", "/dev/stdout"]
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0:
                sys.stderr.write(done.stdout[-4000:] + done.stderr[-4000:])
                print(f"bench_run_cell: {scenario} failed (exit {done.returncode})")
                return 1
            out.append(json.loads(done.stdout.strip().splitlines()[-1]))
    else:
        out = [run(args.scenario[0], args.rounds, args.block)]
    for r in out:
        print(f"{r['scenario']:8s} run_cell per idle cell: on {r['on_median_ms']:.3f} ms, off {r['off_median_ms']:.3f} ms: "
              f"added {r['added_ms']:+.3f} ms, {r['ratio']:.2f}x ({r['rounds']} rounds of {r['block']} cells each); "
              f"CPU time added {r['added_cpu_ms']:+.3f} ms; the hooks where they run {r['hooks_median_us']:.1f} us, "
              f"the rest of the cell {r['added_ms'] * 1e3 - r['hooks_median_us']:+.1f} us"
              + (f"; the whole pass each cell instead: {r['whole_median_ms']:.3f} ms, added "
                 f"{r['whole_added_ms']:+.3f} ms" if "whole_median_ms" in r else ""),
              file=sys.stderr if str(args.json) == "/dev/stdout" else sys.stdout)
    if args.json:
        with open(args.json, "w") as f:
            f.write(json.dumps(out if len(out) > 1 else out[0]) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
