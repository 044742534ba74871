"""gpucleanup's Dask worker plugin with a real distributed.LocalCluster (worker processes) and
the fake CUDA driver in each worker (GPUCLEANUP_LIBCUDA is inherited; each worker's scenario is
set through client.run): it registers, cleans once a worker goes idle, reports, drains on request
between tasks only, survives a failing task and a worker restart, and unregisters; no task's
result or exception changes."""

from __future__ import annotations

import ctypes
import json
import os
import sys
import time

import pytest

distributed = pytest.importorskip("distributed")
dask = pytest.importorskip("dask")

from IPython.core.error import UsageError  # noqa: E402
from IPython.utils.capture import capture_output  # noqa: E402

import gpucleanup.dask.plugin as gdask  # noqa: E402
import gpucleanup.frameworks  # noqa: E402
import gpucleanup.in_kernel.status_endpoint  # noqa: E402
from gpucleanup.records import report  # noqa: E402
from shell_stand_ins import StandInEndpoint, shell  # noqa: E402,F401  (fixture)
from support import GiB  # noqa: E402

# the functions below run in the workers: pickled by value (the workers cannot import this file)
import cloudpickle  # noqa: E402

cloudpickle.register_pickle_by_value(sys.modules[__name__])

POOL_1_GIB = {"devices": [{"primary_active": True, "default_pool": {"reserved_bytes": GiB, "used_bytes": 0}}]}


def _scenario(scenario: dict) -> int:
    lib = ctypes.CDLL(os.environ["GPUCLEANUP_LIBCUDA"])
    lib.fake_cuda_reset.argtypes = [ctypes.c_char_p]
    return lib.fake_cuda_reset(json.dumps(scenario).encode())


def _wait_for(predicate, what: str, limit_s: float = 60.0):
    """Polls until ``predicate()`` gives a true value (the cleanup runs on the worker's own thread)."""
    deadline = time.monotonic() + limit_s
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"{what} did not happen within {limit_s} s"
        time.sleep(0.05)


def _only(workers: dict) -> dict:
    assert len(workers) == 1, workers
    return next(iter(workers.values()))


@pytest.fixture(scope="module")
def cluster():
    # every task goes to the worker at once (no queueing on the scheduler): a batch keeps the
    # worker busy from its first task to its last
    with dask.config.set({"distributed.scheduler.worker-saturation": float("inf")}):
        with distributed.LocalCluster(n_workers=1, threads_per_worker=1, processes=True, dashboard_address=None,
                                      silence_logs=40) as c:
            yield c


@pytest.fixture
def client(cluster):
    with distributed.Client(cluster) as c:
        c.run(_scenario, POOL_1_GIB)
        yield c
        if gdask.PLUGIN_NAME in _plugins(c):
            gdask.unregister(c)


def _plugins(client) -> set:
    return {name for names in client.run(lambda dask_worker: list(dask_worker.plugins)).values() for name in names}


def _cleanups(client) -> int:
    return int(_only(gdask.cluster_memory(client)).get("cleanups", 0))


def test_a_registered_worker_cleans_up_once_idle_after_a_task_and_reports_it(client):
    gdask.register(client, idle_s=0)
    assert client.submit(lambda: 41 + 1, pure=False).result() == 42
    status = _wait_for(lambda: (s := _only(gdask.cluster_memory(client))) and s["cleanups"] >= 1 and s, "a cleanup")
    assert status["plugin"] is True and status["busy"] == 0
    assert status["last"]["reason"] == "idle" and status["last"]["freed_bytes"] == GiB
    [device] = status["memory"]["devices"]
    assert device["pools"] == [{"which": "default", "reserved_bytes": 0, "used_bytes": 0}]
    # "freed since the last look": the 1 GiB once, then nothing
    assert status["freed_since_last_look_bytes"] == GiB and status["freed_total_bytes"] == GiB
    assert _only(gdask.cluster_memory(client))["freed_since_last_look_bytes"] == 0


