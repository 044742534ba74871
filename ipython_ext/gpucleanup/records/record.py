"""The record of one cell's cleanup: typed here, plain JSON everywhere else.

The after-cell engine (``after_cell.py``) returns a :class:`CellRecord`; the history,
``%gpumem --history``, the status endpoint and ``gpucleanup watch`` keep and send
``CellRecord.to_dict()``, whose shape is ``share/schema/cell_record.schema.json``.
Bytes are exact ints, durations seconds as floats; what is printed is returned beside
the record (``Outcome.lines``), never inside it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

__all__ = ["DeviceRecord", "PinnedRecord", "GcRecord", "CellRecord", "Outcome", "OUTSIDE_NOTICE_BYTES"]

# A cell's growth of memory outside every pool (or the raw allocations the trace found it kept) is worth a line
# from this size on (below it: the driver's own bookkeeping and other processes' small moves).
OUTSIDE_NOTICE_BYTES = 16 << 20


@dataclass
class DeviceRecord:
    """One device in use by the kernel, after the cleanup."""

    index: int
    name: Optional[str] = None
    #: drained | busy | unusable | error | interrupted
    state: str = "error"
    #: the native settle: {"status": done | timeout | still_busy | skipped | interrupted, "waited_s", ...}
    settle: Optional[dict] = None
    total_bytes: Optional[int] = None
    #: device used when the cell started: the previous cell's figure after its cleanup (None: unknown)
    used_at_start_bytes: Optional[int] = None
    #: ... when the cell ended, before the cleanup
    used_before_bytes: Optional[int] = None
    #: ... after the cleanup
    used_after_bytes: Optional[int] = None
    #: freed now, per framework ("driver": the driver's own pools)
    freed_bytes: Dict[str, int] = field(default_factory=dict)
    #: held by live objects, per framework
    live_bytes: Dict[str, int] = field(default_factory=dict)
    #: kept by a framework and not freeable now, per framework
    cached_bytes: Dict[str, int] = field(default_factory=dict)
    #: kept by a framework whose pool never gives memory back (JAX's BFC allocator, TensorFlow, RMM),
    #: per framework: not freeable by any cleanup
    reserved_bytes: Dict[str, int] = field(default_factory=dict)
    #: the driver's one line for a busy or unusable device
    message: Optional[str] = None
    #: unusable and already said: no line any more
    quiet: bool = False
    #: after the cleanup, memory no framework and no driver pool accounts for: the CUDA context,
    #: raw allocations, other processes on the GPU (None: not known)
    outside_bytes: Optional[int] = None
    #: ... and how much it grew since the last cleanup (None: not known yet)
    outside_growth_bytes: Optional[int] = None
    #: the process had no context on this device before the cell: the cell's first use of it
    first_use: bool = False
    #: frameworks are in use and none holds anything here: a context no array uses
    context_only: bool = False


@dataclass
class PinnedRecord:
    """Pinned (page-locked) host memory: host-wide, not per device."""

    #: released by this cell's cleanup, per framework
    freed_bytes: Dict[str, int] = field(default_factory=dict)
    #: background releases that finished since the last record: {"cell", "freed_bytes", "elapsed_s"}
    background: List[dict] = field(default_factory=list)
    #: a release still runs in the background
    pending: bool = False
    #: each framework's pinned pool after the cleanup: {"live_bytes", "cached_bytes"}
    pools: Dict[str, dict] = field(default_factory=dict)


@dataclass
class GcRecord:
    policy: str = "auto"
    #: None | "young" | "full"
    ran: Optional[str] = None
    elapsed_s: float = 0.0
    collected: int = 0


@dataclass
class CellRecord:
    #: the cell's execution count; None for %gpumem --drain outside a cell's own cleanup
    cell: Optional[int] = None
    time_ns: int = 0
    elapsed_s: float = 0.0
    driver_state: Optional[str] = None
    interrupted: bool = False
    devices: List[DeviceRecord] = field(default_factory=list)
    pinned: PinnedRecord = field(default_factory=PinnedRecord)
    gc: GcRecord = field(default_factory=GcRecord)
    #: every note of this cell
    notes: List[str] = field(default_factory=list)
    #: the notes printed (the first of their kind)
    shown_notes: List[str] = field(default_factory=list)
    #: what frameworks printed through sys.unraisablehook while freeing (strings only)
    unraisable: List[dict] = field(default_factory=list)
    #: the cell changed GPU memory
    touched: bool = False
    #: a summary line was printed
    shown: bool = False
    #: the release policy this cleanup ran under: "cell", "auto", "idle" or "rerun"
    release: str = "cell"
    #: what this cleanup left for later: {"device": bool, "pinned": bool, "after_s": seconds idle}
    deferred: Optional[dict] = None
    #: releases run while the kernel was idle since the last record:
    #: {"cell", "devices": [{"index", "freed_bytes"}], "pinned_freed_bytes", "elapsed_s"}
    idle: List[dict] = field(default_factory=list)
    #: GPU objects the cell left where no variable names them: its Out[N], its traceback's
    #: frames: {"held_by", "name", "device", "bytes"}
    hidden: List[dict] = field(default_factory=list)
    #: raw allocations the cell made and kept, from the allocation trace (%gpumem --trace on):
    #: {"device", "bytes", "count", "threads", "site", "caller", "kind"}
    traced: List[dict] = field(default_factory=list)
    #: per framework whose pool never gives memory back: what to set so that it does, said on
    #: this cell's line (the first line that shows its reserved memory; once per kernel)
    reserved_fix: Dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict:
        """The JSON shape of share/schema/cell_record.schema.json.

        The same as ``dataclasses.asdict`` (fresh dicts and lists all the way down), in
        about a third of its time: this runs after every cell."""
        return _as_dict(self)


class Outcome:
    """What the engine hands back for one cell: the record and the lines to print.

    ``record``: the cell's :class:`CellRecord`, or ``make``, which builds it when first asked for:
    an idle cell's record is wanted by few (the Dask plugin's summary), and is built on every cell."""

    __slots__ = ("_record", "_make", "lines", "keep", "data")

    def __init__(self, record: Optional[CellRecord] = None, lines: Optional[List[str]] = None, keep: bool = True,
                 data: Optional[dict] = None, make: Optional[Callable[[], CellRecord]] = None):
        if (record is None) == (make is None):
            raise TypeError("an Outcome takes its record, or make (what builds it), not both")
        self._record = record
        self._make = make
        self.lines: List[str] = [] if lines is None else lines
        #: goes to the history and the status endpoint (not: a %gpumem --drain with no GPU in
        #: use, or a cell's own cleanup that added nothing to its %gpumem --drain)
        self.keep = keep
        #: ``record.to_dict()`` as the engine made it for the lines: the history and the status
        #: endpoint keep this one (asdict is the dearest step of building a record)
        self.data = data

    @property
    def record(self) -> CellRecord:
        if self._record is None:
            self._record, self._make = self._make(), None
        return self._record

    def as_dict(self) -> dict:
        return self.data if self.data is not None else self.record.to_dict()

    def __repr__(self) -> str:
        return f"Outcome(record={self.record!r}, lines={self.lines!r}, keep={self.keep!r})"


_RECORDS = (DeviceRecord, PinnedRecord, GcRecord, CellRecord)
_FIELDS = {cls: tuple(f.name for f in dataclasses.fields(cls)) for cls in _RECORDS}


def _as_dict(record) -> dict:
    return {name: _plain(getattr(record, name)) for name in _FIELDS[type(record)]}


def _plain(value):
    """A copy of a record's value: records become dicts, containers are copied, the rest is shared."""
    kind = type(value)
    if kind in _FIELDS:
        return _as_dict(value)
    if kind is dict:
        return {k: _plain(v) for k, v in value.items()}
    if kind is list:
        return [_plain(v) for v in value]
    if kind is tuple:
        return tuple(_plain(v) for v in value)
    return value
