"""Exit, fork and Ctrl-C around the after-cell cleanup, against the fake CUDA driver.

- A process exits while a drain waits for a synchronize that never returns: a plain
  Python process whose script ends while the status server's drain waits, and real
  kernels shut down by Jupyter (an interrupt, then a shutdown request) while their own
  cleanup or a ``gpucleanup drain`` waits. They exit cleanly and remove their files.
- A kernel terminated (SIGTERM) while its cleanup waits dies at once and removes its files in the signal
  handler; one killed (SIGKILL) leaves them behind: ``gpucleanup ps`` removes them and lists nothing.
- ``os.fork()`` in a cell: the child's cells work, the child makes no driver call (CUDA
  cannot be used in a forked child) and says so once, serves no status, and neither
  writes nor removes its parent's discovery file, key or sockets.
- Ctrl-C in every phase of the after-cell path: the cell's result and error stay the
  user's, one line says the cleanup was interrupted, the next cell's cleanup runs as
  usual and the status server says ``idle``.

No assertion here is about speed. Where a process must exit, it is given the settle
limit plus a generous margin: only a hang goes past it.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from conftest import BUILD, FAKE_CUDA
import gpucleanup
import gpucleanup.frameworks
import gpucleanup.in_kernel.status_endpoint
from gpucleanup.protocol import discovery
from gpucleanup.in_kernel import extension
from gpucleanup.protocol import status_client
from gpucleanup.engine.cell_pass import CellPass

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kernel_harness import Kernel, output  # noqa: E402  (tests/kernel_harness.py)
from support import GiB  # noqa: E402

jupyter_client = pytest.importorskip("jupyter_client")
pytest.importorskip("ipykernel")

ROOT = Path(__file__).resolve().parents[2]
LIBRARY = BUILD / "native" / "libgpucleanup.so"
SCENARIO = {"devices": [{"name": "Fake H100", "primary_active": True}]}

SETTLE_S = 30  # the settle limit of the kernels below
DRAIN_S = 60  # the longest drain the status server runs
# Generous on purpose: a process that needs longer than its wait's limit plus this hangs.
# It is a bound that catches a hang, never a measure of speed.
MARGIN_S = 20

# A cell's queued work that never finishes: the fake's synchronize hangs from now on.
HANG = ("import ctypes, os\n"
        "ctypes.CDLL(os.environ['GPUCLEANUP_LIBCUDA']).fake_cuda_update(b'{\"devices\": [{\"sync_seconds\": -1}]}')")


@pytest.fixture(scope="module", autouse=True)
def _built():
    if not LIBRARY.exists() or not FAKE_CUDA.exists():
        pytest.fail(f"build libgpucleanup and the fake driver first ({LIBRARY}, {FAKE_CUDA})")


def _env(runtime: Path, **extra: str) -> dict:
    env = dict(os.environ)
    for name in list(env):
        if name.startswith(("GPUCLEANUP_FAKE_CUDA", "JPY_")):
            env.pop(name)
    env.update(
        PYTHONPATH=str(ROOT / "ipython_ext"),
        GPUCLEANUP_LIBRARY=str(LIBRARY),
        GPUCLEANUP_LIBCUDA=str(FAKE_CUDA),
        GPUCLEANUP_FAKE_CUDA_SCENARIO=json.dumps(SCENARIO),
        JUPYTER_RUNTIME_DIR=str(runtime),
    )
    env.update(extra)
    return env


def _files(runtime: Path) -> list:
    """Every file in the runtime directory and its private directory, relative to it."""
    return sorted(str(p.relative_to(runtime)) for p in runtime.rglob("*") if not p.is_dir())


def _kernel_files(runtime: Path, pid: int) -> list:
    name = discovery.instance_of(discovery.path_for_pid(pid, runtime))  # <pid>-<random>: the kernel's instance
    return [f"gpucleanup-{name}.json", f"gpucleanup/{name}.key", f"gpucleanup/{name}.park", f"gpucleanup/{name}.sock",
            f"gpucleanup/{name}.sock.pub"]


def _target(runtime: Path, pid: int) -> status_client.Target:
    info = json.loads(discovery.path_for_pid(pid, runtime).read_text())
    return status_client.Target(info["endpoint"], Path(info["key_file"]).read_bytes())


def _until(condition, what: str, limit: float = 60.0):
    """Polls ``condition`` until it returns something true; fails after ``limit`` s (a hang, not a speed check)."""
    deadline = time.monotonic() + limit
    while True:
        value = condition()
        if value:
            return value
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.02)


@contextlib.contextmanager
def _killed_if_hung(proc: subprocess.Popen, limit: float = 120.0):
    """Kills ``proc`` if it is still there after ``limit`` s, so that a hang fails the test instead of
    blocking its reads; the process is gone when the block ends."""
    timer = threading.Timer(limit, proc.kill)
    timer.start()
    try:
        yield proc
    finally:
        timer.cancel()
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _cli(runtime: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpucleanup", *args], capture_output=True, text=True,
                          env=_env(runtime), timeout=60)


def _ask_drain(target: status_client.Target, answer: dict) -> threading.Thread:
    """``gpucleanup drain``'s request (signed, the longest limit), on a thread; its reply or error lands in ``answer``."""

    def ask():
        try:
            answer["reply"] = status_client.request(target, "drain", timeout=DRAIN_S + MARGIN_S, timeout_s=DRAIN_S)
        except status_client.StatusError as exc:
            answer["error"] = exc

    thread = threading.Thread(target=ask, name="drain-request")
    thread.start()
    return thread


