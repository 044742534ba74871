"""The ``gpucleanup`` command, run as a subprocess.

First against a status endpoint in this process (a fake kernel description),
then against real kernels started through jupyter_client with
``%load_ext gpucleanup``: busy in Python, busy in a C call that holds the GIL,
killed, unloaded.
"""

from __future__ import annotations

import json
import re
import os
import shutil
import signal
import statistics
import subprocess
import sys
import textwrap
import time
import types
import uuid
from pathlib import Path

import pytest

import gpucleanup
from gpucleanup import _native
from gpucleanup.protocol import discovery, status_client
from gpucleanup.outside import cli as gpucleanup_cli
from gpucleanup.in_kernel.status_endpoint import StatusEndpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kernel_harness import Kernel  # noqa: E402  (tests/kernel_harness.py)
from support import cli  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
BUILD = Path(os.environ.get("GPUCLEANUP_BUILD_DIR", ROOT / "build")).resolve()


@pytest.fixture
def kernel(runtime, fake_cuda):
    """This process, described as a kernel with a notebook and a last cell."""
    ep = StatusEndpoint()
    ep.start(types.SimpleNamespace(user_ns={"__session__": "/home/me/fit.ipynb"}))
    assert ep.error is None, ep.error
    ep.set_state({"state": "running", "cell": 12, "since_ns": time.time_ns() - 5_000_000_000})
    ep.publish(
        {
            "cell": 11,
            "devices": [
                {
                    "index": 0,
                    "freed_bytes": {"cupy": 6 << 30},
                    "live_bytes": {"cupy": 1 << 30},
                    "cached_bytes": {"torch": 300 << 20},
                }
            ],
            "pinned": {"freed_bytes": 0},
        }
    )
    yield ep
    ep.close()


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def write_discovery(runtime: Path, pid: int, **fields) -> Path:
    info = {
        "discovery": 1, "pid": pid, "proc_start_ticks": None, "kernel_id": f"k{pid}", "connection_file": None,
        "notebook": None, "endpoint": f"ipc://{runtime}/gpucleanup/{pid}.sock",
        "pub_endpoint": f"ipc://{runtime}/gpucleanup/{pid}.sock.pub", "transport": "ipc", "key_file": None,
        "signature_scheme": "hmac-sha256", "protocol": 1, "started_ns": 1, "version": "0.1.0",
    }
    info.update(fields)
    path = runtime / f"gpucleanup-{pid}.json"
    discovery.write(path, info)
    return path


# ---------------------------------------------------------------- against this process


def test_status_json_reports_the_kernel(kernel):
    result = cli("status", str(os.getpid()), "--json")
    assert result.returncode == 0, result.stderr
    reply = json.loads(result.stdout)
    assert reply["protocol"] == 1
    assert reply["kind"] == "status"
    assert reply["kernel"]["pid"] == os.getpid()
    assert reply["kernel"]["notebook"] == "/home/me/fit.ipynb"
    assert reply["state"]["state"] == "running"
    assert reply["state"]["cell"] == 12
    assert reply["state"]["age_s"] >= 5
    assert reply["last_record"]["devices"][0]["freed_bytes"] == {"cupy": 6 << 30}
    assert reply["snapshot"]["kind"] == "snapshot"
    assert reply["server"]["request_signed"] is True


def test_status_text_and_notebook_lookup(kernel):
    result = cli("status", "fit.ipynb")
    assert result.returncode == 0, result.stderr
    assert f"kernel     {os.getpid()}" in result.stdout
    # the state began 5 s before the fixture set it; how long ago now depends on the machine
    since = re.search(r"^state      running cell 12 for ([0-9.]+) s$", result.stdout, re.MULTILINE)
    assert since is not None and float(since.group(1)) >= 5, result.stdout
    assert "cupy 1.0 GiB live/0 B cached, torch 0 B live/300 MiB cached" in result.stdout
    assert "last cell  cell 11 freed 6.0 GiB" in result.stdout


def test_ps_lists_the_kernel(kernel):
    result = cli("ps")
    assert result.returncode == 0, result.stderr
    header, row = result.stdout.splitlines()
    assert header.split() == ["PID", "KERNEL", "STATE", "GPU", "MEMORY", "LAST", "CELL"]
    since = re.match(rf"{os.getpid()}  /home/me/fit.ipynb  running cell 12 for ([0-9.]+) s ", row)
    assert since is not None and float(since.group(1)) >= 5, row
    assert "GPU0 live 1.0 GiB cached 300 MiB" in row
    assert row.endswith("cell 11 freed 6.0 GiB")


