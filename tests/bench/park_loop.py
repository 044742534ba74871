"""Park and resume one real kernel again and again, and count the kernels lost (GPU machine only).

A kernel with gpucleanup loaded the README's way (``c.InteractiveShellApp.extensions`` in the kernel's config
file) fills device memory with a framework (JAX: a jitted function on one visible GPU, whose XLA threads poll
their streams; PyTorch; CuPy), keeps a SHA-256 of it, and then, run after run: a cell runs the framework's work,
the kernel is parked from outside (``gpucleanup park PID``) at once or after ``--pause`` seconds idle, and the next
cell (or ``gpucleanup resume PID`` with ``--resume outside``) brings it back; that cell checks every byte. A kernel
that dies is counted lost, its output's last lines kept, and a fresh one takes its place.

    python tests/bench/park_loop.py --framework jax --runs 50 --pause 0 --json out.json

``--park kernel`` parks from inside instead (``%gpumem --park``, as the kernel's own idle park does), which holds a JAX
kernel's own threads while it is parked (gpucleanup.park.parked_hold). ``--hold off`` sets GPUCLEANUP_PARK_HOLD=off for the kernel and the commands: the restore then runs while the
kernel's other threads run too, as before the hold (the control arm). Prints one line per run and a summary;
``--json`` writes every run. Bounded by ``--budget`` seconds (runs not started past it are not counted).
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
import kernel_harness  # noqa: E402

FILL = {
    "jax": ("import jax, jax.numpy as jnp, numpy as np, hashlib\n"
            "data = jax.random.uniform(jax.random.PRNGKey(7), ({count},), dtype='float32')\n"
            "work = jax.jit(lambda x: (jnp.sin(x) * 2.0 + x).sum())\n"
            "def step(): return float(work(data).block_until_ready())\n"
            "def digest(): return hashlib.sha256(np.asarray(data).tobytes()).hexdigest()\n"),
    "torch": ("import torch, hashlib\n"
              "g = torch.Generator(device='cuda').manual_seed(7)\n"
              "data = torch.rand({count}, device='cuda', generator=g)\n"
              "def step(): return float((torch.sin(data) * 2.0 + data).sum())\n"
              "def digest(): return hashlib.sha256(data.cpu().numpy().tobytes()).hexdigest()\n"),
    "cupy": ("import cupy as cp, hashlib\n"
             "data = cp.random.default_rng(7).random({count}, dtype=cp.float32)\n"
             "def step(): return float((cp.sin(data) * 2.0 + data).sum())\n"
             "def digest(): return hashlib.sha256(cp.asnumpy(data).tobytes()).hexdigest()\n"),
    # a dry run of this script on the fake driver (GPUCLEANUP_LIBCUDA and GPUCLEANUP_FAKE_CUDA_CHECKPOINT_DIR set)
    "fake": ("import hashlib\n"
             "data = bytes({count} % 251 for _ in range(1024))\n"
             "def step(): return float(len(data))\n"
             "def digest(): return hashlib.sha256(data).hexdigest()\n"),
}


def kernel_env(tmp: Path, framework: str, hold: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JPY_", "JUPYTER_"))}
    env["JUPYTER_RUNTIME_DIR"] = str(tmp / "runtime")
    env["IPYTHONDIR"] = str(tmp / "ipython")
    profile = tmp / "ipython" / "profile_default"
    profile.mkdir(parents=True, exist_ok=True)
    # the README's set-up: gpucleanup in every kernel through the kernel's config file
    (profile / "ipython_kernel_config.py").write_text("c.InteractiveShellApp.extensions = ['gpucleanup']\n")
    if framework == "jax":
        env["CUDA_VISIBLE_DEVICES"] = env.get("CUDA_VISIBLE_DEVICES", "0")
        env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = env.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.02")
    if hold == "off":  # the control arm: a JAX kernel whose threads are not held is refused without the opt-in
        env["GPUCLEANUP_PARK_HOLD"] = "off"
        env["GPUCLEANUP_PARK_UNPROVEN"] = "jax"
    preload = os.environ.get("GPUCLEANUP_TEST_CRASH_BACKTRACE")
    if preload and os.path.exists(preload):
        env["LD_PRELOAD"] = " ".join(p for p in (preload, env.get("LD_PRELOAD", "")) if p)
    return env


def cli(env: dict, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpucleanup.outside.cli", *args], capture_output=True, text=True,
                          env=env, timeout=timeout)


class Session:
    """One kernel, filled and checked; replaced when it dies."""

    def __init__(self, tmp: Path, framework: str, hold: str, count: int):
        self.output = tmp / f"kernel-{time.monotonic_ns()}.txt"
        self.env = kernel_env(tmp, framework, hold)
        with open(self.output, "wb") as out:
            self.kernel = kernel_harness.Kernel(self.env, python=sys.executable, cwd=tmp, stdout=out, stderr=out,
                                                ready=120, timeout=300)
        cell = self.kernel.execute(FILL[framework].format(count=count) + "before = digest(); print(step())",
                                   300, watch=True)
        if cell.error_line:
            raise RuntimeError(f"the fill failed: {cell.error_line}")

    def tail(self) -> str:
        text = self.output.read_text(errors="replace") if self.output.exists() else ""
        return text[-4000:]

    def close(self) -> None:
        try:
            self.kernel.stop()
        except Exception:
            pass


def park_in_kernel(kernel) -> tuple:
    """``%gpumem --park`` in a cell: (whether it parked, the line it printed)."""
    cell = kernel.execute("%gpumem --park", 300, watch=True)
    lines = [x for x in cell.printed.splitlines() if "gpucleanup" in x and "park" in x and "as soon as" not in x]
    line = lines[-1] if lines else cell.printed[-600:]
    return "· parked " in line, line


def one_run(session: Session, pause: float, resume: str, parked_s: float = 0.0, park_by: str = "outside") -> dict:
    kernel = session.kernel
    out: dict = {}
    try:
        cell = kernel.execute("print(step())", 300, watch=True)
    except kernel_harness.KernelDied:  # a park that failed may still have parked it (its answer came too late)
        return {"outcome": "lost", "before_park": True, "exit": kernel.exit_status(), "tail": session.tail()}
    except queue.Empty:
        return {"outcome": "hung", "before_park": True, "tail": session.tail()}
    if cell.error_line:
        return {"outcome": "error", "why": cell.error_line}
    if pause:
        time.sleep(pause)
    started = time.monotonic()
    if park_by == "kernel":
        try:
            ok, line = park_in_kernel(kernel)
        except kernel_harness.KernelDied:
            return dict(out, outcome="lost", while_parking=True, exit=kernel.exit_status(), tail=session.tail())
        except queue.Empty:
            return dict(out, outcome="hung", while_parking=True, tail=session.tail())
        out["park_s"] = round(time.monotonic() - started, 3)
        out["park_line"] = line
        if not ok:
            return dict(out, outcome="park failed", why=line)
    else:
        parked = cli(session.env, "park", str(kernel.pid), "--json")
        out["park_s"] = round(time.monotonic() - started, 3)
        if parked.returncode != 0:
            return dict(out, outcome="park refused" if parked.returncode == 4 else "park failed",
                        why=(parked.stdout + parked.stderr)[-600:])
        try:
            out["parked_bytes"] = json.loads(parked.stdout).get("parked_bytes")
        except ValueError:
            pass
    if parked_s:
        time.sleep(parked_s)
    # the process's state before any resume: None while it runs (a kernel that died while parked, before any
    # resume was asked for, was not lost by the resume)
    out["exit_before_resume"] = kernel.exit_status()
    started = time.monotonic()
    if resume == "outside":
        resumed = cli(session.env, "resume", str(kernel.pid), "--json")
        out["resume_rc"] = resumed.returncode
        try:
            steps = json.loads(resumed.stdout).get("steps") or []
            out["hold"] = next((s.get("hold") for s in steps if s.get("name") == "restore"), None)
        except ValueError:
            pass
    try:
        cell = kernel.execute("print(digest() == before, step())", 300, watch=True)
    except kernel_harness.KernelDied:
        return dict(out, outcome="lost", exit=kernel.exit_status(), tail=session.tail())
    except queue.Empty:
        return dict(out, outcome="hung", tail=session.tail())
    out["resume_s"] = round(time.monotonic() - started, 3)
    lines = cell.printed.splitlines()
    out["line"] = next((line for line in lines if line.startswith("gpucleanup · resumed")), None)
    if resume == "cell" and out["line"]:
        out["hold"] = {"held": "ran during the restore" not in out["line"]}  # the line says when it was not held
    equal = any(line.startswith("True ") for line in lines)
    out["outcome"] = "ok" if equal and not cell.error_line else "wrong"
    if out["outcome"] != "ok":
        out["why"] = cell.error_line or cell.printed[-600:]
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--framework", choices=sorted(FILL), default="jax")
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--pause", type=float, default=0.0, help="seconds idle between the cell and the park")
    parser.add_argument("--parked", type=float, default=0.0, help="seconds parked before the resume")
    parser.add_argument("--resume", choices=("cell", "outside"), default="cell")
    parser.add_argument("--hold", choices=("on", "off"), default="on")
    parser.add_argument("--park", choices=("outside", "kernel"), default="outside",
                        help="gpucleanup park PID, or %%gpumem --park in a cell")
    parser.add_argument("--mib", type=int, default=512, help="device memory the kernel fills, MiB")
    parser.add_argument("--budget", type=float, default=480.0)
    parser.add_argument("--json")
    args = parser.parse_args()
    end = time.monotonic() + args.budget
    runs = []
    label = (f"{args.framework} pause {args.pause:g}s park {args.park} parked {args.parked:g}s resume {args.resume} "
             f"hold {args.hold}")
    with tempfile.TemporaryDirectory(prefix="gpucleanup-park-loop-") as tmp:
        session = Session(Path(tmp), args.framework, args.hold, args.mib * (1 << 20) // 4)
        try:
            for run in range(1, args.runs + 1):
                if time.monotonic() >= end:
                    break
                result = one_run(session, args.pause, args.resume, args.parked, args.park)
                result["run"] = run
                runs.append(result)
                brief = {k: v for k, v in result.items() if k not in ("tail",)}
                print(f"park-loop {label} run {run}: {json.dumps(brief)}", flush=True)
                if result["outcome"] in ("lost", "hung"):
                    print(result.get("tail", ""), flush=True)
                    session.close()
                    session = Session(Path(tmp), args.framework, args.hold, args.mib * (1 << 20) // 4)
        finally:
            session.close()
    counts: dict = {}
    for result in runs:
        counts[result["outcome"]] = counts.get(result["outcome"], 0) + 1
    held = sum(1 for r in runs if isinstance(r.get("hold"), dict) and r["hold"].get("held"))
    summary = {"label": label, "runs": len(runs), "outcomes": counts, "held": held}
    print(f"park-loop summary {json.dumps(summary)}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"summary": summary, "runs": runs}, indent=1))
    return 0 if counts.get("ok", 0) == len(runs) else 1


if __name__ == "__main__":
    sys.exit(main())
