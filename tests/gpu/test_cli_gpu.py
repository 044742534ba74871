"""`gpucleanup ps/status` against two real kernels on a real GPU, one with CuPy, one with PyTorch.

What each kernel holds, as `gpucleanup ps --json` reports it from outside, must match what the
kernel's own `%gpumem --json` says; a kernel whose cell left GPU work queued is reported as
waiting for the GPU while its settle waits; `status` latency is measured idle and busy.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time

import pytest

from conftest import execute_cell as _execute, require, stop_kernel, subprocess_env

jupyter_client = pytest.importorskip("jupyter_client")
from jupyter_client.manager import start_new_kernel  # noqa: E402

GiB = 1 << 30


def _gpumem_json(kc) -> dict:
    out = _execute(kc, "import json as _j\n_d = %gpumem --json\nprint('GPUMEM ' + _j.dumps(_d))")
    line = next(l for l in out.splitlines() if l.startswith("GPUMEM "))
    return json.loads(line[len("GPUMEM "):])


def _cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpucleanup.outside.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=subprocess_env())


def _holdings_from_gpumem(status: dict) -> dict:
    dev = next(d for d in status["devices"] if d["index"] == 0)
    return {name: (f["live_bytes"], f["cached_bytes"]) for name, f in dev["frameworks"].items()}


def _holdings_from_ps(entry: dict) -> dict:
    record = entry["status"]["last_record"]
    dev = next(d for d in record["devices"] if d["index"] == 0)
    return {name: (dev["live_bytes"].get(name, 0), dev["cached_bytes"].get(name, 0))
            for name in set(dev["live_bytes"]) | set(dev["cached_bytes"])}


def _status_latency(pid: int, n: int = 100) -> list[float]:
    """Median-ready list of `status` round trips (ms), through the same client the CLI uses."""
    code = (
        "import sys, time, json\n"
        "from gpucleanup.outside import cli; from gpucleanup.protocol import discovery, status_client\n"
        f"kernel = next(k for k in discovery.scan()[0] if k.pid == {pid})\n"
        "target = cli._target(kernel)\n"
        "times = []\n"
        f"for _ in range({n}):\n"
        "    t0 = time.perf_counter(); status_client.request(target, 'status', 2.0); times.append((time.perf_counter() - t0) * 1e3)\n"
        "print(json.dumps(times))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=subprocess_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_two_kernels_ps_matches_each_kernels_gpumem_and_shows_a_kernel_waiting_for_the_gpu():
    require("cupy")
    require("torch")
    env = subprocess_env()
    kernels = []
    try:
        km_cupy, kc_cupy = start_new_kernel(kernel_name="python3", env=env)
        kernels.append((km_cupy, kc_cupy))
        km_torch, kc_torch = start_new_kernel(kernel_name="python3", env=env)
        kernels.append((km_torch, kc_torch))
        pid_cupy = int(km_cupy.provisioner.process.pid)
        pid_torch = int(km_torch.provisioner.process.pid)

        for kc in (kc_cupy, kc_torch):
            _execute(kc, "%load_ext gpucleanup")
        _execute(kc_cupy, "import cupy as cp\nkept = cp.ones((1 << 28,), dtype=cp.float32)\n"
                          "tmp = cp.ones((1 << 29,), dtype=cp.float32); del tmp")
        _execute(kc_torch, "import torch\nkept = torch.ones(1 << 27, device='cuda')\n"
                           "tmp = torch.ones(1 << 28, device='cuda'); del tmp")
        own = {pid_cupy: _holdings_from_gpumem(_gpumem_json(kc_cupy)),
               pid_torch: _holdings_from_gpumem(_gpumem_json(kc_torch))}

        ps_json = _cli("ps", "--json")
        assert ps_json.returncode == 0, ps_json.stderr
        listed = {e["pid"]: e for e in json.loads(ps_json.stdout)}
        assert {pid_cupy, pid_torch} <= set(listed)
        for pid in (pid_cupy, pid_torch):
            assert _holdings_from_ps(listed[pid]) == own[pid]
        assert own[pid_cupy]["cupy"][0] == GiB          # 1 GiB live, the 2 GiB temporary freed
        assert own[pid_torch]["torch"][0] == GiB // 2   # 512 MiB live
        ps_text = _cli("ps")
        print("FIGURE gpucleanup ps (two kernels):\n" + ps_text.stdout)
        for pid, kc in ((pid_cupy, kc_cupy), (pid_torch, kc_torch)):
            print(f"FIGURE kernel {pid} %gpumem --json frameworks on GPU0: {own[pid]}")

        idle = _status_latency(pid_cupy)

        # A cell that leaves about 8 s of GPU work queued: its settle waits, the endpoint says so.
        spin = (
            "spin = cp.RawKernel(r'''extern \"C\" __global__ void spin(long long c) {"
            " long long s = clock64(); while (clock64() - s < c) {} }''', 'spin')\n"
            "spin((1,), (1,), (cp.int64(8 * 2_000_000_000),))"
        )
        msg_id = kc_cupy.execute(spin)
        waiting_text, seen = None, None
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            status = _cli("status", str(pid_cupy), "--json")
            if status.returncode == 0:
                seen = json.loads(status.stdout)["state"]
                if seen.get("state") == "waiting":
                    waiting_text = _cli("ps").stdout
                    break
            time.sleep(0.2)
        busy = _status_latency(pid_cupy, n=100)
        assert seen is not None and seen.get("state") == "waiting", seen
        assert seen["device"] == 0
        print("FIGURE gpucleanup ps while the CuPy kernel's settle waits:\n" + waiting_text)
        # let the cell finish
        while True:
            msg = kc_cupy.get_iopub_msg(timeout=60)
            if (msg["parent_header"].get("msg_id") == msg_id and msg["msg_type"] == "status"
                    and msg["content"]["execution_state"] == "idle"):
                break
        print(f"FIGURE status latency idle: median {statistics.median(idle):.3f} ms, max {max(idle):.3f} ms (n={len(idle)})")
        print(f"FIGURE status latency while a settle waits: median {statistics.median(busy):.3f} ms, "
              f"max {max(busy):.3f} ms (n={len(busy)})")
    finally:
        for km, kc in kernels:
            stop_kernel(km, kc)
