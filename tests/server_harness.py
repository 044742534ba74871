"""A real ``jupyter server`` with gpucleanup.server enabled, in private directories, and notebook sessions
started through its REST API as a browser starts them: what the server tests (tests/python/test_server*.py,
against the fake CUDA driver) and the GPU test (tests/gpu/test_server_gpu.py) drive.

The server runs as a subprocess with a random token, a private runtime directory and isolated Jupyter config
and data directories; its kernels inherit its environment. Cells run through jupyter_client on the kernel's
connection file in the runtime directory.
"""

from __future__ import annotations

import contextlib
import http.cookiejar
import json
import os
import secrets
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Callable, Optional

import pytest

from gpucleanup.protocol import discovery
from gpucleanup.outside import kernels
from gpucleanup.protocol import status_client

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT = 60


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Response:
    def __init__(self, status: int, headers, body: bytes):
        self.status = status
        self.headers = headers
        self.body = body

    def json(self):
        return json.loads(self.body)


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args, **kwargs):
        return None  # a redirect comes back as the response itself


class Server:
    """``python -m jupyter_server`` with gpucleanup.server enabled, in private directories under ``base``."""

    def __init__(self, base: Path, *args: str, enable: bool = True, extra_env: Optional[dict] = None,
                 status_timeout: float = 0.5):
        """``extra_env``: what the server and its kernels get besides the private directories (the CUDA driver
        and library to use); ``status_timeout``: the server's GPUCleanupServer.timeout."""
        self.token = secrets.token_hex(16)
        base.mkdir(parents=True, exist_ok=True)
        self.runtime = base / "runtime"
        self.root = base / "root"
        self.runtime.mkdir(mode=0o700)
        self.root.mkdir()
        for name in ("config", "data", "ipython"):
            (base / name).mkdir()
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {k: v for k, v in os.environ.items() if not k.startswith(("JPY_", "GPUCLEANUP_FAKE_CUDA", "JUPYTER_"))}
        env.update(
            PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT / "ipython_ext"), os.environ.get("PYTHONPATH")])),
            JUPYTER_RUNTIME_DIR=str(self.runtime),
            JUPYTER_CONFIG_DIR=str(base / "config"),
            JUPYTER_DATA_DIR=str(base / "data"),
            IPYTHONDIR=str(base / "ipython"),
        )
        env.update(extra_env or {})
        self.env = env  # what the server and its kernels run with (a CLI beside them needs the same)
        argv = [
            sys.executable, "-m", "jupyter_server", "--no-browser",
            f"--IdentityProvider.token={self.token}", "--ServerApp.ip=127.0.0.1", f"--port={self.port}",
            "--ServerApp.port_retries=0", f"--ServerApp.root_dir={self.root}",
            f"--GPUCleanupServer.timeout={status_timeout}",
            *args,
        ]
        if enable:
            # the package comes from PYTHONPATH here, not from an install that enables it
            argv.append("--ServerApp.jpserver_extensions=gpucleanup.server=True")
        if os.geteuid() == 0:
            argv.append("--allow-root")
        self.log_path = base / "server.log"
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(argv, env=env, stdout=self._log, stderr=subprocess.STDOUT, cwd=str(self.root))
        self.jar = http.cookiejar.CookieJar()
        self._opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(self.jar), _NoRedirect())
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + TIMEOUT
        while True:
            if self.proc.poll() is not None:
                pytest.fail(f"jupyter server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if self.request("GET", "/api/status", token=True).status == 200:
                    return
            except OSError:
                pass  # not listening yet
            if time.monotonic() > deadline:
                pytest.fail(f"jupyter server not ready within {TIMEOUT} s:\n{self.log()}")
            time.sleep(0.05)

    def request(self, method: str, path: str, body=None, token: bool = False, cookies: bool = False,
                headers: Optional[dict] = None) -> Response:
        """One request; ``token``: with the ``Authorization: token`` header; ``cookies``: with the cookies
        this client got (the login cookie and ``_xsrf`` after a visit of ``?token=``)."""
        data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data, method=method, headers=dict(headers or {}))
        if token:
            request.add_header("Authorization", f"token {self.token}")
        if data is not None:
            request.add_header("Content-Type", "application/json")
        opener = self._opener if cookies else urllib.request.build_opener(_NoRedirect())
        try:
            with opener.open(request, timeout=TIMEOUT) as response:
                return Response(response.status, response.headers, response.read())
        except urllib.error.HTTPError as error:
            return Response(error.code, error.headers, error.read())

    def api(self, method: str, path: str, body=None, expect: int = 200):
        response = self.request(method, path, body, token=True)
        assert response.status == expect, (response.status, response.body)
        return response.json() if response.body else None

    def cookie(self, name: str) -> Optional[str]:
        return next((c.value for c in self.jar if c.name == name), None)

    def kernels(self) -> list:
        return self.api("GET", "/api/gpucleanup/kernels")["kernels"]

    def entry(self, kernel_id: str) -> dict:
        return self.api("GET", f"/api/gpucleanup/kernels/{kernel_id}")

    def wait_for(self, kernel_id: str, condition: Callable[[dict], bool], what: str) -> dict:
        """The kernel's entry once ``condition`` holds for it (polled, at most TIMEOUT seconds)."""
        deadline = time.monotonic() + TIMEOUT
        while True:
            entry = self.entry(kernel_id)
            if condition(entry):
                return entry
            if time.monotonic() >= deadline:
                gpucleanup_lines = [line for line in self.log().splitlines() if "gpucleanup" in line]
                raise AssertionError(f"{what}: not within {TIMEOUT} s; the server's gpucleanup log lines:\n"
                                     + "\n".join(gpucleanup_lines[-40:]) + f"\nlast entry {entry}")
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(OSError):
                self.request("POST", "/api/shutdown", token=True)
            try:
                self.proc.wait(timeout=TIMEOUT)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


