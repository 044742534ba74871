"""A drain from outside (``gpucleanup drain``, the page's Drain) gives back the frameworks' caches too.

A real kernel (ipykernel, gpucleanup loaded, the fake driver) with CuPy's and PyTorch's stand-ins
(tests/python/stand_ins) holding cached memory on GPU0, its automatic cleanup paused so that the caches
stay between cells: after the library's wait and trim the drain runs the kernel's own cleanup on a thread of
the kernel's own, the reply says per framework what came back, a cell that starts meanwhile waits for it, and a
drain during a cell is still refused. A finalizer (``__del__``) that the cleanup's garbage collection runs, held
as long as the test likes: the reply comes within the drain's time limit and says the cleanup goes on and what it
is doing, the status server answers meanwhile, a park waits for it or names it, a cell waits for it (bounded).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from gpucleanup.protocol import status_client
from test_park_kernel import Kernel, cli, environment, wait_until
from support import GiB, MiB  # noqa: E402

STAND_INS = Path(__file__).resolve().parent
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
def kernel(runtime, monkeypatch, request):
    monkeypatch.setenv("GPUCLEANUP_FAKE_CUDA_SCENARIO", json.dumps(SCENARIO))
    monkeypatch.delenv("GPUCLEANUP_FAKE_CUDA_CHECKPOINT_DIR", raising=False)
    if "parkable" in request.fixturenames:  # the fake driver's checkpoint calls, for a park
        checkpoints = runtime.parent / "checkpoints"
        checkpoints.mkdir()
        monkeypatch.setenv("GPUCLEANUP_FAKE_CUDA_CHECKPOINT_DIR", str(checkpoints))
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
    last = kernel.execute("from gpucleanup.in_kernel.extension import get_extension\n"
                          "_r = get_extension(get_ipython()).history.last(1)[0]\n"
                          "print(_r['cell'], _r['devices'][0]['freed_bytes'])")
    assert last == f"None {{'cupy': {GiB}, 'torch': {512 * MiB}}}\n"  # the drain's record: no cell


def test_a_drain_from_outside_is_counted_and_shown_as_one_not_as_a_cell(kernel):
    before = kernel.execute("from gpucleanup.in_kernel.extension import get_extension\n"
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
    drain = subprocess.Popen([sys.executable, "-m", "gpucleanup.outside.cli", "drain", str(kernel.pid), "--json",
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
    msg_id = kernel.start("from gpucleanup.in_kernel.extension import get_extension\n"
                          "get_extension(get_ipython())._link.say('set_state', {'state': 'idle', 'since_ns': time.time_ns()})\n"
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
    plain = cli("drain", str(kernel.pid), "--drain-timeout", "10")  # idle now: the caches come back, well within
    assert plain.stdout == f"kernel {kernel.pid} GPU0: drained, released 1.5 GiB (cupy 1.0 GiB, torch 512 MiB)\n"


# An object whose finalizer takes as long as the test holds it (at most 120 s), in a reference cycle that only a
# collection frees: the drain's garbage collection (gc "always") runs it. The kernel's own automatic collection is
# off, so that no other collection runs it first. The finalizer says when it starts and when it ends.
SLOW_FINALIZER = textwrap.dedent("""
    import gc
    %config GPUCleanup.gc = "always"
    gc.disable()
    class _SlowFinalizer:
        def __del__(self):
            open({started!r}, "w").close()
            deadline = time.monotonic() + 120
            while not os.path.exists({go!r}) and time.monotonic() < deadline:
                time.sleep(0.01)
            open({ended!r}, "w").close()
    _slow = _SlowFinalizer()
    _slow.cycle = _slow
    del _slow
