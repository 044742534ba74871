"""A park you can leave on, on real GPUs: it never loses a kernel.

- A kernel that has used two GPUs together (one cross-GPU copy in PyTorch) is refused before the lock, by
  ``gpucleanup park --check`` and ``gpucleanup park``, and keeps working (its cross-GPU copies too). The driver
  cannot restore such a process (tests/bench/park_facts.py measured it: CUDA_ERROR_INVALID_VALUE, the process
  lost), so nothing may start. Needs two GPUs.
- A parked kernel whose GPU was taken meanwhile: its next cell is refused at once with the sentence that says
  how much is missing and who holds it (no restore is tried: one without room was seen to lose the process);
  the kernel stays parked; once the other process has gone, the next cell resumes it with every byte equal.

Figures: ``FIGURE`` lines (run pytest with -s).
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
import time

import pytest

from conftest import GiB, gpu_count, require
from test_park_kernel_gpu import FILL, Kernel, used_mib

TIMEOUT = 300


def test_a_kernel_that_used_two_gpus_together_is_never_parked_and_keeps_working(tmp_path):
    count, why = gpu_count()
    if count < 2:
        pytest.skip(f"needs two GPUs ({why})")
    require("torch")
    kernel = Kernel(tmp_path)
    try:
        kernel.run("%load_ext gpucleanup")
        kernel.run("import torch\n"
                   "a = torch.arange(1 << 26, dtype=torch.float32, device='cuda:0')\n"
                   "b = a.to('cuda:1')\n"  # one cross-GPU copy: peer access is on from here
                   "torch.cuda.synchronize(0); torch.cuda.synchronize(1)")
        checked = kernel.cli("park", "--check", str(kernel.pid))
        print(f"FIGURE park --check of a two-GPU kernel: exit {checked.returncode}: {checked.stdout.strip()}")
        assert checked.returncode == 4, checked
        assert f"[gpucleanup.park.627] process {kernel.pid} uses 2 GPUs (GPU0 " in checked.stdout
        started = time.monotonic()
        done = kernel.cli("park", str(kernel.pid))
        refused_s = time.monotonic() - started
        print(f"FIGURE park of a two-GPU kernel refused in {refused_s:.2f} s: {done.stderr.strip()}")
        assert done.returncode == 4, done
        assert "it is not parked, because the driver cannot restore a process that has used two GPUs together" in \
            done.stderr
        assert used_mib(kernel.pid) > 0  # nothing was moved
        out = kernel.run("c = b.to('cuda:0'); print(bool(torch.equal(c, a)), float(b.sum()) == float(a.sum()))")
        assert "True True" in out, out
        status = kernel.cli("status", str(kernel.pid), "--json")
        assert '"state": "idle"' in status.stdout, status.stdout
    finally:
        kernel.close()


HOG = textwrap.dedent('''
    import sys, torch
    free, total = torch.cuda.mem_get_info(0)
    hold = torch.empty(free - (1 << 30), dtype=torch.uint8, device="cuda:0")
    print("holding", hold.numel(), flush=True)
    sys.stdin.read()  # until the test closes it
''')


def test_a_parked_kernel_whose_gpu_was_taken_refuses_its_cell_at_once_and_resumes_once_it_is_free(tmp_path):
    require("torch")
    kernel = Kernel(tmp_path, CUDA_VISIBLE_DEVICES="0")
    hog = None
    try:
        kernel.run("%load_ext gpucleanup")
        out = kernel.run(FILL["torch"].format(count=5 * GiB // 4) + "before = digest()\nprint(before)")
        before = [line for line in out.splitlines() if re.fullmatch(r"[0-9a-f]{64}", line)][0]
        held = used_mib(kernel.pid)
        done = kernel.cli("park", str(kernel.pid))
        assert done.returncode == 0, f"{done.stderr}\n{kernel.diagnose()}"
        assert used_mib(kernel.pid) == 0
        hog = subprocess.Popen([sys.executable, "-c", HOG], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                               env=kernel.env)
        assert hog.stdout.readline().startswith("holding "), "the other process could not take the GPU"
        started = time.monotonic()
        out, error = kernel.run_with_error("print(digest() == before)", timeout=120)
        refused_s = time.monotonic() - started
        print(f"FIGURE a cell of a parked kernel ({held} MiB) on a taken GPU refused in {refused_s:.2f} s: {error}")
        assert error is not None and error.startswith("KernelStillParked: this cell was not run: the kernel is still "
                                                      "parked ([gpucleanup.park.630] GPU0 lacks "), (out, error)
        assert f"held by pid {hog.pid}" in error, error
        assert "True" not in out  # none of the cell's code ran
        listed = kernel.cli("ps")
        assert "parked" in listed.stdout, listed.stdout
        refused = kernel.cli("resume", str(kernel.pid))
        assert refused.returncode == 6 and "[gpucleanup.park.630]" in refused.stderr, refused
        hog.stdin.close()
        assert hog.wait(timeout=120) == 0
        hog = None
        started = time.monotonic()
        out, error = kernel.run_with_error("print(digest() == before)", timeout=120)
        resumed_s = time.monotonic() - started
        print(f"FIGURE the next cell once the GPU was free: resumed and ran in {resumed_s:.2f} s: "
              f"{out.splitlines()[0] if out else error}")
        assert error is None, error
        assert out.splitlines()[0].startswith("gpucleanup · resumed "), out
        assert "True" in out.splitlines(), out
        assert used_mib(kernel.pid) > 0
    finally:
        if hog is not None:
            hog.kill()
            hog.wait()
        kernel.close()


def test_a_parked_kernel_whose_gpu_was_taken_still_shuts_down_at_once(tmp_path):
    require("torch")
    kernel = Kernel(tmp_path, CUDA_VISIBLE_DEVICES="0")
    hog = None
    try:
        kernel.run("%load_ext gpucleanup")
        kernel.run("import torch\nx = torch.ones(1 << 30, device='cuda')")
        assert kernel.cli("park", str(kernel.pid)).returncode == 0
        hog = subprocess.Popen([sys.executable, "-c", HOG], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                               env=kernel.env)
        assert hog.stdout.readline().startswith("holding "), "the other process could not take the GPU"
        started = time.monotonic()
        kernel.kc.stop_channels()
        kernel.km.shutdown_kernel(now=False)  # a shutdown request; killed only past shutdown_wait_time
        ended_s = time.monotonic() - started
        status = kernel.exit_status()
        print(f"FIGURE shutdown of a parked kernel on a taken GPU: {ended_s:.2f} s, exit status {status}")
        assert not kernel.km.is_alive()
        assert hog.poll() is None  # the other user's process is untouched
    finally:
        if hog is not None:
            hog.kill()
            hog.wait()
        kernel.stop()
