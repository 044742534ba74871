"""GPU arrays and tensors in the user's namespace: CuPy, PyTorch, Numba, JAX, PyCUDA.

Objects are recognised by type name and module, and only through frameworks that
are already in ``sys.modules``: nothing here imports a framework or initialises
CUDA. Types are checked with ``type()``, never ``isinstance()`` on the object, which
asks the object's own ``__class__`` (user code can make that raise).

PyCUDA's objects tell no device (finding it would take a driver call per object): they show
as ``GPU?``. A ``pycuda.driver.DeviceAllocation`` (``mem_alloc``) does not tell its size in
Python either: its bytes are None (shown as ``?``); a ``PooledDeviceAllocation`` does
(``len()``), and a ``GPUArray`` has ``nbytes``.
"""

from __future__ import annotations

import re
import sys
import types
import weakref
from typing import Any, Dict, Iterable, List, Optional

__all__ = ["gpu_object_info", "find_gpu_objects", "gpu_holder_names"]

_kind_cache: "weakref.WeakKeyDictionary[type, Optional[str]]" = weakref.WeakKeyDictionary()


def _kind_of_type(tp: type) -> Optional[str]:
    try:
        return _kind_cache[tp]
    except (KeyError, TypeError):
        pass
    try:
        kind = _classify(tp)
    except Exception:  # a user type with an odd metaclass is simply not a GPU array
        kind = None
    try:
        _kind_cache[tp] = kind
    except TypeError:
        pass
    return kind


# PyCUDA 2026.1: pycuda.gpuarray.GPUArray; pycuda._driver.DeviceAllocation (mem_alloc) and
# PooledDeviceAllocation (DeviceMemoryPool.allocate), Boost.Python classes
_PYCUDA_KINDS = {
    "GPUArray": "pycuda.GPUArray",
    "DeviceAllocation": "pycuda.DeviceAllocation",
    "PooledDeviceAllocation": "pycuda.PooledDeviceAllocation",
}


def _classify(tp: type) -> Optional[str]:
    kind = None
    module = getattr(tp, "__module__", "") or ""
    name = getattr(tp, "__name__", "")
    root = module.split(".", 1)[0]
    if root == "cupy" and name == "ndarray":
        kind = "cupy.ndarray"
    elif root == "torch":
        torch = sys.modules.get("torch")
        tensor = getattr(torch, "Tensor", None)
        if isinstance(tensor, type) and issubclass(tp, tensor):
            kind = "torch.Tensor"
    elif root in ("numba", "numba_cuda") and name in ("DeviceNDArray", "DeviceRecord"):
        kind = "numba.DeviceNDArray"
    elif root == "pycuda" and name in _PYCUDA_KINDS:
        kind = _PYCUDA_KINDS[name]
    elif root in ("jax", "jaxlib") and "jax" in sys.modules:
        array = getattr(sys.modules["jax"], "Array", None)
        try:
            if isinstance(array, type) and issubclass(tp, array):
                kind = "jax.Array"
        except TypeError:
            pass
    # torch.Tensor subclasses defined by users live in other modules
    if kind is None and root not in ("builtins", "numpy") and "torch" in sys.modules:
        tensor = getattr(sys.modules["torch"], "Tensor", None)
        try:
            if isinstance(tensor, type) and issubclass(tp, tensor):
                kind = "torch.Tensor"
        except TypeError:
            pass
    return kind


def gpu_object_info(obj: Any) -> Optional[dict]:
    """``{"kind", "shape", "dtype", "device", "bytes"}`` for a GPU array or tensor, else None."""
    kind = _kind_of_type(type(obj))
    if kind is None:
        return None
    try:
        if kind == "torch.Tensor":
            if not getattr(obj, "is_cuda", False):
                return None
            device = getattr(obj.device, "index", None)
            nbytes = int(obj.element_size()) * int(obj.nelement())
            dtype = str(obj.dtype).replace("torch.", "")
        elif kind == "jax.Array":
            devs = list(obj.devices())
            if not devs or getattr(devs[0], "platform", "") not in ("gpu", "cuda"):
                return None
            device = ",".join(str(getattr(d, "id", "?")) for d in devs)
            nbytes = int(obj.nbytes)
            dtype = str(obj.dtype)
        elif kind.startswith("pycuda."):
            return _pycuda_info(obj, kind)
        elif kind == "cupy.ndarray":
            device = getattr(getattr(obj, "device", None), "id", None)
            nbytes = int(obj.nbytes)
            dtype = str(obj.dtype)
        else:
            device = None
            nbytes = int(getattr(obj, "nbytes", 0) or 0)
            dtype = str(getattr(obj, "dtype", ""))
        shape = tuple(int(s) for s in getattr(obj, "shape", ()) or ())
    except Exception:
        return None
    return {
        "kind": kind,
        "shape": list(shape),
        "dtype": dtype,
        "device": f"GPU{device}" if device is not None else "GPU?",
        "bytes": nbytes,
    }


def _pycuda_info(obj: Any, kind: str) -> Optional[dict]:
    nbytes: Optional[int]
    if kind == "pycuda.GPUArray":
        nbytes = int(obj.nbytes)
        shape = [int(s) for s in getattr(obj, "shape", ()) or ()]
        dtype = str(obj.dtype)
    elif kind == "pycuda.PooledDeviceAllocation":
        nbytes, shape, dtype = int(len(obj)), [], ""
    else:  # DeviceAllocation: PyCUDA does not tell its size
        nbytes, shape, dtype = None, [], ""
    return {"kind": kind, "shape": shape, "dtype": dtype, "device": "GPU?", "bytes": nbytes}


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


def _children(obj: Any, path: str) -> Iterable[tuple]:
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
            if key in ("_parameters", "_buffers", "_modules") and isinstance(value, dict):
                # torch.nn.Module keeps its members in these dicts: name them as attributes
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
                nxt.extend(_children(obj, path))
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
