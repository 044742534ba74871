"""Parking a real kernel (ipykernel, gpucleanup loaded, the fake driver): ``%gpumem --park``, the resume
before the next cell, ``gpucleanup park|resume KERNEL``, the state the status endpoint, ``ps`` and
``/metrics`` show, refusals and failures, a cell started while a park is under way, exit while parked.

The fake driver keeps each process's checkpoint state in a record every process sees
(GPUCLEANUP_FAKE_CUDA_CHECKPOINT_DIR, tests/fake_cuda/checkpoint_state.cpp): the tests read the
kernel's state there, inject errors and hold a call ("hang") until they let it go.
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from gpucleanup.protocol import discovery, status_client

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import kernel_harness  # noqa: E402  (tests/kernel_harness.py)
import support  # noqa: E402
from support import wait_until  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
BUILD = Path(os.environ.get("GPUCLEANUP_BUILD_DIR", ROOT / "build")).resolve()


@pytest.fixture
def checkpoints(tmp_path, monkeypatch):
    directory = tmp_path / "checkpoints"
    directory.mkdir()
    monkeypatch.setenv("GPUCLEANUP_FAKE_CUDA_CHECKPOINT_DIR", str(directory))
    monkeypatch.delenv("GPUCLEANUP_FAKE_CUDA_SCENARIO", raising=False)
    return directory


def record(checkpoints: Path, pid: int) -> dict:
    with open(checkpoints / f"{pid}.json") as fh:
        fcntl.flock(fh, fcntl.LOCK_SH)
        return json.loads(fh.read())


def patch(checkpoints: Path, pid: int, change: dict) -> None:
    with open(checkpoints / f"{pid}.json", "r+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        data = json.loads(fh.read())
        data.update(change)
        fh.seek(0)
        fh.truncate()
        fh.write(json.dumps(data))


def environment() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "ipython_ext"), env.get("PYTHONPATH")]))
    env["GPUCLEANUP_LIBRARY"] = str(BUILD / "native" / "libgpucleanup.so")
    env["GPUCLEANUP_LIBCUDA"] = str(BUILD / "tests" / "fake_cuda" / "libcuda.so.1")
    return env


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return support.cli(*args, env=environment(), timeout=timeout)


class Kernel(kernel_harness.Kernel):
    """A real ipykernel on the fake driver (tests/kernel_harness.py); its outputs include gpucleanup's lines."""

    def __init__(self, runtime: Path):
        super().__init__(dict(environment(), JUPYTER_RUNTIME_DIR=str(runtime)), kernel_id=str(uuid.uuid4()),
                         timeout=120)

    start = kernel_harness.Kernel.send  # the name tests/python/test_outside_drain.py uses

    def state(self) -> dict:
        return self.status()["state"]


@pytest.fixture
def kernel(runtime, checkpoints):
    k = Kernel(runtime)
    try:
        out = k.execute("%load_ext gpucleanup")
        assert "Error" not in out, out
        wait_until(lambda: k.state()["state"] == "idle", "the kernel never said idle")
        yield k
    finally:
        k.stop()


def test_gpumem_park_parks_after_the_cell_and_the_next_cell_resumes_first(kernel, checkpoints):
    out = kernel.execute("x = 41\n%gpumem --park")
    assert "gpucleanup · this kernel is parked as soon as this cell has ended\n" in out
    assert "gpucleanup · parked its GPU memory (context included) in host memory in " in out, out
    assert f"the next cell brings it back (or: gpucleanup resume {kernel.pid})" in out
    assert record(checkpoints, kernel.pid)["state"] == "checkpointed"
    assert kernel.state()["state"] == "parked"
    listed = cli("ps")
    assert "parked in host memory for" in listed.stdout, listed

    out = kernel.execute("x + 1")
    assert out.startswith("gpucleanup · resumed its GPU memory from host memory in "), out
    assert "(parked " in out and "42\n" in out
    assert record(checkpoints, kernel.pid)["state"] == "running"
    assert kernel.state()["state"] == "idle"
    # the kernel's own resume ran the restore and the unlock with every other thread of the kernel held
    kept = record(checkpoints, kernel.pid)
    assert (kept["running_at_restore"], kept["running_at_unlock"]) == ([], [])


def test_a_park_asked_for_in_the_cell_that_unloads_gpucleanup_says_it_will_not_happen(kernel, checkpoints):
    out = kernel.execute("%gpumem --park\n%unload_ext gpucleanup")
    assert out == ("gpucleanup · this kernel is parked as soon as this cell has ended\n"
                   "gpucleanup · not parked: gpucleanup was unloaded in the cell that asked for the park (%gpumem "
                   "--park); load it again and ask in a cell of its own\n")
    assert record(checkpoints, kernel.pid)["state"] == "running"
    assert record(checkpoints, kernel.pid)["calls"].get("cuCheckpointProcessLock") is None


