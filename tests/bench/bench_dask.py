"""What gpucleanup's Dask worker plugin costs a worker, side by side in one cluster.

- per task: 2,000 tiny tasks (``inc``) gathered, rounds alternating plugin off and on (the
  plugin's per-task work is its ``transition`` hook: bookkeeping in the event loop);
- per cleanup: the time of the cleanup that follows a batch of CuPy tasks (``last.elapsed_s``).

Usage: python3 tests/bench/bench_dask.py [--rounds 4] [--tasks 2000] [--json FILE]
Needs a GPU, dask-cuda and CuPy (LocalCUDACluster, one worker).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time


def inc(i: int) -> int:
    return i + 1


def cupy_work(i: int) -> float:
    import cupy as cp

    a = cp.random.random((2048, 2048), dtype=cp.float32)
    return float((a @ a).sum())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--tasks", type=int, default=2000)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    import dask
    from dask_cuda import LocalCUDACluster
    from distributed import Client

    import gpucleanup.dask.plugin as gd

    dask.config.set({"distributed.scheduler.worker-saturation": float("inf")})
    out: dict = {"tasks": args.tasks, "rounds": args.rounds, "off_s": [], "on_s": []}
    with LocalCUDACluster(n_workers=1, dashboard_address=None, silence_logs=40) as cluster, Client(cluster) as client:
        client.gather(client.map(inc, range(200), pure=False))  # warm-up
        for _ in range(args.rounds):
            for plugin in (False, True):
                if plugin:
                    gd.register(client, idle_s=0.5)
                start = time.perf_counter()
                client.gather(client.map(inc, range(args.tasks), pure=False))
                out["on_s" if plugin else "off_s"].append(time.perf_counter() - start)
                if plugin:
                    gd.unregister(client)
        gd.register(client, idle_s=0.2)
        cleanups = []
        for _ in range(args.rounds):
            before = next(iter(gd.cluster_memory(client).values()))["cleanups"]
            client.gather(client.map(cupy_work, range(8), pure=False))
            deadline = time.monotonic() + 60
            while True:
                status = next(iter(gd.cluster_memory(client).values()))
                if status["cleanups"] > before:
                    break
                if time.monotonic() > deadline:
                    print("bench_dask: no cleanup within 60 s")
                    return 1
                time.sleep(0.05)
            cleanups.append(status["last"])
        out["cleanups"] = cleanups
    off, on = statistics.median(out["off_s"]), statistics.median(out["on_s"])
    out["per_task_us_off"] = round(off / args.tasks * 1e6, 2)
    out["per_task_us_on"] = round(on / args.tasks * 1e6, 2)
    out["ratio_on_over_off"] = round(on / off, 3)
    print(f"{args.tasks} tiny tasks: plugin off {off:.3f} s, on {on:.3f} s (medians of {args.rounds}): "
          f"{out['per_task_us_off']} -> {out['per_task_us_on']} us per task, on/off {out['ratio_on_over_off']}x")
    for c in cleanups:
        print(f"cleanup after 8 CuPy tasks: freed {c['freed_bytes'] >> 20} MiB in {c['elapsed_s'] * 1e3:.1f} ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
