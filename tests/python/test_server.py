"""The Jupyter Server extension (gpucleanup.server): its REST API against a real ``jupyter server``.

The server runs as a subprocess with a random token, a private runtime directory and isolated Jupyter
config and data directories; its kernels inherit its environment, which points libgpucleanup at the
fake CUDA driver. Notebook sessions are started through the server's REST API, as a browser does;
their cells run through jupyter_client on the kernel's connection file in the runtime directory. A
stand-in CuPy (tests/python/stand_ins) in the kernel gives the devices live memory to report.
"""

from __future__ import annotations

import json
import os
import shutil
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

from gpucleanup.protocol import discovery
from gpucleanup.outside import kernels
from gpucleanup.protocol import status_client  # noqa: E402
from support import GiB, MiB  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
LIBRARY = BUILD / "native" / "libgpucleanup.so"
TIMEOUT = 60
#: the server's GPUCleanupServer.timeout in these tests (it shows in the messages of kernels that do not answer);
#: a live kernel answers well within it on a loaded machine too, where a test reads one entry without asking again
STATUS_TIMEOUT = 2.0

SCENARIO = {"devices": [{"name": "Fake H100", "primary_active": True,
                         "default_pool": {"reserved_bytes": GiB, "used_bytes": 0}}]}


class Server(server_harness.Server):
    """The harness's server, its kernels on the fake CUDA driver."""

    def __init__(self, base: Path, *args: str, enable: bool = True, extra_env: Optional[dict] = None):
        env = {"GPUCLEANUP_LIBRARY": str(LIBRARY), "GPUCLEANUP_LIBCUDA": str(FAKE_CUDA),
               "GPUCLEANUP_FAKE_CUDA_SCENARIO": json.dumps(SCENARIO), **(extra_env or {})}
        super().__init__(base, *args, enable=enable, extra_env=env, status_timeout=STATUS_TIMEOUT)


Notebook = server_harness.Notebook
Response = server_harness.Response


def fake_update(patch: dict) -> str:
    """A cell that changes the fake driver's state (the kernel loaded the same libcuda.so.1 as libgpucleanup)."""
    return ("import ctypes, os\n"
            f"assert ctypes.CDLL(os.environ['GPUCLEANUP_LIBCUDA']).fake_cuda_update({json.dumps(patch).encode()!r}) == 0")


def device_used(used: int) -> dict:
    """The fake device with ``used`` bytes in use (80 GiB in all), its default pool holding 2 GiB of them."""
    return {"devices": [{"free_bytes": 80 * GiB - used, "default_pool": {"reserved_bytes": 2 * GiB}}]}


#: the stand-in CuPy with 3 GiB live, 1 GiB cached on GPU0; ``cp.pool`` changes them later
STAND_IN_CUPY = f"""
import sys, pytest
sys.path.insert(0, {str(ROOT / 'tests' / 'python')!r})
from stand_ins import World, install_cupy
cp = install_cupy(pytest.MonkeyPatch(), World(n_devices=1, active=(0,)), used={{0: {3 * GiB}}}, free={{0: {GiB}}})
"""


def fill(notebook: Notebook) -> None:
    """Cells with GPU work: 5 GiB live (stand-in CuPy), 2 GiB outside every pool, 2 GiB freed from the
    driver pool twice; the device ends at 7.0/80.0 GiB used."""
    notebook.run(STAND_IN_CUPY)
    notebook.run("%config GPUCleanup.release = 'cell'")  # each cell's frees on its own record, as it ends
    notebook.load_gpucleanup()
    for code in (fake_update(device_used(6 * GiB)),
                 f"cp.pool.used[0] = {5 * GiB}; cp.pool.free[0] = {GiB}",
                 fake_update(device_used(9 * GiB)),
                 "x = 1"):
        out = notebook.run(code)
        assert "Error" not in out, out


def _age(entry: dict) -> float:
    age = entry["state"]["age_s"]
    assert isinstance(age, (int, float)) and age >= 0
    return age


# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    if not LIBRARY.exists() or not FAKE_CUDA.exists():
        pytest.fail(f"build libgpucleanup and the fake driver first ({LIBRARY}, {FAKE_CUDA})")
    srv = Server(tmp_path_factory.mktemp("jupyter-server"))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def notebook(server):
    """A kernel with gpucleanup and a few cells, for a notebook whose name needs escaping."""
    nb = Notebook(server, "analysis/fit 100% <b>&</b>.ipynb")
    fill(nb)
    yield nb
    nb.close()


@pytest.fixture(scope="module")
def plain(server):
    """A kernel of the server without gpucleanup."""
    nb = Notebook(server, "plain.ipynb")
    yield nb
    nb.close()


# ---------------------------------------------------------------- authentication


def test_the_api_and_the_page_need_the_token(server):
    assert server.request("GET", "/api/gpucleanup/kernels").status == 403
    assert server.request("GET", "/api/gpucleanup/kernels", headers={"Authorization": "token wrong"}).status == 403
    assert server.request("POST", "/api/gpucleanup/kernels/x/drain", body={}).status == 403
    page = server.request("GET", "/gpucleanup")
    assert page.status == 302
    assert page.headers["Location"].startswith("/login?next=")
    assert server.request("GET", "/gpucleanup/static/page.js").status == 302
    assert server.request("GET", "/api/gpucleanup/kernels", token=True).status == 200


def test_the_page_and_its_files_are_served_to_a_logged_in_user(server):
    page = server.request("GET", f"/gpucleanup?token={server.token}", cookies=True)
    assert page.status == 200
    assert page.headers["Content-Type"] == "text/html; charset=UTF-8"
    text = page.body.decode()
    assert '<script type="module" src="/gpucleanup/static/page.js?v=' in text
    assert 'data-refresh-s="2"' in text
    assert "script-src 'self'" in page.headers["Content-Security-Policy"]
    assert server.cookie("_xsrf"), "the page sets the _xsrf cookie its Drain button sends back"
    script = server.request("GET", "/gpucleanup/static/page.js", cookies=True,
                            headers={"Referer": f"{server.url}/gpucleanup"})
    assert script.status == 200
    assert b"api/gpucleanup/kernels" in script.body
    # the units the page shares with the JupyterLab extension: a module beside it, behind the same login
    assert script.body.startswith(b"// ") and b'from "./units.js";' in script.body
    units = server.request("GET", "/gpucleanup/static/units.js", cookies=True,
                           headers={"Referer": f"{server.url}/gpucleanup"})
    assert units.status == 200 and b"export function formatBytes(n)" in units.body
    assert "javascript" in units.headers["Content-Type"]
    assert server.request("GET", "/gpucleanup/static/units.js").status == 302


