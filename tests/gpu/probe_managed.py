"""What CUDA managed memory looks like from outside a process, and what the driver's checkpoint says of it.

Run on a GPU machine by ``scripts/gpu_run.sh managed`` (not a test: it prints evidence as JSON lines). For each
framework at hand, a child process makes a context and holds ordinary device memory, then managed memory, then
frees it; at each point the parent reads the child's ``/proc/<pid>/maps`` (which mappings name a device file of the
driver, and their sizes) and, with managed memory held and again once it is freed, parks the child with the real
park steps (``gpucleanup.park.steps.park``, resumed where it went through) and reads which step refused and whether
the child still runs. ``cupy-after``: managed memory held and freed before any park; ``cupy-pinned`` and
``torch-pinned``: pinned host memory and no managed memory, parked (what ``managed_bytes`` must not count).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

CHILD = r"""
import sys, time
kind = sys.argv[1]
def wait(tag):
    print(tag, flush=True)
    sys.stdin.readline()
if kind == "cupy":
    import cupy as cp
    a = cp.ones(64 << 20, dtype=cp.uint8)
    cp.cuda.Device().synchronize()
    wait("device")
    m = cp.cuda.malloc_managed(256 << 20)
    cp.cuda.runtime.memset(m.ptr, 1, 256 << 20)
    cp.cuda.Device().synchronize()
    attrs = cp.cuda.runtime.pointerGetAttributes(m.ptr)
    print("attr_type", int(attrs.type), flush=True)
    wait("managed")
    del m
    cp.cuda.Device().synchronize()
    wait("freed")
elif kind == "cupy-pool":
    import cupy as cp
    pool = cp.cuda.MemoryPool(cp.cuda.malloc_managed)
    cp.cuda.set_allocator(pool.malloc)
    b = cp.ones(1 << 20, dtype=cp.uint8)
    cp.cuda.Device().synchronize()
    wait("device")
    a = cp.ones(256 << 20, dtype=cp.uint8)
    cp.cuda.Device().synchronize()
    wait("managed")
    del a, b
    pool.free_all_blocks()
    cp.cuda.Device().synchronize()
    wait("freed")
elif kind == "cupy-after":
    # managed memory held and freed before anything parks it: is the process parkable afterwards?
    import cupy as cp
    m = cp.cuda.malloc_managed(256 << 20)
    cp.cuda.runtime.memset(m.ptr, 1, 256 << 20)
    cp.cuda.Device().synchronize()
    del m
    cp.get_default_memory_pool().free_all_blocks()
    a = cp.ones(64 << 20, dtype=cp.uint8)
    cp.cuda.Device().synchronize()
    wait("freed")
elif kind == "cupy-pinned":
    # pinned host memory (CuPy's pinned pool), no managed memory: not to be taken for managed memory
    import cupy as cp
    import numpy as np
    a = cp.ones(64 << 20, dtype=cp.uint8)
    h = cp.cuda.alloc_pinned_memory(64 << 20)
    host = np.frombuffer(h, dtype=np.uint8, count=64 << 20)
    a.get(out=host)
    cp.cuda.Device().synchronize()
    wait("pinned")
elif kind == "torch-pinned":
    import torch
    a = torch.ones(64 << 20, dtype=torch.uint8, device="cuda")
    h = torch.empty(64 << 20, dtype=torch.uint8, pin_memory=True)
    h.copy_(a)
    torch.cuda.synchronize()
    wait("pinned")