def test_the_command_parks_an_idle_kernel_and_resumes_it(kernel, checkpoints):
    parked = cli("park", str(kernel.pid))
    assert parked.returncode == 0, parked
    assert parked.stdout.startswith(f"kernel {kernel.pid}: parked its GPU memory (context included) in host memory")
    assert record(checkpoints, kernel.pid)["state"] == "checkpointed"
    assert kernel.state()["state"] == "parked"
    status = cli("status", str(kernel.pid))
    assert "state      parked in host memory for " in status.stdout, status

    again = cli("park", str(kernel.pid))
    assert again.returncode == 4
    assert again.stderr == (f"gpucleanup: kernel {kernel.pid}: [gpucleanup.server.420] park refused: the kernel is "
                            "parked\n")

    resumed = cli("resume", str(kernel.pid))
    assert resumed.returncode == 0, resumed
    assert resumed.stdout.startswith(f"kernel {kernel.pid}: resumed its GPU memory from host memory in ")
    assert record(checkpoints, kernel.pid)["state"] == "running"
    assert kernel.state()["state"] == "idle"
    told, printed = kernel.execute("print(6 * 7)").splitlines()  # nothing to resume; it says the resume it missed
    assert told.startswith("gpucleanup · resumed its GPU memory from host memory in "), told
    assert told.endswith(" before this cell, from outside the kernel (gpucleanup resume or the page)"), told
    assert printed == "42"


def test_a_resume_from_outside_holds_every_thread_of_the_kernel_but_the_drivers_restore_thread(kernel, checkpoints):
    assert cli("park", str(kernel.pid)).returncode == 0
    threads = len(os.listdir(f"/proc/{kernel.pid}/task"))
    resumed = cli("resume", "--json", str(kernel.pid))
    assert resumed.returncode == 0, resumed
    restore = [step for step in json.loads(resumed.stdout)["steps"] if step["name"] == "restore"][0]
    kept = record(checkpoints, kernel.pid)
    assert restore["hold"] == {"held": True, "threads": threads - 1, "spared": kept["restore_tid"], "missed": 0}
    assert (kept["running_at_restore"], kept["running_at_unlock"]) == ([], [])
    assert kernel.execute("print(6 * 7)").splitlines()[-1] == "42"


JAX_LIKE_CELL = """
import faulthandler, mmap, sys, types
plugin = open({plugin!r}, "rb")
mapped = mmap.mmap(plugin.fileno(), 0, prot=mmap.PROT_READ)  # the process maps "XLA's CUDA plugin"
sys.modules.setdefault("jaxlib", types.ModuleType("jaxlib"))
sink = open("/dev/null", "w")
faulthandler.dump_traceback_later(3600, file=sink)  # a thread of C's own, as XLA's are: no Python thread of threading's
from gpucleanup.park.parked_hold import threads_to_hold
print(threads_to_hold(None))
"""


def thread_state(pid: int, tid: int) -> str:
    with open(f"/proc/{pid}/task/{tid}/stat") as fh:
        return fh.read().rpartition(")")[2].split()[0]


def test_a_park_from_outside_holds_the_threads_a_jax_kernel_listed_while_it_is_parked(kernel, checkpoints, tmp_path,
                                                                                      monkeypatch):
    monkeypatch.delenv("GPUCLEANUP_PARK_UNPROVEN", raising=False)  # no opt-in: a park that holds them goes ahead
    plugin = tmp_path / "jax_plugins" / "xla_cuda13" / "xla_cuda_plugin.so"
    plugin.parent.mkdir(parents=True)
    plugin.write_bytes(bytes(4096))
    out = kernel.execute(JAX_LIKE_CELL.format(plugin=str(plugin)))
    native = json.loads(out.strip().splitlines()[-1])  # the kernel's threads that are neither Python's nor ZeroMQ's
    restore_tid = record(checkpoints, kernel.pid)["restore_tid"]
    assert restore_tid in native and len(native) >= 2
    held = [tid for tid in native if tid != restore_tid]

    parked = cli("park", "--json", str(kernel.pid))
    assert parked.returncode == 0, parked
    hold = json.loads(parked.stdout)["parked_hold"]
    assert (hold["held"], hold["threads"], hold["missed"]) == (True, len(held), 0)
    # while parked: the listed threads are stopped, every other thread runs (the kernel answers its status)
    assert [thread_state(kernel.pid, tid) for tid in held] == ["t"] * len(held)
    assert thread_state(kernel.pid, restore_tid) != "t" and thread_state(kernel.pid, kernel.pid) != "t"
    assert kernel.state()["state"] == "parked"

    resumed = cli("resume", "--json", str(kernel.pid))
    assert resumed.returncode == 0, resumed
    restore = [step for step in json.loads(resumed.stdout)["steps"] if step["name"] == "restore"][0]
    assert (restore["hold"]["held"], restore["hold"]["held_since_park"]) == (True, len(held))
    assert (record(checkpoints, kernel.pid)["running_at_restore"], record(checkpoints, kernel.pid)["running_at_unlock"]) \
        == ([], [])
    wait_until(lambda: all(thread_state(kernel.pid, tid) != "t" for tid in held), "the held threads never went on")
    assert kernel.execute("print(6 * 7)").splitlines()[-1] == "42"


