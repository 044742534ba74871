"""Real-GPU tests: skipped unless a real CUDA driver sees at least one device.

The check runs in a subprocess (cuInit there, never in the test process: a parent's
cuInit breaks CUDA in forked children). Every scenario also runs in its own fresh
subprocess (``run_script``), so frameworks never meet unless a test wants them to,
and "nothing initialised CUDA before" holds where a test relies on it.

Each test prints its figures in lines starting with ``FIGURE `` (run pytest with -s).

Environment: GPUCLEANUP_LIBRARY selects libgpucleanup.so; otherwise the package's own,
else the one of an installed gpucleanup wheel on sys.path, else build/native/.
"""

from __future__ import annotations

import functools
import json
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "ipython_ext"
MiB = 1 << 20
GiB = 1 << 30
TOLERANCE = 64 * MiB

_CHECK = r"""
import ctypes, sys
try:
    cuda = ctypes.CDLL("libcuda.so.1")
except OSError as exc:
    print("no libcuda.so.1:", exc); sys.exit(0)
if cuda.cuInit(0) != 0:
    print("cuInit failed"); sys.exit(0)
n = ctypes.c_int(0)
print("devices", n.value if cuda.cuDeviceGetCount(ctypes.byref(n)) != 0 else n.value)
"""


@functools.lru_cache(maxsize=None)
def gpu_count() -> tuple[int, str]:
    try:
        out = subprocess.run([sys.executable, "-c", _CHECK], capture_output=True, text=True, timeout=120,
                             env=_clean_env()).stdout.strip()
    except (OSError, subprocess.TimeoutExpired) as exc:
        return 0, f"GPU check failed: {exc}"
    if out.startswith("devices "):
        return int(out.split()[1]), out
    return 0, out or "no output from the GPU check"


def library_path() -> str | None:
    if os.environ.get("GPUCLEANUP_LIBRARY"):
        return os.environ["GPUCLEANUP_LIBRARY"]
    own = PACKAGE / "gpucleanup" / "libgpucleanup.so"
    if own.exists():
        return str(own)
    for entry in sys.path:
        candidate = pathlib.Path(entry or ".") / "gpucleanup" / "libgpucleanup.so"
        if candidate.exists():
            return str(candidate)
    built = ROOT / "build" / "native" / "libgpucleanup.so"
    return str(built) if built.exists() else None


def _clean_env() -> dict:
    env = dict(os.environ)
    env.pop("GPUCLEANUP_LIBCUDA", None)  # tests/python points it at the fake driver
    env["PYTHONUNBUFFERED"] = "1"
    return env


def subprocess_env(**extra: str) -> dict:
    env = _clean_env()
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(PACKAGE), env.get("PYTHONPATH", "")) if p)
    lib = library_path()
    if lib:
        env["GPUCLEANUP_LIBRARY"] = lib
    # GPUCLEANUP_TEST_CRASH_BACKTRACE: a built tests/gpu/native/crash_backtrace.c, preloaded into every process
    # a GPU test starts, which then writes the native stack of a thread that dies of a fatal signal to its stderr
    # (scripts/gpu_run.sh park-loop sets it).
    preload = os.environ.get("GPUCLEANUP_TEST_CRASH_BACKTRACE")
    if preload and os.path.exists(preload):
        env["LD_PRELOAD"] = " ".join(p for p in (preload, env.get("LD_PRELOAD", "")) if p)
    env.update(extra)
    return env


def pytest_collection_modifyitems(config, items):
    here = pathlib.Path(__file__).resolve().parent
    mine = [item for item in items if here in pathlib.Path(str(item.fspath)).resolve().parents]
    if not mine:
        return
    count, why = gpu_count()
    if count < 1:
        skip = pytest.mark.skip(reason=f"no CUDA GPU here ({why})")
    elif library_path() is None:
        skip = pytest.mark.skip(reason="libgpucleanup.so not found: build it or set GPUCLEANUP_LIBRARY")
    else:
        return
    for item in mine:
        item.add_marker(skip)


