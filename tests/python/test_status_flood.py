"""A hostile neighbour floods the status port: the kernel keeps its descriptors and answers.

The kernel stand-in is a child process with RLIMIT_NOFILE lowered to 256 that runs the
real StatusEndpoint on tcp; this process opens far more connections to it than its cap
(plain TCP connections that never speak, and zmq DEALERs that finish the handshake and
then say nothing) and checks what the child can still do. No fixed sleeps: every wait
polls for a condition under a generous deadline.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import socket
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import pytest
import zmq

from gpucleanup.protocol import status_client
from gpucleanup.in_kernel.status_endpoint import StatusEndpoint

ROOT = Path(__file__).resolve().parents[2]
NOFILE = 256
DEADLINE_S = 30.0

# The kernel stand-in: lowers its descriptor limit, starts the endpoint on tcp, then
# answers one line per command on stdin.
CHILD = r"""
import json, logging, os, resource, sys, tempfile, types

soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
limit = LOWERED_LIMIT if hard == resource.RLIM_INFINITY else min(LOWERED_LIMIT, hard)
resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))

from gpucleanup import _native
from gpucleanup.in_kernel.status_endpoint import StatusEndpoint

warnings = []

class Keep(logging.Handler):
    def emit(self, record):
        if record.levelno >= logging.WARNING:
            warnings.append(record.getMessage())

logging.getLogger("gpucleanup").addHandler(Keep())
ep = StatusEndpoint(transport="tcp", max_peers=64, refusals_every_s=0)
ep.start(types.SimpleNamespace(user_ns={}))
ep.set_state({"state": "idle"})
print(json.dumps({"error": ep.error, "info": ep.info, "nofile": limit}), flush=True)
for line in sys.stdin:
    command = line.strip()
    if command == "files":
        try:
            files = [tempfile.TemporaryFile() for _ in range(50)]
            for f in files:
                f.write(b"x")
                f.close()
            print(json.dumps({"files": len(files)}), flush=True)
        except OSError as exc:
            print(json.dumps({"files": 0, "error": str(exc)}), flush=True)
    elif command == "cell":
        # a cell's start and end, as the extension reports them
        ep.set_state({"state": "running", "cell": 1})
        ep.set_state({"state": "idle"})
        print(json.dumps({"error": ep.error, "warnings": warnings,
                          "reader": hasattr(_native, "server_connections")}), flush=True)
    elif command == "quit":
        break
