#!/usr/bin/env python3
"""How long the page /gpucleanup takes to list many kernels: ``GET api/gpucleanup/kernels`` against a real
``jupyter server`` with N light kernels on the fake driver.

The kernels are tests/server_harness.FakeKernels: each a process with gpucleanup's own status endpoint (the
library's status server and discovery file, a notebook name, a last cell's record, an idle state) and no IPython,
what the server sees of a kernel. With ``--smi`` (the default) the stand-in nvidia-smi (tests/python/stand_ins/bin)
lists every kernel's process, as on a GPU server, so every refresh also runs it twice (GPUs, processes).

Requests timed, one after the other, ``--rounds`` times each, interleaved:
  page        ?sort=held&cards=       the page's refresh with no card open (each kernel asked once: status)
  page+card   ?sort=held&cards=<one>  the same with one card open (that kernel also asked for its last cells)
  full        (no query)              every kernel's status and last cells (the API as it was before the table)

Also counted: the status requests each kernel's server answered during one page refresh (its own counter).

Usage: PYTHONPATH=ipython_ext .venv/bin/python tests/bench/bench_page_list.py [--kernels 50] [--rounds 20]
       [--no-smi] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "ipython_ext"))

import server_harness  # noqa: E402

MiB = 1 << 20
UUID0 = "GPU-fa4ec0da-0000-4000-8000-000000000000"  # the fake driver's device 0


def spec(root: Path, i: int) -> dict:
    return {"notebook": str(root / f"team{i % 4}" / f"run-{i:02d}.ipynb"), "idle_s": 60 * i + 30,
            "record": {"cell": 3, "elapsed_s": 0.2, "interrupted": False, "devices": [{
                "index": 0, "name": "Fake H100", "state": "drained", "total_bytes": 80 << 30,
                "live_bytes": {"cupy": (16 + i) * MiB}, "cached_bytes": {"cupy": 8 * MiB}, "outside_bytes": None,
                "used_after_bytes": None, "freed_bytes": {"cupy": 0}}]}}


def summary(times: list) -> dict:
    ordered = sorted(times)
    return {"median_ms": round(statistics.median(ordered) * 1000, 1),
            "p95_ms": round(ordered[max(0, int(len(ordered) * 0.95) - 1)] * 1000, 1),
            "min_ms": round(ordered[0] * 1000, 1), "max_ms": round(ordered[-1] * 1000, 1), "n": len(ordered)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kernels", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--no-smi", action="store_true", help="no nvidia-smi at all (the fake driver alone)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.kernels < 1 or args.rounds < 1:
        parser.error("--kernels and --rounds must be 1 or more")
    build = Path(os.environ.get("GPUCLEANUP_BUILD_DIR", ROOT / "build"))
    libcuda, library = build / "tests" / "fake_cuda" / "libcuda.so.1", build / "native" / "libgpucleanup.so"
    for path in (libcuda, library):
        if not path.exists():
            parser.error(f"{path} is missing: build with -DGPUCLEANUP_BUILD_TESTS=ON first")

    from gpucleanup.protocol import discovery
    from gpucleanup.outside import kernels
    from gpucleanup.protocol import status_client

    with tempfile.TemporaryDirectory(prefix="bench-page-") as tmp:
        base = Path(tmp)
        world = base / "nvidia-smi.json"
        world.write_text(json.dumps({"gpus": [], "apps": []}))
        env = {"GPUCLEANUP_LIBRARY": str(library), "GPUCLEANUP_LIBCUDA": str(libcuda),
               "GPUCLEANUP_FAKE_CUDA_SCENARIO": json.dumps({"devices": [{"name": "Fake H100", "primary_active": True}]})}
        if not args.no_smi:
            env["GPUCLEANUP_FAKE_NVIDIA_SMI"] = str(world)
            env["PATH"] = f"{ROOT / 'tests' / 'python' / 'stand_ins' / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}"
        else:  # no nvidia-smi on PATH, whatever this machine has
            env["PATH"] = os.pathsep.join(p for p in os.environ.get("PATH", "").split(os.pathsep)
                                          if not (Path(p) / "nvidia-smi").exists())
        server = server_harness.Server(base / "srv", extra_env=env, status_timeout=1.0)
        fakes = None
        try:
            started = time.perf_counter()
            fakes = server_harness.FakeKernels(server.runtime, [spec(server.root, i) for i in range(args.kernels)], env)
            start_s = time.perf_counter() - started
            used = sum(40 + i for i in range(args.kernels)) + 300 * args.kernels
            world.write_text(json.dumps({
                "gpus": [{"index": 0, "uuid": UUID0, "free_mib": 81920 - used, "total_mib": 81920}],
                "apps": [{"pid": pid, "uuid": UUID0, "used_mib": 40 + i + 300} for i, pid in enumerate(fakes.pids)]}))
            one = f"pid-{fakes.pids[0]}"
            paths = {"page": "/api/gpucleanup/kernels?sort=held&cards=",
                     "page+card": f"/api/gpucleanup/kernels?sort=held&cards={one}",
                     "full": "/api/gpucleanup/kernels"}
            for path in paths.values():  # warm-up: the fake driver loads in every kernel at its first snapshot
                assert len(server.api("GET", path)["kernels"]) == args.kernels
            times = {name: [] for name in paths}
            for _ in range(args.rounds):
                for name, path in paths.items():
                    t0 = time.perf_counter()
                    server.api("GET", path)
                    times[name].append(time.perf_counter() - t0)
            found = {k.pid: k for k in discovery.scan(server.runtime, clean=False).live}
            targets = [kernels.target_of(found[pid]) for pid in fakes.pids]

            def counts():
                return [r["server"]["requests"] for r in status_client.request_many(targets, "status", 5.0)]

            before = counts()
            server.api("GET", paths["page"])
            asked = sorted({a - b - 1 for a, b in zip(counts(), before)})  # less our own request
        finally:
            if fakes is not None:
                fakes.stop()
            server.stop()
    result = {"kernels": args.kernels, "rounds": args.rounds, "nvidia_smi": "stand-in" if not args.no_smi else "none",
              "kernels_started_s": round(start_s, 1), "requests_per_kernel_per_page_refresh": asked,
              "cpus": os.cpu_count(), "load_avg_1m": round(os.getloadavg()[0], 2), "python": platform.python_version(),
              "requests": {name: summary(values) for name, values in times.items()}}
    print(f"{args.kernels} kernels (light, fake driver), nvidia-smi: {result['nvidia_smi']}, {args.rounds} rounds, "
          f"{os.cpu_count()} CPUs, load {result['load_avg_1m']}")
    for name, figures in result["requests"].items():
        print(f"  {name:10} median {figures['median_ms']:7.1f} ms   p95 {figures['p95_ms']:7.1f} ms   "
              f"min {figures['min_ms']:7.1f} ms   max {figures['max_ms']:7.1f} ms")
    print(f"  status requests per kernel in one page refresh: {asked}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
