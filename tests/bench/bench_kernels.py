#!/usr/bin/env python3
"""Per-cell cost of gpucleanup in real Jupyter kernels, side by side with the alternatives.

Every variant gets a kernel of its own (jupyter_client KernelManager + ipykernel).
The figure is "execute to idle": from sending the execute_request until the
kernel has reported idle on iopub for that request AND its execute_reply has
arrived on the shell channel, i.e. what a frontend waits for. Variants:

  bare            nothing loaded: what the cell costs by itself in a kernel
  gpucleanup      %load_ext gpucleanup (its defaults)
  pasted          the cell followed by the cleanup code people paste at the end of
                  cells: gc.collect() plus, depending on the framework in use,
                  torch.cuda.empty_cache() or CuPy's
                  get_default_memory_pool().free_all_blocks() and
                  get_default_pinned_memory_pool().free_all_blocks()
  ipyexperiments  ipyexperiments' per-cell logger (gc.collect, empty_cache, NVML and
                  an RSS-sampling thread): IPyExperimentsPytorch where CUDA is in use,
                  IPyExperimentsCPU in cuda-unused (the Pytorch one would initialise
                  CUDA there); skipped, with the reason, when it cannot be imported
                  or set up. Its cells cost 20-180 ms, so it runs --ipyx-cells timed
                  cells (default 40), spread over the same rounds as the others

Kernels are started once per variant and framework ("none", "cupy", "torch", or
"fake" with --fake-driver) and shared by the scenarios of that framework, one after
the other: the kernel's first cell loads the tool (%load_ext gpucleanup / the
experiment), the second imports the framework and keeps a small array alive; each
scenario then runs its own set-up (untimed) and, at its end, a teardown (its names
deleted, the framework's pools emptied in every variant, so the next scenario starts
alike). long-session runs last in its group. Cells are run INTERLEAVED: a block of
cells (--block, default 20) on one variant, then a block on the next, round robin
with the starting variant rotated every round, so that drift (CPU clocks, other
load, GPU state) hits every variant alike. Warm-up cells (--warmup) run the same way
first and are not recorded (--warmup, default 5).

Recorded per variant and scenario: every cell's time (JSON), median, p95, the added
time vs bare (difference of medians) and ratios, the kernel process's RSS and thread
count before the timed cells and after them (psutil when importable, else
/proc/<pid>/status), and where CUDA is used: the process's GPU memory from
nvidia-smi (per pid, when nvidia-smi lists it), the framework's pool figures and
gpucleanup.snapshot() of device 0, read through silent user_expressions requests
(silent: no cell hooks run; this imports gpucleanup and loads libgpucleanup in
every kernel; host figures are read first).

Scenarios (--scenario, repeatable or comma separated; default: all that can run here, except
names-10 and blocks-10, which measure the same as cupy-idle within noise; 'all' adds them;
the default run takes about 7.5 minutes on the H100 machine):
  cuda-unused        no framework imported, cell "x += 1"
  torch-idle         PyTorch in use, a small tensor alive, cell "x += 1" (nothing to free)
  rerun-torch-step   a small MLP training step, re-run back to back (--torch-step-cells,
                     default 60: 180-200 ms a cell in the cleaning variants)
  cupy-idle          CuPy in use, a small array alive, cell "x += 1" (nothing to free)
  names-N            N small Python objects ([i]) bound to names (default N = 10,
                     10000, 100000), CUDA in use via CuPy or PyTorch when usable
                     (else the fake driver's device with --fake-driver)
  rerun-cupy-pinned  a CuPy cell staging 64 MiB through pinned memory, re-run back to back
  blocks-N           CuPy's pool with N cached blocks (default N = 10, 1000, 100000):
                     the set-up allocates and frees N small arrays; every timed cell
                     does it again (bare reuses the cached blocks, the cleaning
                     variants gave them back and allocate anew). Fewer cells for
                     large N: max(5, cells * 1000 / N) when N > 1000
  pinned-8g          8 GiB of pinned memory cached (CuPy's pinned pool, else PyTorch's
                     host cache) by a silent request before every timed cell, which
                     is "x += 1": time until the cell reports idle (--pinned-cells,
                     default 3). Also recorded: the silent re-pin (prep_ms), and for
                     gpucleanup and pasted the time from idle until the kernel's RSS
                     fell by the pinned size (release_ms: the memory really given back)
  long-session       --long-cells cells (default 10000) first, pipelined, then the
                     timed cells; the same timed cells also run before them
                     ("early") so growth shows directly. Variants: --long-variants
                     (default bare,gpucleanup: the pasted gc.collect() and
                     ipyexperiments cost 15-130 ms a cell, too long for 10,000)

Without a GPU: --fake-driver build/tests/fake_cuda/libcuda.so.1 sets
GPUCLEANUP_LIBCUDA for the kernels and a fake-driver scenario
(GPUCLEANUP_FAKE_CUDA_SCENARIO): one device in use (CUDA never initialised for
cuda-unused); the framework scenarios then skip. --quick: 30 cells, 5 warm-up,
10 ipyexperiments cells, 300 long-session cells, 2 pinned cells.

Usage: python tests/bench/bench_kernels.py [--scenario NAME ...] [--cells N] [--json PATH]
       [--quick] [--fake-driver PATH] [--variants LIST] [--budget-s S]
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import json
import math
import os
import platform
import queue
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import kernel_harness  # noqa: E402  (tests/kernel_harness.py)

GiB = 1 << 30
MiB = 1 << 20
ROOT = Path(__file__).resolve().parents[2]
VARIANTS = ("bare", "gpucleanup", "pasted", "ipyexperiments")
# Run only when named (--variants), each gpucleanup with one setting changed: where the added time of a cell
# goes, and which release policy a re-run needs.
EXTRA_VARIANTS = {
    "gpucleanup-cell": ["GPUCleanup.release = 'cell'"],  # every cache after every cell (the default before 'rerun')
    "gpucleanup-auto": ["GPUCleanup.release = 'auto'"],  # pinned host pools once idle, device caches per cell
    "gpucleanup-idle": ["GPUCleanup.release = 'idle'"],  # every cache once the kernel has been idle
    "gpucleanup-noserver": ["GPUCleanup.status_server = False"],  # no status endpoint, no state per cell
    # no wait for queued work: the pass runs on the kernel's thread, no hand-off to the device's watchdog (the
    # bound of what asking the driver whether anything is queued, without a wait, can save)
    "gpucleanup-nosettle": ["GPUCleanup.settle_timeout = 0"],
}
EXTRA_VARIANT_NAMES = (*EXTRA_VARIANTS, "gpucleanup-off")
DEFAULT_NAMES = (10, 10_000, 100_000)
DEFAULT_BLOCKS = (10, 1000, 100_000)
# Grouped by framework (one set of kernels per group), the most expensive last.
ALL_ORDER = [
    "cuda-unused",
    "torch-idle",
    "rerun-torch-step",
    "cupy-idle",
    *[f"names-{n}" for n in DEFAULT_NAMES],
    "rerun-cupy-pinned",
    *[f"blocks-{n}" for n in DEFAULT_BLOCKS],
    "pinned-8g",
    "long-session",
]
# The default run (about 7.5 minutes on the H100 machine): names-10 and blocks-10 measure the same as
# cupy-idle within noise (H100: +1.78 and +2.84 ms vs +1.70 ms for gpucleanup), so they run only when named.
DEFAULT_ORDER = [n for n in ALL_ORDER if n not in ("names-10", "blocks-10")]

# fake driver scenarios (tests/fake_cuda/fake_cuda_control.h)
FAKE_IN_USE = {"devices": [{"name": "Fake H100", "primary_active": True, "default_pool": {"reserved_bytes": 0, "used_bytes": 0}}]}
FAKE_UNUSED = {"initialized": False}

# The notebook's first cell per framework: the framework in use, one small array alive.
FW_SETUP = {
    "cupy": "import cupy as cp\nimport cupyx\nimport numpy as np\na_small = cp.ones(1024, dtype=cp.float32)\ncp.cuda.Device(0).synchronize()\n",
    "torch": "import torch\na_small = torch.ones(1024, device='cuda')\ntorch.cuda.synchronize()\n",
    "fake": "",  # the fake driver's scenario has device 0's primary context active
    "none": "",
}
# The boilerplate pasted at the end of each cell.
FW_PASTED = {
    "cupy": "import gc\ngc.collect()\ncp.get_default_memory_pool().free_all_blocks()\ncp.get_default_pinned_memory_pool().free_all_blocks()\n",
    "torch": "import gc\ngc.collect()\ntorch.cuda.empty_cache()\n",
    "fake": "import gc\ngc.collect()\n",
    "none": "import gc\ngc.collect()\n",
}
# Between scenarios, in every variant: the pools emptied, so each scenario starts alike.
FW_RESET = {
    "cupy": "cp.get_default_memory_pool().free_all_blocks()\ncp.get_default_pinned_memory_pool().free_all_blocks()\n",
    "torch": "torch.cuda.empty_cache()\nif hasattr(torch._C, '_host_emptyCache'):\n    torch._C._host_emptyCache()\n",
    "fake": "",
    "none": "",
}
# Per-process pool figures, read with a silent user_expressions request.
FW_POOLS = {
    "cupy": "{'pool_total_bytes': cp.get_default_memory_pool().total_bytes(), "
    "'pool_free_bytes': cp.get_default_memory_pool().free_bytes(), "
    "'pinned_free_blocks': cp.get_default_pinned_memory_pool().n_free_blocks()}",
    "torch": "{'reserved_bytes': torch.cuda.memory_reserved(), 'allocated_bytes': torch.cuda.memory_allocated()}",
}
SNAPSHOT_EXPR = (
    "__import__('json').dumps([{k: d.get(k) for k in ('index', 'name', 'in_use', 'used_bytes', 'free_bytes', 'total_bytes')}"
    " | {'pools_reserved_bytes': sum(int(p.get('reserved_bytes') or 0) for p in d.get('pools') or [])}"
    " for d in __import__('gpucleanup').snapshot().get('devices') or []][:1])"
)


class CellFailed(RuntimeError):
    pass


# ------------------------------------------------------------------ measurements


def percentile(values: List[float], q: float) -> Optional[float]:
    if not values:
        return None
    xs = sorted(values)
    if len(xs) == 1:
        return xs[0]
    pos = (len(xs) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def host_figures(pid: Optional[int]) -> dict:
    """RSS and thread count of a process: psutil when importable, else /proc/<pid>/status."""
    if pid is None:
        return {"error": "no pid"}
    try:
        import psutil  # type: ignore

        proc = psutil.Process(pid)
        return {"rss_bytes": proc.memory_info().rss, "threads": proc.num_threads(), "source": "psutil"}
    except ImportError:
        pass
    except Exception as exc:  # the process is gone
        return {"error": f"{type(exc).__name__}: {exc}"}
    out: dict = {"source": "/proc"}
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    out["rss_bytes"] = int(line.split()[1]) * 1024
                elif line.startswith("Threads:"):
                    out["threads"] = int(line.split()[1])
    except OSError as exc:
        return {"error": str(exc)}
    return out


def nvidia_smi_used_by_pid() -> Optional[Dict[int, int]]:
    """{pid: used GPU memory in bytes} of the compute processes nvidia-smi lists; None without nvidia-smi."""
    exe = shutil.which("nvidia-smi")
    if not exe:
        return None
    try:
        proc = subprocess.run(
            [exe, "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=20,
        )
    except Exception:
        return None
    if proc.returncode != 0:
        return None
    used: Dict[int, int] = {}
    for line in proc.stdout.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) >= 2 and parts[0].isdigit():
            try:
                used[int(parts[0])] = used.get(int(parts[0]), 0) + int(float(parts[1])) * MiB
            except ValueError:
                pass
    return used


def nvidia_smi_machine() -> Optional[str]:
    exe = shutil.which("nvidia-smi")
    if not exe:
        return None
    try:
        proc = subprocess.run([exe, "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=20)
        return proc.stdout.strip() or None
    except Exception:
        return None


# ------------------------------------------------------------------ kernels


class Kernel(kernel_harness.Kernel):
    """One kernel (one variant): start, run cells, measure execute-to-idle (tests/kernel_harness.py)."""

    def __init__(self, variant: str, python: str, env: dict, timeout: float, log: Optional[Path] = None):
        self.variant = variant
        self.log = log
        self._log_fh = None
        output: dict = {}
        if log is not None:  # the kernel's own stdout/stderr (warnings, crashes): a file, shown on failure
            self._log_fh = open(log, "w")
            output.update(stdout=self._log_fh, stderr=subprocess.STDOUT)
        super().__init__(env, python=python, ready=None, timeout=timeout, **output)
        self.pid: Optional[int] = None

    def wait_ready(self) -> None:
        super().wait_ready(max(self.timeout, 120))
        self.pid = int(self.expressions({"pid": "__import__('os').getpid()"})["pid"])

    def log_tail(self, n: int = 1500) -> str:
        try:
            return self.log.read_text(errors="replace")[-n:] if self.log else ""
        except OSError:
            return ""

    def shutdown(self) -> None:
        try:
            with contextlib.suppress(Exception):
                self.stop()
        finally:
            if self._log_fh is not None:
                self._log_fh.close()

    def flush_iopub(self) -> int:
        n = 0
        while True:
            try:
                self.kc.get_iopub_msg(timeout=0)
                n += 1
            except queue.Empty:
                return n

    def run(self, code: str, silent: bool = False, user_expressions: Optional[dict] = None) -> dict:
        """Execute to idle: elapsed_s from sending until both idle (iopub) and the reply (shell) arrived."""
        t0 = time.perf_counter()
        msg_id = self.send(code, silent=silent, user_expressions=user_expressions)
        try:
            cell = self.collect(msg_id, self.timeout, within=t0 + self.timeout - time.perf_counter())
        except queue.Empty as exc:
            raise TimeoutError(f"{self.variant}: {exc}") from None
        elapsed = time.perf_counter() - t0
        said = cell.joined("stdout", "stderr", kernel_harness.GPUCLEANUP)
        if cell.reply.get("status") != "ok":
            err = cell.error or cell.reply
            raise CellFailed(f"{self.variant}: {err.get('ename')}: {err.get('evalue')}\n"
                             + "\n".join(err.get("traceback") or [])[-3000:] + "\n" + said[-2000:])
        return {"elapsed_s": elapsed, "stdout": said, "reply": cell.reply}

    def expressions(self, exprs: Dict[str, str]) -> Dict[str, Any]:
        """Evaluate expressions silently (no cell hooks); values parsed back from their repr."""
        reply = self.run("", silent=True, user_expressions=exprs)["reply"]
        out: Dict[str, Any] = {}
        for key, res in (reply.get("user_expressions") or {}).items():
            if res.get("status") != "ok":
                out[key] = {"error": f"{res.get('ename')}: {res.get('evalue')}"}
                continue
            text = (res.get("data") or {}).get("text/plain", "")
            try:
                value = ast.literal_eval(text)
            except Exception:
                value = text
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except ValueError:
                    pass
            out[key] = value
        return out

    # pipelined requests (set-up in parallel over kernels, the long session): sent with send()
    def wait(self, msg_ids: List[str]) -> None:
        pending = set(msg_ids)
        deadline = time.perf_counter() + self.timeout * max(1, len(msg_ids))
        while pending:
            left = deadline - time.perf_counter()
            if left <= 0:
                raise TimeoutError(f"{self.variant}: {len(pending)} replies missing")
            try:
                reply = self.kc.get_shell_msg(timeout=min(left, 1.0))
            except queue.Empty:
                self.flush_iopub()
                continue
            mid = reply["parent_header"].get("msg_id")
            if mid in pending:
                pending.discard(mid)
                content = reply["content"]
                if content.get("status") != "ok":
                    raise CellFailed(f"{self.variant}: {content.get('ename')}: {content.get('evalue')}\n"
                                     + "\n".join(content.get("traceback") or [])[-3000:])
        self.flush_iopub()


# ------------------------------------------------------------------ scenarios


# ------------------------------------------------------------------ scenarios


def framework_check(python: str, env: dict) -> Dict[str, Optional[str]]:
    """None where the framework can use a GPU in a kernel's environment, else why not."""
    checks = {
        "cupy": "import cupy\nn = cupy.cuda.runtime.getDeviceCount()\nassert n > 0, 'no CUDA device'\nprint('cupy', cupy.__version__, n)",
        "torch": "import torch\nassert torch.cuda.is_available(), 'torch.cuda.is_available() is False'\nprint('torch', torch.__version__, torch.cuda.device_count())",
        "ipyexperiments": "import ipyexperiments\nprint('ipyexperiments', ipyexperiments.__version__)",
        "pynvml": "import pynvml\npynvml.nvmlInit()\nprint('pynvml', getattr(pynvml, '__version__', ''), pynvml.nvmlSystemGetDriverVersion())",
    }
    out: Dict[str, Optional[str]] = {}
    for name, code in checks.items():
        try:
            proc = subprocess.run([python, "-c", code], capture_output=True, text=True, env=env, timeout=180)
        except Exception as exc:
            out[name] = f"{type(exc).__name__}: {exc}"
            continue
        if proc.returncode == 0:
            out[name] = None
            out[name + ":version"] = proc.stdout.strip()
        else:
            lines = [l for l in proc.stderr.strip().splitlines() if l.strip()]
            out[name] = lines[-1] if lines else f"exit {proc.returncode}"
    return out


