"""The releases that run on a thread of their own: what a cell left cached, given back once the kernel is idle
(:class:`IdleRelease`), and the pinned host pools, given back after the cell's last driver call
(:class:`PinnedRelease`); and :class:`Releases`, which holds them between cells.

A leaf of the engine: built from what a release needs (the driver pools' trim, the capture of unraisable
errors, the status server's begin/end hook), not from the engine. Also the adapter-call helpers every part of
the engine shares (:func:`guarded`, :func:`adapter_note`).
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

from ..unraisable import CAPTURE

__all__ = ["Release", "IdleRelease", "PinnedRelease", "Releases", "guarded", "adapter_failed", "adapter_note",
           "index_of", "on_cell_thread", "Note", "DEFERRED"]

# The release policies that leave the frameworks' device caches to a release deferred by the cell ("idle" leaves
# the driver's pools to it too; "rerun" trims them after every cell and runs the release as another cell starts).
DEFERRED = ("idle", "rerun")
PINNED_REPORT_WAIT_S = 0.005  # a pinned release this quick is reported by its own cell

Note = Tuple[str, str]  # (kind, text): a kind is said once per session


def adapter_note(name: str, text: str) -> str:
    """An adapter's note as users read it: named after its adapter once
    ("[gpucleanup.cupy.204] ..." already is; other text gets "cupy: ")."""
    return text if text.startswith(f"[gpucleanup.{name}.") else f"{name}: {text}"


def adapter_failed(adapter: Any, verb: str, exc: BaseException) -> Note:
    """The note for an adapter's verb that raised: "cupy.drain failed: RuntimeError: text"."""
    name = getattr(adapter, "name", "?")
    text = str(exc).strip()
    what = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    return f"adapter:{name}:{verb}:{type(exc).__name__}", f"{name}.{verb} failed: {what}"


def guarded(adapter: Any, verb: str, *args: Any):
    """``(result, None)`` or ``(None, (kind, note))``: an adapter's exception becomes one note."""
    try:
        return getattr(adapter, verb)(*args), None
    except Exception as exc:
        return None, adapter_failed(adapter, verb, exc)


def index_of(key: Any) -> Optional[int]:
    try:
        return int(key)
    except (TypeError, ValueError):
        return None


def on_cell_thread(adapter: Any) -> bool:
    """The framework's device caches can be emptied only on the kernel's thread (``Adapter.drains_on_cell_thread``)."""
    return bool(getattr(adapter, "drains_on_cell_thread", False))


def _add_released(freed: Dict[int, Dict[str, int]], drain: Optional[dict]) -> None:
    for dev in (drain or {}).get("devices") or []:
        idx = index_of(dev.get("index"))
        if idx in freed and dev.get("released_bytes"):
            freed[idx]["driver"] = freed[idx].get("driver", 0) + int(dev["released_bytes"])

@dataclass(frozen=True)
class Release:
    """What a background release gives back: device caches, pinned host pools, and the driver's
    pools after them (``trim``)."""

    device: bool = False
    pinned: bool = False
    trim: bool = False


