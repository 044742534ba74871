"""Stand-in for PyCUDA 2026.1: contexts current on one thread, memory pools, GPUArray.

Modelled on PyCUDA 2026.1's sources (src/cpp/cuda.hpp, src/wrapper/mempool.cpp,
pycuda/tools.py):

- ``Context.get_current()`` reads a thread-local stack (no CUDA call); ``push``/``pop``
  act on the calling thread's stack; ``Context.get_device()`` is the device of the current
  context; ``Device(i) == Device(i)``.
- A ``DeviceMemoryPool`` belongs to the context current when it was made. Its
  ``free_held()`` frees under that context: when it is not current on the calling thread
  and was made on another thread, PyCUDA prints "out-of-thread context could not be
  cleaned up" and the blocks are lost (recorded in ``violations`` and ``lost_bytes``);
  when it was made on the calling thread, PyCUDA would push it (a violation too:
  gpucleanup must never make a context current). ``stop_holding()`` is always a violation.
- ``PageLockedMemoryPool.free_held()`` needs no context.
- Pools report ``held_blocks``, ``active_blocks``, ``managed_bytes``, ``active_bytes``.

Every build makes fresh classes (wrapping one test's ``__init__`` leaves the next alone).
``install_pycuda`` puts the modules into ``sys.modules``; ``write_pycuda_package`` writes
a ``pycuda`` package to a folder, for tests that import it through the import system.
"""

from __future__ import annotations

import itertools
import sys
import textwrap
import threading
from typing import Any, Optional

from .world import World, install, module

_ITEMSIZE = {"uint8": 1, "int8": 1, "float16": 2, "float32": 4, "int32": 4, "float64": 8, "int64": 8}


class LogicError(RuntimeError):
    pass


class PycudaStandIn:
    """The stand-in's state: what tests script and read."""

    def __init__(self, world: World) -> None:
        self.world = world
        self.calls = world.calls
        self.violations = world.violations
        self.local = threading.local()
        self.lost_bytes = 0
        self.stderr: list[str] = []
        self.made: list[str] = []  # labels of the pools made, in order
        self.handles = itertools.count(0x7F00)
        self.pointers = itertools.count(0x7F0000000000, 1 << 24)
        self.driver = _build_driver(self)
        self.gpuarray = _build_gpuarray(self)
        self.tools = _build_tools(self)

    def stack(self) -> list:
        stack = getattr(self.local, "stack", None)
        if stack is None:
            stack = self.local.stack = []
        return stack

    def autoinit(self, ordinal: int = 0) -> Any:
        """What ``import pycuda.autoinit`` does: a context of its own, current on this thread."""
        return self.driver.Device(ordinal).make_context()

    def modules(self) -> dict:
        package = module("pycuda", __path__=[], driver=self.driver, _driver=self.driver, tools=self.tools,
                         gpuarray=self.gpuarray)
        driver = module("pycuda.driver", **{k: v for k, v in vars(self.driver).items() if not k.startswith("__")})
        return {"pycuda": package, "pycuda._driver": self.driver, "pycuda.driver": driver,
                "pycuda.tools": self.tools, "pycuda.gpuarray": self.gpuarray}