class Notebook:
    """A notebook session started through the server's REST API, and a jupyter_client client of its kernel."""

    def __init__(self, server: Server, path: str):
        from jupyter_client import BlockingKernelClient

        self.server = server
        self.path = path
        (server.root / path).parent.mkdir(parents=True, exist_ok=True)
        session = server.api("POST", "/api/sessions", {"path": path, "type": "notebook", "kernel": {"name": "python3"}},
                             expect=201)
        self.kernel_id = session["kernel"]["id"]
        self.kc = BlockingKernelClient(connection_file=str(server.runtime / f"kernel-{self.kernel_id}.json"))
        self.kc.load_connection_file()
        # No heartbeat: a client without a manager judges the kernel dead when its heartbeat has not beaten
        # yet, which a kernel still starting on a busy machine has not; the server watches the kernel.
        self.kc.start_channels(hb=False)
        self.kc.wait_for_ready(timeout=TIMEOUT)
        self.count = 0

    def start(self, code: str) -> str:
        return self.kc.execute(code)

    def collect(self, msg_id: str) -> str:
        """The cell's stream output and error, once the kernel is idle after it; what the cell displayed
        (display_data and execute_result bundles) goes to ``self.displayed``."""
        out = []
        self.displayed = []
        while True:
            msg = self.kc.get_iopub_msg(timeout=TIMEOUT)
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind == "stream":
                out.append(content["text"])
            elif kind == "display_data" and "gpucleanup" in content.get("metadata", {}):
                out.append(content["data"]["text/plain"] + "\n")  # gpucleanup's own output, after the cell's
            elif kind == "error":
                out.append(f"{content['ename']}: {content['evalue']}\n")
            elif kind in ("display_data", "execute_result"):
                self.displayed.append(content["data"])
            elif kind == "execute_input":
                self.count = content["execution_count"]
            elif kind == "status" and content["execution_state"] == "idle":
                return "".join(out)

    def run(self, code: str) -> str:
        return self.collect(self.start(code))

    def load_gpucleanup(self) -> None:
        out = self.run("%load_ext gpucleanup")
        assert "Error" not in out, out

    def discovery(self) -> discovery.Kernel:
        found = [k for k in discovery.scan(self.server.runtime).live if k.kernel_id == self.kernel_id]
        assert len(found) == 1, f"no discovery file of kernel {self.kernel_id}"
        return found[0]

    def status(self) -> dict:
        return status_client.request(kernels.target_of(self.discovery()), "status", timeout=TIMEOUT)

    def interrupt(self, msg_id: str) -> str:
        self.server.api("POST", f"/api/kernels/{self.kernel_id}/interrupt", expect=204)
        return self.collect(msg_id)

    def close(self) -> None:
        self.kc.stop_channels()


