"""The PyCUDA adapter and PyCUDA's objects in ``%gpumem --vars``, against the PyCUDA stand-in.

Real PyCUDA is never imported here: the stand-in (tests/python/stand_ins/pycuda.py) models
contexts current on one thread only, pools that belong to the context current at their
making, and frees that PyCUDA cannot do on another thread (recorded as violations, as is any
``stop_holding`` and any push of a context by gpucleanup). Threads are ordered with joins and
events only.
"""

from __future__ import annotations

import gc
import importlib
import sys
import threading

import pytest

from gpucleanup import frameworks
from gpucleanup.frameworks import ADAPTERS
from gpucleanup.frameworks import pycuda as pycuda_adapter
from gpucleanup.frameworks.objects import find_gpu_objects, gpu_object_info
from stand_ins import World, install_pycuda, install_tensorflow
from stand_ins.pycuda import forget_pycuda_modules, write_pycuda_package
from support import GiB, MiB  # noqa: E402



@pytest.fixture(autouse=True)
def fresh_tracker(monkeypatch):
    """Each test starts with no PyCUDA imported and a tracker that has seen nothing; it leaves
    no finder in sys.meta_path and no PyCUDA module behind."""
    forget_pycuda_modules()
    tracker = pycuda_adapter._Tracker()
    monkeypatch.setattr(pycuda_adapter, "_TRACKER", tracker)
    meta_path = list(sys.meta_path)
    yield tracker
    while tracker._installs:
        tracker.uninstall()
    assert not [f for f in sys.meta_path if isinstance(f, pycuda_adapter._ImportWatch)]
    sys.meta_path[:] = meta_path
    forget_pycuda_modules()


def adapter():
    return next(a for a in ADAPTERS if a.name == "pycuda")


def pushes(calls):
    return [c for c in calls if c[0] in ("push", "pop")]


def in_thread(fn, name="worker"):
    """Runs ``fn`` on a new thread and waits for it; returns what it returned."""
    out = {}

    def run():
        out["value"] = fn()

    t = threading.Thread(target=run, name=name)
    t.start()
    t.join()
    return out.get("value")


def fill_and_empty(pool, gpuarray, count, size):
    """``count`` arrays of ``size`` bytes from ``pool``, then deleted: the pool holds them."""
    before = pool.active_bytes
    arrays = [gpuarray.empty((size,), "uint8", allocator=pool.allocate) for _ in range(count)]
    assert pool.active_bytes - before == count * size
    del arrays
    assert pool.active_bytes == before


# -- not in use ----------------------------------------------------------------------


def test_pycuda_adapter_without_pycuda_is_not_in_use_and_watches_nothing():
    before = list(sys.meta_path)
    a = adapter()
    assert a.in_use() is False
    assert a.stats([0]) == {"devices": {0: {"live_bytes": 0, "cached_bytes": 0}}, "pinned": None, "notes": []}
    assert a.drain([0]) == {"freed_bytes": {0: 0}, "notes": []}
    assert a.describe() == "pycuda is not in use in this kernel"
    assert sys.meta_path == before and "pycuda" not in sys.modules


def test_pycuda_adapter_with_stand_in_module_is_not_in_use_before_a_context_exists(monkeypatch):
    world = World(n_devices=1, active=())
    install_pycuda(monkeypatch, world)
    assert adapter().in_use() is False
    assert world.calls == [] and world.violations == []


# -- device pools ----------------------------------------------------------------------