def _assert_drain_stopped_early(answer: dict) -> None:
    """The process exited while the drain waited: the drain was told to stop, it did not run out its limit.

    Either the server stopped before the worker's answer was sent (error 416), or the
    answer went out first and shows the device abandoned as interrupted (share/protocol.md).
    """
    if "error" in answer:
        assert answer["error"].error_id == "gpucleanup.server.416", answer["error"]
    else:
        (device,) = answer["reply"]["devices"]
        assert device["settle"]["status"] == "interrupted", answer["reply"]


# ---------------------------------------------------------------- exit while a drain waits

EXIT_SCRIPT = textwrap.dedent(
    """
    import ctypes, os, sys, time
    from traitlets.config import Config
    from IPython.core.interactiveshell import InteractiveShell

    fake = ctypes.CDLL(os.environ["GPUCLEANUP_LIBCUDA"])
    fake.fake_cuda_counter.restype = ctypes.c_longlong
    config = Config()
    config.HistoryManager.enabled = False
    shell = InteractiveShell.instance(config=config)
    shell.run_line_magic("load_ext", "gpucleanup")
    fake.fake_cuda_update(b'{"devices": [{"sync_seconds": -1}]}')
    print("loaded", flush=True)
    deadline = time.monotonic() + 60
    while fake.fake_cuda_counter(b"syncs_in_flight") < 1:  # until the drain asked from outside waits
        if time.monotonic() > deadline:
            sys.exit("the drain never started waiting")
        time.sleep(0.01)
    print("waiting", flush=True)
    # the end of the script: the interpreter exits while the drain waits
    """
)


def test_script_ends_while_a_status_drain_waits_on_a_hanging_synchronize(runtime):
    proc = subprocess.Popen([sys.executable, "-c", EXIT_SCRIPT], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=_env(runtime))
    with _killed_if_hung(proc, DRAIN_S + 2 * MARGIN_S):
        assert proc.stdout.readline() == "loaded\n", proc.stderr.read()
        assert _files(runtime) == sorted(_kernel_files(runtime, proc.pid))
        answer: dict = {}
        asking = _ask_drain(_target(runtime, proc.pid), answer)
        assert proc.stdout.readline() == "waiting\n", proc.stderr.read()
        proc.wait(timeout=DRAIN_S + MARGIN_S)  # the drain's own limit plus the margin: only a hang exceeds it
        asking.join()
    stderr = proc.stderr.read()
    assert proc.returncode == 0, stderr  # not killed by a signal (SIGSEGV, SIGABRT): a clean exit
    assert "Traceback" not in stderr and "Error" not in stderr, stderr
    assert _files(runtime) == []  # discovery file, key and both sockets removed at exit
    _assert_drain_stopped_early(answer)


