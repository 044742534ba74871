"""SIGTERM ends a kernel as cleanly as a shutdown request: its discovery file, key and sockets go with it.

Jupyter sends SIGTERM to a kernel that does not answer a shutdown request, and culling or restarting kernels does
the same. The native library's handler removes the status endpoint's files, then the default action ends the
process (exit status -15, as without gpucleanup). A handler someone else set for SIGTERM is left as it is.
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
        mine = [f"gpucleanup-{pid}.json", f"gpucleanup/{pid}.key", f"gpucleanup/{pid}.sock",
                f"gpucleanup/{pid}.sock.pub"]
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
        assert f"gpucleanup-{pid}.json" in _ours(runtime)
        os.kill(pid, signal.SIGTERM)
        # the user's handler ran (in the main thread, at the next cell) and the kernel lives on
        seen = execute(kc, "print(caught)")
        assert seen["stdout"] == f"[{int(signal.SIGTERM)}]\n"
        assert f"gpucleanup-{pid}.json" in _ours(runtime)


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