def _build_driver(s: PycudaStandIn) -> Any:
    class Device:
        def __init__(self, ordinal: int) -> None:
            if not 0 <= int(ordinal) < s.world.n_devices:
                raise LogicError(f"cuDeviceGet failed: invalid device ordinal {ordinal}")
            self.ordinal = int(ordinal)

        def __eq__(self, other: Any) -> bool:
            return type(other) is Device and other.ordinal == self.ordinal

        def __ne__(self, other: Any) -> bool:
            return not self == other

        def __hash__(self) -> int:
            return hash(("Device", self.ordinal))

        def make_context(self, flags: int = 0) -> "Context":
            ctx = Context(self)
            ctx.push()
            return ctx

    class Context:
        """Current only on the threads whose stack holds it."""

        def __init__(self, device: Device) -> None:
            self.device = device
            self.handle = next(s.handles)
            self.thread = threading.get_ident()
            s.world.active.add(device.ordinal)

        def push(self) -> None:
            s.calls.append(("push", self.handle, threading.get_ident()))
            s.stack().append(self)

        @staticmethod
        def pop() -> None:
            s.calls.append(("pop", threading.get_ident()))
            stack = s.stack()
            if not stack:
                raise LogicError("context::pop: cannot pop non-current context")
            stack.pop()

        @staticmethod
        def get_current() -> Optional["Context"]:
            stack = s.stack()
            return stack[-1] if stack else None

        @staticmethod
        def get_device() -> Device:
            stack = s.stack()
            if not stack:
                raise LogicError("cuCtxGetDevice failed: invalid device context")
            return stack[-1].device

    class DeviceAllocation:
        def __init__(self, size: int) -> None:
            self._size = size  # not visible to PyCUDA users: no size attribute in Python
            self._ptr = next(s.pointers)

        def __int__(self) -> int:
            return self._ptr

    def mem_alloc(size: int) -> DeviceAllocation:
        if Context.get_current() is None:
            raise LogicError("cuMemAlloc failed: invalid device context")
        return DeviceAllocation(size)

    class PooledDeviceAllocation:
        def __init__(self, pool: Any, size: int) -> None:
            self._pool = pool
            self._size = size
            self._ptr = next(s.pointers)
            self._freed = False

        def __len__(self) -> int:
            return self._size

        def __int__(self) -> int:
            return self._ptr

        def free(self) -> None:
            if not self._freed:
                self._freed = True
                self._pool._give_back(self)

        def __del__(self) -> None:
            self.free()

    class _Pool:
        kind = "device"

        def __init__(self) -> None:
            self._held: list[int] = []
            self._active: dict[int, int] = {}
            self._label = f"{type(self).__name__}@{len(s.made)}"
            s.made.append(self._label)

        held_blocks = property(lambda self: len(self._held))
        active_blocks = property(lambda self: len(self._active))
        managed_bytes = property(lambda self: sum(self._held) + sum(self._active.values()))
        active_bytes = property(lambda self: sum(self._active.values()))

        def _take(self, size: int) -> None:
            if size in self._held:
                self._held.remove(size)

        def _give_back(self, alloc: Any) -> None:
            size = self._active.pop(id(alloc), None)
            if size is not None:
                self._held.append(size)

        def stop_holding(self) -> None:
            s.violations.append(f"stop_holding() called on {self._label}")
            self.free_held()

    class DeviceMemoryPool(_Pool):
        def __init__(self) -> None:
            ctx = Context.get_current()
            if ctx is None:
                raise LogicError("DeviceMemoryPool: no currently active context")
            self._ctx = ctx
            super().__init__()

        def allocate(self, size: int) -> PooledDeviceAllocation:
            self._take(size)
            alloc = PooledDeviceAllocation(self, size)
            self._active[id(alloc)] = size
            return alloc

        def free_held(self) -> None:
            me = threading.get_ident()
            s.calls.append(("free_held", self._label, me))
            if Context.get_current() is not self._ctx:
                if self._ctx.thread != me:
                    s.violations.append(f"free_held() of {self._label}: cannot activate out-of-thread context")
                    s.stderr.append("PyCUDA WARNING: a clean-up operation failed (dead context maybe?)\n"
                                    "cannot activate out-of-thread context\n"
                                    "out-of-thread context could not be cleaned up")
                    s.lost_bytes += sum(self._held)
                    self._held.clear()
                    return
                s.violations.append(f"free_held() of {self._label} pushed its context")
            self._held.clear()

    class PageLockedMemoryPool(_Pool):
        kind = "pinned"

        def __init__(self, allocator: Any = None) -> None:  # its own, as every Boost.Python class has
            super().__init__()

        def allocate(self, size: int) -> PooledDeviceAllocation:
            self._take(size)
            alloc = PooledDeviceAllocation(self, size)
            self._active[id(alloc)] = size
            return alloc

        def free_held(self) -> None:
            s.calls.append(("pinned_free_held", self._label, threading.get_ident()))
            self._held.clear()  # cuMemFreeHost: no context activation

    for cls in (Device, Context, DeviceAllocation, PooledDeviceAllocation, DeviceMemoryPool, PageLockedMemoryPool):
        cls.__module__ = "pycuda._driver"
    return module("pycuda._driver", Device=Device, Context=Context, DeviceAllocation=DeviceAllocation,
                  PooledDeviceAllocation=PooledDeviceAllocation, DeviceMemoryPool=DeviceMemoryPool,
                  PageLockedMemoryPool=PageLockedMemoryPool, mem_alloc=mem_alloc, LogicError=LogicError)


