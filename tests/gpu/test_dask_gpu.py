"""gpucleanup's Dask worker plugin on a real GPU: a LocalCUDACluster with one worker on the
machine's GPU, CuPy work mapped over it from a client.

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
        import time
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
            deadline = time.monotonic() + 60
            while True:
                status = next(iter(gd.cluster_memory(client).values()))
                if status["cleanups"] > after and not status["busy"]:
                    return status
                assert time.monotonic() < deadline, status
                time.sleep(0.05)

        # every task goes to the worker at once: the batch keeps it busy from its first task to its last
        dask.config.set({"distributed.scheduler.worker-saturation": float("inf")})
        with LocalCUDACluster(n_workers=1, dashboard_address=None, silence_logs=40) as cluster, \\
                Client(cluster) as client:
            gd.register(client, idle_s=0.2)
            client.submit(work, -1, pure=False).result()  # warm-up: CuPy, cuBLAS and cuRAND set up
            warm = cleaned(client, 0)
            used_warm = warm["memory"]["devices"][0]["used_bytes"]
            start = time.perf_counter()
            results = client.gather(client.map(work, range(16), pure=False))
            tasks_s = time.perf_counter() - start
            after = cleaned(client, warm["cleanups"])
            own = next(iter(client.run(cupy_pool).values()))
            device = after["memory"]["devices"][0]
            figure(f"warm-up cleanup: {warm['last']}")
            figure(f"after 16 tasks ({tasks_s:.2f} s): {after['last']}; cleanups {after['cleanups']}, "
                   f"skipped while busy {after['skipped_busy']}")
            figure(f"worker device used {used_warm} -> {device['used_bytes']} B; cupy as reported "
                   f"{device['frameworks'].get('cupy')}, as the worker reads it {own}")
            result(count=len(results), used_warm=used_warm, used_after=device["used_bytes"],
                   reported=device["frameworks"].get("cupy"), own=own, last=after["last"],
                   cleanups=after["cleanups"] - warm["cleanups"])
    ''', timeout=600)
    assert r["count"] == 16
    assert r["last"]["reason"] == "idle" and r["last"]["freed_bytes"] >= 64 * MiB, r["last"]
    assert r["cleanups"] == 1, r  # one cleanup for the batch of 16 tasks
    assert r["reported"] == {"live_bytes": r["own"][0], "cached_bytes": r["own"][1]}, r
    assert r["own"][1] == 0, r  # nothing freeable left in the worker's CuPy pool
    assert abs(r["used_after"] - r["used_warm"]) <= 16 * MiB, r