class IdleRelease:
    """What a cell left cached, given back once the kernel has been idle ``delay_s`` seconds.

    A cell that starts before then holds it (``AfterCell.cell_starts``): what the cell
    re-uses from the caches is not torn down and rebuilt between two cells run back to
    back. When the cell ends, a cleanup that found nothing changed re-arms it, on the same
    thread (a cell re-run back to back starts no thread); any other cancels it and defers
    what is cached then. Under release "rerun" a cell with another source runs it at once
    (:meth:`run_now`; the extension waits for it, bounded, before that cell runs). Once
    started it runs to its end on its own thread; the frameworks' pools and the driver
    serialise it with a cell that starts meanwhile. Its result is reported by the next
    cell's line ("freed 1.5 GiB when idle", "freed 1.5 GiB left by [4]").
    """

    #: a release whose time comes during a park waits for the next cell (which rearms or cancels it)
    waits_for_next_cell = True

    def __init__(self, owner: "Releases", adapters: list, devices: List[int], cell: Optional[int],
                 what: Release, delay_s: float, name: str = "gpucleanup-idle-release"):
        self.owner = owner
        self.adapters = adapters
        self.devices = list(devices)
        self.cell = cell
        self.device, self.pinned, self.trim = what.device, what.pinned, what.trim
        self.freed_device: Dict[int, Dict[str, int]] = {i: {} for i in devices}
        self.freed_pinned: Dict[str, int] = {}
        self.notes: List[Note] = []
        self.unraisable: List[dict] = []
        self.elapsed_s = 0.0
        self.done = threading.Event()
        self.reported = False
        self.delay_s = max(0.0, float(delay_s))
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        # waiting -> running -> done, or waiting -> cancelled; while waiting it runs at _deadline
        # (time.monotonic()), or not at all while held (None: a cell runs)
        self._state = "waiting"
        self._deadline: Optional[float] = None
        # when the thread's wait ends by itself (None: only when woken; -inf: not waiting): a deadline moved later
        # than that needs no wake-up, which matters to a cell re-run back to back (every one re-arms it)
        self._asleep_until: Optional[float] = -math.inf
        self._thread = threading.Thread(target=self._wait, name=name, daemon=True)
        #: release "rerun": the source of the cell that left the caches; any other cell gives them back
        self.source: Optional[str] = None
        self.when = "idle"  # what started it: "idle", or "cell" (another cell began)
        self._began = False  # the status server was told it runs (and is told when it ends)

    def start(self) -> None:
        self._deadline = time.monotonic() + self.delay_s
        self._thread.start()

    def hold(self) -> bool:
        """A cell starts: not before it has ended (:meth:`rearm` or :meth:`cancel` then); True if held."""
        return self._move(None, only_idle=True)

    def run_now(self) -> bool:
        """Another cell starts (release "rerun"): run now on its thread, alongside the cell; True if it will."""
        return self._move(0.0, when="cell")

    def rearm(self) -> bool:
        """The cell that held it changed nothing: wait ``delay_s`` again from now, on the same thread
        (a cell re-run back to back costs no thread, and wakes none); True if it still waits."""
        return self._move(self.delay_s)

    def _move(self, after_s: Optional[float], when: Optional[str] = None, only_idle: bool = False) -> bool:
        """While it still waits (and, ``only_idle``, for the kernel to be idle): run ``after_s`` seconds from
        now (None: not until moved again), said to be started by ``when``; the thread is woken only when its
        wait would end after the new deadline (a later deadline is seen when the wait ends). False when it
        runs, ran or was cancelled."""
        with self._lock:
            if self._state != "waiting" or (only_idle and self.when != "idle"):
                return False
            if when is not None:
                self.when = when
            self._deadline = None if after_s is None else time.monotonic() + after_s
            asleep_until = self._asleep_until
            if self._deadline is not None and (asleep_until is None or self._deadline < asleep_until):
                self._wake.notify()  # it would wake too late: waking a thread costs the cell's thread the GIL
            return True

    def before_cell(self, limit_s: float, still_parked: bool) -> bool:
        """Another cell starts under release "rerun" and waits for this release, woken again (woken while the
        kernel was parked, it was told to wait for the next cell: its driver calls would wait for the restore), at
        most ``limit_s`` seconds; dropped when the kernel is still parked after its resume, and the next cleanup
        finds what is cached. False when the release still runs past the limit (the cell runs alongside it)."""
        if still_parked:
            self.cancel()
            return True
        self.run_now()  # False, and nothing moved, once it runs or ran
        return limit_s <= 0 or self.done.wait(limit_s)

    def cancel(self) -> bool:
        """Drop it if it has not started; True if it was dropped."""
        with self._lock:
            if self._state != "waiting":
                return False
            self._state = "cancelled"
            self._wake.notify()
        self.done.set()
        return True

    @property
    def cancelled(self) -> bool:
        return self._state == "cancelled"

    def _wait(self) -> None:
        """The job's thread: wait for the deadline (moved by :meth:`hold` and :meth:`rearm`), then run."""
        with self._lock:
            while self._state == "waiting":
                left = None if self._deadline is None else self._deadline - time.monotonic()
                if left is not None and left <= 0:
                    if self._begin():
                        break
                    # a park under way: a driver call would wait for the restore
                    if not self.waits_for_next_cell:
                        self._state = "cancelled"  # no cell holds it: it ends, freeing nothing
                        self.done.set()
                        return
                    self._deadline = None  # the next cell rearms or cancels it
                    continue
                self._asleep_until = self._deadline
                self._wake.wait(left)
                self._asleep_until = -math.inf
            if self._state != "waiting":
                return
            self._state = "running"
        self._run()

    def _begin(self) -> bool:
        """Said to the status server before the release runs: False while a park is under way."""
        try:
            self._began = bool(self.owner.background(True))
        except Exception:
            self._began = True  # a failing hook must not keep the caches forever: nothing could park anyway
        return self._began

    def _end(self) -> None:
        if self._began:
            self._began = False
            try:
                self.owner.background(False)
            except Exception:
                pass

    def _run(self) -> None:
        owner = self.owner
        start = time.perf_counter()
        try:
            with owner.unraisables.capture() as captured:
                for adapter in self.adapters:
                    if owner.exiting:
                        break
                    with owner.adapter_lock(adapter.name), owner.unraisables.source(adapter.name):
                        # a device cache that only the kernel's thread can empty was emptied as its cell ended
                        if self.device and getattr(adapter, "can_release", True) and not on_cell_thread(adapter):
                            result, note = self._guarded(adapter, "drain", list(self.devices))
                            self._take(adapter.name, result, note, pinned=False)
                        if self.pinned and hasattr(adapter, "drain_pinned"):
                            result, note = self._guarded(adapter, "drain_pinned")
                            self._take(adapter.name, result, note, pinned=True)
                if self.trim and not owner.exiting:
                    try:
                        _add_released(self.freed_device, owner.trim())
                    except Exception as exc:
                        self.notes.append((f"idle-trim:{type(exc).__name__}", f"trim when idle failed: {exc}"))
            self.unraisable = captured
        except BaseException as exc:  # a background thread must never die loudly
            self.notes.append(("idle:internal", f"release when idle failed: {type(exc).__name__}: {exc}"))
        finally:
            self.elapsed_s = time.perf_counter() - start
            self._end()  # before done: whoever waits for it may park at once
            self._state = "done"
            self.done.set()

    def _guarded(self, adapter: Any, verb: str, *args: Any):
        """:func:`guarded` on this thread, where no Ctrl-C ever arrives (Python runs signal
        handlers on the main thread only): whatever an adapter raises here, KeyboardInterrupt
        included, is that adapter's fault, said as any other, and the next adapter still runs."""
        try:
            return guarded(adapter, verb, *args)
        except BaseException as exc:
            return None, adapter_failed(adapter, verb, exc)

    def _take(self, name: str, result: Any, note: Optional[Note], pinned: bool) -> None:
        if note:
            self.notes.append(note)
            return
        if not isinstance(result, dict):
            return
        if pinned:
            freed = int(result.get("freed_bytes") or 0)
            if freed:
                self.freed_pinned[name] = self.freed_pinned.get(name, 0) + freed
        else:
            for key, n in (result.get("freed_bytes") or {}).items():
                idx = index_of(key)
                if idx in self.freed_device and n:
                    self.freed_device[idx][name] = self.freed_device[idx].get(name, 0) + int(n)
        for text in result.get("notes") or []:
            self.notes.append((f"note:{name}:{text}", adapter_note(name, text)))

    def result(self) -> dict:
        return {
            "cell": self.cell,
            "devices": [{"index": i, "freed_bytes": dict(f)} for i, f in sorted(self.freed_device.items()) if f],
            "pinned_freed_bytes": dict(self.freed_pinned),
            "elapsed_s": round(self.elapsed_s, 6),
            "when": self.when,
        }


