"""A park either brings the process back whole or does not start: the decision every way of parking goes
through, on the fake driver's checkpoint states and a stand-in nvidia-smi (tests/python/stand_ins/bin).

- helpers run gpucleanup's own code only (a package planted in the caller's directory is never imported);
- no restore is tried on a GPU without room, and the process stays parked with nothing lost;
- a process on more than one GPU, or one whose cgroup cannot take its memory, is refused before the lock;
- states a step under way (4, 5) is named, never taken for "locked";
- Ctrl-C during a step lets it finish and stops where the state can be named;
- the process must belong to whoever owns the kernel's files.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from conftest import FAKE_CUDA
from support import wait_until
from shell_stand_ins import StandInEndpoint
from test_park import FAST, TARGET, patch, record

from gpucleanup.park import steps as park, kernel_side as parking, from_outside as remote_park

HERE = pathlib.Path(__file__).resolve().parent
STAND_IN_BIN = HERE / "stand_ins" / "bin"
PACKAGE = HERE.parents[1] / "ipython_ext"
MiB, GiB = 1 << 20, 1 << 30


@pytest.fixture(autouse=True)
def no_thread_of_an_earlier_test():
    """The thread guard's tests name the threads that keep a park away: none of an earlier test may still run."""
    wait_until(lambda: not parking.outliving_threads(), "the threads of an earlier test ended")


@pytest.fixture
def checkpoints(tmp_path):
    directory = tmp_path / "checkpoints"
    directory.mkdir()
    return directory


@pytest.fixture
def smi(tmp_path, monkeypatch):
    """The stand-in nvidia-smi, first on PATH; ``smi.set(gpus=..., apps=...)`` says what it sees."""
    world = tmp_path / "nvidia-smi.json"

    class World:
        def set(self, gpus, apps):
            world.write_text(json.dumps({"gpus": gpus, "apps": apps}))

    monkeypatch.setenv("PATH", f"{STAND_IN_BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    monkeypatch.setenv("GPUCLEANUP_FAKE_NVIDIA_SMI", str(world))
    out = World()
    out.set([], [])
    return out


@pytest.fixture
def env(checkpoints, monkeypatch):
    monkeypatch.setenv("GPUCLEANUP_FAKE_CUDA_CHECKPOINT_DIR", str(checkpoints))
    monkeypatch.delenv("GPUCLEANUP_FAKE_CUDA_SCENARIO", raising=False)
    return dict(os.environ)


@pytest.fixture
def target(env):
    proc = subprocess.Popen([sys.executable, "-c", TARGET, str(FAKE_CUDA)], env=env, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    yield proc
    proc.kill()
    proc.wait()


def wait_for(predicate, what: str, limit: float = 30.0) -> None:
    deadline = time.monotonic() + limit
    while not predicate():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.01)


# ------------------------------------------------------------------ helpers run gpucleanup's code only


PLANTED = '''
import pathlib
pathlib.Path({marker!r}).write_text("planted code ran")
raise SystemExit("planted")
'''


@pytest.mark.parametrize("shape", ["package", "module"])
def test_a_gpucleanup_planted_in_the_callers_directory_is_never_run_by_a_helper(target, env, tmp_path, shape):
    planted = tmp_path / "shared-notebooks"
    planted.mkdir()
    marker = tmp_path / "marker"
    if shape == "package":
        (planted / "gpucleanup").mkdir()
        (planted / "gpucleanup" / "__init__.py").write_text(PLANTED.format(marker=str(marker)))
    else:
        (planted / "gpucleanup.py").write_text(PLANTED.format(marker=str(marker)))
    # The caller imported the real gpucleanup first, then works from the planted directory with it first on
    # sys.path (as `python -c`, a kernel started there, or root in a world-writable directory).
    script = textwrap.dedent(f'''
        import json, os, sys
        sys.path.insert(0, {str(PACKAGE)!r})
        from gpucleanup.park import steps as park
        os.chdir({str(planted)!r})
        sys.path.insert(0, "")
        found = park.state({target.pid})
        print(json.dumps(found.as_dict()))
    ''')
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=planted,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout.splitlines()[-1])
    assert (found["ok"], found["state"], found["refused"]) == (True, "running", None)
    assert not marker.exists()