# ---------------------------------------------------------------- the list


def test_a_kernel_is_listed_with_its_notebook_and_the_figures_of_its_status_endpoint(server, notebook):
    # the server learns the kernel's execution state from its messages, on its own time; the last cell
    # (x = 1) changed nothing since the cleanup before it: an idle cell, it has no record
    last = notebook.count - 1
    entry = server.wait_for(notebook.kernel_id,
                            lambda e: (e["last_cells"] or [{}])[0].get("cell") == last
                            and e["execution_state"] == "idle", "the last cell's record, and idle for the server")
    reply = notebook.status()
    assert entry["notebook"] == notebook.path  # the server's session path
    assert entry["id"] == entry["kernel_id"] == notebook.kernel_id
    assert entry["pid"] == reply["kernel"]["pid"] == notebook.discovery().pid
    assert entry["server_kernel"] is True and entry["gpucleanup"] is True
    assert entry["error"] is None and entry["hint"] is None
    assert entry["state"]["state"] == "idle"
    assert entry["state_text"].startswith("idle for ")
    assert entry["execution_state"] == "idle"
    assert entry["snapshot_status"] == "fresh"
    # the figures are the status endpoint's, device by device
    assert entry["devices"] == kernels.device_rows(reply)
    (device,) = entry["devices"]
    assert (device["index"], device["name"]) == (0, "Fake H100")
    assert (device["used_bytes"], device["total_bytes"]) == (7 * GiB, 80 * GiB)
    assert device["live_bytes"] == {"cupy": 5 * GiB}
    assert device["outside_bytes"] == 2 * GiB
    # the last cells, newest first: the two cells that grew the driver pool freed 2 GiB each
    cells = {c["cell"]: c for c in entry["last_cells"]}
    assert entry["last_cells"][0]["cell"] == last and notebook.count not in cells
    assert [cells[n]["freed_bytes"] for n in (notebook.count - 3, notebook.count - 1)] == [2 * GiB, 2 * GiB]
    assert cells[last]["devices"][0]["used_after_bytes"] == 7 * GiB
    # the timeline has every cell since the extension loaded
    history = status_client.request(kernels.target_of(notebook.discovery()), "history", timeout=TIMEOUT)["records"]
    (series,) = entry["timeline"]["devices"]
    assert [p["cell"] for p in series["points"]] == [r["cell"] for r in history]
    assert series["points"][-1]["used_bytes"] == 7 * GiB
    assert series["points"][-1]["live_bytes"] == 5 * GiB
    # the whole list holds the same entry
    listed = server.api("GET", "/api/gpucleanup/kernels")
    assert listed["runtime_dir"] == str(server.runtime)
    assert listed["skipped"] == []
    assert [e["devices"] for e in listed["kernels"] if e["id"] == notebook.kernel_id] == [entry["devices"]]


def test_reading_the_list_deletes_no_file_not_even_a_stale_one(server):
    # whoever may read the list (a read-only user included) must not be able to delete files
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    gone = proc.pid
    path = server.runtime / f"gpucleanup-{gone}.json"
    discovery.write(path, {
        "discovery": 1, "pid": gone, "proc_start_ticks": 1, "kernel_id": None, "connection_file": None,
        "notebook": None, "endpoint": f"ipc://{server.runtime}/gpucleanup/{gone}.sock",
        "pub_endpoint": f"ipc://{server.runtime}/gpucleanup/{gone}.sock.pub", "transport": "ipc",
        "key_file": None, "signature_scheme": "hmac-sha256", "protocol": 1, "started_ns": 1, "version": "0.1.0"})
    try:
        assert discovery.scan(server.runtime, clean=False).stale == [path]
        listed = server.api("GET", "/api/gpucleanup/kernels")
        assert gone not in [e["pid"] for e in listed["kernels"]]
        assert server.request("GET", f"/api/gpucleanup/kernels/pid-{gone}", token=True).status == 404
        assert path.exists()
    finally:
        discovery.remove(path)


def test_a_kernel_without_gpucleanup_is_listed_with_a_hint(server, plain):
    entry = server.entry(plain.kernel_id)
    assert entry["notebook"] == "plain.ipynb"
    assert entry["gpucleanup"] is False
    assert entry["server_kernel"] is True
    assert entry["hint"] == "gpucleanup is not loaded in this kernel: run %load_ext gpucleanup in a cell"
    assert entry["devices"] == [] and entry["state"] is None
    drain = server.request("POST", f"/api/gpucleanup/kernels/{plain.kernel_id}/drain", body={}, token=True)
    assert drain.status == 409
    assert drain.json()["message"] == f"kernel {plain.kernel_id}: {entry['hint']}"


def test_an_unknown_kernel_is_404_with_a_json_message(server):
    for method, path in (("GET", "/api/gpucleanup/kernels/no-such-kernel"),
                         ("POST", "/api/gpucleanup/kernels/no-such-kernel/drain")):
        response = server.request(method, path, body={} if method == "POST" else None, token=True)
        assert response.status == 404
        assert response.headers["Content-Type"].startswith("application/json")
        assert response.json()["message"] == "no kernel no-such-kernel: GET api/gpucleanup/kernels lists the kernels"


# ---------------------------------------------------------------- drain


def test_drain_is_post_only(server, notebook):
    response = server.request("GET", f"/api/gpucleanup/kernels/{notebook.kernel_id}/drain", token=True)
    assert response.status == 405


