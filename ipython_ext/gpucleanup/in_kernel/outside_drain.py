"""The kernel's part of a drain asked for from outside the kernel (``gpucleanup drain``, the page's **Drain**).

:class:`OutsideDrain` runs the kernel's cleanup after the library's drain, on a thread of its own and only while no
cell is under way; a cell that starts meanwhile waits for it, bounded.
"""

from __future__ import annotations

import contextlib
import gc
import math
import threading
import time
import weakref
from typing import Any, Callable, Dict, List, Optional

from .cell_state import CellState
from ..records.record import Outcome
from ..say import say

__all__ = ["OutsideDrain", "OUTSIDE_DRAIN_MARGIN_S", "REPLY_WAIT_MIN_S", "gave_no_way", "drain_part"]

# How long a cell that starts waits at most for the kernel's cleanup of a drain from outside to end, counted from
# the cleanup's start (past it, the cell runs beside it and says so).
OUTSIDE_DRAIN_MARGIN_S = 10.0
# The least the reply waits for the kernel's cleanup, whatever is left of the request's time limit: the
# frameworks' calls take milliseconds, and a reply without their figures says less.
REPLY_WAIT_MIN_S = 0.5
REPLY_WAIT_MAX_S = 60.0  # the longest time limit a drain request may name (max_drain_timeout_s)

# What the kernel's cleanup is doing, as the reply and a cell that waits say it.
CACHES = "emptying the frameworks' caches"
COLLECTING = "in garbage collection, where objects' finalizers (__del__) run"


class _Job:
    """One run of the kernel's cleanup on its thread: its part once done."""

    def __init__(self) -> None:
        self.done = False  # under OutsideDrain's condition
        self.part: Optional[dict] = None


def gave_no_way(exc: BaseException) -> bool:
    """Did a native call refuse to wait behind a drain started with ``gpucleanup drain``?"""
    return getattr(exc, "status", None) == 6 or str(exc).startswith("[gpucleanup.api.111]")


