"""Parking as the culling policy: gpucleanup's park (``GPUCleanupServer.park_idle_after_s``) beside Jupyter Server's
own culling (``MappingKernelManager.cull_idle_timeout``), against a real ``jupyter server`` with short times.

- A park and a resume made from outside (the server's automatic park, ``gpucleanup resume``) go through the kernel's
  status endpoint, never through Jupyter's channels: the kernel's ``last_activity``, the clock the culler reads, and
  the server's own (``/api/status``, what JupyterHub's activity reports and jupyterhub-idle-culler read) stay as the
  last cell left them.
- A parked kernel that the culler ends is resumed before it exits and ends by itself, as a shutdown does: its
  process gone (and with it the host memory the park filled), its discovery file, key, park lock and socket removed.

The kernels run on the fake CUDA driver, whose checkpoint state is a record per process in
GPUCLEANUP_FAKE_CUDA_CHECKPOINT_DIR (tests/fake_cuda/checkpoint_state.cpp): the fake keeps no copy of device memory
anywhere, so what stands for "the host memory is back" here is the process being gone (on a real driver the parked
copy is in the kernel process's own memory). No GPU test of culling exists yet.
"""

from __future__ import annotations

import fcntl
import json
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import pytest

from conftest import BUILD, FAKE_CUDA

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import server_harness  # noqa: E402  (tests/server_harness.py)

pytest.importorskip("jupyter_server")
pytest.importorskip("jupyter_client")
pytest.importorskip("ipykernel")

from gpucleanup.park import kernel_side as parking  # noqa: E402
from gpucleanup.protocol import discovery  # noqa: E402
import support  # noqa: E402
from support import wait_until  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
LIBRARY = BUILD / "native" / "libgpucleanup.so"
TIMEOUT = 60
SCENARIO = {"devices": [{"name": "Fake H100", "primary_active": True,
                         "default_pool": {"reserved_bytes": 1 << 30, "used_bytes": 0}}]}
#: the query that keeps a request of the test's own out of the server's activity (jupyter_server's APIHandler)
QUIET = "no_track_activity=1"


class Server(server_harness.Server):
    """A real jupyter server whose kernels run on the fake driver with a checkpoint directory, parking kernels
    idle ``park_after_s`` and culling kernels idle ``cull_after_s`` (checked every second)."""

    def __init__(self, base: Path, park_after_s: float, cull_after_s: int, *args: str):
        self.checkpoints = base.parent / f"{base.name}-checkpoints"
        self.checkpoints.mkdir()
        env = {"GPUCLEANUP_LIBRARY": str(LIBRARY), "GPUCLEANUP_LIBCUDA": str(FAKE_CUDA),
               "GPUCLEANUP_FAKE_CUDA_SCENARIO": json.dumps(SCENARIO),
               "GPUCLEANUP_FAKE_CUDA_CHECKPOINT_DIR": str(self.checkpoints)}
        super().__init__(base, f"--GPUCleanupServer.park_idle_after_s={park_after_s}",
                         f"--MappingKernelManager.cull_idle_timeout={cull_after_s}",
                         "--MappingKernelManager.cull_interval=1", *args, extra_env=env, status_timeout=1.0)

    def kernel_model(self, kernel_id: str) -> Optional[dict]:
        """Jupyter's own model of the kernel (``last_activity``, ``execution_state``), None once it is gone; read
        without counting as activity."""
        response = self.request("GET", f"/api/kernels/{kernel_id}?{QUIET}", token=True)
        if response.status == 404:
            return None
        assert response.status == 200, (response.status, response.body)
        return response.json()

    def last_activity(self) -> str:
        """The server's own last activity (``/api/status``, which is never counted as activity itself)."""
        return self.api("GET", "/api/status")["last_activity"]

    def driver_record(self, pid: int) -> dict:
        return json.loads((self.checkpoints / f"{pid}.json").read_text())


