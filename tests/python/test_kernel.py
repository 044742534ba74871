"""The extension in a real IPython kernel, through jupyter_client (the ipykernel test-helper pattern).

Each test starts a kernel whose environment points libgpucleanup at the fake CUDA
driver (GPUCLEANUP_LIBCUDA) with a scenario (GPUCLEANUP_FAKE_CUDA_SCENARIO), runs
cells, collects the iopub messages of each cell until the kernel is idle, and
asserts what arrived on that cell's stdout stream and as gpucleanup's own display
output (metadata ``{"gpucleanup": ...}``), which the summary line is, never the stdout.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest

from conftest import BUILD, FAKE_CUDA

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kernel_harness import Kernel  # noqa: E402  (tests/kernel_harness.py)
from support import GiB  # noqa: E402

jupyter_client = pytest.importorskip("jupyter_client")
pytest.importorskip("ipykernel")

ROOT = Path(__file__).resolve().parents[2]
LIBRARY = BUILD / "native" / "libgpucleanup.so"
TIMEOUT = 60


def _kernel_env(tmp_path: Path, **extra: str) -> dict:
    env = dict(os.environ)
    for name in list(env):
        if name.startswith(("GPUCLEANUP_FAKE_CUDA", "JPY_")):
            env.pop(name)
    env.update(
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT / "ipython_ext"), extra.pop("PYTHONPATH", "")])),
        GPUCLEANUP_LIBRARY=str(LIBRARY),
        GPUCLEANUP_LIBCUDA=str(FAKE_CUDA),
        JUPYTER_RUNTIME_DIR=str(tmp_path / "runtime"),
        IPYTHONDIR=str(tmp_path / "ipython"),
    )
    env.update(extra)
    return env


@contextlib.contextmanager
def kernel(tmp_path: Path, python: str = sys.executable, **env: str):
    """A real ipykernel run by ``python`` (tests/kernel_harness.py), stopped when the block ends."""
    k = Kernel(_kernel_env(tmp_path, **env), python=python, ready=TIMEOUT, timeout=TIMEOUT)
    try:
        yield k
    finally:
        k.stop()


def execute(k: Kernel, code: str) -> dict:
    """Run one cell; its stdout, stderr, rich outputs, gpucleanup's lines, error and reply."""
    cell = k.execute(code)
    for out in cell.outputs:
        if out.kind == "gpucleanup":  # gpucleanup's own output after the cell: never in the cell's stdout
            assert out.metadata["tags"] == ["gpucleanup"]
            assert out.data["text/html"].startswith('<div class="gpucleanup-line"')
    return {"stdout": cell.stdout, "stderr": cell.stderr, "gpucleanup": cell.gpucleanup, "error": cell.error,
            "display": [out.data for out in cell.outputs if out.kind in ("display", "result")], "reply": cell.reply}


def _timeless(text: str) -> str:
    return re.sub(r" · [0-9.]+ (ms|s)$", " · <t>", text, flags=re.MULTILINE)


@pytest.fixture(scope="module", autouse=True)
def _built():
    if not LIBRARY.exists() or not FAKE_CUDA.exists():
        pytest.fail(f"build libgpucleanup and the fake driver first ({LIBRARY}, {FAKE_CUDA})")


SCENARIO = {"devices": [{"name": "Fake H100", "primary_active": True, "default_pool": {"reserved_bytes": GiB, "used_bytes": 0}}]}


# A cell that "allocates" 2 GiB into the device's default pool (reserved, so no longer free),
# through the fake's control API: the kernel loaded the same libcuda.so.1 as libgpucleanup.
_FREE = 80 * GiB - 512 * (1 << 20) - 2 * GiB
ALLOCATE = (
    "import ctypes, os\n"
    "ctypes.CDLL(os.environ['GPUCLEANUP_LIBCUDA']).fake_cuda_update("
    f"b'{{\"devices\": [{{\"free_bytes\": {_FREE}, \"default_pool\": {{\"reserved_bytes\": {2 * GiB}}}}}]}}')"
)