def test_ps_json_carries_exact_bytes(kernel):
    result = cli("ps", "--json")
    assert result.returncode == 0, result.stderr
    (entry,) = json.loads(result.stdout)
    assert entry["pid"] == os.getpid()
    assert entry["status"]["last_record"]["devices"][0]["live_bytes"] == {"cupy": 1 << 30}


def test_dead_kernels_files_are_cleaned_and_not_listed(kernel, runtime):
    gone = dead_pid()
    gone_file = write_discovery(runtime, gone)
    # A live pid whose process started at another time: the pid was reused.
    reused_file = write_discovery(runtime, os.getppid(), proc_start_ticks=1, kernel_id="reused")
    result = cli("ps")
    assert result.returncode == 0, result.stderr
    # one row, this kernel's: neither the dead pid nor the reused one is listed
    assert [line.split()[0] for line in result.stdout.splitlines()[1:]] == [str(os.getpid())]
    assert "reused" not in result.stdout and str(gone) not in result.stdout.split()
    assert not gone_file.exists()
    assert not reused_file.exists()
    assert kernel.discovery_path.exists()


def test_dead_kernel_by_pid_is_a_clear_error(kernel, runtime):
    gone = dead_pid()
    write_discovery(runtime, gone)
    result = cli("status", str(gone))
    assert result.returncode == 1
    assert result.stderr == (
        f"gpucleanup: kernel {gone} is dead: its process is gone (its discovery file was removed)\n"
    )


def test_bad_key_exits_nonzero_with_a_clear_message(kernel):
    key_file = Path(kernel.info["key_file"])
    key_file.write_text("0" * 64)
    result = cli("status", str(os.getpid()))
    assert result.returncode == 4
    assert result.stderr.startswith(
        f"gpucleanup: kernel {os.getpid()} refused the request: its key file {key_file} does not hold the kernel's key"
    )
    assert "[gpucleanup.server.403] bad signature" in result.stderr


def test_unreadable_key_file_says_whose_it_is(kernel):
    if os.geteuid() == 0:
        pytest.skip("root reads any file")
    os.chmod(kernel.info["key_file"], 0)
    result = cli("status", str(os.getpid()))
    assert result.returncode == 4
    assert "cannot read its key file" in result.stderr


def test_no_kernels(runtime):
    result = cli("ps")
    assert result.returncode == 1
    assert result.stdout == ""
    assert result.stderr == (
        f"gpucleanup: no kernel with gpucleanup is running (no usable discovery file in {runtime}): "
        "run %load_ext gpucleanup in a kernel first\n"
    )
    assert cli("status", "123").returncode == 1
    assert cli("watch").returncode == 1


def test_unknown_and_ambiguous_kernels(kernel, runtime):
    result = cli("status", "nope")
    assert result.returncode == 1
    assert result.stderr == "gpucleanup: no kernel 'nope': gpucleanup ps lists the kernels (pid, kernel id or notebook)\n"
    # Two live processes whose kernel ids share a prefix.
    write_discovery(runtime, os.getppid(), kernel_id="abc-1", proc_start_ticks=discovery.process_start_ticks(os.getppid()))
    kernel.info["kernel_id"] = "abc-2"
    discovery.write(kernel.discovery_path, kernel.info)
    result = cli("status", "abc")
    assert result.returncode == 1
    assert "'abc' matches 2 kernels" in result.stderr
    result = cli("status", "abc-2", "--json")
    assert result.returncode == 0, result.stderr


def test_a_stuck_kernel_does_not_stall_ps(kernel, runtime):
    import zmq

    stuck = zmq.Context.instance().socket(zmq.ROUTER)  # accepts, never answers
    stuck.setsockopt(zmq.LINGER, 0)
    port = stuck.bind_to_random_port("tcp://127.0.0.1")
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        write_discovery(runtime, sleeper.pid, endpoint=f"tcp://127.0.0.1:{port}", transport="tcp",
                        proc_start_ticks=discovery.process_start_ticks(sleeper.pid))
        start = time.monotonic()
        result = cli("ps", "--timeout", "5")  # the live kernel answers well within it, on a loaded machine too
        elapsed = time.monotonic() - start
        assert result.returncode == 0, result.stderr
        rows = {line.split()[0]: line for line in result.stdout.splitlines()[1:]}
        assert "no answer" in rows[str(sleeper.pid)]
        assert "running cell 12" in rows[str(os.getpid())]
        print(f"\nps with one stuck kernel (--timeout 5): {elapsed:.2f} s including interpreter start")
        result = cli("status", str(sleeper.pid), "--timeout", "0.3")
        assert result.returncode == 3
        assert result.stderr == (
            f"gpucleanup: kernel {sleeper.pid} did not answer within 0.3 s: the process may be stopped or "
            "overloaded (--timeout waits longer)\n"
        )
    finally:
        sleeper.kill()
        sleeper.wait()
        stuck.close()