def settled(srv: Server, nb: server_harness.Notebook) -> dict:
    """Jupyter's model of the kernel once its last cell's messages have all been seen (the same
    ``last_activity`` twice, half a second apart, the kernel idle)."""
    deadline = time.monotonic() + TIMEOUT
    while True:
        first = srv.kernel_model(nb.kernel_id)
        time.sleep(0.5)
        again = srv.kernel_model(nb.kernel_id)
        if first == again and again["execution_state"] == "idle":
            return again
        assert time.monotonic() < deadline, f"the kernel's activity never settled: {again}"


def kernel_files(nb: server_harness.Notebook) -> dict:
    """Every file the kernel's gpucleanup made: its discovery file, key, park lock and status socket."""
    found = nb.discovery()
    files = {"discovery file": found.path, "key": Path(found.key_file),
             "park lock": parking.lock_path(found.key_file, found.pid)}
    if found.endpoint.startswith("ipc://"):
        files["status socket"] = Path(found.endpoint[len("ipc://"):])
    return files


def cli(srv: Server, *args: str) -> subprocess.CompletedProcess:
    env = support.package_env(JUPYTER_RUNTIME_DIR=str(srv.runtime), GPUCLEANUP_LIBRARY=str(LIBRARY),
                              GPUCLEANUP_LIBCUDA=str(FAKE_CUDA),
                              GPUCLEANUP_FAKE_CUDA_CHECKPOINT_DIR=str(srv.checkpoints))
    return support.cli(*args, env=env, timeout=120)


@pytest.mark.parametrize("policy", ["server", "kernel"])
def test_a_park_and_a_resume_from_outside_leave_the_culling_clocks_alone(tmp_path, policy):
    """``server``: GPUCleanupServer.park_idle_after_s parks the kernel; ``kernel``: its own
    GPUCleanup.park_after_idle_s does. Then ``gpucleanup resume``, and the next cell says what happened."""
    # parked after 10 s idle: the steps between the resume and the next cell (a few requests) must come within one
    # idle period, or a second park comes between them and the cell says its own resume (a completion's test saw
    # a 3 s period pass on a loaded 2-core machine)
    srv = Server(tmp_path / "srv", 10 if policy == "server" else 0, 3600)
    nb = None
    try:
        nb = server_harness.Notebook(srv, "parked.ipynb")
        nb.load_gpucleanup()
        if policy == "kernel":
            assert nb.run("%config GPUCleanup.park_after_idle_s = 10") == ""
        pid = nb.discovery().pid
        before = settled(srv, nb)
        server_before = srv.last_activity()

        wait_until(lambda: nb.status()["state"]["state"] == "parked", f"the {policy}'s automatic park")
        assert srv.driver_record(pid)["state"] == "checkpointed"
        parked = srv.kernel_model(nb.kernel_id)
        assert (parked["last_activity"], parked["execution_state"]) == (before["last_activity"], "idle")
        assert srv.last_activity() == server_before

        resumed = cli(srv, "resume", str(pid))
        assert resumed.returncode == 0, resumed.stderr
        assert srv.driver_record(pid)["state"] == "running"
        after = srv.kernel_model(nb.kernel_id)
        assert (after["last_activity"], after["execution_state"]) == (before["last_activity"], "idle")
        assert srv.last_activity() == server_before

        # the user comes back: the next cell is activity, as any cell is, and says the park it missed, once
        out = nb.run("print('back')")
        first, printed = out.splitlines()
        assert first.startswith("gpucleanup · resumed its GPU memory from host memory in ") and " (parked " in first
        assert first.endswith(" before this cell, from outside the kernel (gpucleanup resume or the page)"), out
        assert printed == "back"
        assert settled(srv, nb)["last_activity"] > before["last_activity"]
        assert nb.run("print('again')") == "again\n"
    finally:
        if nb is not None:
            nb.close()
        srv.stop()


