"""The main job, as a newcomer runs it: scripts/demo.py's tour in a real Jupyter kernel on the fake CUDA driver,
then the same scripted device by hand (--shell: IPython; --server: Jupyter Server with gpucleanup's page).

Its output is the showcase: every cell with its output, gpucleanup's lines among them, and nothing from other
packages (ipykernel warns on its stderr when a kernel runs over TCP; the demo uses ipc sockets). Every mode
parks and resumes on the fake driver (a checkpoint directory of the demo's own) and leaves no temporary file.
"""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Callable

import pytest

from conftest import FAKE_CUDA

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "scripts" / "demo.py"
TIMEOUT = 60

pytest.importorskip("nbclient")


@pytest.fixture
def demo_env(tmp_path):
    """A newcomer's environment (no gpucleanup or Jupyter variables), with private Jupyter and IPython
    directories and a TMPDIR of its own, to show that the demo removes what it creates there."""
    if not FAKE_CUDA.exists():
        pytest.skip(f"the fake CUDA driver is not built ({FAKE_CUDA})")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GPUCLEANUP_", "JPY_", "JUPYTER_"))}
    for name in ("runtime", "ipython", "tmp"):
        (tmp_path / name).mkdir()
    env.update(JUPYTER_RUNTIME_DIR=str(tmp_path / "runtime"), IPYTHONDIR=str(tmp_path / "ipython"),
               TMPDIR=str(tmp_path / "tmp"))
    return env


def demo(*args: str) -> list:
    return [sys.executable, str(DEMO), *args, "--fake-driver", str(FAKE_CUDA)]


def leftovers(env: dict) -> list:
    return sorted(p.name for p in Path(env["TMPDIR"]).iterdir())