def test_drain_refused_while_running_then_runs_when_idle(kernel):
    result = cli("drain", str(os.getpid()))
    assert result.returncode == 4
    assert result.stderr == (
        f"gpucleanup: kernel {os.getpid()}: [gpucleanup.server.411] drain refused: the kernel is running; "
        "a drain runs only between cells (state idle)\n"
    )
    kernel.set_state({"state": "idle"})
    result = cli("drain", str(os.getpid()), "--json", "--drain-timeout", "1")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["result"]["kind"] == "drain"


def settle_after(fake_cuda) -> None:
    """Lets every hanging synchronize finish, so the next test's reset finds no watchdog mid-call."""
    fake_cuda.release_sync()
    deadline = time.monotonic() + 10
    while fake_cuda.counter("syncs_in_flight") != 0 or fake_cuda.counter("retained") != 0:
        assert time.monotonic() < deadline, "a drain's watchdog never finished"
        time.sleep(0.01)


def test_drain_of_a_busy_device_exits_5_and_says_which_device_and_why(kernel, fake_cuda):
    fake_cuda.reset({"devices": [
        {"uuid": "GPU-c11d0000-0000-0000-0000-000000000001", "primary_active": True, "sync_seconds": -1},
        {"uuid": "GPU-c11d0000-0000-0000-0000-000000000002", "primary_active": True,
         "default_pool": {"reserved_bytes": 1 << 30, "used_bytes": 0}},
    ]})
    kernel.set_state({"state": "idle"})
    pid = os.getpid()
    try:
        result = cli("drain", str(pid), "--drain-timeout", "0.2")
        assert result.returncode == 5
        assert result.stdout == f"kernel {pid} GPU1: drained, released 1.0 GiB\n"
        assert result.stderr == (
            f"gpucleanup: kernel {pid} GPU0 busy: the work the kernel queued on it did not finish within 0.2 s, "
            "so its memory pools were not trimmed; try again later, or with a longer --drain-timeout (at most 60)\n"
        )

        # The first drain's wait goes on: the next one does not wait again, and says so.
        result = cli("drain", str(pid), "--json", "--drain-timeout", "60")
        assert result.returncode == 5
        reply = json.loads(result.stdout)
        assert [(d["index"], d["state"], d["settle"]["status"]) for d in reply["result"]["devices"]] == [
            (0, "busy", "still_busy"), (1, "drained", "done")]
        busy_for = gpucleanup_cli.format_duration(reply["result"]["devices"][0]["settle"]["busy_for_s"])
        assert result.stderr == (
            f"gpucleanup: kernel {pid} GPU0 busy: its work queued {busy_for} ago is still running, and a wait for it "
            "is under way already (the kernel's own cleanup after its last cell, or an earlier drain) or cannot be "
            "made without holding the GPU's context, so its memory pools were not trimmed; try again when that work "
            "has finished\n"
        )
    finally:
        settle_after(fake_cuda)


def test_drain_of_an_unusable_device_exits_5_with_the_librarys_advice(kernel, fake_cuda):
    # Its own uuid: the library remembers a sticky error per device for the process's life.
    fake_cuda.reset({"devices": [{"uuid": "GPU-c11d0000-0000-0000-0000-0000000000a7", "primary_active": True,
                                  "sticky_error": 700}]})
    kernel.set_state({"state": "idle"})
    pid = os.getpid()
    result = cli("drain", str(pid), "--drain-timeout", "1")
    assert result.returncode == 5
    assert result.stdout == ""
    assert result.stderr == (
        f"gpucleanup: kernel {pid} GPU0 unusable: GPU0 is unusable after CUDA_ERROR_ILLEGAL_ADDRESS: "
        "restart the kernel\n"
    )


def test_drain_of_a_failing_device_exits_5_and_says_to_try_again(kernel, fake_cuda):
    fake_cuda.reset({"devices": [{"uuid": "GPU-c11d0000-0000-0000-0000-0000000000e1", "primary_active": True,
                                  "errors": {"cuMemGetInfo": 999}}]})
    kernel.set_state({"state": "idle"})
    pid = os.getpid()
    result = cli("drain", str(pid), "--json", "--drain-timeout", "1")
    assert result.returncode == 5
    (device,) = json.loads(result.stdout)["result"]["devices"]
    assert device["state"] == "error"
    assert device["message"].endswith("on GPU0: gpucleanup left the device alone this time")
    assert result.stderr == f"gpucleanup: kernel {pid} GPU0 error: {device['message']}; try again\n"


