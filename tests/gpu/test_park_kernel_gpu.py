"""Parking real kernels (issue 26): a CuPy, a PyTorch and a JAX notebook (one visible GPU) parked and resumed.

Each kernel fills device memory from a seeded generator and keeps a SHA-256 of every byte. It is parked
either by ``%gpumem --park`` (after its cell) or by ``gpucleanup park PID`` from outside; while parked,
``nvidia-smi --query-compute-apps`` shows 0 MiB for its process (the context goes too) and ``gpucleanup ps``
says ``parked``. Its next cell is resumed first, says so in one line, and finds every byte equal.

Figures: ``FIGURE`` lines (run pytest with -s).
"""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import GiB, ROOT, require, stop_kernel, subprocess_env

sys.path.insert(0, str(ROOT / "tests"))
import kernel_harness  # noqa: E402  (tests/kernel_harness.py)

TIMEOUT = 300
RESUME_TIMEOUT = 120  # a resume of these sizes takes seconds: past this the kernel is stuck

FILL = {
    "cupy": ("import cupy as cp, hashlib\n"
             "data = cp.random.default_rng(7).random({count}, dtype=cp.float32)\n"
             "def digest(): return hashlib.sha256(cp.asnumpy(data).tobytes()).hexdigest()\n"),
    "torch": ("import torch, hashlib\n"
              "g = torch.Generator(device='cuda').manual_seed(7)\n"
              "data = torch.rand({count}, device='cuda', generator=g)\n"
              "def digest(): return hashlib.sha256(data.cpu().numpy().tobytes()).hexdigest()\n"),
    "jax": ("import jax, numpy as np, hashlib\n"
            "data = jax.random.uniform(jax.random.PRNGKey(7), ({count},), dtype='float32')\n"
            "def digest(): return hashlib.sha256(np.asarray(data).tobytes()).hexdigest()\n"),
}


def used_mib(pid: int) -> int:
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, timeout=60).stdout
    return sum(int(used) for p, used in (line.split(",") for line in out.strip().splitlines() if "," in line)
               if p.strip() == str(pid) and used.strip().isdigit())


class Kernel(kernel_harness.Kernel):
    """A real ipykernel on this machine's GPUs (tests/kernel_harness.py); a kernel that dies in a cell fails it
    at once, with :meth:`diagnose`."""

    def __init__(self, tmp_path: Path, **env: str):
        self.output = tmp_path / "kernel-output.txt"  # the kernel's own stdout and stderr (a failure says them)
        with open(self.output, "wb") as output:
            super().__init__(subprocess_env(JUPYTER_RUNTIME_DIR=str(tmp_path / "runtime"),
                                            IPYTHONDIR=str(tmp_path / "ipython"), **env),
                             python=sys.executable, cwd=tmp_path, stdout=output, stderr=output, ready=TIMEOUT,
                             timeout=TIMEOUT)

    def run(self, code: str, timeout: float = TIMEOUT) -> str:
        """The cell's stdout and gpucleanup's lines; fails on an error in the cell (queue.Empty: no message
        within ``timeout`` seconds)."""
        out, error = self.run_with_error(code, timeout)
        assert error is None, error
        return out

    def run_with_error(self, code: str, timeout: float = TIMEOUT) -> tuple:
        """The cell's stdout and gpucleanup's lines, and its error (``ename: evalue``) or None."""
        cell = self.execute(code, timeout, watch=True)
        return cell.printed, cell.error_line

    def cli(self, *args: str) -> subprocess.CompletedProcess:
        return self.cli_env({}, *args)

    def cli_env(self, extra: dict, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "gpucleanup.outside.cli", *args], capture_output=True, text=True,
                              env={**self.env, **extra}, timeout=TIMEOUT)

    def close(self) -> None:
        stop_kernel(self.km, self.kc)

    def dump_on_signal(self) -> None:
        """The kernel writes every Python thread's stack to a file on SIGUSR2 (for :meth:`diagnose`), and to
        another file on a fatal signal (a crash then says where each thread was: ipykernel's stderr is a pipe
        that dies with the process)."""
        self.stacks = self.runtime.parent / "stacks.txt"
        self.crash = self.runtime.parent / "crash.txt"
        self.run(f"import faulthandler as _fh, signal as _sig\n"
                 f"_fh.register(_sig.SIGUSR2, file=open({str(self.stacks)!r}, 'w'), all_threads=True)\n"
                 f"_fh.enable(file=open({str(self.crash)!r}, 'w'), all_threads=True)\n"
                 "del _fh, _sig")

    def diagnose(self) -> str:
        """What the kernel's threads do now (a failure's message): ps and status asked again with 5 s each,
        each thread's name, state and wait channel (and kernel stack where readable), every Python stack."""
        out = [f"kernel {self.pid}: exit status {self.exit_status()}"]
        for args in (("ps", "--timeout", "5"), ("status", str(self.pid), "--json", "--timeout", "5")):
            started = time.monotonic()
            done = self.cli(*args)
            out.append(f"$ gpucleanup {' '.join(args)} ({time.monotonic() - started:.2f} s, rc {done.returncode})\n"
                       f"{done.stdout}{done.stderr}")
        for task in sorted(Path(f"/proc/{self.pid}/task").glob("*")):
            def read(name):
                try:
                    return (task / name).read_text(errors="replace").strip()
                except OSError as exc:
                    return f"({exc.strerror})"
            state = read("stat").rsplit(")", 1)[-1].split()[:1]
            out.append(f"thread {task.name} {read('comm')!r} state {state} wchan {read('wchan')}\n{read('stack')}")
        stacks = getattr(self, "stacks", None)
        if stacks is not None and self.exit_status() is None:
            os.kill(self.pid, signal.SIGUSR2)
            time.sleep(1.0)  # faulthandler writes from its signal handler, without the GIL
            out.append("Python stacks:\n" + (stacks.read_text(errors="replace") if stacks.exists() else "(none written)"))
        crash = getattr(self, "crash", None)
        if crash is not None and crash.exists() and crash.stat().st_size:
            out.append("a fatal signal's Python stacks:\n" + crash.read_text(errors="replace")[-6000:])
        output = self.output.read_text(errors="replace") if self.output.exists() else ""
        out.append("the kernel's stdout and stderr (last 6000 characters):\n" + output[-6000:])
        return "\n".join(out)


