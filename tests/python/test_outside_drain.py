"""A drain from outside (``gpucleanup drain``, the page's Drain) gives back the frameworks' caches too.

A real kernel (ipykernel, gpucleanup loaded, the fake driver) with CuPy's and PyTorch's stand-ins
(tests/python/stand_ins) holding cached memory on GPU0, its automatic cleanup paused so that the caches
stay between cells: the drain runs the kernel's own cleanup on the status server's thread before the
library trims the driver's pools, the reply says per framework what came back, a cell that starts
meanwhile waits for it, and a drain during a cell is still refused.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from test_park_kernel import Kernel, cli, environment, wait_until

STAND_INS = Path(__file__).resolve().parent
GiB = 1 << 30
MiB = 1 << 20
SCENARIO = {"devices": [{"uuid": "GPU-0d7a0000-0000-0000-0000-000000000001", "primary_active": True,
                         "total_bytes": 80 * GiB, "free_bytes": 70 * GiB}]}

# Pauses the automatic cleanup (so the caches stay), then puts CuPy with 1 GiB cached and PyTorch with
# 512 MiB cached on GPU0 into the kernel's sys.modules.
SETUP = textwrap.dedent(f"""
    %gpumem --off
    import ctypes, os, sys, threading, time
    sys.path.insert(0, {str(STAND_INS)!r})
    import pytest
    from stand_ins import World, install_cupy, install_torch
    _mp = pytest.MonkeyPatch()
    _world = World(n_devices=1, active=(0,))
    _cupy = install_cupy(_mp, _world, used={{0: 0}}, free={{0: {GiB}}})
    _torch = install_torch(_mp, _world, allocated={{0: 0}}, reserved={{0: {512 * MiB}}})
    _fake = ctypes.CDLL(os.environ["GPUCLEANUP_LIBCUDA"])