def test_a_batch_of_tasks_is_cleaned_once_after_its_last_task(client):
    gdask.register(client, idle_s=0)
    assert client.submit(lambda: 0, pure=False).result() == 0
    _wait_for(lambda: _cleanups(client) >= 1, "the first cleanup")
    before = _cleanups(client)
    gate = distributed.Event("gpucleanup-test-gate", client=client)
    futures = client.map(lambda i: distributed.Event("gpucleanup-test-gate").wait() and i, range(40), pure=False)
    # all 40 on the worker (one running, 39 ready) before any may finish
    _wait_for(lambda: sum(len(v) for v in client.processing().values()) == 40, "the batch reaching the worker")
    _wait_for(lambda: _only(client.run(lambda dask_worker: dask_worker.state.executing_count
                                       + len(dask_worker.state.ready))) == 40, "the worker holding the batch")
    gate.set()
    assert client.gather(futures) == list(range(40))
    _wait_for(lambda: _cleanups(client) >= before + 1, "the cleanup after the batch")
    status = _only(gdask.cluster_memory(client))
    assert status["cleanups"] == before + 1  # one for the whole batch, none between its tasks
    gate.clear()


def test_a_failing_task_keeps_its_exception_and_the_worker_still_cleans(client):
    gdask.register(client, idle_s=0)

    def fails():
        raise ValueError("the task's own error")

    future = client.submit(fails, pure=False)
    with pytest.raises(ValueError, match="the task's own error"):
        future.result()
    _wait_for(lambda: _cleanups(client) >= 1, "a cleanup after the failed task")
    assert client.submit(lambda: "next", pure=False).result() == "next"


def test_drain_on_request_cleans_idle_workers_and_skips_busy_ones(client):
    gdask.register(client, idle_s=3600)  # no cleanup of its own during this test
    [drained] = gdask.drain_cluster(client).values()
    assert drained["reason"] == "request" and drained["freed_bytes"] == GiB
    gate = distributed.Event("gpucleanup-test-hold", client=client)
    held = client.submit(lambda: distributed.Event("gpucleanup-test-hold").wait(), pure=False)
    _wait_for(lambda: _only(client.run(lambda dask_worker: dask_worker.state.executing_count)) == 1, "the task running")
    [skipped] = gdask.drain_cluster(client).values()
    assert skipped["skipped"] == "busy with 1 task: drained only between tasks"
    gate.set()
    assert held.result() is True
    gate.clear()


def test_unregister_stops_the_plugin_and_a_worker_without_it_is_only_read(client):
    gdask.register(client, idle_s=0)
    assert gdask.PLUGIN_NAME in _plugins(client)
    gdask.unregister(client)
    assert gdask.PLUGIN_NAME not in _plugins(client)
    # the cleanup thread ends on its own (teardown does not wait for it)
    _wait_for(lambda: _only(_cleanup_threads(client)) == [], "the cleanup thread's end")
    status = _only(gdask.cluster_memory(client))
    assert status["plugin"] is False and status["memory"]["devices"][0]["pools"][0]["reserved_bytes"] == GiB


def _cleanup_threads(client) -> dict:
    return client.run(lambda: [t.name for t in __import__("threading").enumerate() if t.name == "gpucleanup-dask"])


def _fake_counter(name: str) -> int:
    lib = ctypes.CDLL(os.environ["GPUCLEANUP_LIBCUDA"])
    lib.fake_cuda_counter.argtypes = [ctypes.c_char_p]
    lib.fake_cuda_counter.restype = ctypes.c_longlong
    return lib.fake_cuda_counter(name.encode())


def _release_sync() -> None:
    ctypes.CDLL(os.environ["GPUCLEANUP_LIBCUDA"]).fake_cuda_release_sync()


