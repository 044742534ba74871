"""CuPy: the device memory pool of each device, the pinned host pool, the FFT plan cache.

CuPy's pool calls act on the calling thread's current device, so the adapter makes
each given device current in turn. It does not use ``with cupy.cuda.Device(i)``:
on leaving, that calls ``cudaSetDevice(previous)``, which would create a context on
the previous device when the thread had none current (the runtime then reports
device 0). Instead it records the current context, switches only to given
devices, and puts the same context back with ``cuCtxSetCurrent`` (NULL included).
"""

from __future__ import annotations

import collections
import gc
from typing import Any, Callable, Optional

from ..unraisable import CAPTURE
from .base import Adapter, Figures, _bytes_text, _figures, _fault, _module, _object


def _pool_figures(pool: Any) -> tuple[int, int]:
    """(live, cached) bytes of one pool on the current device."""
    used = int(pool.used_bytes())
    if _is_async(pool):
        # MemoryAsyncPool: used = USED_MEM_CURRENT, total = RESERVED_MEM_CURRENT
        return used, max(int(pool.total_bytes()) - used, 0)
    return used, int(pool.free_bytes())


def _is_async(pool: Any) -> bool:
    kind = type(pool)
    known = _ASYNC.get(kind)
    if known is None:  # once per type of pool: read on every cell
        cls = getattr(getattr(_module("cupy"), "cuda", None), "MemoryAsyncPool", None)
        known = _ASYNC[kind] = isinstance(cls, type) and issubclass(kind, cls)
    return known


#: per type of device pool: whether it is CuPy's MemoryAsyncPool (read as used and reserved)
_ASYNC: "dict[type, bool]" = {}


#: per type of pinned pool: whether it counts its bytes itself (used_bytes and free_bytes)
_COUNTS_BYTES: "dict[type, bool]" = {}


def _counts_bytes(pool: Any) -> bool:
    """Whether a pinned pool counts its bytes itself; asked once per type of pool (a Cython class raises
    inside getattr for what it lacks, which costs on every cell)."""
    counts = _COUNTS_BYTES.get(type(pool))
    if counts is None:
        counts = _COUNTS_BYTES[type(pool)] = all(callable(getattr(pool, m, None)) for m in ("used_bytes", "free_bytes"))
    return counts


def _pinned_pool_bytes(pool: Any) -> Optional[tuple[int, int]]:
    """(live, cached) bytes of a PinnedMemoryPool, or None where CuPy does not tell.

    CuPy 14 exposes only ``n_free_blocks``. Its pool keeps the free blocks in a
    dict {rounded size: [block, ...]} and the blocks handed out in a set (a dict
    {ptr: block} in older CuPy): attributes the Cython class hides but the garbage
    collector sees. They are read through ``gc.get_referents`` and only when they
    have exactly one of these shapes; anything else gives None.
    """
    if _counts_bytes(pool):
        return int(pool.used_bytes()), int(pool.free_bytes())
    refs = gc.get_referents(pool)
    dicts = [r for r in refs if isinstance(r, dict)]
    sets = [r for r in refs if isinstance(r, (set, frozenset))]
    if len(dicts) == 1 and len(sets) == 1:
        free_map, in_use = dicts[0], sets[0]
    elif len(dicts) == 2 and not sets:
        free_maps = [d for d in dicts if isinstance(d, collections.defaultdict)]
        if len(free_maps) != 1:
            return None
        free_map = free_maps[0]
        in_use = next(d for d in dicts if d is not free_map)
    else:
        return None
    for _ in range(3):  # another thread may change the pool while it is read
        try:
            return _blocks_bytes(list(free_map.items()), list(in_use.values()) if isinstance(in_use, dict) else list(in_use))
        except RuntimeError:
            continue
    return None


def _pinned_pool_counts(pool: Any) -> tuple:
    """What changes whenever :func:`_pinned_pool_bytes` would answer otherwise, without summing the blocks:
    the pool's own byte counters where it has them, else its count of free blocks with the sizes of the
    containers the collector sees (the free blocks by size, the blocks handed out). A cell that takes a free
    block and frees one of another size leaves the counts as they were: its cache is still given back by
    the release the last cleanup deferred (a release "cell" leaves no free block to take)."""
    if _counts_bytes(pool):
        return int(pool.used_bytes()), int(pool.free_bytes())
    sizes = [int(pool.n_free_blocks())]
    for ref in gc.get_referents(pool):
        if isinstance(ref, (dict, set, frozenset)):
            sizes.append(len(ref))
    return tuple(sizes)


def _blocks_bytes(free: list, in_use: list) -> Optional[tuple[int, int]]:
    """(live, cached) of the pinned pool's blocks: ``free`` as (size, [block, ...]) pairs, ``in_use`` the
    blocks handed out; None where a value is not of that shape. Loops, not generators: read on every cell."""
    cached = live = 0
    for size, blocks in free:
        if not isinstance(blocks, list):
            return None
        cached += int(size) * len(blocks)
    for block in in_use:
        size = getattr(block, "size", None)
        if size is None:
            return None
        live += int(size)
    return live, cached


