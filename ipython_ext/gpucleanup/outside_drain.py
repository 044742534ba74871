"""A drain asked for from outside the kernel (``gpucleanup drain``, the page's **Drain**): the kernel's part.

The library's drain runs on the status server's thread. Where the library has the hook
(``set_drain_hook``), it first calls the kernel's cleanup through :meth:`OutsideDrain.run`, which runs it
only while no cell is under way; a cell that starts meanwhile waits for it in ``pre_run_cell``, bounded
(:meth:`OutsideDrain.wait`). Both sides meet under one condition, built on the cells' own lock
(``cell_state.CellState.lock``).
"""

from __future__ import annotations

import contextlib
import threading
import time
import weakref
from typing import Any, Callable, Dict, List, Optional

from .cell_state import CellState
from .record import Outcome
from .say import say

__all__ = ["OutsideDrain", "OUTSIDE_DRAIN_MARGIN_S", "gave_no_way", "drain_part"]

# How much longer than its own time limit a cell that starts waits for a drain from outside to end.
OUTSIDE_DRAIN_MARGIN_S = 10.0


def gave_no_way(exc: BaseException) -> bool:
    """Did a native call refuse to wait behind a drain started with ``gpucleanup drain``?"""
    return getattr(exc, "status", None) == 6 or str(exc).startswith("[gpucleanup.api.111]")


class OutsideDrain:
    """The kernel's cleanup for a drain from outside, never beside a cell.

    ``clean(overrides)`` runs the cleanup ``%gpumem --drain`` runs with ``overrides`` to the settings (its
    time limit, nothing printed) and says the kernel's state around it; ``refusal()`` says why the cleanup is
    not active in the kernel (None: it is); ``show(lines)`` and ``warn_once(kind, text)`` are the kernel's
    output for the cell that waits.
    """

    def __init__(self, native: Any, cells: CellState, clean: Callable[[dict], Optional[Outcome]],
                 refusal: Callable[[], Optional[str]], show: Callable[[List[str]], None],
                 warn_once: Callable[[str, str], None]):
        self.native = native
        self.cells = cells
        self._clean = clean
        self._refusal = refusal
        self._show = show
        self._warn_once = warn_once
        self._cv = threading.Condition(cells.lock)
        self.running = False
        self.deadline = 0.0  # time.monotonic() by which it has ended
        self.target: Any = None  # what the native drain hook calls while this kernel serves

    # ------------------------------------------------------------ the library's hook

    def hook(self, endpoint: Any) -> None:
        """A drain from outside runs this kernel's cleanup first (:meth:`run`), where the library has the hook."""
        setter = getattr(self.native, "set_drain_hook", None)
        if setter is None or not getattr(endpoint, "running", False):
            return
        ref = weakref.ref(self)  # the library's hook must not keep an unloaded extension alive

        def target(timeout_s: float) -> dict:
            drain = ref()
            if drain is None:
                return {"ran": False, "skipped": "gpucleanup is not loaded in this kernel", "error": None}
            return drain.run(timeout_s)

        try:
            if setter(target):
                self.target = target
        except Exception as exc:
            self._warn_once("status:drain-hook", f"a drain from outside cannot empty the frameworks' caches ({exc})")

    def unhook(self) -> None:
        target, self.target = self.target, None
        if target is not None:
            with contextlib.suppress(Exception):
                self.native.clear_drain_hook(target)

    # ------------------------------------------------------------ the drain and the cells

    def run(self, timeout_s: float = 0.0) -> dict:
        """The kernel's part of a drain asked for through the status server, after the library's drain has
        waited for queued work: the cleanup ``%gpumem --drain`` runs (the frameworks' caches, device and
        pinned, garbage that holds GPU memory, the driver's pools again), its own wait for queued work bounded
        by ``timeout_s`` (0 from the library), said nowhere but in the reply and the history. Runs on the
        status server's thread.

        Never beside a cell: it runs only while no cell is under way (from ``pre_run_cell`` to the end of
        ``post_run_cell``), and a cell that starts meanwhile waits in ``pre_run_cell`` until it has ended
        (at most ``timeout_s`` + ``OUTSIDE_DRAIN_MARGIN_S``). Returns the drain result's ``kernel``
        (share/schema/drain.schema.json); never raises.
        """
        start = time.perf_counter()
        with self._cv:
            if self.running:
                return drain_part(start, skipped="another drain from outside is running the kernel's cleanup")
            why = self.why_not()
            if why is not None:
                return drain_part(start, skipped=why)
            self.running = True
            self.deadline = time.monotonic() + float(timeout_s) + OUTSIDE_DRAIN_MARGIN_S
        try:
            try:
                outcome = self._clean({"settle_timeout": float(timeout_s), "show": "never"})
            except Exception as exc:
                return drain_part(start, error=f"{type(exc).__name__}: {exc}")
            return drain_part(start, data=None if outcome is None else outcome.as_dict())
        except BaseException as exc:  # on the server's thread: nothing may escape
            return drain_part(start, error=f"{type(exc).__name__}: {exc}")
        finally:
            with self._cv:
                self.running = False
                self._cv.notify_all()

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
        (the drain's own limit and a margin; past it, the cell runs and says so)."""
        with self._cv:
            if not self.running:
                return
            limit = max(0.0, self.deadline - time.monotonic())
        self._show([say("waiting for a drain asked for from outside (gpucleanup drain or the "
                        f"page's Drain) to finish emptying this kernel's caches, at most {limit:.0f} s")])
        with self._cv:
            ended = self._cv.wait_for(lambda: not self.running, timeout=limit)
        if not ended:
            self._warn_once("outside-drain:late", f"a drain from outside still ran after {limit:.0f} s: the cell "
                                                  "runs beside it")


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