def test_the_tour_runs_in_a_kernel_and_shows_only_cells_and_gpucleanup(demo_env, tmp_path):
    done = subprocess.run(demo(), capture_output=True, text=True, timeout=300, env=demo_env, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("No GPU here: running the tour against the fake CUDA driver")
    assert lines[2].startswith("=== share/demo/tour.ipynb (real Jupyter kernel:")
    assert lines[3] == "" and lines[4].startswith("In [1]: ")
    assert any(line.startswith("gpucleanup · GPU0 Fake H100 (scripted) · freed ") for line in lines)
    assert "the kernel process's own stderr" not in done.stdout
    for noise in ("Warning", "WARNING", "without encryption", "Traceback"):
        assert noise not in done.stdout + done.stderr, noise
    assert leftovers(demo_env) == []


def test_the_tour_ends_with_a_park_and_the_next_cell_resuming(demo_env, tmp_path):
    done = subprocess.run(demo(), capture_output=True, text=True, timeout=300, env=demo_env, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    park = done.stdout[done.stdout.index("%gpumem --park"):]
    lines = park.splitlines()
    assert lines[1] == "gpucleanup · this kernel is parked as soon as this cell has ended"
    assert lines[2].startswith("gpucleanup · parked its GPU memory (context included) in host memory in ")
    assert lines[4].startswith("In [11]: x + 1  # the next cell brings the GPU memory back first")
    assert lines[5].startswith("gpucleanup · resumed its GPU memory from host memory in ")
    assert lines[6] == "42"
    assert "has not used the GPU" not in done.stdout
    assert "bash scripts/demo.sh --shell" in lines[-1] and "bash scripts/demo.sh --server" in lines[-1]


def test_the_shell_has_gpucleanup_loaded_on_the_scripted_device_and_parks(demo_env, tmp_path):
    lines = "%gpumem\nx = 41\n%gpumem --park\nx + 1\n%gpumem --plot\nexit\n"
    done = subprocess.run(demo("--shell"), input=lines, capture_output=True, text=True, timeout=TIMEOUT,
                          env=demo_env, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert out.startswith("An IPython shell with gpucleanup loaded, on the fake CUDA driver of the test suite")
    assert "GPU0 Fake H100 (scripted) — 14.5/79.6 GiB used" in out  # %gpumem before the first drain
    assert "gpucleanup · GPU0 Fake H100 (scripted) · freed 5.5 GiB (driver 5.5)" in out
    assert "gpucleanup · parked its GPU memory (context included) in host memory in " in out
    assert "gpucleanup · resumed its GPU memory from host memory in " in out
    assert "Out[4]: 42" in out
    assert "GPU0 Fake H100 (scripted) · 79.6 GiB total" in out  # the text plot
    assert "Traceback" not in out + done.stderr and "has not used the GPU" not in out
    assert leftovers(demo_env) == []


def test_an_unknown_argument_gets_the_usage_and_no_set_up(demo_env):
    done = subprocess.run(demo("--frobnicate"), capture_output=True, text=True, timeout=TIMEOUT, env=demo_env)
    assert done.returncode == 2
    assert done.stderr.splitlines()[-1] == "demo.py: error: unrecognized arguments: --frobnicate"
    assert "--shell" in done.stderr and "--server" in done.stderr
    # demo.sh says so before its set-up, which takes minutes on a fresh clone
    done = subprocess.run(["bash", str(ROOT / "scripts" / "demo.sh"), "--frobnicate"], capture_output=True,
                          text=True, timeout=TIMEOUT, env=demo_env)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == ("demo.sh: unknown argument '--frobnicate' "
                           "(usage: bash scripts/demo.sh [--shell | --server | --lab | NOTEBOOK.ipynb ...])\n")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def api(url: str, token: str, method: str = "GET", path: str = "/api/gpucleanup/kernels"):
    request = urllib.request.Request(url + path, method=method, data=b"{}" if method == "POST" else None,
                                     headers={"Authorization": f"token {token}"})
    with urllib.request.urlopen(request, timeout=TIMEOUT) as response:
        return response.status, json.loads(response.read())


def reader(proc: subprocess.Popen, seen: list) -> Callable[[str], str]:
    """``read_until(prefix)``: the demo's output line by line (each kept in ``seen``) until one starts with
    ``prefix``; fails when the demo ends first or no such line comes within the timeout."""
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout] + [lines.put(None)],
                     daemon=True).start()

    def read_until(prefix: str) -> str:
        deadline = time.monotonic() + TIMEOUT
        while True:
            line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            assert line is not None, "demo.py ended:\n" + "".join(seen)
            seen.append(line)
            if line.startswith(prefix):
                return line

    return read_until


def test_the_server_lists_its_kernel_parks_it_and_stops_everything_on_ctrl_c(demo_env, tmp_path):
    port = free_port()
    proc = subprocess.Popen(demo("--server", "--port", str(port)), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=demo_env, cwd=tmp_path)
    seen: list = []
    read_until = reader(proc, seen)

    pids: list = []
    try:
        page = read_until("  page:   ")
        match = re.search(r"(http://127\.0\.0\.1:(\d+))/gpucleanup\?token=([0-9a-f]+)", page)
        assert match and int(match[2]) == port, page
        url, token = match[1], match[3]
        assert "gpucleanup · GPU0 Fake H100 (scripted) · freed 5.5 GiB (driver 5.5)" in "".join(seen)
        read_until("Ctrl-C stops the server and its kernel.")

        status, listing = api(url, token)
        assert status == 200 and len(listing["kernels"]) == 1, listing
        kernel = listing["kernels"][0]
        assert kernel["server_kernel"] and kernel["gpucleanup"] and kernel["notebook"] == "tour.ipynb", kernel
        server_pid = json.loads(next(Path(demo_env["JUPYTER_RUNTIME_DIR"]).glob("jpserver-*.json")).read_text())["pid"]
        pids = [server_pid, kernel["pid"]]
        for pid in pids:  # every local user reads a process's arguments: the token is never among them
            assert token.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes(), pid
        with urllib.request.urlopen(f"{url}/gpucleanup?token={token}", timeout=TIMEOUT) as response:
            assert response.status == 200

        parked = api(url, token, "POST", f"/api/gpucleanup/kernels/{kernel['id']}/park")[1]
        assert parked["ok"] and parked["state"] == "checkpointed", parked
        resumed = api(url, token, "POST", f"/api/gpucleanup/kernels/{kernel['id']}/resume")[1]
        assert resumed["ok"] and resumed["state"] == "running", resumed

        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=TIMEOUT) == 0, "".join(seen)
        read_until("demo: Jupyter Server stopped (status 0)")
        deadline = time.monotonic() + TIMEOUT
        while any(alive(pid) for pid in pids):
            assert time.monotonic() < deadline, f"still running: {[pid for pid in pids if alive(pid)]}"
            time.sleep(0.05)
        assert leftovers(demo_env) == []
        assert "Traceback" not in "".join(seen) and "WARNING" not in "".join(seen)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in pids:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_the_lab_demo_serves_jupyterlab_with_gpucleanups_extension_on_the_kernels_notebook(demo_env, tmp_path):
    pytest.importorskip("jupyterlab")
    proc = subprocess.Popen(demo("--lab"), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=demo_env,
                            cwd=tmp_path)
    seen: list = []
    read_until = reader(proc, seen)

    try:
        lab = read_until("  lab:    ")
        match = re.search(r"(http://127\.0\.0\.1:\d+)/lab/tree/tour\.ipynb\?token=([0-9a-f]+) ", lab)
        assert match, lab
        read_until("Ctrl-C stops the server and its kernel.")
        with urllib.request.urlopen(match[0].strip(), timeout=TIMEOUT) as response:
            assert response.status == 200
            html = response.read().decode()
        config = json.loads(re.search(r'<script id="jupyter-config-data" type="application/json">(.*?)</script>',
                                      html, re.DOTALL)[1])
        assert "gpucleanup" in [ext["name"] for ext in config["federated_extensions"]]
        status, listing = api(match[1], match[2])
        assert status == 200 and [k["notebook"] for k in listing["kernels"]] == ["tour.ipynb"]
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=TIMEOUT) == 0, "".join(seen)
        assert leftovers(demo_env) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