def test_drain_with_an_unusable_driver_exits_5(kernel, fake_cuda):
    fake_cuda.reset({"errors": {"cuDeviceGetCount": 999}, "devices": [{"primary_active": True}]})
    kernel.set_state({"state": "idle"})
    message = _native.probe()["driver"]["message"]
    assert message.startswith("[gpucleanup.driver.104] ")
    result = cli("drain", str(os.getpid()), "--drain-timeout", "1")
    assert result.returncode == 5
    assert result.stdout == ""
    assert result.stderr == f"gpucleanup: kernel {os.getpid()} nothing drained, the CUDA driver is unusable: {message}\n"


def test_drain_without_a_gpu_in_use_exits_0(kernel):
    kernel.set_state({"state": "idle"})
    result = cli("drain", str(os.getpid()), "--drain-timeout", "0")
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"kernel {os.getpid()}: drained; no GPU in use\n"
    assert result.stderr == ""


def test_ps_json_without_kernels_is_an_empty_list(runtime):
    result = cli("ps", "--json")
    assert result.returncode == 0
    assert result.stdout == "[]\n"
    assert result.stderr == ""


def test_version(runtime):
    result = cli("--version")
    assert result.returncode == 0
    assert result.stdout == f"gpucleanup {gpucleanup.__version__}\n"
    assert result.stderr == ""


def test_help_lists_the_exit_codes(runtime):
    result = cli("--help")
    assert result.returncode == 0
    assert result.stdout.endswith(
        "Exit status: (the page's REST API answers the same outcomes with the HTTP status in brackets)\n"
        "  0    done [200]; ps --json with no kernel prints []; park --check: it can\n"
        "       be parked now\n"
        "  1    no kernel with gpucleanup; KERNEL unknown, ambiguous or dead [404]\n"
        "  2    usage: unknown command or option, option value out of range [400]\n"
        "  3    a kernel did not answer within --timeout [504]\n"
        "  4    refused, nothing was done [409]: a cell or a drain is running, the\n"
        "       kernel is parked already (park) or not parked (resume), another park\n"
        "       of it is under way, no room to resume it, it cannot be parked (park\n"
        "       --check says why); also a key file that cannot be used, or an answer\n"
        "       that cannot be read [502]\n"
        "  5    drain: the kernel answered, but a device was not drained (busy,\n"
        "       unusable, failed) or its CUDA driver is unusable [200, \"drained\":\n"
        "       false]\n"
        "  6    park, resume: a driver step failed [500, \"ok\": false]; the message\n"
        "       says what state the process is in and what to do\n"
        "  7    cannot run here: exporter without prometheus_client (pip install\n"
        "       'gpucleanup[server]'), or its port or token file cannot be used\n"
        "  130  interrupted (Ctrl-C; SIGTERM too during park and resume, which let the\n"
        "       driver's step under way finish and say the state they left), except\n"
        "       watch and exporter, whose way to stop is Ctrl-C (exporter: SIGTERM\n"
        "       too), which exit 0\n"
    )
    assert result.stderr == ""


def test_drain_timeout_out_of_range_is_a_usage_error(runtime):
    # Before the fix these reached the kernel: "did not answer within 0 s", "request is malformed" (exit 4).
    for value in ("-1", "100"):
        result = cli("drain", "123", "--drain-timeout", value)
        assert result.returncode == 2
        assert result.stdout == ""
        assert result.stderr.startswith("usage: gpucleanup drain ")
        assert result.stderr.splitlines()[-1] == (
            f"gpucleanup drain: error: argument --drain-timeout: must be a number of seconds from 0 to 60, got '{value}'"
        )


TIMEOUT_RANGE = "greater than 0 and at most 86400"


@pytest.mark.parametrize("argv, said", [
    (["--json", "ps"], "gpucleanup ps: error: --json is an option of ps: it goes after the command (gpucleanup ps --json)"),
    (["--json", "status", "123"],
     "gpucleanup status: error: --json is an option of status: it goes after the command (gpucleanup status --json)"),
    (["ps", "--jsno"], "gpucleanup ps: error: unrecognized arguments: --jsno (--jsno: did you mean --json?)"),
    (["drain", "123", "--drain-timout", "5"],
     "gpucleanup drain: error: unrecognized arguments: --drain-timout 5 (--drain-timout: did you mean --drain-timeout?)"),
    (["ps", "--frobnicate"], "gpucleanup ps: error: unrecognized arguments: --frobnicate"),
])
def test_an_option_before_its_command_or_misspelt_is_a_usage_error_that_says_what_to_write(argv, said, runtime,
                                                                                           capsys):
    with pytest.raises(SystemExit) as raised:
        gpucleanup_cli.main(argv)
    assert raised.value.code == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err.splitlines()[-1] == said


