"""Parking as the culling policy on a GPU: a real ``jupyter server`` parks an idle PyTorch kernel
(``GPUCleanupServer.park_idle_after_s``) and later culls it (``MappingKernelManager.cull_idle_timeout``).

While parked, ``nvidia-smi`` shows 0 MiB for the kernel and its host memory holds the parked copy (its RSS); the
park leaves Jupyter's culling clock (the kernel's ``last_activity``) as the last cell left it. Culled, the kernel is
resumed before it exits; its process and its GPU memory are gone (its host memory with its process). Its files are
gone whether it ends by itself or by SIGTERM: with Jupyter's default ``shutdown_wait_time`` (5 s, SIGTERM at 2.5 s) a
16 GiB kernel is still resuming at the SIGTERM, whose handler removes its files, park lock included; with 60 s it
ends by itself.

Figures: ``FIGURE`` lines (run pytest with -s).
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import GiB, ROOT, library_path, require

sys.path.insert(0, str(ROOT / "tests"))
import server_harness  # noqa: E402  (tests/server_harness.py)

from gpucleanup.park import kernel_side as parking  # noqa: E402  (this tree's: PYTHONPATH=ipython_ext)

TIMEOUT = 300
CULL_AFTER_S = 40
CULLED = re.compile(r"Culling 'idle' kernel '\w+' \((?P<id>[0-9a-f-]+)\)")


def used_mib(pid: int) -> int:
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, timeout=60).stdout
    return sum(int(used) for p, used in (line.split(",") for line in out.strip().splitlines() if "," in line)
               if p.strip() == str(pid) and used.strip().isdigit())


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def wait_until(predicate, what: str, limit: float = TIMEOUT) -> float:
    started = time.monotonic()
    while not predicate():
        assert time.monotonic() - started < limit, f"not within {limit:.0f} s: {what}"
        time.sleep(0.1)
    return time.monotonic() - started


@pytest.mark.parametrize("gib, wait_s", [(4, None), (16, None), (16, 60)])
def test_a_parked_kernel_is_culled_and_gives_everything_back(tmp_path, gib, wait_s):
    require("torch")
    args = ["--GPUCleanupServer.park_idle_after_s=2", f"--MappingKernelManager.cull_idle_timeout={CULL_AFTER_S}",
            "--MappingKernelManager.cull_interval=1"]
    if wait_s is not None:
        args.append(f"--KernelManager.shutdown_wait_time={wait_s}")
    srv = server_harness.Server(tmp_path / "srv", *args, status_timeout=2.0,
                                extra_env={"GPUCLEANUP_LIBRARY": library_path(), "PYTHONUNBUFFERED": "1",
                                           "CUDA_VISIBLE_DEVICES": "0"})
    nb = None
    try:
        nb = server_harness.Notebook(srv, f"torch-{gib}.ipynb")
        nb.load_gpucleanup()
        out = nb.run(f"import torch\nx = torch.ones({gib} * (1 << 30) // 4, device='cuda')")
        assert "Error" not in out, out
        found = nb.discovery()
        pid = found.pid
        files = {"discovery file": found.path, "key": Path(found.key_file),
                 "park lock": parking.lock_path(found.key_file, pid)}
        used = used_mib(pid)
        assert used >= gib * 1024, used
        model = srv.api("GET", f"/api/kernels/{nb.kernel_id}?no_track_activity=1")
        while True:  # the last cell's messages all seen
            time.sleep(0.5)
            again = srv.api("GET", f"/api/kernels/{nb.kernel_id}?no_track_activity=1")
            if again == model and again["execution_state"] == "idle":
                break
            model = again

        parked_s = wait_until(lambda: nb.status()["state"]["state"] == "parked", "the server's automatic park")
        rss = rss_bytes(pid)
        assert used_mib(pid) == 0
        assert rss >= gib * GiB, rss
        assert srv.api("GET", f"/api/kernels/{nb.kernel_id}?no_track_activity=1")["last_activity"] == \
            model["last_activity"]
        print(f"FIGURE cull {gib} GiB (shutdown_wait_time {wait_s or 'default'}): {used} MiB on the GPU, parked "
              f"within {parked_s:.1f} s of idle: 0 MiB on the GPU, kernel RSS {rss / GiB:.1f} GiB, last_activity "
              f"unchanged")
        nb.close()
        nb = None

        wait_until(lambda: [m for m in CULLED.finditer(srv.log()) if m["id"] == found.kernel_id],
                   "the culler picks the parked kernel")
        shutdown_s = wait_until(lambda: srv.request("GET", f"/api/kernels/{found.kernel_id}?no_track_activity=1",
                                                    token=True).status == 404, "the culler's shutdown ends", 120)
        wait_until(lambda: not Path(f"/proc/{pid}").exists(), "the culled kernel's process is gone", 120)
        left = {name: str(path) for name, path in files.items() if path.exists()}
        print(f"FIGURE cull {gib} GiB (shutdown_wait_time {wait_s or 'default'}): shutdown ended {shutdown_s:.1f} s "
              f"after the culler picked it; GPU memory of pid {pid}: {used_mib(pid)} MiB; "
              f"files left: {left or 'none'}")
        assert used_mib(pid) == 0
        assert left == {}, left  # its close(), or its SIGTERM handler, removed every file
    finally:
        if nb is not None:
            nb.close()
        srv.stop()
        print("LOG " + "\nLOG ".join(line for line in srv.log().splitlines()
                                     if "gpucleanup:" in line or "Cull" in line or "shutdown" in line.lower()))