ep.close()
""".replace("LOWERED_LIMIT", str(NOFILE))


class Kernel:
    """The child process and its one-line-per-command channel."""

    def __init__(self, tmp_path: Path):
        env = dict(os.environ)
        env["JUPYTER_RUNTIME_DIR"] = str(tmp_path / "runtime")
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "ipython_ext"), env.get("PYTHONPATH", "")) if p)
        if env.get("GPUCLEANUP_LIBRARY"):
            env["GPUCLEANUP_LIBRARY"] = os.path.abspath(env["GPUCLEANUP_LIBRARY"])
        env.pop("JPY_SESSION_NAME", None)
        env.pop("GPUCLEANUP_STATUS_TRANSPORT", None)
        self._stderr = open(tmp_path / "kernel.stderr", "w+")
        self.proc = subprocess.Popen(
            [sys.executable, "-c", CHILD],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            text=True,
            env=env,
        )
        self._lines: "queue.Queue[str]" = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self._lines.put(line)

    def receive(self) -> dict:
        deadline = time.monotonic() + DEADLINE_S
        while True:
            try:
                return json.loads(self._lines.get(timeout=0.05))
            except queue.Empty:
                if self.proc.poll() is None and time.monotonic() < deadline:
                    continue
            self._stderr.seek(0)
            pytest.fail(f"the kernel stand-in did not answer; its stderr:\n{self._stderr.read()}")

    def ask(self, command: str) -> dict:
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self.receive()

    def descriptors(self) -> int:
        return len(os.listdir(f"/proc/{self.proc.pid}/fd"))

    def close(self) -> None:
        try:
            if self.proc.poll() is None:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.flush()
                self.proc.wait(DEADLINE_S)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()
        finally:
            self._stderr.close()


def _wait_for(condition, what: str):
    deadline = time.monotonic() + DEADLINE_S
    while True:
        value = condition()
        if value:
            return value
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.01)


def _port(endpoint: str) -> int:
    return int(endpoint.rsplit(":", 1)[1])


@pytest.fixture
def kernel(tmp_path):
    k = Kernel(tmp_path)
    yield k
    k.close()


def test_a_flood_of_connections_leaves_the_kernel_its_descriptors(kernel):
    started = kernel.receive()
    assert started["error"] is None, started["error"]
    info = started["info"]
    assert info["transport"] == "tcp"
    key = Path(info["key_file"]).read_bytes()
    target = status_client.Target(info["endpoint"], key)
    baseline = kernel.descriptors()

    # A first answer before the flood: the library has loaded what it loads.
    cap = status_client.request(target, "status", timeout=DEADLINE_S)["connections"]["max_peers"]
    # 64 asked for, an eighth of the lowered limit allowed
    assert cap == min(64, NOFILE // 8) == 32
    bound = baseline + 2 * cap + 16
    assert bound < NOFILE

    flood: list = []
    context = zmq.Context()
    try:
        for port, n in ((_port(info["endpoint"]), 4 * cap + 40), (_port(info["pub_endpoint"]), 2 * cap + 20)):
            flood.extend(socket.create_connection(("127.0.0.1", port)) for _ in range(n))
        quiet = []
        for _ in range(cap // 2):
            dealer = context.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.connect(info["endpoint"])  # finishes the handshake, then says nothing
            quiet.append(dealer)
        # more connections held than the kernel could have had descriptors for
        assert len(flood) + len(quiet) > NOFILE - baseline

        # The kernel's side shrinks to the cap (plus a fixed margin) while the flood holds on.
        _wait_for(lambda: kernel.descriptors() <= bound, f"the kernel's descriptors to drop to {bound}")

        # A legitimate, signed request is answered during the flood.
        def answered():
            try:
                return status_client.request(target, "status", timeout=2.0)
            except status_client.StatusTimeout:
                return None

        reply = _wait_for(answered, "an answer to a signed status request during the flood")
        assert reply["ok"] is True and reply["kind"] == "status"
        connections = reply["connections"]
        assert connections["max_peers"] == cap
        assert 1 <= connections["peers"] <= cap
        assert 0 <= connections["pub_peers"] <= cap
        assert connections["refused_connections"] >= 1

        # The kernel still opens files, and its cells' state changes go through.
        assert kernel.ask("files") == {"files": 50}
        cell = kernel.ask("cell")
        assert cell["error"] is None
        refusals = [w for w in cell["warnings"] if "refused" in w]
        # said once, when the library lets the endpoint read its counters
        assert len(refusals) == (1 if cell["reader"] else 0), cell
        assert kernel.ask("cell")["warnings"] == cell["warnings"]

        assert kernel.descriptors() <= bound
    finally:
        for s in flood:
            s.close()
        context.destroy(linger=0)


# ---- the endpoint's side, with a stand-in library ------------------------------------


class FakeNative:
    """Records server_start's config; server_connections counts what a flood would."""

    def __init__(self, refused):
        self.refused = list(refused)
        self.config = None
        self.reads = 0

    def server_start(self, config):
        self.config = config
        return {"endpoint": "tcp://127.0.0.1:5555", "pub_endpoint": "tcp://127.0.0.1:5556"}

    def server_set_state(self, state):
        pass

    def server_publish(self, record):
        pass

    def server_stop(self):
        pass

    def server_connections(self):
        self.reads += 1
        value = self.refused.pop(0) if len(self.refused) > 1 else self.refused[0]
        return {"max_peers": 7, "peers": 0, "pub_peers": 0, "refused_connections": value, "dropped_idle": 0}


@pytest.fixture
def runtime(tmp_path, monkeypatch):
    directory = tmp_path / "runtime"
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(directory))
    monkeypatch.delenv("JPY_SESSION_NAME", raising=False)
    return directory


def test_limits_reach_server_start_and_refusals_are_logged_once(runtime, caplog):
    native = FakeNative([0, 0, 3, 9, 12])
    ep = StatusEndpoint(transport="tcp", max_peers=7, peer_idle_timeout_s=2.5, native=native, refusals_every_s=0)
    ep.start(types.SimpleNamespace(user_ns={}))
    try:
        assert ep.error is None, ep.error
        assert native.config["max_peers"] == 7
        assert native.config["peer_idle_timeout_s"] == 2.5
        with caplog.at_level(logging.WARNING, logger="gpucleanup"):
            for _ in range(6):
                ep.set_state({"state": "idle"})
        refusals = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
        assert len(refusals) == 1
        assert "refused 3 connection(s)" in refusals[0] and "limit of 7" in refusals[0]
        assert ep.error is None
    finally:
        ep.close()


def test_endpoint_defaults_and_the_trait():
    from traitlets import TraitError

    from gpucleanup.in_kernel.config import GPUCleanupOptions

    ep = StatusEndpoint()
    assert (ep.max_peers, ep.peer_idle_timeout_s) == (64, 10.0)
    options = GPUCleanupOptions()
    assert options.status_max_peers == 64
    options.status_max_peers = 1024
    assert options.status_max_peers == 1024
    for bad in (0, 1025):
        with pytest.raises(TraitError):
            options.status_max_peers = bad


def test_the_refused_counter_is_read_at_most_every_few_seconds(runtime):
    # set_state runs twice per cell: the counter is not worth a native call each time
    native = FakeNative([0] * 50)
    ep = StatusEndpoint(transport="tcp", native=native)
    ep.start(types.SimpleNamespace(user_ns={}))
    try:
        for _ in range(20):
            ep.set_state({"state": "idle"})
        assert native.reads == 1
    finally:
        ep.close()