@pytest.mark.parametrize("argv, said", [
    (["stauts"], "gpucleanup: error: unknown command 'stauts': did you mean 'status'? (the commands: drain, exporter, "
                 "park, ps, resume, status, watch)"),
    (["prk", "123"], "gpucleanup: error: unknown command 'prk': did you mean 'park'? (the commands: drain, exporter, "
                     "park, ps, resume, status, watch)"),
    (["frobnicate"], "gpucleanup: error: unknown command 'frobnicate' (the commands: drain, exporter, park, ps, "
                     "resume, status, watch)"),
    (["\x1b]0;x\x07"], "gpucleanup: error: unknown command '\\x1b]0;x\\x07' (the commands: drain, exporter, park, "
                       "ps, resume, status, watch)"),
])
def test_a_mistyped_command_is_a_usage_error_that_names_the_near_miss(argv, said, runtime, capsys):
    with pytest.raises(SystemExit) as raised:
        gpucleanup_cli.main(argv)
    assert raised.value.code == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err.splitlines()[-1] == said


@pytest.mark.parametrize("argv, action", [(["park", "99999"], "park"), (["resume", "99999"], "resume"),
                                          (["resume", ""], "resume")])
def test_park_and_resume_json_print_one_object_even_when_no_kernel_is_found(argv, action, runtime, capsys):
    code = gpucleanup_cli.main([*argv, "--json"])
    out = capsys.readouterr()
    reply = json.loads(out.out)
    message = out.err.removeprefix("gpucleanup: ").rstrip("\n")
    assert reply == {"action": action, "pid": None, "kernel": argv[1], "ok": False, "changed": False,
                     "message": message}
    assert code == (2 if argv[1] == "" else 1) and message
    code = gpucleanup_cli.main(["park", "--check", "99999", "--json"])
    out = capsys.readouterr()
    assert json.loads(out.out) == {"pid": None, "kernel": "99999", "parkable": False,
                                   "reasons": [out.err.removeprefix("gpucleanup: ").rstrip("\n")]}


@pytest.mark.parametrize(
    "argv, option, allowed",
    [
        *[(["drain", "123", "--drain-timeout", v], "--drain-timeout", "from 0 to 60")
          for v in ("-1", "60.5", "100", "nan", "inf", "ten", "")],
        *[([command, *kernel, "--timeout", v], "--timeout", TIMEOUT_RANGE)
          for command, kernel in (("ps", []), ("status", ["123"]), ("watch", []), ("drain", ["123"]))
          for v in ("0", "-0.5", "86401", "nan", "inf", "1e400", "ten")],
    ],
)
def test_bad_option_values_are_usage_errors(argv, option, allowed, runtime, capsys):
    with pytest.raises(SystemExit) as raised:
        gpucleanup_cli.main(argv)
    assert raised.value.code == 2
    out = capsys.readouterr()
    assert out.out == ""
    assert out.err.startswith(f"usage: gpucleanup {argv[0]} ")
    assert out.err.splitlines()[-1] == (
        f"gpucleanup {argv[0]}: error: argument {option}: must be a number of seconds {allowed}, got {argv[-1]!r}"
    )


def test_option_values_at_the_limits_are_accepted():
    parse = gpucleanup_cli._parser().parse_args
    assert parse(["drain", "k", "--drain-timeout", "0"]).drain_timeout == 0
    assert parse(["drain", "k", "--drain-timeout", "60"]).drain_timeout == 60
    assert parse(["drain", "k"]).drain_timeout == 10
    assert parse(["ps", "--timeout", "86400"]).timeout == 86400
    assert parse(["ps", "--timeout", "0.001"]).timeout == 0.001
    assert parse(["ps"]).timeout == status_client.DEFAULT_TIMEOUT


def test_watch_prints_records_until_interrupted(kernel, runtime):
    env = dict(os.environ, PYTHONPATH=str(ROOT / "ipython_ext"))
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpucleanup.outside.cli", "watch", "--json"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )
    try:
        import selectors

        sel = selectors.DefaultSelector()
        sel.register(proc.stdout, selectors.EVENT_READ)
        line = ""
        deadline = time.monotonic() + 20
        cell = 100
        while not line and time.monotonic() < deadline:
            cell += 1
            kernel.publish({"cell": cell, "devices": []})
            if sel.select(timeout=0.1):
                line = proc.stdout.readline()
        assert line, "watch printed nothing"
        message = json.loads(line)
        assert message["kind"] == "record"
        assert message["kernel"]["pid"] == os.getpid()
        assert message["record"]["cell"] > 100
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=10)
    assert proc.returncode == 0
    assert "watching 1 kernel(s); Ctrl-C stops" in proc.stderr.read()


