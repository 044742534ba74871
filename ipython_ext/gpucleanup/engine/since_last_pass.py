"""What lasts between cells: the figures the last cleanup left, which the next cell is compared with.

:class:`SinceLastPass` keeps them (the last full pass, the free and used bytes per device, the live and cached
bytes the frameworks told, memory outside every pool and its base, what each drain could not give back, the
devices seen in use and those found unusable, the names that held GPU memory) with the methods that read them;
:class:`SaidOnce`, the kinds of note already said in this session.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Tuple

from .figures import LastPass, Stats, outside_every_pool
from ..frameworks.objects import gpu_holder_names
from .releases import Note, index_of
from ..units import format_bytes

__all__ = ["SinceLastPass", "SaidOnce", "GpuHolders"]


class SaidOnce:
    """The kinds of note said in this session: each is said once."""

    def __init__(self):
        self.kinds: set = set()

    def first(self, kind: str) -> bool:
        """True the first time ``kind`` is seen in this session."""
        if kind in self.kinds:
            return False
        self.kinds.add(kind)
        return True

    def __contains__(self, kind: str) -> bool:
        return kind in self.kinds


class GpuHolders:
    """Which top-level names held GPU memory at the last walk of the namespace.

    The garbage policy wants to know whether a cell unbound such a name (``del model``)
    while GPU memory is still live. Checking the remembered names costs as many
    lookups as there are such names; the namespace itself is walked again only when the
    frameworks' live bytes grew past what the last walk saw (new GPU objects the walk
    cannot explain), bounded by ``gpu_holder_names``. A session of 10,000 cells and
    100,000 names costs nothing more per cell while GPU memory stays as it is.
    """

    def __init__(self, walk: Callable[[dict], Dict[str, int]] = gpu_holder_names):
        self._walk = walk
        self.names: Dict[str, int] = {}
        self.live_at_walk: Optional[int] = None
        self.walks = 0

    def unbound(self, namespace: Optional[dict]) -> bool:
        if not namespace or not self.names:
            return False
        return any(id(namespace.get(name, _MISSING)) != oid for name, oid in self.names.items())

    def update(self, namespace: Optional[dict], live: Optional[int]) -> None:
        """After the cleanup: forget unbound names; walk again only for unexplained growth."""
        if namespace is None or live is None:
            return
        self.names = {n: oid for n, oid in self.names.items() if id(namespace.get(n, _MISSING)) == oid}
        if live > 0 and (self.live_at_walk is None or live > self.live_at_walk):
            try:
                self.names = self._walk(namespace)
                self.walks += 1
            except Exception:
                self.names = {}
        self.live_at_walk = live


_MISSING = object()


class SinceLastPass:
    """The figures the last cleanup left, and what the cells since have counted.

    ``last``: the last full cleanup, for an idle cell to be compared with (None: none to compare with);
    ``free`` and ``used``: per device after it; ``live`` and ``cached``: the frameworks' bytes after it (None: not
    known); ``outside`` and ``outside_base``: per device, memory outside every pool after the last and the first
    cleanup; ``kept``: per framework and device, the cached bytes its last drain could not give back;
    ``seen_in_use``: devices seen with a context of this process, at load or by a cleanup (None: nothing known yet;
    a device in use now and never before had "no context yet" before the cell, its first GPU cell; never emptied: a
    driver call that fails and lists no device changes nothing here); ``unusable``: devices with a sticky error,
    left alone from then on; ``holders``: the names that held GPU memory; ``skipped``: idle cells whose cleanup was
    skipped; ``driver_state``: the driver's, as the last cell found it; ``unused``: the last pass found the driver
    initialised and no device in use (the library's quiet check then holds while none is)."""

    def __init__(self):
        self.last: Optional[LastPass] = None
        self.free: Dict[int, int] = {}
        self.used: Dict[int, int] = {}
        self.live: Optional[int] = None
        self.cached: Optional[int] = None
        self.outside: Dict[int, int] = {}
        self.outside_base: Dict[int, int] = {}
        self.kept: Dict[str, Dict[int, int]] = {}
        self.seen_in_use: Optional[set] = None
        self.unusable: set = set()
        self.holders = GpuHolders()
        self.skipped = 0
        self.driver_state: Optional[str] = None
        self.unused = False

    def baseline(self, probe: dict) -> None:
        """The devices in use before the first cell (the extension's probe at load): a device
        not among them that a cell starts using is that cell's first use of it."""
        self.seen_in_use = {int(d["index"]) for d in probe.get("devices") or []
                            if d.get("in_use") and index_of(d.get("index")) is not None}

    def know_baseline(self) -> None:
        """Nothing in use now: from here on a device that shows up in use is a first use."""
        if self.seen_in_use is None:
            self.seen_in_use = set()

    def is_unusable(self, index: int) -> bool:
        return index in self.unusable

    def take_pass(self, work, dev: dict, notes: List[Note]) -> None:
        """What lasts of a device's pass entry: a device unusable from now on; an error said."""
        if work.state == "unusable":
            self.unusable.add(work.index)
        elif work.state == "error":
            err = dev.get("error") or {}
            notes.append((f"device-error:{err.get('name') or dev.get('message')}",
                          dev.get("message") or f"GPU{work.index}: {err.get('message')}"))

    def live_hint(self, settled: list) -> Optional[int]:
        """Live GPU bytes as the frameworks told them after the last cleanup, when the
        driver saw no change on any device since and no framework kept a cache (None:
        not known, or memory may have changed hands)."""
        if self.live is None or self.cached != 0:
            # a framework kept a cache (release "auto"/"idle", or one that cannot release):
            # it can hand out memory again without the driver seeing any change
            return None
        return self.live if self.driver_unchanged(settled) else None

    def driver_unchanged(self, settled: list) -> bool:
        """Every device has the free memory the last cleanup left (False: one changed, or not known)."""
        return all(work.free_before is not None and self.free.get(work.index) == work.free_before
                   for work in settled)

    def changed(self, work) -> bool:
        """Device memory changed since the last cleanup (a device with no context before is a first use)."""
        return work.free_before is not None and work.index in self.free and self.free[work.index] != work.free_before

    def remember_figures(self, work: dict) -> None:
        """The device figures after this cleanup: what the next cell's are compared with."""
        for i, item in work.items():
            fig = item.after or {}
            if fig.get("free_bytes") is not None:
                self.free[i] = int(fig["free_bytes"])
            if fig.get("used_bytes") is not None:
                self.used[i] = int(fig["used_bytes"])

    def outside_after(self, work, stats: Optional[Stats], warn_bytes: int, said: SaidOnce,
                      notes: List[Note]) -> Tuple[Optional[int], Optional[int]]:
        """Device memory no framework, no framework cache and no driver pool accounts for,
        after the cleanup (:func:`~.figures.outside_every_pool`), and how much it grew since the last cleanup
        (None: not known). With no framework in use (``stats`` empty) only the driver pools account for
        anything; with frameworks whose figures are not known (``None``) it is not known."""
        i, used = work.index, (work.after or {}).get("used_bytes")
        if used is None or work.pools is None or work.quiet or not work.settled or stats is None:
            return None, None
        outside = outside_every_pool(used, stats, i, work.pools)
        before = None if work.first_use else self.outside.get(i)
        self.outside[i] = outside
        base = self.outside_base.setdefault(i, outside)
        if warn_bytes and outside - base >= warn_bytes and f"outside:{i}" not in said:  # said once
            notes.append((f"outside:{i}", (
                f"GPU{i}: {format_bytes(outside - base)} outside every pool have appeared since gpucleanup "
                "loaded: CUDA libraries' code and handles, raw allocations (cuMemAlloc through ctypes or cuda-python) "
                "that nothing frees, or another process on this GPU; %gpumem shows the total")))
        return outside, (None if before is None else outside - before)

    def outside_since_load(self, i: int) -> Optional[int]:
        """Growth of memory outside every pool on device ``i`` since the first cleanup."""
        if i not in self.outside or i not in self.outside_base:
            return None
        return self.outside[i] - self.outside_base[i]
