"""Device memory per cell over a session, from cell records: the data behind every timeline.

``%gpumem --plot`` draws it, ``%gpumem --plot --json`` returns it and the Jupyter Server page draws it for each
kernel; its shape is ``share/schema/timeline.schema.json`` (checked in ``tests/python/test_kernels_timeline.py``).
"""

from __future__ import annotations

from typing import Dict, Iterable, List, Optional

__all__ = ["series", "released_later", "VERSION"]

VERSION = 1


def _int(value) -> Optional[int]:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _sum(mapping) -> int:
    if not isinstance(mapping, dict):
        return 0
    return sum(v for v in mapping.values() if isinstance(v, int) and not isinstance(v, bool) and v > 0)


def released_later(record: dict, index: int) -> int:
    """What the releases a record reports (deferred by earlier cells, run since) gave back on device ``index``."""
    total = 0
    for job in record.get("idle") or ():
        for device in (job.get("devices") or ()) if isinstance(job, dict) else ():
            if isinstance(device, dict) and device.get("index") == index:
                total += _sum(device.get("freed_bytes"))
    return total


def series(records: Iterable[dict]) -> dict:
    """The timeline of ``records`` (oldest first), one series per device, devices by index."""
    devices: Dict[int, dict] = {}
    count = 0
    for record in records:
        if not isinstance(record, dict):
            continue
        count += 1
        cell = record.get("cell")
        cell = cell if isinstance(cell, int) and not isinstance(cell, bool) else None
        time_ns = _int(record.get("time_ns"))
        for device in record.get("devices") or ():
            if not isinstance(device, dict) or _int(device.get("index")) is None:
                continue
            index = device["index"]
            entry = devices.get(index)
            if entry is None:
                entry = devices[index] = {"index": index, "name": None, "total_bytes": None, "points": []}
            if isinstance(device.get("name"), str):
                entry["name"] = device["name"]
            if _int(device.get("total_bytes")) is not None:
                entry["total_bytes"] = device["total_bytes"]
            entry["points"].append(
                {
                    "cell": cell,
                    "time_ns": time_ns,
                    "used_bytes": _int(device.get("used_after_bytes")),
                    "used_before_bytes": _int(device.get("used_before_bytes")),
                    "live_bytes": _sum(device.get("live_bytes")),
                    "cached_bytes": _sum(device.get("cached_bytes")),
                    "outside_bytes": _int(device.get("outside_bytes")),
                    "freed_bytes": _sum(device.get("freed_bytes")) + released_later(record, index),
                    "state": device.get("state") if isinstance(device.get("state"), str) else None,
                    # a drain asked for from outside the kernel (gpucleanup drain, the page's Drain), not a cell
                    **({"source": "outside"} if record.get("source") == "outside" else {}),
                }
            )
    ordered: List[dict] = [devices[i] for i in sorted(devices)]
    return {"timeline": VERSION, "cells": count, "devices": ordered}
