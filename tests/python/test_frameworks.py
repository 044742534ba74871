"""Contract tests of the framework adapters, against stand-in framework modules.

The stand-ins (tests/python/stand_ins) are put into sys.modules for one test and
record every call; ``world.violations`` lists any call that would have
initialised CUDA, created a context or touched a device that was not given.
"""

from __future__ import annotations

import sys
import threading

import pytest

from gpucleanup import frameworks
from gpucleanup.frameworks import ADAPTERS, active
from stand_ins import (World, install_cupy, install_jax, install_numba, install_rmm, install_tensorflow,
                       install_torch)
from stand_ins.cupy import MemoryAsyncPool, PlanCache
from stand_ins.numba import Context
from support import GiB, MiB  # noqa: E402

FRAMEWORK_MODULES = ("cupy", "torch", "numba", "numba.cuda", "numba.cuda.cudadrv.devices", "jax",
                     "jax._src.xla_bridge", "rmm", "tensorflow", "tensorflow.python.eager.context",
                     "cupy.fft._cache")


@pytest.fixture(autouse=True)
def no_frameworks(monkeypatch):
    """Each test starts with no framework imported, whatever the test process has loaded."""
    for name in list(sys.modules):
        if name.split(".")[0] in {"cupy", "torch", "numba", "numba_cuda", "jax", "jaxlib", "rmm", "tensorflow"}:
            monkeypatch.delitem(sys.modules, name)
    yield


def adapter(name):
    return next(a for a in ADAPTERS if a.name == name)


# -- the registry ----------------------------------------------------------------


def test_adapters_come_in_the_fixed_order_with_what_each_can_release(monkeypatch):
    monkeypatch.delenv("XLA_PYTHON_CLIENT_ALLOCATOR", raising=False)
    assert [a.name for a in ADAPTERS] == ["cupy", "torch", "numba", "pycuda", "jax", "rmm", "tensorflow"]
    assert [a.can_release for a in ADAPTERS] == [True, True, True, True, False, False, False]
    assert isinstance(ADAPTERS, tuple) and all(isinstance(a, frameworks.Adapter) for a in ADAPTERS)
    assert not hasattr(frameworks, "format_bytes")


def test_no_adapter_imports_a_framework_or_reports_one_that_is_absent():
    before = set(sys.modules)
    assert active() == []
    for a in ADAPTERS:
        assert a.in_use() is False
        assert a.stats([0, 1]) == {"devices": {0: {"live_bytes": 0, "cached_bytes": 0},
                                               1: {"live_bytes": 0, "cached_bytes": 0}},
                                   "pinned": None, "notes": []}
        assert a.drain([0, 1]) == {"freed_bytes": {0: 0, 1: 0}, "notes": []}
        assert a.drain_pinned() == {"freed_bytes": 0, "notes": []}
        assert a.describe() == f"{a.name} is not in use in this kernel"
    assert set(sys.modules) == before
    assert not any(name in sys.modules for name in FRAMEWORK_MODULES)


def test_active_lists_adapters_in_use_and_counts_a_failing_check_as_not_in_use(monkeypatch):
    world = World()
    install_cupy(monkeypatch, world)
    install_torch(monkeypatch, world, initialised=True)

    def broken():
        raise RuntimeError("broken check")

    monkeypatch.setattr(adapter("torch"), "_in_use", broken)
    assert [a.name for a in active()] == ["cupy"]


def test_active_asks_only_the_adapters_whose_framework_was_imported(monkeypatch):
    world = World()
    install_cupy(monkeypatch, world)
    asked = []
    for a in ADAPTERS:
        monkeypatch.setattr(a, "_in_use", lambda name=a.name: asked.append(name) or name == "cupy")
    assert [a.name for a in active()] == ["cupy"]
    assert asked == ["cupy"]  # no other framework's module is in sys.modules: none of them is asked
    assert {a.name: a.modules for a in ADAPTERS} == {
        "cupy": ("cupy",), "torch": ("torch",), "numba": ("numba.cuda.cudadrv.devices",
                                                          "numba_cuda.numba.cuda.cudadrv.devices"),
        "pycuda": ("pycuda.driver",), "jax": ("jax",), "rmm": ("rmm",), "tensorflow": ("tensorflow",)}


# -- cupy --------------------------------------------------------------------------


def test_cupy_adapter_with_stand_in_module_reports_exact_bytes_of_given_devices_only(monkeypatch):
    world = World(n_devices=3, active=(0, 1, 2), current=0)
    install_cupy(monkeypatch, world, used={0: 100, 1: 200, 2: 300}, free={0: 1000, 1: 2000, 2: 3000})
    result = adapter("cupy").stats([1])
    assert result["devices"] == {1: {"live_bytes": 200, "cached_bytes": 2000}}
    assert result["notes"] == []
    assert [c for c in world.calls if c[0] == "setDevice"] == [("setDevice", 1)]
    assert world.current == 0 and world.violations == []


def test_cupy_adapter_on_the_device_current_to_the_thread_switches_and_puts_back_nothing(monkeypatch):
    world = World(n_devices=1, active=(0,), current=0)
    cupy = install_cupy(monkeypatch, world, used={0: 100}, free={0: 1000})
    assert adapter("cupy").stats([0])["devices"] == {0: {"live_bytes": 100, "cached_bytes": 1000}}
    assert adapter("cupy").drain([0]) == {"freed_bytes": {0: 1000}, "notes": []}
    assert [c for c in world.calls if c[0] in ("setDevice", "ctxSetCurrent")] == []
    assert world.current == 0 and world.violations == [] and cupy.pool.free == {0: 0}