@pytest.fixture
def kernel(runtime):
    """Starts real ipykernels with gpucleanup loaded (tests/kernel_harness.py); each stopped at the end."""
    started = []

    def start() -> Kernel:
        # Jupyter interrupts, asks the kernel to shut down, then after half of shutdown_wait_time sends
        # SIGTERM: here only a kernel that hangs would get it.
        k = Kernel(_env(runtime), shutdown_wait_s=2 * (DRAIN_S + MARGIN_S))
        started.append(k)
        out = k.execute(f"%load_ext gpucleanup\n%config GPUCleanup.settle_timeout = {SETTLE_S}")
        assert out == "", out
        assert _files(runtime) == sorted(_kernel_files(runtime, k.pid) + [p.name for p in runtime.glob("kernel-*.json")])
        return k

    yield start
    for k in started:
        k.stop()


def _waiting_in_the_cells_cleanup(k: Kernel) -> str:
    """Starts a cell whose cleanup waits for queued work that never finishes; returns its msg_id once it waits."""
    msg_id = k.kc.execute(HANG)
    # "waiting" is said by the native wait's progress report: the cleanup is inside the wait
    _until(lambda: k.status()["state"]["state"] == "waiting", "the cell's cleanup waits")
    return msg_id


def _waiting_in_a_status_drain(k: Kernel, answer: dict) -> threading.Thread:
    """Between cells, a ``gpucleanup drain`` that waits for queued work that never finishes."""
    k.execute(HANG, silent=True)  # a silent request: no cleanup after it, the kernel stays idle
    assert k.status()["state"]["state"] == "idle"
    asking = _ask_drain(_target(k.runtime, k.pid), answer)
    _until(lambda: k.status()["server"]["drain_running"], "the drain runs")
    return asking


def _iopub(k: Kernel) -> list:
    """Every message the kernel published and the client has not read yet."""
    messages = []
    while True:
        try:
            messages.append(k.kc.get_iopub_msg(timeout=1))
        except queue.Empty:  # the kernel has exited: what it sent has arrived
            return messages


@pytest.mark.parametrize("waits", ["cell cleanup", "gpucleanup drain"])
def test_jupyter_shuts_the_kernel_down_while_a_drain_waits(kernel, runtime, waits):
    k = kernel()
    answer: dict = {}
    asking = None
    if waits == "cell cleanup":
        cell = _waiting_in_the_cells_cleanup(k)
    else:
        asking = _waiting_in_a_status_drain(k, answer)
    started = time.monotonic()
    # What Jupyter does to shut a kernel down: an interrupt, a shutdown request, and only after
    # half of shutdown_wait_time SIGTERM. The kernel exits on its own, well before that.
    k.km.shutdown_kernel(now=False)
    # bound: the wait's limit plus the margin; only a hang reaches it (the kernel would then get SIGTERM)
    assert time.monotonic() - started < (SETTLE_S if asking is None else DRAIN_S) + MARGIN_S
    assert k.process.wait(timeout=MARGIN_S) == 0  # exited by itself: no SIGTERM, SIGKILL, SIGSEGV or SIGABRT
    assert [f for f in _files(runtime) if "gpucleanup" in f] == []  # discovery file, key, sockets
    if asking is not None:
        asking.join()
        _assert_drain_stopped_early(answer)
    else:  # Jupyter's interrupt stopped the wait: the cell's line, sent before the kernel exited, says so
        outputs = [output(m["msg_type"], m["content"]) for m in _iopub(k) if m["parent_header"].get("msg_id") == cell]
        said = "".join(out.text for out in outputs if out is not None and out.kind == "gpucleanup")
        assert re.search(r"^gpucleanup · GPU0 .* · interrupted \(Ctrl-C\): cleanup stopped", said, re.MULTILINE), said


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_kernel_killed_while_its_cleanup_waits_is_cleaned_by_ps(kernel, runtime, sig):
    k = kernel()
    _waiting_in_the_cells_cleanup(k)
    left = _kernel_files(runtime, k.pid)
    assert set(left) <= set(_files(runtime))
    os.kill(k.pid, sig)  # Jupyter's last resort; no atexit runs, the files stay
    # the kernel dies of the signal at once, whatever the native wait does (no crash of its own)
    assert k.process.wait(timeout=MARGIN_S) == -sig
    if sig == signal.SIGTERM:
        # the native handler removed them before the default action ended the process
        assert not set(left) & set(_files(runtime)), _files(runtime)
    else:
        assert set(left) <= set(_files(runtime))

    listed = _cli(runtime, "ps")
    assert listed.returncode == 1, listed
    assert listed.stdout == ""
    assert "no kernel with gpucleanup is running" in listed.stderr
    assert not set(left) & set(_files(runtime))  # discovery file, key and both sockets removed
    as_json = _cli(runtime, "ps", "--json")
    assert as_json.returncode == 0, as_json
    assert json.loads(as_json.stdout) == []


