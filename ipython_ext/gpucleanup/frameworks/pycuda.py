"""PyCUDA: the ``DeviceMemoryPool`` and ``PageLockedMemoryPool`` instances the kernel made.

PyCUDA keeps no registry of its pools, so gpucleanup remembers each pool weakly as it is made (:class:`_Tracker`);
:class:`PycudaAdapter` reports them and drains a device pool only where PyCUDA can free its blocks.
"""

from __future__ import annotations

import gc
import itertools
import sys
import threading
import weakref
from typing import Any, Callable, Optional

from .base import Adapter, Figures, _bytes_text, _figures, _fault, _module

__all__ = ["PycudaAdapter", "install", "uninstall"]

#: module names whose import the finder watches
_WATCHED = ("pycuda._driver", "pycuda.driver")
#: the pool classes: name in pycuda._driver -> kind
_POOL_CLASSES = (("DeviceMemoryPool", "device"), ("PageLockedMemoryPool", "pinned"))
# GPU objects by type name (PyCUDA 2026.1): pycuda.gpuarray.GPUArray; pycuda._driver.DeviceAllocation
# (mem_alloc) and PooledDeviceAllocation (DeviceMemoryPool.allocate), Boost.Python classes
_OBJECT_KINDS = {
    "GPUArray": "pycuda.GPUArray",
    "DeviceAllocation": "pycuda.DeviceAllocation",
    "PooledDeviceAllocation": "pycuda.PooledDeviceAllocation",
}


class _Pool:
    """What gpucleanup knows about one pool; the pool itself only through a weak reference."""

    __slots__ = ("ref", "kind", "label", "seen", "thread", "thread_name", "ctx_handle", "ctx", "device", "index")

    def __init__(self, ref: Any, kind: str, label: str, seen: bool) -> None:
        self.ref = ref
        self.kind = kind
        self.label = label
        self.seen = seen  # True: its making was seen (thread and context known)
        self.thread: Optional[int] = None
        self.thread_name: Optional[str] = None
        self.ctx_handle: Optional[int] = None
        self.ctx: Any = None  # only where the Context has no ``handle``
        self.device: Any = None  # pycuda.driver.Device of its context
        self.index: Optional[int] = None  # device index, once matched


def _driver() -> Any:
    """``pycuda._driver`` (or ``pycuda.driver``, which re-exports it) if imported, else None."""
    return _module("pycuda._driver") or _module("pycuda.driver")


def _current_context(drv: Any) -> Any:
    """PyCUDA's current context on this thread (its own thread-local stack), or None."""
    context = getattr(drv, "Context", None)
    return None if context is None else context.get_current()


def _same_context(ctx: Any, pool: _Pool) -> bool:
    if ctx is None:
        return False
    handle = getattr(ctx, "handle", None)
    if handle is not None and pool.ctx_handle is not None:
        return int(handle) == pool.ctx_handle
    return pool.ctx is not None and bool(ctx == pool.ctx)


def _pool_bytes(pool: Any) -> Optional[tuple[int, int]]:
    """(live, held) bytes of a pool, or None where this PyCUDA does not tell them."""
    managed = getattr(pool, "managed_bytes", None)
    active = getattr(pool, "active_bytes", None)
    if managed is None or active is None:
        return None
    managed, active = int(managed), int(active)
    return active, max(managed - active, 0)


