"""gpucleanup_after_cell and gpucleanup_trim through the ctypes binding, against the fake driver.

One native call per cell: probe, settle, trim and memory afterwards in one JSON reply
(share/schema/after_cell.schema.json). The library keeps per-device state for the life
of the process (keyed by UUID), so every scenario here uses UUIDs of its own.
"""

from __future__ import annotations

import ctypes
import os
import signal
import threading
import time

import pytest

from gpucleanup import _native
from support import GiB, MiB  # noqa: E402


# One cell's driver calls with one idle device in use (native/README.md, "Calls per cell").
ONE_DEVICE_IN_USE = {
    "cuDeviceGetCount": 1,
    "cuCtxGetCurrent": 1,
    "cuDeviceGet": 1,
    "cuDeviceGetUuid": 1,
    "cuDevicePrimaryCtxGetState": 1,
    "cuDevicePrimaryCtxRetain": 1,
    "cuCtxPushCurrent": 2,  # the look at the pools before the settle (one reserves memory: no event), the pass
    "cuMemGetInfo": 2,
    "cuDeviceGetDefaultMemPool": 2,
    "cuDeviceGetMemPool": 2,
    "cuMemPoolGetAttribute": 3,
    "cuCtxSynchronize": 1,
    "cuMemPoolTrimTo": 1,
    "cuCtxPopCurrent": 2,
    "cuDevicePrimaryCtxRelease": 1,
}