def test_cupy_adapter_with_stand_in_module_frees_only_given_devices(monkeypatch):
    world = World(n_devices=3, active=(0, 1, 2), current=0)
    cupy = install_cupy(monkeypatch, world, used={0: 100, 1: 200, 2: 300}, free={0: 1000, 1: 2000, 2: 3000})
    result = adapter("cupy").drain([1, 2])
    assert result == {"freed_bytes": {1: 2000, 2: 3000}, "notes": []}
    assert cupy.pool.free == {0: 1000, 1: 0, 2: 0}
    assert [c for c in world.calls if c[0] == "free_all_blocks"] == [("free_all_blocks", 1), ("free_all_blocks", 2)]
    assert world.current == 0, "the previous current device is restored"
    assert world.violations == []


def test_cupy_adapter_with_stand_in_module_puts_back_a_thread_without_current_context(monkeypatch):
    # only device 1 has a context and the thread has none current: switching back
    # with cudaSetDevice(0) would create a context on device 0
    world = World(n_devices=2, active=(1,), current=None)
    cupy = install_cupy(monkeypatch, world, used={1: 5}, free={1: 7 * MiB})
    assert adapter("cupy").drain([1]) == {"freed_bytes": {1: 7 * MiB}, "notes": []}
    assert adapter("cupy").stats([1])["devices"] == {1: {"live_bytes": 5, "cached_bytes": 0}}
    assert world.current is None
    assert ("ctxSetCurrent", 0) in world.calls
    assert world.violations == [] and world.active == {1}
    assert cupy.pool.free == {1: 0}


def test_cupy_adapter_with_stand_in_module_drains_an_async_pool_set_as_allocator_and_says_so(monkeypatch):
    world = World(n_devices=1, active=(0,), current=0)
    cupy = install_cupy(monkeypatch, world, used={0: 10}, free={0: 90})
    async_pool = MemoryAsyncPool(world, used={0: 1 * GiB}, reserved={0: 5 * GiB})
    cupy.allocator = async_pool.malloc
    stats = adapter("cupy").stats([0])
    assert stats["devices"] == {0: {"live_bytes": 1 * GiB + 10, "cached_bytes": 4 * GiB + 90}}
    assert stats["notes"] == ["[gpucleanup.cupy.201] cupy allocates from a MemoryAsyncPool set with "
                              "cupy.cuda.set_allocator: gpucleanup drains it and the default pool"]
    assert adapter("cupy").drain([0]) == {"freed_bytes": {0: 4 * GiB + 90}, "notes": []}
    assert async_pool.reserved == {0: 1 * GiB}
    assert ("trim", 0) in world.calls


def test_cupy_adapter_with_stand_in_module_notes_an_allocator_that_is_no_pool(monkeypatch):
    world = World(n_devices=1)
    cupy = install_cupy(monkeypatch, world, used={0: 0}, free={0: 64})

    def _malloc(size):  # what cupy.cuda.set_allocator(None) leaves
        raise NotImplementedError

    cupy.allocator = _malloc
    stats = adapter("cupy").stats([0])
    assert stats["notes"] == [
        "[gpucleanup.cupy.202] cupy allocates with test_cupy_adapter_with_stand_in_module_notes_an_allocator_"
        "that_is_no_pool.<locals>._malloc, not a memory pool: gpucleanup drains only cupy's default pool"]
    assert adapter("cupy").drain([0])["freed_bytes"] == {0: 64}


def test_cupy_adapter_with_stand_in_module_clears_the_fft_plan_cache_of_given_devices(monkeypatch):
    world = World(n_devices=2, active=(0, 1))
    cupy = install_cupy(monkeypatch, world, used={0: 8 * MiB, 1: 0}, free={0: 0, 1: 0},
                        plan_caches={0: PlanCache(3, 8 * MiB), 1: PlanCache(1, MiB)})
    stats = adapter("cupy").stats([0])
    assert stats["notes"] == ["[gpucleanup.cupy.203] GPU0: cupy's FFT plan cache holds 3 plans with "
                              "8388608 bytes of work area (counted as live)"]

    result = adapter("cupy").drain([0])
    assert result["notes"] == ["[gpucleanup.cupy.204] GPU0: cleared cupy's FFT plan cache "
                               "(3 plans, 8388608 bytes of work area)"]
    assert cupy.plan_caches[0].get_curr_size() == 0
    assert cupy.plan_caches[1].get_curr_size() == 1, "device 1 was not given"


def test_cupy_adapter_with_stand_in_module_keeps_fft_plans_that_hold_no_work_area(monkeypatch):
    world = World(n_devices=1, active=(0,))
    cupy = install_cupy(monkeypatch, world, used={0: 0}, free={0: 0}, plan_caches={0: PlanCache(2, 0)})
    result = adapter("cupy").drain([0])
    assert result["notes"] == []
    assert cupy.plan_caches[0].get_curr_size() == 2, "plans without a work area free nothing: kept"