# ---------------------------------------------------------------- real kernels


HOLD_GIL_C = """
#include <time.h>
/* Loaded with ctypes.PyDLL, so the interpreter lock stays held during the call. */
void hold_gil_ms(long ms) {
  struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
  nanosleep(&ts, 0);
}
"""


@pytest.fixture(scope="module")
def hold_gil_library(tmp_path_factory):
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build the GIL-holding call")
    directory = tmp_path_factory.mktemp("holdgil")
    (directory / "hold.c").write_text(HOLD_GIL_C)
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(directory / "libhold.so"), str(directory / "hold.c")], check=True)
    return directory / "libhold.so"


def kernel_env(runtime: Path) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT / "ipython_ext")
    env["GPUCLEANUP_LIBRARY"] = str(BUILD / "native" / "libgpucleanup.so")
    env["GPUCLEANUP_LIBCUDA"] = str(BUILD / "tests" / "fake_cuda" / "libcuda.so.1")
    env["JUPYTER_RUNTIME_DIR"] = str(runtime)
    return env


@pytest.fixture
def kernels(runtime):
    """Starts real ipykernels with gpucleanup loaded (tests/kernel_harness.py); each stopped at the end."""
    started = []

    def start() -> Kernel:
        k = Kernel(kernel_env(runtime), kernel_id=str(uuid.uuid4()))
        started.append(k)
        out = k.execute("%load_ext gpucleanup")
        assert "Error" not in out, out
        assert discovery.path_for_pid(k.pid, runtime).exists(), out
        return k

    yield start
    for k in started:
        k.stop()


def wait_for_state(target: status_client.Target, state: str, limit: float = 20) -> dict:
    deadline = time.monotonic() + limit
    while True:
        reply = status_client.request(target, "status", timeout=2)
        if reply["state"]["state"] == state or time.monotonic() > deadline:
            return reply
        time.sleep(0.01)


def latencies(target: status_client.Target, count: int, state: str) -> list:
    times = []
    for _ in range(count):
        start = time.perf_counter()
        reply = status_client.request(target, "status", timeout=2)
        times.append(time.perf_counter() - start)
        assert reply["state"]["state"] == state
    return times


def report(label: str, times: list) -> None:
    print(f"\nstatus latency, {label}: median {statistics.median(times) * 1e3:.2f} ms, "
          f"max {max(times) * 1e3:.2f} ms over {len(times)} requests")


def test_ps_lists_live_kernels_and_not_a_killed_one(kernels, runtime):
    first, second, third = kernels(), kernels(), kernels()
    os.kill(third.pid, signal.SIGKILL)  # no atexit: the discovery file stays
    deadline = time.monotonic() + 10
    while discovery.is_alive({"pid": third.pid}) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not discovery.is_alive({"pid": third.pid}), "a killed, unreaped kernel (zombie) counts as dead"
    third_file = discovery.path_for_pid(third.pid, runtime)
    assert third_file.exists()

    result = cli("ps")
    assert result.returncode == 0, result.stderr
    pids = [line.split()[0] for line in result.stdout.splitlines()[1:]]
    assert sorted(pids) == sorted([str(first.pid), str(second.pid)])
    assert first.id in result.stdout and second.id in result.stdout
    assert not third_file.exists()

    result = cli("status", first.id[:13], "--json")
    assert result.returncode == 0, result.stderr
    reply = json.loads(result.stdout)
    assert reply["kernel"]["kernel_id"] == first.id
    assert reply["kernel"]["pid"] == first.pid
    assert reply["state"]["state"] == "idle"