def test_a_jax_kernel_is_refused_by_a_park_that_holds_no_thread_and_the_opt_in_still_lets_it_through(
        kernel, checkpoints, tmp_path, monkeypatch):
    # with the hold turned off for the command (GPUCLEANUP_PARK_HOLD=off), a JAX kernel is refused before the lock:
    # on an H100, 9 of 29 such kernels were lost (tests/bench/results/h100-park-hold-control-hold-off-179687d-*)
    monkeypatch.delenv("GPUCLEANUP_PARK_UNPROVEN", raising=False)
    plugin = tmp_path / "jax_plugins" / "xla_cuda13" / "xla_cuda_plugin.so"
    plugin.parent.mkdir(parents=True)
    plugin.write_bytes(bytes(4096))
    kernel.execute(JAX_LIKE_CELL.format(plugin=str(plugin)))
    monkeypatch.setenv("GPUCLEANUP_PARK_HOLD", "off")
    said = (f"[gpucleanup.park.651] process {kernel.pid} runs JAX on the GPU, whose own threads call the driver while "
            "the process is checkpointed and kill it unless they are held while it is parked, and this park holds "
            "none (holding is turned off here (GPUCLEANUP_PARK_HOLD=off)): it is not parked; "
            "GPUCLEANUP_PARK_UNPROVEN=jax (for the kernel, or for the command or server that parks) parks it all the "
            "same")
    check = cli("park", "--check", str(kernel.pid))
    assert (check.returncode, check.stdout) == (4, f"kernel {kernel.pid} cannot be parked now:\n  - {said}\n"), check
    refused = cli("park", str(kernel.pid))
    assert (refused.returncode, said in refused.stderr) == (4, True), refused
    assert record(checkpoints, kernel.pid)["calls"].get("cuCheckpointProcessLock") is None
    assert kernel.state()["state"] == "idle"
    monkeypatch.setenv("GPUCLEANUP_PARK_UNPROVEN", "jax")  # the opt-in: parked all the same, no thread held
    parked = cli("park", "--json", str(kernel.pid))
    assert parked.returncode == 0, parked
    assert json.loads(parked.stdout).get("parked_hold") is None
    assert record(checkpoints, kernel.pid)["state"] == "checkpointed"
    monkeypatch.delenv("GPUCLEANUP_PARK_HOLD")
    assert kernel.execute("print(6 * 7)").splitlines()[-1] == "42"
    assert record(checkpoints, kernel.pid)["state"] == "running"


def test_park_check_and_park_refuse_a_jax_kernel_whose_thread_list_is_gone_until_a_cell_lists_them_again(
        kernel, checkpoints, runtime, tmp_path, monkeypatch):
    monkeypatch.delenv("GPUCLEANUP_PARK_UNPROVEN", raising=False)
    plugin = tmp_path / "jax_plugins" / "xla_cuda13" / "xla_cuda_plugin.so"
    plugin.parent.mkdir(parents=True)
    plugin.write_bytes(bytes(4096))
    kernel.execute(JAX_LIKE_CELL.format(plugin=str(plugin)))
    listed = list(Path(runtime).rglob("*.park-threads"))
    assert len(listed) == 1, listed
    listed[0].unlink()  # as if the kernel had not listed them yet
    said = ("[gpucleanup.park.654] process {pid} runs JAX, whose own threads call the driver while the process is "
            "checkpointed and die there: they are held while it is parked, and this time they could not be (the "
            "kernel has listed none yet; it lists them as a cell ends: run a cell): it is not parked and runs as "
            "before").format(pid=kernel.pid)
    check = cli("park", "--check", str(kernel.pid))
    assert (check.returncode, check.stdout) == (4, f"kernel {kernel.pid} cannot be parked now:\n  - {said}\n"), check
    # the page's cheap check (files only: no helper, no request) says the same, so no bulk park counts on it
    from gpucleanup.server import admin

    [found] = [k for k in discovery.scan(runtime).live if k.pid == kernel.pid]
    quick = admin.quick_check(found, {"state": "idle"}, None, admin.GpuView())
    assert (quick["parkable"], quick["reasons"]) == (False, [said])
    refused = cli("park", str(kernel.pid))
    assert (refused.returncode, said in refused.stderr) == (4, True), refused
    assert record(checkpoints, kernel.pid)["calls"].get("cuCheckpointProcessLock") is None
    assert kernel.state()["state"] == "idle"
    kernel.execute("6 * 7")
    assert listed[0].exists()  # listed again as that cell ended
    assert cli("park", "--check", str(kernel.pid)).returncode == 0
    assert admin.quick_check(found, {"state": "idle"}, None, admin.GpuView())["parkable"] is True