def test_the_helper_sees_every_gpu_whatever_the_caller_was_given(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert "CUDA_VISIBLE_DEVICES" not in park.helper_env()
    command = park.helper_command("state", 42)
    assert command[1] == "-I" and command[-2:] == ["state", "42"]


# ------------------------------------------------------------------ room for the resume


def test_a_resume_without_room_on_the_gpu_is_not_tried_and_the_process_stays_parked(target, env, checkpoints, smi,
                                                                                    tmp_path):
    gpus_now = [{"index": 0, "uuid": "GPU-aaaa", "free_mib": 90_000, "total_mib": 143_000}]
    smi.set(gpus_now, [{"pid": target.pid, "uuid": "GPU-aaaa", "used_mib": 5_120}])
    steps: list = []
    lock = tmp_path / f"{target.pid}.park"

    def record_step(step, parked_bytes):
        steps.append(step)
        return {}

    parked = parking.park_kernel(target.pid, record_step, lock, FAST, env=env)
    assert parked.ok and parked.usage == {"GPU-aaaa": 5_120 * MiB}
    assert steps == ["begin", "parked"]
    # Another user takes the GPU while the kernel is parked: 4 GiB free where 5 GiB were held.
    smi.set([{"index": 0, "uuid": "GPU-aaaa", "free_mib": 4_096, "total_mib": 143_000}],
            [{"pid": os.getpid(), "uuid": "GPU-aaaa", "used_mib": 138_000}])
    lacking = parking.resume_kernel(target.pid, record_step, lock, FAST, env=env)
    assert (lacking.ok, lacking.state, lacking.changed) == (False, "checkpointed", False)
    assert lacking.message.startswith(
        "[gpucleanup.park.630] GPU0 lacks 1.2 GiB for the resume (it needs 5.0 GiB and a margin of 256 MiB; 4.0 GiB is "
        f"free; held by pid {os.getpid()}")
    assert lacking.message.endswith(f"): process {target.pid} stays parked with nothing lost (a restore without room "
                                    "can lose it, so none was tried); resume it once the memory is free: python -m "
                                    f"gpucleanup.park resume {target.pid}")
    assert "cuCheckpointProcessRestore" not in record(checkpoints, target.pid)["calls"]
    assert record(checkpoints, target.pid)["state"] == "checkpointed"
    assert steps == ["begin", "parked"]  # not resumed: the kernel's state still says parked
    # The memory comes back: the next resume restores it.
    smi.set(gpus_now, [])
    resumed = parking.resume_kernel(target.pid, record_step, lock, FAST, env=env)
    assert (resumed.ok, resumed.state, resumed.changed) == (True, "running", True)
    assert steps == ["begin", "parked", "resumed"]
    assert lock.read_bytes() == b""  # the park's note is gone with the park


def test_room_needs_the_parked_bytes_and_the_margin_on_each_gpu():
    view = [park.Gpu(0, "GPU-aaaa", 5 * GiB + park.RESUME_MARGIN, 140 * GiB), park.Gpu(1, "GPU-bbbb", GiB, 140 * GiB)]
    assert park.room_refusal(7, {"GPU-aaaa": 5 * GiB}, view) is None
    assert park.room_refusal(7, {"GPU-aaaa": 5 * GiB + 1}, view).startswith("[gpucleanup.park.630] GPU0 lacks 1 B ")
    assert park.room_refusal(7, {"GPU-cccc": GiB}, view) == (
        "[gpucleanup.park.633] the GPU process 7 was parked from (GPU-cccc) is not on this machine now: it stays "
        "parked with nothing lost; bring that GPU back, then resume it")
    assert park.room_refusal(7, None, view) is None and park.room_refusal(7, {"GPU-aaaa": GiB}, None) is None


# ------------------------------------------------------------------ refused before the lock


def test_a_process_on_two_gpus_is_refused_before_the_lock(target, env, checkpoints, smi):
    smi.set([{"index": 0, "uuid": "GPU-aaaa", "free_mib": 1, "total_mib": 143_000},
             {"index": 1, "uuid": "GPU-bbbb", "free_mib": 1, "total_mib": 143_000}],
            [{"pid": target.pid, "uuid": "GPU-aaaa", "used_mib": 1_024},
             {"pid": target.pid, "uuid": "GPU-bbbb", "used_mib": 512}])
    with pytest.raises(park.ParkRefused) as refused:
        park.park(target.pid, FAST, env=env)
    assert str(refused.value).startswith(f"[gpucleanup.park.627] process {target.pid} uses 2 GPUs (GPU0 1.0 GiB, "
                                         "GPU1 512 MiB): it is not parked")
    assert "cuCheckpointProcessLock" not in record(checkpoints, target.pid)["calls"]


def write(path: pathlib.Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_the_tightest_cgroup_limit_is_found_in_v2_and_v1(tmp_path):
    proc, root = tmp_path / "proc", tmp_path / "cgroup"
    write(proc / "100" / "cgroup", "0::/kubepods/pod1/container\n")
    write(root / "kubepods" / "pod1" / "container" / "memory.max", "max\n")
    write(root / "kubepods" / "pod1" / "container" / "memory.current", "1000\n")
    write(root / "kubepods" / "pod1" / "memory.max", f"{8 * GiB}\n")  # the pod's limit, a level up
    write(root / "kubepods" / "pod1" / "memory.current", f"{3 * GiB}\n")
    found = park.cgroup_memory(100, str(proc), str(root))
    assert found == (str(root / "kubepods" / "pod1"), 8 * GiB, 3 * GiB) and found.room == 5 * GiB

    write(proc / "200" / "cgroup", "12:cpu,cpuacct:/docker/abc\n9:memory:/docker/abc\n")
    write(root / "memory" / "docker" / "abc" / "memory.limit_in_bytes", f"{4 * GiB}\n")
    write(root / "memory" / "docker" / "abc" / "memory.usage_in_bytes", f"{GiB}\n")
    write(root / "memory" / "memory.limit_in_bytes", "9223372036854771712\n")  # v1's "no limit"
    write(root / "memory" / "memory.usage_in_bytes", f"{60 * GiB}\n")
    assert park.cgroup_memory(200, str(proc), str(root)) == (str(root / "memory" / "docker" / "abc"), 4 * GiB, GiB)

    write(proc / "300" / "cgroup", "0::/user.slice\n")
    write(root / "user.slice" / "memory.max", "max\n")
    write(root / "user.slice" / "memory.current", "5\n")
    assert park.cgroup_memory(300, str(proc), str(root)) is None  # no limit anywhere: the machine's check decides
    assert park.cgroup_memory(400, str(proc), str(root)) is None  # no such process


def test_a_cgroup_that_cannot_take_the_parked_memory_is_a_refusal():
    memory = park.CgroupMemory("/sys/fs/cgroup/kubepods/pod1", 8 * GiB, 3 * GiB)
    assert park.cgroup_memory_refusal(4 * GiB, memory) is None  # 5 GiB left, margin 410 MiB
    assert park.cgroup_memory_refusal(5 * GiB, memory) == (
        "[gpucleanup.park.628] this kernel's memory limit cannot hold its GPU memory: a park copies 5.0 GiB into the "
        "kernel's own memory, and its cgroup (/sys/fs/cgroup/kubepods/pod1: limit 8.0 GiB, 3.0 GiB in use) leaves "
        "5.0 GiB, less a margin of 410 MiB: the out-of-memory killer would end the kernel; raise the container's "
        "memory limit, or free GPU memory first")
    assert park.cgroup_memory_refusal(None, memory) is None and park.cgroup_memory_refusal(GiB, None) is None


# ------------------------------------------------------------------ states of a step under way


@pytest.mark.parametrize("under_way", ["checkpointing", "restoring"])
def test_a_step_under_way_is_named_and_neither_park_nor_resume_acts(target, env, checkpoints, under_way):
    patch(checkpoints, target.pid, {"state": under_way})
    sentence = (f"[gpucleanup.park.632] the driver reports process {target.pid} as {under_way}: a park or a resume "
                "of it is under way; ask again when it has ended")
    with pytest.raises(park.ParkRefused) as refused:
        park.park(target.pid, FAST, env=env)
    assert str(refused.value) == sentence
    resumed = park.resume(target.pid, FAST, env=env)
    assert (resumed.ok, resumed.state, resumed.message) == (False, under_way, sentence)
    assert [s.name for s in resumed.steps] == ["state"]
    calls = record(checkpoints, target.pid)["calls"]
    assert not {"cuCheckpointProcessLock", "cuCheckpointProcessRestore", "cuCheckpointProcessUnlock"} & set(calls)


# ------------------------------------------------------------------ Ctrl-C and SIGTERM


PARKER = '''
import json, pathlib, signal, sys
sys.path.insert(0, {package!r})
from gpucleanup.outside import cli
from gpucleanup.park import steps as park
with cli._TermAsInterrupt():  # as gpucleanup park and resume take SIGTERM: as Ctrl-C
    for sig in (signal.SIGINT, signal.SIGTERM):  # say that the signal came, then act on it as installed
        def noted(number, frame, then=signal.getsignal(sig)):
            pathlib.Path({flag!r}).write_text("signalled")
            then(number, frame)
        signal.signal(sig, noted)
    outcome = park.park({pid}, park.Limits(state_s=30, lock_s=30, lock_timeout_s=5, checkpoint_s=60, restore_s=30,
                                           unlock_s=30))
print(json.dumps({{"ok": outcome.ok, "state": outcome.state, "interrupted": outcome.interrupted,
                  "message": outcome.message, "steps": [s.name for s in outcome.steps]}}), flush=True)
'''


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_an_interrupt_during_the_lock_lets_it_finish_then_unlocks(target, env, checkpoints, sig, tmp_path):
    flag = tmp_path / "signalled"
    patch(checkpoints, target.pid, {"hang": ["cuCheckpointProcessLock"]})
    parker = subprocess.Popen([sys.executable, "-c", PARKER.format(package=str(PACKAGE), pid=target.pid, flag=str(flag))], env=env,
                              stdout=subprocess.PIPE, text=True, start_new_session=True)
    wait_for(lambda: record(checkpoints, target.pid)["calls"].get("cuCheckpointProcessLock") == 1, "the lock began")
    os.killpg(parker.pid, sig)  # a terminal's Ctrl-C reaches the whole group: the helper is not in it
    wait_for(flag.exists, "the parker took the signal")
    patch(checkpoints, target.pid, {"hang": []})
    out, _ = parker.communicate(timeout=60)
    outcome = json.loads(out.splitlines()[-1])
    assert outcome["interrupted"] is True and (outcome["ok"], outcome["state"]) == (False, "running")
    assert outcome["steps"] == ["state", "lock", "unlock"]
    assert outcome["message"] == (f"[gpucleanup.park.620] interrupted (Ctrl-C or SIGTERM) during the lock: process "
                                  f"{target.pid} was unlocked and runs as before, nothing was parked")
    assert record(checkpoints, target.pid)["state"] == "running"


def test_an_interrupt_during_the_checkpoint_lets_it_finish_and_says_the_process_is_parked(target, env, checkpoints,
                                                                                          tmp_path):
    flag = tmp_path / "signalled"
    patch(checkpoints, target.pid, {"hang": ["cuCheckpointProcessCheckpoint"]})
    parker = subprocess.Popen([sys.executable, "-c", PARKER.format(package=str(PACKAGE), pid=target.pid, flag=str(flag))], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    wait_for(lambda: record(checkpoints, target.pid)["calls"].get("cuCheckpointProcessCheckpoint") == 1,
             "the checkpoint began")
    os.killpg(parker.pid, signal.SIGINT)
    wait_for(flag.exists, "the parker took the signal")
    # said at once, while the checkpoint still runs (before: nothing until the step ended)
    assert parker.stderr.readline().startswith("gpucleanup: interrupted: the driver's checkpoint under way is let "
                                               "finish (at most ")
    patch(checkpoints, target.pid, {"hang": []})
    out, _ = parker.communicate(timeout=60)
    outcome = json.loads(out.splitlines()[-1])
    assert outcome["interrupted"] is True and (outcome["ok"], outcome["state"]) == (True, "checkpointed")
    assert outcome["message"] == (f"parked process {target.pid}: the interrupt (Ctrl-C or SIGTERM) came during the "
                                  "checkpoint, which was let finish; resume it with python -m gpucleanup.park resume "
                                  f"{target.pid}")
    assert record(checkpoints, target.pid)["state"] == "checkpointed"


# ------------------------------------------------------------------ ownership


def test_a_process_that_is_not_the_file_owners_is_refused(tmp_path):
    own = os.stat(tmp_path).st_uid
    proc = tmp_path / "proc"
    write(proc / "4242" / "status", f"Name:\tpython\nUid:\t{own + 1}\t{own + 1}\t{own + 1}\t{own + 1}\n")
    write(proc / "4343" / "status", f"Name:\tpython\nUid:\t{own}\t{own}\t{own}\t{own}\n")
    lock = tmp_path / "gpucleanup" / "4242.park"
    lock.parent.mkdir()
    refusal = remote_park.owner_refusal(4242, lock, str(proc))
    assert refusal.startswith(f"[gpucleanup.park.643] process 4242 belongs to uid {own + 1}")
    assert refusal.endswith(f"who owns {lock.parent}: its discovery file names another user's process, so nothing "
                            "was done; remove that file if it is not a kernel's")
    assert remote_park.owner_refusal(4343, lock, str(proc)) is None
    assert remote_park.owner_refusal(4444, lock, str(proc)).startswith("[gpucleanup.park.612] process 4444 ")


# ------------------------------------------------------------------ the kernel's side


def test_a_thread_started_in_a_cell_that_runs_on_blocks_an_automatic_park_until_it_ends():
    kernel = parking.InKernel(lambda: None, lambda lines: None)
    assert kernel.automatic_park_blocker() is None
    stop = threading.Event()
    worker = threading.Thread(target=stop.wait, name="train-loop")
    worker.start()
    try:
        assert kernel.automatic_park_blocker() == (
            "[gpucleanup.park.642] 1 thread started in a cell still runs (train-loop): an automatic park would stop "
            "their GPU calls; it is left to %gpumem --park or gpucleanup park once they end")
    finally:
        stop.set()
        worker.join()
    assert kernel.automatic_park_blocker() is None


def test_the_kernel_tells_its_server_what_keeps_an_automatic_park_away_only_when_it_changes():
    said = []

    class Endpoint(StandInEndpoint):
        def park_blocker(self, why):
            said.append(why)

    kernel = parking.InKernel(lambda: Endpoint(), lambda lines: None)
    kernel.threads_seen()
    assert said == []  # no thread started or ended: nothing asked, nothing said
    stop = threading.Event()
    worker = threading.Thread(target=stop.wait, name="prefetch")
    worker.start()
    try:
        kernel.threads_seen()
        kernel.threads_seen()
    finally:
        stop.set()
        worker.join()
    assert len(said) == 1 and said[0].startswith("[gpucleanup.park.642] 1 thread started in a cell still runs (prefetch)")
    kernel.threads_seen()
    assert said[1:] == [None]  # it ended: an automatic park may come again


class _Parking:
    """The kernel's parking side as the request guard sees it: parked until a resume works."""

    def __init__(self, parked: bool, resume_works: bool):
        self.is_parked, self.resume_works, self.resumes = parked, resume_works, 0

    def resume_for_request(self, msg_type: str = "request") -> bool:
        if self.is_parked:
            self.resumes += 1
            self.is_parked = not self.resume_works
        return self.is_parked


class _Log:
    def __init__(self):
        self.lines = []

    def warning(self, fmt, *args):
        self.lines.append(fmt % args)


class _Kernel:
    def __init__(self):
        self.log = _Log()
        self.calls = []
        self.shell_handlers = {t: (lambda t: lambda stream, idents, msg: self.calls.append(t))(t)
                               for t in ("execute_request", "comm_msg", "inspect_request", "kernel_info_request")}


def test_requests_that_run_code_and_are_no_cell_resume_the_kernel_first():
    kernel, parked = _Kernel(), _Parking(parked=True, resume_works=True)
    refused = []
    guard = parking.RequestGuard(parked, refused.append)
    originals = dict(kernel.shell_handlers)
    assert guard.install(kernel)
    kernel.shell_handlers["execute_request"](None, [], {"content": {"code": "x", "silent": False}})
    assert parked.resumes == 0  # a cell: its pre_run_cell resumes it and says so
    kernel.shell_handlers["execute_request"](None, [], {"content": {"code": "x", "silent": True}})
    assert parked.resumes == 1 and not parked.is_parked
    kernel.shell_handlers["comm_msg"](None, [], {"content": {}})
    assert kernel.calls == ["execute_request", "execute_request", "comm_msg"] and refused == []
    assert kernel.shell_handlers["kernel_info_request"] is originals["kernel_info_request"]  # runs no code
    guard.remove()
    assert kernel.shell_handlers == originals


def test_a_request_that_cannot_resume_the_kernel_is_refused_or_dropped_never_left_to_hang():
    kernel, parked = _Kernel(), _Parking(parked=True, resume_works=False)
    refused = []
    guard = parking.RequestGuard(parked, refused.append)
    guard.install(kernel)
    kernel.shell_handlers["inspect_request"](None, [], {"content": {}})
    kernel.shell_handlers["comm_msg"](None, [], {"content": {}})
    assert kernel.calls == [] and len(kernel.log.lines) == 2
    assert kernel.log.lines[1].startswith("gpucleanup: comm_msg dropped: the kernel is still parked after a resume")
    kernel.shell_handlers["execute_request"](None, [], {"content": {"silent": True}})
    assert kernel.calls == ["execute_request"] and len(refused) == 1  # its code is refused by the transformer
    assert refused[0].startswith("the kernel is still parked after a resume was tried before this execute_request")


def test_a_kernel_still_parked_after_its_resume_refuses_the_cell_and_says_why(monkeypatch, tmp_path):
    class Endpoint(StandInEndpoint):
        park_lock = tmp_path / "lock"

        def parked(self):
            return 2

        def park_step(self, step, parked_bytes=None, then=None):
            raise AssertionError("no step is recorded when the resume did not happen")

    said = []
    kernel = parking.InKernel(lambda: Endpoint(), said.extend)
    lacking = park.Outcome("resume", os.getpid(), False, "checkpointed",
                           f"[gpucleanup.park.630] GPU0 lacks 1.2 GiB for the resume (...): process {os.getpid()} "
                           f"stays parked with nothing lost (...); resume it once the memory is free: python -m "
                           f"gpucleanup.park resume {os.getpid()}")
    monkeypatch.setattr(parking, "resume_kernel", lambda *args, **kwargs: lacking)
    kernel.resume_before_cell({"state": "running", "cell": 3}, parked=2)
    assert said == []
    assert kernel.refusal == (
        f"this cell was not run: the kernel is still parked ([gpucleanup.park.630] GPU0 lacks 1.2 GiB for the resume "
        f"(...): process {os.getpid()} stays parked with nothing lost (...); resume it once the memory is free: "
        f"gpucleanup resume {os.getpid()}); nothing is lost: run the cell again, or resume it with gpucleanup resume "
        f"{os.getpid()}")


def test_a_process_the_driver_cannot_checkpoint_while_it_holds_gpu_memory_is_said_as_such(tmp_path):
    found = park.Step("state", False, result="CUDA_ERROR_INVALID_VALUE")
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       67108864 kB\nMemAvailable:   60000000 kB\n")
    reasons = park.refusals(4242, found, {"GPU-aaaa": GiB}, meminfo=str(meminfo), proc=str(tmp_path / "proc"))
    assert reasons == [
        "[gpucleanup.park.634] the driver cannot checkpoint process 4242 (CUDA_ERROR_INVALID_VALUE), although it "
        "holds 1.0 GiB of GPU memory: nothing was done; it runs as before (a process in another container's driver "
        "namespace, or one whose CUDA the driver cannot checkpoint)"]
    assert park.refusals(4242, found, {}, meminfo=str(meminfo), proc=str(tmp_path / "proc"))[0].startswith(
        "[gpucleanup.park.612] process 4242 is not a CUDA process the driver can park")


def test_a_refusal_armed_for_a_request_that_never_ran_is_not_the_next_cells(fake_cuda):
    from IPython.core.interactiveshell import InteractiveShell
    from IPython.utils.capture import capture_output

    from gpucleanup.in_kernel import extension

    fake_cuda.reset({"devices": [{"primary_active": True}]})
    ip = InteractiveShell.instance()
    with capture_output():
        ip.run_line_magic("load_ext", "gpucleanup")
    try:
        ext = extension.get_extension(ip)
        ext._refuse_the_cell.arm("the kernel is still parked after a resume was tried before this execute_request")
        result = ip.run_cell("ran = 1")  # the kernel is not parked: this cell's own resume found nothing to do
        assert result.error_before_exec is None and ip.user_ns.get("ran") == 1
        assert ext._refuse_the_cell not in ip.ast_transformers
        ext._refuse_the_cell.arm("still parked")
        refused = ip.run_cell("refused = 1", silent=True)  # a silent execute has no pre_run_cell: refused
        assert isinstance(refused.error_before_exec, extension.KernelStillParked) and "refused" not in ip.user_ns
        assert refused.error_before_exec._render_traceback_() == ["gpucleanup · still parked"]
        assert ext._refuse_the_cell not in ip.ast_transformers
    finally:
        ip.extension_manager.unload_extension("gpucleanup")


class _Session:
    def __init__(self):
        self.sent = []

    def send(self, stream, msg_type, content, parent, ident):
        self.sent.append((msg_type, content, parent, ident))


class _FullKernel(_Kernel):
    """A kernel with ipykernel's control handlers and session: error replies can be sent."""

    def __init__(self):
        super().__init__()
        self.session = _Session()
        self.shell_handlers["complete_request"] = lambda stream, idents, msg: self.calls.append("complete_request")
        self.control_handlers = {"debug_request": lambda stream, idents, msg: self.calls.append("debug_request"),
                                 "shutdown_request": lambda stream, idents, msg: self.calls.append("shutdown")}


class _WatchedParking(_Parking):
    def __init__(self, parked: bool, resume_works: bool):
        super().__init__(parked, resume_works)
        self.looks = 0

    def threads_seen(self):
        self.looks += 1


def test_an_execute_with_user_expressions_resumes_first_whatever_its_code():
    kernel, parked = _FullKernel(), _WatchedParking(parked=True, resume_works=True)
    guard = parking.RequestGuard(parked, [].append)
    guard.install(kernel)
    # blank code: IPython runs no cell hook, then ipykernel evaluates the expressions (before: a deadlock)
    kernel.shell_handlers["execute_request"](None, [], {"content": {"code": "  ", "user_expressions": {"n": "x"}}})
    assert (parked.resumes, parked.is_parked, kernel.calls) == (1, False, ["execute_request"])


def test_user_expressions_of_a_kernel_still_parked_each_answer_why_and_a_cell_with_code_is_refused():
    kernel, parked = _FullKernel(), _WatchedParking(parked=True, resume_works=False)
    refused = []
    guard = parking.RequestGuard(parked, refused.append)
    guard.install(kernel)
    msg = {"content": {"code": "", "user_expressions": {"n": "torch.cuda.memory_allocated()"}}}
    kernel.shell_handlers["execute_request"](None, [], msg)
    assert refused == []  # blank code: nothing to refuse, the expressions answer instead
    expression = msg["content"]["user_expressions"]["n"]
    with pytest.raises(parking.StillParked) as answered:
        eval(expression, {})
    assert str(answered.value).startswith("the kernel is still parked after a resume was tried before this "
                                          "execute_request: its GPU calls would wait for a restore nobody makes")
    kernel.shell_handlers["execute_request"](None, [], {"content": {"code": "x", "user_expressions": {"n": "x"}}})
    assert len(refused) == 1


def test_the_debuggers_variable_requests_resume_first_and_get_an_error_reply_when_still_parked():
    kernel, parked = _FullKernel(), _WatchedParking(parked=True, resume_works=True)
    originals = dict(kernel.control_handlers)
    guard = parking.RequestGuard(parked, [].append)
    guard.install(kernel)
    kernel.control_handlers["debug_request"](None, [], {"content": {"command": "debugInfo", "seq": 1}})
    assert parked.resumes == 0  # runs no user code
    kernel.control_handlers["debug_request"](None, [], {"content": {"command": "inspectVariables", "seq": 2}})
    assert (parked.resumes, kernel.calls) == (1, ["debug_request", "debug_request"])
    assert kernel.control_handlers["shutdown_request"] is originals["shutdown_request"]
    guard.remove()
    assert kernel.control_handlers == originals

    kernel, parked = _FullKernel(), _WatchedParking(parked=True, resume_works=False)
    parking.RequestGuard(parked, [].append).install(kernel)
    request = {"content": {"command": "richInspectVariables", "seq": 7}}
    kernel.control_handlers["debug_request"]("control", [b"id"], request)
    kernel.shell_handlers["complete_request"]("shell", [b"id"], {"content": {"code": "x.", "cursor_pos": 2}})
    assert kernel.calls == []  # neither ran: each got an error reply that says why, none waits for ever
    (debug_type, debug, parent, ident), (complete_type, complete, _, _) = kernel.session.sent
    assert (debug_type, debug["success"], debug["request_seq"], debug["command"], parent, ident) == (
        "debug_reply", False, 7, "richInspectVariables", request, [b"id"])
    assert debug["message"].startswith("the kernel is still parked after a resume was tried before this debug_request")
    assert (complete_type, complete["status"], complete["ename"]) == ("complete_reply", "error", "KernelStillParked")


def test_after_a_comm_message_the_kernels_threads_are_looked_at_again():
    kernel, parked = _FullKernel(), _WatchedParking(parked=False, resume_works=True)
    parking.RequestGuard(parked, [].append).install(kernel)
    kernel.shell_handlers["comm_msg"](None, [], {"content": {}})  # a widget's button may start a thread
    assert (kernel.calls, parked.looks) == (["comm_msg"], 1)


def test_the_kernels_own_threads_and_idle_executor_workers_never_block_an_automatic_park():
    import asyncio
    import concurrent.futures

    kernel = parking.InKernel(lambda: None, lambda lines: None)
    stop = threading.Event()

    class ParentPoller(threading.Thread):  # as ipykernel's own, whatever its name or when it started
        pass

    ParentPoller.__module__ = "ipykernel.parentpoller"
    machinery = ParentPoller(target=stop.wait, name="Thread-1", daemon=True)
    machinery.start()
    pool = concurrent.futures.ThreadPoolExecutor(2)
    try:
        pool.submit(lambda: None).result()  # a worker now waits in the pool's queue for work
        asyncio.run(asyncio.to_thread(lambda: None))  # asyncio's default executor: asyncio_0, idle after
        # a worker whose task's result is out may still be on its way back to the queue: idle once it is there
        wait_until(lambda: kernel.automatic_park_blocker() is None, "the idle workers leave an automatic park be")
        pool.submit(stop.wait)  # a worker running a task blocks it
        wait_until(kernel.automatic_park_blocker, "a worker running a task seen")
        assert kernel.automatic_park_blocker().startswith("[gpucleanup.park.642] 1 thread started in a cell still "
                                                          "runs (ThreadPoolExecutor-")
    finally:
        stop.set()
        pool.shutdown(wait=True)
        machinery.join()
    assert kernel.automatic_park_blocker() is None


def test_a_thread_started_before_gpucleanup_loaded_blocks_an_automatic_park_too():
    stop = threading.Event()
    early = threading.Thread(target=stop.wait, name="train-before-load", daemon=True)
    early.start()
    try:
        kernel = parking.InKernel(lambda: None, lambda lines: None)  # loaded after the thread started
        assert "(train-before-load)" in kernel.automatic_park_blocker()
    finally:
        stop.set()
        early.join()


def test_a_blocked_automatic_park_looks_again_and_parks_once_the_thread_ends(monkeypatch, tmp_path):
    class Endpoint(StandInEndpoint):
        park_lock = tmp_path / "lock"

        def park_step(self, step, parked_bytes=None):
            return {}

    parked = []
    monkeypatch.setattr(parking, "RECHECK_S", 0.05)
    monkeypatch.setattr(parking, "park_kernel", lambda *args, **kwargs: parked.append(args) or park.Outcome(
        "park", os.getpid(), True, "checkpointed", "parked"))
    kernel = parking.InKernel(lambda: Endpoint(), lambda lines: None)
    stop = threading.Event()
    prefetch = threading.Thread(target=stop.wait, name="prefetch", daemon=True)
    prefetch.start()
    kernel.arm(0.05)
    deadline = time.monotonic() + 10
    while kernel._auto_note is None:  # noqa: SLF001
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert "(prefetch)" in kernel.take_note() and parked == []
    stop.set()
    prefetch.join()
    while not parked:  # before: the timer was not armed again, and the kernel stayed unparked for good
        assert time.monotonic() < deadline, "no park once the thread ended"
        time.sleep(0.01)
    kernel.close()


def test_the_servers_memo_of_a_blocker_is_cleared_when_its_threads_end_without_a_cell(monkeypatch):
    said = []

    class Endpoint(StandInEndpoint):
        def park_blocker(self, why):
            said.append(why)

    monkeypatch.setattr(parking, "RECHECK_S", 0.05)
    kernel = parking.InKernel(lambda: Endpoint(), lambda lines: None)
    stop = threading.Event()
    worker = threading.Thread(target=stop.wait, name="train-loop", daemon=True)
    worker.start()
    kernel.threads_seen()  # a cell ends with the thread running: the server is told
    assert len(said) == 1 and "(train-loop)" in said[0]
    stop.set()
    worker.join()
    deadline = time.monotonic() + 10
    while said[-1] is not None:  # no cell ends: the kernel's watch tells the server the thread is gone
        assert time.monotonic() < deadline, f"the server still holds {said[-1]}"
        time.sleep(0.01)
    kernel.close()


def test_a_thread_that_ends_before_the_next_cell_ends_is_told_though_the_watch_thread_keeps_the_count(monkeypatch):
    # The blocker's watch thread starts as the notebook's thread runs: when that thread ends, Python's thread
    # count is what it was at the last cell's end. The next cell's end still tells the server the thread is gone.
    said = []

    class Endpoint(StandInEndpoint):
        def park_blocker(self, why):
            said.append(why)

    monkeypatch.setattr(parking, "RECHECK_S", 3600.0)  # the watch never looks again within this test
    kernel = parking.InKernel(lambda: Endpoint(), lambda lines: None)
    stop = threading.Event()
    worker = threading.Thread(target=stop.wait, name="train-loop", daemon=True)
    worker.start()
    try:
        kernel.threads_seen()  # a cell ends with the thread running: the server is told, the watch starts
        assert len(said) == 1 and "(train-loop)" in said[0]
        assert any(t.name == "gpucleanup-thread-watch" for t in threading.enumerate())
        stop.set()
        worker.join()
        kernel.threads_seen()  # the cell that ended it ends
        assert said[1:] == [None]
        kernel.threads_seen()  # and nothing more is said while nothing changes
        assert said[1:] == [None]
    finally:
        stop.set()
        kernel.close()


class _PolicyWatch:
    """The server's automatic park (server.auto_park.AutoPark) over one idle kernel whose status replies and park
    outcomes a test gives, round by round."""

    def __init__(self, monkeypatch):
        import asyncio
        import logging
        import types

        from gpucleanup.outside import kernels
        from gpucleanup.server.auto_park import AutoPark

        monkeypatch.setattr(kernels, "target_of", lambda kernel: "target")
        self.asyncio = asyncio
        kernel = types.SimpleNamespace(pid=4242, kernel_id="k1", elsewhere=None, key_file="/run/kernel-4242.json")
        self.state = {}
        self.answers = []
        self.parks = 0
        test = self

        class Watch:
            runtime_dir = pathlib.Path("/nonexistent")
            settings = types.SimpleNamespace(timeout=1.0)
            stopped = False

            async def run(self, function, *args, **kwargs):
                assert function is kernels.gather
                view = types.SimpleNamespace(kernel=kernel, pid=kernel.pid, kernel_id=kernel.kernel_id,
                                             elsewhere=None, status={"state": dict(test.state)})
                return types.SimpleNamespace(kernels=[view])

            async def server_kernels(self):
                return [{"kernel_id": "k1", "pid": 4242}]

            async def park(self, kernel_, target, action, automatic=False):
                assert (kernel_, action, automatic) == (kernel, "park", True)
                test.parks += 1
                answer = test.answers.pop(0)
                if isinstance(answer, Exception):
                    raise answer
                return answer

        self.auto = AutoPark(Watch(), 1.0, logging.getLogger("test"))

    def round(self):
        return self.asyncio.run(self.auto.round())


def _blocked(text):
    exc = park.ParkRefused(text)
    exc.error_id = "gpucleanup.park.642"
    return exc


def test_the_servers_policy_parks_a_kernel_once_the_thread_that_blocked_it_ends_with_no_cell(monkeypatch):
    blocker = ("[gpucleanup.park.642] 1 thread started in a cell still runs (train-loop): an automatic park would "
               "stop their GPU calls; it is left to %gpumem --park or gpucleanup park once they end")
    policy = _PolicyWatch(monkeypatch)
    policy.state = {"state": "idle", "age_s": 5.0, "since_ns": 1000, "park_blocker": blocker}
    policy.answers = [_blocked(blocker)]
    said = policy.round()
    assert policy.parks == 1 and len(said) == 1 and "not parked: [gpucleanup.park.642]" in said[0], said
    assert policy.round() == [] and policy.parks == 1  # the same idle period, the same blocker: not asked again
    # The watch thread tells the kernel's server that the thread ended: no cell ran, the idle time is the same.
    del policy.state["park_blocker"]
    policy.answers = [_blocked("[gpucleanup.park.640] a refusal that is not the blocker's")]
    said = policy.round()
    assert policy.parks == 2 and len(said) == 1 and "park.640" in said[0], said
    assert policy.round() == [] and policy.parks == 2  # refused again for another reason: once per idle period


def test_the_servers_policy_asks_again_when_a_blocker_came_between_its_listing_and_its_park(monkeypatch):
    blocker = ("[gpucleanup.park.642] 1 thread started in a cell still runs (loader): an automatic park would "
               "stop their GPU calls; it is left to %gpumem --park or gpucleanup park once they end")
    policy = _PolicyWatch(monkeypatch)
    policy.state = {"state": "idle", "age_s": 5.0, "since_ns": 1000}  # listed with no blocker
    policy.answers = [_blocked(blocker)]  # the kernel said one meanwhile
    policy.round()
    policy.state["park_blocker"] = blocker
    policy.answers = [_blocked(blocker)]
    policy.round()  # listed with it: asked once more, remembered with it
    assert policy.parks == 2 and policy.round() == [] and policy.parks == 2
    del policy.state["park_blocker"]
    policy.answers = [_blocked("[gpucleanup.park.640] another refusal")]
    policy.round()
    assert policy.parks == 3  # the blocker's end is seen


def test_the_bulk_parks_preview_skips_a_kernel_whose_notebook_thread_runs_and_says_why():
    from gpucleanup.server import admin

    blocker = ("[gpucleanup.park.642] 1 thread started in a cell still runs (train-loop): an automatic park would "
               "stop their GPU calls; it is left to %gpumem --park or gpucleanup park once they end")
    entries = [{"id": kid, "gpucleanup": True, "pid": pid, "idle_s": 600.0, "held_bytes": 1 << 30, "held": [],
                "state": dict({"state": "idle"}, **extra), "park_check": {"parkable": True, "reasons": []}}
               for kid, pid, extra in (("a", 11, {}), ("b", 12, {"park_blocker": blocker}))]
    preview = admin.park_preview(entries, 300)
    assert [k["id"] for k in preview["kernels"]] == ["a"] and preview["bytes"] == 1 << 30
    assert [(r["id"], r["reasons"]) for r in preview["refused"]] == [("b", [blocker])]


def _idle_pool(prefix: str):
    """A one-worker executor whose worker has run a task and waits in its queue again (an idle worker)."""
    import concurrent.futures

    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=prefix)
    pool.submit(lambda: None).result()
    wait_until(lambda: not [n for n in parking.outliving_threads() if n.startswith(prefix)],
               "the worker back in its queue")
    return pool


def _a_busy_worker_is_told(kernel, said: list, prefix: str) -> None:
    """A cell ends with an idle executor worker (nothing said); the next gives it a long task, no thread starting:
    the kernel tells the server it is busy."""
    stop = threading.Event()
    pool = _idle_pool(prefix)
    try:
        kernel.threads_seen()
        assert said == []
        pool.submit(stop.wait)
        _told_busy(kernel, said, "the busy worker told to the server")
        assert f"({prefix}_0)" in said[0]
    finally:
        stop.set()
        pool.shutdown(wait=True)


def _told_busy(kernel, said: list, what: str) -> None:
    """Cells end until the kernel has told the server a blocker (``what`` is the failure's words)."""
    def look():
        kernel.threads_seen()
        return said
    wait_until(look, what)


class _SaysBlockers(StandInEndpoint):
    def __init__(self, said: list):
        super().__init__()
        self.said = said

    def park_blocker(self, why):
        self.said.append(why)


def test_a_task_an_existing_executor_worker_takes_is_told_to_the_server_though_no_thread_started():
    said = []
    endpoint = _SaysBlockers(said)
    kernel = parking.InKernel(lambda: endpoint, lambda lines: None)
    _a_busy_worker_is_told(kernel, said, "idle-worker")
    kernel.threads_seen()
    assert said[-1] is None
    kernel.close()


def test_a_worker_that_starts_as_another_thread_ends_is_still_watched():
    # The thread count stays as it was: one thread ended, the executor's worker started.
    said = []
    endpoint = _SaysBlockers(said)
    ended = threading.Event()
    earlier = threading.Thread(target=ended.wait, name="gpucleanup-test-earlier", daemon=True)
    earlier.start()
    kernel = parking.InKernel(lambda: endpoint, lambda lines: None)
    ended.set()
    earlier.join()
    _a_busy_worker_is_told(kernel, said, "swapped-worker")
    kernel.close()


def test_a_thread_a_cell_starts_as_the_park_timers_thread_ends_is_told_to_the_server():
    # Each cell ends the last park timer (its thread ends) and may start the notebook's own thread: the same count.
    said = []
    endpoint = _SaysBlockers(said)
    timer = threading.Timer(60, lambda: None)
    timer.name = "gpucleanup-park-timer"
    timer.start()
    kernel = parking.InKernel(lambda: endpoint, lambda lines: None)
    kernel.threads_seen()
    assert said == []  # gpucleanup's own thread keeps no park away
    stop = threading.Event()
    timer.cancel()
    timer.join()
    train = threading.Thread(target=stop.wait, name="train-loop", daemon=True)
    train.start()
    try:
        kernel.threads_seen()
        assert said == ["[gpucleanup.park.642] 1 thread started in a cell still runs (train-loop): an automatic park "
                        "would stop their GPU calls; it is left to %gpumem --park or gpucleanup park once they end"]
    finally:
        stop.set()
        train.join()
    kernel.threads_seen()
    assert said[-1] is None
    kernel.close()


def test_the_look_at_threads_keeps_no_thread_of_the_notebook_alive():
    # A thread object keeps what the notebook gave it (a model on the GPU): gpucleanup never holds one past its end.
    import weakref

    kernel = parking.InKernel(lambda: None, lambda lines: None)
    stop = threading.Event()

    class Train(threading.Thread):
        def __init__(self):
            super().__init__(name="train-loop", daemon=True)
            self.model = bytearray(1 << 20)

        def run(self):
            stop.wait()

    train = Train()
    train.start()
    kernel.threads_seen()  # a cell ends while it runs
    stop.set()
    train.join()
    gone = weakref.ref(train)
    del train
    assert gone() is None
    kernel.close()


def test_a_park_lock_with_a_second_link_is_refused_and_the_linked_file_keeps_its_bytes(tmp_path):
    victim = tmp_path / "notes.txt"
    victim.write_text("mine")
    lock = tmp_path / "kernel.park"
    os.link(victim, lock)  # planted: the park's note would overwrite notes.txt
    with pytest.raises(parking.LockUnusable) as refused:
        with parking.ParkLock(lock, 1.0) as held:
            held.write_note({"usage": {}})
    assert str(refused.value) == (f"[gpucleanup.park.646] the park lock {lock} has 2 links (a hard link to another "
                                  "file): nothing was done; remove it, then try again")
    assert victim.read_text() == "mine"


def test_a_cgroup_path_reaches_the_terminal_with_its_control_characters_escaped():
    memory = park.CgroupMemory("/sys/fs/cgroup/evil\x1b]0;owned\x07\nname", 1 << 30, 1 << 29)
    refusal = park.cgroup_memory_refusal(4 << 30, memory)
    assert "\x1b" not in refusal and "\x07" not in refusal and "\n" not in refusal
    assert "(/sys/fs/cgroup/evil\\x1b]0;owned\\x07\\nname: limit 1.0 GiB" in refusal


def test_cupti_in_use_a_mig_device_and_an_mps_server_are_refused_before_anything_is_done(tmp_path):
    proc = tmp_path / "proc"
    write(proc / "500" / "maps", "7f00-7f10 r-xp 0 08:01 1 /usr/lib/libcuda.so.1\n"
                                 "7f20-7f30 r-xp 0 08:01 2 /opt/cuda/lib64/libcupti.so.13\n")
    (proc / "500" / "environ").write_bytes(b"HOME=/root\0CUDA_VISIBLE_DEVICES=MIG-4f1c2a7e-0000-1111\0"
                                           b"CUDA_INJECTION64_PATH=/opt/nsight/libToolsInjection64.so\0")
    write(proc / "500" / "comm", "python\n")
    write(proc / "600" / "maps", "7f00-7f10 r-xp 0 08:01 1 /usr/lib/libcuda.so.1\n")
    (proc / "600" / "environ").write_bytes(b"CUDA_VISIBLE_DEVICES=0\0")
    assert park.unsupported_refusals(600, str(proc)) == []
    write(proc / "700" / "comm", "nvidia-cuda-mps-server\n")
    park._MPS_SEEN.clear()
    found = park.unsupported_refusals(500, str(proc))
    assert [r.split("]")[0] for r in found] == ["[gpucleanup.park.647", "[gpucleanup.park.648", "[gpucleanup.park.649"]
    assert found[0] == ("[gpucleanup.park.647] process 500 runs under a CUDA tool injected through "
                        "CUDA_INJECTION64_PATH=/opt/nsight/libToolsInjection64.so (a profiler or compute-sanitizer, "
                        "through CUPTI), which the driver's checkpoint does not support: it is not parked; restart "
                        "the kernel without the tool to make it parkable")
    assert "CUDA_VISIBLE_DEVICES names MIG-4f1c2a7e-0000-1111" in found[1]
    assert found[2] == ("[gpucleanup.park.649] an MPS server runs on this machine (process 700, nvidia-cuda-mps-server), "
                        "and the driver's checkpoint does not support MPS clients: nothing is parked while it runs")
    assert "[gpucleanup.park.647]" in park.refusals(500, None, {}, proc=str(proc))[0]
    park._MPS_SEEN.clear()


# /proc/PID/maps of a CuPy process on an H100 (driver 580.159.04, tests/bench/results/h100-managed-probe-*.jsonl):
# the one 2 MiB mapping of /dev/nvidia-uvm every CUDA process has, and a 256 MiB managed allocation's own
UVM_BASE = "7f1000000000-7f1000200000 rw-s 00000000 00:05 812 /dev/nvidia-uvm\n"
UVM_MANAGED = "7f2000000000-7f2010000000 rw-s 00000000 00:05 812 /dev/nvidia-uvm\n"
CUDA_MAPS = ("7f00-7f10 r-xp 0 08:01 1 /usr/lib/libcuda.so.1\n"
             "7f3000000000-7f3000200000 rw-s 00000000 00:05 811 /dev/nvidia0\n")


def test_a_process_holding_managed_memory_is_refused_before_anything_is_locked_and_one_without_is_not(
        tmp_path, monkeypatch):
    monkeypatch.delenv("GPUCLEANUP_PARK_UNPROVEN", raising=False)
    proc = tmp_path / "proc"
    write(proc / "520" / "maps", CUDA_MAPS + UVM_BASE + UVM_MANAGED)
    (proc / "520" / "environ").write_bytes(b"CUDA_VISIBLE_DEVICES=0\0")
    write(proc / "521" / "maps", CUDA_MAPS + UVM_BASE)  # ordinary device memory only
    (proc / "521" / "environ").write_bytes(b"CUDA_VISIBLE_DEVICES=0\0")
    park._MPS_SEEN.clear()
    assert park.managed_bytes(CUDA_MAPS + UVM_BASE + UVM_MANAGED) == 256 * MiB
    assert park.managed_bytes(CUDA_MAPS + UVM_BASE) == 0 and park.managed_bytes("") == 0
    (refusal,) = park.unsupported_refusals(520, str(proc))
    assert refusal == ("[gpucleanup.park.653] process 520 holds 256 MiB of CUDA managed memory (its mappings of "
                       "/dev/nvidia-uvm), which the driver's checkpoint does not support: it is not parked; "
                       f"{park.MANAGED_REMEDY}; GPUCLEANUP_PARK_UNPROVEN=managed tries the park all the same")
    assert park.refusals(520, None, {}, proc=str(proc)) == [refusal]
    assert park.unsupported_refusals(521, str(proc)) == []
    # a driver that maps its device otherwise: the kernel's own opt-in lets the park be tried
    (proc / "520" / "environ").write_bytes(b"CUDA_VISIBLE_DEVICES=0\0GPUCLEANUP_PARK_UNPROVEN=jax,managed\0")
    assert park.unsupported_refusals(520, str(proc)) == []
    # or the opt-in of a park given an environment of its own (park(pid, env=...)), and only there
    (proc / "520" / "environ").write_bytes(b"CUDA_VISIBLE_DEVICES=0\0")
    assert park.refusals(520, None, {}, proc=str(proc), env={"GPUCLEANUP_PARK_UNPROVEN": "managed"}) == []
    assert park.refusals(520, None, {}, proc=str(proc), env={}) == [refusal]
    park._MPS_SEEN.clear()


def test_libcupti_loaded_without_a_subscriber_is_parkable_and_the_kernels_own_trace_is_not(tmp_path):
    # JAX's XLA plugin and PyTorch's profiler map libcupti at import and subscribe nothing: the H100 run that
    # refused every JAX park for the mapping alone is why this is no refusal
    proc = tmp_path / "proc"
    write(proc / "510" / "maps", "7f00-7f10 r-xp 0 08:01 1 /usr/lib/libcuda.so.1\n"
                                 "7f20-7f30 r-xp 0 08:01 2 /site/nvidia/cuda_cupti/lib/libcupti.so.12\n"
                                 "7f40-7f50 r-xp 0 08:01 3 /site/jax_plugins/xla_cuda12/xla_cuda_plugin.so\n")
    # let through the JAX wait for proof (park.651, its own test), to look at CUPTI alone
    (proc / "510" / "environ").write_bytes(b"CUDA_VISIBLE_DEVICES=0\0GPUCLEANUP_PARK_UNPROVEN=jax\0")
    park._MPS_SEEN.clear()
    assert park.unsupported_refusals(510, str(proc)) == []
    assert park.refusals(510, None, {}, proc=str(proc)) == []
    traced = park.refusals(510, None, {}, proc=str(proc), tracing=True)
    assert traced == ["[gpucleanup.park.647] %gpumem --trace is on in this kernel: its CUPTI subscriber is something "
                      "the driver's checkpoint does not support, so it is not parked; %gpumem --trace off, then park"]
    park._MPS_SEEN.clear()


def test_the_trace_keeps_automatic_parks_away_and_the_server_is_told_when_it_is_turned_on_and_off():
    told = []

    class Endpoint(StandInEndpoint):
        def park_blocker(self, text):
            told.append(text)

    endpoint = Endpoint()
    tracing = [False]
    kernel = parking.InKernel(lambda: endpoint, lambda lines: None, tracing=lambda: tracing[0])
    try:
        assert kernel.automatic_park_blocker() is None
        tracing[0] = True
        kernel.threads_seen()  # no thread started or ended: the trace alone is news
        assert kernel.automatic_park_blocker() == (
            "[gpucleanup.park.647] %gpumem --trace is on: the driver's checkpoint does not support its CUPTI "
            "subscriber (%gpumem --trace off makes the kernel parkable)")
        assert told == [kernel.automatic_park_blocker()]
        kernel.threads_seen()
        assert len(told) == 1  # said once while it stays on
        tracing[0] = False
        kernel.threads_seen()
        assert told[-1] is None and len(told) == 2
    finally:
        kernel.close()


def test_park_checks_of_one_kernel_share_one_helper_until_a_park_of_it(monkeypatch, tmp_path):
    import asyncio

    import importlib

    from gpucleanup.park import from_outside as remote_park

    handlers = importlib.import_module("gpucleanup.server.handlers")

    calls = []

    def check_kernel(pid, target, timeout, lock):
        calls.append(pid)
        time.sleep(0.2)
        return {"pid": pid, "parkable": True, "reasons": []}

    monkeypatch.setattr(remote_park, "check_kernel", check_kernel)
    monkeypatch.setattr(remote_park, "park_from_outside", lambda *args: "parked")
    watch = handlers.KernelWatch(None, handlers.GPUCleanupServer())
    watch.CHECK_SHARED_S = 3600.0  # "within the window" whatever the machine's load

    class Kernel:  # what the watch reads of a discovered kernel
        pid, key_file = 4242, str(tmp_path / "4242-ab.key")

    kernel = Kernel()

    async def viewers():
        first = await asyncio.gather(*(watch.park_check(kernel, None) for _ in range(5)))
        again = await watch.park_check(kernel, None)  # within the window: the same answer
        await watch.park(kernel, None, "park")        # a park forgets it: the next check looks again
        after = await watch.park_check(kernel, None)
        return first, again, after

    try:
        first, again, after = asyncio.run(viewers())
    finally:
        watch.close()
    assert calls == [4242, 4242]  # five viewers and a sixth request: one helper; after the park: one more
    assert all(f["parkable"] for f in first) and again["parkable"] and after["parkable"]


def test_the_end_of_a_request_that_ran_code_tells_the_server_it_was_activity():
    told = []

    class Endpoint(StandInEndpoint):
        def background(self, begin, activity=False):
            told.append((begin, activity))
            return True

    endpoint = Endpoint()
    kernel = parking.InKernel(lambda: endpoint, lambda lines: None)
    assert kernel.hold_off_parks(True) is True
    assert kernel.hold_off_parks(False) is True
    # the begin holds parks off; the end lets them go and starts the idle time again (a park policy waits for
    # idle time counted from the last request, as Jupyter's culling does: a completion is no idle time)
    assert told == [(True, False), (False, True)]


def test_no_park_begins_while_a_request_that_is_no_cell_runs():
    import asyncio

    class Parking(_WatchedParking):
        def __init__(self):
            super().__init__(parked=False, resume_works=True)
            self.holds = []

        def hold_off_parks(self, begin):
            self.holds.append(begin)
            return True

    kernel, parked = _FullKernel(), Parking()
    seen = []

    async def complete(stream, idents, msg):  # ipykernel's handlers are coroutines
        seen.append(list(parked.holds))
        await asyncio.sleep(0)
        return "replied"

    kernel.shell_handlers["complete_request"] = complete
    parking.RequestGuard(parked, [].append).install(kernel)
    assert asyncio.run(kernel.shell_handlers["complete_request"](None, [], {"content": {}})) == "replied"
    assert seen == [[True]] and parked.holds == [True, False]  # held off while it ran, let go after
    kernel.shell_handlers["execute_request"](None, [], {"content": {"code": "x"}})  # a cell: its own state holds it
    assert parked.holds == [True, False]


def test_a_jax_kernel_is_parked_only_by_a_park_that_holds_its_threads_unless_let_through(tmp_path, monkeypatch):
    # issue 50: "until a framework is proven, refuse its park with a sentence (park --check says it)"; proven on an
    # H100 with the hold while parked (117 of 117 kept), lost without it (9 of 29)
    monkeypatch.delenv("GPUCLEANUP_PARK_UNPROVEN", raising=False)
    monkeypatch.delenv("GPUCLEANUP_PARK_HOLD", raising=False)
    proc = tmp_path / "proc"
    write(proc / "520" / "maps", "7f00-7f10 r-xp 0 08:01 1 /usr/lib/libcuda.so.1\n"
                                 "7f40-7f50 r-xp 0 08:01 3 /site/jax_plugins/xla_cuda12/xla_cuda_plugin.so\n")
    (proc / "520" / "environ").write_bytes(b"CUDA_VISIBLE_DEVICES=0\0")
    write(proc / "530" / "maps", "7f00-7f10 r-xp 0 08:01 1 /usr/lib/libcuda.so.1\n"
                                 "7f40-7f50 r-xp 0 08:01 3 /site/jaxlib/xla_extension.so\n")  # JAX on the CPU only
    (proc / "530" / "environ").write_bytes(b"")
    park._MPS_SEEN.clear()
    refused = park.refusals(520, None, {}, proc=str(proc))  # a park by pid alone: nothing lists its threads
    assert refused == [
        "[gpucleanup.park.651] process 520 runs JAX on the GPU, whose own threads call the driver while the process "
        "is checkpointed and kill it unless they are held while it is parked, and this park holds none (a park by "
        "process id alone (gpucleanup.park.park) cannot list a kernel's threads: park it with gpucleanup park, the "
        "page or %gpumem --park): it is not parked; GPUCLEANUP_PARK_UNPROVEN=jax (for the kernel, or for the command "
        "or server that parks) parks it all the same"]
    # a kernel's park holds them, unless turned off for the process that parks
    assert park.kernel_hold() is None
    assert park.refusals(520, None, {}, proc=str(proc), unheld=park.kernel_hold()) == []
    monkeypatch.setenv("GPUCLEANUP_PARK_HOLD", "off")
    assert park.kernel_hold() == park.HOLD_TURNED_OFF
    assert "this park holds none (holding is turned off here (GPUCLEANUP_PARK_HOLD=off))" in \
        park.refusals(520, None, {}, proc=str(proc), unheld=park.kernel_hold())[0]
    assert park.kernel_hold({"GPUCLEANUP_PARK_HOLD": "on"}) is None  # a park's own environment, when it has one
    assert park.refusals(530, None, {}, proc=str(proc)) == []
    # let through by the kernel's own environment, or by the parking process's
    (proc / "520" / "environ").write_bytes(b"CUDA_VISIBLE_DEVICES=0\0GPUCLEANUP_PARK_UNPROVEN=torch, jax\0")
    assert park.refusals(520, None, {}, proc=str(proc)) == []
    (proc / "520" / "environ").write_bytes(b"CUDA_VISIBLE_DEVICES=0\0")
    monkeypatch.setenv("GPUCLEANUP_PARK_UNPROVEN", "jax")
    assert park.refusals(520, None, {}, proc=str(proc)) == []
    # a park given an environment of its own (park(pid, env=...)) reads the opt-in there, as it reads
    # GPUCLEANUP_PARK_HOLD: this process's opt-in does not reach it, and its own lets the park through
    assert park.refusals(520, None, {}, proc=str(proc), env={})[0].startswith("[gpucleanup.park.651] process 520 ")
    monkeypatch.delenv("GPUCLEANUP_PARK_UNPROVEN")
    assert park.refusals(520, None, {}, proc=str(proc), env={"GPUCLEANUP_PARK_UNPROVEN": "jax"}) == []
    park._MPS_SEEN.clear()


def test_a_name_the_unproven_list_does_not_know_is_said_at_load():
    from gpucleanup.in_kernel.load_notes import environment_notes

    assert environment_notes({"GPUCLEANUP_PARK_UNPROVEN": "jax"}) == []
    assert environment_notes({"GPUCLEANUP_PARK_UNPROVEN": "jax,tensorflw"}) == [
        "GPUCLEANUP_PARK_UNPROVEN='jax,tensorflw' names 'tensorflw', which is not among the frameworks whose parks "
        "wait for proof (jax): ignored there"]
