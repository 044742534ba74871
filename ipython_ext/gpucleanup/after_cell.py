"""The after-cell engine: what gpucleanup does to GPU memory after a cell, as plain steps.

Like IPython's own ``autoreload`` (a ``ModuleReloader`` that knows nothing of the shell,
and a hook of a few lines that delegates), this module imports nothing from IPython:
the extension (``extension.py``) owns the lifecycle, the traits and ``%gpumem``, and
hands each cell to :meth:`AfterCell.run`, which returns an :class:`~.record.Outcome`:
a typed record and the lines to print, separately.

The steps, each a method of :class:`CellPass` over one :class:`DeviceWork` per device
in use (built once from the native pass's entry for it) and the frameworks' figures read
once into :class:`FrameworkFigures`:

0. ``quiet``: once a cell has been proven idle, the next asks the library's quiet check
   (``_native.quiet``: the same devices, free memory and pools as that pass left, nothing
   queued) and reads each framework once (which frameworks are in use: as the last idle cell
   found them while nothing was imported since, ``_adapters_in_use``); figures equal to the last
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
7. ``record`` and ``AfterCell._outcome``: the record and what to print.

When nothing in the process uses CUDA, a cell costs one native call and nothing else.
Nothing here raises into the caller for a fault of a framework or of the driver: each
becomes a note, said once per kind.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import math
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple, Union

try:  # the C module under signal: no enum made per call (the cleanup arms its handler once per cell)
    import _signal as _raw_signal
except ImportError:  # pragma: no cover - not CPython
    _raw_signal = signal

from . import report
from .frameworks.objects import gpu_holder_names
from .record import CellRecord, DeviceRecord, GcRecord, Outcome, PinnedRecord
from .unraisable import CAPTURE, summarize_unraisables

__all__ = ["AfterCell", "Settings", "adapter_note"]

# The release policies that leave the frameworks' device caches to a release deferred by the cell ("idle" leaves
# the driver's pools to it too; "rerun" trims them after every cell and runs the release as another cell starts).
DEFERRED = ("idle", "rerun")
_PINNED_REPORT_WAIT_S = 0.005  # a pinned release this quick is reported by its own cell
_ADAPTER_LOCK_WAIT_S = 0.05  # how long a cell waits for a background pinned release of the same adapter

Note = Tuple[str, str]  # (kind, text): a kind is said once per session


@dataclass(frozen=True)
class Settings:
    """What one cell's cleanup does: the extension's traits, read when the cell ends."""

    gc: str = "auto"
    pinned: bool = True
    driver_pools: bool = True
    settle_timeout: float = 30.0
    show: str = "auto"
    frameworks: Mapping[str, bool] = field(default_factory=dict)
    #: "cell": every cache after every cell; "auto": device caches after every cell, pinned
    #: host pools once the kernel is idle; "idle": everything once the kernel is idle; "rerun":
    #: the driver's pools after every cell, the frameworks' caches once the kernel is idle or as
    #: soon as a cell other than the one that left them starts. "cell" here, for callers without
    #: cells (the Dask worker plugin); the extension's trait defaults to "rerun"
    release: str = "cell"
    #: how long the kernel must stay idle before a deferred release runs
    idle_release_s: float = 1.0
    #: say once per device when memory outside every pool grew this much since loading (0: never)
    outside_warning_mib: int = 256

    def framework_enabled(self, name: str) -> bool:
        return bool(self.frameworks.get(name, True))


def adapter_note(name: str, text: str) -> str:
    """An adapter's note as users read it: named after its adapter once
    ("[gpucleanup.cupy.204] ..." already is; other text gets "cupy: ")."""
    return text if text.startswith(f"[gpucleanup.{name}.") else f"{name}: {text}"


def _adapter_failed(adapter: Any, verb: str, exc: BaseException) -> Note:
    """The note for an adapter's verb that raised: "cupy.drain failed: RuntimeError: text"."""
    name = getattr(adapter, "name", "?")
    text = str(exc).strip()
    what = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    return f"adapter:{name}:{verb}:{type(exc).__name__}", f"{name}.{verb} failed: {what}"


def _same_answer(last: dict, now: dict) -> bool:
    """Two answers of an adapter's ``stats`` are equal; one holding values that cannot be compared
    (an array's ``==`` has no single truth) is taken as different."""
    try:
        return bool(last == now)
    except Exception:
        return False


def _index(key: Any) -> Optional[int]:
    try:
        return int(key)
    except (TypeError, ValueError):
        return None


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

    def _handler(self, signum, frame) -> None:
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
                    _raw_signal.signal(signal.SIGINT, ctrl_c._handler)
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

    def __init__(self, engine: "AfterCell", adapters: list, devices: List[int], cell: Optional[int],
                 what: Release, delay_s: float, name: str = "gpucleanup-idle-release"):
        self.engine = engine
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
            self._began = bool(self.engine.background(True))
        except Exception:
            self._began = True  # a failing hook must not keep the caches forever: nothing could park anyway
        return self._began

    def _end(self) -> None:
        if self._began:
            self._began = False
            try:
                self.engine.background(False)
            except Exception:
                pass

    def _run(self) -> None:
        engine = self.engine
        start = time.perf_counter()
        try:
            with engine.unraisables.capture() as captured:
                for adapter in self.adapters:
                    if engine.exiting:
                        break
                    with engine.adapter_lock(adapter.name), engine.unraisables.source(adapter.name):
                        # a device cache that only the kernel's thread can empty was emptied as its cell ended
                        if self.device and getattr(adapter, "can_release", True) and not _on_cell_thread(adapter):
                            result, note = self._guarded(adapter, "drain", list(self.devices))
                            self._take(adapter.name, result, note, pinned=False)
                        if self.pinned and hasattr(adapter, "drain_pinned"):
                            result, note = self._guarded(adapter, "drain_pinned")
                            self._take(adapter.name, result, note, pinned=True)
                if self.trim and not engine.exiting:
                    try:
                        _add_released(self.freed_device, engine.native.trim())
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
        """``engine.guarded`` on this thread, where no Ctrl-C ever arrives (Python runs signal
        handlers on the main thread only): whatever an adapter raises here, KeyboardInterrupt
        included, is that adapter's fault, said as any other, and the next adapter still runs."""
        try:
            return self.engine.guarded(adapter, verb, *args)
        except BaseException as exc:
            return None, _adapter_failed(adapter, verb, exc)

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
                idx = _index(key)
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

    def __init__(self, engine: "AfterCell", adapters: list, cell: Optional[int]):
        super().__init__(engine, adapters, [], cell, Release(pinned=True), delay_s=0.0, name="gpucleanup-pinned")

    @property
    def freed(self) -> Dict[str, int]:
        return self.freed_pinned

    def result(self) -> dict:
        return {"cell": self.cell, "freed_bytes": dict(self.freed_pinned), "elapsed_s": round(self.elapsed_s, 6)}


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


@dataclass(frozen=True)
class Held:
    """A framework's bytes on one device, or in its pinned host pools: live, and cached (given back
    on a drain, or, for a framework that never gives memory back, reserved)."""

    live: int = 0
    cached: int = 0

    @classmethod
    def read(cls, entry: Any) -> Optional["Held"]:
        if not isinstance(entry, dict):
            return None
        return cls(int(entry.get("live_bytes") or 0), int(entry.get("cached_bytes") or 0))

    def as_dict(self) -> dict:
        return {"live_bytes": self.live, "cached_bytes": self.cached}


_NOTHING_HELD = Held()


