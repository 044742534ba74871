"""Stand-in for JAX: the backends (created or not) and device.memory_stats()."""

from __future__ import annotations

from .world import World, install, module


class Device:
    def __init__(self, world, i, stats, platform="gpu"):
        self.world, self.id, self.local_hardware_id, self._stats, self.platform = world, i, i, stats, platform

    def memory_stats(self):
        self.world.calls.append(("memory_stats", self.id))
        return dict(self._stats)


class Client:
    def __init__(self, platform, devices):
        self.platform, self._devices = platform, devices

    def local_devices(self):
        return list(self._devices)


def install_jax(monkeypatch, world: World, initialised=True, stats=None):
    """stats: {device: memory_stats dict} for the GPU devices JAX sees."""
    stats = stats or {}
    state = {"initialised": initialised}

    def backends():
        if not state["initialised"]:
            world.violations.append("jax backends created")
        return {"cpu": Client("cpu", [Device(world, 0, {}, "cpu")]),
                "cuda": Client("gpu", [Device(world, i, s) for i, s in sorted(stats.items())])}

    def devices(*a):  # pragma: no cover - the adapter goes through the bridge
        return backends()["cuda"].local_devices()

    bridge = module("jax._src.xla_bridge", backends_are_initialized=lambda: state["initialised"], backends=backends)
    src = module("jax._src", xla_bridge=bridge)
    jax = module("jax", _src=src, devices=devices)
    install(monkeypatch, {"jax": jax, "jax._src": src, "jax._src.xla_bridge": bridge})
    return state