def test_pycuda_adapter_with_stand_in_module_drains_a_pool_made_on_this_thread_under_its_context(monkeypatch):
    world = World(n_devices=1, active=())
    pycuda = install_pycuda(monkeypatch, world)
    pycuda.autoinit()
    frameworks.install()
    pool = pycuda.tools.DeviceMemoryPool()
    fill_and_empty(pool, pycuda.gpuarray, 8, 64 * MiB)
    assert (pool.held_blocks, pool.managed_bytes, pool.active_bytes) == (8, 512 * MiB, 0)
    start = len(world.calls)
    a = adapter()
    assert a.in_use() is True
    stats = a.stats([0])
    assert stats["devices"] == {0: {"live_bytes": 0, "cached_bytes": 512 * MiB}}
    assert stats["pinned"] == {"live_bytes": 0, "cached_bytes": 0}
    assert stats["notes"] == []
    assert stats["pools"] == [{"pool": "DeviceMemoryPool #1", "kind": "device", "device": 0, "thread": "MainThread",
                               "live_bytes": 0, "cached_bytes": 512 * MiB, "drained_here": True}]
    assert a.drain([0]) == {"freed_bytes": {0: 512 * MiB}, "notes": []}
    assert pool.held_blocks == 0 and pool.managed_bytes == 0
    assert [c for c in world.calls[start:] if c[0] == "free_held"] == [
        ("free_held", "DeviceMemoryPool@0", threading.get_ident())]
    assert pushes(world.calls[start:]) == []
    assert world.violations == [] and pycuda.lost_bytes == 0
    assert a.stats([0])["devices"] == {0: {"live_bytes": 0, "cached_bytes": 0}}
    assert a.describe() == ("pycuda holds 0 B live and 0 B cached in 1 device memory pool and 0 B cached in its "
                            "page-locked pools; gpucleanup frees the cached part of the pools made on the kernel's "
                            "thread after every cell")


def test_pycuda_adapter_with_stand_in_module_counts_live_blocks_and_frees_only_the_held_ones(monkeypatch):
    world = World(n_devices=1, active=())
    pycuda = install_pycuda(monkeypatch, world)
    pycuda.autoinit()
    frameworks.install()
    pool = pycuda.tools.DeviceMemoryPool()
    kept = [pycuda.gpuarray.empty((16 * MiB,), "uint8", allocator=pool.allocate) for _ in range(2)]
    fill_and_empty(pool, pycuda.gpuarray, 3, 32 * MiB)
    a = adapter()
    assert a.stats([0])["devices"] == {0: {"live_bytes": 32 * MiB, "cached_bytes": 96 * MiB}}
    assert a.drain([0]) == {"freed_bytes": {0: 96 * MiB}, "notes": []}
    assert (pool.held_blocks, pool.active_blocks, pool.active_bytes) == (0, 2, 32 * MiB)
    assert len(kept) == 2 and world.violations == []


def test_pycuda_adapter_with_stand_in_module_names_and_leaves_a_pool_made_on_another_thread(monkeypatch):
    # the context is the main thread's (pycuda.autoinit); a worker pushes it, makes a pool,
    # fills it and pops: freeing its blocks needs that worker (PyCUDA: "cannot activate
    # out-of-thread context" where the context is not current and belongs to another thread)
    world = World(n_devices=1, active=())
    pycuda = install_pycuda(monkeypatch, world)
    frameworks.install()
    ctx = pycuda.autoinit()
    ctx.pop()  # no context current on the main thread: the worker's pool still makes it in use

    def work():
        ctx.push()
        try:
            pool = pycuda.tools.DeviceMemoryPool()
            fill_and_empty(pool, pycuda.gpuarray, 2, 64 * MiB)
            return pool
        finally:
            ctx.pop()

    pool = in_thread(work, name="loader")
    start = len(world.calls)
    a = adapter()
    assert a.in_use() is True
    note = ("[gpucleanup.pycuda.202] GPU0: DeviceMemoryPool #1 holds 128 MiB of freed blocks: it was made on "
            "thread 'loader', and its blocks can be freed only on the thread that owns its context: call "
            "pool.free_held() there")
    stats = a.stats([0])
    assert stats["devices"] == {0: {"live_bytes": 0, "cached_bytes": 128 * MiB}}
    assert stats["notes"] == [note]
    assert a.drain([0]) == {"freed_bytes": {0: 0}, "notes": [note]}
    assert pool.held_blocks == 2
    assert not [c for c in world.calls[start:] if c[0] == "free_held"]
    assert pushes(world.calls[start:]) == [] and world.violations == []
    assert a.describe() == (
        "pycuda holds 0 B live and 128 MiB cached in 1 device memory pool and 0 B cached in its page-locked pools; "
        "gpucleanup frees the cached part of the pools made on the kernel's thread after every cell; "
        "DeviceMemoryPool #1 keep 128 MiB: gpucleanup leaves them to the thread that owns their context "
        "(pool.free_held() there)")