def test_a_completion_asked_of_a_parked_kernel_resumes_it_and_the_next_cell_says_so(tmp_path):
    """Opening the notebook again and pressing Tab: the completion resumes the kernel first (it has no cell to
    say it under), is activity as any request is, and the next cell says the park. The policy waits 10 s: the
    completion and the cell after it must both come within one idle period, or a second park would come between
    them (seen at 3 s on a loaded 2-core machine) and the cell would say its own resume."""
    srv = Server(tmp_path / "srv", 10, 3600)
    nb = None
    try:
        nb = server_harness.Notebook(srv, "tab.ipynb")
        nb.load_gpucleanup()
        assert nb.run("value = 6 * 7") == ""
        pid = nb.discovery().pid
        before = settled(srv, nb)
        wait_until(lambda: nb.status()["state"]["state"] == "parked", "the server's automatic park")
        assert srv.kernel_model(nb.kernel_id)["last_activity"] == before["last_activity"]
        reply = nb.kc.complete("val", 3, reply=True, timeout=TIMEOUT)
        assert reply["content"]["status"] == "ok" and "value" in reply["content"]["matches"], reply["content"]
        assert srv.driver_record(pid)["state"] == "running"
        # a completion is a request like any other for Jupyter's culling clock: activity
        wait_until(lambda: srv.kernel_model(nb.kernel_id)["last_activity"] > before["last_activity"],
                   "the completion counted as activity")
        out = nb.run("print(value)")
        first, printed = out.splitlines()
        assert first.startswith("gpucleanup · resumed its GPU memory from host memory in ") and " (parked " in first
        assert first.endswith(" before this cell, for a completion"), out
        assert printed == "42"
    finally:
        if nb is not None:
            nb.close()
        srv.stop()


CULLED = re.compile(r"Culling 'idle' kernel '\w+' \((?P<id>[0-9a-f-]+)\) with (?P<connections>\d+) connections "
                    r"due to (?P<idle>\d+) seconds of inactivity")


def test_a_parked_kernel_is_culled_on_its_last_cells_clock_and_leaves_nothing_behind(tmp_path):
    cull_after_s = 12
    srv = Server(tmp_path / "srv", 1, cull_after_s)
    nb = None
    try:
        nb = server_harness.Notebook(srv, "left-open.ipynb")
        nb.load_gpucleanup()
        found = nb.discovery()
        pid = found.pid
        files = kernel_files(nb)
        before = settled(srv, nb)

        wait_until(lambda: nb.status()["state"]["state"] == "parked", "the server's automatic park")
        assert srv.driver_record(pid)["state"] == "checkpointed"
        assert all(path.exists() for path in files.values()), files  # the park lock too, written by the park
        assert srv.kernel_model(nb.kernel_id)["last_activity"] == before["last_activity"]
        nb.close()
        nb = None

        wait_until(lambda: srv.kernel_model(found.kernel_id) is None, "the culler ends the parked kernel")
        culled = [m for m in CULLED.finditer(srv.log()) if m["id"] == found.kernel_id]
        assert len(culled) == 1, srv.log()
        assert int(culled[0]["idle"]) >= cull_after_s
        # gone: no process, or one that exited and waits to be reaped (a zombie), as discovery.is_alive counts it
        wait_until(lambda: not discovery.is_alive(found.info), "the culled kernel's process is gone", 30)

        # Resumed before it exited (its frameworks' frees at exit would wait for a restore), then ended by itself:
        # the park lock goes with the other files, at a clean exit or by the SIGTERM handler.
        record = srv.driver_record(pid)
        assert record["state"] == "running", record
        assert record["calls"].get("cuCheckpointProcessRestore") == 1, record
        left = {name: str(path) for name, path in files.items() if path.exists()}
        assert left == {}, f"the culled kernel left {left} behind\n{srv.log()}"
    finally:
        if nb is not None:
            nb.close()
        srv.stop()


