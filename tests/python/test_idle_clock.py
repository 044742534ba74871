"""The kernel's idle time counts from its last cell's end, whatever was done to the kernel since.

A real kernel (ipykernel, gpucleanup loaded, the fake driver with its checkpoint calls): a cell ends, then the
kernel is parked and resumed from outside and drained from outside, each of which restarts its state's own age;
the status reply's ``last_cell_ended_ns`` stays at the cell's end, ``gpucleanup_kernel_idle_seconds`` in a scrape
and ``gpucleanup ps``'s "idle for" count from it, and a cell that runs says 0 while the field keeps the previous
cell's end. Every check is an ordering against clock readings taken around the steps.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import prometheus_client
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gpucleanup.outside import metrics
from test_park_kernel import Kernel, checkpoints, cli, record, wait_until  # noqa: F401 (checkpoints: a fixture)


@pytest.fixture
def kernel(runtime, checkpoints):  # noqa: F811
    k = Kernel(runtime)
    try:
        out = k.execute("%load_ext gpucleanup")
        assert "Error" not in out, out
        wait_until(lambda: k.state()["state"] == "idle", "the kernel never said idle")
        yield k
    finally:
        k.stop()


def scrape(runtime: Path, pid: int) -> dict:
    """The kernel's gauges in one scrape of the metrics' collector: name -> value."""
    registry = prometheus_client.CollectorRegistry()
    registry.register(metrics.KernelCollector(runtime, timeout=10.0))
    text = prometheus_client.generate_latest(registry).decode()
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples
            if s.labels.get("pid") == str(pid) and "state" not in s.labels}


def seconds_of(text: str) -> float:
    """A duration as ``units.format_duration`` writes it (``12 ms``, ``2.5 s``, ``31 s``, ``2 min 5 s``)."""
    if m := re.fullmatch(r"(\d+) min(?: (\d+) s)?", text):
        return int(m[1]) * 60 + int(m[2] or 0)
    if m := re.fullmatch(r"([\d.]+) s", text):
        return float(m[1])
    m = re.fullmatch(r"([\d.]+) ms", text)
    assert m, text
    return float(m[1]) / 1000


def ps_idle_for(pid: int) -> float:
    listed = cli("ps")
    assert listed.returncode == 0, listed
    line = next(l for l in listed.stdout.splitlines() if l.split()[:1] == [str(pid)])
    m = re.search(r"idle for (\d+ min(?: \d+ s)?|[\d.]+ m?s)", line)
    assert m, line
    return seconds_of(m[1])


def run_a_cell(kernel) -> tuple:
    """One cell; the clock read before it starts and after its reply (its end is said before the reply)."""
    before = time.time_ns()
    assert kernel.execute("x = 41") == ""
    return before, time.time_ns()


def test_a_park_a_resume_and_a_drain_from_outside_leave_the_idle_time_counting_from_the_last_cell(
        kernel, runtime, checkpoints):  # noqa: F811
    started, replied = run_a_cell(kernel)
    ended = kernel.state()["last_cell_ended_ns"]
    assert started <= ended <= replied
    time.sleep(1.0)  # so that the park's own time is well apart from the cell's end in ps's rounding

    assert cli("park", str(kernel.pid)).returncode == 0
    assert record(checkpoints, kernel.pid)["state"] == "checkpointed"
    parked = kernel.state()
    assert parked["state"] == "parked" and parked["since_ns"] > replied
    assert parked["last_cell_ended_ns"] == ended
    assert cli("resume", str(kernel.pid)).returncode == 0
    resumed = kernel.state()
    assert resumed["state"] == "idle" and resumed["since_ns"] > parked["since_ns"]
    assert resumed["last_cell_ended_ns"] == ended
    drained = cli("drain", str(kernel.pid), "--drain-timeout", "5")
    assert drained.returncode == 0, drained.stderr
    wait_until(lambda: kernel.state()["state"] == "idle", "the drain's cleanup never ended")
    after_drain = kernel.state()
    assert after_drain["since_ns"] > resumed["since_ns"]  # the state's age restarted at each step
    assert after_drain["last_cell_ended_ns"] == ended

    asked = time.time_ns()
    gauges = scrape(runtime, kernel.pid)
    answered = time.time_ns()
    idle = gauges["gpucleanup_kernel_idle_seconds"]
    assert (asked - replied) / 1e9 <= idle <= (answered - started) / 1e9, (idle, asked, answered, started, replied)
    assert idle > gauges["gpucleanup_kernel_state_age_seconds"]  # the age counts from the drain's end only

    asked = time.time_ns()
    shown = ps_idle_for(kernel.pid)
    answered = time.time_ns()
    # ps rounds: 2.5 s, 31 s, 2 min 5 s (at most half a second either way)
    assert (asked - replied) / 1e9 - 0.5 <= shown <= (answered - started) / 1e9 + 0.5, shown


def test_a_running_cell_is_idle_for_0_and_keeps_the_previous_cells_end_until_its_own(kernel, runtime, tmp_path):
    started, replied = run_a_cell(kernel)
    ended = kernel.state()["last_cell_ended_ns"]
    assert started <= ended <= replied
    go = tmp_path / "go"
    msg = kernel.start(f"import os, time\nwhile not os.path.exists({str(go)!r}): time.sleep(0.01)")
    try:
        wait_until(lambda: kernel.state()["state"] == "running", "the cell never said running")
        running = kernel.state()
        assert running["last_cell_ended_ns"] == ended
        assert scrape(runtime, kernel.pid)["gpucleanup_kernel_idle_seconds"] == 0
    finally:
        let_go = time.time_ns()  # read before the file exists: the cell may end as soon as it does
        go.touch()
    kernel.collect(msg)
    done = time.time_ns()
    wait_until(lambda: kernel.state()["state"] == "idle", "the cell never said idle")
    second = kernel.state()["last_cell_ended_ns"]
    assert let_go <= second <= done
