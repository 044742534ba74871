"""Reliability on a real GPU: a 500-cell soak with CuPy and PyTorch in one kernel, and a kernel killed while its
cleanup waits on its GPU.

- Soak: 500 cells in a real kernel (jupyter_client), CuPy and PyTorch allocating and freeing arrays of varying
  size, temporaries and kept ones, with gpucleanup loaded. The device's used memory after the cleanup of a late
  cell that keeps nothing must equal that after an early one (after warm-up: the frameworks' handles and library
  code are loaded once) within 16 MiB; every cell's own cleanup must have run (one record each).
- Kill: a kernel leaves about 20 s of GPU work queued (a spinning CUDA kernel); its cell's cleanup waits for it
  (``waiting for GPU0``, seen from outside) and the kernel is killed with SIGKILL meanwhile. ``gpucleanup ps`` must
  remove the dead kernel's files and list nothing, and the device memory the kernel held must be back.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import execute_cell as _execute, MiB, require, stop_kernel, subprocess_env

jupyter_client = pytest.importorskip("jupyter_client")
from jupyter_client.manager import start_new_kernel  # noqa: E402

CELLS = 500
WARM_UP = 20
SOAK_TOLERANCE = 16 * MiB


def _value(kc, expression: str):
    out = _execute(kc, f"import json as _j\nprint('VALUE ' + _j.dumps({expression}))")
    line = next(l for l in out.splitlines() if l.startswith("VALUE "))
    return json.loads(line[len("VALUE "):])


#: what the kernel's last record says GPU0 used after its cleanup, and how many records it keeps
_LAST = "(lambda h: {'used': h[-1]['devices'][0]['used_after_bytes'], 'n': len(h)})(" \
        "get_ipython().extension_manager.loaded and __import__('gpucleanup.in_kernel.extension', fromlist=['x'])" \
        ".get_extension(get_ipython()).history.last())"


def _cell(i: int) -> str:
    """Cell i of the soak: a deterministic mix of CuPy and PyTorch work, every fifth cell keeping nothing."""
    size = (1 + i % 7) << 20  # 1..7 Mi elements (4..28 MiB of float32)
    kinds = [
        f"a = cp.random.random({size}, dtype=cp.float32); b = (a * 2).sum(); del a, b",
        f"t = torch.randn({size}, device='cuda'); s = (t @ t).item(); del t",
        f"keep_cp.append(cp.ones({size // 4}, dtype=cp.float32))",
        f"keep_t.append(torch.ones({size // 4}, device='cuda'))",
        "keep_cp.clear(); keep_t.clear()",
    ]
    return kinds[i % len(kinds)]


def test_500_cells_with_cupy_and_pytorch_leave_device_memory_where_it_was():
    require("cupy")
    require("torch")
    km, kc = start_new_kernel(kernel_name="python3", env=subprocess_env())
    try:
        _execute(kc, "%load_ext gpucleanup\n%config GPUCleanup.history_size = 1000")
        _execute(kc, "import cupy as cp, torch\nkeep_cp, keep_t = [], []")
        used_after_clear = {}
        started = time.monotonic()
        for i in range(CELLS):
            _execute(kc, _cell(i))
            if i % 5 == 4:  # the cell that keeps nothing: where the device should come back to
                used_after_clear[i] = _value(kc, _LAST)["used"]
        elapsed = time.monotonic() - started
        last = _value(kc, _LAST)
        early = used_after_clear[min(i for i in used_after_clear if i >= WARM_UP)]
        late = used_after_clear[max(used_after_clear)]
        values = list(used_after_clear.values())
        print(f"FIGURE soak: {CELLS} cells in {elapsed:.1f} s; GPU0 used after clearing cells: after warm-up "
              f"{early / MiB:.1f} MiB, at the end {late / MiB:.1f} MiB (min {min(values) / MiB:.1f}, "
              f"max {max(values) / MiB:.1f} MiB over {len(values)} clearing cells); records kept {last['n']}")
        assert abs(late - early) <= SOAK_TOLERANCE
        # one record per cell that used the GPU: the soak's cells, the import cell and the probes' own cells
        assert last["n"] >= CELLS
    finally:
        stop_kernel(km, kc)


def _cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpucleanup", *args], capture_output=True, text=True,
                          timeout=timeout, env=subprocess_env())


def _free_bytes() -> int:
    """GPU0's free memory, from a process of its own (this one never initialises CUDA)."""
    code = ("import ctypes; c = ctypes.CDLL('libcuda.so.1'); c.cuInit(0); d = ctypes.c_int(); c.cuDeviceGet(ctypes.byref(d), 0)\n"
            "ctx = ctypes.c_void_p(); c.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), d); c.cuCtxSetCurrent(ctx)\n"
            "f, t = ctypes.c_size_t(), ctypes.c_size_t(); c.cuMemGetInfo_v2(ctypes.byref(f), ctypes.byref(t)); print(f.value)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=subprocess_env())
    assert out.returncode == 0, out.stderr
    return int(out.stdout.strip())


def test_a_kernel_killed_while_its_cleanup_waits_on_the_gpu_is_cleaned_by_ps():
    require("cupy")
    before = _free_bytes()
    km, kc = start_new_kernel(kernel_name="python3", env=subprocess_env())
    pid = int(km.provisioner.process.pid)
    try:
        _execute(kc, "%load_ext gpucleanup")
        runtime = _value(kc, "__import__('jupyter_core.paths', fromlist=['x']).jupyter_runtime_dir()")
        _execute(kc, "import cupy as cp\nheld = cp.ones((1 << 28,), dtype=cp.float32)")  # 1 GiB
        files = [os.path.join(runtime, f"gpucleanup-{pid}.json")] + [
            os.path.join(runtime, "gpucleanup", f"{pid}{suffix}") for suffix in (".key", ".sock", ".sock.pub")]
        assert all(os.path.exists(f) for f in files), files
        # about 20 s of work left queued on the GPU: the cell's cleanup waits for it (settle_timeout is 30 s)
        kc.execute("spin = cp.RawKernel(r'''extern \"C\" __global__ void spin(long long c) {"
                   " long long s = clock64(); while (clock64() - s < c) {} }''', 'spin')\n"
                   "spin((1,), (1,), (cp.int64(20 * 2_000_000_000),))")
        deadline = time.monotonic() + 60
        state = None
        while time.monotonic() < deadline:  # bounded poll of the kernel's state, from outside
            status = _cli("status", str(pid), "--json")
            if status.returncode == 0:
                state = json.loads(status.stdout)["state"]
                if state.get("state") == "waiting":
                    break
            time.sleep(0.1)
        assert state is not None and state.get("state") == "waiting", state
        print(f"FIGURE kernel {pid} killed (SIGKILL) while {state['state']} for GPU{state.get('device')} "
              f"for {state.get('age_s', 0):.1f} s")
        os.kill(pid, signal.SIGKILL)
        km.provisioner.process.wait(timeout=60)
        ps = _cli("ps")
        print(f"FIGURE gpucleanup ps after the kill: exit {ps.returncode}: {ps.stderr.strip()}")
        assert ps.returncode == 1 and "no kernel with gpucleanup is running" in ps.stderr
        assert [f for f in files if os.path.exists(f)] == []
        assert json.loads(_cli("ps", "--json").stdout) == []
        # the driver tears the dead process's context down on its own time: a bounded poll
        deadline = time.monotonic() + 60
        while True:
            after = _free_bytes()
            if abs(after - before) <= 64 * MiB or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        print(f"FIGURE GPU0 free before the kernel {before / MiB:.0f} MiB, after its kill {after / MiB:.0f} MiB")
        assert abs(after - before) <= 64 * MiB
    finally:
        kc.stop_channels()
        if km.is_alive():
            km.shutdown_kernel(now=True)
        else:
            km.cleanup_resources()
