"""What the driver's checkpoint calls do where a park was seen to lose a process: two GPUs used together, and
a GPU taken while a process is parked. Plain processes (no kernel, no gpucleanup loaded), each step through
gpucleanup's own park helpers (:mod:`gpucleanup.park`), so that what is measured is what a park does.

Cases (each in a fresh process; the ones that need two GPUs are skipped with fewer):
  torch-cross-map     PyTorch on GPU0 and GPU1, one cross-GPU copy before the park; restore with the identity
                      map of every GPU (the default); after the resume: tensors equal, a cross-GPU copy both ways
  torch-apart-map     tensors on both GPUs, no cross-GPU copy before; after the resume the first cross-GPU copy
  jax-two-map         JAX on both GPUs (XLA enables peer access between them at start), platform allocator
  torch-cross-nomap   as torch-cross-map, restored with no map (GPUCLEANUP_PARK_RESTORE_MAP=none): last, since
                      a failed restore may lose the process
  gpu-taken           PyTorch with 5 GiB on GPU0 parked; another process takes all of GPU0 but 1 GiB; a restore
                      then (its result, time, state after); the other process exits; a restore again; equal?

Usage: python3 tests/bench/park_facts.py [--json FILE] [--only CASE ...]
Each case prints one line ``FACT {json}``; the whole list goes to --json.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import subprocess
import sys
import textwrap
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "ipython_ext"))

from gpucleanup.park import steps as park  # noqa: E402

WORKER = textwrap.dedent('''
    import sys, json
    ns = {}
    for line in sys.stdin:
        try:
            exec(json.loads(line), ns)
            out = {"ok": True, "result": ns.pop("_r", None)}
        except BaseException as exc:
            out = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:400]}
        print(json.dumps(out, default=str), flush=True)
''')


class Worker:
    """A Python process that runs the code it is sent, one JSON reply a request, each waited for at most N s."""

    def __init__(self, env_extra=None):
        env = dict(os.environ)
        env.pop("CUDA_VISIBLE_DEVICES", None)
        env.update(env_extra or {})
        self.proc = subprocess.Popen([sys.executable, "-c", WORKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, env=env, text=True, bufsize=1)
        self.pid = self.proc.pid

    def run(self, code: str, timeout: float = 120.0) -> dict:
        started = time.monotonic()
        try:
            self.proc.stdin.write(json.dumps(textwrap.dedent(code)) + "\n")
            self.proc.stdin.flush()
        except OSError as exc:
            return {"ok": False, "error": f"worker gone ({exc})", "seconds": 0.0}
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            return {"ok": False, "error": f"no answer in {timeout:.0f} s", "seconds": round(time.monotonic() - started, 2)}
        line = self.proc.stdout.readline()
        if not line:
            return {"ok": False, "error": f"worker exited ({self.proc.poll()})", "seconds": round(time.monotonic() - started, 2)}
        out = json.loads(line)
        out["seconds"] = round(time.monotonic() - started, 2)
        return out

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass


def usage(pid: int):
    return park.process_gpu_usage(pid)


def steps_of(outcome) -> list:
    return [{k: v for k, v in s.as_dict().items() if v not in (None, False)} for s in outcome.steps]


def cycle(worker: Worker, fact: dict, env=None, limits=park.Limits(restore_s=90.0)) -> bool:
    """Park, then resume, the worker; records each outcome in ``fact``; True when it runs again."""
    fact["before"] = usage(worker.pid)
    try:
        parked = park.park(worker.pid, limits, env=env)
    except park.ParkRefused as exc:
        fact["park"] = {"refused": str(exc)}
        return False
    fact["park"] = {"ok": parked.ok, "state": parked.state, "message": parked.message,
                    "seconds": round(parked.seconds, 2), "steps": steps_of(parked)}
    fact["while_parked"] = usage(worker.pid)
    if not parked.ok:
        return parked.state == park.RUNNING
    resumed = park.resume(worker.pid, limits, env=env)
    fact["resume"] = {"ok": resumed.ok, "state": resumed.state, "message": resumed.message,
                      "seconds": round(resumed.seconds, 2), "steps": steps_of(resumed)}
    fact["after"] = usage(worker.pid)
    return resumed.ok


def torch_two(cross_before: bool, nomap: bool) -> dict:
    fact = {"case": f"torch-{'cross' if cross_before else 'apart'}-{'nomap' if nomap else 'map'}"}
    worker = Worker()
    try:
        setup = ('import torch\n'
                 'a = torch.arange(1 << 28, dtype=torch.float32, device="cuda:0")\n')
        setup += ('b = a.to("cuda:1")\n' if cross_before else
                  'b = torch.arange(1 << 28, dtype=torch.float32, device="cuda:1")\n')
        setup += ('torch.cuda.synchronize(0); torch.cuda.synchronize(1)\n'
                  '_r = {"a": float(a.sum()), "b": float(b.sum()), "peer": torch.cuda.can_device_access_peer(0, 1)}\n')
        fact["setup"] = worker.run(setup)
        if not fact["setup"].get("ok"):
            return fact
        env = dict(os.environ, GPUCLEANUP_PARK_RESTORE_MAP="none") if nomap else None
        fact["runs_again"] = cycle(worker, fact, env)
        fact["check"] = worker.run('_r = {"a": float(a.sum()), "b": float(b.sum())}', timeout=60)
        fact["equal"] = fact["check"].get("result") == {"a": fact["setup"]["result"]["a"],
                                                        "b": fact["setup"]["result"]["b"]}
        fact["cross_after"] = worker.run('''
            c = b.to("cuda:0"); d = a.to("cuda:1"); torch.cuda.synchronize(0); torch.cuda.synchronize(1)
            _r = bool(torch.equal(c, a)) and bool(torch.equal(d.cpu(), b.cpu()))
            ''', timeout=60)
        fact["cross_after_again"] = worker.run('''
            c = b.to("cuda:0"); torch.cuda.synchronize(0); _r = bool(torch.equal(c, a))
            ''', timeout=60)
        if not fact.get("runs_again"):
            fact["state_at_end"] = park.state(worker.pid).as_dict()
    finally:
        worker.close()
    return fact


def jax_two() -> dict:
    fact = {"case": "jax-two-map"}
    refusal = park.unrestorable_refusal
    park.unrestorable_refusal = lambda *args: None  # the fact wanted is the driver's own answer
    worker = Worker({"XLA_PYTHON_CLIENT_ALLOCATOR": "platform"})
    try:
        fact["setup"] = worker.run('''
            import jax, jax.numpy as jnp
            d = jax.devices()
            x = jax.device_put(jnp.arange(1 << 26, dtype=jnp.float32), d[0])
            y = jax.device_put(x, d[1])
            _r = {"devices": len(d), "x": float(x.sum()), "y": float(y.sum())}
            ''', timeout=180)
        if not fact["setup"].get("ok"):
            return fact
        fact["runs_again"] = cycle(worker, fact)
        fact["check"] = worker.run('''
            z = jax.device_put(y, d[0])
            _r = {"x": float(x.sum()), "y": float(y.sum()), "z": float(z.sum())}
            ''', timeout=60)
        want = fact["setup"]["result"]
        fact["equal"] = fact["check"].get("result") == {"x": want["x"], "y": want["y"], "z": want["y"]}
        if not fact.get("runs_again"):
            fact["state_at_end"] = park.state(worker.pid).as_dict()
    finally:
        park.unrestorable_refusal = refusal
        worker.close()
    return fact


def gpu_tight(spare_mib: int) -> dict:
    """Parked with 5 GiB; another process then leaves free only what the park freed plus ``spare_mib``."""
    fact = {"case": f"gpu-tight-{spare_mib}"}
    worker = Worker()
    hog = None
    try:
        fact["setup"] = worker.run('''
            import torch
            a = torch.full((5 << 28,), 3.0, dtype=torch.float32, device="cuda:0")
            torch.cuda.synchronize(0)
            _r = float(a.sum())
            ''')
        fact["before"] = usage(worker.pid)
        parked = park.park(worker.pid)
        fact["park"] = {"ok": parked.ok, "seconds": round(parked.seconds, 2), "parked_bytes": parked.parked_bytes}
        if not parked.ok:
            return fact
        need = sum((fact["before"] or {}).values())
        hog = Worker()
        fact["hog"] = hog.run(f'''
            import torch
            free, total = torch.cuda.mem_get_info(0)
            h = torch.empty(free - {need} - ({spare_mib} << 20), dtype=torch.uint8, device="cuda:0")
            free2, _ = torch.cuda.mem_get_info(0)
            _r = {{"free_after": free2}}
            ''')
        smi = subprocess.run(["nvidia-smi", "--query-gpu=index,memory.free", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30).stdout
        fact["smi_free_mib"] = smi.strip()
        resumed = park.resume(worker.pid, park.Limits(restore_s=60.0))
        fact["resume"] = {"ok": resumed.ok, "state": resumed.state, "message": resumed.message,
                          "steps": steps_of(resumed)}
        fact["check"] = worker.run("torch.cuda.synchronize(0); _r = float(a.sum())", timeout=60)
        fact["equal"] = fact["check"].get("result") == fact["setup"]["result"]
    finally:
        if hog is not None:
            hog.close()
        worker.close()
    return fact


def gpu_taken() -> dict:
    fact = {"case": "gpu-taken"}
    worker = Worker()
    hog = None
    try:
        fact["setup"] = worker.run('''
            import torch
            a = torch.full((5 << 28,), 3.0, dtype=torch.float32, device="cuda:0")
            torch.cuda.synchronize(0)
            _r = float(a.sum())
            ''')
        if not fact["setup"].get("ok"):
            return fact
        try:
            parked = park.park(worker.pid)
        except park.ParkRefused as exc:
            fact["park"] = {"refused": str(exc)}
            return fact
        fact["park"] = {"ok": parked.ok, "seconds": round(parked.seconds, 2), "state": parked.state}
        if not parked.ok:
            return fact
        hog = Worker()
        fact["hog"] = hog.run('''
            import torch
            free, total = torch.cuda.mem_get_info(0)
            take = free - (1 << 30)
            h = torch.empty(take, dtype=torch.uint8, device="cuda:0")
            free2, _ = torch.cuda.mem_get_info(0)
            _r = {"took": take, "free_after": free2}
            ''')
        limits = park.Limits(restore_s=60.0)
        started = time.monotonic()
        first = park.resume(worker.pid, limits)
        fact["resume_while_taken"] = {"ok": first.ok, "state": first.state, "message": first.message,
                                      "seconds": round(time.monotonic() - started, 2), "steps": steps_of(first)}
        fact["state_while_taken"] = park.state(worker.pid).as_dict()
        hog.close()
        hog = None
        time.sleep(2.0)
        started = time.monotonic()
        second = park.resume(worker.pid, limits)
        fact["resume_after_freed"] = {"ok": second.ok, "state": second.state, "message": second.message,
                                      "seconds": round(time.monotonic() - started, 2), "steps": steps_of(second)}
        fact["check"] = worker.run("torch.cuda.synchronize(0); _r = float(a.sum())", timeout=60)
        fact["equal"] = fact["check"].get("result") == fact["setup"]["result"]
    finally:
        if hog is not None:
            hog.close()
        worker.close()
    return fact


def gpu_count() -> int:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=uuid", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return len([line for line in out.splitlines() if line.strip()])


CASES = {
    "gpu-taken": (1, gpu_taken),
    "gpu-tight-1024": (1, lambda: gpu_tight(1024)),
    "gpu-tight-256": (1, lambda: gpu_tight(256)),
    "torch-cross-map": (2, lambda: torch_two(True, False)),
    "torch-apart-map": (2, lambda: torch_two(False, False)),
    "jax-two-map": (2, jax_two),
    "torch-cross-nomap": (2, lambda: torch_two(True, True)),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json")
    parser.add_argument("--only", nargs="*")
    args = parser.parse_args()
    gpus = gpu_count()
    facts = []
    for name, (needs, run) in CASES.items():
        if args.only and name not in args.only:
            continue
        if gpus < needs:
            fact = {"case": name, "skipped": f"needs {needs} GPUs, {gpus} seen"}
        else:
            started = time.monotonic()
            try:
                fact = run()
            except Exception as exc:  # a case's own fault is a fact too, the next case still runs
                fact = {"case": name, "error": f"{type(exc).__name__}: {exc}"}
            fact["case_seconds"] = round(time.monotonic() - started, 1)
        facts.append(fact)
        print("FACT " + json.dumps(fact), flush=True)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump({"gpus": gpus, "facts": facts}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
