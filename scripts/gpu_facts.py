"""Re-checks, on a real GPU, the driver facts gpucleanup is built on (share/FACTS.md §7)
and what the native library does there. Each check runs in a fresh subprocess so
CUDA state never carries over. Prints one "FACT <name>: <json>" line per check;
native/README.md keeps the figures.

Usage (GPU machine, gpucleanup importable): python scripts/gpu_facts.py
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

PRELUDE = textwrap.dedent(
    """
    import ctypes, json, os, sys, time
    cu = ctypes.CDLL("libcuda.so.1")
    def count():
        n = ctypes.c_int(-1); rc = cu.cuDeviceGetCount(ctypes.byref(n)); return rc, n.value
    def primary_states():
        rc, n = count()
        out = []
        for i in range(max(n, 0)):
            dev = ctypes.c_int(); cu.cuDeviceGet(ctypes.byref(dev), i)
            flags = ctypes.c_uint(0); active = ctypes.c_int(0)
            r = cu.cuDevicePrimaryCtxGetState(dev, ctypes.byref(flags), ctypes.byref(active))
            out.append((r, active.value))
        return out
    def emit(name, value):
        print("FACT " + name + ": " + json.dumps(value), flush=True)
    """
)

CHECKS = {
    # 7.1: nothing initialised: the probe's premise, and gpucleanup's answer.
    "fresh_process": """
import gpucleanup
rc, n = count()
snap = gpucleanup.snapshot(); drain = gpucleanup.drain(timeout=1)
rc2, _ = count()
emit("fresh_process", {"cuDeviceGetCount_before": rc, "driver_state": snap["driver"]["state"],
     "devices_listed": len(snap["devices"]), "drain_devices": len(drain["devices"]),
     "cuDeviceGetCount_after_gpucleanup": rc2})
""",
    # Never create a context (native/README.md rules): driver initialised elsewhere, no context: gpucleanup creates none.
    "initialised_no_context": """
import gpucleanup
assert cu.cuInit(0) == 0
before = primary_states()
snap = gpucleanup.snapshot(); drain = gpucleanup.drain(timeout=1)
after = primary_states()
emit("initialised_no_context", {"active_before": [a for _, a in before], "active_after": [a for _, a in after],
     "driver_state": snap["driver"]["state"], "in_use": [d["in_use"] for d in snap["devices"]],
     "drain_devices": len(drain["devices"])})
""",
    # Snapshot against CuPy's view, and the cost of the per-cell calls.
    "snapshot_vs_cupy": """
import cupy as cp, gpucleanup, gpucleanup._native as nat
a = cp.ones((1 << 28,), dtype=cp.float32)  # 1 GiB
cp.cuda.Device(0).synchronize()
free_cupy, total_cupy = cp.cuda.runtime.memGetInfo()
snap = gpucleanup.snapshot()
d0 = snap["devices"][0]
t0 = time.perf_counter(); [nat.probe() for _ in range(1000)]; probe_us = (time.perf_counter() - t0) * 1e3
t0 = time.perf_counter(); [nat.snapshot() for _ in range(200)]; snap_us = (time.perf_counter() - t0) / 200 * 1e6
emit("snapshot_vs_cupy", {"free_cupy": free_cupy, "free_gpucleanup": d0["free_bytes"],
     "difference_bytes": abs(free_cupy - d0["free_bytes"]), "total_cupy": total_cupy, "total_gpucleanup": d0["ctx_total_bytes"],
     "name": d0["name"], "uuid": d0["uuid"], "context": d0["context"],
     "other_devices_in_use": [d["in_use"] for d in snap["devices"][1:]],
     "probe_us_per_call": round(probe_us, 2), "snapshot_us_per_call": round(snap_us, 2),
     "driver": snap["driver"]})
""",
    # 7.4 and the drain: 4 GiB freed into the driver's default pool comes back after a drain.
    "async_pool_drain": """
