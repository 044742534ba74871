"""Parking a process through gpucleanup.park: each step in a helper process of its own, against the
fake driver's checkpoint state machine (tests/fake_cuda/checkpoint_state.cpp), whose records in
GPUCLEANUP_FAKE_CUDA_CHECKPOINT_DIR every process sees.

The target is a real process that loaded the fake driver (so it registered as a CUDA process); it
makes one driver call each time it reads a line, which shows that a call made while parked waits
and completes after the resume."""

from __future__ import annotations

import fcntl
import json
import os
import pathlib
import select
import subprocess
import sys
import time

import pytest

from conftest import FAKE_CUDA

from gpucleanup.park import steps as park

TARGET = r"""
import ctypes, sys
lib = ctypes.CDLL(sys.argv[1])
count = ctypes.c_int()
lib.cuDeviceGetCount(ctypes.byref(count))   # the fake registers this process as it loads
print("ready", flush=True)
for line in sys.stdin:
    print(lib.cuDeviceGetCount(ctypes.byref(count)), flush=True)
"""


@pytest.fixture
def checkpoints(tmp_path):
    directory = tmp_path / "checkpoints"
    directory.mkdir()
    return directory


@pytest.fixture
def env(checkpoints):
    out = dict(os.environ, GPUCLEANUP_FAKE_CUDA_CHECKPOINT_DIR=str(checkpoints))
    out.pop("GPUCLEANUP_FAKE_CUDA_SCENARIO", None)
    return out


