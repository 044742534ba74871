"""The Jupyter Server page's data, /metrics and %gpumem --plot against two real kernels on a real GPU.

A real ``jupyter server`` with gpucleanup.server runs two notebooks, one with CuPy and one with PyTorch,
through a 10-cell session each (allocations kept, temporaries freed, a matrix product). Then what the server
shows from outside (``GET /api/gpucleanup/kernels``, the Prometheus series in the server's own ``/metrics``)
must equal each kernel's own ``%gpumem --json``, and ``%gpumem --plot`` must draw a PNG of the session.

With ``GPUCLEANUP_ARTIFACTS=DIR`` the test writes what it saw there: ``server-kernels.json`` (the API's
answer), ``server-metrics.txt`` (gpucleanup's series of /metrics), ``gpumem-<framework>.json`` and
``gpumem-plot-<framework>.png``: the README's examples and the page's screenshot are made from these.
"""

from __future__ import annotations

import base64
import json
import time
import os
import sys
from pathlib import Path

import pytest

from conftest import GiB, MiB, library_path, require

pytest.importorskip("jupyter_server")
pytest.importorskip("jupyter_client")
prometheus_parser = pytest.importorskip("prometheus_client.parser")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import server_harness  # noqa: E402  (tests/server_harness.py)

from gpucleanup.outside import kernels
from gpucleanup.protocol import status_client  # noqa: E402

#: the outside-every-pool figure is device-wide (the CUDA context, other processes), read at two moments
OUTSIDE_TOLERANCE = 64 * MiB

SESSIONS = {
    "cupy": [
        "%load_ext gpucleanup",
        "import cupy as cp",
        "kept = cp.ones((1 << 28,), dtype=cp.float32)                 # 1 GiB kept",
        "tmp = cp.ones((1 << 29,), dtype=cp.float32)\ndel tmp          # 2 GiB freed",
        "double = kept * 2                                            # 1 GiB more",
        "del double",
        "blocks = [cp.empty(1 << 28, dtype=cp.uint8) for _ in range(4)]",
        "del blocks",
        "x = cp.random.random((4096, 4096), dtype=cp.float32)\ny = x @ x\ndel x",
        "%gpumem --plot",
    ],
    "torch": [
        "%load_ext gpucleanup",
        "import torch",
        "kept = torch.ones(1 << 27, device='cuda')                    # 512 MiB kept",
        "tmp = torch.ones(1 << 28, device='cuda')\ndel tmp             # 1 GiB freed",
        "w = torch.randn(8192, 8192, device='cuda')                   # 256 MiB",
        "z = w @ w\ndel z",
        "batches = [torch.empty(64 << 20, dtype=torch.uint8, device='cuda') for _ in range(8)]",
        "del batches",
        "del w",
        "%gpumem --plot",
    ],
}


def _artifacts() -> Path | None:
    where = os.environ.get("GPUCLEANUP_ARTIFACTS")
    if not where:
        return None
    path = Path(where)
    path.mkdir(parents=True, exist_ok=True)
    return path


def _gpumem_json(notebook: server_harness.Notebook) -> dict:
    out = notebook.run("import json as _j\n_d = %gpumem --json\nprint('GPUMEM ' + _j.dumps(_d))")
    line = next((l for l in out.splitlines() if l.startswith("GPUMEM ")), None)
    assert line is not None, out
    return json.loads(line[len("GPUMEM "):])


def _own_figures(status: dict) -> dict:
    dev = next(d for d in status["devices"] if d["index"] == 0)
    return {"frameworks": {name: (f["live_bytes"], f["cached_bytes"]) for name, f in dev["frameworks"].items()},
            "outside_bytes": dev["outside_bytes"], "total_bytes": dev["total_bytes"]}


def _page_figures(entry: dict) -> dict:
    dev = next(d for d in entry["devices"] if d["index"] == 0)
    names = set(dev["live_bytes"]) | set(dev["cached_bytes"])
    return {"frameworks": {n: (dev["live_bytes"].get(n, 0), dev["cached_bytes"].get(n, 0)) for n in names},
            "outside_bytes": dev["outside_bytes"], "total_bytes": dev["total_bytes"], "uuid": dev.get("uuid")}


def _series(families, name: str, kernel_id: str) -> dict:
    """{labels (without kernel labels) as a tuple of items: value} of one metric for one kernel."""
    out = {}
    for family in families:
        for sample in family.samples:
            if sample.name == name and sample.labels.get("kernel_id") == kernel_id:
                labels = {k: v for k, v in sample.labels.items() if k not in ("kernel_id", "notebook", "pid")}
                out[tuple(sorted(labels.items()))] = sample.value
    return out


