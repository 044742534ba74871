"""The demo notebooks (share/examples) through a real kernel, cell by cell.

The cells hold no cleanup code; the first one runs ``%load_ext gpucleanup``. After each
cell the test asks the kernel (a silent request: no cell hooks run) what the pools still
hold, and checks:
- the summary line (gpucleanup's own display output, after the cell's) starts with "gpucleanup ·" when the cell used the GPU
  (a cell that only frees pinned host memory may leave that report to the next cell's line);
- CuPy's device pool, PyTorch's cache and Numba's queue hold nothing freeable (no free
  block at all where nothing is live; only remnants of blocks split by live arrays otherwise);
- the pinned pools are released (on a background thread: polled, at most 60 s);
- device free memory is back within 64 MiB of where it was before the cell, less what
  the cell left live (skipped for the cell that first makes a context or starts torch:
  contexts and library handles live outside every pool).
"""

from __future__ import annotations

import ast
import json
import sys
import time
from pathlib import Path

import pytest

from conftest import MiB, ROOT, TOLERANCE, require, stop_kernel, subprocess_env

sys.path.insert(0, str(ROOT / "tests"))
import kernel_harness  # noqa: E402  (tests/kernel_harness.py)

EXAMPLES = ROOT / "share" / "examples"
TIMEOUT = 180

PROBE = r'''
def __gpucleanup_probe():
    import json, sys, gpucleanup
    from gpucleanup.in_kernel import extension
    snap = gpucleanup.snapshot()
    out = {"state": snap["driver"]["state"], "free": {}, "live": 0, "cached": {}, "pinned_cached": {}}
    ext = extension.get_extension(get_ipython())
    job = ext.engine.releases.idle_job if ext is not None else None
    out["release_pending"] = bool(job is not None and not job.done.is_set())  # release "rerun": once idle
    if out["state"] != "ready":
        return json.dumps(out)   # nothing initialised CUDA: reading any pool would
    out["free"] = {str(d["index"]): d["free_bytes"] for d in snap["devices"] if d["in_use"]}
    cp = sys.modules.get("cupy")
    if cp is not None:
        pool = cp.get_default_memory_pool()
        out["live"] += pool.used_bytes()
        out["cupy_live"] = pool.used_bytes()
        out["cached"]["cupy"] = pool.free_bytes()
        out["cupy_free_blocks"] = pool.n_free_blocks()
        out["pinned_cached"]["cupy_blocks"] = cp.get_default_pinned_memory_pool().n_free_blocks()
    torch = sys.modules.get("torch")
    out["torch_initialised"] = bool(torch is not None and torch.cuda.is_initialized())
    if out["torch_initialised"]:
        out["live"] += torch.cuda.memory_allocated(0)
        out["cached"]["torch"] = torch.cuda.memory_reserved(0) - torch.cuda.memory_allocated(0)
        hs = torch.cuda.memory.host_memory_stats()
        owned = hs.get("allocated_bytes.current", 0)
        # under 1 MiB torch's pinned cache is left alone on purpose (its own scalar staging:
        # gpucleanup.frameworks.torch.SMALL_PINNED_BYTES); from there on it must be released
        out["pinned_cached"]["torch_owned"] = owned if owned >= (1 << 20) else 0
        out["torch_pinned_small"] = owned if owned < (1 << 20) else 0
    devices = sys.modules.get("numba.cuda.cudadrv.devices")
    if devices is not None:
        info = type(devices._runtime.gpus).__dict__.get("lst")
        if info is not None and info.fget.cache_info().currsize:
            pending = 0
            for g in devices._runtime.gpus.lst:
                if g.primary_context is not None:
                    pending += g.primary_context.memory_manager.deallocations._size
            out["cached"]["numba"] = pending
    return json.dumps(out)
'''