class CupyAdapter(Adapter):
    name = "cupy"
    modules = ("cupy",)
    can_release = True
    packages = ("cupy", "cupy_backends")
    oom_types = ("OutOfMemoryError",)  # cupy.cuda.memory.OutOfMemoryError
    object_modules = ("cupy",)

    def object_kind(self, tp: type) -> Optional[str]:
        return "cupy.ndarray" if getattr(tp, "__name__", "") == "ndarray" else None

    def object_info(self, obj: Any, kind: str) -> Optional[dict]:
        device = getattr(getattr(obj, "device", None), "id", None)
        return _object(kind, obj, device, int(obj.nbytes), str(obj.dtype))

    def _in_use(self) -> bool:
        # CuPy has no "initialised" flag that can be read without a CUDA call;
        # the extension calls adapters only once the driver is initialised and
        # the pool calls below create no context.
        cupy = _module("cupy")
        return cupy is not None and hasattr(cupy, "get_default_memory_pool") and hasattr(cupy, "cuda")

    # -- pools -------------------------------------------------------------

    def _pools(self, cupy: Any, notes: list[str]) -> list[Any]:
        default = cupy.get_default_memory_pool()
        pools = [default]
        get_allocator = getattr(cupy.cuda, "get_allocator", None)
        if get_allocator is None:
            return pools
        allocator = get_allocator()
        owner = getattr(allocator, "__self__", None)
        if owner is default:
            return pools
        if owner is not None and all(hasattr(owner, m) for m in ("free_all_blocks", "used_bytes", "free_bytes")):
            pools.insert(0, owner)
            notes.append(self._note("stats", (
                f"cupy allocates from a {type(owner).__name__} set with cupy.cuda.set_allocator: "
                "gpucleanup drains it and the default pool"), 201))
        else:
            what = getattr(allocator, "__qualname__", None) or getattr(allocator, "__name__", None) or repr(allocator)
            notes.append(self._note("stats", (
                f"cupy allocates with {what}, not a memory pool: "
                "gpucleanup drains only cupy's default pool"), 202))
        return pools

    def _on_devices(self, cupy: Any, devices: list[int]) -> "_OnDevices":
        """A context whose value is ``select(i)``, which makes device ``i`` current; afterwards the calling
        thread's device and context are put back. A device whose context is already current to the thread
        is not selected again: on one GPU (the common case) the verbs switch nothing and put nothing back."""
        return _OnDevices(cupy, devices)

    def _fft_cache(self) -> Any:
        cache_mod = _module("cupy.fft._cache")
        get = getattr(cache_mod, "get_plan_cache", None)
        return get() if get is not None else None

    # -- verbs ---------------------------------------------------------------

    def _stats(self, devices: list[int], result: dict) -> None:
        cupy = _module("cupy")
        notes = result["notes"]
        pools = self._pools(cupy, notes)
        with self._on_devices(cupy, devices) as select:
            for i in devices:
                try:
                    select(i)
                    live = cached = 0
                    for pool in pools:
                        pool_live, pool_cached = _pool_figures(pool)
                        live += pool_live
                        cached += pool_cached
                    result["devices"][i] = _figures(live, cached)
                    cache = self._fft_cache()
                    if cache is not None and cache.get_curr_size() > 0:
                        notes.append(self._note("stats", (
                            f"GPU{i}: cupy's FFT plan cache holds {cache.get_curr_size()} plans with "
                            f"{cache.get_curr_memsize()} bytes of work area (counted as live)"), 203))
                except Exception as exc:
                    notes.append(self._note("stats", f"could not read cupy's pool on GPU{i}: {_fault(exc)}"))

    def _quiet_token(self, devices: list[int]) -> Optional[tuple]:
        """What ``stats`` reads, read without building figures: the pools (which ones and their counters), the
        FFT plan cache's size, and the pinned pool's counters. Only for one device that is the calling
        thread's current one with its context current (the common case: no device is switched); else None."""
        cupy = _module("cupy")
        cuda = cupy.cuda
        if len(devices) != 1 or devices[0] != cuda.runtime.getDevice() or not cuda.driver.ctxGetCurrent():
            return None
        token: list = [devices[0]]
        for pool in self._pools(cupy, token):  # the notes it would say are part of the token
            token.append(id(pool))
            token.append(int(pool.used_bytes()))
            token.append(int(pool.total_bytes()) if _is_async(pool) else int(pool.free_bytes()))
        cache = self._fft_cache()
        if cache is not None:
            token.append(cache.get_curr_size())
            token.append(cache.get_curr_memsize())
        pinned = cupy.get_default_pinned_memory_pool()
        token.append(id(pinned))
        token.extend(_pinned_pool_counts(pinned))
        return tuple(token)

    def _drain(self, devices: list[int], result: dict) -> None:
        cupy = _module("cupy")
        notes = result["notes"]
        pools = self._pools(cupy, [])
        with _UnraisableCapture() as captured, self._on_devices(cupy, devices) as select:
            for i in devices:
                try:
                    select(i)
                    before = sum(_held(p) for p in pools)
                    cache = self._fft_cache()
                    if cache is not None and cache.get_curr_memsize() > 0:
                        # Gives the plans' work areas back to the pool; the next FFT
                        # of each shape plans again. Plans without a work area hold no
                        # device memory: clearing them would only cost time (26 ms a
                        # cell for two 2048x2048 plans on an H100) and re-planning.
                        plans, work = cache.get_curr_size(), cache.get_curr_memsize()
                        cache.clear()
                        notes.append(self._note("drain", (
                            f"GPU{i}: cleared cupy's FFT plan cache ({plans} plans, {work} bytes of work area)"), 204))
                    for pool in pools:
                        pool.free_all_blocks()
                    after = sum(_held(p) for p in pools)
                    result["freed_bytes"][i] = max(before - after, 0)
                except Exception as exc:
                    notes.append(self._note("drain", f"could not free cupy's pool on GPU{i}: {_fault(exc)}"))
        if captured.errors:
            first = captured.errors[0]
            notes.append(self._note("drain", (
                f"cupy could not free {len(captured.errors)} blocks ({first}): "
                "the GPU is probably unusable after an earlier error; restart the kernel"), 205))

    def _pinned_stats(self, notes: list[str]) -> Optional[Figures]:
        cupy = _module("cupy")
        pool = cupy.get_default_pinned_memory_pool()
        figures = _pinned_pool_bytes(pool)
        if figures is None:
            notes.append(self._note("pinned", (
                f"cupy's pinned pool holds {pool.n_free_blocks()} free blocks; "
                "this CuPy does not tell their size"), 206))
            return None
        return _figures(*figures)

    def _drain_pinned(self, result: dict) -> None:
        cupy = _module("cupy")
        pool = cupy.get_default_pinned_memory_pool()
        before = _pinned_pool_bytes(pool)
        blocks = pool.n_free_blocks()
        with _UnraisableCapture() as captured:
            pool.free_all_blocks()
        after = _pinned_pool_bytes(pool)
        if before is not None and after is not None:
            result["freed_bytes"] = max(before[1] - after[1], 0)
            self._remember_pinned(_figures(*after))
        elif blocks:
            result["notes"].append(self._note("pinned", (
                f"released {blocks} pinned blocks; this CuPy does not tell their size"), 206))
        if captured.errors:
            result["notes"].append(self._note("pinned", (
                f"cupy could not free {len(captured.errors)} pinned blocks ({captured.errors[0]})"), 207))

    def _describe(self, devices: dict[int, Figures], pinned: Optional[Figures]) -> str:
        live, cached = self._held(devices)
        text = f"cupy holds {_bytes_text(live)} live and {_bytes_text(cached)} cached in its device pools"
        if pinned is not None:
            text += f" and {_bytes_text(pinned['cached_bytes'])} cached in its pinned pool"
        return text + "; gpucleanup frees the cached part after every cell"