def expand_names(selected: List[str]) -> List[str]:
    names: List[str] = []
    for item in selected:
        for name in filter(None, (s.strip() for s in item.split(","))):
            if name == "names":
                names += [f"names-{n}" for n in DEFAULT_NAMES]
            elif name == "blocks":
                names += [f"blocks-{n}" for n in DEFAULT_BLOCKS]
            elif name == "all":
                names += ALL_ORDER
            else:
                names.append(name)
    seen: set = set()
    return [n for n in names if not (n in seen or seen.add(n))]


def make_scenario(name: str, args, fw: Dict[str, Optional[str]]) -> dict:
    """The scenario's code and counts, or {"skip": reason}."""
    fake = bool(args.fake_driver)

    def need(framework: str) -> Optional[str]:
        if fake:
            return f"needs {framework} on a real GPU (--fake-driver given)"
        return None if fw.get(framework) is None else f"{framework} unusable: {fw.get(framework)}"

    def auto() -> str:
        if fake:
            return "fake"
        for candidate in ("cupy", "torch"):
            if fw.get(candidate) is None:
                return candidate
        return "none"

    sc: dict = dict(name=name, setup="x = 0\n", teardown="", cell="x += 1\n", cells=args.cells, warmup=args.warmup,
                    prep=None, release=None, pre_cells=0, variants=list(VARIANTS + EXTRA_VARIANT_NAMES), fake_scenario=FAKE_IN_USE,
                    extra_pasted="")
    if name == "cuda-unused":
        sc.update(framework="none", fake_scenario=FAKE_UNUSED)
    elif name in ("cupy-idle", "torch-idle"):
        framework = name.split("-")[0]
        why = need(framework)
        if why:
            return {"skip": why}
        sc.update(framework=framework)
    elif name.startswith("names-"):
        try:
            n = int(name.split("-", 1)[1])
        except ValueError:
            return {"skip": f"unknown scenario {name}"}
        sc.update(framework=auto(), n=n)
        sc["setup"] += f"get_ipython().user_ns.update({{f'v{{i}}': [i] for i in range({n})}})\n"
        sc["teardown"] = f"for _i in range({n}):\n    get_ipython().user_ns.pop(f'v{{_i}}', None)\n"
    elif name == "long-session":
        sc.update(framework=auto(), pre_cells=args.long_cells, variants=list(args.long_variants))
    elif name.startswith("blocks-"):
        try:
            n = int(name.split("-", 1)[1])
        except ValueError:
            return {"skip": f"unknown scenario {name}"}
        why = need("cupy")
        if why:
            return {"skip": why}
        loop = f"_blocks = [cp.empty(256, dtype=cp.uint8) for _ in range({n})]\ndel _blocks\n"
        cells = args.cells if n <= 1000 else max(5, args.cells * 1000 // n)
        sc.update(framework="cupy", n=n, cells=min(args.cells, cells), warmup=min(args.warmup, 1 if n > 1000 else args.warmup))
        sc["setup"] += loop
        sc["cell"] = loop + "x += 1\n"
    elif name == "rerun-cupy-pinned":
        why = need("cupy")
        if why:
            return {"skip": why}
        sc.update(framework="cupy")
        sc["cell"] = textwrap.dedent(
            """
            _h = cupyx.empty_pinned((16 << 20,), dtype=np.float32)  # 64 MiB pinned staging
            _h[:] = 1.0
            _d = cp.asarray(_h)
            s = float(_d.sum())
            del _h, _d
            """
        )
    elif name == "rerun-torch-step":
        why = need("torch")
        if why:
            return {"skip": why}
        sc.update(framework="torch", cells=min(args.cells, args.torch_step_cells))
        sc["setup"] += textwrap.dedent(
            """
            model = torch.nn.Sequential(torch.nn.Linear(1024, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 10)).cuda()
            opt = torch.optim.SGD(model.parameters(), lr=0.01)
            """
        )
        sc["cell"] = textwrap.dedent(
            """
            xb = torch.randn(1024, 1024, device="cuda")
            yb = torch.randint(0, 10, (1024,), device="cuda")
            loss = torch.nn.functional.cross_entropy(model(xb), yb)
            opt.zero_grad(); loss.backward(); opt.step()
            step_loss = float(loss)
            """
        )
        sc["teardown"] = "for _n in ('model', 'opt', 'xb', 'yb', 'loss', 'step_loss'):\n    get_ipython().user_ns.pop(_n, None)\n"
    elif name == "pinned-8g":
        if fake:
            return {"skip": "needs CuPy or PyTorch on a real GPU (--fake-driver given)"}
        framework = "cupy" if fw.get("cupy") is None else "torch" if fw.get("torch") is None else None
        if framework is None:
            return {"skip": f"neither CuPy ({fw.get('cupy')}) nor PyTorch ({fw.get('torch')}) usable"}
        gib = args.pinned_gib
        if framework == "cupy":
            prep = f"_h = cupyx.empty_pinned(({gib} << 30,), dtype=np.uint8)\ndel _h\n"
        else:
            prep = f"_h = torch.empty({gib} << 30, dtype=torch.uint8, pin_memory=True)\ndel _h\n"
            sc["extra_pasted"] = "if hasattr(torch._C, '_host_emptyCache'):\n    torch._C._host_emptyCache()\n"
        sc.update(framework=framework, prep=prep, release={"bytes": gib * GiB, "variants": ["gpucleanup", "pasted"]},
                  cells=min(args.cells, args.pinned_cells), warmup=min(args.warmup, 1), gib=gib)
    else:
        return {"skip": f"unknown scenario {name} (known: {', '.join(ALL_ORDER)}, names-N, blocks-N)"}
    sc["pasted"] = FW_PASTED[sc["framework"]] + sc.get("extra_pasted", "")
    sc["teardown"] += FW_RESET[sc["framework"]]
    sc["uses_cuda"] = sc["framework"] != "none"
    sc["group"] = sc["framework"] + (" " + json.dumps(sc["fake_scenario"], sort_keys=True) if fake else "")
    return sc


def ipyexperiments_class(framework: str) -> str:
    return "IPyExperimentsPytorch" if framework in ("cupy", "torch") else "IPyExperimentsCPU"


GPUCLEANUP_CONFIG: List[str] = []  # --config: %config lines run after %load_ext gpucleanup


def tool_cell(variant: str, framework: str) -> Optional[str]:
    if variant == "gpucleanup":
        return "\n".join(["%load_ext gpucleanup"] + [f"%config {line}" for line in GPUCLEANUP_CONFIG])
    if variant in EXTRA_VARIANTS:  # set before the load: the status endpoint starts with it
        return "\n".join([f"%config {line}" for line in EXTRA_VARIANTS[variant] + GPUCLEANUP_CONFIG]
                         + ["%load_ext gpucleanup"])
    if variant == "gpucleanup-off":  # loaded, its cleanup paused: the hooks and the status endpoint alone
        return "%load_ext gpucleanup\n%gpumem --off"
    if variant == "ipyexperiments":
        cls = ipyexperiments_class(framework)
        return f"from ipyexperiments import {cls}\nexp = {cls}()"
    return None


def ipyexperiments_skip(framework: str, fw: Dict[str, Optional[str]]) -> Optional[str]:
    if fw.get("ipyexperiments") is not None:
        return f"ipyexperiments not importable: {fw['ipyexperiments']}"
    if framework in ("cupy", "torch"):
        if fw.get("torch") is not None:
            return f"IPyExperimentsPytorch needs PyTorch with CUDA: {fw['torch']}"
        if fw.get("pynvml") is not None:
            return f"IPyExperimentsPytorch needs pynvml: {fw['pynvml']}"
    return None


# ------------------------------------------------------------------ running


def kernel_env(args, sc: dict, workdir: Path, variant: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JPY_", "GPUCLEANUP_FAKE_CUDA"))}
    # absolute paths: the kernel does not depend on our working directory
    if env.get("PYTHONPATH"):
        env["PYTHONPATH"] = os.pathsep.join(os.path.abspath(p) for p in env["PYTHONPATH"].split(os.pathsep) if p)
    for key in ("GPUCLEANUP_LIBRARY", "GPUCLEANUP_LIBCUDA"):
        if env.get(key) and os.sep in env[key]:
            env[key] = os.path.abspath(env[key])
    if args.fake_driver:
        env["GPUCLEANUP_LIBCUDA"] = os.path.abspath(args.fake_driver)
        env["GPUCLEANUP_FAKE_CUDA_SCENARIO"] = json.dumps(sc["fake_scenario"])
    (workdir / variant / "ipython").mkdir(parents=True, exist_ok=True)
    (workdir / "runtime").mkdir(parents=True, exist_ok=True)
    env["IPYTHONDIR"] = str(workdir / variant / "ipython")
    env["JUPYTER_RUNTIME_DIR"] = str(workdir / "runtime")
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def device_figures(kernel: Kernel, sc: dict, nvsmi: Optional[Dict[int, int]]) -> dict:
    if not sc["uses_cuda"]:
        return {}
    out: dict = {}
    if nvsmi is not None:
        out["nvidia_smi_used_bytes"] = nvsmi.get(kernel.pid) if kernel.pid in nvsmi else None
    exprs = {"snapshot": SNAPSHOT_EXPR}
    if sc["framework"] in FW_POOLS:
        exprs["pools"] = FW_POOLS[sc["framework"]]
    try:
        values = kernel.expressions(exprs)
    except Exception as exc:
        values = {"error": f"{type(exc).__name__}: {exc}"}
    out.update(values)
    return out


def measure_point(kernels: Dict[str, Kernel], sc: dict, label: str, store: Dict[str, dict]) -> None:
    for v, k in kernels.items():  # host figures first, for every kernel
        store.setdefault(v, {}).setdefault("host", {})[label] = host_figures(k.pid)
    if label == "ready":
        return
    nvsmi = nvidia_smi_used_by_pid() if sc["uses_cuda"] else None
    for v, k in kernels.items():
        dev = device_figures(k, sc, nvsmi)
        if dev:
            store[v].setdefault("device", {})[label] = dev


def code_for(variant: str, sc: dict) -> str:
    return sc["cell"] + ("\n" + sc["pasted"] if variant == "pasted" else "")


def run_one(kernel: Kernel, sc: dict, variant: str) -> dict:
    sample: dict = {}
    release = sc.get("release")
    rss_before_prep = host_figures(kernel.pid).get("rss_bytes") if release else None
    if sc["prep"]:
        sample["prep_s"] = kernel.run(sc["prep"], silent=True)["elapsed_s"]
    res = kernel.run(code_for(variant, sc))
    sample["t"] = res["elapsed_s"]
    sample["stdout"] = res["stdout"]
    if release:
        idle_at = time.perf_counter()
        rss_idle = host_figures(kernel.pid).get("rss_bytes")
        sample["rss_at_idle_bytes"] = rss_idle
        if variant in release["variants"] and isinstance(rss_before_prep, int):
            # released when the kernel's RSS is back near what it was before the re-pin
            limit = rss_before_prep + release["bytes"] // 10
            released = None
            while time.perf_counter() - idle_at < 30.0:
                rss = host_figures(kernel.pid).get("rss_bytes")
                if not isinstance(rss, int):
                    break
                if rss <= limit:
                    released = time.perf_counter() - idle_at
                    break
                time.sleep(0.005)
            sample["release_s"] = released
    return sample


def drop(kernels: Dict[str, Kernel], v: str, failed: Dict[str, str], what: str, exc: BaseException) -> None:
    """A variant whose cell failed leaves the group; the others go on."""
    kernel = kernels.pop(v)
    kernel.shutdown()
    tail = kernel.log_tail()
    failed[v] = f"{what}: {type(exc).__name__}: {exc}" + (f"\n-- kernel log:\n{tail}" if tail.strip() else "")
    print(f"   {v}: {what}, dropped: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}", flush=True)


def interleaved(kernels: Dict[str, Kernel], sc: dict, counts: Dict[str, int], block: int,
                record: Optional[Dict[str, list]], failed: Dict[str, str]) -> None:
    """counts[v] cells on each kernel, round robin in blocks; a variant with fewer cells gets
    proportionally smaller blocks, so its cells spread over the same rounds."""
    order = [v for v in counts if v in kernels]
    if not order:
        return
    rounds = max(1, math.ceil(max(counts[v] for v in order) / max(1, block)))
    per_round = {v: math.ceil(counts[v] / rounds) for v in order}
    done = {v: 0 for v in order}
    for rnd in range(rounds + 1):
        shift = rnd % len(order)
        for v in order[shift:] + order[:shift]:
            if v not in kernels or done[v] >= counts[v]:
                continue
            count = min(per_round[v], counts[v] - done[v])
            try:
                for _ in range(count):
                    sample = run_one(kernels[v], sc, v)
                    if record is not None:
                        record[v].append(sample)
            except (CellFailed, TimeoutError) as exc:
                drop(kernels, v, failed, f"cell of {sc['name']} failed", exc)
                continue
            done[v] += count


def parallel(kernels: Dict[str, Kernel], code_by_variant: Dict[str, str], what: str, failed: Dict[str, str]) -> None:
    """One cell on every kernel at once (set-up, teardown): the kernels run it in parallel."""
    ids = {v: [kernels[v].send(code)] for v, code in code_by_variant.items() if code and v in kernels}
    for v, msg in ids.items():
        try:
            kernels[v].wait(msg)
        except (CellFailed, TimeoutError) as exc:
            drop(kernels, v, failed, f"{what} failed", exc)


def pipelined(kernels: Dict[str, Kernel], code_by_variant: Dict[str, str], n: int, chunk: int, failed: Dict[str, str]) -> float:
    """n cells on every kernel, sent in chunks without waiting for each: the kernels run in parallel."""
    t0 = time.perf_counter()
    sent = 0
    while sent < n and kernels:
        k = min(chunk, n - sent)
        ids = {v: [kern.send(code_by_variant[v]) for _ in range(k)] for v, kern in kernels.items()}
        for v in list(ids):
            try:
                kernels[v].wait(ids[v])
            except (CellFailed, TimeoutError) as exc:
                drop(kernels, v, failed, "long session failed", exc)
        sent += k
    return time.perf_counter() - t0


def summarize(samples: List[dict]) -> dict:
    times = [s["t"] * 1e3 for s in samples]
    out = {
        "n": len(times),
        "median_ms": round(statistics.median(times), 4) if times else None,
        "p95_ms": round(percentile(times, 0.95), 4) if times else None,
        "mean_ms": round(statistics.fmean(times), 4) if times else None,
        "min_ms": round(min(times), 4) if times else None,
        "max_ms": round(max(times), 4) if times else None,
        "times_ms": [round(t, 4) for t in times],
        "cells_with_output": sum(1 for s in samples if s.get("stdout")),
        "stdout_sample": next((s["stdout"] for s in reversed(samples) if s.get("stdout")), "")[-600:],
    }
    preps = [s["prep_s"] * 1e3 for s in samples if s.get("prep_s") is not None]
    if preps:
        out["prep_median_ms"] = round(statistics.median(preps), 3)
        out["prep_ms"] = [round(p, 3) for p in preps]
    if any("rss_at_idle_bytes" in s for s in samples):
        out["rss_at_idle_bytes"] = [s.get("rss_at_idle_bytes") for s in samples]
    rel = [s.get("release_s") for s in samples if "release_s" in s]
    if rel:
        known = [r * 1e3 for r in rel if r is not None]
        out["release_ms"] = [None if r is None else round(r * 1e3, 3) for r in rel]
        out["release_median_ms"] = round(statistics.median(known), 3) if known else None
    return out


def add_comparisons(variants: Dict[str, dict]) -> None:
    base = {k: (variants.get(k) or {}).get("median_ms") for k in ("bare", "pasted", "ipyexperiments")}
    for name, v in variants.items():
        m = v.get("median_ms")
        if m is None:
            continue
        if base["bare"]:
            v["added_ms_vs_bare"] = round(m - base["bare"], 4)
            v["ratio_vs_bare"] = round(m / base["bare"], 4)
            if v.get("p95_ms") is not None and variants["bare"].get("p95_ms"):
                v["added_p95_ms_vs_bare"] = round(v["p95_ms"] - variants["bare"]["p95_ms"], 4)
        for other in ("pasted", "ipyexperiments"):
            if base[other] and name != other:
                v[f"ratio_vs_{other}"] = round(m / base[other], 4)


def run_scenario(sc: dict, group: Dict[str, Kernel], args, failed: Dict[str, str]) -> dict:
    """One scenario on the group's kernels (those of its variants)."""
    t_start = time.perf_counter()
    kernels = {v: k for v, k in group.items() if v in sc["variants"]}
    result: dict = {"framework": sc["framework"], "cells": sc["cells"], "warmup": sc["warmup"], "block": args.block,
                    "setup": sc["setup"], "cell": sc["cell"], "pasted": sc["pasted"], "teardown": sc["teardown"],
                    "variants": {}, "phases_s": {}}
    for key in ("n", "gib", "prep"):
        if sc.get(key) is not None:
            result[key] = sc[key]
    if sc["pre_cells"]:
        result["long_cells"] = sc["pre_cells"]
    counts = {v: (min(sc["cells"], args.ipyx_cells) if v == "ipyexperiments" else sc["cells"]) for v in kernels}
    warm = {v: (min(sc["warmup"], max(1, args.ipyx_cells // 5)) if v == "ipyexperiments" else sc["warmup"]) for v in kernels}
    store: Dict[str, dict] = {v: {} for v in kernels}
    lost = set(failed)

    def phase(name: str, t0: float) -> float:
        now = time.perf_counter()
        result["phases_s"][name] = round(now - t0, 2)
        return now

    t = time.perf_counter()
    parallel(kernels, {v: sc["setup"] for v in kernels}, f"set-up of {sc['name']}", failed)
    ex = {}
    for v, k in kernels.items():
        try:
            ex[v] = k.expressions({"n": "len(In)"}).get("n")
        except Exception:
            ex[v] = None
    result["cells_before_in_kernel"] = ex
    interleaved(kernels, sc, warm, args.block, None, failed)
    t = phase("setup_and_warmup", t)
    samples: Dict[str, list] = {v: [] for v in kernels}
    if sc["pre_cells"]:
        early: Dict[str, list] = {v: [] for v in kernels}
        interleaved(kernels, sc, counts, args.block, early, failed)
        for v in kernels:
            store[v]["early"] = summarize(early[v])
        t = phase("early_cells", t)
        print(f"   {sc['pre_cells']} cells on {', '.join(kernels)} (pipelined) ...", flush=True)
        result["long_cells_s"] = round(pipelined(kernels, {v: code_for(v, sc) for v in kernels}, sc["pre_cells"],
                                                 args.chunk, failed), 2)
        t = phase("long_cells", t)
    measure_point(kernels, sc, "before", store)
    interleaved(kernels, sc, counts, args.block, samples, failed)
    t = phase("timed_cells", t)
    measure_point(kernels, sc, "after", store)
    for v in kernels:
        entry = summarize(samples[v])
        entry.update(store[v])
        result["variants"][v] = entry
    parallel(kernels, {v: sc["teardown"] for v in kernels}, f"teardown of {sc['name']}", failed)
    phase("teardown", t)
    for v in list(group):  # variants dropped in this scenario leave the group
        if v in sc["variants"] and v not in kernels:
            group.pop(v, None)
    for v, why in failed.items():
        if v not in lost and v in sc["variants"]:
            result["variants"].setdefault(v, {})["failed"] = why
    add_comparisons({v: e for v, e in result["variants"].items() if "median_ms" in e})
    for v, e in result["variants"].items():
        if "early" in e and e["early"].get("median_ms") and e.get("median_ms") is not None:
            e["growth_ms_late_minus_early"] = round(e["median_ms"] - e["early"]["median_ms"], 4)
    result["elapsed_s"] = round(time.perf_counter() - t_start, 2)
    return result


def run_group(scs: List[dict], args, fw: Dict[str, Optional[str]], workroot: Path, results: Dict[str, dict],
              t_all: float, save) -> None:
    """Start one kernel per variant for these scenarios (same framework), run them one after the other."""
    first = scs[0]
    framework = first["framework"]
    wanted = [v for v in args.variants if any(v in sc["variants"] for sc in scs)]
    skipped: Dict[str, str] = {}
    if "ipyexperiments" in wanted:
        why = ipyexperiments_skip(framework, fw)
        if why:
            wanted.remove("ipyexperiments")
            skipped["ipyexperiments"] = why
            print(f"   ipyexperiments: skipped ({why})", flush=True)
    workdir = workroot / framework
    kernels: Dict[str, Kernel] = {}
    failed: Dict[str, str] = {}
    group_info: dict = {"framework": framework, "scenarios": [sc["name"] for sc in scs], "variants": wanted}
    if "ipyexperiments" in wanted:
        group_info["ipyexperiments_class"] = ipyexperiments_class(framework)
    t0 = time.perf_counter()
    print(f"-- kernels for {framework}: {', '.join(wanted)}; scenarios {', '.join(sc['name'] for sc in scs)}", flush=True)
    try:
        for v in wanted:
            env = kernel_env(args, first, workdir, v)
            kernels[v] = Kernel(v, args.python, env, args.cell_timeout, log=workdir / v / "kernel.log")
        for v in list(kernels):
            try:
                kernels[v].wait_ready()
            except Exception as exc:
                drop(kernels, v, failed, "kernel did not start", exc)
        ready: Dict[str, dict] = {}
        measure_point(kernels, first, "ready", ready)
        group_info["host_ready"] = {v: s.get("host", {}).get("ready") for v, s in ready.items()}
        # the tool first (%load_ext / the experiment), then the framework; in parallel over kernels
        parallel(kernels, {v: tool_cell(v, framework) for v in kernels}, "loading the tool", failed)
        parallel(kernels, {v: FW_SETUP[framework] for v in kernels}, f"importing {framework}", failed)
        group_info["start_s"] = round(time.perf_counter() - t0, 2)
        print(f"   started in {group_info['start_s']} s", flush=True)
        for sc in scs:
            name = sc["name"]
            spent = time.perf_counter() - t_all
            if args.budget_s and spent > args.budget_s:
                results[name] = {"skipped": f"time budget of {args.budget_s:.0f} s spent ({spent:.0f} s)"}
                print(f"== {name}: skipped (time budget of {args.budget_s:.0f} s spent)", flush=True)
                continue
            if "bare" not in kernels:
                results[name] = {"error": f"the bare kernel failed: {failed.get('bare')}"}
                print_table(name, results[name])
                continue
            print(f"-- {name}: running ({', '.join(v for v in kernels if v in sc['variants'])}) ...", flush=True)
            try:
                res = run_scenario(sc, kernels, args, failed)
                res["group"] = {k: v for k, v in group_info.items() if k != "host_ready"}
                for v, why in skipped.items():
                    if v in sc["variants"]:
                        res["variants"][v] = {"skipped": why}
                if "ipyexperiments" in res["variants"] and "median_ms" in res["variants"]["ipyexperiments"]:
                    res["ipyexperiments_class"] = group_info["ipyexperiments_class"]
                results[name] = res
            except Exception as exc:
                import traceback

                results[name] = {"error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-3000:]}"}
            print_table(name, results[name])
            sys.stdout.flush()
            save()
    finally:
        for k in kernels.values():
            k.shutdown()


# ------------------------------------------------------------------ output


def _mib(b: Any) -> str:
    return f"{b / MiB:.1f}" if isinstance(b, (int, float)) else "-"


def _arrow(a: Any, b: Any, fmt) -> str:
    if a is None and b is None:
        return "-"
    return f"{fmt(a)}→{fmt(b)}"


def _device_cell(entry: dict) -> str:
    dev = entry.get("device") or {}
    before, after = dev.get("before") or {}, dev.get("after") or {}
    if before.get("nvidia_smi_used_bytes") is not None or after.get("nvidia_smi_used_bytes") is not None:
        return "proc " + _arrow(before.get("nvidia_smi_used_bytes"), after.get("nvidia_smi_used_bytes"), _mib)
    pb, pa = before.get("pools") or {}, after.get("pools") or {}
    for key, label in (("pool_total_bytes", "cupy pool"), ("reserved_bytes", "torch reserved")):
        if isinstance(pb, dict) and key in pb:
            return f"{label} " + _arrow(pb.get(key), (pa or {}).get(key), _mib)
    sb, sa = before.get("snapshot"), after.get("snapshot")
    if isinstance(sb, list) and sb and isinstance(sa, list) and sa:
        return "dev0 " + _arrow(sb[0].get("used_bytes"), sa[0].get("used_bytes"), _mib)
    return "-"


def print_table(name: str, res: dict) -> None:
    if "skipped" in res:
        print(f"== {name}: skipped ({res['skipped']})")
        return
    if "error" in res:
        print(f"== {name}: FAILED ({res['error'].splitlines()[0] if res['error'] else ''})")
        return
    extra = f", {res['long_cells']} cells before ({res.get('long_cells_s')} s)" if res.get("long_cells") else ""
    cls = f", {res['ipyexperiments_class']}" if res.get("ipyexperiments_class") else ""
    ran = [e.get("n") for e in res["variants"].values() if "n" in e]
    before = [n for n in (res.get("cells_before_in_kernel") or {}).values() if isinstance(n, int)]
    print(f"== {name}: framework {res['framework']}, {res['cells']} timed cells per variant after {res['warmup']} warm-up"
          f"{' (ipyexperiments: ' + str(min(ran)) + ')' if ran and min(ran) < res['cells'] else ''}, "
          f"blocks of {res['block']}{extra}{cls}; kernels had run {min(before) if before else '?'}+ cells before; "
          f"{res['elapsed_s']} s")
    header = f"  {'variant':<15}{'n':>5}{'median ms':>11}{'p95 ms':>10}{'+ms vs bare':>13}{'x bare':>8}  {'RSS MiB before→after':<22}{'threads':<9}device MiB"
    print(header)
    for v in VARIANTS:
        e = res["variants"].get(v)
        if e is None:
            continue
        if "median_ms" not in e:
            why = e.get("skipped") or e.get("failed") or "?"
            print(f"  {v:<15}{'skipped' if 'skipped' in e else 'failed'}: {why.splitlines()[0][:120]}")
            continue
        host = e.get("host") or {}
        hb, ha = host.get("before") or {}, host.get("after") or {}
        added = e.get("added_ms_vs_bare")
        ratio = e.get("ratio_vs_bare")
        print(f"  {v:<15}{e['n']:>5}{e['median_ms']:>11.3f}{e['p95_ms']:>10.3f}"
              f"{'—' if v == 'bare' or added is None else f'{added:+.3f}':>13}{'' if ratio is None else f'{ratio:.2f}':>8}  "
              f"{_arrow(hb.get('rss_bytes'), ha.get('rss_bytes'), _mib):<22}"
              f"{_arrow(hb.get('threads'), ha.get('threads'), str):<9}{_device_cell(e)}")
        if "early" in e:
            early = e["early"]
            print(f"  {'  (early)':<15}{early['n']:>5}{early['median_ms']:>11.3f}{early['p95_ms']:>10.3f}"
                  f"   growth {e.get('growth_ms_late_minus_early', 0):+.3f} ms after {res.get('long_cells')} cells")
        if "prep_median_ms" in e or "release_ms" in e:
            bits = []
            if "prep_median_ms" in e:
                bits.append(f"silent re-pin before each cell: median {e['prep_median_ms']:.1f} ms")
            rss = [b for b in e.get("rss_at_idle_bytes") or [] if isinstance(b, int)]
            if rss:
                bits.append(f"RSS at idle {statistics.median(rss) / MiB:.0f} MiB")
            if "release_ms" in e:
                rel = e.get("release_median_ms")
                bits.append("RSS not back within 30 s" if rel is None else f"RSS back {rel:.1f} ms after idle (median)")
            print(f"  {'':<15}" + "; ".join(bits))
    g = res["variants"].get("gpucleanup") or {}
    ratios = [f"gpucleanup/{o} {g[f'ratio_vs_{o}']:.2f}" for o in ("pasted", "ipyexperiments") if g.get(f"ratio_vs_{o}")]
    if ratios:
        print("  " + ", ".join(ratios) + " (medians)")
    if g.get("stdout_sample"):
        print(f"  gpucleanup said (last): {g['stdout_sample'].strip().splitlines()[-1][:160]}")


def print_summary(results: Dict[str, dict], order: List[str]) -> None:
    print("\n== summary (median execute-to-idle, ms; +added vs bare)")
    print(f"  {'scenario':<20}" + "".join(f"{v:>22}" for v in VARIANTS))
    for name in [n for n in order if n in results] + [n for n in results if n not in order]:
        res = results[name]
        if "variants" not in res:
            print(f"  {name:<20}{res.get('skipped') or res.get('error', '')[:80]}")
            continue
        cells = []
        for v in VARIANTS:
            e = res["variants"].get(v) or {}
            if "median_ms" not in e:
                cells.append("skipped" if "skipped" in e else "failed" if "failed" in e else "-")
            elif v == "bare":
                cells.append(f"{e['median_ms']:.3f}")
            else:
                cells.append(f"{e['median_ms']:.3f} ({e.get('added_ms_vs_bare', 0):+.3f})")
        print(f"  {name:<20}" + "".join(f"{c:>22}" for c in cells))


# ------------------------------------------------------------------ main


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n", 2)[2])
    parser.add_argument("--scenario", action="append", default=[],
                        help="scenario(s), comma separated or repeated; 'names', 'blocks' and 'all' expand "
                        "(default: all but names-10 and blocks-10; --list)")
    parser.add_argument("--cells", type=int, default=200, help="timed cells per variant (default 200)")
    parser.add_argument("--warmup", type=int, default=5, help="warm-up cells per variant, not recorded (default 5)")
    parser.add_argument("--block", type=int, default=20, help="cells in a row on one variant before the next (default 20)")
    parser.add_argument("--long-cells", type=int, default=10_000, help="cells run before the timed ones in long-session (default 10000)")
    parser.add_argument("--long-variants", default="bare,gpucleanup", help="variants of long-session (default bare,gpucleanup)")
    parser.add_argument("--pinned-cells", type=int, default=3, help="timed cells per variant in pinned-8g (default 3)")
    parser.add_argument("--ipyx-cells", type=int, default=40,
                        help="timed cells of the ipyexperiments variant (default 40: its cells cost 20-180 ms)")
    parser.add_argument("--torch-step-cells", type=int, default=60, help="timed cells of rerun-torch-step (default 60)")
    parser.add_argument("--pinned-gib", type=int, default=8, help="GiB pinned in pinned-8g (default 8)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"variants to run (default {','.join(VARIANTS)})")
    parser.add_argument("--chunk", type=int, default=250, help="requests in flight per kernel in long-session (default 250)")
    parser.add_argument("--quick", action="store_true", help="30 cells, 5 warm-up, 300 long-session cells, 2 pinned cells")
    parser.add_argument("--fake-driver", help="the fake libcuda.so.1 (no GPU): GPUCLEANUP_LIBCUDA and a fake scenario for the kernels")
    parser.add_argument("--python", default=sys.executable, help="interpreter of the kernels (default: this one)")
    parser.add_argument("--cell-timeout", type=float, default=300.0, help="seconds a cell may take (default 300)")
    parser.add_argument("--budget-s", type=float, default=0.0,
                        help="start no further scenario once this many seconds have passed (default 0: no limit)")
    parser.add_argument("--json", help="write every figure here (rewritten after each scenario)")
    parser.add_argument("--list", action="store_true", help="list the scenarios and exit")
    parser.add_argument("--config", action="append", default=[],
                        help="a %%config line for the gpucleanup variant, e.g. \"GPUCleanup.release = 'auto'\" (repeatable)")
    args = parser.parse_args()
    GPUCLEANUP_CONFIG.extend(args.config)
    if args.list:
        print("\n".join(f"{n}{'' if n in DEFAULT_ORDER else '   (only when named)'}" for n in ALL_ORDER + ["names-N", "blocks-N"]))
        return 0
    if args.quick:
        args.cells, args.warmup, args.long_cells, args.pinned_cells, args.ipyx_cells = 30, 5, 300, 2, 10
        args.block = min(args.block, 10)
    args.variants = [v for v in (s.strip() for s in args.variants.split(",")) if v]
    args.long_variants = [v for v in (s.strip() for s in args.long_variants.split(",")) if v]
    for v in args.variants + args.long_variants:
        if v not in VARIANTS + EXTRA_VARIANT_NAMES:
            parser.error(f"unknown variant {v} (known: {', '.join(VARIANTS + EXTRA_VARIANT_NAMES)})")
    if "bare" not in args.variants:
        args.variants.insert(0, "bare")
    if "bare" not in args.long_variants:
        args.long_variants.insert(0, "bare")
    if args.fake_driver and not Path(args.fake_driver).exists():
        parser.error(f"--fake-driver {args.fake_driver}: no such file")
    try:
        import jupyter_client  # noqa: F401
    except ImportError as exc:
        print(f"bench_kernels: jupyter_client is not importable ({exc}): nothing to run")
        return 1
    names = expand_names(args.scenario) or list(DEFAULT_ORDER)
    t_all = time.perf_counter()

    probe_env = {k: v for k, v in os.environ.items() if not k.startswith(("JPY_", "GPUCLEANUP_FAKE_CUDA"))}
    fw = framework_check(args.python, probe_env)
    meta = {
        "time": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "gpu": nvidia_smi_machine(),
        "fake_driver": os.path.abspath(args.fake_driver) if args.fake_driver else None,
        "frameworks": fw,
        "options": {k: v for k, v in vars(args).items() if k not in ("json", "list")},
        "psutil": _has("psutil"),
        "versions": {m: _version(m) for m in ("IPython", "ipykernel", "jupyter_client", "zmq", "gpucleanup")},
        "method": "execute to idle: execute_request sent until status idle (iopub) and execute_reply (shell) "
        "for that msg_id have both arrived; one kernel per variant and framework, shared by that framework's "
        "scenarios in turn; blocks interleaved round robin",
    }
    print(f"bench_kernels: Python {meta['python']}, {meta['cpus']} CPUs, GPU {meta['gpu'] or 'none (nvidia-smi absent)'}"
          + (f", fake driver {meta['fake_driver']}" if args.fake_driver else ""))
    print("  " + ", ".join(f"{m} {v}" for m, v in meta["versions"].items()))
    print("  " + "; ".join(f"{k}: {'ok ' + (fw.get(k + ':version') or '') if fw.get(k) is None else fw[k]}"
                           for k in ("cupy", "torch", "ipyexperiments", "pynvml")))
    if not meta["psutil"]:
        print("  psutil not importable: RSS and threads from /proc/<pid>/status")

    results: Dict[str, dict] = {}
    out = {"meta": meta, "scenarios": results}

    def save() -> None:
        if args.json:
            _write(args.json, out)

    # scenarios grouped by framework (one set of kernels each), groups in order of first appearance,
    # long-session last in its group
    groups: Dict[str, List[dict]] = {}
    for name in names:
        sc = make_scenario(name, args, fw)
        if "skip" in sc:
            results[name] = {"skipped": sc["skip"]}
            print(f"== {name}: skipped ({sc['skip']})", flush=True)
            continue
        groups.setdefault(sc["group"], []).append(sc)
    for scs in groups.values():
        scs.sort(key=lambda sc: sc["pre_cells"] > 0)
    workroot = Path(tempfile.mkdtemp(prefix="gpucleanup-bench-kernels-"))
    try:
        for scs in groups.values():
            run_group(scs, args, fw, workroot, results, t_all, save)
    finally:
        shutil.rmtree(workroot, ignore_errors=True)
    out["elapsed_s"] = round(time.perf_counter() - t_all, 1)
    print_summary(results, names)
    print(f"\nbench_kernels: {len(names)} scenarios in {out['elapsed_s']} s")
    if args.json:
        _write(args.json, out)
        print(f"bench_kernels: figures in {args.json}")
    return 0 if not any("error" in r for r in results.values()) else 1


def _write(path: str, data: dict) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as fh:
        json.dump(data, fh, indent=1)
    os.replace(tmp, path)


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def _version(module: str) -> Optional[str]:
    try:
        mod = __import__(module)
        return getattr(mod, "__version__", None) or getattr(mod, "pyzmq_version", lambda: None)()
    except Exception:
        return None


if __name__ == "__main__":
    sys.exit(main())
