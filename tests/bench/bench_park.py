"""Park and resume time against the bytes parked, next to the alternative people have today.

For each size (default 1, 8 and 32 GiB of PyTorch tensors, and JAX at its default preallocation on one
visible GPU), a target process fills the device from a seeded generator (the "set-up cells"), then:

- park: ``gpucleanup.park.steps.park`` (lock + checkpoint, each step in a helper process), the device memory of
  the process from ``nvidia-smi`` before and while parked, its host RSS while parked;
- resume: ``gpucleanup.park.steps.resume`` (restore + unlock), and the first read of the data afterwards, with a
  SHA-256 of every byte compared with the one taken before the park;
- the alternative: a fresh process that imports the framework and builds the same data again (a kernel
  restart and its set-up cells re-run), timed from its start to "ready".

Usage: python tests/bench/bench_park.py [--sizes 1,8,32] [--no-jax] [--json PATH]
Needs a GPU, nvidia-smi, PyTorch (and JAX for its row). Prints one line per case.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "gpu"))
from test_park_gpu import TARGET, used_mib  # noqa: E402  (the same target process as the GPU test)

GiB = 1 << 30


def env(target: bool = True) -> dict:
    """The targets see GPU0 only; the park helpers every GPU (as measured, share/FACTS.md §10)."""
    out = dict(os.environ, PYTHONUNBUFFERED="1")
    if target:
        out["CUDA_VISIBLE_DEVICES"] = "0"
    out.pop("GPUCLEANUP_LIBCUDA", None)
    if "gpucleanup" not in sys.modules:
        out["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "ipython_ext"), out.get("PYTHONPATH", "")) if p)
    return out


def start(framework: str, size: int, extra: dict) -> tuple:
    began = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-c", TARGET, framework, str(size)], env=dict(env(), **extra), text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    if proc.stdout.readline().strip() != "ready":
        proc.kill()
        raise RuntimeError(f"the {framework} target did not start")
    return proc, time.monotonic() - began


def digest(proc) -> tuple:
    began = time.monotonic()
    proc.stdin.write("digest\n")
    proc.stdin.flush()
    return json.loads(proc.stdout.readline())["sha256"], time.monotonic() - began


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as fh:
        return next(int(line.split()[1]) * 1024 for line in fh if line.startswith("VmRSS"))


def case(framework: str, size: int, extra: dict, label: str) -> dict:
    from gpucleanup.park import steps as park

    proc, setup_s = start(framework, size, extra)
    try:
        before, _ = digest(proc)
        used_before = used_mib(proc.pid)
        rss_before = rss(proc.pid)
        parked = park.park(proc.pid, env=env(target=False))
        if not parked.ok:
            return {"case": label, "error": parked.message}
        used_parked, rss_parked = used_mib(proc.pid), rss(proc.pid)
        resumed = park.resume(proc.pid, env=env(target=False))
        if not resumed.ok:
            return {"case": label, "error": resumed.message}
        after, first_read_s = digest(proc)
    finally:
        proc.kill()
        proc.wait()
    restarted, restart_s = start(framework, size, extra)  # the alternative: a new kernel, the set-up re-run
    restarted.kill()
    restarted.wait()
    step = {s.name: s.seconds for s in parked.steps + resumed.steps}
    return {"case": label, "framework": framework, "device_mib_before": used_before, "device_mib_parked": used_parked,
            "host_rss_before_bytes": rss_before, "host_rss_parked_bytes": rss_parked,
            "park_s": parked.seconds, "checkpoint_step_s": step.get("checkpoint"), "lock_step_s": step.get("lock"),
            "resume_s": resumed.seconds, "restore_step_s": step.get("restore"), "unlock_step_s": step.get("unlock"),
            "first_read_after_s": first_read_s, "equal": after == before, "setup_s": setup_s,
            "restart_and_setup_s": restart_s}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1,8,32", help="GiB of PyTorch tensors, comma-separated")
    parser.add_argument("--no-jax", action="store_true", help="leave out JAX at its default preallocation")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    cases = [("torch", int(float(s) * GiB), {}, f"torch {s} GiB") for s in args.sizes.split(",") if s]
    if not args.no_jax:
        # JAX preallocates 75% of the GPU at its first use; 256 MiB of data inside that.
        cases.append(("jax", 256 << 20, {}, "jax default preallocation"))
    results = []
    for framework, size, extra, label in cases:
        try:
            row = case(framework, size, extra, label)
        except Exception as exc:  # one case failing must not lose the others' figures
            row = {"case": label, "error": f"{type(exc).__name__}: {exc}"}
        results.append(row)
        if "error" in row:
            print(f"{label}: {row['error']}", flush=True)
        else:
            print(f"{label}: {row['device_mib_before']} MiB -> parked in {row['park_s']:.2f} s (checkpoint "
                  f"{row['checkpoint_step_s']:.2f} s), {row['device_mib_parked']} MiB on the device, host RSS "
                  f"{row['host_rss_parked_bytes'] / GiB:.1f} GiB; resumed in {row['resume_s']:.2f} s (restore "
                  f"{row['restore_step_s']:.2f} s), first read {row['first_read_after_s']:.2f} s, equal "
                  f"{row['equal']}; restart + set-up {row['restart_and_setup_s']:.2f} s", flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"results": results}, fh, indent=1)
    return 0 if all("error" not in r and r["equal"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