def eventually(condition, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True


def driver_calls(fake_cuda) -> dict:
    counters = fake_cuda.state()["counters"]
    return {name[len("calls."):]: n for name, n in counters.items() if name.startswith("calls.") and n}


def delta(after: dict, before: dict) -> dict:
    return {name: n - before.get(name, 0) for name, n in after.items() if n != before.get(name, 0)}


def one_device(uuid: str, **extra) -> dict:
    device = {"uuid": uuid, "primary_active": True, "free_bytes": 10 * GiB,
              "default_pool": {"reserved_bytes": 2 * GiB, "used_bytes": 512 * MiB}}
    device.update(extra)
    return {"devices": [device]}


@pytest.fixture
def settled(fake_cuda):
    """The fake driver; after the test, every hanging synchronize is released and finished."""
    yield fake_cuda
    fake_cuda.release_sync()
    assert eventually(lambda: fake_cuda.counter("syncs_in_flight") == 0 and fake_cuda.counter("retained") == 0)


@pytest.fixture(scope="module")
def trim_schema(schema_registry):
    import jsonschema

    registry, _docs = schema_registry
    return jsonschema.Draft202012Validator({"$ref": "after_cell.schema.json#/$defs/trim"}, registry=registry)


def test_one_call_settles_trims_and_reports_memory_afterwards(settled, schemas):
    settled.reset(one_device("GPU-af7e0000-0000-4000-8000-0000000000a1",
                             default_pool={"reserved_bytes": 2 * GiB, "used_bytes": 0, "pending_free_bytes": 1 * GiB}))
    result = _native.after_cell(timeout=5)
    schemas["after_cell.schema.json"].validate(result)
    assert result["kind"] == "after_cell"
    assert result["driver"]["state"] == "ready"
    assert result["trim"] is True and result["interrupted"] is False
    [device] = result["devices"]
    assert device["uuid"] == "GPU-af7e0000-0000-4000-8000-0000000000a1"
    assert device["state"] == "drained"
    assert device["settle"]["status"] == "done"
    assert device["free_before_bytes"] == 10 * GiB
    assert device["released_bytes"] == 2 * GiB  # the pending free was observed by the settle
    assert [(p["reserved_before_bytes"], p["reserved_after_bytes"], p["trimmed"]) for p in device["pools"]] == [(2 * GiB, 0, True)]
    assert device["total_bytes"] == 80 * GiB
    assert device["free_bytes"] == 12 * GiB
    assert device["used_bytes"] == 80 * GiB - 12 * GiB
    assert device["error"] is None and device["message"] is None
    assert settled.counter("contexts_created") == 0
    assert settled.counter("retained") == 0


def test_settle_only_leaves_the_pools_as_they_are(settled, schemas):
    settled.reset(one_device("GPU-af7e0000-0000-4000-8000-0000000000a2"))
    result = _native.after_cell(timeout=5, trim=False)
    schemas["after_cell.schema.json"].validate(result)
    assert result["trim"] is False
    [device] = result["devices"]
    assert device["released_bytes"] == 0
    assert [(p["reserved_after_bytes"], p["trimmed"]) for p in device["pools"]] == [(2 * GiB, False)]
    assert settled.counter("calls.cuMemPoolTrimTo") == 0


def test_a_hundred_cells_cost_the_same_driver_calls_each_and_no_thread_each(settled, schemas):
    settled.reset(one_device("GPU-af7e0000-0000-4000-8000-0000000000a3"))
    _native.after_cell(timeout=30)  # the first also reads name and total once, and starts the watchdog
    for cell in range(100):
        settled.update({"devices": [{"default_pool": {"reserved_bytes": 1 * GiB, "used_bytes": 0}}]})
        before = driver_calls(settled)
        result = _native.after_cell(timeout=30)
        assert delta(driver_calls(settled), before) == ONE_DEVICE_IN_USE, f"cell {cell}"
        assert result["devices"][0]["released_bytes"] == 1 * GiB
        assert settled.counter("retained") == 0
    schemas["after_cell.schema.json"].validate(result)
    assert sum(ONE_DEVICE_IN_USE.values()) == 22
    # Threads that ever called the driver: the test's and the device's watchdog.
    assert settled.counter("threads") == 2
    assert settled.counter("contexts_created") == 0
    assert settled.counter("cuInit") == 0


def test_not_initialised_is_one_driver_call_and_a_tiny_reply(fake_cuda, schemas):
    fake_cuda.reset({"initialized": False, "devices": [{"uuid": "GPU-af7e0000-0000-4000-8000-0000000000a4"}]})
    for _ in range(10):
        before = driver_calls(fake_cuda)
        result = _native.after_cell(timeout=30)
        assert delta(driver_calls(fake_cuda), before) == {"cuDeviceGetCount": 1}
    schemas["after_cell.schema.json"].validate(result)
    assert result["driver"]["state"] == "not_initialized"
    assert result["devices"] == []
    assert fake_cuda.counter("threads") == 1
    trimmed = _native.trim()
    assert trimmed["kind"] == "trim" and trimmed["devices"] == []
    assert fake_cuda.counter("cuInit") == 0


def test_whether_cuda_was_initialised_is_one_driver_call_without_json(fake_cuda):
    fake_cuda.reset({"initialized": False, "devices": [{"uuid": "GPU-af7e0000-0000-4000-8000-0000000000b2"}]})
    for _ in range(10):
        before = driver_calls(fake_cuda)
        assert _native.cuda_initialized() is False
        assert delta(driver_calls(fake_cuda), before) == {"cuDeviceGetCount": 1}
    fake_cuda.reset({"devices": [{"uuid": "GPU-af7e0000-0000-4000-8000-0000000000b3", "primary_active": True}]})
    assert _native.cuda_initialized() is True
    assert fake_cuda.counter("cuInit") == 0 and fake_cuda.counter("contexts_created") == 0


def test_nothing_in_use_is_the_probe_alone(fake_cuda, schemas):
    fake_cuda.reset({"devices": [{"uuid": "GPU-af7e0000-0000-4000-8000-0000000000a5"}]})
    before = driver_calls(fake_cuda)
    result = _native.after_cell(timeout=30)
    schemas["after_cell.schema.json"].validate(result)
    assert result["devices"] == []
    assert delta(driver_calls(fake_cuda), before) == {
        "cuDeviceGetCount": 1, "cuCtxGetCurrent": 1, "cuDeviceGet": 1, "cuDeviceGetUuid": 1,
        "cuDevicePrimaryCtxGetState": 1,
    }
    assert fake_cuda.counter("threads") == 1


def test_a_hung_device_returns_at_the_limit_then_is_still_busy_without_a_second_wait(settled, schemas, trim_schema):
    settled.reset(one_device("GPU-af7e0000-0000-4000-8000-0000000000a6", sync_seconds=-1))
    # The fake's hang never ends: that the call returns at all is the proof.
    first = _native.after_cell(timeout=0.2)
    schemas["after_cell.schema.json"].validate(first)
    [busy] = first["devices"]
    assert busy["state"] == "busy"
    assert busy["settle"]["status"] == "timeout"
    assert busy["message"].startswith("GPU0 is still busy after ")
    assert busy["free_bytes"] == 10 * GiB  # read at the start of the call
    assert [p["trimmed"] for p in busy["pools"]] == [False]
    assert settled.counter("calls.cuMemPoolTrimTo") == 0
    assert eventually(lambda: settled.counter("syncs_in_flight") == 1)

    again = _native.after_cell(timeout=30)
    schemas["after_cell.schema.json"].validate(again)
    [still] = again["devices"]
    assert still["state"] == "busy"
    assert still["settle"]["status"] == "still_busy"
    assert still["message"].startswith("GPU0 is still busy with work queued ")
    assert settled.counter("calls.cuCtxSynchronize") == 1

    trimmed = _native.trim()
    trim_schema.validate(trimmed)
    assert trimmed["devices"][0]["state"] == "busy"
    assert settled.counter("calls.cuMemPoolTrimTo") == 0

    settled.release_sync()
    assert eventually(lambda: settled.counter("syncs_in_flight") == 0 and settled.counter("retained") == 0)
    after = _native.after_cell(timeout=5)
    assert after["devices"][0]["state"] == "drained"
    assert after["devices"][0]["released_bytes"] == 2 * GiB - 512 * MiB
    assert settled.counter("threads") == 2  # the same watchdog waited both times


def test_trim_releases_what_frameworks_gave_back_without_waiting(settled, trim_schema, schemas):
    settled.reset(one_device("GPU-af7e0000-0000-4000-8000-0000000000a7"))
    _native.after_cell(timeout=5)
    settled.update({"devices": [{"default_pool": {"reserved_bytes": 1536 * MiB, "used_bytes": 512 * MiB}}]})
    syncs = settled.counter("calls.cuCtxSynchronize")
    result = _native.trim()
    trim_schema.validate(result)
    schemas["after_cell.schema.json"].validate(result)
    [device] = result["devices"]
    assert device["state"] == "trimmed"
    assert device["released_bytes"] == 1 * GiB
    assert device["free_bytes"] == 10 * GiB + (2 * GiB - 512 * MiB) + 1 * GiB
    assert settled.counter("calls.cuCtxSynchronize") == syncs
    assert settled.counter("retained") == 0


def test_a_primary_context_reset_by_a_framework_is_not_used_through_its_old_handle(settled, schemas):
    # The framework has GPU0's primary context current on this thread (CuPy, PyTorch do).
    scenario = one_device("GPU-af7e0000-0000-4000-8000-0000000000a8")
    scenario["current_context"] = {"device": 0, "primary": True}
    settled.reset(scenario)
    assert _native.after_cell(timeout=5)["devices"][0]["state"] == "drained"
    reset_primary = settled.lib.fake_cuda_reset_primary_context
    reset_primary.argtypes = [ctypes.c_int]
    reset_primary.restype = ctypes.c_int
    # cuDevicePrimaryCtxReset: the context is destroyed, the device inactive, the stale
    # handle still current to this thread (as on a real driver).
    assert reset_primary(0) == 0
    for _ in range(3):
        result = _native.after_cell(timeout=5)
        schemas["after_cell.schema.json"].validate(result)
        assert result["devices"] == []  # nothing in use, and no error about the stale context
    assert _native.trim()["devices"] == []
    assert [d["state"] for d in _native.snapshot()["devices"]] == ["idle"]
    # The framework uses the device again: the next cell uses the new context.
    settled.update({"devices": [{"primary_active": True}]})
    for timeout in (5, 0):
        [device] = _native.after_cell(timeout=timeout)["devices"]
        assert device["state"] == "drained", device
        assert device["error"] is None
    assert _native.trim()["devices"][0]["state"] == "trimmed"
    assert settled.counter("primary_resets") == 1
    assert settled.counter("contexts_created") == 0


def test_a_sticky_error_is_said_once_and_the_device_left_alone(settled, schemas):
    settled.reset(one_device("GPU-af7e0000-0000-4000-8000-0000000000a9", sticky_error=700))
    result = _native.after_cell(timeout=5)
    schemas["after_cell.schema.json"].validate(result)
    [device] = result["devices"]
    assert device["state"] == "unusable"
    assert device["message"] == "GPU0 is unusable after CUDA_ERROR_ILLEGAL_ADDRESS: restart the kernel"
    assert device["error"]["id"] == "gpucleanup.devices.201"
    retains = settled.counter("calls.cuDevicePrimaryCtxRetain")
    again = _native.after_cell(timeout=5)
    schemas["after_cell.schema.json"].validate(again)
    assert again["devices"][0]["state"] == "unusable"
    assert settled.counter("calls.cuDevicePrimaryCtxRetain") == retains
    assert settled.counter("calls.cuCtxSynchronize") == 0


def test_progress_can_stop_the_wait(settled, schemas):
    settled.reset(one_device("GPU-af7e0000-0000-4000-8000-0000000000aa", sync_seconds=-1))
    seen = []

    def progress(payload):
        seen.append(payload)
        return True

    result = _native.after_cell(timeout=60, progress=progress)
    schemas["after_cell.schema.json"].validate(result)
    assert len(seen) == 1 and seen[0]["device"] == 0 and seen[0]["limit_s"] == 60
    assert result["interrupted"] is True
    assert "keyboard_interrupt" not in result
    assert result["devices"][0]["settle"]["status"] == "interrupted"


def _send_sigint_once_waiting(fake_cuda, done: threading.Event) -> None:
    while fake_cuda.counter("syncs_in_flight") < 1 and not done.is_set():
        time.sleep(0.01)
    if not done.is_set():
        os.kill(os.getpid(), signal.SIGINT)


def test_ctrl_c_stops_the_wait_and_is_reported_not_raised(settled, schemas):
    settled.reset(one_device("GPU-af7e0000-0000-4000-8000-0000000000ab", sync_seconds=-1))
    done = threading.Event()
    sender = threading.Thread(target=_send_sigint_once_waiting, args=(settled, done))
    sender.start()
    try:
        result = _native.after_cell(timeout=60)
    finally:
        done.set()
        sender.join()
    schemas["after_cell.schema.json"].validate(result)
    assert result["keyboard_interrupt"] is True
    assert result["interrupted"] is True
    assert result["devices"][0]["settle"]["status"] == "interrupted"
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_ctrl_c_inside_the_progress_callback_stops_the_wait(settled):
    settled.reset(one_device("GPU-af7e0000-0000-4000-8000-0000000000ac", sync_seconds=-1))

    def progress(_payload):
        raise KeyboardInterrupt

    result = _native.after_cell(timeout=60, progress=progress)
    assert result["keyboard_interrupt"] is True
    assert result["devices"][0]["settle"]["status"] == "interrupted"


def test_bad_timeouts_are_refused_before_any_driver_call(fake_cuda):
    fake_cuda.reset({})
    with pytest.raises(ValueError):
        _native.after_cell(timeout=-1)
    with pytest.raises(ValueError):
        _native.after_cell(timeout=float("nan"))
    with pytest.raises(TypeError):
        _native.after_cell(timeout="5")
    assert fake_cuda.counter("calls.cuDeviceGetCount") == 0


def test_drain_keeps_working_beside_it(settled, schemas):
    settled.reset(one_device("GPU-af7e0000-0000-4000-8000-0000000000ad"))
    drained = _native.drain(timeout=5)
    schemas["drain.schema.json"].validate(drained)
    assert drained["devices"][0]["released_bytes"] == 2 * GiB - 512 * MiB
    settled.update({"devices": [{"default_pool": {"reserved_bytes": 1536 * MiB, "used_bytes": 512 * MiB}}]})
    result = _native.after_cell(timeout=5)
    schemas["after_cell.schema.json"].validate(result)
    assert result["devices"][0]["released_bytes"] == 1 * GiB
    assert settled.counter("threads") == 2  # drain and after_cell share the device's watchdog


def test_a_library_without_the_new_functions_is_said_plainly(monkeypatch):
    class Older:
        """A libgpucleanup of this ABI version built before gpucleanup_after_cell existed."""

    monkeypatch.setattr(_native, "held", lambda: Older())
    with pytest.raises(_native.NativeError, match=r"^\[gpucleanup\.python\.102\] .* has no gpucleanup_after_cell"):
        _native.after_cell()
    with pytest.raises(_native.NativeError, match=r"^\[gpucleanup\.python\.102\] .* has no gpucleanup_trim"):
        _native.trim()
    with pytest.raises(_native.NativeError, match=r"^\[gpucleanup\.python\.102\] .* has no gpucleanup_quiet"):
        _native.quiet()


def test_quiet_compares_with_what_the_last_after_cell_pass_left(settled):
    settled.reset(one_device("GPU-af7e0000-0000-4000-8000-0000000000b1", default_pool={"reserved_bytes": 0,
                                                                                      "used_bytes": 0}))
    _native.after_cell(timeout=5)
    assert _native.quiet() is True
    calls_before = settled.counter("calls.cuMemGetInfo"), settled.counter("calls.cuCtxSynchronize")
    for _ in range(10):
        assert _native.quiet() is True
    # one cuMemGetInfo a check, no synchronize, nothing trimmed, no context made
    assert (settled.counter("calls.cuMemGetInfo"), settled.counter("calls.cuCtxSynchronize")) == (
        calls_before[0] + 10, calls_before[1])
    settled.update({"devices": [{"free_bytes": 10 * GiB - 64 * MiB}]})  # memory taken
    assert _native.quiet() is False
    settled.update({"devices": [{"free_bytes": 10 * GiB}]})
    assert _native.quiet() is True
    # a pass that leaves memory in a driver pool leaves nothing to compare with
    settled.update({"devices": [{"default_pool": {"reserved_bytes": 256 * MiB, "used_bytes": 256 * MiB}}]})
    _native.after_cell(timeout=5)
    assert _native.quiet() is False
    assert settled.counter("contexts_created") == 0


# ---------------------------------------------------------------- the interpreter lock

def test_per_cell_calls_keep_the_interpreter_lock_unless_told_otherwise():
    # ctypes.PyDLL: a call of microseconds does not let another Python thread in
    assert isinstance(_native.held(), ctypes.PyDLL)
    assert not isinstance(_native.library(), ctypes.PyDLL)


def test_a_cell_makes_no_call_that_releases_the_interpreter_lock(settled, monkeypatch):
    # every per-cell function goes through ctypes.PyDLL, the reply's free() included
    _native.library()
    used = []

    class Releasing:  # the ctypes.CDLL handle, watched
        def __init__(self, lib):
            self._lib = lib

        def __getattr__(self, name):
            used.append(name)
            return getattr(self._lib, name)

    monkeypatch.setattr(_native, "_lib", Releasing(_native._lib))
    settled.reset(one_device("GPU-af7e0000-0000-4000-8000-0000000000b4"))
    assert _native.cuda_initialized() is True
    assert _native.after_cell(timeout=30)["devices"][0]["state"] == "drained"
    _native.trim()
    _native.snapshot()
    assert used == []


def test_a_call_that_keeps_the_lock_gives_it_up_while_a_device_settles(settled):
    # A device whose synchronize takes 0.3 s: a thread of Python's own must run during
    # the wait, although the call was made through ctypes.PyDLL. Had the library kept the
    # lock for the wait, the thread could not have counted at all until it returned.
    settled.reset(one_device("GPU-af7e0000-0000-4000-8000-0000000000b1", sync_seconds=0.3))
    counted = []
    stop = threading.Event()
    started = threading.Event()

    def count():
        started.set()
        while not stop.is_set():
            counted.append(1)
            time.sleep(0.001)

    thread = threading.Thread(target=count, daemon=True)
    thread.start()
    assert started.wait(10)
    before = len(counted)
    result = _native.after_cell(timeout=30)
    during = len(counted) - before
    stop.set()
    thread.join(10)
    assert result["devices"][0]["state"] == "drained"
    assert during > 0