class OutsideDrain:
    """The kernel's cleanup for a drain from outside: it begins only while no cell is under way; a cell that
    starts meanwhile waits for it, bounded, and past the bound runs beside it.

    ``clean(overrides)`` runs the cleanup ``%gpumem --drain`` runs with ``overrides`` to the settings (its
    time limit, nothing printed) and says "draining" before it; ``idle()`` says the kernel is idle again once
    it has ended (unless a cell is under way: the cell says its own state); ``refusal()`` says why the cleanup
    is not active in the kernel (None: it is); ``show(lines)`` and ``warn_once(kind, text)`` are the kernel's
    output for the cell that waits. Both sides meet under one condition, built on the cells' own lock
    (``cell_state.CellState.lock``).
    """

    def __init__(self, native: Any, cells: CellState, clean: Callable[[dict], Optional[Outcome]],
                 refusal: Callable[[], Optional[str]], show: Callable[[List[str]], None],
                 warn_once: Callable[[str, str], None], idle: Callable[[], Any] = lambda: None):
        self.native = native
        self.cells = cells
        self._clean = clean
        self._refusal = refusal
        self._show = show
        self._warn_once = warn_once
        self._idle = idle
        self._cv = threading.Condition(cells.lock)
        self.running = False
        self.deadline = 0.0  # time.monotonic() past which a cell that starts no longer waits for it
        self.began = 0.0  # time.monotonic() when it began
        self.collecting = False  # its thread is in a garbage collection (objects' finalizers run there)
        self.beside = False  # a cell outwaited it and runs beside it: the cell's state stands (:meth:`quiet`)
        self.target: Any = None  # what the native drain hook calls while this kernel serves
        self._worker: Optional[int] = None  # the thread ident of the cleanup under way
        self._unhooked = False  # the endpoint closes: a reply waits no longer for the cleanup

    # ------------------------------------------------------------ the library's hook

    def hook(self, endpoint: Any) -> None:
        """A drain from outside runs this kernel's cleanup too (:meth:`run`), where the library has the hook
        (``set_drain_hook``); the library's drain runs on a thread of the status server's own, and passes how long
        its reply may wait for it (the request's time limit left)."""
        setter = getattr(self.native, "set_drain_hook", None)
        if setter is None or not endpoint.running:
            return
        ref = weakref.ref(self)  # the library's hook must not keep an unloaded extension alive
        with self._cv:
            self._unhooked = False

        def target(wait_s: float) -> dict:
            drain = ref()
            if drain is None:
                return {"ran": False, "skipped": "gpucleanup is not loaded in this kernel", "error": None}
            return drain.run(wait_s)

        try:
            if setter(target):
                self.target = target
        except Exception as exc:
            self._warn_once("status:drain-hook", f"a drain from outside cannot empty the frameworks' caches ({exc})")

    def unhook(self) -> None:
        """Before the endpoint closes (its drain thread is joined): a reply under way stops waiting for the kernel's
        cleanup at once (the cleanup itself goes on), so that closing never waits for a finalizer."""
        self._stop_waiting()
        target, self.target = self.target, None
        if target is not None:
            with contextlib.suppress(Exception):
                self.native.clear_drain_hook(target)

    def _stop_waiting(self) -> None:
        with self._cv:
            self._unhooked = True
            self._cv.notify_all()

    # ------------------------------------------------------------ the drain and the cells

    def run(self, wait_s: float = 0.0) -> dict:
        """The kernel's part of a drain asked for through the status server, after the library's drain has
        waited for queued work and trimmed: the cleanup ``%gpumem --drain`` runs (the frameworks' caches,
        device and pinned, garbage that holds GPU memory, the driver's pools again), with no wait for queued
        work of its own, said nowhere but in the reply and the history. Called on the library's drain thread.

        It begins only while no cell is under way (from ``pre_run_cell`` to the end of ``post_run_cell``), and
        a cell that starts meanwhile waits in ``pre_run_cell`` until it has ended (at most
        ``OUTSIDE_DRAIN_MARGIN_S`` from its start; past that the cell runs beside it, and says so). It runs on a
        thread of its own, because it can run the user's code (objects' finalizers, ``__del__``, which may take any
        time); this waits for it at most ``wait_s`` seconds (the request's time limit left, at least
        ``REPLY_WAIT_MIN_S``), then returns a part that says it still runs (``running``, ``doing``).
        Returns the drain result's ``kernel`` (share/schema/drain.schema.json); never raises.
        """
        start = time.perf_counter()
        try:
            wait = float(wait_s)
        except (TypeError, ValueError):
            wait = REPLY_WAIT_MIN_S
        wait = min(max(REPLY_WAIT_MIN_S, wait), REPLY_WAIT_MAX_S) if math.isfinite(wait) else REPLY_WAIT_MIN_S
        with self._cv:
            if self.running:
                return drain_part(start, skipped="another drain from outside is still running the kernel's cleanup "
                                                 f"({self.doing()}); ask again when the kernel is idle")
            why = self.why_not()
            if why is not None:
                return drain_part(start, skipped=why)
            self.running = True
            self.collecting = False
            self.beside = False
            self.began = time.monotonic()
            self.deadline = self.began + OUTSIDE_DRAIN_MARGIN_S
        job = _Job()
        try:
            threading.Thread(target=self._work, args=(job, start), name="gpucleanup-outside-drain",
                             daemon=True).start()  # daemon: a finalizer that never ends never holds up exit
        except BaseException as exc:  # no thread to be had: nothing ran
            self._ended()
            return drain_part(start, error=f"its thread did not start ({type(exc).__name__}: {exc})")
        try:
            with self._cv:
                self._cv.wait_for(lambda: job.done or self._unhooked, timeout=wait)
                if job.done:
                    return job.part or drain_part(start, error="the kernel's cleanup ended without a result")
                part = drain_part(start)
                part.update(ran=False, running=True, doing=self.doing() if self.running else CACHES)
            return part
        except BaseException as exc:  # on the library's thread: nothing may escape
            return drain_part(start, error=f"{type(exc).__name__}: {exc}")

    def _work(self, job: _Job, start: float) -> None:
        """The cleanup itself, on the thread :meth:`run` started; its part goes to ``job``."""
        self._worker = threading.get_ident()
        watched = False
        try:
            try:
                gc.callbacks.append(self._gc_phase)
                watched = True
                outcome = self._clean({"settle_timeout": 0.0, "show": "never"})
                job.part = drain_part(start, data=None if outcome is None else outcome.as_dict())
            except BaseException as exc:  # a thread of the kernel's: nothing may escape into its excepthook
                job.part = drain_part(start, error=f"{type(exc).__name__}: {exc}")
        finally:
            if watched:
                with contextlib.suppress(ValueError):
                    gc.callbacks.remove(self._gc_phase)
            self._ended(job)

    def _ended(self, job: Optional[_Job] = None) -> None:
        """The cleanup has ended: "idle" in the same step, unless a cell is under way (between its
        ``pre_run_cell`` and its ``post_run_cell``, waiting or not: it says "running" next, then "idle")."""
        with self._cv:
            if job is not None:
                job.done = True
            self.running = False
            self.collecting = False
            self._worker = None
            try:
                if self.cells.depth == 0:
                    self._idle()
            except Exception:
                pass  # the state is the endpoint's; the cleanup's end is not held up by it
            finally:
                self._cv.notify_all()

    def say_after_cell(self, idle: Callable[[], Any], draining: Callable[[], Any]) -> None:
        """A cell's end says the kernel's state: "idle", or "draining" while a cleanup it outwaited still runs
        (so that no park begins beside it), decided in one step with that cleanup's end (:meth:`_ended`)."""
        with self._cv:
            (draining if self.running else idle)()

    def _gc_phase(self, phase: str, info: dict) -> None:
        """gc.callbacks: a collection starts or stops; noted only for the cleanup's own thread (the finalizers of
        what it collects run between the two)."""
        if threading.get_ident() == self._worker:
            self.collecting = phase == "start"

    def quiet(self) -> bool:
        """Whether the kernel's state that the cleanup would say now is left unsaid: on the cleanup's own thread
        while a cell that outwaited it runs beside it (the cell's "running" stands, then its "idle")."""
        return self.beside and threading.get_ident() == self._worker

    def doing(self) -> str:
        """What the kernel's cleanup is doing now, with how long it has run."""
        since = max(0.0, time.monotonic() - self.began)
        return f"{COLLECTING if self.collecting else CACHES}, for {since:.1f} s so far"

    def why_not(self) -> Optional[str]:
        if self.cells.busy():
            return "a cell is under way"
        return self._refusal()

    def cell_starts(self) -> bool:
        """``pre_run_cell``'s first step: the cell is counted under way, in the same step as a drain checks
        the count, so that no drain begins from here; True when one runs now (the cell waits: :meth:`wait`)."""
        cells = self.cells
        with cells.lock:  # the condition's own lock, taken alone: nothing waits or is woken here (every cell)
            cells.under_way += 1
            return self.running

    def wait(self) -> None:
        """A cell starts while a drain from outside runs the kernel's cleanup: the cell waits for it, bounded
        (``OUTSIDE_DRAIN_MARGIN_S`` from the cleanup's start; past it, the cell runs and says so, once)."""
        with self._cv:
            if not self.running:
                return
            limit = max(0.0, self.deadline - time.monotonic())
            what = ("this kernel's garbage collection, where objects' finalizers (__del__) run" if self.collecting
                    else "emptying this kernel's caches")
        ended = False
        if limit >= 0.5:  # less: not worth a line of its own; the cell runs beside it at once, and says so
            self._show([say("waiting for a drain asked for from outside (gpucleanup drain or the "
                            f"page's Drain) to finish {what}, at most {limit:.0f} s")])
            with self._cv:
                ended = self._cv.wait_for(lambda: not self.running, timeout=limit)
        if not ended:
            with self._cv:
                doing = self.doing() if self.running else ""
                self.beside = self.running
            if doing:
                self._warn_once("outside-drain:late", "the kernel's cleanup for a drain from outside still runs "
                                f"({doing}); a cell waits for it at most {OUTSIDE_DRAIN_MARGIN_S:g} s from its start: "
                                "this cell runs beside it")


