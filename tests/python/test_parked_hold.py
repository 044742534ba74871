"""The hold while parked (gpucleanup.park.parked_hold) on the fake driver: a JAX kernel's own threads, which call the
driver on their own, are kept stopped from before the lock until after the unlock, and nothing else is touched."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from conftest import FAKE_CUDA
from support import wait_until
from test_park import FAST, checkpoints, env, names, record  # noqa: F401 (fixtures)

from gpucleanup.park import kernel_side as parking, parked_hold, steps as park

# A process that looks like a JAX kernel to the park (it maps a file named as XLA's CUDA plugin) and has a thread
# that calls the driver over and over on its own, as XLA's stream poller does.
JAX_LIKE = r"""
import ctypes, mmap, sys, threading, time
lib = ctypes.CDLL(sys.argv[1])
count = ctypes.c_int()
lib.cuDeviceGetCount(ctypes.byref(count))   # the fake registers this process (and its restore thread)
plugin = open(sys.argv[2], "rb")
mapped = mmap.mmap(plugin.fileno(), 0, prot=mmap.PROT_READ) if sys.argv[2] else None
polls = [0]

def poll():
    c = ctypes.c_int()
    while True:
        lib.cuDeviceGetCount(ctypes.byref(c))
        polls[0] += 1
        time.sleep(0.001)

poller = threading.Thread(target=poll, daemon=True)
poller.start()
while not poller.native_id:
    time.sleep(0.001)
print(poller.native_id, flush=True)
for line in sys.stdin:
    before = polls[0]
    while polls[0] == before:
        time.sleep(0.001)
    print("polling", flush=True)
