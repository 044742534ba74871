"""Side-by-side benchmark: gpucleanup after every cell vs the cleanup code people paste.

Each scenario runs in a fresh Python process (so CUDA state never leaks from one
to the next) with an IPython InteractiveShell, and runs the same cells twice:

  pasted      the cell's code followed by the usual boilerplate
              (pool.free_all_blocks(), pinned.free_all_blocks(),
              torch.cuda.empty_cache(), gc.collect()), no extension loaded
  gpucleanup  the cell's code alone, with %load_ext gpucleanup
  bare        the cell's code alone, nothing loaded (what the cell costs by itself)

For each it records how long the cell takes to return (run_cell wall time,
the hooks included), the device's free memory after the cell, and the pinned
host pool right after the cell and once background frees have finished.
Results are quoted as ratios (gpucleanup / pasted) in BENCHMARKS.md.

Scenarios that need a GPU framework are skipped (and say so) where it is
absent; "idle" runs anywhere and measures the per-cell cost when nothing uses
CUDA.

Usage: python tests/bench/bench_after_cell.py [--json out.json] [--cells N] [--only NAME]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import textwrap

GiB = 1 << 30

# Each scenario: setup code (run once, untimed), the cell (timed, N times), the
# boilerplate a user pastes after it, and a probe that returns memory figures.
SCENARIOS = {
    "idle": dict(
        needs=None,
        setup="x = 0",
        cell="x += 1",
        pasted="import gc; gc.collect()",
        probe="{}",
    ),
    "idle_big_heap": dict(
        needs=None,
        setup="heap = [[i] for i in range(3_000_000)]",
        cell="x = sum(range(1000))",
        pasted="import gc; gc.collect()",
        probe="{}",
    ),
    "cupy_images": dict(
        needs="cupy",
        setup=textwrap.dedent(
            """
            import cupy as cp, cupyx
            images = cp.random.rand(16, 2048, 2048, dtype=cp.float32)
            cp.cuda.Device(0).synchronize()
            """
        ),
        cell=textwrap.dedent(
            """
            out = []
            for img in images:
                f = cp.fft.rfft2(img)
                out.append(float(cp.abs(cp.fft.irfft2(f * f.conj())).mean()))
            staging = cupyx.empty_pinned((1 << 28,), dtype=cp.float32)  # 1 GiB pinned
            staging[:] = 1.0
            del f, img, staging
            """
        ),
        pasted=textwrap.dedent(
            """
            import gc
            cp.get_default_memory_pool().free_all_blocks()
            cp.get_default_pinned_memory_pool().free_all_blocks()
            cp.fft.config.get_plan_cache().clear()
            gc.collect()
            """
        ),
        probe=textwrap.dedent(
            """
            {"device_free": cp.cuda.runtime.memGetInfo()[0],
             "pool_cached": cp.get_default_memory_pool().free_bytes(),
             "pinned_free_blocks": cp.get_default_pinned_memory_pool().n_free_blocks()}
            """
        ),
    ),
    "cupy_async_pool": dict(
        needs="cupy",
        setup=textwrap.dedent(
            """
            import cupy as cp
            cp.cuda.set_allocator(cp.cuda.MemoryAsyncPool().malloc)
            """
        ),
        cell=textwrap.dedent(
            """
            a = cp.ones((1 << 30,), dtype=cp.float32)  # 4 GiB from the driver's pool
            s = float(a.sum())
            del a
            """
        ),
        pasted=textwrap.dedent(
            """
            import gc
            cp.get_default_memory_pool().free_all_blocks()
            cp.get_default_pinned_memory_pool().free_all_blocks()
            gc.collect()
            """
        ),
        probe='{"device_free": cp.cuda.runtime.memGetInfo()[0]}',
    ),
    "torch_training": dict(
        needs="torch",
        setup=textwrap.dedent(
            """
            import torch
            torch.zeros(1, device="cuda")
            """
        ),
        cell=textwrap.dedent(
            """
            model = torch.nn.Sequential(*[torch.nn.Linear(4096, 4096) for _ in range(8)]).cuda()
            opt = torch.optim.Adam(model.parameters())
            for _ in range(5):
                loss = model(torch.randn(2048, 4096, device="cuda")).square().mean()
                loss.backward(); opt.step(); opt.zero_grad()
            host = torch.empty(1 << 28, dtype=torch.float32, pin_memory=True)  # 1 GiB pinned
            host.copy_(torch.ones(1 << 28, device="cuda"), non_blocking=True)
            torch.cuda.synchronize()
            del model, opt, loss, host
            """
        ),
        pasted=textwrap.dedent(
            """
            import gc
            gc.collect()
            torch.cuda.empty_cache()
            if hasattr(torch._C, "_host_emptyCache"):
                torch._C._host_emptyCache()
            """
        ),
        probe=textwrap.dedent(
            """
            {"device_free": torch.cuda.mem_get_info()[0],
             "reserved": torch.cuda.memory_reserved(),
             "allocated": torch.cuda.memory_allocated()}
            """
        ),
    ),
}

CHILD = r"""
import contextlib, io, json, sys, time
from IPython.core.interactiveshell import InteractiveShell