def test_the_page_and_metrics_show_each_kernels_own_figures(tmp_path):
    require("cupy")
    require("torch")
    server = server_harness.Server(tmp_path / "server", status_timeout=2.0,
                                   extra_env={"GPUCLEANUP_LIBRARY": library_path(), "PYTHONUNBUFFERED": "1"})
    notebooks = {}
    try:
        for framework, cells in SESSIONS.items():
            notebook = notebooks[framework] = server_harness.Notebook(server, f"session/{framework}_session.ipynb")
            for code in cells:
                out = notebook.run(code)
                assert "Error" not in out, (code, out)
            pngs = [d["image/png"] for d in notebook.displayed if "image/png" in d]
            assert len(pngs) == 1, f"%gpumem --plot displayed {[sorted(d) for d in notebook.displayed]}"
            png = base64.b64decode(pngs[0])
            assert png.startswith(b"\x89PNG\r\n\x1a\n")
            if _artifacts():
                (_artifacts() / f"gpumem-plot-{framework}.png").write_bytes(png)
        own = {}
        for framework, notebook in notebooks.items():
            status = _gpumem_json(notebook)
            own[framework] = _own_figures(status)
            if _artifacts():
                (_artifacts() / f"gpumem-{framework}.json").write_text(json.dumps(status, indent=1))

        answer = server.api("GET", "/api/gpucleanup/kernels")
        entries = {e["kernel_id"]: e for e in answer["kernels"]}
        # /metrics answers on the server's loop with the last finished collection and starts the next one: scrape
        # until a collection made after the kernels' last cells comes back (gpucleanup_collected_timestamp_seconds)
        asked = time.time()
        deadline = time.monotonic() + 60
        while True:
            metrics = server.request("GET", "/metrics", token=True)
            assert metrics.status == 200
            text = metrics.body.decode()
            families = list(prometheus_parser.text_string_to_metric_families(text))
            stamps = [s.value for f in families for s in f.samples if s.name == "gpucleanup_collected_timestamp_seconds"]
            if stamps and stamps[0] >= asked:
                break
            assert time.monotonic() < deadline, f"no collection newer than the scrape's start: {stamps}"
            time.sleep(0.2)
        if _artifacts():
            (_artifacts() / "server-kernels.json").write_text(json.dumps(answer, indent=1))
            (_artifacts() / "server-metrics.txt").write_text(
                "".join(line + "\n" for line in text.splitlines() if "gpucleanup_" in line))

        for framework, notebook in notebooks.items():
            entry = entries[notebook.kernel_id]
            assert entry["notebook"] == f"session/{framework}_session.ipynb"
            assert entry["gpucleanup"] is True and entry["error"] is None
            assert entry["state"]["state"] == "idle"
            page = _page_figures(entry)
            mine = own[framework]
            print(f"FIGURE {framework} kernel: %gpumem --json {mine}; page {page}")
            assert page["frameworks"] == mine["frameworks"]
            assert page["total_bytes"] == mine["total_bytes"]
            assert abs(page["outside_bytes"] - mine["outside_bytes"]) <= OUTSIDE_TOLERANCE
            assert page["uuid"] and page["uuid"].startswith("GPU-")
            live, _cached = mine["frameworks"][framework]
            # kept (1 GiB, 512 MiB), plus what the session's last cells keep (y, cuBLAS's workspace)
            assert live >= (GiB if framework == "cupy" else GiB // 2)

            # the session's 10 cells and the %gpumem --json cell: every record the timeline has, the counter has
            (device,) = [d for d in entry["timeline"]["devices"] if d["index"] == 0]
            assert device["points"], entry["timeline"]
            freed = sum(p["freed_bytes"] for p in device["points"])
            assert freed >= (2 * GiB if framework == "cupy" else GiB)

            kernel_id = notebook.kernel_id
            metric_live = _series(families, "gpucleanup_device_live_bytes", kernel_id)
            assert metric_live[(("device", "0"), ("framework", framework), ("uuid", page["uuid"]))] == live
            up = _series(families, "gpucleanup_kernel_up", kernel_id)
            assert list(up.values()) == [1.0]
            # the counters against the kernel's own records: one cleanup per record, and what each freed on
            # GPU0 (a cell's own cleanup, and releases run while the kernel was idle)
            records = status_client.request(kernels.target_of(notebook.discovery()), "history", timeout=30,
                                            limit=1000)["records"]
            assert entry["timeline"]["cells"] == len(records)
            cells = _series(families, "gpucleanup_cells_cleaned_total", kernel_id)
            assert list(cells.values()) == [float(len(records))]
            expected = sum(kernels.total(d.get("freed_bytes")) for r in records for d in r["devices"] if d["index"] == 0)
            expected += sum(kernels.total(d.get("freed_bytes")) for r in records for job in r.get("idle") or ()
                            for d in job.get("devices") or () if d.get("index") == 0)
            freed_total = _series(families, "gpucleanup_freed_bytes_total", kernel_id)
            assert sum(v for k, v in freed_total.items() if ("device", "0") in k) == float(expected)
            print(f"FIGURE {framework} kernel: {int(entry['timeline']['cells'])} cleanups, freed {freed / GiB:.2f} GiB "
                  f"on GPU0; /metrics live {live / GiB:.2f} GiB")
    finally:
        for notebook in notebooks.values():
            notebook.close()
        server.stop()