def _build_gpuarray(s: PycudaStandIn) -> Any:
    drv = s.driver

    class GPUArray:
        def __init__(self, shape: Any, dtype: str, allocator: Any = None) -> None:
            self.shape = tuple(shape) if isinstance(shape, (tuple, list)) else (int(shape),)
            self.dtype = dtype
            size = 1
            for n in self.shape:
                size *= int(n)
            self.nbytes = size * _ITEMSIZE[dtype]
            self.gpudata = (allocator or drv.mem_alloc)(self.nbytes)

    GPUArray.__module__ = "pycuda.gpuarray"

    def empty(shape: Any, dtype: str, allocator: Any = None) -> GPUArray:
        return GPUArray(shape, dtype, allocator)

    return module("pycuda.gpuarray", GPUArray=GPUArray, empty=empty)


def _build_tools(s: PycudaStandIn) -> Any:
    drv = s.driver
    DeviceMemoryPool = drv.DeviceMemoryPool

    class DebugMemoryPool(DeviceMemoryPool):  # pycuda/tools.py: calls DeviceMemoryPool.__init__(self)
        def __init__(self, interactive: bool = True, logger: Any = None) -> None:
            DeviceMemoryPool.__init__(self)

    DebugMemoryPool.__module__ = "pycuda.tools"
    return module("pycuda.tools", DeviceMemoryPool=DeviceMemoryPool, PageLockedMemoryPool=drv.PageLockedMemoryPool,
                  DebugMemoryPool=DebugMemoryPool)


def install_pycuda(monkeypatch, world: World) -> PycudaStandIn:
    """PyCUDA already imported: its modules in ``sys.modules`` for this test."""
    stand_in = PycudaStandIn(world)
    install(monkeypatch, stand_in.modules())
    return stand_in


#: the stand-in the package written by ``write_pycuda_package`` hands out when imported
FOR_IMPORT: list = []


def write_pycuda_package(folder, world: World) -> PycudaStandIn:
    """A ``pycuda`` package in ``folder`` (put it on sys.path) whose modules are this stand-in's,
    so that ``import pycuda.tools`` goes through the import system (and its finders)."""
    stand_in = PycudaStandIn(world)
    FOR_IMPORT[:] = [stand_in]
    root = folder / "pycuda"
    root.mkdir()
    (root / "__init__.py").write_text("")
    fill = textwrap.dedent('''
        from stand_ins.pycuda import FOR_IMPORT as _F
        globals().update({k: v for k, v in vars(_F[0].PART).items() if not k.startswith("__")})
    ''')
    (root / "_driver.py").write_text(fill.replace("PART", "driver"))
    (root / "driver.py").write_text("from pycuda._driver import *  # noqa\n"
                                    "from pycuda._driver import Context, Device, DeviceMemoryPool, "
                                    "PageLockedMemoryPool, mem_alloc  # noqa\n")
    (root / "tools.py").write_text("import pycuda.driver as _drv\n" + fill.replace("PART", "tools"))
    (root / "gpuarray.py").write_text("import pycuda.driver as _drv\n" + fill.replace("PART", "gpuarray"))
    return stand_in


def forget_pycuda_modules() -> None:
    """Drop every ``pycuda`` module a test imported."""
    for name in list(sys.modules):
        if name == "pycuda" or name.startswith("pycuda."):
            del sys.modules[name]


__all__ = ["PycudaStandIn", "install_pycuda", "write_pycuda_package", "forget_pycuda_modules", "LogicError"]