"""


def start_target(env, tmp_path, jax: bool = True):
    plugin = tmp_path / "jax_plugins" / "xla_cuda13" / "xla_cuda_plugin.so"
    plugin.parent.mkdir(parents=True, exist_ok=True)
    plugin.write_bytes(b"\0" * 4096)
    other = tmp_path / "libother.so"
    other.write_bytes(b"\0" * 4096)
    # no opt-in (GPUCLEANUP_PARK_UNPROVEN): every park here holds the threads, which lets JAX's park through
    proc = subprocess.Popen([sys.executable, "-c", JAX_LIKE, str(FAKE_CUDA), str(plugin if jax else other)],
                            env={k: v for k, v in env.items() if k != "GPUCLEANUP_PARK_UNPROVEN"},
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    return proc, int(proc.stdout.readline())


def thread_state(pid: int, tid: int) -> str:
    with open(f"/proc/{pid}/task/{tid}/stat") as fh:
        return fh.read().rpartition(")")[2].split()[0]


def tracer(pid: int, tid: int) -> int:
    with open(f"/proc/{pid}/task/{tid}/status") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("TracerPid:"))


def gone(pid: int, limit: float = 5.0) -> bool:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().rpartition(")")[2].split()[0] == "Z":
            return True
        time.sleep(0.01)
    return False


@pytest.fixture
def jax_like(env, tmp_path):
    proc, poller = start_target(env, tmp_path)
    yield proc, poller
    proc.kill()
    proc.wait()


def test_a_jax_kernels_own_thread_is_held_from_before_the_lock_until_after_the_unlock(jax_like, env, checkpoints,
                                                                                      tmp_path):
    proc, poller = jax_like
    pid = proc.pid
    asked = []

    def hold_threads(restore_thread):
        asked.append(restore_thread)
        return [poller]

    lock_file = tmp_path / "kernel.park"
    outcome = parking.park_kernel(pid, lambda step, size: {}, lock_file, FAST, env, hold_threads=hold_threads)
    assert (outcome.ok, outcome.state) == (True, "checkpointed")
    kept = record(checkpoints, pid)
    assert asked == [kept["restore_tid"]]  # the kernel is told the driver's restore thread, to leave it running
    held = outcome.parked_hold
    assert (held["held"], held["threads"], held["missed"], held["pid"]) == (True, 1, 0, pid)
    holder = held["holder"]
    # while parked: the poller is stopped, traced by the hold's helper (held after the lock, as CRIU freezes a
    # process: a call it made after the lock waits in the driver, at most one)
    assert (thread_state(pid, poller), tracer(pid, poller)) == ("t", holder)
    assert kept["calls_while_parked"].get("cuDeviceGetCount", 0) <= 1
    waiting = kept["calls_while_parked"]
    assert json.loads(lock_file.read_text())["held"]["holder"] == holder  # the resume finds it there
    # the main thread is not held: the process answers (its stdin is read by a thread the hold left alone)
    assert thread_state(pid, pid) != "t"

    resumed = parking.resume_kernel(pid, None, lock_file, FAST, env)
    assert (resumed.ok, resumed.state, names(resumed)) == (True, "running", ["state", "restore", "unlock"])
    # the resume held every other thread itself and left the poller to the park's hold
    hold = resumed.steps[1].hold
    assert (hold["held"], hold["held_since_park"]) == (True, 1)
    kept = record(checkpoints, pid)
    assert (kept["running_at_restore"], kept["running_at_unlock"]) == ([], [])
    # after the unlock the hold ended: its helper is gone and the poller calls the driver again
    assert gone(holder)
    assert tracer(pid, poller) == 0
    proc.stdin.write("go\n")
    proc.stdin.flush()
    assert proc.stdout.readline().strip() == "polling"
    assert record(checkpoints, pid)["calls_while_parked"] == waiting  # none entered while it was held


def test_a_process_without_jax_is_parked_without_a_hold(env, checkpoints, tmp_path):
    proc, poller = start_target(env, tmp_path, jax=False)
    try:
        asked = []
        outcome = park.park(proc.pid, FAST, env=env, hold_threads=lambda restore: asked.append(restore) or [poller])
        assert (outcome.ok, outcome.parked_hold, asked) == (True, None, [])
        assert thread_state(proc.pid, poller) != "t"
        assert park.resume(proc.pid, FAST, env=env).ok
    finally:
        proc.kill()
        proc.wait()


def test_a_hold_that_cannot_be_made_after_the_lock_unlocks_the_process_and_says_why(jax_like, env, checkpoints,
                                                                                    monkeypatch):
    proc, poller = jax_like
    monkeypatch.setattr(parked_hold, "start", lambda *args: {"held": False, "threads": 0,
                                                             "why": "thread 7 could not be held (ptrace: EPERM)"})
    outcome = park.park(proc.pid, FAST, env=env, hold_threads=lambda restore: [poller])
    assert (outcome.ok, outcome.state, names(outcome)) == (False, "running", ["state", "lock", "unlock"])
    assert outcome.message == (
        f"[gpucleanup.park.654] process {proc.pid} runs JAX, whose own threads call the driver while the process is "
        "checkpointed and die there: they are held while it is parked, and this time they could not be (thread 7 "
        "could not be held (ptrace: EPERM)): it is not parked and runs as before")
    kept = record(checkpoints, proc.pid)
    assert (kept["state"], kept["calls"].get("cuCheckpointProcessCheckpoint")) == ("running", None)


@pytest.mark.parametrize("error", [ValueError("filedescriptor out of range in select()"), OSError(24, "Too many open files")])
def test_a_hold_that_raises_after_the_lock_unlocks_the_process_and_says_why(jax_like, env, checkpoints, monkeypatch,
                                                                           error):
    # never a locked kernel left behind: its next cell would wait for ever for the driver
    proc, poller = jax_like

    def start(*args):
        raise error

    monkeypatch.setattr(parked_hold, "start", start)
    outcome = park.park(proc.pid, FAST, env=env, hold_threads=lambda restore: [poller])
    assert (outcome.ok, outcome.state, names(outcome)) == (False, "running", ["state", "lock", "unlock"])
    assert outcome.message.startswith(f"[gpucleanup.park.654] process {proc.pid} runs JAX")
    assert f"this time they could not be ({type(error).__name__}: {error})" in outcome.message
    assert record(checkpoints, proc.pid)["state"] == "running"


def test_ctrl_c_while_the_threads_are_being_held_unlocks_the_process_and_stops_the_helper(jax_like, env, checkpoints,
                                                                                         monkeypatch):
    proc, poller = jax_like
    real_start = parked_hold.start
    helpers = []

    def start(pid, command, limit_ms, env_, cwd, allow=None):
        def allowed(helper):
            helpers.append(helper)
            if allow is not None:
                allow(helper)
            raise KeyboardInterrupt  # as the CLI's Ctrl-C or SIGTERM lands while the helper starts
        return real_start(pid, command, limit_ms, env_, cwd, allowed)

    monkeypatch.setattr(parked_hold, "start", start)
    outcome = park.park(proc.pid, FAST, env=env, hold_threads=lambda restore: [poller])
    assert (outcome.ok, outcome.state, names(outcome)) == (False, "running", ["state", "lock", "unlock"])
    assert "interrupted (Ctrl-C or SIGTERM) while its threads were being held" in outcome.message
    assert len(helpers) == 1 and gone(helpers[0])
    assert record(checkpoints, proc.pid)["state"] == "running"
    assert tracer(proc.pid, poller) == 0 and thread_state(proc.pid, poller) != "t"


def test_a_park_that_fails_after_the_hold_leaves_a_locked_kernels_threads_held_for_its_resume(jax_like, env,
                                                                                             checkpoints, monkeypatch):
    # A thread let go while the process is locked or parked could call the driver there and kill a real JAX kernel:
    # the hold ends with the resume's unlock, which finds it by its threads' tracer.
    proc, poller = jax_like
    real_step = park.step

    def step(pid, name, *args, **kwargs):
        if name == "checkpoint":
            raise RuntimeError("the checkpoint's helper could not be started")
        return real_step(pid, name, *args, **kwargs)

    monkeypatch.setattr(park, "step", step)
    with pytest.raises(RuntimeError):
        park.park(proc.pid, FAST, env=env, hold_threads=lambda restore: [poller])
    assert record(checkpoints, proc.pid)["state"] == "locked"
    assert tracer(proc.pid, poller) != 0 and thread_state(proc.pid, poller) == "t"
    monkeypatch.setattr(park, "step", real_step)
    resumed = park.resume(proc.pid, FAST, env=env)
    assert (resumed.ok, resumed.state) == (True, "running"), resumed.message
    assert tracer(proc.pid, poller) == 0 and thread_state(proc.pid, poller) != "t"


def test_a_jax_kernel_whose_restore_thread_the_driver_does_not_name_is_refused_before_the_lock(jax_like, env,
                                                                                               checkpoints,
                                                                                               monkeypatch):
    proc, poller = jax_like
    real_state = park.state

    def state(pid, *args, **kwargs):
        return dataclasses.replace(real_state(pid, *args, **kwargs), restore_thread=None)

    monkeypatch.setattr(park, "state", state)
    with pytest.raises(park.ParkRefused) as refused:
        park.park(proc.pid, FAST, env=env, hold_threads=lambda restore: [poller])
    assert "(the driver did not name its restore thread, which must run while the others are held)" in str(
        refused.value)
    assert record(checkpoints, proc.pid)["calls"].get("cuCheckpointProcessLock") is None


def test_no_helper_may_hold_threads_under_yamas_strictest_scopes(tmp_path, monkeypatch):
    yama = tmp_path / "sys" / "kernel" / "yama"
    yama.mkdir(parents=True)
    for scope, said in (("0", None), ("1", None),
                        ("3", "Yama's ptrace_scope is 3 on this machine: no process may trace another")):
        (yama / "ptrace_scope").write_text(scope + "\n")
        assert park.ptrace_refusal(str(tmp_path)) == said
    (yama / "ptrace_scope").write_text("2\n")
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert park.ptrace_refusal(str(tmp_path)) == (
        "Yama's ptrace_scope is 2 on this machine: only root may trace another process")
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    assert park.ptrace_refusal(str(tmp_path)) is None
    assert park.ptrace_refusal(str(tmp_path / "none")) is None  # no Yama: the ordinary rules


def test_the_kernels_own_park_of_a_jax_kernel_whose_notebook_thread_runs_is_refused():
    stop = threading.Event()
    train = threading.Thread(target=stop.wait, name="train-loop", daemon=True)
    train.start()
    try:
        assert parking._threads_to_hold_here(None) == (  # noqa: SLF001
            "1 thread of the notebook still runs (train-loop), which would call JAX while it is parked; park it once "
            "they end")
    finally:
        stop.set()
        train.join()
    assert isinstance(parking._threads_to_hold_here(None), list)  # noqa: SLF001


def test_a_park_the_driver_refuses_lets_the_held_threads_go(jax_like, env, checkpoints, monkeypatch):
    proc, poller = jax_like
    pid = proc.pid
    holders = []
    real_start = parked_hold.start

    def start(*args):
        report = real_start(*args)
        holders.append(report["holder"])
        return report

    monkeypatch.setattr(parked_hold, "start", start)
    from test_park import patch
    patch(checkpoints, pid, {"errors": {"cuCheckpointProcessCheckpoint": 999}})
    outcome = park.park(pid, FAST, env=env, hold_threads=lambda restore: [poller])
    assert (outcome.ok, outcome.state, outcome.parked_hold) == (False, "running", None)
    assert names(outcome) == ["state", "lock", "checkpoint", "unlock"]
    assert len(holders) == 1 and gone(holders[0])
    assert tracer(pid, poller) == 0 and thread_state(pid, poller) != "t"


def test_the_kernel_holds_every_thread_but_its_python_threads_zeromqs_gpucleanups_and_the_restore_thread(tmp_path):
    task = tmp_path / "proc" / "900" / "task"
    names_of = {900: "python", 901: "python", 902: "ZMQbg/IO/0", 903: "ZMQbg/Reaper", 904: "gpucleanup-srv",
                905: "python", 906: "cuda-EvtHandlr", 907: "tf_XLAEigen", 908: "python"}
    for tid, name in names_of.items():
        (task / str(tid)).mkdir(parents=True)
        (task / str(tid) / "comm").write_text(name + "\n")
    # 900, 901: Python threads; 908: the driver's restore thread; 905, 906, 907: XLA's and the driver's own
    assert parked_hold.threads_to_hold(908, [900, 901], proc=str(tmp_path / "proc"), pid=900) == [905, 906, 907]
    assert parked_hold.threads_to_hold(None, [900], proc=str(tmp_path / "proc"), pid=900) == [901, 905, 906, 907, 908]
    assert parked_hold.threads_to_hold(None, [], proc=str(tmp_path / "proc"), pid=1) == []  # no such process


def test_the_release_never_signals_a_process_that_is_not_the_hold(tmp_path):
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        # its pid, but another start time (a pid taken again), or a command that is no hold: left alone
        stale = {"held": True, "threads": 1, "holder": sleeper.pid, "start": parked_hold._start_time(sleeper.pid) + 1}
        assert parked_hold.release(stale, 4242) is None
        same = dict(stale, start=parked_hold._start_time(sleeper.pid))
        assert parked_hold.release(same, 4242) is None
        time.sleep(0.1)
        assert sleeper.poll() is None
    finally:
        sleeper.send_signal(signal.SIGKILL)
        sleeper.wait()


def _one_thread_for_another(before, then) -> None:
    """Runs ``before`` while a thread runs, then ``then`` once its task has left the process and another thread has
    started: as many threads as before, other thread ids."""
    first_go, second_go = threading.Event(), threading.Event()
    first = threading.Thread(target=first_go.wait, daemon=True)
    first.start()
    before()
    first_go.set()
    first.join()
    # join() returns as Python lets go of the thread: its task may be listed a moment longer
    wait_until(lambda: str(first.native_id) not in os.listdir("/proc/self/task"), "the first thread's task gone")
    second = threading.Thread(target=second_go.wait, daemon=True)
    second.start()
    try:
        then()
    finally:
        second_go.set()
        second.join()


def test_a_jax_kernel_lists_every_thread_it_has_for_a_park_from_outside_to_hold_or_spare(tmp_path, monkeypatch):
    lock_file = tmp_path / "kernel-1.park"
    listed = parked_hold.listed_path(lock_file)
    threads = parked_hold.ThreadList()
    threads.seen(lock_file)
    assert not os.path.exists(listed)  # no JAX imported: nothing listed, nothing read but a dict
    monkeypatch.setitem(sys.modules, "jaxlib", sys)
    threads.seen(lock_file)
    note = json.loads(open(listed).read())
    pid = os.getpid()
    mine = parked_hold.threads_to_hold(None)
    tids = sorted(int(t) for t in os.listdir("/proc/self/task"))
    assert note == {"pid": pid, "threads": [[t, parked_hold.thread_start(pid, t)] for t in mine],
                    "spared": [[t, parked_hold.thread_start(pid, t)] for t in tids if t not in mine]}
    assert oct(os.stat(listed).st_mode & 0o777) == "0o600"
    assert [n for n in os.listdir(tmp_path) if n.endswith(".part")] == []
    # the same threads at the next cell: not written again; one thread ended as another started: written again
    written = []

    def first_cell():
        threads.seen(lock_file)
        written.append(os.stat(listed).st_ino)
        threads.seen(lock_file)
        assert os.stat(listed).st_ino == written[0]

    _one_thread_for_another(first_cell, lambda: threads.seen(lock_file))
    assert os.stat(listed).st_ino != written[0]
    uid = os.getuid()
    assert parked_hold.listed_threads(lock_file, pid, None, uid) == mine
    # another process's list, another owner's file, or none at all: the kernel cannot say (None)
    assert parked_hold.listed_threads(lock_file, pid + 1, None, uid) is None
    assert parked_hold.listed_threads(lock_file, pid, None, uid + 1) is None
    threads.close()
    assert not os.path.exists(listed)
    assert parked_hold.listed_threads(lock_file, pid, None, uid) is None


def _task(proc, pid: int, tid: int, start: int) -> None:
    """A thread of a made-up /proc: its ``stat`` with the start time (field 22)."""
    where = proc / str(pid) / "task" / str(tid)
    where.mkdir(parents=True, exist_ok=True)
    (where / "stat").write_text(f"{tid} (t) S " + " ".join(["0"] * 18) + f" {start} 0 0\n")


def test_a_park_from_outside_holds_the_listed_threads_still_the_same_and_refuses_any_it_cannot_place(tmp_path):
    proc, pid, uid = tmp_path / "proc", 700, os.getuid()
    lock_file = tmp_path / "kernel-1.park"
    for tid, start in ((700, 50), (701, 60), (702, 70), (703, 80)):
        _task(proc, pid, tid, start)

    def listing(**note):
        with open(parked_hold.listed_path(lock_file), "w") as fh:
            json.dump(dict({"pid": pid}, **note), fh)
        return parked_hold.listed_threads(lock_file, pid, 703, uid, proc=str(proc))

    # 701 and 702 XLA's, 703 the driver's restore thread (never held), 700 the kernel's Python thread
    assert listing(threads=[[701, 60], [702, 70], [703, 80]], spared=[[700, 50]]) == [701, 702]
    # a listed thread that ended since is simply not held
    assert listing(threads=[[701, 60], [702, 70], [704, 90]], spared=[[700, 50]]) == [701, 702]
    # a thread in neither list (started since the last cell ended), or an id that came back for another thread
    # (another start time): nothing says whether it calls the driver, so the park is refused
    _task(proc, pid, 705, 100)
    assert listing(threads=[[701, 60], [702, 70]], spared=[[700, 50]]) == (
        "1 thread started since its last cell ended (705), which the kernel has not listed: run a cell")
    assert listing(threads=[[701, 61], [702, 70], [705, 100]], spared=[[700, 50]]) == (
        "1 thread started since its last cell ended (701), which the kernel has not listed: run a cell")
    # a list from before the spared threads were listed too: as none
    assert listing(threads=[[701, 60], [702, 70], [705, 100]]) is None


def test_a_park_from_outside_of_a_jax_kernel_that_listed_no_threads_is_refused_before_the_lock(jax_like, env,
                                                                                                checkpoints):
    proc, poller = jax_like
    with pytest.raises(park.ParkRefused) as refused:
        park.park(proc.pid, FAST, env=env, hold_threads=lambda restore: None)
    assert str(refused.value).endswith("and this time they could not be (the kernel has listed none yet; it lists "
                                       "them as a cell ends: run a cell): it is not parked and runs as before")
    assert record(checkpoints, proc.pid)["calls"].get("cuCheckpointProcessLock") is None


def test_a_jax_kernel_reaps_the_hold_helpers_that_ended_as_a_cell_ends(monkeypatch, tmp_path):
    # a resume from outside ends the helper the kernel's own park started: it must not stay the kernel's zombie
    helper = subprocess.Popen([sys.executable, "-c", "pass"])
    monkeypatch.setattr(parked_hold, "_started", [helper])
    wait_until(lambda: gone(helper.pid, 0.01), "the helper ended")
    assert helper.returncode is None  # ended, not reaped: a zombie
    monkeypatch.setitem(sys.modules, "jaxlib", sys)
    parking.InKernel(lambda: None, lambda lines: None).threads_seen()  # a cell ends
    assert helper.returncode == 0 and parked_hold._started == []  # reaped (poll() set its status)  # noqa: SLF001


def test_a_hold_whose_helper_ends_but_is_not_reaped_yet_has_ended():
    # the helper of a park made by another process (the server) ends as it is told, and stays a zombie until that
    # process reaps it: the release sees it ended, and neither waits for it nor kills it
    helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "hold", "4242"])
    try:
        deadline = time.monotonic() + 10
        while b"hold" not in open(f"/proc/{helper.pid}/cmdline", "rb").read():
            assert time.monotonic() < deadline, "the stand-in never started"
            time.sleep(0.01)
        report = {"held": True, "threads": 1, "holder": helper.pid, "start": parked_hold._start_time(helper.pid)}
        assert parked_hold.release(report, 4242) is None  # SIGUSR1 ended it (its default action)
        assert parked_hold._start_time(helper.pid) is None
        assert open(f"/proc/{helper.pid}/stat").read().rpartition(")")[2].split()[0] == "Z"  # not reaped by it
    finally:
        helper.kill()
        helper.wait()


def test_a_resume_not_given_the_parks_report_finds_the_hold_and_ends_it_after_the_unlock(jax_like, env, checkpoints):
    # the bare python -m gpucleanup.park resume PID: no lock file's note, the hold found by its threads' tracer
    proc, poller = jax_like
    pid = proc.pid
    outcome = park.park(pid, FAST, env=env, hold_threads=lambda restore: [poller])
    holder = outcome.parked_hold["holder"]
    assert parked_hold.find(pid) == {"held": True, "threads": 1, "holder": holder,
                                     "start": outcome.parked_hold["start"]}
    resumed = park.resume(pid, FAST, env=env)
    assert (resumed.ok, resumed.state) == (True, "running")
    assert resumed.steps[1].hold["held_since_park"] == 1
    assert gone(holder) and tracer(pid, poller) == 0 and parked_hold.find(pid) is None
    proc.stdin.write("go\n")
    proc.stdin.flush()
    assert proc.stdout.readline().strip() == "polling"


def test_with_holding_turned_off_a_jax_kernel_is_refused_unless_let_through_then_parked_without_the_hold(
        jax_like, env, checkpoints):
    proc, poller = jax_like
    asked = []
    off = dict(env, GPUCLEANUP_PARK_HOLD="off")
    off.pop("GPUCLEANUP_PARK_UNPROVEN", None)  # the park's own environment has no opt-in, whatever the runner's has
    with pytest.raises(park.ParkRefused, match=r"park\.651.*this park holds none \(holding is turned off here"):
        park.park(proc.pid, FAST, env=off, hold_threads=lambda restore: asked.append(restore) or [poller])
    assert asked == [] and park.state(proc.pid, FAST, env=env).state == park.RUNNING
    # the opt-in of the process that parks: in the park's own environment, where it reads GPUCLEANUP_PARK_HOLD too
    outcome = park.park(proc.pid, FAST, env=dict(off, GPUCLEANUP_PARK_UNPROVEN="jax"),
                        hold_threads=lambda restore: asked.append(restore) or [poller])
    assert (outcome.ok, outcome.parked_hold, asked) == (True, None, [])
    assert tracer(proc.pid, poller) == 0
    assert park.resume(proc.pid, FAST, env=env).ok
