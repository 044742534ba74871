"""What the extension has done since it loaded, cumulative: the counters behind ``gpucleanup.outside.metrics``.

The extension adds every record it keeps and publishes :meth:`Totals.as_dict` beside it, so the status reply's
``last_record.totals`` is the kernel's cumulative figures (``share/schema/cell_record.schema.json``, ``$defs/totals``).
Nothing here raises: a malformed record adds what can be read of it.
"""

from __future__ import annotations

import bisect
import math
import threading
import time
from typing import Dict, Iterable, Optional, Sequence

__all__ = ["Totals", "BUCKETS_S", "settle_wait_s"]

#: upper bounds of the settle-wait histogram, in seconds (the +Inf bucket is implicit)
BUCKETS_S = (0.001, 0.01, 0.1, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)


def _count(value) -> int:
    """A byte count as the records hold it, else 0."""
    return value if type(value) is int and value > 0 else 0


def _add_bytes(into: Dict[str, int], freed) -> None:
    if not isinstance(freed, dict):
        return
    for name, n in freed.items():
        n = _count(n)
        if n and isinstance(name, str):
            into[name] = into.get(name, 0) + n


def settle_wait_s(record: dict) -> Optional[float]:
    """How long one cleanup waited for queued GPU work: the longest settle of its devices, None when
    none waited (no device, or every settle ``skipped``)."""
    longest = None
    for device in record.get("devices") or ():
        settle = device.get("settle") if isinstance(device, dict) else None
        if not isinstance(settle, dict) or settle.get("status") == "skipped":
            continue
        waited = settle.get("waited_s")
        if isinstance(waited, bool) or not isinstance(waited, (int, float)) or not math.isfinite(waited):
            continue
        waited = max(0.0, float(waited))
        longest = waited if longest is None else max(longest, waited)
    return longest


class Totals:
    """Cumulative cleanups, freed bytes and settle waits of one extension object.

    Freed bytes count once everything a record reports: its cleanup's own, a background pinned release finished
    since and the releases run while the kernel was idle. A cleanup's wait is the longest of its devices' settles;
    one whose settles were all skipped is not an observation."""

    def __init__(self, buckets: Sequence[float] = BUCKETS_S, started_ns: Optional[int] = None):
        bounds = [float(b) for b in buckets]
        if not bounds or any(not math.isfinite(b) for b in bounds) or bounds != sorted(set(bounds)):
            raise ValueError(f"histogram buckets must be finite, increasing and distinct, got {list(buckets)!r}")
        self.buckets = tuple(bounds)
        self.started_ns = int(started_ns) if started_ns is not None else time.time_ns()
        self.cleanups = 0
        self.drains_from_outside = 0  # gpucleanup drain, the page's Drain: not cells, counted apart
        self.device_freed: Dict[int, Dict[str, int]] = {}
        self.pinned_freed: Dict[str, int] = {}
        # per bucket, not cumulative; the last one is +Inf
        self._wait_counts = [0] * (len(self.buckets) + 1)
        self.wait_sum_s = 0.0
        self.wait_count = 0
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ adding

    def observe_wait(self, seconds: float) -> None:
        """One cleanup's settle wait; counted in every bucket whose bound is >= it (``le``: inclusive)."""
        with self._lock:
            self._observe(seconds)

    def _observe(self, seconds: float) -> None:
        seconds = max(0.0, float(seconds))
        self._wait_counts[bisect.bisect_left(self.buckets, seconds)] += 1
        self.wait_sum_s += seconds
        self.wait_count += 1

    def add(self, record: dict) -> None:
        """One kept record's plain form (``CellRecord.to_dict()``)."""
        if not isinstance(record, dict):
            return
        with self._lock:
            if record.get("source") == "outside":
                self.drains_from_outside += 1
            else:
                self.cleanups += 1
            for device in record.get("devices") or ():
                if isinstance(device, dict):
                    self._add_device(device.get("index"), device.get("freed_bytes"))
            pinned = record.get("pinned")
            if isinstance(pinned, dict):
                _add_bytes(self.pinned_freed, pinned.get("freed_bytes"))
                for job in _dicts(pinned.get("background")):
                    _add_bytes(self.pinned_freed, job.get("freed_bytes"))
            for job in _dicts(record.get("idle")):
                for device in _dicts(job.get("devices")):
                    self._add_device(device.get("index"), device.get("freed_bytes"))
                _add_bytes(self.pinned_freed, job.get("pinned_freed_bytes"))
            waited = settle_wait_s(record)
            if waited is not None:
                self._observe(waited)

    def _add_device(self, index, freed) -> None:
        if type(index) is not int or index < 0:
            return
        _add_bytes(self.device_freed.setdefault(index, {}), freed)

    # ------------------------------------------------------------------ reading

    def as_dict(self) -> dict:
        """The JSON form (``$defs/totals`` of share/schema/cell_record.schema.json): fresh containers."""
        with self._lock:
            cumulative = []
            running = 0
            for n in self._wait_counts[:-1]:
                running += n
                cumulative.append(running)
            return {
                "started_ns": self.started_ns,
                "cleanups": self.cleanups,
                "drains_from_outside": self.drains_from_outside,
                "devices": [{"index": i, "freed_bytes": dict(f)} for i, f in sorted(self.device_freed.items())],
                "pinned_freed_bytes": dict(self.pinned_freed),
                "settle_wait_s": {"le": list(self.buckets), "counts": cumulative, "count": self.wait_count,
                                  "sum": self.wait_sum_s},
            }


def _dicts(values) -> Iterable[dict]:
    if isinstance(values, list):
        return (v for v in values if isinstance(v, dict))
    return ()