def test_status_answers_while_a_cell_is_busy(kernels, hold_gil_library):
    k = kernels()
    target = k.target()
    k.execute("x = 1")
    wait_for_state(target, "idle")
    report("real kernel, idle", latencies(target, 100, "idle"))

    # Pure Python: the interpreter lock changes hands every 5 ms.
    msg_id = k.kc.execute("while True:\n    pass")
    assert wait_for_state(target, "running")["state"]["state"] == "running"
    report("real kernel, cell in a pure-Python busy loop", latencies(target, 100, "running"))
    result = cli("status", str(k.pid), "--json", "--timeout", "2")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["state"]["state"] == "running"
    k.km.interrupt_kernel()
    assert "KeyboardInterrupt" in k.collect(msg_id)

    # A C call that keeps the interpreter lock for its whole length.
    code = textwrap.dedent(
        f"""
        import ctypes
        ctypes.PyDLL({str(hold_gil_library)!r}).hold_gil_ms(ctypes.c_long(60000))
        """
    )
    msg_id = k.kc.execute(code)
    reply = wait_for_state(target, "running")
    assert reply["state"]["state"] == "running"
    report("real kernel, cell in a C call holding the GIL", latencies(target, 100, "running"))
    result = cli("status", str(k.pid), "--timeout", "2")
    assert result.returncode == 0, result.stderr
    assert "state      running cell" in result.stdout
    k.km.interrupt_kernel()  # nanosleep returns on SIGINT; Python then raises KeyboardInterrupt
    assert "KeyboardInterrupt" in k.collect(msg_id)


def test_unload_removes_the_discovery_file(kernels, runtime):
    k = kernels()
    path = discovery.path_for_pid(k.pid, runtime)
    info = json.loads(path.read_text())
    k.execute("%unload_ext gpucleanup")
    assert not path.exists()
    assert not Path(info["key_file"]).exists()
    result = cli("ps")
    assert result.returncode == 1
    assert "no kernel with gpucleanup is running" in result.stderr


def test_kernel_exit_removes_the_discovery_file(kernels, runtime):
    k = kernels()
    path = discovery.path_for_pid(k.pid, runtime)
    assert path.exists()
    k.km.shutdown_kernel(now=False)
    assert not path.exists()


# ------------------------------------------------------------------ python -m, colour, tables


def test_python_dash_m_gpucleanup_is_the_command(kernel):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "ipython_ext"), env.get("PYTHONPATH")]))
    result = subprocess.run([sys.executable, "-m", "gpucleanup", "ps", "--json"], capture_output=True, text=True,
                            env=env, timeout=30)
    assert result.returncode == 0, result.stderr
    (entry,) = json.loads(result.stdout)
    assert entry["pid"] == os.getpid()
    assert entry["status"]["state"]["cell"] == 12


def _ps_on_a_terminal(extra_env: dict) -> str:
    """``gpucleanup ps`` with its stdout on a pseudo-terminal; what it wrote."""
    import pty

    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "ipython_ext"), env.get("PYTHONPATH")]))
    env.pop("NO_COLOR", None)
    env["TERM"] = "xterm-256color"
    env.update(extra_env)
    leader, follower = pty.openpty()
    try:
        proc = subprocess.Popen([sys.executable, "-m", "gpucleanup", "ps"], stdout=follower, stderr=subprocess.PIPE,
                                env=env)
        os.close(follower)
        follower = -1
        chunks = []
        while True:
            try:
                data = os.read(leader, 65536)
            except OSError:  # EIO: the child closed the terminal
                break
            if not data:
                break
            chunks.append(data)
        assert proc.wait(timeout=30) == 0, proc.stderr.read()
        proc.stderr.close()
    finally:
        os.close(leader)
        if follower >= 0:
            os.close(follower)
    return b"".join(chunks).decode()


def test_ps_colours_the_state_on_a_terminal_only(kernel):
    coloured = _ps_on_a_terminal({})
    assert "\033[33mrunning cell 12 for " in coloured  # running: yellow
    plain = cli("ps").stdout  # a pipe: no colour
    assert "\033[" not in plain
    assert "\033[" not in _ps_on_a_terminal({"NO_COLOR": "1"})
    assert "\033[" not in _ps_on_a_terminal({"TERM": "dumb"})


def test_colour_keeps_the_columns_aligned(kernel):
    stripped = re.sub(r"\033\[[0-9;]*m", "", _ps_on_a_terminal({})).replace("\r\n", "\n")
    header, row = stripped.splitlines()
    assert row.index("running cell 12") == header.index("STATE")
    assert row.index("GPU0 live") == header.index("GPU MEMORY")
    assert row.index("cell 11 freed") == header.index("LAST CELL")


@pytest.mark.parametrize(
    "state, colour",
    [("idle for 3 s", "green"), ("running cell 4 for 2 s", "yellow"), ("waiting for GPU1 for 8 s", "magenta"),
     ("draining cell 4", "magenta"), ("no answer", "red"), ("refused: bad signature", "red"),
     ("elsewhere (another PID namespace)", "dim"), ("unknown", None)],
)
def test_state_colours(state, colour):
    assert gpucleanup_cli.state_colour(state) == colour