def test_the_park_step_tracer_is_signed_taken_only_while_parked_and_checks_its_pid(kernel, checkpoints):
    target = kernel.target()
    with pytest.raises(status_client.StatusError) as refused:
        status_client.request(target, "park", 10, step="tracer", pid=os.getpid())
    assert refused.value.error_id == "gpucleanup.server.420"
    assert "the kernel is not parked, so there is no restore to hold it for" in str(refused.value)
    assert cli("park", str(kernel.pid)).returncode == 0
    for bad in (0, -1, 2 ** 31, "12", None):
        with pytest.raises(status_client.StatusError) as malformed:
            status_client.request(target, "park", 10, step="tracer", pid=bad)
        assert malformed.value.error_id == "gpucleanup.server.408"
        assert "a park step tracer needs \"pid\": the helper's process id" in str(malformed.value)
    unsigned = status_client.Target(target.endpoint, b"")
    with pytest.raises(status_client.StatusError):
        status_client.request(unsigned, "park", 10, step="tracer", pid=os.getpid())
    named = status_client.request(target, "park", 10, step="tracer", pid=os.getpid())
    # 0: named; EINVAL (22): no Yama on this machine, where no name is needed
    assert (named["step"], named["errno"] in (0, 22), named["state"]["state"]) == ("tracer", True, "parked")
    assert kernel.state()["state"] == "parked"  # the step changes no state
    assert cli("resume", str(kernel.pid)).returncode == 0


def test_resume_of_a_kernel_never_parked_is_refused_and_park_json_prints_its_object_when_refused(kernel,
                                                                                                   checkpoints):
    # before: exit 6, "it has not used the GPU, or it has exited" (a failed driver step); nothing was refused
    never = cli("resume", str(kernel.pid))
    assert (never.returncode, never.stdout) == (4, "")
    assert never.stderr == (f"gpucleanup: kernel {kernel.pid} not resumed: [gpucleanup.park.645] kernel {kernel.pid} "
                            "is not parked: nothing to resume\n")
    as_json = cli("resume", "--json", str(kernel.pid))
    assert as_json.returncode == 4
    assert json.loads(as_json.stdout) == {"action": "resume", "pid": kernel.pid, "ok": False, "changed": False,
                                          "message": f"kernel {kernel.pid} not resumed: [gpucleanup.park.645] kernel "
                                                     f"{kernel.pid} is not parked: nothing to resume"}
    assert cli("park", str(kernel.pid)).returncode == 0
    again = cli("park", "--json", str(kernel.pid))  # refused by the kernel: before, nothing on stdout
    assert again.returncode == 4
    assert json.loads(again.stdout) == {"action": "park", "pid": kernel.pid, "ok": False, "changed": False,
                                        "message": f"kernel {kernel.pid}: [gpucleanup.server.420] park refused: the "
                                                   "kernel is parked"}
    assert kernel.state()["state"] == "parked"
    assert cli("resume", str(kernel.pid)).returncode == 0


def test_a_kernel_running_a_cell_is_not_parked(kernel, checkpoints):
    msg_id = kernel.start("import time\nwhile not __import__('os').path.exists(%r): time.sleep(0.01)"
                          % str(checkpoints / "go"))
    wait_until(lambda: kernel.state()["state"] == "running", "the cell never said running")
    refused = cli("park", str(kernel.pid))
    (checkpoints / "go").touch()
    kernel.collect(msg_id)
    assert refused.returncode == 4
    assert refused.stderr == (f"gpucleanup: kernel {kernel.pid}: [gpucleanup.server.420] park refused: the kernel is "
                              "running; a park starts only between cells (state idle): ask again when the cell has "
                              "ended\n")
    assert record(checkpoints, kernel.pid)["state"] == "running"


def test_a_failed_checkpoint_leaves_the_kernel_running_and_idle(kernel, checkpoints):
    patch(checkpoints, kernel.pid, {"errors": {"cuCheckpointProcessCheckpoint": 2}})
    failed = cli("park", str(kernel.pid))
    assert failed.returncode == 6, failed
    assert failed.stderr == (f"gpucleanup: kernel {kernel.pid}: [gpucleanup.park.620] the checkpoint failed with "
                             f"CUDA_ERROR_OUT_OF_MEMORY: process {kernel.pid} was unlocked and runs as before, nothing "
                             "was parked\n")
    assert record(checkpoints, kernel.pid)["state"] == "running"
    assert kernel.state()["state"] == "idle"
    assert kernel.execute("print('still here')") == "still here\n"


