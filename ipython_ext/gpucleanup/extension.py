"""The IPython extension: one ``GPUCleanup`` object that is the configurable, the ``%gpumem``
magic and the ``pre_run_cell`` / ``post_run_cell`` handler.

After each cell (``post_run_cell``), when something in the kernel already uses CUDA:

1. native settle: wait, at most ``settle_timeout`` seconds, for queued GPU work on every
   device in use (progress line after 2 s); busy devices are skipped;
2. garbage collection, only when it can release GPU memory (``gc`` policy, see config.py);
3. the framework adapters empty their caches on the settled devices; pinned host pools
   are emptied on a background thread;
4. the driver's stream-ordered pools are trimmed;
5. a snapshot; one summary line per device; the record goes to the history and the
   status endpoint.

When nothing uses CUDA the whole per-cell cost is one native probe. Nothing here raises
into the user's cell: each failure becomes a note, printed once per kind.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import signal
import sys
import threading
import time
import weakref
from typing import Any, Callable, Dict, List, Optional

from IPython.core.magic import Magics, line_magic, magics_class
from traitlets import observe

from . import report
from .config import GPUCleanupOptions
from .history import History
from .magics import bound_gpu_objects, find_gpu_objects, gpumem_arguments, parse_gpumem

__all__ = ["GPUCleanup", "load_ipython_extension", "unload_ipython_extension", "DEFAULTS"]

# What a fresh extension object is built with; tests substitute stand-ins here.
# None means: the real thing (gpucleanup._native, gpucleanup.frameworks.active,
# gpucleanup.status_endpoint.StatusEndpoint), imported at load time.
DEFAULTS: Dict[str, Any] = {"native": None, "adapters": None, "status_endpoint": None}

_MISSING = object()
_PINNED_REPORT_WAIT_S = 0.005  # a pinned release this quick is reported by its own cell
_ADAPTER_LOCK_WAIT_S = 0.05  # how long a cell waits for a background pinned release of the same adapter


def _counts_before_pre_run_cell() -> bool:
    """Does this IPython count a cell before ``pre_run_cell`` (so the running cell is count - 1)?

    IPython 9.8 moved ``execution_count += 1`` from the end of ``run_cell_async`` to
    before the ``pre_run_cell`` event; 8.x and 9.0-9.7 count after the cell
    (IPython/core/interactiveshell.py, ``run_cell_async``, in each release).
    """
    try:
        import IPython

        return tuple(IPython.version_info[:2]) >= (9, 8)
    except Exception:
        return True


def running_cell_number(shell: Any, info: Any = None) -> Optional[int]:
    """The number of the cell about to run, as ``pre_run_cell`` sees it, on every IPython."""
    count = getattr(shell, "execution_count", None)
    if not isinstance(count, int):
        return None
    stores = info is None or getattr(info, "store_history", True)
    if stores and _counts_before_pre_run_cell():
        count -= 1
    return count


def outside_drain_gave_no_way(exc: BaseException) -> bool:
    """Did a native call refuse to wait behind a drain started with ``gpucleanup drain``?"""
    return getattr(exc, "status", None) == 6 or str(exc).startswith("[gpucleanup.api.111]")


def _index(key: Any) -> Optional[int]:
    try:
        return int(key)
    except (TypeError, ValueError):
        return None


class _Unraisables:
    """Captures what ``sys.unraisablehook`` receives on the capturing thread during a drain.

    Frameworks print tracebacks through it from ``__dealloc__`` (CuPy after a sticky
    error). The hook is process-wide, so it is installed while at least one capture
    runs (the main thread's drain, a background pinned release) and restored after;
    reports from other threads go to the hook that was there before. Only strings
    are kept: the exception's frames could hold GPU memory alive.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._saved: Optional[Callable] = None
        self._by_thread: Dict[int, List[dict]] = {}
        self._local = threading.local()

    @contextlib.contextmanager
    def capture(self):
        tid = threading.get_ident()
        entries: List[dict] = []
        with self._lock:
            if not self._by_thread:
                self._saved = sys.unraisablehook
                sys.unraisablehook = self._hook
            self._by_thread[tid] = entries
        try:
            yield entries
        finally:
            with self._lock:
                self._by_thread.pop(tid, None)
                if not self._by_thread:
                    if sys.unraisablehook == self._hook:
                        sys.unraisablehook = self._saved or sys.__unraisablehook__
                    self._saved = None

    @contextlib.contextmanager
    def source(self, name: str):
        """Attribute what is captured meanwhile on this thread to ``name`` (an adapter)."""
        previous = getattr(self._local, "source", None)
        self._local.source = name
        try:
            yield
        finally:
            self._local.source = previous

    def _hook(self, unraisable) -> None:
        entries = self._by_thread.get(threading.get_ident())
        if entries is None:
            (self._saved or sys.__unraisablehook__)(unraisable)
            return
        exc_type = getattr(unraisable, "exc_type", None)
        obj = getattr(unraisable, "object", None)
        source = getattr(self._local, "source", None)
        if not source:
            module = obj if isinstance(obj, str) else getattr(obj, "__module__", None)
            module = module or getattr(exc_type, "__module__", "") or ""
            source = "" if module == "builtins" else module.split(".", 1)[0]
        entries.append(
            {
                "source": source or "a framework",
                "type": getattr(exc_type, "__name__", str(exc_type)),
                "message": str(getattr(unraisable, "exc_value", ""))[:300],
                "object": (obj if isinstance(obj, str) else repr(obj))[:200],
                "err_msg": str(getattr(unraisable, "err_msg", "") or "")[:200],
            }
        )


def summarize_unraisables(entries: List[dict]) -> Optional[str]:
    """One line for the tracebacks a drain printed through sys.unraisablehook."""
    if not entries:
        return None
    first = entries[0]
    detail = f"{first['type']}: {first['message']}" if first["message"] else first["type"]
    count = len(entries)
    what = "traceback" if count == 1 else "tracebacks"
    return f"{count} {what} from {first['source']} while freeing captured (first: {detail})"


class _CtrlC:
    """Ctrl-C during the cleanup becomes a flag the cleanup checks between steps.

    A KeyboardInterrupt raised by the default handler lands wherever the main thread
    runs Python next, which during the native settle is the first line of the ctypes
    progress callback, where it would be printed and lost. With this handler the
    progress callback sees the flag and asks the native wait to stop; the steps after
    it are skipped. The previous handler is restored when the cleanup ends.
    """

    def __init__(self):
        self.pressed = False

    @contextlib.contextmanager
    def armed(self):
        self.pressed = False
        previous = None
        installed = False
        if threading.current_thread() is threading.main_thread():
            try:
                previous = signal.getsignal(signal.SIGINT)
                if previous is not None:
                    signal.signal(signal.SIGINT, self._handler)
                    installed = True
            except (ValueError, TypeError, OSError):
                installed = False
        try:
            yield self
        finally:
            if installed:
                with contextlib.suppress(Exception):
                    signal.signal(signal.SIGINT, previous)

    def _handler(self, signum, frame) -> None:
        self.pressed = True

    def check(self) -> None:
        if self.pressed:
            raise KeyboardInterrupt


def adapter_note(name: str, text: str) -> str:
    """An adapter's note as users read it: named after its adapter once
    ("[gpucleanup.cupy.204] ..." already is; other text gets "cupy: ")."""
    return text if text.startswith(f"[gpucleanup.{name}.") else f"{name}: {text}"


class _InterruptTheCell:
    """An IPython AST transformer that hands a Ctrl-C caught in ``pre_run_cell`` to the cell.

    IPython runs ``pre_run_cell`` callbacks inside ``events.trigger``, which catches a
    KeyboardInterrupt, prints it and runs the cell anyway: a Ctrl-C that lands while the
    hook runs would be lost. The cell's AST is transformed after ``pre_run_cell``
    (``run_cell_async``: trigger, then ``transform_ast``, then run), so the interrupt is
    put back as the cell's first statement: the cell stops at once, with
    KeyboardInterrupt as its error, as if Ctrl-C had come a moment later.
    """

    def __init__(self):
        self.pending = False

    def visit(self, node):
        if not self.pending:
            return node
        self.pending = False
        import ast

        stop = ast.parse("raise KeyboardInterrupt").body[0]
        body = getattr(node, "body", None)
        if isinstance(body, list):
            node.body = [ast.copy_location(stop, body[0]) if body else stop] + body
            ast.fix_missing_locations(node)
        return node


class _PinnedJob:
    """One background release of pinned host pools; adapters are done one after another."""

    def __init__(self, owner: "GPUCleanup", adapters: list, cell: Optional[int]):
        self.owner = owner
        self.adapters = adapters
        self.cell = cell
        self.freed: Dict[str, int] = {}
        self.notes: List[tuple] = []
        self.unraisable: List[dict] = []
        self.elapsed_s = 0.0
        self.done = threading.Event()
        self.reported = False
        self.thread = threading.Thread(target=self._run, name="gpucleanup-pinned", daemon=True)

    def _run(self) -> None:
        start = time.perf_counter()
        try:
            with self.owner._unraisables.capture() as captured:
                for adapter in self.adapters:
                    if self.owner._exiting:
                        break
                    lock = self.owner._adapter_lock(adapter.name)
                    with lock, self.owner._unraisables.source(adapter.name):
                        result, note = self.owner._guarded(adapter, "drain_pinned")
                    if note:
                        self.notes.append(note)
                        continue
                    if isinstance(result, dict):
                        freed = int(result.get("freed_bytes") or 0)
                        if freed:
                            self.freed[adapter.name] = self.freed.get(adapter.name, 0) + freed
                        for text in result.get("notes") or []:
                            self.notes.append((f"note:{adapter.name}:{text}", adapter_note(adapter.name, text)))
            self.unraisable = captured
        except BaseException as exc:  # a background thread must never die loudly
            self.notes.append(("pinned:internal", f"pinned release failed: {type(exc).__name__}: {exc}"))
        finally:
            self.elapsed_s = time.perf_counter() - start
            self.done.set()

    def result(self) -> dict:
        return {"cell": self.cell, "freed_bytes": dict(self.freed), "elapsed_s": round(self.elapsed_s, 6)}


@magics_class
class GPUCleanup(Magics, GPUCleanupOptions):
    """Frees GPU memory after every cell and answers ``%gpumem``.

    Configure with ``c.GPUCleanup.<trait>`` or ``%config GPUCleanup``; the traits are
    documented in ``gpucleanup/config.py``.
    """

    def __init__(self, shell=None, native: Any = None, adapters: Any = _MISSING, status_endpoint: Any = _MISSING, **kwargs):
        super().__init__(shell=shell, **kwargs)
        if native is None:
            from . import _native as native
        self.native = native
        # adapters: a callable returning the adapters in use, None for none; _MISSING: the real ones
        self._adapters_fn = adapters
        self._endpoint_factory = status_endpoint
        self.history = History(self.history_size)
        self._endpoint = None
        self._draining_cell: Optional[int] = None
        self._hooks_registered = False
        self._magics_registered = False
        self._loaded = False
        self._exiting = False
        self._last_driver_state: Optional[str] = None
        self._pre: Optional[dict] = None
        self._warned: set = set()
        self._unusable: set = set()
        self._unraisables = _Unraisables()
        self._adapter_locks: Dict[str, threading.Lock] = {}
        self._locks_lock = threading.Lock()
        self._pinned_job: Optional[_PinnedJob] = None
        self._progress_shown = False
        self._progress_opened = False  # a progress line was printed during this cell's cleanup
        self._forced_in_cell: Optional[dict] = None  # what %gpumem --drain did in the running cell
        self._ctrl_c = _CtrlC()
        self._interrupt_the_cell = _InterruptTheCell()

    # ------------------------------------------------------------ lifecycle

    def load(self) -> None:
        """Register the magic and, where CUDA can ever be in use, the cell hooks; print why not otherwise."""
        self.shell.register_magics(self)
        self._magics_registered = True
        self._loaded = True
        for sentence in self.ignored_config:
            print(f"{report.PREFIX}{report.SEP}{sentence}")
        try:
            probe = self.native.probe()
        except Exception as exc:
            if str(exc).startswith("[gpucleanup.driver."):
                # the library loaded; the driver it found cannot be used (its message says why and what to do)
                self._last_driver_state = "unusable"
                print(f"{report.PREFIX}{report.SEP}{exc}: no cleanup after cells")
                return
            print(
                f"{report.PREFIX}{report.SEP}gpucleanup's native library could not be loaded ({type(exc).__name__}: {exc}): "
                "nothing is cleaned after cells; reinstall gpucleanup"
            )
            return
        driver = probe.get("driver") or {}
        state = driver.get("state")
        self._last_driver_state = state
        if state == "no_driver":
            where = driver.get("path") or "libcuda.so.1"
            print(f"{report.PREFIX}{report.SEP}no CUDA driver found ({where}): nothing to clean, no cleanup after cells")
            return
        if state == "unusable":
            where = driver.get("path") or "libcuda.so.1"
            print(f"{report.PREFIX}{report.SEP}the CUDA driver {where} is unusable ({driver.get('message')}): no cleanup after cells")
            return
        if state == "ready" and not probe.get("devices"):
            print(f"{report.PREFIX}{report.SEP}no GPU on this machine: nothing to clean, no cleanup after cells")
            return
        self.shell.events.register("pre_run_cell", self.pre_run_cell)
        self.shell.events.register("post_run_cell", self.post_run_cell)
        self._hooks_registered = True
        self._start_status_endpoint()
        atexit.register(self._at_exit)

    def unload(self) -> None:
        """Undo ``load``: the same bound methods are unregistered, the magic and %config entry removed."""
        if self._hooks_registered:
            for event, fn in (("pre_run_cell", self.pre_run_cell), ("post_run_cell", self.post_run_cell)):
                with contextlib.suppress(ValueError):
                    self.shell.events.unregister(event, fn)
            with contextlib.suppress(ValueError):
                self.shell.ast_transformers.remove(self._interrupt_the_cell)
            self._hooks_registered = False
        if self._magics_registered:
            manager = self.shell.magics_manager
            line = manager.magics.get("line", {})
            bound = line.get("gpumem")
            if bound is not None and getattr(bound, "__self__", None) is self:
                del line["gpumem"]
            if manager.registry.get(type(self).__name__) is self:
                del manager.registry[type(self).__name__]
            self._magics_registered = False
        # Magics.__init__ added us to shell.configurables (for %config): a reload must not leave two
        self.shell.configurables[:] = [c for c in self.shell.configurables if c is not self]
        atexit.unregister(self._at_exit)
        self._close_status_endpoint()
        self._loaded = False

    def _at_exit(self) -> None:
        # no driver call may happen while the process exits
        self._exiting = True
        self._close_status_endpoint()

    def _start_status_endpoint(self) -> None:
        if not self.status_server:
            return
        factory = self._endpoint_factory
        if factory is _MISSING:
            try:
                from .status_endpoint import StatusEndpoint as factory
            except ModuleNotFoundError as exc:
                if exc.name and exc.name.endswith("status_endpoint"):
                    return  # not built into this package: skip silently
                self._warn_once_now("status:import", f"status endpoint unavailable ({exc})")
                return
            except Exception as exc:
                self._warn_once_now("status:import", f"status endpoint unavailable ({type(exc).__name__}: {exc})")
                return
        if factory is None:
            return
        try:
            try:
                endpoint = factory(history_limit=self.history_size, max_peers=self.status_max_peers)
            except TypeError:
                endpoint = factory()  # a factory that takes no options
            endpoint.start(self.shell)
            self._endpoint = endpoint
        except Exception as exc:
            self._warn_once_now("status:start", f"status endpoint did not start ({type(exc).__name__}: {exc})")
            return
        # Loaded by %load_ext, the cell that loads it is running (its end sets "idle");
        # loaded from the config at start-up, no cell runs: say "idle" now rather than
        # leaving the endpoint without a state (and refusing drains) until a first cell.
        # IPython keeps displayhook.exec_result set only while a cell executes.
        now = time.time_ns()
        running = getattr(getattr(self.shell, "displayhook", None), "exec_result", None)
        if running is not None:
            cell = getattr(running, "execution_count", None)
            self._status("set_state", {"state": "running", "cell": cell, "since_ns": now})
        else:
            self._status("set_state", {"state": "idle", "since_ns": now})

    def _close_status_endpoint(self) -> None:
        endpoint, self._endpoint = self._endpoint, None
        if endpoint is not None:
            with contextlib.suppress(Exception):
                endpoint.close()

    def _status(self, method: str, payload: dict) -> None:
        endpoint = self._endpoint
        if endpoint is None:
            return
        try:
            getattr(endpoint, method)(payload)
        except Exception as exc:
            self._warn_once_now(f"status:{method}", f"status endpoint failed ({type(exc).__name__}: {exc})")

    @observe("history_size", "status_max_peers")
    def _resize_history(self, change) -> None:
        if change["name"] == "history_size" and hasattr(self, "history"):
            self.history.resize(change["new"])
        # The native server's history bound and peer cap are fixed when it starts: restart
        # it so that the status endpoint keeps as many records as %gpumem --history.
        if getattr(self, "_endpoint", None) is not None:
            self._close_status_endpoint()
            self._start_status_endpoint()

    # ------------------------------------------------------------ notes

    def _warn_once_now(self, kind: str, text: str) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            print(f"{report.PREFIX}{report.SEP}{text}")

    def _shown_notes(self, notes: List[tuple]) -> List[str]:
        shown = []
        for kind, text in notes:
            if kind not in self._warned:
                self._warned.add(kind)
                shown.append(text)
        return shown

    # ------------------------------------------------------------ adapters

    def _adapter_lock(self, name: str) -> threading.Lock:
        with self._locks_lock:
            lock = self._adapter_locks.get(name)
            if lock is None:
                lock = self._adapter_locks[name] = threading.Lock()
            return lock

    def _adapters(self, notes: List[tuple]) -> list:
        """Enabled adapters whose framework is in use. Only called once the driver is 'ready'."""
        fn = self._adapters_fn
        if fn is _MISSING:
            try:
                from .frameworks import active as fn
            except Exception:
                fn = None  # the adapters are not part of this build
            self._adapters_fn = fn
        if fn is None:
            return []
        try:
            found = fn()
            adapters = list(found.values() if isinstance(found, dict) else found)
        except Exception as exc:
            notes.append(("adapters:active", f"framework detection failed: {type(exc).__name__}: {exc}"))
            return []
        return [a for a in adapters if self.framework_enabled(str(getattr(a, "name", "?")))]

    def _guarded(self, adapter: Any, verb: str, *args: Any):
        """``(result, None)`` or ``(None, (kind, note))``: an adapter's exception becomes one note."""
        name = getattr(adapter, "name", "?")
        try:
            return getattr(adapter, verb)(*args), None
        except Exception as exc:
            return None, (f"adapter:{name}:{verb}:{type(exc).__name__}", f"{name}.{verb} failed: {type(exc).__name__}: {exc}")

    def _stats(self, adapters: list, devices: List[int], notes: List[tuple]) -> Dict[str, dict]:
        out = {}
        for adapter in adapters:
            result, note = self._guarded(adapter, "stats", list(devices))
            if note:
                notes.append(note)
                continue
            if not isinstance(result, dict):
                continue
            per_device = {}
            for key, entry in (result.get("devices") or {}).items():
                idx = _index(key)
                if idx is not None and isinstance(entry, dict):
                    per_device[idx] = {
                        "live_bytes": int(entry.get("live_bytes") or 0),
                        "cached_bytes": int(entry.get("cached_bytes") or 0),
                    }
            pinned = result.get("pinned")
            if isinstance(pinned, dict):
                pinned = {"live_bytes": int(pinned.get("live_bytes") or 0), "cached_bytes": int(pinned.get("cached_bytes") or 0)}
            else:
                pinned = None
            out[adapter.name] = {"devices": per_device, "pinned": pinned, "notes": list(result.get("notes") or [])}
        return out

    @staticmethod
    def _live_total(stats: Dict[str, dict], devices: List[int]) -> int:
        return sum(s["devices"].get(i, {}).get("live_bytes", 0) for s in stats.values() for i in devices)

    # ------------------------------------------------------------ event handlers

    def pre_run_cell(self, info: Any = None) -> None:
        """Before a cell: mark it running for the status endpoint; snapshot if CUDA is in use."""
        try:
            self._pre = None
            if not self.enabled or self._exiting:
                return
            if info is not None and getattr(info, "silent", False):
                return
            now = time.time_ns()
            self._forced_in_cell = None
            count = running_cell_number(self.shell, info)
            self._status("set_state", {"state": "running", "cell": count, "since_ns": now})
            if self._last_driver_state != "ready":
                return  # nothing used CUDA after the last cell: the post-cell probe decides
            pre: dict = {"time_ns": now, "snapshot": self.native.snapshot()}
            if self.gc == "auto":
                ns = self.shell.user_ns
                pre["names"] = [n for n in ns if not n.startswith("_")]
                pre["gpu"] = bound_gpu_objects(ns)
            self._pre = pre
        except (Exception, KeyboardInterrupt) as exc:
            self._pre = None
            if isinstance(exc, KeyboardInterrupt):
                # Ctrl-C is the user's: it stops the cell. The transformer is there only
                # for this cell (IPython makes cyclic garbage per cell while one is set).
                self._interrupt_the_cell.pending = True
                if self._interrupt_the_cell not in self.shell.ast_transformers:
                    self.shell.ast_transformers.append(self._interrupt_the_cell)
                return
            if outside_drain_gave_no_way(exc):
                return  # the cell runs at once; its line then has no "before" to compare with
            with contextlib.suppress(Exception):
                self._warn_once_now(f"pre:{type(exc).__name__}", f"snapshot before the cell failed ({type(exc).__name__}: {exc})")

    def post_run_cell(self, result: Any = None) -> None:
        """After a cell: the cleanup; never raises and leaves the cell's result and error alone."""
        try:
            if result is not None and getattr(getattr(result, "info", None), "silent", False):
                return
            if not self.enabled or self._exiting:
                return
            record = self.cleanup(result, after_forced=self._forced_in_cell)
            if record is not None and record.get("shown"):
                for line in record.pop("_lines", []):
                    print(line)
            elif record is not None:
                record.pop("_lines", None)
        except KeyboardInterrupt:
            with contextlib.suppress(Exception):
                print(f"{report.PREFIX}{report.SEP}interrupted (Ctrl-C): cleanup stopped")
        except Exception as exc:
            if outside_drain_gave_no_way(exc):
                with contextlib.suppress(Exception):
                    print(f"{report.PREFIX}{report.SEP}{exc}")
                return
            with contextlib.suppress(Exception):
                self._warn_once_now(f"internal:{type(exc).__name__}", f"cleanup failed ({type(exc).__name__}: {exc}); the cell is not affected")
        finally:
            self._pre = None
            self._forced_in_cell = None
            self._interrupt_the_cell.pending = False
            with contextlib.suppress(Exception):
                if self._interrupt_the_cell in self.shell.ast_transformers:
                    self.shell.ast_transformers.remove(self._interrupt_the_cell)
            with contextlib.suppress(Exception):
                if self._endpoint is not None:
                    self._status("set_state", {"state": "idle", "since_ns": time.time_ns()})

    # ------------------------------------------------------------ the cleanup

    def _progress(self, payload: dict) -> bool:
        if self._ctrl_c.pressed:
            return True  # stop waiting
        # The status endpoint (gpucleanup ps) shows which GPU the cell waits for,
        # since when: the wait began waited_s ago.
        waited_ns = int(float(payload.get("waited_s", 0.0)) * 1e9)
        self._status("set_state", {"state": "waiting", "device": int(payload.get("device", 0)),
                                   "cell": self._draining_cell, "since_ns": time.time_ns() - waited_ns})
        if self.show == "never":
            return False
        line = report.progress_line(int(payload.get("device", 0)), float(payload.get("waited_s", 0.0)))
        sys.stdout.write(("\r" if self._progress_shown else "") + line)
        sys.stdout.flush()
        self._progress_shown = True
        self._progress_opened = True
        return False

    def _drain(self, timeout: float, notes: List[tuple], progress: bool) -> Optional[dict]:
        self._progress_shown = False
        # driver_pools off: settle only, the driver's pools are left as they are
        extra = {} if self.driver_pools else {"trim": False}
        try:
            return self.native.drain(timeout=timeout, progress=self._progress if progress else None, **extra)
        except Exception as exc:
            notes.append((f"drain:{type(exc).__name__}", f"native drain failed: {exc}"))
            return None
        finally:
            if self._progress_shown:
                sys.stdout.write("\n")
                sys.stdout.flush()
                self._progress_shown = False

    def _cell_unbound_something(self, pre: Optional[dict]) -> bool:
        """Did the cell delete a name, or unbind a GPU array/tensor, of the user namespace?"""
        if not pre or "names" not in pre:
            return False
        ns = self.shell.user_ns
        if any(name not in ns for name in pre["names"]):
            return True
        before = pre["gpu"]
        if not before:
            return False
        now = bound_gpu_objects(ns)
        return any(oid not in now for oid in before)

    def _collect_garbage(self, live: Optional[int], unbound: bool, recount: Callable[[], Optional[int]]) -> dict:
        info = {"policy": self.gc, "ran": None, "elapsed_s": 0.0, "collected": 0}
        if self.gc == "never":
            return info
        start = time.perf_counter()
        if self.gc == "always":
            info["collected"] = gc.collect()
            info["ran"] = "full"
        elif live is None or live > 0:
            # auto: only live GPU objects can be garbage holding GPU memory
            info["collected"] = gc.collect(1)
            info["ran"] = "young"
            if unbound:
                after = recount()
                if after is None or after > 0:
                    info["collected"] += gc.collect()
                    info["ran"] = "full"
        info["elapsed_s"] = round(time.perf_counter() - start, 6)
        return info

    def _take_pinned_results(self) -> List[_PinnedJob]:
        job = self._pinned_job
        if job is not None and job.done.is_set() and not job.reported:
            job.reported = True
            self._pinned_job = None
            return [job]
        return []

    def cleanup(self, result: Any = None, forced: bool = False, after_forced: Optional[dict] = None) -> Optional[dict]:
        """Run the after-cell cleanup now; returns the cell's record (None when CUDA is not in use).

        ``forced`` (``%gpumem --drain``) always builds the summary lines. ``after_forced``
        is the record of a ``%gpumem --drain`` run earlier in the same cell: this
        cleanup then says and records only what it adds to it (one line per cell).
        """
        start = time.perf_counter()
        self._progress_opened = False
        cell = getattr(result, "execution_count", None) if result is not None else None
        pre, self._pre = self._pre, None
        probe = self.native.probe()
        driver = probe.get("driver") or {}
        state = driver.get("state")
        self._last_driver_state = state
        in_use = [d for d in probe.get("devices") or [] if d.get("in_use")]
        if state != "ready" or not in_use:
            if state in ("unusable",):
                self._warn_once_now("driver:unusable", f"the CUDA driver is unusable: {driver.get('message')}")
            if not forced:
                return None
            why = report.driver_sentence(driver) if state != "ready" else "no GPU in use by this kernel: nothing to clean"
            return {"cell": cell, "driver_state": state, "devices": [], "shown": True, "_lines": [report.SEP.join([report.PREFIX, why])]}

        notes: List[tuple] = []
        all_devices = [int(d["index"]) for d in in_use]
        quiet = set(i for i in all_devices if i in self._unusable)
        devices = [i for i in all_devices if i not in self._unusable]
        self._draining_cell = cell
        self._status("set_state", {"state": "draining", "cell": cell, "since_ns": time.time_ns()})

        freed: Dict[int, Dict[str, int]] = {i: {} for i in all_devices}
        dev_state: Dict[int, str] = {}
        settle: Dict[int, dict] = {}
        messages: Dict[int, Optional[str]] = {}
        free_before: Dict[int, Optional[int]] = {}
        interrupted = False
        gc_info = {"policy": self.gc, "ran": None, "elapsed_s": 0.0, "collected": 0}
        pinned_now: Dict[str, int] = {}
        pending = False
        pinned_candidates: list = []
        adapters: list = []
        stats_after: Dict[str, dict] = {}
        stats_settled: Dict[str, dict] = {}
        captured: List[dict] = []
        captured_now: List[dict] = []

        def released(drain: Optional[dict]) -> None:
            for dev in (drain or {}).get("devices") or []:
                idx = _index(dev.get("index"))
                if idx in freed and dev.get("released_bytes"):
                    freed[idx]["driver"] = freed[idx].get("driver", 0) + int(dev["released_bytes"])

        background = self._take_pinned_results()
        for job in background:
            notes.extend(job.notes)
            captured.extend(job.unraisable)
        try:
            with self._ctrl_c.armed() as ctrl_c, self._unraisables.capture() as captured_now:
                # 1. settle (with driver_pools on, the native drain also trims the driver pools once)
                first = self._drain(self._settle_limit(after_forced), notes, progress=True)
                if first is not None:
                    interrupted = bool(first.get("keyboard_interrupt")) or ctrl_c.pressed
                    for dev in first.get("devices") or []:
                        idx = _index(dev.get("index"))
                        if idx is None:
                            continue
                        dev_state[idx] = dev.get("state") or "error"
                        settle[idx] = dev.get("settle") or {}
                        messages[idx] = dev.get("message")
                        free_before[idx] = dev.get("free_before_bytes")
                        if dev_state[idx] == "unusable":
                            if idx in self._unusable:
                                quiet.add(idx)
                            self._unusable.add(idx)
                        elif dev_state[idx] == "error":
                            err = dev.get("error") or {}
                            notes.append((f"device-error:{err.get('name') or dev.get('message')}", dev.get("message") or f"GPU{idx}: {err.get('message')}"))
                        if interrupted and settle[idx].get("status") == "interrupted":
                            dev_state[idx] = "interrupted"
                    released(first)
                settled = [i for i in devices if dev_state.get(i) == "drained"]
                if interrupted:
                    raise KeyboardInterrupt
                ctrl_c.check()
                adapters = self._adapters(notes) if settled else []
                stats_settled = self._stats(adapters, settled, notes) if adapters else {}

                # 2. garbage, only when it can release GPU memory
                if settled and self.gc != "never":
                    live = self._live_total(stats_settled, settled) if adapters else None
                    unbound = self._cell_unbound_something(pre) if self.gc == "auto" else False

                    def recount() -> Optional[int]:
                        if not adapters:
                            return None
                        return self._live_total(self._stats(adapters, settled, []), settled)

                    gc_info = self._collect_garbage(live, unbound, recount)
                ctrl_c.check()

                # 3. the frameworks' caches, device by device
                for adapter in adapters:
                    ctrl_c.check()
                    if not getattr(adapter, "can_release", True):
                        continue
                    lock = self._adapter_lock(adapter.name)
                    if not lock.acquire(timeout=_ADAPTER_LOCK_WAIT_S):
                        notes.append(
                            (f"busy-pinned:{adapter.name}", f"{adapter.name}: pinned release of an earlier cell still running, its device pool waits for the next cell")
                        )
                        continue
                    try:
                        with self._unraisables.source(adapter.name):
                            res, note = self._guarded(adapter, "drain", list(settled))
                    finally:
                        lock.release()
                    if note:
                        notes.append(note)
                        continue
                    if isinstance(res, dict):
                        for key, n in (res.get("freed_bytes") or {}).items():
                            idx = _index(key)
                            if idx in freed and n:
                                freed[idx][adapter.name] = freed[idx].get(adapter.name, 0) + int(n)
                        for text in res.get("notes") or []:
                            notes.append((f"note:{adapter.name}:{text}", adapter_note(adapter.name, text)))

                # pinned host pools: off the cell's critical path
                if self.pinned and adapters and len(settled) == len(devices):
                    job = self._pinned_job
                    if job is not None and not job.done.is_set():
                        pending = True
                    else:
                        # started once this cell's driver calls are done (below): a
                        # pinned free (cudaFreeHost) makes the driver calls made meanwhile
                        # wait for it, 145 ms for 1 GiB on an H100
                        pinned_candidates = [
                            a
                            for a in adapters
                            if getattr(a, "can_release", True)
                            and hasattr(a, "drain_pinned")
                            and a.name in stats_settled
                            # unknown pinned stats: try; known empty pools: no thread for nothing
                            and (stats_settled[a.name]["pinned"] is None or stats_settled[a.name]["pinned"]["cached_bytes"] > 0)
                        ]

                # 4. the driver's pools, after the frameworks gave memory back to them. The
                # settle above trimmed them once; trim again only if something was given back
                # since (a framework freed, or gc collected objects whose frees may go to a pool).
                ctrl_c.check()
                given_back = any(n for i in settled for name, n in freed[i].items() if name != "driver")
                if self.driver_pools and settled and (given_back or gc_info.get("collected")):
                    released(self._drain(0.0, notes, progress=False))
        except KeyboardInterrupt:
            interrupted = True
            for i in devices:
                if dev_state.get(i) in (None, "drained"):
                    dev_state[i] = "interrupted"

        # 5. what is left, and the record
        captured.extend(captured_now)
        snapshot = None
        try:
            snapshot = self.native.snapshot()
        except Exception as exc:
            notes.append((f"snapshot:{type(exc).__name__}", f"snapshot failed: {exc}"))
        snap_devices = {int(d["index"]): d for d in (snapshot or {}).get("devices") or [] if _index(d.get("index")) is not None}
        if adapters and not interrupted:
            stats_after = self._stats(adapters, [i for i in devices if dev_state.get(i) != "unusable"], notes)
        if pinned_candidates and not interrupted:
            new = _PinnedJob(self, pinned_candidates, cell)
            self._pinned_job = new
            new.thread.start()
            if new.done.wait(_PINNED_REPORT_WAIT_S):
                new.reported = True
                self._pinned_job = None
                pinned_now = dict(new.freed)
                notes.extend(new.notes)
                captured.extend(new.unraisable)
            else:
                pending = True
        unraisable_line = summarize_unraisables(captured)
        if unraisable_line:
            first_type = captured[0]["type"]
            notes.append((f"unraisable:{first_type}", unraisable_line))

        pre_devices = {int(d["index"]): d for d in ((pre or {}).get("snapshot") or {}).get("devices") or [] if _index(d.get("index")) is not None}
        record_devices = []
        touched = False  # without a snapshot from before the cell (paused, or loaded in it): only what was freed counts
        for i in all_devices:
            snap = snap_devices.get(i, {})
            total = snap.get("total_bytes")
            used_after = snap.get("used_bytes")
            fb = free_before.get(i)
            used_before = (total - fb) if (total is not None and fb is not None) else None
            start_free = pre_devices.get(i, {}).get("free_bytes")
            if pre is not None and (i not in pre_devices or (fb is not None and start_free != fb)):
                touched = True
            live = {name: s["devices"].get(i, {}).get("live_bytes", 0) for name, s in stats_after.items() if s["devices"].get(i, {}).get("live_bytes")}
            cached = {name: s["devices"].get(i, {}).get("cached_bytes", 0) for name, s in stats_after.items() if s["devices"].get(i, {}).get("cached_bytes")}
            state_i = dev_state.get(i, "error" if i not in quiet else "unusable")
            record_devices.append(
                {
                    "index": i,
                    "name": snap.get("name"),
                    "state": state_i,
                    "settle": settle.get(i),
                    "total_bytes": total,
                    "used_at_start_bytes": (pre_devices.get(i, {}).get("used_bytes")),
                    "used_before_bytes": used_before,
                    "used_after_bytes": used_after,
                    "freed_bytes": freed.get(i, {}),
                    "live_bytes": live,
                    "cached_bytes": cached,
                    "message": messages.get(i),
                    "quiet": i in quiet,
                }
            )
        pinned_stats = {name: s["pinned"] for name, s in stats_after.items() if s.get("pinned")}
        record = {
            "cell": cell,
            "time_ns": time.time_ns(),
            "elapsed_s": round(time.perf_counter() - start, 6),
            "driver_state": state,
            "interrupted": interrupted,
            "devices": record_devices,
            "pinned": {
                "freed_bytes": pinned_now,
                "background": [job.result() for job in background],
                "pending": pending,
                "pools": pinned_stats,
            },
            "gc": gc_info,
            "notes": [text for _, text in notes],
            "unraisable": captured[:20],
        }
        record["shown_notes"] = self._shown_notes(notes)
        record["touched"] = bool(touched)
        anything_freed = any(sum(d["freed_bytes"].values()) for d in record_devices) or pinned_now or any(
            job.freed for job in background
        )
        trouble = bool(record["shown_notes"]) or interrupted or any(
            d["state"] not in ("drained",) and not d["quiet"] for d in record_devices
        )
        if after_forced is not None:
            # %gpumem --drain already said this cell's line: say only what is new
            before_states = {d.get("index"): d.get("state") for d in after_forced.get("devices") or []}
            new_trouble = bool(record["shown_notes"]) or interrupted or any(
                d["state"] != before_states.get(d["index"]) and d["state"] != "drained" and not d["quiet"] for d in record_devices
            )
            shown = self.show != "never" and bool(anything_freed or new_trouble)
        elif forced or self.show == "always":
            shown = True
        elif self.show == "never":
            shown = False
        else:
            shown = bool(touched or anything_freed or trouble)
        # a progress line was printed: the summary closes it, whatever the policy
        shown = shown or self._progress_opened
        # a sticky error is said once even when summaries are off
        first_sticky = [d for d in record_devices if d["state"] == "unusable" and not d["quiet"]]
        lines = report.summary_lines(record) if (shown or first_sticky) else []
        if not shown and first_sticky:
            lines = [report.SEP.join([report.PREFIX, d["message"] or report.unusable_sentence(d)]) for d in first_sticky]
        record["shown"] = bool(lines)
        record["_lines"] = lines
        if after_forced is None or lines:
            # one record per cell: after a %gpumem --drain, only when this pass added to it
            self.history.append({k: v for k, v in record.items() if k != "_lines"})
            self._status("publish", {k: v for k, v in record.items() if k != "_lines"})
        return record

    def _settle_limit(self, after_forced: Optional[dict]) -> float:
        """How long this cleanup waits for queued work: no second wait for a device that
        a ``%gpumem --drain`` earlier in the cell already waited for in vain."""
        if after_forced is not None and any(
            (d.get("state") not in ("drained", "unusable")) for d in after_forced.get("devices") or []
        ):
            return 0.0
        return float(self.settle_timeout)

    # ------------------------------------------------------------ %gpumem

    def status(self) -> dict:
        """What %gpumem shows, as data with exact bytes."""
        notes: List[tuple] = []
        out: dict = {"kind": "gpumem", "time_ns": time.time_ns(), "enabled": bool(self.enabled), "devices": [], "pinned": {}}
        try:
            snap = self.native.snapshot()
        except Exception as exc:
            out["driver"] = {"state": "unusable", "message": str(exc)}
            out["notes"] = [f"snapshot failed: {exc}"]
            out["history"] = self.history.last(5)
            return out
        driver = snap.get("driver") or {}
        out["driver"] = driver
        in_use = [d for d in snap.get("devices") or [] if d.get("in_use")]
        adapters = self._adapters(notes) if driver.get("state") == "ready" and in_use else []
        indices = [int(d["index"]) for d in in_use if int(d["index"]) not in self._unusable]
        stats = self._stats(adapters, indices, notes) if adapters else {}
        out["frameworks"] = {}
        for adapter in adapters:
            desc, note = self._guarded(adapter, "describe")
            out["frameworks"][adapter.name] = desc if isinstance(desc, str) else None
        for dev in in_use:
            i = int(dev["index"])
            fws = {name: s["devices"][i] for name, s in stats.items() if i in s["devices"]}
            pools = [
                {"which": p.get("which"), "reserved_bytes": p.get("reserved_bytes"), "used_bytes": p.get("used_bytes")}
                for p in dev.get("pools") or []
            ]
            used = dev.get("used_bytes")
            known = sum(e["live_bytes"] + e["cached_bytes"] for e in fws.values()) + sum(int(p["reserved_bytes"] or 0) for p in pools)
            out["devices"].append(
                {
                    "index": i,
                    "name": dev.get("name"),
                    "state": "unusable" if i in self._unusable else dev.get("state"),
                    "total_bytes": dev.get("total_bytes"),
                    "used_bytes": used,
                    "free_bytes": dev.get("free_bytes"),
                    "frameworks": fws,
                    "pools": pools,
                    "known_bytes": known,
                    "outside_bytes": max(0, used - known) if used is not None else None,
                    "message": (dev.get("error") or {}).get("message"),
                }
            )
        out["pinned"] = {name: s["pinned"] for name, s in stats.items() if s.get("pinned")}
        for s in stats.values():
            notes.extend((f"stats-note:{n}", n) for n in s.get("notes") or [])
        out["notes"] = [text for _, text in notes]
        out["history"] = self.history.last(5)
        return out

    @gpumem_arguments
    @line_magic
    def gpumem(self, line: str = ""):
        """GPU memory of this kernel: per device in use, per framework, driver pools, pinned host pools.

        With no option, a table per device in use: total and used memory (device-wide,
        as the driver sees it), each framework's live and cached bytes, the driver's
        memory pools (used / reserved), the pinned host pools, and what is outside every
        pool (device used minus everything known: the CUDA context, other processes on
        the same GPU and raw allocations), then the last cells' records.

        Rich frontends get HTML tables, terminals aligned text. ``--json`` returns the
        same data with exact bytes (assign it: ``d = %gpumem --json``).

        After every cell, while the kernel uses CUDA, gpucleanup waits (at most
        ``settle_timeout`` s) for queued GPU work, collects garbage when it can release
        GPU memory, empties the frameworks' caches (pinned host pools in the
        background), trims the driver's pools and prints one line per device, e.g.
        ``gpucleanup · GPU0 H100 · freed 6.0 GiB (cupy 5.5, torch 0.5) · device 2.7/79.6 GiB · 12 ms``.

        Configure it with ``%config GPUCleanup`` (enabled, frameworks, pinned,
        driver_pools, gc, settle_timeout, show, history_size, status_server) or
        ``c.GPUCleanup.<trait>`` in ipython_config.py / ipython_kernel_config.py.
        """
        args = parse_gpumem(self.gpumem, line)
        from IPython.display import display

        if (args.off or args.on) and not self._hooks_registered:
            # no driver, no GPU or no native library at load: there is no cleanup to pause or resume
            self.enabled = not args.off
            print(f"{report.PREFIX}{report.SEP}no cleanup runs after cells in this kernel ({self._why_no_hooks()}): nothing to "
                  + ("pause" if args.off else "resume"))
        elif args.off:
            self.enabled = False
            print(f"{report.PREFIX}{report.SEP}automatic cleanup paused (%gpumem --on resumes it)")
        elif args.on:
            self.enabled = True
            print(f"{report.PREFIX}{report.SEP}automatic cleanup resumed")
        if args.drain:
            self._pre = None
            record = self.cleanup(None, forced=True)
            for text in (record or {}).pop("_lines", []):
                print(text)
            if record is not None:
                self._forced_in_cell = record
        wants_table = not (args.off or args.on or args.drain) or args.json
        if args.json:
            data = self.status() if (args.history is None and args.vars is None) or wants_table else {}
            if args.history is not None:
                data["history"] = self.history.last(args.history)
            if args.vars is not None:
                data["vars"] = self._vars()[: args.vars] if args.vars else self._vars()
            return report.JSONReport(data)
        shown = False
        if args.history is not None:
            display(report.history_report(self.history.last(args.history)))
            shown = True
        if args.vars is not None:
            display(report.vars_report(self._vars(), args.vars))
            shown = True
        if wants_table and not shown:
            display(report.memory_report(self.status()))
        return None

    def _why_no_hooks(self) -> str:
        state = self._last_driver_state
        if state == "no_driver":
            return "no CUDA driver"
        if state == "unusable":
            return "the CUDA driver is unusable"
        if state == "ready":
            return "no GPU on this machine"
        return "the native library could not be loaded"

    def _vars(self) -> List[dict]:
        out_cache = getattr(getattr(self.shell, "history_manager", None), "output_hist", None)
        found = find_gpu_objects(self.shell.user_ns, out_cache)
        return sorted(found, key=lambda f: -int(f.get("bytes") or 0))


# ---------------------------------------------------------------- entry points

try:
    _instances: "weakref.WeakKeyDictionary[Any, GPUCleanup]" = weakref.WeakKeyDictionary()
except Exception:  # pragma: no cover
    _instances = {}  # type: ignore[assignment]


def load_ipython_extension(ipython) -> None:
    """``%load_ext gpucleanup``: one GPUCleanup object per shell."""
    if ipython in _instances:
        print(f"{report.PREFIX} is already loaded (%reload_ext gpucleanup reloads it)")
        return
    kwargs = {}
    if DEFAULTS.get("native") is not None:
        kwargs["native"] = DEFAULTS["native"]
    if DEFAULTS.get("adapters") is not None:
        kwargs["adapters"] = DEFAULTS["adapters"]
    if DEFAULTS.get("status_endpoint") is not None:
        kwargs["status_endpoint"] = DEFAULTS["status_endpoint"]
    ext = GPUCleanup(shell=ipython, **kwargs)
    _instances[ipython] = ext
    try:
        ext.load()
    except Exception:
        _instances.pop(ipython, None)
        with contextlib.suppress(Exception):
            ext.unload()
        raise


def unload_ipython_extension(ipython) -> None:
    """``%unload_ext gpucleanup``: unregisters exactly what load registered."""
    ext = _instances.pop(ipython, None)
    if ext is not None:
        ext.unload()


def get_extension(ipython) -> Optional[GPUCleanup]:
    """The loaded extension object of a shell, or None."""
    return _instances.get(ipython)