def test_colour_wanted_follows_no_color_and_term(monkeypatch):
    class Tty:
        def isatty(self):
            return True

    monkeypatch.delenv("NO_COLOR", raising=False)
    monkeypatch.setenv("TERM", "xterm")
    assert gpucleanup_cli.colour_wanted(Tty()) is True
    monkeypatch.setenv("NO_COLOR", "1")
    assert gpucleanup_cli.colour_wanted(Tty()) is False
    monkeypatch.setenv("NO_COLOR", "")  # no-color.org: only a non-empty value turns colour off
    assert gpucleanup_cli.colour_wanted(Tty()) is True
    monkeypatch.setenv("TERM", "dumb")
    assert gpucleanup_cli.colour_wanted(Tty()) is False


def test_exporter_port_out_of_range_is_a_usage_error(runtime):
    result = cli("exporter", "--port", "70000")
    assert result.returncode == 2
    assert "must be a port number from 0 (any free port) to 65535, got '70000'" in result.stderr


@pytest.mark.parametrize("stop, ignored", [(signal.SIGINT, False), (signal.SIGINT, True), (signal.SIGTERM, False)],
                         ids=["ctrl-c", "ctrl-c-started-with-&", "sigterm"])
def test_exporter_serves_metrics_until_interrupted(kernel, stop, ignored):
    # started with & from a script, a process gets SIGINT ignored (the shell's doing): it must still stop on it
    import pwd
    import urllib.request

    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "ipython_ext"), env.get("PYTHONPATH")]))
    proc = subprocess.Popen([sys.executable, "-m", "gpucleanup", "exporter", "--port", "0", "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            preexec_fn=(lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if ignored else None)
    try:
        where = json.loads(proc.stdout.readline())
        assert where["host"] == "127.0.0.1" and where["port"] > 0
        assert where["url"] == f"http://127.0.0.1:{where['port']}/metrics"
        token = open(where["token_file"]).read().strip()
        request = urllib.request.Request(where["url"], headers={"Authorization": f"Bearer {token}"})
        body = urllib.request.urlopen(request, timeout=30).read().decode()
        user = pwd.getpwuid(os.getuid()).pw_name
        assert (f'gpucleanup_kernel_up{{kernel_id="",notebook="/home/me/fit.ipynb",pid="{os.getpid()}",'
                f'user="{user}"}} 1.0') in body
        assert "gpucleanup_kernels 1.0" in body
        proc.send_signal(stop)
        assert proc.wait(timeout=30) == 0  # its normal way to stop, as watch's (the exit table says so)
        assert proc.stderr.read() == ""
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        proc.stderr.close()


def test_exporter_on_a_port_in_use_cannot_run_here(runtime):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        result = cli("exporter", "--port", str(taken.getsockname()[1]))
    assert result.returncode == 7  # before: 2, the usage code, though the command line was right
    assert "the port is in use by another program; choose another port with --port" in result.stderr


def test_exporter_without_prometheus_client_cannot_run_here(runtime, monkeypatch, capsys):
    from gpucleanup.outside import cli as cli_module

    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    monkeypatch.setitem(sys.modules, "prometheus_client.core", None)
    # before: 2, the usage code, though the command line was right
    assert cli_module.main(["exporter", "--port", "0", "--runtime-dir", str(runtime)]) == cli_module.EXIT_CANNOT_RUN == 7
    out = capsys.readouterr()
    assert out.out == ""
    assert out.err.startswith("gpucleanup: ") and "pip install 'gpucleanup[server]'" in out.err


def test_a_drain_of_a_stopped_kernel_says_so_within_timeout_not_timeout_plus_the_drains(runtime, fake_cuda):
    # before: --timeout 0.5 with the drain's 10 s waited 10.5 s, and said so
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "ipython_ext"), env.get("PYTHONPATH")]))
    stopped = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import sys, types
        from gpucleanup.in_kernel.status_endpoint import StatusEndpoint
        ep = StatusEndpoint()
        ep.start(types.SimpleNamespace(user_ns={}))
        assert ep.error is None, ep.error
        print("ready", flush=True)
        sys.stdin.read()
    """)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert stopped.stdout.readline() == "ready\n"
        os.kill(stopped.pid, signal.SIGSTOP)
        result = cli("drain", str(stopped.pid), "--timeout", "0.5", "--drain-timeout", "60", timeout=120)
        assert result.returncode == 3
        assert f"kernel {stopped.pid} did not answer within 0.5 s" in result.stderr, result.stderr
    finally:
        os.kill(stopped.pid, signal.SIGCONT)
        stopped.stdin.close()
        stopped.wait(timeout=60)
