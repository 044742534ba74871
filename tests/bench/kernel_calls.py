#!/usr/bin/env python3
"""What gpucleanup does per cell, counted: calls into libgpucleanup, driver calls, JSON, threads, namespace walks.

Runs N cells ("x += 1" after a scenario's set-up) in an in-process IPython
InteractiveShell with %load_ext gpucleanup, after a few warm-up cells, and
prints one line per counter, "<counter>: per cell: N", with the same cells
without the extension ("bare") alongside. Each scenario and mode runs in a
child process of its own (fresh shell, fresh library state).

Counters (differences over the N measured cells, divided by N):
  ctypes calls into libgpucleanup   every function of the loaded CDLL (ctypes)
                                    wrapped by a counting Python callable;
                                    one line per symbol called
  gpucleanup._native functions      the module's Python functions (probe,
                                    snapshot, drain, server_*), counted however
                                    they are referenced
  driver calls                      the fake driver's "calls.<entry>" counters
                                    (fake_cuda_state_json) read through ctypes
                                    from the same libcuda.so.1 that
                                    libgpucleanup loaded; absent with a real driver
  JSON encodes / decodes            json.dumps/dump and json.loads/load calls,
                                    split by calling module (gpucleanup.* or not)
  threads started                   threading.Thread.start calls (by thread name);
                                    OS threads of the process before/after
  namespace walks                   calls of find_gpu_objects,
                                    gpu_holder_names wherever they live in
                                    gpucleanup.* (absent when none exists)
  IPython history writeouts         HistoryManager.writeout_cache calls

Functions are counted by swapping their __code__ for a trampoline, so a call
counts whatever name or default argument holds the function. Everything is
looked up defensively: what a refactored extension no longer has reads
"absent", never an error.

Scenarios (default: cuda-unused, device-in-use, names-10000 with the fake
driver; cuda-unused, cupy-idle, torch-idle, names-10000 with a real one):
  cuda-unused     nothing initialised CUDA (fake: "initialized": false)
  device-in-use   fake driver only: device 0's primary context active
  cupy-idle       CuPy in use, a small array alive (real driver)
  torch-idle      PyTorch in use, a small tensor alive (real driver)
  names-N         N small objects bound to names, CUDA in use (fake device,
                  else CuPy or PyTorch when usable)

Driver: --driver auto (default) takes the real one where nvidia-smi exists,
else the fake (build/tests/fake_cuda/libcuda.so.1, or --fake-driver) when it
is built, else the real one (then "no CUDA driver": the extension stays idle).

Usage: python tests/bench/kernel_calls.py [--cells N] [--scenario NAME ...] [--driver auto|fake|real]
       [--fake-driver PATH] [--no-bare] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, List, Optional

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_FAKE = ROOT / os.environ.get("GPUCLEANUP_BUILD_DIR", "build") / "tests" / "fake_cuda" / "libcuda.so.1"
FAKE_IN_USE = {"devices": [{"name": "Fake H100", "primary_active": True, "default_pool": {"reserved_bytes": 0, "used_bytes": 0}}]}
FAKE_UNUSED = {"initialized": False}
FW_SETUP = {
    "cupy": "import cupy as cp\na_small = cp.ones(1024, dtype=cp.float32)\ncp.cuda.Device(0).synchronize()\n",
    "torch": "import torch\na_small = torch.ones(1024, device='cuda')\ntorch.cuda.synchronize()\n",
    "fake": "",
    "none": "",
}
WALKS = ("find_gpu_objects", "gpu_holder_names")


# ------------------------------------------------------------------ child: one scenario, one mode


def child(spec: dict) -> dict:
    import collections
    import ctypes
    import threading
    import time
    import types

    counts: collections.Counter = collections.Counter()
    thread_names: collections.Counter = collections.Counter()
    notes: List[str] = []

    def instrument(func: Any, key: str) -> bool:
        """Count calls of a Python function, however it is referenced: its __code__ becomes a trampoline."""
        func = getattr(func, "__func__", func)
        if not isinstance(func, types.FunctionType) or getattr(func, "_kernel_calls_key", None):
            return False
        if func.__code__.co_freevars:
            notes.append(f"{key}: a closure, not counted")
            return False
        clone = types.FunctionType(func.__code__, func.__globals__, func.__name__, func.__defaults__, func.__closure__)
        clone.__kwdefaults__ = func.__kwdefaults__
        clone._kernel_calls_key = f"{key} (original)"  # never instrumented itself
        g = func.__globals__
        orig_name = f"_kernel_calls_orig_{id(func)}"
        g[orig_name] = clone
        g["_kernel_calls_counts"] = counts
        src = (f"def {func.__name__}(*args, **kwargs):\n"
               f"    _kernel_calls_counts[{key!r}] += 1\n"
               f"    return {orig_name}(*args, **kwargs)\n")
        ns: dict = {}
        exec(compile(src, f"<kernel_calls {key}>", "exec"), g, ns)
        func.__code__ = ns[func.__name__].__code__
        func.__defaults__ = None
        func.__kwdefaults__ = None
        func._kernel_calls_key = key
        return True

    # threads
    original_start = threading.Thread.start

    def counted_start(self, *a, **k):
        counts["threads.started"] += 1
        thread_names[self.name.split("-")[0] if self.name.startswith("Thread-") else self.name] += 1
        return original_start(self, *a, **k)

    threading.Thread.start = counted_start

    # JSON, split by the calling module (before gpucleanup is imported: "from json import x" gets the wrapper)
    for fname, kind in (("dumps", "encode"), ("dump", "encode"), ("loads", "decode"), ("load", "decode")):
        original = getattr(json, fname)

        def wrapper(*a, _original=original, _kind=kind, **k):
            caller = sys._getframe(1).f_globals.get("__name__", "") or ""
            if caller != "json":  # json.load calls json.loads: one count
                group = "gpucleanup" if caller.split(".")[0] == "gpucleanup" else "other"
                counts[f"json.{_kind}.{group}"] += 1
            return _original(*a, **k)

        setattr(json, fname, wrapper)

    # the fake driver's counters
    fake = None
    if spec.get("fake"):
        try:
            fake = ctypes.CDLL(spec["fake"], mode=os.RTLD_LOCAL)
            fake.fake_cuda_state_json.restype = ctypes.c_char_p
            fake.fake_cuda_state_json.argtypes = []
        except Exception as exc:
            notes.append(f"fake driver counters unavailable: {exc}")
            fake = None

    def driver_counters() -> Optional[Dict[str, int]]:
        if fake is None:
            return None
        try:
            state = json.loads(fake.fake_cuda_state_json().decode())
        except Exception as exc:
            notes.append(f"fake_cuda_state_json failed: {exc}")
            return None
        return {k: int(v) for k, v in (state.get("counters") or {}).items() if k.startswith("calls.") or k == "cuInit"}

    def last_pid() -> Optional[int]:
        """The PID namespace's most recently created task (threads included): /proc/loadavg's last field."""
        try:
            with open("/proc/loadavg") as fh:
                return int(fh.read().split()[-1])
        except (OSError, ValueError, IndexError):
            return None

    def os_threads() -> Optional[int]:
        try:
            return len(os.listdir("/proc/self/task"))
        except OSError:
            return None

    import contextlib
    import io

    from IPython.core import history as ipy_history
    from IPython.core.interactiveshell import InteractiveShell

    original_writeout = getattr(ipy_history.HistoryManager, "writeout_cache", None)
    if original_writeout is not None:  # called by IPython's history-saving thread, through the instance
        def counted_writeout(self, *a, **k):
            counts["history.writeout_cache"] += 1
            return original_writeout(self, *a, **k)

        ipy_history.HistoryManager.writeout_cache = counted_writeout

    shell = InteractiveShell.instance()
    sink = io.StringIO()

    def run(code: str) -> float:
        t0 = time.perf_counter()
        with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
            result = shell.run_cell(code, store_history=True)
        elapsed = time.perf_counter() - t0
        if result.error_before_exec or result.error_in_exec:
            raise SystemExit(f"cell failed: {result.error_before_exec or result.error_in_exec!r}\n{sink.getvalue()[-3000:]}")
        return elapsed

    found: Dict[str, Any] = {"walks": {}, "native_functions": [], "cdll_symbols": []}
    if spec["mode"] == "gpucleanup":
        # load the library ourselves first, so its functions are wrapped before anything caches them
        try:
            import gpucleanup._native as native  # noqa: F401
        except Exception as exc:
            native = None
            notes.append(f"gpucleanup._native not importable: {type(exc).__name__}: {exc}")
        if native is not None and callable(getattr(native, "library", None)):
            try:
                native.library()
            except Exception as exc:
                notes.append(f"_native.library() failed: {type(exc).__name__}: {exc}")
    run(spec["setup"])
    if spec["mode"] == "gpucleanup":
        wrap_everything(found, instrument, counts, notes)
        run("%load_ext gpucleanup")
        wrap_everything(found, instrument, counts, notes)  # modules imported by the load
        loaded = [l for l in sink.getvalue().splitlines() if l.startswith("gpucleanup")]
        found["load_lines"] = loaded[-3:]
    for _ in range(spec["warmup"]):
        run(spec["cell"])
    if spec["mode"] == "gpucleanup":
        wrap_everything(found, instrument, counts, notes)  # modules imported lazily by the first cells

    before = dict(counts)
    before_names = dict(thread_names)
    drv_before = driver_counters()
    threads_before = os_threads()
    pid_before = last_pid()
    times = []
    for _ in range(spec["cells"]):
        times.append(run(spec["cell"]))
    time.sleep(0.2)  # background releases end
    after = dict(counts)
    drv_after = driver_counters()
    pid_after = last_pid()
    threads_after = os_threads()
    diff = {k: after.get(k, 0) - before.get(k, 0) for k in set(after) | set(before)}
    names = {k: thread_names.get(k, 0) - before_names.get(k, 0) for k in thread_names}
    driver = None
    if drv_after is not None and drv_before is not None:
        driver = {k: drv_after.get(k, 0) - drv_before.get(k, 0) for k in set(drv_after) | set(drv_before)}
    return {
        "cells": spec["cells"],
        "run_cell_median_ms": round(statistics.median(times) * 1e3, 4) if times else None,
        "counts": diff,
        "thread_names": {k: v for k, v in names.items() if v},
        "driver": driver,
        "os_threads": [threads_before, threads_after],
        "tasks_created": (pid_after - pid_before) if pid_after is not None and pid_before is not None and pid_after >= pid_before else None,
        "found": found,
        "notes": notes,
        "last_lines": [l for l in sink.getvalue().splitlines() if l.startswith("gpucleanup")][-2:],
    }


def wrap_everything(found: dict, instrument, counts, notes: List[str]) -> None:
    """Wrap what gpucleanup has now: its CDLL's functions, _native's functions, the namespace walks."""
    import ctypes

    modules = {name: mod for name, mod in list(sys.modules.items())
               if mod is not None and (name == "gpucleanup" or name.startswith("gpucleanup."))}
    # ctypes: every CDLL instance held by a gpucleanup module
    for mod in modules.values():
        for value in list(vars(mod).values()):
            if isinstance(value, ctypes.CDLL) and not getattr(value, "_kernel_calls_wrapped", False):
                # ctypes.PyDLL calls keep the interpreter lock; other CDLL calls release it
                kind = "held" if isinstance(value, ctypes.PyDLL) else "released"
                for attr, fn in list(vars(value).items()):
                    if isinstance(fn, ctypes._CFuncPtr):  # noqa: SLF001
                        setattr(value, attr, _counting(fn, f"ctypes.{attr} ({kind})", counts))
                        found["cdll_symbols"].append(attr)
                value._kernel_calls_wrapped = True
    native = modules.get("gpucleanup._native")
    if native is not None:
        for attr, fn in list(vars(native).items()):
            if callable(fn) and getattr(fn, "__module__", None) == native.__name__ and not isinstance(fn, type) \
                    and not attr.startswith(("__", "_kernel_calls")) \
                    and attr not in ("library", "held", "library_path", "_raise", "_declare"):
                if instrument(fn, f"native.{attr}"):
                    found["native_functions"].append(attr)
    for mod_name, mod in modules.items():
        for walk in WALKS:
            fn = vars(mod).get(walk)
            if fn is not None and getattr(fn, "__module__", None) == mod_name and instrument(fn, f"walk.{walk}"):
                found["walks"][walk] = mod_name


def _counting(fn, key: str, counts):
    def call(*a, **k):
        counts[key] += 1
        return fn(*a, **k)

    call.__wrapped__ = fn
    return call


# ------------------------------------------------------------------ parent


def pick_driver(args) -> tuple:
    """("fake", path) or ("real", None)."""
    fake = Path(args.fake_driver) if args.fake_driver else DEFAULT_FAKE
    if args.driver == "fake" or (args.driver == "auto" and args.fake_driver):
        if not fake.exists():
            raise SystemExit(f"kernel_calls: the fake driver is not built at {fake}")
        return "fake", str(fake.resolve())
    if args.driver == "real":
        return "real", None
    if shutil.which("nvidia-smi"):
        return "real", None
    if fake.exists():
        return "fake", str(fake.resolve())
    return "real", None


def usable(python: str, framework: str, env: dict) -> Optional[str]:
    code = {"cupy": "import cupy; assert cupy.cuda.runtime.getDeviceCount() > 0",
            "torch": "import torch; assert torch.cuda.is_available(), 'torch.cuda.is_available() is False'"}[framework]
    try:
        proc = subprocess.run([python, "-c", code], capture_output=True, text=True, env=env, timeout=180)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    if proc.returncode == 0:
        return None
    lines = [l for l in proc.stderr.splitlines() if l.strip()]
    return lines[-1] if lines else f"exit {proc.returncode}"


def scenario_spec(name: str, driver: str, fw: Dict[str, Optional[str]]) -> dict:
    spec: dict = {"setup": "x = 0\n", "cell": "x += 1\n", "fake_scenario": FAKE_IN_USE}
    if name == "cuda-unused":
        spec.update(framework="none", fake_scenario=FAKE_UNUSED)
    elif name == "device-in-use":
        if driver != "fake":
            return {"skip": "needs the fake driver"}
        spec.update(framework="fake")
    elif name in ("cupy-idle", "torch-idle"):
        framework = name.split("-")[0]
        if driver == "fake":
            return {"skip": f"needs {framework} on a real GPU"}
        if fw.get(framework):
            return {"skip": f"{framework} unusable: {fw[framework]}"}
        spec.update(framework=framework)
    elif name.startswith("names-") and name[6:].isdigit():
        n = int(name[6:])
        framework = "fake" if driver == "fake" else next((f for f in ("cupy", "torch") if not fw.get(f)), "none")
        spec.update(framework=framework)
        spec["setup"] += f"get_ipython().user_ns.update({{f'v{{i}}': [i] for i in range({n})}})\n"
    else:
        return {"skip": f"unknown scenario {name}"}
    spec["setup"] = FW_SETUP[spec["framework"]] + spec["setup"]
    return spec


def run_child(spec: dict, env: dict, python: str) -> dict:
    proc = subprocess.run([python, str(Path(__file__).resolve()), "--child", json.dumps(spec)],
                          capture_output=True, text=True, env=env, timeout=900)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    return {"error": f"exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"}


def per_cell(n: int, cells: int) -> str:
    return f"{n / cells:.3f}" if cells else "-"


def report(name: str, desc: str, res: Dict[str, dict]) -> List[str]:
    ours, bare = res.get("gpucleanup") or {}, res.get("bare")
    lines = [f"== {name}: {desc}"]
    if "error" in ours:
        return lines + ["  FAILED: " + ours["error"].strip().splitlines()[-1][:300], ours["error"][-1500:]]
    cells = ours["cells"]
    bcells = (bare or {}).get("cells") or 0
    bcounts = (bare or {}).get("counts") or {}
    counts = ours["counts"]

    def line(label: str, n: Optional[int], bare_n: Optional[int] = None, absent: Optional[str] = None) -> None:
        if absent is not None:
            lines.append(f"  {label}: absent ({absent})")
            return
        text = f"  {label}: per cell: {per_cell(n or 0, cells)}"
        if bare is not None and bare_n is not None and "error" not in bare:
            text += f"   (bare: {per_cell(bare_n, bcells)})"
        lines.append(text)

    lines.append(f"  run_cell median: {ours['run_cell_median_ms']} ms over {cells} cells"
                 + (f" (bare: {bare['run_cell_median_ms']} ms)" if bare and "error" not in bare else ""))
    for text in ours.get("found", {}).get("load_lines") or []:
        lines.append(f"  load said: {text[:160]}")
    ctypes_keys = sorted(k for k in counts if k.startswith("ctypes."))
    found = ours.get("found") or {}
    if found.get("cdll_symbols"):
        line("ctypes calls into libgpucleanup", sum(counts[k] for k in ctypes_keys), 0)
        line("  of which release the interpreter lock", sum(counts[k] for k in ctypes_keys if k.endswith("(released)")), 0)
        for k in ctypes_keys:
            if counts[k]:
                line(f"  {k[7:]}", counts[k])
    else:
        line("ctypes calls into libgpucleanup", None, absent="no loaded CDLL found in gpucleanup's modules")
    native_keys = sorted(k for k in counts if k.startswith("native."))
    if found.get("native_functions"):
        line("gpucleanup._native function calls", sum(counts[k] for k in native_keys), 0)
        for k in native_keys:
            if counts[k]:
                line(f"  {k[7:]}()", counts[k])
    else:
        line("gpucleanup._native function calls", None, absent="no functions found in gpucleanup._native")
    driver = ours.get("driver")
    if driver is None:
        line("driver calls", None, absent="real driver: no call counters" if not ours.get("fake") else "fake counters unreadable")
    else:
        line("driver calls", sum(v for k, v in driver.items() if k.startswith("calls.")), sum(
            v for k, v in ((bare or {}).get("driver") or {}).items() if k.startswith("calls.")))
        for k in sorted(driver):
            if driver[k]:
                line(f"  {k[6:] if k.startswith('calls.') else k}", driver[k])
    line("JSON encodes by gpucleanup", counts.get("json.encode.gpucleanup", 0), bcounts.get("json.encode.gpucleanup", 0))
    line("JSON decodes by gpucleanup", counts.get("json.decode.gpucleanup", 0), bcounts.get("json.decode.gpucleanup", 0))
    line("JSON encodes by others (IPython, ...)", counts.get("json.encode.other", 0), bcounts.get("json.encode.other", 0))
    line("JSON decodes by others (IPython, ...)", counts.get("json.decode.other", 0), bcounts.get("json.decode.other", 0))
    line("threads started", counts.get("threads.started", 0), bcounts.get("threads.started", 0))
    for tname, n in sorted((ours.get("thread_names") or {}).items()):
        line(f"  {tname}", n)
    ot = ours.get("os_threads") or [None, None]
    bt = (bare or {}).get("os_threads") or [None, None]
    lines.append(f"  OS threads of the process: {ot[0]} before, {ot[1]} after" + (f"   (bare: {bt[0]}, {bt[1]})" if bare else ""))
    tc, btc = ours.get("tasks_created"), (bare or {}).get("tasks_created")
    if tc is not None:
        line("tasks created in the PID namespace (native threads included; other processes' too, compare bare)", tc, btc)
    walks = found.get("walks") or {}
    if walks:
        line("namespace walks", sum(counts.get(f"walk.{w}", 0) for w in WALKS), 0)
        for w in WALKS:
            if w in walks:
                line(f"  {w} ({walks[w]})", counts.get(f"walk.{w}", 0))
    else:
        line("namespace walks", None, absent=f"none of {', '.join(WALKS)} found in gpucleanup's modules")
    if "history.writeout_cache" in counts or "history.writeout_cache" in bcounts:
        line("IPython history writeouts", counts.get("history.writeout_cache", 0), bcounts.get("history.writeout_cache", 0))
    else:
        line("IPython history writeouts", 0, 0)
    for note in ours.get("notes") or []:
        lines.append(f"  note: {note}")
    if bare is not None and "error" in bare:
        lines.append("  bare run FAILED: " + bare["error"].strip().splitlines()[-1][:300])
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n", 2)[2])
    parser.add_argument("--cells", type=int, default=200, help="measured cells (default 200)")
    parser.add_argument("--warmup", type=int, default=5, help="cells before counting (default 5)")
    parser.add_argument("--scenario", action="append", default=[], help="scenario(s), comma separated or repeated")
    parser.add_argument("--driver", choices=("auto", "fake", "real"), default="auto")
    parser.add_argument("--fake-driver", help=f"the fake libcuda.so.1 (default {DEFAULT_FAKE})")
    parser.add_argument("--no-bare", action="store_true", help="skip the runs without the extension")
    parser.add_argument("--python", default=sys.executable, help="interpreter of the runs (default: this one)")
    parser.add_argument("--json", help="write the counts here")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(json.loads(args.child))))
        return 0

    driver, fake_path = pick_driver(args)
    base_env = {k: v for k, v in os.environ.items() if not k.startswith(("GPUCLEANUP_FAKE_CUDA", "JPY_"))}
    if base_env.get("PYTHONPATH"):
        base_env["PYTHONPATH"] = os.pathsep.join(os.path.abspath(p) for p in base_env["PYTHONPATH"].split(os.pathsep) if p)
    for key in ("GPUCLEANUP_LIBRARY", "GPUCLEANUP_LIBCUDA"):
        if base_env.get(key) and os.sep in base_env[key]:
            base_env[key] = os.path.abspath(base_env[key])
    fw: Dict[str, Optional[str]] = {}
    if driver == "real":
        fw = {f: usable(args.python, f, base_env) for f in ("cupy", "torch")}
    names = [n for item in args.scenario for n in item.split(",") if n.strip()] or (
        ["cuda-unused", "device-in-use", "names-10000"] if driver == "fake" else ["cuda-unused", "cupy-idle", "torch-idle", "names-10000"])
    print(f"kernel_calls: {driver} driver" + (f" {fake_path}" if fake_path else "")
          + ("; " + ", ".join(f"{k}: {'usable' if v is None else v}" for k, v in fw.items()) if fw else ""))
    out: Dict[str, Any] = {"driver": driver, "fake_driver": fake_path, "frameworks": fw, "scenarios": {}}
    tmp = Path(tempfile.mkdtemp(prefix="gpucleanup-kernel-calls-"))
    try:
        for name in names:
            spec = scenario_spec(name.strip(), driver, fw)
            if "skip" in spec:
                print(f"== {name}: skipped ({spec['skip']})")
                out["scenarios"][name] = {"skipped": spec["skip"]}
                continue
            env = dict(base_env, IPYTHONDIR=str(tmp / name / "ipython"), JUPYTER_RUNTIME_DIR=str(tmp / "runtime"))
            (tmp / name / "ipython").mkdir(parents=True, exist_ok=True)
            (tmp / "runtime").mkdir(parents=True, exist_ok=True)
            if driver == "fake":
                env["GPUCLEANUP_LIBCUDA"] = fake_path
                env["GPUCLEANUP_FAKE_CUDA_SCENARIO"] = json.dumps(spec["fake_scenario"])
            res: Dict[str, dict] = {}
            for mode in ("gpucleanup",) + (() if args.no_bare else ("bare",)):
                child_spec = dict(mode=mode, setup=spec["setup"], cell=spec["cell"], cells=args.cells, warmup=args.warmup,
                                  fake=fake_path if driver == "fake" else None)
                res[mode] = run_child(child_spec, env, args.python)
                res[mode]["fake"] = bool(fake_path)
            desc = (f"{'fake' if driver == 'fake' else 'real'} driver, framework {spec['framework']}, "
                    f"{args.cells} cells of {spec['cell'].strip()!r}, gpucleanup loaded")
            for text in report(name, desc, res):
                print(text)
            out["scenarios"][name] = res
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)
    return 0 if not any("error" in r.get("gpucleanup", {}) for r in out["scenarios"].values() if isinstance(r, dict)) else 1


if __name__ == "__main__":
    sys.exit(main())
