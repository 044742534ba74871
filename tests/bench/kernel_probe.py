"""Timers inside a kernel, for bench_paired.py --stages: where a cell's added time goes.

Imported inside each kernel by an untimed cell before gpucleanup is first loaded:
  * ``install()`` wraps the steps of profile_cell.STAGES with timers (so the hooks the
    extension registers at load are the timed ones), and wraps the kernel's
    ``do_execute`` (ipykernel runs the cell and triggers post_run_cell inside it; the
    shell's ``run_cell_async`` does not hold post_run_cell) to time the whole execution
    inside the kernel, with gpucleanup's hooks on or off (read from the post_run_cell
    registry); outside a kernel, the shell's ``run_cell``.
  * ``report(skip)`` gives, as JSON-able data, the median microseconds per cell of
    the execution on and off, and of each step over the "on" cells (inclusive times,
    as profile_cell --stages prints them), leaving out each kernel's first ``skip``
    cells (set-up and warm-up).

So the client's added time (execute to idle) splits into what the hooks take, what the
rest of the execution takes with gpucleanup loaded, and what lies outside it
(ipykernel's messages, other threads).
"""

from __future__ import annotations

import statistics
import time

import profile_cell

_cells: list = []  # (cell number, on, µs of the execution)
_stages: dict = {}


def _on(shell) -> bool:
    return any((getattr(f, "__module__", None) or "").startswith("gpucleanup")
               for f in shell.events.callbacks.get("post_run_cell", []))


def install(shell) -> None:
    """Wraps the steps and the execution of a cell; call once, before %load_ext gpucleanup."""
    import inspect

    _stages.update(profile_cell._time_stages(0))
    counter = _stages["_counter"]
    kernel = getattr(shell, "kernel", None)
    owner, name = (kernel, "do_execute") if kernel is not None else (shell, "run_cell")
    original = getattr(owner, name)

    def done(t0: int) -> None:
        _cells.append((counter["cell"], _on(shell), (time.perf_counter_ns() - t0) / 1e3))

    if inspect.iscoroutinefunction(original):
        async def timed(*a, **k):
            counter["cell"] += 1
            t0 = time.perf_counter_ns()
            try:
                return await original(*a, **k)
            finally:
                done(t0)
    else:
        def timed(*a, **k):
            counter["cell"] += 1
            t0 = time.perf_counter_ns()
            try:
                result = original(*a, **k)
                if inspect.isawaitable(result):
                    async def finish(result=result, t0=t0):
                        try:
                            return await result
                        finally:
                            done(t0)
                    return finish()
                done(t0)
                return result
            except BaseException:
                done(t0)
                raise

    setattr(owner, name, timed)


def report(skip: int) -> dict:
    """{"run_cell_us": {"on": median, "off": median, "n_on", "n_off"} (the whole execution), "stages": [[label,
    median µs, calls]]}."""
    kept = [c for c in _cells if c[0] > skip]
    on_cells = {c[0] for c in kept if c[1]}
    out: dict = {"run_cell_us": {}}
    for state in (True, False):
        times = [c[2] for c in kept if c[1] is state]
        key = "on" if state else "off"
        out["run_cell_us"][key] = round(statistics.median(times), 1) if times else None
        out["run_cell_us"][f"n_{key}"] = len(times)
    out["stages"] = [[label, round(median, 1), round(calls, 2)]
                     for median, _worst, calls, label in profile_cell.stage_rows(_stages, sorted(on_cells))]
    return out
