"""``gpucleanup.outside.kernels`` (every kernel's status, asked at once: what ps, the server page and the metrics
read) and ``gpucleanup.records.timeline`` (device memory per cell, the data of every timeline)."""

from __future__ import annotations

import json
import os
import time
import types
from pathlib import Path

import pytest

from gpucleanup.protocol import discovery
from gpucleanup.outside import kernels
from gpucleanup.records import timeline
from gpucleanup.in_kernel.status_endpoint import StatusEndpoint

RECORD = {
    "cell": 11,
    "devices": [
        {
            "index": 0,
            "name": "NVIDIA H100 80GB HBM3",
            "total_bytes": 80 << 30,
            "used_before_bytes": 9 << 30,
            "used_after_bytes": 3 << 30,
            "freed_bytes": {"cupy": 6 << 30, "driver": 1 << 20},
            "live_bytes": {"cupy": 1 << 30},
            "cached_bytes": {"torch": 300 << 20},
            "outside_bytes": 500 << 20,
            "state": "drained",
        }
    ],
    "pinned": {"freed_bytes": {}},
}


@pytest.fixture
def endpoint(runtime, fake_cuda):
    ep = StatusEndpoint()
    ep.start(types.SimpleNamespace(user_ns={"__session__": "/home/me/fit.ipynb"}))
    assert ep.error is None, ep.error
    ep.set_state({"state": "idle", "since_ns": time.time_ns()})
    ep.publish({**RECORD, "cell": 10})
    ep.publish(RECORD)
    yield ep
    ep.close()


def test_gather_asks_every_kernel_and_reads_its_history(endpoint, runtime):
    gathered = kernels.gather(runtime, timeout=5, history=10)
    assert gathered.directory == runtime
    (view,) = gathered.kernels
    assert view.pid == os.getpid()
    assert view.notebook == "/home/me/fit.ipynb"
    assert view.error is None and view.elsewhere is None
    assert view.status["state"]["state"] == "idle"
    assert [r["cell"] for r in view.history] == [10, 11]
    (row,) = kernels.device_rows(view.status)
    assert row["index"] == 0
    assert row["live_bytes"] == {"cupy": 1 << 30}
    assert row["cached_bytes"] == {"torch": 300 << 20}
    assert row["outside_bytes"] == 500 << 20
    assert row["freed_bytes"] == {"cupy": 6 << 30, "driver": 1 << 20}
    assert kernels.total(row["freed_bytes"]) == (6 << 30) + (1 << 20)


def test_gather_without_history_asks_status_only(endpoint, runtime):
    (view,) = kernels.gather(runtime, timeout=5).kernels
    assert view.history is None
    assert view.status["last_record"]["cell"] == 11


def test_a_key_file_that_is_a_fifo_is_named_not_read(endpoint, runtime):
    (view,) = kernels.gather(runtime, timeout=5).kernels
    key_file = Path(view.kernel.key_file)
    key_file.unlink()
    os.mkfifo(key_file, 0o600)
    (view,) = kernels.gather(runtime, timeout=5).kernels
    assert view.status is None
    assert view.error_kind == "bad_key"
    assert isinstance(view.exception, discovery.UnsafeFile)
    assert view.error.startswith(f"its key file {key_file} is ")


def test_a_kernel_with_the_wrong_key_is_refused_with_a_reason(endpoint, runtime):
    (view,) = kernels.gather(runtime, timeout=5).kernels
    Path(view.kernel.key_file).write_text("0" * 64)
    (view,) = kernels.gather(runtime, timeout=5).kernels
    assert view.status is None
    assert view.error_kind == "refused"
    assert "does not hold the kernel's key" in view.error


def test_no_kernels_is_an_empty_list(runtime):
    gathered = kernels.gather(runtime, timeout=1)
    assert gathered.kernels == [] and gathered.skipped == []


def test_a_bad_discovery_file_is_skipped_with_its_reason(runtime):
    bad = runtime / "gpucleanup-123.json"
    bad.write_text(json.dumps({"discovery": 1, "pid": "many"}))
    bad.chmod(0o600)
    gathered = kernels.gather(runtime, timeout=1)
    assert gathered.kernels == []
    ((path, why),) = gathered.skipped
    assert Path(path) == bad and "pid" in why


# ------------------------------------------------------------------ timeline


def _record(cell, used, live, cached, outside, freed, index=0, name="NVIDIA H100 80GB HBM3"):
    return {"cell": cell, "time_ns": 1000 + (cell or 0),
            "devices": [{"index": index, "name": name, "total_bytes": 80 << 30, "used_after_bytes": used,
                         "used_before_bytes": used + freed, "live_bytes": {"cupy": live},
                         "cached_bytes": {"torch": cached}, "outside_bytes": outside,
                         "freed_bytes": {"cupy": freed}, "state": "drained"}]}