""")

CACHES = "print('cupy', _cupy.pool.free, 'torch', _torch.reserved, 'violations', _world.violations)"


@pytest.fixture
def kernel(runtime, monkeypatch):
    monkeypatch.setenv("GPUCLEANUP_FAKE_CUDA_SCENARIO", json.dumps(SCENARIO))
    monkeypatch.delenv("GPUCLEANUP_FAKE_CUDA_CHECKPOINT_DIR", raising=False)
    k = Kernel(runtime)
    try:
        out = k.execute("%load_ext gpucleanup")
        assert "Error" not in out, out
        out = k.execute(SETUP)
        assert out == "gpucleanup · automatic cleanup paused (%gpumem --on resumes it)\n", out
        wait_until(lambda: k.state()["state"] == "idle", "the kernel never said idle")
        yield k
    finally:
        k.stop()


def test_drain_empties_the_frameworks_caches_and_says_per_framework_what_came_back(kernel, schemas):
    result = cli("drain", str(kernel.pid), "--drain-timeout", "5")
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"kernel {kernel.pid} GPU0: drained, released 1.5 GiB (cupy 1.0 GiB, torch 512 MiB)\n"
    assert result.stderr == ""
    assert kernel.execute(CACHES) == "cupy {0: 0} torch {0: 0} violations []\n"
    assert kernel.state()["state"] == "idle"

    # Nothing cached any more: the next drain runs the kernel's cleanup, which finds nothing to give back.
    result = cli("drain", str(kernel.pid), "--json", "--drain-timeout", "5")
    assert result.returncode == 0, result.stderr
    reply = json.loads(result.stdout)
    schemas["drain.schema.json"].validate(reply["result"])
    part = reply["result"]["kernel"]
    assert (part["ran"], part["skipped"], part["error"], part["released_bytes"]) == (True, None, None, {})
    assert [(d["index"], d["state"], d["released_bytes"]) for d in part["devices"]] == [(0, "drained", {})]
    assert result.stdout.count('"ran": true') == 1


def test_the_reply_carries_the_figures_and_the_history_keeps_the_drain(kernel, schemas):
    result = cli("drain", str(kernel.pid), "--json", "--drain-timeout", "5")
    assert result.returncode == 0, result.stderr
    drained = json.loads(result.stdout)["result"]
    schemas["drain.schema.json"].validate(drained)
    part = drained["kernel"]
    assert part["ran"] is True and part["skipped"] is None and part["error"] is None
    assert part["released_bytes"] == {"cupy": GiB, "torch": 512 * MiB}
    assert [(d["index"], d["state"], d["released_bytes"]) for d in part["devices"]] == [
        (0, "drained", {"cupy": GiB, "torch": 512 * MiB})]
    assert [d["state"] for d in drained["devices"]] == ["drained"]
    last = kernel.execute("from gpucleanup.extension import get_extension\n"
                          "_r = get_extension(get_ipython()).history.last(1)[0]\n"
                          "print(_r['cell'], _r['devices'][0]['freed_bytes'])")
    assert last == f"None {{'cupy': {GiB}, 'torch': {512 * MiB}}}\n"  # the drain's record: no cell


def test_a_drain_from_outside_is_counted_and_shown_as_one_not_as_a_cell(kernel):
    before = kernel.execute("from gpucleanup.extension import get_extension\n"
                            "_t = get_extension(get_ipython()).totals.as_dict()\n"
                            "print(_t['cleanups'], _t['drains_from_outside'])")
    cleanups = int(before.split()[0])
    assert before.split()[1] == "0"
    result = cli("drain", str(kernel.pid), "--drain-timeout", "5")
    assert result.returncode == 0, result.stderr
    after = kernel.execute("_e = get_extension(get_ipython())\n"
                           "_t = _e.totals.as_dict()\n"
                           "print(_t['cleanups'], _t['drains_from_outside'], _e.history.last(1)[0].get('source'))")
    # the drain's record says where it came from; the cells cleaned stay as they were
    assert after == f"{cleanups} 1 outside\n"
    shown = cli("status", str(kernel.pid))
    assert shown.returncode == 0, shown.stderr
    assert "last cell  drain from outside freed 1.5 GiB" in shown.stdout, shown.stdout


def test_a_cell_started_during_the_kernels_part_of_the_drain_waits_for_it(kernel, tmp_path):
    # CuPy's pool gives its blocks back only once the test lets it: the drain's part in the kernel is under way
    # until then.
    go = tmp_path / "go"
    kernel.execute(textwrap.dedent(f"""
        _free_all_blocks = _cupy.pool.free_all_blocks
        def _free_when_let_go(stream=None):
            deadline = time.monotonic() + 120
            while not os.path.exists({str(go)!r}) and time.monotonic() < deadline:
                time.sleep(0.01)
            _free_all_blocks(stream)
        _cupy.pool.free_all_blocks = _free_when_let_go
    """))
    drain = subprocess.Popen([sys.executable, "-m", "gpucleanup.cli", "drain", str(kernel.pid), "--json",
                              "--drain-timeout", "5"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=environment())
    try:
        wait_until(lambda: kernel.state()["state"] == "draining", "the kernel's part of the drain never started")
        msg_id = kernel.start(CACHES)
        waited = []
        while not waited:  # the cell has started, and waits
            msg = kernel.kc.get_iopub_msg(timeout=60)
            if msg["parent_header"].get("msg_id") == msg_id and msg["msg_type"] == "display_data":
                waited.append(msg["content"]["data"]["text/plain"])
        assert waited[0].startswith("gpucleanup · waiting for a drain asked for from outside (gpucleanup drain or "
                                    "the page's Drain) to finish emptying this kernel's caches, at most "), waited
        go.touch()
        out = kernel.collect(msg_id)
        stdout, stderr = drain.communicate(timeout=120)
    finally:
        go.touch()
        drain.kill()
    # The cell's first line ran after the kernel's part of the drain: both caches were empty by then.
    assert out == "cupy {0: 0} torch {0: 0} violations []\n", out
    assert drain.returncode == 0, stderr
    part = json.loads(stdout)["result"]["kernel"]
    assert part["ran"] is True and part["released_bytes"] == {"cupy": GiB, "torch": 512 * MiB}
    assert kernel.state()["state"] == "idle"


def test_a_drain_during_a_cell_is_refused(kernel, tmp_path):
    kernel.execute("%gpumem --on")  # the cells say "running" again
    go = tmp_path / "go"
    msg_id = kernel.start(f"while not os.path.exists({str(go)!r}):\n    time.sleep(0.01)")
    try:
        wait_until(lambda: kernel.state()["state"] == "running", "the cell never ran")
        result = cli("drain", str(kernel.pid), "--drain-timeout", "1")
    finally:
        go.touch()
    kernel.collect(msg_id)
    assert result.returncode == 4
    assert result.stderr == (f"gpucleanup: kernel {kernel.pid}: [gpucleanup.server.411] drain refused: the kernel is "
                             "running; a drain runs only between cells (state idle)\n")


def test_a_cell_under_way_keeps_the_kernels_part_out_even_when_the_server_takes_the_drain(kernel, tmp_path):
    # The cell tells the server it is idle (as nothing in gpucleanup does during a cell): the server takes the
    # drain, and the kernel's part still leaves the caches to the cell.
    go, started = tmp_path / "go", tmp_path / "started"
    msg_id = kernel.start("from gpucleanup.extension import get_extension\n"
                          "get_extension(get_ipython())._status('set_state', {'state': 'idle', 'since_ns': time.time_ns()})\n"
                          f"open({str(started)!r}, 'w').close()\nwhile not os.path.exists({str(go)!r}):\n"
                          "    time.sleep(0.01)\n" + CACHES)
    try:
        wait_until(started.exists, "the cell never ran")
        assert kernel.state()["state"] == "idle"
        result = cli("drain", str(kernel.pid), "--json", "--drain-timeout", "1")
    finally:
        go.touch()
    assert kernel.collect(msg_id) == f"cupy {{0: {GiB}}} torch {{0: {512 * MiB}}} violations []\n"
    assert result.returncode == 0, result.stderr
    part = json.loads(result.stdout)["result"]["kernel"]
    assert (part["ran"], part["skipped"], part["released_bytes"]) == (False, "a cell is under way", {})
    plain = cli("drain", str(kernel.pid), "--drain-timeout", "1")  # idle now: the caches come back
    assert plain.stdout == f"kernel {kernel.pid} GPU0: drained, released 1.5 GiB (cupy 1.0 GiB, torch 512 MiB)\n"
