"""The after-cell engine's face: :class:`AfterCell` hands each cell to a :class:`~.cell_pass.CellPass` (whose
docstring tells the steps) and holds what lasts between cells, each part in its own home.

Like IPython's own ``autoreload``, it imports nothing from IPython: the extension owns the lifecycle, the traits and
``%gpumem``, and gets back an :class:`~.record.Outcome` (a typed record and the lines to print). When nothing in the
process uses CUDA, a cell costs one native call; a fault of a framework or of the driver becomes a note, said once
per kind, never an exception.
"""

from __future__ import annotations

import time
from typing import Any, Callable, List, Optional, Union

from .cell_pass import CellHooks, CellPass, CtrlC, DeviceWork, Silent  # noqa: F401  (re-exported)
from .figures import (FrameworkFigures, FrameworkReader, Held, LastPass, Stats, live_total,  # noqa: F401
                      outside_every_pool, status_figures)
from .quiet_check import IdleProof, QuietCheck, QuietFinding  # noqa: F401
from ..records.record import CellRecord, Outcome
from .releases import IdleRelease, PinnedRelease, Release, Releases, adapter_note, guarded  # noqa: F401
from .settings import Cell, Settings  # noqa: F401  (Cell re-exported)
from .since_last_pass import GpuHolders, SinceLastPass  # noqa: F401

__all__ = ["AfterCell", "Settings", "adapter_note"]


class AfterCell:
    """One cell's cleanup at a time (:meth:`run`), over the parts that last between cells.

    ``native`` is ``gpucleanup._native`` (or a stand-in with its ``cuda_initialized``, ``after_cell``, ``quiet``,
    ``trim`` and ``snapshot``, returning the same shapes); ``adapters`` a callable returning the framework adapters
    in use (None: the real ones, ``gpucleanup.frameworks.active``); ``status`` a callable ``(method, payload)``
    feeding the status endpoint; ``voice`` what renders the lines and the progress line (``report.CellVoice``;
    None: nothing is said, the lines are empty); ``traced`` and ``tracing`` the allocation trace's entries of a cell
    and whether it runs (:class:`~.cell_pass.CellHooks`); ``background`` the status server's hook around a release
    on a thread of its own (:class:`~.releases.Releases`). What the extension does not call lives in the parts
    themselves: ``releases``, ``since``, ``quiet``, ``frameworks``, ``hooks``.
    """

    def __init__(self, native: Any, adapters: Optional[Callable[[], Any]] = None,
                 status: Optional[Callable[[str, dict], None]] = None, voice: Any = None,
                 traced: Optional[Callable[[int], List[dict]]] = None, tracing: Optional[Callable[[], bool]] = None,
                 background: Optional[Callable[[bool], bool]] = None):
        self.native = native
        self.frameworks = FrameworkReader(adapters)
        self.releases = Releases(trim=lambda: self.native.trim())
        self.since = SinceLastPass()
        self.quiet = QuietCheck()
        self.hooks = CellHooks(voice=voice if voice is not None else Silent(), traced=traced)
        if status is not None:
            self.hooks.status = status
        if tracing is not None:
            self.hooks.tracing = tracing
        if background is not None:
            self.releases.background = background

    # ------------------------------------------------------------ the cell

    def run(self, settings: Settings, cell: Optional[int] = None, namespace: Optional[dict] = None,
            forced: bool = False, after_forced: Optional[CellRecord] = None,
            hidden: Union[None, List[dict], Callable[[], List[dict]]] = None) -> Optional[Outcome]:
        """The cleanup after one cell (a :class:`CellPass`); None when nothing in the process uses CUDA.

        ``forced`` (``%gpumem --drain``) always returns lines. ``after_forced`` is the
        record of a ``%gpumem --drain`` earlier in the same cell: this cleanup then says
        and keeps only what it adds to it (one line and one record per cell). ``hidden``:
        the cell's holders no variable names, or a callable asked for them once a device is in use.
        """
        self.releases.cell_starts()  # a release still waiting is re-armed, or replaced by this cleanup's
        try:
            if not forced and self.never_initialised():
                return None  # what the last pass found and kept (CellPass.nothing_initialised) still stands
            return CellPass(self.native, self.frameworks, settings, Cell(cell, namespace, forced, after_forced, hidden),
                            self.since, self.quiet, self.releases, self.hooks).run()
        finally:
            self.releases.cell_ends()

    def never_initialised(self) -> bool:
        """Nothing in the process has initialised CUDA, as the last pass found too: one driver call, no pass built.
        Initialisation is for the process's life, so from True nothing can have used a GPU since the last pass."""
        if self.since.driver_state != "not_initialized" or self.quiet.ok or not self.releases.quiet:
            return False
        try:
            if self.native.cuda_initialized() is not False:
                return False
        except Exception:
            return False  # the whole pass says what is wrong
        self.since.know_baseline()  # as CellPass.nothing_initialised: the next device in use is a first use
        return True

    def memory_status(self, settings: Settings) -> dict:
        """The process's GPU memory as data with exact bytes (what %gpumem shows); see :func:`memory_status`."""
        return memory_status(self.native, self.frameworks, self.since, settings)

    def baseline(self, probe: dict) -> None:
        self.since.baseline(probe)

    # ------------------------------------------------------------ the releases between cells

    def cell_starts(self, source: Optional[str] = None) -> Optional[IdleRelease]:
        return self.releases.cell_starts(source)

    def cell_ends(self) -> None:
        self.releases.cell_ends()

    def stop(self) -> None:
        """Unload or exit: nothing waits any more to run later."""
        self.releases.stop()

    @property
    def exiting(self) -> bool:
        return self.releases.exiting

    @exiting.setter
    def exiting(self, value: bool) -> None:
        self.releases.exiting = value

    # ------------------------------------------------------------ what the face reads and sets

    def note_once(self, kind: str) -> bool:
        """True the first time ``kind`` is seen in this session."""
        return self.hooks.said.first(kind)

    @property
    def last_driver_state(self) -> Optional[str]:
        return self.since.driver_state

    @last_driver_state.setter
    def last_driver_state(self, state: Optional[str]) -> None:
        self.since.driver_state = state