def test_cupy_adapter_with_stand_in_module_reports_and_releases_the_pinned_pool_exactly(monkeypatch):
    world = World(n_devices=1)
    cupy = install_cupy(monkeypatch, world, pinned_free=(16 * MiB, 16 * MiB, 4 * MiB), pinned_in_use=(8 * MiB,))
    assert adapter("cupy").stats([0])["pinned"] == {"live_bytes": 8 * MiB, "cached_bytes": 36 * MiB}
    assert adapter("cupy").drain_pinned() == {"freed_bytes": 36 * MiB, "notes": []}
    assert cupy.pinned.n_free_blocks() == 0
    assert adapter("cupy").stats([0])["pinned"] == {"live_bytes": 8 * MiB, "cached_bytes": 0}
    assert adapter("cupy").describe() == (
        "cupy holds 0 B live and 0 B cached in its device pools and 0 B cached in its pinned pool; "
        "gpucleanup frees the cached part after every cell")


def test_cupy_quiet_token_stays_while_nothing_changes_and_differs_for_every_figure_stats_reads(monkeypatch):
    world = World(n_devices=1)
    cupy = install_cupy(monkeypatch, world, used={0: MiB}, free={0: 0}, pinned_free=(4 * MiB,),
                        pinned_in_use=(8 * MiB,), plan_caches={0: PlanCache(0, 0)})
    cupy_adapter = adapter("cupy")
    token = cupy_adapter.quiet_token([0])
    assert isinstance(token, tuple) and cupy_adapter.quiet_token([0]) == token
    assert not world.violations and ("setDevice", 0) not in world.calls, "on the current device: nothing switched"

    def changed(change, undo):
        change()
        now = cupy_adapter.quiet_token([0])
        undo()
        assert cupy_adapter.quiet_token([0]) == token
        return now != token

    pool, pinned, plans = cupy.pool, cupy.pinned, cupy.plan_caches[0]
    block = next(iter(pinned._in_use))
    assert changed(lambda: pool.used.update({0: 2 * MiB}), lambda: pool.used.update({0: MiB}))  # an allocation
    assert changed(lambda: pool.free.update({0: MiB}), lambda: pool.free.update({0: 0}))  # a del: cached
    assert changed(lambda: pinned._free[4 * MiB].append(block), lambda: pinned._free[4 * MiB].pop())  # pinned freed
    extra = type(block)(2 * MiB)
    assert changed(lambda: pinned._in_use.add(extra), lambda: pinned._in_use.discard(extra))  # pinned allocated
    assert changed(lambda: setattr(plans, "plans", 1), lambda: setattr(plans, "plans", 0))  # an FFT plan
    other = type(pool)(world, {0: MiB}, {0: 0})
    assert changed(lambda: setattr(cupy, "allocator", other.malloc), lambda: setattr(cupy, "allocator", pool.malloc))


def test_cupy_quiet_token_is_none_where_reading_would_switch_devices(monkeypatch):
    # the figures are then read as always: the token only ever saves a read on the thread's own device
    world = World(n_devices=2, active=(0, 1), current=0)
    install_cupy(monkeypatch, world, used={0: 1, 1: 2}, free={0: 0, 1: 0})
    cupy_adapter = adapter("cupy")
    assert cupy_adapter.quiet_token([0, 1]) is None
    assert cupy_adapter.quiet_token([1]) is None
    world.current = None  # no context current to the thread: the runtime says device 0
    assert cupy_adapter.quiet_token([0]) is None
    assert not world.violations
    for other in ADAPTERS[1:]:
        assert other.quiet_token([0]) is None


def test_cupy_adapter_with_stand_in_module_stats_never_wait_for_a_pinned_release(monkeypatch):
    world = World(n_devices=1)
    cupy = install_cupy(monkeypatch, world, used={0: 1}, free={0: 2}, pinned_free=(GiB,))
    started, release = threading.Event(), threading.Event()
    original = cupy.pinned.free_all_blocks

    def slow_free_all_blocks():
        started.set()
        release.wait(10)
        original()

    # the pool has slots, like CuPy's Cython class: patch its type
    monkeypatch.setattr(type(cupy.pinned), "free_all_blocks", lambda self: slow_free_all_blocks())
    try:
        cupy_adapter = adapter("cupy")
        assert cupy_adapter.stats([0])["pinned"] == {"live_bytes": 0, "cached_bytes": GiB}
        results = []
        worker = threading.Thread(target=lambda: results.append(cupy_adapter.drain_pinned()))
        worker.start()
        assert started.wait(10)
        during = cupy_adapter.stats([0])
        assert during["devices"] == {0: {"live_bytes": 1, "cached_bytes": 2}}
        assert during["pinned"] == {"live_bytes": 0, "cached_bytes": GiB}
        assert during["notes"] == ["[gpucleanup.cupy.104] cupy's pinned pool is being released: "
                                   "figures from before the release"]
        assert cupy_adapter.drain_pinned() == {"freed_bytes": 0, "notes": [
            "[gpucleanup.cupy.105] cupy's pinned pool is already being released"]}
        release.set()
        worker.join(10)
        assert results == [{"freed_bytes": GiB, "notes": []}]
        assert cupy_adapter.stats([0])["pinned"] == {"live_bytes": 0, "cached_bytes": 0}
    finally:
        release.set()