# ---------------------------------------------------------------- fork

FORK_SCRIPT = textwrap.dedent(
    """
    import contextlib, ctypes, io, json, os, sys
    from traitlets.config import Config
    from IPython.core.interactiveshell import InteractiveShell

    fake = ctypes.CDLL(os.environ["GPUCLEANUP_LIBCUDA"])
    fake.fake_cuda_state_json.restype = ctypes.c_char_p

    def counters():
        return json.loads(fake.fake_cuda_state_json())["counters"]

    def cell(code):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            result = shell.run_cell(code)
        error = result.error_in_exec
        return {"out": out.getvalue(), "result": repr(result.result),
                "error": None if error is None else type(error).__name__}

    config = Config()
    config.HistoryManager.enabled = False  # its SQLite connection must not cross the fork
    shell = InteractiveShell.instance(config=config)
    shell.run_line_magic("load_ext", "gpucleanup")
    shell.user_ns.update(counters=counters)
    print(json.dumps({"loaded": os.getpid()}), flush=True)
    sys.stdin.readline()

    reading, writing = os.pipe()
    forked = cell("import os\\nbefore = counters()\\npid = os.fork()")
    if shell.user_ns["pid"] == 0:  # the child
        os.close(reading)
        report = {"pid": os.getpid(), "forking_cell": forked}
        report["cells"] = [cell(code) for code in (
            "x = 6 * 7", "x", "1 / 0",
            "__session__ = '/home/me/child.ipynb'",  # the child names a notebook: the parent's file stays
            "y = x + 1", "g = %gpumem --json")]
        g = shell.user_ns.get("g") or {}
        report["gpumem_driver"] = (g.get("driver") or {}).get("state")
        after, before = counters(), shell.user_ns["before"]
        report["driver_calls"] = {k: after[k] - before.get(k, 0) for k in after
                                  if k.startswith("calls.") or k in ("cuInit", "contexts_created")
                                  if after[k] != before.get(k, 0)}
        os.write(writing, json.dumps(report).encode())
        os.close(writing)
        sys.exit(0)  # a normal exit: the child's atexit handlers run
    os.close(writing)
    data = b""
    while True:
        chunk = os.read(reading, 1 << 16)
        if not chunk:
            break
        data += chunk
    _, status = os.waitpid(shell.user_ns["pid"], 0)
    after = cell("z = 1")
    print(json.dumps({"child": json.loads(data), "child_exit": os.waitstatus_to_exitcode(status),
                      "parent_forking_cell": forked, "parent_after": after}), flush=True)
    sys.stdin.readline()
    """
)