@dataclass
class FrameworkFigures:
    """One framework's figures, read once from its adapter's ``stats`` into typed values."""

    devices: Dict[int, Held] = field(default_factory=dict)
    pinned: Optional[Held] = None  # None: not known
    notes: List[str] = field(default_factory=list)
    releases: bool = True  # False: a pool that never gives memory back: its cache is reserved, not freeable
    fix: Optional[str] = None  # what to set so that it does
    pools: List[dict] = field(default_factory=list)  # pools of the user's making (PyCUDA), one entry each

    @classmethod
    def read(cls, adapter: Any, result: dict) -> "FrameworkFigures":
        devices = {}
        for key, entry in (result.get("devices") or {}).items():
            idx, held = _index(key), Held.read(entry)
            if idx is not None and held is not None:
                devices[idx] = held
        pools = result.get("pools")
        return cls(devices=devices, pinned=Held.read(result.get("pinned")), notes=list(result.get("notes") or []),
                   releases=bool(getattr(adapter, "can_release", True)),
                   fix=_text_or_none(getattr(adapter, "reserved_fix", None)),
                   pools=[dict(p) for p in pools if isinstance(p, dict)] if isinstance(pools, list) else [])

    def on(self, i: int) -> Held:
        return self.devices.get(i, _NOTHING_HELD)


Stats = Dict[str, FrameworkFigures]  # per framework name

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