class _ImportWatch:
    """A ``sys.meta_path`` finder for PyCUDA's driver modules only: it asks the finders after
    it for the module's spec and calls ``then`` once the module has run."""

    def __init__(self, then: Callable[[], None]) -> None:
        self._then = then

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname not in _WATCHED:
            return None
        for finder in list(sys.meta_path):
            if finder is self or isinstance(finder, _ImportWatch):
                continue
            find = getattr(finder, "find_spec", None)
            if find is None:
                continue
            spec = find(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = getattr(spec, "loader", None)
        if loader is not None and hasattr(loader, "exec_module"):
            spec.loader = _ThenLoader(loader, self._then)
        return spec

    def invalidate_caches(self) -> None:
        return None


class _ThenLoader:
    """The module's own loader, and ``then`` after it ran the module."""

    def __init__(self, loader: Any, then: Callable[[], None]) -> None:
        self._loader = loader
        self._then = then

    def create_module(self, spec: Any) -> Any:
        create = getattr(self._loader, "create_module", None)
        return None if create is None else create(spec)

    def exec_module(self, module: Any) -> None:
        self._loader.exec_module(module)
        try:
            self._then()
        except Exception:  # never break the user's import
            pass

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


class _Tracker:
    """The pools the kernel made, weakly; the finder and the wrapped ``__init__`` methods.

    PyCUDA keeps no registry of its pools (PyCUDA 2026.1 sources, src/wrapper/mempool.cpp, pycuda/tools.py:
    ``DeviceMemoryPool = _drv.DeviceMemoryPool``, ``PageLockedMemoryPool = _drv.PageLockedMemoryPool``,
    Boost.Python classes of ``pycuda._driver``), so gpucleanup remembers each pool weakly as it is made: the
    classes' ``__init__`` is wrapped (Boost.Python classes are heap types; ``pycuda.tools.DebugMemoryPool`` calls
    ``DeviceMemoryPool.__init__`` and is seen too). The wrapping is put in place

    - by a ``sys.meta_path`` finder (``install()``) that reacts only to ``pycuda._driver`` and ``pycuda.driver`` and
      wraps the classes once that module has run, so pools made in the cell that imports PyCUDA are seen;
      ``uninstall()`` removes the finder and the wrapping;
    - or at once, by ``install()`` or by the first ``in_use()`` that finds ``pycuda.driver`` imported. Pools made
      before that are looked for once in the garbage collector's objects (only where it tracks them): they are
      named, never drained, since nobody saw which thread and context made them.

    Nothing of this runs per cell while PyCUDA is not imported: ``in_use`` is one dictionary look-up then. Once it
    is, a cell costs a walk over the pools the kernel made.
    """

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._pools: dict[int, _Pool] = {}
        self._keys = itertools.count(1)
        self._numbers = {"device": itertools.count(1), "pinned": itertools.count(1)}
        self._installs = 0
        self._finder: Optional[_ImportWatch] = None
        # (class, its own __init__ or None where it inherited one, wrapper)
        self._wrapped: list[tuple[type, Any, Any]] = []
        self._searched = False
        self._closed = False  # every install undone: nothing wraps again until the next install
        self._dead: list[int] = []  # keys of pools gone (weak reference callbacks only append)

    # -- install / uninstall ------------------------------------------------------

    def install(self) -> None:
        with self._lock:
            self._installs += 1
            self._closed = False
            if _driver() is not None:
                self.wrap(after_import=True)
            elif self._finder is None:
                self._finder = _ImportWatch(lambda: self.wrap(after_import=False))
                sys.meta_path.insert(0, self._finder)

    def uninstall(self) -> None:
        with self._lock:
            self._installs = max(self._installs - 1, 0)
            if self._installs:
                return
            self._closed = True
            if self._finder is not None:
                try:
                    sys.meta_path.remove(self._finder)
                except ValueError:
                    pass
                self._finder = None
            for cls, original, wrapper in self._wrapped:
                if cls.__dict__.get("__init__") is wrapper:
                    try:
                        if original is None:
                            delattr(cls, "__init__")
                        else:
                            setattr(cls, "__init__", original)
                    except Exception:
                        pass
            self._wrapped = []

    @property
    def watching(self) -> bool:
        with self._lock:
            return self._finder is not None or bool(self._wrapped)

    # -- wrapping -----------------------------------------------------------------

    def wrap(self, after_import: bool) -> None:
        """Wrap the pool classes' ``__init__`` (once); ``after_import``: PyCUDA was imported
        before, so look once for pools made before gpucleanup watched."""
        with self._lock:
            drv = _driver()
            if drv is None:
                return
            done = {cls for cls, _, _ in self._wrapped}
            for name, kind in _POOL_CLASSES:
                cls = getattr(drv, name, None)
                if not isinstance(cls, type) or cls in done:
                    continue
                own = cls.__dict__.get("__init__")
                # a wrapper left by an earlier gpucleanup (a reload): wrap what it wrapped
                own = getattr(own, "_gpucleanup_wraps", own)
                wrapper = self._wrapper(own if own is not None else cls.__init__, kind)
                try:
                    setattr(cls, "__init__", wrapper)
                except Exception:
                    continue
                self._wrapped.append((cls, own, wrapper))
            if self._finder is not None:
                try:
                    sys.meta_path.remove(self._finder)
                except ValueError:
                    pass
                self._finder = None
            if after_import and not self._searched:
                self._searched = True
                self._search(drv)

    def _wrapper(self, original: Any, kind: str) -> Any:
        tracker = self

        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            original(self, *args, **kwargs)
            try:
                tracker.made(self, kind)
            except Exception:  # the user's pool works whatever gpucleanup could not note
                pass

        __init__._gpucleanup_wraps = original  # type: ignore[attr-defined]
        __init__.__doc__ = getattr(original, "__doc__", None)
        return __init__

    def ensure_wrapped(self) -> None:
        """The first ``in_use`` after PyCUDA's import wraps the classes when no finder did
        (unless every ``install`` was undone: the extension is unloaded)."""
        if not self._wrapped and not self._closed:
            self.wrap(after_import=True)

    # -- pools --------------------------------------------------------------------

    def made(self, pool: Any, kind: str) -> None:
        """A pool was just made on this thread (called from the wrapped ``__init__``)."""
        drv = _driver()
        ctx = _current_context(drv) if drv is not None else None
        facts: dict = {"thread": threading.get_ident(), "thread_name": threading.current_thread().name}
        if ctx is not None:
            handle = getattr(ctx, "handle", None)
            if handle is not None:
                facts["ctx_handle"] = int(handle)
            else:
                facts["ctx"] = ctx
            if kind == "device":
                try:  # the device of the context current now: the pool's (cuCtxGetDevice)
                    facts["device"] = drv.Context.get_device()
                except Exception:
                    pass
        self._add(pool, kind, seen=True, facts=facts)

    def _add(self, pool: Any, kind: str, seen: bool, facts: Optional[dict] = None) -> Optional[_Pool]:
        with self._lock:
            for existing in self._pools.values():
                if existing.ref() is pool:
                    return None
            key = next(self._keys)
            dead = self._dead

            def gone(_ref: Any, key: int = key) -> None:
                dead.append(key)  # pruned under the lock by pools()

            try:
                ref = weakref.ref(pool, gone)
            except TypeError:
                return None
            name = type(pool).__name__
            label = f"{name} #{next(self._numbers[kind])}" if seen else f"{name} at {id(pool):#x}"
            record = _Pool(ref, kind, label, seen)
            for field, value in (facts or {}).items():
                setattr(record, field, value)
            self._pools[key] = record  # complete before any other thread can read it
            return record

    def _search(self, drv: Any) -> None:
        """Once: pools made before gpucleanup watched, where the collector tracks them."""
        classes = []
        for name, kind in _POOL_CLASSES:
            cls = getattr(drv, name, None)
            if isinstance(cls, type):
                classes.append((cls, kind))
        if not classes:
            return
        for obj in gc.get_objects():
            tp = type(obj)
            for cls, kind in classes:
                if issubclass(tp, cls):
                    self._add(obj, kind, seen=False)
                    break

    def pools(self) -> list[tuple[_Pool, Any]]:
        """(record, pool) of the pools alive now, in the order they were made."""
        with self._lock:
            while self._dead:
                self._pools.pop(self._dead.pop(), None)
            records = list(self._pools.values())
        out = []
        for record in records:
            pool = record.ref()
            if pool is not None:
                out.append((record, pool))
        return out


_TRACKER = _Tracker()


def install() -> None:
    """Watch PyCUDA's pools from now on (the extension's load). Counted: each ``install``
    needs its ``uninstall``."""
    _TRACKER.install()


def uninstall() -> None:
    """Undo ``install`` (the extension's unload): the finder leaves ``sys.meta_path`` and the
    pool classes get their own ``__init__`` back once every install is undone."""
    _TRACKER.uninstall()


class PycudaAdapter(Adapter):
    """PyCUDA's pools: reported, and a device pool drained where PyCUDA can free its blocks.

    A device pool frees its blocks under ``scoped_context_activation`` of its context (PyCUDA 2026.1 sources,
    src/cpp/cuda.hpp): when that context is not current on the freeing thread and belongs to another thread,
    PyCUDA throws "cannot activate out-of-thread context", prints "out-of-thread context could not be cleaned up"
    and the block is lost. So a device pool is drained (``free_held``; never ``stop_holding``) only on the thread
    that made it and only while the context current there at its making is current again, so that PyCUDA never
    pushes a context. Other pools are named in a note. PyCUDA's contexts are read from its own thread-local stack
    (``Context.get_current``, no CUDA call); gpucleanup never pushes, pops or creates one. ``PageLockedMemoryPool``
    frees with ``cuMemFreeHost`` and no context activation: its held blocks go with the pinned release.

    Live bytes are the pools' ``active_bytes``; cached bytes ``managed_bytes - active_bytes``. Memory from
    ``pycuda.driver.mem_alloc`` is in no pool: the engine shows it as memory outside every pool.
    """

    name = "pycuda"
    modules = ("pycuda.driver",)
    can_release = True
    drains_on_cell_thread = True  # a pool is drained only on the thread that made it (see the class docstring)
    object_modules = ("pycuda",)

    def object_kind(self, tp: type) -> Optional[str]:
        return _OBJECT_KINDS.get(getattr(tp, "__name__", ""))

    def object_info(self, obj: Any, kind: str) -> Optional[dict]:
        # PyCUDA's objects tell no device (finding it would take a driver call per object): GPU?. A
        # DeviceAllocation (mem_alloc) does not tell its size in Python either: its bytes are None.
        nbytes: Optional[int]
        if kind == "pycuda.GPUArray":
            nbytes = int(obj.nbytes)
            shape = [int(s) for s in getattr(obj, "shape", ()) or ()]
            dtype = str(obj.dtype)
        elif kind == "pycuda.PooledDeviceAllocation":
            nbytes, shape, dtype = int(len(obj)), [], ""
        else:
            nbytes, shape, dtype = None, [], ""
        return {"kind": kind, "shape": shape, "dtype": dtype, "device": "GPU?", "bytes": nbytes}

    def __init__(self) -> None:
        super().__init__()
        self._last_pools: list[dict] = []

    def _in_use(self) -> bool:
        drv = _module("pycuda.driver")
        if drv is None:
            return False
        tracker = _TRACKER
        tracker.ensure_wrapped()
        if _current_context(drv) is not None:
            return True
        return bool(tracker.pools())

    # -- helpers ------------------------------------------------------------------

    def _index(self, drv: Any, record: _Pool, devices: list[int]) -> Optional[int]:
        if record.index is not None:
            return record.index
        if record.device is None:
            return None
        for i in devices:
            if drv.Device(i) == record.device:
                record.index = i
                return i
        return None

    def _why_kept(self, record: _Pool, current: Any) -> Optional[str]:
        """None when gpucleanup may drain this device pool here and now, else why not."""
        if not record.seen:
            return ("it was made before gpucleanup watched PyCUDA, so gpucleanup cannot tell which thread "
                    "and context own it; call pool.free_held() on the thread that made it")
        if record.thread != threading.get_ident():
            return (f"it was made on thread {record.thread_name!r}, and its blocks can be freed only on the "
                    "thread that owns its context: call pool.free_held() there")
        if not _same_context(current, record):
            return ("its context is not current on this thread now (gpucleanup never makes a context "
                    "current): call pool.free_held() while it is")
        return None

    def _kept_note(self, record: _Pool, where: str, held: Optional[int], blocks: int, why: str) -> str:
        what = f"{_bytes_text(held)} of freed blocks" if held is not None else f"{blocks} freed blocks"
        return self._note("drain", f"{where}{record.label} holds {what}: {why}", 202 if record.seen else 203)

    # -- verbs --------------------------------------------------------------------

    def _stats(self, devices: list[int], result: dict) -> None:
        drv = _driver()
        notes = result["notes"]
        for i in devices:
            result["devices"][i] = _figures()
        current = _current_context(drv)
        pools: list[dict] = []
        unknown = False
        for record, pool in _TRACKER.pools():
            if record.kind != "device":
                continue
            figures = _pool_bytes(pool)
            if figures is None:
                unknown = True
                continue
            live, held = figures
            i = self._index(drv, record, devices)
            why = self._why_kept(record, current)
            pools.append({"pool": record.label, "kind": "device", "device": i, "thread": record.thread_name,
                          "live_bytes": live, "cached_bytes": held, "drained_here": why is None})
            if i is None:
                # not on a given device; or its device is unknown: made before gpucleanup
                # watched (its bytes then show as memory outside every pool), or no device
                # could be read when it was made
                if held and not record.seen:
                    notes.append(self._kept_note(record, "", held, int(pool.held_blocks), why))
                elif held and record.device is None:
                    notes.append(self._note("stats", (
                        f"{record.label} holds {_bytes_text(held)} of freed blocks on a device gpucleanup "
                        "cannot tell"), 204))
                continue
            figures_i = result["devices"][i]
            figures_i["live_bytes"] += live
            figures_i["cached_bytes"] += held
            if why is not None and held:
                notes.append(self._kept_note(record, f"GPU{i}: ", held, int(pool.held_blocks), why))
        if unknown:
            notes.append(self._note("stats", "this PyCUDA does not tell its pools' bytes (managed_bytes, "
                                             "active_bytes)", 205))
        for record, pool in _TRACKER.pools():
            if record.kind == "pinned":
                figures = _pool_bytes(pool)
                if figures is not None:
                    pools.append({"pool": record.label, "kind": "pinned", "device": None,
                                  "thread": record.thread_name, "live_bytes": figures[0],
                                  "cached_bytes": figures[1], "drained_here": True})
        result["pools"] = pools
        with self._state_lock:
            self._last_pools = [dict(p) for p in pools]

    def _drain(self, devices: list[int], result: dict) -> None:
        drv = _driver()
        notes = result["notes"]
        freed = result["freed_bytes"]
        for i in devices:
            freed[i] = 0
        current = _current_context(drv)
        for record, pool in _TRACKER.pools():
            if record.kind != "device":
                continue
            i = self._index(drv, record, devices)
            if i is None:
                continue
            try:
                figures = _pool_bytes(pool)
                held_blocks = int(pool.held_blocks)
                if not held_blocks:
                    continue
                why = self._why_kept(record, current)
                if why is not None:
                    notes.append(self._kept_note(record, f"GPU{i}: ", figures[1] if figures else None,
                                                 held_blocks, why))
                    continue
                pool.free_held()
                after = _pool_bytes(pool)
                if figures is not None and after is not None:
                    freed[i] += max(figures[1] - after[1], 0)
            except Exception as exc:
                notes.append(self._note("drain", f"could not free {record.label} on GPU{i}: {_fault(exc)}"))

    def _pinned_stats(self, notes: list[str]) -> Optional[Figures]:
        live = cached = 0
        for record, pool in _TRACKER.pools():
            if record.kind != "pinned":
                continue
            figures = _pool_bytes(pool)
            if figures is None:
                notes.append(self._note("pinned", (
                    f"{record.label} holds {int(pool.held_blocks)} free blocks; this PyCUDA does not tell "
                    "their size"), 206))
                return None
            live += figures[0]
            cached += figures[1]
        return _figures(live, cached)

    def _drain_pinned(self, result: dict) -> None:
        freed = 0
        known = True
        for record, pool in _TRACKER.pools():
            if record.kind != "pinned":
                continue
            try:
                if not int(pool.held_blocks):
                    continue
                before = _pool_bytes(pool)
                pool.free_held()  # cuMemFreeHost, no context activation (src/wrapper/mempool.cpp)
                after = _pool_bytes(pool)
                if before is not None and after is not None:
                    freed += max(before[1] - after[1], 0)
                else:
                    known = False
            except Exception as exc:
                result["notes"].append(self._note("pinned", f"could not release {record.label}: {_fault(exc)}"))
        result["freed_bytes"] = freed
        if known:
            live = cached = 0
            for record, pool in _TRACKER.pools():
                figures = _pool_bytes(pool) if record.kind == "pinned" else None
                if figures is not None:
                    live, cached = live + figures[0], cached + figures[1]
            self._remember_pinned(_figures(live, cached))

    def _describe(self, devices: dict[int, Figures], pinned: Optional[Figures]) -> str:
        live, cached = self._held(devices)
        with self._state_lock:
            pools = [dict(p) for p in self._last_pools]
        device_pools = [p for p in pools if p["kind"] == "device"]
        kept = [p for p in device_pools if not p["drained_here"] and p["cached_bytes"]]
        text = (f"pycuda holds {_bytes_text(live)} live and {_bytes_text(cached)} cached in "
                f"{len(device_pools)} device memory pool{'s' if len(device_pools) != 1 else ''}")
        if pinned is not None:
            text += f" and {_bytes_text(pinned['cached_bytes'])} cached in its page-locked pools"
        text += "; gpucleanup frees the cached part of the pools made on the kernel's thread after every cell"
        if kept:
            held = sum(p["cached_bytes"] for p in kept)
            names = ", ".join(p["pool"] for p in kept[:3]) + (", ..." if len(kept) > 3 else "")
            text += (f"; {names} keep {_bytes_text(held)}: gpucleanup leaves them to the thread that owns "
                     "their context (pool.free_held() there)")
        return text