def _check_lines(cell, summary: list, out: kernel_harness.Cell, background_report_due: bool) -> bool:
    """The cell's line as the notebook's metadata expects it under release "cell"; True when a pinned
    release left to the background is due on the next cell's line."""
    if background_report_due:
        assert summary and "freed in background" in summary[0], (summary, "the earlier pinned release")
        background_report_due = False
    expect = cell.metadata.get("gpucleanup", {}).get("expect_summary", True)
    if expect == "same-or-next" and not summary:
        background_report_due = True   # a pinned-only cell: its release may be reported next
    elif expect:
        assert summary and summary[0].startswith("gpucleanup · GPU0"), out.printed
    says = cell.metadata.get("gpucleanup", {}).get("expect_text")
    if says:
        assert summary and says in summary[0], (says, summary)
    return background_report_due


def _notebooks():
    return sorted(p.name for p in EXAMPLES.glob("*.ipynb"))


class Kernel(kernel_harness.Kernel):
    """A real ipykernel on this machine's GPUs (tests/kernel_harness.py)."""

    def __init__(self, tmp_path: Path):
        super().__init__(subprocess_env(JUPYTER_RUNTIME_DIR=str(tmp_path / "runtime"),
                                        IPYTHONDIR=str(tmp_path / "ipython")),
                         python=sys.executable, cwd=tmp_path, ready=TIMEOUT, timeout=TIMEOUT)

    def close(self):
        stop_kernel(self.km, self.kc)

    def probe(self) -> dict:
        reply = self.execute("", silent=True, user_expressions={"p": "__gpucleanup_probe()"}).reply
        value = reply["user_expressions"]["p"]
        assert value["status"] == "ok", value
        return json.loads(ast.literal_eval(value["data"]["text/plain"]))


@pytest.mark.parametrize("release", ["cell", "rerun"])
@pytest.mark.parametrize("name", _notebooks())
def test_notebook_cells_leave_no_freeable_gpu_memory(name, release, tmp_path):
    """"cell": nothing freeable once each cell has ended, and each line as the notebook expects.
    "rerun" (the default): nothing freeable once the kernel has been idle after each cell (the
    release it deferred has run: polled, at most 60 s); the lines are those of the policy."""
    import nbformat

    nb = nbformat.read(EXAMPLES / name, as_version=4)
    sources = " ".join(c.source for c in nb.cells if c.cell_type == "code")
    for module, word in (("cupy", "cupy"), ("torch", "torch"), ("numba.cuda", "numba")):
        if word in sources:
            require(module)
    for module in nb.metadata.get("gpucleanup", {}).get("requires", []):  # e.g. pycuda, tensorflow
        require(module)
    kernel = Kernel(tmp_path)
    try:
        kernel.execute(f"%config GPUCleanup.release = {release!r}", silent=True)  # before the first cell loads it
        kernel.execute(PROBE, silent=True)
        previous = kernel.probe()
        background_report_due = False
        for number, cell in enumerate(c for c in nb.cells if c.cell_type == "code"):
            t0 = time.perf_counter()
            out = kernel.execute(cell.source)
            elapsed = (time.perf_counter() - t0) * 1e3
            assert out.error is None, f"cell {number} failed:\n{out.traceback}"
            summary = [line for line in out.printed.splitlines() if line.startswith("gpucleanup ·")]
            now = kernel.probe()
            # the pinned pools are released on a background thread, and "rerun" releases once idle: poll
            deadline = time.monotonic() + 60
            while (any(now["pinned_cached"].values()) or now["release_pending"]) and time.monotonic() < deadline:
                time.sleep(0.05)
                now = kernel.probe()
            print(f"FIGURE {name} cell {number}: {elapsed:.0f} ms; {summary[0] if summary else '(no summary)'}")
            print(f"FIGURE {name} cell {number}: pools after {now['cached']}, pinned {now['pinned_cached']}, "
                  f"live {now['live']} B, free {now['free']}")
            if release == "cell":  # the notebook's expected lines are those of "cell"
                background_report_due = _check_lines(cell, summary, out, background_report_due)
            assert now["state"] in ("ready", "not_initialized")
            # Blocks split by a live array or tensor cannot be released (CuPy: "a split block
            # is not released until all its parts are merged"; the same holds in torch's cache):
            # with nothing live there must be no free block at all.
            assert now["cached"].get("numba", 0) == 0, now["cached"]
            if now.get("cupy_live", 0) == 0:
                assert now["cached"].get("cupy", 0) == 0 and now.get("cupy_free_blocks", 0) == 0, now
            else:
                assert now["cached"].get("cupy", 0) <= TOLERANCE, now
            assert now["cached"].get("torch", 0) <= 20 * MiB, now["cached"]
            assert not any(now["pinned_cached"].values()), now["pinned_cached"]
            fresh = (set(now["free"]) != set(previous["free"])
                     or now.get("torch_initialised") != previous.get("torch_initialised"))
            if not fresh:
                for dev, free in now["free"].items():
                    # a cell that keeps (or frees) raw allocations on purpose says how much
                    kept = int(cell.metadata.get("gpucleanup", {}).get("keeps_outside_bytes", 0))
                    expected = previous["free"][dev] - (now["live"] - previous["live"]) - kept
                    print(f"FIGURE {name} cell {number}: GPU{dev} free {free} B, expected {expected} B, "
                          f"off by {free - expected} B")
                    assert abs(free - expected) <= TOLERANCE, (dev, free, expected)
            previous = now
        status = kernel.execute("%gpumem --json")
        assert status.error is None
        # %gpumem --json returns a dict shown as JSON text (d = %gpumem --json keeps it)
        data = json.loads(status.result)
        assert data["kind"] == "gpumem"
        assert data["frameworks"], data
        for framework, text in data["frameworks"].items():
            assert text.startswith(f"{framework} holds "), text
        print(f"FIGURE {name} %gpumem --json frameworks: {json.dumps(data.get('frameworks'))}")
    finally:
        kernel.close()


