"""Stand-in for CuPy: device MemoryPool per device, MemoryAsyncPool, pinned pool, FFT plan cache."""

from __future__ import annotations

import collections

from .world import World, install, module


class MemoryPool:
    def __init__(self, world: World, used=None, free=None):
        self.world = world
        self.used = dict(used or {})
        self.free = dict(free or {})

    def _dev(self) -> int:
        return self.world.get_device()

    def used_bytes(self):
        self.world.calls.append(("used_bytes", self._dev()))
        return self.used.get(self._dev(), 0)

    def free_bytes(self):
        return self.free.get(self._dev(), 0)

    def total_bytes(self):
        return self.used_bytes() + self.free_bytes()

    def free_all_blocks(self, stream=None):
        self.world.calls.append(("free_all_blocks", self._dev()))
        self.free[self._dev()] = 0

    def malloc(self, size):  # pragma: no cover - identity only
        raise NotImplementedError


class MemoryAsyncPool(MemoryPool):
    """used_bytes = USED_MEM_CURRENT, total_bytes = RESERVED_MEM_CURRENT."""

    def __init__(self, world: World, used=None, reserved=None):
        super().__init__(world, used)
        self.reserved = dict(reserved or {})

    def total_bytes(self):
        return self.reserved.get(self._dev(), 0)

    def free_bytes(self):  # pragma: no cover - not how CuPy's async pool is read
        raise AssertionError("MemoryAsyncPool has no free_bytes accounting worth reading")

    def free_all_blocks(self, stream=None):
        self.world.calls.append(("trim", self._dev()))
        self.reserved[self._dev()] = self.used.get(self._dev(), 0)


class PinnedBlock:
    def __init__(self, size):
        self.size = size


class PinnedMemoryPool:
    """Shaped like CuPy 14's Cython pool: the collector sees a dict {size: [blocks]}
    of free blocks and a set of blocks in use; no byte counters."""

    __slots__ = ("_alloc", "_free", "_in_use", "world", "__weakref__")

    def __init__(self, world: World, free_sizes=(), in_use_sizes=()):
        self.world = world
        self._alloc = len
        self._free = {}
        for size in free_sizes:
            self._free.setdefault(size, []).append(PinnedBlock(size))
        self._in_use = {PinnedBlock(size) for size in in_use_sizes}

    def n_free_blocks(self):
        return sum(len(v) for v in self._free.values())

    def free_all_blocks(self):
        self.world.calls.append(("pinned_free_all_blocks", None))
        self._free.clear()


class PlanCache:
    def __init__(self, plans=0, memsize=0):
        self.plans, self.memsize = plans, memsize

    def get_curr_size(self):
        return self.plans

    def get_curr_memsize(self):
        return self.memsize

    def clear(self):
        self.plans = self.memsize = 0


class CupyStandIn:
    def __init__(self, world: World, pool: MemoryPool, pinned: PinnedMemoryPool):
        self.world = world
        self.pool = pool
        self.pinned = pinned
        self.allocator = pool.malloc
        self.plan_caches: dict = {}
        self.ctx_current = None  # handle of the thread's current context, None: none


def install_cupy(monkeypatch, world: World, used=None, free=None, pinned_free=(), pinned_in_use=(),
                 plan_caches=None) -> CupyStandIn:
    pool = MemoryPool(world, used, free)
    pinned = PinnedMemoryPool(world, pinned_free, pinned_in_use)
    stand_in = CupyStandIn(world, pool, pinned)
    stand_in.plan_caches = dict(plan_caches or {})

    def getDevice():
        world.calls.append(("getDevice", world.get_device()))
        return world.get_device()

    def setDevice(i):
        world.set_device(i)

    def ctxGetCurrent():
        return 0 if world.current is None else 1000 + world.current

    def ctxSetCurrent(handle):
        world.calls.append(("ctxSetCurrent", handle))
        world.current = None if handle == 0 else handle - 1000

    def get_plan_cache():
        return stand_in.plan_caches.setdefault(world.get_device(), PlanCache())

    def get_default_memory_pool():
        return pool

    runtime = module("cupy.cuda.runtime", getDevice=getDevice, setDevice=setDevice)
    driver = module("cupy.cuda.driver", ctxGetCurrent=ctxGetCurrent, ctxSetCurrent=ctxSetCurrent)

    def Device(i):  # pragma: no cover - the adapter must not use it
        world.violations.append(f"cupy.cuda.Device({i})")
        raise AssertionError("cupy.cuda.Device used")

    cuda = module(
        "cupy.cuda", runtime=runtime, driver=driver, MemoryPool=MemoryPool, MemoryAsyncPool=MemoryAsyncPool,
        get_allocator=lambda: stand_in.allocator, Device=Device,
    )
    fft_cache = module("cupy.fft._cache", get_plan_cache=get_plan_cache)
    cupy = module(
        "cupy", cuda=cuda, get_default_memory_pool=get_default_memory_pool,
        get_default_pinned_memory_pool=lambda: pinned,
    )
    install(monkeypatch, {"cupy": cupy, "cupy.cuda": cuda, "cupy.cuda.runtime": runtime,
                          "cupy.cuda.driver": driver, "cupy.fft._cache": fft_cache})
    return stand_in


__all__ = ["install_cupy", "MemoryPool", "MemoryAsyncPool", "PinnedMemoryPool", "PlanCache", "collections"]