@pytest.mark.parametrize("framework, how", [("cupy", "magic"), ("torch", "command"), ("jax", "command")])
def test_a_notebook_is_parked_to_zero_and_resumed_with_every_byte(framework, how, tmp_path):
    require(framework)
    env = {"CUDA_VISIBLE_DEVICES": "0"} if framework == "jax" else {}
    if framework == "jax":
        env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = "0.05"
    kernel = Kernel(tmp_path, **env)
    try:
        kernel.dump_on_signal()
        kernel.run("%load_ext gpucleanup")
        out = kernel.run(FILL[framework].format(count=GiB // 4) + "before = digest()\nprint(before)")
        before = [line for line in out.splitlines() if re.fullmatch(r"[0-9a-f]{64}", line)][0]
        used = used_mib(kernel.pid)
        assert used > 0
        started = time.monotonic()
        if how == "magic":
            out = kernel.run("%gpumem --park")
            assert "gpucleanup · parked " in out, out
        else:
            done = kernel.cli("park", str(kernel.pid))
            assert done.returncode == 0, f"{done.stderr}\n{kernel.diagnose()}"
            out = done.stdout
        parked_s = time.monotonic() - started
        assert used_mib(kernel.pid) == 0
        listed = kernel.cli("ps")
        assert "parked" in listed.stdout, f"{listed.stdout}\n{kernel.diagnose()}"
        print(f"FIGURE park kernel {framework} ({how}): {used} MiB -> 0 MiB in {parked_s:.2f} s: {out.strip()}")

        started = time.monotonic()
        try:
            out = kernel.run("print(digest() == before)", timeout=RESUME_TIMEOUT)
        except queue.Empty:
            pytest.fail(f"the next cell said nothing for {RESUME_TIMEOUT} s while resuming\n{kernel.diagnose()}")
        resumed_s = time.monotonic() - started
        lines = out.splitlines()
        assert lines[0].startswith("gpucleanup · resumed "), out
        assert "True" in lines, out
        assert used_mib(kernel.pid) > 0
        print(f"FIGURE resume kernel {framework}: next cell in {resumed_s:.2f} s: {lines[0]}")
        status = json.loads(kernel.cli("status", str(kernel.pid), "--json").stdout)
        assert status["state"]["state"] == "idle"
    finally:
        kernel.close()


def test_a_parked_kernel_shuts_down_without_hanging(tmp_path):
    require("torch")
    kernel = Kernel(tmp_path)
    try:
        kernel.run("%load_ext gpucleanup")
        kernel.run("import torch\nx = torch.ones(1 << 28, device='cuda')")
        assert kernel.cli("park", str(kernel.pid)).returncode == 0
        assert used_mib(kernel.pid) == 0
        started = time.monotonic()
        kernel.kc.stop_channels()
        kernel.km.shutdown_kernel(now=False)  # a shutdown request; killed only past shutdown_wait_time
        print(f"FIGURE shutdown of a parked kernel: {time.monotonic() - started:.2f} s")
        assert not kernel.km.is_alive()
        assert not (kernel.runtime / f"gpucleanup-{kernel.pid}.json").exists()  # ended by itself, files removed
    finally:
        kernel.stop()


def test_a_kernel_holding_managed_memory_is_refused_before_any_lock_and_the_drivers_refusal_is_remembered(tmp_path):
    # issue 50, case 6: CuPy's pool on malloc_managed; the driver's checkpoint refuses it (CUDA_ERROR_NOT_SUPPORTED)
    require("cupy")
    kernel = Kernel(tmp_path)
    try:
        kernel.run("%load_ext gpucleanup")
        kernel.run("import cupy as cp\npool = cp.cuda.MemoryPool(cp.cuda.malloc_managed)\n"
                   "cp.cuda.set_allocator(pool.malloc)\nm = cp.ones(1 << 28, dtype=cp.float32)\n"
                   "cp.cuda.Device().synchronize()")
        # seen from outside in its mappings of /dev/nvidia-uvm: refused before anything is locked
        check = kernel.cli("park", "--check", str(kernel.pid))
        refused = kernel.cli("park", str(kernel.pid))
        print(f"FIGURE managed: park --check: rc {check.returncode}: {check.stdout.strip()}")
        print(f"FIGURE managed: park: rc {refused.returncode}: {refused.stderr.strip()}")
        assert check.returncode == 4 and "[gpucleanup.park.653]" in check.stdout and "1.0 GiB" in check.stdout, check
        assert refused.returncode == 4 and "[gpucleanup.park.653]" in refused.stderr, refused
        # tried all the same: the driver refuses it, the process runs on, and no park is tried again before a cell
        tried = kernel.cli_env({"GPUCLEANUP_PARK_UNPROVEN": "managed"}, "park", str(kernel.pid))
        print(f"FIGURE managed: park tried all the same: rc {tried.returncode}: {tried.stderr.strip()}")
        assert tried.returncode == 6, f"{tried.stdout}{tried.stderr}\n{kernel.diagnose()}"
        assert "CUDA_ERROR_NOT_SUPPORTED (the process holds memory the driver's checkpoint does not support" \
            in tried.stderr
        again = kernel.cli_env({"GPUCLEANUP_PARK_UNPROVEN": "managed"}, "park", str(kernel.pid))
        assert again.returncode == 4 and "[gpucleanup.park.652]" in again.stderr, again
        # the kernel runs as before; a cell frees the managed memory: nothing of it is left in the mappings
        out = kernel.run("print(float(m.sum()))\ndel m\npool.free_all_blocks()\n"
                         "cp.cuda.set_allocator(cp.get_default_memory_pool().malloc)\n"
                         "x = cp.ones(1 << 26, dtype=cp.float32)\ncp.cuda.Device().synchronize()")
        assert "268435456.0" in out, out
        check = kernel.cli("park", "--check", str(kernel.pid))
        print(f"FIGURE managed: park --check after the cell that freed it: rc {check.returncode}: "
              f"{check.stdout.strip()}")
        # nothing of it in the mappings now, but the driver fails every later checkpoint of a process it refused
        # (CUDA_ERROR_UNKNOWN, tests/gpu/probe_managed.py): the memo stands, and no park is tried
        assert check.returncode == 4 and "[gpucleanup.park.652]" in check.stdout, check
        assert "[gpucleanup.park.653]" not in check.stdout, check
        again = kernel.cli("park", str(kernel.pid))
        assert again.returncode == 4 and "[gpucleanup.park.652]" in again.stderr, again
        out = kernel.run("print(float(x.sum()))", timeout=RESUME_TIMEOUT)
        assert "67108864.0" in out, out
    finally:
        kernel.close()
