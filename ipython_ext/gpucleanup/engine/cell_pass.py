"""One cell's cleanup (:class:`CellPass`): the after-cell steps (its docstring tells them) as methods, in their
order, over this cell's state only: a :class:`DeviceWork` per device in use, built from the native pass, and the
frameworks' figures. What lasts between cells is handed in, each part in its own home: the figures since the
last pass (:class:`~.since_last_pass.SinceLastPass`), the quiet check (:class:`~.quiet_check.QuietCheck`), the
background releases (:class:`~.releases.Releases`), the framework reader (:class:`~.figures.FrameworkReader`)
and the hooks around the cell (:class:`CellHooks`: the status server, the voice, the trace, Ctrl-C, the notes
said). Nothing here renders a line: the voice the caller handed in does (``report.CellVoice``).
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

try:  # the C module under signal: no enum made per call (the cleanup arms its handler once per cell)
    import _signal as _raw_signal
except ImportError:  # pragma: no cover - not CPython
    _raw_signal = signal

from .figures import (FrameworkReader, LastPass, Stats, context_only, live_total, nothing_new_cached, per_framework,
                      pools_reserved)
from .quiet_check import IdleProof, QuietCheck
from ..records.record import OUTSIDE_NOTICE_BYTES, CellRecord, DeviceRecord, GcRecord, Outcome, PinnedRecord
from .releases import (DEFERRED, IdleRelease, Note, PinnedRelease, Release, Releases, adapter_note, guarded,
                       index_of, on_cell_thread)
from .settings import Cell, Settings
from .since_last_pass import SaidOnce, SinceLastPass
from ..unraisable import summarize_unraisables

__all__ = ["CellPass", "Cell", "CellHooks", "DeviceWork", "CtrlC", "Silent"]

_ADAPTER_LOCK_WAIT_S = 0.05  # how long a cell waits for a background pinned release of the same adapter


class CtrlC:
    """Ctrl-C during the cleanup becomes a flag the cleanup checks between steps.

    A KeyboardInterrupt raised by the default handler lands wherever the main thread
    runs Python next, which during the native settle is the first line of the ctypes
    progress callback, where it would be printed and lost. With this handler the
    progress callback sees the flag and asks the native wait to stop; the steps after
    it are skipped. The previous handler is restored when the cleanup ends. Armed once per
    driver pass (an idle cell's quiet check waits for nothing and is not armed), through the C
    module (``_signal``): ``signal.signal`` makes an enum of each handler.
    """

    def __init__(self):
        self.pressed = False

    def armed(self) -> "_Armed":
        """A context manager: this handler for SIGINT while it is entered (on the main thread), the
        previous one back as it exits. A small object rather than a generator: it runs once per cell."""
        return _Armed(self)

    def handler(self, signum, frame) -> None:
        self.pressed = True

    def check(self) -> None:
        if self.pressed:
            raise KeyboardInterrupt


class _Armed:
    """:meth:`CtrlC.armed`'s context: what it installed is its own, so two threads arming one
    :class:`CtrlC` (a drain from outside and a cell) never restore each other's handler."""

    __slots__ = ("ctrl_c", "previous", "installed")

    def __init__(self, ctrl_c: CtrlC):
        self.ctrl_c = ctrl_c
        self.previous: Any = None
        self.installed = False

    def __enter__(self) -> CtrlC:
        ctrl_c = self.ctrl_c
        ctrl_c.pressed = False
        if threading.current_thread() is threading.main_thread():
            try:
                self.previous = _raw_signal.getsignal(signal.SIGINT)
                if self.previous is not None:
                    _raw_signal.signal(signal.SIGINT, ctrl_c.handler)
                    self.installed = True
            except (ValueError, TypeError, OSError):
                self.installed = False
        return ctrl_c

    def __exit__(self, *exc: Any) -> None:
        if self.installed:
            try:  # not contextlib.suppress: an object made and entered on every cell
                _raw_signal.signal(signal.SIGINT, self.previous)
            except Exception:
                pass


class Silent:
    """The voice of a caller that prints nothing (the Dask plugin's status reads): the same methods as
    ``report.CellVoice``, saying nothing."""

    def progress(self, device: int, waited_s: float, again: bool) -> None:
        pass

    def progress_end(self) -> None:
        pass

    def driver_unusable(self, driver: dict) -> None:
        pass

    def nothing_in_use(self, driver: dict) -> List[str]:
        return []

    def summary(self, data: dict, shown: bool) -> List[str]:
        return []


@dataclass
class CellHooks:
    """What the cell calls out to: ``status`` (``(method, payload)``, feeding the status endpoint), ``voice``
    (what renders the lines and the progress line: ``report.CellVoice``, or :class:`Silent`), ``traced`` (the
    allocation trace's entries of a cell, None: no trace), ``tracing`` (whether the trace runs now: while it does,
    no cell is skipped as idle), ``ctrl_c`` and ``said`` (the kinds of note said in this session)."""

    status: Callable[[str, dict], None] = lambda method, payload: None
    voice: Any = field(default_factory=Silent)
    traced: Optional[Callable[[int], List[dict]]] = None
    tracing: Callable[[], bool] = lambda: False
    ctrl_c: CtrlC = field(default_factory=CtrlC)
    said: SaidOnce = field(default_factory=SaidOnce)


_FIGURES = ("name", "total_bytes", "used_bytes", "free_bytes")




@dataclass
class DeviceWork:
    """One device's part of a cell's cleanup, built once from the native pass's entry for it;
    the later stages add what they freed and the figures after them."""

    index: int
    quiet: bool = False  # unusable, and already said
    first_use: bool = False  # no context of this process before the cell
    state: Optional[str] = None  # the pass's: drained, busy, unusable, error, interrupted (None: not in it)
    settle: Optional[dict] = None
    message: Optional[str] = None
    free_before: Optional[int] = None
    after: Optional[dict] = None  # name, total, used, free after the pass (or the trim, or a snapshot)
    pools: Optional[int] = None  # the driver pools' reserved bytes with ``after``
    freed: Dict[str, int] = field(default_factory=dict)  # per framework, and "driver"

    def take_pass(self, dev: dict, interrupted: bool) -> None:
        """The native pass's entry for this device (share/schema/after_cell.schema.json)."""
        self.state = dev.get("state") or "error"
        self.settle = dev.get("settle") or {}
        self.message = dev.get("message")
        self.free_before = dev.get("free_before_bytes")
        if "free_bytes" in dev or "total_bytes" in dev:
            self.take_figures(dev)
        if interrupted and self.settle.get("status") == "interrupted":
            self.state = "interrupted"
        self.add_freed("driver", dev.get("released_bytes"))

    def take_figures(self, dev: dict) -> None:
        """Figures after a stage: the pass's, a trim's or a snapshot's entry for this device."""
        self.after = {k: dev.get(k) for k in _FIGURES}
        self.pools = pools_reserved(dev)

    def add_freed(self, name: str, n: Any) -> None:
        if n:
            self.freed[name] = self.freed.get(name, 0) + int(n)

    @property
    def settled(self) -> bool:
        return self.state == "drained"

    @property
    def used_before(self) -> Optional[int]:
        total = (self.after or {}).get("total_bytes")
        return None if total is None or self.free_before is None else total - self.free_before


class CellPass:
    """One cell's cleanup: the steps below as methods, in their order, over this cell's state only. Built from
    what it reads and what it changes between cells, each a part of its own: ``native`` (the library),
    ``frameworks`` (the adapters in use and their figures), ``settings``, ``cell`` (what the extension hands over),
    ``since`` (the figures the last pass left), ``quiet`` (the idle proof), ``releases`` (the background releases)
    and ``hooks``.

    The steps, each a method of this class over one :class:`DeviceWork` per
    device in use (built once from the native pass's entry for it) and the frameworks' figures read
    once into :class:`~.figures.FrameworkFigures`:

    0. ``proven_idle``: once a cell has been proven idle, the next asks the library's quiet check
       (``QuietCheck.look``: ``_native.quiet``, the same devices, free memory and pools as that pass left,
       nothing queued) and reads each framework once (which frameworks are in use: as the last idle cell
       found them while nothing was imported since, ``adapters_in_use``); figures equal to the last
       cleanup's with nothing new to give back (``nothing_new``) end the cell there, and leave
       what that proof rested on (:class:`IdleProof`): the next cell that finds all of it as it was,
       every framework's quiet token included, is proven idle without the comparisons. Anything else
       runs the steps below.
    1. ``settle``: the driver pass (``_native.after_cell``, the only native protocol). On every
       device already in use, wait (at most ``settle_timeout``) for queued work, then trim the
       driver's pools once; busy devices are skipped. Past 2 s a progress line is written.
    2. ``collect``: garbage collection, only when it can release GPU memory; then each
       framework's figures. ``unchanged``: nothing changed since the last cleanup (``same_devices``:
       the same free memory and pools on every settled device; ``nothing_new``: the same framework
       figures, nothing cached or queued): the steps below are skipped, no record is built, kept
       or published.
    3. ``drain``: each framework adapter empties its caches on the settled devices.
    4. ``trim``: the driver's pools again, only if a framework gave memory back to them.
    5. ``snapshot``: device figures after the cleanup (the driver pass's own, or the trim's,
       when nothing changed since it).
    6. ``release_pinned``: pinned host pools are released on a background thread, started
       after the cell's last driver call (a pinned free makes concurrent driver calls wait).
    7. ``record`` and ``outcome``: the record, whether to speak (the show policy), and the lines, rendered by
       the voice the caller handed in (``report.CellVoice``): the engine itself renders nothing.
    """

    # slots: a cell pass is built on every cell, idle ones too (a third of the cost of 35 dict-held fields)
    __slots__ = ("native", "frameworks", "settings", "cell", "since", "quiet_check", "releases", "hooks",
                 "start", "now_device", "now_trim", "notes", "captured", "first", "driver", "state", "work",
                 "devices", "settled", "adapters", "stats_settled", "stats_after", "gc_record", "candidates",
                 "pending", "interrupted", "given_back", "figures_stale", "drained_now", "background",
                 "idle_done", "pinned_now", "deferred", "progress_shown", "progress_opened")

    def __init__(self, native: Any, frameworks: FrameworkReader, settings: Settings, cell: Cell,
                 since: SinceLastPass, quiet: QuietCheck, releases: Releases, hooks: CellHooks):
        self.native = native
        self.frameworks = frameworks
        # %gpumem --drain: everything, now
        self.settings = dataclasses.replace(settings, release="cell") if cell.forced else settings
        self.cell = cell
        self.since = since
        self.quiet_check = quiet
        self.releases = releases
        self.hooks = hooks
        self.start = time.perf_counter()
        self.now_device = self.settings.release not in DEFERRED  # the frameworks' device caches, now or later
        self.now_trim = self.settings.release != "idle"  # the driver's pools: "idle" alone leaves them to later
        self.notes: List[Note] = []
        self.captured: List[dict] = []
        self.first: dict = {}  # the one-pass native call's result
        self.driver: dict = {}
        self.state: Optional[str] = None  # the driver's
        self.work: Dict[int, DeviceWork] = {}  # per device in use, in the pass's order
        self.devices: List[int] = []  # in use and not unusable
        self.settled: List[int] = []  # drained by the driver pass: where the frameworks are cleaned
        self.adapters: list = []
        self.stats_settled: Stats = {}  # the frameworks' figures after the collection
        self.stats_after: Optional[Stats] = {}  # ... after the cleanup; None: not known
        self.gc_record: Optional[GcRecord] = None  # the collection's, made by begin(): an idle cell needs none
        self.candidates: list = []  # adapters whose pinned pools are released after the last driver call
        self.pending = False  # a pinned release still runs
        self.interrupted = False
        self.given_back = False  # a framework gave memory back to the driver
        self.figures_stale = False  # the pass's device figures predate a change
        self.drained_now: List[str] = []  # frameworks drained by this cleanup
        self.background: List[PinnedRelease] = []
        self.idle_done: List[IdleRelease] = []
        self.pinned_now: Dict[str, int] = {}
        self.deferred: Optional[dict] = None
        self.progress_shown = False  # the progress line is open (the native wait has not returned)
        self.progress_opened = False  # a progress line was written during this cleanup

    def run(self) -> Optional[Outcome]:
        quiet = self.quiet_check
        if self.nothing_initialised():
            return None
        quiet_before, proof = quiet.take()  # set again only by a cell proven idle
        # Not armed for Ctrl-C: nothing in the quiet check waits, so a Ctrl-C there is Python's own, and
        # arming costs two sigaction calls on every idle cell.
        if quiet_before and self.proven_idle(proof):
            return self.unchanged_outcome(holders_checked=True)
        with self.hooks.ctrl_c.armed() as ctrl_c:  # once for the driver pass and steps 1 to 4
            if not self.probe(ctrl_c):
                return self.nothing_in_use()
            self.begin()
            if self.clean(ctrl_c):
                quiet.ok = True  # this pass left the library the state the next cell's quiet check compares with
                return self.unchanged_outcome()
        self.snapshot()
        self.read_frameworks_after()
        self.release_pinned()
        record = self.record()
        self.remember(record)
        return self.outcome(record)

    # ------------------------------------------------------------ the steps, in order

    def proven_idle(self, proof: Optional[IdleProof]) -> bool:
        """Step 0: the cell proven idle without the driver pass, from what the quiet check found
        (:meth:`QuietCheck.look`): a proof that still stands, or figures equal to the last cleanup's with nothing
        new to give back. False: the whole pass runs, and what the look caught unraisably goes to its record."""
        quiet, since = self.quiet_check, self.since
        found = quiet.look(self.native, self.frameworks, since, self.releases, self.settings, self.cell,
                           self.hooks.tracing, proof)
        if found is None:
            return False
        self.state = since.driver_state = "ready"
        self.devices, self.settled, self.adapters = found.devices, list(found.devices), found.adapters
        if found.proof is not None:
            self.stats_settled = found.stats
            quiet.proven(found.proof)
            return True
        if found.stats is not None and not found.notes and not found.captured:
            self.stats_settled = found.stats  # the last cleanup's own: nothing_new() compares them by identity
            if self.nothing_new():
                quiet.proven(IdleProof.made(self.settings, since.last, found.adapters, self.frameworks,
                                            self.releases))
                return True
        self.captured.extend(found.captured)  # said by the whole pass's record
        self.devices, self.settled, self.adapters, self.stats_settled, self.state = [], [], [], {}, None
        return False

    def nothing_initialised(self) -> bool:
        """The common cell of a kernel that never used CUDA: one driver call, no JSON."""
        # the last cell was proven idle with a device in use: CUDA stays initialised once it is
        if self.quiet_check.ok or self.cell.forced or not self.releases.quiet:
            return False
        try:
            initialised = self.native.cuda_initialized()
        except Exception:
            initialised = None  # the full pass below says what is wrong
        if initialised is not False:
            return bool(initialised) and self.still_unused()
        self.since.driver_state = "not_initialized"
        self.since.know_baseline()  # no context anywhere: the next device in use is a first use
        self.state = None
        return True

    def still_unused(self) -> bool:
        """The driver initialised and no device in use, as the last pass found it and the library's quiet check
        still finds it (the probe's calls, no JSON): the cell is the one :meth:`nothing_in_use` would end."""
        if not self.since.unused:
            return False
        try:
            unused = self.native.quiet() is True
        except Exception:
            unused = False
        if unused:
            self.state = self.since.driver_state = "ready"
        return unused

    def probe(self, ctrl_c: CtrlC) -> bool:
        """The driver pass: probe, settle, trim and the figures after in one native call (when
        nothing in the process uses CUDA it is a probe and nothing else). True when a device is in use."""
        self.quiet_check.forget_adapters()  # what an idle cell kept stands only until the next full pass
        notes_first: List[Note] = []
        first = self.native_pass(self.settle_limit(), notes_first,
                                 trim=self.now_trim and self.settings.driver_pools)
        if first is not None and ctrl_c.pressed:
            first["keyboard_interrupt"] = True  # the settle step stops there
        if first is None:
            raise RuntimeError(notes_first[0][1] if notes_first else "the native after-cell pass failed")
        self.first = first
        in_use = [d for d in first.get("devices") or [] if index_of(d.get("index")) is not None]
        self.driver = first.get("driver") or {}
        self.state = self.driver.get("state")
        self.since.driver_state = self.state
        # no device listed at all (none in use, none unusable): the library left an empty quiet mark
        self.since.unused = self.state == "ready" and not first.get("devices")
        if self.since.unused:
            self.since.last = None  # no figures to compare with until a device is in use again
        if self.state != "ready" or not in_use:
            if self.state in ("ready", "not_initialized"):
                self.since.know_baseline()
            return False
        self.work = {int(d["index"]): DeviceWork(int(d["index"])) for d in in_use}
        return True

    def settle_limit(self) -> float:
        """No second wait for a device that a ``%gpumem --drain`` earlier in the cell
        already waited for in vain."""
        after_forced = self.cell.after_forced
        if after_forced is not None and any(d.state not in ("drained", "unusable") for d in after_forced.devices):
            return 0.0
        return float(self.settings.settle_timeout)

    def native_pass(self, timeout: float, notes: List[Note], trim: bool) -> Optional[dict]:
        """The one-pass native call (``_native.after_cell``), with the progress line; the line it may write is
        closed when it returns."""
        self.progress_shown = False
        try:
            return self.native.after_cell(timeout=timeout, progress=self._progress, trim=trim)
        except Exception as exc:
            if str(exc).startswith("[gpucleanup.api.111]"):
                raise  # a drain from outside holds the library: the extension says so
            notes.append((f"drain:{type(exc).__name__}", f"native after-cell pass failed: {exc}"))
            return None
        finally:
            if self.progress_shown:
                self.hooks.voice.progress_end()
                self.progress_shown = False

    def _progress(self, payload: dict) -> bool:
        if self.hooks.ctrl_c.pressed:
            return True  # stop waiting
        # The status endpoint (gpucleanup ps) shows which GPU the cell waits for,
        # since when: the wait began waited_s ago.
        waited_s = float(payload.get("waited_s", 0.0))
        device = int(payload.get("device", 0))
        self.hooks.status("set_state", {"state": "waiting", "device": device, "cell": self.cell.number,
                                        "since_ns": time.time_ns() - int(waited_s * 1e9)})
        if self.settings.show == "never":
            return False
        self.hooks.voice.progress(device, waited_s, self.progress_shown)
        self.progress_shown = True
        self.progress_opened = True
        return False

    def nothing_in_use(self) -> Optional[Outcome]:
        """No device in use, or the driver not ready: said once when the driver is unusable; a forced cell
        (``%gpumem --drain``) gets its one sentence."""
        state = self.driver.get("state")
        if state == "unusable" and self.hooks.said.first("driver:unusable"):
            self.hooks.voice.driver_unusable(self.driver)
        if not self.cell.forced:
            return None
        record = CellRecord(cell=self.cell.number, time_ns=time.time_ns(), driver_state=state, shown=True)
        return Outcome(record=record, lines=self.hooks.voice.nothing_in_use(self.driver), keep=False)

    def begin(self) -> None:
        """The devices of this cell, its first uses, and what background releases finished since the last."""
        since = self.since
        self.gc_record = GcRecord(policy=self.settings.gc)
        seen = since.seen_in_use
        for i, work in self.work.items():
            work.first_use = seen is not None and i not in seen
            work.quiet = i in since.unusable
        since.seen_in_use = (seen or set()) | set(self.work)
        self.devices = [i for i, work in self.work.items() if not work.quiet]
        self.background = self.releases.finished_pinned()
        self.idle_done = self.releases.finished_idle()
        for job in [*self.background, *self.idle_done]:
            self.notes.extend(job.notes)
            self.captured.extend(job.unraisable)

    def settle(self, ctrl_c: CtrlC) -> None:
        """Step 1: what the driver pass found, per device (the bounded wait and the first trim)."""
        self.interrupted = bool(self.first.get("keyboard_interrupt")) or ctrl_c.pressed
        for dev in self.first.get("devices") or []:
            work = self.work.get(index_of(dev.get("index")))
            if work is not None:
                work.take_pass(dev, self.interrupted)
                self.since.take_pass(work, dev, self.notes)
        self.settled = [i for i in self.devices if self.work[i].settled]
        if self.interrupted:
            raise KeyboardInterrupt
        ctrl_c.check()

    def collect(self, ctrl_c: CtrlC) -> None:
        """Step 2: collect first, then read the frameworks once: what the collection freed is in
        those figures, and only a cache that holds something is emptied.

        When the driver saw no change since the last cleanup, the frameworks are read first: figures
        equal to those the last cleanup left (live and cached alike: a new object handed memory from
        a cache would be new live bytes) mean the cell made no GPU object a collection could find,
        and it unbound no name that held GPU memory; the collection is then skipped and those figures
        stand. A collection that finds garbage has the frameworks read again."""
        frameworks = self.frameworks
        self.adapters = frameworks.adapters(self.settings.frameworks, self.notes) if self.settled else []
        # not known (the device's memory changed, or a framework keeps a cache): a young
        # collection, cheaper than reading every framework to decide
        live = self.since.live_hint([self.work[i] for i in self.settled]) if self.adapters else None
        early, early_notes = self._early_figures(live) if live != 0 else (None, [])
        if early is not None and early == self.since.last.stats:
            live = 0  # nothing a collection could give back
        self.gc_record = self.collect_garbage(live)
        ctrl_c.check()
        if early is not None and not self.gc_record.collected:
            self.stats_settled = early  # nothing collected: the figures read before stand
            self.notes.extend(early_notes)
        else:
            self.stats_settled = frameworks.stats(self.adapters, self.settled, self.notes) if self.adapters else {}

    def _early_figures(self, live: Optional[int]) -> Tuple[Optional[Stats], List[Note]]:
        """The frameworks' figures read before the collection, with their notes, when they may
        prove it useless: garbage policy "auto", a last cleanup to compare with, the driver saw no
        change on any device since it, and no name that held GPU memory unbound (that asks for a
        collection anyway); else (None, [])."""
        since = self.since
        if (not self.adapters or self.settings.gc != "auto" or since.last is None or self.cell.forced
                or not since.driver_unchanged([self.work[i] for i in self.settled])
                or since.holders.unbound(self.cell.namespace)):
            return None, []
        notes: List[Note] = []
        return self.frameworks.stats(self.adapters, self.settled, notes), notes

    def collect_garbage(self, live: Optional[int]) -> GcRecord:
        """Garbage collection, only when it can release GPU memory.

        'auto': a young collection unless the frameworks held no live GPU memory after the
        last cleanup, kept no cache, and the driver has seen no change since (``live`` is
        then 0; None: not known, collect); a full one only when the cell also unbound a
        name that held GPU memory and GPU memory is still live after the young one.
        'always': a full collection.
        """
        settings, settled = self.settings, self.settled
        info = GcRecord(policy=settings.gc)
        if not settled or settings.gc == "never":
            return info
        start = time.perf_counter()
        if settings.gc == "always":
            info.collected = gc.collect()
            info.ran = "full"
        elif live is None or live > 0:
            # only live GPU objects can be garbage holding GPU memory
            info.collected = gc.collect(1)
            info.ran = "young"
            if self.since.holders.unbound(self.cell.namespace):
                after = live_total(self.frameworks.stats(self.adapters, settled, []), settled) if self.adapters \
                    else None
                if after is None or after > 0:
                    info.collected += gc.collect()
                    info.ran = "full"
        info.elapsed_s = round(time.perf_counter() - start, 6)
        return info

    def drain(self, ctrl_c: CtrlC) -> None:
        """Step 3: the frameworks' caches on the settled devices; which pinned pools go after the last driver call.
        Under a release that waits (``idle``, ``rerun``) only the frameworks whose caches can be emptied on this
        thread alone (``drains_on_cell_thread``: PyCUDA) are emptied now; the others are left to the release."""
        now = self.adapters if self.now_device else [a for a in self.adapters if on_cell_thread(a)]
        if now:
            self.given_back = self.drain_frameworks(now, ctrl_c)
        self.candidates, self.pending = self.pinned_candidates(self.adapters, self.stats_settled)
        ctrl_c.check()

    def drain_frameworks(self, adapters: list, ctrl_c: CtrlC) -> bool:
        """Each framework empties its caches on the settled devices; True if any gave memory back.

        A framework whose figures (``stats_settled``, read after the collection) say it caches
        nothing on any of them, or exactly what its last drain could not give back (torch
        keeps a partly used segment), is left alone: nothing to give back, no call made."""
        work, settled, notes, stats = self.work, self.settled, self.notes, self.stats_settled
        for adapter in adapters:
            ctrl_c.check()
            if not getattr(adapter, "can_release", True):
                continue
            if stats is not None and nothing_new_cached(stats.get(adapter.name), settled,
                                                        self.since.kept.get(adapter.name, {})):
                continue
            lock = self.releases.adapter_lock(adapter.name)
            if not lock.acquire(timeout=_ADAPTER_LOCK_WAIT_S):
                notes.append((f"busy-pinned:{adapter.name}",
                              f"{adapter.name}: pinned release of an earlier cell still running, its device pool waits for the next cell"))
                continue
            try:
                with self.releases.unraisables.source(adapter.name):
                    res, note = guarded(adapter, "drain", list(settled))
            finally:
                lock.release()
            if note:
                notes.append(note)
                continue
            if isinstance(res, dict) and not res.get("notes"):
                self.drained_now.append(adapter.name)  # emptied as far as it can be
            if isinstance(res, dict):
                for key, n in (res.get("freed_bytes") or {}).items():
                    if index_of(key) in work:
                        work[index_of(key)].add_freed(adapter.name, n)
                for text in res.get("notes") or []:
                    notes.append((f"note:{adapter.name}:{text}", adapter_note(adapter.name, text)))
        return any(n for i in settled for name, n in work[i].freed.items() if name != "driver")

    def pinned_candidates(self, adapters: list, stats: Stats) -> Tuple[list, bool]:
        """Which adapters' pinned pools to release after the cell's last driver call, and
        whether an earlier release still runs."""
        if not (self.settings.pinned and adapters and len(self.settled) == len(self.devices)):
            return [], False
        if self.releases.pinned_running():
            return [], True
        return [
            a
            for a in adapters
            if getattr(a, "can_release", True)
            and hasattr(a, "drain_pinned")
            and a.name in stats
            # unknown pinned stats: try; known empty pools: no thread for nothing
            and (stats[a.name].pinned is None or stats[a.name].pinned.cached > 0)
        ], False

    def trim(self, ctrl_c: CtrlC) -> None:
        """Step 4: the driver's pools again, when a framework gave memory back, or the collection
        freed memory straight into them (asynchronous frees: live GPU memory is below what the
        last cleanup left; else the next cell's pass trims it)."""
        last_live = self.since.live
        gc_freed = bool(self.gc_record.collected) and (
            last_live is None or live_total(self.stats_settled, self.settled) < last_live)
        self.figures_stale = bool(self.given_back or gc_freed)
        if self.now_trim and self.settings.driver_pools and self.settled and self.figures_stale:
            reported = {i for i, work in self.work.items() if work.after is not None}
            fresh = self.trim_pools()
            # the trim reported every device's memory after it: as fresh as a snapshot
            self.figures_stale = not (fresh and reported and fresh >= reported)
        ctrl_c.check()  # a Ctrl-C during the trim: said as at every other step, not lost

    def trim_pools(self) -> set:
        """The driver's pools again, after the frameworks gave memory back to them. Returns the devices
        whose figures after it the library reported (no snapshot needed for them)."""
        try:
            result = self.native.trim()
        except Exception as exc:
            self.notes.append((f"trim:{type(exc).__name__}", f"native trim failed: {exc}"))
            return set()
        fresh = set()
        for dev in result.get("devices") or []:
            item = self.work.get(index_of(dev.get("index")))
            if item is None:
                continue
            item.add_freed("driver", dev.get("released_bytes"))
            if dev.get("free_bytes") is not None:
                item.take_figures(dev)
                fresh.add(item.index)
        return fresh

    def clean(self, ctrl_c: CtrlC) -> bool:
        """Steps 1 to 4 under the unraisable hook (Ctrl-C is a flag here: :meth:`run` armed it). True
        when the cell changed nothing since the last cleanup (:meth:`unchanged`): the steps after the
        collection are skipped, and the status endpoint never hears of a drain."""
        captured_now: List[dict] = []
        same = False
        try:
            with self.releases.unraisables.capture() as captured_now:
                self.settle(ctrl_c)
                self.collect(ctrl_c)
                same = self.unchanged()
                if not same:
                    self.hooks.status("set_state", {"state": "draining", "cell": self.cell.number,
                                                    "since_ns": time.time_ns()})
                    self.drain(ctrl_c)
                    self.trim(ctrl_c)
        except KeyboardInterrupt:
            self.stop_here()
            same = False
        self.captured.extend(captured_now)
        return same and not self.captured and not self.notes

    def unchanged(self) -> bool:
        """Nothing changed since the last cleanup, as far as can be proven: the native pass found
        every device settled with the very free bytes and driver pools that cleanup left and
        released nothing (:meth:`same_devices`), and there is nothing new (:meth:`nothing_new`)."""
        return self.same_devices() and self.nothing_new()

    def same_devices(self) -> bool:
        """The native pass found the devices the last cleanup left, each settled, with its free bytes
        and driver pools, a first use of none, nothing released."""
        last = self.since.last
        if last is None or set(self.work) != set(last.devices) or self.settled != list(self.work):
            return False
        for i, work in self.work.items():
            free_after = (work.after or {}).get("free_bytes")
            if (work.first_use or work.freed or last.devices[i] != (work.free_before, work.pools)
                    or free_after not in (None, work.free_before)):
                return False
        return True

    def nothing_new(self) -> bool:
        """Each framework's figures equal those after the last cleanup, with nothing new cached (what
        the release it deferred covers is not new); no pinned pool to release; nothing queued or
        finished in the background; nothing to say; no line asked for."""
        releases, last = self.releases, self.since.last
        held = releases.held_job
        if (last is None or self.cell.forced or self.cell.after_forced is not None or self.settings.show == "always"
                or self.progress_opened or self.notes or self.background or self.idle_done
                or releases.pinned_job is not None or any(job is not held for job in releases.unreported)
                or self._tracing()):
            return False
        if self.stats_settled is not last.stats and self.stats_settled != last.stats:
            return False
        # What the release the last cleanup deferred covers is cached as it was then (the figures are
        # the same): it is not new, and that release, held during the cell, gives it back once idle.
        deferred = held.adapters if held is not None and self.settings.release != "cell" else []
        kept = self.since.kept
        for a in self.adapters:  # a loop, not any(): this runs on every idle cell
            if getattr(a, "can_release", True) and not (a in deferred and held.device) and not nothing_new_cached(
                    self.stats_settled.get(a.name), self.settled, kept.get(a.name, {})):
                return False  # something to give back now, or when idle
        candidates, pending = self.pinned_candidates(self.adapters, self.stats_settled)
        return not pending and all(a in deferred and held.pinned for a in candidates)

    def _tracing(self) -> bool:
        """The allocation trace (opt-in) runs: every cell gets its record of what it traced."""
        try:
            return bool(self.hooks.tracing())
        except Exception:
            return True

    def unchanged_outcome(self, holders_checked: bool = False) -> Outcome:
        """An idle cell's: no device record built, nothing kept or published, no line; its record
        says only that the driver is ready and nothing was freed (the last cleanup's figures stand).
        The names that held GPU memory are still checked (cheap: no walk), unless the quiet check found
        each still bound to its object (``holders_checked``) and the live bytes are those of their last
        update: that update would change nothing."""
        since = self.since
        since.skipped += 1
        self.releases.rearm_held()  # what the last cleanup deferred is still to be given back once idle
        holders, namespace = since.holders, self.cell.namespace
        if namespace is not None and not (holders_checked and namespace and holders.live_at_walk == since.live):
            holders.update(namespace, since.live)
        # built when asked for (the Dask plugin's summary): most idle cells' records are never read
        make = functools.partial(CellRecord, cell=self.cell.number, time_ns=time.time_ns(), driver_state=self.state,
                                 release=self.settings.release, elapsed_s=round(time.perf_counter() - self.start, 6))
        return Outcome(lines=[], keep=False, make=make)

    def stop_here(self) -> None:
        """Ctrl-C: the steps left are skipped; devices not yet done say so."""
        self.interrupted = True
        for i in self.devices:
            if self.work[i].state in (None, "drained"):
                self.work[i].state = "interrupted"

    def snapshot(self) -> None:
        """Step 5: device figures after the cleanup; a fresh snapshot only when the pass's (or the
        trim's) may be stale (something was freed or collected since, or a Ctrl-C), or it reported none."""
        stale = self.figures_stale or self.interrupted
        if not stale and any(item.after is not None for item in self.work.values()):
            return
        try:
            snapshot = self.native.snapshot()
        except Exception as exc:
            self.notes.append((f"snapshot:{type(exc).__name__}", f"snapshot failed: {exc}"))
            snapshot = {}
        found = {index_of(d.get("index")): d for d in snapshot.get("devices") or []}
        for item in self.work.values():
            if item.index in found:
                item.take_figures(found[item.index])
            else:
                item.after, item.pools = None, None

    def read_frameworks_after(self) -> None:
        """The frameworks' figures after the cleanup: those read after the collection when nothing
        was freed since (None: frameworks are in use and their figures are not known)."""
        if not self.adapters:
            self.stats_after = {}
            return
        if self.interrupted:
            self.stats_after = None
            return
        usable = [i for i in self.devices if self.work[i].state != "unusable"]
        if not self.given_back and usable == self.settled:
            self.stats_after = self.stats_settled
        else:
            self.stats_after = self.frameworks.stats(self.adapters, usable, self.notes)

    def release_pinned(self) -> None:
        """Step 6: pinned host pools on a background thread after the cell's last driver call,
        or what is left for later (release "auto", "idle" and "rerun"): "idle" always defers
        (the driver's pools too), "rerun" only a cache that holds something."""
        if self.interrupted:
            return
        release = self.settings.release
        if self.candidates and release == "cell":
            job = self.releases.start_pinned(self.candidates, self.cell.number)
            if job is not None:  # quick enough for this cell's line
                self.notes.extend(job.notes)
                self.captured.extend(job.unraisable)
                self.pinned_now = dict(job.freed)
            else:
                self.pending = True
        elif self.settled and (self.candidates or release == "idle" or (release == "rerun" and self._cached())):
            later = [] if self.now_device else [a for a in self.adapters if not on_cell_thread(a)]
            self.deferred = self.defer(later, self.candidates)

    def defer(self, device_adapters: list, pinned_adapters: list) -> dict:
        """Steps 3, 4 and 6 for later: once the kernel has been idle ``idle_release_s``."""
        settings = self.settings
        adapters = list(device_adapters)
        for a in pinned_adapters:
            if a not in adapters:
                adapters.append(a)
        device = bool(device_adapters) or settings.release in DEFERRED
        what = Release(device=device, pinned=bool(pinned_adapters), trim=device and settings.driver_pools)
        self.releases.defer(what, adapters, self.settled, self.cell.number, delay_s=settings.idle_release_s,
                            rerun=settings.release == "rerun")
        return {"device": device, "pinned": bool(pinned_adapters), "after_s": float(settings.idle_release_s)}

    def _cached(self) -> bool:
        """A framework that can give memory back on a release's thread caches some on a settled device (or its
        figures are not known)."""
        stats = self.stats_after or {}
        return any(getattr(a, "can_release", True) and not on_cell_thread(a) and (
            a.name not in stats or any(stats[a.name].on(i).cached > 0 for i in self.settled)) for a in self.adapters)

    def record(self) -> CellRecord:
        """Step 7: the record of this cell."""
        said = self.hooks.said
        line = summarize_unraisables(self.captured)
        if line:
            self.notes.append((f"unraisable:{self.captured[0]['type']}", line))
        record = CellRecord(
            cell=self.cell.number,
            time_ns=time.time_ns(),
            driver_state=self.state,
            interrupted=self.interrupted,
            devices=[self.device_record(work) for work in self.work.values()],
            pinned=PinnedRecord(
                freed_bytes=self.pinned_now,
                background=[job.result() for job in self.background],
                pending=self.pending,
                pools={name: s.pinned.as_dict() for name, s in (self.stats_after or {}).items() if s.pinned is not None},
            ),
            gc=self.gc_record,
            notes=[text for _, text in self.notes],
            shown_notes=[text for kind, text in self.notes if said.first(kind)],
            unraisable=self.captured[:20],
            release=self.settings.release,
            deferred=self.deferred,
        )
        record.touched = any(work.first_use or self.since.changed(work) for work in self.work.values())
        self.since.remember_figures(self.work)
        record.elapsed_s = round(time.perf_counter() - self.start, 6)
        record.hidden = self.hidden(record)
        self.traced(record)
        record.idle = [job.result() for job in self.idle_done]
        return record

    def hidden(self, record: CellRecord) -> List[dict]:
        """The cell's holders no variable names (``Out[N]``, its traceback), asked for only once
        this pass found a device in use: the first GPU cell's too."""
        hidden = self.cell.hidden
        if not callable(hidden):
            return list(hidden or [])
        try:
            return list(hidden() or [])
        except Exception as exc:
            text = f"the cell's Out[N] and traceback could not be searched ({type(exc).__name__}: {exc})"
            record.notes.append(text)
            if self.hooks.said.first(f"hidden:{type(exc).__name__}"):
                record.shown_notes.append(text)
            return []

    def traced(self, record: CellRecord) -> None:
        """The allocation trace (opt-in): the raw allocations this cell made and kept."""
        traced = self.hooks.traced
        if traced is None or record.cell is None:
            return
        try:
            record.traced = traced(record.cell)
        except Exception as exc:
            text = f"the allocation trace could not be read ({type(exc).__name__}: {exc})"
            record.notes.append(text)
            if self.hooks.said.first("trace-failed"):
                record.shown_notes.append(text)

    def device_record(self, work: DeviceWork) -> DeviceRecord:
        i, fig, stats = work.index, work.after or {}, self.stats_after or {}
        dev = DeviceRecord(
            index=i,
            name=fig.get("name"),
            state=work.state or ("unusable" if work.quiet else "error"),
            settle=work.settle,
            total_bytes=fig.get("total_bytes"),
            used_at_start_bytes=self.since.used.get(i),
            used_before_bytes=work.used_before,
            used_after_bytes=fig.get("used_bytes"),
            freed_bytes=work.freed,
            live_bytes=per_framework(stats, i, live=True),
            cached_bytes=per_framework(stats, i, live=False, releases=True),
            reserved_bytes=per_framework(stats, i, live=False, releases=False),
            message=work.message,
            quiet=work.quiet,
            first_use=work.first_use,
            context_only=context_only(stats, i),
        )
        # a framework in use whose figures could not be read: what is outside every pool is not known
        read = self.stats_after is not None and all(a.name in self.stats_after for a in self.adapters)
        dev.outside_bytes, dev.outside_growth_bytes = self.since.outside_after(
            work, self.stats_after if read else None, int(self.settings.outside_warning_mib) << 20, self.hooks.said,
            self.notes)
        return dev

    def remember(self, record: CellRecord) -> None:
        """What the next cell compares with: what each drain could not give back, the live and
        cached bytes after this cleanup, the names that hold GPU memory."""
        since = self.since
        stats_after = self.stats_after or {}
        for name in self.drained_now:  # what each drain could not give back, until it changes
            if name in stats_after:
                since.kept[name] = {i: f.cached for i, f in stats_after[name].devices.items()}
        if self.adapters and not self.interrupted:
            since.live = live_total(stats_after, self.devices)
            since.cached = sum(s.on(i).cached for s in stats_after.values() for i in self.devices)
            if self.cell.namespace is not None:
                since.holders.update(self.cell.namespace, since.live)
        elif not self.adapters:
            since.live = None
        since.last = None if self.interrupted or self.stats_after is None else LastPass(
            devices={i: ((w.after or {}).get("free_bytes"), w.pools) for i, w in self.work.items()},
            stats=self.stats_after)

    def outcome(self, record: CellRecord) -> Outcome:
        """Step 7: whether to speak (the show policy), and the lines, which the hooks' voice renders."""
        settings, after_forced, devices = self.settings, self.cell.after_forced, record.devices
        anything_freed = (any(sum(d.freed_bytes.values()) for d in devices) or bool(record.pinned.freed_bytes)
                          or any(job.get("freed_bytes") for job in record.pinned.background)
                          or any(job.get("devices") or job.get("pinned_freed_bytes") for job in record.idle))
        trouble = bool(record.shown_notes) or record.interrupted or any(d.state != "drained" and not d.quiet for d in devices)
        keep = True
        if after_forced is not None:
            before = {d.index: d.state for d in after_forced.devices}
            new_trouble = bool(record.shown_notes) or record.interrupted or any(
                d.state != before.get(d.index) and d.state != "drained" and not d.quiet for d in devices
            )
            shown = settings.show != "never" and bool(anything_freed or new_trouble)
        elif self.cell.forced or settings.show == "always":
            shown = True
        elif settings.show == "never":
            shown = False
        else:
            # the allocation trace found raw allocations the cell kept: worth a line even when the
            # device's figure did not move (another process may have freed as much meanwhile)
            traced = sum(int(e.get("bytes") or 0) for e in record.traced) >= OUTSIDE_NOTICE_BYTES
            shown = bool(record.touched or anything_freed or trouble or traced)
        # a progress line was written: the summary closes it, whatever the policy
        shown = shown or self.progress_opened
        if shown:
            record.reserved_fix = self.reserved_fix(record)
        data = record.to_dict()
        lines = self.hooks.voice.summary(data, shown)
        record.shown = data["shown"] = bool(lines)
        if after_forced is not None and not lines:
            keep = False  # one record per cell: this pass added nothing to the %gpumem --drain's
        return Outcome(record=record, lines=lines, keep=keep, data=data)

    def reserved_fix(self, record: CellRecord) -> Dict[str, str]:
        """What to set, per framework whose pool never gives memory back, for the first line
        that shows its reserved memory (once per kernel)."""
        fixes, said = self.frameworks.fixes, self.hooks.said
        return {name: fixes[name] for d in record.devices for name in d.reserved_bytes
                if fixes.get(name) and said.first(f"reserved:{name}")}