import cupy as cp, gpucleanup
pool = cp.cuda.MemoryAsyncPool()
cp.cuda.set_allocator(pool.malloc)
cp.cuda.Device(0).synchronize()
free0 = cp.cuda.runtime.memGetInfo()[0]
a = cp.ones((1 << 30,), dtype=cp.float32); cp.cuda.Device(0).synchronize()
del a; cp.cuda.Device(0).synchronize()
free_held = cp.cuda.runtime.memGetInfo()[0]
t0 = time.perf_counter(); res = gpucleanup.drain(timeout=10); ms = (time.perf_counter() - t0) * 1e3
free_after = cp.cuda.runtime.memGetInfo()[0]
emit("async_pool_drain", {"free_before_alloc": free0, "free_while_pool_holds": free_held, "free_after_drain": free_after,
     "returned_bytes": free_after - free_held, "gap_to_start_bytes": free0 - free_after, "drain_ms": round(ms, 2),
     "device": res["devices"][0]})
""",
    # The bounded settle: a kernel that spins for 4 s, a drain limited to 1 s.
    "bounded_settle": """
import cupy as cp, gpucleanup
spin = cp.RawKernel(r'''
extern "C" __global__ void spin(long long cycles) {
  long long start = clock64(); while (clock64() - start < cycles) {}
}''', "spin")
spin((1,), (1,), (cp.int64(4 * 2_000_000_000),))
t0 = time.perf_counter(); first = gpucleanup.drain(timeout=1.0); t1 = time.perf_counter()
second = gpucleanup.drain(timeout=0.2); t2 = time.perf_counter()
cp.cuda.Device(0).synchronize(); t3 = time.perf_counter()
third = gpucleanup.drain(timeout=5)
emit("bounded_settle", {"first_returned_s": round(t1 - t0, 3), "first": first["devices"][0]["settle"],
     "first_state": first["devices"][0]["state"], "second_returned_s": round(t2 - t1, 3),
     "second": second["devices"][0]["settle"], "kernel_finished_after_s": round(t3 - t0, 3),
     "third": third["devices"][0]["settle"], "third_state": third["devices"][0]["state"]})
""",
    # 7.7: after an illegal address, what the driver answers and what gpucleanup says.
    "sticky_error": """
import cupy as cp, gpucleanup
bad = cp.RawKernel(r'''
extern "C" __global__ void bad(int* p) { *(p + (1ll << 40)) = 1; }''', "bad")
x = cp.zeros(1, dtype=cp.int32)
bad((1,), (1,), (x,))
try:
    cp.cuda.Device(0).synchronize(); sync = "ok"
except Exception as e:
    sync = type(e).__name__ + ": " + str(e)[:80]
states = primary_states()
snap = gpucleanup.snapshot(); d1 = gpucleanup.drain(timeout=2); d2 = gpucleanup.drain(timeout=2)
emit("sticky_error", {"cupy_sync": sync, "primary_state_after": states, "snapshot_device": snap["devices"][0],
     "first_drain": d1["devices"][0], "second_drain_state": d2["devices"][0]["state"]})
""",
    # 7.2 / 7.3: which framework calls initialise the driver.
    "framework_init": """
import cupy, torch
r0, _ = count()
torch.cuda.memory_reserved(); r_torch, _ = count()
cupy.get_default_memory_pool().total_bytes(); r_cupy, _ = count()
emit("framework_init", {"after_imports": r0, "after_torch_memory_reserved": r_torch,
     "after_cupy_pool_total_bytes": r_cupy, "torch_initialized": torch.cuda.is_initialized()})
""",
}


def main() -> int:
    failures = 0
    for name, body in CHECKS.items():
        proc = subprocess.run([sys.executable, "-c", PRELUDE + textwrap.dedent(body)], capture_output=True, text=True,
                              timeout=120)
        lines = [l for l in proc.stdout.splitlines() if l.startswith("FACT ")]
        if lines:
            print("\n".join(lines))
        else:
            failures += 1
            print(f"FACT {name}: " + json.dumps({"error": f"exit {proc.returncode}", "stderr": proc.stderr[-1500:]}))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
