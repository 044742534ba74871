"""What the allocation trace (%gpumem --trace on) costs the program it watches, side by side
in one process: each workload is timed in rounds that alternate trace off and trace on.

Workloads:
  alloc-bindings  cuMemAlloc + cuMemFree of 1 MiB through cuda-bindings (calls that release
                  the interpreter lock: the trace records size, thread and caller library)
  alloc-pycuda    pycuda.driver.mem_alloc + free of 1 MiB (calls that keep the interpreter
                  lock: the trace also asks Python for the line), when PyCUDA is installed
  alloc-pycuda/no-line, alloc-pycuda/no-caller
                  the same with one part of the trace left out: the Python line, the native
                  stack walk that names the calling library (GPUCLEANUP_TRACE_CALLER=0)
  torch-launch    x.add_(1) on a one-element CUDA tensor: no allocation, so the trace must
                  cost nothing here (only memory callbacks are enabled)

Usage: python3 tests/bench/bench_trace.py [--rounds 6] [--json FILE]
Needs a GPU, torch and cuda-bindings; prints one line per workload with the off/on ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time


def _per_call_us(fn, n: int) -> float:
    start = time.perf_counter_ns()
    fn(n)
    return (time.perf_counter_ns() - start) / n / 1000.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    import torch
    from cuda.bindings import driver as cu

    from gpucleanup import _native
    from gpucleanup.in_kernel import tracing

    x = torch.ones(1, device="cuda")
    torch.cuda.synchronize()
    err, ctx = cu.cuCtxGetCurrent()

    def bindings(n: int) -> None:
        for _ in range(n):
            _, ptr = cu.cuMemAlloc(1 << 20)
            cu.cuMemFree(ptr)

    def launch(n: int) -> None:
        for _ in range(n):
            x.add_(1)
        torch.cuda.synchronize()

    workloads = {"alloc-bindings": (bindings, 2000), "torch-launch": (launch, 20000)}
    try:
        import pycuda.driver as drv

        drv.init()
        pycuda_ctx = drv.Context.attach()  # the primary context torch made current: no new context

        def pycuda_alloc(n: int) -> None:
            for _ in range(n):
                drv.mem_alloc(1 << 20).free()

        workloads["alloc-pycuda"] = (pycuda_alloc, 2000)
        # the same with the trace's two parts apart: no Python line asked for, no native stack walked
        workloads["alloc-pycuda/no-line"] = (pycuda_alloc, 2000)
        workloads["alloc-pycuda/no-caller"] = (pycuda_alloc, 2000)
    except Exception as exc:  # noqa: BLE001 - PyCUDA is optional here
        print(f"bench_trace: no PyCUDA workload ({type(exc).__name__}: {exc})")
        pycuda_ctx = None

    tracer = tracing.Tracer(_native, None)
    for fn, n in workloads.values():  # warm-up, trace off
        fn(n // 4)
    results = {}
    for name, (fn, n) in workloads.items():
        off, on = [], []
        for _ in range(args.rounds):
            off.append(_per_call_us(fn, n))
            os.environ["GPUCLEANUP_TRACE_CALLER"] = "0" if name.endswith("/no-caller") else "1"
            reply = tracer.start(lines=not name.endswith("/no-line"))
            if not reply.get("active"):
                print(f"bench_trace: the trace did not start: {reply.get('error')}")
                return 1
            on.append(_per_call_us(fn, n))
            tracer.stop()
        results[name] = {
            "calls_per_round": n,
            "rounds": args.rounds,
            "off_us": round(statistics.median(off), 3),
            "on_us": round(statistics.median(on), 3),
            "ratio_on_over_off": round(statistics.median(on) / statistics.median(off), 3),
            "off_rounds_us": [round(v, 3) for v in off],
            "on_rounds_us": [round(v, 3) for v in on],
        }
        r = results[name]
        print(f"{name:15s} off {r['off_us']:9.3f} us  on {r['on_us']:9.3f} us  on/off {r['ratio_on_over_off']:.3f}x"
              f"  ({args.rounds} rounds of {n} calls, medians)")
    if pycuda_ctx is not None:
        pycuda_ctx.detach()
    meta = {"torch": torch.__version__, "device": torch.cuda.get_device_name(0), "python": sys.version.split()[0],
            "cupti": tracer.library}
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
