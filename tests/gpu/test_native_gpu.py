"""libgpucleanup against the real driver: figures agree with CuPy's, no context is made,
and a drain gives the stream-ordered pool's memory back to the device."""

from __future__ import annotations

from conftest import GiB, TOLERANCE, require, run_script


def test_snapshot_free_agrees_with_cupy_memgetinfo_while_cupy_holds_memory():
    require("cupy")
    r = run_script('''
        import cupy, gpucleanup
        x = cupy.ones((2 * 1024 ** 3) // 4, dtype=cupy.float32)   # 2 GiB live in CuPy's pool
        cupy.cuda.runtime.deviceSynchronize()
        free_cupy, total_cupy = cupy.cuda.runtime.memGetInfo()
        snap = gpucleanup.snapshot()
        dev = next(d for d in snap["devices"] if d["index"] == 0)
        figure(f"snapshot free {dev['free_bytes']} B, cupy memGetInfo free {free_cupy} B, "
               f"difference {abs(dev['free_bytes'] - free_cupy)} B")
        result(state=snap["driver"]["state"], in_use=dev["in_use"], free=dev["free_bytes"], free_cupy=free_cupy,
               total=dev["ctx_total_bytes"], total_cupy=total_cupy)
    ''')
    assert r["state"] == "ready" and r["in_use"] is True
    assert abs(r["free"] - r["free_cupy"]) <= TOLERANCE
    assert r["total"] == r["total_cupy"]


def test_snapshot_and_drain_create_no_context_in_a_fresh_process():
    r = run_script('''
        import ctypes, time, gpucleanup
        cuda = ctypes.CDLL("libcuda.so.1")
        n = ctypes.c_int(0)

        def states():
            out = []
            for i in range(n.value):
                flags, active = ctypes.c_uint(0), ctypes.c_int(0)   # active starts at 0 (see CUDAHooks.cpp)
                rc = cuda.cuDevicePrimaryCtxGetState(i, ctypes.byref(flags), ctypes.byref(active))
                out.append((rc, active.value))
            return out

        # 1. nothing initialised CUDA: gpucleanup must not be the one to do it
        t0 = time.perf_counter()
        before = gpucleanup.snapshot()["driver"]["state"]
        drained = gpucleanup.drain(timeout=5)
        ms = (time.perf_counter() - t0) * 1e3
        uninitialised = cuda.cuDeviceGetCount(ctypes.byref(n))   # 3: still not initialised
        # 2. the test (not gpucleanup) initialises the driver; still no context anywhere
        assert cuda.cuInit(0) == 0
        assert cuda.cuDeviceGetCount(ctypes.byref(n)) == 0
        states_before = states()
        snap = gpucleanup.snapshot()
        drain = gpucleanup.drain(timeout=5)
        states_after = states()
        figure(f"fresh process: snapshot+drain before cuInit {ms:.2f} ms, devices {n.value}, "
               f"primary contexts active after snapshot+drain: {sum(a for _, a in states_after)}")
        result(before=before, drained_devices=len(drained["devices"]), uninitialised=uninitialised,
               states_before=states_before, states_after=states_after,
               in_use=[d["in_use"] for d in snap["devices"]], drain_devices=len(drain["devices"]))
    ''')
    assert r["before"] == "not_initialized" and r["drained_devices"] == 0
    assert r["uninitialised"] == 3, "gpucleanup called cuInit"
    assert all(rc == 0 and active == 0 for rc, active in r["states_before"])
    assert r["states_after"] == r["states_before"], "gpucleanup created a context"
    assert r["in_use"] == [False] * len(r["in_use"]) and r["drain_devices"] == 0


def test_drain_returns_memory_freed_from_a_cupy_async_pool_to_the_device():
    require("cupy")
    r = run_script('''
        import time, cupy, gpucleanup
        pool = cupy.cuda.MemoryAsyncPool()
        cupy.cuda.set_allocator(pool.malloc)
        cupy.zeros(1)
        cupy.cuda.runtime.deviceSynchronize()
        free_start = cupy.cuda.runtime.memGetInfo()[0]
        blocks = [cupy.empty(256 * 1024 ** 2, dtype=cupy.uint8) for _ in range(16)]   # 4 GiB
        del blocks
        cupy.cuda.runtime.deviceSynchronize()
        free_held = cupy.cuda.runtime.memGetInfo()[0]
        t0 = time.perf_counter()
        drain = gpucleanup.drain(timeout=30)
        ms = (time.perf_counter() - t0) * 1e3
        free_end = cupy.cuda.runtime.memGetInfo()[0]
        dev = next(d for d in drain["devices"] if d["index"] == 0)
        figure(f"async pool: held {free_start - free_held} B after del, drain released {dev['released_bytes']} B "
               f"in {ms:.1f} ms; free now {free_start - free_end} B below the start")
        result(free_start=free_start, free_held=free_held, free_end=free_end, released=dev["released_bytes"],
               state=dev["state"])
    ''')
    assert r["state"] == "drained"
    assert r["free_start"] - r["free_held"] >= 4 * GiB - TOLERANCE, "the pool did not keep the freed memory"
    assert r["released"] >= 4 * GiB - TOLERANCE
    assert abs(r["free_start"] - r["free_end"]) <= TOLERANCE


def test_the_quiet_check_holds_on_an_idle_device_and_sees_an_allocation_queued_work_and_a_pool():
    require("cupy")
    r = run_script('''
        import time, cupy, gpucleanup._native as native
        x = cupy.ones(1 << 28, dtype=cupy.float32)       # 1 GiB live, nothing cached
        x *= 1.0                                          # its kernel loaded now, not during the checks
        cupy.cuda.runtime.deviceSynchronize()
        native.after_cell(timeout=5)                      # the pass that leaves what the check compares with
        idle = [native.quiet() for _ in range(20)]
        t0 = time.perf_counter()
        for _ in range(200):
            native.quiet()
        us = (time.perf_counter() - t0) / 200 * 1e6
        y = cupy.ones(64 << 20, dtype=cupy.uint8)          # 64 MiB more: CuPy asks the driver for it
        cupy.cuda.runtime.deviceSynchronize()
        after_alloc = native.quiet()
        del y
        cupy.get_default_memory_pool().free_all_blocks()   # given back: the device as the pass left it
        back = native.quiet()
        for _ in range(200):
            x *= 1.0                                       # queued in place: no memory changes hands
        queued = native.quiet()
        cupy.cuda.runtime.deviceSynchronize()
        settled = native.quiet()
        pool = cupy.cuda.MemoryAsyncPool()                 # the device's stream-ordered pool
        b = pool.malloc(32 << 20)
        cupy.cuda.runtime.deviceSynchronize()
        with_pool = native.quiet()
        figure(f"quiet check: {us:.1f} µs a call in a loop; idle {sum(idle)}/20; after a 64 MiB allocation "
               f"{after_alloc}, given back {back}; 200 kernels queued {queued}, done {settled}; "
               f"a stream-ordered pool holding 32 MiB {with_pool}")
        result(idle=idle, after_alloc=after_alloc, back=back, queued=queued, settled=settled, with_pool=with_pool)
    ''')
    assert r["idle"] == [True] * 20
    assert r["after_alloc"] is False and r["back"] is True
    assert r["queued"] is False and r["settled"] is True
    assert r["with_pool"] is False