def drain_part(start: float, data: Optional[dict] = None, skipped: Optional[str] = None,
               error: Optional[str] = None) -> dict:
    """The drain result's ``kernel`` (share/schema/drain.schema.json) from the cleanup's record ``data``
    (None: nothing in the kernel uses CUDA), or why it did not run."""
    part: Dict[str, Any] = {"ran": skipped is None and error is None, "skipped": skipped, "error": error,
                            "elapsed_s": round(time.perf_counter() - start, 6), "interrupted": False,
                            "released_bytes": {}, "pinned_released_bytes": {}, "pinned_pending": False, "devices": []}
    if data is None:
        return part
    total: Dict[str, int] = {}
    for dev in data.get("devices") or []:
        freed = {name: int(n) for name, n in (dev.get("freed_bytes") or {}).items() if int(n or 0) > 0}
        for name, n in freed.items():
            total[name] = total.get(name, 0) + n
        part["devices"].append({"index": dev.get("index"), "state": dev.get("state"), "released_bytes": freed})
    part["released_bytes"] = total
    pinned = (data.get("pinned") or {}).get("freed_bytes") or {}
    part["pinned_released_bytes"] = {name: int(n) for name, n in pinned.items() if int(n or 0) > 0} \
        if isinstance(pinned, dict) else {}
    part["pinned_pending"] = bool((data.get("pinned") or {}).get("pending"))  # given back in the background
    part["interrupted"] = bool(data.get("interrupted"))
    return part