""")


@pytest.fixture
def slow_finalizer(kernel, tmp_path):
    paths = {name: str(tmp_path / name) for name in ("started", "go", "ended")}
    out = kernel.execute(SLOW_FINALIZER.format(**paths))
    assert "Error" not in out, out
    yield {name: Path(path) for name, path in paths.items()}
    Path(paths["go"]).touch()


def test_a_slow_finalizer_in_the_drain_runs_off_the_servers_thread_and_the_reply_says_so(kernel, slow_finalizer):
    # The drain's reply comes within its time limit, while the finalizer still runs, and says what is happening.
    # (5 s: the kernel's part reaches the finalizer within it on a loaded machine too; the finalizer never ends.)
    result = cli("drain", str(kernel.pid), "--json", "--drain-timeout", "5")
    assert result.returncode == 0, result.stderr
    assert slow_finalizer["started"].exists() and not slow_finalizer["ended"].exists()
    reply = json.loads(result.stdout)
    part = reply["result"]["kernel"]
    assert (part["ran"], part["running"], part["skipped"], part["error"]) == (False, True, None, None), part
    assert part["doing"].startswith("in garbage collection, where objects' finalizers (__del__) run, for "), part
    assert [d["state"] for d in reply["result"]["devices"]] == ["drained"]

    # The status server answers meanwhile: status (with a fresh snapshot: no snapshot waits behind the drain),
    # and the state says the drain goes on.
    status = cli("status", str(kernel.pid), "--json")
    assert status.returncode == 0, status.stderr
    shown = json.loads(status.stdout)
    assert (shown["state"]["state"], shown["state"].get("cell"), shown["snapshot_status"]) == ("draining", None,
                                                                                              "fresh"), shown
    # Another drain is refused, naming the one that goes on, and says to ask again.
    again = cli("drain", str(kernel.pid), "--drain-timeout", "1")
    assert again.returncode == 4
    assert again.stderr == (f"gpucleanup: kernel {kernel.pid}: [gpucleanup.server.412] drain refused: an earlier "
                            "drain from outside is still running the kernel's own cleanup (garbage collection, where "
                            "objects' finalizers run, or the frameworks' caches); it ends by itself: ask again when "
                            "the kernel is idle\n")
    assert not slow_finalizer["ended"].exists()

    # A cell that starts now waits for it, says why once, then runs after it.
    msg_id = kernel.start(f"print(os.path.exists({str(slow_finalizer['ended'])!r}))")
    waited = []
    while not waited:
        msg = kernel.kc.get_iopub_msg(timeout=60)
        if msg["parent_header"].get("msg_id") == msg_id and msg["msg_type"] == "display_data":
            waited.append(msg["content"]["data"]["text/plain"])
    assert waited[0].startswith("gpucleanup · waiting for a drain asked for from outside (gpucleanup drain or the "
                                "page's Drain) to finish this kernel's garbage collection, where objects' finalizers "
                                "(__del__) run, at most "), waited
    slow_finalizer["go"].touch()
    out = kernel.collect(msg_id)
    assert out == "True\n", out  # one line of its own: the wait's line is said once, before the cell runs
    assert kernel.state()["state"] == "idle"
    # The drain's record says what it did once it ended.
    last = kernel.execute("from gpucleanup.in_kernel.extension import get_extension\n"
                          "_r = get_extension(get_ipython()).history.last(1)[0]\n"
                          "print(_r.get('source'), _r['devices'][0]['freed_bytes'])")
    assert last == f"outside {{'cupy': {GiB}, 'torch': {512 * MiB}}}\n", last


def test_the_drains_plain_reply_says_the_kernels_cleanup_goes_on(kernel, slow_finalizer):
    result = cli("drain", str(kernel.pid), "--drain-timeout", "5")  # the finalizer reached within it, under load too
    slow_finalizer["go"].touch()
    assert result.returncode == 0, result.stderr
    assert "may be stopped or overloaded" not in result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == f"kernel {kernel.pid} GPU0: drained, released 0 B", lines
    assert lines[1].startswith(f"kernel {kernel.pid}: the kernel's own cleanup is still running (in garbage "
                               "collection, where objects' finalizers (__del__) run, for "), lines
    assert lines[1].endswith(" s so far): it goes on by itself, nothing to do; the kernel says draining until it "
                             "ends, a cell or a park waits for it (at most 10 s), and its last cell then shows what "
                             "the drain freed"), lines
    assert len(lines) == 2 and result.stderr == ""
    wait_until(lambda: kernel.state()["state"] == "idle", "the drain's cleanup never ended")
    shown = cli("status", str(kernel.pid))
    assert "last cell  drain from outside freed 1.5 GiB" in shown.stdout, shown.stdout


def test_a_park_asked_for_during_the_drains_finalizer_is_told_the_drain_is_the_cause(kernel, slow_finalizer):
    result = cli("drain", str(kernel.pid), "--json", "--drain-timeout", "1")
    assert json.loads(result.stdout)["result"]["kernel"]["running"] is True
    # What the park's begin hears (gpucleanup park asks again while it passes), and what park --check says.
    with pytest.raises(status_client.StatusError) as refused:
        status_client.request(kernel.target(), "park", 5, step="begin")
    assert refused.value.error_id == "gpucleanup.server.421"
    assert str(refused.value).endswith(
        "park refused: a drain from outside (gpucleanup drain, the page's Drain) is running the kernel's own cleanup "
        "(the frameworks' caches, then garbage collection, where objects' finalizers run); it ends by itself: ask "
        "again when the kernel is idle"), str(refused.value)
    check = cli("park", "--check", str(kernel.pid), "--json")
    found = json.loads(check.stdout)
    assert found["parkable"] is False
    assert ("a drain from outside (gpucleanup drain, the page's Drain) is running the kernel's own cleanup (the "
            "frameworks' caches, then garbage collection, where objects' finalizers run); it ends by itself: ask "
            "again when the kernel is idle (a park waits for it up to 10 s)") in found["reasons"], found
    assert kernel.state()["state"] == "draining"  # nothing changed
    slow_finalizer["go"].touch()
    wait_until(lambda: kernel.state()["state"] == "idle", "the drain's cleanup never ended")


@pytest.fixture
def parkable():
    """The kernel fixture gives the fake driver checkpoint calls (a directory of their own)."""


def test_a_park_asked_for_during_the_drains_finalizer_waits_for_it_then_parks(parkable, kernel, slow_finalizer):
    result = cli("drain", str(kernel.pid), "--json", "--drain-timeout", "1")
    assert json.loads(result.stdout)["result"]["kernel"]["running"] is True
    refused_before = kernel.status()["server"]["errors"]
    park = subprocess.Popen([sys.executable, "-m", "gpucleanup.outside.cli", "park", str(kernel.pid)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=environment())
    try:
        # the park's begin is refused for the moment, and it asks again (each refusal counts as the server's error)
        wait_until(lambda: kernel.status()["server"]["errors"] >= refused_before + 2, "the park never asked")
        assert park.poll() is None and kernel.state()["state"] == "draining"
        slow_finalizer["go"].touch()
        stdout, stderr = park.communicate(timeout=120)
    finally:
        slow_finalizer["go"].touch()
        park.kill()
    assert park.returncode == 0, stderr
    assert stdout.startswith(f"kernel {kernel.pid}: parked "), stdout
    assert " for a release or a drain under way to end" in stdout, stdout
    assert kernel.state()["state"] == "parked"
    assert kernel.execute("print('resumed')").endswith("resumed\n")


def test_a_cell_that_outwaits_the_drains_finalizer_runs_beside_it_and_stays_running(kernel, slow_finalizer, tmp_path):
    # A cell waits for the kernel's cleanup at most OUTSIDE_DRAIN_MARGIN_S from its start: none here, for speed.
    kernel.execute("import gpucleanup.in_kernel.outside_drain as _od\n_od.OUTSIDE_DRAIN_MARGIN_S = 0.0")
    result = cli("drain", str(kernel.pid), "--json", "--drain-timeout", "0")
    assert json.loads(result.stdout)["result"]["kernel"]["running"] is True
    held = tmp_path / "held"
    msg_id = kernel.start(f"print('ran')\nwhile not os.path.exists({str(held)!r}):\n    time.sleep(0.01)")
    try:
        wait_until(lambda: kernel.state()["state"] == "running", "the cell never ran beside the drain")
        slow_finalizer["go"].touch()  # the drain's cleanup ends while the cell runs
        wait_until(lambda: (kernel.status()["last_record"] or {}).get("source") == "outside", "the drain never ended")
        wait_until(slow_finalizer["ended"].exists, "the finalizer never ended")
        for _ in range(25):  # the drain's end never says idle over the running cell
            state = kernel.state()
            assert state["state"] == "running", state
            subprocess.run([sys.executable, "-c", "pass"], check=True)  # a moment, without a timed assertion
    finally:
        held.touch()
    out = kernel.collect(msg_id)
    lines = out.splitlines()
    # said once, before the cell's own output; no line of waiting (nothing was left of the bound)
    assert len(lines) == 2 and lines[1] == "ran", out
    assert lines[0].startswith("gpucleanup · the kernel's cleanup for a drain from outside still runs (in garbage "
                               "collection, where objects' finalizers (__del__) run, for "), out
    assert lines[0].endswith(" s so far); a cell waits for it at most 0 s from its start: this cell runs beside it"), out
    wait_until(lambda: kernel.state()["state"] == "idle", "the cell never said idle")


def test_a_cell_that_outwaited_the_drains_finalizer_and_ended_leaves_the_kernel_draining_until_it_ends(
        kernel, slow_finalizer):
    kernel.execute("import gpucleanup.in_kernel.outside_drain as _od\n_od.OUTSIDE_DRAIN_MARGIN_S = 0.0")
    result = cli("drain", str(kernel.pid), "--json", "--drain-timeout", "0")
    assert json.loads(result.stdout)["result"]["kernel"]["running"] is True
    out = kernel.execute("print('ran')")
    assert out.endswith("this cell runs beside it\nran\n"), out
    # The cell has ended; the finalizer still runs: the kernel is not idle, and no park may begin beside it.
    state = kernel.state()
    assert (state["state"], state.get("cell")) == ("draining", None), state
    with pytest.raises(status_client.StatusError) as refused:
        status_client.request(kernel.target(), "park", 5, step="begin")
    assert refused.value.error_id == "gpucleanup.server.421"
    slow_finalizer["go"].touch()
    wait_until(lambda: kernel.state()["state"] == "idle", "the drain's end never said idle")
    assert kernel.execute("print('next')") == "next\n"  # nothing left to wait for, nothing said


def test_jupyter_shuts_the_kernel_down_while_a_drains_reply_waits_for_a_finalizer(kernel, slow_finalizer):
    drain = subprocess.Popen([sys.executable, "-m", "gpucleanup.outside.cli", "drain", str(kernel.pid), "--drain-timeout",
                              "60"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environment())
    try:
        wait_until(slow_finalizer["started"].exists, "the finalizer never ran")
        # What Jupyter does: a shutdown request, SIGTERM only past half of shutdown_wait_time. The reply's wait for
        # the finalizer (up to 60 s here) ends at exit: the kernel exits by itself (a loaded machine may take more
        # than the default 2.5 s to get there, so the wait is longer: exit status 0 says no signal ended it).
        kernel.km.shutdown_wait_time = 60
        kernel.km.shutdown_kernel(now=False)
        assert kernel.process.wait(timeout=60) == 0  # no SIGTERM, SIGKILL, SIGSEGV or SIGABRT
        stdout, stderr = drain.communicate(timeout=120)
    finally:
        slow_finalizer["go"].touch()
        drain.kill()
    assert not slow_finalizer["ended"].exists()  # the finalizer never finished: the exit did not wait for it
    # The close stops the reply's wait at once; which comes first, the reply that says so or the server's stop,
    # is a race the drain may see either way, and each answer is true: never a hang, never a wrong figure.
    if drain.returncode == 0:
        assert "the kernel's own cleanup is still running" in stdout, (stdout, stderr)
    else:
        assert drain.returncode == 4, (stdout, stderr)
        assert stderr == (f"gpucleanup: kernel {kernel.pid}: [gpucleanup.server.416] the server stopped before the "
                          "drain finished\n"), stderr


def test_the_library_gives_the_kernels_part_what_is_left_of_the_drains_time_limit(kernel):
    kernel.execute("from gpucleanup.in_kernel.extension import get_extension\n"
                   "_outside = get_extension(get_ipython()).outside\n_run, _waits = _outside.run, []\n"
                   "_outside.run = lambda wait_s: (_waits.append(wait_s), _run(wait_s))[1]")
    for limit in ("5", "0"):
        result = cli("drain", str(kernel.pid), "--json", "--drain-timeout", limit)
        assert result.returncode == 0, result.stderr
        assert json.loads(result.stdout)["result"]["kernel"]["ran"] is True
    waits = [float(w) for w in kernel.execute("print(*_waits)").split()]
    # no queued work here: the library's own part takes milliseconds of the limit (generous bound: 2 s)
    assert len(waits) == 2 and 3.0 <= waits[0] <= 5.0 and waits[1] == 0.0, waits


class _Native:
    """What OutsideDrain needs of the library: a drain hook it can set and clear."""

    def __init__(self):
        self.hooked = None

    def set_drain_hook(self, target):
        self.hooked = target
        return True

    def clear_drain_hook(self, target):
        if self.hooked is target:
            self.hooked = None


class _Endpoint:
    running = True


def _outside_drain(clean):
    from gpucleanup.in_kernel.cell_state import CellState
    from gpucleanup.in_kernel.outside_drain import OutsideDrain

    said = []
    drain = OutsideDrain(_Native(), CellState(), clean, lambda: None, said.extend,
                         lambda kind, text: said.append(text))
    drain.hook(_Endpoint())
    return drain, said


def test_the_kernels_cleanup_runs_on_a_thread_of_its_own_and_an_unhook_ends_the_replys_wait_at_once():
    import gc
    import threading

    let_go, inside = threading.Event(), threading.Event()
    ran_on = []

    class Held:
        def __del__(self):
            inside.set()
            let_go.wait(60)

    def clean(overrides):
        ran_on.append((threading.get_ident(), overrides))
        held = Held()
        held.cycle = held
        del held
        gc.collect()

    drain, _ = _outside_drain(clean)
    answer = []
    caller = threading.Thread(target=lambda: answer.append(drain.native.hooked(30.0)))
    caller.start()
    try:
        assert inside.wait(60), "the finalizer never ran"
        drain.unhook()  # the endpoint closes: the reply stops waiting though the finalizer still runs
        caller.join(60)
        assert not caller.is_alive()
        part = answer[0]
        assert (part["ran"], part["running"], part["skipped"], part["error"]) == (False, True, None, None)
        assert part["doing"].startswith("in garbage collection, where objects' finalizers (__del__) run, for ")
        assert drain.running and drain.native.hooked is None
    finally:
        let_go.set()
    assert ran_on[0][0] not in (caller.ident, threading.get_ident())  # neither the library's thread nor the test's
    assert ran_on[0][1] == {"settle_timeout": 0.0, "show": "never"}
    for _ in range(6000):
        if not drain.running:
            break
        threading.Event().wait(0.01)
    assert not drain.running and not drain.collecting


def test_a_cleanup_that_ends_within_the_wait_gives_its_figures_and_bad_waits_get_the_least():
    drain, _ = _outside_drain(lambda overrides: None)
    for wait in (5.0, float("nan"), -3, None, "x", float("inf")):
        part = drain.run(wait)
        assert (part["ran"], part["skipped"], part["error"], part["devices"]) == (True, None, None, []), (wait, part)
        assert "running" not in part
