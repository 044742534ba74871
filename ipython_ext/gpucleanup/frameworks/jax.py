"""JAX: reported, released only where JAX itself frees.

JAX's default BFC allocator takes 75% of each GPU at the first operation and never
returns it; only ``XLA_PYTHON_CLIENT_ALLOCATOR=platform`` frees memory as arrays
die (JAX's "GPU memory allocation" docs; jax#13330 is the open request for a way to
empty the cache). So the adapter reports what JAX holds and says why it stays.
Devices are listed only once JAX's backends exist (listing them creates them).
"""

from __future__ import annotations

import os
from typing import Any, Optional

from .base import Adapter, Figures, _bytes_text, _figures, _fault, _module, _object

_GPU_PLATFORMS = ("gpu", "cuda", "rocm")


def _bridge() -> Any:
    return _module("jax._src.xla_bridge")


def _backends_ready(bridge: Any) -> bool:
    ready = getattr(bridge, "backends_are_initialized", None)
    if ready is not None:
        return bool(ready())
    return bool(getattr(bridge, "_backends", None))


def _gpu_devices(bridge: Any) -> list:
    found = []
    for name, client in dict(bridge.backends()).items():
        if name in _GPU_PLATFORMS or getattr(client, "platform", None) in _GPU_PLATFORMS:
            found.extend(client.local_devices())
    return found


def _platform_allocator() -> bool:
    return os.environ.get("XLA_PYTHON_CLIENT_ALLOCATOR", "").strip().lower() == "platform"


class JaxAdapter(Adapter):
    name = "jax"
    modules = ("jax",)
    packages = ("jaxlib", "jax_plugins", "jax_cuda*")
    libraries = ("xla_extension", "pjrt")
    oom_texts = ("resource_exhausted",)  # XLA's status for an allocation that failed
    object_modules = ("jax", "jaxlib")

    def object_kind(self, tp: type) -> Optional[str]:
        array = getattr(_module("jax"), "Array", None)
        return "jax.Array" if isinstance(array, type) and issubclass(tp, array) else None

    def object_info(self, obj: Any, kind: str) -> Optional[dict]:
        devs = list(obj.devices())
        if not devs or getattr(devs[0], "platform", "") not in ("gpu", "cuda"):
            return None
        device = ",".join(str(getattr(d, "id", "?")) for d in devs)
        return _object(kind, obj, device, int(obj.nbytes), str(obj.dtype))

    @property
    def can_release(self) -> bool:  # type: ignore[override]
        return _platform_allocator()

    @property
    def reserved_fix(self) -> Optional[str]:  # type: ignore[override]
        """What to set so that JAX does not keep the device (said once per kernel on the line)."""
        if _platform_allocator():
            return None
        return ("XLA_PYTHON_CLIENT_PREALLOCATE=false before import, or XLA_PYTHON_CLIENT_ALLOCATOR=platform to "
                "free as arrays die; XLA_PYTHON_CLIENT_MEM_FRACTION caps it")

    def _in_use(self) -> bool:
        bridge = _bridge()
        if _module("jax") is None or bridge is None or not _backends_ready(bridge):
            return False
        return bool(_gpu_devices(bridge))

    def _stats(self, devices: list[int], result: dict) -> None:
        for device in _gpu_devices(_bridge()):
            # local_hardware_id is the CUDA ordinal (what the driver probe counts)
            hardware_id = getattr(device, "local_hardware_id", None)
            index = int(hardware_id if hardware_id is not None else device.id)
            if index not in devices:
                continue
            try:
                stats = device.memory_stats() or {}
            except Exception as exc:
                result["notes"].append(self._note("stats", f"could not read jax's memory on GPU{index}: {_fault(exc)}"))
                continue
            live = int(stats.get("bytes_in_use", 0))
            # pool_bytes: what the BFC allocator took from the device (75% when it preallocates)
            pool = int(stats.get("pool_bytes", stats.get("bytes_reserved", 0)) or 0)
            result["devices"][index] = _figures(live, max(pool - live, 0))
        for i in devices:
            result["devices"].setdefault(i, _figures())

    def _drain(self, devices: list[int], result: dict) -> None:
        # Nothing to call: the BFC allocator has no release, and the platform
        # allocator frees as arrays die.
        result["freed_bytes"] = {i: 0 for i in devices}

    def _describe(self, devices: dict[int, Figures], pinned: Optional[Figures]) -> str:
        live, cached = self._held(devices)
        if _platform_allocator():
            return (f"jax holds {_bytes_text(live)} in arrays; its platform allocator frees memory "
                    "as soon as arrays are deleted")
        return (f"jax holds {_bytes_text(live + cached)} in its BFC allocator ({_bytes_text(live)} in arrays); "
                "JAX cannot give it back: set XLA_PYTHON_CLIENT_ALLOCATOR=platform before JAX starts, "
                "or delete arrays to make room inside JAX")