def test_pycuda_adapter_with_stand_in_module_leaves_a_pool_whose_context_is_not_current_now(monkeypatch):
    world = World(n_devices=1, active=())
    pycuda = install_pycuda(monkeypatch, world)
    frameworks.install()
    pycuda.autoinit()  # context A, current on this thread
    other = pycuda.driver.Device(0).make_context()  # context B pushed over it
    pool = pycuda.tools.DeviceMemoryPool()  # B's
    fill_and_empty(pool, pycuda.gpuarray, 1, 8 * MiB)
    other.pop()  # A current again: draining would make PyCUDA push B
    start = len(world.calls)
    note = ("[gpucleanup.pycuda.202] GPU0: DeviceMemoryPool #1 holds 8.0 MiB of freed blocks: its context is not "
            "current on this thread now (gpucleanup never makes a context current): call pool.free_held() "
            "while it is")
    assert adapter().drain([0]) == {"freed_bytes": {0: 0}, "notes": [note]}
    assert pool.held_blocks == 1 and pushes(world.calls[start:]) == [] and world.violations == []
    other.push()  # the user's own code makes B current again: now it is drained
    assert adapter().drain([0]) == {"freed_bytes": {0: 8 * MiB}, "notes": []}
    assert world.violations == []


def test_pycuda_adapter_with_stand_in_module_drains_only_pools_of_given_devices(monkeypatch):
    world = World(n_devices=2, active=())
    pycuda = install_pycuda(monkeypatch, world)
    frameworks.install()
    pycuda.driver.Device(1).make_context()
    pool = pycuda.tools.DeviceMemoryPool()
    fill_and_empty(pool, pycuda.gpuarray, 2, 4 * MiB)
    a = adapter()
    assert a.stats([0])["devices"] == {0: {"live_bytes": 0, "cached_bytes": 0}}
    assert a.drain([0]) == {"freed_bytes": {0: 0}, "notes": []}
    assert pool.held_blocks == 2
    assert a.stats([0, 1])["devices"] == {0: {"live_bytes": 0, "cached_bytes": 0},
                                          1: {"live_bytes": 0, "cached_bytes": 8 * MiB}}
    assert a.drain([0, 1]) == {"freed_bytes": {0: 0, 1: 8 * MiB}, "notes": []}
    assert pool.held_blocks == 0 and world.violations == []


def test_pycuda_adapter_with_stand_in_module_names_a_pool_made_before_it_watched_and_never_drains_it(monkeypatch):
    world = World(n_devices=1, active=())
    pycuda = install_pycuda(monkeypatch, world)
    pycuda.autoinit()
    early = pycuda.tools.DeviceMemoryPool()  # PyCUDA imported and used before gpucleanup loaded
    fill_and_empty(early, pycuda.gpuarray, 1, 16 * MiB)
    a = adapter()
    assert a.in_use() is True  # wraps the classes now, and looks once for earlier pools
    later = pycuda.tools.DeviceMemoryPool()
    fill_and_empty(later, pycuda.gpuarray, 1, 2 * MiB)
    start = len(world.calls)
    stats = a.stats([0])
    assert stats["devices"] == {0: {"live_bytes": 0, "cached_bytes": 2 * MiB}}
    assert stats["notes"] == [
        f"[gpucleanup.pycuda.203] DeviceMemoryPool at {id(early):#x} holds 16 MiB of freed blocks: it was made "
        "before gpucleanup watched PyCUDA, so gpucleanup cannot tell which thread and context own it; call "
        "pool.free_held() on the thread that made it"]
    assert a.drain([0]) == {"freed_bytes": {0: 2 * MiB}, "notes": []}
    assert early.held_blocks == 1 and later.held_blocks == 0
    assert [c[1] for c in world.calls[start:] if c[0] == "free_held"] == ["DeviceMemoryPool@1"]
    assert world.violations == []


def test_pycuda_adapter_with_stand_in_module_forgets_a_pool_that_is_gone(monkeypatch):
    world = World(n_devices=1, active=())
    pycuda = install_pycuda(monkeypatch, world)
    pycuda.autoinit()
    frameworks.install()
    pool = pycuda.tools.DeviceMemoryPool()
    fill_and_empty(pool, pycuda.gpuarray, 1, MiB)
    assert adapter().stats([0])["devices"][0]["cached_bytes"] == MiB
    del pool
    gc.collect()
    assert adapter().stats([0])["devices"] == {0: {"live_bytes": 0, "cached_bytes": 0}}
    assert pycuda_adapter._TRACKER.pools() == []