class _OnDevices:
    """:meth:`CupyAdapter._on_devices`'s context (a small object: the figures are read on every cell)."""

    __slots__ = ("runtime", "driver", "devices", "previous", "saved_ctx", "switched")

    def __init__(self, cupy: Any, devices: list[int]):
        self.runtime = cupy.cuda.runtime
        self.driver = getattr(cupy.cuda, "driver", None)
        self.devices = devices
        self.previous: Optional[int] = None
        self.saved_ctx: Any = None
        self.switched = False

    def __enter__(self) -> Callable[[int], None]:
        self.previous = self.runtime.getDevice()
        self.saved_ctx = self.driver.ctxGetCurrent() if hasattr(self.driver, "ctxGetCurrent") else None
        return self.select

    def select(self, i: int) -> None:
        if i == self.previous and self.saved_ctx and not self.switched:
            return  # its context is current: nothing to switch (a thread with none gets it selected)
        self.switched = True
        self.runtime.setDevice(i)

    def __exit__(self, *exc: Any) -> None:
        if self.switched:
            if self.previous in self.devices:
                self.runtime.setDevice(self.previous)
            if self.saved_ctx is not None and hasattr(self.driver, "ctxSetCurrent"):
                self.driver.ctxSetCurrent(self.saved_ctx)


def _held(pool: Any) -> int:
    if _is_async(pool):
        return int(pool.total_bytes())
    return int(pool.used_bytes()) + int(pool.free_bytes())


class _UnraisableCapture:
    """Collects the "Exception ignored in ...Memory.__dealloc__" errors that CuPy's frees
    raise after a sticky CUDA error (share/FACTS.md §7.7), so a drain says one line instead of
    printing a traceback per block. Uses gpucleanup's one capture of sys.unraisablehook."""

    def __enter__(self) -> "_UnraisableCapture":
        self._context = CAPTURE.capture()
        self._entries = self._context.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._context.__exit__(*exc)

    @property
    def errors(self) -> list[str]:
        return [f"{e['type']}: {e['message']}" if e["message"] else e["type"] for e in self._entries]