# ---------------------------------------------------------------- kernels without a kernel's weight

#: A process that is, to everything outside it, a kernel with gpucleanup: the kernel side's own StatusEndpoint
#: (libgpucleanup's status server, its discovery file and key) with a notebook name, a last cell's record and
#: a state, and nothing else (no IPython, no Jupyter kernel): what the page, the API and the parking see of a
#: kernel, at a fraction of a kernel's start-up. It runs until its stdin closes.
FAKE_KERNEL = r"""
import json, os, sys, time, types
from gpucleanup.in_kernel.status_endpoint import StatusEndpoint
spec = json.loads(sys.argv[1])
endpoint = StatusEndpoint()
endpoint.start(types.SimpleNamespace(user_ns={}))
if endpoint.error:
    print(json.dumps({"error": endpoint.error}), flush=True)
    sys.exit(1)
now = time.time_ns()
since = now - int(spec.get("idle_s", 0) * 1e9)
if spec.get("record"):
    record = dict(spec["record"], time_ns=since)
    endpoint.publish(record)
if spec.get("running_cell"):
    endpoint.set_state({"state": "running", "cell": spec["running_cell"], "since_ns": since})
else:
    endpoint.set_state({"state": "idle", "since_ns": since})
print(json.dumps({"pid": os.getpid(), "discovery": str(endpoint.discovery_path)}), flush=True)
sys.stdin.read()
endpoint.close()
"""


class FakeKernels:
    """Many kernels with gpucleanup as :data:`FAKE_KERNEL` processes in ``runtime`` (a server's runtime
    directory), started at once. ``specs``: per kernel ``{"notebook", "idle_s", "running_cell", "record"}``;
    ``env``: the library, the driver and its scenario (what a server's kernels would inherit)."""

    def __init__(self, runtime: Path, specs: list, env: dict):
        self.procs = []
        self.pids = []
        try:
            for spec in specs:
                kernel_env = {k: v for k, v in os.environ.items() if not k.startswith(("JPY_", "JUPYTER_"))}
                kernel_env.update(env)
                kernel_env["JUPYTER_RUNTIME_DIR"] = str(runtime)
                kernel_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "ipython_ext"),
                                                                         os.environ.get("PYTHONPATH")]))
                if spec.get("notebook"):
                    kernel_env["JPY_SESSION_NAME"] = spec["notebook"]
                self.procs.append(subprocess.Popen([sys.executable, "-c", FAKE_KERNEL, json.dumps(spec)],
                                                   env=kernel_env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                                   text=True))
            for proc in self.procs:
                line = proc.stdout.readline()
                said = json.loads(line) if line.strip() else {"error": f"exited with {proc.wait()}"}
                assert "pid" in said, f"a fake kernel did not start: {said}"
                self.pids.append(said["pid"])
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        for proc in self.procs:
            with contextlib.suppress(OSError):
                proc.stdin.close()
        for proc in self.procs:
            try:
                proc.wait(timeout=TIMEOUT)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            with contextlib.suppress(OSError):
                proc.stdout.close()