def test_unregister_while_the_gpu_is_stalled_returns_at_once_and_the_worker_answers(client):
    import threading

    stalled = {"devices": [{"primary_active": True, "sync_seconds": -1,
                            "default_pool": {"reserved_bytes": GiB, "used_bytes": 0}}]}
    client.run(_scenario, stalled)
    try:
        # a settle limit of a day: a teardown that waited for the cleanup would hold the worker that long
        gdask.register(client, idle_s=0, settle_timeout=86400)
        assert client.submit(lambda: 1, pure=False).result() == 1
        _wait_for(lambda: _only(client.run(_fake_counter, "syncs_in_flight")) >= 1, "the cleanup's stalled synchronize")
        # a drain on request while that cleanup waits: skipped at once, not queued behind it for a day
        [skipped] = gdask.drain_cluster(client).values()
        assert skipped["skipped"] == ("a cleanup is already running (waiting for the GPU to finish queued work): "
                                      "try again later")
        done = threading.Event()
        failed = []

        def remove():
            try:
                gdask.unregister(client)
            except Exception as exc:  # reported below
                failed.append(exc)
            done.set()

        threading.Thread(target=remove, daemon=True).start()
        answered = _only(client.run(lambda: "here"))  # the worker's event loop answers meanwhile
        assert answered == "here"
        assert done.wait(60), "unregister waited on the stalled GPU"  # generous: it returns at once
        assert failed == []
        assert gdask.PLUGIN_NAME not in _plugins(client)
        # the GPU is still stalled: the cleanup thread still waits, the worker does not
        assert _only(client.run(_fake_counter, "syncs_in_flight")) >= 1
        assert client.submit(lambda: 2, pure=False).result() == 2
    finally:
        client.run(_release_sync)
    _wait_for(lambda: _only(_cleanup_threads(client)) == [], "the cleanup thread's end once the GPU answers")
    client.run(_scenario, POOL_1_GIB)


def test_the_plugin_comes_back_on_a_restarted_worker(client):
    gdask.register(client, idle_s=0)
    client.restart()
    client.run(_scenario, POOL_1_GIB)
    assert gdask.PLUGIN_NAME in _plugins(client)
    assert client.submit(lambda: 7, pure=False).result() == 7
    _wait_for(lambda: _cleanups(client) >= 1, "a cleanup on the restarted worker")


def test_bad_plugin_options_are_refused_with_what_to_pass():
    with pytest.raises(ValueError, match="idle_s must be a number of seconds from 0 to 3,600"):
        gdask.GPUCleanupPlugin(idle_s=-1)
    with pytest.raises(ValueError, match="history must be a whole number"):
        gdask.GPUCleanupPlugin(history=0)
    with pytest.raises(ValueError) as error:
        gdask.GPUCleanupPlugin(pinned="no")
    assert str(error.value) == "pinned must be True or False, got 'no'"
    with pytest.raises(ValueError, match="driver_pools must be True or False, got 0"):
        gdask.GPUCleanupPlugin(driver_pools=0)
    with pytest.raises(ValueError) as error:
        gdask.GPUCleanupPlugin(frameworks={"cupi": False})
    assert str(error.value).startswith("frameworks names unknown framework(s) 'cupi'; known: ")
    assert "cupy" in str(error.value)
    with pytest.raises(ValueError, match=r"frameworks takes True or False per framework, got cupy='off'"):
        gdask.GPUCleanupPlugin(frameworks={"cupy": "off"})
    with pytest.raises(ValueError, match="frameworks must be a dict"):
        gdask.GPUCleanupPlugin(frameworks=["cupy"])
    assert gdask.GPUCleanupPlugin(frameworks={"cupy": False}, pinned=False).frameworks == {"cupy": False}


def test_gpumem_dask_in_a_kernel_registers_shows_and_drains_the_workers(shell, client, monkeypatch):  # noqa: F811
    monkeypatch.setattr(gpucleanup.frameworks, "active", lambda: [])
    monkeypatch.setattr(gpucleanup.in_kernel.status_endpoint, "StatusEndpoint", lambda: StandInEndpoint())
    shell.run_line_magic("load_ext", "gpucleanup")
    with capture_output() as cap:
        shell.run_line_magic("gpumem", "--dask on")
    assert cap.stdout.splitlines()[0].startswith("gpucleanup · gpucleanup's plugin registered on 1 Dask workers")
    data = shell.run_line_magic("gpumem", "--dask --drain --json")
    [drained] = data["drained"].values()
    assert drained["freed_bytes"] == GiB
    [worker] = data["workers"].values()
    assert worker["plugin"] is True and worker["cleanups"] >= 1
    table = report.dask_report(data["workers"]).text()
    assert "Dask workers" in table and worker["address"] in table
    with capture_output() as cap:
        shell.run_line_magic("gpumem", "--dask off")
    assert cap.stdout.strip() == "gpucleanup · gpucleanup's plugin removed from the Dask workers"
    with pytest.raises(UsageError, match="--dask takes on or off"):
        shell.run_line_magic("gpumem", "--dask maybe")