class AfterCell:
    """One cell's cleanup at a time, and what it must remember between cells.

    ``native`` is ``gpucleanup._native`` (or a stand-in with its ``cuda_initialized``, ``after_cell``,
    ``trim`` and ``snapshot``, returning the same shapes);
    ``adapters`` a callable returning the framework adapters in use (None: the real
    ones, ``gpucleanup.frameworks.active``); ``status`` a callable ``(method, payload)``
    feeding the status endpoint; ``write`` where the progress line goes.
    """

    def __init__(
        self,
        native: Any,
        adapters: Optional[Callable[[], Any]] = None,
        status: Optional[Callable[[str, dict], None]] = None,
        write: Optional[Callable[[str], None]] = None,
    ):
        self.native = native
        self._adapters_fn = adapters
        self._status = status or (lambda method, payload: None)
        self._write = write or _write_stdout
        self.unraisables = CAPTURE
        self.ctrl_c = CtrlC()
        self.holders = GpuHolders()
        #: the allocation trace's entries of a cell (``Tracer.cell_entries``), None: no trace
        self.traced: Optional[Callable[[int], List[dict]]] = None
        #: whether the allocation trace runs now: while it does, no cell is skipped as idle (what it
        #: traced may change with no change the driver sees)
        self.tracing: Callable[[], bool] = lambda: False
        # A release on a thread of its own begins (True) or ends (False), said to the status server: begin
        # answers False while the kernel is parking or parked (the release then makes no call at all, since a
        # driver call of a parked process waits until it is restored), and until it ends no park may begin
        # (a thread that waits for the restore while it holds the interpreter lock keeps the kernel from ever
        # running the cell that would resume it). Without a server nothing can park the kernel: always True.
        self.background: Callable[[bool], bool] = lambda begin: True
        self.exiting = False
        self.last_driver_state: Optional[str] = None
        self.pinned_job: Optional[PinnedRelease] = None
        self.idle_job: Optional[IdleRelease] = None  # the latest, while it may still be cancelled
        self._held: Optional[IdleRelease] = None  # ... held while a cell runs (cell_starts)
        self._source: Optional[str] = None  # the source of the cell that runs or ran last
        self._idle_jobs: List[IdleRelease] = []  # started, not yet reported by a cell's line
        self._warned: set = set()
        self._unusable: set = set()
        self._adapter_locks: Dict[str, threading.Lock] = {}
        self._locks_lock = threading.Lock()
        self._last_free: Dict[int, int] = {}  # device free after the last cleanup
        self._last_live: Optional[int] = None  # live GPU bytes the frameworks told after it
        self._last_cached: Optional[int] = None  # and the bytes they kept cached
        self._last_outside: Dict[int, int] = {}  # per device: outside every pool after the last cleanup
        self._outside_base: Dict[int, int] = {}  # ... after the first cleanup
        self._kept: Dict[str, Dict[int, int]] = {}  # per framework and device: cached bytes its last drain left
        self._fixes: Dict[str, str] = {}  # per framework whose pool never gives memory back: what to set
        #: per framework: (adapter, its last stats answer, the figures read from it, its quiet token read just
        #: before that answer), see :meth:`stats`
        self._figures_read: Dict[str, Tuple[Any, dict, FrameworkFigures, Optional[tuple]]] = {}
        self._drained_now: List[str] = []  # frameworks drained by this cleanup
        #: the last full cleanup, for an idle cell to be compared with (None: none to compare with)
        self._last_pass: Optional[LastPass] = None
        #: the last cleanup proved nothing had changed, from a native pass whose state the library keeps
        #: (or from the quiet check since): the next cell may ask the library's quiet check first
        self._quiet_ok = False
        #: (the number of modules imported, the settings, the adapters in use) as the last idle cell proved
        #: them; a full pass forgets them (see :meth:`CellPass._adapters_in_use`)
        self._quiet_adapters: Optional[Tuple[int, Settings, list]] = None
        #: what the last cell proven idle by the quiet check rested on (:class:`IdleProof`): the next cell, if
        #: it finds the same, skips the comparisons that proof made; taken by every cell, so it stands only
        #: from one cell proven idle to the next
        self._idle_proof: Optional[IdleProof] = None
        self.skipped = 0  # idle cells whose cleanup was skipped: nothing had changed since the last
        self._last_used: Dict[int, int] = {}
        #: devices seen with a context of this process, at load or by a cleanup (None: nothing known
        #: yet): a device in use now and never before had "no context yet" before the cell, its first
        #: GPU cell. Never emptied: a driver call that fails and lists no device changes nothing here
        self._seen_in_use: Optional[set] = None
        self._cell: Optional[int] = None
        self._progress_shown = False
        self.progress_opened = False  # a progress line was written during this cleanup

    # ------------------------------------------------------------ shared helpers

    def note_once(self, kind: str) -> bool:
        """True the first time ``kind`` is seen in this session."""
        if kind in self._warned:
            return False
        self._warned.add(kind)
        return True

    def adapter_lock(self, name: str) -> threading.Lock:
        with self._locks_lock:
            lock = self._adapter_locks.get(name)
            if lock is None:
                lock = self._adapter_locks[name] = threading.Lock()
            return lock

    def guarded(self, adapter: Any, verb: str, *args: Any):
        """``(result, None)`` or ``(None, (kind, note))``: an adapter's exception becomes one note."""
        try:
            return getattr(adapter, verb)(*args), None
        except Exception as exc:
            return None, _adapter_failed(adapter, verb, exc)

    def adapters(self, settings: Settings, notes: List[Note]) -> list:
        """Enabled adapters whose framework is in use. Only called once the driver is 'ready'."""
        fn = self._adapters_fn
        if fn is None:
            try:
                from .frameworks import active as fn
            except Exception:
                return []  # the adapters are not part of this build
            self._adapters_fn = fn
        try:
            found = fn()
            adapters = list(found.values() if isinstance(found, dict) else found)
        except Exception as exc:
            notes.append(("adapters:active", f"framework detection failed: {type(exc).__name__}: {exc}"))
            return []
        if not settings.frameworks:  # none turned off (the default): nothing to filter, on every cell
            return adapters
        return [a for a in adapters if settings.framework_enabled(str(getattr(a, "name", "?")))]

    def stats(self, adapters: list, devices: List[int], notes: List[Note], by_token: bool = False) -> Stats:
        """Each adapter's figures on ``devices``, read once into a :class:`FrameworkFigures`. An adapter
        that answers what it answered last time gets the very figures built then: on an idle cell the
        comparison with the last cleanup's figures is then one of identity. Each read is preceded by the
        adapter's quiet token (``Adapter.quiet_token``, where it has one); ``by_token`` (an idle cell): an
        adapter whose token is the one read before its last figures is not asked for them again, they stand
        (a change after that token was read shows in the next one)."""
        out: Stats = {}
        for adapter in adapters:
            last = self._figures_read.get(adapter.name)
            if last is not None and last[0] is not adapter:
                last = None
            token = self._quiet_token(adapter, devices, by_token)
            if by_token and token is not None and last is not None and last[3] == token:
                figures = out[adapter.name] = last[2]
            else:
                result, note = self.guarded(adapter, "stats", list(devices))
                if note:
                    notes.append(note)
                    continue
                if not isinstance(result, dict):
                    continue
                if last is not None and _same_answer(last[1], result):
                    figures = out[adapter.name] = last[2]
                    result = last[1]
                else:
                    figures = out[adapter.name] = FrameworkFigures.read(adapter, result)
                self._figures_read[adapter.name] = (adapter, result, figures, token)
            if figures.fix:
                self._fixes[adapter.name] = figures.fix
        return out

    @staticmethod
    def _quiet_token(adapter: Any, devices: List[int], in_use: bool = False) -> Optional[tuple]:
        """The adapter's quiet token, None where it has none or fails (its figures are read then). ``in_use``:
        an idle cell's adapters, found in use by the last full look (``CellPass._adapters_in_use``)."""
        read = getattr(adapter, "quiet_token", None)
        if read is None:
            return None
        try:
            token = read(list(devices), in_use=True) if in_use else read(list(devices))
        except Exception:
            return None
        return token if isinstance(token, tuple) else None

    def memory_status(self, settings: Settings) -> dict:
        """The process's GPU memory as data with exact bytes (what %gpumem shows): per device in
        use the driver's figures, each framework's live and cached bytes, the driver pools and what
        is outside every pool; the pinned pools; notes. Reads only: frees nothing, initialises nothing."""
        notes: List[tuple] = []
        out: dict = {"kind": "gpumem", "time_ns": time.time_ns(), "devices": [], "pinned": {}}
        try:
            snap = self.native.snapshot()
        except Exception as exc:
            out["driver"] = {"state": "unusable", "message": str(exc)}
            out["notes"] = [f"snapshot failed: {exc}"]
            return out
        driver = snap.get("driver") or {}
        out["driver"] = driver
        in_use = [d for d in snap.get("devices") or [] if d.get("in_use")]
        adapters = self.adapters(settings, notes) if driver.get("state") == "ready" and in_use else []
        indices = [int(d["index"]) for d in in_use if not self.is_unusable(int(d["index"]))]
        stats = self.stats(adapters, indices, notes) if adapters else {}
        out["frameworks"] = {}
        for adapter in adapters:
            desc, note = self.guarded(adapter, "describe")
            out["frameworks"][adapter.name] = desc if isinstance(desc, str) else None
            if note:
                notes.append(note)
        for dev in in_use:
            i = int(dev["index"])
            fws = {name: _status_figures(s, i) for name, s in stats.items() if i in s.devices}
            pools = [
                {"which": p.get("which"), "reserved_bytes": p.get("reserved_bytes"), "used_bytes": p.get("used_bytes")}
                for p in dev.get("pools") or []
            ]
            used = dev.get("used_bytes")
            known = sum(e["live_bytes"] + e["cached_bytes"] + e.get("reserved_bytes", 0) for e in fws.values()) + sum(int(p["reserved_bytes"] or 0) for p in pools)
            out["devices"].append(
                {
                    "index": i,
                    "name": dev.get("name"),
                    "state": "unusable" if self.is_unusable(i) else dev.get("state"),
                    "total_bytes": dev.get("total_bytes"),
                    "used_bytes": used,
                    "free_bytes": dev.get("free_bytes"),
                    "frameworks": fws,
                    "pools": pools,
                    "known_bytes": known,
                    "outside_bytes": max(0, used - known) if used is not None else None,
                    "outside_since_load_bytes": self.outside_since_load(i),
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

    @staticmethod
    def live_total(stats: Stats, devices: List[int]) -> int:
        return sum(s.on(i).live for s in stats.values() for i in devices)

    def is_unusable(self, index: int) -> bool:
        return index in self._unusable

    def baseline(self, probe: dict) -> None:
        """The devices in use before the first cell (the extension's probe at load): a device
        not among them that a cell starts using is that cell's first use of it."""
        self._seen_in_use = {int(d["index"]) for d in probe.get("devices") or []
                             if d.get("in_use") and _index(d.get("index")) is not None}

    def _know_baseline(self) -> None:
        """Nothing in use now: from here on a device that shows up in use is a first use."""
        if self._seen_in_use is None:
            self._seen_in_use = set()

    def cell_starts(self, source: Optional[str] = None) -> Optional[IdleRelease]:
        """A cell starts: a release waiting for the kernel to be idle waits for the cell's end (held);
        under release "rerun" a cell other than the one that left the caches (its ``source`` differs)
        has them given back now, on the release's thread: that release is returned (the caller may
        wait for it, bounded), else None."""
        job = self.idle_job
        if source is not None:
            self._source = source
            if job is not None and job.source is not None and job.source != source and job.run_now():
                self.idle_job = None  # it runs: the line of the cell that ends after it reports it
                return job
        if job is None or job is self._held:  # none, or held already by this cell's start (the cleanup asks again)
            return None
        if job.hold():
            self._held = job
        else:
            self.idle_job = None  # it runs or ran: the next cell's line reports it
        return None

    def held(self) -> Optional[IdleRelease]:
        """The release the last cleanup deferred, held while this cell runs (None: none)."""
        return self._held

    def rearm_held(self) -> None:
        """The cell changed nothing: the held release waits its full delay again from now."""
        job, self._held = self._held, None
        if job is not None and not job.rearm():
            self.idle_job = None

    def cell_ends(self) -> None:
        """A held release not re-armed is not wanted any more: this cleanup released or deferred what
        is cached now (also called before it defers anew, and by the extension when no cleanup ran)."""
        job, self._held = self._held, None
        if job is not None and job.cancel():
            with contextlib.suppress(ValueError):
                self._idle_jobs.remove(job)
            if self.idle_job is job:
                self.idle_job = None

    def stop(self) -> None:
        """Unload or exit: nothing waits any more to run later."""
        self.cell_starts()
        self.cell_ends()

    # ------------------------------------------------------------ the cell

    def run(
        self,
        settings: Settings,
        cell: Optional[int] = None,
        namespace: Optional[dict] = None,
        forced: bool = False,
        after_forced: Optional[CellRecord] = None,
        hidden: Union[None, List[dict], Callable[[], List[dict]]] = None,
    ) -> Optional[Outcome]:
        """The cleanup after one cell (a :class:`CellPass`); None when nothing in the process uses CUDA.

        ``forced`` (``%gpumem --drain``) always returns lines. ``after_forced`` is the
        record of a ``%gpumem --drain`` earlier in the same cell: this cleanup then says
        and keeps only what it adds to it (one line and one record per cell). ``hidden``:
        the cell's holders no variable names, or a callable asked for them once a device is in use.
        """
        self.progress_opened = False
        self.cell_starts()  # a release still waiting is re-armed, or replaced by this cleanup's
        self._cell = cell
        try:
            return CellPass(self, settings, Cell(cell, namespace, forced, after_forced, hidden)).run()
        finally:
            self.cell_ends()

    # ------------------------------------------------------------ steps

    def _hidden(self, hidden: Union[None, List[dict], Callable[[], List[dict]]], notes: CellRecord) -> List[dict]:
        """The cell's holders no variable names (``Out[N]``, its traceback), asked for only once
        this pass found a device in use: the first GPU cell's too."""
        if not callable(hidden):
            return list(hidden or [])
        try:
            return list(hidden() or [])
        except Exception as exc:
            text = f"the cell's Out[N] and traceback could not be searched ({type(exc).__name__}: {exc})"
            notes.notes.append(text)
            if self.note_once(f"hidden:{type(exc).__name__}"):
                notes.shown_notes.append(text)
            return []

    def _nothing_in_use(self, driver: dict, cell: Optional[int], forced: bool) -> Optional[Outcome]:
        state = driver.get("state")
        if state == "unusable" and self.note_once("driver:unusable"):
            self._write(f"{report.PREFIX}{report.SEP}the CUDA driver is unusable: {driver.get('message')}\n")
        if not forced:
            return None
        why = report.driver_sentence(driver) if state != "ready" else "no GPU in use by this kernel: nothing to clean"
        record = CellRecord(cell=cell, time_ns=time.time_ns(), driver_state=state, shown=True)
        return Outcome(record=record, lines=[report.SEP.join([report.PREFIX, why])], keep=False)

    def _settle_limit(self, settings: Settings, after_forced: Optional[CellRecord]) -> float:
        """No second wait for a device that a ``%gpumem --drain`` earlier in the cell
        already waited for in vain."""
        if after_forced is not None and any(d.state not in ("drained", "unusable") for d in after_forced.devices):
            return 0.0
        return float(settings.settle_timeout)

    def _take_pass(self, work: DeviceWork, dev: dict, notes: List[Note]) -> None:
        """What lasts of a device's pass entry: a device unusable from now on; an error said."""
        if work.state == "unusable":
            self._unusable.add(work.index)
        elif work.state == "error":
            err = dev.get("error") or {}
            notes.append((f"device-error:{err.get('name') or dev.get('message')}",
                          dev.get("message") or f"GPU{work.index}: {err.get('message')}"))

    @contextlib.contextmanager
    def _progress_line(self, settings: Settings):
        """Around a native wait: the progress line it may write is closed when it returns."""
        self._progress_shown = False
        self._show_progress = settings.show != "never"
        try:
            yield
        finally:
            if self._progress_shown:
                self._write("\n")
                self._progress_shown = False

    def _native_pass(self, timeout: float, settings: Settings, notes: List[Note], trim: bool) -> Optional[dict]:
        """The one-pass native call (``_native.after_cell``), with the progress line."""
        with self._progress_line(settings):
            try:
                return self.native.after_cell(timeout=timeout, progress=self._progress, trim=trim)
            except Exception as exc:
                if str(exc).startswith("[gpucleanup.api.111]"):
                    raise  # a drain from outside holds the library: the extension says so
                notes.append((f"drain:{type(exc).__name__}", f"native after-cell pass failed: {exc}"))
                return None

    def _progress(self, payload: dict) -> bool:
        if self.ctrl_c.pressed:
            return True  # stop waiting
        # The status endpoint (gpucleanup ps) shows which GPU the cell waits for,
        # since when: the wait began waited_s ago.
        waited_s = float(payload.get("waited_s", 0.0))
        device = int(payload.get("device", 0))
        self._status("set_state", {"state": "waiting", "device": device, "cell": self._cell,
                                   "since_ns": time.time_ns() - int(waited_s * 1e9)})
        if not self._show_progress:
            return False
        self._write(("\r" if self._progress_shown else "") + report.progress_line(device, waited_s))
        self._progress_shown = True
        self.progress_opened = True
        return False

    def _live_hint(self, settled: List[DeviceWork]) -> Optional[int]:
        """Live GPU bytes as the frameworks told them after the last cleanup, when the
        driver saw no change on any device since and no framework kept a cache (None:
        not known, or memory may have changed hands)."""
        if self._last_live is None or self._last_cached != 0:
            # a framework kept a cache (release "auto"/"idle", or one that cannot release):
            # it can hand out memory again without the driver seeing any change
            return None
        return self._last_live if self._driver_unchanged(settled) else None

    def _driver_unchanged(self, settled: List[DeviceWork]) -> bool:
        """Every device has the free memory the last cleanup left (False: one changed, or not known)."""
        return all(work.free_before is not None and self._last_free.get(work.index) == work.free_before
                   for work in settled)

    def _collect(self, settings: Settings, adapters: list, live: Optional[int], settled: List[int],
                 namespace: Optional[dict]) -> GcRecord:
        """Step 2: garbage collection, only when it can release GPU memory.

        'auto': a young collection unless the frameworks held no live GPU memory after the
        last cleanup, kept no cache, and the driver has seen no change since (``live`` is
        then 0; None: not known, collect); a full one only when the cell also unbound a
        name that held GPU memory and GPU memory is still live after the young one.
        'always': a full collection.
        """
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
            if self.holders.unbound(namespace):
                after = self.live_total(self.stats(adapters, settled, []), settled) if adapters else None
                if after is None or after > 0:
                    info.collected += gc.collect()
                    info.ran = "full"
        info.elapsed_s = round(time.perf_counter() - start, 6)
        return info

    def _drain_frameworks(self, adapters: list, work: Dict[int, DeviceWork], settled: List[int], notes: List[Note],
                          ctrl_c: CtrlC, stats: Optional[Stats] = None) -> bool:
        """Step 3: each framework empties its caches on the settled devices; True if any gave memory back.

        A framework whose figures (``stats``, read after the collection) say it caches
        nothing on any of them, or exactly what its last drain could not give back (torch
        keeps a partly used segment), is left alone: nothing to give back, no call made."""
        for adapter in adapters:
            ctrl_c.check()
            if not getattr(adapter, "can_release", True):
                continue
            if stats is not None and _nothing_new_cached(stats.get(adapter.name), settled,
                                                         self._kept.get(adapter.name, {})):
                continue
            lock = self.adapter_lock(adapter.name)
            if not lock.acquire(timeout=_ADAPTER_LOCK_WAIT_S):
                notes.append((f"busy-pinned:{adapter.name}",
                              f"{adapter.name}: pinned release of an earlier cell still running, its device pool waits for the next cell"))
                continue
            try:
                with self.unraisables.source(adapter.name):
                    res, note = self.guarded(adapter, "drain", list(settled))
            finally:
                lock.release()
            if note:
                notes.append(note)
                continue
            if isinstance(res, dict) and not res.get("notes"):
                self._drained_now.append(adapter.name)  # emptied as far as it can be
            if isinstance(res, dict):
                for key, n in (res.get("freed_bytes") or {}).items():
                    if _index(key) in work:
                        work[_index(key)].add_freed(adapter.name, n)
                for text in res.get("notes") or []:
                    notes.append((f"note:{adapter.name}:{text}", adapter_note(adapter.name, text)))
        return any(n for i in settled for name, n in work[i].freed.items() if name != "driver")

    def _pinned_candidates(self, settings: Settings, adapters: list, stats: Stats, settled: List[int],
                           devices: List[int]) -> Tuple[list, bool]:
        """Which adapters' pinned pools to release after the cell's last driver call, and
        whether an earlier release still runs."""
        if not (settings.pinned and adapters and len(settled) == len(devices)):
            return [], False
        job = self.pinned_job
        if job is not None and not job.done.is_set():
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

    def _trim(self, work: Dict[int, DeviceWork], notes: List[Note]) -> set:
        """Step 4: the driver's pools again, after the frameworks gave memory back to them.
        Returns the devices whose figures after it the library reported (no snapshot needed for them)."""
        try:
            result = self.native.trim()
        except Exception as exc:
            notes.append((f"trim:{type(exc).__name__}", f"native trim failed: {exc}"))
            return set()
        fresh = set()
        for dev in result.get("devices") or []:
            item = work.get(_index(dev.get("index")))
            if item is None:
                continue
            item.add_freed("driver", dev.get("released_bytes"))
            if dev.get("free_bytes") is not None:
                item.take_figures(dev)
                fresh.add(item.index)
        return fresh

    def _snapshot(self, work: Dict[int, DeviceWork], stale: bool, notes: List[Note]) -> None:
        """Step 5: device figures after the cleanup; a fresh snapshot only when the pass's (or the
        trim's) may be ``stale`` (something was freed or collected since), or it reported none."""
        if not stale and any(item.after is not None for item in work.values()):
            return
        try:
            snapshot = self.native.snapshot()
        except Exception as exc:
            notes.append((f"snapshot:{type(exc).__name__}", f"snapshot failed: {exc}"))
            snapshot = {}
        found = {_index(d.get("index")): d for d in snapshot.get("devices") or []}
        for item in work.values():
            if item.index in found:
                item.take_figures(found[item.index])
            else:
                item.after, item.pools = None, None

    def _defer(self, settings: Settings, device_adapters: list, pinned_adapters: list, devices: List[int],
               cell: Optional[int]) -> dict:
        """Steps 3, 4 and 6 for later: once the kernel has been idle ``idle_release_s``."""
        adapters = list(device_adapters)
        for a in pinned_adapters:
            if a not in adapters:
                adapters.append(a)
        device = bool(device_adapters) or settings.release in DEFERRED
        what = Release(device=device, pinned=bool(pinned_adapters), trim=device and settings.driver_pools)
        self.cell_ends()  # the release an earlier cell deferred is replaced by this one
        job = IdleRelease(self, adapters, devices, cell, what, delay_s=settings.idle_release_s)
        if settings.release == "rerun":
            job.source = self._source
        self.idle_job = job
        self._idle_jobs.append(job)
        job.start()
        return {"device": device, "pinned": bool(pinned_adapters), "after_s": float(settings.idle_release_s)}

    def _finished_idle(self) -> List[IdleRelease]:
        done = [job for job in self._idle_jobs if job.done.is_set()]
        self._idle_jobs = [job for job in self._idle_jobs if not job.done.is_set()]
        for job in done:
            job.reported = True
        return [job for job in done if not job.cancelled]

    def _finished_pinned(self) -> List[PinnedRelease]:
        job = self.pinned_job
        if job is not None and job.done.is_set() and not job.reported:
            job.reported = True
            self.pinned_job = None
            return [job]
        return []

    def _start_pinned(self, candidates: list, cell: Optional[int], notes: List[Note],
                      captured: List[dict]) -> Tuple[Dict[str, int], bool]:
        """Step 6: the pinned release, on its own thread; reported now if it is quick."""
        job = PinnedRelease(self, candidates, cell)
        self.pinned_job = job
        job.start()
        if job.done.wait(_PINNED_REPORT_WAIT_S):
            job.reported = True
            self.pinned_job = None
            notes.extend(job.notes)
            captured.extend(job.unraisable)
            return dict(job.freed), False
        return {}, True

    def _remember_figures(self, work: Dict[int, DeviceWork]) -> None:
        """The device figures after this cleanup: what the next cell's are compared with."""
        for i, item in work.items():
            fig = item.after or {}
            if fig.get("free_bytes") is not None:
                self._last_free[i] = int(fig["free_bytes"])
            if fig.get("used_bytes") is not None:
                self._last_used[i] = int(fig["used_bytes"])

    def _traced(self, record: CellRecord) -> None:
        """The allocation trace (opt-in): the raw allocations this cell made and kept."""
        if self.traced is None or record.cell is None:
            return
        try:
            record.traced = self.traced(record.cell)
        except Exception as exc:
            text = f"the allocation trace could not be read ({type(exc).__name__}: {exc})"
            record.notes.append(text)
            if self.note_once("trace-failed"):
                record.shown_notes.append(text)

    def _outside(self, work: DeviceWork, stats: Optional[Stats], warn_bytes: int,
                 notes: List[Note]) -> Tuple[Optional[int], Optional[int]]:
        """Device memory no framework, no framework cache and no driver pool accounts for,
        after the cleanup, and how much it grew since the last cleanup (None: not known).

        It holds the CUDA context, raw allocations (``cuMemAlloc``) and, since
        ``cuMemGetInfo`` is device-wide, other processes' memory on the same GPU. With no
        framework in use (``stats`` empty) only the driver pools account for anything;
        with frameworks whose figures are not known (``None``) it is not known."""
        i, used = work.index, (work.after or {}).get("used_bytes")
        if used is None or work.pools is None or work.quiet or not work.settled or stats is None:
            return None, None
        known = sum(s.on(i).live + s.on(i).cached for s in stats.values()) + int(work.pools)
        outside = max(0, int(used) - known)
        before = None if work.first_use else self._last_outside.get(i)
        self._last_outside[i] = outside
        base = self._outside_base.setdefault(i, outside)
        if warn_bytes and outside - base >= warn_bytes and f"outside:{i}" not in self._warned:  # said once
            notes.append((f"outside:{i}", (
                f"GPU{i}: {report.format_bytes(outside - base)} outside every pool have appeared since gpucleanup "
                "loaded: CUDA libraries' code and handles, raw allocations (cuMemAlloc through ctypes or cuda-python) "
                "that nothing frees, or another process on this GPU; %gpumem shows the total")))
        return outside, (None if before is None else outside - before)

    def _reserved_fix(self, record: CellRecord) -> Dict[str, str]:
        """What to set, per framework whose pool never gives memory back, for the first line
        that shows its reserved memory (once per kernel)."""
        fixes = self._fixes
        return {name: fixes[name] for d in record.devices for name in d.reserved_bytes
                if fixes.get(name) and self.note_once(f"reserved:{name}")}

    def outside_since_load(self, i: int) -> Optional[int]:
        """Growth of memory outside every pool on device ``i`` since the first cleanup."""
        if i not in self._last_outside or i not in self._outside_base:
            return None
        return self._last_outside[i] - self._outside_base[i]

    def _outcome(self, settings: Settings, record: CellRecord, forced: bool,
                 after_forced: Optional[CellRecord]) -> Outcome:
        """Step 7: whether to speak, and the lines."""
        devices = record.devices
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
        elif forced or settings.show == "always":
            shown = True
        elif settings.show == "never":
            shown = False
        else:
            # the allocation trace found raw allocations the cell kept: worth a line even when the
            # device's figure did not move (another process may have freed as much meanwhile)
            traced = sum(int(e.get("bytes") or 0) for e in record.traced) >= report.OUTSIDE_NOTICE_BYTES
            shown = bool(record.touched or anything_freed or trouble or traced)
        # a progress line was written: the summary closes it, whatever the policy
        shown = shown or self.progress_opened
        if shown:
            record.reserved_fix = self._reserved_fix(record)
        data = record.to_dict()
        # a sticky error is said once even when summaries are off
        first_sticky = [d for d in data["devices"] if d["state"] == "unusable" and not d["quiet"]]
        lines = report.summary_lines(data) if (shown or first_sticky) else []
        if not shown and first_sticky:
            lines = [report.SEP.join([report.PREFIX, d["message"] or report.unusable_sentence(d)]) for d in first_sticky]
        record.shown = data["shown"] = bool(lines)
        if after_forced is not None and not lines:
            keep = False  # one record per cell: this pass added nothing to the %gpumem --drain's
        return Outcome(record=record, lines=lines, keep=keep, data=data)


@dataclass(eq=False)
class IdleProof:
    """What a cell proven idle by :meth:`CellPass.quiet` rested on besides the library's quiet check, kept
    for the next cell: the settings, the count of modules imported, the last full cleanup, the release held
    and those not yet reported, the frameworks in use and the quiet token each answered. Every input of the
    frameworks' figures and of :meth:`CellPass.nothing_new` is among them, or checked again by ``quiet`` on
    every cell (a forced cell, devices found unusable, a pinned release, a name unbound), or by
    :meth:`stands` (a ``%gpumem --drain`` earlier in the cell, the allocation trace): where all of it is as
    it was, the proof's answer stands without its comparisons. Made only where every framework in use has
    a quiet token (one without is read on every cell), and forgotten by any cell not proven idle so."""

    settings: Settings
    modules: int
    last: LastPass
    held: Optional[IdleRelease]
    jobs: List[IdleRelease]
    adapters: Tuple[Any, ...]
    tokens: Tuple[tuple, ...]

    @classmethod
    def made(cls, cell_pass: "CellPass") -> Optional["IdleProof"]:
        """The proof of a cell that :meth:`CellPass.quiet` just found idle the long way; None where a
        framework in use gave no quiet token this cell (its figures are then read on every cell)."""
        engine, last = cell_pass.engine, cell_pass.engine._last_pass
        tokens = []
        if last is None or len(last.stats) != len(cell_pass.adapters):
            return None
        for adapter in cell_pass.adapters:
            # the figures were equal to the last cleanup's, each adapter's among them: its entry is this
            # cell's, and its token the one read this cell
            read = engine._figures_read.get(adapter.name)
            if adapter.name not in last.stats or read is None or read[0] is not adapter or read[3] is None:
                return None
            tokens.append(read[3])
        return cls(cell_pass.settings, len(sys.modules), last, engine._held, list(engine._idle_jobs),
                   tuple(cell_pass.adapters), tuple(tokens))

    def stands(self, cell_pass: "CellPass") -> bool:
        """Whether this cell finds everything the proof rested on as it was. Each framework's quiet token is
        read again, the one read no proof can spare: a framework's memory may change with no change the
        driver sees (an array deleted into its pool). The last cleanup and the releases not yet reported
        change only in a full pass, which forgets the proof: compared all the same, as the guard of that.
        A token read or trace check that raises does not stand: the long way then says what is wrong."""
        engine = cell_pass.engine
        if (cell_pass.settings is not self.settings or cell_pass.cell.after_forced is not None
                or engine._last_pass is not self.last or engine._held is not self.held
                or len(sys.modules) != self.modules or engine._idle_jobs != self.jobs):
            return False
        devices = cell_pass.settled
        try:
            if engine.tracing():  # the allocation trace: every cell gets its record (CellPass._tracing)
                return False
            for adapter, token in zip(self.adapters, self.tokens):  # a loop, not all(): runs on every idle cell
                if adapter.quiet_token(devices, in_use=True) != token:
                    return False
        except Exception:  # a fault of the trace or of an adapter: the long way says what is wrong
            return False
        return True


@dataclass
class LastPass:
    """What the last full cleanup left: per device its free bytes and driver pools' reserved
    bytes after it, and each framework's figures."""

    devices: Dict[int, Tuple[Optional[int], Optional[int]]]
    stats: Stats


@dataclass
class Cell:
    """What the extension hands the engine about one cell (see :meth:`AfterCell.run`)."""

    number: Optional[int] = None
    namespace: Optional[dict] = None
    forced: bool = False  # %gpumem --drain
    after_forced: Optional[CellRecord] = None  # the record of a %gpumem --drain earlier in the cell
    hidden: Union[None, List[dict], Callable[[], List[dict]]] = None  # holders no variable names


class CellPass:
    """One cell's cleanup: the steps of the module docstring as methods, in their order, over
    this cell's state only: a :class:`DeviceWork` per device in use, built from the native
    pass, and the frameworks' figures as :class:`FrameworkFigures`. What lasts between cells
    (the last figures, the notes said, the background releases) stays on the
    :class:`AfterCell` engine that made it."""

    def __init__(self, engine: "AfterCell", settings: Settings, cell: Cell):
        self.engine = engine
        # %gpumem --drain: everything, now
        self.settings = dataclasses.replace(settings, release="cell") if cell.forced else settings
        self.cell = cell
        self.start = time.perf_counter()
        self.now_device = self.settings.release not in DEFERRED  # the frameworks' device caches, now or later
        self.now_trim = self.settings.release != "idle"  # the driver's pools: "idle" alone leaves them to later
        self.notes: List[Note] = []
        self.captured: List[dict] = []
        self.first: dict = {}  # the one-pass native call's result
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
        self.background: List[PinnedRelease] = []
        self.idle_done: List[IdleRelease] = []
        self.pinned_now: Dict[str, int] = {}
        self.deferred: Optional[dict] = None

    def run(self) -> Optional[Outcome]:
        engine = self.engine
        if self.nothing_initialised():
            return None
        quiet_before, engine._quiet_ok = engine._quiet_ok, False  # set again only by a cell proven idle
        proof, engine._idle_proof = engine._idle_proof, None  # ... and so is the proof's record
        # Not armed for Ctrl-C: nothing in the quiet check waits, so a Ctrl-C there is Python's own, and
        # arming costs two sigaction calls on every idle cell.
        if quiet_before and self.quiet(proof):
            engine._quiet_ok = True
            return self.unchanged_outcome(holders_checked=True)
        with engine.ctrl_c.armed() as ctrl_c:  # once for the driver pass and steps 1 to 4
            if not self.probe(ctrl_c):
                return engine._nothing_in_use(self.driver, self.cell.number, self.cell.forced)
            self.begin()
            if self.clean(ctrl_c):
                engine._quiet_ok = True  # this pass left the library the state the next cell's quiet check compares with
                return self.unchanged_outcome()
        self.snapshot()
        self.read_frameworks_after()
        self.release_pinned()
        record = self.record()
        self.remember(record)
        return engine._outcome(self.settings, record, self.cell.forced, self.cell.after_forced)

    # ------------------------------------------------------------ the steps, in order

    def nothing_initialised(self) -> bool:
        """The common cell of a kernel that never used CUDA: one driver call, no JSON."""
        engine = self.engine
        # the last cell was proven idle with a device in use: CUDA stays initialised once it is
        if engine._quiet_ok or self.cell.forced or engine._idle_jobs != [] or engine.pinned_job is not None:
            return False
        try:
            initialised = engine.native.cuda_initialized()
        except Exception:
            initialised = None  # the full pass below says what is wrong
        if initialised is not False:
            return False
        engine.last_driver_state = "not_initialized"
        engine._know_baseline()  # no context anywhere: the next device in use is a first use
        self.state = None
        return True

    def probe(self, ctrl_c: CtrlC) -> bool:
        """The driver pass: probe, settle, trim and the figures after in one native call (when
        nothing in the process uses CUDA it is a probe and nothing else). True when a device is in use."""
        engine = self.engine
        engine._quiet_adapters = None  # what an idle cell kept stands only until the next full pass
        notes_first: List[Note] = []
        first = engine._native_pass(engine._settle_limit(self.settings, self.cell.after_forced), self.settings,
                                    notes_first, trim=self.now_trim and self.settings.driver_pools)
        if first is not None and ctrl_c.pressed:
            first["keyboard_interrupt"] = True  # the settle step stops there
        if first is None:
            raise RuntimeError(notes_first[0][1] if notes_first else "the native after-cell pass failed")
        self.first = first
        in_use = [d for d in first.get("devices") or [] if _index(d.get("index")) is not None]
        self.driver = first.get("driver") or {}
        self.state = self.driver.get("state")
        engine.last_driver_state = self.state
        if self.state != "ready" or not in_use:
            if self.state in ("ready", "not_initialized"):
                engine._know_baseline()
            return False
        self.work = {int(d["index"]): DeviceWork(int(d["index"])) for d in in_use}
        return True

    def quiet(self, proof: Optional["IdleProof"] = None) -> bool:
        """The idle cell without the driver pass: True when the last cleanup proved nothing had changed,
        the library's quiet check (``native.quiet``: the same devices in use, nothing queued, no driver
        pool reserving memory, the same free memory as the pass behind that proof left) says nothing
        changed since, and the frameworks' figures are those the last cleanup left with nothing new to
        give back (:meth:`nothing_new`, over the last cleanup's devices): then no collection could find
        anything either (:meth:`collect`), unless the policy is "always" or the cell unbound a name that
        held GPU memory (those collect: the whole pass runs). False: not proven; what this tried is
        forgotten, but for what an unraisable hook caught, and the whole pass runs. Not armed for Ctrl-C
        (:class:`CtrlC`): nothing here waits, and a Ctrl-C is a KeyboardInterrupt the extension reports.
        ``proof``: what the cell before this one, proven idle here, rested on; where it still stands
        (:meth:`IdleProof.stands`: the same Python-side state and every framework's quiet token as it was),
        the frameworks' figures and :meth:`nothing_new` would answer as they did, and are not asked again.
        The tokens are read outside the capture of unraisable errors that the long way enters: they free
        nothing and run no collection, so what could arrive there is a finalizer Python's own cyclic
        collection ran at that moment, reported as it would be anywhere in the cell."""
        engine, last = self.engine, self.engine._last_pass
        if (last is None or self.cell.forced or engine._unusable or engine.pinned_job is not None
                or self.settings.gc == "always" or engine.holders.unbound(self.cell.namespace)):
            return False
        try:
            if engine.native.quiet() is not True:
                return False
        except Exception:  # a library without the check, or one that fails: the pass says what is wrong
            return False
        self.state = engine.last_driver_state = "ready"
        # the devices, their free bytes and pools are the last cleanup's: what the library just compared
        self.devices, self.settled = list(last.devices), list(last.devices)
        if proof is not None and proof.stands(self):
            self.adapters, self.stats_settled = list(proof.adapters), last.stats
            engine._idle_proof = proof
            return True
        same = False
        with engine.unraisables.capture() as captured:
            self.adapters = self._adapters_in_use()
            figures = engine.stats(self.adapters, self.settled, self.notes, by_token=True) if self.adapters else {}
            if figures == last.stats:
                self.stats_settled = last.stats  # the same figures: nothing_new() compares them by identity
                same = self.nothing_new()
        if same and not captured and not self.notes:
            engine._idle_proof = IdleProof.made(self)
            return True
        self.captured.extend(captured)  # said by the whole pass's record
        self.devices, self.settled, self.adapters, self.notes = [], [], [], []
        self.stats_settled, self.state = {}, None
        return False

    def _adapters_in_use(self) -> list:
        """The adapters in use, as the last idle cell found them when nothing was imported since and the
        settings are the same, else asked afresh. Sound only behind the library's quiet check: a framework
        that starts using the GPU during a cell allocates, which changes the free memory that check compares,
        and the full pass that follows forgets what was kept here (a framework whose use begins without an
        allocation, a context already made by another, holds nothing to give back)."""
        engine, imported = self.engine, len(sys.modules)
        kept = engine._quiet_adapters
        if kept is not None and kept[0] == imported and (kept[1] is self.settings or kept[1] == self.settings):
            return list(kept[2])
        adapters = engine.adapters(self.settings, self.notes)
        engine._quiet_adapters = (imported, self.settings, list(adapters))
        return adapters

    def begin(self) -> None:
        """The devices of this cell, its first uses, and what background releases finished since the last."""
        engine = self.engine
        self.gc_record = GcRecord(policy=self.settings.gc)
        seen = engine._seen_in_use
        for i, work in self.work.items():
            work.first_use = seen is not None and i not in seen
            work.quiet = i in engine._unusable
        engine._seen_in_use = (seen or set()) | set(self.work)
        self.devices = [i for i, work in self.work.items() if not work.quiet]
        engine._drained_now = []
        self.background = engine._finished_pinned()
        self.idle_done = engine._finished_idle()
        for job in [*self.background, *self.idle_done]:
            self.notes.extend(job.notes)
            self.captured.extend(job.unraisable)

    def settle(self, ctrl_c: CtrlC) -> None:
        """Step 1: what the driver pass found, per device (the bounded wait and the first trim)."""
        self.interrupted = bool(self.first.get("keyboard_interrupt")) or ctrl_c.pressed
        for dev in self.first.get("devices") or []:
            work = self.work.get(_index(dev.get("index")))
            if work is not None:
                work.take_pass(dev, self.interrupted)
                self.engine._take_pass(work, dev, self.notes)
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
        engine = self.engine
        self.adapters = engine.adapters(self.settings, self.notes) if self.settled else []
        # not known (the device's memory changed, or a framework keeps a cache): a young
        # collection, cheaper than reading every framework to decide
        live = engine._live_hint([self.work[i] for i in self.settled]) if self.adapters else None
        early, early_notes = self._early_figures(live) if live != 0 else (None, [])
        if early is not None and early == self.engine._last_pass.stats:
            live = 0  # nothing a collection could give back
        self.gc_record = engine._collect(self.settings, self.adapters, live, self.settled, self.cell.namespace)
        ctrl_c.check()
        if early is not None and not self.gc_record.collected:
            self.stats_settled = early  # nothing collected: the figures read before stand
            self.notes.extend(early_notes)
        else:
            self.stats_settled = engine.stats(self.adapters, self.settled, self.notes) if self.adapters else {}

    def _early_figures(self, live: Optional[int]) -> Tuple[Optional[Stats], List[Note]]:
        """The frameworks' figures read before the collection, with their notes, when they may
        prove it useless: garbage policy "auto", a last cleanup to compare with, the driver saw no
        change on any device since it, and no name that held GPU memory unbound (that asks for a
        collection anyway); else (None, [])."""
        engine = self.engine
        if (not self.adapters or self.settings.gc != "auto" or engine._last_pass is None or self.cell.forced
                or not engine._driver_unchanged([self.work[i] for i in self.settled])
                or engine.holders.unbound(self.cell.namespace)):
            return None, []
        notes: List[Note] = []
        return engine.stats(self.adapters, self.settled, notes), notes

    def drain(self, ctrl_c: CtrlC) -> None:
        """Step 3: the frameworks' caches on the settled devices; which pinned pools go after the last driver call.
        Under a release that waits (``idle``, ``rerun``) only the frameworks whose caches can be emptied on this
        thread alone (``drains_on_cell_thread``: PyCUDA) are emptied now; the others are left to the release."""
        engine = self.engine
        now = self.adapters if self.now_device else [a for a in self.adapters if _on_cell_thread(a)]
        if now:
            self.given_back = engine._drain_frameworks(now, self.work, self.settled, self.notes, ctrl_c,
                                                       self.stats_settled)
        self.candidates, self.pending = engine._pinned_candidates(self.settings, self.adapters, self.stats_settled,
                                                                  self.settled, self.devices)
        ctrl_c.check()

    def trim(self, ctrl_c: CtrlC) -> None:
        """Step 4: the driver's pools again, when a framework gave memory back, or the collection
        freed memory straight into them (asynchronous frees: live GPU memory is below what the
        last cleanup left; else the next cell's pass trims it)."""
        engine = self.engine
        gc_freed = bool(self.gc_record.collected) and (
            engine._last_live is None or engine.live_total(self.stats_settled, self.settled) < engine._last_live)
        self.figures_stale = bool(self.given_back or gc_freed)
        if self.now_trim and self.settings.driver_pools and self.settled and self.figures_stale:
            reported = {i for i, work in self.work.items() if work.after is not None}
            fresh = engine._trim(self.work, self.notes)
            # the trim reported every device's memory after it: as fresh as a snapshot
            self.figures_stale = not (fresh and reported and fresh >= reported)
        ctrl_c.check()  # a Ctrl-C during the trim: said as at every other step, not lost

    def clean(self, ctrl_c: CtrlC) -> bool:
        """Steps 1 to 4 under the unraisable hook (Ctrl-C is a flag here: :meth:`run` armed it). True
        when the cell changed nothing since the last cleanup (:meth:`unchanged`): the steps after the
        collection are skipped, and the status endpoint never hears of a drain."""
        captured_now: List[dict] = []
        same = False
        try:
            with self.engine.unraisables.capture() as captured_now:
                self.settle(ctrl_c)
                self.collect(ctrl_c)
                same = self.unchanged()
                if not same:
                    self.engine._status("set_state", {"state": "draining", "cell": self.cell.number,
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
        last = self.engine._last_pass
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
        engine, last, held = self.engine, self.engine._last_pass, self.engine.held()
        if (last is None or self.cell.forced or self.cell.after_forced is not None or self.settings.show == "always"
                or engine.progress_opened or self.notes or self.background or self.idle_done
                or engine.pinned_job is not None or any(job is not held for job in engine._idle_jobs)
                or self._tracing()):
            return False
        if self.stats_settled is not last.stats and self.stats_settled != last.stats:
            return False
        # What the release the last cleanup deferred covers is cached as it was then (the figures are
        # the same): it is not new, and that release, held during the cell, gives it back once idle.
        deferred = held.adapters if held is not None and self.settings.release != "cell" else []
        for a in self.adapters:  # a loop, not any(): this runs on every idle cell
            if getattr(a, "can_release", True) and not (a in deferred and held.device) and not _nothing_new_cached(
                    self.stats_settled.get(a.name), self.settled, engine._kept.get(a.name, {})):
                return False  # something to give back now, or when idle
        candidates, pending = engine._pinned_candidates(self.settings, self.adapters, self.stats_settled,
                                                        self.settled, self.devices)
        return not pending and all(a in deferred and held.pinned for a in candidates)

    def _tracing(self) -> bool:
        """The allocation trace (opt-in) runs: every cell gets its record of what it traced."""
        try:
            return bool(self.engine.tracing())
        except Exception:
            return True

    def unchanged_outcome(self, holders_checked: bool = False) -> Outcome:
        """An idle cell's: no device record built, nothing kept or published, no line; its record
        says only that the driver is ready and nothing was freed (the last cleanup's figures stand).
        The names that held GPU memory are still checked (cheap: no walk), unless :meth:`quiet` found
        each still bound to its object (``holders_checked``) and the live bytes are those of their last
        update: that update would change nothing."""
        engine = self.engine
        engine.skipped += 1
        engine.rearm_held()  # what the last cleanup deferred is still to be given back once idle
        holders, namespace = engine.holders, self.cell.namespace
        if namespace is not None and not (holders_checked and namespace and holders.live_at_walk == engine._last_live):
            holders.update(namespace, engine._last_live)
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
        """Step 5: device figures after the cleanup (the pass's own when nothing changed since)."""
        self.engine._snapshot(self.work, self.figures_stale or self.interrupted, self.notes)

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
            self.stats_after = self.engine.stats(self.adapters, usable, self.notes)

    def release_pinned(self) -> None:
        """Step 6: pinned host pools on a background thread after the cell's last driver call,
        or what is left for later (release "auto", "idle" and "rerun"): "idle" always defers
        (the driver's pools too), "rerun" only a cache that holds something."""
        if self.interrupted:
            return
        release = self.settings.release
        if self.candidates and release == "cell":
            self.pinned_now, started = self.engine._start_pinned(self.candidates, self.cell.number, self.notes,
                                                                 self.captured)
            self.pending = self.pending or started
        elif self.settled and (self.candidates or release == "idle" or (release == "rerun" and self._cached())):
            later = [] if self.now_device else [a for a in self.adapters if not _on_cell_thread(a)]
            self.deferred = self.engine._defer(self.settings, later, self.candidates, self.settled, self.cell.number)

    def _cached(self) -> bool:
        """A framework that can give memory back on a release's thread caches some on a settled device (or its
        figures are not known)."""
        stats = self.stats_after or {}
        return any(getattr(a, "can_release", True) and not _on_cell_thread(a) and (
            a.name not in stats or any(stats[a.name].on(i).cached > 0 for i in self.settled)) for a in self.adapters)

    def record(self) -> CellRecord:
        """Step 7: the record of this cell."""
        engine = self.engine
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
            shown_notes=[text for kind, text in self.notes if engine.note_once(kind)],
            unraisable=self.captured[:20],
            release=self.settings.release,
            deferred=self.deferred,
        )
        record.touched = any(work.first_use or self._changed(work) for work in self.work.values())
        engine._remember_figures(self.work)
        record.elapsed_s = round(time.perf_counter() - self.start, 6)
        record.hidden = engine._hidden(self.cell.hidden, notes=record)
        engine._traced(record)
        record.idle = [job.result() for job in self.idle_done]
        return record

    def _changed(self, work: DeviceWork) -> bool:
        """Device memory changed since the last cleanup (a device with no context before is a first use)."""
        last = self.engine._last_free
        return work.free_before is not None and work.index in last and last[work.index] != work.free_before

    def device_record(self, work: DeviceWork) -> DeviceRecord:
        i, fig, stats = work.index, work.after or {}, self.stats_after or {}
        dev = DeviceRecord(
            index=i,
            name=fig.get("name"),
            state=work.state or ("unusable" if work.quiet else "error"),
            settle=work.settle,
            total_bytes=fig.get("total_bytes"),
            used_at_start_bytes=self.engine._last_used.get(i),
            used_before_bytes=work.used_before,
            used_after_bytes=fig.get("used_bytes"),
            freed_bytes=work.freed,
            live_bytes=_per_framework(stats, i, live=True),
            cached_bytes=_per_framework(stats, i, live=False, releases=True),
            reserved_bytes=_per_framework(stats, i, live=False, releases=False),
            message=work.message,
            quiet=work.quiet,
            first_use=work.first_use,
            context_only=_context_only(stats, i),
        )
        # a framework in use whose figures could not be read: what is outside every pool is not known
        read = self.stats_after is not None and all(a.name in self.stats_after for a in self.adapters)
        dev.outside_bytes, dev.outside_growth_bytes = self.engine._outside(
            work, self.stats_after if read else None, int(self.settings.outside_warning_mib) << 20, self.notes)
        return dev

    def remember(self, record: CellRecord) -> None:
        """What the next cell compares with: what each drain could not give back, the live and
        cached bytes after this cleanup, the names that hold GPU memory."""
        engine = self.engine
        stats_after = self.stats_after or {}
        for name in engine._drained_now:  # what each drain could not give back, until it changes
            if name in stats_after:
                engine._kept[name] = {i: f.cached for i, f in stats_after[name].devices.items()}
        if self.adapters and not self.interrupted:
            engine._last_live = engine.live_total(stats_after, self.devices)
            engine._last_cached = sum(s.on(i).cached for s in stats_after.values() for i in self.devices)
            if self.cell.namespace is not None:
                engine.holders.update(self.cell.namespace, engine._last_live)
        elif not self.adapters:
            engine._last_live = None
        engine._last_pass = None if self.interrupted or self.stats_after is None else LastPass(
            devices={i: ((w.after or {}).get("free_bytes"), w.pools) for i, w in self.work.items()},
            stats=self.stats_after)


def _on_cell_thread(adapter: Any) -> bool:
    """The framework's device caches can be emptied only on the kernel's thread (``Adapter.drains_on_cell_thread``)."""
    return bool(getattr(adapter, "drains_on_cell_thread", False))


def pools_reserved(dev: dict) -> Optional[int]:
    """The driver pools' reserved bytes of one device entry (after a trim where it says so),
    None when the entry lists no pools or a pool's figure is unknown."""
    pools = dev.get("pools")
    if not isinstance(pools, list) or not pools:
        return None if pools is None else 0
    total = 0
    for pool in pools:
        value = pool.get("reserved_after_bytes", pool.get("reserved_bytes")) if isinstance(pool, dict) else None
        if value is None:
            return None
        total += int(value)
    return total


def _nothing_new_cached(stats: Optional[FrameworkFigures], devices: List[int], kept: Dict[int, int]) -> bool:
    """True when an adapter's figures name every device and each caches nothing, or the
    very bytes its last drain left there (``kept``)."""
    per_device = stats.devices if stats is not None else {}
    for i in devices:  # a loop, not all(): this runs on every idle cell
        if i not in per_device or per_device[i].cached not in (0, kept.get(i, 0)):
            return False
    return bool(devices)


def _per_framework(stats: Stats, i: int, live: bool, releases: Optional[bool] = None) -> Dict[str, int]:
    """Live (or cached) bytes on device ``i`` per framework (``releases``: only frameworks that do,
    or do not, give their cache back), zeros left out."""
    out = {}
    for name, s in stats.items():
        if i in s.devices and (releases is None or s.releases == releases):
            n = s.devices[i].live if live else s.devices[i].cached
            if n:
                out[name] = n
    return out


def _status_figures(stats: FrameworkFigures, i: int) -> dict:
    """A framework's figures on device ``i`` for %gpumem: a pool that never gives memory back
    says its cache as ``reserved_bytes`` (not freeable), never as cached."""
    fig = stats.devices[i].as_dict()
    if not stats.releases:
        fig["reserved_bytes"], fig["cached_bytes"] = fig["cached_bytes"], 0
    return fig


def _context_only(stats: Stats, i: int) -> bool:
    """Frameworks are in use and none holds anything on device ``i``: its memory is a context no array uses."""
    return bool(stats) and all(i in s.devices and s.devices[i].live + s.devices[i].cached == 0
                               for s in stats.values())


def _text_or_none(value: Any) -> Optional[str]:
    return value if isinstance(value, str) and value else None


def _add_released(freed: Dict[int, Dict[str, int]], drain: Optional[dict]) -> None:
    for dev in (drain or {}).get("devices") or []:
        idx = _index(dev.get("index"))
        if idx in freed and dev.get("released_bytes"):
            freed[idx]["driver"] = freed[idx].get("driver", 0) + int(dev["released_bytes"])


def _write_stdout(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()