class PinnedRelease(IdleRelease):
    """The pinned host pools released now, on their own thread (release = "cell"): a pinned
    free makes driver calls made meanwhile wait for it, so it starts after the cell's last one.
    Should a park have begun before its thread did, it ends at once, freeing nothing: no cell holds
    it, and the next cell's cleanup finds what is still pinned."""

    waits_for_next_cell = False

    def __init__(self, owner: "Releases", adapters: list, cell: Optional[int]):
        super().__init__(owner, adapters, [], cell, Release(pinned=True), delay_s=0.0, name="gpucleanup-pinned")

    @property
    def freed(self) -> Dict[str, int]:
        return self.freed_pinned

    def result(self) -> dict:
        return {"cell": self.cell, "freed_bytes": dict(self.freed_pinned), "elapsed_s": round(self.elapsed_s, 6)}

class Releases:
    """The background releases between cells: the pinned release that may still run, the idle release that may
    still be cancelled, the one a running cell holds, those started and not yet reported by a cell's line, and a
    lock per adapter (a release and a cell never drain one framework at once).

    ``trim``: the driver pools' trim (``_native.trim``), run after a release gave device memory back;
    ``unraisables``: the capture of unraisable errors a release runs under. ``background`` is the status server's
    hook: a release on a thread of its own begins (True) or ends (False); begin answers False while the kernel is
    parking or parked (the release then makes no call at all, since a driver call of a parked process waits until
    it is restored), and until it ends no park may begin (a thread that waits for the restore while it holds the
    interpreter lock keeps the kernel from ever running the cell that would resume it). Without a server nothing
    can park the kernel: always True. ``exiting``: the kernel exits, a release still running stops between
    adapters.
    """

    def __init__(self, trim: Callable[[], dict], unraisables: Any = CAPTURE):
        self.trim = trim
        self.unraisables = unraisables
        self.background: Callable[[bool], bool] = lambda begin: True
        self.exiting = False
        self.pinned_job: Optional[PinnedRelease] = None
        self.idle_job: Optional[IdleRelease] = None  # the latest, while it may still be cancelled
        self.held_job: Optional[IdleRelease] = None  # ... held while a cell runs (cell_starts)
        self.source: Optional[str] = None  # the source of the cell that runs or ran last
        self.unreported: List[IdleRelease] = []  # started, not yet reported by a cell's line
        self._locks: Dict[str, threading.Lock] = {}
        self._locks_lock = threading.Lock()

    def adapter_lock(self, name: str) -> threading.Lock:
        with self._locks_lock:
            lock = self._locks.get(name)
            if lock is None:
                lock = self._locks[name] = threading.Lock()
            return lock

    @property
    def quiet(self) -> bool:
        """No release waits to be reported and no pinned release is under way."""
        return not self.unreported and self.pinned_job is None

    def pinned_running(self) -> bool:
        job = self.pinned_job
        return job is not None and not job.done.is_set()

    def cell_starts(self, source: Optional[str] = None) -> Optional[IdleRelease]:
        """A cell starts: a release waiting for the kernel to be idle waits for the cell's end (held);
        under release "rerun" a cell other than the one that left the caches (its ``source`` differs)
        has them given back now, on the release's thread: that release is returned (the caller may
        wait for it, bounded), else None."""
        job = self.idle_job
        if source is not None:
            self.source = source
            if job is not None and job.source is not None and job.source != source and job.run_now():
                self.idle_job = None  # it runs: the line of the cell that ends after it reports it
                return job
        if job is None or job is self.held_job:  # none, or held already by this cell's start (the cleanup asks again)
            return None
        if job.hold():
            self.held_job = job
        else:
            self.idle_job = None  # it runs or ran: the next cell's line reports it
        return None

    def held(self) -> Optional[IdleRelease]:
        """The release the last cleanup deferred, held while this cell runs (None: none)."""
        return self.held_job

    def rearm_held(self) -> None:
        """The cell changed nothing: the held release waits its full delay again from now."""
        job, self.held_job = self.held_job, None
        if job is not None and not job.rearm():
            self.idle_job = None

    def cell_ends(self) -> None:
        """A held release not re-armed is not wanted any more: this cleanup released or deferred what
        is cached now (also called before it defers anew, and by the extension when no cleanup ran)."""
        job, self.held_job = self.held_job, None
        if job is not None and job.cancel():
            with contextlib.suppress(ValueError):
                self.unreported.remove(job)
            if self.idle_job is job:
                self.idle_job = None

    def stop(self) -> None:
        """Unload or exit: nothing waits any more to run later."""
        self.cell_starts()
        self.cell_ends()

    def defer(self, what: Release, adapters: list, devices: List[int], cell: Optional[int], delay_s: float,
              rerun: bool) -> IdleRelease:
        """What the cell leaves cached, given back once the kernel has been idle ``delay_s`` (``rerun``: or as
        soon as a cell with another source starts)."""
        self.cell_ends()  # the release an earlier cell deferred is replaced by this one
        job = IdleRelease(self, adapters, devices, cell, what, delay_s=delay_s)
        if rerun:
            job.source = self.source
        self.idle_job = job
        self.unreported.append(job)
        job.start()
        return job

    def finished_idle(self) -> List[IdleRelease]:
        """The idle releases that ended since the last cell asked, cancelled ones left out: reported once."""
        done = [job for job in self.unreported if job.done.is_set()]
        self.unreported = [job for job in self.unreported if not job.done.is_set()]
        for job in done:
            job.reported = True
        return [job for job in done if not job.cancelled]

    def finished_pinned(self) -> List[PinnedRelease]:
        job = self.pinned_job
        if job is not None and job.done.is_set() and not job.reported:
            job.reported = True
            self.pinned_job = None
            return [job]
        return []

    def start_pinned(self, adapters: list, cell: Optional[int]) -> Optional[PinnedRelease]:
        """The pinned release, on its own thread; the job when it ended quickly enough for its own cell's line
        (reported now), else None (the next cell's line reports it)."""
        job = PinnedRelease(self, adapters, cell)
        self.pinned_job = job
        job.start()
        if job.done.wait(PINNED_REPORT_WAIT_S):
            job.reported = True
            self.pinned_job = None
            return job
        return None