def test_gpumem_dask_without_a_client_says_how_to_make_one(shell, monkeypatch):  # noqa: F811
    monkeypatch.setattr(gpucleanup.frameworks, "active", lambda: [])
    monkeypatch.setattr(gpucleanup.in_kernel.status_endpoint, "StatusEndpoint", lambda: StandInEndpoint())
    shell.run_line_magic("load_ext", "gpucleanup")
    with pytest.raises(UsageError, match="this kernel has no Dask client: create one first"):
        shell.run_line_magic("gpumem", "--dask")


def test_gpumem_dask_without_dask_installed_names_the_extra_to_install(shell, monkeypatch):  # noqa: F811
    import importlib.util
    import sys

    monkeypatch.setattr(gpucleanup.frameworks, "active", lambda: [])
    monkeypatch.setattr(gpucleanup.in_kernel.status_endpoint, "StatusEndpoint", lambda: StandInEndpoint())
    shell.run_line_magic("load_ext", "gpucleanup")
    monkeypatch.delitem(sys.modules, "distributed", raising=False)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "distributed" else real(name, *a))
    with pytest.raises(UsageError, match=r"Dask's distributed is not installed: pip install 'gpucleanup\[dask\]'"):
        shell.run_line_magic("gpumem", "--dask")


def _stand_in_rmm_pool(pool_bytes: int, current_bytes: int) -> list:
    """In the worker: a stand-in RMM (tests/python/stand_ins) with a pool on device 0, as dask-cuda's
    rmm_pool_size sets one up; kept in sys.modules for the worker's life."""
    import pytest as _pytest
    from stand_ins import World, install_rmm
    from stand_ins.rmm import CudaMemoryResource, PoolMemoryResource, StatisticsResourceAdaptor

    world = World(n_devices=1, active=(0,))
    pool = PoolMemoryResource(CudaMemoryResource(), pool_bytes)
    install_rmm(_pytest.MonkeyPatch(), world, resources={0: StatisticsResourceAdaptor(pool, current_bytes)})
    return world.violations


def test_an_rmm_pool_set_up_for_the_worker_is_reported_as_rmms_and_left_alone(client):
    import stand_ins
    import stand_ins.rmm
    import stand_ins.world

    for m in (stand_ins, stand_ins.rmm, stand_ins.world):
        cloudpickle.register_pickle_by_value(m)
    try:
        assert client.run(_stand_in_rmm_pool, 2 * GiB, GiB // 2) == {a: [] for a in client.scheduler_info()["workers"]}
        gdask.register(client, idle_s=0)
        assert client.submit(lambda: 1, pure=False).result() == 1
        status = _wait_for(lambda: (s := _only(gdask.cluster_memory(client))) and s["cleanups"] >= 1 and s,
                           "a cleanup")
        [device] = status["memory"]["devices"]
        # an RMM pool never gives memory back: reserved, never called cached
        assert device["frameworks"]["rmm"] == {"live_bytes": GiB // 2, "cached_bytes": 0, "reserved_bytes": 3 * GiB // 2}
        assert status["memory"]["frameworks"]["rmm"].startswith("rmm holds 2.0 GiB (512 MiB live); RMM pools give "
                                                                "memory back only when their resource is destroyed")
        assert status["last"]["freed_bytes"] == GiB  # the driver pool of the scenario; nothing of RMM's
    finally:
        client.restart()  # the stand-in leaves with the worker process
        for m in (stand_ins, stand_ins.rmm, stand_ins.world):
            cloudpickle.unregister_pickle_by_value(m)