def test_cupy_adapter_with_stand_in_module_says_one_line_for_frees_failing_after_a_sticky_error(monkeypatch, capsys):
    world = World(n_devices=1)
    cupy = install_cupy(monkeypatch, world, used={0: 0}, free={0: 3 * MiB})

    class CUDARuntimeError(RuntimeError):
        pass

    class Memory:
        def __del__(self):
            raise CUDARuntimeError("cudaErrorIllegalAddress: an illegal memory access was encountered")

    def free_all_blocks(stream=None):
        blocks = [Memory(), Memory(), Memory()]
        del blocks  # each __del__ raises: Python reports it through sys.unraisablehook
        cupy.pool.free[0] = 0

    monkeypatch.setattr(cupy.pool, "free_all_blocks", free_all_blocks)
    hook = sys.unraisablehook
    result = adapter("cupy").drain([0])
    assert result["notes"] == [
        "[gpucleanup.cupy.205] cupy could not free 3 blocks (CUDARuntimeError: cudaErrorIllegalAddress: an "
        "illegal memory access was encountered): the GPU is probably unusable after an earlier error; "
        "restart the kernel"]
    assert capsys.readouterr().err == ""
    assert sys.unraisablehook is hook


def test_cupy_adapter_with_stand_in_module_turns_a_fault_into_a_note(monkeypatch):
    world = World(n_devices=1)
    cupy = install_cupy(monkeypatch, world)

    def broken():
        raise RuntimeError("cudaErrorInitializationError")

    monkeypatch.setattr(cupy.pool, "used_bytes", broken)
    assert adapter("cupy").stats([0])["notes"] == [
        "[gpucleanup.cupy.101] could not read cupy's pool on GPU0: RuntimeError: cudaErrorInitializationError"]
    assert world.current == 0


# -- torch -------------------------------------------------------------------------


def test_torch_adapter_with_stand_in_module_not_initialised_is_not_in_use_and_calls_nothing(monkeypatch):
    world = World(n_devices=2, active=(0,))
    install_torch(monkeypatch, world, initialised=False, reserved={0: GiB}, host_owned=GiB)
    torch_adapter = adapter("torch")
    assert torch_adapter.in_use() is False
    assert torch_adapter.stats([0])["devices"] == {0: {"live_bytes": 0, "cached_bytes": 0}}
    assert torch_adapter.drain([0]) == {"freed_bytes": {0: 0}, "notes": []}
    assert torch_adapter.drain_pinned() == {"freed_bytes": 0, "notes": []}
    assert world.calls == [] and world.violations == []


def test_torch_quiet_token_stays_while_nothing_changes_and_differs_for_every_figure_stats_reads(monkeypatch):
    world = World(n_devices=2, active=(0, 1), current=0)
    torch = install_torch(monkeypatch, world, allocated={0: MiB, 1: 2 * MiB}, reserved={0: 2 * MiB, 1: 2 * MiB},
                          host_active=MiB, host_owned=3 * MiB, host_keys="2.5")
    torch_adapter = adapter("torch")
    token = torch_adapter.quiet_token([0, 1])
    assert isinstance(token, tuple) and torch_adapter.quiet_token([0, 1]) == token
    # the two C functions alone: no Python wrapper, no device switched, nothing initialised
    assert world.calls == [("host_memory_stats_as_nested_dict", None)] * 2 and not world.violations

    def changed(name, value):
        old = getattr(torch, name)
        setattr(torch, name, value)
        now = torch_adapter.quiet_token([0, 1])
        setattr(torch, name, old)
        assert torch_adapter.quiet_token([0, 1]) == token
        return now != token

    assert changed("allocated", {0: 2 * MiB, 1: 2 * MiB})  # a tensor made in the cache of GPU0: no driver call
    assert changed("allocated", {0: MiB, 1: 0})  # a tensor deleted on GPU1: its bytes stay cached
    assert changed("reserved", {0: 4 * MiB, 1: 2 * MiB})  # a segment more
    assert changed("host_active", 2 * MiB)  # a pinned tensor made from the host cache
    assert changed("host_owned", 4 * MiB)  # a pinned block more
    # every figure stats reads, and only those: the same token, the same figures
    assert torch_adapter.stats([0, 1])["devices"] == {0: {"live_bytes": MiB, "cached_bytes": MiB},
                                                      1: {"live_bytes": 2 * MiB, "cached_bytes": 0}}
    # an idle cell's caller found torch in use already: the same token, torch not asked again
    asked = []
    initialised = sys.modules["torch"].cuda.is_initialized
    monkeypatch.setattr(sys.modules["torch"].cuda, "is_initialized", lambda: asked.append(1) or initialised())
    assert torch_adapter.quiet_token([0, 1]) == token and len(asked) == 1
    assert torch_adapter.quiet_token([0, 1], in_use=True) == token and len(asked) == 1


def test_torch_quiet_token_is_none_where_this_torch_cannot_give_one_cheaply(monkeypatch):
    # the figures are then read as always
    world = World(n_devices=1)
    install_torch(monkeypatch, world, allocated={0: 1}, reserved={0: 2}, nested="wrappers")
    assert adapter("torch").quiet_token([0]) is None  # only the Python wrappers: they cost what stats does
    install_torch(monkeypatch, world, initialised=False, reserved={0: GiB})
    assert adapter("torch").quiet_token([0]) is None  # not in use: the C functions are not even asked
    install_torch(monkeypatch, world, allocated={0: 1}, reserved={0: 2})
    torch_adapter = adapter("torch")
    assert isinstance(torch_adapter.quiet_token([0]), tuple)
    monkeypatch.setattr(torch_adapter, "_releasing", True)  # a pinned release under way: stats says its
    assert torch_adapter.quiet_token([0]) is None  # figures are from before it
    assert not world.violations