def test_summary_line_arrives_as_its_own_output_never_on_the_cells_stdout(tmp_path):
    with kernel(tmp_path, GPUCLEANUP_FAKE_CUDA_SCENARIO=json.dumps(SCENARIO)) as kc:
        # the cell that loads the extension is cleaned too: the pool held 1 GiB before
        loaded = execute(kc, "%load_ext gpucleanup")
        assert loaded["reply"]["status"] == "ok"
        assert _timeless(loaded["gpucleanup"]) == "gpucleanup · GPU0 Fake H100 · freed 1.0 GiB (driver 1.0) · device 0.5/80.0 GiB · <t>\n"
        assert loaded["stdout"] == ""
        quiet = execute(kc, "y = 2")
        assert quiet["stdout"] == quiet["gpucleanup"] == ""  # nothing changed: nothing said (show = "auto")
        cell = execute(kc, ALLOCATE)
        assert cell["reply"]["status"] == "ok"
        assert _timeless(cell["gpucleanup"]) == "gpucleanup · GPU0 Fake H100 · freed 2.0 GiB (driver 2.0) · device 0.5/80.0 GiB · <t>\n"
        assert cell["stdout"] == cell["stderr"] == ""
        again = execute(kc, "%load_ext gpucleanup")
        assert "already loaded" in again["stdout"]
        table = execute(kc, "%gpumem")
        assert table["stdout"] == "" and len(table["display"]) == 1
        data = table["display"][0]
        assert data["text/plain"].splitlines()[0] == "GPU0 Fake H100 — 0.5/80.0 GiB used"
        assert "<table" in data["text/html"]
        n = cell["reply"]["execution_count"]
        check = execute(
            kc,
            "from gpucleanup.in_kernel.extension import get_extension\n"
            f"print([r['devices'][0]['freed_bytes'] for r in get_extension(get_ipython()).history.last() if r['cell'] == {n}])",
        )
        assert check["stdout"] == "[{'driver': 2147483648}]\n"


def test_a_clear_output_left_pending_by_the_cell_is_never_taken_by_the_line(tmp_path):
    # clear_output(wait=True) clears at the next output: were gpucleanup's line that output, what the cell drew
    # would be wiped (nbclient's Clear Output.ipynb)
    with kernel(tmp_path, GPUCLEANUP_FAKE_CUDA_SCENARIO=json.dumps(SCENARIO)) as kc:
        assert execute(kc, "%load_ext gpucleanup")["reply"]["status"] == "ok"
        kinds = lambda cell: [o.kind for o in cell.outputs]  # noqa: E731
        before = kc.execute("import sys\nprint([getattr(vars(s).get('write'), '__qualname__', None) "
                            "for s in (sys.stdout, sys.stderr)])").stdout
        drawn = kc.execute(ALLOCATE + "\nfrom IPython.display import clear_output, display\n"
                           "display('frame 1'); clear_output(wait=True); display('frame 2'); clear_output(wait=True)")
        assert drawn.reply["status"] == "ok"
        assert kinds(drawn) == ["display", "clear", "display", "clear"]  # no line: frame 2 stays shown
        assert drawn.display == ["'frame 1'", "'frame 2'"]
        n = drawn.reply["execution_count"]
        kept = kc.execute("from gpucleanup.in_kernel.extension import get_extension\n"
                          f"print([r['devices'][0]['freed_bytes'] for r in get_extension(get_ipython()).history.last() "
                          f"if r['cell'] == {n}])")
        assert kept.stdout == "[{'driver': 2147483648}]\n"  # cleaned all the same, and in the history
        shown = kc.execute(ALLOCATE + "\nfrom IPython.display import clear_output, display\n"
                           "clear_output(wait=True); display('frame 3')")
        assert kinds(shown) == ["clear", "display", "gpucleanup"]  # the clear was taken by the cell's own output
        assert "freed 2.0 GiB" in shown.gpucleanup
        result = kc.execute(ALLOCATE + "\nfrom IPython.display import clear_output\nclear_output(wait=True)\n41 + 1")
        assert kinds(result) == ["clear", "result", "gpucleanup"] and result.result == "42"
        now = kc.execute(ALLOCATE + "\nfrom IPython.display import clear_output\nclear_output()")
        assert kinds(now) == ["clear", "gpucleanup"]  # cleared at once: nothing left to wipe
        # a progress loop that prints after each clear: the text takes the clear, the line comes after it
        printed = kc.execute(ALLOCATE + "\nfrom IPython.display import clear_output\n"
                             "for i in range(3):\n    clear_output(wait=True)\n    print(f'step {i}')")
        assert [o for o in kinds(printed) if o != "stdout"] == ["clear", "clear", "clear", "gpucleanup"]
        assert printed.stdout.endswith("step 2\n") and "freed 2.0 GiB" in printed.gpucleanup
        # the kernel's streams are as they were: IPython's own write (its tee into the history) is back on them
        own = ("import sys\nprint([getattr(vars(s).get('write'), '__qualname__', None) "
               "for s in (sys.stdout, sys.stderr)])")
        assert kc.execute(own).stdout == before


