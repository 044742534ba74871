"""Parking a Jupyter kernel against restarting it, side by side, by the bytes parked.

For each case (default: 1, 8 and 32 GiB of PyTorch tensors; JAX at its default preallocation on one visible
GPU), a real ipykernel with ``%load_ext gpucleanup`` runs its set-up cell (import the framework, build the
data from a seeded generator), then:

- park: ``gpucleanup park PID`` from another process, end to end; the kernel's device memory from
  ``nvidia-smi`` before and while parked, its host RSS while parked;
- resume: the next cell (``digest() == before``: a SHA-256 of every byte, compared with the one taken
  before the park) and the resume time its line states;
- the alternative: the kernel restarted (``KernelManager.restart_kernel``) and its set-up cell run again,
  timed from the restart request until that cell is done.

Usage: python tests/bench/bench_park_kernels.py [--sizes 1,8,32] [--no-jax] [--json PATH]
Needs a GPU, nvidia-smi, ipykernel, PyTorch (and JAX for its row); one line per case.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "gpu"))
sys.path.insert(0, str(ROOT / "tests"))
import kernel_harness  # noqa: E402  (tests/kernel_harness.py)
from test_park_gpu import used_mib  # noqa: E402  (nvidia-smi's figure for one pid)

GiB = 1 << 30
TIMEOUT = 900

SETUP = {
    "torch": ("import torch, hashlib\n"
              "g = torch.Generator(device='cuda').manual_seed(7)\n"
              "data = [torch.rand({count}, device='cuda', generator=g) for _ in range({parts})]\n"
              "def digest():\n    h = hashlib.sha256()\n    for d in data:\n"
              "        for i in range(0, d.shape[0], 1 << 26):\n            h.update(d[i:i + (1 << 26)].cpu().numpy().tobytes())\n"
              "    return h.hexdigest()\n"),
    "jax": ("import jax, numpy as np, hashlib\n"
            "data = [jax.random.uniform(jax.random.PRNGKey(7), ({count},), dtype='float32')]\n"
            "def digest(): return hashlib.sha256(np.asarray(data[0]).tobytes()).hexdigest()\n"),
}


class Kernel(kernel_harness.Kernel):
    """A real ipykernel (tests/kernel_harness.py) that can be restarted as Jupyter restarts one."""

    def __init__(self, workdir: pathlib.Path, env: dict):
        super().__init__(env, python=sys.executable, cwd=workdir, ready=TIMEOUT, timeout=TIMEOUT)

    def run(self, code: str) -> str:
        """The cell's stdout and gpucleanup's lines; an error in the cell raises RuntimeError."""
        cell = self.execute(code)
        if cell.error is not None:
            raise RuntimeError(cell.error_line)
        return cell.printed

    def restart(self) -> None:
        self.kc.stop_channels()
        self.km.restart_kernel(now=False)
        self.process, self.pid = self.km.provisioner.process, self.km.provisioner.pid
        self.kc = self.km.client()
        self.kc.start_channels()
        self.wait_ready(TIMEOUT)

    def close(self) -> None:
        self.stop(now=False)


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as fh:
        return next(int(line.split()[1]) * 1024 for line in fh if line.startswith("VmRSS"))


def case(label: str, framework: str, setup: str, extra: dict) -> dict:
    workdir = pathlib.Path(tempfile.mkdtemp(prefix="gpucleanup-bench-"))
    env = dict(os.environ, JUPYTER_RUNTIME_DIR=str(workdir / "runtime"), CUDA_VISIBLE_DEVICES="0", **extra)
    # gpucleanup park finds the kernel in its runtime directory; its helpers see every GPU (share/FACTS.md §10)
    helpers = dict(os.environ, JUPYTER_RUNTIME_DIR=env["JUPYTER_RUNTIME_DIR"])
    kernel = Kernel(workdir, env)
    try:
        kernel.run("%load_ext gpucleanup")
        began = time.monotonic()
        kernel.run(setup)
        setup_s = time.monotonic() - began
        kernel.run("before = digest()")  # every byte's SHA-256, to compare after the resume (not set-up time)
        device_before = used_mib(kernel.pid)
        began = time.monotonic()
        parked = subprocess.run([sys.executable, "-m", "gpucleanup.outside.cli", "park", str(kernel.pid)], capture_output=True,
                                text=True, env=helpers, timeout=TIMEOUT)
        park_s = time.monotonic() - began
        if parked.returncode != 0:
            return {"case": label, "parked": False, "message": (parked.stderr or parked.stdout).strip()}
        device_parked = used_mib(kernel.pid)
        rss_parked = rss(kernel.pid)
        began = time.monotonic()
        out = kernel.run("print(digest() == before)")
        next_cell_s = time.monotonic() - began
        resumed = re.search(r"resumed .* in ([0-9.]+) s", out)
        began = time.monotonic()
        kernel.restart()
        kernel.run(setup)
        restart_s = time.monotonic() - began
        return {"case": label, "parked": True, "setup_s": setup_s, "device_before_mib": device_before,
                "park_s": park_s, "device_parked_mib": device_parked, "host_rss_parked_bytes": rss_parked,
                "resume_s": float(resumed.group(1)) if resumed else None, "next_cell_s": next_cell_s,
                "equal": "True" in out.splitlines(), "restart_and_setup_s": restart_s, "park_line": parked.stdout.strip()}
    finally:
        kernel.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1,8,32", help="GiB of PyTorch tensors, comma-separated")
    parser.add_argument("--no-jax", action="store_true", help="leave out JAX at its default preallocation")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    cases = []
    for size in (int(s) for s in args.sizes.split(",") if s):
        parts = max(1, size)
        setup = SETUP["torch"].format(count=GiB // 4, parts=parts)
        cases.append((f"PyTorch, {size} GiB", "torch", setup, {}))
    if not args.no_jax:
        cases.append(("JAX, default preallocation", "jax", SETUP["jax"].format(count=GiB // 4), {}))
    results = []
    for label, framework, setup, extra in cases:
        try:
            result = case(label, framework, setup, extra)
        except Exception as exc:  # one case's failure is its row, the next case still runs
            result = {"case": label, "error": f"{type(exc).__name__}: {exc}"}
        results.append(result)
        print(json.dumps(result), flush=True)
        if args.json:
            pathlib.Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