def test_a_checkpoint_the_driver_does_not_support_is_said_and_never_tried_again(kernel, checkpoints):
    # CUDA managed memory: the driver's checkpoint answers CUDA_ERROR_NOT_SUPPORTED, and fails every later one of
    # the process even once the memory is freed (CUDA_ERROR_UNKNOWN on an H100): the refusal lasts as the process
    patch(checkpoints, kernel.pid, {"errors": {"cuCheckpointProcessCheckpoint": 801}})
    failed = cli("park", str(kernel.pid))
    assert failed.returncode == 6, failed
    assert failed.stderr == (f"gpucleanup: kernel {kernel.pid}: [gpucleanup.park.620] the checkpoint failed with "
                             "CUDA_ERROR_NOT_SUPPORTED (the process holds memory the driver's checkpoint does not "
                             "support, such as CUDA managed memory: cudaMallocManaged, CuPy's malloc_managed, Numba's "
                             "managed_array; the driver then fails every later checkpoint of the process, even once "
                             "that memory is freed, so no park of it is tried again; restart the kernel to make it "
                             f"parkable): process {kernel.pid} was unlocked and runs as before, nothing was parked\n")
    memo = (f"[gpucleanup.park.652] the driver refused to checkpoint process {kernel.pid} ", " ago "
            "(CUDA_ERROR_NOT_SUPPORTED: the process holds memory the driver's checkpoint does not support, such as CUDA "
            "managed memory: cudaMallocManaged, CuPy's malloc_managed, Numba's managed_array); the driver then fails "
            "every later checkpoint of the process, even once that memory is freed, so no park of it is tried again; "
            "restart the kernel to make it parkable")
    check = cli("park", "--check", str(kernel.pid))
    assert check.returncode == 4, check
    assert check.stdout.startswith(f"kernel {kernel.pid} cannot be parked now:\n  - {memo[0]}")
    assert memo[1] in check.stdout
    again = cli("park", str(kernel.pid))
    assert again.returncode == 4, again
    assert again.stderr.startswith(f"gpucleanup: kernel {kernel.pid} not parked: {memo[0]}") and memo[1] in again.stderr
    calls = record(checkpoints, kernel.pid)["calls"]
    assert (calls.get("cuCheckpointProcessLock"), calls.get("cuCheckpointProcessCheckpoint")) == (1, 1)  # not again
    assert kernel.state()["state"] == "idle"
    assert kernel.execute("print('still here')") == "still here\n"  # a cell that frees it: the memo stays
    patch(checkpoints, kernel.pid, {"errors": {}})
    check = cli("park", "--check", str(kernel.pid))
    assert check.returncode == 4 and memo[1] in check.stdout, check
    again = cli("park", str(kernel.pid))
    assert again.returncode == 4 and memo[1] in again.stderr, again
    calls = record(checkpoints, kernel.pid)["calls"]
    assert (calls.get("cuCheckpointProcessLock"), calls.get("cuCheckpointProcessCheckpoint")) == (1, 1)
    assert kernel.execute("print('still here')") == "still here\n" and kernel.state()["state"] == "idle"


def test_a_failed_restore_keeps_the_kernel_parked_refuses_the_cell_and_says_how_to_retry(kernel, checkpoints):
    assert cli("park", str(kernel.pid)).returncode == 0
    patch(checkpoints, kernel.pid, {"errors": {"cuCheckpointProcessRestore": 2}})
    out = kernel.execute("print('cell ran')")
    refused = (f"KernelStillParked: this cell was not run: the kernel is still parked ([gpucleanup.park.624] the "
               f"restore of process {kernel.pid} failed with CUDA_ERROR_OUT_OF_MEMORY: it stays parked, its GPU "
               f"memory safe in host memory; retry with gpucleanup resume {kernel.pid}); nothing is lost: run the "
               f"cell again, or resume it with gpucleanup resume {kernel.pid}\n")
    assert out == refused  # its first GPU call would have waited for a restore nobody makes
    assert kernel.state()["state"] == "parked"  # no cleanup after the cell: its driver calls would wait
    assert kernel.execute("%gpumem") == refused  # each cell tries the resume again first
    patch(checkpoints, kernel.pid, {"errors": {}})
    assert kernel.execute("print('cell ran')").endswith("cell ran\n")  # the memory is back: the cell resumes it
    assert kernel.state()["state"] == "idle"
    assert record(checkpoints, kernel.pid)["state"] == "running"


def test_park_check_says_whether_a_kernel_can_be_parked_and_touches_nothing(kernel, checkpoints):
    ok = cli("park", "--check", str(kernel.pid))
    assert (ok.returncode, ok.stdout, ok.stderr) == (0, f"kernel {kernel.pid} can be parked now\n", "")
    assert record(checkpoints, kernel.pid)["calls"].get("cuCheckpointProcessLock") is None
    assert cli("park", str(kernel.pid)).returncode == 0
    parked = cli("park", "--check", str(kernel.pid))
    assert (parked.returncode, parked.stdout) == (4, f"kernel {kernel.pid} cannot be parked now:\n  - the kernel is "
                                                     f"parked already: gpucleanup resume {kernel.pid} brings it back\n")
    data = json.loads(cli("park", "--check", "--json", str(kernel.pid)).stdout)
    assert (data["parkable"], data["state"], data["driver_state"]) == (False, "parked", "checkpointed")
    assert record(checkpoints, kernel.pid)["state"] == "checkpointed"  # still parked: nothing was touched


@pytest.mark.parametrize("command", ["park", "resume", "drain", "status"])
@pytest.mark.parametrize("blank", ["", "   "])
def test_an_empty_kernel_argument_is_a_usage_error_and_never_picks_the_only_kernel(kernel, checkpoints, command, blank):
    done = cli(command, blank)
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == ("gpucleanup: KERNEL is empty: give a pid, a kernel id (or a unique prefix) or a notebook; "
                           "gpucleanup ps lists them\n")
    assert record(checkpoints, kernel.pid)["state"] == "running"


def test_a_silent_execute_resumes_a_parked_kernel_before_its_code(kernel, checkpoints):
    assert cli("park", str(kernel.pid)).returncode == 0
    # a variable inspector's poll: silent, no pre_run_cell, and a driver call that would wait while parked
    msg_id = kernel.kc.execute("import gpucleanup; _n = len(gpucleanup.snapshot()['devices'])", silent=True)
    reply = kernel.kc.get_shell_msg(timeout=120)
    while reply["parent_header"].get("msg_id") != msg_id:  # replies to earlier requests may come first
        reply = kernel.kc.get_shell_msg(timeout=120)
    assert reply["content"]["status"] == "ok", reply["content"]
    assert record(checkpoints, kernel.pid)["state"] == "running"
    assert kernel.state()["state"] == "idle"


