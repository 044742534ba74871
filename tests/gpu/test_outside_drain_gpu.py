"""`gpucleanup drain` gives back CuPy's and PyTorch's caches of a real kernel on a real GPU.

The kernel's automatic cleanup is paused (``%gpumem --off``) so that a 1 GiB CuPy temporary and a 512 MiB
PyTorch temporary stay cached after their cell; the drain from outside must empty both pools, and its reply
must say so per framework, as the kernel's pools themselves tell afterwards.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import execute_cell as _execute, require, stop_kernel, subprocess_env

jupyter_client = pytest.importorskip("jupyter_client")
from jupyter_client.manager import start_new_kernel  # noqa: E402

GiB = 1 << 30
MiB = 1 << 20


def _cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpucleanup.outside.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=subprocess_env())


def _cached(kc) -> dict:
    out = _execute(kc, "import json as _j\n"
                       "_p = cp.get_default_memory_pool()\n"
                       "print('CACHED ' + _j.dumps({'cupy': _p.total_bytes() - _p.used_bytes(), "
                       "'torch': torch.cuda.memory_reserved(0) - torch.cuda.memory_allocated(0)}))")
    line = next(l for l in out.splitlines() if l.startswith("CACHED "))
    return json.loads(line[len("CACHED "):])


def test_drain_from_outside_empties_cupys_and_torchs_caches_and_says_so():
    require("cupy")
    require("torch")
    km, kc = start_new_kernel(kernel_name="python3", env=subprocess_env())
    try:
        pid = int(km.provisioner.process.pid)
        _execute(kc, "%load_ext gpucleanup")
        _execute(kc, "%gpumem --off\nimport cupy as cp, torch\n"
                     "tmp = cp.ones((1 << 28,), dtype=cp.float32); del tmp\n"
                     "tmp = torch.ones((1 << 29) // 4, device='cuda'); del tmp\n"
                     "cp.cuda.runtime.deviceSynchronize(); torch.cuda.synchronize()")
        before = _cached(kc)
        assert before["cupy"] >= GiB and before["torch"] >= 512 * MiB, before

        result = _cli("drain", str(pid), "--json", "--drain-timeout", "30")
        assert result.returncode == 0, result.stderr
        part = json.loads(result.stdout)["result"]["kernel"]
        assert part["ran"] is True and part["error"] is None, part
        assert part["released_bytes"]["cupy"] == before["cupy"], part
        assert part["released_bytes"]["torch"] == before["torch"], part
        assert _cached(kc) == {"cupy": 0, "torch": 0}

        _execute(kc, "tmp = cp.ones((1 << 28,), dtype=cp.float32); del tmp")
        text = _cli("drain", str(pid), "--drain-timeout", "30")
        assert text.returncode == 0, text.stderr
        assert f"kernel {pid} GPU0: drained, released " in text.stdout and "(cupy 1.0 GiB" in text.stdout, text.stdout
        print(f"FIGURE gpucleanup drain of a kernel with 1 GiB cached by CuPy: {text.stdout.strip()}")
    finally:
        stop_kernel(km, kc)