def test_torch_adapter_with_stand_in_module_reports_exact_bytes(monkeypatch):
    world = World(n_devices=2, active=(0, 1))
    install_torch(monkeypatch, world, allocated={0: 100, 1: 10}, reserved={0: 1100, 1: 20},
                  host_active=8 * MiB, host_owned=24 * MiB, host_keys="2.5")
    result = adapter("torch").stats([0])
    assert result == {"devices": {0: {"live_bytes": 100, "cached_bytes": 1000}},
                      "pinned": {"live_bytes": 8 * MiB, "cached_bytes": 16 * MiB}, "notes": []}
    assert world.calls == [("host_memory_stats_as_nested_dict", None)]


def test_torch_adapter_through_the_python_wrappers_of_the_nested_statistics_reads_the_same_figures(monkeypatch):
    # a torch whose C functions have other names: the public wrappers answer the same nested figures
    world = World(n_devices=2, active=(0, 1))
    install_torch(monkeypatch, world, allocated={0: 100, 1: 10}, reserved={0: 1100, 1: 20},
                  host_active=8 * MiB, host_owned=24 * MiB, host_keys="2.5", nested="wrappers")
    assert adapter("torch").stats([0, 1]) == {
        "devices": {0: {"live_bytes": 100, "cached_bytes": 1000}, 1: {"live_bytes": 10, "cached_bytes": 10}},
        "pinned": {"live_bytes": 8 * MiB, "cached_bytes": 16 * MiB}, "notes": []}
    assert world.calls == [("host_memory_stats_as_nested_dict", None)]


def test_torch_adapter_without_the_nested_statistics_reads_the_flat_ones_with_the_same_figures(monkeypatch):
    world = World(n_devices=2, active=(0, 1))
    install_torch(monkeypatch, world, allocated={0: 100, 1: 10}, reserved={0: 1100, 1: 20},
                  host_active=8 * MiB, host_owned=24 * MiB, host_keys="2.5", nested=False)
    torch_adapter = adapter("torch")
    assert torch_adapter.stats([0, 1]) == {
        "devices": {0: {"live_bytes": 100, "cached_bytes": 1000}, 1: {"live_bytes": 10, "cached_bytes": 10}},
        "pinned": {"live_bytes": 8 * MiB, "cached_bytes": 16 * MiB}, "notes": []}
    assert world.calls == [("host_memory_stats", None)]
    assert torch_adapter.drain([0, 1]) == {"freed_bytes": {0: 1000, 1: 10}, "notes": []}


def test_torch_adapter_with_stand_in_module_empties_the_cache_inside_each_given_device(monkeypatch):
    world = World(n_devices=3, active=(0, 1, 2), current=2)
    torch = install_torch(monkeypatch, world, allocated={0: 1, 1: 2}, reserved={0: 11, 1: 22})
    result = adapter("torch").drain([0, 1])
    assert result == {"freed_bytes": {0: 10, 1: 20}, "notes": []}
    assert [c for c in world.calls if c[0] == "empty_cache"] == [("empty_cache", 0), ("empty_cache", 1)]
    assert ("ipc_collect", 0) in world.calls
    assert world.current == 2 and world.violations == []
    assert torch.reserved == {0: 1, 1: 2}


def test_torch_adapter_with_stand_in_module_leaves_no_device_current_when_none_was(monkeypatch):
    world = World(n_devices=2, active=(1,), current=None)
    install_torch(monkeypatch, world, allocated={1: 0}, reserved={1: 4 * MiB})
    assert adapter("torch").drain([1]) == {"freed_bytes": {1: 4 * MiB}, "notes": []}
    assert world.violations == [] and world.active == {1}


def test_torch_adapter_with_stand_in_module_skips_a_device_capturing_a_graph(monkeypatch):
    world = World(n_devices=2, active=(0, 1))
    install_torch(monkeypatch, world, reserved={0: 5, 1: 7}, capturing=(0, 1))
    result = adapter("torch").drain([0, 1])
    assert result == {"freed_bytes": {0: 0, 1: 0}, "notes": [
        "[gpucleanup.torch.204] GPU0: a CUDA graph is being captured; torch's cache left as is",
        "[gpucleanup.torch.204] GPU1: a CUDA graph is being captured; torch's cache left as is"]}
    assert not any(c[0] in ("empty_cache", "ipc_collect") for c in world.calls)


def test_torch_adapter_with_stand_in_module_notes_the_cuda_malloc_async_backend(monkeypatch):
    world = World(n_devices=1)
    install_torch(monkeypatch, world, backend="cudaMallocAsync", host_keys="2.5")
    assert adapter("torch").stats([0])["notes"] == [
        "[gpucleanup.torch.203] torch allocates with cudaMallocAsync: its cache is the driver's default pool, "
        "which empty_cache trims"]


