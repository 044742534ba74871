"""gpucleanup's Dask worker plugin on real GPUs: a LocalCUDACluster with one worker per GPU of the
machine (one on a one-GPU machine), CuPy work mapped over them from a client.

- after the tasks, once the worker is idle, its CuPy pool holds nothing freeable and its device
  memory is back within 16 MiB of where it was after a warm-up task;
- what cluster_memory reports for the worker's CuPy pool is what the worker reads from CuPy.
"""

from __future__ import annotations

from conftest import MiB, require, run_script


def test_cupy_tasks_on_a_local_cuda_cluster_leave_the_workers_pool_empty():
    require("cupy")
    require("dask_cuda")
    r = run_script('''
        import os, time
        import dask
        from dask_cuda import LocalCUDACluster
        from distributed import Client
        import gpucleanup.dask as gd

        def work(i):
            import cupy as cp
            a = cp.random.random((4096, 4096), dtype=cp.float32)  # 64 MiB, and as much again for a @ a
            return float((a @ a).sum())

        def cupy_pool():
            import cupy as cp
            pool = cp.get_default_memory_pool()
            return pool.used_bytes(), pool.free_bytes()

        def cleaned(client, after):
            # every worker has cleaned up more often than ``after`` (address -> count) and is idle
            deadline = time.monotonic() + 60
            while True:
                statuses = gd.cluster_memory(client)
                if all(s["cleanups"] > after.get(a, 0) and not s["busy"] for a, s in statuses.items()):
                    return statuses
                assert time.monotonic() < deadline, statuses
                time.sleep(0.05)

        # every task goes to the worker at once: the batch keeps it busy from its first task to its last
        dask.config.set({"distributed.scheduler.worker-saturation": float("inf")})
        with LocalCUDACluster(dashboard_address=None, silence_logs=40) as cluster, \\
                Client(cluster) as client:
            gd.register(client, idle_s=0.2)
            workers = sorted(client.scheduler_info()["workers"])
            for w in workers:  # warm-up on each: CuPy, cuBLAS and cuRAND set up
                client.submit(work, -1, workers=[w], pure=False).result()
            warm = cleaned(client, {})
            start = time.perf_counter()
            results = client.gather(client.map(work, range(16 * len(workers)), pure=False))
            tasks_s = time.perf_counter() - start
            after = cleaned(client, {a: s["cleanups"] for a, s in warm.items()})
            own = client.run(cupy_pool)
            # dask-cuda gives each worker its own GPU first in CUDA_VISIBLE_DEVICES (its device 0)
            first = client.run(lambda: os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0])
            out = []
            for a in workers:
                device = after[a]["memory"]["devices"][0]
                figure(f"{a}: GPU{device['index']} used {warm[a]['memory']['devices'][0]['used_bytes']} -> "
                       f"{device['used_bytes']} B; last cleanup {after[a]['last']}; cupy as reported "
                       f"{device['frameworks'].get('cupy')}, as the worker reads it {own[a]}")
                out.append(dict(index=device["index"], gpu=first[a], used_warm=warm[a]["memory"]["devices"][0]["used_bytes"],
                                used_after=device["used_bytes"], reported=device["frameworks"].get("cupy"),
                                own=own[a], last=after[a]["last"], devices=len(after[a]["memory"]["devices"]),
                                cleanups=after[a]["cleanups"] - warm[a]["cleanups"]))
            figure(f"{len(results)} tasks on {len(workers)} workers in {tasks_s:.2f} s")
            result(count=len(results), workers=out)
    ''', timeout=600)
    assert r["count"] == 16 * len(r["workers"])
    assert len({w["gpu"] for w in r["workers"]}) == len(r["workers"]), r["workers"]  # one GPU each
    for w in r["workers"]:
        assert w["devices"] == 1, w  # a worker touches its own GPU only
        assert w["last"]["reason"] == "idle" and w["last"]["freed_bytes"] >= 64 * MiB, w
        assert w["cleanups"] == 1, w  # one cleanup for its share of the batch
        assert w["reported"] == {"live_bytes": w["own"][0], "cached_bytes": w["own"][1]}, w
        assert w["own"][1] == 0, w  # nothing freeable left in the worker's CuPy pool
        assert abs(w["used_after"] - w["used_warm"]) <= 16 * MiB, w