def test_error_in_the_cell_stays_the_users(tmp_path):
    with kernel(tmp_path, GPUCLEANUP_FAKE_CUDA_SCENARIO=json.dumps(SCENARIO)) as kc:
        execute(kc, "%load_ext gpucleanup")
        cell = execute(kc, ALLOCATE + "\n1 / 0")
        assert cell["reply"]["status"] == "error" and cell["error"]["ename"] == "ZeroDivisionError"
        assert _timeless(cell["gpucleanup"]) == "gpucleanup · GPU0 Fake H100 · freed 2.0 GiB (driver 2.0) · device 0.5/80.0 GiB · <t>\n"
        assert cell["stdout"] == ""
        after = execute(kc, "import sys; print(type(sys.last_value).__name__)")
        assert after["stdout"] == "ZeroDivisionError\n"
        result = execute(kc, "6 * 7")
        assert result["display"][0]["text/plain"] == "42"
        assert execute(kc, "print(_, Out[max(Out)])")["stdout"] == "42 42\n"


def test_reload_and_unload_in_a_kernel(tmp_path):
    with kernel(tmp_path, GPUCLEANUP_FAKE_CUDA_SCENARIO=json.dumps(SCENARIO)) as kc:
        execute(kc, "%load_ext gpucleanup")
        execute(kc, "%reload_ext gpucleanup")
        execute(kc, "%reload_ext gpucleanup")
        count = execute(kc, "print(sum(type(getattr(f, '__self__', None)).__name__ == 'GPUCleanup' for f in get_ipython().events.callbacks['post_run_cell']))")
        assert count["stdout"] == "1\n"
        execute(kc, "%unload_ext gpucleanup")
        count = execute(kc, "print(sum(type(getattr(f, '__self__', None)).__name__ == 'GPUCleanup' for f in get_ipython().events.callbacks['post_run_cell']))")
        assert count["stdout"] == "0\n"


def test_autoload_from_the_kernel_config(tmp_path):
    profile = tmp_path / "ipython" / "profile_default"
    profile.mkdir(parents=True)
    (profile / "ipython_kernel_config.py").write_text(
        'c.InteractiveShellApp.extensions = ["gpucleanup"]\nc.GPUCleanup.show = "always"\n'
    )
    with kernel(tmp_path, GPUCLEANUP_FAKE_CUDA_SCENARIO=json.dumps(SCENARIO)) as kc:
        first = execute(kc, "x = 1")
        assert _timeless(first["gpucleanup"]) == "gpucleanup · GPU0 Fake H100 · freed 1.0 GiB (driver 1.0) · device 0.5/80.0 GiB · <t>\n"
        cell = execute(kc, "x = 2")  # show = "always" from the config file
        assert _timeless(cell["gpucleanup"]) == "gpucleanup · GPU0 Fake H100 · freed 0 B · device 0.5/80.0 GiB · <t>\n"
        # what the cell prints, %%capture and a redirected stdout hold only the user's own text
        printed = execute(kc, "print('hi')")
        assert printed["stdout"] == "hi\n" and printed["gpucleanup"] != ""
        captured = execute(kc, "%%capture out\nprint('inside')")
        assert captured["stdout"] == ""
        assert execute(kc, "print(repr(out.stdout), len(out.outputs))")["stdout"] == "'inside\\n' 0\n"
        redirected = execute(kc, "import contextlib, io\nbuf = io.StringIO()\nwith contextlib.redirect_stdout(buf):\n    print('mine')")
        assert redirected["stdout"] == ""
        assert execute(kc, "print(repr(buf.getvalue()))")["stdout"] == "'mine\\n'\n"


def test_no_driver_says_one_line_at_load_and_nothing_after_cells(tmp_path):
    with kernel(tmp_path, GPUCLEANUP_LIBCUDA="/nonexistent") as kc:
        loaded = execute(kc, "%load_ext gpucleanup")
        assert loaded["stdout"] == "gpucleanup · no CUDA driver found (/nonexistent): nothing to clean, no cleanup after cells\n"
        for code in ("x = 1", "y = x + 1", "print('hi')"):
            cell = execute(kc, code)
            assert cell["stdout"] in ("", "hi\n") and cell["stderr"] == ""
        hooks = execute(kc, "print(len(get_ipython().events.callbacks['post_run_cell']))")
        table = execute(kc, "%gpumem")
        assert table["display"][0]["text/plain"] == "gpucleanup · no CUDA driver: nothing to clean"
        # only IPython's/ipykernel's own post_run_cell callbacks remain, none of ours
        ours = execute(kc, "print(any(type(getattr(f, '__self__', None)).__name__ == 'GPUCleanup' for f in get_ipython().events.callbacks['post_run_cell']))")
        assert ours["stdout"] == "False\n" and hooks["stdout"].strip().isdigit()


