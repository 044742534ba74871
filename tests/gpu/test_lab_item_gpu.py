"""The JupyterLab status item's figures on a real GPU: what the extension asks the server for, against nvidia-smi.

A real ``jupyter server`` with gpucleanup.server runs one CuPy notebook (2 GiB kept, 512 MiB more cached in
CuPy's pool). The test asks the server exactly what the extension asks every refresh
(``GET api/gpucleanup/kernels?sort=held&cards=``) and holds the item's text for that answer (the rule of
``tests/lab_item.py``) to nvidia-smi's figure for the kernel's process: the same text. Then the kernel is parked
through the server (the item's Park button does the same POST): the item says ``GPU parked <bytes>``, nvidia-smi
no longer lists the process; a cell resumes it and the item's figures are back.

The GPU machine has no browser. With ``GPUCLEANUP_ARTIFACTS=DIR`` the answers (``lab-item-idle.json``,
``lab-item-parked.json``, ``lab-item-resumed.json``, each with nvidia-smi's look beside it) are written there;
``tests/python/test_labextension.py`` draws them in the real extension in headless Chromium (the screenshot kept
in tests/bench/results/).

Self-contained: ``pytest tests/gpu/test_lab_item_gpu.py -s``; each figure is printed on a ``FIGURE`` line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import GiB, MiB, library_path, require

pytest.importorskip("jupyter_server")
pytest.importorskip("jupyter_client")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import server_harness  # noqa: E402  (tests/server_harness.py)
from lab_item import item_text  # noqa: E402  (tests/lab_item.py)

#: nvidia-smi counts in MiB; two looks a moment apart at an idle GPU differ by at most this
SMI_TOLERANCE = 8 * MiB

CELLS = ["%load_ext gpucleanup", "import cupy as cp",
         "%config GPUCleanup.release = 'idle'",
         "%config GPUCleanup.idle_release_s = 3600.0                          # the cache kept for the test",
         "kept = cp.ones((1 << 29,), dtype=cp.float32)                      # 2 GiB",
         "tmp = cp.ones((1 << 27,), dtype=cp.float32)\ndel tmp               # 512 MiB cached in CuPy's pool",
         "cp.cuda.Device().synchronize()"]


def smi_used(pid: int) -> dict:
    """nvidia-smi's memory for the process ``pid``, per GPU UUID (absent: not listed)."""
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,gpu_uuid,used_memory", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    rows = [[p.strip() for p in line.split(",")] for line in out.splitlines() if line.strip()]
    return {r[1]: int(r[2]) * MiB for r in rows if r[0] == str(pid) and r[2].isdigit()}


def save(name: str, answer: dict, smi: dict) -> None:
    where = os.environ.get("GPUCLEANUP_ARTIFACTS")
    if where:
        Path(where).mkdir(parents=True, exist_ok=True)
        (Path(where) / name).write_text(json.dumps({"answer": answer, "nvidia_smi": smi}, indent=1))


def test_the_status_items_figures_are_nvidia_smis_and_follow_a_park(tmp_path):
    require("cupy")
    try:
        subprocess.run(["nvidia-smi", "-L"], capture_output=True, timeout=60, check=True)
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"nvidia-smi cannot be run here: {exc}")
    server = server_harness.Server(tmp_path / "server", status_timeout=2.0,
                                   extra_env={"GPUCLEANUP_LIBRARY": library_path(), "PYTHONUNBUFFERED": "1"})
    nb = None
    try:
        nb = server_harness.Notebook(server, "fit.ipynb")
        for code in CELLS:
            out = nb.run(code)
            assert "Error" not in out, (code, out)
        pid = nb.discovery().pid
        time.sleep(1.0)  # idle, its idle-time release done
        answer = server.api("GET", "/api/gpucleanup/kernels?sort=held&cards=")
        smi = smi_used(pid)
        save("lab-item-idle.json", answer, smi)
        (entry,) = [e for e in answer["kernels"] if e["notebook"] == "fit.ipynb"]
        if not smi:
            pytest.skip("nvidia-smi lists no process of this PID namespace: the item shows the kernel's own pools")
        (held,) = entry["held"]
        said = item_text(entry)
        from_smi = item_text({"held": [dict(held, bytes=smi[held["uuid"]])]})
        print(f"FIGURE idle: item {said!r}; nvidia-smi {smi[held['uuid']] / MiB:.0f} MiB gives {from_smi!r}; "
              f"held {held['bytes'] / MiB:.0f} MiB (live {held['live_bytes'] / MiB:.0f}, cached "
              f"{held['cached_bytes'] / MiB:.0f}, outside {held['outside_bytes'] / MiB:.0f}, {held['source']})")
        assert held["source"] == "nvidia-smi" and abs(held["bytes"] - smi[held["uuid"]]) <= SMI_TOLERANCE
        assert said == from_smi
        assert held["live_bytes"] == 2 * GiB and held["cached_bytes"] >= 512 * MiB
        assert said.startswith(f"GPU{held['index']} ") and "cached)" in said

        # the item's Park button: POST api/gpucleanup/kernels/<id>/park
        response = server.request("POST", f"/api/gpucleanup/kernels/{entry['id']}/park", {}, token=True)
        done = response.json()
        print(f"FIGURE park: HTTP {response.status}: {done.get('message')}")
        if not done.get("ok"):
            pytest.skip(f"the kernel could not be parked here: {done.get('message')}")
        parked = server.api("GET", "/api/gpucleanup/kernels?sort=held&cards=")
        smi_parked = smi_used(pid)
        save("lab-item-parked.json", parked, smi_parked)
        (entry_parked,) = [e for e in parked["kernels"] if e["notebook"] == "fit.ipynb"]
        print(f"FIGURE parked: {entry_parked['parked']}; nvidia-smi for the process: {smi_parked}")
        assert entry_parked["parked"] and entry_parked["state"]["state"] == "parked"
        assert abs(entry_parked["parked"]["bytes"] - held["bytes"]) <= SMI_TOLERANCE
        assert entry_parked["held_bytes"] == 0 and sum(smi_parked.values()) == 0  # unlisted, or listed at 0 MiB

        out = nb.run("print(float(kept[:4].sum()))")  # a cell resumes it, the array intact
        assert out.startswith("gpucleanup · resumed ") and "4.0" in out.splitlines(), out
        time.sleep(1.0)
        resumed = server.api("GET", "/api/gpucleanup/kernels?sort=held&cards=")
        smi_resumed = smi_used(pid)
        save("lab-item-resumed.json", resumed, smi_resumed)
        (entry_resumed,) = [e for e in resumed["kernels"] if e["notebook"] == "fit.ipynb"]
        (held_resumed,) = entry_resumed["held"]
        print(f"FIGURE resumed: item {item_text(entry_resumed)!r}; nvidia-smi "
              f"{smi_resumed.get(held_resumed['uuid'], 0) / MiB:.0f} MiB")
        assert entry_resumed["parked"] is None and held_resumed["live_bytes"] == 2 * GiB
        assert abs(held_resumed["bytes"] - smi_resumed[held_resumed["uuid"]]) <= SMI_TOLERANCE
        assert item_text(entry_resumed).startswith(f"GPU{held['index']} ")
    finally:
        if nb is not None:
            nb.close()
        server.stop()
