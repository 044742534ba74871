"""The cell record's plain form: what the history, the status endpoint and the lines read."""

from __future__ import annotations

import dataclasses

from gpucleanup.records.record import CellRecord, DeviceRecord, GcRecord, PinnedRecord


def _full_record() -> CellRecord:
    return CellRecord(
        cell=12, time_ns=1_700_000_000_000_000_000, elapsed_s=0.0012, driver_state="ready",
        devices=[DeviceRecord(index=0, name="NVIDIA H100 80GB HBM3", state="drained",
                              settle={"status": "done", "waited_s": 0.0}, total_bytes=80 << 30,
                              used_at_start_bytes=1 << 30, used_before_bytes=3 << 30, used_after_bytes=2 << 30,
                              freed_bytes={"driver": 1 << 20, "torch": 1 << 30}, live_bytes={"torch": 5},
                              cached_bytes={"jax": 7})],
        pinned=PinnedRecord(freed_bytes={"cupy": 8}, background=[{"cell": 11, "freed_bytes": {"cupy": 9}}],
                            pending=True, pools={"torch": {"live_bytes": 1, "cached_bytes": 2}}),
        gc=GcRecord(policy="auto", ran="young", elapsed_s=0.00002, collected=3),
        notes=["a note"], shown_notes=["a note"], unraisable=[{"type": "ValueError", "text": "x"}],
        touched=True, shown=True, release="auto", deferred={"device": True, "pinned": False, "after_s": 1.0},
        idle=[{"cell": 10, "devices": [{"index": 0, "freed_bytes": 4}], "pinned_freed_bytes": 0}],
    )


def test_the_plain_form_is_what_asdict_makes():
    record = _full_record()
    assert record.to_dict() == dataclasses.asdict(record)


def test_the_plain_form_shares_no_container_with_the_record():
    record = _full_record()
    data = record.to_dict()
    data["devices"][0]["settle"]["status"] = "changed"
    data["pinned"]["background"][0]["freed_bytes"]["cupy"] = 0
    data["idle"][0]["devices"].clear()
    data["notes"].append("more")
    assert record.devices[0].settle == {"status": "done", "waited_s": 0.0}
    assert record.pinned.background == [{"cell": 11, "freed_bytes": {"cupy": 9}}]
    assert record.idle[0]["devices"] == [{"index": 0, "freed_bytes": 4}]
    assert record.notes == ["a note"]
