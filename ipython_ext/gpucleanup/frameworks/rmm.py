"""RAPIDS RMM: reported, never released.

An RMM pool gives memory back only when its resource is destroyed (rmm#144, #145,
#724); ``CudaAsyncMemoryResource`` keeps a private driver pool that gpucleanup
cannot reach. The adapter reads each configured device's resource chain:
``PoolMemoryResource.pool_size()`` for what a pool holds, and the current bytes of
a statistics or tracking adaptor for what is live. It never asks RMM for the
current device's resource (that reads the current device and registers a default
resource for it); it lists configured devices through ``get_log_filenames()``.
"""

from __future__ import annotations

from typing import Any, Optional

from .base import Adapter, Figures, _bytes_text, _figures, _fault, _module


def _mr_module() -> Any:
    rmm = _module("rmm")
    return getattr(rmm, "mr", None)


def _configured_devices() -> Optional[list[int]]:
    rmm = _module("rmm")
    names = getattr(rmm, "get_log_filenames", None) or getattr(_mr_module(), "get_log_filenames", None)
    if names is None:
        return None
    return sorted(int(i) for i in names())


def _chain(mr: Any) -> list:
    chain = []
    while mr is not None and len(chain) < 16:
        chain.append(mr)
        upstream = getattr(mr, "get_upstream", None)
        mr = upstream() if callable(upstream) else getattr(mr, "upstream_mr", None)
    return chain


def _figures_of(chain: list) -> tuple[Optional[int], Optional[int], list[str]]:
    """(live bytes or None, pool bytes or None, resource type names) of a resource chain."""
    live = pool = None
    kinds = []
    for mr in chain:
        kind = type(mr).__name__
        kinds.append(kind)
        if live is None and hasattr(mr, "allocation_counts"):
            counts = mr.allocation_counts
            counts = counts() if callable(counts) else counts
            current = getattr(counts, "current_bytes", None)
            if current is None and isinstance(counts, dict):
                current = counts.get("current_bytes")
            if current is not None:
                live = int(current)
        if live is None and callable(getattr(mr, "get_allocated_bytes", None)):
            live = int(mr.get_allocated_bytes())
        if pool is None and callable(getattr(mr, "pool_size", None)):
            pool = int(mr.pool_size())
    return live, pool, kinds


class RmmAdapter(Adapter):
    name = "rmm"
    modules = ("rmm",)
    can_release = False
    packages = ("rmm", "librmm")
    libraries = ("librmm",)
    #: what gives an RMM pool back (said once per kernel on the line)
    reserved_fix = "rmm.reinitialize() destroys the pool; a smaller initial_pool_size takes less"

    def _in_use(self) -> bool:
        rmm = _module("rmm")
        if rmm is None:
            return False
        initialised = getattr(rmm, "is_initialized", None)
        if initialised is None or not initialised():
            return False
        configured = _configured_devices()
        # is_initialized() is True when no device has a resource yet
        return configured is None or bool(configured)

    def _stats(self, devices: list[int], result: dict) -> None:
        configured = _configured_devices()
        mr_module = _mr_module()
        for i in devices:
            result["devices"][i] = _figures()
            if configured is not None and i not in configured:
                continue
            try:
                live, pool, kinds = _figures_of(_chain(mr_module.get_per_device_resource(i)))
            except Exception as exc:
                result["notes"].append(self._note("stats", f"could not read rmm's resource on GPU{i}: {_fault(exc)}"))
                continue
            held = pool if pool is not None else live
            result["devices"][i] = _figures(live or 0, max((held or 0) - (live or 0), 0))
            if pool is not None and live is None:
                result["notes"].append(self._note("stats", (
                    f"GPU{i}: rmm's pool holds {pool} bytes; how much is live needs a "
                    "StatisticsResourceAdaptor (rmm.statistics.enable_statistics())"), 201))
            if "CudaAsyncMemoryResource" in kinds:
                result["notes"].append(self._note("stats", (
                    f"GPU{i}: rmm's CudaAsyncMemoryResource keeps a private driver pool "
                    "gpucleanup can neither see nor trim"), 202))

    def _describe(self, devices: dict[int, Figures], pinned: Optional[Figures]) -> str:
        live, cached = self._held(devices)
        return (f"rmm holds {_bytes_text(live + cached)} ({_bytes_text(live)} live); RMM pools give memory "
                "back only when their resource is destroyed (rmm.reinitialize()), so gpucleanup leaves them")