def test_fork_in_a_cell_child_cells_work_without_the_driver_and_leave_the_parents_files(runtime):
    proc = subprocess.Popen([sys.executable, "-c", FORK_SCRIPT], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=_env(runtime))
    with _killed_if_hung(proc):
        loaded = json.loads(proc.stdout.readline() or proc.stderr.read())
        parent = loaded["loaded"]
        ours = sorted(_kernel_files(runtime, parent))
        assert _files(runtime) == ours
        discovery_file = discovery.path_for_pid(parent, runtime)
        written = discovery_file.read_bytes()
        stat = discovery_file.stat()
        assert json.loads(written)["notebook"] is None

        proc.stdin.write("fork\n")
        proc.stdin.flush()
        line = proc.stdout.readline()
        assert line, proc.stderr.read()
        report = json.loads(line)
        child = report["child"]

        assert report["child_exit"] == 0
        assert child["pid"] != parent
        # the child's cells work: results and errors are the user's
        cells = child["cells"]
        assert [c["error"] for c in cells] == [None, None, "ZeroDivisionError", None, None, None]
        assert cells[1]["result"] == "42"
        assert not any("Error in callback" in c["out"] for c in [child["forking_cell"], *cells])
        # CUDA cannot be used in a forked child: not one driver call, and said once
        assert child["driver_calls"] == {}
        said = [ln for c in [child["forking_cell"], *cells] for ln in c["out"].splitlines() if ln.startswith("gpucleanup")]
        assert said == ["gpucleanup · the CUDA driver is unusable: [gpucleanup.driver.105] CUDA was initialised "
                        "before this process forked: CUDA cannot be used in a forked child"]
        assert child["gpumem_driver"] == "unusable"  # %gpumem answers, without the driver
        # the parent's own cells are unaffected
        assert report["parent_forking_cell"]["error"] is None and report["parent_after"]["error"] is None
        assert "unusable" not in report["parent_forking_cell"]["out"] + report["parent_after"]["out"]

        # the child served no status and left the parent's files exactly as they were
        assert _files(runtime) == ours
        assert discovery_file.read_bytes() == written
        assert discovery_file.stat().st_mtime_ns == stat.st_mtime_ns
        reply = status_client.request(_target(runtime, parent), "status", timeout=5)
        assert reply["kernel"]["pid"] == parent and reply["state"]["state"] == "idle"
        listed = _cli(runtime, "ps", "--json")
        assert listed.returncode == 0, listed
        (entry,) = json.loads(listed.stdout)
        assert entry["pid"] == parent and entry["status"]["state"]["state"] == "idle"

        proc.stdin.write("exit\n")
        proc.stdin.flush()
        proc.wait(timeout=MARGIN_S)
    stderr = proc.stderr.read()
    assert proc.returncode == 0, stderr
    assert "Traceback" not in stderr, stderr
    assert _files(runtime) == []  # the parent's own exit removes them


# ---------------------------------------------------------------- Ctrl-C in every phase of the after-cell path


class Scripted:
    """A framework adapter (the verbs of gpucleanup.frameworks) over scripted figures: it keeps
    ``live`` bytes on device 0, caches ``cached`` there and ``pinned`` bytes of pinned host memory."""

    name = "scripted"
    can_release = True

    def __init__(self):
        self.live = GiB
        self.cached = 0
        self.pinned = 0

    def in_use(self):
        return True

    def stats(self, devices):
        return {"devices": {i: {"live_bytes": self.live if i == 0 else 0, "cached_bytes": self.cached if i == 0 else 0}
                            for i in devices},
                "pinned": {"live_bytes": 0, "cached_bytes": self.pinned}, "notes": []}

    def drain(self, devices):
        freed, self.cached = (self.cached, 0) if 0 in devices else (0, self.cached)
        return {"freed_bytes": {0: freed} if freed else {}, "notes": []}

    def drain_pinned(self):
        freed, self.pinned = self.pinned, 0
        return {"freed_bytes": freed, "notes": []}

    def describe(self):
        return "scripted framework"


def ctrl_c() -> None:
    """Ctrl-C as a terminal sends it: SIGINT to the main thread, taken by the handler installed now.

    Sent by the main thread to itself, it is delivered before ``pthread_kill`` returns and
    its Python handler runs inside that call: the interrupt lands exactly here.
    """
    signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)


def _interrupt_once(monkeypatch, owner, name: str, when=lambda *a, **k: True) -> list:
    """Ctrl-C on the first call of ``owner.name`` that ``when`` accepts, as it starts; the hits are returned."""
    real = getattr(owner, name)
    hits: list = []

    def wrapper(*args, **kwargs):
        if not hits and when(*args, **kwargs):
            hits.append(name)
            ctrl_c()
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, wrapper)
    return hits


class _InterruptingStdout:
    """stdout that takes Ctrl-C as the first summary line is about to be written."""

    def __init__(self, stream, hits: list):
        self._stream = stream
        self._hits = hits

    def write(self, text):
        if not self._hits and text.startswith("gpucleanup · GPU0 "):
            self._hits.append("summary line")
            ctrl_c()
        return self._stream.write(text)

    def __getattr__(self, name):
        return getattr(self._stream, name)


def _state_is(name):
    return lambda state, *a, **k: isinstance(state, dict) and state.get("state") == name


