"""SIGTERM ends a kernel as cleanly as a shutdown request: its discovery file, key and sockets go with it.

Jupyter sends SIGTERM to a kernel that does not answer a shutdown request, and culling or restarting kernels does
the same. The native library's handler removes the status endpoint's files, then the default action ends the
process (exit status -15, as without gpucleanup). A handler someone else set for SIGTERM is left as it is. It
removes a path only while it is still the file the kernel wrote (another process's file put at the name since
stays: tests/python/test_shared_runtime.py).
"""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from conftest import FAKE_CUDA
from test_kernel import execute, kernel

pytest.importorskip("jupyter_client")


def _ours(runtime) -> list:
    found = [p.name for p in runtime.glob("gpucleanup-*.json")]
    found += [f"gpucleanup/{p.name}" for p in (runtime / "gpucleanup").glob("*") if p.suffix in (".key", ".sock", ".pub")]
    return sorted(found)


def _pid(kc) -> int:
    return int(execute(kc, "import os; print(os.getpid())")["stdout"])


def _instance(runtime, pid: int) -> str:
    """The instance (``<pid>-<random>``) the files of the kernel with ``pid`` are named from."""
    (path,) = runtime.glob(f"gpucleanup-{pid}-*.json")
    return path.name[len("gpucleanup-"):-len(".json")]


def _mine(runtime, pid: int) -> list:
    name = _instance(runtime, pid)
    return [f"gpucleanup-{name}.json", f"gpucleanup/{name}.key", f"gpucleanup/{name}.sock",
            f"gpucleanup/{name}.sock.pub"]


def _wait_gone(pid: int, limit_s: float = 30.0) -> None:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        try:
            # the kernel is this process's child: once dead it stays a zombie until its manager reaps it
            state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return
        if state in ("Z", "X"):
            return
        time.sleep(0.05)
    raise AssertionError(f"kernel {pid} still runs {limit_s} s after SIGTERM")


def test_sigterm_removes_the_kernels_files_and_ends_it(tmp_path):
    runtime = tmp_path / "runtime"
    with kernel(tmp_path, GPUCLEANUP_FAKE_CUDA_SCENARIO=json.dumps({"devices": [{"primary_active": True}]})) as kc:
        execute(kc, "%load_ext gpucleanup")
        pid = _pid(kc)
        mine = _mine(runtime, pid)
        assert set(mine) <= set(_ours(runtime))
        os.kill(pid, signal.SIGTERM)
        _wait_gone(pid)
        assert not set(mine) & set(_ours(runtime))


def test_a_sigterm_handler_set_before_loading_stays_the_users(tmp_path):
    runtime = tmp_path / "runtime"
    with kernel(tmp_path) as kc:
        execute(kc, "import signal\ncaught = []\nsignal.signal(signal.SIGTERM, lambda *a: caught.append(a[0]))")
        execute(kc, "%load_ext gpucleanup")
        pid = _pid(kc)
        mine = _mine(runtime, pid)
        assert set(mine) <= set(_ours(runtime))
        os.kill(pid, signal.SIGTERM)
        # the user's handler ran (in the main thread, at the next cell) and the kernel lives on
        seen = execute(kc, "print(caught)")
        assert seen["stdout"] == f"[{int(signal.SIGTERM)}]\n"
        assert set(mine) <= set(_ours(runtime))


SIGTERM_HANDLER = (
    "import ctypes, signal\n"
    "buf = ctypes.create_string_buffer(256)  # glibc's struct sigaction, the handler first\n"
    "assert ctypes.CDLL(None).sigaction(int(signal.SIGTERM), None, buf) == 0\n"
    "print(ctypes.c_void_p.from_buffer(buf).value or 0)"
)


def test_the_handler_is_set_at_load_and_the_default_put_back_at_unload(tmp_path):
    with kernel(tmp_path) as kc:
        assert execute(kc, SIGTERM_HANDLER)["stdout"] == "0\n"  # SIG_DFL
        execute(kc, "%load_ext gpucleanup")
        assert execute(kc, SIGTERM_HANDLER)["stdout"] != "0\n"
        execute(kc, "%unload_ext gpucleanup")
        assert execute(kc, SIGTERM_HANDLER)["stdout"] == "0\n"
        assert _ours(tmp_path / "runtime") == []


def test_a_discovery_file_rewritten_for_a_notebook_named_later_still_goes_on_sigterm(tmp_path):
    # naming the notebook rewrites the discovery file (a new inode): the handler is given the new file
    runtime = tmp_path / "runtime"
    with kernel(tmp_path, GPUCLEANUP_FAKE_CUDA_SCENARIO=json.dumps({"devices": [{"primary_active": True}]})) as kc:
        execute(kc, "%load_ext gpucleanup")
        pid = _pid(kc)
        mine = _mine(runtime, pid)
        first = os.stat(runtime / mine[0]).st_ino
        execute(kc, "__session__ = '/srv/named/later.ipynb'")
        execute(kc, "1")
        record = json.loads((runtime / mine[0]).read_text())
        assert record["notebook"] == "/srv/named/later.ipynb"
        assert os.stat(runtime / mine[0]).st_ino != first
        os.kill(pid, signal.SIGTERM)
        _wait_gone(pid)
        assert not set(mine) & set(_ours(runtime))


HANDLER_ONLY = r"""
import json, os, signal, sys
from gpucleanup import _native
ours, theirs, gone, directory = sys.argv[1:5]
for path in (ours, theirs):
    open(path, "w").write("written by this process\n")
os.mkdir(directory)
assert _native.sigterm_cleanup({"files": [ours, theirs, gone], "dirs": [directory]})
# someone else's file put at one of the names, and a file made at a name that was absent when the list was given
other = theirs + ".other"
open(other, "w").write("someone else's\n")
os.replace(other, theirs)
open(gone, "w").write("made after the list\n")
os.kill(os.getpid(), signal.SIGTERM)
"""


def test_the_handler_removes_only_what_is_still_the_file_it_was_given(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    from conftest import BUILD

    ours, theirs, gone, directory = (tmp_path / n for n in ("ours", "theirs", "gone", "dir"))
    env = dict(os.environ, GPUCLEANUP_LIBRARY=str(BUILD / "native" / "libgpucleanup.so"),
               PYTHONPATH=str(Path(__file__).resolve().parents[2] / "ipython_ext"))
    done = subprocess.run([sys.executable, "-c", HANDLER_ONLY, str(ours), str(theirs), str(gone), str(directory)],
                          env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == -signal.SIGTERM, done.stderr
    assert not ours.exists() and not directory.exists()
    assert theirs.read_text() == "someone else's\n"
    assert gone.read_text() == "made after the list\n"