elif kind == "torch":
    import torch
    a = torch.ones(64 << 20, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    wait("device")
    wait("managed")
    wait("freed")
elif kind == "numba":
    from numba import cuda
    import numpy as np
    a = cuda.to_device(np.ones(64 << 20, dtype=np.uint8))
    cuda.synchronize()
    wait("device")
    m = cuda.managed_array(256 << 20, dtype=np.uint8)
    m[:] = 1
    cuda.synchronize()
    wait("managed")
    del m
    import gc; gc.collect()
    cuda.current_context().deallocations.clear()  # numba defers frees: make this one now
    cuda.synchronize()
    wait("freed")
wait("end")
"""


def mappings(pid: int) -> dict:
    """The child's mappings of the driver's device files: per file, how many and how many bytes."""
    out: dict = {}
    with open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as fh:
        for line in fh:
            fields = line.split()
            if len(fields) < 6 or not fields[5].startswith("/dev/nvidia"):
                continue
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            entry = out.setdefault(fields[5], {"count": 0, "bytes": 0, "perms": {}})
            entry["count"] += 1
            entry["bytes"] += hi - lo
            entry["perms"][fields[1]] = entry["perms"].get(fields[1], 0) + 1
    return out


def smaps_rss(pid: int, name: str) -> int:
    total = 0
    current = False
    with open(f"/proc/{pid}/smaps", encoding="utf-8", errors="replace") as fh:
        for line in fh:
            if "-" in line.split(" ", 1)[0] and len(line.split()) >= 5:
                current = line.rstrip().endswith(name)
            elif current and line.startswith("Rss:"):
                total += int(line.split()[1]) * 1024
    return total


def park_once(child) -> dict:
    """The real park steps on the child, and its resume where the park went through."""
    from gpucleanup.park import steps

    started = time.monotonic()
    outcome = steps.park(child.pid)
    out = {"ok": outcome.ok, "state": outcome.state, "message": outcome.message,
           "steps": [{"name": s.name, "result": s.result, "state": s.state} for s in outcome.steps],
           "seconds": round(time.monotonic() - started, 2)}
    if outcome.ok:
        back = steps.resume(child.pid)
        out["resume"] = {"ok": back.ok, "message": back.message}
    return out


def run(kind: str) -> dict:
    child = subprocess.Popen([sys.executable, "-c", CHILD, kind], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
    result: dict = {"kind": kind, "points": {}}
    try:
        while True:
            line = child.stdout.readline().strip()
            if not line:
                result["exit"] = child.wait(timeout=60)
                break
            if line.startswith("attr_type"):
                result["attr_type"] = int(line.split()[1])
                continue
            from gpucleanup.park import steps as park_steps

            with open(f"/proc/{child.pid}/maps", encoding="utf-8", errors="replace") as fh:
                managed = park_steps.managed_bytes(fh.read())  # what park.653 would say it holds
            result["points"][line] = {"maps": mappings(child.pid), "uvm_rss": smaps_rss(child.pid, "/dev/nvidia-uvm"),
                                      "managed_bytes": managed}
            # a park with managed memory held, and again once it is freed (twice, 2 s apart: does a refusal last?)
            if line in ("managed", "freed", "pinned") and kind != "torch":
                tries = [park_once(child)]
                if line == "freed" and not tries[0]["ok"]:
                    time.sleep(2)
                    tries.append(park_once(child))
                result["park_after_free" if line == "freed" else "park"] = tries if line == "freed" else tries[0]
                result["alive_after_park"] = child.poll() is None
            if line == "end":
                child.stdin.write("\n")
                child.stdin.flush()
                continue
            child.stdin.write("\n")
            child.stdin.flush()
    except Exception as exc:  # evidence, not a test: say what broke and go on with the next framework
        result["error"] = f"{type(exc).__name__}: {exc}"
        child.kill()
    return result


def main() -> int:
    # the driver's own answer is what is probed: gpucleanup's refusal before the lock (park.653) is let through,
    # and what it would have said is each point's managed_bytes
    import os

    os.environ["GPUCLEANUP_PARK_UNPROVEN"] = "managed"
    for kind in sys.argv[1:] or ["cupy", "cupy-pool", "cupy-after", "cupy-pinned", "torch-pinned", "numba", "torch"]:
        print(json.dumps(run(kind)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