def test_drain_with_the_token_needs_no_xsrf_and_returns_the_result(server, notebook):
    server.wait_for(notebook.kernel_id, lambda e: e["state"]["state"] == "idle", "idle")
    response = server.request("POST", f"/api/gpucleanup/kernels/{notebook.kernel_id}/drain",
                              body={"timeout_s": 5}, token=True)
    assert response.status == 200, response.body
    data = response.json()
    assert data["id"] == data["kernel_id"] == notebook.kernel_id
    assert data["notebook"] == notebook.path
    assert data["result"]["kind"] == "drain"
    assert data["result"]["timeout_s"] == 5
    assert [d["state"] for d in data["result"]["devices"]] == ["drained"]
    assert data["drained"] is True
    assert data["lines"] == ["GPU0: drained, released 0 B"]  # the cells' own cleanups trimmed the pool already


def test_drain_lines_say_per_framework_what_the_kernels_own_cleanup_gave_back():
    from gpucleanup.server.model import drain_lines

    def device(i, released):
        return {"index": i, "state": "drained", "released_bytes": released, "settle": {"status": "done"}, "message": None}

    result = {"driver": {"state": "ready"}, "devices": [device(0, 256 * MiB), device(1, 0)], "kernel": {
        "ran": True, "skipped": None, "error": None, "released_bytes": {"cupy": GiB, "torch": 512 * MiB},
        "pinned_released_bytes": {"cupy": 64 * MiB}, "pinned_pending": False,
        "devices": [{"index": 0, "state": "drained", "released_bytes": {"cupy": GiB, "torch": 512 * MiB}},
                    {"index": 1, "state": "drained", "released_bytes": {}}]}}
    assert drain_lines(result, 10) == [
        "GPU0: drained, released 1.8 GiB (cupy 1.0 GiB, torch 512 MiB, driver pools 256 MiB)",
        "GPU1: drained, released 0 B",
        "released 64 MiB of pinned host memory (cupy 64 MiB)",
    ]
    result["kernel"] = {"ran": False, "skipped": "a cell is under way", "error": None}
    assert drain_lines(result, 10) == [
        "GPU0: drained, released 256 MiB",
        "GPU1: drained, released 0 B",
        "the kernel's own cleanup did not run (a cell is under way): the frameworks' caches were left as they are",
    ]


def test_drain_from_a_login_cookie_needs_the_xsrf_header(server, notebook):
    assert server.request("GET", f"/gpucleanup?token={server.token}", cookies=True).status == 200
    path = f"/api/gpucleanup/kernels/{notebook.kernel_id}/drain"
    # logged in by cookie: reading works without more
    assert server.request("GET", f"/api/gpucleanup/kernels/{notebook.kernel_id}", cookies=True).status == 200
    refused = server.request("POST", path, body={}, cookies=True)
    assert refused.status == 403
    assert "_xsrf" in refused.json()["message"]
    server.wait_for(notebook.kernel_id, lambda e: e["state"]["state"] == "idle", "idle")
    done = server.request("POST", path, body={}, cookies=True, headers={"X-XSRFToken": server.cookie("_xsrf")})
    assert done.status == 200, done.body
    assert done.json()["result"]["kind"] == "drain"


def test_bad_drain_requests_say_what_to_send(server, notebook):
    path = f"/api/gpucleanup/kernels/{notebook.kernel_id}/drain"
    for body, message in (
        ({"timeout_s": 61}, "timeout_s must be a number of seconds from 0 to 60, got 61"),
        ({"timeout_s": "ten"}, "timeout_s must be a number of seconds from 0 to 60, got 'ten'"),
        ([1], 'the body must be a JSON object, e.g. {"timeout_s": 10}'),
    ):
        response = server.request("POST", path, body=body, token=True)
        assert (response.status, response.json()["message"]) == (400, message)


def test_a_kernel_stuck_in_a_cell_shows_as_running_and_refuses_a_drain(server, notebook):
    cell = notebook.count + 1
    msg_id = notebook.start("import time\ntime.sleep(600)")
    try:
        # gpucleanup's state and the server's own view (from the kernel's iopub status) agree, in time
        first = server.wait_for(notebook.kernel_id,
                                lambda e: e["state"]["state"] == "running" and e["execution_state"] == "busy",
                                "running, and busy for the server")
        assert first["state"]["cell"] == cell
        assert first["state_text"].startswith(f"running cell {cell} for ")
        later = server.entry(notebook.kernel_id)
        assert later["state"]["cell"] == cell
        assert _age(later) >= _age(first)  # still the same cell, an age that grows
        refused = server.request("POST", f"/api/gpucleanup/kernels/{notebook.kernel_id}/drain", body={}, token=True)
        assert refused.status == 409
        assert refused.json()["message"] == (
            f"kernel {notebook.kernel_id}: [gpucleanup.server.411] drain refused: the kernel is running; "
            "a drain runs only between cells (state idle)"
        )
    finally:
        assert "KeyboardInterrupt" in notebook.interrupt(msg_id)
    server.wait_for(notebook.kernel_id, lambda e: e["state"]["state"] == "idle", "idle after the interrupt")


def test_a_kernel_waiting_for_its_gpu_shows_which(server, notebook):
    # The cell leaves work on GPU0 that never finishes: its cleanup waits for it (settle_timeout, 30 s).
    cell = notebook.count + 1
    msg_id = notebook.start(fake_update({"devices": [{"sync_seconds": -1}]}))
    try:
        entry = server.wait_for(notebook.kernel_id, lambda e: e["state"]["state"] == "waiting", "waiting")
        assert entry["state"]["device"] == 0
        assert entry["state"]["cell"] == cell
        assert entry["state_text"].startswith("waiting for GPU0 for ")
    finally:
        notebook.interrupt(msg_id)  # Ctrl-C stops the wait
        out = notebook.run("import ctypes, os\nlib = ctypes.CDLL(os.environ['GPUCLEANUP_LIBCUDA'])\n"
                           "lib.fake_cuda_release_sync()\n" + fake_update({"devices": [{"sync_seconds": 0}]}))
        assert "Error" not in out, out
    server.wait_for(notebook.kernel_id, lambda e: e["state"]["state"] == "idle", "idle after the wait")