HOST_STATS = ("import json as _j, torch as _t\n"
              "print('HOST ' + _j.dumps({k: v for k, v in _t.cuda.memory.host_memory_stats().items() if 'bytes' in k or k.startswith(('allocations', 'num_'))}))")


def test_torch_cells_that_pin_nothing_say_nothing_about_pinned_memory(tmp_path):
    """Every figure in the line is true: no 'pinned N B' after cells that pinned nothing."""
    require("torch")
    kernel = Kernel(tmp_path)
    try:
        cells = [
            "%load_ext gpucleanup",
            "import torch\nmodel = torch.nn.Linear(1024, 1024).cuda()\nopt = torch.optim.SGD(model.parameters(), lr=0.1)",
            "x = torch.randn(256, 1024, device='cuda')\nloss = model(x).square().mean()\nloss.backward(); opt.step(); opt.zero_grad()\nprint(float(loss))",
            "big = torch.randn(8192, 8192, device='cuda'); s = float((big @ big).sum()); del big",
            "%gpumem --drain",
        ]
        lines = []
        for cell in cells:
            out = kernel.execute(cell)
            assert out.error is None, out.traceback
            summary = [line for line in out.printed.splitlines() if line.startswith("gpucleanup ·")]
            stats = kernel.execute(HOST_STATS).printed
            host = [line for line in stats.splitlines() if line.startswith("HOST ")]
            print(f"FIGURE pinned-nothing {cell.splitlines()[0][:40]!r}: {summary}; torch host stats after: {host}")
            print(f"FIGURE pinned-nothing stats cell said: {[l for l in stats.splitlines() if l.startswith('gpucleanup')]}")
            lines += summary + [l for l in stats.splitlines() if l.startswith("gpucleanup ·")]
        assert lines, "no summary line at all"
        assert not [line for line in lines if " pinned " in f" {line} "], lines
    finally:
        kernel.close()