@pytest.mark.parametrize("empty", ["_C", "accelerator"])
def test_torch_adapter_with_stand_in_module_releases_the_pinned_cache_exactly(monkeypatch, empty):
    world = World(n_devices=1)
    torch = install_torch(monkeypatch, world, host_active=2 * MiB, host_owned=66 * MiB, host_keys="2.5",
                          host_empty=empty)
    assert adapter("torch").stats([0])["pinned"] == {"live_bytes": 2 * MiB, "cached_bytes": 64 * MiB}
    assert adapter("torch").drain_pinned() == {"freed_bytes": 64 * MiB, "notes": []}
    assert torch.host_owned == 2 * MiB
    assert adapter("torch").stats([0])["pinned"] == {"live_bytes": 2 * MiB, "cached_bytes": 0}


def test_torch_adapter_with_stand_in_module_releases_a_pinned_cache_whose_live_part_it_cannot_tell(monkeypatch):
    # torch 2.11: allocated_bytes = owned; active_bytes does not drop on free, so live is unknown
    world = World(n_devices=1)
    torch = install_torch(monkeypatch, world, host_active=2 * MiB, host_owned=66 * MiB, host_keys="2.11")
    stats = adapter("torch").stats([0])
    assert stats["pinned"] is None
    assert stats["notes"] == ["[gpucleanup.torch.208] torch's pinned host cache owns 69206016 bytes; "
                              "this torch does not tell how much of it is in use"]
    assert adapter("torch").drain_pinned() == {"freed_bytes": 64 * MiB, "notes": []}
    assert torch.host_owned == 2 * MiB


def test_torch_adapter_counts_scalar_staging_in_the_pinned_cache_live_and_leaves_it_alone(monkeypatch):
    # torch 2.11 after a float(t): a few bytes pinned, never released (SMALL_PINNED_BYTES), so nothing is
    # cached and the engine has no pinned release to try after each idle cell
    world = World(n_devices=1)
    torch = install_torch(monkeypatch, world, host_active=8, host_owned=8, host_keys="2.11")
    stats = adapter("torch").stats([0])
    assert stats["pinned"] == {"live_bytes": 8, "cached_bytes": 0}
    assert stats["notes"] == []
    assert adapter("torch").drain_pinned() == {"freed_bytes": 0, "notes": []}
    assert torch.host_owned == 8


def test_torch_adapter_with_stand_in_module_reports_an_empty_pinned_cache_without_a_note(monkeypatch):
    world = World(n_devices=1)
    install_torch(monkeypatch, world, host_active=0, host_owned=0, host_keys="2.11")
    stats = adapter("torch").stats([0])
    assert stats["pinned"] == {"live_bytes": 0, "cached_bytes": 0}
    assert stats["notes"] == []


def test_torch_adapter_with_stand_in_module_says_when_it_cannot_read_or_empty_the_pinned_cache(monkeypatch):
    world = World(n_devices=1)
    install_torch(monkeypatch, world, host_keys="none", host_empty=None)
    assert adapter("torch").stats([0])["pinned"] is None
    assert adapter("torch").stats([0])["notes"] == [
        "[gpucleanup.torch.206] this torch does not report its pinned host cache"]
    assert adapter("torch").drain_pinned() == {"freed_bytes": 0, "notes": [
        "[gpucleanup.torch.207] this torch cannot empty its pinned host cache"]}


# -- numba -------------------------------------------------------------------------


def test_numba_adapter_with_stand_in_module_is_not_in_use_before_numba_lists_devices(monkeypatch):
    world = World(n_devices=2)
    install_numba(monkeypatch, world, contexts={0: {"pending": [("cuMemFree", 1, MiB)]}}, listed=False)
    assert adapter("numba").in_use() is False
    assert adapter("numba").drain([0]) == {"freed_bytes": {0: 0}, "notes": []}
    assert world.calls == [] and world.violations == []


def test_numba_adapter_with_stand_in_module_is_not_in_use_without_a_primary_context(monkeypatch):
    world = World(n_devices=2)
    install_numba(monkeypatch, world, contexts={})
    assert adapter("numba").in_use() is False


def test_numba_adapter_with_stand_in_module_flushes_pending_frees_inside_given_contexts_only(monkeypatch):
    world = World(n_devices=2, active=(0, 1), current=0)
    pending = [("cuMemFree", 1, 256 * MiB), ("cuMemFree", 2, 64 * MiB)]
    install_numba(monkeypatch, world, contexts={
        0: {"pending": [("cuMemFree", 3, MiB)]},
        1: {"pending": pending, "ctx_pending": [("cuStreamDestroy", 4, 0)], "live": (8 * MiB,)},
    })
    stats = adapter("numba").stats([1])
    assert stats["devices"] == {1: {"live_bytes": 8 * MiB, "cached_bytes": 320 * MiB}}
    assert stats["notes"] == ["[gpucleanup.numba.201] GPU1: numba has 3 frees pending (335544320 bytes of memory)"]

    assert adapter("numba").drain([1]) == {"freed_bytes": {1: 320 * MiB}, "notes": []}
    assert [c for c in world.calls if c[0] in ("push", "clear", "pop")] == [
        ("push", 1), ("clear", 1, 1), ("clear", 1, 1), ("pop", 1)]
    assert world.current == 0 and world.violations == []
    assert adapter("numba").stats([0])["devices"] == {0: {"live_bytes": 0, "cached_bytes": MiB}}