def test_a_kernel_that_does_not_answer_shows_why_and_its_drain_is_504(server):
    import zmq

    stuck = zmq.Context.instance().socket(zmq.ROUTER)  # accepts, never answers
    stuck.setsockopt(zmq.LINGER, 0)
    port = stuck.bind_to_random_port("tcp://127.0.0.1")
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    path = server.runtime / f"gpucleanup-{sleeper.pid}.json"
    try:
        discovery.write(path, {
            "discovery": 1, "pid": sleeper.pid, "proc_start_ticks": discovery.process_start_ticks(sleeper.pid),
            "kernel_id": None, "connection_file": None, "notebook": "elsewhere/stuck.ipynb",
            "endpoint": f"tcp://127.0.0.1:{port}", "pub_endpoint": f"tcp://127.0.0.1:{port}", "transport": "tcp",
            "key_file": None, "signature_scheme": "hmac-sha256", "protocol": 1, "started_ns": 1, "version": "0.1.0",
        })
        key = f"pid-{sleeper.pid}"
        entry = server.entry(key)
        assert entry["notebook"] == "elsewhere/stuck.ipynb"
        assert entry["server_kernel"] is False and entry["gpucleanup"] is True
        assert entry["error_kind"] == "no_answer"
        assert entry["error"] == f"did not answer within {STATUS_TIMEOUT:g} s: the process may be stopped or overloaded"
        assert entry["state"] is None and entry["devices"] == []
        response = server.request("POST", f"/api/gpucleanup/kernels/{key}/drain", body={"timeout_s": 0}, token=True)
        assert response.status == 504
        assert response.json()["message"] == (
            f"kernel {key} did not answer within {STATUS_TIMEOUT:g} s: the process may be stopped or overloaded")
    finally:
        path.unlink(missing_ok=True)
        sleeper.kill()
        sleeper.wait()
        stuck.close()


def test_drains_to_kernels_that_do_not_answer_never_hold_up_the_list(server):
    import threading

    import zmq

    stuck = zmq.Context.instance().socket(zmq.ROUTER)  # accepts, never answers
    stuck.setsockopt(zmq.LINGER, 0)
    port = stuck.bind_to_random_port("tcp://127.0.0.1")
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    path = server.runtime / f"gpucleanup-{sleeper.pid}.json"
    key = f"pid-{sleeper.pid}"
    statuses = []
    try:
        discovery.write(path, {
            "discovery": 1, "pid": sleeper.pid, "proc_start_ticks": discovery.process_start_ticks(sleeper.pid),
            "kernel_id": None, "connection_file": None, "notebook": "elsewhere/stuck.ipynb",
            "endpoint": f"tcp://127.0.0.1:{port}", "pub_endpoint": f"tcp://127.0.0.1:{port}", "transport": "tcp",
            "key_file": None, "signature_scheme": "hmac-sha256", "protocol": 1, "started_ns": 1, "version": "0.1.0",
        })
        assert server.entry(key)["error_kind"] == "no_answer"

        def drain():  # each waits 20 s for an answer that never comes
            statuses.append(server.request("POST", f"/api/gpucleanup/kernels/{key}/drain", body={"timeout_s": 20},
                                           token=True).status)

        drains = [threading.Thread(target=drain) for _ in range(4)]
        for t in drains:
            t.start()
        # every drain has reached the kernel (and holds a thread of the server) before the list is asked
        seen = 0
        while seen < 4:
            assert stuck.poll(TIMEOUT * 1000), "the drains did not reach the kernel"
            seen += sum(b'"drain"' in frame for frame in stuck.recv_multipart())
        # the list answers, every time, while every drain still waits (generous bound: half the drains' wait)
        started = time.monotonic()
        for _ in range(3):
            listed = server.api("GET", "/api/gpucleanup/kernels")
            assert key in [e["id"] for e in listed["kernels"]]
        assert time.monotonic() - started < 10
        assert statuses == [] and all(t.is_alive() for t in drains)
        for t in drains:
            t.join(120)
        assert statuses == [504] * 4
    finally:
        path.unlink(missing_ok=True)
        sleeper.kill()
        sleeper.wait()
        stuck.close()


# ---------------------------------------------------------------- enabling, settings


def test_the_config_file_a_wheel_installs_enables_the_extension(tmp_path):
    # what the wheel puts in <prefix>/etc/jupyter/jupyter_server_config.d (CMakeLists.txt installs it)
    shipped = ROOT / "share" / "jupyter-config" / "gpucleanup.json"
    assert json.loads(shipped.read_text()) == {"ServerApp": {"jpserver_extensions": {"gpucleanup.server": True}}}
    config = tmp_path / "etc-jupyter"
    (config / "jupyter_server_config.d").mkdir(parents=True)
    shutil.copy(shipped, config / "jupyter_server_config.d")
    (tmp_path / "server").mkdir()
    srv = Server(tmp_path / "server", enable=False, extra_env={"JUPYTER_CONFIG_PATH": str(config)})
    try:
        listed = srv.api("GET", "/api/gpucleanup/kernels")
        assert listed["kernels"] == [] and listed["runtime_dir"] == str(srv.runtime)
        assert "gpucleanup.server | extension was successfully loaded." in srv.log()
    finally:
        srv.stop()


def test_settings_are_traits_with_documented_defaults_and_bounds():
    from traitlets import TraitError
    from traitlets.config import Config

    from gpucleanup.server import GPUCleanupServer

    defaults = GPUCleanupServer()
    assert (defaults.timeout, defaults.history, defaults.refresh_s, defaults.drain_timeout) == (1.0, 50, 2.0, 10.0)
    config = Config({"GPUCleanupServer": {"timeout": 2.5, "history": 10, "refresh_s": 5}})
    assert (GPUCleanupServer(config=config).timeout, GPUCleanupServer(config=config).history) == (2.5, 10)
    for name, value in (("timeout", 0), ("history", -1), ("refresh_s", 0.1), ("drain_timeout", 61)):
        with pytest.raises(TraitError, match=f"The value of the '{name}' trait of a GPUCleanupServer instance"):
            GPUCleanupServer(**{name: value})


