"""GPU arrays and tensors in the user's namespace, of every registered framework.

This module walks the namespace and asks each adapter which types are GPU objects and how to describe one
(``object_modules``, ``object_kind``, ``object_info`` in ``frameworks/base.py``). It sees only frameworks already
in ``sys.modules``: nothing here imports a framework or initialises CUDA.
"""

from __future__ import annotations

import re
import types
import weakref
from typing import Any, Dict, Iterable, List, Optional, Tuple

__all__ = ["gpu_object_info", "find_gpu_objects", "gpu_holder_names"]

#: per type: its kind and the adapter that describes it, or None (not a GPU object)
_kind_cache: "weakref.WeakKeyDictionary[type, Optional[Tuple[str, Any]]]" = weakref.WeakKeyDictionary()

#: module roots whose types are never a subclass of a framework's GPU object
_PLAIN_ROOTS = ("builtins", "numpy")


def _adapters() -> tuple:
    # The registry, read when asked: the package's face imports the adapters, and an adapter may import this.
    from . import ADAPTERS

    return ADAPTERS


def _kind_of_type(tp: type) -> Optional[Tuple[str, Any]]:
    try:
        return _kind_cache[tp]
    except (KeyError, TypeError):
        pass
    try:
        found = _classify(tp)
    except Exception:  # a user type with an odd metaclass is simply not a GPU array
        found = None
    try:
        _kind_cache[tp] = found
    except TypeError:
        pass
    return found


def _classify(tp: type) -> Optional[Tuple[str, Any]]:
    """``(kind, adapter)``: first the adapters whose modules define ``tp``, then those whose object type
    users subclass in modules of their own."""
    root = (getattr(tp, "__module__", "") or "").split(".", 1)[0]
    adapters = _adapters()
    for adapter in adapters:
        if root in adapter.object_modules:
            kind = _asked(adapter, tp)
            if kind is not None:
                return kind, adapter
    if root in _PLAIN_ROOTS:
        return None
    for adapter in adapters:
        if adapter.objects_subclassed and root not in adapter.object_modules:
            kind = _asked(adapter, tp)
            if kind is not None:
                return kind, adapter
    return None


def _asked(adapter: Any, tp: type) -> Optional[str]:
    try:
        return adapter.object_kind(tp)
    except Exception:  # e.g. issubclass on a type with an odd metaclass: not this framework's
        return None


def gpu_object_info(obj: Any) -> Optional[dict]:
    """``{"kind", "shape", "dtype", "device", "bytes"}`` for a GPU array or tensor, else None.

    The type is read with ``type()``, never ``isinstance()`` on the object, which asks the object's own
    ``__class__`` (user code can make that raise). PyCUDA's objects tell no device (finding it would take a driver
    call per object): they show as ``GPU?``. A ``pycuda.driver.DeviceAllocation`` (``mem_alloc``) does not tell its
    size in Python either: its bytes are None (shown as ``?``); a ``PooledDeviceAllocation`` does (``len()``), and a
    ``GPUArray`` has ``nbytes``.
    """
    found = _kind_of_type(type(obj))
    if found is None:
        return None
    kind, adapter = found
    try:
        return adapter.object_info(obj, kind)
    except Exception:
        return None


_IPYTHON_NAMES = {"_", "__", "___", "_i", "_ii", "_iii", "In", "Out", "_ih", "_oh", "_dh", "exit", "quit", "get_ipython"}
_SKIP_TYPES = (
    types.ModuleType,
    type,
    types.FunctionType,
    types.BuiltinFunctionType,
    types.MethodType,
    str,
    bytes,
    bytearray,
    int,
    float,
    complex,
    bool,
    type(None),
)


def _skipped(obj: Any) -> bool:
    # type(), not isinstance(): isinstance also asks obj.__class__, which user code can make raise
    return issubclass(type(obj), _SKIP_TYPES)


def _is_history_name(name: str) -> bool:
    if name in _IPYTHON_NAMES:
        return True
    if name.startswith("_i") and name[2:].isdigit():
        return True
    return name.startswith("_") and name[1:].isdigit()


def _member_dicts() -> frozenset:
    """The attributes through which an object keeps its members in dicts, of every framework."""
    return frozenset(name for adapter in _adapters() for name in adapter.member_dicts)


def _children(obj: Any, path: str, members: frozenset = frozenset()) -> Iterable[tuple]:
    tp = type(obj)
    if issubclass(tp, dict):
        for key, value in list(obj.items())[:1000]:
            yield f"{path}[{key!r}]", value
    elif issubclass(tp, (list, tuple)):
        for i, value in enumerate(obj[:1000]):
            yield f"{path}[{i}]", value
    elif issubclass(tp, (set, frozenset)):
        for value in list(obj)[:1000]:
            yield f"{path}{{…}}", value
    else:
        attrs = getattr(obj, "__dict__", None)
        if type(attrs) is not dict:
            return
        for key, value in list(attrs.items())[:1000]:
            if key in members and isinstance(value, dict):
                # a framework's object keeps its members in these dicts (torch.nn.Module): named as attributes
                for sub, subvalue in value.items():
                    yield f"{path}.{sub}", subvalue
            else:
                yield f"{path}.{key}", value


def find_gpu_objects(user_ns: dict, out_cache: Optional[dict] = None, max_depth: int = 6, max_visits: int = 50_000) -> List[dict]:
    """GPU arrays and tensors reachable from ``user_ns`` (breadth first, shortest name wins).

    Each entry is ``gpu_object_info`` plus ``"name"`` (``x``, ``model.fc.weight``,
    ``d['k'][0]``, ``Out[3]``). The walk goes into dicts, lists, tuples, sets and
    object attributes, at most ``max_depth`` levels and ``max_visits`` objects.
    """
    frontier = []
    for name, value in list(user_ns.items()):
        if not _is_history_name(name) and not name.startswith("__"):
            frontier.append((name, value))
    for key, value in list((out_cache or {}).items()):
        frontier.append((f"Out[{key}]", value))
    seen = set()
    found: List[dict] = []
    visits = 0
    members = _member_dicts()
    for _depth in range(max_depth + 1):
        nxt = []
        for path, obj in frontier:
            if visits >= max_visits:
                return found
            oid = id(obj)
            if oid in seen:
                continue
            seen.add(oid)
            visits += 1
            if _skipped(obj):
                continue
            info = gpu_object_info(obj)
            if info is not None:
                info["name"] = path
                found.append(info)
                continue
            try:
                nxt.extend(_children(obj, path, members))
            except Exception:  # an object whose attributes or items raise is not walked into
                continue
        frontier = nxt
        if not frontier:
            break
    return found


_TOP_NAME = re.compile(r"[^.\[{]+")


def gpu_holder_names(user_ns: dict, max_visits: int = 50_000) -> Dict[str, int]:
    """``{name: id(value)}`` of the top-level names through which a GPU array or tensor is
    reachable (``x``, ``model`` for ``model.fc.weight``, ``d`` for ``d['k'][0]``).

    Bounded like ``find_gpu_objects`` (depth and objects visited). The extension keeps
    this to tell, without walking the namespace again, that a cell unbound a name that
    held GPU memory (``del model``).
    """
    holders: Dict[str, int] = {}
    for found in find_gpu_objects(user_ns, max_visits=max_visits):
        match = _TOP_NAME.match(found["name"])
        if match is None:
            continue
        top = match.group(0)
        if top in user_ns:
            holders[top] = id(user_ns[top])
    return holders
