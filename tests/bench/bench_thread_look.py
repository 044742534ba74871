#!/usr/bin/env python3
"""What the kernel's look at Python's threads costs per cell (``InKernel.threads_seen``), side by side with the
ways it could tell one look from the next.

Method: N threads waiting on an event besides the main thread (a kernel has about 8: ipykernel's channels,
heartbeat, parent poller, IPython's history saver), then for each way, interleaved, 7 runs of 20,000 looks
(build the signature, compare it with the last one); the figure is each way's fastest run, per look.
Ways: ``count`` (``threading.active_count()``, what the kernel compared before 2026-12-07: blind to one thread
ending as another starts), ``objects`` (the thread objects: keeps a finished thread's object alive until the next
look), ``weakrefs`` (:func:`gpucleanup.park.kernel_side._thread_refs`, what it compares now), ``ids`` and
``native_ids``.

Usage: python tests/bench/bench_thread_look.py [N]   (PYTHONPATH=ipython_ext)
"""

from __future__ import annotations

import sys
import threading
import time

from gpucleanup.park.kernel_side import _thread_refs


def main() -> int:
    waiting = int(sys.argv[1]) if len(sys.argv) > 1 else 8
    stop = threading.Event()
    for _ in range(waiting):
        threading.Thread(target=stop.wait, daemon=True).start()
    ways = {
        "count": threading.active_count,
        "objects": lambda: tuple(threading.enumerate()),
        "weakrefs": lambda: _thread_refs(threading.enumerate()),
        "ids": lambda: tuple(map(id, threading.enumerate())),
        "native_ids": lambda: tuple([t.native_id for t in threading.enumerate()]),
    }
    best = {name: float("inf") for name in ways}
    for _ in range(7):
        for name, look in ways.items():
            last = look()
            started = time.perf_counter()
            for _ in range(20000):
                now = look()
                now != last  # noqa: B015 (the comparison is what is timed)
            best[name] = min(best[name], (time.perf_counter() - started) / 20000 * 1e6)
    stop.set()
    print(f"{threading.active_count()} threads: " + ", ".join(f"{name} {us:.2f} us" for name, us in best.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