# -- the import hook -------------------------------------------------------------------


def test_pycuda_adapter_with_stand_in_package_sees_pools_made_in_the_cell_that_imports_pycuda(monkeypatch, tmp_path):
    world = World(n_devices=1, active=())
    write_pycuda_package(tmp_path, world)
    monkeypatch.syspath_prepend(str(tmp_path))
    frameworks.install()
    finders = [f for f in sys.meta_path if isinstance(f, pycuda_adapter._ImportWatch)]
    assert len(finders) == 1
    assert finders[0].find_spec("json") is None  # reacts only to PyCUDA's driver modules
    # one cell: import, make a context and two pools, fill them
    tools = importlib.import_module("pycuda.tools")
    gpuarray = importlib.import_module("pycuda.gpuarray")
    from stand_ins.pycuda import FOR_IMPORT
    pycuda = FOR_IMPORT[0]
    pycuda.autoinit()
    pool = tools.DeviceMemoryPool()
    debug = tools.DebugMemoryPool()  # calls DeviceMemoryPool.__init__(self)
    fill_and_empty(pool, gpuarray, 2, 64 * MiB)
    fill_and_empty(debug, gpuarray, 1, 64 * MiB)
    assert not [f for f in sys.meta_path if isinstance(f, pycuda_adapter._ImportWatch)], "the finder left once used"
    stats = adapter().stats([0])
    assert stats["devices"] == {0: {"live_bytes": 0, "cached_bytes": 192 * MiB}}
    assert [p["pool"] for p in stats["pools"]] == ["DeviceMemoryPool #1", "DebugMemoryPool #2"]
    assert adapter().drain([0]) == {"freed_bytes": {0: 192 * MiB}, "notes": []}
    assert pool.held_blocks == debug.held_blocks == 0 and world.violations == []
    # unload: the classes get their own __init__ back; pools made after it are not seen
    frameworks.uninstall()
    cls = sys.modules["pycuda._driver"].DeviceMemoryPool
    assert not hasattr(cls.__dict__["__init__"], "_gpucleanup_wraps")
    tools.DeviceMemoryPool()
    assert len(pycuda_adapter._TRACKER.pools()) == 2
    adapter().in_use()
    assert not hasattr(cls.__dict__["__init__"], "_gpucleanup_wraps"), "nothing wraps again after the unload"


def test_pycuda_install_is_counted_and_uninstall_removes_the_finder():
    before = list(sys.meta_path)
    frameworks.install()
    frameworks.install()
    assert len(sys.meta_path) == len(before) + 1
    frameworks.uninstall()
    assert pycuda_adapter._TRACKER.watching is True
    frameworks.uninstall()
    assert pycuda_adapter._TRACKER.watching is False
    assert sys.meta_path == before


def test_pycuda_install_after_the_import_wraps_at_once_without_a_finder(monkeypatch):
    world = World(n_devices=1, active=())
    pycuda = install_pycuda(monkeypatch, world)
    before = list(sys.meta_path)
    frameworks.install()
    assert sys.meta_path == before
    assert hasattr(pycuda.driver.DeviceMemoryPool.__dict__["__init__"], "_gpucleanup_wraps")
    assert hasattr(pycuda.driver.PageLockedMemoryPool.__dict__["__init__"], "_gpucleanup_wraps")
    frameworks.uninstall()
    assert not hasattr(pycuda.driver.DeviceMemoryPool.__dict__["__init__"], "_gpucleanup_wraps")


# -- page-locked pools ----------------------------------------------------------------------


def test_pycuda_adapter_with_stand_in_module_releases_page_locked_pools_on_another_thread(monkeypatch):
    world = World(n_devices=1, active=())
    pycuda = install_pycuda(monkeypatch, world)
    pycuda.autoinit()
    frameworks.install()
    pinned = pycuda.tools.PageLockedMemoryPool()
    blocks = [pinned.allocate(16 * MiB) for _ in range(4)]
    del blocks[1:]
    a = adapter()
    stats = a.stats([0])
    assert stats["pinned"] == {"live_bytes": 16 * MiB, "cached_bytes": 48 * MiB}
    assert stats["devices"] == {0: {"live_bytes": 0, "cached_bytes": 0}}
    result = in_thread(a.drain_pinned, name="gpucleanup-pinned")  # the engine's background release
    assert result == {"freed_bytes": 48 * MiB, "notes": []}
    assert [c for c in world.calls if c[0] == "pinned_free_held"][0][1] == "PageLockedMemoryPool@0"
    assert pinned.held_blocks == 0 and pinned.active_bytes == 16 * MiB
    assert a.stats([0])["pinned"] == {"live_bytes": 16 * MiB, "cached_bytes": 0}
    assert world.violations == []