def run_script(*parts: str, timeout: float = 300, **env: str) -> dict:
    """Runs the code ``parts`` (each dedented) in a fresh Python; it reports with
    ``result(**values)`` (JSON on the last line).

    Lines it prints that start with ``FIGURE `` are printed here too.
    """
    prelude = textwrap.dedent('''
        import json as _json, sys as _sys
        def result(**values):
            print("RESULT " + _json.dumps(values))
        def figure(text):
            print("FIGURE " + text, flush=True)
    ''')
    proc = subprocess.run([sys.executable, "-c", prelude + "".join(textwrap.dedent(p) for p in parts)], capture_output=True,
                          text=True, timeout=timeout, env=subprocess_env(**env), cwd=str(ROOT))
    for line in proc.stdout.splitlines():
        if line.startswith("FIGURE "):
            print(line)
    results = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not results:
        raise AssertionError(f"script failed (rc {proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}")
    return json.loads(results[-1][len("RESULT "):])


def require(module: str) -> None:
    """Skip when the GPU machine lacks a framework (checked in a subprocess: importing jax or
    torch here would drag them into every other test's process)."""
    proc = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, env=subprocess_env())
    if proc.returncode != 0:
        pytest.skip(f"{module} is not installed here")


# A cell's code (escaped to sit inside a run("...") call of a test's script): five threads that each push
# PyCUDA's autoinit context (ctx), keep a 64 MiB drv.mem_alloc in ``kept`` and pop the context. The
# allocation is on line 6 of the cell, in work().
PYCUDA_THREADS = (
    "kept = []\\n"
    "lock = threading.Lock()\\n"
    "def work():\\n"
    "    ctx.push()\\n"
    "    try:\\n"
    "        block = drv.mem_alloc(64 << 20)\\n"
    "        with lock:\\n"
    "            kept.append(block)\\n"
    "    finally:\\n"
    "        ctx.pop()\\n"
    "threads = [threading.Thread(target=work) for _ in range(5)]\\n"
    "for t in threads:\\n"
    "    t.start()\\n"
    "for t in threads:\\n"
    "    t.join()"
)


def execute_cell(kc, code: str, timeout: float = 120) -> str:
    """Runs a cell in a real kernel through its jupyter_client client, returns its stdout; fails on an error in
    the cell."""
    import time

    msg_id = kc.execute(code)
    out, error = [], None
    deadline = time.monotonic() + timeout
    while True:
        msg = kc.get_iopub_msg(timeout=max(0.1, deadline - time.monotonic()))
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        kind, content = msg["msg_type"], msg["content"]
        if kind == "stream" and content["name"] == "stdout":
            out.append(content["text"])
        elif kind == "display_data" and "gpucleanup" in content.get("metadata", {}):
            out.append(content["data"]["text/plain"] + "\n")  # gpucleanup's own output, after the cell's
        elif kind == "error":
            error = f"{content['ename']}: {content['evalue']}"
        elif kind == "status" and content["execution_state"] == "idle":
            break
    while kc.get_shell_msg(timeout=timeout)["parent_header"].get("msg_id") != msg_id:
        pass  # a reply to an earlier request (wait_for_ready's kernel_info) still queued
    assert error is None, error
    return "".join(out)


def stop_kernel(km, kc=None) -> None:
    """Stops a kernel as Jupyter does: a shutdown request, and a kill only if it has not ended within
    ``km.shutdown_wait_time`` (5 s). ``GPUCLEANUP_SHUTDOWN_WAIT_S`` lengthens that wait: under
    compute-sanitizer a kernel ends slowly, and a killed process cannot write its sanitizer report
    (``scripts/gpu_run.sh memcheck`` sets it; on the H100 this did not bring back the kernels' missing
    reports, see BENCHMARKS.md)."""
    if kc is not None:
        kc.stop_channels()
    wait = os.environ.get("GPUCLEANUP_SHUTDOWN_WAIT_S")
    if wait:
        km.shutdown_wait_time = float(wait)
    km.shutdown_kernel(now=False)