def test_a_cell_started_while_a_park_is_under_way_waits_for_it_then_resumes(kernel, checkpoints):
    patch(checkpoints, kernel.pid, {"hang": ["cuCheckpointProcessCheckpoint"]})
    parking = subprocess.Popen([sys.executable, "-m", "gpucleanup.outside.cli", "park", str(kernel.pid)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environment())
    try:
        wait_until(lambda: record(checkpoints, kernel.pid)["state"] == "locked", "the park never locked the kernel")
        msg_id = kernel.start("print('after the park')")
        wait_until(lambda: kernel.state()["state"] == "parking", "the kernel left the park's state")
        patch(checkpoints, kernel.pid, {"hang": []})
        out = kernel.collect(msg_id)
        assert parking.wait(120) == 0, parking.stderr.read()
    finally:
        parking.kill()
    assert out.startswith("gpucleanup · resumed its GPU memory from host memory in "), out
    assert out.endswith("after the park\n")
    assert record(checkpoints, kernel.pid)["state"] == "running"


def test_a_parked_kernel_that_exits_is_resumed_first(kernel, checkpoints):
    assert cli("park", str(kernel.pid)).returncode == 0
    kernel.km.shutdown_wait_time = 60  # the resume's helpers at exit, on a loaded machine: no SIGTERM meanwhile
    kernel.km.shutdown_kernel(now=False)
    assert not kernel.km.is_alive()
    assert kernel.process.wait(timeout=60) == 0  # it exited by itself, resumed first
    assert record(checkpoints, kernel.pid)["state"] == "running"
    assert not discovery.path_for_pid(kernel.pid, kernel.runtime).exists()


def test_park_and_resume_of_a_dead_kernel_say_so(kernel, checkpoints):
    assert cli("park", str(kernel.pid)).returncode == 0
    kernel.km.shutdown_kernel(now=True)  # SIGKILL: its discovery file stays behind
    assert not kernel.km.is_alive()
    assert discovery.path_for_pid(kernel.pid, kernel.runtime).exists()
    resumed = cli("resume", str(kernel.pid))
    assert resumed.returncode == 1
    assert resumed.stderr == (f"gpucleanup: kernel {kernel.pid} is dead: its process is gone (its discovery file was "
                              "removed)\n")


@pytest.mark.parametrize("line, message", [
    ("--park --json", "%gpumem: --park goes alone, not with --json."),
    ("--park --history 3", "%gpumem: --park goes alone, not with --history."),
])
def test_park_goes_alone(line, message):
    from IPython.core.error import UsageError

    from gpucleanup.in_kernel.extension import GPUCleanup
    from gpucleanup.in_kernel.magics import parse_gpumem

    with pytest.raises(UsageError) as raised:
        parse_gpumem(GPUCleanup.gpumem, line)
    assert str(raised.value).startswith(message)


def test_park_after_idle_parks_a_kernel_left_idle_and_its_next_cell_resumes_it(kernel, checkpoints):
    assert kernel.execute("%config GPUCleanup.park_after_idle_s = 0.5\ny = 7") == ""
    wait_until(lambda: kernel.state()["state"] == "parked", "the idle kernel was never parked")
    assert record(checkpoints, kernel.pid)["state"] == "checkpointed"
    out = kernel.execute("print(y * 6)")
    assert out.startswith("gpucleanup · resumed its GPU memory from host memory in "), out
    assert out.endswith("42\n")
    assert record(checkpoints, kernel.pid)["state"] == "running"


def test_park_after_idle_parks_a_kernel_that_loads_gpucleanup_from_its_config_file(runtime, checkpoints, tmp_path):
    # the README's set-up: ipykernel's parent poller and its other threads start after the extension loads; they
    # were taken for threads a cell started, and no automatic park ever happened
    profile = tmp_path / "ipython" / "profile_default"
    profile.mkdir(parents=True)
    (profile / "ipython_kernel_config.py").write_text("c.InteractiveShellApp.extensions = ['gpucleanup']\n"
                                                      "c.GPUCleanup.park_after_idle_s = 0.5\n")
    k = kernel_harness.Kernel(dict(environment(), JUPYTER_RUNTIME_DIR=str(runtime), IPYTHONDIR=str(tmp_path / "ipython")),
                              kernel_id=str(uuid.uuid4()), timeout=120)
    try:
        assert k.execute("y = 7\nimport threading\nprint(threading.active_count() > 2)") == "True\n"
        wait_until(lambda: k.status()["state"]["state"] == "parked", "the idle kernel was never parked")
        assert record(checkpoints, k.pid)["state"] == "checkpointed"
        out = k.execute("print(y * 6)")
        assert out.startswith("gpucleanup · resumed its GPU memory from host memory in "), out
        assert out.endswith("42\n")
    finally:
        k.stop()


def test_a_bad_park_after_idle_is_refused_and_changes_nothing(kernel):
    out = kernel.execute("%config GPUCleanup.park_after_idle_s = -1")
    assert "park_after_idle_s" in out and "-1" in out, out
    assert kernel.execute("%config GPUCleanup.park_after_idle_s") == "0.0\n"


# ---------------------------------------------------------------- the lock and the steps, without a kernel


def test_the_park_lock_is_never_followed_through_a_link_and_waits_a_bounded_time(tmp_path):
    from gpucleanup.park import kernel_side as parking

    (tmp_path / "elsewhere").write_text("")
    (tmp_path / "1.park").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(parking.LockUnusable) as unusable:
        parking.ParkLock(tmp_path / "1.park", timeout=0).__enter__()
    assert str(unusable.value) == (f"[gpucleanup.park.640] the park lock {tmp_path / '1.park'} cannot be opened (it is "
                                   "a symbolic link, which is never followed): nothing was done; remove what is at "
                                   "that name if it is not gpucleanup's, then try again")
    path = parking.lock_path(tmp_path / "2.key", 2)
    assert path == tmp_path / "2.park"
    with parking.ParkLock(path, timeout=0):
        with pytest.raises(parking.LockBusy) as busy:
            with parking.ParkLock(path, timeout=0.1):
                pass
    assert str(busy.value) == f"another park or resume of this kernel has held {path} for over 0 s"
    with parking.ParkLock(path, timeout=0):  # let go with the first one
        pass


def test_a_refused_park_tells_the_kernels_state_it_failed(tmp_path, checkpoints):
    from gpucleanup.park import steps as park, kernel_side as parking

    steps = []

    def record(step, parked_bytes):
        steps.append((step, parked_bytes))
        return {}

    with pytest.raises(park.ParkRefused):  # this pytest process never loaded the fake driver
        parking.park_kernel(os.getpid(), record, tmp_path / "x.park", env=environment())
    assert steps == [("begin", None), ("failed", None)]


def test_the_kernels_state_refusing_a_park_stops_it_before_any_driver_step(tmp_path):
    from gpucleanup.park import kernel_side as parking
    from gpucleanup._native import NativeError

    asked = []

    def record(step, parked_bytes):
        asked.append(step)
        raise NativeError(7, "[gpucleanup.server.509] park refused: the kernel is running")

    with pytest.raises(NativeError) as refused:
        parking.park_kernel(os.getpid(), record, tmp_path / "x.park", begin_wait_s=60)
    assert refused.value.error_id == "gpucleanup.server.509"
    assert asked == ["begin"]  # a refusal that stands is not asked again


def _endpoint_in_this_process(tmp_path, monkeypatch):
    """A status endpoint of this process (the real library, no kernel) and a target that signs under its key."""
    from gpucleanup.protocol import discovery
    from gpucleanup.in_kernel.status_endpoint import StatusEndpoint

    runtime = tmp_path / "runtime"
    runtime.mkdir(mode=0o700)
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(runtime))
    endpoint = StatusEndpoint()
    endpoint.start(__import__("types").SimpleNamespace(user_ns={}))
    assert endpoint.error is None, endpoint.error
    found = [k for k in discovery.scan(runtime).live if k.pid == os.getpid()]
    assert len(found) == 1, found
    return endpoint, status_client.Target(found[0].endpoint, found[0].read_key()), found[0].key_file


