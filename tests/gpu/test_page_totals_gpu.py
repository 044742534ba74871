"""The page's per-GPU totals (GET api/gpucleanup/kernels, the admin's view) against nvidia-smi on a real GPU.

A real ``jupyter server`` with gpucleanup.server runs three notebooks with CuPy (1 GiB, 2 GiB kept with 512 MiB
more cached in CuPy's pool, 512 MiB), and one plain Python process with CuPy and no gpucleanup keeps 1.5 GiB on
the same GPU. Then, per GPU, the page's figures must be nvidia-smi's: used of total, each kernel's memory (its
process's, as nvidia-smi lists it), held by kernels with gpucleanup being the sum of the rows, split into live
(each kernel's own %gpumem --json), cached and outside every pool, and the rest being the process without
gpucleanup (and whatever else nvidia-smi sees there). Then "park the kernels idle for more than 0 s" previews
the three and parks them (where the driver can park): what it gave back is what the preview said, and nvidia-smi
sees the GPU's memory fall by that much.

Self-contained: ``pytest tests/gpu/test_page_totals_gpu.py -s`` on the GPU machine; every figure compared is
printed on a ``FIGURE`` line. With ``GPUCLEANUP_ARTIFACTS=DIR`` the API's answers are written there
(``page-totals-before.json``, ``page-totals-after.json``) for ``scripts/page_snapshot.sh``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import GiB, MiB, library_path, require, subprocess_env

pytest.importorskip("jupyter_server")
pytest.importorskip("jupyter_client")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import server_harness  # noqa: E402  (tests/server_harness.py)

#: nvidia-smi counts in MiB; two looks a moment apart at an idle GPU differ by at most this
SMI_TOLERANCE = 8 * MiB

KERNELS = {
    "a.ipynb": ["kept = cp.ones((1 << 28,), dtype=cp.float32)                      # 1 GiB"],
    "b.ipynb": ["%config GPUCleanup.release = 'idle'",
                "%config GPUCleanup.idle_release_s = 3600.0                          # caches kept for the test",
                "kept = cp.ones((1 << 29,), dtype=cp.float32)                      # 2 GiB",
                "tmp = cp.ones((1 << 27,), dtype=cp.float32)\ndel tmp               # 512 MiB cached in CuPy's pool"],
    "c.ipynb": ["kept = cp.ones((1 << 27,), dtype=cp.float32)                      # 512 MiB"],
}

OTHER = r"""
import sys, cupy as cp
held = cp.ones((3 << 27,), dtype=cp.float32)   # 1.5 GiB, no gpucleanup in this process
cp.cuda.Device().synchronize()
print("ready", flush=True)
sys.stdin.read()
"""


def smi(query: str) -> list:
    out = subprocess.run(["nvidia-smi", f"--query-{query}", "--format=csv,noheader,nounits"], capture_output=True,
                         text=True, timeout=60, check=True).stdout
    return [[p.strip() for p in line.split(",")] for line in out.splitlines() if line.strip()]


def smi_gpus() -> dict:
    """Per GPU UUID: index, used (total less free: recent drivers leave memory they reserve out of memory.used,
    and so does the page) and total."""
    return {r[1]: {"index": int(r[0]), "used": (int(r[3]) - int(r[2])) * MiB, "total": int(r[3]) * MiB}
            for r in smi("gpu=index,uuid,memory.free,memory.total")}


def smi_apps() -> list:
    return [(int(r[0]), r[1], int(r[2]) * MiB) for r in smi("compute-apps=pid,gpu_uuid,used_memory")
            if r[0].isdigit() and r[2].isdigit()]


def artifacts() -> Path | None:
    where = os.environ.get("GPUCLEANUP_ARTIFACTS")
    if not where:
        return None
    path = Path(where)
    path.mkdir(parents=True, exist_ok=True)
    return path


def test_the_pages_gpu_totals_are_nvidia_smis(tmp_path):
    require("cupy")
    try:
        smi_gpus()
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"nvidia-smi cannot be run here: {exc}")
    server = server_harness.Server(tmp_path / "server", status_timeout=2.0,
                                   extra_env={"GPUCLEANUP_LIBRARY": library_path(), "PYTHONUNBUFFERED": "1"})
    notebooks = {}
    other = None
    try:
        for path, cells in KERNELS.items():
            nb = notebooks[path] = server_harness.Notebook(server, path)
            for code in ["%load_ext gpucleanup", "import cupy as cp", *cells, "cp.cuda.Device().synchronize()"]:
                out = nb.run(code)
                assert "Error" not in out, (path, code, out)
        other = subprocess.Popen([sys.executable, "-c", OTHER], env=subprocess_env(), stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True)
        assert other.stdout.readline().strip() == "ready"
        own = {}
        for path, nb in notebooks.items():
            line = next(l for l in nb.run("import json as _j\n_d = %gpumem --json\nprint('GPUMEM ' + _j.dumps(_d))")
                        .splitlines() if l.startswith("GPUMEM "))
            dev = next(d for d in json.loads(line[7:])["devices"] if d["index"] == 0)
            own[path] = {name: f["live_bytes"] for name, f in dev["frameworks"].items()}
        pids = {path: nb.discovery().pid for path, nb in notebooks.items()}

        time.sleep(1.0)  # every kernel idle, its idle-time release done
        answer = server.api("GET", "/api/gpucleanup/kernels?sort=held&cards=")
        gpus, apps = smi_gpus(), smi_apps()
        if artifacts():
            (artifacts() / "page-totals-before.json").write_text(json.dumps(answer, indent=1))
        rows = {e["notebook"]: e for e in answer["kernels"]}
        listed = {pid for pid, _, _ in apps}
        if not set(pids.values()) & listed:
            pytest.skip("nvidia-smi lists no process of this PID namespace (a container without --pid=host): "
                        "the page can only count the kernels' own pools here")
        (uuid,) = {h["gpu"] for path in KERNELS for h in rows[path]["held"]}  # all on one GPU
        page = next(g for g in answer["gpus"] if g["gpu"] == uuid)
        seen = gpus[uuid]
        print(f"FIGURE GPU{seen['index']} {uuid}: nvidia-smi used {seen['used'] / MiB:.0f} MiB of "
              f"{seen['total'] / MiB:.0f} MiB; page used {page['used_bytes'] / MiB:.0f} MiB of "
              f"{page['total_bytes'] / MiB:.0f} MiB ({page['used_source']})")
        assert page["used_source"] == "nvidia-smi" and page["total_bytes"] == seen["total"]
        assert abs(page["used_bytes"] - seen["used"]) <= SMI_TOLERANCE

        for path in KERNELS:
            row = rows[path]
            (held,) = [h for h in row["held"] if h["gpu"] == uuid]
            smi_bytes = sum(used for pid, on, used in apps if pid == pids[path] and on == uuid)
            print(f"FIGURE {path} pid {pids[path]}: page held {held['bytes'] / MiB:.0f} MiB (live "
                  f"{held['live_bytes'] / MiB:.0f}, cached {held['cached_bytes'] / MiB:.0f}, outside "
                  f"{held['outside_bytes'] / MiB:.0f}); nvidia-smi {smi_bytes / MiB:.0f} MiB; %gpumem live "
                  f"{own[path]}")
            assert held["source"] == "nvidia-smi"
            assert abs(held["bytes"] - smi_bytes) <= SMI_TOLERANCE
            assert held["live_bytes"] == sum(own[path].values())
            assert held["live_bytes"] + held["cached_bytes"] + held["outside_bytes"] == held["bytes"]
        assert rows["b.ipynb"]["held"][0]["cached_bytes"] >= 512 * MiB

        held_rows = sum(h["bytes"] for e in answer["kernels"] for h in e["held"] if h["gpu"] == uuid)
        others = sum(used for pid, on, used in apps if on == uuid and pid not in pids.values())
        unlisted = seen["used"] - sum(used for _, on, used in apps if on == uuid)  # the driver's reserve, no process's
        print(f"FIGURE header: held by kernels with gpucleanup {page['held_bytes'] / MiB:.0f} MiB (sum of rows "
              f"{held_rows / MiB:.0f}; live {page['live_bytes'] / MiB:.0f}, cached {page['cached_bytes'] / MiB:.0f}, "
              f"outside {page['outside_bytes'] / MiB:.0f}); rest {page['rest_bytes'] / MiB:.0f} MiB; nvidia-smi: "
              f"other processes {others / MiB:.0f} MiB (process without gpucleanup pid {other.pid}), not in any "
              f"process {unlisted / MiB:.0f} MiB")
        assert page["held_bytes"] == held_rows
        assert page["live_bytes"] + page["cached_bytes"] + page["outside_bytes"] + page["unsplit_bytes"] == held_rows
        assert abs(page["rest_bytes"] - (others + unlisted)) <= 2 * SMI_TOLERANCE
        assert others >= 3 * GiB // 2  # the process without gpucleanup is in the rest
        assert sum(used for pid, on, used in apps if pid == other.pid and on == uuid) >= 3 * GiB // 2

        # park the kernels idle for more than 0 s: the preview's figure is what the parks give back
        preview = server.api("GET", "/api/gpucleanup/park-idle?min_idle_s=0")
        chosen = {k["notebook"]: k for k in preview["kernels"]}
        print(f"FIGURE preview: {sorted(chosen)} would give back {preview['bytes'] / MiB:.0f} MiB; left "
              f"{[(k['notebook'], k['reasons']) for k in preview['refused']]}")
        assert set(chosen) == set(KERNELS)
        done = server.api("POST", "/api/gpucleanup/park-idle", {"min_idle_s": 0, "ids": [k["id"] for k in preview["kernels"]]})
        for result in done["results"]:
            print(f"FIGURE park {result['id']}: ok {result['ok']}, {result['bytes']} bytes: {result['message']}")
        if not any(r["ok"] for r in done["results"]):
            pytest.skip(f"no kernel could be parked here: {done['results'][0]['message']}")
        for result in done["results"]:
            item = next(k for k in preview["kernels"] if k["id"] == result["id"])
            assert result["ok"], result
            assert abs(result["bytes"] - item["bytes"]) <= SMI_TOLERANCE
        time.sleep(1.0)
        after = server.api("GET", "/api/gpucleanup/kernels?sort=held&cards=")
        gpus_after = smi_gpus()
        if artifacts():
            (artifacts() / "page-totals-after.json").write_text(json.dumps(after, indent=1))
        page_after = next(g for g in after["gpus"] if g["gpu"] == uuid)
        fell = seen["used"] - gpus_after[uuid]["used"]
        print(f"FIGURE after the parks: nvidia-smi used {gpus_after[uuid]['used'] / MiB:.0f} MiB (fell "
              f"{fell / MiB:.0f} MiB; the parks said {done['parked_bytes'] / MiB:.0f} MiB); page held "
              f"{page_after['held_bytes'] / MiB:.0f} MiB, parked {page_after['parked_bytes'] / MiB:.0f} MiB, rest "
              f"{page_after['rest_bytes'] / MiB:.0f} MiB")
        assert abs(fell - done["parked_bytes"]) <= 2 * SMI_TOLERANCE * len(KERNELS)
        assert page_after["held_bytes"] == 0
        assert page_after["parked_bytes"] == sum(e["parked"]["bytes"] for e in after["kernels"] if e["parked"])
        assert abs(page_after["parked_bytes"] - done["parked_bytes"]) <= SMI_TOLERANCE * len(KERNELS)
        # each kernel comes back with its next cell, its arrays intact
        for nb in notebooks.values():
            out = nb.run("print(float(kept[:4].sum()))")
            assert out.startswith("gpucleanup · resumed ") and "4.0" in out.splitlines(), out
    finally:
        if other is not None:
            other.stdin.close()
            other.wait(timeout=60)
        for nb in notebooks.values():
            nb.close()
        server.stop()