def test_importing_gpucleanup_does_not_import_jupyter_server():
    result = subprocess.run(
        [sys.executable, "-c", "import sys, gpucleanup, gpucleanup.outside.kernels, gpucleanup.in_kernel.extension; "
                               "print(sorted(m for m in sys.modules if m.startswith(('jupyter_server', 'tornado'))))"],
        capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT / "ipython_ext")), timeout=TIMEOUT,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == "[]\n"
    from gpucleanup.server import _jupyter_server_extension_points

    assert _jupyter_server_extension_points() == [{"module": "gpucleanup.server"}]


# ---------------------------------------------------------------- the entries, from plain data


def _view(pid, kernel_id=None, notebook=None, status=None, history=None, error=None, error_kind=None, elsewhere=None):
    info = {"pid": pid, "kernel_id": kernel_id, "notebook": notebook}
    return kernels.KernelView(discovery.Kernel(Path(f"/run/gpucleanup-{pid}.json"), info, elsewhere=elsewhere),
                              status=status, history=history, error=error, error_kind=error_kind, elsewhere=elsewhere)


def _record(cell, freed, used):
    return {"cell": cell, "time_ns": cell, "elapsed_s": 0.01, "interrupted": False,
            "devices": [{"index": 0, "name": "GPU", "total_bytes": 8 * GiB, "used_after_bytes": used,
                         "freed_bytes": {"torch": freed}, "live_bytes": {"torch": GiB}, "cached_bytes": {},
                         "outside_bytes": GiB // 2, "state": "drained"}],
            "pinned": {"freed_bytes": {"torch": 1024}}}


def test_entries_join_the_servers_kernels_and_the_discovery_files():
    from gpucleanup.server import model

    status = {"state": {"state": "running", "cell": 12, "age_s": 63.2}, "snapshot_status": "stale",
              "snapshot_age_s": 1.5, "snapshot": {"driver": {"state": "ready"}, "devices": []},
              "last_record": _record(11, 0, 3 * GiB), "kernel": {"notebook": "from-kernel.ipynb"}}
    history = [_record(n, GiB if n % 2 else 0, n * GiB // 4) for n in range(1, 12)]
    gathered = kernels.Gathered(
        kernels=[
            _view(101, None, None, status=status, history=history),  # the server's kernel, known by pid only
            _view(202, "other", "theirs.ipynb", error="did not answer within 1 s", error_kind="no_answer"),
            _view(303, "far", "far.ipynb", error="elsewhere (another PID namespace)", error_kind="elsewhere",
                  elsewhere="another PID namespace"),
        ],
        skipped=[discovery.Skipped(Path("/run/gpucleanup-9.json"), "not JSON")],
        directory=Path("/run"),
    )
    ours = [{"kernel_id": "k-b", "notebook": "b.ipynb", "pid": 101, "execution_state": "busy"},
            {"kernel_id": "k-a", "notebook": "a.ipynb", "pid": 100, "execution_state": "idle"},
            {"kernel_id": "k-c", "notebook": None, "pid": None, "execution_state": "starting"}]
    data = model.assemble(ours, gathered)
    assert data["runtime_dir"] == "/run"
    assert data["skipped"] == [{"path": "/run/gpucleanup-9.json", "why": "not JSON"}]
    # this server's kernels by notebook (none last), then the others by pid
    assert [e["id"] for e in data["kernels"]] == ["k-a", "k-b", "k-c", "other", "far"]
    a, b, c, other, far = data["kernels"]
    assert (a["gpucleanup"], a["hint"], a["execution_state"]) == (False, model.NOT_LOADED, "idle")
    assert (b["gpucleanup"], b["hint"], b["notebook"], b["pid"]) == (True, None, "b.ipynb", 101)
    assert b["state_text"] == "running cell 12 for 1 min 3 s"
    assert (b["snapshot_status"], b["snapshot_age_s"], b["driver_state"]) == ("stale", 1.5, "ready")
    assert [cell["cell"] for cell in b["last_cells"]] == [11, 10, 9, 8, 7, 6]
    assert b["last_cells"][0] == {"cell": 11, "time_ns": 11, "elapsed_s": 0.01, "interrupted": False,
                                  "freed_bytes": GiB, "pinned_freed_bytes": 1024,
                                  "devices": [{"index": 0, "state": "drained", "freed_bytes": GiB,
                                               "used_after_bytes": 11 * GiB // 4, "live_bytes": GiB,
                                               "cached_bytes": 0, "outside_bytes": GiB // 2}]}
    assert [p["cell"] for p in b["timeline"]["devices"][0]["points"]] == list(range(1, 12))
    assert b["devices"][0]["outside_bytes"] == GiB // 2
    assert (c["id"], c["gpucleanup"], c["notebook"]) == ("k-c", False, None)
    assert (other["server_kernel"], other["notebook"], other["error_kind"]) == (False, "theirs.ipynb", "no_answer")
    assert other["state"] is None and other["state_text"] is None and other["hint"] is None
    assert (far["error_kind"], far["pid"]) == ("elsewhere", 303)


def test_an_entry_without_a_kernel_id_goes_by_its_pid():
    from gpucleanup.server import model

    data = model.assemble([], kernels.Gathered([_view(4242, None, "ipython")], [], Path("/run")))
    assert [(e["id"], e["kernel_id"], e["server_kernel"]) for e in data["kernels"]] == [("pid-4242", None, False)]


def test_state_text_reads_like_gpucleanup_ps():
    from gpucleanup.server.model import state_text

    assert state_text({"state": "idle", "age_s": 3}) == "idle for 3.0 s"
    assert state_text({"state": "running", "cell": 12, "age_s": 63.2}) == "running cell 12 for 1 min 3 s"
    assert state_text({"state": "waiting", "device": 1, "cell": 4, "age_s": 8}) == "waiting for GPU1 for 8.0 s"
    assert state_text({"state": "draining", "cell": 4}) == "draining cell 4"
    assert state_text({"state": "parked", "bytes": 3 << 30, "age_s": 2520}) == "parked 3.0 GiB in host memory for 42 min"
    assert state_text({"state": "parked", "bytes": None}) == "parked in host memory"
    assert state_text(None) is None


def test_drain_lines_say_what_was_released_and_why_not():
    from gpucleanup.server.model import drain_lines

    result = {"driver": {"state": "ready"}, "devices": [
        {"index": 0, "state": "drained", "released_bytes": GiB, "settle": {"status": "done"}, "message": None},
        {"index": 1, "state": "busy", "settle": {"status": "timeout"}},
        {"index": 2, "state": "busy", "settle": {"status": "still_busy"}},
        {"index": 3, "state": "unusable", "message": "GPU3 is unusable after CUDA_ERROR_ILLEGAL_ADDRESS: restart the kernel"},
        {"index": 4, "state": "error", "message": "cuMemPoolTrimTo failed on GPU4"},
    ]}
    assert drain_lines(result, 2) == [
        "GPU0: drained, released 1.0 GiB",
        "GPU1 busy: the work the kernel queued on it did not finish within 2 s, so its memory pools were not "
        "trimmed; try again later",
        "GPU2 busy: its queued work is still running and a wait for it is under way already (the kernel's own "
        "cleanup, or an earlier drain), so its memory pools were not trimmed; try again when that work has finished",
        "GPU3 unusable: GPU3 is unusable after CUDA_ERROR_ILLEGAL_ADDRESS: restart the kernel",
        "GPU4 error: cuMemPoolTrimTo failed on GPU4; try again",
    ]
    assert drain_lines({"driver": {"state": "not_initialized"}, "devices": []}, 10) == ["drained; no GPU in use"]
    assert drain_lines({"driver": {"state": "unusable", "message": "bad"}, "devices": []}, 10) == [
        "nothing drained: the CUDA driver is unusable (bad)"]


# ---------------------------------------------------------------- park and resume


def test_park_and_resume_through_the_api(tmp_path):
    """POST .../park and .../resume: the kernel's state, the driver's (the fake's checkpoint record), the
    refusals, and the page's data; the same checks of token and XSRF as a drain."""
    checkpoints = tmp_path / "checkpoints"
    checkpoints.mkdir()
    srv = Server(tmp_path / "srv", extra_env={"GPUCLEANUP_FAKE_CUDA_CHECKPOINT_DIR": str(checkpoints)})
    nb = None
    try:
        nb = Notebook(srv, "park.ipynb")
        nb.load_gpucleanup()
        pid = nb.discovery().pid
        path = f"/api/gpucleanup/kernels/{nb.kernel_id}"
        srv.wait_for(nb.kernel_id, lambda e: e["state"]["state"] == "idle", "idle")
        assert srv.request("POST", f"{path}/park", body={}).status == 403
        assert srv.request("GET", f"{path}/park", token=True).status == 405
        assert srv.request("GET", f"{path}/park-check").status == 403
        checked = srv.request("GET", f"{path}/park-check", token=True)
        assert checked.status == 200, checked.body
        data = checked.json()
        assert (data["parkable"], data["reasons"], data["state"], data["driver_state"], data["message"]) == (
            True, [], "idle", "running", "can be parked now")
        assert json.loads((checkpoints / f"{pid}.json").read_text())["calls"].get("cuCheckpointProcessLock") is None

        parked = srv.request("POST", f"{path}/park", body={}, token=True)
        assert parked.status == 200, parked.body
        data = parked.json()
        assert (data["action"], data["ok"], data["state"], data["pid"]) == ("park", True, "checkpointed", pid)
        assert data["message"].startswith("parked its GPU memory (context included) in host memory in ")
        assert json.loads((checkpoints / f"{pid}.json").read_text())["state"] == "checkpointed"
        entry = srv.wait_for(nb.kernel_id, lambda e: e["state"]["state"] == "parked", "parked")
        assert entry["state_text"].startswith("parked in host memory for ")
        assert entry["snapshot_status"] in ("stale", "unavailable")  # no driver call while parked

        checked = srv.request("GET", f"{path}/park-check", token=True).json()
        assert (checked["parkable"], checked["state"]) == (False, "parked")
        assert checked["message"] == ("cannot be parked now: the kernel is parked already: gpucleanup resume "
                                      f"{pid} brings it back")

        again = srv.request("POST", f"{path}/park", body={}, token=True)
        assert again.status == 409
        assert again.json()["message"] == (f"kernel {nb.kernel_id}: [gpucleanup.server.420] park refused: the kernel "
                                           "is parked")

        resumed = srv.request("POST", f"{path}/resume", body={}, token=True)
        assert resumed.status == 200, resumed.body
        data = resumed.json()
        assert (data["action"], data["ok"], data["state"]) == ("resume", True, "running")
        assert data["message"].startswith("resumed its GPU memory from host memory in ")
        assert json.loads((checkpoints / f"{pid}.json").read_text())["state"] == "running"
        srv.wait_for(nb.kernel_id, lambda e: e["state"]["state"] == "idle", "idle after the resume")
        told, printed = nb.run("print(1 + 1)").splitlines()  # the next cell says the resume it did not see
        assert told.endswith(" before this cell, from outside the kernel (gpucleanup resume or the page)"), told
        assert printed == "2"

        # a resume of a kernel that is not parked is refused, as a park of a parked one (before: 200, ok true)
        not_parked = srv.request("POST", f"{path}/resume", body={}, token=True)
        assert not_parked.status == 409, not_parked.body
        assert not_parked.json()["message"] == (f"kernel {nb.kernel_id} not resumed: [gpucleanup.park.645] kernel "
                                                f"{pid} is not parked: nothing to resume")
        # a failed driver step is 500, its body the same as a success's (before: 200 with ok false)
        record = json.loads((checkpoints / f"{pid}.json").read_text())
        record["errors"] = {"cuCheckpointProcessCheckpoint": 2}
        (checkpoints / f"{pid}.json").write_text(json.dumps(record))
        failed = srv.request("POST", f"{path}/park", body={}, token=True)
        assert failed.status == 500, failed.body
        data = failed.json()
        assert (data["action"], data["ok"], data["state"]) == ("park", False, "running")
        assert data["message"].startswith("[gpucleanup.park.620] the checkpoint failed with CUDA_ERROR_OUT_OF_MEMORY")
    finally:
        if nb is not None:
            nb.close()
        srv.stop()


def test_the_server_parks_kernels_left_idle_when_told_to(tmp_path):
    checkpoints = tmp_path / "checkpoints"
    checkpoints.mkdir()
    srv = Server(tmp_path / "srv", "--GPUCleanupServer.park_idle_after_s=1",
                 extra_env={"GPUCLEANUP_FAKE_CUDA_CHECKPOINT_DIR": str(checkpoints)})
    nb = None
    try:
        nb = Notebook(srv, "idle.ipynb")
        nb.load_gpucleanup()
        pid = nb.discovery().pid
        srv.wait_for(nb.kernel_id, lambda e: e["state"]["state"] == "parked", "parked after 1 s idle")
        assert json.loads((checkpoints / f"{pid}.json").read_text())["state"] == "checkpointed"
        out = nb.run("print('back')")
        assert out.startswith("gpucleanup · resumed its GPU memory from host memory in "), out
        assert out.endswith("back\n")
    finally:
        if nb is not None:
            nb.close()
        srv.stop()


def test_the_servers_automatic_park_leaves_a_kernel_alone_while_a_thread_a_cell_started_runs(tmp_path):
    checkpoints = tmp_path / "checkpoints"
    checkpoints.mkdir()
    srv = Server(tmp_path / "srv", "--GPUCleanupServer.park_idle_after_s=1",
                 extra_env={"GPUCLEANUP_FAKE_CUDA_CHECKPOINT_DIR": str(checkpoints)})
    nb = None
    try:
        nb = Notebook(srv, "training.ipynb")
        # in the cell that loads gpucleanup: no round finds the kernel idle before the thread runs
        out = nb.run("%load_ext gpucleanup\nimport threading\nstop = threading.Event()\n"
                     "worker = threading.Thread(target=stop.wait, name='train-loop')\nworker.start()")
        assert "Error" not in out, out
        pid = nb.discovery().pid
        tried = f"gpucleanup: kernel {nb.kernel_id} idle "
        deadline = time.monotonic() + TIMEOUT
        while not [line for line in srv.log().splitlines() if tried in line]:
            assert time.monotonic() < deadline, f"no automatic park attempt within {TIMEOUT} s:\n{srv.log()}"
            time.sleep(0.05)
        attempt = [line for line in srv.log().splitlines() if tried in line][0]
        assert ("[gpucleanup.park.642] 1 thread started in a cell still runs (train-loop): an automatic park would "
                "stop their GPU calls") in attempt, attempt
        record = json.loads((checkpoints / f"{pid}.json").read_text())
        assert "cuCheckpointProcessLock" not in record["calls"] and record["state"] == "running", record
        # The thread ends; the cell that ends it says so, and the policy parks the kernel at its next round.
        assert nb.run("stop.set(); worker.join()") == ""
        srv.wait_for(nb.kernel_id, lambda e: e["state"]["state"] == "parked", "parked once the thread ended")
        assert json.loads((checkpoints / f"{pid}.json").read_text())["state"] == "checkpointed"
    finally:
        if nb is not None:
            nb.close()
        srv.stop()


def _rounds_pass(nb: Notebook, rounds: int) -> dict:
    """The kernel's status once the server has asked it ``rounds`` more rounds' worth of requests (a round asks
    each kernel for its status and its history: 2 requests; a park attempt adds its own), polled: the
    automatic park's rounds leave no other trace when they do nothing."""
    first = nb.status()
    polls = 0
    deadline = time.monotonic() + TIMEOUT
    while True:
        reply = nb.status()
        polls += 1
        by_server = reply["server"]["requests"] - first["server"]["requests"] - polls
        if by_server >= 2 * rounds:
            return reply
        assert time.monotonic() < deadline, f"{rounds} rounds of the automatic park not within {TIMEOUT} s"
        time.sleep(0.05)


@pytest.mark.parametrize("why", ["cpu_only", "checkpoint_fails"])
def test_the_server_tries_a_kernel_it_cannot_park_once_per_idle_period_and_keeps_its_idle_time(tmp_path, why):
    # cpu_only: a kernel that never used the GPU (the fake driver keeps no checkpoint record of it, so the park
    # is refused); checkpoint_fails: the driver's checkpoint fails and the kernel is unlocked. Either way the
    # park's "failed" step puts back the idle state "begin" found, so the server's memo of refused kernels
    # (by kernel and idle-since time) holds until a cell runs (issue 41, item 10).
    extra_env = {}
    checkpoints = tmp_path / "checkpoints"
    if why == "checkpoint_fails":
        checkpoints.mkdir()
        extra_env["GPUCLEANUP_FAKE_CUDA_CHECKPOINT_DIR"] = str(checkpoints)
    srv = Server(tmp_path / "srv", "--GPUCleanupServer.park_idle_after_s=1", extra_env=extra_env)
    nb = None
    try:
        nb = Notebook(srv, "cpu.ipynb")
        load = "%load_ext gpucleanup"
        if why == "checkpoint_fails":  # in the same cell: no round finds the kernel idle before the error is set
            load += ("\nimport ctypes, os\nassert ctypes.CDLL(os.environ['GPUCLEANUP_LIBCUDA']).fake_cuda_checkpoint_update("
                     "os.getpid(), b'{\"errors\": {\"cuCheckpointProcessCheckpoint\": 2}}') == 0")
        out = nb.run(load)
        assert "Error" not in out, out
        tried = f"gpucleanup: kernel {nb.kernel_id} idle "

        def attempts() -> list:
            return [line for line in srv.log().splitlines() if tried in line]

        def wait_for_attempts(n: int) -> None:
            deadline = time.monotonic() + TIMEOUT
            while len(attempts()) < n:
                assert time.monotonic() < deadline, f"no park attempt {n} within {TIMEOUT} s:\n{srv.log()}"
                time.sleep(0.05)

        def idle_state() -> dict:  # polled: a park under way says "parking" for a moment
            deadline = time.monotonic() + TIMEOUT
            while True:
                state = nb.status()["state"]
                if state["state"] == "idle":
                    return state
                assert time.monotonic() < deadline, f"not idle within {TIMEOUT} s: {state}"
                time.sleep(0.05)

        idle = idle_state()
        wait_for_attempts(1)
        status = _rounds_pass(nb, 3)
        assert len(attempts()) == 1, attempts()
        assert "not parked" in attempts()[0] or "nothing was parked" in attempts()[0], attempts()
        assert status["state"]["state"] == "idle", status["state"]
        assert status["state"]["since_ns"] == idle["since_ns"], (status["state"], idle)
        assert status["state"]["age_s"] >= idle["age_s"]
        entry = srv.entry(nb.kernel_id)  # the page's "idle for" and the metric's age: from the same time
        assert entry["state"]["since_ns"] == idle["since_ns"], entry["state"]
        if why == "checkpoint_fails":
            record = json.loads((checkpoints / f"{nb.discovery().pid}.json").read_text())
            assert record["calls"].get("cuCheckpointProcessCheckpoint") == 1, record
            assert record["state"] == "running", record

        # A cell ran: a new idle period, one more attempt, and again only one.
        assert nb.run("print(1 + 1)") == "2\n"
        idle_again = idle_state()
        assert idle_again["since_ns"] > idle["since_ns"], (idle_again, idle)
        wait_for_attempts(2)
        status = _rounds_pass(nb, 3)
        assert len(attempts()) == 2, attempts()
        assert status["state"]["since_ns"] == idle_again["since_ns"], (status["state"], idle_again)
    finally:
        if nb is not None:
            nb.close()
        srv.stop()


#: In a process of its own: a ServerApp with the extension (and the automatic parking) set up in-process, the
#: extension loaded a second time by hand, one collection run, then the server's own cleanup; prints what it saw.
LIFETIME = r"""
import asyncio, json, sys, threading
from jupyter_server.serverapp import ServerApp
import gpucleanup.server as extension

def routes(app):
    out = []
    for host in app.web_app.default_router.rules:
        for rule in getattr(host.target, "rules", ()):
            pattern = getattr(rule.matcher, "regex", None)
            if pattern is not None and "gpucleanup" in pattern.pattern:
                out.append(pattern.pattern)
    return out

app = ServerApp()
app.initialize(argv=sys.argv[1:])
watch = app.web_app.settings["gpucleanup_watch"]
first = routes(app)
extension._load_jupyter_server_extension(app)
loop = asyncio.new_event_loop()
asyncio.set_event_loop(loop)
data = loop.run_until_complete(watch.collect(frozenset()))
pools = sorted({t.name.rsplit("_", 1)[0] for t in threading.enumerate() if t.name.startswith("gpucleanup-")})
after_second = {"same_watch": app.web_app.settings["gpucleanup_watch"] is watch, "routes": len(routes(app)),
                "first_routes": len(first), "timers": int(watch.auto_park is not None),
                "timer_running": [watch.auto_park.started]}
auto_park = watch.auto_park
loop.run_until_complete(app._cleanup())
for thread in [t for t in threading.enumerate() if t.name.startswith("gpucleanup-")]:
    thread.join(30)
print(json.dumps({**after_second, "kernels": len(data["kernels"]), "pools_used": pools,
                  "stopped": watch.stopped, "timers_running_after": [auto_park.started],
                  "threads_after": [t.name for t in threading.enumerate() if t.name.startswith("gpucleanup-")],
                  "setting_after": "gpucleanup_watch" in app.web_app.settings,
                  "executor_shut": [watch._executor._shutdown, watch._drains._shutdown]}))
"""


def test_the_extension_stops_with_the_server_and_a_second_load_adds_nothing(tmp_path):
    """Its two pools shut down and its parking timer stops when the server cleans up (ServerApp._cleanup, which
    stop(), Ctrl-C and POST /api/shutdown all end in); loaded twice on one server, the second load adds no
    handler, no pool and no second parking loop."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JPY_", "JUPYTER_"))}
    for name in ("runtime", "config", "data"):
        (tmp_path / name).mkdir()
    env.update(JUPYTER_RUNTIME_DIR=str(tmp_path / "runtime"), JUPYTER_CONFIG_DIR=str(tmp_path / "config"),
               JUPYTER_DATA_DIR=str(tmp_path / "data"),
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT / "ipython_ext"), os.environ.get("PYTHONPATH")])))
    argv = ["--ServerApp.jpserver_extensions=gpucleanup.server=True", "--GPUCleanupServer.park_idle_after_s=3600",
            f"--ServerApp.root_dir={tmp_path}", "--ServerApp.port=0", "--IdentityProvider.token=x"]
    if os.geteuid() == 0:
        argv.append("--allow-root")
    done = subprocess.run([sys.executable, "-c", LIFETIME, *argv], env=env, capture_output=True, text=True,
                          timeout=TIMEOUT)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["first_routes"] == 8  # the page, its files, the API's 6 routes
    assert (seen["same_watch"], seen["routes"], seen["timers"], seen["timer_running"]) == (True, 8, 1, [True])
    assert "the extension is loaded on this server already; nothing added" in done.stderr
    assert seen["kernels"] == 0 and seen["pools_used"] == ["gpucleanup-server"]
    assert (seen["stopped"], seen["timers_running_after"], seen["threads_after"], seen["executor_shut"],
            seen["setting_after"]) == (True, [False], [], [True, True], False)