spec = json.loads(sys.argv[1])
mode, cells = spec["mode"], spec["cells"]
shell = InteractiveShell.instance()
sink = io.StringIO()

def run(code):
    with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
        result = shell.run_cell(code, store_history=True)
    if result.error_before_exec or result.error_in_exec:
        raise SystemExit(f"cell failed in {mode}: {result.error_before_exec or result.error_in_exec!r}\n{sink.getvalue()}")

run(spec["setup"])
if mode == "gpucleanup":
    run("%load_ext gpucleanup")
code = spec["cell"] + "\n" + spec["pasted"] if mode == "pasted" else spec["cell"]
times, after, settled = [], [], []
for _ in range(cells):
    t0 = time.perf_counter()
    run(code)
    times.append(time.perf_counter() - t0)
    after.append(shell.ev(spec["probe"]))
# Background pinned frees: give them a moment, then read the pools again.
time.sleep(2.0)
settled.append(shell.ev(spec["probe"]))
print("RESULT " + json.dumps({"times_s": times, "after": after, "settled": settled[0],
                              "summary_lines": [l for l in sink.getvalue().splitlines() if l.startswith("gpucleanup")][-3:]}))
"""


def available(module: str | None) -> bool:
    if module is None:
        return True
    probe = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True)
    return probe.returncode == 0


def run_mode(name: str, mode: str, cells: int) -> dict:
    spec = dict(SCENARIOS[name], mode=mode, cells=cells)
    spec.pop("needs")
    proc = subprocess.run([sys.executable, "-c", CHILD, json.dumps(spec)], capture_output=True, text=True,
                          env=dict(os.environ), timeout=600)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise RuntimeError(f"{name}/{mode} failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")


def summarise(result: dict) -> dict:
    times = sorted(result["times_s"])
    # The first cell pays one-off costs (plan creation, first pool growth):
    # report the median of the rest as the steady per-cell figure.
    steady = times[1:] if len(times) > 2 else times
    return {
        "median_ms": round(statistics.median(steady) * 1e3, 3),
        "max_ms": round(max(times) * 1e3, 3),
        "last_after": result["after"][-1],
        "settled": result["settled"],
        "summary_lines": result["summary_lines"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--cells", type=int, default=7, help="cells per mode (default 7)")
    parser.add_argument("--only", action="append", choices=sorted(SCENARIOS), help="run only these scenarios")
    args = parser.parse_args()

    results = {}
    for name in args.only or SCENARIOS:
        needs = SCENARIOS[name]["needs"]
        if not available(needs):
            print(f"{name}: skipped ({needs} not importable)")
            results[name] = {"skipped": f"{needs} not importable"}
            continue
        cells = args.cells if needs else max(args.cells, 50)
        bare = summarise(run_mode(name, "bare", cells))
        pasted = summarise(run_mode(name, "pasted", cells))
        ours = summarise(run_mode(name, "gpucleanup", cells))
        ratio = ours["median_ms"] / pasted["median_ms"] if pasted["median_ms"] else None
        results[name] = {"cells": cells, "bare": bare, "pasted": pasted, "gpucleanup": ours,
                         "cell_time_ratio": round(ratio, 3) if ratio else None,
                         "overhead_ms": {"pasted": round(pasted["median_ms"] - bare["median_ms"], 3),
                                         "gpucleanup": round(ours["median_ms"] - bare["median_ms"], 3)}}
        print(f"{name}: cell returns in {ours['median_ms']} ms with gpucleanup vs {pasted['median_ms']} ms pasted, "
              f"{bare['median_ms']} ms bare (ratio gpucleanup/pasted {results[name]['cell_time_ratio']}); "
              f"after: gpucleanup {ours['last_after']} "
              f"pasted {pasted['last_after']}; settled: gpucleanup {ours['settled']} pasted {pasted['settled']}")
        for line in ours["summary_lines"]:
            print(f"    {line}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
