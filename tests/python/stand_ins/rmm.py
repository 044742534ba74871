"""Stand-in for RMM: per-device resources, a pool and a statistics adaptor."""

from __future__ import annotations

from .world import World, install, module


class CudaMemoryResource:
    pass


class PoolMemoryResource:
    def __init__(self, upstream, size):
        self._upstream, self._size = upstream, size

    def get_upstream(self):
        return self._upstream

    def pool_size(self):
        return self._size


class StatisticsResourceAdaptor:
    def __init__(self, upstream, current):
        self._upstream, self._current = upstream, current

    def get_upstream(self):
        return self._upstream

    @property
    def allocation_counts(self):
        return {"current_bytes": self._current, "peak_bytes": self._current}


class CudaAsyncMemoryResource:
    pass


def install_rmm(monkeypatch, world: World, resources=None):
    """resources: {device: resource} configured by rmm.reinitialize / set_per_device_resource."""
    resources = dict(resources or {})

    def get_per_device_resource(i):
        world.calls.append(("get_per_device_resource", i))
        if i not in resources:
            world.violations.append(f"rmm registered a default resource for device {i}")
            resources[i] = CudaMemoryResource()
        return resources[i]

    def get_current_device_resource():  # pragma: no cover - must never be called
        world.violations.append("rmm.mr.get_current_device_resource")
        raise AssertionError

    mr = module("rmm.mr", get_per_device_resource=get_per_device_resource,
                get_current_device_resource=get_current_device_resource)
    rmm = module("rmm", mr=mr, is_initialized=lambda: all(True for _ in resources.values()),
                 get_log_filenames=lambda: {i: None for i in resources})
    install(monkeypatch, {"rmm": rmm, "rmm.mr": mr})
    return resources