@pytest.mark.parametrize("remote", [True, False], ids=["from outside", "in the kernel"])
def test_a_park_asked_for_during_the_kernels_own_release_asks_again_and_begins_once_it_ends(
        tmp_path, monkeypatch, remote):
    # gpucleanup's release once idle (a thread of its own) comes due about a second after a cell: a park asked
    # for then is told "ask again" (server.421 on the socket, server.510 in the process), and asks again.
    from gpucleanup.park import steps as park, kernel_side as parking, from_outside as remote_park

    endpoint, target, key_file = _endpoint_in_this_process(tmp_path, monkeypatch)
    try:
        endpoint.cell_state("idle", None, 0)
        assert endpoint.background(True)
        ask = remote_park.remote_record(target, 5.0) if remote else endpoint.park_step
        steps, refused = [], []

        def record(step, parked_bytes):
            steps.append(step)
            try:
                return ask(step, parked_bytes)
            except Exception as exc:
                refused.append(getattr(exc, "error_id", None))
                endpoint.background(False)  # the release ends while the park waits to ask again
                raise

        with pytest.raises(park.ParkRefused):  # begun: then the helper refuses this pytest process itself
            parking.park_kernel(os.getpid(), record, parking.lock_path(key_file, os.getpid()), env=environment())
        assert refused == ["gpucleanup.server.421" if remote else "gpucleanup.server.510"]
        assert steps == ["begin", "begin", "failed"]
        assert endpoint.park_step("begin")["state"] == "parking"  # the failed park went back to idle
    finally:
        endpoint.close()