def test_a_parked_kernel_whose_resume_at_exit_outlasts_the_shutdown_wait_leaves_no_files(tmp_path):
    srv = Server(tmp_path / "srv", 1, 8, "--KernelManager.shutdown_wait_time=2")
    nb = None
    pid = None
    try:
        nb = server_harness.Notebook(srv, "big.ipynb")
        nb.load_gpucleanup()
        found = nb.discovery()
        pid = found.pid
        files = kernel_files(nb)
        wait_until(lambda: nb.status()["state"]["state"] == "parked", "the server's automatic park")
        hang_restore(srv, pid, True)  # a restore longer than the shutdown's wait: SIGTERM comes during it
        nb.close()
        nb = None
        wait_until(lambda: srv.kernel_model(found.kernel_id) is None, "the culler ends the parked kernel")
        # gone: no process, or one that exited and waits to be reaped (a zombie), as discovery.is_alive counts it
        wait_until(lambda: not discovery.is_alive(found.info), "the culled kernel's process is gone", 30)
        left = {name: str(path) for name, path in files.items() if path.exists()}
        assert left == {}, f"the culled kernel left {left} behind"
    finally:
        if pid is not None:
            hang_restore(srv, pid, False)  # the orphaned helper's restore ends
        if nb is not None:
            nb.close()
        srv.stop()


def hang_restore(srv: Server, pid: int, hang: bool) -> None:
    path = srv.checkpoints / f"{pid}.json"
    with open(path, "r+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        record = json.loads(fh.read())
        record["hang"] = ["cuCheckpointProcessRestore"] if hang else []
        fh.seek(0)
        fh.truncate()
        fh.write(json.dumps(record))


def test_the_readmes_recipe_is_taken_by_a_real_server_as_meant(tmp_path):
    recipe = ROOT / "share" / "jupyter-config" / "park-then-cull.py"
    from jupyter_server.services.kernels.kernelmanager import ServerKernelManager
    from traitlets.config.loader import PyFileConfigLoader

    config = PyFileConfigLoader(recipe.name, path=str(recipe.parent)).load_config()
    assert ServerKernelManager(config=config).shutdown_wait_time == 60.0
    srv = server_harness.Server(tmp_path / "srv", f"--config={recipe}",
                                extra_env={"GPUCLEANUP_LIBRARY": str(LIBRARY), "GPUCLEANUP_LIBCUDA": str(FAKE_CUDA)})
    try:
        nb = server_harness.Notebook(srv, "any.ipynb")  # the culler starts with the first kernel
        nb.close()
        wait_until(lambda: "Culling kernels with idle durations > 86400 seconds at 300 second intervals" in srv.log(),
                   "the culler's settings in the server's log")
        log = srv.log()
        assert "gpucleanup: kernels idle for 1800 s are parked (GPUCleanupServer.park_idle_after_s)" in log, log
        assert "Culling kernels even with connected clients" in log, log
    finally:
        srv.stop()


def test_the_pages_reads_leave_the_servers_activity_clock_alone_and_a_drain_moves_it(tmp_path):
    """An open /gpucleanup page refreshes every 2 s: its reads (the list, one kernel, the park check) must not keep
    an idle server alive for jupyterhub-idle-culler, which culls on /api/status's last_activity. An action, a
    drain asked from the page, is activity."""
    srv = Server(tmp_path / "srv", 0, 3600)
    nb = None
    try:
        nb = server_harness.Notebook(srv, "watched.ipynb")
        nb.load_gpucleanup()
        settled(srv, nb)
        before = srv.last_activity()
        time.sleep(0.05)  # a later request would stamp a later time
        listed = srv.api("GET", "/api/gpucleanup/kernels?sort=held&cards=")
        assert [k["kernel_id"] for k in listed["kernels"]] == [nb.kernel_id]
        assert srv.api("GET", f"/api/gpucleanup/kernels/{nb.kernel_id}")["kernel_id"] == nb.kernel_id
        assert "parkable" in srv.api("GET", f"/api/gpucleanup/kernels/{nb.kernel_id}/park-check")
        assert srv.last_activity() == before
        srv.api("POST", f"/api/gpucleanup/kernels/{nb.kernel_id}/drain", {"timeout_s": 5})
        assert srv.last_activity() > before
    finally:
        if nb is not None:
            nb.close()
        srv.stop()
