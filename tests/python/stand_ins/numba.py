"""Stand-in for numba-cuda: the device list, primary contexts and their queues of pending frees."""

from __future__ import annotations

import functools

from .world import World, install, module


class PendingDeallocs:
    def __init__(self, world: World, device: int, items=()):
        self.world = world
        self.device = device
        self._cons = list(items)  # (name, handle, size)
        self._size = sum(size for _, _, size in self._cons)
        self._disable_count = 0

    @property
    def is_disabled(self):
        return self._disable_count > 0

    def clear(self):
        if self.is_disabled:
            return
        self.world.calls.append(("clear", self.device, self.world.current))
        if self.world.current != self.device:
            self.world.violations.append(f"frees of device {self.device} flushed outside its context")
        self._cons.clear()
        self._size = 0

    def __len__(self):
        return len(self._cons)


class Block:
    def __init__(self, size):
        self.size = size


class Context:
    def __init__(self, world: World, device: int, pending=(), ctx_pending=(), live=()):
        self.world = world
        self.device = device
        self.memory_manager = module("mm", deallocations=PendingDeallocs(world, device, pending),
                                     allocations={k: Block(s) for k, s in enumerate(live)})
        self.deallocations = PendingDeallocs(world, device, ctx_pending)
        self.stack: list = []

    def push(self):
        self.world.calls.append(("push", self.device))
        self.stack.append(self.world.current)
        self.world.current = self.device

    def pop(self):
        self.world.calls.append(("pop", self.device))
        self.world.current = self.stack.pop()


class Gpu:
    def __init__(self, i, ctx):
        self.id = i
        self.primary_context = ctx


class DeviceList:
    def __init__(self, gpus):
        self._gpus = gpus

    @property
    @functools.cache
    def lst(self):
        return list(self._gpus)


def install_numba(monkeypatch, world: World, contexts=None, listed=True) -> DeviceList:
    """contexts: {device: Context kwargs} for devices where numba holds a primary context."""
    contexts = contexts or {}
    gpus = [Gpu(i, Context(world, i, **contexts[i]) if i in contexts else None) for i in range(world.n_devices)]
    # a fresh property per install, so the cache starts empty
    device_list_type = type("DeviceList", (DeviceList,), {"lst": property(functools.cache(lambda self: list(self._gpus)))})
    device_list = device_list_type(gpus)
    if listed:
        device_list.lst  # numba has listed its devices

    def current_context():  # pragma: no cover - must never be called
        world.violations.append("numba.cuda.current_context()")
        raise AssertionError("current_context")

    devices = module("numba.cuda.cudadrv.devices", _runtime=module("rt", gpus=device_list), gpus=device_list)
    cudadrv = module("numba.cuda.cudadrv", devices=devices)
    cuda = module("numba.cuda", cudadrv=cudadrv, current_context=current_context, gpus=device_list)
    install(monkeypatch, {"numba": module("numba", cuda=cuda), "numba.cuda": cuda,
                          "numba.cuda.cudadrv": cudadrv, "numba.cuda.cudadrv.devices": devices})
    return device_list