def test_a_park_still_told_to_ask_again_past_its_wait_says_why_and_changes_nothing(tmp_path, monkeypatch):
    from gpucleanup.park import kernel_side as parking, from_outside as remote_park

    endpoint, target, key_file = _endpoint_in_this_process(tmp_path, monkeypatch)
    try:
        endpoint.cell_state("idle", None, 0)
        assert endpoint.background(True)  # a release that has not ended
        with pytest.raises(status_client.StatusRejected) as refused:
            parking.park_kernel(os.getpid(), remote_park.remote_record(target, 5.0),
                                parking.lock_path(key_file, os.getpid()), begin_wait_s=0.2)
        assert refused.value.error_id == "gpucleanup.server.421"
        assert str(refused.value) == ("[gpucleanup.server.421] park refused: gpucleanup is giving the frameworks' caches back on a thread "
                                      "of its own; ask again in a few seconds")
        assert status_client.request(target, "status", 5.0)["state"]["state"] == "idle"
    finally:
        endpoint.close()



def test_a_park_that_waited_for_a_release_to_end_says_how_long(tmp_path, monkeypatch):
    from gpucleanup.park import steps as park, kernel_side as parking
    from gpucleanup._native import NativeError
    from gpucleanup.units import format_duration

    passing = "[gpucleanup.server.510] park refused: gpucleanup is giving the frameworks' caches back on a thread"
    refusals = [NativeError(7, passing), NativeError(7, passing)]
    steps = []

    def record(step, parked_bytes):
        steps.append(step)
        if step == "begin" and refusals:
            raise refusals.pop(0)
        return {}

    monkeypatch.setattr(park, "park", lambda pid, limits, env=None, tracing=False, hold_threads=None, allow=None:
                        park.Outcome("park", pid, True, park.CHECKPOINTED, "parked", seconds=2.0, changed=True,
                                     parked_bytes=1 << 30))
    outcome = parking.park_kernel(4242, record, tmp_path / "x.park")
    assert steps == ["begin", "begin", "begin", "parked"]
    assert outcome.waited_s >= 0.1  # two refusals, each followed by 50 ms before asking again
    assert parking.parked_text(outcome) == (
        "parked 1.0 GiB of GPU memory (context included) in host memory in 2.0 s, after waiting "
        f"{format_duration(outcome.waited_s)} for a release or a drain under way to end")
    assert outcome.as_dict()["waited_s"] == outcome.waited_s  # gpucleanup park --json says it too

    refusals.clear()
    steps.clear()
    outcome = parking.park_kernel(4242, record, tmp_path / "x.park")
    assert steps == ["begin", "parked"] and outcome.waited_s == 0.0
    assert parking.parked_text(outcome) == "parked 1.0 GiB of GPU memory (context included) in host memory in 2.0 s"


def test_park_check_says_what_keeps_automatic_and_bulk_parks_away(kernel, checkpoints):
    assert kernel.execute("import threading\nstop = threading.Event()\n"
                          "worker = threading.Thread(target=stop.wait, name='train-loop')\nworker.start()") == ""
    checked = cli("park", "--check", str(kernel.pid))
    assert checked.returncode == 0, checked  # a person may still park it
    assert checked.stdout.endswith("  but automatic and bulk parks leave it alone: [gpucleanup.park.642] 1 thread "
                                   "started in a cell still runs (train-loop): an automatic park would stop their "
                                   "GPU calls; it is left to %gpumem --park or gpucleanup park once they end\n"), checked
    assert json.loads(cli("park", "--check", "--json", str(kernel.pid)).stdout)["blocker"].startswith(
        "[gpucleanup.park.642] 1 thread")
    assert kernel.execute("stop.set(); worker.join()") == ""
    assert json.loads(cli("park", "--check", "--json", str(kernel.pid)).stdout)["blocker"] is None


def test_a_resume_that_loses_the_kernel_says_so_at_once_in_every_later_cell_and_in_ps(kernel, checkpoints):
    out = kernel.execute("x = 41\n%gpumem --park")
    assert "gpucleanup · parked " in out, out
    patch(checkpoints, kernel.pid, {"errors": {"cuCheckpointProcessRestore": 304},
                                    "error_state": {"cuCheckpointProcessRestore": "failed"}})
    out = kernel.execute("x + 1")
    assert out.startswith("KernelStillParked: this cell was not run: the kernel's GPU state is lost ([gpucleanup.park.625] "
                          f"the restore of process {kernel.pid} failed with CUDA_ERROR_OPERATING_SYSTEM and left it "
                          "failed: its GPU state may be lost; save what you can and restart it); restart the kernel "
                          "(its variables cannot be brought back to the GPU)"), out
    assert "42" not in out
    assert kernel.state()["state"] == "lost"
    restores = record(checkpoints, kernel.pid)["calls"]["cuCheckpointProcessRestore"]
    again = kernel.execute("x + 1")  # at once: no helper started again, no wait
    assert again == out and record(checkpoints, kernel.pid)["calls"]["cuCheckpointProcessRestore"] == restores
    listed = cli("ps")
    assert "lost: a resume could not bring its GPU state back; restart it" in listed.stdout, listed
    resumed = cli("resume", str(kernel.pid))
    assert resumed.returncode != 0 and "its GPU state is lost, restart it" in resumed.stdout + resumed.stderr, resumed