def _torch_python():
    """An interpreter that can import torch and ipykernel: this one, or $GPUCLEANUP_TEST_TORCH_PYTHON."""
    if importlib.util.find_spec("torch") is not None:
        return sys.executable, ""
    other = os.environ.get("GPUCLEANUP_TEST_TORCH_PYTHON")
    if other and Path(other).exists():
        # ipykernel and friends come from this interpreter's site-packages
        return other, sysconfig.get_paths()["purelib"]
    return None, ""


@pytest.mark.parametrize("scenario", [{"initialized": False}, SCENARIO], ids=["cuda-not-initialised", "device-in-use"])
def test_torch_imported_in_the_kernel_stays_uninitialised(tmp_path, scenario):
    python, extra_path = _torch_python()
    if python is None:
        pytest.skip("torch is not importable (set GPUCLEANUP_TEST_TORCH_PYTHON to an interpreter that has it)")
    with kernel(tmp_path, python=python, PYTHONPATH=extra_path, GPUCLEANUP_FAKE_CUDA_SCENARIO=json.dumps(scenario)) as kc:
        execute(kc, "%load_ext gpucleanup")
        cell = execute(kc, "import torch\nt = torch.zeros(4, 4) @ torch.ones(4, 4)\nprint(float(t.sum()))")
        assert cell["reply"]["status"] == "ok", cell
        assert cell["stdout"] == "0.0\n"
        for magic in ("%gpumem", "%gpumem --vars", "%gpumem --drain", "%gpumem --json"):
            assert execute(kc, magic)["reply"]["status"] == "ok"
        state = execute(kc, "print(torch.cuda.is_initialized())")
        assert state["stdout"] == "False\n"


def _kernel_files(runtime: Path, pid: int) -> list:
    from gpucleanup.protocol import discovery

    private = runtime / "gpucleanup"
    path = discovery.path_for_pid(pid, runtime)  # named from its instance, or (left by hand here) from the pid
    name = discovery.instance_of(path)
    return [path, private / f"{name}.key", private / f"{name}.sock", private / f"{name}.sock.pub"]


def test_the_next_kernel_that_loads_sweeps_what_a_killed_kernel_left(tmp_path):
    import socket

    from gpucleanup.protocol import discovery

    runtime = tmp_path / "runtime"
    private = discovery.ensure_private_dir(runtime / "gpucleanup")
    os.chmod(runtime, 0o700)

    def leave(pid: int, **fields) -> list:
        """A killed kernel's four files (its process is gone)."""
        (private / f"{pid}.key").write_text("0" * 64)
        for name in (f"{pid}.sock", f"{pid}.sock.pub"):
            s = socket.socket(socket.AF_UNIX)
            s.bind(str(private / name))
            s.close()
        info = {"discovery": 1, "pid": pid, "proc_start_ticks": 1, "kernel_id": None, "connection_file": None,
                "notebook": None, "endpoint": f"ipc://{private}/{pid}.sock", "pub_endpoint": f"ipc://{private}/{pid}.sock.pub",
                "transport": "ipc", "key_file": str(private / f"{pid}.key"), "signature_scheme": "hmac-sha256",
                "protocol": 1, "started_ns": 1, "version": "0.1.0", **fields}
        discovery.write(discovery.discovery_path(pid, runtime), info)
        return _kernel_files(runtime, pid)

    def gone() -> int:
        proc = subprocess.Popen([sys.executable, "-c", "pass"])
        proc.wait()
        return proc.pid

    stale = leave(gone())
    unknown = leave(gone(), pid_ns=None)  # liveness unknown: elsewhere, left alone
    with kernel(tmp_path, GPUCLEANUP_FAKE_CUDA_SCENARIO=json.dumps(SCENARIO)) as kc:
        execute(kc, "%load_ext gpucleanup")
        pid = int(execute(kc, "import os; print(os.getpid())")["stdout"])
        assert [p for p in stale if os.path.lexists(p)] == []
        assert all(os.path.lexists(p) for p in unknown)
        assert all(os.path.lexists(p) for p in _kernel_files(runtime, pid))
