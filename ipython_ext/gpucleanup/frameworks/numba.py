"""Numba-CUDA: the queue of deferred frees of each primary context Numba holds.

Numba queues frees and flushes them only after 10 of them, 20% of the device, or
an out-of-memory error; a notebook that deletes a few large arrays keeps them
all. The adapter never calls ``numba.cuda.current_context()`` (it creates and
pushes a context on device 0): it walks Numba's device list, only once Numba has
built it, and uses ``gpu.primary_context`` only where Numba already holds one.
"""

from __future__ import annotations

from typing import Any, Iterator, Optional

from .base import Adapter, Figures, _bytes_text, _figures, _fault, _module, _object

_DEVICES_MODULES = ("numba.cuda.cudadrv.devices", "numba_cuda.numba.cuda.cudadrv.devices")


def _device_list() -> Optional[list]:
    """Numba's devices if Numba has already listed them (listing would call the driver)."""
    for name in _DEVICES_MODULES:
        devices_mod = _module(name)
        runtime = getattr(devices_mod, "_runtime", None)
        gpus = getattr(runtime, "gpus", None)
        if gpus is None:
            continue
        if "lst" in vars(gpus):  # numba < 0.60: a plain attribute once built
            return list(vars(gpus)["lst"])
        prop = vars(type(gpus)).get("lst")
        cache_info = getattr(getattr(prop, "fget", None), "cache_info", None)
        if cache_info is not None and cache_info().currsize > 0:
            return list(gpus.lst)  # cached: no driver call
        return None
    return None


def _contexts(devices: Optional[list[int]] = None) -> Iterator[tuple[int, Any]]:
    for gpu in _device_list() or ():
        ctx = getattr(gpu, "primary_context", None)
        index = int(getattr(gpu, "id", -1))
        if ctx is None or (devices is not None and index not in devices):
            continue
        yield index, ctx


def _queues(ctx: Any) -> list:
    """The pending-free queues of a context: its memory manager's (device and host
    memory) and its own (streams, events, modules)."""
    queues = []
    manager = getattr(ctx, "memory_manager", None)
    for owner in (manager, ctx):
        queue = getattr(owner, "deallocations", None)
        if queue is not None and all(q is not queue for q in queues):
            queues.append(queue)
    return queues


def _live_bytes(ctx: Any) -> int:
    manager = getattr(ctx, "memory_manager", None)
    allocations = getattr(manager, "allocations", None)
    if allocations is None:
        return 0
    return sum(int(getattr(m, "size", 0)) for m in list(allocations.values())
               if type(m).__name__ != "MappedMemory")


class NumbaAdapter(Adapter):
    name = "numba"
    modules = _DEVICES_MODULES
    can_release = True
    object_modules = ("numba", "numba_cuda")

    def object_kind(self, tp: type) -> Optional[str]:
        return "numba.DeviceNDArray" if getattr(tp, "__name__", "") in ("DeviceNDArray", "DeviceRecord") else None

    def object_info(self, obj: Any, kind: str) -> Optional[dict]:
        # Numba's arrays tell no device without a context of theirs: shown as GPU?
        return _object(kind, obj, None, int(getattr(obj, "nbytes", 0) or 0), str(getattr(obj, "dtype", "")))

    def _in_use(self) -> bool:
        return any(True for _ in _contexts())

    def _stats(self, devices: list[int], result: dict) -> None:
        for i in devices:
            result["devices"][i] = _figures()
        for i, ctx in _contexts(devices):
            try:
                queues = _queues(ctx)
                pending = sum(int(getattr(q, "_size", 0)) for q in queues)
                count = sum(len(q) for q in queues)
                result["devices"][i] = _figures(_live_bytes(ctx), pending)
                if count:
                    result["notes"].append(self._note("stats", (
                        f"GPU{i}: numba has {count} frees pending ({pending} bytes of memory)"), 201))
            except Exception as exc:
                result["notes"].append(self._note("stats", f"could not read numba's queue on GPU{i}: {_fault(exc)}"))

    def _drain(self, devices: list[int], result: dict) -> None:
        for i, ctx in _contexts(devices):
            try:
                queues = _queues(ctx)
                pending = sum(int(getattr(q, "_size", 0)) for q in queues)
                if not any(len(q) for q in queues):
                    result["freed_bytes"][i] = 0
                    continue
                if any(getattr(q, "is_disabled", False) for q in queues):
                    result["notes"].append(self._note("drain", (
                        f"GPU{i}: numba's frees are deferred (defer_cleanup is active); left queued"), 202))
                ctx.push()
                try:
                    for q in queues:
                        q.clear()
                finally:
                    ctx.pop()
                left = sum(int(getattr(q, "_size", 0)) for q in queues)
                result["freed_bytes"][i] = max(pending - left, 0)
            except Exception as exc:
                result["notes"].append(self._note("drain", f"could not flush numba's queue on GPU{i}: {_fault(exc)}"))

    def _describe(self, devices: dict[int, Figures], pinned: Optional[Figures]) -> str:
        live, pending = self._held(devices)
        return (f"numba holds {_bytes_text(live)} in device arrays and {_bytes_text(pending)} waiting in its "
                "queue of deferred frees; gpucleanup flushes the queue after every cell")