def test_numba_adapter_with_stand_in_module_leaves_deferred_frees_and_says_so(monkeypatch):
    world = World(n_devices=1)
    devices = install_numba(monkeypatch, world, contexts={0: {"pending": [("cuMemFree", 1, MiB)]}})
    queue = devices.lst[0].primary_context.memory_manager.deallocations
    queue._disable_count = 1  # inside numba.cuda.defer_cleanup()
    assert adapter("numba").drain([0]) == {"freed_bytes": {0: 0}, "notes": [
        "[gpucleanup.numba.202] GPU0: numba's frees are deferred (defer_cleanup is active); left queued"]}
    assert len(queue) == 1


# -- jax ---------------------------------------------------------------------------


def test_jax_adapter_with_stand_in_module_is_not_in_use_before_backends_exist(monkeypatch):
    world = World(n_devices=1)
    install_jax(monkeypatch, world, initialised=False, stats={0: {"bytes_in_use": 1}})
    assert adapter("jax").in_use() is False
    assert adapter("jax").stats([0])["devices"] == {0: {"live_bytes": 0, "cached_bytes": 0}}
    assert world.calls == [] and world.violations == []


def test_jax_adapter_with_stand_in_module_reports_its_bfc_pool_and_releases_nothing(monkeypatch):
    monkeypatch.delenv("XLA_PYTHON_CLIENT_ALLOCATOR", raising=False)
    world = World(n_devices=2, active=(0, 1))
    install_jax(monkeypatch, world, stats={
        0: {"bytes_in_use": 4 * MiB, "pool_bytes": 12 * GiB, "bytes_limit": 12 * GiB},
        1: {"bytes_in_use": 0, "pool_bytes": 12 * GiB}})
    jax_adapter = adapter("jax")
    assert jax_adapter.can_release is False
    assert jax_adapter.stats([0]) == {"devices": {0: {"live_bytes": 4 * MiB, "cached_bytes": 12 * GiB - 4 * MiB}},
                                      "pinned": None, "notes": []}
    assert world.calls == [("memory_stats", 0)]
    assert jax_adapter.drain([0]) == {"freed_bytes": {0: 0}, "notes": []}
    assert jax_adapter.describe() == (
        "jax holds 12.0 GiB in its BFC allocator (4.0 MiB in arrays); JAX cannot give it back: "
        "set XLA_PYTHON_CLIENT_ALLOCATOR=platform before JAX starts, or delete arrays to make room inside JAX")


def test_jax_adapter_with_stand_in_module_can_release_with_the_platform_allocator(monkeypatch):
    monkeypatch.setenv("XLA_PYTHON_CLIENT_ALLOCATOR", "platform")
    world = World(n_devices=1)
    install_jax(monkeypatch, world, stats={0: {"bytes_in_use": 3 * MiB}})
    jax_adapter = adapter("jax")
    assert jax_adapter.can_release is True
    assert jax_adapter.stats([0])["devices"] == {0: {"live_bytes": 3 * MiB, "cached_bytes": 0}}
    assert jax_adapter.describe() == ("jax holds 3.0 MiB in arrays; its platform allocator frees memory "
                                      "as soon as arrays are deleted")


# -- rmm ---------------------------------------------------------------------------


def test_rmm_adapter_with_stand_in_module_reports_pool_and_live_bytes_of_configured_devices(monkeypatch):
    from stand_ins.rmm import CudaMemoryResource, PoolMemoryResource, StatisticsResourceAdaptor

    world = World(n_devices=2, active=(0, 1))
    pool = PoolMemoryResource(CudaMemoryResource(), 2 * GiB)
    install_rmm(monkeypatch, world, resources={0: StatisticsResourceAdaptor(pool, 512 * MiB)})
    rmm_adapter = adapter("rmm")
    assert rmm_adapter.can_release is False
    result = rmm_adapter.stats([0, 1])
    assert result == {"devices": {0: {"live_bytes": 512 * MiB, "cached_bytes": 1536 * MiB},
                                  1: {"live_bytes": 0, "cached_bytes": 0}}, "pinned": None, "notes": []}
    assert world.calls == [("get_per_device_resource", 0)] and world.violations == []
    assert rmm_adapter.drain([0]) == {"freed_bytes": {0: 0}, "notes": []}
    assert rmm_adapter.describe() == (
        "rmm holds 2.0 GiB (512 MiB live); RMM pools give memory back only when their resource is destroyed "
        "(rmm.reinitialize()), so gpucleanup leaves them")


def test_rmm_adapter_with_stand_in_module_notes_what_it_cannot_see(monkeypatch):
    from stand_ins.rmm import CudaAsyncMemoryResource, CudaMemoryResource, PoolMemoryResource

    world = World(n_devices=2, active=(0, 1))
    install_rmm(monkeypatch, world, resources={0: PoolMemoryResource(CudaMemoryResource(), GiB),
                                               1: CudaAsyncMemoryResource()})
    result = adapter("rmm").stats([0, 1])
    assert result["devices"] == {0: {"live_bytes": 0, "cached_bytes": GiB}, 1: {"live_bytes": 0, "cached_bytes": 0}}
    assert result["notes"] == [
        "[gpucleanup.rmm.201] GPU0: rmm's pool holds 1073741824 bytes; how much is live needs a "
        "StatisticsResourceAdaptor (rmm.statistics.enable_statistics())",
        "[gpucleanup.rmm.202] GPU1: rmm's CudaAsyncMemoryResource keeps a private driver pool "
        "gpucleanup can neither see nor trim"]