# -- raw allocations and GPU objects -----------------------------------------------------------


def test_pycuda_adapter_with_stand_in_module_counts_no_raw_allocation_of_threads(monkeypatch):
    # five threads push the context, mem_alloc 64 MiB each and keep it: in no pool, so not the
    # adapter's (the engine says it as growth outside every pool)
    world = World(n_devices=1, active=())
    pycuda = install_pycuda(monkeypatch, world)
    frameworks.install()
    ctx = pycuda.autoinit()
    kept = []
    ready = threading.Barrier(5)

    def work():
        ctx.push()
        try:
            ready.wait()
            kept.append(pycuda.driver.mem_alloc(64 * MiB))
        finally:
            ctx.pop()

    threads = [threading.Thread(target=work) for _ in range(5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(kept) == 5
    assert adapter().stats([0])["devices"] == {0: {"live_bytes": 0, "cached_bytes": 0}}
    found = find_gpu_objects({"kept": kept})
    assert [(f["name"], f["kind"], f["bytes"], f["device"]) for f in found] == [
        (f"kept[{i}]", "pycuda.DeviceAllocation", None, "GPU?") for i in range(5)]


def test_pycuda_objects_with_stand_in_module_are_listed_with_their_size_where_pycuda_tells_it(monkeypatch):
    world = World(n_devices=1, active=())
    pycuda = install_pycuda(monkeypatch, world)
    pycuda.autoinit()
    pool = pycuda.tools.DeviceMemoryPool()
    array = pycuda.gpuarray.empty((1024, 256), "float32", allocator=pool.allocate)
    block = pool.allocate(3 * MiB)
    raw = pycuda.driver.mem_alloc(MiB)
    assert gpu_object_info(array) == {"kind": "pycuda.GPUArray", "shape": [1024, 256], "dtype": "float32",
                                      "device": "GPU?", "bytes": MiB}
    assert gpu_object_info(block) == {"kind": "pycuda.PooledDeviceAllocation", "shape": [], "dtype": "",
                                      "device": "GPU?", "bytes": 3 * MiB}
    assert gpu_object_info(raw) == {"kind": "pycuda.DeviceAllocation", "shape": [], "dtype": "",
                                    "device": "GPU?", "bytes": None}
    assert gpu_object_info(pool) is None
    found = find_gpu_objects({"array": array, "d": {"b": block}})
    assert [(f["name"], f["kind"]) for f in found] == [("array", "pycuda.GPUArray"),
                                                       ("d['b']", "pycuda.PooledDeviceAllocation")]


# -- tensorflow with the stream-ordered allocator ------------------------------------------------


def test_tensorflow_adapter_with_stand_in_module_and_cuda_malloc_async_counts_its_memory_as_the_driver_pools(monkeypatch):
    monkeypatch.setenv("TF_GPU_ALLOCATOR", "cuda_malloc_async")
    world = World(n_devices=1)
    install_tensorflow(monkeypatch, world, current={0: 3 * GiB})
    tf = next(a for a in ADAPTERS if a.name == "tensorflow")
    assert tf.stats([0]) == {"devices": {0: {"live_bytes": 0, "cached_bytes": 0}}, "pinned": None, "notes": [
        "[gpucleanup.tensorflow.202] tensorflow allocates from each device's default stream-ordered pool "
        "(TF_GPU_ALLOCATOR=cuda_malloc_async): its memory is counted as the driver pool's, and what it frees is "
        "trimmed after each cell"]}
    assert world.calls == [] and world.violations == []
    assert tf.describe() == ("tensorflow holds its memory in the driver's default pool "
                             "(TF_GPU_ALLOCATOR=cuda_malloc_async): it is counted there, and gpucleanup trims what "
                             "tensorflow frees after every cell")