# phase -> what Ctrl-C interrupts there: (where it lands, the line that says so)
STOPPED_ON_THE_DEVICE = "device"  # the record says the device's cleanup was interrupted
STOPPED_THE_HOOK = "hook"  # the hook stopped after the cleanup's steps: one line on its own
# the cleanup had ended (its line printed): the Ctrl-C is dropped as an idle kernel drops one
CAME_AFTER = "after"

PHASES = {
    # the native wait for queued work (Ctrl-C reaches Python at its progress report)
    "settle": (lambda ext, fw, mp: _interrupt_once(mp, CellPass, "_progress"), STOPPED_ON_THE_DEVICE),
    # said once the pass has found something to clean, in the device's steps: the device's line says it stopped
    "draining state": (lambda ext, fw, mp: _interrupt_once(mp, ext._endpoint, "set_state", _state_is("draining")),
                       STOPPED_ON_THE_DEVICE),
    "gc": (lambda ext, fw, mp: _interrupt_once(mp, CellPass, "collect_garbage"), STOPPED_ON_THE_DEVICE),
    "framework stats": (lambda ext, fw, mp: _interrupt_once(mp, ext.engine.frameworks, "stats"), STOPPED_ON_THE_DEVICE),
    "framework drain": (lambda ext, fw, mp: _interrupt_once(mp, fw, "drain"), STOPPED_ON_THE_DEVICE),
    "driver trim": (lambda ext, fw, mp: _interrupt_once(mp, CellPass, "trim_pools"), STOPPED_ON_THE_DEVICE),
    "snapshot": (lambda ext, fw, mp: _interrupt_once(mp, CellPass, "snapshot"), STOPPED_THE_HOOK),
    "pinned release": (lambda ext, fw, mp: _interrupt_once(mp, ext.engine.releases, "start_pinned"), STOPPED_THE_HOOK),
    # the cell pass's record step: what is outside every pool, per device (the figures since the last pass)
    "record": (lambda ext, fw, mp: _interrupt_once(mp, ext.engine.since, "outside_after"), STOPPED_THE_HOOK),
    "summary": (lambda ext, fw, mp: _interrupt_once(mp, CellPass, "outcome"), STOPPED_THE_HOOK),
    "publish": (lambda ext, fw, mp: _interrupt_once(mp, ext._endpoint, "publish"), STOPPED_THE_HOOK),
    "summary line": (None, STOPPED_THE_HOOK),
    # said as the hook ends, through the endpoint's call for a cell's own states
    "idle state": (lambda ext, fw, mp: _interrupt_once(mp, ext._endpoint, "cell_state", lambda state, *a: state == "idle"),
                   CAME_AFTER),
}


@pytest.fixture
def shell(runtime, fake_cuda, monkeypatch):
    """This process's InteractiveShell with gpucleanup loaded over the fake driver: the real native
    library and status endpoint, one scripted framework."""
    from IPython.core.interactiveshell import InteractiveShell

    fake_cuda.reset(SCENARIO)
    framework = Scripted()
    monkeypatch.setattr(gpucleanup.frameworks, "active", lambda: [framework])
    ip = InteractiveShell.instance()
    ip.config.pop("GPUCleanup", None)
    ip.run_line_magic("load_ext", "gpucleanup")
    ip.run_line_magic("config", "GPUCleanup.show = 'always'")
    ip.run_line_magic("config", f"GPUCleanup.settle_timeout = {SETTLE_S}")
    # every phase in the cell's own cleanup: the caches given back as it ends, not once idle ("rerun")
    ip.run_line_magic("config", "GPUCleanup.release = 'cell'")
    ip.framework = framework
    yield ip
    fake_cuda.release_sync()
    ip.extension_manager.unload_extension("gpucleanup")
    for name in ("x", "framework"):
        ip.user_ns.pop(name, None)
    del ip.framework
    ip.config.pop("GPUCleanup", None)


def _gpu0() -> str:
    """GPU0 as the lines name it. The native library keeps the first name it read for the process's
    life (a real GPU does not change its name): an earlier test in this process may have set it."""
    from gpucleanup import _native
    from gpucleanup.records import report

    return "GPU0 " + report.short_device_name(_native.snapshot()["devices"][0]["name"])