def test_rmm_adapter_with_stand_in_module_is_not_in_use_without_a_resource(monkeypatch):
    world = World(n_devices=1)
    install_rmm(monkeypatch, world, resources={})
    assert adapter("rmm").in_use() is False


# -- tensorflow --------------------------------------------------------------------


def test_tensorflow_adapter_with_stand_in_module_does_not_list_gpus_before_its_context_exists(monkeypatch):
    world = World(n_devices=1)
    install_tensorflow(monkeypatch, world, context_ready=False, current={0: GiB})
    assert adapter("tensorflow").in_use() is False
    assert adapter("tensorflow").stats([0])["devices"] == {0: {"live_bytes": 0, "cached_bytes": 0}}
    assert world.violations == [] and world.calls == []


def test_tensorflow_adapter_with_stand_in_module_reports_live_bytes_and_why_the_rest_stays(monkeypatch):
    monkeypatch.delenv("TF_GPU_ALLOCATOR", raising=False)
    world = World(n_devices=2, active=(0, 1))
    install_tensorflow(monkeypatch, world, current={0: 3 * GiB, 1: GiB})
    tf_adapter = adapter("tensorflow")
    result = tf_adapter.stats([0])
    assert result == {"devices": {0: {"live_bytes": 3 * GiB, "cached_bytes": 0}}, "pinned": None, "notes": [
        "[gpucleanup.tensorflow.201] tensorflow's default (BFC) allocator gives no memory back until the process "
        "ends, and no API says how much it caches: its tensors are counted as live (get_memory_info), the rest "
        "shows as memory outside every pool; TF_GPU_ALLOCATOR=cuda_malloc_async, set before tensorflow starts, "
        "lets gpucleanup's driver-pool trim give back what it frees"]}
    assert world.calls == [("get_memory_info", "GPU:0")]
    assert tf_adapter.drain([0]) == {"freed_bytes": {0: 0}, "notes": []}
    assert tf_adapter.describe() == (
        "tensorflow holds 3.0 GiB in tensors and keeps the rest of its memory until the process exits: restart "
        "the kernel to release it; with TF_GPU_ALLOCATOR=cuda_malloc_async, gpucleanup's driver-pool trim "
        "reaches what it frees")


# -- two frameworks together ----------------------------------------------------------


def test_adapters_with_stand_in_modules_of_two_frameworks_each_free_their_own_pool(monkeypatch):
    world = World(n_devices=2, active=(0, 1), current=1)
    cupy = install_cupy(monkeypatch, world, used={0: 1, 1: 0}, free={0: 100, 1: 50})
    torch = install_torch(monkeypatch, world, allocated={0: 2}, reserved={0: 202})
    assert [a.name for a in active()] == ["cupy", "torch"]
    freed = {a.name: a.drain([0])["freed_bytes"] for a in active()}
    assert freed == {"cupy": {0: 100}, "torch": {0: 200}}
    assert cupy.pool.free == {0: 0, 1: 50} and torch.reserved == {0: 2}
    assert world.current == 1 and world.violations == []


def test_torch_adapter_with_stand_in_module_leaves_a_pinned_cache_under_a_mebibyte_alone(monkeypatch):
    # torch pins a few bytes for each .item(): releasing them said "pinned 5 B" after cells that pinned nothing
    world = World(n_devices=1, active=(0,))
    torch = install_torch(monkeypatch, world, host_active=0, host_owned=5)
    assert adapter("torch").drain_pinned() == {"freed_bytes": 0, "notes": []}
    assert torch.host_owned == 5
    assert not [c for c in world.calls if c[0] == "host_empty_cache"]
    torch.host_owned = 1 << 20  # from a mebibyte on, it is released as before
    assert adapter("torch").drain_pinned() == {"freed_bytes": 1 << 20, "notes": []}


def test_torch_drain_gives_back_library_workspaces_before_emptying_the_cache(monkeypatch):
    # cuBLAS workspaces are allocated through torch's allocator: they count as live until cleared
    world = World(n_devices=2, active=(0, 1))
    torch = install_torch(monkeypatch, world, allocated={0: 100 + 32 * MiB, 1: 10}, reserved={0: 1100 + 32 * MiB, 1: 20})
    torch.workspace = {0: 32 * MiB}
    result = adapter("torch").drain([0, 1])
    assert result == {"freed_bytes": {0: 1000 + 32 * MiB, 1: 10}, "notes": []}
    names = [c[0] for c in world.calls]
    assert names.index("clear_cublas_workspaces") < names.index("empty_cache")
    assert "cufft_clear_plan_cache(0)" in names and "cufft_clear_plan_cache(1)" in names
    assert world.violations == []


def test_torch_drain_leaves_library_workspaces_alone_while_a_graph_is_captured(monkeypatch):
    world = World(n_devices=2, active=(0, 1))
    torch = install_torch(monkeypatch, world, allocated={0: 100 + 32 * MiB, 1: 10}, reserved={0: 1100 + 32 * MiB, 1: 20},
                          capturing=(1,))
    torch.workspace = {0: 32 * MiB}
    adapter("torch").drain([0, 1])
    names = [c[0] for c in world.calls]
    assert "clear_cublas_workspaces" not in names
    assert not any(n.startswith("cufft_clear_plan_cache") for n in names)
    assert torch.workspace == {0: 32 * MiB}
