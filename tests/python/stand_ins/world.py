"""A scripted CUDA process: which primary contexts are active, which is current."""

from __future__ import annotations

import types


class World:
    """Devices 0..n-1; ``active`` holds the devices whose primary context exists.

    ``current`` is the calling thread's current device, or None when no context is
    current (the runtime then reports device 0). Making an inactive device current
    creates its context: recorded in ``violations``.
    """

    def __init__(self, n_devices: int = 2, active=(0,), current=0):
        self.n_devices = n_devices
        self.active = set(active)
        self.current = current
        self.calls: list = []
        self.violations: list = []

    def set_device(self, i: int, who: str = "setDevice") -> None:
        self.calls.append((who, i))
        if i not in self.active:
            self.violations.append(f"{who}({i}) created a context on device {i}")
            self.active.add(i)
        self.current = i

    def get_device(self) -> int:
        return 0 if self.current is None else self.current


def module(name: str, **attrs) -> types.ModuleType:
    m = types.ModuleType(name)
    m.__dict__.update(attrs)
    return m


def install(monkeypatch, modules: dict) -> None:
    for name, mod in modules.items():
        monkeypatch.setitem(__import__("sys").modules, name, mod)