def _said(text: str) -> list:
    return [re.sub(r" · [0-9.]+ (ms|s)$", " · <t>", line) for line in text.splitlines() if line.startswith("gpucleanup")]


def _settled() -> None:
    """The hanging synchronize was let go: wait until the device is no longer busy."""
    from gpucleanup import _native

    _until(lambda: all(d["state"] != "busy" for d in _native.probe()["devices"]), "the device settles", 10)


@pytest.mark.parametrize("cell", ["value", "error"])
@pytest.mark.parametrize("phase", list(PHASES))
def test_ctrl_c_in_each_phase_of_the_cleanup(shell, fake_cuda, monkeypatch, capsys, phase, cell):
    ext = extension.get_extension(shell)
    install, stopped = PHASES[phase]
    if install is None:  # the summary line, as print writes it
        hits: list = []
        monkeypatch.setattr(sys, "stdout", _InterruptingStdout(sys.stdout, hits))
    else:
        hits = install(ext, shell.framework, monkeypatch)
    if phase == "settle":
        fake_cuda.update({"devices": [{"sync_seconds": -1}]})  # the cell's queued work never finishes
    shell.framework.cached = shell.framework.pinned = GiB
    handler = signal.getsignal(signal.SIGINT)
    code = "x = 6 * 7\nx" if cell == "value" else "raise ValueError('the users own')"

    try:
        result = shell.run_cell(code, store_history=True)
    except KeyboardInterrupt:  # pragma: no cover - what this test exists to catch
        pytest.fail(f"Ctrl-C in the {phase} phase escaped into the shell")
    out = capsys.readouterr()

    assert hits, f"the cleanup never reached its {phase} phase"
    # the user's cell: its result or its error, nothing of ours
    if cell == "value":
        assert result.error_in_exec is None and result.result == 42
    else:
        assert isinstance(result.error_in_exec, ValueError) and str(result.error_in_exec) == "the users own"
        assert sys.last_value is result.error_in_exec  # %debug and %tb still show the user's error
    assert "Error in callback" not in out.out and "KeyboardInterrupt" not in out.out + out.err
    said = _said(out.out)
    if stopped == STOPPED_ON_THE_DEVICE:  # one line, the device's, says the cleanup was interrupted
        assert said == [f"gpucleanup · {_gpu0()} · interrupted (Ctrl-C): cleanup stopped, nothing more freed · "
                        "device 0.5/80.0 GiB · <t>"], said
        assert ext.history.last()[-1]["interrupted"] is True
    elif stopped == STOPPED_THE_HOOK:  # one line of its own says so
        assert said == ["gpucleanup · interrupted (Ctrl-C): cleanup stopped"], said
    else:
        (line,) = said
        assert line.startswith(f"gpucleanup · {_gpu0()} · freed 1.0 GiB (scripted 1.0) · "), said
        assert ext.history.last()[-1]["interrupted"] is False
    assert signal.getsignal(signal.SIGINT) is handler  # the shell's own Ctrl-C handling is back

    if phase == "settle":
        fake_cuda.release_sync()
        _settled()
    job = ext.engine.releases.pinned_job  # a pinned release the cell started runs to its end on its thread
    assert job is None or job.done.wait(10)
    # nothing stays stuck: no lock held, the status server says idle, the next cell's cleanup runs as usual
    assert not ext.engine.releases.adapter_lock("scripted").locked()
    target = _target(Path(os.environ["JUPYTER_RUNTIME_DIR"]), os.getpid())
    assert status_client.request(target, "status", timeout=5)["state"]["state"] == "idle"
    shell.framework.cached = GiB
    after = shell.run_cell("6 * 7 + 1", store_history=True)
    out = capsys.readouterr()
    assert after.error_in_exec is None and after.result == 43
    (line,) = _said(out.out)
    assert line.startswith(f"gpucleanup · {_gpu0()} · freed 1.0 GiB (scripted 1.0) · ") and "interrupted" not in line
    record = ext.history.last()[-1]
    assert record["cell"] == after.execution_count and record["interrupted"] is False
    assert [(d["state"], d["freed_bytes"]) for d in record["devices"]] == [("drained", {"scripted": GiB})]
    assert status_client.request(target, "status", timeout=5)["state"]["state"] == "idle"
