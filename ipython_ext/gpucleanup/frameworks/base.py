"""The base of every framework adapter: :class:`Adapter`, whose docstring is the contract every adapter keeps.

A new framework is its adapter module and one line in ``ADAPTERS`` (``frameworks/__init__.py``); adapters import
this module, never the package's face.
"""

from __future__ import annotations

import sys
import threading
from typing import Any, Callable, Iterable, Optional

from ..units import format_bytes as _bytes_text  # noqa: F401  (the adapters' byte formatter)

__all__ = ["Adapter", "Stats", "Figures"]

Stats = dict
Figures = dict


def _figures(live: int = 0, cached: int = 0) -> Figures:
    return {"live_bytes": int(live), "cached_bytes": int(cached)}


def _device_list(devices: Iterable[Any]) -> list[int]:
    seen: list[int] = []
    for d in devices or ():
        try:
            i = int(d)
        except (TypeError, ValueError):
            continue
        if i >= 0 and i not in seen:
            seen.append(i)
    return seen


def _fault(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class Adapter:
    """Base of every adapter: the guards, the notes and the pinned-release lock.

    Subclasses implement ``_in_use``, ``_stats``, ``_drain``, ``_pinned_stats``,
    ``_drain_pinned`` and ``_describe``; the public verbs wrap them so that a
    framework fault becomes a note and never reaches the caller.

    The extension calls these only after the native probe reports the CUDA driver as
    initialised (``driver.state == "ready"``), and passes the indices of the devices
    whose primary context is already active. Every adapter keeps to these rules:

    - it never imports a framework: it acts only on modules already in ``sys.modules``;
    - it never initialises CUDA nor creates a context: it switches only to the devices
      it is given, and puts the calling thread's current device (and context) back;
    - it raises nothing for a fault of the framework: each verb returns notes instead.
      Notes start with a stable id, ``[gpucleanup.<adapter>.<number>]``.

    Verbs (the same on every adapter)::

        in_use()              -> bool
        stats(devices)        -> {"devices": {idx: {"live_bytes", "cached_bytes"}},
                                  "pinned": {"live_bytes", "cached_bytes"} | None, "notes": [str]}
        drain(devices)        -> {"freed_bytes": {idx: int}, "notes": [str]}
        drain_pinned()        -> {"freed_bytes": int, "notes": [str]}
        describe()            -> str
        quiet_token(devices, in_use=False)  -> tuple | None

    ``quiet_token`` is optional and cheap: a value that differs whenever ``stats(devices)``
    could answer otherwise (None: the adapter cannot tell without reading its figures). An
    idle cell compares it with the one read just before the last figures, and reads the
    figures again only when it differs; it passes ``in_use=True`` (the framework was found in
    use and nothing was imported since), so the adapter does not ask again. CuPy and PyTorch
    have one.

    An adapter whose device caches only the kernel's thread can empty sets ``drains_on_cell_thread``
    (PyCUDA): the engine then empties them as each cell ends, never on a release's thread.

    ``live_bytes`` is what the framework's objects hold, ``cached_bytes`` what it keeps
    for reuse (for frameworks that cannot release, what they hold beyond live objects).
    ``drain_pinned`` may take about 130 ms per GiB; it may run on another thread while
    ``stats`` runs: ``stats`` never waits for it and reports the figures read before
    that release began.

    ``install()`` / ``uninstall()`` (the extension's load and unload) put in place and remove
    what an adapter needs to see objects as they are made: PyCUDA keeps no registry of its
    memory pools, so :mod:`.pycuda` watches their making from PyCUDA's import on.

    What the rest of gpucleanup knows of a framework is in the class attributes and methods below: ``packages`` and
    ``libraries`` (the trace), ``oom_types`` and ``oom_texts`` (the hidden holders), ``object_modules``,
    ``object_kind`` and ``object_info`` (its GPU objects) and ``name`` (the configuration).
    """

    name: str = ""
    #: modules of which one must be imported for the framework to be in use (empty: always asked);
    #: ``active()`` asks ``in_use`` only then, so a framework never imported costs a dict lookup a cell
    modules: tuple[str, ...] = ()
    #: False: the framework's pool never gives memory back (its cache is "reserved", not "cached")
    can_release: bool = True
    #: for a pool that never gives memory back: what the user can set so that it does, or takes less
    reserved_fix: Optional[str] = None
    #: True: its device caches can be emptied only on the thread that made them (the kernel's), so they are
    #: never left to a release on a thread of its own: emptied as the cell ends whatever ``release`` says
    drains_on_cell_thread: bool = False
    #: number prefix of this adapter's fault notes (stats, drain, pinned)
    _fault_ids = {"stats": 101, "drain": 102, "pinned": 103}

    # What the rest of gpucleanup knows of the framework, read from the registered adapters (the trace,
    # the GPU objects of %gpumem --vars, the hidden holders, the out-of-memory test, the config's help):
    # a new framework is its adapter module and one line in the registry. Each is data or a read of a
    # type or object the user already made; none imports the framework.

    #: folders under site-packages whose shared objects allocate for its pool, so the trace does not count
    #: their driver allocations as raw; a trailing ``*`` matches every folder that starts so (``jax_cuda*``)
    packages: tuple[str, ...] = ()
    #: pieces of the file names of its allocator's shared objects, wherever they are installed (``libtorch``)
    libraries: tuple[str, ...] = ()
    #: type names of its out-of-memory exceptions, and pieces (lower case) of the messages of its others;
    #: CUDA's own names for it are known without any framework
    oom_types: tuple[str, ...] = ()
    oom_texts: tuple[str, ...] = ()
    #: roots of the modules that define its GPU array or tensor types: only their types are given to
    #: ``object_kind`` (and every type when ``objects_subclassed``)
    object_modules: tuple[str, ...] = ()
    #: True: users subclass its GPU object type in modules of their own (``torch.Tensor``), so a type of
    #: any module but Python's and NumPy's is given to ``object_kind`` when no other adapter claimed it
    objects_subclassed: bool = False
    #: attributes that hold a dict of an object's members, named by the namespace walk as attributes
    #: (``model.fc.weight`` rather than ``model._modules['fc']``)
    member_dicts: tuple[str, ...] = ()

    def object_kind(self, tp: type) -> Optional[str]:
        """The kind of GPU object that type ``tp`` makes (``"cupy.ndarray"``), else None. Asked once per type
        (the answer is kept); reads ``sys.modules`` only, and may raise (then: not a GPU object)."""
        return None

    def object_info(self, obj: Any, kind: str) -> Optional[dict]:
        """``{"kind", "shape", "dtype", "device", "bytes"}`` of ``obj``, one of its objects of ``kind``; None when
        it is not on a GPU. May raise (then: not a GPU object)."""
        return None

    def __init__(self) -> None:
        self._pinned_lock = threading.Lock()
        self._releasing = False
        self._state_lock = threading.Lock()
        self._last_devices: dict[int, Figures] = {}
        self._last_pinned: Optional[Figures] = None

    # -- public verbs ---------------------------------------------------------

    def in_use(self) -> bool:
        """True when the framework is imported and already uses CUDA in this process."""
        try:
            return bool(self._in_use())
        except Exception:
            return False

    def stats(self, devices: list[int]) -> Stats:
        devices = _device_list(devices)
        result: Stats = {"devices": {}, "pinned": None, "notes": []}
        if not self.in_use():
            result["devices"] = {i: _figures() for i in devices}
            return result
        try:
            self._stats(devices, result)
        except Exception as exc:
            result["notes"].append(self._note("stats", f"could not read {self.name}'s memory: {_fault(exc)}"))
        # Never wait for a pinned release running on another thread: report what
        # was read before it began. The lock is only ever held for a quick read.
        with self._pinned_lock:
            if self._releasing:
                with self._state_lock:
                    result["pinned"] = None if self._last_pinned is None else dict(self._last_pinned)
                result["notes"].append(self._note(
                    "pinned", f"{self.name}'s pinned pool is being released: figures from before the release", 104))
            else:
                try:
                    pinned = self._pinned_stats(result["notes"])
                    with self._state_lock:
                        self._last_pinned = pinned  # describe() copies what it reads
                    result["pinned"] = pinned
                except Exception as exc:
                    result["notes"].append(
                        self._note("pinned", f"could not read {self.name}'s pinned pool: {_fault(exc)}")
                    )
        # Kept as read, not copied (this runs on every cell): the figures are made afresh by each read, the
        # engine only reads them, and describe() copies them under the lock.
        with self._state_lock:
            self._last_devices = result["devices"]
        return result

    def drain(self, devices: list[int]) -> dict:
        devices = _device_list(devices)
        result: dict = {"freed_bytes": {}, "notes": []}
        if not self.in_use():
            result["freed_bytes"] = {i: 0 for i in devices}
            return result
        try:
            self._drain(devices, result)
        except Exception as exc:
            result["notes"].append(self._note("drain", f"could not free {self.name}'s cache: {_fault(exc)}"))
        for i in devices:
            result["freed_bytes"].setdefault(i, 0)
        return result

    def drain_pinned(self) -> dict:
        result: dict = {"freed_bytes": 0, "notes": []}
        if not self.in_use():
            return result
        with self._pinned_lock:
            if self._releasing:
                result["notes"].append(self._note(
                    "pinned", f"{self.name}'s pinned pool is already being released", 105))
                return result
            self._releasing = True
        try:
            self._drain_pinned(result)
        except Exception as exc:
            result["notes"].append(self._note(
                "pinned", f"could not release {self.name}'s pinned pool: {_fault(exc)}"))
        finally:
            with self._pinned_lock:
                self._releasing = False
        return result

    def quiet_token(self, devices: list[int], in_use: bool = False) -> Optional[tuple]:
        """A cheap value that differs whenever ``stats(devices)`` could answer otherwise: read just before
        the figures, it tells an idle cell that they still stand. None: the adapter cannot tell without
        reading them (the default), or a fault of the framework (the figures then say what is wrong).
        ``in_use``: the caller found the framework in use in this process and nothing was imported since
        (an idle cell's frameworks, ``CellPass._adapters_in_use``), so it is not asked again: a framework
        stays in use once it is (its CUDA state is not torn down), and a token read that fails is None."""
        read = self._quiet_token
        if read is None:  # most adapters: not even asked whether the framework is in use (an idle cell's cost)
            return None
        try:
            return read(devices) if in_use or self.in_use() else None
        except Exception:
            return None

    def describe(self) -> str:
        """One line for users: what the framework holds (as of the last stats) and what can be released."""
        if not self.in_use():
            return f"{self.name} is not in use in this kernel"
        try:
            with self._state_lock:
                devices = {i: dict(f) for i, f in self._last_devices.items()}
                pinned = None if self._last_pinned is None else dict(self._last_pinned)
            return self._describe(devices, pinned)
        except Exception as exc:  # pragma: no cover - describe must never fail
            return f"{self.name}: {_fault(exc)}"

    # -- for subclasses ----------------------------------------------------------

    def _note(self, kind: str, text: str, number: Optional[int] = None) -> str:
        return f"[gpucleanup.{self.name}.{number or self._fault_ids[kind]}] {text}"

    def _remember_pinned(self, pinned: Optional[Figures]) -> None:
        with self._state_lock:
            self._last_pinned = None if pinned is None else dict(pinned)

    def _in_use(self) -> bool:
        raise NotImplementedError

    def _stats(self, devices: list[int], result: Stats) -> None:
        raise NotImplementedError

    def _drain(self, devices: list[int], result: dict) -> None:
        result["freed_bytes"] = {i: 0 for i in devices}

    #: an adapter with a quiet token defines ``_quiet_token(self, devices) -> Optional[tuple]``
    _quiet_token: Optional[Callable[[list[int]], Optional[tuple]]] = None

    def _pinned_stats(self, notes: list[str]) -> Optional[Figures]:
        return None

    def _drain_pinned(self, result: dict) -> None:
        return None

    def _describe(self, devices: dict[int, Figures], pinned: Optional[Figures]) -> str:
        raise NotImplementedError

    # shared wording
    @staticmethod
    def _held(devices: dict[int, Figures]) -> tuple[int, int]:
        live = sum(f["live_bytes"] for f in devices.values())
        cached = sum(f["cached_bytes"] for f in devices.values())
        return live, cached


def _object(kind: str, obj: Any, device: Any, nbytes: Optional[int], dtype: str) -> dict:
    """One GPU object as ``gpu_object_info`` tells it: its shape read from ``obj``, ``device`` an index
    (or indices joined with commas) shown as ``GPU0``, None shown as ``GPU?``."""
    shape = [int(s) for s in getattr(obj, "shape", ()) or ()]
    return {
        "kind": kind,
        "shape": shape,
        "dtype": dtype,
        "device": f"GPU{device}" if device is not None else "GPU?",
        "bytes": nbytes,
    }


def _module(name: str) -> Any:
    """The module if something already imported it, else None (never imports)."""
    return sys.modules.get(name)
