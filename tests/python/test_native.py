"""libgpucleanup through its ctypes binding, against the fake CUDA driver.

Every JSON the library hands out is validated against share/schema. The
library keeps per-device state for the life of the process (keyed by UUID), so
scenarios that would leave a device unusable or busy use UUIDs of their own or
finish their waits before the test ends.
"""

from __future__ import annotations

import ast
import os
import pathlib
import subprocess
import sys
import re
import time

import pytest

import gpucleanup
from gpucleanup import _native
from support import GiB, MiB  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]


def eventually(condition, timeout=10.0):
    """Polls until condition() holds (never a blind sleep)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True


def eight_devices_three_in_use():
    # UUIDs of their own: the library remembers a device's name by its UUID, and the fake driver's default
    # UUIDs are those of every other test's devices (one named "Fake H100" would keep that name here)
    return {"devices": [{"primary_active": i in (1, 4, 6), "uuid": f"GPU-8d000000-0000-4000-8000-00000000000{i}"}
                        for i in range(8)]}


@pytest.fixture
def settled(fake_cuda):
    """The fake driver; after the test, every hanging synchronize is released and finished."""
    yield fake_cuda
    fake_cuda.release_sync()
    assert eventually(lambda: fake_cuda.counter("syncs_in_flight") == 0 and fake_cuda.counter("retained") == 0)


def test_versions_match_the_binding():
    assert _native.abi_version() == _native.ABI_VERSION
    assert _native.version() == gpucleanup.__version__


def test_file_size_is_the_regular_files_size_at_the_path_else_minus_one(tmp_path):
    path = tmp_path / "lock.park"
    assert _native.held().gpucleanup_file_size is not None  # the library's own call, not the fallback
    assert _native.file_size(bytes(path)) == -1  # none yet
    path.write_bytes(b"12345")
    assert _native.file_size(bytes(path)) == 5
    os.truncate(path, 0)  # written in place, as a park's note is
    assert _native.file_size(bytes(path)) == 0
    link = tmp_path / "link.park"
    link.symlink_to(path)
    assert _native.file_size(bytes(link)) == -1  # a link is not followed
    fifo = tmp_path / "fifo.park"
    os.mkfifo(fifo)
    assert _native.file_size(bytes(fifo)) == -1  # not a regular file, and not opened
    assert _native.file_size(bytes(tmp_path)) == -1  # a directory


def test_file_size_without_the_librarys_call_answers_the_same_through_os_lstat(tmp_path, monkeypatch):
    path = tmp_path / "lock.park"
    path.write_bytes(b"123")
    link = tmp_path / "link.park"
    link.symlink_to(path)
    monkeypatch.setattr(_native, "held", lambda: object())  # a build older than gpucleanup_file_size
    assert [_native.file_size(bytes(p)) for p in (path, link, tmp_path, tmp_path / "none")] == [3, -1, -1, -1]
    assert _native.file_size(bytes(path) + b"\0tail") == -1  # names no file


def test_probe_and_snapshot_follow_the_schema(fake_cuda, schemas):
    fake_cuda.reset(eight_devices_three_in_use())
    probe = _native.probe()
    schemas["snapshot.schema.json"].validate(probe)
    assert probe["kind"] == "probe"
    snapshot = gpucleanup.snapshot()
    schemas["snapshot.schema.json"].validate(snapshot)
    assert snapshot["kind"] == "snapshot"
    assert snapshot["driver"]["state"] == "ready"
    assert snapshot["driver"]["resolver"] == "cuGetProcAddress_v2"


def test_eight_devices_three_in_use_only_those_have_memory_and_no_context_is_created(fake_cuda, schemas):
    fake_cuda.reset(eight_devices_three_in_use())
    scripted = fake_cuda.state()
    snapshot = gpucleanup.snapshot()
    schemas["snapshot.schema.json"].validate(snapshot)
    devices = snapshot["devices"]
    assert [d["index"] for d in devices] == list(range(8))
    assert [d["index"] for d in devices if d["in_use"]] == [1, 4, 6]
    for device in devices:
        assert device["name"] == scripted["devices"][device["index"]]["name"]
        assert device["uuid"] == scripted["devices"][device["index"]]["uuid"]
        assert device["total_bytes"] == 80 * GiB
        if device["in_use"]:
            assert device["state"] == "in_use"
            assert device["context"] == "primary"
            assert device["free_bytes"] == 80 * GiB - 512 * MiB
            assert [p["which"] for p in device["pools"]] == ["default"]
        else:
            assert device["state"] == "idle"
            assert device["context"] is None
            assert device["free_bytes"] is None
            assert device["used_bytes"] is None
            assert device["pools"] == []

    drained = gpucleanup.drain(timeout=5)
    schemas["drain.schema.json"].validate(drained)
    assert [d["index"] for d in drained["devices"]] == [1, 4, 6]
    assert all(d["state"] == "drained" for d in drained["devices"])
    assert fake_cuda.counter("contexts_created") == 0
    assert fake_cuda.counter("cuInit") == 0
    assert fake_cuda.counter("retained") == 0
    assert fake_cuda.counter("pushed") == 0


def test_uninitialised_process_is_not_initialised_and_never_calls_cuinit(fake_cuda, schemas):
    fake_cuda.reset({"initialized": False, "devices": [{}, {}]})
    snapshot = gpucleanup.snapshot()
    schemas["snapshot.schema.json"].validate(snapshot)
    assert snapshot["driver"]["state"] == "not_initialized"
    assert snapshot["devices"] == []
    drained = gpucleanup.drain(timeout=1)
    schemas["drain.schema.json"].validate(drained)
    assert drained["devices"] == []
    assert fake_cuda.counter("cuInit") == 0


def test_drain_trims_the_pools_and_free_rises_by_what_was_released(fake_cuda, schemas):
    fake_cuda.reset(
        {
            "devices": [
                {
                    "primary_active": True,
                    "free_bytes": 10 * GiB,
                    "default_pool": {"reserved_bytes": 3 * GiB, "used_bytes": 1 * GiB, "pending_free_bytes": 1 * GiB},
                }
            ]
        }
    )
    result = gpucleanup.drain(timeout=5)
    schemas["drain.schema.json"].validate(result)
    device = result["devices"][0]
    assert device["settle"]["status"] == "done"
    assert device["released_bytes"] == 2 * GiB
    assert device["free_after_bytes"] - device["free_before_bytes"] == 2 * GiB
    assert device["pools"][0]["reserved_after_bytes"] == 1 * GiB


def test_drain_returns_at_the_limit_while_the_gpu_hangs(settled, schemas):
    settled.reset({"devices": [{"primary_active": True, "sync_seconds": -1, "uuid": "GPU-0000000a-0000-0000-0000-000000000001"}]})
    result = gpucleanup.drain(timeout=0.5)  # the fake never finishes: returning is the bound
    schemas["drain.schema.json"].validate(result)
    device = result["devices"][0]
    assert device["state"] == "busy"
    assert device["settle"]["status"] == "timeout"
    waited = re.match(r"GPU0 is still busy after ([0-9.]+) s: ", device["message"])
    assert waited is not None and float(waited.group(1)) >= 0.5, device["message"]

    again = gpucleanup.drain(timeout=5)
    schemas["drain.schema.json"].validate(again)
    assert again["devices"][0]["settle"]["status"] == "still_busy"
    assert settled.counter("calls.cuCtxSynchronize") == 1
    snapshot = gpucleanup.snapshot()
    schemas["snapshot.schema.json"].validate(snapshot)
    assert snapshot["devices"][0]["state"] == "busy"


def test_progress_callback_is_called_and_can_stop_the_wait(settled, schemas):
    settled.reset({"devices": [{"primary_active": True, "sync_seconds": -1, "uuid": "GPU-0000000a-0000-0000-0000-000000000002"}]})
    seen = []

    def progress(report):
        seen.append(report)
        return True

    result = _native.drain(timeout=30, progress=progress)
    schemas["drain.schema.json"].validate(result)
    assert len(seen) == 1
    assert seen[0]["device"] == 0
    assert seen[0]["limit_s"] == 30
    assert seen[0]["waited_s"] >= 2
    assert result["interrupted"] is True
    assert result["devices"][0]["settle"]["status"] == "interrupted"
    assert result["elapsed_s"] < 5


def test_negative_or_non_finite_timeout_is_a_value_error(fake_cuda):
    fake_cuda.reset({})
    for bad in (-1, float("nan"), float("inf")):
        with pytest.raises(ValueError):
            gpucleanup.drain(timeout=bad)
    assert fake_cuda.counter("calls.cuDeviceGetCount") == 0


def test_invalid_arguments_reach_the_library_as_errors_with_ids(fake_cuda):
    lib = _native.library()
    assert lib.gpucleanup_drain(-1.0, _native.PROGRESS_FN(lambda *_: 0), None, None) == _native.ERR_INVALID_ARGUMENT
    assert lib.gpucleanup_last_error().decode().startswith("[gpucleanup.api.101] json_out is NULL")
    with pytest.raises(_native.NativeError) as error:
        _native.server_set_state({"state": "idle"})
    assert error.value.status == _native.ERR_SERVER
    assert str(error.value).startswith("[gpucleanup.api.107] ")


def test_no_driver_is_a_state_in_a_fresh_process():
    env = dict(os.environ)
    env["GPUCLEANUP_LIBCUDA"] = "/nonexistent/libcuda.so.1"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "ipython_ext"), env.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, "-c", "import gpucleanup, gpucleanup._native as n; assert n.cuda_initialized() is None; "
                               "print(gpucleanup.snapshot())"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    snapshot = ast.literal_eval(done.stdout.strip())
    assert snapshot["driver"]["state"] == "no_driver"
    assert snapshot["driver"]["message"].startswith("[gpucleanup.driver.101] no CUDA driver: cannot load /nonexistent/libcuda.so.1")
    assert snapshot["devices"] == []


def test_the_library_gives_the_list_of_its_entry_points_and_it_is_the_checkouts_entry_points_def():
    # the list the binding declares every function with comes from the library it loaded (made from
    # entry_points.def when it was built): a copy of the package or of the library never needs the file
    from gpucleanup import _native

    lib = _native.library()
    own = _native._entry_points(lib)
    from_file = _native._entry_points(None)
    assert [e[0] for e in own] == [e[0] for e in from_file]
    assert own == from_file
    assert "gpucleanup_entry_points" in [e[0] for e in own] and len(own) == 36