def memory_status(native: Any, frameworks: FrameworkReader, since: SinceLastPass, settings: Settings) -> dict:
    """The process's GPU memory as data with exact bytes (what %gpumem shows): per device in
    use the driver's figures, each framework's live and cached bytes, the driver pools and what
    is outside every pool; the pinned pools; notes. Reads only: frees nothing, initialises nothing."""
    notes: List[tuple] = []
    out: dict = {"kind": "gpumem", "time_ns": time.time_ns(), "devices": [], "pinned": {}}
    try:
        snap = native.snapshot()
    except Exception as exc:
        out["driver"] = {"state": "unusable", "message": str(exc)}
        out["notes"] = []  # the driver's sentence says it, once
        return out
    driver = snap.get("driver") or {}
    out["driver"] = driver
    in_use = [d for d in snap.get("devices") or [] if d.get("in_use")]
    adapters = frameworks.adapters(settings.frameworks, notes) if driver.get("state") == "ready" and in_use else []
    indices = [int(d["index"]) for d in in_use if not since.is_unusable(int(d["index"]))]
    stats = frameworks.stats(adapters, indices, notes) if adapters else {}
    out["frameworks"] = {}
    for adapter in adapters:
        desc, note = guarded(adapter, "describe")
        out["frameworks"][adapter.name] = desc if isinstance(desc, str) else None
        if note:
            notes.append(note)
    for dev in in_use:
        i = int(dev["index"])
        fws = {name: status_figures(s, i) for name, s in stats.items() if i in s.devices}
        pools = [
            {"which": p.get("which"), "reserved_bytes": p.get("reserved_bytes"), "used_bytes": p.get("used_bytes")}
            for p in dev.get("pools") or []
        ]
        used = dev.get("used_bytes")
        pools_bytes = sum(int(p["reserved_bytes"] or 0) for p in pools)
        outside = None if used is None else outside_every_pool(used, stats, i, pools_bytes)
        out["devices"].append(
            {
                "index": i,
                "name": dev.get("name"),
                "state": "unusable" if since.is_unusable(i) else dev.get("state"),
                "total_bytes": dev.get("total_bytes"),
                "used_bytes": used,
                "free_bytes": dev.get("free_bytes"),
                "frameworks": fws,
                "pools": pools,
                "known_bytes": sum(e["live_bytes"] + e["cached_bytes"] + e.get("reserved_bytes", 0)
                                   for e in fws.values()) + pools_bytes,
                "outside_bytes": outside,
                "outside_since_load_bytes": since.outside_since_load(i),
                "message": (dev.get("error") or {}).get("message"),
            }
        )
    out["pinned"] = {name: s.pinned.as_dict() for name, s in stats.items() if s.pinned is not None}
    out["reserved_fix"] = {name: s.fix for name, s in stats.items() if s.fix and not s.releases}
    # pools of the user's own making, per framework (PyCUDA's DeviceMemoryPool and PageLockedMemoryPool)
    out["framework_pools"] = {name: s.pools for name, s in stats.items() if s.pools}
    for s in stats.values():
        notes.extend((f"stats-note:{n}", n) for n in s.notes)
    out["notes"] = [text for _, text in notes]
    return out