@pytest.fixture
def target(env):
    proc = subprocess.Popen([sys.executable, "-c", TARGET, str(FAKE_CUDA)], env=env, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    yield proc
    proc.kill()
    proc.wait()


def record(checkpoints, pid: int) -> dict:
    """The process's record, read under the flock the fake takes to rewrite it (never half-written)."""
    with open(checkpoints / f"{pid}.json") as fh:
        fcntl.flock(fh, fcntl.LOCK_SH)
        return json.loads(fh.read())


def patch(checkpoints, pid: int, change: dict) -> None:
    """Merges ``change`` into the process's record under the same flock the fake takes."""
    with open(checkpoints / f"{pid}.json", "r+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        data = json.loads(fh.read())
        data.update(change)
        fh.seek(0)
        fh.truncate()
        fh.write(json.dumps(data))


def names(outcome) -> list:
    return [s.name for s in outcome.steps]


FAST = park.Limits(state_s=30, lock_s=30, lock_timeout_s=5, checkpoint_s=30, restore_s=30, unlock_s=30)


def test_park_then_resume_moves_the_process_through_every_state(target, env, checkpoints):
    parked = park.park(target.pid, FAST, env=env)
    assert (parked.ok, parked.state, parked.changed, parked.message) == (True, "checkpointed", True,
                                                                          f"parked process {target.pid}")
    assert names(parked) == ["state", "lock", "checkpoint"]
    assert record(checkpoints, target.pid)["state"] == "checkpointed"
    resumed = park.resume(target.pid, FAST, env=env)
    assert (resumed.ok, resumed.state, resumed.changed, resumed.message) == (True, "running", True,
                                                                              f"resumed process {target.pid}")
    assert names(resumed) == ["state", "restore", "unlock"]
    assert record(checkpoints, target.pid)["state"] == "running"


def test_a_driver_call_made_while_parked_waits_and_completes_after_the_resume(target, env, checkpoints):
    assert park.park(target.pid, FAST, env=env).ok
    target.stdin.write("call\n")
    target.stdin.flush()
    deadline = time.monotonic() + 30
    while record(checkpoints, target.pid)["calls_while_parked"].get("cuDeviceGetCount", 0) == 0:
        assert time.monotonic() < deadline, "the parked process never made its call"
        time.sleep(0.01)
    assert select.select([target.stdout], [], [], 0)[0] == []  # still waiting in the driver
    assert park.resume(target.pid, FAST, env=env).ok
    assert target.stdout.readline().strip() == "0"  # CUDA_SUCCESS, once running again


def test_resuming_a_running_process_does_nothing(target, env):
    outcome = park.resume(target.pid, FAST, env=env)
    assert (outcome.ok, outcome.state, outcome.changed) == (True, "running", False)
    assert outcome.message == f"process {target.pid} is not parked: nothing to resume"
    assert names(outcome) == ["state"]


def test_a_failed_checkpoint_unlocks_and_leaves_the_process_as_it_was(target, env, checkpoints):
    patch(checkpoints, target.pid, {"errors": {"cuCheckpointProcessCheckpoint": 2}})
    outcome = park.park(target.pid, FAST, env=env)
    assert (outcome.ok, outcome.state, outcome.changed) == (False, "running", False)
    assert outcome.message == (f"[gpucleanup.park.620] the checkpoint failed with CUDA_ERROR_OUT_OF_MEMORY: process "
                               f"{target.pid} was unlocked and runs as before, nothing was parked")
    assert names(outcome) == ["state", "lock", "checkpoint", "unlock"]
    assert record(checkpoints, target.pid)["state"] == "running"


def test_a_hung_checkpoint_is_stopped_reported_and_the_process_unlocked(target, env, checkpoints):
    patch(checkpoints, target.pid, {"hang": ["cuCheckpointProcessCheckpoint"]})
    limits = park.Limits(state_s=30, lock_s=30, lock_timeout_s=5, checkpoint_s=1, restore_s=30, unlock_s=30)
    outcome = park.park(target.pid, limits, env=env)
    assert [(s.name, s.hung) for s in outcome.steps] == [("state", False), ("lock", False), ("checkpoint", True),
                                                         ("state", False), ("unlock", False)]
    assert (outcome.ok, outcome.state) == (False, "running")
    assert outcome.message == (f"[gpucleanup.park.620] the checkpoint outran its limit of 1 s: process {target.pid} "
                               "was unlocked and runs as before, nothing was parked")


def test_a_busy_process_is_not_locked_and_keeps_running(target, env, checkpoints):
    patch(checkpoints, target.pid, {"busy": True})
    limits = park.Limits(lock_timeout_s=0.05)
    outcome = park.park(target.pid, limits, env=env)
    assert (outcome.ok, outcome.state) == (False, "running")
    assert outcome.message == (f"[gpucleanup.park.616] process {target.pid} did not stop its GPU work within 0 s: it "
                               "was not parked and runs as before; park it when it is idle")
    assert record(checkpoints, target.pid)["calls"].get("cuCheckpointProcessCheckpoint") is None


def test_a_failed_restore_leaves_the_process_parked_and_says_how_to_retry(target, env, checkpoints):
    assert park.park(target.pid, FAST, env=env).ok
    patch(checkpoints, target.pid, {"errors": {"cuCheckpointProcessRestore": 1}})
    failed = park.resume(target.pid, FAST, env=env)
    assert (failed.ok, failed.state, failed.changed) == (False, "checkpointed", False)
    assert failed.message == (f"[gpucleanup.park.624] the restore of process {target.pid} failed with "
                              "CUDA_ERROR_INVALID_VALUE: it stays parked, its GPU memory safe in host memory; retry "
                              f"with python -m gpucleanup.park resume {target.pid}")
    patch(checkpoints, target.pid, {"errors": {}})
    retried = park.resume(target.pid, FAST, env=env)
    assert (retried.ok, retried.state) == (True, "running")


def test_a_restore_that_loses_the_process_says_so(target, env, checkpoints):
    assert park.park(target.pid, FAST, env=env).ok
    patch(checkpoints, target.pid, {"errors": {"cuCheckpointProcessRestore": 304},
                                    "error_state": {"cuCheckpointProcessRestore": "failed"}})
    outcome = park.resume(target.pid, FAST, env=env)
    assert (outcome.ok, outcome.state) == (False, "failed")
    assert outcome.message == (f"[gpucleanup.park.625] the restore of process {target.pid} failed with "
                               "CUDA_ERROR_OPERATING_SYSTEM and left it failed: its GPU state may be lost; save what "
                               "you can and restart it")


def test_a_process_left_locked_is_unlocked_by_resume(target, env, checkpoints):
    patch(checkpoints, target.pid, {"state": "locked"})
    outcome = park.resume(target.pid, FAST, env=env)
    assert (outcome.ok, outcome.state, outcome.changed) == (True, "running", True)
    assert names(outcome) == ["state", "unlock"]


def test_park_refuses_a_process_that_is_parked_locked_or_failed(target, env, checkpoints):
    pid = target.pid
    expected = {
        "checkpointed": f"[gpucleanup.park.613] process {pid} is already parked: resume it with python -m gpucleanup.park resume {pid}",
        "locked": f"[gpucleanup.park.614] process {pid} is locked by an earlier step that did not finish: bring it "
                  f"back with python -m gpucleanup.park resume {pid}",
        "failed": f"[gpucleanup.park.615] the driver reports process {pid} as failed: it cannot be parked; save what "
                  "you can and restart it",
    }
    for state, message in expected.items():
        patch(checkpoints, pid, {"state": state})
        with pytest.raises(park.ParkRefused) as refused:
            park.park(pid, FAST, env=env)
        assert str(refused.value) == message
        assert record(checkpoints, pid)["calls"].get("cuCheckpointProcessLock") is None


def test_park_refuses_a_process_that_never_used_cuda(env):
    other = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE, env=env)
    try:
        with pytest.raises(park.ParkRefused) as refused:
            park.park(other.pid, FAST, env=env)
        assert str(refused.value) == (f"[gpucleanup.park.612] process {other.pid} is not a CUDA process the driver can "
                                      "park (CUDA_ERROR_INVALID_VALUE): it has not used the GPU, or it has exited")
    finally:
        other.kill()
        other.wait()


def test_park_refuses_with_a_sentence_on_a_driver_without_checkpoint_calls(target, env, checkpoints):
    old = dict(env, GPUCLEANUP_FAKE_CUDA_SCENARIO=json.dumps({"driver_version": 12040}))
    with pytest.raises(park.ParkRefused) as refused:
        park.park(target.pid, FAST, env=old)
    assert str(refused.value) == (
        f"[gpucleanup.park.602] the CUDA driver {env['GPUCLEANUP_LIBCUDA']} (CUDA 12.4) has no checkpoint calls "
        "(cuCheckpointProcessGetState, cuCheckpointProcessLock, cuCheckpointProcessCheckpoint, "
        "cuCheckpointProcessRestore, cuCheckpointProcessUnlock): parking needs a driver for CUDA 12.8 or newer "
        "(R570 or later); update the NVIDIA driver, or leave the kernel running")
    assert record(checkpoints, target.pid)["state"] == "running"


def test_resume_of_a_process_killed_while_parked_says_it_is_gone(target, env):
    assert park.park(target.pid, FAST, env=env).ok
    target.kill()
    target.wait()
    outcome = park.resume(target.pid, FAST, env=env)
    assert (outcome.ok, outcome.state, outcome.changed) == (False, None, False)
    assert outcome.message == (f"[gpucleanup.park.612] process {target.pid} is not a CUDA process the driver can "
                               "park (CUDA_ERROR_INVALID_VALUE): it has not used the GPU, or it has exited")


def test_host_memory_that_cannot_hold_the_device_state_is_a_refusal(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       67108864 kB\nMemFree:        1000 kB\nMemAvailable:   8388608 kB\n")
    gib = 1 << 30
    # 64 GiB machine: margin 3.2 GiB; 8 GiB available.
    assert park.host_memory_refusal(4 * gib, str(meminfo)) is None
    assert park.host_memory_refusal(6 * gib, str(meminfo)) == (
        "[gpucleanup.park.621] host memory cannot hold this kernel's GPU memory: parking needs 6.0 GiB plus a margin "
        "of 3.2 GiB, and only 8.0 GiB is available: free host memory (or park a smaller kernel)")
    assert park.host_memory_refusal(None, str(meminfo)) is None


def test_park_refuses_when_host_memory_cannot_hold_the_device_state(target, env, checkpoints):
    with pytest.raises(park.ParkRefused) as refused:
        park.park(target.pid, FAST, env=env, parked_bytes=1 << 60)
    assert str(refused.value).startswith("[gpucleanup.park.621] host memory cannot hold this kernel's GPU memory: "
                                         "parking needs 1048576.0 TiB plus a margin of ")
    assert str(refused.value).endswith(": free host memory (or park a smaller kernel)")
    assert record(checkpoints, target.pid)["calls"].get("cuCheckpointProcessLock") is None
    assert record(checkpoints, target.pid)["state"] == "running"


def test_the_helper_refuses_bad_arguments_with_its_usage():
    done = subprocess.run([sys.executable, "-m", "gpucleanup.park.native_step", "suspend", "12"], capture_output=True,
                          text=True)
    assert done.returncode == 2
    assert done.stderr.strip() == ("usage: python -m gpucleanup.park.native_step {state,lock,checkpoint,restore,unlock,resume} PID "
                                   "[LOCK_TIMEOUT_MS]")


def test_the_command_line_reads_the_state_and_resumes(target, env, checkpoints):
    def run(*args):
        done = subprocess.run([sys.executable, "-m", "gpucleanup.park", *args], capture_output=True, text=True, env=env)
        return done.returncode, done.stdout.strip()

    assert run("state", str(target.pid)) == (0, f"process {target.pid} is running")
    assert park.park(target.pid, FAST, env=env).ok
    assert run("state", str(target.pid)) == (1, f"process {target.pid} is checkpointed")
    assert run("resume", str(target.pid)) == (0, f"resumed process {target.pid}")
    assert record(checkpoints, target.pid)["state"] == "running"
    code, out = run("resume", str(target.pid), "--json")
    assert code == 0 and json.loads(out)["message"] == f"process {target.pid} is not parked: nothing to resume"


def test_a_process_on_more_than_one_gpu_is_refused_and_one_gpu_is_not():
    gib = 1 << 30
    view = [park.Gpu(0, "GPU-aaaa", 100 * gib, 140 * gib), park.Gpu(1, "GPU-bbbb", 100 * gib, 140 * gib)]
    assert park.unrestorable_refusal(4242, {"GPU-bbbb": gib, "GPU-aaaa": 2 * gib}, view) == (
        "[gpucleanup.park.627] process 4242 uses 2 GPUs (GPU0 2.0 GiB, GPU1 1.0 GiB): it is not parked, because the "
        "driver cannot restore a process that has used two GPUs together (a cross-GPU copy or peer access: its "
        "restore fails and the process is lost) and one that has not loses its first cross-GPU copy after the "
        "resume; give each kernel one GPU (CUDA_VISIBLE_DEVICES) to make it parkable")
    assert park.unrestorable_refusal(4242, {"GPU-aaaa": gib}, view) is None
    assert park.unrestorable_refusal(4242, {}, view) is None
    assert park.unrestorable_refusal(4242, None, None) is None


def test_a_cells_end_arms_the_idle_park_timer_only_when_asked_and_a_requested_park_without_endpoint_says_why():
    from gpucleanup.park.kernel_side import InKernel

    said = []
    kernel = InKernel(lambda: None, said.extend)
    kernel.after_cell(0.0)  # neither a park asked for nor a timer: nothing armed, nothing said
    assert kernel._timer is None and said == []
    kernel.after_cell(3600.0)
    first = kernel._timer
    assert first is not None and first.daemon and first.is_alive() and first.interval == 3600.0
    kernel.after_cell(3600.0)  # re-armed from this cell's end: the old timer is cancelled
    assert kernel._timer is not first and first.finished.is_set()
    kernel.after_cell(0.0)  # turned off: the timer goes
    assert kernel._timer is None and said == []
    kernel.requested = True  # %gpumem --park, with the status endpoint off
    kernel.after_cell(0.0)
    assert not kernel.requested and len(said) == 1 and "parking needs the status endpoint" in said[0]


# ------------------------------------------------ the helper's arguments (gpucleanup.park.native_step.main)

HELPER_USAGE = "usage: python -m gpucleanup.park.native_step {state,lock,checkpoint,restore,unlock,resume} PID [LOCK_TIMEOUT_MS]"
NOT_DIGITS = ("PID must be a decimal integer from 1 to 2147483647 in digits alone (no sign, space or exponent), "
              "got {!r}: pass the id of the process to act on")
OUT_OF_RANGE = "PID must be from 1 to 2147483647, got {!r}: pass the id of the process to act on"


@pytest.fixture
def no_native(monkeypatch):
    """Makes loading the library fail the test: a refused argument must be refused before it is loaded."""
    import gpucleanup

    monkeypatch.delattr(gpucleanup, "_native", raising=False)
    monkeypatch.setitem(sys.modules, "gpucleanup._native", None)


@pytest.mark.parametrize("args, sentence", [
    (["state", "4294967297"], OUT_OF_RANGE.format("4294967297")),  # wrapped to pid 1 in the C int
    (["state", "2147483648"], OUT_OF_RANGE.format("2147483648")),
    (["state", "0"], OUT_OF_RANGE.format("0")),
    (["state", "-1"], NOT_DIGITS.format("-1")),
    (["state", ""], NOT_DIGITS.format("")),
    (["state", " 12"], NOT_DIGITS.format(" 12")),
    (["state", "1e3"], NOT_DIGITS.format("1e3")),
    (["lock", "12", "4294967296"],
     "LOCK_TIMEOUT_MS must be from 0 to 4294967295, got '4294967296': pass the lock's limit in milliseconds "
     "(0: no limit)"),
    (["lock", "12", "-5"],
     "LOCK_TIMEOUT_MS must be a decimal integer from 0 to 4294967295 in digits alone (no sign, space or exponent), "
     "got '-5': pass the lock's limit in milliseconds (0: no limit)"),
])
def test_the_helper_refuses_a_pid_or_timeout_it_cannot_pass_exactly(args, sentence, no_native, capsys):
    from gpucleanup.park.native_step import main

    assert main(args) == 2
    out, err = capsys.readouterr()
    assert out == ""
    # The sentence is the last line: what gpucleanup.park quotes when the helper gives no answer.
    assert err == f"{HELPER_USAGE}\npark_step: {sentence}\n"


def test_the_helper_answers_json_at_the_bounds_of_its_arguments(target, env, checkpoints):
    def helper(step, pid, *extra):  # started as gpucleanup.park starts it
        done = subprocess.run(park.helper_command(step, pid, list(extra)), capture_output=True, text=True,
                              env=park.helper_env(env), cwd=park.HELPER_CWD, timeout=60)
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)

    pid = target.pid
    assert helper("state", pid)["state"] == "running"
    locked = helper("lock", pid, "4294967295")  # the largest timeout the library can take exactly
    assert (locked["ok"], locked["lock_timeout_ms"], locked["state"]) == (True, 4294967295, "locked")
    assert helper("checkpoint", pid)["state"] == "checkpointed"
    restored = helper("restore", pid)
    assert (restored["ok"], restored["restore_map"], restored["state"]) == (True, 1, "locked")  # the fake's one GPU
    assert record(checkpoints, target.pid)["restore_map"] == 1
    assert helper("unlock", pid)["state"] == "running"
    # The largest pid passes the check and reaches the driver, which knows no such process.
    assert helper("state", 2147483647)["result"] == "CUDA_ERROR_INVALID_VALUE"


# ---------------------------------------------------------------- a resume no cell said: the next cell says it

S = 1_000_000_000


def test_a_resume_no_cell_said_is_one_sentence_with_its_size_times_and_cause():
    from gpucleanup.park import resume_news

    note = resume_news.after_resume({"usage": {"GPU-a": 1 << 30}, "parked_bytes": 3 << 29, "since_ns": 100 * S},
                                    0.94, resume_news.for_request("complete_request"), now_ns=(100 + 42 * 60) * S)
    assert note == {"resumed": {"by": "for a completion", "bytes": 3 << 29, "parked_ns": 100 * S,
                                "resumed_ns": (100 + 42 * 60) * S, "seconds": 0.94}}
    assert resume_news.sentence(note["resumed"], now_ns=(100 + 47 * 60) * S) == (
        "resumed 1.5 GiB from host memory in 0.9 s (parked 42 min), 5 min before this cell, for a completion")
    # the fake driver's park knows no size (no nvidia-smi): the sentence says so without a number
    unsized = resume_news.after_resume({"since_ns": 10 * S}, 0.31, resume_news.FROM_OUTSIDE, now_ns=22 * S)
    assert resume_news.sentence(unsized["resumed"], now_ns=24 * S) == (
        "resumed its GPU memory from host memory in 0.3 s (parked 12 s), 2.0 s before this cell, from outside the "
        "kernel (gpucleanup resume or the page)")
    assert resume_news.sentence({"usage": {}}) is None  # a park's own note is no resume


def test_a_resume_no_cell_said_is_taken_once_from_the_lock_file(tmp_path):
    from gpucleanup.park import kernel_side as parking, resume_news

    lock = tmp_path / "4242-0123456789abcdef.park"
    assert resume_news.take(lock) is None  # no park ever: no file
    with parking.ParkLock(lock, 1.0) as held:
        held.write_note({"pid": 4242, "usage": {}, "parked_bytes": None, "since_ns": 5 * S})
    assert resume_news.take(lock) is None  # parked, not resumed: the cell's own resume says it
    assert lock.stat().st_size > 0  # and the park's note stays for that resume's room check
    with parking.ParkLock(lock, 1.0) as held:
        held.write_note(resume_news.after_resume(held.read_note(), 0.25, resume_news.for_request("comm_msg")))
    said = resume_news.take(lock)
    assert said is not None and said.startswith("resumed its GPU memory from host memory in 0.2 s (parked ")
    assert said.endswith(" before this cell, for a comm message (a widget)")
    assert lock.stat().st_size == 0 and resume_news.take(lock) is None  # said once


def test_the_cells_look_for_news_reads_the_file_at_the_lock_name_and_never_a_planted_one(tmp_path):
    from gpucleanup.park import kernel_side as parking, resume_news

    lock = tmp_path / "4242-0123456789abcdef.park"
    look = resume_news.NewsLook()
    assert look.take(lock) is None  # no file yet
    lock.write_bytes(b"")  # the endpoint's empty lock file
    assert look.take(lock) is None and look.take(lock) is None

    def resumed(path):
        with parking.ParkLock(path, 1.0) as held:
            held.write_note(resume_news.after_resume({"parked_bytes": 3 << 30, "since_ns": 5 * S}, 0.5,
                                                     resume_news.FROM_OUTSIDE))

    resumed(lock)  # written in place, under the lock
    said = look.take(lock)
    assert said is not None and said.startswith("resumed 3.0 GiB from host memory in 0.5 s")
    assert look.take(lock) is None  # said once
    # the file replaced by a rename, or removed and made again: what is at the name now is read
    fresh = tmp_path / "fresh.park"
    fresh.write_bytes(b"")
    resumed(fresh)
    os.replace(fresh, lock)
    said = look.take(lock)
    assert said is not None and said.endswith(resume_news.FROM_OUTSIDE)
    lock.unlink()
    assert look.take(lock) is None and not lock.exists()  # nothing made in its place
    lock.write_bytes(b"")
    resumed(lock)
    assert look.take(lock) is not None
    # a FIFO or a link planted at the name is not read (opening a FIFO for reading would wait for a writer)
    lock.unlink()
    os.mkfifo(lock)
    assert look.take(lock) is None
    lock.unlink()
    target = tmp_path / "elsewhere"
    target.write_text('{"resumed": {"resumed_ns": 1}}')
    lock.symlink_to(target)
    assert look.take(lock) is None and target.read_text() == '{"resumed": {"resumed_ns": 1}}'
    assert look.take(None) is None


def test_a_refused_parks_memo_is_read_from_outside_said_with_its_age_and_outlives_the_next_cell(tmp_path):
    from gpucleanup.park import from_outside, kernel_side as parking, lock as park_lock, resume_news

    lock = tmp_path / "4242-0123456789abcdef.park"
    with parking.ParkLock(lock, 1.0) as held:
        held.write_note(resume_news.after_resume({"since_ns": 10 * S}, 0.31, resume_news.FROM_OUTSIDE, now_ns=22 * S))
        held.write_note(dict(held.read_note(), refused={"result": "CUDA_ERROR_NOT_SUPPORTED", "since_ns": 100 * S}))
    memo = park_lock.refused_memo(park_lock.peek_note(lock, owners={os.geteuid()}))
    assert memo == {"result": "CUDA_ERROR_NOT_SUPPORTED", "since_ns": 100 * S}
    assert park.refused_again_refusal(4242, memo, now_ns=(100 + 185) * S).startswith(
        "[gpucleanup.park.652] the driver refused to checkpoint process 4242 3 min 5 s ago (CUDA_ERROR_NOT_SUPPORTED: "
        "the process holds memory the driver's checkpoint does not support, such as CUDA managed memory")
    assert " moments ago " in park.refused_again_refusal(4242, memo, now_ns=100 * S + 10)
    # this process stands in for the kernel: its own files
    assert from_outside.refused_before(os.getpid(), lock).startswith("[gpucleanup.park.652]")
    assert park_lock.peek_note(lock, owners={os.geteuid() + 1}) == {}  # another user's file is not read
    for malformed in ({"refused": "yes"}, {"refused": {"result": 801, "since_ns": 1}},
                      {"refused": {"result": "CUDA_ERROR_NOT_SUPPORTED", "since_ns": 0}}):
        assert park_lock.refused_memo(malformed) is None
    # the next cell's look says the resume no cell said, once; the memo stays, cell after cell (the driver would
    # refuse every later park)
    said = resume_news.take(lock)
    assert said is not None and said.startswith("resumed its GPU memory from host memory in 0.3 s (parked 12 s)")
    assert resume_news.take(lock) is None and resume_news.take(lock) is None
    assert park_lock.peek_note(lock, owners={os.geteuid()}) == {"refused": memo}
    assert from_outside.refused_before(os.getpid(), lock).startswith("[gpucleanup.park.652]")


def test_only_a_lasting_checkpoint_refusal_of_a_process_that_runs_again_is_remembered():
    def outcome(result, state=park.RUNNING, ok=False):
        return park.Outcome("park", 4242, ok, state, "", [park.Step("lock", True, "CUDA_SUCCESS"),
                                                        park.Step("checkpoint", ok, result)])

    assert park.lasting_refusal(outcome("CUDA_ERROR_NOT_SUPPORTED")) == "CUDA_ERROR_NOT_SUPPORTED"
    assert park.lasting_refusal(outcome("CUDA_ERROR_OUT_OF_MEMORY")) is None  # may pass: tried again
    assert park.lasting_refusal(outcome("CUDA_ERROR_NOT_SUPPORTED", state=park.LOCKED)) is None  # not running
    assert park.lasting_refusal(outcome("CUDA_SUCCESS", state=park.CHECKPOINTED, ok=True)) is None


SHELL = r"""
import json, os, subprocess, sys
from IPython.core.interactiveshell import InteractiveShell
from IPython.utils.capture import capture_output
from gpucleanup.in_kernel import extension

ip = InteractiveShell.instance()

def cell(code):
    with capture_output() as out:
        ip.run_cell(code)
    lines = [o.data.get("text/plain", "") for o in out.outputs]
    return "\n".join(lines + [out.stdout]).strip()

said = {"load": cell("%load_ext gpucleanup")}
ext = extension.get_extension(ip)
said["park"] = cell("x = 41\n%gpumem --park")
said["parked"] = ext.parking.parked()
ext._request_guard.holds_back("complete_request", {"content": {"code": "x.", "cursor_pos": 2}})  # Tab in a cell
said["after completion"] = ext.parking.parked()
said["next cell"] = cell("print(x + 1)")
said["cell after"] = cell("print(x + 2)")
cell("%gpumem --park")
done = subprocess.run([sys.executable, "-m", "gpucleanup.outside.cli", "resume", str(os.getpid())], capture_output=True,
                      text=True, timeout=120)
said["resume"] = [done.returncode, done.stdout + done.stderr]
said["after outside resume"] = cell("print(x + 3)")
print("SAID " + json.dumps(said))
"""


def test_the_next_cell_says_a_resume_made_for_a_request_or_from_outside_once(tmp_path, env):
    package = str(pathlib.Path(__file__).resolve().parents[2] / "ipython_ext")  # this tree's, whatever the cwd
    run_env = dict(env, PYTHONPATH=os.pathsep.join(filter(None, [package, env.get("PYTHONPATH")])),
                   JUPYTER_RUNTIME_DIR=str(tmp_path / "runtime"), IPYTHONDIR=str(tmp_path / "ipython"),
                   GPUCLEANUP_FAKE_CUDA_SCENARIO=json.dumps({"devices": [{"primary_active": True}]}))
    (tmp_path / "runtime").mkdir(mode=0o700)
    done = subprocess.run([sys.executable, "-c", SHELL], capture_output=True, text=True, env=run_env, timeout=300,
                          cwd=str(tmp_path))
    found = [line for line in done.stdout.splitlines() if line.startswith("SAID ")]
    assert done.returncode == 0 and found, done.stdout + done.stderr
    said = json.loads(found[0][len("SAID "):])
    assert "parked its GPU memory (context included) in host memory" in said["park"], said
    assert (said["parked"], said["after completion"]) == (True, False), said
    first, printed = said["next cell"].splitlines()
    assert first.startswith("gpucleanup · resumed its GPU memory from host memory in "), said
    assert " (parked " in first and first.endswith(" before this cell, for a completion"), said
    assert printed == "42"
    assert said["cell after"] == "43"  # said once
    assert said["resume"][0] == 0, said
    first, printed = said["after outside resume"].splitlines()
    assert first.startswith("gpucleanup · resumed its GPU memory from host memory in "), said
    assert first.endswith(" before this cell, from outside the kernel (gpucleanup resume or the page)"), said
    assert printed == "44"


# ------------------------------------------------------------------ a restore runs alone (DESIGN rule 12)

BUSY_TARGET = r"""
import ctypes, sys, threading
lib = ctypes.CDLL(sys.argv[1])
count = ctypes.c_int()
lib.cuDeviceGetCount(ctypes.byref(count))   # the fake registers this process (and its restore thread)
spins = [0]

def spin():                                  # a thread that never waits: only a hold stops it
    while True:
        spins[0] += 1

def poll():                                  # a thread that calls the driver over and over, as XLA's do
    c = ctypes.c_int()
    while True:
        lib.cuDeviceGetCount(ctypes.byref(c))

threading.Thread(target=spin, daemon=True).start()
threading.Thread(target=poll, daemon=True).start()
print("ready", flush=True)
for line in sys.stdin:
    before = spins[0]
    while spins[0] == before:
        pass
    print("spinning", flush=True)
"""


@pytest.fixture
def busy_target(env):
    proc = subprocess.Popen([sys.executable, "-c", BUSY_TARGET, str(FAKE_CUDA)], env=env, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    yield proc
    proc.kill()
    proc.wait()


def thread_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def test_the_restore_and_its_unlock_run_with_every_other_thread_of_the_process_held(busy_target, env, checkpoints):
    pid = busy_target.pid
    assert park.park(pid, FAST, env=env).ok
    threads = thread_count(pid)
    resumed = park.resume(pid, FAST, env=env)
    assert (resumed.ok, resumed.state, resumed.changed) == (True, "running", True)
    assert names(resumed) == ["state", "restore", "unlock"]
    kept = record(checkpoints, pid)
    # the fake looked at every thread as the driver's restore and unlock ran: none but the restore thread ran
    assert (kept["running_at_restore"], kept["running_at_unlock"]) == ([], [])
    restored = resumed.steps[1]
    assert restored.hold == {"held": True, "threads": threads - 1, "spared": kept["restore_tid"], "missed": 0}
    # and every thread runs again after it: the spinning one moves, the polling one's calls go through
    busy_target.stdin.write("go\n")
    busy_target.stdin.flush()
    assert busy_target.stdout.readline().strip() == "spinning"
    assert [line.split()[2] for line in open(f"/proc/{pid}/task/{pid}/stat")][0] not in ("t", "T")


def test_with_the_hold_turned_off_the_other_threads_run_during_the_restore(busy_target, env, checkpoints):
    pid = busy_target.pid
    assert park.park(pid, FAST, env=env).ok
    resumed = park.resume(pid, FAST, env=dict(env, GPUCLEANUP_PARK_HOLD="off"))
    assert (resumed.ok, resumed.state) == (True, "running")
    kept = record(checkpoints, pid)
    assert kept["restore_tid"] not in kept["running_at_restore"]
    assert len(kept["running_at_restore"]) == thread_count(pid) - 1  # every thread but the restore thread ran
    assert resumed.steps[1].hold == {"held": False, "threads": 0,
                                     "why": "holding was turned off (GPUCLEANUP_PARK_HOLD=off)"}


def test_a_driver_that_names_no_restore_thread_is_restored_without_a_hold_and_the_step_says_why(busy_target, env,
                                                                                               checkpoints):
    pid = busy_target.pid
    assert park.park(pid, FAST, env=env).ok
    patch(checkpoints, pid, {"errors": {"cuCheckpointProcessGetRestoreThreadId": 500}})
    resumed = park.resume(pid, FAST, env=env)
    assert (resumed.ok, resumed.state) == (True, "running")
    assert resumed.steps[1].hold == {"held": False, "threads": 0, "why": "the driver did not name the restore thread "
                                                                         "(CUDA_ERROR_NOT_FOUND)"}
    assert record(checkpoints, pid)["running_at_restore"] != []


def test_a_failed_restore_under_the_hold_lets_every_thread_go_and_tries_no_unlock(busy_target, env, checkpoints):
    pid = busy_target.pid
    assert park.park(pid, FAST, env=env).ok
    patch(checkpoints, pid, {"errors": {"cuCheckpointProcessRestore": 1}})
    failed = park.resume(pid, FAST, env=env)
    assert (failed.ok, failed.state, names(failed)) == (False, "checkpointed", ["state", "restore"])
    assert failed.steps[1].hold["held"] is True
    kept = record(checkpoints, pid)
    assert kept["calls"].get("cuCheckpointProcessUnlock") is None
    # no thread is left stopped: the main thread answers once the kernel is resumed
    patch(checkpoints, pid, {"errors": {}})
    assert park.resume(pid, FAST, env=env).ok
    busy_target.stdin.write("go\n")
    busy_target.stdin.flush()
    assert busy_target.stdout.readline().strip() == "spinning"


def test_a_driver_whose_restore_arguments_this_build_does_not_know_is_restored_without_them(target, env, checkpoints):
    helpers = dict(env, GPUCLEANUP_FAKE_CUDA_SCENARIO='{"driver_version": 13030}')  # CUDA 13.3: another layout
    parked = park.park(target.pid, FAST, env=helpers)
    assert parked.ok and parked.steps[0].driver_version == 13030 and parked.steps[0].restore_layout_known is False
    resumed = park.resume(target.pid, FAST, env=helpers)
    assert resumed.ok and resumed.steps[1].restore_map == 0  # NULL args: never a struct of the wrong shape
    assert record(checkpoints, target.pid)["restore_map"] == 0
    known = park.resume(target.pid, FAST, env=env)
    assert known.steps[0].driver_version == 13000 and known.steps[0].restore_layout_known is True


def test_an_unknown_restore_layout_refuses_a_park_only_on_a_machine_of_several_gpus():
    found = park.Step("state", True, state="running", driver_version=13030, restore_layout_known=False)
    one = [park.Gpu(0, "GPU-a", 1 << 30, 1 << 34)]
    two = one + [park.Gpu(1, "GPU-b", 1 << 30, 1 << 34)]
    assert park.layout_refusal(found, one) is None
    assert park.layout_refusal(found, lambda: two) == (
        "[gpucleanup.park.650] the driver (CUDA 13.3) lays out the restore's arguments unlike this gpucleanup (built "
        "for CUDA 12.9 to 13.0), and this machine has 2 GPUs, whose restore needs a GPU map in them: nothing was "
        "done; update gpucleanup for this driver to park here")
    assert park.layout_refusal(park.Step("state", True, state="running", driver_version=13000,
                                         restore_layout_known=True), two) is None