def test_series_matches_its_schema_for_cells_drains_and_records_with_fields_missing(schemas):
    drain = dict(_record(None, 90, 60, 0, 30, 10), source="outside")  # a drain asked for from outside
    old = {"cell": 4, "devices": [{"index": 2}]}  # a record of an older version: nothing but the index
    data = timeline.series([_record(1, 100, 60, 10, 30, 0), drain, old, "not a record"])
    schemas["timeline.schema.json"].validate(data)
    assert data["cells"] == 3
    assert [d["index"] for d in data["devices"]] == [0, 2]
    assert data["devices"][0]["points"][1]["source"] == "outside" and "source" not in data["devices"][0]["points"][0]
    assert data["devices"][1] == {"index": 2, "name": None, "total_bytes": None, "points": [
        {"cell": 4, "time_ns": None, "used_bytes": None, "used_before_bytes": None, "live_bytes": 0,
         "cached_bytes": 0, "outside_bytes": None, "freed_bytes": 0, "state": None}]}
    schemas["timeline.schema.json"].validate(timeline.series([]))
    # a point the series never makes is refused: the schema says the whole shape
    bad = timeline.series([_record(1, 100, 60, 10, 30, 0)])
    bad["devices"][0]["points"][0]["extra"] = 1
    assert not schemas["timeline.schema.json"].is_valid(bad)


def test_series_has_one_point_per_cell_and_device():
    records = [_record(1, 100, 60, 10, 30, 0), _record(2, 200, 150, 20, 30, 50), _record(2, 210, 150, 20, 40, 0, index=1)]
    data = timeline.series(records)
    assert data["timeline"] == 1 and data["cells"] == 3
    assert [d["index"] for d in data["devices"]] == [0, 1]
    gpu0 = data["devices"][0]
    assert gpu0["name"] == "NVIDIA H100 80GB HBM3" and gpu0["total_bytes"] == 80 << 30
    assert gpu0["points"] == [
        {"cell": 1, "time_ns": 1001, "used_bytes": 100, "used_before_bytes": 100, "live_bytes": 60,
         "cached_bytes": 10, "outside_bytes": 30, "freed_bytes": 0, "state": "drained"},
        {"cell": 2, "time_ns": 1002, "used_bytes": 200, "used_before_bytes": 250, "live_bytes": 150,
         "cached_bytes": 20, "outside_bytes": 30, "freed_bytes": 50, "state": "drained"},
    ]
    assert [p["used_bytes"] for p in data["devices"][1]["points"]] == [210]


def test_series_sums_frameworks_and_keeps_unknowns_unknown():
    record = {"cell": None, "devices": [{"index": 0, "live_bytes": {"cupy": 5, "torch": 7},
                                         "freed_bytes": {"cupy": 1, "driver": 2, "bogus": "x"}}]}
    (device,) = timeline.series([record])["devices"]
    (point,) = device["points"]
    assert point["cell"] is None  # a %gpumem --drain between cells
    assert point["live_bytes"] == 12 and point["freed_bytes"] == 3
    assert point["used_bytes"] is None and point["outside_bytes"] is None
    assert device["name"] is None and device["total_bytes"] is None


def test_series_skips_what_is_not_a_record():
    data = timeline.series([None, "x", {"devices": [None, {"index": -1}, {"index": True}, {"name": "no index"}]}])
    assert data["cells"] == 1 and data["devices"] == []


def test_series_and_the_pages_cell_count_what_a_release_left_by_an_earlier_cell_gave_back():
    # release "rerun": cell 3 started, the release cell 2 deferred gave back 1.5 GiB of CuPy's cache and
    # 64 MiB of pinned memory, and cell 3's record reports it; its own cleanup freed 4 MiB
    from gpucleanup.server import model

    record = _record(3, 100, 60, 0, 30, 4 << 20)
    record["idle"] = [{"cell": 2, "when": "cell", "elapsed_s": 0.01, "pinned_freed_bytes": {"cupy": 64 << 20},
                       "devices": [{"index": 0, "freed_bytes": {"cupy": 1536 << 20}},
                                   {"index": 1, "freed_bytes": {"cupy": 1 << 20}}]}]
    (device,) = timeline.series([record])["devices"]
    assert device["points"][0]["freed_bytes"] == (1536 << 20) + (4 << 20)  # device 1's share is not GPU0's
    cell = model.compact_cell(record)
    assert cell["freed_bytes"] == (1536 << 20) + (4 << 20) and cell["pinned_freed_bytes"] == 64 << 20
    assert cell["devices"][0]["freed_bytes"] == (1536 << 20) + (4 << 20)
